"""What `eop status` makes of an ordered handler's partition rows (no servers)."""

from __future__ import annotations

import datetime

import eop
from eop.handler import HandlerSpec
from eop.ordering import ownership
from eop.ordering import status as partition_status

NOW = datetime.datetime(2026, 11, 28, 14, 0, tzinfo=datetime.timezone.utc)


def _spec(count: int) -> HandlerSpec:
    app = eop.App()

    @app.handler(
        stream="LEDGER",
        subject="ledger.*.step",
        name="ledger",
        order_by="subject:1",
        partitions=count,
    )
    async def ledger(msg: eop.Message, session: object) -> None:
        pass

    return app.handlers["ledger"]


def _row(
    partition: int, pid: int | None, epoch: int, left_s: float | None, count: int = 3
) -> ownership.PartitionRow:
    return ownership.PartitionRow(
        subscription="ledger",
        partition=partition,
        count=count,
        host=None if pid is None else "web",
        pid=pid,
        epoch=epoch,
        consumer=f"eop-ledger-p{partition}-e{epoch}",
        acquired_at=NOW + datetime.timedelta(seconds=epoch),
        expires_in_s=left_s,
    )


def test_owners_members_rebalance_and_warnings_from_the_rows() -> None:
    """Owners by host:pid, the newest acquisition as the last rebalance, another
    handler's rows left out; an expired lease and a partition without an owner are
    warnings, not problems."""
    rows = [
        _row(0, 11, 4, 8.0),
        _row(1, 11, 2, -3.0),
        _row(2, None, 7, None),
        ownership.PartitionRow("other", 0, 1, "x", 1, 9, None, NOW, 5.0),
    ]
    members = [
        ownership.MemberRow("ledger", "web", 11, NOW),
        ownership.MemberRow("other", "x", 1, NOW),
    ]
    status = partition_status.from_rows(_spec(3), rows, members)
    assert status.owners() == {"web:11": [0, 1]}
    assert [(m.host, m.pid) for m in status.members] == [("web", 11)]
    assert (status.last_rebalance_partition, status.last_rebalance_epoch) == (2, 7)
    warnings, problems = partition_status.findings(_spec(3), status)
    assert problems == []
    assert warnings[0].startswith("WARNING: partition 1's lease expired 3 s ago (owner web:11")
    assert warnings[1].startswith("WARNING: partition 2 has no owner")
    assert len(warnings) == 2
    table = "\n".join(partition_status.format_partitions([("ledger", status)]))
    assert "EXPIRED 3 s ago" in table
    assert "web:11 owns partitions 0, 1" in table
    assert "last rebalance: 2026-11-28 14:00:07 UTC (partition 2 taken at epoch 7)" in table


def test_no_rows_or_another_partition_count_is_a_problem() -> None:
    """A handler no worker ever ran has no partitions (as a missing consumer, an error);
    rows of another partition count stop its workers from starting."""
    _, problems = partition_status.findings(_spec(3), partition_status.from_rows(_spec(3), [], []))
    assert "no partitions in the database" in problems[0]
    other = partition_status.from_rows(_spec(3), [_row(0, 11, 1, 5.0, count=2)], [])
    _, problems = partition_status.findings(_spec(3), other)
    assert "has 2 partitions" in problems[0]
