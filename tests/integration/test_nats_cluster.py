"""eop on a three-server NATS cluster: replicated streams and consumers, and `eop status`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
import structlog
import structlog.testing
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

import eop
from eop import errors
from eop.broker import floors, jetstream
from eop.handler import StreamSpec
from eop.ordering import partitions
from eop.tools.embedded_cluster import NatsCluster

from ..conftest import unavailable
from .bed import STREAM, SUBJECT, create_effects_table, drained, effects_by_body, publish, wait_for
from .test_cli import Workers, consumer_exists, eop_env
from .test_cli import eop as run_eop

APP = "tests.integration.clusterapp:app"


@pytest.fixture
def cluster() -> Iterator[NatsCluster]:
    """Three clustered nats-servers with JetStream, for this test alone."""
    try:
        nodes = NatsCluster()
    except errors.ServerBinaryNotFound as exc:
        unavailable(str(exc))
    with nodes:
        yield nodes


async def consumer_led(js: Any) -> bool:
    """True once the consumer's group has elected a leader."""
    try:
        info = await js.consumer_info(STREAM, "eop-billing")
    except (nats.errors.Error, TimeoutError):
        return False  # no leader yet to answer
    return bool(info.cluster and info.cluster.leader)


async def published(js: Any, body: str) -> bool:
    """Whether publishing ``body`` (its msg-id its body) got an ack this time."""
    try:
        await publish(js, body, msg_id=body)
    except (nats.errors.Error, TimeoutError):
        return False
    return True


async def _status_json(env: dict[str, str]) -> dict[str, Any]:
    result = run_eop("status", APP, "--json", env=env)
    assert result.returncode == 0, result.stderr
    [row] = json.loads(result.stdout)
    assert isinstance(row, dict)
    return row


async def test_a_worker_creates_an_r3_stream_and_consumer_and_status_shows_their_leaders(
    cluster: NatsCluster, database_url: str, engine: AsyncEngine, tmp_path: Path
) -> None:
    """`eop worker` against the three URLs creates the declared R3 stream and a consumer
    with as many replicas; `eop status` (--json and the table) shows the replicas, the
    leaders of both and each follower's state, and a killed server as offline."""
    await create_effects_table(engine)
    env = eop_env(database_url, cluster.url)
    workers = Workers(env, tmp_path, app=APP)
    nc = await nats.connect(cluster.url.split(","))
    try:
        js = nc.jetstream()
        workers.start()
        await wait_for(lambda: consumer_exists(js, "eop-billing"), 30, "the consumer")
        await wait_for(lambda: consumer_led(js), 30, "the consumer's leader")
        stream = await js.stream_info(STREAM)
        consumer = await js.consumer_info(STREAM, "eop-billing")
        assert stream.config.num_replicas == 3
        assert stream.cluster is not None
        assert consumer.cluster is not None
        assert len(consumer.cluster.replicas or []) == 2  # the leader's two followers
        for i in range(20):
            await publish(js, f"m{i}", msg_id=f"id-{i}")
        await wait_for(lambda: drained(js, "eop-billing"), 30, "the messages")
        assert await effects_by_body(engine) == {f"m{i}": 1 for i in range(20)}

        row = await _status_json(env)
        assert row["stream_replicas"] == row["consumer_replicas"] == 3
        assert row["stream_leader"] in cluster.names
        assert row["consumer_leader"] in cluster.names
        assert {f["name"] for f in row["stream_followers"]} == set(cluster.names) - {
            row["stream_leader"]
        }
        assert (row["num_pending"], row["ack_pending"]) == (0, 0)
        table = run_eop("status", APP, env=env)
        assert table.returncode == 0, table.stderr
        assert "STREAM LEADER" in table.stdout
        assert f"{row['stream_followers'][0]['name']} current" in table.stdout

        # A follower of the stream (not a leader of either, nor of the meta group)
        # crashes: shown behind, its group's leader no longer hearing from it.
        # Rather not the consumer's leader either, but three servers may lead three groups.
        spared = [
            n for n in cluster.names if n not in (row["stream_leader"], cluster.meta_leader())
        ]
        follower = sorted(spared, key=lambda n: n == row["consumer_leader"])[0]
        cluster.kill(follower)
        # Our own connection may have been to it: the same msg-id again until stored.
        await wait_for(lambda: published(js, "after"), 30, "a publish after the crash")

        async def behind() -> bool:
            result = run_eop("status", APP, "--json", env=env)
            if result.returncode != 0:
                # The consumer's leader may have been the one killed: no answer until
                # its group elects another. Said so, as a problem (exit 1).
                assert "did not answer" in result.stderr, result.stderr
                return False
            [row] = json.loads(result.stdout)
            return any(f["name"] == follower and not f["current"] for f in row["stream_followers"])

        await wait_for(behind, 60, f"{follower} shown behind")
        table = run_eop("status", APP, env=env)
        assert f"{follower} behind by" in table.stdout or f"{follower} not current" in table.stdout
        assert f"its replica on {follower} is not current" in table.stdout
    finally:
        assert workers.stop_all() == [0]
        await nc.close()


async def test_an_existing_stream_with_other_replicas_is_left_as_it_is_with_a_warning(
    cluster: NatsCluster,
) -> None:
    """An R1 stream that an app declares with replicas=3 is used as it is, and eop says
    so (stream.replicas_differ, with the `nats stream edit` that changes it)."""
    nc = await nats.connect(cluster.url.split(","))
    try:
        js = nc.jetstream()
        await jetstream.ensure_stream(js, StreamSpec(STREAM, ("ORDERS.>",)), create=True)
        with structlog.testing.capture_logs() as logs:
            spec = StreamSpec(STREAM, ("ORDERS.>",), replicas=3)
            await jetstream.ensure_stream(js, spec, create=True)
        assert (await js.stream_info(STREAM)).config.num_replicas == 1
        [warning] = [e for e in logs if e["event"] == "stream.replicas_differ"]
        assert (warning["replicas"], warning["declared"]) == (1, 3)
        assert warning["fix"] == f"nats stream edit {STREAM} --replicas 3"
    finally:
        await nc.close()


async def test_replicas_on_a_single_server_are_one_clear_error(nats_url: str) -> None:
    """replicas=3 against a server that is not in a cluster: a ConfigurationError that says
    what a replicated stream needs, not the server's bare refusal."""
    nc = await nats.connect(nats_url)
    try:
        spec = StreamSpec(STREAM, ("ORDERS.>",), replicas=3)
        with pytest.raises(eop.ConfigurationError, match="needs a NATS cluster"):
            await jetstream.ensure_stream(nc.jetstream(), spec, create=True)
    finally:
        await nc.close()


async def test_a_placement_no_server_matches_is_one_clear_error(cluster: NatsCluster) -> None:
    """placement_tags that no server of the cluster carries: the server's refusal, and
    what the stream needs, in one ConfigurationError."""
    nc = await nats.connect(cluster.url.split(","))
    try:
        spec = StreamSpec(STREAM, ("ORDERS.>",), replicas=3, placement_tags=("ssd",))
        with pytest.raises(eop.ConfigurationError, match="matching its placement") as caught:
            await jetstream.ensure_stream(nc.jetstream(), spec, create=True)
        assert "placement" in str(caught.value).split("(")[0]
    finally:
        await nc.close()


async def test_an_ordered_partition_handed_over_twice_on_r3_starts_above_what_was_acked(
    cluster: NatsCluster,
) -> None:
    """An ordered handler's partition changes owner twice with nothing acked in between, on
    a replicated stream. A replicated consumer created at a start sequence reports an ack
    floor of 0 until its first ack (a single server: the start minus one), so the third
    owner's consumer started at the stream's first message: every message delivered
    again, skipped one by one, for as long as the stream is. Each consumer now starts where
    the first left off, and its floor (for the watermark, `eop status` and the audit) is
    never below its start."""
    app = eop.App()

    @app.handler(stream=STREAM, subject=SUBJECT, name="ordered", order_by="subject:1")
    async def ordered(msg: eop.Message, session: AsyncSession) -> None:
        """Never run: the test opens the partition's consumers itself."""

    spec = app.handlers["ordered"]
    settings = eop.Settings()
    nc = await nats.connect(cluster.url.split(","))
    try:
        js = nc.jetstream()
        await jetstream.ensure_stream(
            js, StreamSpec(STREAM, ("ORDERS.>",), replicas=3), create=True
        )
        for i in range(30):
            await publish(js, f"m{i}")
        first = await partitions.open_consumer(js, spec, settings, 0, 1, None)
        assert first.start is None  # the first owner starts at the stream's start
        sub = await js.pull_subscribe_bind(first.name, STREAM)
        for msg in await sub.fetch(30, timeout=10):
            await msg.ack_sync()
        assert await partitions.floor(js, STREAM, [first.name]) == 30

        async def handed_over(epoch: int, previous: str) -> partitions.Opened:
            opened = await partitions.open_consumer(js, spec, settings, 0, epoch, previous)
            await partitions.retire(js, STREAM, [previous])
            return opened

        second = await handed_over(2, first.name)
        assert second.start == 31
        # Nothing published, nothing acked: the replicated consumer says 0 itself.
        info = await js.consumer_info(STREAM, second.name)
        assert int(info.ack_floor.stream_seq if info.ack_floor else 0) == 0
        assert floors.acked_through(info) == 30
        await publish(js, "m30")  # pending: the floor is the consumer's own, not the stream's
        assert await partitions.floor(js, STREAM, [second.name]) == 30
        third = await handed_over(3, second.name)
        assert third.start == 31
        sub = await js.pull_subscribe_bind(third.name, STREAM)
        [msg] = await sub.fetch(30, timeout=10)
        assert msg.data == b"m30"
    finally:
        await nc.close()
