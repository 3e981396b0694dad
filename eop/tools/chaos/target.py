"""What a chaos run exercises: an app, one of its handlers, and how to count its effects.

The built-in target is :mod:`eop.tools.chaos.bank` (money transfers between
accounts). To check your own handler the same way, describe it with a
:class:`Target`::

    from eop.tools import chaos

    target = chaos.Target(
        app="myapp:app",
        handler="orders",
        effects_sql="SELECT order_id, count(*) FROM order_lines GROUP BY order_id",
        payloads=make_order,          # (index, rng) -> chaos.Payload
        setup=create_my_tables,       # (sync database URL) -> None, optional
    )
    report = chaos.run(chaos.Config(target=target, messages=2000, duration_s=120))
    assert report.ok, report.render()

``effects_sql`` returns one row per logical message key and the number of
effects it has; a correct handler shows 1 for every key the harness
published and nothing else.

A pipeline (handlers that publish to each other through ``eop.outbox``) lists
its later handlers as ``downstream`` :class:`Stage` s: every good message
must then take effect once in each stage from the one it enters at
(:attr:`Payload.stage`). A ``writer`` adds messages the way a web service
does: committed in the app's own transactions with ``eop.outbox.add``.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from eop import app as app_mod
from eop import errors

if TYPE_CHECKING:
    import sqlalchemy as sa


@dataclasses.dataclass(frozen=True)
class Payload:
    """One logical message: its key (published as ``Nats-Msg-Id``), body and headers.

    ``poison`` marks a message the handler must refuse: the checker expects
    exactly one dead letter and no effect for it.
    """

    key: str
    data: bytes
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    poison: bool = False
    stage: int = 0
    """The stage it enters at: 0 is the target's handler, 1 its first ``downstream``
    stage... It must take effect once in that stage and every later one (a poison
    one: a dead letter in that stage, and nothing later)."""
    subject: str | None = None
    """Where to publish it (default: the target's subject): e.g. one subject per
    ordering key, for a handler with ``order_by="subject:N"``."""


PayloadFactory = Callable[[int, random.Random], Payload]
"""Makes the ``index``-th logical message (poison or not) with the run's seeded rng."""

Setup = Callable[[str], None]
"""Creates the target's tables, given a sync (psycopg) SQLAlchemy URL."""

Invariant = Callable[["sa.Connection", Sequence[Payload]], list[str]]
"""Checks an aggregate after the run; returns the problems found (none: holds)."""

GoodFactory = Callable[[str, random.Random], Payload]
"""Makes a good message with the given key (the hunts choose the key)."""

FailingFactory = Callable[[str], Payload]
"""Makes a message with the given key that fails on every delivery (poison)."""

Writer = Callable[[str, int, float, int], Awaitable["WriterResult"]]
"""``(async database URL, count, spread_s, seed)``: commits ``count`` logical messages
over ``spread_s`` seconds, each in a transaction of its own with ``eop.outbox.add``,
retrying through faults until each is known to be committed exactly once."""


@dataclasses.dataclass
class WriterResult:
    """What a :data:`Writer` committed, and what it met on the way."""

    payloads: list[Payload]
    """The logical messages committed, each exactly once."""
    retries: int = 0
    """Transactions tried again after a failure (of the database, the network, a timeout)."""
    found_committed: int = 0
    """Retries that found their transaction committed after all (an ambiguous COMMIT)."""
    unfinished: list[str] = dataclasses.field(default_factory=list)
    """Keys it could not commit by the end (a failure of the run)."""


@dataclasses.dataclass(frozen=True)
class Stage:
    """A handler downstream of the target's, run by the same workers."""

    handler: str
    effects_sql: str
    """``SELECT key, count`` of this handler's effects per logical message key."""


@dataclasses.dataclass(frozen=True)
class Target:
    """An app and handler under test, its payloads, and its effect-counting query."""

    app: str
    """``module:attribute`` of the :class:`eop.App`, importable by the worker processes."""
    handler: str
    """The handler name (its subscription)."""
    effects_sql: str
    """``SELECT key, count`` of effects per logical message key."""
    payloads: PayloadFactory
    setup: Setup | None = None
    invariant: Invariant | None = None
    invariant_sql: str | None = None
    """A query returning one row per violation of an aggregate invariant (none: holds)."""
    subject: str | None = None
    """The subject to publish to (default: the handler's, when it has no wildcard)."""
    bad_subject: bytes | None = None
    """A subject the handler's filter matches that is not UTF-8 (``bad-subject``)."""
    make_good: GoodFactory | None = None
    """Good messages with chosen keys (``long-msg-id``, ``poison-flood``)."""
    make_failing: FailingFactory | None = None
    """Always-failing messages (``poison-flood``)."""
    lock_sql: str | None = None
    """Locks rows every handler run updates, in the injector's transaction
    (``lock-timeouts``)."""
    downstream: tuple[Stage, ...] = ()
    """Later handlers of a pipeline (the workers run them too)."""
    writer: Writer | None = None
    """Commits messages in the app's own transactions during the chaos phase, half as
    many as the harness publishes."""
    key_header: str | None = None
    """The header that carries the logical message's key in every outbox message: ties a
    message the relay sent twice to its effects downstream."""
    order_sql: str | None = None
    """For an ordered handler: ``SELECT key, position, prior_settled`` per effect, in
    commit order. Each key's positions must be 1, 2, 3... in that order, and
    ``prior_settled`` true: the message published before it (a dead-lettered one, say)
    had its outcome committed before it ran (:func:`eop.tools.chaos.checker.check_order`)."""

    @property
    def handlers(self) -> tuple[str, ...]:
        """The target's handler and its downstream ones: what the workers run."""
        return (self.handler, *(stage.handler for stage in self.downstream))


def load_callable(path: str) -> Callable[..., Any]:
    """Import ``module:function`` and return it."""
    func = app_mod.import_attribute(path, "MODULE:FUNCTION")
    if not callable(func):
        raise errors.ConfigurationError(f"{path!r} is not callable")
    return func


def from_options(
    *,
    app: str,
    handler: str,
    effects_sql: str,
    payloads: str,
    setup: str | None = None,
    invariant_sql: str | None = None,
) -> Target:
    """A :class:`Target` from the ``eop chaos`` options (``module:function`` strings)."""
    return Target(
        app=app,
        handler=handler,
        effects_sql=effects_sql,
        payloads=load_callable(payloads),
        setup=load_callable(setup) if setup else None,
        invariant_sql=invariant_sql,
    )
