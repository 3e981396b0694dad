"""The inbox edge: how driver errors are classified, and the real store's statements."""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import pytest
import sqlalchemy.exc as sa_exc
from sqlalchemy.dialects import postgresql

from eop import errors
from eop.handler import HandlerSpec
from eop.message import Message
from eop.pg import contract, failures, models, transactions
from eop.pg.sql import claim as claim_sql
from eop.pg.sql import inbox as inbox_sql
from eop.pg.sql import retries as retries_sql

DbFailure = failures.DbFailure


class DriverError(Exception):
    """A driver exception carrying a SQLSTATE (asyncpg and psycopg 3 spell it ``sqlstate``)."""

    def __init__(self, sqlstate: str, text: str = "driver error") -> None:
        super().__init__(text)
        self.sqlstate = sqlstate


class Psycopg2Error(Exception):
    """psycopg2 spells it ``pgcode``."""

    def __init__(self, pgcode: str) -> None:
        super().__init__("psycopg2 error")
        self.pgcode = pgcode


def wrapped(orig: BaseException, *, invalidated: bool = False) -> sa_exc.DBAPIError:
    return sa_exc.OperationalError("COMMIT", {}, orig, connection_invalidated=invalidated)


# ------------------------------------------------------------------- classify


@pytest.mark.parametrize(
    ("sqlstate", "expected"),
    [
        ("40001", DbFailure.CONFLICT),  # serialization_failure
        ("40P01", DbFailure.CONFLICT),  # deadlock_detected
        ("55P03", DbFailure.LOCK_TIMEOUT),  # lock_not_available
        ("57P01", DbFailure.CONNECTION),  # admin_shutdown
        ("57P02", DbFailure.CONNECTION),  # crash_shutdown
        ("57P03", DbFailure.CONNECTION),  # cannot_connect_now
        ("08006", DbFailure.CONNECTION),  # connection_failure
        ("08003", DbFailure.CONNECTION),  # connection_does_not_exist
        ("23505", DbFailure.OTHER),  # unique_violation
        ("57014", DbFailure.BUSY),  # query_canceled (statement_timeout)
        ("25006", DbFailure.BUSY),  # read_only_sql_transaction
        ("53300", DbFailure.BUSY),  # too_many_connections
        ("53100", DbFailure.BUSY),  # disk_full
        # A transaction-mode pooler lost or doubled a prepared statement (db_pooler
        # set wrong), or the schema lacks what a statement names (a migration that did
        # not run): the same on every attempt, never one of the handler's; the worker
        # stops on them (eop.protocol.misconfiguration).
        ("42P05", DbFailure.MISCONFIGURED),  # duplicate_prepared_statement
        ("26000", DbFailure.MISCONFIGURED),  # invalid_sql_statement_name
        ("42P01", DbFailure.MISCONFIGURED),  # undefined_table
        ("42703", DbFailure.MISCONFIGURED),  # undefined_column
        ("42883", DbFailure.MISCONFIGURED),  # undefined_function
        ("42704", DbFailure.MISCONFIGURED),  # undefined_object
        ("3F000", DbFailure.MISCONFIGURED),  # invalid_schema_name
        ("42601", DbFailure.OTHER),  # syntax_error: the handler's
    ],
)
def test_classify_reads_the_sqlstate(sqlstate: str, expected: DbFailure) -> None:
    assert failures.classify(DriverError(sqlstate)) is expected


@pytest.mark.parametrize(
    ("sqlstate", "expected"), [("42P05", True), ("26000", True), ("23505", False)]
)
def test_pooler_mismatch_names_the_prepared_statement_errors_of_a_transaction_pooler(
    sqlstate: str, expected: bool
) -> None:
    """What `eop db ...` and the worker's start-up check turn into the EOP_DB_POOLER advice."""
    assert failures.pooler_mismatch(wrapped(DriverError(sqlstate))) is expected


@pytest.mark.parametrize(
    ("sqlstate", "expected"),
    [
        ("26000", failures.Misconfiguration.POOLER),
        ("42P01", failures.Misconfiguration.SCHEMA),
        ("3F000", failures.Misconfiguration.SCHEMA),
        ("28P01", failures.Misconfiguration.LOGIN),
        ("28000", failures.Misconfiguration.LOGIN),
        ("3D000", failures.Misconfiguration.LOGIN),
        ("40001", None),
    ],
)
def test_misconfiguration_names_the_fix_a_misconfigured_failure_needs(
    sqlstate: str, expected: failures.Misconfiguration | None
) -> None:
    """Pooler (EOP_DB_POOLER), schema (a migration) or a login the server refuses since
    the worker started (the URL's credentials): the fixes the worker names; each is
    retried uncounted, never a message's attempt."""
    assert failures.misconfiguration(wrapped(DriverError(sqlstate))) is expected
    assert failures.transient(wrapped(DriverError(sqlstate))) is (sqlstate != "42601")


def test_database_message_is_the_drivers_first_line_and_sqlstate() -> None:
    """The text the worker stops with: the database's own words, without SQLAlchemy's
    wrapper or the statement (whose literals may be payload)."""
    exc = wrapped(DriverError("42P01", 'relation "effects" does not exist\nLINE 1: x'))
    assert failures.database_message(exc) == ('relation "effects" does not exist (SQLSTATE 42P01)')


class OperationalError(Exception):
    """psycopg's error for a connection that could not be made: no SQLSTATE."""

    __module__ = "psycopg"


def test_classify_an_operational_error_without_sqlstate_as_connection() -> None:
    assert failures.classify(wrapped(OperationalError("connection refused"))) is (
        DbFailure.CONNECTION
    )


def test_classify_reads_psycopg2_pgcode() -> None:
    assert failures.classify(Psycopg2Error("40001")) is DbFailure.CONFLICT


def test_classify_looks_inside_sqlalchemy_wrappers() -> None:
    assert failures.classify(wrapped(DriverError("40P01"))) is DbFailure.CONFLICT


def test_classify_an_invalidated_connection_as_connection() -> None:
    assert failures.classify(wrapped(ValueError("x"), invalidated=True)) is DbFailure.CONNECTION


@pytest.mark.parametrize(
    "exc",
    [
        wrapped(OSError("reset")),
        wrapped(ConnectionResetError()),
        wrapped(ConnectionRefusedError()),
        sa_exc.DisconnectionError(),
    ],
)
def test_classify_socket_errors_below_a_database_error_as_connection(exc: BaseException) -> None:
    """An OSError raised by the driver (wrapped by SQLAlchemy) is a lost connection."""
    assert failures.classify(exc) is DbFailure.CONNECTION


@pytest.mark.parametrize(
    "exc", [OSError("reset"), ConnectionRefusedError(), FileNotFoundError("/x"), TimeoutError()]
)
def test_classify_a_bare_os_error_as_other(exc: BaseException) -> None:
    """A handler's own OSError (a file, an HTTP API) is not the database's connection."""
    assert failures.classify(exc) is DbFailure.OTHER


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (errors.TransactionConflict("x"), True),
        (errors.DatabaseUnavailable("x"), True),
        (DriverError("40P01"), True),
        (DriverError("55P03"), True),
        (DriverError("57014"), True),
        (wrapped(OSError("reset")), True),
        (DriverError("23505"), False),
        (errors.Reject("bad"), False),
        (OSError("the handler's own"), False),
    ],
)
def test_transient_failures_are_the_databases_not_the_handlers(
    exc: BaseException, transient: bool
) -> None:
    """eop's own outage errors always, its other errors never, the rest by their kind."""
    assert failures.transient(exc) is transient


def test_transient_takes_the_kinds_a_caller_retries() -> None:
    """A caller narrowing the kinds (Spark's partitions: no BUSY) gets its own answer."""
    kinds = frozenset({DbFailure.CONFLICT})
    assert failures.transient(DriverError("40001"), kinds) is True
    assert failures.transient(DriverError("57014"), kinds) is False
    assert failures.transient(errors.DatabaseUnavailable("x"), kinds) is True


def test_classify_asyncpg_connection_errors_by_name() -> None:
    """asyncpg's connection errors, raised unwrapped, are lost connections."""
    namespace = {"__module__": "asyncpg.exceptions"}
    ConnectionDoesNotExistError = type("ConnectionDoesNotExistError", (Exception,), namespace)
    InterfaceError = type("InterfaceError", (Exception,), namespace)
    # A pooled connection left mid-operation by a terminated backend: its BEGIN fails so.
    InternalClientError = type("InternalClientError", (Exception,), namespace)
    assert failures.classify(ConnectionDoesNotExistError()) is DbFailure.CONNECTION
    assert failures.classify(InterfaceError()) is DbFailure.CONNECTION
    assert failures.classify(InternalClientError("cannot switch to state 15")) is (
        DbFailure.CONNECTION
    )


def test_classify_database_unavailable_as_connection() -> None:
    assert failures.classify(errors.DatabaseUnavailable()) is DbFailure.CONNECTION


@pytest.mark.parametrize("exc", [ValueError("x"), KeyError("k"), errors.Reject("no")])
def test_classify_anything_else_as_other(exc: BaseException) -> None:
    assert failures.classify(exc) is DbFailure.OTHER


def test_classify_follows_the_cause_chain() -> None:
    outer = RuntimeError("claim failed")
    outer.__cause__ = DriverError("55P03")
    assert failures.classify(outer) is DbFailure.LOCK_TIMEOUT


def test_classify_follows_the_context_chain() -> None:
    outer = RuntimeError("while handling")
    outer.__context__ = DriverError("40001")
    assert failures.classify(outer) is DbFailure.CONFLICT


def test_classify_ends_on_a_cyclic_chain() -> None:
    a, b = ValueError("a"), ValueError("b")
    a.__context__, b.__context__ = b, a
    assert failures.classify(a) is DbFailure.OTHER


# --------------------------------------------------- the real store's statements


class FakeAsyncSession:
    """Just enough of an AsyncSession for AsyncTransaction: records what it is asked."""

    def __init__(
        self,
        results: list[list[tuple[Any, ...]]] | None = None,
        commit_error: Exception | None = None,
    ) -> None:
        self.executed: list[Any] = []
        self.bound: list[dict[str, Any]] = []
        """The values of each executed statement's bind parameters (``p_`` names)."""
        self.info: dict[str, Any] = {}
        self.results = list(results or [])
        self.commit_error = commit_error
        self.calls: list[str] = []
        self.new: list[object] = []
        self.dirty: list[object] = []
        self.deleted: list[object] = []
        self.sync_session = FakeSyncFace(self)

    driver = "fake"
    """The driver the session's connection reports (``asyncpg``: claims go to it directly)."""

    async def connection(self) -> Any:
        session = self

        class Raw:
            driver_connection = self

        class Connection:
            dialect = types.SimpleNamespace(driver=session.driver)

            async def get_raw_connection(self) -> Raw:
                return Raw()

        return Connection()

    async def fetch(self, query: str, *args: Any) -> list[tuple[Any, ...]]:
        """The asyncpg connection's fetch, when :attr:`driver` is ``asyncpg``."""
        self.executed.append((query, args))
        return self.results.pop(0) if self.results else []

    async def execute(
        self, stmt: Any, params: dict[str, Any] | None = None
    ) -> list[tuple[Any, ...]]:
        self.executed.append(stmt)
        self.bound.append(params or {})
        self.calls.append("execute")
        return self.results.pop(0) if self.results else []

    async def flush(self) -> None:
        self.calls.append("flush")

    async def run_sync(self, fn: Any, *args: Any) -> Any:
        """As AsyncSession's: ``fn`` on the sync face (where eop ends its transaction)."""
        return fn(self.sync_session, *args)


class FakeSyncFace:
    """The fake's ``sync_session``: what eop guards, and ends past the guard."""

    def __init__(self, outer: FakeAsyncSession) -> None:
        self.outer = outer
        # The fake's objects are no ORM objects: as if one were loaded, which leaves the
        # whole flush to the session (eop.pg.pending).
        self.identity_map = {"key": object()}

    def commit(self) -> None:
        self.outer.calls.append("commit")
        if self.outer.commit_error is not None:
            raise self.outer.commit_error

    def rollback(self) -> None:
        self.outer.calls.append("rollback")
        raise ConnectionResetError("the connection is gone")


async def noop_handler(message: Message, session: Any) -> None:
    session.calls.append("handler")


def spec(*, msg_id_guard: bool = True) -> HandlerSpec:
    return HandlerSpec(
        func=noop_handler,
        name="orders",
        stream="ORDERS",
        subject="orders.>",
        durable="eop-orders",
        msg_id_guard=msg_id_guard,
    )


def message(headers: dict[str, str] | None = None) -> Message:
    return Message(
        subscription="orders",
        subject="orders.new",
        data=b'{"id": 1}',
        headers=headers or {},
        stream="ORDERS",
        stream_epoch="e1",
        seq=3,
        num_delivered=2,
    )


def transaction(session: FakeAsyncSession, **spec_options: Any) -> transactions.AsyncTransaction:
    return transactions.AsyncTransaction(session, models.tables("eop"), spec(**spec_options))  # type: ignore[arg-type]


def params(stmt: Any) -> dict[str, Any]:
    return dict(stmt.compile(dialect=postgresql.dialect()).params)


async def test_claim_is_true_when_the_insert_returns_a_row() -> None:
    session = FakeAsyncSession(results=[[(3,)]])
    assert await transaction(session).claim(message(), models.OUTCOME_PROCESSED) is True


async def test_batch_claim_on_asyncpg_sends_shared_values_once_and_the_rest_as_arrays() -> None:
    """On asyncpg the claim skips SQLAlchemy: the same statement, its parameters positional in
    the order of claim_sql.CLAIM_PARAMS, the watermark read FOR SHARE. Subscription, stream and
    outcome are scalars; a column whose rows all hold one value (the epoch, the delivery
    count here) goes once, its array left empty; the others as arrays."""
    session = FakeAsyncSession(results=[[(3,)]])
    session.driver = "asyncpg"
    msgs = [message({"Nats-Msg-Id": "m-1"}), dataclasses.replace(message(), seq=4)]
    claimed = await transaction(session).claim_many(msgs, models.OUTCOME_PROCESSED)
    assert claimed == {3}
    # One message not claimed: the lanes are made if missing (none was: no claim again).
    [(query, args), lanes] = session.executed
    assert session.bound[-1] == {
        "p_subscription": "orders",
        "p_stream": "ORDERS",
        "p_epochs": ["e1"],
    }
    assert "watermarks" in str(lanes)
    assert query == claim_sql.claim_driver_text("eop")
    assert "FOR SHARE" in query
    assert "ON CONFLICT DO NOTHING" in query
    params = dict(zip(claim_sql.CLAIM_PARAMS, args, strict=True))
    assert (params["subscription"], params["stream"], params["outcome"]) == (
        "orders",
        "ORDERS",
        "processed",
    )
    assert params["stream_seq"] == [3, 4]
    assert params["fingerprint"] == [m.fingerprint for m in msgs]
    assert (params["stream_epoch"], params["stream_epoch_each"]) == ("e1", [])
    assert (params["delivery_count"], params["delivery_count_each"]) == (2, [])
    assert (params["msg_id"], params["msg_id_each"]) == (None, ["m-1", None])
    # Each row's values are those of claim_row (the stream is the scalar the lane is
    # found by).
    tx = transaction(FakeAsyncSession())
    for i, m in enumerate(msgs):
        row = tx.claim_row(m, models.OUTCOME_PROCESSED)
        for name, value in row.items():
            each = params.get(f"{name}_each")
            expected = each[i] if each else params[name]
            if isinstance(expected, list):
                expected = expected[i]
            assert expected == value, name


async def test_a_claim_that_finds_a_lane_missing_makes_it_and_claims_again() -> None:
    """A message whose epoch has no watermark row yet (no lane) is not claimed by the
    statement: the claim makes the batch's missing rows, in its transaction, and runs again;
    the sequences of both runs are claimed. A full claim makes nothing."""
    session = FakeAsyncSession(results=[[(3,)], [(7,)], [(4,)]])
    session.driver = "asyncpg"
    msgs = [message(), dataclasses.replace(message(), seq=4, stream_epoch="e2")]
    claimed = await transaction(session).claim_many(msgs, models.OUTCOME_PROCESSED)
    assert claimed == {3, 4}
    first, lanes, again = session.executed
    assert first == again
    assert "INSERT INTO eop.watermarks" in str(lanes)
    assert session.bound[-1]["p_epochs"] == ["e1", "e2"]
    full = FakeAsyncSession(results=[[(3,)]])
    full.driver = "asyncpg"
    assert await transaction(full).claim_many([message()], models.OUTCOME_PROCESSED) == {3}
    assert len(full.executed) == 1


def test_the_psycopg_claim_sends_its_arrays_as_array_text() -> None:
    """On psycopg the claim's arrays go as the text of PostgreSQL arrays, escaped (quotes and
    backslashes in text, bytea as hex), the scalars as they are; an array holding a NULL
    stays a list, for psycopg to adapt (unquoted NULL depends on the server's
    array_nulls)."""
    args = claim_sql.claim_arguments(
        "s",
        "S",
        "processed",
        [7, 8],
        [b"\x00\xff", b"ab"],
        ['e"1', "e\\2"],
        [1, 2],
        ["m-1", None],
    )
    params = claim_sql.claim_pyformat_parameters(args)
    assert (params["subscription"], params["stream"], params["outcome"]) == ("s", "S", "processed")
    assert params["stream_seq"] == "{7,8}"
    assert params["fingerprint"] == '{"\\\\x00ff","\\\\x6162"}'
    assert params["stream_epoch_each"] == '{"e\\"1","e\\\\2"}'
    assert params["delivery_count_each"] == "{1,2}"
    assert params["msg_id_each"] == ["m-1", None]
    text = claim_sql.claim_pyformat_text("eop")
    assert all(f"%({name})s" in text for name in claim_sql.CLAIM_PARAMS)


class FakeSyncSession:
    """A sync Session stand-in on a driver other than psycopg: the claim takes the ORM's way."""

    def __init__(self, rows: list[tuple[int]]) -> None:
        self.info: dict[str, object] = {}
        self.rows = rows
        self.executed: list[Any] = []

    def connection(self) -> Any:
        return types.SimpleNamespace(dialect=types.SimpleNamespace(driver="psycopg2"))

    def execute(self, stmt: Any) -> list[tuple[int]]:
        self.executed.append(stmt)
        return self.rows


async def test_a_sync_claim_on_another_driver_runs_the_statement_through_the_session() -> None:
    """Only psycopg's connection takes the claim as plain SQL; a session on another driver
    (a sync_sessionmaker of the user's) executes the SQLAlchemy statement."""
    session = FakeSyncSession([(3,)])
    tx = transactions.SyncTransaction(session, models.tables("eop"), spec())  # type: ignore[arg-type]
    assert await tx.claim_many([message()], models.OUTCOME_PROCESSED) == {3}
    [stmt] = session.executed
    assert params(stmt)["stream_seq"] == [3]


def test_claim_arguments_send_an_epoch_per_row_when_a_batch_spans_two_epochs() -> None:
    """A batch may span a stream's recreation: then every row carries its own epoch."""
    args = claim_sql.claim_arguments(
        "s", "S", "processed", [1, 2], [b"a", b"b"], ["e1", "e2"], [1, 1], [None, None]
    )
    params = dict(zip(claim_sql.CLAIM_PARAMS, args, strict=True))
    assert (params["stream_epoch"], params["stream_epoch_each"]) == (None, ["e1", "e2"])
    assert (params["msg_id"], params["msg_id_each"]) == (None, [])


def test_a_batch_claim_refuses_messages_of_two_streams() -> None:
    """The claim sends the subscription and the stream once: a mixed batch is an error,
    never rows filed under the first message's stream."""
    msgs = [message(), dataclasses.replace(message(), stream="OTHER", seq=4)]
    with pytest.raises(ValueError, match="one subscription and stream"):
        transaction(FakeAsyncSession()).claim_arguments(msgs, models.OUTCOME_PROCESSED)


async def test_claim_is_false_when_the_insert_returns_nothing() -> None:
    assert await transaction(FakeAsyncSession()).claim(message(), "processed") is False


class FailingSession(FakeAsyncSession):
    """A session whose every statement fails with ``error``."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    async def execute(self, stmt: Any, params: dict[str, Any] | None = None) -> Any:
        raise self.error


@pytest.mark.parametrize(
    ("error", "raised"),
    [
        (DriverError("55P03", "canceling statement due to lock timeout"), errors.ClaimTimeout),
        (DriverError("54000", "index row size 5016 exceeds maximum"), errors.UnclaimableMessage),
        (DriverError("22021", "invalid byte sequence"), errors.UnclaimableMessage),
    ],
)
async def test_claim_raises_a_held_key_and_a_refused_row_in_eops_terms(
    error: Exception, raised: type[errors.EopError]
) -> None:
    """The edge translates: a lock timeout is ClaimTimeout, refused values UnclaimableMessage
    (naming the driver's error), each from the driver's error; the protocol needs no wrapper."""
    with pytest.raises(raised) as info:
        await transaction(FailingSession(error)).claim(message(), models.OUTCOME_PROCESSED)
    assert info.value.__cause__ is error
    if raised is errors.UnclaimableMessage:
        assert str(info.value).startswith("the inbox refuses this message's row: DriverError: ")


async def test_claim_raises_other_failures_and_a_batch_claims_failures_as_they_are() -> None:
    """A statement timeout in the claim stays the driver's (retried as infrastructure); a batch's
    claim translates nothing (the batch path reads the driver's error itself)."""
    timeout = DriverError("57014", "canceling statement due to statement timeout")
    with pytest.raises(DriverError) as info:
        await transaction(FailingSession(timeout)).claim(message(), models.OUTCOME_PROCESSED)
    assert info.value is timeout
    held = DriverError("55P03", "canceling statement due to lock timeout")
    with pytest.raises(DriverError) as info:
        await transaction(FailingSession(held)).claim_many([message()], "processed")
    assert info.value is held


async def test_claim_stores_key_fingerprint_outcome_and_msg_id() -> None:
    msg = message({"Nats-Msg-Id": "m-1"})
    row = transaction(FakeAsyncSession()).claim_row(msg, models.OUTCOME_DEAD_LETTERED)
    assert (row["subscription"], row["stream"], row["stream_epoch"], row["stream_seq"]) == (
        "orders",
        "ORDERS",
        "e1",
        3,
    )
    assert row["fingerprint"] == msg.fingerprint
    assert row["outcome"] == models.OUTCOME_DEAD_LETTERED
    assert row["msg_id"] == "m-1"
    assert row["delivery_count"] == 2


async def test_claim_without_msg_id_guard_stores_no_msg_id() -> None:
    tx = transaction(FakeAsyncSession(), msg_id_guard=False)
    assert tx.claim_row(message({"Nats-Msg-Id": "m-1"}), "x")["msg_id"] is None


async def test_find_reports_a_row_under_the_key_with_its_fingerprint() -> None:
    session = FakeAsyncSession(results=[[(b"fp", "processed")]])
    found = await transaction(session).find(message({"Nats-Msg-Id": "m-1"}))
    assert found == contract.Existing(by="key", fingerprint=b"fp", outcome="processed")


async def test_find_falls_back_to_the_msg_id() -> None:
    session = FakeAsyncSession(results=[[], [("ORDERS", "e1", 1, "processed")]])
    found = await transaction(session).find(message({"Nats-Msg-Id": "m-1"}))
    assert found == contract.Existing(by="msg_id", fingerprint=None, outcome="processed")


async def test_find_without_msg_id_guard_looks_under_the_key_only() -> None:
    session = FakeAsyncSession(results=[[], []])
    assert (
        await transaction(session, msg_id_guard=False).find(message({"Nats-Msg-Id": "m"})) is None
    )
    # The key, then the watermark; never the msg-id.
    assert len(session.executed) == 2
    assert "msg_id =" not in str(session.executed[1])


async def test_dead_letter_row_keeps_payload_and_error_and_redacts_headers() -> None:
    session = FakeAsyncSession()
    msg = message({"Authorization": "Bearer s3cr3t", "X-Api-Key": "k", "Nats-Msg-Id": "m-1"})
    dead = contract.DeadLetter(reason="rejected", error="Reject: no", traceback="Traceback ...")
    await transaction(session).add_dead_letter(msg, dead)
    row = {name.removeprefix("p_"): value for name, value in session.bound[0].items()}
    assert row["headers"] == {"Authorization": "***", "X-Api-Key": "***", "Nats-Msg-Id": "m-1"}
    assert (row["payload"], row["reason"], row["error"], row["traceback"]) == (
        b'{"id": 1}',
        "rejected",
        "Reject: no",
        "Traceback ...",
    )
    assert (row["subject"], row["stream_seq"], row["msg_id"]) == ("orders.new", 3, "m-1")


async def test_commit_marks_the_transaction_committed() -> None:
    tx = transaction(FakeAsyncSession())
    await tx.commit()
    assert tx.committed


@pytest.mark.parametrize(
    "error",
    [ConnectionResetError("reset"), wrapped(DriverError("08006")), DriverError("57P01")],
)
async def test_connection_lost_during_commit_is_an_ambiguous_commit(error: Exception) -> None:
    tx = transaction(FakeAsyncSession(commit_error=error))
    with pytest.raises(errors.AmbiguousCommit):
        await tx.commit()
    assert not tx.committed


@pytest.mark.parametrize("sqlstate", ["40001", "40P01"])
async def test_conflict_during_commit_is_a_transaction_conflict(sqlstate: str) -> None:
    with pytest.raises(errors.TransactionConflict):
        await transaction(FakeAsyncSession(commit_error=wrapped(DriverError(sqlstate)))).commit()


async def test_other_commit_errors_pass_through() -> None:
    error = DriverError("23505", "duplicate key")
    with pytest.raises(DriverError, match="duplicate key"):
        await transaction(FakeAsyncSession(commit_error=error)).commit()


async def test_rollback_never_raises() -> None:
    session = FakeAsyncSession()
    await transaction(session).rollback()
    assert session.calls == ["rollback"]


async def test_run_flushes_the_handlers_writes_so_their_errors_are_handler_errors() -> None:
    session = FakeAsyncSession()
    session.new.append(object())  # the handler session.add()-ed something
    await transaction(session).run(message())
    assert session.calls == ["handler", "flush"]


async def test_run_skips_the_flush_when_the_handler_left_nothing_pending() -> None:
    session = FakeAsyncSession()
    await transaction(session).run(message())
    assert session.calls == ["handler"]


async def test_connecting_error_becomes_database_unavailable() -> None:
    async def connect() -> None:
        raise ConnectionRefusedError("[Errno 111] Connect call failed\nmore detail")

    with pytest.raises(errors.DatabaseUnavailable, match="Connect call failed") as info:
        await failures.connected(connect())
    assert "more detail" not in str(info.value)


async def test_other_errors_while_connecting_pass_through() -> None:
    async def connect() -> None:
        raise DriverError("28P01", "password authentication failed")

    with pytest.raises(DriverError):
        await failures.connected(connect())


def test_loop_statements_are_built_once_and_take_their_values_as_parameters() -> None:
    """Compaction, the retry poll and every statement of a failure's or a retry's handling
    run per round or per message: each statement is one object per schema (its SQLAlchemy
    cache key computed once), the call's values passed beside it."""
    t = models.tables("eop")
    key = ("orders", "ORDERS", "e1", 7)
    failure = {
        "subscription": "orders",
        "stream": "ORDERS",
        "stream_epoch": "e1",
        "stream_seq": 7,
        "last_error": "boom",
        "parked": True,
        "due_in_s": 1.5,
        "subject": "orders.new",
        "headers": b"{}",
        "payload": b"orders-payload",
        "stored_at": None,
    }
    dead = {
        "subscription": "orders",
        "stream": "ORDERS",
        "stream_epoch": "e1",
        "stream_seq": 7,
        "fingerprint": b"f",
        "msg_id": None,
        "subject": "orders.new",
        "headers": {},
        "payload": b"orders-payload",
        "reason": "rejected",
        "error": "no",
        "traceback": None,
        "delivery_count": 1,
    }
    calls = [
        (retries_sql.take_due, ("orders", 5, 30.0)),
        (inbox_sql.advance_watermark, (*key[:3], 7, 250)),
        (inbox_sql.first_to_delete, (*key[:3], 7, 3600.0)),
        (inbox_sql.delete_below_watermark, (*key[:3], 7, 100, 3600.0)),
        (retries_sql.count_failure, (failure,)),
        (retries_sql.reschedule, (*key, 2.0)),
        (retries_sql.forget_failures, key),
        (retries_sql.lock_run, (*key, 3)),
        (retries_sql.settle_retrying, (*key, "processed")),
        (inbox_sql.unclaim, key),
        (inbox_sql.find_by_key, key),
        (inbox_sql.find_by_msg_id, ("orders", "m-1")),
        (inbox_sql.find_dead_letter, (*key, b"f")),
        (inbox_sql.insert_dead_letter, (dead,)),
    ]
    for make, args in calls:
        first, params = make(t, *args)
        again, _ = make(t, *args)
        assert first is again
        # Compiled as an execution compiles it, with the names of the values given: an
        # UPDATE refuses a parameter named as one of its columns.
        compiled = first.compile(dialect=postgresql.dialect(), column_keys=list(params))
        assert set(params) <= set(compiled.params)
        assert "orders" not in str(compiled)
