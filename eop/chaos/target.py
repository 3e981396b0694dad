"""What a chaos run exercises: an app, one of its handlers, and how to count its effects.

The built-in target is :mod:`eop.chaos.bank` (money transfers between
accounts). To check your own handler the same way, describe it with a
:class:`Target`::

    from eop import chaos

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
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Mapping, Sequence
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
