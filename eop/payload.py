"""Typed payloads: a handler annotated with a dataclass or a pydantic model gets it decoded.

The annotation of a handler's first parameter is read once, when the handler
is registered (:func:`bind`): ``eop.Message`` (or none) passes the message
itself and costs nothing per message; a dataclass, a ``TypedDict`` or a
pydantic model decodes the JSON payload into it, through a pydantic
``TypeAdapter`` built at registration; with ``batch=True``, ``list[Model]``.
A payload that does not decode or validate raises
:class:`eop.UndecodableMessage`, which eop dead-letters at once with the
validation error as the reason (fields and problems, never the values):
retrying could never make it valid.

A typed handler still reaches the message (its idempotency key, headers)
through a further parameter annotated ``eop.Message`` (``list[eop.Message]``
for a batch handler), passed by keyword::

    @app.handler(stream="ORDERS", subject="ORDERS.created", name="orders")
    async def save(order: Order, session: AsyncSession, msg: eop.Message) -> None: ...

Plain dataclasses and ``TypedDict`` are validated strictly, as JSON types are
(``"7"`` is not an ``int``; ``datetime``, ``UUID`` and ``Decimal`` come from
strings); a pydantic model or dataclass follows its own ``model_config``.
Unknown JSON keys are ignored, as pydantic does by default, so a producer may
add fields before its consumers know them. A field type pydantic cannot
validate is a :class:`eop.ConfigurationError` at registration.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import inspect
import sys
import types
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from typing_extensions import is_typeddict

from eop import errors
from eop.message import Message

if TYPE_CHECKING:
    # Imported when a typed handler is registered: `import eop` does not pay for it.
    import pydantic

_MAX_REPORTED = 10


@dataclasses.dataclass(frozen=True)
class Binding:
    """How a typed handler is called: what it is given instead of the raw message."""

    target: str
    """The annotated type, for messages (``Order`` or ``list[Order]``)."""
    decode: Callable[[Message], Any]
    """Decodes one message's payload; raises :class:`eop.UndecodableMessage`."""
    batch: bool
    message_param: str | None = None
    """A parameter that also receives the raw message(s), by keyword."""

    def arguments(self, messages: list[Message]) -> tuple[Any, dict[str, Any]]:
        """The handler's first argument and its keyword arguments for ``messages``."""
        if self.batch:
            value: Any = [self.decode(m) for m in messages]
            raw: Any = messages
        else:
            value, raw = self.decode(messages[0]), messages[0]
        return value, ({self.message_param: raw} if self.message_param else {})


def bind(func: Callable[..., Any], *, batch: bool, handler: str) -> Binding | None:
    """Resolve the handler's payload type from its annotations; None for raw messages.

    A :class:`eop.ConfigurationError` names the handler, the parameter and
    the fix when the annotation is not one eop can decode into.
    """
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):  # builtins and some callables have no signature
        return None
    if not params or params[0].kind is inspect.Parameter.VAR_POSITIONAL:
        return None
    first = params[0]
    hints = _hints(func)
    where = f"handler {handler!r}, parameter {first.name!r}"
    annotation = resolve(func, first, hints, where)
    item, is_list = _unwrap_sequence(annotation)
    if _is_raw(annotation) or (is_list and _is_raw(item)):
        if _is_raw(annotation) or batch:
            return None
        raise errors.ConfigurationError(
            f"{where}: a handler without batch=True gets one message, not {_name(annotation)}"
        )
    if batch and not is_list:
        raise errors.ConfigurationError(
            f"{where}: a batch handler gets a list: annotate it list[{_name(annotation)}]"
        )
    if is_list and not batch:
        raise errors.ConfigurationError(
            f"{where}: {_name(annotation)} needs batch=True; "
            f"a handler without it gets one {_name(item)}"
        )
    target = item if batch else annotation
    decode = _decoder(target, where)
    return Binding(
        target=_name(annotation),
        decode=decode,
        batch=batch,
        message_param=_message_param(func, params[2:], hints, batch=batch, handler=handler),
    )


def _hints(func: Callable[..., Any]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(func)
    except Exception:
        # One annotation imported under TYPE_CHECKING (typically the session's)
        # sinks them all: resolve the ones eop needs one by one instead.
        return {}


def resolve(
    func: Callable[..., Any], param: inspect.Parameter, hints: dict[str, Any], where: str
) -> Any:
    """The type a handler parameter is annotated with, resolved in the handler's module.

    ``hints`` are the function's resolved hints when they all resolve; otherwise
    this one annotation is resolved alone, and a :class:`eop.ConfigurationError`
    names ``where`` when it cannot be.
    """
    if param.name in hints:
        return hints[param.name]
    annotation = param.annotation
    if not isinstance(annotation, str):
        return annotation
    # A function in the handler's module namespace, annotated with this one string.
    stub = types.FunctionType(_stub.__code__, getattr(func, "__globals__", {}))
    stub.__annotations__ = {"x": annotation}
    try:
        return typing.get_type_hints(stub)["x"]
    except Exception as exc:
        if annotation.rsplit(".", 1)[-1] in ("Message", "eop.Message"):
            # Message imported under TYPE_CHECKING: what eop passes anyway.
            return Message
        raise errors.ConfigurationError(
            f"{where}: cannot resolve its annotation {annotation!r} ({exc}): "
            "import the type at module level, not under TYPE_CHECKING"
        ) from exc


def _stub() -> None:
    """The code object of the namespace stubs of :func:`resolve`."""


def _message_param(
    func: Callable[..., Any],
    params: list[inspect.Parameter],
    hints: dict[str, Any],
    *,
    batch: bool,
    handler: str,
) -> str | None:
    """The parameter after the session that asks for the raw message(s), if any."""
    for param in params:
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        where = f"handler {handler!r}, parameter {param.name!r}"
        annotation = resolve(func, param, hints, where)
        item, is_list = _unwrap_sequence(annotation)
        if annotation is Message or (is_list and item is Message):
            if is_list != batch:
                wanted = "list[eop.Message]" if batch else "eop.Message"
                raise errors.ConfigurationError(f"{where}: annotate it {wanted}")
            return param.name
        if param.default is inspect.Parameter.empty:
            raise errors.ConfigurationError(
                f"{where}: eop passes the payload, the session, and the message to a "
                "parameter annotated eop.Message; give this one a default"
            )
    return None


def _is_raw(annotation: Any) -> bool:
    return annotation in (inspect.Parameter.empty, Any, object, Message)


_SEQUENCES = (list, collections.abc.Sequence, collections.abc.Iterable, collections.abc.Collection)


def _unwrap_sequence(annotation: Any) -> tuple[Any, bool]:
    """``(T, True)`` for ``list[T]`` and the like (bare ``list`` gives ``Any``)."""
    if annotation in _SEQUENCES:
        return Any, True
    origin = typing.get_origin(annotation)
    if origin in _SEQUENCES:
        args = typing.get_args(annotation)
        return (args[0] if args else Any), True
    return annotation, False


def _decoder(target: Any, where: str) -> Callable[[Message], Any]:
    """A decoder of ``target`` from JSON bytes, built once by pydantic's TypeAdapter."""
    v1 = sys.modules.get("pydantic.v1")  # imported only by apps that use it
    if v1 is not None and isinstance(target, type) and issubclass(target, v1.BaseModel):
        raise errors.ConfigurationError(
            f"{where}: {_name(target)} is a pydantic v1 model: eop needs v2"
        )
    if not _is_structured(target):
        raise errors.ConfigurationError(
            f"{where}: unsupported annotation {_name(target)}: annotate it eop.Message, "
            "a dataclass, a TypedDict or a pydantic model (a list of them with batch=True)"
        )
    import pydantic

    try:
        adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(target)
    except (pydantic.PydanticUserError, NameError) as exc:
        # A field type pydantic has no schema for, a forward reference it cannot resolve.
        reason = str(exc).split("\n", 1)[0]
        raise errors.ConfigurationError(
            f"{where}: cannot decode JSON into {_name(target)}: {reason}"
        ) from exc
    # Plain dataclasses and TypedDicts are strict, as JSON types are: "7" is not an int.
    # A pydantic class follows its own model_config (lax unless it says strict=True).
    strict = not _is_pydantic(target)
    name = _name(target)

    def decode(msg: Message) -> Any:
        try:
            return adapter.validate_json(msg.data, strict=strict)
        except pydantic.ValidationError as exc:
            raise errors.UndecodableMessage(describe(exc, name)) from None
        except RecursionError:
            raise errors.UndecodableMessage(
                f"payload does not validate as {name}: nested too deeply"
            ) from None

    return decode


def describe(error: pydantic.ValidationError, name: str) -> str:
    """A validation error as one line naming each field and its problem, never a value.

    A dead letter's reason goes to logs and to ``eop dlq``: pydantic's own text
    quotes the input (``input_value=...``), this one does not.
    """
    problems = error.errors(include_url=False, include_input=False, include_context=False)
    if problems and problems[0]["type"] == "json_invalid":
        return f"payload is not valid JSON: {problems[0]['msg'].removeprefix('Invalid JSON: ')}"
    text = "; ".join(
        f"{_path(problem['loc'])}: {_QUOTING.get(problem['type'], problem['msg'])}"
        for problem in problems[:_MAX_REPORTED]
    )
    more = len(problems) - _MAX_REPORTED
    suffix = f"; and {more} more" if more > 0 else ""
    return f"payload does not validate as {name}: {text}{suffix}"


# Error types whose message quotes a piece of the input: their own wording instead.
_QUOTING = {
    "union_tag_invalid": "its tag matches none of the expected tags",
}


def _path(loc: tuple[int | str, ...]) -> str:
    """``lines[0].qty`` for pydantic's ``('lines', 0, 'qty')``; ``(root)`` for ``()``."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(root)"


def _is_pydantic(target: Any) -> bool:
    """A pydantic model or a pydantic dataclass: validated as its own config says."""
    pydantic = sys.modules.get("pydantic")  # not imported: the target is not one of its
    return (
        pydantic is not None
        and isinstance(target, type)
        and (issubclass(target, pydantic.BaseModel) or hasattr(target, "__pydantic_validator__"))
    )


def _is_structured(target: Any) -> bool:
    """A type a JSON object decodes into: a pydantic model, a dataclass, a TypedDict."""
    if _is_pydantic(target):
        return True
    return (dataclasses.is_dataclass(target) and isinstance(target, type)) or is_typeddict(target)


def _name(tp: Any) -> str:
    """A short spelling of an annotation: ``list[Order]``, not ``list[myapp.models.Order]``."""
    if tp is inspect.Parameter.empty:
        return "(no annotation)"
    if tp is type(None):
        return "None"
    args = typing.get_args(tp)
    if isinstance(tp, type) and not args:
        return tp.__name__
    origin = typing.get_origin(tp)
    if args and origin is not None:
        if origin in (typing.Union, types.UnionType):
            return " | ".join(_name(a) for a in args)
        head = getattr(origin, "__name__", str(origin).replace("typing.", ""))
        return f"{head}[{', '.join('...' if a is Ellipsis else _name(a) for a in args)}]"
    return str(tp).replace("typing.", "")
