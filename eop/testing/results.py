"""What a :class:`~eop.testing.app.TestApp` delivery came to: one :class:`Result` per handler."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from eop import errors
from eop.observe import observer as observe
from eop.types import Outcome

if TYPE_CHECKING:
    from eop.handler import HandlerSpec
    from eop.message import Message
    from eop.outbox.outgoing import Outgoing
    from eop.types import Delivery


@dataclasses.dataclass(frozen=True)
class Result:
    """What became of one delivery (or one retry) of a message to one handler.

    ``outcome`` is the protocol's: ``PROCESSED`` (the handler's writes
    committed, acked), ``DUPLICATE`` (skipped: the message, by its stream
    sequence or its ``Nats-Msg-Id``, already has an outcome), ``RETRY`` (the
    handler failed; the message waits for its retry, see
    :meth:`TestApp.retry <eop.testing.app.TestApp.retry>`), ``DEAD_LETTERED``
    (with its ``reason``), ``QUARANTINED`` or ``LEFT``; None when the
    delivery is held back (:attr:`held`): its handler did not run.
    """

    handler: str
    """The handler's name."""
    outcome: Outcome | None
    message: Message
    """The message as the handler got it: ``stream``, ``seq``, ``num_delivered``, ``msg_id``..."""
    error: BaseException | None = None
    """What the handler raised on this run (None if it returned)."""
    reason: str | None = None
    """Why it was dead-lettered (``attempts_exhausted``, ``rejected``, ``undecodable``...)."""
    outbox: tuple[Outgoing, ...] = ()
    """The messages this run's committed transaction added to the outbox."""
    held_behind: int | None = None
    """For an ``order_by`` handler, the stream sequence of the retried message of the same
    key this delivery waits behind (None when it ran): see :attr:`held`."""

    @property
    def held(self) -> bool:
        """Held back, unrun: a message of the same key (an ``order_by`` handler's) waits for
        its retry, and this one runs after it has an outcome (:meth:`TestApp.retry
        <eop.testing.app.TestApp.retry>` returns that run)."""
        return self.held_behind is not None

    @property
    def processed(self) -> bool:
        """The handler's writes committed."""
        return self.outcome is Outcome.PROCESSED

    @property
    def duplicate(self) -> bool:
        """Skipped: the message already had an outcome, the handler did not run."""
        return self.outcome is Outcome.DUPLICATE

    @property
    def retried(self) -> bool:
        """The handler failed and the message waits for its retry."""
        return self.outcome is Outcome.RETRY

    @property
    def dead_lettered(self) -> bool:
        """The message is a dead letter now (see :attr:`reason`)."""
        return self.outcome is Outcome.DEAD_LETTERED

    def __str__(self) -> str:
        if self.outcome is None:
            text = f"{self.handler}: held behind #{self.held_behind}"
        else:
            text = f"{self.handler}: {self.outcome.value}"
        if self.reason is not None:
            text += f" ({self.reason})"
        if self.error is not None:
            text += f" after {type(self.error).__name__}: {self.error}"
        return f"{text} [{self.message.stream} #{self.message.seq}]"


class Delivered(Mapping[str, Result]):
    """The results of one delivery, by handler name (every handler whose subject matched).

    With one handler, :attr:`outcome`, :attr:`processed` and the others read
    its result directly; with several, pick one: ``delivered["billing"]``.
    """

    def __init__(self, subject: str, results: Sequence[Result]) -> None:
        self.subject = subject
        """The subject delivered on."""
        self._results = {r.handler: r for r in results}

    def __getitem__(self, handler: str) -> Result:
        try:
            return self._results[handler]
        except KeyError:
            known = ", ".join(self._results) or "none"
            raise KeyError(f"handler {handler!r} did not get {self.subject}: {known} did") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._results)

    def __len__(self) -> int:
        return len(self._results)

    @property
    def result(self) -> Result:
        """The one handler's result (an error when several handlers got the message)."""
        if len(self._results) != 1:
            names = ", ".join(self._results)
            raise LookupError(
                f"{len(self._results)} handlers got {self.subject} ({names}): pick one, "
                "delivered['name'], or deliver(..., handler='name')"
            )
        return next(iter(self._results.values()))

    @property
    def outcome(self) -> Outcome | None:
        """The one handler's outcome (None if it holds the message back)."""
        return self.result.outcome

    @property
    def outcomes(self) -> dict[str, Outcome | None]:
        """Each handler's outcome (None for one that holds the message back)."""
        return {name: r.outcome for name, r in self._results.items()}

    @property
    def processed(self) -> bool:
        """Every handler processed the message."""
        return all(r.processed for r in self._results.values())

    @property
    def duplicate(self) -> bool:
        """Every handler skipped it as a duplicate."""
        return all(r.duplicate for r in self._results.values())

    @property
    def retried(self) -> bool:
        """The one handler failed, the message waits for its retry."""
        return self.result.retried

    @property
    def dead_lettered(self) -> bool:
        """The one handler's message is a dead letter now."""
        return self.result.dead_lettered

    @property
    def held(self) -> bool:
        """The one handler holds the message back behind a retried one of its key."""
        return self.result.held

    @property
    def held_behind(self) -> int | None:
        """The stream sequence of the retried message the one handler holds it back behind."""
        return self.result.held_behind

    @property
    def reason(self) -> str | None:
        """The one handler's dead letter reason."""
        return self.result.reason

    @property
    def error(self) -> BaseException | None:
        """What the one handler raised."""
        return self.result.error

    @property
    def message(self) -> Message:
        """The message as the one handler got it."""
        return self.result.message

    @property
    def outbox(self) -> tuple[Outgoing, ...]:
        """The outbox messages every handler's committed transaction added."""
        return tuple(m for r in self._results.values() for m in r.outbox)

    def __repr__(self) -> str:
        inner = "; ".join(str(r) for r in self._results.values())
        return f"<Delivered {self.subject}: {inner}>"


class Recorder(observe.Observer):
    """Hears what the protocol settled and what the handler raised, per delivery."""

    def __init__(self) -> None:
        self.settled: dict[int, observe.Settled] = {}
        self.errors: dict[int, BaseException] = {}

    def outcome(self, event: observe.Settled) -> None:
        """Keep the settlement of the delivery."""
        self.settled[id(event.delivery)] = event

    def failed(self, spec: HandlerSpec, delivery: Delivery, error: BaseException) -> None:
        """Keep what the handler raised on the delivery."""
        self.errors[id(delivery)] = error

    def take(self, delivery: Delivery) -> tuple[observe.Settled | None, BaseException | None]:
        """The settlement and handler error of ``delivery``, forgotten here."""
        return self.settled.pop(id(delivery), None), self.errors.pop(id(delivery), None)


def describe_handlers(specs: Sequence[HandlerSpec]) -> str:
    """The handlers an app has, for an error naming what a subject could match."""
    return ", ".join(f"{s.name} ({s.subject} on {s.stream})" for s in specs) or "none"


def unexpected(error: BaseException | None) -> bool:
    """An error the handler did not raise on purpose (not ``eop.Retry`` or ``eop.Reject``)."""
    return error is not None and not isinstance(error, errors.HandlerError)


def raise_unexpected(
    results: Sequence[Result], advice: str = " Pass raise_errors=False to test failures."
) -> None:
    """Raise :class:`eop.errors.HandlerFailed` from the first error a handler did not raise
    on purpose, if any; ``advice`` ends its text."""
    for result in results:
        if result.error is None or not unexpected(result.error):
            continue
        msg = result.message
        settled = "held" if result.outcome is None else result.outcome.value
        raise errors.HandlerFailed(
            f"handler {result.handler!r} raised {type(result.error).__name__}: {result.error} "
            f"(on {msg.subject}, {msg.stream} #{msg.seq}, delivery {msg.num_delivered}); the "
            f"message was settled as {settled}.{advice}"
        ) from result.error


def payload_bytes(data: Any) -> bytes:
    """The bytes of a test message: bytes and text as they are, anything else as JSON."""
    if isinstance(data, bytes):
        return data
    if isinstance(data, str):
        return data.encode()
    dump = getattr(data, "model_dump_json", None)
    if callable(dump):  # a pydantic model
        return str(dump()).encode()
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        data = dataclasses.asdict(data)
    return json.dumps(data).encode()
