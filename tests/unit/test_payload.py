"""Typed payloads: what a handler's annotation makes eop pass it, and what it rejects."""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import uuid
from collections.abc import Sequence
from typing import Any, Literal, Optional

import pydantic
import pytest
from typing_extensions import TypedDict

import eop
from eop import errors, payload, testing
from eop.handler import HandlerSpec
from eop.pg import models
from eop.protocol import processor
from eop.types import Outcome

from .support import FAST, STREAM, delivery

# Module level: annotations are strings here (PEP 563) and resolve in this namespace.


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclasses.dataclass(frozen=True)
class Line:
    sku: str
    qty: int
    price: decimal.Decimal | None = None


@dataclasses.dataclass(frozen=True)
class Address:
    city: str
    zip: Optional[str] = None  # noqa: UP045  # the typing spelling must work too


@dataclasses.dataclass
class Order:
    id: int
    lines: list[Line]
    ship_to: Address | None = None
    colour: Colour = Colour.RED
    kind: Literal["retail", "wholesale"] = "retail"
    tags: tuple[str, ...] = ()
    attrs: dict[str, Any] = dataclasses.field(default_factory=dict)
    at: datetime.datetime | None = None
    ref: uuid.UUID | None = None
    weight: float = 0.0

    def __post_init__(self) -> None:
        if self.id < 0:
            raise ValueError("id must not be negative")


@dataclasses.dataclass
class Tree:
    name: str
    children: list[Tree] = dataclasses.field(default_factory=list)


class Payment(pydantic.BaseModel):
    id: int
    amount: decimal.Decimal
    note: str | None = None


class Opaque:
    """A class pydantic has no schema for."""


@dataclasses.dataclass
class Unsupported:
    when: Opaque


class Shipment(TypedDict):
    id: int
    to: Address


def message(data: bytes, seq: int = 1) -> eop.Message:
    return eop.Message(
        subscription="h",
        subject="orders.new",
        data=data,
        headers={},
        stream=STREAM,
        stream_epoch="e1",
        seq=seq,
        num_delivered=1,
    )


def binding(func: Any, *, batch: bool = False) -> payload.Binding:
    bound = payload.bind(func, batch=batch, handler="h")
    assert bound is not None
    return bound


def decode(func: Any, data: bytes) -> Any:
    return binding(func).arguments([message(data)])[0]


# -- what the annotation selects


async def raw(msg: eop.Message, session: Any) -> None: ...


async def unannotated(msg, session):  # type: ignore[no-untyped-def]
    ...


async def typed(order: Order, session: Any) -> None: ...


async def typed_with_message(order: Order, session: Any, msg: eop.Message) -> None: ...


async def batch_typed(orders: list[Order], session: Any, msgs: list[eop.Message]) -> None: ...


async def batch_raw(msgs: list[eop.Message], session: Any) -> None: ...


async def by_pydantic(payment: Payment, session: Any) -> None: ...


@pytest.mark.parametrize("func", [raw, unannotated], ids=["Message", "none"])
def test_raw_handlers_bind_to_nothing_so_they_pay_nothing_per_message(func: Any) -> None:
    assert payload.bind(func, batch=False, handler="h") is None


def test_batch_handler_of_raw_messages_binds_to_nothing() -> None:
    assert payload.bind(batch_raw, batch=True, handler="h") is None


def test_the_handler_spec_resolves_its_binding_at_registration() -> None:
    app = eop.App(database_url="postgresql+asyncpg://x/y")
    app.handler(stream="S", subject="s", name="typed")(typed)
    app.handler(stream="S", subject="s", name="raw")(raw)
    assert app.handlers["typed"].payload is not None
    assert app.handlers["raw"].payload is None


def test_dataclass_payload_decodes_nested_optional_enum_literal_and_scalars() -> None:
    data = (
        b'{"id": 7, "lines": [{"sku": "a", "qty": 2, "price": "1.50"}, {"sku": "b", "qty": 1}],'
        b' "ship_to": {"city": "Oslo"}, "colour": "blue", "kind": "wholesale", "tags": ["x"],'
        b' "attrs": {"k": [1]}, "at": "2024-05-01T10:00:00+00:00",'
        b' "ref": "12345678-1234-5678-1234-567812345678", "weight": 3, "unknown": 1}'
    )
    order = decode(typed, data)
    assert order == Order(
        id=7,
        lines=[Line("a", 2, decimal.Decimal("1.50")), Line("b", 1)],
        ship_to=Address("Oslo"),
        colour=Colour.BLUE,
        kind="wholesale",
        tags=("x",),
        attrs={"k": [1]},
        at=datetime.datetime(2024, 5, 1, 10, tzinfo=datetime.timezone.utc),
        ref=uuid.UUID("12345678-1234-5678-1234-567812345678"),
        weight=3.0,
    )
    assert isinstance(order.weight, float)


def test_recursive_dataclasses_decode() -> None:
    async def tree(t: Tree, session: Any) -> None: ...

    assert decode(tree, b'{"name": "a", "children": [{"name": "b"}]}') == Tree("a", [Tree("b")])


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"{", "payload is not valid JSON: EOF while parsing"),
        (b"\xff\xfe\x00", "not valid JSON"),
        (b"[]", "(root): Input should be an object"),
        (b'{"lines": []}', "id: Field required"),
        (b'{"id": "7", "lines": []}', "id: Input should be a valid integer"),
        (b'{"id": true, "lines": []}', "id: Input should be a valid integer"),
        (b'{"id": 1, "lines": [{"sku": "a"}]}', "lines[0].qty: Field required"),
        (b'{"id": 1, "lines": [], "ship_to": {"city": 5}}', "ship_to.city"),
        (b'{"id": 1, "lines": [], "colour": "green"}', "colour: Input should be 'red' or 'blue'"),
        (b'{"id": 1, "lines": [], "kind": "x"}', "kind: Input should be 'retail' or 'wholesale'"),
        (b'{"id": 1, "lines": [], "at": "yesterday"}', "at: Input should be a valid datetime"),
        (b'{"id": -1, "lines": []}', "id must not be negative"),
        (b'{"id": 1' + b"0" * 5000 + b', "lines": []}', "not valid JSON"),
        (b"[" * 5000 + b"]" * 5000, "not valid JSON"),
    ],
)
def test_invalid_payloads_raise_undecodable_with_the_field_and_the_problem(
    data: bytes, problem: str
) -> None:
    with pytest.raises(errors.UndecodableMessage) as caught:
        decode(typed, data)
    assert problem in str(caught.value)


@pytest.mark.parametrize(
    ("func", "data"),
    [
        ("typed", b'{"id": "s3cret-value", "lines": []}'),
        ("typed", b'{"id": 1, "lines": [{"sku": "a", "qty": "s3cret"}]}'),
        ("typed", b'{"id": 1, "lines": [], "kind": "s3cret", "colour": "s3cret"}'),
        ("typed", b'{"id": 1, "lines": [], "at": "s3cret", "ref": "s3cret"}'),
        ("by_pydantic", b'{"id": "s3cret-value", "amount": 1}'),
        ("by_pydantic", b'{"id": 1, "amount": "s3cret"}'),
        ("tagged", b'{"shape": {"kind": "s3cret"}}'),
        ("tagged", b'{"shape": {"kind": "circle", "r": "s3cret"}}'),
        ("shipment", b'{"id": 1, "to": {"city": ["s3cret"]}}'),
    ],
)
def test_validation_errors_never_quote_the_payload(func: str, data: bytes) -> None:
    """A dead letter's reason goes to logs: it names fields and types, not values.

    pydantic's own error text quotes them (``input_value=...``); eop's does not.
    """
    with pytest.raises(errors.UndecodableMessage) as caught:
        decode(globals()[func], data)
    assert "s3cret" not in str(caught.value)
    assert "input_value" not in str(caught.value)


def test_a_validation_error_reports_ten_problems_and_counts_the_rest() -> None:
    lines = ",".join('{"sku": 1, "qty": "x"}' for _ in range(8)).encode()
    with pytest.raises(errors.UndecodableMessage) as caught:
        decode(typed, b'{"id": 1, "lines": [' + lines + b"]}")
    assert str(caught.value).count(": Input should be") == 10
    assert str(caught.value).endswith("; and 6 more")


class Circle(pydantic.BaseModel):
    kind: Literal["circle"]
    r: float


class Square(pydantic.BaseModel):
    kind: Literal["square"]
    side: float


class Drawing(pydantic.BaseModel):
    shape: Circle | Square = pydantic.Field(discriminator="kind")


async def tagged(d: Drawing, session: Any) -> None: ...


async def shipment(s: Shipment, session: Any) -> None: ...


def test_typeddict_payloads_decode_strictly_into_a_dict() -> None:
    assert decode(shipment, b'{"id": 1, "to": {"city": "Oslo"}, "x": 0}') == {
        "id": 1,
        "to": Address("Oslo"),
    }
    with pytest.raises(errors.UndecodableMessage, match="id: Input should be a valid integer"):
        decode(shipment, b'{"id": "1", "to": {"city": "Oslo"}}')


def test_pydantic_models_validate_the_json_payload() -> None:
    payment = decode(by_pydantic, b'{"id": 1, "amount": "2.5"}')
    assert payment == Payment(id=1, amount=decimal.Decimal("2.5"))


def test_pydantic_validation_error_lists_each_field() -> None:
    with pytest.raises(errors.UndecodableMessage) as caught:
        decode(by_pydantic, b'{"amount": "lots"}')
    text = str(caught.value)
    assert text.startswith("payload does not validate as Payment:")
    assert "id: Field required" in text
    assert "amount:" in text


def test_pydantic_dataclasses_are_validated_by_pydantic() -> None:
    assert decode(pydantic_dc, b'{"n": "3"}') == PydanticDC(n=3)


@pydantic.dataclasses.dataclass
class PydanticDC:
    n: int


async def pydantic_dc(x: PydanticDC, session: Any) -> None: ...


def test_a_parameter_annotated_message_receives_the_raw_message() -> None:
    msg = message(b'{"id": 1, "lines": []}')
    value, extra = binding(typed_with_message).arguments([msg])
    assert value == Order(id=1, lines=[])
    assert extra == {"msg": msg}


def test_batch_handlers_get_a_list_of_models_and_of_messages() -> None:
    msgs = [message(b'{"id": 1, "lines": []}', 1), message(b'{"id": 2, "lines": []}', 2)]
    value, extra = binding(batch_typed, batch=True).arguments(msgs)
    assert value == [Order(id=1, lines=[]), Order(id=2, lines=[])]
    assert extra == {"msgs": msgs}


def test_sequence_annotations_work_for_batches() -> None:
    async def seq(orders: Sequence[Order], session: Any) -> None: ...

    assert binding(seq, batch=True).batch


# -- rejected at registration, with the fix


async def wants_int(n: int, session: Any) -> None: ...


async def wants_dict(d: dict[str, Any], session: Any) -> None: ...


async def bad_field(x: Unsupported, session: Any) -> None: ...


async def extra_required(order: Order, session: Any, other: int) -> None: ...


async def wrong_message_kind(orders: list[Order], session: Any, msg: eop.Message) -> None: ...


async def undefined_name(order: NotDefinedAnywhere, session: Any) -> None:  # type: ignore[name-defined]  # noqa: F821
    ...


@pytest.mark.parametrize(
    ("func", "batch", "problem"),
    [
        (wants_int, False, "unsupported annotation int"),
        (wants_dict, False, "unsupported annotation dict[str, Any]"),
        (bad_field, False, "cannot decode JSON into Unsupported: Unable to generate"),
        (typed, True, "a batch handler gets a list: annotate it list[Order]"),
        (batch_typed, False, "list[Order] needs batch=True"),
        (batch_raw, False, "without batch=True gets one message"),
        (extra_required, False, "give this one a default"),
        (wrong_message_kind, True, "annotate it list[eop.Message]"),
        (undefined_name, False, "cannot resolve its annotation 'NotDefinedAnywhere'"),
    ],
)
def test_unsupported_annotations_fail_at_registration_with_the_fix(
    func: Any, batch: bool, problem: str
) -> None:
    app = eop.App(database_url="postgresql+asyncpg://x/y")
    with pytest.raises(errors.ConfigurationError) as caught:
        app.handler(stream="S", subject="s", name="h", batch=batch)(func)
    assert problem in str(caught.value)
    assert "handler 'h'" in str(caught.value)


async def raw_one_parameter(msg: eop.Message) -> None: ...


async def raw_extra_required(msg: eop.Message, session: Any, extra: int) -> None: ...


async def raw_keyword_required(msg: eop.Message, session: Any, *, extra: int) -> None: ...


def sync_unannotated_extra(msg, session, extra):  # type: ignore[no-untyped-def]
    ...


async def raw_extra_defaulted(msg: eop.Message, session: Any, extra: int = 1) -> None: ...


async def raw_catch_all(msg: eop.Message, session: Any, *more: Any, **named: Any) -> None: ...


@pytest.mark.parametrize(
    ("func", "problem"),
    [
        (raw_one_parameter, "too many positional arguments"),
        (raw_extra_required, "missing a required argument: 'extra'"),
        (raw_keyword_required, "missing a required argument: 'extra'"),
        (sync_unannotated_extra, "missing a required argument: 'extra'"),
    ],
)
def test_a_raw_message_handler_eop_cannot_call_fails_at_registration(
    func: Any, problem: str
) -> None:
    """A handler of raw messages is called with the message and the session, like any: one
    that needs another argument (or takes one) is refused in one line at registration.
    It was accepted, then failed every message until each was dead-lettered."""
    app = eop.App(database_url="postgresql+asyncpg://x/y")
    with pytest.raises(errors.ConfigurationError) as caught:
        app.handler(stream="S", subject="s", name="h")(func)
    text = str(caught.value)
    assert "handler 'h' cannot be called as eop calls it" in text
    assert problem in text
    assert "give any other a default" in text
    for fine in (raw_extra_defaulted, raw_catch_all):
        app.handler(stream="S", subject="s", name=fine.__name__.replace("_", "-"))(fine)


def test_a_pydantic_v1_model_is_rejected_at_registration() -> None:
    import pydantic.v1

    class Old(pydantic.v1.BaseModel):
        n: int

    async def old(o: Old, session: Any) -> None: ...

    old.__annotations__ = {"o": Old, "session": Any}
    with pytest.raises(errors.ConfigurationError, match="pydantic v1 model: eop needs v2"):
        payload.bind(old, batch=False, handler="h")


# -- through the protocol


async def test_invalid_typed_payload_is_dead_lettered_at_the_first_delivery() -> None:
    """Never retried: the validation error is the dead letter's reason, the handler never runs."""
    calls: list[Order] = []

    async def handle(order: Order, session: Any) -> None:
        calls.append(order)

    handle.__annotations__ = {"order": Order, "session": Any}
    spec = HandlerSpec(func=handle, name="h", stream=STREAM, subject="orders.>", durable="d")
    store = testing.MemoryStore()
    proc = processor.Processor(
        spec=spec, settings=FAST, store=store, epochs=testing.FakeEpochs({STREAM: "e1"})
    )
    good, bad = delivery(b'{"id": 1, "lines": []}', seq=1), delivery(b'{"id": "x"}', seq=2)
    assert await proc.handle(good, proc.clock()) is Outcome.PROCESSED
    assert await proc.handle(bad, proc.clock()) is Outcome.DEAD_LETTERED
    assert calls == [Order(id=1, lines=[])]
    [dead] = store.dead_letters
    assert dead.reason == models.REASON_UNDECODABLE
    assert "id: Input should be a valid integer" in dead.error
    assert dead.payload == b'{"id": "x"}'
    assert dead.delivery_count == 1


OBSERVED_CALLS: list[tuple[Order, eop.Message]] = []


async def observed_handler(order: Order, session: Any, msg: eop.Message) -> None:
    """Module level, so that its string annotations resolve only in this module."""
    OBSERVED_CALLS.append((order, msg))


async def test_an_observed_typed_handler_keeps_its_binding_and_gets_its_raw_message() -> None:
    """Metrics or tracing wrap the handler; it still gets the decoded payload and the message."""
    from eop.observe import observer as observe

    OBSERVED_CALLS.clear()
    spec = HandlerSpec(
        func=observed_handler, name="h", stream=STREAM, subject="orders.>", durable="d"
    )
    started: list[Any] = []

    class Recording(observe.Observer):
        def handler_started(self, spec: HandlerSpec, arg: Any) -> Any:
            started.append(arg)

    observed = observe.instrument(spec, Recording())
    assert observed.func is not observed_handler
    assert observed.payload is not None
    assert observed.payload.message_param == "msg"
    proc = processor.Processor(
        spec=observed,
        settings=FAST,
        store=testing.MemoryStore(),
        epochs=testing.FakeEpochs({STREAM: "e1"}),
    )
    good = delivery(b'{"id": 1, "lines": []}', seq=1)
    assert await proc.handle(good, proc.clock()) is Outcome.PROCESSED
    [(order, msg)] = OBSERVED_CALLS
    assert order == Order(id=1, lines=[])
    assert msg.seq == 1
    assert started == [Order(id=1, lines=[])]
