"""Options, offsets and sequence ranges of the ``jetstream`` data source (no I/O, no Spark).

An offset is the next stream sequence to read, with the stream's name and
epoch: ``{"stream": "ORDERS", "epoch": "...", "seq": 101}``. A micro-batch
or a batch read covers the sequences ``[start.seq, end.seq)`` of one epoch,
split into partitions of at most ``messagesPerPartition`` sequences.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from eop import errors as eop_errors
from eop import settings as settings_mod
from eop.contrib.spark import errors
from eop.nats_access import NatsAccess

DEFAULT_MESSAGES_PER_PARTITION = 1000


#: The NATS secrets an option may name an environment variable for (``natsPasswordEnv``...).
SECRET_FIELDS = ("password", "token")


def with_secrets_from_env(
    access: NatsAccess, secret_env: tuple[tuple[str, str], ...]
) -> NatsAccess:
    """``access`` with each named secret read from this process's environment variable."""
    values: dict[str, Any] = {}
    for field, var in secret_env:
        value = os.environ.get(var)
        if value is None:
            raise eop_errors.ConfigurationError(
                f"the jetstream source's option nats{field.capitalize()}Env names {var}, "
                "which is not set in this process's environment (the driver, or an executor)"
            )
        values[field] = value
    return dataclasses.replace(access, **values)


@dataclasses.dataclass(frozen=True)
class SourceOptions:
    """The options of ``spark.read.format("jetstream")``, parsed and checked.

    Spark hands data source options over with lower-cased keys; the names
    below are the documented spellings (any case works).
    """

    stream: str
    subject: str | None = None
    """``subject``: a filter subject (wildcards allowed); all of the stream's by default."""
    nats_url: str = settings_mod.DEFAULT_NATS_URL
    """``natsUrl``: default ``EOP_NATS_URL``, else ``nats://127.0.0.1:4222``."""
    start_seq: int | None = None
    """``startSequence``: the first sequence to read; the stream's first by default."""
    end_seq: int | None = None
    """``endSequence``: the last sequence to read, inclusive (batch reads only)."""
    max_per_batch: int | None = None
    """``maxMessagesPerBatch``: sequences per micro-batch (streaming only); unbounded by default."""
    per_partition: int = DEFAULT_MESSAGES_PER_PARTITION
    """``messagesPerPartition``: sequences per partition, so per task and per sink transaction."""
    nats_auth: NatsAccess | None = None
    """``natsUser``, ``natsPassword``, ``natsToken``, ``natsNkeySeedFile``, ``natsCredsFile``,
    ``natsTlsCaFile``, ``natsTlsCertFile``, ``natsTlsKeyFile``, ``natsTlsHostname``,
    ``natsTlsHandshakeFirst``: default the ``EOP_NATS_*`` settings."""

    secret_env: tuple[tuple[str, str], ...] = ()
    """``natsPasswordEnv``, ``natsTokenEnv``: the secret's field and the environment variable
    that holds it where the partition is read; partitions carry the name, never the value."""

    @property
    def nats(self) -> NatsAccess:
        """How to reach NATS: ``nats_url`` with the authentication and TLS options."""
        return dataclasses.replace(
            self.nats_auth or NatsAccess(url=self.nats_url), url=self.nats_url
        )

    @property
    def shipped_nats(self) -> NatsAccess:
        """:attr:`nats` as partitions carry it: the secrets named by variables left out."""
        blank: dict[str, Any] = {field: "" for field, _ in self.secret_env}
        return dataclasses.replace(self.nats, **blank)

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SourceOptions:
        """Parse Spark's (lower-cased) option map."""
        opts = {k.lower(): v for k, v in options.items()}
        stream = opts.get("stream", "").strip()
        if not stream:
            raise eop_errors.ConfigurationError(
                'the jetstream source needs .option("stream", NAME)'
            )
        base = settings_mod.Settings.from_env().nats_access
        access = NatsAccess.from_spark_options(opts, base)
        secret_env = tuple(
            (field, opts[f"nats{field}env"])
            for field in SECRET_FIELDS
            if opts.get(f"nats{field}env")
        )
        access = with_secrets_from_env(access, secret_env)
        access.check()
        return cls(
            stream=stream,
            subject=opts.get("subject") or None,
            nats_url=access.url,
            nats_auth=access,
            start_seq=_positive(opts, "startsequence"),
            end_seq=_positive(opts, "endsequence"),
            max_per_batch=_positive(opts, "maxmessagesperbatch"),
            secret_env=secret_env,
            per_partition=_positive(opts, "messagesperpartition") or DEFAULT_MESSAGES_PER_PARTITION,
        )


def _positive(opts: Mapping[str, str], key: str) -> int | None:
    raw = opts.get(key)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise eop_errors.ConfigurationError(
            f"option {key} must be an integer, not {raw!r}"
        ) from None
    if value < 1:
        raise eop_errors.ConfigurationError(f"option {key} must be at least 1, not {value}")
    return value


@dataclasses.dataclass(frozen=True)
class StreamState:
    """What the server says about a stream: its epoch and the sequences it holds."""

    stream: str
    epoch: str
    first_seq: int
    last_seq: int

    @property
    def earliest(self) -> int:
        """The first sequence still stored (an empty new stream reports 0: it will be 1)."""
        return max(self.first_seq, 1)

    @property
    def next_seq(self) -> int:
        """The sequence the next stored message will get."""
        return self.last_seq + 1


@dataclasses.dataclass(frozen=True)
class Offset:
    """A position in one epoch of a stream: the next sequence to read."""

    stream: str
    epoch: str
    seq: int

    def to_json(self) -> dict[str, Any]:
        """The JSON-able dict Spark checkpoints."""
        return {"stream": self.stream, "epoch": self.epoch, "seq": self.seq}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Offset:
        """The offset of a checkpointed dict."""
        return cls(stream=str(data["stream"]), epoch=str(data["epoch"]), seq=int(data["seq"]))


@dataclasses.dataclass(frozen=True)
class SeqRange:
    """The sequences ``[start, end)`` of one epoch of a stream, read with ``subject`` as filter."""

    stream: str
    epoch: str
    subject: str | None
    start: int
    end: int


def check_available(stream: str, start: int, end: int, state: StreamState) -> None:
    """Fail unless every sequence of ``[start, end)`` the stream ever stored is still there.

    Retention (and purges) remove messages from the head of a stream, so a
    range is intact exactly when it starts at or after the first sequence
    still stored.
    """
    if start < end and start < state.earliest:
        raise errors.RangeUnavailable(
            f"stream {stream!r} no longer holds sequences {start}..{min(end, state.earliest) - 1} "
            f"(retention or a purge removed them; its first sequence is now {state.earliest}): "
            "start at a later sequence to process what is left"
        )


def check_epoch(expected: str, state: StreamState) -> None:
    """Fail when the stream is no longer the incarnation the offsets were taken in."""
    if state.epoch != expected:
        raise errors.StreamRecreated(
            f"stream {state.stream!r} was recreated (epoch {expected} is now {state.epoch}): "
            "its sequences name other messages now. Start again with a new checkpoint "
            "(already processed messages will be skipped by the inbox)"
        )


def batch_bounds(opts: SourceOptions, state: StreamState) -> tuple[int, int]:
    """``[start, end)`` of a batch read: the options, clamped to what the stream has stored."""
    start = opts.start_seq or state.earliest
    end = state.next_seq if opts.end_seq is None else min(opts.end_seq + 1, state.next_seq)
    end = max(start, end)
    check_available(opts.stream, start, end, state)
    return start, end


def initial_offset(opts: SourceOptions, state: StreamState) -> Offset:
    """Where a new streaming query starts: ``startSequence``, else the stream's first sequence."""
    start = opts.start_seq or state.earliest
    check_available(opts.stream, start, state.next_seq, state)
    return Offset(opts.stream, state.epoch, start)


def latest_offset(
    start: Offset, state: StreamState, *, max_rows: int | None = None, until: int | None = None
) -> Offset:
    """The end of the next micro-batch: at most ``max_rows`` sequences, never past ``until``."""
    check_epoch(start.epoch, state)
    end = state.next_seq
    if max_rows is not None:
        end = min(end, start.seq + max_rows)
    if until is not None:
        end = min(end, until)
    end = max(end, start.seq)
    check_available(start.stream, start.seq, end, state)
    return Offset(start.stream, start.epoch, end)


def split(
    stream: str, epoch: str, subject: str | None, start: int, end: int, size: int
) -> list[SeqRange]:
    """``[start, end)`` in ranges of at most ``size`` sequences (none when empty)."""
    return [
        SeqRange(stream, epoch, subject, lo, min(lo + size, end)) for lo in range(start, end, size)
    ]


def check_same_stream(opts: SourceOptions, offset: Offset) -> None:
    """A checkpoint belongs to the stream it was taken on."""
    if offset.stream != opts.stream:
        raise eop_errors.ConfigurationError(
            f"the checkpoint's offsets are for stream {offset.stream!r}, "
            f"but the query reads {opts.stream!r}: use another checkpoint directory"
        )
