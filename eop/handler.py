"""Handler and stream declarations: what ``@app.handler`` and ``app.stream`` record."""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal, Union

from eop import errors, payload, writes

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session

    from eop.message import Message

AsyncHandler = Callable[["Message", "AsyncSession"], Awaitable[None]]
SyncHandler = Callable[["Message", "Session"], None]
AsyncBatchHandler = Callable[[list["Message"], "AsyncSession"], Awaitable[None]]
SyncBatchHandler = Callable[[list["Message"], "Session"], None]
AsyncWritesHandler = Callable[["Message", "writes.Writes"], Awaitable[None]]
SyncWritesHandler = Callable[["Message", "writes.Writes"], None]
AsyncBatchWritesHandler = Callable[[list["Message"], "writes.Writes"], Awaitable[None]]
SyncBatchWritesHandler = Callable[[list["Message"], "writes.Writes"], None]
HandlerFunc = Union[  # noqa: UP007  # a runtime alias on 3.10
    AsyncHandler,
    SyncHandler,
    AsyncBatchHandler,
    SyncBatchHandler,
    AsyncWritesHandler,
    SyncWritesHandler,
    AsyncBatchWritesHandler,
    SyncBatchWritesHandler,
]

StorageType = Literal["file", "memory"]

_NAME = re.compile(r"[A-Za-z0-9_-]+")

#: The most replicas nats-server allows a stream (and a consumer).
MAX_REPLICAS = 5


@dataclasses.dataclass(frozen=True)
class StreamSpec:
    """A stream that eop may create when it does not exist.

    Streams eop creates carry an epoch id in their metadata; see
    :func:`eop.broker.jetstream.stream_epoch`.
    """

    name: str
    subjects: tuple[str, ...]
    storage: StorageType = "file"
    duplicate_window_s: float = 120.0
    """How long the server remembers ``Nats-Msg-Id`` values to drop duplicate publishes."""
    max_age_s: float = 0.0
    """Retention by age; 0 keeps messages until limits remove them."""
    replicas: int | None = None
    """Copies of the stream in a NATS cluster (1 to 5); its consumers get as many.
    None: the server's default (1) for a stream eop creates, no opinion on one that exists."""
    placement_cluster: str | None = None
    """The NATS cluster to place the stream in (a super-cluster's), or None for any."""
    placement_tags: tuple[str, ...] = ()
    """Server tags every replica's server must have (``server_tags`` in their config)."""

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise errors.ConfigurationError(
                f"stream name {self.name!r} may only hold letters, digits, '_' and '-'"
            )
        if not self.subjects:
            raise errors.ConfigurationError(f"stream {self.name!r} needs at least one subject")
        replicas = self.replicas
        if replicas is None:
            return
        # bool is an int: replicas=True would pass for 1.
        if isinstance(replicas, bool) or not isinstance(replicas, int):
            raise errors.ConfigurationError(
                f"stream {self.name!r}: replicas must be a whole number from 1 to "
                f"{MAX_REPLICAS}, not {replicas!r}"
            )
        if not 1 <= replicas <= MAX_REPLICAS:
            raise errors.ConfigurationError(
                f"stream {self.name!r}: replicas must be from 1 to {MAX_REPLICAS} "
                f"(nats-server's limit), not {replicas}"
            )


@dataclasses.dataclass(frozen=True)
class HandlerSpec:
    """A registered handler and the subscription it runs on.

    ``name`` is the subscription's stable logical name: the inbox is keyed on
    it, so renaming or recreating the NATS consumer does not reprocess
    anything, while renaming the handler does.
    """

    func: HandlerFunc
    name: str
    stream: str
    subject: str
    durable: str
    max_attempts: int | None = None
    ack_wait_s: float | None = None
    order_by: str | None = None
    """``subject:N`` or ``header:NAME``: same-key messages are handled in stream order."""
    partitions: int = 1
    """How many partitions an ordered handler's keys are spread over: each is owned by one
    process at a time, so up to this many processes run the handler at once."""
    batch: bool = False
    """The handler takes a list of messages (a whole fetched batch) instead of one."""
    msg_id_guard: bool = True
    """Also skip a message whose ``Nats-Msg-Id`` this handler already processed
    under another sequence (a republish after the duplicate window)."""
    payload: payload.Binding | None = dataclasses.field(
        default=None, init=False, compare=False, repr=False
    )
    """How a typed handler gets its decoded payload (None: it takes the message itself);
    resolved from the handler's annotations when the spec is made."""
    takes_writes: bool = dataclasses.field(default=False, init=False, compare=False, repr=False)
    """The handler's second parameter is annotated :class:`eop.Writes`: it gets the
    transaction's write queue instead of the session."""

    def arguments(self, messages: list[Message]) -> tuple[Any, dict[str, Any]]:
        """What to call :attr:`func` with for ``messages``, after the session.

        The message (the list, for a batch handler), or a typed handler's
        decoded payload and the keyword arguments naming its raw messages.
        """
        if self.payload is None:
            return (messages if self.batch else messages[0]), {}
        return self.payload.arguments(messages)

    @property
    def is_async(self) -> bool:
        """True for ``async def`` handlers (given an ``AsyncSession``)."""
        return inspect.iscoroutinefunction(self.func)

    def __post_init__(self) -> None:
        for label, value in (("handler name", self.name), ("durable", self.durable)):
            if not _NAME.fullmatch(value):
                raise errors.ConfigurationError(
                    f"{label} {value!r} may only hold letters, digits, '_' and '-'"
                )
        if not self.subject or " " in self.subject:
            raise errors.ConfigurationError(f"invalid subject {self.subject!r}")
        if self.order_by is not None:
            parse_order_by(self.order_by)
        self._check_partitions()
        if self.max_attempts is not None and self.max_attempts < 1:
            raise errors.ConfigurationError("max_attempts must be at least 1")
        # Through wrappers (eop.observe.observer.instrument) to the user's function and its hints.
        func = inspect.unwrap(self.func)
        binding = payload.bind(func, batch=self.batch, handler=self.name)
        _check_callable(func, binding, self.name)
        object.__setattr__(self, "payload", binding)  # a frozen dataclass's derived fields
        object.__setattr__(self, "takes_writes", _takes_writes(func, self.name))

    def _check_partitions(self) -> None:
        """Several partitions need a subject key that is a ``*`` of the handler's subject:
        the stream hashes that token (docs/ordering.md, 'Partitions')."""
        count = self.partitions
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 1024:
            raise errors.ConfigurationError(
                f"handler {self.name!r}: partitions must be a whole number from 1 to 1024, "
                f"not {count!r}"
            )
        if count == 1:
            return
        if self.order_by is None:
            raise errors.ConfigurationError(
                f"handler {self.name!r}: partitions={count} needs order_by (partitions spread "
                "an ordered handler's keys; an unordered handler scales out without them)"
            )
        kind, arg = parse_order_by(self.order_by)
        tokens = self.subject.split(".")
        if kind != "subject" or int(arg) >= len(tokens) or tokens[int(arg)] != "*":
            raise errors.ConfigurationError(
                f"handler {self.name!r}: partitions={count} needs order_by='subject:N' where "
                f"token N of its subject {self.subject!r} is a '*' (the stream hashes that "
                f"token into the partition); {self.order_by!r} is not. Use such a subject, "
                "or partitions=1"
            )


def _check_callable(func: Callable[..., Any], binding: payload.Binding | None, name: str) -> None:
    """Refuse a handler that cannot be called as eop calls it: its message (or payload, or
    batch), its session (or ``eop.Writes``), and the raw message's keyword when it asks
    for one. Found only when messages came, it failed each of them until dead-lettered."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):  # builtins and some callables have no signature
        return
    keyword = binding.message_param if binding is not None else None
    try:
        signature.bind(None, None, **({keyword: None} if keyword else {}))
    except TypeError as exc:
        raise errors.ConfigurationError(
            f"handler {name!r} cannot be called as eop calls it, with the message (or its "
            f"payload) and the session: {exc}. Fix: take those two parameters; give any "
            "other a default"
        ) from None


def _takes_writes(func: Callable[..., Any], handler: str) -> bool:
    """Whether the handler's second parameter is annotated ``eop.Writes`` (else: the session)."""
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return False
    if len(params) < 2 or params[1].annotation is inspect.Parameter.empty:
        return False
    annotation = params[1].annotation
    try:
        resolved = payload.resolve(func, params[1], {}, f"handler {handler!r}")
    except errors.ConfigurationError:
        # Imported under TYPE_CHECKING, as sessions often are: the name decides.
        return isinstance(annotation, str) and annotation.rsplit(".", 1)[-1] == "Writes"
    return resolved is writes.Writes


def parse_order_by(order_by: str) -> tuple[str, str]:
    """Check an ``order_by`` spec, ``subject:N`` or ``header:NAME``; (kind, argument)."""
    if not isinstance(order_by, str):
        # A function of the message is the natural guess; a key must be one the stream's
        # subject transform (or the header) can give every process without running it.
        raise errors.ConfigurationError(
            "order_by must be 'subject:N' (a subject token) or 'header:NAME', not "
            f"{type(order_by).__name__} {order_by!r}: put the key in the subject or a "
            "header when publishing (docs/ordering.md)"
        )
    kind, _, arg = order_by.partition(":")
    if (kind == "subject" and arg.isdigit()) or (kind == "header" and arg):
        return kind, arg
    raise errors.ConfigurationError(
        f"order_by must be 'subject:N' (a subject token) or 'header:NAME', not {order_by!r}"
    )
