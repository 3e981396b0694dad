"""The :class:`App`: the registry of handlers and the database it writes to."""

from __future__ import annotations

import asyncio
import importlib
import os
import sys
import traceback
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, TypeVar

import sqlalchemy as sa
from sqlalchemy import orm
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine

from eop import errors
from eop import handler as handler_mod
from eop import settings as settings_mod
from eop.outbox import table as outbox
from eop.pg import engines
from eop.pg.store import PostgresStore

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession

F = TypeVar("F", bound=handler_mod.HandlerFunc)

# Drivers whose sync twin eop knows, for sync handlers on an async URL.
_SYNC_DRIVER = {
    "postgresql": "postgresql+psycopg",
    "postgresql+asyncpg": "postgresql+psycopg",
    "postgresql+psycopg": "postgresql+psycopg",
}


class App:
    """An eop application: handlers registered by decorator, and where they write.

    ``App()`` reads its settings from ``EOP_*`` environment variables;
    ``database_url``/``nats_url`` or ``settings`` override them. To plug into an
    existing application, pass its ``engine`` (an ``AsyncEngine``) or its
    ``sessionmaker`` (an ``async_sessionmaker``), and for sync handlers
    optionally its sync ``sync_sessionmaker``.
    """

    def __init__(
        self,
        *,
        database_url: str | None = None,
        nats_url: str | None = None,
        engine: AsyncEngine | None = None,
        sessionmaker: async_sessionmaker[AsyncSession] | None = None,
        sync_sessionmaker: orm.sessionmaker[orm.Session] | None = None,
        settings: settings_mod.Settings | None = None,
        schema: str | None = None,
    ) -> None:
        base = settings if settings is not None else settings_mod.Settings.from_env()
        if sessionmaker is not None and engine is None:
            bind = sessionmaker.kw.get("bind")
            if not isinstance(bind, AsyncEngine):
                raise errors.ConfigurationError("the sessionmaker must be bound to an AsyncEngine")
            engine = bind
        if engine is not None:
            database_url = engine.url.render_as_string(hide_password=False)
        self.settings = base.replace(database_url=database_url, nats_url=nats_url, schema=schema)
        self._engine = engine
        self._sessionmaker = sessionmaker
        self._sync_sessionmaker = sync_sessionmaker
        self._sync_given = sync_sessionmaker is not None
        self._handlers: dict[str, handler_mod.HandlerSpec] = {}
        self._streams: dict[str, handler_mod.StreamSpec] = {}
        self._store_factory: Callable[[App], PostgresStore] = PostgresStore
        self._threaded_store = False

    def handler(
        self,
        *,
        stream: str,
        subject: str,
        name: str,
        durable: str | None = None,
        max_attempts: int | None = None,
        ack_wait_s: float | None = None,
        msg_id_guard: bool = True,
        batch: bool = False,
        order_by: str | None = None,
        partitions: int = 1,
    ) -> Callable[[F], F]:
        """Register a handler for the messages of ``stream`` matching ``subject``.

        ``name`` is the handler's stable identity: the inbox is keyed on it.
        An ``async def`` handler is called as ``await handler(message,
        async_session)``, a plain ``def`` one as ``handler(message, session)``
        in a worker thread; both run inside the transaction that claims the
        message, and must not commit it. With ``batch=True`` the handler gets
        the list of messages of one fetched batch instead (all claimed in the
        same transaction); if it raises, eop retries the messages one by one to
        find the failing one. ``order_by="subject:N"`` or ``"header:NAME"``
        handles messages with the same key in stream order, on any number of
        worker processes and machines; ``partitions=N`` (with ``subject:N``
        keys) spreads the keys over N partitions, each owned by one process at
        a time, so that the handler scales out (docs/ordering.md).
        """

        def register(func: F) -> F:
            if name in self._handlers:
                raise errors.ConfigurationError(f"a handler named {name!r} is already registered")
            self._handlers[name] = handler_mod.HandlerSpec(
                func=func,
                name=name,
                stream=stream,
                subject=subject,
                durable=durable or f"eop-{name}",
                max_attempts=max_attempts,
                ack_wait_s=ack_wait_s,
                msg_id_guard=msg_id_guard,
                batch=batch,
                order_by=order_by,
                partitions=partitions,
            )
            return func

        return register

    def stream(
        self,
        name: str,
        *,
        subjects: Iterable[str],
        storage: handler_mod.StorageType = "file",
        duplicate_window_s: float = 120.0,
        max_age_s: float = 0.0,
        replicas: int | None = None,
        placement_cluster: str | None = None,
        placement_tags: Iterable[str] = (),
    ) -> handler_mod.StreamSpec:
        """Declare a stream that workers (and ``eop relay``) create if it is missing
        (with ``create`` on), whether a handler consumes it or only the outbox
        publishes to it. An existing stream is used as it is.

        ``replicas`` (1 to 5; None: the server's default, 1) is how many servers
        of a NATS cluster keep a copy of the stream; the consumers eop creates
        on it get as many. A stream that exists with another number is left as
        it is, with a warning
        (``stream.replicas_differ``): ``nats stream edit NAME --replicas N``
        changes it. ``placement_cluster`` and ``placement_tags`` choose where
        the server puts the replicas.

        Undeclared streams are created with the subjects of their handlers.
        """
        spec = handler_mod.StreamSpec(
            name=name,
            subjects=tuple(subjects),
            storage=storage,
            duplicate_window_s=duplicate_window_s,
            max_age_s=max_age_s,
            replicas=replicas,
            placement_cluster=placement_cluster,
            # One tag given as a string is that tag, not a list of letters.
            placement_tags=(
                (placement_tags,) if isinstance(placement_tags, str) else tuple(placement_tags)
            ),
        )
        self._streams[name] = spec
        return spec

    @property
    def streams(self) -> dict[str, handler_mod.StreamSpec]:
        """The declared streams by name (:meth:`stream`)."""
        return dict(self._streams)

    @property
    def handlers(self) -> dict[str, handler_mod.HandlerSpec]:
        """The registered handlers by name."""
        return dict(self._handlers)

    def stream_spec(self, name: str) -> handler_mod.StreamSpec:
        """The declared stream ``name``, or one built from its handlers' subjects."""
        if name in self._streams:
            return self._streams[name]
        subjects = sorted({h.subject for h in self._handlers.values() if h.stream == name})
        return handler_mod.StreamSpec(name=name, subjects=tuple(subjects))

    def with_settings(self, **changes: object) -> App:
        """A copy of this app with some settings changed (None values are ignored)."""
        clone = App.__new__(App)
        clone.__dict__.update(self.__dict__)
        clone.settings = self.settings.replace(**changes)
        return clone

    def with_database(self, database: str | AsyncEngine, *, schema: str | None = None) -> App:
        """A copy of this app on another database: the same handlers and streams, its own pools.

        ``database`` is a URL or an ``AsyncEngine``; the copy's sync handlers get
        a psycopg engine on the same URL. The test kit runs an app's handlers
        on a test database this way.
        """
        engine = database if isinstance(database, AsyncEngine) else None
        url = None if engine is not None else str(database)
        clone = App(database_url=url, engine=engine, settings=self.settings, schema=schema)
        clone._handlers = self._handlers
        clone._streams = self._streams
        return clone

    def with_store(self, factory: Callable[[App], PostgresStore], *, threaded: bool = False) -> App:
        """A copy of this app whose workers open handler transactions on ``factory(app)``.

        :mod:`eop.contrib.django` gives one that runs them on Django's connections;
        eop's own bookkeeping stays on the app's engine. ``threaded``: every
        handler's transaction holds a connection in a thread of the store's, as
        sync handlers' do (:meth:`connection_shares` counts them so).
        """
        clone = self.with_settings()
        clone._store_factory = factory
        clone._threaded_store = threaded
        return clone

    def make_store(self) -> PostgresStore:
        """The store a worker of this app opens its handlers' transactions with."""
        return self._store_factory(self)

    def connection_shares(self) -> tuple[int, int]:
        """How the pools eop makes share ``settings.db_connections()``: (async, sync).

        That number bounds the PostgreSQL connections of one worker process,
        both pools included, and neither overflows it. Without sync handlers,
        or with sync handlers on the async session (:meth:`bridges_sync_handlers`,
        the default), the async pool has them all. With both kinds on a sync
        pool of eop's (a threaded store: Django's), half go to the sync pool
        (the async pool gets the odd one); with sync handlers only, the async
        pool keeps 1 or 2 for eop's bookkeeping (start-up check, compaction,
        the check after an ambiguous COMMIT) and the sync pool the rest.
        """
        return self._shares(bridged=self.bridges_sync_handlers())

    def _shares(self, *, bridged: bool) -> tuple[int, int]:
        """:meth:`connection_shares`, sync handlers on the async pool if ``bridged``."""
        total = self.settings.db_connections()
        if self._threaded_store:
            kinds = {False}
        else:
            kinds = {spec.is_async or bridged for spec in self._handlers.values()}
        if False not in kinds:
            return total, 0
        if total < 2:
            raise errors.ConfigurationError(
                f"db_pool_size is {total}, but an app with sync handlers needs at least 2 "
                "connections per worker process (one for each pool): raise db_pool_size"
            )
        async_share = total - total // 2 if True in kinds else max(1, min(2, total // 4))
        return async_share, total - async_share

    def bridges_sync_handlers(self) -> bool:
        """Whether sync handlers run their transactions on the async engine.

        They do unless the app was given a ``sync_sessionmaker`` (its engine,
        its driver) or a store of its own (Django's): the handler runs in a
        thread with the sync face of an ``AsyncSession``, whose statements are
        sent from the event loop (:mod:`eop.pg.bridge`).
        """
        return not self._sync_given and not self._threaded_store

    def sync_transactions(self) -> int:
        """How many sync transactions eop keeps open at once (and threads it runs them in).

        On the async session (the default): the async pool's size, so that a
        handler never waits for a thread while its transaction holds a
        connection. With eop's own sync pool: that pool's size, its share of
        ``db_connections``. With a ``sync_sessionmaker`` given: what its pool
        can hand out at once (``pool_size + max_overflow`` of a ``QueuePool``),
        so that eop never waits for a connection of it while holding one; for
        a pool without a limit (``NullPool``, an unlimited overflow), eop's
        share again.
        """
        if self.bridges_sync_handlers():
            return self.connection_shares()[0]
        share = max(1, self.connection_shares()[1])
        if self._sync_sessionmaker is None:
            return share
        bind = self._sync_sessionmaker.kw.get("bind")
        pool = bind.pool if isinstance(bind, sa.Engine) else None
        if isinstance(pool, sa.QueuePool):
            # No public reader of max_overflow; -1 means no limit.
            overflow: int = pool._max_overflow
            return pool.size() + overflow if overflow >= 0 else share
        if isinstance(pool, (sa.StaticPool, sa.SingletonThreadPool, sa.AssertionPool)):
            return 1
        return share

    @classmethod
    def from_path(cls, path: str) -> App:
        """Import ``module:attribute`` (``myapp:app``) and return the app it names.

        The current directory is importable, as for ``eop worker myapp:app``.
        """
        app = import_attribute(path, "MODULE:APP, e.g. myapp:app")
        if not isinstance(app, App):
            raise errors.ConfigurationError(
                f"{path!r} is not an eop.App (got {type(app).__name__})"
            )
        return app

    @property
    def engine(self) -> AsyncEngine:
        """The async engine: the one given, or one made from ``database_url``."""
        if self._engine is None:
            # libpq's TLS parameters (sslrootcert...) become asyncpg's ssl context.
            url, connect_args = engines.asyncpg_url(self.settings.database_url)
            within = self.settings.db_connect_timeout_s
            if url.get_driver_name() == "asyncpg":
                connect_args = engines.timed(url, engines.named(connect_args), within)
            else:  # psycopg takes libpq's options in the URL, not asyncpg's server_settings
                url = engines.timed_url(engines.named_url(url), within)
            self._engine = create_async_engine(
                url,
                connect_args=connect_args,
                # Batches share connections: a few transactions at a time keep
                # the database busy without exhausting max_connections. No
                # overflow: db_pool_size is a bound, not a baseline.
                pool_size=self.connection_shares()[0],
                max_overflow=0,
                # Bound values are payload data: keep them out of SQLAlchemy's
                # error texts and echo logs (log.describe_error drops them too,
                # for engines eop is given).
                hide_parameters=True,
            )
            engines.for_pooler(self._engine.sync_engine, self.settings.db_pooler)
            engines.paged_for_psycopg(self._engine.sync_engine)
            engines.rows_for_asyncpg(self._engine.sync_engine)
        return self._engine

    @property
    def sessionmaker(self) -> async_sessionmaker[AsyncSession]:
        """The async sessionmaker eop opens handler transactions with."""
        if self._sessionmaker is None:
            self._sessionmaker = async_sessionmaker(
                self.engine, expire_on_commit=False, info=self._outbox_info()
            )
        return self._sessionmaker

    @property
    def sync_sessionmaker(self) -> orm.sessionmaker[orm.Session]:
        """The sync sessionmaker for sync handlers (made from the async URL if not given).

        The one eop makes has its share of ``db_connections`` and no overflow:
        exactly one connection per thread of :meth:`sync_transactions`.
        """
        if self._sync_sessionmaker is None:
            self._sync_sessionmaker = orm.sessionmaker(
                # From the settings' URL: the engine's lost the TLS parameters libpq reads.
                engines.for_pooler(
                    engines.paged_for_psycopg(
                        sa.create_engine(
                            engines.timed_url(
                                engines.named_url(
                                    sync_url(sa.make_url(self.settings.database_url))
                                ),
                                self.settings.db_connect_timeout_s,
                            ),
                            # Spark's executors and tools open it; a worker's sync
                            # handlers do too when not bridged.
                            pool_size=max(1, self._shares(bridged=False)[1]),
                            max_overflow=0,
                            pool_pre_ping=True,
                            hide_parameters=True,  # as the async engine's
                        )
                    ),
                    self.settings.db_pooler,
                ),
                expire_on_commit=False,
                info=self._outbox_info(),
            )
        return self._sync_sessionmaker

    def _outbox_info(self) -> dict[str, object]:
        # Sessions the app makes know their outbox: eop.outbox.add needs no schema= then.
        return {outbox.CONTEXT_KEY: outbox.Context.of(self.settings)}

    async def dispose(self) -> None:
        """Close the connection pools eop made (not the ones it was given)."""
        if self._engine is not None:
            await self._engine.dispose()
        if self._sync_sessionmaker is not None:
            bind = self._sync_sessionmaker.kw.get("bind")
            if isinstance(bind, sa.Engine):
                # Closing sync connections blocks: not on the event loop.
                await asyncio.to_thread(bind.dispose)


def sync_url(url: sa.URL) -> sa.URL:
    """The sync-driver twin of an async database URL."""
    driver = _SYNC_DRIVER.get(url.drivername)
    if driver is None:
        raise errors.ConfigurationError(
            f"no sync driver known for {url.drivername!r}: pass sync_sessionmaker= to App"
        )
    query = dict(url.query)
    # asyncpg spells TLS "ssl=", libpq (psycopg) "sslmode=".
    if "ssl" in query and "sslmode" not in query:
        query["sslmode"] = query.pop("ssl")
    return url.set(drivername=driver, query=query)


def select_handlers(app: App, names: Iterable[str]) -> list[handler_mod.HandlerSpec]:
    """The specs of the handlers called ``names`` (all when empty); clear error if unknown."""
    wanted = list(names)
    if not wanted:
        return list(app.handlers.values())
    unknown = [n for n in wanted if n not in app.handlers]
    if unknown:
        known = ", ".join(sorted(app.handlers)) or "none"
        raise errors.ConfigurationError(f"unknown handler(s) {unknown}; registered: {known}")
    return [app.handlers[n] for n in wanted]


def import_attribute(path: str, form: str) -> object:
    """Import ``module:attribute`` and return the attribute.

    ``form`` names what the user should have written, for the error message.
    """
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise errors.ConfigurationError(f"expected {form}, not {path!r}")
    # Like uvicorn: the current directory is importable, as users expect.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise errors.ConfigurationError(f"cannot import {module_name!r}: {exc}") from exc
    except Exception as exc:
        # The module's own code failed: one line naming where, not a traceback.
        raise errors.ConfigurationError(
            f"importing {module_name!r} failed{_where(exc)}: {type(exc).__name__}: {exc}"
        ) from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        # Not "got NoneType": the user mistyped a name, say which one.
        raise errors.ConfigurationError(
            f"module {module_name!r} ({getattr(module, '__file__', None) or 'no file'}) "
            f"has no attribute {attr!r}: expected {form}"
        ) from None


def _where(exc: BaseException) -> str:
    """`` at FILE, line N``: where the import failed (the deepest frame, or the line a
    SyntaxError names)."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f" at {exc.filename}, line {exc.lineno}"
    frames = traceback.extract_tb(exc.__traceback__)
    return f" at {frames[-1].filename}, line {frames[-1].lineno}" if frames else ""
