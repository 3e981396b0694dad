"""``eop streams create``: make an app's streams before any worker runs.

A worker creates the streams it needs as it starts (``create``, on by default).
A deployment that runs no worker yet also needs them: a Spark job reading a
stream, publishers started first, a setup job of a pipeline whose workers run
with ``EOP_CREATE=false``. This makes each stream a worker would, the same way:
the app's declared streams (``app.stream``) and every handler's, each with the
epoch id in its metadata and the subject transform its ordered handlers of
several partitions need. A stream that exists is left as it is, and checked as
a worker checks it (that transform, its replicas against the declaration).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from eop.app import App
from eop.broker import jetstream
from eop.handler import StreamSpec
from eop.ops import tables
from eop.ordering import partitions


@dataclasses.dataclass(frozen=True)
class Provisioned:
    """One of an app's streams and what :func:`create` did with it."""

    stream: str
    subjects: tuple[str, ...]
    created: bool
    """True if this call created it; False if it existed."""
    partitioned_by: tuple[str, ...] = ()
    """The ordered handlers whose keys it spreads over partitions (its subject transform)."""


def app_streams(app: App) -> list[StreamSpec]:
    """The streams a worker of ``app`` would make: the declared ones and each handler's,
    once each, the declared ones first."""
    specs = dict(app.streams)
    for spec in app.handlers.values():
        specs.setdefault(spec.stream, app.stream_spec(spec.stream))
    return list(specs.values())


async def create(app: App) -> list[Provisioned]:
    """Create ``app``'s streams that are missing, as a worker starting would.

    Raises :class:`eop.ConfigurationError` for a stream the server refuses (overlapping
    subjects, more replicas than servers) or an existing stream without the subject
    transform an ordered handler needs, and :class:`eop.NatsUnavailable` if NATS does not
    answer.
    """
    transforms = partitions.stream_transforms(app.handlers.values())
    nc = await jetstream.connect(app.settings, name="eop-streams")
    try:
        js = nc.jetstream()
        done = []
        for spec in app_streams(app):
            bound = await jetstream.ensure_stream(
                js, spec, create=True, transform=transforms.get(spec.name)
            )
            ordered = _partitioned(app, spec.name)
            for handler in ordered:
                partitions.check_transform(bound.info, app.handlers[handler])
            subjects = tuple(bound.info.config.subjects or ())
            done.append(Provisioned(spec.name, subjects, bound.created, ordered))
        return done
    finally:
        await nc.close()


def _partitioned(app: App, stream: str) -> tuple[str, ...]:
    return tuple(
        name
        for name, spec in app.handlers.items()
        if spec.stream == stream and partitions.transform(spec) is not None
    )


def format_table(done: Sequence[Provisioned]) -> str:
    """The streams, one line each: name, created or existed, subjects, ordered handlers."""
    cells = [["stream", "state", "subjects", "partitions for"]]
    for p in done:
        state = "created" if p.created else "existed"
        cells.append([p.stream, state, ", ".join(p.subjects), ", ".join(p.partitioned_by) or "-"])
    return "\n".join(tables.aligned(cells))
