"""PostgreSQL TLS through the database URL, against a throwaway TLS-only server."""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from eop.app import App
from eop.pg import migrate
from eop.settings import Settings
from eop.tools import embedded

from .authbed import CertificateAuthority, Pair

SSL_QUERY = "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()"


@pytest.fixture
def certificates() -> Iterator[tuple[Path, Pair]]:
    """A CA file and a server certificate the (unprivileged) PostgreSQL account can read."""
    # Not tmp_path: its parent is private to root, and PostgreSQL runs as another user.
    folder = Path(tempfile.mkdtemp(prefix="eop-pgtls-"))
    folder.chmod(0o755)
    ca = CertificateAuthority(folder)
    cert = ca.issue("db", dns=("db.eop.test",))
    for path in (cert.cert, cert.key):
        # PostgreSQL wants its key private to the account it runs as.
        path.chmod(0o600)
        if os.geteuid() == 0:
            import pwd

            for user in ("postgres", "pgserver", "nobody"):
                try:
                    entry = pwd.getpwnam(user)
                except KeyError:
                    continue
                os.chown(path, entry.pw_uid, entry.pw_gid)
                break
    yield ca.path, cert
    shutil.rmtree(folder, ignore_errors=True)


async def test_async_engine_sync_engine_and_migrations_use_tls_from_the_url(
    certificates: tuple[Path, Pair],
    make_postgres_server: Callable[..., embedded.PostgresServer],
) -> None:
    """sslmode=verify-ca&sslrootcert=...: asyncpg, psycopg and Alembic all connect over TLS."""
    ca_file, cert = certificates
    # pgserver's wheel is built without OpenSSL; a distribution's PostgreSQL has it.
    bin_dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"))
    if not bin_dirs:
        pytest.skip("no PostgreSQL build with SSL (a distribution's server package) here")
    server = make_postgres_server(
        bin_dir=bin_dirs[-1],
        settings={"ssl": "on", "ssl_cert_file": str(cert.cert), "ssl_key_file": str(cert.key)},
    )
    url = server.url + f"?sslmode=verify-ca&sslrootcert={ca_file}"
    migrate.upgrade(url)
    assert migrate.current(url) == migrate.head()
    app = App(settings=Settings(database_url=url))
    try:
        async with app.engine.connect() as conn:
            assert (await conn.execute(sa.text(SSL_QUERY))).scalar() is True
        with app.sync_sessionmaker() as session:
            assert session.execute(sa.text(SSL_QUERY)).scalar() is True
    finally:
        await app.dispose()
