"""How eop fits its engines to a connection pooler (``db_pooler``), without a server."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine.interfaces import ExecuteStyle
from structlog.testing import capture_logs

import eop
from eop import settings as settings_mod
from eop.pg import engines


class _Info:
    def __init__(self, pid: int) -> None:
        self.backend_pid = pid


class _Cursor:
    def __init__(self, pid: int) -> None:
        self.pid = pid

    def execute(self, statement: str) -> None:
        assert statement == "SELECT pg_backend_pid()"

    def fetchone(self) -> tuple[int]:
        return (self.pid,)

    def close(self) -> None:
        pass


class FakePsycopg:
    """A DBAPI connection whose BackendKeyData pid (``info``) and SQL pid may differ."""

    def __init__(self, protocol_pid: int, sql_pid: int) -> None:
        self.info = _Info(protocol_pid)
        self.sql_pid = sql_pid
        self.closed = False

    def cursor(self) -> _Cursor:
        return _Cursor(self.sql_pid)

    def rollback(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class FakeDialect:
    driver = "psycopg"

    def __init__(self, protocol_pid: int, sql_pid: int) -> None:
        self.pids = (protocol_pid, sql_pid)
        self.made: list[tuple[dict[str, Any], FakePsycopg]] = []

    def connect(self, *_: Any, **cparams: Any) -> FakePsycopg:
        conn = FakePsycopg(*self.pids)
        self.made.append((cparams, conn))
        return conn


def _hook(pooler: str) -> Any:
    engine = engines.for_pooler(sa.create_engine("postgresql+psycopg://u@h/db"), pooler)  # type: ignore[arg-type]  # each choice in turn
    hooks = list(engine.dialect.dispatch.do_connect)
    return hooks[0] if hooks else None


def test_uncached_turns_statement_caches_off_for_both_drivers() -> None:
    """asyncpg: no statement cache (unnamed statements), no SQLAlchemy cache; psycopg: never
    prepares. An unknown driver gets nothing."""
    assert engines.uncached("asyncpg") == {
        "statement_cache_size": 0,
        "prepared_statement_cache_size": 0,
    }
    assert engines.uncached("psycopg") == {"prepare_threshold": None}
    assert engines.uncached("pg8000") == {}


@pytest.mark.parametrize("pooler", ["none", "session", "transaction_prepared"])
def test_poolers_that_keep_prepared_statements_leave_the_engine_as_it_is(pooler: str) -> None:
    assert _hook(pooler) is None


def test_transaction_makes_every_connection_uncached() -> None:
    """The first connection is opened uncached (and asked about a pooler), every later
    one is given the uncached arguments."""
    hook = _hook("transaction")
    dialect = FakeDialect(protocol_pid=-12345, sql_pid=4242)
    first = hook(dialect, None, [], {"host": "h"})
    assert first is dialect.made[0][1]
    assert dialect.made[0][0] == {"host": "h", "prepare_threshold": None}
    cparams: dict[str, Any] = {"host": "h"}
    assert hook(dialect, None, [], cparams) is None
    assert cparams == {"host": "h", "prepare_threshold": None}
    assert len(dialect.made) == 1


@pytest.mark.parametrize(("protocol_pid", "warned"), [(4242, True), (-12345, False)])
def test_transaction_warns_once_when_no_pooler_is_in_between(
    protocol_pid: int, warned: bool
) -> None:
    """db_pooler=transaction straight to PostgreSQL works, only slower (no statement
    cache, the relay polls): one db.pooler_unneeded warning naming the fix; none behind
    a pooler (whose mode eop cannot tell)."""
    hook = _hook("transaction")
    dialect = FakeDialect(protocol_pid=protocol_pid, sql_pid=4242)
    with capture_logs() as logs:
        kept = hook(dialect, None, [], {"host": "h"})
        hook(dialect, None, [], {"host": "h"})
    assert kept is dialect.made[0][1]
    assert not kept.closed
    events = [(e["event"], e["log_level"]) for e in logs]
    assert events == ([("db.pooler_unneeded", "warning")] if warned else [])
    if warned:
        assert "EOP_DB_POOLER=auto" in logs[0]["fix"]


def test_auto_keeps_the_probe_connection_when_the_pids_differ() -> None:
    """Behind a pooler the BackendKeyData pid is the pooler's own: the first connection
    stays (uncached), and so are all later ones, without probing again."""
    hook = _hook("auto")
    dialect = FakeDialect(protocol_pid=-12345, sql_pid=4242)
    first = hook(dialect, None, [], {"host": "h"})
    assert first is dialect.made[0][1]
    assert dialect.made[0][0]["prepare_threshold"] is None
    later: dict[str, Any] = {"host": "h"}
    assert hook(dialect, None, [], later) is None
    assert later["prepare_threshold"] is None
    assert len(dialect.made) == 1


def test_auto_closes_the_probe_and_connects_as_is_when_the_pids_match() -> None:
    """Straight to PostgreSQL: the probe is closed, connections keep their caches."""
    hook = _hook("auto")
    dialect = FakeDialect(protocol_pid=4242, sql_pid=4242)
    cparams: dict[str, Any] = {"host": "h"}
    assert hook(dialect, None, [], cparams) is None
    assert dialect.made[0][1].closed
    assert cparams == {"host": "h"}
    assert hook(dialect, None, [], cparams) is None
    assert len(dialect.made) == 1


def test_psycopg_engines_page_insertmanyvalues_within_psycopgs_parse_cache() -> None:
    """The sync engine eop makes for sync handlers, and an async engine on psycopg, run
    statements in an execution context that pages SQLAlchemy's multi-row INSERTs;
    asyncpg's and other drivers' engines keep theirs."""
    app = eop.App(settings=settings_mod.Settings(database_url="postgresql+asyncpg://x@127.0.0.1/x"))
    app.handler(stream="S", subject="s", name="h")(lambda msg, session: None)
    sync_context = app.sync_sessionmaker.kw["bind"].dialect.execution_ctx_cls
    assert sync_context.__name__.startswith("Paged")
    assert not app.engine.sync_engine.dialect.execution_ctx_cls.__name__.startswith("Paged")
    on_psycopg = eop.App(
        settings=settings_mod.Settings(database_url="postgresql+psycopg://x@127.0.0.1/x")
    )
    assert on_psycopg.engine.sync_engine.dialect.execution_ctx_cls.__name__.startswith("Paged")
    again = engines.paged_for_psycopg(app.sync_sessionmaker.kw["bind"])
    assert again.dialect.execution_ctx_cls is sync_context
    other = engines.paged_for_psycopg(sa.create_engine("sqlite://"))
    assert not other.dialect.execution_ctx_cls.__name__.startswith("Paged")


class _Context:
    """An execution context's attributes that the paged one reads."""

    def __init__(self, style: Any, per_row: int, **options: Any) -> None:
        self.execute_style = style
        self.parameters = [{f"p{i}": i for i in range(per_row)}] * 3
        self.execution_options = sa.util.immutabledict(options)

    def pre_exec(self) -> None:
        pass


@pytest.mark.parametrize(
    ("per_row", "options", "page"),
    [
        (1, {}, 50),
        (3, {}, 16),
        (12, {}, 4),
        (50, {}, 1),
        (51, {}, None),  # parsed anew in any page: SQLAlchemy's page size stays
        (3, {"insertmanyvalues_page_size": 7}, 7),  # the caller's choice stays
    ],
)
def test_a_multi_row_insert_gets_the_page_psycopg_parses_once(
    per_row: int, options: dict[str, Any], page: int | None
) -> None:
    """A page holds as many rows as fit in 50 parameters, at least one; a row of more
    keeps SQLAlchemy's page size, and so does a page size the caller gave."""
    paged = engines._paged(_Context)
    context = paged(ExecuteStyle.INSERTMANYVALUES, per_row, **options)
    context.pre_exec()
    assert context.execution_options.get("insertmanyvalues_page_size") == page
    single = paged(ExecuteStyle.EXECUTE, per_row)
    single.pre_exec()
    assert "insertmanyvalues_page_size" not in single.execution_options


def test_connection_attempts_are_bounded_unless_the_url_bounds_them_itself() -> None:
    """``db_connect_timeout_s`` reaches asyncpg's ``timeout`` and libpq's ``connect_timeout``
    (whole seconds, at least one); a bound the URL sets is kept, for either driver."""
    plain = sa.make_url("postgresql+asyncpg://u@h/d")
    assert engines.timed(plain, {"ssl": "x"}, 2.5) == {"ssl": "x", "timeout": 2.5}
    own = sa.make_url("postgresql+asyncpg://u@h/d?timeout=30")
    assert engines.timed(own, {}, 2.5) == {}
    libpq = sa.make_url("postgresql+psycopg://u@h/d")
    assert engines.timed_url(libpq, 2.5).query["connect_timeout"] == "3"
    assert engines.timed_url(libpq, 0.2).query["connect_timeout"] == "1"
    assert engines.timed(plain, {}, 0.0) == {}
    assert "connect_timeout" not in engines.timed_url(libpq, 0.0).query
    kept = sa.make_url("postgresql+psycopg://u@h/d?connect_timeout=60")
    assert engines.timed_url(kept, 2.5).query["connect_timeout"] == "60"


async def test_eops_engines_carry_the_connect_timeout_setting() -> None:
    """The async engine and the sync one eop makes from ``database_url`` both bound a
    connection attempt by the setting."""
    app = eop.App(
        settings=settings_mod.Settings(
            database_url="postgresql+asyncpg://u@h/d", db_connect_timeout_s=4.0, db_pooler="none"
        )
    )
    seen: dict[str, Any] = {}

    class _Seen(Exception):
        pass

    def catch(dialect: Any, record: Any, cargs: Any, cparams: dict[str, Any]) -> None:
        seen.update(cparams)
        raise _Seen  # before any connection is attempted

    sync_engine = app.sync_sessionmaker.kw["bind"]
    for engine in (app.engine.sync_engine, sync_engine):
        sa.event.listen(engine, "do_connect", catch)
    with pytest.raises(_Seen):
        async with app.engine.connect():
            pass
    assert seen["timeout"] == 4.0
    seen.clear()
    with pytest.raises(_Seen):
        sync_engine.raw_connection()
    assert seen["connect_timeout"] == "4"
