"""eop.contrib.django without servers: Django's DATABASES as eop's URLs, manage.py's arguments."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from eop import errors
from eop.contrib.django import cli, conf, project

DATABASE = {
    "ENGINE": "django.db.backends.postgresql",
    "NAME": "shop",
    "USER": "app",
    "PASSWORD": "p@ss:word/",
    "HOST": "db.internal",
    "PORT": "6432",
    "OPTIONS": {"sslmode": "verify-full", "connect_timeout": 5, "server_side_binding": True},
}


def test_a_databases_entry_becomes_an_asyncpg_url_with_only_its_tls_options() -> None:
    """Credentials survive quoting; asyncpg gets libpq's TLS options (eop.pg.engines maps
    them), not the ones it would refuse, nor Django's own."""
    url = conf.database_url(DATABASE)
    assert url.drivername == "postgresql+asyncpg"
    assert (url.username, url.password, url.host, url.port, url.database) == (
        "app",
        "p@ss:word/",
        "db.internal",
        6432,
        "shop",
    )
    assert dict(url.query) == {"sslmode": "verify-full"}
    assert sa.make_url(url.render_as_string(hide_password=False)).password == "p@ss:word/"


def test_the_psycopg_url_keeps_libpqs_connection_options_and_a_socket_directory() -> None:
    """psycopg reads libpq's options as they are; a HOST that is a directory is a socket."""
    url = conf.database_url({**DATABASE, "HOST": "/var/run/postgresql", "PORT": ""}, "psycopg")
    assert url.drivername == "postgresql+psycopg"
    assert url.host is None
    assert url.port is None
    assert dict(url.query) == {
        "sslmode": "verify-full",
        "connect_timeout": "5",
        "host": "/var/run/postgresql",
    }


def test_the_test_databases_name_replaces_the_configured_one() -> None:
    """Django's test runner migrates test_<NAME>: the URL names the database given."""
    assert conf.database_url(DATABASE, name="test_shop").database == "test_shop"


def test_a_database_that_is_not_postgresql_is_a_clear_error() -> None:
    """eop needs PostgreSQL: SQLite's ENGINE is refused by name."""
    with pytest.raises(errors.ConfigurationError, match=r"sqlite3"):
        conf.database_url({"ENGINE": "django.db.backends.sqlite3", "NAME": "db.sqlite3"})


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (["worker", "--concurrency", "4"], ["worker", project.APP_PATH, "--concurrency", "4"]),
        (["worker"], ["worker", project.APP_PATH]),
        (["status"], ["status", project.APP_PATH]),
        (["worker", "other:app"], ["worker", "other:app"]),
        (["db", "upgrade"], ["db", "upgrade"]),
        (["dlq", "list"], ["dlq", "list"]),
        ([], []),
    ],
)
def test_manage_py_eop_puts_the_projects_app_where_a_command_takes_one(
    given: list[str], expected: list[str]
) -> None:
    """Commands whose first argument is MODULE:APP get the project's; the others use EOP_APP."""
    assert cli.argv_for(given) == expected


def test_settings_eop_keys_are_eops_settings_by_their_env_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``settings.EOP`` takes eop's settings by their EOP_* names without the prefix; APP
    and DATABASE are its own; any other key is an error naming the known ones."""
    monkeypatch.setattr(
        conf, "eop_dict", lambda: {"APP": "x:app", "DATABASE": "default", "MAX_ATTEMPTS": 3}
    )
    assert conf.eop_given() == {"MAX_ATTEMPTS": 3}
    monkeypatch.setattr(conf, "eop_dict", lambda: {"MAX_ATEMPTS": 3})
    with pytest.raises(errors.ConfigurationError, match=r"unknown key 'MAX_ATEMPTS'.*MAX_ATTEMPTS"):
        conf.eop_given()
    monkeypatch.setattr(conf, "eop_dict", lambda: {"DATABASE_URL": "postgresql://x/y"})
    with pytest.raises(errors.ConfigurationError, match="uses the database of DATABASES"):
        conf.eop_given()


def test_a_refused_value_of_settings_eop_is_named_by_its_key_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bad value in ``settings.EOP`` is reported as ``settings.EOP["KEY"]``, where the
    user set it, not as the EOP_* variable; one from the environment keeps its name."""
    monkeypatch.delenv("EOP_CONCURRENCY", raising=False)
    monkeypatch.setattr(conf, "eop_dict", lambda: {"APP": "x:app", "CONCURRENCY": "abc"})
    with pytest.raises(errors.ConfigurationError) as caught:
        conf.checked()
    assert str(caught.value) == (
        """concurrency (settings.EOP["CONCURRENCY"]) must be a whole number, not 'abc'"""
    )
    monkeypatch.setattr(conf, "eop_dict", lambda: {"APP": "x:app"})
    monkeypatch.setenv("EOP_CONCURRENCY", "abc")
    with pytest.raises(errors.ConfigurationError, match=r"\(EOP_CONCURRENCY\)"):
        conf.checked()


def test_for_psycopg_binds_values_as_a_session_on_psycopg_would() -> None:
    """eop's statements compiled for a bare psycopg cursor: ``%(name)s`` placeholders, every
    value bound, a JSONB value wrapped for psycopg (Django's cursor has no SQLAlchemy)."""
    from psycopg.types.json import Jsonb

    from eop.outbox import sql as outbox_sql
    from eop.pg import models
    from eop.pg.sql import base as base_sql
    from eop.pg.sql import inbox as inbox_sql

    tables = models.tables("custom")
    row = {
        "subscription": "h",
        "stream": "S",
        "stream_epoch": "e",
        "stream_seq": 7,
        "fingerprint": b"f",
        "msg_id": None,
        "subject": "S.a",
        "headers": {"k": "v"},
        "payload": b"\x00p",
        "reason": "rejected",
        "error": "boom",
        "traceback": None,
        "delivery_count": 1,
    }
    text, values = base_sql.for_psycopg(*inbox_sql.insert_dead_letter(tables, row))
    assert "custom.dead_letters" in text
    assert "%(p_headers)s" in text
    assert isinstance(values["p_headers"], Jsonb)
    assert values["p_payload"] == b"\x00p"
    outbox_row = {"msg_id": "m", "subject": "S.a", "headers": b"{}", "payload": b"x"}
    text, values = base_sql.for_psycopg(outbox_sql.insert(tables), outbox_row)
    assert text.startswith('INSERT INTO "custom".outbox')
    assert values == outbox_row
