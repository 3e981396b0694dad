"""Settings: parsed from EOP_* variables once, validated, frozen."""

from __future__ import annotations

import dataclasses
from typing import Literal, get_origin, get_type_hints

import pytest

from eop import errors
from eop.settings import Settings, env_var

DURATIONS = [f.name for f in dataclasses.fields(Settings) if f.name.endswith("_s")]


def test_from_an_empty_environment_gives_the_defaults() -> None:
    assert Settings.from_env({}) == Settings()


def test_from_env_parses_each_type() -> None:
    settings = Settings.from_env(
        {
            "EOP_CONCURRENCY": "4",
            "EOP_ACK_WAIT_S": "2.5",
            "EOP_CREATE": "off",
            "EOP_LOG_FORMAT": "json",
            "EOP_NATS_URL": "nats://a:4222,nats://b:4222",
            "EOP_SCHEMA": "events",
        }
    )
    assert settings.concurrency == 4
    assert settings.ack_wait_s == 2.5
    assert settings.create is False
    assert settings.log_format == "json"
    assert settings.nats_url == "nats://a:4222,nats://b:4222"
    assert settings.schema == "events"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("1", True),
        ("true", True),
        ("YES", True),
        (" on ", True),
        ("0", False),
        ("False", False),
        ("no", False),
        ("off", False),
    ],
)
def test_from_env_reads_booleans(raw: str, expected: bool) -> None:
    assert Settings.from_env({"EOP_CREATE": raw}).create is expected


def test_from_env_reads_only_the_given_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EOP_BATCH", "7")
    assert Settings.from_env({}).batch == Settings().batch
    assert Settings.from_env().batch == 7


def test_from_env_ignores_unknown_variables() -> None:
    assert Settings.from_env({"EOP_NO_SUCH_THING": "1", "OTHER": "x"}) == Settings()


@pytest.mark.parametrize(
    ("variable", "raw"),
    [
        ("EOP_CONCURRENCY", "four"),
        ("EOP_CONCURRENCY", "1.5"),
        ("EOP_ACK_WAIT_S", "soon"),
        ("EOP_ACK_WAIT_S", ""),
        ("EOP_CREATE", "maybe"),
    ],
)
def test_unparsable_value_is_a_configuration_error_naming_the_variable(
    variable: str, raw: str
) -> None:
    with pytest.raises(errors.ConfigurationError, match=variable) as info:
        Settings.from_env({variable: raw})
    assert repr(raw) in str(info.value)


def test_overrides_win_over_the_environment() -> None:
    settings = Settings.from_env({"EOP_BATCH": "7"}, overrides={"batch": 9})
    assert settings.batch == 9


def test_none_overrides_are_ignored() -> None:
    settings = Settings.from_env({"EOP_BATCH": "7"}, overrides={"batch": None})
    assert settings.batch == 7


@pytest.mark.parametrize("name", ["concurrency", "batch", "max_attempts", "max_ack_pending"])
def test_counts_must_be_at_least_one(name: str) -> None:
    with pytest.raises(
        errors.ConfigurationError, match=rf"{name} \({env_var(name)}\) must be at least 1"
    ):
        Settings(**{name: 0})  # type: ignore[arg-type]


@pytest.mark.parametrize("name", DURATIONS)
def test_durations_must_not_be_negative(name: str) -> None:
    with pytest.raises(
        errors.ConfigurationError, match=rf"{name} \({env_var(name)}\) must be 0 or more"
    ):
        Settings(**{name: -1.0})  # type: ignore[arg-type]


def test_zero_durations_are_allowed() -> None:
    assert Settings(lease_margin_s=0.0).lease_margin_s == 0.0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("log_format", "xml"),
        ("log_level", "verbose"),
        ("db_pooler", "pgbouncer"),
        ("schema", "eop; DROP TABLE x"),
        ("schema", ""),
    ],
)
def test_closed_choices_and_the_schema_are_validated(field: str, value: str) -> None:
    with pytest.raises(errors.ConfigurationError, match=field):
        Settings(**{field: value})  # type: ignore[arg-type]


def test_an_invalid_choice_from_the_environment_is_rejected() -> None:
    with pytest.raises(errors.ConfigurationError, match="log_level"):
        Settings.from_env({"EOP_LOG_LEVEL": "loud"})


def test_settings_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings().batch = 3  # type: ignore[misc]


def test_replace_applies_changes_and_ignores_none() -> None:
    base = Settings(batch=3)
    changed = base.replace(batch=None, concurrency=2)
    assert (changed.batch, changed.concurrency) == (3, 2)
    assert base.concurrency == Settings().concurrency


def test_replace_validates() -> None:
    with pytest.raises(errors.ConfigurationError):
        Settings().replace(concurrency=0)


def test_env_var_names_a_field() -> None:
    assert env_var("ack_wait_s") == "EOP_ACK_WAIT_S"


def test_every_field_has_help_text() -> None:
    for field in dataclasses.fields(Settings):
        assert field.metadata.get("help"), field.name


@pytest.mark.parametrize("raw", ["nan", "NaN"])
def test_a_nan_duration_is_rejected(raw: str) -> None:
    with pytest.raises(errors.ConfigurationError, match="EOP_ACK_WAIT_S"):
        Settings.from_env({"EOP_ACK_WAIT_S": raw})


def test_an_invalid_value_from_the_environment_names_the_variable() -> None:
    with pytest.raises(errors.ConfigurationError, match="EOP_CONCURRENCY"):
        Settings.from_env({"EOP_CONCURRENCY": "0"})


@pytest.mark.parametrize("ack_wait_s", [2.0, 1.0, 0.0])
def test_a_lease_margin_not_below_ack_wait_is_rejected(ack_wait_s: float) -> None:
    with pytest.raises(errors.ConfigurationError, match="lease_margin_s"):
        Settings(ack_wait_s=ack_wait_s)


def test_db_pooler_defaults_to_auto_and_reads_each_choice_from_the_environment() -> None:
    """EOP_DB_POOLER takes each of its choices; auto is the default."""
    assert Settings().db_pooler == "auto"
    for choice in ("auto", "none", "session", "transaction", "transaction_prepared"):
        assert Settings.from_env({"EOP_DB_POOLER": choice}).db_pooler == choice


def test_a_bad_db_pooler_names_the_variable_and_the_choices() -> None:
    with pytest.raises(errors.ConfigurationError, match="EOP_DB_POOLER") as caught:
        Settings.from_env({"EOP_DB_POOLER": "pgbouncer"})
    assert "transaction_prepared" in str(caught.value)


@pytest.mark.parametrize(
    "schema",
    ["a'b", "a;b", "a b", "", "a" * 64, "Eop", "1eop", "pg_eop", 'e"op', "eop-x", "é"],
)
def test_a_schema_that_is_not_a_plain_lowercase_name_is_refused(schema: str) -> None:
    """Quotes, semicolons, spaces, upper case, an empty name, a pg_ prefix or more than
    63 bytes: refused with the variable and the rule, before any SQL is written."""
    with pytest.raises(errors.ConfigurationError, match=r"schema \(EOP_SCHEMA\) must") as info:
        Settings(schema=schema)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("schema", ["eop", "billing_eop", "a" * 63, "_x1"])
def test_plain_lowercase_schema_names_are_accepted(schema: str) -> None:
    assert Settings(schema=schema).schema == schema


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("database_url", "mysql://u@h/db", "PostgreSQL URL"),
        ("database_url", "not a url", "must be a URL"),
        ("nats_url", "http://h:4222", "NATS server URLs"),
        ("nats_url", "nats://h:99999", "NATS server URLs"),
        ("nats_url", "nats://a:4222,,nats://b", "NATS server URLs"),
        ("metrics_port", 70000, "at most 65535"),
        ("metrics_port", -1, "0 or more"),
        ("metrics_host", "two words", "IP address"),
        ("processes", -1, "0 or more"),
        ("ack_wait_s", float("inf"), "finite"),
        ("concurrency", True, "whole number"),
        ("concurrency", 2.5, "whole number"),
        ("create", "yes", "true or false"),
        ("log_level", "loud", "one of debug, info, warning, error"),
        ("schema", 5, "must be text"),
    ],
)
def test_every_field_is_checked_by_type_range_and_syntax(
    field: str, value: object, rule: str
) -> None:
    """The generic pass over the fields: types, ranges, choices and URL syntax, each
    refusal naming the field, its EOP_ variable and the rule."""
    with pytest.raises(errors.ConfigurationError, match=rf"{field} \({env_var(field)}\)") as info:
        Settings(**{field: value})  # type: ignore[arg-type]
    assert rule in str(info.value)


def test_a_refused_url_or_secret_is_never_echoed() -> None:
    """The message shows a refused URL without its password, and a secret not at all."""
    with pytest.raises(errors.ConfigurationError) as info:
        Settings(database_url="mysql://user:hunter2@h/db")
    assert "hunter2" not in str(info.value)
    with pytest.raises(errors.ConfigurationError) as info:
        Settings.from_env({"EOP_NATS_URL": "http://tok3n-secret@h"})
    assert "tok3n-secret" not in str(info.value)
    with pytest.raises(errors.ConfigurationError) as info:
        Settings(nats_password=7)  # type: ignore[arg-type]
    assert "7" not in str(info.value).split("not", 1)[-1]


def test_a_field_added_later_is_checked_without_being_listed() -> None:
    """The pass reads types and metadata: a new dataclass with the same helpers is
    checked too (what the PgBouncer or any later field gets for free)."""
    from eop import rules

    @dataclasses.dataclass(frozen=True)
    class More:
        pool_port: int = dataclasses.field(default=6432)
        pool_url: str = dataclasses.field(default="", metadata={"check": rules.postgres_url})

        def __post_init__(self) -> None:
            rules.check_fields(self)

    with pytest.raises(errors.ConfigurationError, match=r"pool_port \(EOP_POOL_PORT\)"):
        More(pool_port=70000)
    with pytest.raises(errors.ConfigurationError, match=r"pool_url \(EOP_POOL_URL\)"):
        More(pool_url="x")


def _bad_values(field: dataclasses.Field[object]) -> list[str]:
    """Values of the EOP_ variable of ``field`` that its type or rules refuse."""
    hint = get_type_hints(Settings)[field.name]
    if hint is bool:
        return ["maybe"]
    if hint in (int, float):
        return ["lots", "-1", "nan" if hint is float else "1.5"]
    if get_origin(hint) is Literal:
        return ["bogus"]
    if "check" in field.metadata:
        return ["", "has space;'"]
    return []  # free text (a user name, a file path): checked where it is used


EVERY_BAD_VALUE = [
    pytest.param(field.name, raw, id=f"{field.name}={raw!r}")
    for field in dataclasses.fields(Settings)
    for raw in _bad_values(field)
]


@pytest.mark.parametrize(("name", "raw"), EVERY_BAD_VALUE)
def test_every_field_refuses_a_bad_value_with_one_line_naming_its_variable(
    name: str, raw: str
) -> None:
    """Derived from the fields themselves: a field added later is covered too."""
    with pytest.raises(errors.ConfigurationError) as info:
        Settings.from_env({env_var(name): raw})
    text = str(info.value)
    assert env_var(name) in text
    assert "\n" not in text
    assert " must " in text
