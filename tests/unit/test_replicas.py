"""Replicated streams without a server: declaring replicas and placement, and what
`eop status` makes of a stream's and consumer's group."""

from __future__ import annotations

import nats.errors
import pytest
from nats.js import api

import eop
from eop.broker import jetstream
from eop.handler import StreamSpec
from eop.ops import status


@pytest.mark.parametrize("bad", [0, 6, -1, True, "3", 2.0])
def test_replicas_outside_one_to_five_are_a_configuration_error(bad: object) -> None:
    """replicas must be a whole number from 1 to 5 (nats-server's limit); anything else is
    one clear ConfigurationError naming the stream, before any server is asked."""
    app = eop.App(database_url="postgresql+asyncpg://x@localhost/x")
    with pytest.raises(eop.ConfigurationError, match=r"stream 'ORDERS': replicas must"):
        app.stream("ORDERS", subjects=["ORDERS.>"], replicas=bad)  # type: ignore[arg-type]  # the wrong types are the point


def test_replicas_and_placement_reach_the_stream_config_eop_creates() -> None:
    """replicas=3 with a placement cluster and tags (one tag may be a plain string) become
    num_replicas and placement of the stream's config; without them, the server's
    defaults (no num_replicas, no placement)."""
    app = eop.App(database_url="postgresql+asyncpg://x@localhost/x")
    spec = app.stream(
        "ORDERS", subjects=["ORDERS.>"], replicas=3, placement_cluster="east", placement_tags="ssd"
    )
    config = jetstream.stream_config(spec)
    assert config.num_replicas == 3
    assert config.placement == api.Placement(cluster="east", tags=["ssd"])
    plain = jetstream.stream_config(StreamSpec("PLAIN", ("p.>",)))
    assert (plain.num_replicas, plain.placement) == (None, None)


def _cluster(leader: str | None, *peers: api.PeerInfo) -> api.ClusterInfo:
    return api.ClusterInfo(name="eop", leader=leader, replicas=list(peers))


def test_followers_behind_or_offline_and_a_missing_leader_are_warnings() -> None:
    """A follower that is behind (a crashed server stays 'behind', not 'offline'), one that
    is offline, and a group without a leader each give a warning; a healthy group and a
    lone server none."""
    healthy = _cluster("n1", api.PeerInfo(name="n2", current=True, active=1000))
    assert status.group_warnings("stream 'S'", healthy) == []
    assert status.group_warnings("stream 'S'", api.ClusterInfo(leader="NABC")) == []
    sick = _cluster(
        "n1",
        api.PeerInfo(name="n2", current=False, lag=7, active=40 * 10**9),
        api.PeerInfo(name="n3", current=False, offline=True),
    )
    found = status.group_warnings("stream 'S'", sick)
    assert "replica on n2 is not current (n2 behind by 7, seen 40 s ago" in found[0]
    assert "replica on n3 is offline" in found[1]
    leaderless = status.group_warnings("consumer 'c'", _cluster(None))
    assert "consumer 'c' has no leader" in leaderless[0]


def test_status_table_shows_replicas_leaders_and_followers() -> None:
    """Below the handlers' table, one row per handler: its stream's replicas, the leaders
    of the stream and of the consumer, and each follower's state."""
    follower = status.Replica(name="n2", current=True, offline=False, lag=0, active_s=0.1)
    behind = status.Replica(name="n3", current=False, offline=False, lag=4, active_s=12.0)
    s = status.HandlerStatus(
        handler="billing", stream="ORDERS", consumer="eop-billing",
        stream_replicas=3, stream_leader="n1", stream_followers=[follower, behind],
        consumer_replicas=3, consumer_leader="n2", consumer_followers=[],
    )  # fmt: skip
    text = status.format_table([s])
    assert "STREAM LEADER" in text
    assert "n2 current, n3 behind by 4, seen 12 s ago" in text
    assert s.to_json()["stream_followers"][1]["lag"] == 4


def test_a_declared_replicas_count_the_stream_lacks_is_a_warning() -> None:
    """The app declares 3 replicas, the stream has 1: status says so, with the fix; no
    declaration (None) or the same count says nothing."""
    s = status.HandlerStatus(handler="b", stream="ORDERS", consumer="c", stream_replicas=1)
    [warning] = status.replicas_warnings(3, s)
    assert "nats stream edit ORDERS --replicas 3" in warning
    assert status.replicas_warnings(None, s) == status.replicas_warnings(1, s) == []


class _SilentJetStream:
    """account_info() times out ``silent`` times, then answers (or raises ``error``)."""

    def __init__(self, silent: int, error: Exception | None = None) -> None:
        self.silent, self.error, self.asked = silent, error, 0

    def jetstream(self) -> _SilentJetStream:
        return self

    async def account_info(self) -> object:
        self.asked += 1
        if self.error is not None:
            raise self.error
        if self.asked <= self.silent:
            raise nats.errors.TimeoutError
        return object()


async def test_a_silent_jetstream_is_asked_again_but_no_responders_fail_at_once() -> None:
    """A cluster electing its meta leader is silent for seconds: connect asks up to three
    times; a server without JetStream (no responders) fails on the first answer."""
    electing = _SilentJetStream(silent=2)
    await jetstream._jetstream_answers(electing)  # type: ignore[arg-type]  # a fake client
    assert electing.asked == 3
    lost = _SilentJetStream(silent=5)
    with pytest.raises(nats.errors.TimeoutError):
        await jetstream._jetstream_answers(lost)  # type: ignore[arg-type]  # a fake client
    assert lost.asked == jetstream.JETSTREAM_TRIES
    off = _SilentJetStream(silent=0, error=nats.errors.NoRespondersError())
    with pytest.raises(nats.errors.NoRespondersError):
        await jetstream._jetstream_answers(off)  # type: ignore[arg-type]  # a fake client
    assert off.asked == 1
