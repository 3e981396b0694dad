"""A throwaway PgBouncer in front of the test PostgreSQL, for the pooler tests.

PgBouncer refuses to run as root: as root it runs as the ``postgres`` account
(or ``nobody``), as the embedded PostgreSQL does. Its admin console (database
``pgbouncer``) answers ``SHOW CLIENTS`` to user ``postgres``, which is how the
tests count the connections a worker holds.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from typing import Literal

import psycopg

from eop.tools import _child, embedded

Mode = Literal["session", "transaction"]


def binary() -> str | None:
    """``$EOP_TEST_PGBOUNCER``, else the pgbouncer on PATH (or in /usr/sbin), else None."""
    found = os.environ.get("EOP_TEST_PGBOUNCER") or shutil.which("pgbouncer")
    if found is None and os.access("/usr/sbin/pgbouncer", os.X_OK):
        found = "/usr/sbin/pgbouncer"
    return found


#: The first PgBouncer with ``max_prepared_statements`` (Debian bookworm packages 1.18).
PREPARED = (1, 21)


def prepared_binary() -> str | None:
    """A PgBouncer 1.21+: ``$EOP_TEST_PGBOUNCER_PREPARED`` (``python3 run.py test``
    builds one from Debian's source package when the packaged one is older), else
    :func:`binary` when it is new enough, else None."""
    for path in (os.environ.get("EOP_TEST_PGBOUNCER_PREPARED"), binary()):
        if path and version(path) >= PREPARED:
            return path
    return None


def version(path: str) -> tuple[int, ...]:
    """PgBouncer's version, from ``pgbouncer --version`` ("PgBouncer 1.18.0")."""
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=False).stdout
    found = re.search(r"PgBouncer (\d+)\.(\d+)", out)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def no_prepared_statements(path: str) -> dict[str, str]:
    """The settings that turn off PgBouncer's own prepared statements (on by default
    from 1.22; 1.18 has none and knows no such setting)."""
    return {"max_prepared_statements": "0"} if version(path) >= PREPARED else {}


class PgBouncer(_child.Managed):
    """PgBouncer on 127.0.0.1 in ``mode``, trusting user ``postgres``, for every database.

    ``pool_size`` is each (database, user) pool's server connections;
    ``settings`` are extra ``[pgbouncer]`` lines (``max_prepared_statements``...).
    """

    def __init__(
        self,
        path: str,
        postgres: embedded.PostgresCluster,
        mode: Mode,
        *,
        pool_size: int = 5,
        settings: dict[str, str] | None = None,
    ) -> None:
        self._path = path
        self._postgres = postgres
        self.mode = mode
        self.port = embedded.free_port()
        self._pool_size = pool_size
        self._settings = settings or {}
        self._child = _child.Child("pgbouncer", signal.SIGINT)

    def url_for(self, database: str, *, driver: str = "asyncpg") -> str:
        """A SQLAlchemy URL of ``database`` through this PgBouncer."""
        return f"postgresql+{driver}://postgres@{embedded.HOST}:{self.port}/{database}"

    def log(self) -> str:
        """PgBouncer's log so far."""
        return self._child.tail(100_000)

    def start(self) -> None:
        """Write the configuration and start PgBouncer; wait for its port."""
        scratch = self._child.scratch
        (scratch / "users.txt").write_text('"postgres" ""\n')
        lines = {
            "listen_addr": embedded.HOST,
            "listen_port": str(self.port),
            "unix_socket_dir": "",
            "auth_type": "trust",
            "auth_file": str(scratch / "users.txt"),
            "admin_users": "postgres",
            "pool_mode": self.mode,
            "default_pool_size": str(self._pool_size),
            "max_client_conn": "500",
            # A stall surfaces as an error in the worker's log, not a silent wait.
            "query_wait_timeout": "30",
            "pidfile": str(scratch / "pgbouncer.pid"),
            **self._settings,
        }
        target = f"host={embedded.HOST} port={self._postgres.port}"
        config = "[databases]\n* = " + target + "\n\n[pgbouncer]\n"
        config += "".join(f"{key} = {value}\n" for key, value in lines.items())
        ini = scratch / "pgbouncer.ini"
        ini.write_text(config)
        argv = [self._path, str(ini)]
        account = _child.unprivileged_account(("postgres", "pgbouncer", "nobody"), "PgBouncer")
        if account is not None:
            for path in (scratch, ini, scratch / "users.txt"):
                os.chown(path, *account)
        self._child.start(argv, cwd=scratch, account=account)
        _child.wait_for_port(embedded.HOST, self.port, self._child, 20.0)

    def clients(self, database: str) -> int:
        """Client connections to ``database`` PgBouncer holds now (its ``SHOW CLIENTS``)."""
        return sum(1 for row in self.show("CLIENTS") if row["database"] == database)

    def server_prepared_statements(self, database: str) -> int:
        """Prepared statements PgBouncer keeps on its server connections to ``database``
        (the ``prepared_statements`` column of ``SHOW SERVERS``, PgBouncer 1.21+)."""
        rows = self.show("SERVERS")
        return sum(int(row["prepared_statements"]) for row in rows if row["database"] == database)

    def show(self, what: str) -> list[dict[str, str]]:
        """The rows of the admin console's ``SHOW <what>``, column name to text value."""
        dsn = f"host={embedded.HOST} port={self.port} user=postgres dbname=pgbouncer"
        with psycopg.connect(dsn, autocommit=True) as conn:
            # The admin console speaks the simple query protocol only.
            result = conn.pgconn.exec_(f"SHOW {what}".encode())
            names = [(result.fname(i) or b"").decode() for i in range(result.nfields)]
            return [
                {name: (result.get_value(r, c) or b"").decode() for c, name in enumerate(names)}
                for r in range(result.ntuples)
            ]

    def close(self) -> None:
        """Stop PgBouncer and remove its directory."""
        self._child.cleanup()


def unprepared_transaction_mode(
    path: str, postgres: embedded.PostgresCluster, pool_size: int = 3
) -> PgBouncer:
    """PgBouncer in transaction mode without its own prepared statements, on ``pool_size``
    server connections: where a client's cached statements get lost or doubled."""
    return PgBouncer(
        path, postgres, "transaction", pool_size=pool_size, settings=no_prepared_statements(path)
    )
