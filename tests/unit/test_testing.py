"""The fakes eop ships for users' tests behave like the real thing."""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

import nats.errors
import pytest

from eop import errors, testing
from eop.handler import HandlerSpec
from eop.message import Message
from eop.pg import contract, failures, models


async def handler(message: Message, session: Any) -> None:
    session.add(("effect", message.seq))


def sync_handler(message: Message, session: Any) -> None:
    session.add_all([("a", message.seq), ("b", message.seq)])


def spec(*, msg_id_guard: bool = True, func: Any = handler, name: str = "orders") -> HandlerSpec:
    return HandlerSpec(
        func=func,
        name=name,
        stream="ORDERS",
        subject="orders.>",
        durable=f"eop-{name}",
        msg_id_guard=msg_id_guard,
    )


def message(
    seq: int = 1, data: bytes = b"x", msg_id: str | None = None, subscription: str = "orders"
) -> Message:
    return Message(
        subscription=subscription,
        subject="orders.new",
        data=data,
        headers={} if msg_id is None else {"Nats-Msg-Id": msg_id},
        stream="ORDERS",
        stream_epoch="e1",
        seq=seq,
        num_delivered=1,
    )


# -------------------------------------------------------------- FakeDelivery


def test_make_builds_jetstream_metadata() -> None:
    d = testing.FakeDelivery.make(
        data=b"{}", subject="orders.new", stream="ORDERS", seq=7, num_delivered=2
    )
    meta = d.metadata
    assert (meta.stream, meta.sequence.stream, meta.sequence.consumer) == ("ORDERS", 7, 7)
    assert (meta.num_delivered, meta.consumer) == (2, "eop-test")
    assert isinstance(meta.timestamp, datetime.datetime)
    assert (d.subject, d.data, d.headers) == ("orders.new", b"{}", None)
    assert d.reply.startswith("$JS.ACK.ORDERS.eop-test.2.7.7.")


async def test_ack_sync_records_the_ack() -> None:
    d = testing.FakeDelivery.make()
    assert await d.ack_sync() is d
    assert (d.acked, d.is_acked, d.ack_attempts) == (True, True, 1)


async def test_a_second_ack_raises_already_acked_like_nats_py() -> None:
    d = testing.FakeDelivery.make()
    await d.ack_sync()
    with pytest.raises(nats.errors.MsgAlreadyAckdError):
        await d.ack_sync()


@pytest.mark.parametrize("first", ["ack_sync", "nak", "term"])
@pytest.mark.parametrize("second", ["ack_sync", "nak", "term"])
async def test_a_settled_delivery_refuses_any_further_settling(first: str, second: str) -> None:
    d = testing.FakeDelivery.make()
    await getattr(d, first)()
    with pytest.raises(nats.errors.MsgAlreadyAckdError):
        await getattr(d, second)()


async def test_failed_acks_raise_then_succeed() -> None:
    d = testing.FakeDelivery.make().fail_acks(2)
    for _ in range(2):
        with pytest.raises(nats.errors.TimeoutError):
            await d.ack_sync()
    assert not d.acked
    await d.ack_sync()
    assert (d.acked, d.ack_attempts) == (True, 3)


async def test_fail_acks_takes_an_error_instance() -> None:
    error = nats.errors.NoRespondersError()
    d = testing.FakeDelivery.make().fail_acks(1, error)
    with pytest.raises(nats.errors.NoRespondersError) as info:
        await d.ack_sync()
    assert info.value is error


async def test_nak_records_its_delay() -> None:
    d = testing.FakeDelivery.make()
    await d.nak(delay=1.5)
    assert (d.naked, d.nak_delay, d.acked) == (True, 1.5, False)


async def test_in_progress_may_be_repeated_even_after_settling() -> None:
    d = testing.FakeDelivery.make()
    await d.in_progress()
    await d.ack_sync()
    await d.in_progress()
    assert d.in_progress_calls == 2


async def test_wait_for_in_progress_returns_once_the_count_is_reached() -> None:
    d = testing.FakeDelivery.make()
    waiter = asyncio.create_task(d.wait_for_in_progress(2))
    await d.in_progress()
    await asyncio.sleep(0)
    assert not waiter.done()
    await d.in_progress()
    await asyncio.wait_for(waiter, timeout=10)


def test_redeliver_is_the_next_delivery_of_the_same_message() -> None:
    d = testing.FakeDelivery.make(data=b"x", seq=4, headers={"Nats-Msg-Id": "m"})
    again = d.redeliver()
    assert (again.data, again.headers, again.metadata.sequence.stream) == (
        b"x",
        {"Nats-Msg-Id": "m"},
        4,
    )
    assert again.metadata.num_delivered == 2
    assert again.metadata.sequence.consumer == d.metadata.sequence.consumer + 1
    assert not again.is_acked


# --------------------------------------------------------------- FakeEpochs


async def test_epochs_default_and_configured() -> None:
    epochs = testing.FakeEpochs({"ORDERS": "e1"}, default="d")
    assert await epochs.get("ORDERS") == "e1"
    assert await epochs.get("OTHER") == "d"


async def test_epochs_are_cached_until_refreshed() -> None:
    epochs = testing.FakeEpochs({"ORDERS": "e1"})
    await epochs.get("ORDERS")
    epochs.set("ORDERS", "e2")
    assert await epochs.get("ORDERS") == "e1"
    assert await epochs.refresh("ORDERS") == "e2"
    assert await epochs.get("ORDERS") == "e2"
    assert epochs.refreshes == 1


# -------------------------------------------------------------- MemoryStore


async def test_claim_is_visible_to_others_only_after_commit() -> None:
    store = testing.MemoryStore()
    async with store.transaction(spec()) as tx:
        assert await tx.claim(message(), models.OUTCOME_PROCESSED)
        assert store.inbox == {}
        assert not await store.has_outcome(spec(), message())
        await tx.commit()
    assert store.outcome_of(message()) == models.OUTCOME_PROCESSED
    assert await store.has_outcome(spec(), message())


async def test_rollback_discards_claim_effects_and_dead_letters() -> None:
    store = testing.MemoryStore()
    async with store.transaction(spec()) as tx:
        await tx.claim(message(), models.OUTCOME_PROCESSED)
        await tx.run(message())
        await tx.add_dead_letter(message(), contract.DeadLetter(reason="r", error="e"))
        await tx.rollback()
    assert (store.inbox, store.effects, store.dead_letters) == ({}, [], [])


async def test_leaving_the_transaction_without_commit_rolls_back() -> None:
    store = testing.MemoryStore()
    async with store.transaction(spec()) as tx:
        await tx.claim(message(), models.OUTCOME_PROCESSED)
        await tx.run(message())
    assert (store.inbox, store.effects) == ({}, [])
    async with store.transaction(spec()) as tx:
        assert await tx.claim(message(), models.OUTCOME_PROCESSED)


async def test_committed_effects_come_from_the_session() -> None:
    store = testing.MemoryStore()
    async with store.transaction(spec(func=sync_handler)) as tx:
        await tx.claim(message(seq=3), models.OUTCOME_PROCESSED)
        await tx.run(message(seq=3))
        await tx.commit()
    assert store.effects == [("a", 3), ("b", 3)]
    assert store.commits == 1


async def test_a_taken_key_cannot_be_claimed() -> None:
    store = testing.MemoryStore()
    store.record(message())
    async with store.transaction(spec()) as tx:
        assert not await tx.claim(message(data=b"other"), models.OUTCOME_PROCESSED)
        found = await tx.find(message(data=b"other"))
    assert found == contract.Existing(
        by="key", fingerprint=message().fingerprint, outcome="processed"
    )


async def test_a_taken_msg_id_cannot_be_claimed_with_the_guard() -> None:
    store = testing.MemoryStore()
    store.record(message(seq=1, msg_id="m"))
    async with store.transaction(spec()) as tx:
        assert not await tx.claim(message(seq=2, msg_id="m"), models.OUTCOME_PROCESSED)
        found = await tx.find(message(seq=2, msg_id="m"))
    assert found == contract.Existing(by="msg_id", fingerprint=None, outcome="processed")


async def test_msg_id_guard_off_ignores_msg_ids() -> None:
    store = testing.MemoryStore()
    store.record(message(seq=1, msg_id="m"))
    async with store.transaction(spec(msg_id_guard=False)) as tx:
        assert await tx.find(message(seq=2, msg_id="m")) is None
        assert await tx.claim(message(seq=2, msg_id="m"), models.OUTCOME_PROCESSED)
        await tx.commit()
    assert store.inbox[("orders", "ORDERS", "e1", 2)].msg_id is None


async def test_msg_ids_are_per_subscription() -> None:
    store = testing.MemoryStore()
    store.record(message(seq=1, msg_id="m"))
    async with store.transaction(spec(name="billing")) as tx:
        assert await tx.claim(message(seq=1, msg_id="m", subscription="billing"), "processed")


async def test_a_second_claim_in_the_same_transaction_is_refused() -> None:
    store = testing.MemoryStore()
    async with store.transaction(spec()) as tx:
        assert await tx.claim(message(), models.OUTCOME_PROCESSED)
        assert not await tx.claim(message(), models.OUTCOME_PROCESSED)
        assert (await tx.find(message())) is not None


async def test_a_concurrent_claim_waits_and_is_refused_once_the_holder_commits() -> None:
    store = testing.MemoryStore()
    async with store.transaction(spec()) as first:
        await first.claim(message(), models.OUTCOME_PROCESSED)
        async with store.transaction(spec()) as second:
            waiting = asyncio.create_task(second.claim(message(), models.OUTCOME_PROCESSED))
            await asyncio.sleep(0)
            assert not waiting.done()
            await first.commit()
            assert await waiting is False


async def test_a_concurrent_claim_waits_and_succeeds_once_the_holder_rolls_back() -> None:
    store = testing.MemoryStore()
    async with store.transaction(spec()) as first:
        await first.claim(message(), models.OUTCOME_PROCESSED)
        async with store.transaction(spec()) as second:
            waiting = asyncio.create_task(second.claim(message(), models.OUTCOME_PROCESSED))
            await asyncio.sleep(0)
            await first.rollback()
            assert await waiting is True


async def test_a_concurrent_claim_times_out_with_a_claim_timeout() -> None:
    """As the real store's claim: the lock timeout (sqlstate 55P03) is raised as ClaimTimeout."""
    store = testing.MemoryStore(lock_timeout_s=0.01)
    async with store.transaction(spec()) as first:
        await first.claim(message(), models.OUTCOME_PROCESSED)
        async with store.transaction(spec()) as second:
            with pytest.raises(errors.ClaimTimeout) as info:
                await second.claim(message(), models.OUTCOME_PROCESSED)
    assert isinstance(info.value.__cause__, testing.LockNotAvailable)
    assert failures.classify(info.value.__cause__) is failures.DbFailure.LOCK_TIMEOUT


async def test_the_turn_is_held_until_its_transaction_ends_across_handlers() -> None:
    """As the real store's advisory lock: a contended transaction of another handler waits
    for the turn until the holder commits; taking it twice in one transaction does not wait."""
    store = testing.MemoryStore()
    async with store.transaction(spec()) as first:
        await first.take_turn()
        await first.take_turn()
        async with store.transaction(spec(name="payments")) as second:
            waiting = asyncio.create_task(second.take_turn())
            await asyncio.sleep(0)
            assert not waiting.done()
            await first.commit()
            await waiting
            async with store.transaction(spec()) as third:
                waiting = asyncio.create_task(third.take_turn())
                await asyncio.sleep(0)
                assert not waiting.done()
                await second.rollback()
                await waiting


async def test_a_wait_for_the_turn_past_the_lock_timeout_raises_lock_not_available() -> None:
    """Bounded by the store's lock timeout, as the real wait is; eop retries that failure."""
    store = testing.MemoryStore(lock_timeout_s=0.01)
    async with store.transaction(spec()) as holder:
        await holder.take_turn()
        async with store.transaction(spec()) as tx:
            with pytest.raises(testing.LockNotAvailable) as info:
                await tx.take_turn()
    assert failures.classify(info.value) is failures.DbFailure.LOCK_TIMEOUT
    async with store.transaction(spec()) as after:
        await after.take_turn()  # the holder's scope ended: the turn is free


async def test_claim_many_claims_in_one_go_skipping_taken_keys_and_msg_ids() -> None:
    """Like INSERT ... ON CONFLICT DO NOTHING: a committed key, a committed msg-id and a
    msg-id repeated by an earlier row of the same batch are skipped, the rest claimed."""
    store = testing.MemoryStore()
    store.record(message(seq=2))
    store.record(message(seq=9, msg_id="taken"))
    batch = [
        message(seq=1, msg_id="a"),
        message(seq=2),
        message(seq=3, msg_id="taken"),
        message(seq=4, msg_id="a"),
        message(seq=5),
    ]
    async with store.transaction(spec()) as tx:
        assert await tx.claim_many(batch, models.OUTCOME_PROCESSED) == {1, 5}
        await tx.commit()
    assert sorted(k[3] for k in store.inbox) == [1, 2, 5, 9]


async def test_claim_many_that_times_out_on_a_held_key_claims_nothing() -> None:
    """A failed statement leaves none of its rows, even those it inserted before waiting."""
    store = testing.MemoryStore(lock_timeout_s=0.01)
    async with store.transaction(spec()) as holder:
        await holder.claim(message(seq=2), models.OUTCOME_PROCESSED)
        async with store.transaction(spec()) as tx:
            with pytest.raises(testing.LockNotAvailable):
                await tx.claim_many([message(seq=1), message(seq=2)], models.OUTCOME_PROCESSED)
            assert await tx.find(message(seq=1)) is None


async def test_unclaim_drops_the_row_but_keeps_the_key_locked_until_the_end() -> None:
    """As a row inserted and deleted by an open PostgreSQL transaction: a concurrent claim
    waits for that transaction, then finds the key free."""
    store = testing.MemoryStore()
    async with store.transaction(spec()) as first:
        await first.claim_many([message(seq=1), message(seq=2)], models.OUTCOME_PROCESSED)
        await first.unclaim(message(seq=1))
        assert await first.find(message(seq=1)) is None
        async with store.transaction(spec()) as second:
            waiting = asyncio.create_task(second.claim(message(seq=1), models.OUTCOME_PROCESSED))
            await asyncio.sleep(0)
            assert not waiting.done()
            await first.commit()
            assert await waiting is True
    assert sorted(k[3] for k in store.inbox) == [2]


async def test_run_isolated_rolls_back_a_failing_handlers_writes_alone_and_returns_its_error() -> (
    None
):
    async def fails_on_2(msg: Message, session: Any) -> None:
        session.add(("effect", msg.seq))
        if msg.seq == 2:
            raise ValueError("boom")

    store = testing.MemoryStore()
    async with store.transaction(spec(func=fails_on_2)) as tx:
        assert await tx.run_isolated([message(seq=1)]) is None
        error = await tx.run_isolated([message(seq=2)])
        assert isinstance(error, ValueError)
        assert await tx.run_isolated([message(seq=3)]) is None
        await tx.commit()
    assert store.effects == [("effect", 1), ("effect", 3)]


async def test_run_isolated_raises_a_failure_of_the_database() -> None:
    class StatementTimeout(Exception):
        sqlstate = "57014"

    async def times_out(msg: Message, session: Any) -> None:
        raise StatementTimeout()

    store = testing.MemoryStore()
    async with store.transaction(spec(func=times_out)) as tx:
        with pytest.raises(StatementTimeout):
            await tx.run_isolated([message()])


async def test_run_many_calls_a_batch_handler_with_the_list() -> None:
    seen: list[list[int]] = []

    async def batch_handler(msgs: list[Message], session: Any) -> None:
        seen.append([m.seq for m in msgs])

    batch_spec = HandlerSpec(
        func=batch_handler,
        name="orders",
        stream="ORDERS",
        subject="orders.>",
        durable="eop-orders",
        batch=True,
    )
    async with testing.MemoryStore().transaction(batch_spec) as tx:
        await tx.run_many([message(seq=1), message(seq=2)], flush=False)
        await tx.flush()
    assert seen == [[1, 2]]


async def test_dead_letters_are_unique_per_key_and_fingerprint() -> None:
    store = testing.MemoryStore()
    dead = contract.DeadLetter(reason="rejected", error="e")
    for data in (b"x", b"x", b"y"):
        async with store.transaction(spec()) as tx:
            await tx.add_dead_letter(message(data=data), dead)
            await tx.commit()
    assert [d.payload for d in store.dead_letters] == [b"x", b"y"]


async def test_has_outcome_ignores_msg_id_matches() -> None:
    store = testing.MemoryStore()
    store.record(message(seq=1, msg_id="m"))
    assert not await store.has_outcome(spec(), message(seq=2, msg_id="m"))


async def test_a_finished_transaction_refuses_more_statements() -> None:
    store = testing.MemoryStore()
    async with store.transaction(spec()) as tx:
        await tx.commit()
        with pytest.raises(RuntimeError, match="already committed or rolled back"):
            await tx.claim(message(), models.OUTCOME_PROCESSED)


# ------------------------------------------------------------------- knobs


async def test_fail_transactions_raises_database_unavailable_n_times() -> None:
    store = testing.MemoryStore().fail_transactions(2)
    for _ in range(2):
        with pytest.raises(errors.DatabaseUnavailable):
            async with store.transaction(spec()):
                pass
    async with store.transaction(spec()):
        pass
    assert store.transactions == 1


async def test_lock_timeout_claims_raise_a_claim_timeout() -> None:
    """The claim raises ClaimTimeout from a lock timeout, then claims; a batch's claim
    raises the lock timeout itself, as the real store's does."""
    store = testing.MemoryStore().lock_timeout_claims(2)
    async with store.transaction(spec()) as tx:
        with pytest.raises(errors.ClaimTimeout) as info:
            await tx.claim(message(), models.OUTCOME_PROCESSED)
        with pytest.raises(testing.LockNotAvailable):
            await tx.claim_many([message()], models.OUTCOME_PROCESSED)
        assert await tx.claim(message(), models.OUTCOME_PROCESSED)
    assert info.value.__cause__ is not None
    assert failures.classify(info.value.__cause__) is failures.DbFailure.LOCK_TIMEOUT


async def test_conflict_commits_roll_back_and_raise_transaction_conflict() -> None:
    store = testing.MemoryStore().conflict_commits(1)
    async with store.transaction(spec()) as tx:
        await tx.claim(message(), models.OUTCOME_PROCESSED)
        await tx.run(message())
        with pytest.raises(errors.TransactionConflict):
            await tx.commit()
    assert (store.inbox, store.effects, store.commits) == ({}, [], 0)


@pytest.mark.parametrize("committed", [True, False])
async def test_ambiguous_commit_raises_and_did_or_did_not_commit(committed: bool) -> None:
    store = testing.MemoryStore().ambiguous_commit(committed=committed)
    async with store.transaction(spec()) as tx:
        await tx.claim(message(), models.OUTCOME_PROCESSED)
        await tx.run(message())
        with pytest.raises(errors.AmbiguousCommit):
            await tx.commit()
    assert await store.has_outcome(spec(), message()) is committed
    assert len(store.effects) == int(committed)


async def test_fail_has_outcome_raises_n_times() -> None:
    store = testing.MemoryStore().fail_has_outcome(1)
    with pytest.raises(errors.DatabaseUnavailable):
        await store.has_outcome(spec(), message())
    assert await store.has_outcome(spec(), message()) is False


async def test_paused_commits_wait_for_resume() -> None:
    store = testing.MemoryStore().pause_commits()
    async with store.transaction(spec()) as tx:
        await tx.claim(message(), models.OUTCOME_PROCESSED)
        commit = asyncio.create_task(tx.commit())
        await store.commit_started.wait()
        assert store.inbox == {}
        store.resume_commits()
        await commit
    assert store.outcome_of(message()) == models.OUTCOME_PROCESSED


async def test_closing_a_transaction_under_its_commit_is_reported_as_misuse() -> None:
    store = testing.MemoryStore().pause_commits()
    commit: asyncio.Task[None] | None = None
    async with store.transaction(spec()) as tx:
        await tx.claim(message(), models.OUTCOME_PROCESSED)
        commit = asyncio.create_task(tx.commit())
        await store.commit_started.wait()
    assert store.misuse
    store.resume_commits()
    await commit


def test_lock_not_available_carries_sqlstate_55p03() -> None:
    assert testing.LockNotAvailable().sqlstate == "55P03"
    assert failures.classify(testing.LockNotAvailable()) is failures.DbFailure.LOCK_TIMEOUT


async def test_plain_ack_records_the_ack() -> None:
    d = testing.FakeDelivery.make()
    await d.ack()
    assert d.acked


async def test_session_flush_works_awaited_or_not() -> None:
    session = testing.FakeSession()
    session.flush()
    await session.flush()
    assert session.flushes == 2
