"""Ordered handlers (``order_by=...``): a key's messages handled in stream order.

The handler's keys are spread over partitions, each owned by one process at a time
through a lease in the database and fetched from a consumer of its own ownership;
in the owning process each key has a lane, its messages run one after another.
docs/ordering.md has the guarantee and why it holds.

Every module of the package sits in its own layer (CONTRIBUTING.md, 'Feature
packages'): ``keys`` and ``heads`` in the protocol, ``partitions`` (NATS),
``ownership`` and ``sql`` (PostgreSQL) at the edges, ``share`` and ``lanes`` in the
runtime, ``status`` in the operations. This one holds no code, so that importing any
of them loads nothing of the others.
"""
