"""NATS authentication and TLS against real nats-servers configured for each mode.

Every mode runs a real worker (through eop's own connect path) that processes
messages exactly once into the shared PostgreSQL; every mode's negative case
fails at once with an error that names the cause and carries no secret.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import nkeys
import pytest
import structlog
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

import eop
from eop import errors, nats_access
from eop.broker import connection
from eop.contrib.spark import offsets, reader
from eop.runtime.worker import Worker
from eop.tools import embedded

from .authbed import CertificateAuthority, new_nkey, new_operator
from .bed import (
    STREAM,
    SUBJECT,
    bed_settings,
    create_effects_table,
    drained,
    effects_by_body,
    error_lines,
    publish,
    record_effect,
    running,
    wait_for,
)
from .test_cli import eop_env

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "s3cr@t/pa:ss"  # characters that need quoting in a URL
TOKEN = "tok-5f1e9b0c"


@dataclasses.dataclass
class Mode:
    """A server configuration, the settings that get in, and settings that must not."""

    config: str
    good: dict[str, Any]
    bad: dict[str, Any]
    refused: type[errors.EopError]
    secret: str = ""
    url_credentials: str = ""


def _tls(tmp: Path, *, mutual: bool = False, handshake_first: bool = False) -> Mode:
    ca = CertificateAuthority(tmp)
    server = ca.issue("server", dns=("nats.eop.test",))
    client = ca.issue("client", client=True)
    lines = [f'cert_file: "{server.cert}"', f'key_file: "{server.key}"']
    if mutual:
        lines += [f'ca_file: "{ca.path}"', "verify: true"]
    if handshake_first:
        lines.append("handshake_first: true")
    good: dict[str, Any] = {"nats_tls_ca_file": str(ca.path), "nats_tls_hostname": "nats.eop.test"}
    if handshake_first:
        good["nats_tls_handshake_first"] = True
    if mutual:
        # The negative case: the right CA and name, but no client certificate.
        bad = dict(good)
        good.update(nats_tls_cert_file=str(client.cert), nats_tls_key_file=str(client.key))
    else:
        # The negative case: the certificate names another host than the URL's.
        bad = {k: v for k, v in good.items() if k != "nats_tls_hostname"}
    return Mode(
        config="tls {\n  " + "\n  ".join(lines) + "\n}\n",
        good=good,
        bad=bad,
        refused=errors.NatsTlsError,
    )


def make_mode(name: str, tmp: Path) -> Mode:
    """The server configuration and client settings of mode ``name``."""
    if name == "user_password":
        return Mode(
            config=f'authorization {{ user: alice, password: "{PASSWORD}" }}\n',
            good={"nats_user": "alice", "nats_password": PASSWORD},
            bad={"nats_user": "alice", "nats_password": "not-" + PASSWORD},
            refused=errors.NatsAuthenticationFailed,
            secret="not-" + PASSWORD,
        )
    if name == "user_password_in_url":
        quoted = PASSWORD.replace("@", "%40").replace("/", "%2F").replace(":", "%3A")
        return Mode(
            config=f'authorization {{ user: alice, password: "{PASSWORD}" }}\n',
            good={},
            bad={},
            refused=errors.NatsAuthenticationFailed,
            url_credentials=f"alice:{quoted}@",
            secret=quoted,
        )
    if name == "token":
        return Mode(
            config=f'authorization {{ token: "{TOKEN}" }}\n',
            good={"nats_token": TOKEN},
            bad={"nats_token": TOKEN + "x"},
            refused=errors.NatsAuthenticationFailed,
            secret=TOKEN + "x",
        )
    if name == "nkey":
        user, stranger = new_nkey(nkeys.PREFIX_BYTE_USER), new_nkey(nkeys.PREFIX_BYTE_USER)
        (tmp / "user.nk").write_bytes(user.seed)
        (tmp / "stranger.nk").write_bytes(stranger.seed)
        return Mode(
            config=f"authorization {{ users = [ {{ nkey: {user.public} }} ] }}\n",
            good={"nats_nkey_seed_file": str(tmp / "user.nk")},
            bad={"nats_nkey_seed_file": str(tmp / "stranger.nk")},
            refused=errors.NatsAuthenticationFailed,
            secret=stranger.seed.decode(),
        )
    if name == "creds":
        operator, stranger = new_operator(), new_operator()
        return Mode(
            config=operator.server_config(),
            good={"nats_creds_file": str(operator.creds(tmp / "user.creds"))},
            bad={"nats_creds_file": str(stranger.creds(tmp / "stranger.creds"))},
            refused=errors.NatsAuthenticationFailed,
            secret=stranger.user.seed.decode(),
        )
    if name == "tls":
        return _tls(tmp)
    if name == "mutual_tls":
        return _tls(tmp, mutual=True)
    if name == "tls_handshake_first":
        return _tls(tmp, handshake_first=True)
    raise AssertionError(name)


MODES = [
    "user_password",
    "user_password_in_url",
    "token",
    "nkey",
    "creds",
    "tls",
    "mutual_tls",
    "tls_handshake_first",
]


@pytest.fixture
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[embedded.NatsServer]:
    """A nats-server configured for the test's mode (``request.param``)."""
    request.node.mode = make_mode(request.param, tmp_path)
    try:
        nats = embedded.NatsServer(config=request.node.mode.config)
    except errors.ServerBinaryNotFound as exc:
        pytest.skip(str(exc))
    with nats:
        yield nats


@pytest.fixture
def secured(request: pytest.FixtureRequest, server: embedded.NatsServer) -> tuple[Mode, str]:
    """The test's mode, and its server's URL (with the mode's URL credentials)."""
    mode: Mode = request.node.mode
    return mode, f"nats://{mode.url_credentials}{embedded.HOST}:{server.port}"


def access_of(url: str, settings: dict[str, Any]) -> nats_access.NatsAccess:
    """The access the ``nats_*`` settings describe."""
    return nats_access.NatsAccess(
        url=url, **{k.removeprefix("nats_"): v for k, v in settings.items()}
    )


def make_app(database_url: str, url: str, auth: dict[str, Any]) -> eop.App:
    """An app whose handler records one effect per message."""
    app = eop.App(settings=bed_settings(database_url, url, **auth))
    app.stream(STREAM, subjects=["ORDERS.>"], storage="file")

    @app.handler(stream=STREAM, subject=SUBJECT, name="secure")
    async def handle(msg: eop.Message, session: AsyncSession) -> None:
        await record_effect(session, "secure", msg)

    return app


@pytest.mark.parametrize("server", MODES, indirect=True)
async def test_worker_processes_each_message_once_through_the_secured_server(
    secured: tuple[Mode, str], database_url: str, engine: AsyncEngine
) -> None:
    """Each auth/TLS mode: a real worker connects with the settings and takes every effect once."""
    mode, url = secured
    await create_effects_table(engine)
    app = make_app(database_url, url, mode.good)
    nc = await connection.connect_nats(access_of(url, mode.good), name="eop-test-publisher")
    try:
        js = nc.jetstream()
        async with running(app):
            await wait_for(lambda: drained(js, "eop-secure"), what="the consumer")
            for i in range(10):
                await publish(js, f"m-{i}", msg_id=f"id-{i}")
            await publish(js, "m-0", msg_id="id-0")  # a republish: the server drops it
            await wait_for(lambda: drained(js, "eop-secure"), what="all messages acked")
    finally:
        await nc.close()
    assert await effects_by_body(engine) == {f"m-{i}": 1 for i in range(10)}


@pytest.mark.parametrize("server", MODES, indirect=True)
async def test_worker_with_wrong_credentials_fails_at_once_with_a_clear_error(
    secured: tuple[Mode, str], database_url: str
) -> None:
    """Wrong password/token/key/creds, wrong host, no client cert: refused, named, no secret."""
    mode, url = secured
    if mode.url_credentials:
        url = url.replace(mode.url_credentials, mode.url_credentials.replace(":", ":x", 1))
    app = make_app(database_url, url, mode.bad)
    with pytest.raises(mode.refused) as caught:
        async with running(app):
            pass
    text = str(caught.value)
    assert "refused the authentication" in text or "TLS" in text or "certificate" in text
    if mode.secret:
        assert mode.secret not in text
        assert mode.secret not in repr(app.settings)


@pytest.mark.parametrize("server", ["tls"], indirect=True)
async def test_tls_settings_refuse_a_server_without_tls(
    secured: tuple[Mode, str], nats_server: embedded.NatsServer
) -> None:
    """TLS configured, plain server: refused before credentials go out in the clear."""
    mode, _ = secured
    access = access_of(nats_server.url, {**mode.good, "nats_user": "u", "nats_password": "p"})
    with pytest.raises(errors.NatsTlsError, match="does not offer TLS"):
        await connection.connect_nats(access, name="eop-test")


@pytest.mark.parametrize("server", ["user_password"], indirect=True)
async def test_auth_failure_is_a_single_attempt(
    secured: tuple[Mode, str], server: embedded.NatsServer
) -> None:
    """A refused authentication is not retried: the server sees exactly one attempt."""
    mode, url = secured
    with pytest.raises(errors.NatsAuthenticationFailed):
        await connection.connect_nats(access_of(url, mode.bad), name="eop-test")
    violations = [line for line in server.log().splitlines() if "authentication error" in line]
    assert len(violations) == 1, server.log()


@pytest.mark.parametrize("server", ["token", "mutual_tls"], indirect=True)
async def test_spark_reader_reads_through_the_secured_server(secured: tuple[Mode, str]) -> None:
    """The Spark source's reader connects with the same settings, from Spark's options."""
    mode, url = secured
    access = access_of(url, mode.good)
    nc = await connection.connect_nats(access, name="eop-test-publisher")
    try:
        js = nc.jetstream()
        await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
        for i in range(3):
            await publish(js, f"s-{i}")
    finally:
        await nc.close()
    opts = offsets.SourceOptions.parse(
        {k.lower(): v for k, v in {**access.spark_options(), "stream": STREAM}.items()}
    )
    assert opts.nats == access
    state = await _in_thread(reader.state_once, opts.nats, STREAM)
    seqs = offsets.split(STREAM, state.epoch, None, 1, state.next_seq, 10)[0]
    batches = await _in_thread(lambda: list(reader.iterate(opts.nats, seqs)))
    rows = [row for batch in batches for row in batch]
    assert [r[5] for r in rows] == [b"s-0", b"s-1", b"s-2"]


async def _in_thread(func: Callable[..., Any], *args: Any) -> Any:
    # The reader's sync API runs event loops of its own: not on the test's loop.
    return await asyncio.to_thread(func, *args)


@pytest.mark.parametrize("server", ["user_password"], indirect=True)
def test_cli_worker_with_a_wrong_password_exits_with_the_reason(
    secured: tuple[Mode, str], database_url: str
) -> None:
    """`eop worker` as a user runs it: exit 1, 'refused the authentication', no password shown."""
    _, url = secured
    env = dict(os.environ)
    env.update(
        EOP_DATABASE_URL=database_url,
        EOP_NATS_URL=url,
        EOP_NATS_USER="alice",
        EOP_NATS_PASSWORD="wrong-" + PASSWORD,
        EOP_PROCESSES="1",
        PYTHONPATH=str(ROOT),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "eop", "worker", "tests.integration.cliapp:app"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    assert "refused the authentication (user and password)" in proc.stderr
    assert PASSWORD not in proc.stderr + proc.stdout


NEW_PASSWORD = "n3w-" + PASSWORD


def _users(password: str) -> str:
    return f'authorization {{ user: alice, password: "{password}" }}\n'


def _worker(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """`eop worker` on the CLI tests' app, its output into ``log``."""
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "eop", "worker", "tests.integration.cliapp:app"],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=out,
        )


async def _exited(proc: subprocess.Popen[bytes]) -> bool:
    return proc.poll() is not None


@pytest.mark.parametrize("change", ["reload", "restart"])
async def test_cli_worker_whose_password_is_changed_stops_and_exits_with_the_reason(
    change: str, tmp_path: Path, database_url: str, engine: AsyncEngine
) -> None:
    """Password changed under a running `eop worker` (SIGHUP reload or restart of the server).

    After ``nats_auth_refusals`` refused reconnects it logs ``nats.auth_refused``
    once (no password), stops as on SIGTERM and exits 1 with the reason; a
    worker given the new password then takes the rest: every effect once.
    """
    conf = tmp_path / "nats.conf"
    conf.write_text(_users(PASSWORD))
    try:
        server = embedded.NatsServer(args=["-c", str(conf)])
    except errors.ServerBinaryNotFound as exc:
        pytest.skip(str(exc))
    with server:
        await create_effects_table(engine)
        env = eop_env(
            database_url,
            server.url,
            EOP_NATS_USER="alice",
            EOP_NATS_PASSWORD=PASSWORD,
            EOP_ACK_GIVE_UP_S="1",
            EOP_CONCURRENCY="4",
            EOP_BATCH="4",
            CLIAPP_HANDLER_DELAY_S="0.02",
            PYTHONPATH=str(ROOT),
        )
        first = _worker(env, tmp_path / "first.log")
        try:
            nc = await connection.connect_nats(
                access_of(server.url, {"nats_user": "alice", "nats_password": PASSWORD}),
                name="eop-test-publisher",
            )
            try:
                js = nc.jetstream()
                await wait_for(lambda: drained(js, "eop-cli"), what="the worker's consumer")
                for i in range(40):
                    await publish(js, f"m-{i}", msg_id=f"id-{i}")
                # Some effects in, some messages still in flight or not fetched yet.
                await wait_for(lambda: _at_least(engine, 5), what="the first effects", timeout_s=10)
            finally:
                await nc.close()
            conf.write_text(_users(NEW_PASSWORD))
            if change == "reload":
                os.kill(server.pid or 0, signal.SIGHUP)
            else:
                server.restart()
            await wait_for(lambda: _exited(first), what="the worker to exit", timeout_s=15)
        finally:
            if first.poll() is None:
                first.kill()
            first.wait()
        output = (tmp_path / "first.log").read_text()
        assert first.returncode == 1, output
        assert PASSWORD not in output  # also a part of NEW_PASSWORD
        events = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
        names = [e["event"] for e in events if e["event"] != "command.failed"]
        refused = [e for e in events if e["event"] == "nats.auth_refused"]
        assert len(refused) == 1, output
        assert refused[0]["level"] == "error"
        assert "nats.closed" not in names
        # The stop of a SIGTERM, after the refusal.
        assert names.index("nats.auth_refused") < names.index("worker.stopping")
        assert names[-1] == "worker.stopped", output
        (last,) = error_lines(output)
        assert last.startswith(
            f"eop: error: NATS at {server.url} refused the authentication (user and password)"
        ), last
        if change == "restart" or refused[0]["refusals"] > 1:
            assert refused[0]["refusals"] == 3
            assert "3 reconnects in a row refused" in output
        else:
            # Servers that end the live connection on reload with an
            # authorization violation, rather than dropping it (as 2.9 does).
            assert "the server closed the connection" in output

        # A worker given the new password: the messages left over, each once.
        new = {"nats_user": "alice", "nats_password": NEW_PASSWORD}
        env["EOP_NATS_PASSWORD"] = NEW_PASSWORD
        second = _worker(env, tmp_path / "second.log")
        try:
            nc = await connection.connect_nats(
                access_of(server.url, new), name="eop-test-publisher"
            )
            try:
                js = nc.jetstream()
                for i in range(40, 50):
                    await publish(js, f"m-{i}", msg_id=f"id-{i}")
                await wait_for(lambda: drained(js, "eop-cli"), what="all messages acked")
            finally:
                await nc.close()
            second.send_signal(signal.SIGTERM)
            assert second.wait(timeout=30) == 0, (tmp_path / "second.log").read_text()
        finally:
            if second.poll() is None:
                second.kill()
                second.wait()
    assert await effects_by_body(engine) == {f"m-{i}": 1 for i in range(50)}


async def _at_least(engine: AsyncEngine, count: int) -> bool:
    return sum((await effects_by_body(engine)).values()) >= count


async def test_worker_whose_credentials_expire_stops_with_the_reason(
    tmp_path: Path, database_url: str, engine: AsyncEngine
) -> None:
    """A user JWT expiring under a running worker: the server ends the connection.

    nats-py does not reconnect a connection the server ended with an error,
    so the worker would idle for ever; instead it logs ``nats.auth_refused``,
    stops and raises :class:`eop.errors.NatsReauthenticationFailed`.
    """
    operator = new_operator()
    lasting = {"nats_creds_file": str(operator.creds(tmp_path / "user.creds"))}
    try:
        server = embedded.NatsServer(config=operator.server_config())
    except errors.ServerBinaryNotFound as exc:
        pytest.skip(str(exc))
    with server:
        await create_effects_table(engine)
        nc = await connection.connect_nats(access_of(server.url, lasting), name="eop-test")
        # Long enough for the worker to start and process, short for the test.
        jwt = operator.user_jwt_expiring(int(time.time()) + 6)
        expiring = operator.creds(tmp_path / "expiring.creds", user_jwt=jwt)
        app = make_app(database_url, server.url, {"nats_creds_file": str(expiring)})
        try:
            js = nc.jetstream()
            with structlog.testing.capture_logs() as logs:
                worker = Worker(app)
                task = asyncio.create_task(worker.run())
                await wait_for(lambda: drained(js, "eop-secure"), what="the worker's consumer")
                for i in range(5):
                    await publish(js, f"m-{i}", msg_id=f"id-{i}")
                await wait_for(lambda: drained(js, "eop-secure"), what="all messages acked")
                with pytest.raises(errors.NatsReauthenticationFailed, match="closed the conn"):
                    await asyncio.wait_for(task, timeout=20)
        finally:
            await nc.close()
    events = [entry["event"] for entry in logs]
    assert events.count("nats.auth_refused") == 1, logs
    assert events.index("nats.auth_refused") < events.index("worker.stopping")
    assert events[-1] == "worker.stopped"
    assert await effects_by_body(engine) == {f"m-{i}": 1 for i in range(5)}
