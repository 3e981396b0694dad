"""Typed payloads: a handler annotated with a dataclass or a pydantic model gets it decoded.

The annotation of a handler's first parameter is read once, when the handler
is registered (:func:`bind`): ``eop.Message`` (or none) passes the message
itself and costs nothing per message; a dataclass or a pydantic v2 model (the
``eop[pydantic]`` extra) decodes the JSON payload into it; with
``batch=True``, ``list[Model]``. A payload that does not decode or validate
raises :class:`eop.UndecodableMessage`, which eop dead-letters at once with
the validation error as the reason: retrying could never make it valid.

A typed handler still reaches the message (its idempotency key, headers)
through a further parameter annotated ``eop.Message`` (``list[eop.Message]``
for a batch handler), passed by keyword::

    @app.handler(stream="ORDERS", subject="ORDERS.created", name="orders")
    async def save(order: Order, session: AsyncSession, msg: eop.Message) -> None: ...

Dataclass fields may be ``int``, ``float``, ``str``, ``bool``, ``None``,
``Any``, ``Literal``, enums, ``datetime``/``date``/``UUID``/``Decimal`` (from
JSON strings), nested dataclasses, ``list``/``tuple``/``set``/``Sequence``,
``dict``/``Mapping`` with string keys, and unions of these (``X | None``);
anything else is a :class:`eop.ConfigurationError` at registration. Unknown
JSON keys are ignored, as pydantic does by default, so a producer may add
fields before its consumers know them.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import datetime
import decimal
import enum
import inspect
import sys
import types
import typing
import uuid
from collections.abc import Callable
from typing import Any

from eop import errors
from eop.message import Message

Convert = Callable[[Any, str], Any]
"""Turns a decoded JSON value into the annotated type; ``_Invalid`` when it does not fit."""

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
    if _is_pydantic_model(target):
        return _pydantic_decoder(target)
    if dataclasses.is_dataclass(target) and isinstance(target, type):
        if hasattr(target, "__pydantic_validator__"):
            return _pydantic_decoder(target)
        convert = _Compiler(where).dataclass(target)
        name = target.__name__

        def decode(msg: Message) -> Any:
            value = msg.json()
            try:
                return convert(value, "")
            except RecursionError:
                raise errors.UndecodableMessage(
                    f"payload does not validate as {name}: nested too deeply"
                ) from None
            except _Invalid as exc:
                raise errors.UndecodableMessage(
                    f"payload does not validate as {name}: {exc}"
                ) from None

        return decode
    if isinstance(target, type) and hasattr(target, "parse_raw"):
        raise errors.ConfigurationError(
            f"{where}: {_name(target)} is a pydantic v1 model: eop needs v2"
        )
    raise errors.ConfigurationError(
        f"{where}: unsupported annotation {_name(target)}: annotate it eop.Message, "
        "a dataclass or a pydantic model (a list of them with batch=True)"
    )


def _is_pydantic_model(target: Any) -> bool:
    pydantic = sys.modules.get("pydantic")
    return (
        pydantic is not None and isinstance(target, type) and issubclass(target, pydantic.BaseModel)
    )


def _pydantic_decoder(target: Any) -> Callable[[Message], Any]:
    import pydantic  # present: the model is one of its classes

    validate = (
        target.model_validate_json
        if issubclass(target, pydantic.BaseModel)
        else pydantic.TypeAdapter(target).validate_json
    )
    name = target.__name__

    def decode(msg: Message) -> Any:
        try:
            return validate(msg.data)
        except pydantic.ValidationError as exc:
            # Without the inputs: a dead letter's reason ends up in logs, payloads must not.
            problems = exc.errors(include_url=False, include_input=False, include_context=False)
            text = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}"
                for e in problems[:_MAX_REPORTED]
            )
            more = len(problems) - _MAX_REPORTED
            suffix = f"; and {more} more" if more > 0 else ""
            raise errors.UndecodableMessage(
                f"payload does not validate as {name}: {text}{suffix}"
            ) from None

    return decode


class _Invalid(Exception):
    """A JSON value does not fit the annotated type (``path: problem``)."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path or '(root)'}: {problem}")


def _kind(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean"}.get(
        type(value), "null" if value is None else type(value).__name__
    )


class _Compiler:
    """Builds converters for dataclasses, once, at registration."""

    def __init__(self, where: str) -> None:
        self.where = where
        self._classes: dict[type, Convert] = {}

    def dataclass(self, cls: type) -> Convert:
        if cls in self._classes:
            return self._classes[cls]
        fields: list[tuple[str, Convert, bool]] = []

        def convert(value: Any, path: str) -> Any:
            if not isinstance(value, dict):
                raise _Invalid(path, f"expected an object for {cls.__name__}, got {_kind(value)}")
            kwargs = {}
            for name, field_convert, required in fields:
                if name in value:
                    kwargs[name] = field_convert(value[name], f"{path}.{name}" if path else name)
                elif required:
                    raise _Invalid(f"{path}.{name}" if path else name, "field required")
            try:
                return cls(**kwargs)
            except (TypeError, ValueError) as exc:  # the class's own __post_init__ checks
                raise _Invalid(path, f"{cls.__name__}: {exc}") from None

        # Registered before the fields are compiled, so a recursive dataclass works.
        self._classes[cls] = convert
        try:
            hints = typing.get_type_hints(cls)
        except Exception as exc:
            raise errors.ConfigurationError(
                f"{self.where}: cannot resolve the annotations of {cls.__name__}: {exc}"
            ) from exc
        for field in dataclasses.fields(cls):
            if not field.init:
                continue
            required = (
                field.default is dataclasses.MISSING
                and field.default_factory is dataclasses.MISSING
            )
            fields.append((field.name, self.type(hints[field.name], cls, field.name), required))
        return convert

    def type(self, tp: Any, owner: type, field: str) -> Convert:  # noqa: C901  # one case per kind
        if tp in (Any, object):
            return _identity
        if tp is type(None):
            return _none
        if tp in _SCALARS:
            return _SCALARS[tp]
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            return _enum(tp)
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            return self.dataclass(tp)
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin is typing.Literal:
            return _literal(args)
        if origin in (typing.Union, types.UnionType):
            return _union([self.type(a, owner, field) for a in args], args)
        if tp in (list, dict, tuple, set, frozenset):
            origin, args = tp, ()
        if origin is typing.Annotated:
            return self.type(args[0], owner, field)
        if origin in (list, set, frozenset, collections.abc.Sequence, collections.abc.Set):
            make: Callable[[Any], Any] = origin if origin in (set, frozenset) else list
            return _array(self.type(args[0], owner, field) if args else _identity, make)
        if origin is tuple:
            if len(args) == 2 and args[1] is Ellipsis:
                return _array(self.type(args[0], owner, field), tuple)
            if args:
                return _fixed_tuple([self.type(a, owner, field) for a in args])
            return _array(_identity, tuple)
        if origin in (dict, collections.abc.Mapping):
            if args and args[0] is not str:
                raise errors.ConfigurationError(
                    f"{self.where}: field {owner.__name__}.{field}: JSON object keys are "
                    f"strings, not {_name(args[0])}"
                )
            return _object(self.type(args[1], owner, field) if args else _identity)
        raise errors.ConfigurationError(
            f"{self.where}: field {owner.__name__}.{field} has type {_name(tp)}, which eop "
            "cannot decode from JSON (use a pydantic model for custom types)"
        )


def _identity(value: Any, path: str) -> Any:
    return value


def _none(value: Any, path: str) -> Any:
    if value is not None:
        raise _Invalid(path, f"expected null, got {_kind(value)}")
    return None


def _scalar(name: str, accept: Callable[[Any], bool], make: Callable[[Any], Any]) -> Convert:
    def convert(value: Any, path: str) -> Any:
        if not accept(value):
            raise _Invalid(path, f"expected {name}, got {_kind(value)}")
        try:
            return make(value)
        except (ValueError, ArithmeticError):
            raise _Invalid(path, f"expected {name}, got an invalid {_kind(value)}") from None

    return convert


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


_SCALARS: dict[Any, Convert] = {
    bool: _scalar("a boolean", lambda v: isinstance(v, bool), bool),
    int: _scalar("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool), int),
    float: _scalar("a number", _is_number, float),
    str: _scalar("a string", _is_str, str),
    datetime.datetime: _scalar("an ISO 8601 date-time", _is_str, datetime.datetime.fromisoformat),
    datetime.date: _scalar("an ISO 8601 date", _is_str, datetime.date.fromisoformat),
    uuid.UUID: _scalar("a UUID", _is_str, uuid.UUID),
    decimal.Decimal: _scalar(
        "a decimal", lambda v: _is_str(v) or _is_number(v), lambda v: decimal.Decimal(str(v))
    ),
}


def _enum(cls: type[enum.Enum]) -> Convert:
    def convert(value: Any, path: str) -> Any:
        try:
            return cls(value)
        except (ValueError, TypeError):
            raise _Invalid(path, f"not a valid {cls.__name__}") from None

    return convert


def _literal(choices: tuple[Any, ...]) -> Convert:
    def convert(value: Any, path: str) -> Any:
        # bool is an int: Literal[1] must not accept true.
        if any(value == c and type(value) is type(c) for c in choices):
            return value
        raise _Invalid(path, f"expected one of {list(choices)!r}")

    return convert


def _union(converters: list[Convert], args: tuple[Any, ...]) -> Convert:
    names = " | ".join(_name(a) for a in args)

    def convert(value: Any, path: str) -> Any:
        failures = []
        for option, arg in zip(converters, args, strict=True):
            try:
                return option(value, path)
            except _Invalid as exc:
                if arg is not type(None):
                    failures.append(exc)
        if len(failures) == 1:
            # ``X | None`` given a wrong X: X's own error says which field is wrong.
            raise failures[0]
        raise _Invalid(path, f"expected {names}, got {_kind(value)}")

    return convert


def _array(item: Convert, make: Callable[[Any], Any]) -> Convert:
    def convert(value: Any, path: str) -> Any:
        if not isinstance(value, list):
            raise _Invalid(path, f"expected an array, got {_kind(value)}")
        return make(item(v, f"{path}[{i}]") for i, v in enumerate(value))

    return convert


def _fixed_tuple(items: list[Convert]) -> Convert:
    def convert(value: Any, path: str) -> Any:
        if not isinstance(value, list) or len(value) != len(items):
            raise _Invalid(path, f"expected an array of {len(items)} items")
        return tuple(
            c(v, f"{path}[{i}]") for i, (c, v) in enumerate(zip(items, value, strict=True))
        )

    return convert


def _object(item: Convert) -> Convert:
    def convert(value: Any, path: str) -> Any:
        if not isinstance(value, dict):
            raise _Invalid(path, f"expected an object, got {_kind(value)}")
        return {k: item(v, f"{path}.{k}" if path else k) for k, v in value.items()}

    return convert


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
