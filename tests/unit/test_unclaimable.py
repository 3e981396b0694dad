"""A message whose inbox row the database refuses settles once, on its own (fakes)."""

from __future__ import annotations

import contextlib

import pytest

from eop import errors
from eop.pg import failures, models
from eop.types import Outcome

from .support import Harness, delivery


class DriverError(Exception):
    """A driver exception carrying a SQLSTATE."""

    def __init__(self, sqlstate: str, text: str = "driver error") -> None:
        super().__init__(text)
        self.sqlstate = sqlstate


def row_too_big() -> DriverError:
    return DriverError("54000", "index row size 5016 exceeds btree version 4 maximum 2704")


@pytest.mark.parametrize(
    ("exc", "refused"),
    [
        (DriverError("54000"), True),  # program_limit_exceeded: index row too large
        (DriverError("22021"), True),  # character_not_in_repertoire
        (DriverError("22P05"), True),  # untranslatable_character
        (DriverError("23502"), True),  # not_null_violation
        (UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"), True),
        (DriverError("57014"), False),  # query_canceled: a statement timeout
        (DriverError("55P03"), False),  # lock_not_available
        (DriverError("40001"), False),  # serialization_failure
        (DriverError("08006"), False),  # connection_failure
        (DriverError("42501"), False),  # insufficient_privilege: configuration
        (RuntimeError("bug"), False),
    ],
)
def test_refuses_values_only_for_errors_of_the_statements_values(
    exc: BaseException, refused: bool
) -> None:
    """Data, integrity and size errors are the values' fault; timeouts, locks, connections not."""
    assert failures.refuses_values(exc) is refused


def test_refuses_values_follows_the_cause_chain() -> None:
    """A refusal below the driver's wrapper counts."""
    outer = RuntimeError("wrapped")
    outer.__cause__ = row_too_big()
    assert failures.refuses_values(outer)


async def test_refused_claim_dead_letters_as_undecodable_keyed_without_its_msg_id(
    harness: Harness,
) -> None:
    """The handler never runs; one dead letter (keeping the msg-id); its row lacks the msg-id."""
    harness.store.fail_claims(1, row_too_big())
    d = delivery(b"x", seq=3, headers={"Nats-Msg-Id": "m" * 5000})
    assert await harness.handle(d) is Outcome.DEAD_LETTERED
    assert harness.calls == []
    [dead] = harness.store.dead_letters
    assert dead.reason == models.REASON_UNDECODABLE
    assert dead.error.startswith("the inbox refuses this message's row: DriverError: index row")
    assert dead.msg_id == "m" * 5000
    [row] = harness.store.inbox.values()
    assert (row.stream_seq, row.outcome, row.msg_id) == (3, models.OUTCOME_DEAD_LETTERED, None)
    assert (d.acked, d.naked, d.termed) == (False, False, True)


async def test_redelivery_of_a_refused_message_is_a_duplicate(harness: Harness) -> None:
    """Its row is keyed like any other: a redelivery finds it and is acked, not run."""
    harness.store.fail_claims(1, row_too_big())
    d = delivery(headers={"Nats-Msg-Id": "long"})
    await harness.handle(d)
    again = d.redeliver()
    assert await harness.handle(again) is Outcome.DUPLICATE
    assert again.acked
    assert harness.calls == []
    assert len(harness.store.dead_letters) == 1


async def test_row_refused_even_without_its_msg_id_is_left_to_the_worker(harness: Harness) -> None:
    """No outcome can be recorded: the error reaches the worker (which naks), no loop here."""
    harness.store.fail_claims(2, row_too_big())
    d = delivery(headers={"Nats-Msg-Id": "long"})
    with pytest.raises(errors.UnclaimableMessage):
        await harness.handle(d)
    assert harness.store.dead_letters == []
    assert harness.store.inbox == {}
    assert not d.termed


async def test_statement_timeout_in_the_claim_is_never_a_dead_letter(harness: Harness) -> None:
    """Infrastructure is not the message's fault: whatever else happens, it is not dead-lettered."""
    harness.store.fail_claims(1, DriverError("57014", "canceling statement due to timeout"))
    d = delivery(headers={"Nats-Msg-Id": "m-1"})
    with contextlib.suppress(Exception):
        await harness.handle(d)
    assert harness.store.dead_letters == []
    assert not d.termed
