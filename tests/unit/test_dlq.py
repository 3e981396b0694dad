"""`eop dlq` and `eop status` pieces that need no server: filters, msg-ids, headers, tables."""

from __future__ import annotations

import datetime

import pytest
from sqlalchemy.dialects import postgresql

from eop import cli, errors
from eop.ops import dlq, status
from eop.pg import models
from eop.pg.sql import dead_letters as dead_letters_sql

UTC = datetime.timezone.utc
NOW = datetime.datetime(2026, 1, 31, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2h", NOW - datetime.timedelta(hours=2)),
        ("90s", NOW - datetime.timedelta(seconds=90)),
        ("1d12h", NOW - datetime.timedelta(days=1, hours=12)),
        ("1.5H", NOW - datetime.timedelta(hours=1.5)),
        ("1w", NOW - datetime.timedelta(weeks=1)),
        ("2026-01-30T08:00:00Z", datetime.datetime(2026, 1, 30, 8, tzinfo=UTC)),
        ("2026-01-30T08:00:00", datetime.datetime(2026, 1, 30, 8, tzinfo=UTC)),
        ("2026-01-30", datetime.datetime(2026, 1, 30, tzinfo=UTC)),
        (
            "2026-01-30T10:00:00+02:00",
            datetime.datetime(2026, 1, 30, 8, tzinfo=UTC),
        ),
    ],
)
def test_parse_when_takes_iso_times_utc_if_naive_and_durations_ago(
    text: str, expected: datetime.datetime
) -> None:
    """--since/--until/--before: an ISO time (naive means UTC) or a duration back from now."""
    assert dlq.parse_when(text, NOW) == expected


@pytest.mark.parametrize("text", ["", "yesterday", "2x", "h2", "2h30"])
def test_parse_when_rejects_anything_else_with_a_hint(text: str) -> None:
    """A value that is neither is a ConfigurationError naming both accepted forms."""
    with pytest.raises(errors.ConfigurationError, match=r"ISO time .* duration"):
        dlq.parse_when(text, NOW)


def test_reason_filter_is_case_insensitive_substring_with_wildcards_escaped() -> None:
    """--reason matches reason or error with ILIKE; % and _ in the text are literal."""
    t = models.tables("eop")
    [cond] = dead_letters_sql.dead_letter_where(t, reason="100%_x")
    compiled = cond.compile(dialect=postgresql.dialect())
    assert "ILIKE" in str(compiled).upper()
    assert set(compiled.params.values()) == {"%100\\%\\_x%"}


def test_filters_are_empty_only_without_conditions() -> None:
    """purge refuses an empty filter set without --all."""
    assert dlq.Filters().empty
    assert dlq.Filters(limit=5).empty
    assert not dlq.Filters(handler="a").empty
    assert not dlq.Filters(since=NOW).empty


def test_replay_msg_id_is_deterministic_per_generation_and_names_the_message() -> None:
    """The same dead letter and generation give the same msg-id; a new generation a new one."""
    row = {"subscription": "billing", "stream": "ORDERS", "stream_seq": 7, "id": 3}
    assert dlq.replay_msg_id(row, 1) == dlq.replay_msg_id(dict(row), 1)
    assert dlq.replay_msg_id(row, 1) == "eop-replay:billing:ORDERS:7:3:1"
    assert dlq.replay_msg_id(row, 2) != dlq.replay_msg_id(row, 1)


def test_replay_headers_drop_nats_headers_and_redacted_values_and_mark_the_replay() -> None:
    """The original msg-id and expectations go, redacted secrets go, the replay is traceable."""
    stored = {
        "Nats-Msg-Id": "orig",
        "Nats-Expected-Last-Sequence": "4",
        "Authorization": "***",
        "X-Trace": "t1",
    }
    headers, dropped = dlq.replay_headers(stored, 3, "eop-replay:x")
    assert headers == {"X-Trace": "t1", "Nats-Msg-Id": "eop-replay:x", "Eop-Replay-Of": "3"}
    assert sorted(dropped) == ["Authorization", "Nats-Expected-Last-Sequence", "Nats-Msg-Id"]


def dead_letter_row(**changes: object) -> dict[str, object]:
    row: dict[str, object] = {
        "id": 12,
        "subscription": "billing",
        "stream": "ORDERS",
        "stream_epoch": "e1",
        "stream_seq": 40,
        "subject": "ORDERS.created",
        "msg_id": None,
        "fingerprint": b"\x01\x02",
        "headers": {"Authorization": "Bearer leaked", "X": "1"},
        "reason": "rejected",
        "error": "ValueError: " + "very long explanation " * 10,
        "traceback": "Traceback...\n  line",
        "delivery_count": 3,
        "created_at": NOW,
        "payload_size": 9,
        "replay_generation": 0,
        "replay_mode": None,
        "replay_msg_id": None,
        "replay_requested_at": None,
        "replayed_at": None,
        "replay_stream_seq": None,
    }
    row.update(changes)
    return row


def test_table_cuts_errors_and_shows_replay_state() -> None:
    """One aligned line per dead letter; long errors cut; replay state readable."""
    rows = [
        dead_letter_row(),
        dead_letter_row(id=13, replay_requested_at=NOW),
        dead_letter_row(
            id=14,
            replay_requested_at=NOW,
            replayed_at=NOW,
            replay_mode="publish",
            replay_generation=1,
            replay_stream_seq=99,
        ),
    ]
    lines = dlq.format_table(rows, error_width=20).splitlines()
    assert lines[0].split()[:4] == ["ID", "HANDLER", "STREAM", "SEQ"]
    assert "ValueError: very lo…" in lines[1]
    assert "2026-01-31 12:00:00" in lines[1]
    assert lines[1].rstrip().endswith("-")
    assert lines[2].rstrip().endswith("pending")
    assert lines[3].rstrip().endswith("publish #1 seq 99")


def test_json_and_details_redact_headers_and_never_carry_the_payload() -> None:
    """show and list --json: headers redacted (even if stored unredacted), no payload."""
    row = dead_letter_row(payload=b"secret payload")
    data = dlq.to_json(row)
    assert data["headers"] == {"Authorization": "***", "X": "1"}
    assert "payload" not in data
    assert data["fingerprint"] == "0102"
    assert data["created_at"] == "2026-01-31T12:00:00+00:00"
    details = dlq.format_details(row)
    assert "leaked" not in details
    assert "secret payload" not in details
    assert "payload_size:   9" in details
    assert "traceback:" in details


def test_window_warnings_flag_a_full_and_a_nearly_full_window() -> None:
    """A full ack-pending window stalls fetches silently: status says so loudly."""
    assert status.window_warnings(10, 1000) == []
    assert "nearly full" in status.window_warnings(900, 1000)[0]
    assert "window full (1000/1000)" in status.window_warnings(1000, 1000)[0]
    assert status.window_warnings(5000, -1) == []


def test_status_table_lists_handlers_with_problems_and_warnings() -> None:
    """The table shows unknown values as ?, then each warning and problem on its own line."""
    ok = status.HandlerStatus(
        handler="billing", stream="ORDERS", consumer="eop-billing", num_pending=5,
        ack_pending=2, max_ack_pending=2, redelivered=1, inbox_rows=10, watermark=7,
        dead_letters=3, dead_letters_unreplayed=1, last_processed_at=NOW,
        warnings=status.window_warnings(2, 2),
    )  # fmt: skip
    broken = status.HandlerStatus(
        handler="audit", stream="GONE", consumer="eop-audit", problems=["stream 'GONE' missing"]
    )
    text = status.format_table([ok, broken])
    assert "2/2 FULL" in text
    assert "3 (1)" in text
    assert "billing: WARNING: ack-pending window full" in text
    assert "audit: ERROR: stream 'GONE' missing" in text
    assert ok.to_json()["last_processed_at"] == "2026-01-31T12:00:00+00:00"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["dlq", "replay"], "IDs) or pass --all"),
        (["dlq", "replay", "1", "--all"], "IDs) or pass --all"),
        (["dlq", "replay", "1", "--rerun"], "--app"),
        (["dlq", "replay", "1", "--handler", "x"], "--all only"),
        (["dlq", "purge"], "needs a filter"),
        (["dlq", "list", "--since", "soon"], "neither an ISO time"),
    ],
)
def test_dlq_command_line_mistakes_are_clear_errors(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Wrong combinations of IDs, --all, --rerun and filters are usage errors: one line with
    the fix, no traceback, status 2 as for a flag the parser refuses."""
    monkeypatch.delenv("EOP_APP", raising=False)
    if "--since" in argv:
        with pytest.raises(SystemExit) as refused:
            cli.main(argv)
        status = refused.value.code
    else:
        status = cli.main(argv)
    assert status == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


async def test_replay_many_tells_each_result_before_the_next_replay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`eop dlq replay` prints each dead letter's result as it is done: a replay killed
    or stopped by an outage midway has said what it did."""
    import eop

    events: list[str] = []

    async def replay(self: dlq.Replayer, i: int, **_: object) -> dlq.ReplayResult:
        events.append(f"replay {i}")
        if i == 3:
            raise errors.NatsUnavailable("gone")
        return dlq.ReplayResult(id=i, status="published", mode="publish", generation=1)

    monkeypatch.setattr(dlq.Replayer, "replay", replay)
    with pytest.raises(errors.NatsUnavailable):
        await dlq.Replayer(eop.App()).replay_many(
            [1, 2, 3], on_result=lambda r: events.append(f"told {r.id}")
        )
    assert events == ["replay 1", "told 1", "replay 2", "told 2", "replay 3"]


def test_status_says_a_problem_every_handler_shares_once_naming_them_all() -> None:
    """An unreachable NATS is every handler's problem: the table and the one-line summary
    say it once with the handlers it concerns, a handler's own problem apart."""
    down = "NATS is unreachable at nats://127.0.0.1:1"
    billing = status.HandlerStatus(
        handler="billing", stream="ORDERS", consumer="eop-billing", problems=[down]
    )
    audit = status.HandlerStatus(
        handler="audit", stream="ORDERS", consumer="eop-audit", problems=[down, "own"]
    )
    text = status.format_table([billing, audit])
    assert text.count(down) == 1
    assert f"billing, audit: ERROR: {down}" in text
    assert "audit: ERROR: own" in text
    assert status.problem_summary([billing, audit]) == f"billing, audit: {down}; audit: own"
    assert status.problem_summary([status.HandlerStatus("x", "S", "c")]) == ""


def test_counts_in_the_ops_output_are_singular_for_one() -> None:
    """The operators' lines say "1 dead letter", "2 partitions", "1 parked row"."""
    from eop.ops import tables
    from eop.outbox import operations as outbox

    assert tables.counted(1, "dead letter") == "1 dead letter"
    assert tables.counted(2, "partition") == "2 partitions"
    assert tables.counted(0, "dead letter") == "0 dead letters"
    assert outbox.count_text(1, "parked") == "1 parked row"
    assert outbox.count_text(3, "parked") == "3 parked rows"
