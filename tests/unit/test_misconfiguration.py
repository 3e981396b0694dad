"""The rule that stops a worker on a database error only a change of configuration ends."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from structlog.testing import capture_logs

from eop import errors
from eop.outbox import publishing, relay
from eop.pg import failures
from eop.protocol import misconfiguration
from eop.settings import Settings

from .test_inbox import DriverError, wrapped

SETTINGS = Settings(
    database_url="postgresql+asyncpg://app:hunter2@pgbouncer:6432/mydb", db_pooler="none"
)
POOLER = wrapped(DriverError("26000", 'prepared statement "__asyncpg_stmt_1__" does not exist'))
TABLE = wrapped(DriverError("42P01", 'relation "orders" does not exist'))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _watch() -> tuple[misconfiguration.Watch, list[errors.ConfigurationError], Clock]:
    stopped: list[errors.ConfigurationError] = []
    clock = Clock()
    return misconfiguration.Watch(stop=stopped.append, clock=clock), stopped, clock


def test_the_third_pooler_failure_within_the_window_stops_the_worker_once() -> None:
    """STRIKES failures of one kind within WINDOW_S: one stop, one error-level log line,
    the error naming EOP_DB_POOLER=transaction and the URL without its password."""
    watch, stopped, clock = _watch()
    with capture_logs() as logs:
        for _ in range(misconfiguration.STRIKES - 1):
            watch.note(POOLER, "handler 'orders'", SETTINGS)
            clock.now += 1
        assert stopped == []
        for _ in range(3):
            watch.note(POOLER, "handler 'orders'", SETTINGS)
    assert len(stopped) == 1
    assert stopped[0] is watch.error
    text = str(stopped[0])
    assert "EOP_DB_POOLER=transaction" in text
    assert "'none'" in text
    assert "hunter2" not in text
    assert "pgbouncer:6432/mydb" in text
    assert "none dead-lettered" in text
    assert [(e["event"], e["log_level"], e["problem"]) for e in logs] == [
        ("db.misconfigured", "error", "pooler")
    ]


def test_failures_further_apart_than_the_window_never_add_up() -> None:
    """A rare one (a failure every minute and more) is retried as before, without a stop."""
    watch, stopped, clock = _watch()
    for _ in range(10):
        watch.note(POOLER, "handler 'orders'", SETTINGS)
        clock.now += misconfiguration.WINDOW_S / (misconfiguration.STRIKES - 1) + 1
    assert stopped == []
    assert watch.error is None


def test_other_failures_and_successes_do_not_reset_the_count() -> None:
    """Through a mismatched pooler some transactions land where their statements are:
    what lies between two misconfigured failures does not matter, only their times."""
    watch, stopped, clock = _watch()
    conflict = wrapped(DriverError("40001"))
    for _ in range(misconfiguration.STRIKES):
        watch.note(POOLER, "handler 'orders'", SETTINGS)
        watch.note(conflict, "handler 'orders'", SETTINGS)
        clock.now += 5
    assert len(stopped) == 1


@pytest.mark.parametrize("where", ["handler 'orders'", "the outbox relay"])
def test_a_missing_table_names_who_hit_it_and_the_migration(where: str) -> None:
    """Schema: the database's message (names only) and SQLSTATE, and the fix."""
    watch, stopped, _clock = _watch()
    for _ in range(misconfiguration.STRIKES):
        watch.note(TABLE, where, SETTINGS)
    assert len(stopped) == 1
    text = str(stopped[0])
    assert text.startswith(f'{where}: relation "orders" does not exist (SQLSTATE 42P01)')
    assert "migration" in text


def test_a_login_refused_while_running_names_the_url_and_its_credentials() -> None:
    """A rotated password or a pg_hba.conf change while the worker runs: one line with
    the server's words, the URL without its password, and where to fix it."""
    refused = wrapped(DriverError("28P01", 'password authentication failed for user "app"'))
    watch, stopped, _clock = _watch()
    for _ in range(misconfiguration.STRIKES):
        watch.note(refused, "handler 'orders'", SETTINGS)
    assert len(stopped) == 1
    text = str(stopped[0])
    assert text.startswith(
        "PostgreSQL at postgresql+asyncpg://app:***@pgbouncer:6432/mydb refuses new "
        "connections of handler 'orders': password authentication failed for user \"app\" "
        "(SQLSTATE 28P01), on every attempt: fix the role, password or database name in "
        "EOP_DATABASE_URL"
    )
    assert "hunter2" not in text
    assert "none dead-lettered" in text


def test_each_kind_is_counted_on_its_own() -> None:
    watch, stopped, _clock = _watch()
    for exc in (POOLER, TABLE, POOLER, TABLE):
        watch.note(exc, "handler 'orders'", SETTINGS)
    assert stopped == []
    assert failures.misconfiguration(POOLER) is failures.Misconfiguration.POOLER


def test_without_a_stop_the_watch_only_logs() -> None:
    """A Processor made outside a worker (the test kit) gets a watch that cannot stop
    anything: it logs the error once and the retries go on."""
    watch = misconfiguration.Watch()
    with capture_logs() as logs:
        for _ in range(misconfiguration.STRIKES + 2):
            watch.note(TABLE, "handler 'orders'", SETTINGS)
    assert watch.error is not None
    assert [e["event"] for e in logs] == ["db.misconfigured"]


class _FailingEngine:
    """An engine whose every transaction fails as through a mismatched pooler."""

    def begin(self) -> _FailingEngine:
        return self

    async def __aenter__(self) -> None:
        raise POOLER

    async def __aexit__(self, *_: object) -> None:
        return None


class _Publisher:
    target = "a target"

    async def publish(self, rows: Sequence[publishing.Row]) -> list[publishing.Receipt]:
        raise AssertionError("the lease fails first: no round gets this far")


async def test_the_outbox_relay_counts_its_failures_and_stops_through_the_watch() -> None:
    """The relay retries a failed round with backoff for ever; a misconfigured one goes to
    the watch, whose stop (the worker's, or `eop relay`'s) ends its loop with the error."""
    stopping = asyncio.Event()
    stopped: list[errors.ConfigurationError] = []

    def stop(error: errors.ConfigurationError) -> None:
        stopped.append(error)
        stopping.set()

    watch = misconfiguration.Watch(stop=stop)
    publisher = relay.Relay(
        _FailingEngine(),  # type: ignore[arg-type]  # only begin() is used
        _Publisher(),
        SETTINGS,
        misconfigured=watch,
    )
    await asyncio.wait_for(publisher.run(stopping), 30)
    assert len(stopped) == 1
    assert "EOP_DB_POOLER=transaction" in str(stopped[0])


async def test_an_idle_workers_failing_compaction_stops_it_through_the_watch() -> None:
    """A worker with no message to run still compacts: rounds that fail on a mismatched
    pooler are counted like its transactions, and the third within the window stops it
    with the one line naming EOP_DB_POOLER, where it used to log the error's type for ever."""
    from .test_compaction import CountingCompactor, compactor

    class Failing(CountingCompactor):
        async def compact_once(self) -> None:
            self.rounds += 1
            raise POOLER

    watch, stopped, _ = _watch()
    like = compactor()
    c = Failing(
        like.js,
        like.store,
        like.spec,
        like.epochs,
        noted=lambda exc: watch.note(exc, "compaction of handler 'orders'", SETTINGS),
    )
    stopping = asyncio.Event()
    task = asyncio.create_task(c.run_forever(0.01, stopping))
    for _ in range(500):
        await asyncio.sleep(0.01)
        if stopped:
            break
    stopping.set()
    await asyncio.wait_for(task, 5)
    assert c.rounds >= misconfiguration.STRIKES
    assert len(stopped) == 1
    assert "EOP_DB_POOLER=transaction" in str(stopped[0])


async def test_an_ordered_handlers_failing_partition_ticks_stop_it_through_the_watch() -> None:
    """A process whose ownership ticks fail on a mismatched pooler owns no partition and
    runs no handler: its ticks count like transactions, and the third within the window
    stops the worker with the one line, where each was logged once and then at debug."""
    import types

    from eop.handler import HandlerSpec
    from eop.observe import observer as observe
    from eop.ordering import keys, share

    class Owners:
        member = types.SimpleNamespace(name="me")
        count = 4
        ticks = 0

        async def tick(self, *_: object, **__: object) -> None:
            self.ticks += 1
            raise POOLER

    async def noop(msg: object, session: object) -> None:
        """A handler never run here."""

    async def no_slots() -> int:
        return 0

    watch, stopped, _ = _watch()
    stopping = asyncio.Event()
    owners = Owners()
    spec = HandlerSpec(func=noop, name="ledger", stream="L", subject="l", durable="eop-l")
    runner = share.OrderedRunner(
        spec=spec,
        nc=None,  # type: ignore[arg-type]  # a failing tick reaches neither server
        js=None,  # type: ignore[arg-type]
        owners=owners,  # type: ignore[arg-type]
        settings=Settings(partition_lease_s=1.0),
        dispatch=None,  # type: ignore[arg-type]
        take_slots=no_slots,
        give_slots=lambda n: None,
        stopping=stopping,
        observer=observe.NOOP,
        blocked=keys.BlockedKeys(),
        noted=lambda exc: (
            watch.note(exc, "the partition ownership of handler 'ledger'", SETTINGS),
            stopping.set() if stopped else None,
        ),
    )
    await asyncio.wait_for(runner.run(), 30)
    assert owners.ticks == misconfiguration.STRIKES
    assert len(stopped) == 1
    assert "EOP_DB_POOLER=transaction" in str(stopped[0])
