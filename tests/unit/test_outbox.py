"""eop.outbox.add without a database: its checks, and the test kit's record of what was added."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import eop
from eop.outbox import outgoing
from eop.testing import MemoryStore


def test_outgoing_checks_subjects_headers_and_size_and_fixes_the_msg_id() -> None:
    """A message is checked when it is added: what NATS would refuse raises at once, and
    its msg-id is chosen once (the caller's, the header's, else a random one)."""
    good = outgoing.outgoing("A.b", "text", headers={"X-K": "v"})
    assert good.data == b"text"
    assert len(good.msg_id) == 32
    assert outgoing.outgoing("A.b", b"", headers={"Nats-Msg-Id": "m1"}).msg_id == "m1"
    assert outgoing.outgoing("A.b", b"", msg_id="m2").headers == {}
    with pytest.raises(eop.UnpublishableMessage, match="differ"):
        outgoing.outgoing("A.b", b"", msg_id="m", headers={"Nats-Msg-Id": "n"})
    with pytest.raises(eop.UnpublishableMessage, match="line breaks"):
        outgoing.outgoing("A.b", b"", msg_id="a\nb")
    for subject in ("", "A.", ".A", "A..B", "A.*", "A.>", "A B", "A\tB"):
        with pytest.raises(eop.UnpublishableMessage, match="subject"):
            outgoing.outgoing(subject, b"")
    with pytest.raises(eop.PayloadTooLarge, match="max_payload of 100"):
        outgoing.outgoing("A.b", b"x" * 60, headers={"H": "y" * 30}, max_payload=100)


def test_add_refuses_what_is_not_a_session() -> None:
    """Anything but a Session, an AsyncSession, an eop.Writes or a DB-API connection
    (something with cursor()) is a clear error."""
    with pytest.raises(eop.ConfigurationError, match="takes a SQLAlchemy Session"):
        eop.outbox.add(object(), "A.b", b"")  # type: ignore[arg-type]


def test_the_memory_store_records_outbox_messages_of_committed_transactions_only() -> None:
    """Under eop.testing's MemoryStore, a handler's eop.outbox.add is recorded in
    store.outbox when its transaction commits, and dropped when it rolls back."""
    store = MemoryStore()
    app = eop.App()

    @app.handler(stream="S", subject="S.x", name="h")
    async def h(msg: eop.Message, session: Any) -> None:
        eop.outbox.add(session, "T.y", msg.data, msg_id="fixed")

    spec = app.handlers["h"]

    async def main() -> None:
        async with store.transaction(spec) as tx:
            await tx.run(_message(b"kept"))
            await tx.commit()
        async with store.transaction(spec) as tx:
            await tx.run(_message(b"dropped"))
            await tx.rollback()

    asyncio.run(main())
    assert [(m.subject, m.data, m.msg_id) for m in store.outbox] == [("T.y", b"kept", "fixed")]


def _message(data: bytes) -> eop.Message:
    return eop.Message(
        subscription="h",
        subject="S.x",
        data=data,
        headers={},
        stream="S",
        stream_epoch="e",
        seq=1,
        num_delivered=1,
    )


def test_add_raises_the_error_settings_were_refused_with() -> None:
    """A Django project whose settings.EOP eop refused: adding an outbox row through a
    connection raises that error rather than send the row where the settings did not
    mean (the default schema)."""
    from eop.outbox import table

    class Cursorish:
        def cursor(self) -> Any:
            raise AssertionError("nothing is sent")

    before = list(table._configured)
    table.configure_default(eop.ConfigurationError("settings.EOP has an unknown key 'X'"))
    try:
        raised = []
        for _ in range(2):
            with pytest.raises(eop.ConfigurationError, match="unknown key 'X'") as info:
                eop.outbox.add(Cursorish(), "A.b", b"")
            raised.append(info.value)
        # A new exception each time: the stored one would gather every caller's frames.
        assert raised[0] is not raised[1]
    finally:
        table._configured[:] = before


def test_a_relay_refused_its_credentials_logs_as_the_worker_does() -> None:
    """NATS refusing the relay's credentials again and again is `nats.auth_refused` (with
    the refusals), as for a worker; a connection closed for good is `nats.closed`; the
    relay stops with the error either way."""
    from structlog.testing import capture_logs

    from eop import errors
    from eop.outbox import process

    app = eop.App(settings=eop.Settings())
    refused = process.RelayProcess(app)
    with capture_logs() as logs:
        refused.nats_lost(errors.NatsReauthenticationFailed("refused", refusals=3))
    assert [(e["event"], e["refusals"]) for e in logs] == [("nats.auth_refused", 3)]
    assert refused.draining
    closed = process.RelayProcess(app)
    with capture_logs() as logs:
        closed.nats_lost(errors.NatsUnavailable("closed"))
    assert [e["event"] for e in logs] == ["nats.closed"]
    assert isinstance(closed.lost, errors.NatsUnavailable)
