"""An ordered handler's subjects and consumer names as the operators' tools read them."""

from __future__ import annotations

import eop
from eop.handler import HandlerSpec
from eop.ordering import partitions


def _spec(count: int) -> HandlerSpec:
    app = eop.App()

    @app.handler(
        stream="LEDGER",
        subject="ledger.*.step",
        name="ledger",
        order_by="subject:1",
        partitions=count,
    )
    async def ledger(msg: eop.Message, session: object) -> None:
        pass

    return app.handlers["ledger"]


def test_partition_consumers_are_told_from_other_consumers_by_name() -> None:
    """`<durable>-p<N>-e<M>` is one of the handler's partition consumers; the durable
    itself, another handler's and look-alikes are not."""
    assert partitions.is_consumer_of("eop-ledger", "eop-ledger-p0-e1")
    assert partitions.is_consumer_of("eop-ledger", "eop-ledger-p12-e340")
    for name in (
        "eop-ledger",
        "eop-ledger2-p0-e1",
        "eop-ledger-p-e1",
        "eop-ledger-p0-e",
        "eop-ledger-px-e1",
        "eop-other-p0-e1",
    ):
        assert not partitions.is_consumer_of("eop-ledger", name), name


def test_the_stored_subject_goes_back_to_the_published_one() -> None:
    """The stream's transform puts the key's partition in front (FNV-1a of the key, as
    nats-server hashes it); `published` takes it off again; one partition stores the
    subject as published, and another transform or subject is left alone."""
    spec = _spec(4)
    transform = partitions.transform(spec)
    stored = partitions.stored_subject(transform, "ledger.acc1.step")
    head, _, rest = stored.partition(".")
    assert rest == "ledger.acc1.step"
    assert 0 <= int(head) < 4
    assert partitions.published(spec, stored) == (int(head), "ledger.acc1.step")
    assert partitions.published(spec, "ledger.acc1.step") == (None, "ledger.acc1.step")
    assert partitions.stored_subject(transform, "ledger.acc1.other") == "ledger.acc1.other"
    assert partitions.stored_subject(None, "ledger.acc1.step") == "ledger.acc1.step"
    assert partitions.stored_subject(("a.*", "{{wildcard(1)}}.a"), "a.b") == "a.b"
    one = _spec(1)
    assert partitions.transform(one) is None
    assert partitions.published(one, "ledger.acc1.step") == (0, "ledger.acc1.step")
    spread = {partitions.stored_subject(transform, f"ledger.acc{i}.step")[0] for i in range(40)}
    assert spread == {"0", "1", "2", "3"}
