"""What several partitions ask of a handler, its stream and its server, and the refusals."""

from __future__ import annotations

import types

import pytest

import eop
from eop.handler import HandlerSpec
from eop.ordering import partitions


async def _handler(msg: eop.Message, session: object) -> None:
    return None


def _spec(
    subject: str = "ledger.*.step",
    order_by: str | None = "subject:1",
    *,
    partitions: int = 4,
    name: str = "ledger",
) -> HandlerSpec:
    return HandlerSpec(
        func=_handler,
        name=name,
        stream="LEDGER",
        subject=subject,
        durable=f"eop-{name}",
        order_by=order_by,
        partitions=partitions,
    )


def test_the_transform_hashes_the_key_token_and_puts_the_partition_in_front() -> None:
    """The key is the first `*` here, the second there; `>` passes through."""
    assert partitions.transform(_spec()) == (
        "ledger.*.step",
        "{{partition(4,1)}}.ledger.{{wildcard(1)}}.step",
    )
    assert partitions.transform(_spec("t.*.*.>", "subject:2")) == (
        "t.*.*.>",
        "{{partition(4,2)}}.t.{{wildcard(1)}}.{{wildcard(2)}}.>",
    )
    assert partitions.transform(_spec(partitions=1)) is None


@pytest.mark.parametrize(
    ("subject", "order_by", "partitions", "words"),
    [
        ("ledger.*.step", None, 2, "needs order_by"),
        ("ledger.*.step", "header:X-Account", 2, "token N"),
        ("ledger.acc.step", "subject:1", 2, "token N"),
        ("ledger.>", "subject:1", 2, "token N"),
        ("ledger.*.step", "subject:1", 0, "from 1 to 1024"),
    ],
)
def test_several_partitions_need_a_star_token_key(
    subject: str, order_by: str | None, partitions: int, words: str
) -> None:
    """Header keys, a literal token or one under `>` cannot be hashed by the stream: refused
    when the handler is declared, with what to do instead."""
    with pytest.raises(eop.ConfigurationError, match=words):
        _spec(subject, order_by, partitions=partitions)


def test_one_partition_takes_any_key() -> None:
    """partitions=1 (the default) asks nothing of the key or the stream."""
    spec = _spec("ledger.>", "header:X-Account", partitions=1)
    assert partitions.transform(spec) is None


def test_a_stream_without_the_transform_is_refused_with_the_transform_to_set() -> None:
    """The refusal names the exact src and dest to set, and the alternatives."""
    bare = types.SimpleNamespace(config=types.SimpleNamespace(subject_transform=None))
    with pytest.raises(eop.ConfigurationError) as refused:
        partitions.check_transform(bare, _spec())  # type: ignore[arg-type]
    text = str(refused.value)
    assert 'src "ledger.*.step"' in text
    assert 'dest "{{partition(4,1)}}.ledger.{{wildcard(1)}}.step"' in text
    assert "partitions=1" in text
    partitions.check_transform(_ledger_stream(4), _spec())  # type: ignore[arg-type]


def _ledger_stream(count: int) -> types.SimpleNamespace:
    """A stream's info whose transform spreads the ledger's keys over ``count`` partitions."""
    dest = f"{{{{partition({count},1)}}}}.ledger.{{{{wildcard(1)}}}}.step"
    return types.SimpleNamespace(
        config=types.SimpleNamespace(
            subject_transform=types.SimpleNamespace(src="ledger.*.step", dest=dest)
        )
    )


def test_a_changed_partition_count_is_refused_as_a_count_fixed_for_the_streams_life() -> None:
    """A stream made for another count of the same keys: the refusal names both counts and
    the way to change one, not a transform to set (which would strand the messages stored
    under the old count)."""
    with pytest.raises(eop.ConfigurationError) as refused:
        partitions.check_transform(_ledger_stream(8), _spec())  # type: ignore[arg-type]
    text = str(refused.value)
    assert "declares partitions=4" in text
    assert "over 8 partitions" in text
    assert "Keep partitions=8" in text
    assert "dest" not in text


def test_handlers_that_would_not_see_a_partitioned_streams_subjects_are_refused() -> None:
    """A stream has one transform: two partitioned handlers must agree, and another handler
    reading the rewritten subjects would never match them."""
    ledger = _spec()
    assert partitions.stream_transforms([ledger]) == {"LEDGER": partitions.transform(ledger)}
    other = _spec(partitions=8, name="other")
    with pytest.raises(eop.ConfigurationError, match="both spread their keys"):
        partitions.stream_transforms([ledger, other])
    reader = _spec("ledger.>", None, partitions=1, name="reader")
    with pytest.raises(eop.ConfigurationError, match="would never see them"):
        partitions.stream_transforms([ledger, reader])
    elsewhere = _spec("audit.>", None, partitions=1, name="audit")
    assert set(partitions.stream_transforms([ledger, elsewhere])) == {"LEDGER"}


def test_an_order_by_function_is_refused_with_what_to_give_instead() -> None:
    """A function of the message is the natural guess for ``order_by``: it is refused at
    registration with one clear line saying what it takes, not an AttributeError."""
    app = eop.App()

    with pytest.raises(eop.ConfigurationError, match="order_by must be 'subject:N'") as caught:

        @app.handler(
            stream="LEDGER",
            subject="ledger.>",
            name="ledger",
            order_by=lambda m: m.subject,  # type: ignore[arg-type]
        )
        async def ledger(msg: eop.Message, session: object) -> None:
            """Never registered."""

    assert "not function" in str(caught.value)
    assert "docs/ordering.md" in str(caught.value)
