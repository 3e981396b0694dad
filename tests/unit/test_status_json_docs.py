"""docs/operations.md lists every field `eop status --json` emits, and only those.

The page's table of fields is written by hand; this test builds a status with
every part filled in (cluster replicas, an ordered handler's partitions and
members), takes the field names its JSON has, and compares them with the
table's, so a field added to (or dropped from) the status fails here until the
page says what it means.
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path
from typing import Any

from eop.ops import status
from eop.ordering import status as partition_status

PAGE = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
SECTION = "### The fields of `eop status --json`"
NOW = datetime.datetime(2026, 11, 28, 14, 0, tzinfo=datetime.timezone.utc)


def documented() -> list[str]:
    """The field names in the first column of the page's table, in its order."""
    text = PAGE.read_text(encoding="utf-8")
    assert SECTION in text, f"docs/operations.md lost its section {SECTION!r}"
    section = re.split(r"\n#+ ", text.split(SECTION, 1)[1], maxsplit=1)[0]
    return re.findall(r"^\| `([^`]+)` \|", section, flags=re.MULTILINE)


def emitted(value: Any, prefix: str = "") -> list[str]:
    """Every field of ``value``, nested ones as ``a.b`` and ``a[].b`` (``[]``: each element)."""
    fields: list[str] = []
    for key, inner in value.items():
        name = f"{prefix}{key}"
        fields.append(name)
        if isinstance(inner, dict):
            fields.extend(emitted(inner, f"{name}."))
        elif isinstance(inner, list) and inner and isinstance(inner[0], dict):
            fields.extend(emitted(inner[0], f"{name}[]."))
    return fields


def full_status() -> status.HandlerStatus:
    """A status with every optional part present, so its JSON shows every field."""
    replica = status.Replica(name="n2", current=True, offline=False, lag=0, active_s=0.1)
    partition = partition_status.PartitionStatus(
        partition=0,
        owner_host="web",
        owner_pid=11,
        epoch=3,
        consumer="eop-ledger-p0-e3",
        acquired_at=NOW,
        lease_left_s=8.0,
        num_pending=2,
        ack_pending=1,
        redelivered=0,
    )
    ordered = partition_status.OrderedStatus(
        partition_count=1,
        partitions=[partition],
        members=[partition_status.MemberStatus(host="web", pid=11, joined_at=NOW)],
        last_rebalance_at=NOW,
        last_rebalance_partition=0,
        last_rebalance_epoch=3,
    )
    return status.HandlerStatus(
        handler="ledger",
        stream="LEDGER",
        consumer="eop-ledger-p*-e*",
        stream_followers=[replica],
        consumer_followers=[replica],
        ordered=ordered,
        warnings=["WARNING: something"],
        problems=["something"],
    )


def test_status_json_fields_are_the_documented_ones() -> None:
    """Every field of `eop status --json` has a row in docs/operations.md, and every row
    is a field it emits (nested ones included)."""
    names = documented()
    fields = emitted(full_status().to_json())
    assert len(names) == len(set(names)), "a field is documented twice"
    missing = [f for f in fields if f not in names]
    stale = [n for n in names if n not in fields]
    assert not missing, f"docs/operations.md does not document these status fields: {missing}"
    assert not stale, f"docs/operations.md documents fields status does not emit: {stale}"
