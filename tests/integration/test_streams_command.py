"""`eop streams create`: an app's streams made before any worker runs, as a worker makes
them (docs/deployment.md)."""

from __future__ import annotations

import json

from nats.aio.client import Client as NATS
from nats.js.api import StreamConfig, SubjectTransform

from eop.broker import jetstream
from eop.ordering import partitions

from .bed import error_lines
from .streamsapp import app
from .test_cli import eop, eop_env

APP = "tests.integration.streamsapp:app"


async def test_streams_create_makes_each_stream_a_worker_would_once(
    database_url: str, nats_url: str, nc: NATS
) -> None:
    """The declared stream and each handler's are created, with an epoch id and, for the
    ordered handler of several partitions, its subject transform; a second run changes
    nothing and says they existed. No database is needed."""
    env = eop_env("postgresql+asyncpg://nobody@127.0.0.1:1/none", nats_url)
    first = eop("streams", "create", APP, env=env)
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    assert lines[0].split() == ["stream", "state", "subjects", "partitions", "for"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    assert rows == {
        "SHIPMENTS": ["created", "SHIPMENTS.>", "-"],
        "ORDERS": ["created", "ORDERS.created", "-"],
        "LEDGER": ["created", "ledger.*.entry", "ledger"],
    }
    js = nc.jetstream()
    epochs = {}
    for name in rows:
        info = await js.stream_info(name)
        epochs[name] = (info.config.metadata or {}).get(jetstream.EPOCH_METADATA_KEY)
        assert epochs[name], f"{name} has no epoch id"
    ledger = await js.stream_info("LEDGER")
    partitions.check_transform(ledger, app.handlers["ledger"])  # raises if it lacks it

    again = eop("streams", "create", APP, env=env)
    assert again.returncode == 0, again.stderr
    assert [line.split()[1] for line in again.stdout.splitlines()[1:]] == ["existed"] * 3
    for name, epoch in epochs.items():
        info = await js.stream_info(name)
        assert (info.config.metadata or {}).get(jetstream.EPOCH_METADATA_KEY) == epoch


async def test_streams_create_refuses_an_ordered_handlers_stream_without_its_transform(
    database_url: str, nats_url: str, nc: NATS
) -> None:
    """An existing stream without the subject transform the ordered handler needs is
    refused in one line that names the fix, as a worker would refuse it; nothing else is
    changed on it."""
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="LEDGER", subjects=["ledger.>"]))
    refused = eop("streams", "create", APP, env=eop_env(database_url, nats_url))
    assert refused.returncode == 1, refused.stdout
    [line] = error_lines(refused.stderr.strip())
    assert line.startswith("eop: error: handler 'ledger' spreads its keys over 4 partitions")
    assert "subject transform" in line
    assert "Traceback" not in refused.stderr
    info = await js.stream_info("LEDGER")
    assert info.config.subject_transform is None
    # With the transform set, the stream passes.
    src, dest = partitions.transform(app.handlers["ledger"]) or ("", "")
    config = info.config
    config.subject_transform = SubjectTransform(src=src, dest=dest)
    await js.update_stream(config)
    fixed = eop("streams", "create", APP, env=eop_env(database_url, nats_url))
    assert fixed.returncode == 0, fixed.stderr


def test_streams_create_without_nats_fails_in_one_line(database_url: str) -> None:
    """NATS unreachable: exit 1 with `eop: error:` naming it, no traceback; in JSON with
    EOP_LOG_FORMAT=json."""
    env = eop_env(database_url, "nats://127.0.0.1:1")
    failed = eop("streams", "create", APP, env=env)
    assert failed.returncode == 1
    assert "Traceback" not in failed.stderr
    [entry] = [json.loads(line) for line in failed.stderr.splitlines() if line.strip()]
    assert entry["error"].startswith("NATS is unreachable at nats://127.0.0.1:1")
