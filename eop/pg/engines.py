"""Engines for eop's database URL: libpq's TLS parameters for asyncpg too, and poolers.

:func:`asyncpg_url` lets a database URL carry libpq's TLS parameters
(``sslmode``, ``sslrootcert``, ``sslcert``, ``sslkey``) for both drivers:
psycopg (libpq) reads them as they are, asyncpg gets an ``ssl`` context made
from them. :func:`for_pooler` fits an engine to the ``db_pooler`` setting
(PgBouncer in transaction mode, see docs/pgbouncer.md).
"""

from __future__ import annotations

import math
import os
import ssl
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine.interfaces import ExecuteStyle

from eop import errors, log
from eop import settings as settings_mod
from eop.pg.sql import base as base_sql

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection

_LIBPQ_TLS = ("sslmode", "sslrootcert", "sslcert", "sslkey")
_VERIFYING = ("require", "verify-ca", "verify-full")


def asyncpg_url(url: str | sa.URL) -> tuple[sa.URL, dict[str, Any]]:
    """An asyncpg URL without libpq's TLS parameters, and the ``connect_args`` replacing them.

    asyncpg takes ``ssl=<mode>`` but not ``sslmode``, ``sslrootcert``,
    ``sslcert`` or ``sslkey``; with those, eop builds the ``ssl`` context.
    ``sslmode=verify-full`` checks the server's name, ``verify-ca`` only its
    CA, ``require`` with ``sslrootcert`` verifies the CA as libpq does.
    """
    parsed = sa.make_url(url)
    query = dict(parsed.query)
    if not parsed.drivername.endswith("+asyncpg") or not any(k in query for k in _LIBPQ_TLS):
        return parsed, {}
    mode = str(query.pop("sslmode", "") or query.get("ssl", "") or "")
    files = {k: str(query.pop(k)) for k in ("sslrootcert", "sslcert", "sslkey") if k in query}
    rest = parsed.set(query={k: v for k, v in query.items() if k != "ssl"})
    if not files:
        return rest, {"ssl": mode} if mode else {}
    if mode not in _VERIFYING:
        raise errors.ConfigurationError(
            f"database_url: sslrootcert/sslcert/sslkey need sslmode=require, verify-ca or "
            f"verify-full, not {mode or 'none'!r}"
        )
    if ("sslcert" in files) != ("sslkey" in files):
        raise errors.ConfigurationError("database_url: sslcert and sslkey go together")
    for key, path in files.items():
        if not os.path.isfile(path):
            raise errors.ConfigurationError(f"database_url: {key} {path!r} does not exist")
    context = ssl.create_default_context(cafile=files.get("sslrootcert"))
    context.check_hostname = mode == "verify-full"
    if mode == "require" and "sslrootcert" not in files:
        context.verify_mode = ssl.CERT_NONE
    if "sslcert" in files:
        context.load_cert_chain(files["sslcert"], files["sslkey"])
    return rest, {"ssl": context}


def timed(url: sa.URL, connect_args: dict[str, Any], seconds: float) -> dict[str, Any]:
    """asyncpg ``connect_args`` whose connection attempts give up after ``seconds`` (0: as
    asyncpg's own do), unless the URL sets asyncpg's ``timeout`` (the URL's query would
    lose to ``connect_args``)."""
    if "timeout" in url.query or not seconds:
        return connect_args
    return {**connect_args, "timeout": seconds}


def timed_url(url: sa.URL, seconds: float) -> sa.URL:
    """A libpq (psycopg) URL whose connection attempts give up after ``seconds`` (0: never, as
    libpq's own), unless it sets ``connect_timeout``; libpq counts whole seconds."""
    if "connect_timeout" in url.query or not seconds:
        return url
    return url.update_query_dict({"connect_timeout": str(max(1, math.ceil(seconds)))})


#: How eop's own connections show in ``pg_stat_activity`` (unless the URL names them).
APPLICATION_NAME = "eop"


def named(connect_args: dict[str, Any]) -> dict[str, Any]:
    """asyncpg ``connect_args`` that name the connection :data:`APPLICATION_NAME`.

    A ``server_settings`` entry already there wins.
    """
    server_settings = {
        "application_name": APPLICATION_NAME,
        **connect_args.get("server_settings", {}),
    }
    return {**connect_args, "server_settings": server_settings}


def named_url(url: sa.URL) -> sa.URL:
    """A libpq (psycopg) URL with ``application_name``, unless it has one."""
    if "application_name" in url.query:
        return url
    return url.update_query_dict({"application_name": APPLICATION_NAME})


#: The most parameters a statement may have for psycopg to keep what it parsed
#: of it (its placeholders, their order): one with more is parsed anew at each
#: execution, which can cost more than sending its rows one by one.
PSYCOPG_CACHED_PARAMETERS = 50


def paged_for_psycopg(engine: sa.Engine) -> sa.Engine:
    """Send SQLAlchemy's multi-row INSERTs on a psycopg ``engine`` in statements of at
    most :data:`PSYCOPG_CACHED_PARAMETERS` parameters (at least one row each).

    SQLAlchemy sends an executemany INSERT with RETURNING (the ORM's flush of
    objects whose keys the database makes) as "insertmanyvalues": one
    statement of up to 1,000 rows, which psycopg parses at each execution. A
    flush of 64 rows of three columns cost about 60,000 instructions a row
    more (callgrind) than in pages of 16 rows, each page's statement parsed
    once by psycopg; of twelve columns, 230,000 more than in pages of four.
    The rows, their order and the keys read back are the same. INSERTs
    without RETURNING are not affected (psycopg's executemany sends them),
    nor is one given a page size in its execution options.

    The page is chosen per statement, from its parameters per row, as each
    execution starts (``pre_exec`` of the dialect's execution context): with
    SQLAlchemy's own ``insertmanyvalues_max_parameters`` a row of more
    parameters than the bound makes pages of no row, and the flush fails.
    Such a row is parsed anew in any page: its statements keep SQLAlchemy's
    page size.
    """
    dialect = engine.dialect
    if dialect.driver == "psycopg":
        dialect.execution_ctx_cls = _paged(dialect.execution_ctx_cls)
    return engine


def rows_for_asyncpg(engine: sa.Engine) -> sa.Engine:
    """Send SQLAlchemy's executemany INSERTs without RETURNING on an asyncpg ``engine`` as
    statements of many rows ("insertmanyvalues"), as SQLAlchemy does itself on psycopg2.

    The ORM's flush of objects whose keys it has (the bench's async ORM handler)
    and a Core INSERT executed with a list of rows go out as asyncpg
    ``executemany`` calls otherwise, and PostgreSQL starts its executor once a
    row: about a quarter of its CPU a message on eop's default path, counted
    (BENCHMARKS.md, "Where PostgreSQL's time goes"). The worker's side does not
    change (``benchmarks/store_transactions.py o`` under callgrind: 338,190 and
    336,640 instructions a message). The rows, their order, the keys and the
    ORM's events are the same; a ``FOR EACH STATEMENT`` trigger fires once for a
    statement's rows.
    """
    if engine.dialect.driver == "asyncpg":
        engine.dialect.use_insertmanyvalues_wo_returning = True
    return engine


_PAGED: dict[type[Any], type[Any]] = {}


def _paged(context_class: type[Any]) -> type[Any]:
    """``context_class`` whose insertmanyvalues executions get a page size of their own
    (one subclass per class: engines of one dialect share it)."""
    if context_class in _PAGED.values():
        return context_class
    paged = _PAGED.get(context_class)
    if paged is not None:
        return paged

    def pre_exec(self: Any) -> None:
        context_class.pre_exec(self)
        options = self.execution_options
        if (
            self.execute_style is not ExecuteStyle.INSERTMANYVALUES
            or "insertmanyvalues_page_size" in options
        ):
            return
        # A row of more parameters than psycopg caches is parsed anew whatever the page.
        per_row = len(self.parameters[0])
        if 0 < per_row <= PSYCOPG_CACHED_PARAMETERS:
            rows = PSYCOPG_CACHED_PARAMETERS // per_row
            self.execution_options = options.union({"insertmanyvalues_page_size": rows})

    paged = type(f"Paged{context_class.__name__}", (context_class,), {"pre_exec": pre_exec})
    return _PAGED.setdefault(context_class, paged)


# -- connection poolers (docs/pgbouncer.md)

#: What a transaction-mode pooler needs from each driver: no prepared statement
#: that outlives its transaction. asyncpg then prepares unnamed statements
#: (re-parsed with each execution, so never found missing on another server
#: connection), SQLAlchemy keeps none of them; psycopg never prepares.
_UNCACHED: dict[str, dict[str, Any]] = {
    "asyncpg": {"statement_cache_size": 0, "prepared_statement_cache_size": 0},
    "psycopg": {"prepare_threshold": None},
}


def uncached(driver: str) -> dict[str, Any]:
    """The connect arguments that make ``driver`` safe behind a transaction-mode pooler."""
    return dict(_UNCACHED.get(driver, {}))


def for_pooler(engine: sa.Engine, pooler: settings_mod.DbPooler) -> sa.Engine:
    """Make ``engine`` (an ``AsyncEngine``'s ``sync_engine`` for an async one) fit ``pooler``.

    ``transaction``: every connection is :func:`uncached`; the first is asked
    whether a pooler stands in between, and a warning says when none does
    (the caches and ``LISTEN`` are off for nothing). ``none``,
    ``session`` and ``transaction_prepared`` (a pooler that keeps prepared
    statements itself): as it is. ``auto``: the engine's first connection is opened
    uncached and asked whether a pooler stands in between
    (:func:`behind_pooler`); if one does, it and all later connections stay
    uncached, else it is closed and connections are made as they are.
    """
    if pooler in ("none", "session", "transaction_prepared"):
        return engine
    sa.event.listen(engine, "do_connect", _Connector(pooler == "transaction" or None).connect)
    return engine


class _Connector:
    """The ``do_connect`` hook of :func:`for_pooler`: remembers what ``auto`` found."""

    def __init__(self, pooled: bool | None) -> None:
        self.pooled = pooled
        # Set by ``transaction``: its first connection is asked whether a pooler serves it.
        self._unverified = bool(pooled)

    def connect(
        self, dialect: sa.Dialect, record: object, cargs: list[Any], cparams: dict[str, Any]
    ) -> Any:
        safe = uncached(str(dialect.driver))
        if self._unverified and safe:
            self._unverified = False
            return self._checking(dialect, cargs, {**cparams, **safe})
        if self.pooled is None and safe:
            # Concurrent first connections may each probe: the answer is the same.
            conn = dialect.connect(*cargs, **{**cparams, **safe})
            try:
                self.pooled = _probe(conn)
            except BaseException:
                conn.close()
                raise
            if self.pooled:
                log.get_logger().info(log.Event.DB_POOLER_FOUND, statement_cache="off")
                return conn
            conn.close()
        if self.pooled:
            cparams.update(safe)
        return None  # SQLAlchemy connects with cparams

    def _checking(self, dialect: sa.Dialect, cargs: list[Any], cparams: dict[str, Any]) -> Any:
        """``transaction`` set: the first connection, and a warning if no pooler serves it.

        Only a cost: a session-mode pooler cannot be told from a transaction-mode
        one, and is not warned about."""
        conn = dialect.connect(*cargs, **cparams)
        try:
            pooled = _probe(conn)
        except BaseException:
            conn.close()
            raise
        if not pooled:
            log.get_logger().warning(
                log.Event.DB_POOLER_UNNEEDED,
                db_pooler="transaction",
                statement_cache="off",
                fix="EOP_DB_POOLER=auto (or none): PostgreSQL is reached directly",
            )
        return conn


def _probe(conn: Any) -> bool:
    """Whether the DBAPI connection ``conn`` reaches PostgreSQL through a pooler."""
    cursor = conn.cursor()
    try:
        cursor.execute(base_sql.BACKEND_PID)
        row = cursor.fetchone()
    finally:
        cursor.close()
    conn.rollback()
    protocol_pid = _protocol_pid(conn)
    return protocol_pid is not None and int(row[0]) != protocol_pid


def _protocol_pid(conn: Any) -> int | None:
    """The pid the server announced when the connection opened (BackendKeyData)."""
    driver = getattr(conn, "driver_connection", conn)
    get_server_pid = getattr(driver, "get_server_pid", None)  # asyncpg
    if get_server_pid is not None:
        return int(get_server_pid())
    info = getattr(driver, "info", None)  # psycopg
    pid = getattr(info, "backend_pid", None)
    return int(pid) if pid is not None else None


async def transaction_pooled(conn: AsyncConnection, pooler: settings_mod.DbPooler) -> bool:
    """Whether ``conn`` is to be used as through a transaction-mode pooler.

    ``pooler`` (the ``db_pooler`` setting) decides, except ``auto``, which
    asks the connection (:func:`behind_pooler`): any pooler found counts.
    """
    if pooler == "auto":
        return await behind_pooler(conn)
    return pooler in ("transaction", "transaction_prepared")


async def behind_pooler(conn: AsyncConnection) -> bool:
    """Whether ``conn`` reaches PostgreSQL through a pooler (its transaction is rolled back)."""
    try:
        pid = (await conn.execute(base_sql.backend_pid())).scalar_one()
    finally:
        await conn.rollback()
    raw = await conn.get_raw_connection()
    protocol_pid = _protocol_pid(raw.dbapi_connection)
    return protocol_pid is not None and int(pid) != protocol_pid
