"""What JetStream says of a stream or a consumer, read alike for every handler's status
and for each partition consumer of an ordered one (:mod:`eop.ops.status`,
:mod:`eop.ordering.status`): its replica group (the leader, each follower's state as
the leader sees it), the ack-pending window, and the stream's persistence.
"""

from __future__ import annotations

import dataclasses

from nats.js import api

#: Share of max_ack_pending from which the window is reported as nearly full.
NEARLY_FULL = 0.9


@dataclasses.dataclass
class Replica:
    """A follower's copy of a stream or consumer, as the group's leader sees it."""

    name: str
    """The server's name."""
    current: bool
    """Up to date with the leader."""
    offline: bool
    lag: int
    """Operations it is behind the leader."""
    active_s: float | None
    """Seconds since the leader last heard from it."""

    def describe(self) -> str:
        """``n2 current``, ``n3 behind by 12, seen 40 s ago``, ``n3 not current``, ``n1 offline``.

        A server that crashed is not offline to its group (that takes a clean
        shutdown): it falls behind, and the leader stops hearing from it.
        """
        if self.offline:
            return f"{self.name} offline"
        if not self.current:
            seen = f", seen {self.active_s:.0f} s ago" if (self.active_s or 0) >= 2 else ""
            state = f"behind by {self.lag}" if self.lag else "not current"
            return f"{self.name} {state}{seen}"
        return f"{self.name} current"


def window_warnings(ack_pending: int, max_ack_pending: int) -> list[str]:
    """Warnings about the ack-pending window (max_ack_pending <= 0 means unlimited)."""
    if max_ack_pending <= 0:
        return []
    if ack_pending >= max_ack_pending:
        return [
            f"WARNING: ack-pending window full ({ack_pending}/{max_ack_pending}): the server "
            "hands out no more messages until some are acked; fetches stall silently "
            "(slow or stuck handlers, or workers that died holding deliveries until AckWait)"
        ]
    if ack_pending >= NEARLY_FULL * max_ack_pending:
        return [
            f"WARNING: ack-pending window nearly full ({ack_pending}/{max_ack_pending}): "
            "fetches stall once it is full"
        ]
    return []


def group(cluster: api.ClusterInfo | None) -> tuple[str | None, list[Replica]]:
    """The leader and followers of a stream's or consumer's group; no leader off a cluster."""
    if cluster is None or not cluster.name:
        # A lone server names itself the leader, by its id: nothing to report.
        return None, []
    followers = [
        Replica(
            name=str(peer.name),
            current=bool(peer.current),
            offline=bool(peer.offline),
            lag=int(peer.lag or 0),
            # The server reports nanoseconds.
            active_s=peer.active / 1e9 if peer.active is not None else None,
        )
        for peer in cluster.replicas or []
    ]
    return cluster.leader or None, followers


def group_warnings(what: str, cluster: api.ClusterInfo | None) -> list[str]:
    """Warnings about a clustered stream's or consumer's replicas: no leader, one offline
    or behind."""
    if cluster is None or not cluster.name:
        return []
    leader, followers = group(cluster)
    found = []
    if leader is None:
        found.append(
            f"WARNING: {what} has no leader (an election is under way, or too few of its "
            "servers are up): publishes, fetches and acks wait until it has one"
        )
    for peer in followers:
        if peer.offline:
            found.append(f"WARNING: {what}: its replica on {peer.name} is offline")
        elif not peer.current:
            found.append(
                f"WARNING: {what}: its replica on {peer.name} is not current "
                f"({peer.describe()}; down, or catching up)"
            )
    return found


def persistence_warnings(stream: str, config: api.StreamConfig) -> list[str]:
    """A stream whose storage can lose messages nats-server acknowledged: ``persist_mode:
    async`` (nats-server 2.12+), or memory storage."""
    mode = config.persist_mode
    if mode is not None and api.PersistMode(mode) is api.PersistMode.ASYNC:
        return [
            f"WARNING: stream {stream!r} has persist_mode async: nats-server acknowledges a "
            "publish before the message is on disk, so a nats-server crash can lose messages "
            "a publisher (or eop's outbox) was told are stored, and no handler ever sees them. "
            "nats-server cannot change it on a stream: recreate the stream without it to keep "
            "every acknowledged message"
        ]
    if config.storage is not None and api.StorageType(config.storage) is api.StorageType.MEMORY:
        return [
            f"WARNING: stream {stream!r} keeps its messages in memory: a nats-server restart "
            "loses those not yet processed (use file storage to keep them)"
        ]
    return []
