"""The nats-server versions eop runs on, and what it asks of each.

One minimum for every command: a worker, a relay, ``eop status``, the DLQ and
audit tools and the Spark reader all connect through
:func:`eop.broker.connection.connect_nats`, which refuses an older server in
one line naming its version and the fix (docs/servers.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from eop import errors

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

MINIMUM = (2, 10)
"""The oldest nats-server minor eop supports.

Before 2.10 a stream has no metadata (eop's epoch id, which tells a recreated
stream from the old one, would be dropped silently) and no subject transforms
(an ordered handler's partitions); 2.9 no longer gets fixes upstream, and the
chaos suite runs against 2.10 and newer only.
"""

PERSIST_MODE = (2, 12)
"""The first minor with a stream's ``persist_mode`` (``async`` may acknowledge a
message before it is on disk)."""


def version_of(nc: NATS) -> tuple[int, int, int] | None:
    """The connected server's (major, minor, patch), or None when it is not known."""
    version = nc.connected_server_version
    # nats-py says 0.0.0 before the server's INFO arrived.
    if version.major == 0:
        return None
    return (version.major, version.minor, version.patch)


def shown(version: tuple[int, ...]) -> str:
    """A version as nats-server prints it (``2.10.26``)."""
    return ".".join(map(str, version))


def check_supported(nc: NATS, where: str) -> None:
    """Refuse a nats-server older than :data:`MINIMUM`; accept one of unknown version."""
    version = version_of(nc)
    if version is not None and version[:2] < MINIMUM:
        raise errors.ConfigurationError(
            f"nats-server {shown(version)} at {where} is too old: eop needs nats-server "
            f"{shown(MINIMUM)} or newer (stream metadata, subject transforms). Upgrade the "
            "server (see docs/servers.md)"
        )
