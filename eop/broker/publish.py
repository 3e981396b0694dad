"""Publishing to a stream with eop's checks: size, msg-id, and errors a person can act on.

nats-py refuses an oversized payload with a bare ``MaxPayloadError`` and
counts the payload only, while the server counts headers too; a publish to a
subject no stream holds times out as "no response from stream", and so does
a publish to a replicated stream while its servers elect a leader.
:func:`publish` says what is wrong and how to fix it instead.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS

from eop import errors
from eop.broker.jetstream import API_PREFIX
from eop.message import MSG_ID_HEADER
from eop.outbox.outgoing import wire_size


async def publish(
    nc: NATS,
    subject: str,
    data: bytes,
    *,
    headers: Mapping[str, str] | None = None,
    msg_id: str | None = None,
    timeout_s: float = 5.0,
) -> Any:
    """Publish ``data`` to the stream holding ``subject`` and wait for its ack (a ``PubAck``).

    ``msg_id`` sets ``Nats-Msg-Id`` (the server drops a republish inside its
    duplicate window, eop's inbox one after it). Raises
    :class:`eop.PayloadTooLarge` before sending anything the server would
    refuse, :class:`eop.ConfigurationError` when no stream holds ``subject``
    and :class:`eop.NatsUnavailable` when the server does not answer.
    """
    hdrs = dict(headers or {})
    if msg_id is not None:
        hdrs[MSG_ID_HEADER] = msg_id
    size, limit = wire_size(data, hdrs), int(nc.max_payload)
    if size > limit:
        raise errors.PayloadTooLarge(
            f"message to {subject} is {size} bytes (payload {len(data)}, headers "
            f"{size - len(data)}), above the server's max_payload of {limit} bytes: send a "
            "reference to data stored elsewhere, split it, or raise max_payload in the "
            "nats-server configuration"
        )
    try:
        return await nc.jetstream().publish(subject, data, timeout=timeout_s, headers=hdrs or None)
    except nats.js.errors.NoStreamResponseError:
        if await _a_stream_holds(nc, subject, timeout_s):
            # A replicated stream has no leader for a few seconds after one died.
            raise errors.NatsUnavailable(
                f"publish to {subject} not acknowledged: its stream has no leader (an "
                "election under way?); publish again with the same msg_id"
            ) from None
        raise errors.ConfigurationError(
            f"no stream answered for subject {subject}: no stream holds it (add it to a "
            "stream's subjects) or JetStream is not enabled"
        ) from None
    except nats.errors.BadHeaderError as exc:
        raise errors.ConfigurationError(
            f"invalid header name {str(exc).rsplit(': ', 1)[-1]}: NATS header names are "
            "letters, digits and !#$%&'*+-.^_`|~"
        ) from None
    except nats.errors.MaxPayloadError as exc:
        raise errors.PayloadTooLarge(
            f"message to {subject} is above the server's max_payload of {limit} bytes"
        ) from exc
    except nats.js.errors.APIError as exc:
        description = getattr(exc, "description", None) or str(exc)
        raise errors.ConfigurationError(f"publish to {subject} refused: {description}") from exc
    except (nats.errors.Error, asyncio.TimeoutError, OSError) as exc:
        raise errors.NatsUnavailable(
            f"publish to {subject} not acknowledged ({type(exc).__name__}): "
            "it may or may not be stored; publish again with the same msg_id"
        ) from exc


async def _a_stream_holds(nc: NATS, subject: str, timeout_s: float) -> bool:
    """Whether JetStream names a stream holding ``subject``; True when it cannot tell.

    Only a JetStream that answers "none" (or does not exist) makes a publish
    without an answer a configuration error; any doubt leaves it a retry.
    """
    request = json.dumps({"subject": subject}).encode()
    try:
        reply = await nc.request(f"{API_PREFIX}.STREAM.NAMES", request, timeout=timeout_s)
    except nats.errors.NoRespondersError:
        return False  # JetStream is not enabled
    except (nats.errors.Error, asyncio.TimeoutError, OSError):
        return True
    try:
        return bool(json.loads(reply.data).get("streams"))
    except (ValueError, AttributeError):
        return True
