"""eop_0011, the inbox keyed by (lane, stream_seq): rows migrated keep their outcomes, the
claim of a worker of an older eop fails once it ran, and its downgrade brings the old key back."""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from eop.pg import failures, migrate, models
from eop.pg.sql import claim as claim_sql
from eop.pg.sql import inbox as inbox_sql

EPOCH_A, EPOCH_B = "a" * 32, "b" * 32

#: The claim of eop_0010's workers (eop.pg.sql.claim.claim_pyformat_text before eop_0011),
#: as an older worker still running during a rolling update sends it.
OLD_CLAIM = (
    'INSERT INTO "eop".inbox (subscription, stream, outcome, stream_seq, fingerprint,'
    " stream_epoch, subject, delivery_count, msg_id, msg_id_digest) SELECT"
    " CAST(%(subscription)s AS text), CAST(%(stream)s AS text), CAST(%(outcome)s AS text),"
    " i.stream_seq, i.fingerprint, COALESCE(i.stream_epoch, CAST(%(stream_epoch)s AS text)),"
    " COALESCE(i.subject, CAST(%(subject)s AS text)), COALESCE(i.delivery_count,"
    " CAST(%(delivery_count)s AS integer)), COALESCE(i.msg_id, CAST(%(msg_id)s AS text)),"
    " sha256(convert_to(COALESCE(i.msg_id, CAST(%(msg_id)s AS text)), 'UTF8')) FROM"
    " unnest(CAST(%(stream_seq)s AS bigint[]), CAST(%(fingerprint)s AS bytea[]),"
    " CAST(%(stream_epoch_each)s AS text[]), CAST(%(subject_each)s AS text[]),"
    " CAST(%(delivery_count_each)s AS integer[]), CAST(%(msg_id_each)s AS text[])) AS"
    " i(stream_seq, fingerprint, stream_epoch, subject, delivery_count, msg_id) WHERE"
    " i.stream_seq > COALESCE(CASE WHEN i.stream_epoch IS NULL THEN (SELECT w.watermark FROM"
    ' "eop".watermarks AS w WHERE w.subscription = CAST(%(subscription)s AS text) AND w.stream'
    " = CAST(%(stream)s AS text) AND w.stream_epoch = CAST(%(stream_epoch)s AS text) FOR SHARE)"
    ' ELSE (SELECT w.watermark FROM "eop".watermarks AS w WHERE w.subscription ='
    " CAST(%(subscription)s AS text) AND w.stream = CAST(%(stream)s AS text) AND"
    " w.stream_epoch = i.stream_epoch FOR SHARE) END, 0) ON CONFLICT DO NOTHING RETURNING"
    " stream_seq"
)


def old_claim_params(subscription: str, epoch: str, seq: int, fingerprint: bytes) -> dict[str, Any]:
    """The parameters of :data:`OLD_CLAIM` for one message."""
    return {
        "subscription": subscription,
        "stream": "S",
        "outcome": "processed",
        "stream_seq": [seq],
        "fingerprint": [fingerprint],
        "stream_epoch": epoch,
        "stream_epoch_each": [],
        "subject": "S.a",
        "subject_each": [],
        "delivery_count": 1,
        "delivery_count_each": [],
        "msg_id": None,
        "msg_id_each": [],
    }


def conninfo(url: str) -> str:
    return sa.make_url(url).set(drivername="postgresql").render_as_string(False)


def engine(url: str) -> sa.Engine:
    sync = sa.make_url(url).set(drivername="postgresql+psycopg").render_as_string(False)
    return sa.create_engine(sync, poolclass=NullPool)


def fp(n: int) -> bytes:
    return hashlib.sha256(str(n).encode()).digest()


#: Rows of eop_0010's inbox: (subscription, epoch, seq, msg_id, outcome).
OLD_ROWS = [
    ("h", EPOCH_A, 5, None, "processed"),
    ("h", EPOCH_A, 6, "id-6", "processed"),
    ("h", EPOCH_A, 7, None, "retrying"),
    ("h", EPOCH_B, 1, None, "dead_lettered"),
    ("g", EPOCH_A, 5, "id-6", "processed"),
]


def fill_old_inbox(url: str) -> None:
    """eop_0010's inbox with :data:`OLD_ROWS`; only ("h", EPOCH_A) has a watermark row."""
    with engine(url).begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO eop.watermarks (subscription, stream, stream_epoch, watermark)"
                " VALUES ('h', 'S', :e, 4)"
            ),
            {"e": EPOCH_A},
        )
        for subscription, epoch, seq, msg_id, outcome in OLD_ROWS:
            conn.execute(
                sa.text(
                    "INSERT INTO eop.inbox (subscription, stream, stream_epoch, stream_seq,"
                    " fingerprint, msg_id, msg_id_digest, subject, outcome, delivery_count)"
                    " VALUES (:s, 'S', :e, :q, :f, :m, sha256(convert_to(:m, 'UTF8')), 'S.a',"
                    " :o, 3)"
                ),
                {"s": subscription, "e": epoch, "q": seq, "f": fp(seq), "m": msg_id, "o": outcome},
            )


def claim(conn: sa.Connection, subscription: str, epoch: str, seqs: list[int]) -> set[int]:
    """eop's claim (this version's) of ``seqs``, each with :func:`fp` of its sequence."""
    arguments = claim_sql.claim_arguments(
        subscription,
        "S",
        models.OUTCOME_PROCESSED,
        seqs,
        [fp(s) for s in seqs],
        [epoch] * len(seqs),
        [1] * len(seqs),
        [None] * len(seqs),
    )
    return {int(row[0]) for row in conn.execute(claim_sql.claim(models.tables(), arguments))}


def test_migrated_rows_keep_their_outcomes_and_a_redelivery_is_a_duplicate(
    database_url: str,
) -> None:
    """eop_0011 over an inbox with rows: each (subscription, stream, epoch) gets a lane (a
    watermark row at 0 where it had none, an existing one keeping its watermark), every row
    keeps its values under its lane, found by its key and its msg-id; the claim of a
    migrated message claims nothing (a duplicate) while a new sequence is claimed."""
    migrate.downgrade(database_url, revision="eop_0010")
    fill_old_inbox(database_url)
    migrate.upgrade(database_url)
    migrate.check(database_url)
    t = models.tables()
    with engine(database_url).begin() as conn:
        lanes = dict(
            conn.execute(
                sa.text(
                    "SELECT subscription || '/' || stream_epoch || '/' || watermark, lane"
                    " FROM eop.watermarks"
                )
            ).all()
        )
        assert set(lanes) == {f"h/{EPOCH_A}/4", f"h/{EPOCH_B}/0", f"g/{EPOCH_A}/0"}
        assert len(set(lanes.values())) == 3
        for subscription, epoch, seq, msg_id, outcome in OLD_ROWS:
            found = conn.execute(*inbox_sql.find_by_key(t, subscription, "S", epoch, seq)).all()
            assert found == [(fp(seq), outcome)]
            if msg_id is not None:
                by_id = conn.execute(*inbox_sql.find_by_msg_id(t, subscription, msg_id)).all()
                assert by_id == [("S", epoch, seq, outcome)]
        assert claim(conn, "h", EPOCH_A, [5, 6, 7, 8]) == {8}
        assert claim(conn, "h", EPOCH_B, [1, 2]) == {2}
        assert claim(conn, "g", EPOCH_A, [5]) == set()
        # The watermark of ("h", EPOCH_A) is 4: a sequence at or below it is not claimed.
        assert claim(conn, "h", EPOCH_A, [4]) == set()
        delivery = conn.execute(sa.text("SELECT count(*) FROM eop.inbox WHERE delivery_count = 3"))
        assert delivery.scalar_one() == len(OLD_ROWS)


def test_an_old_workers_claim_fails_after_the_migration_and_inserts_nothing(
    database_url: str,
) -> None:
    """A worker of eop_0010 still running after eop_0011: its claim names columns the inbox
    no longer has, so it fails (SQLSTATE 42703, a misconfiguration: the worker stops, the
    message is redelivered, never dead-lettered) and inserts no row, for a message old or new."""
    migrate.downgrade(database_url, revision="eop_0010")
    fill_old_inbox(database_url)
    migrate.upgrade(database_url)
    with psycopg.connect(conninfo(database_url)) as conn:
        for seq in (5, 9):
            with pytest.raises(psycopg.errors.UndefinedColumn) as info:
                conn.execute(OLD_CLAIM, old_claim_params("h", EPOCH_A, seq, fp(seq)))
            conn.rollback()
            assert failures.classify(info.value) is failures.DbFailure.MISCONFIGURED
        count = conn.execute("SELECT count(*) FROM eop.inbox").fetchone()
    assert count == (len(OLD_ROWS),)


def test_the_migration_waits_for_an_old_claim_in_flight_and_keeps_its_row(
    database_url: str,
) -> None:
    """An old worker's claim open when eop_0011 starts: the migration waits for its
    transaction, then carries its row over, so the message's redelivery to a new worker is
    a duplicate; there is no moment when both shapes can claim."""
    migrate.downgrade(database_url, revision="eop_0010")
    with psycopg.connect(conninfo(database_url)) as old:
        claimed = old.execute(OLD_CLAIM, old_claim_params("h", EPOCH_A, 3, fp(3))).fetchall()
        assert claimed == [(3,)]
        upgrade = threading.Thread(target=migrate.upgrade, args=(database_url,))
        upgrade.start()
        time.sleep(1.0)
        assert upgrade.is_alive(), "the migration did not wait for the open claim"
        old.commit()
        upgrade.join(timeout=60)
    assert not upgrade.is_alive()
    with engine(database_url).begin() as conn:
        assert claim(conn, "h", EPOCH_A, [3, 4]) == {4}
        found = conn.execute(*inbox_sql.find_by_key(models.tables(), "h", "S", EPOCH_A, 3))
        assert found.all() == [(fp(3), "processed")]


def test_downgrade_brings_the_old_key_back_and_the_grants_survive(database_url: str) -> None:
    """eop_0011 and its downgrade grant on the new inbox what was granted on the old (a
    worker's own role); the downgrade copies every row back under its stream and epoch
    (its subject empty: eop_0011 dropped it) and drops the lanes."""
    role = f"eop_worker_{uuid.uuid4().hex[:8]}"
    with engine(database_url).begin() as conn:
        conn.execute(sa.text(f"CREATE ROLE {role}"))
    try:
        migrate.downgrade(database_url, revision="eop_0010")
        fill_old_inbox(database_url)
        with engine(database_url).begin() as conn:
            conn.execute(sa.text(f"GRANT SELECT, INSERT, DELETE ON eop.inbox TO {role}"))
        migrate.upgrade(database_url)
        assert privileges(database_url, role) == {"SELECT", "INSERT", "DELETE"}
        migrate.downgrade(database_url, revision="eop_0010")
        assert privileges(database_url, role) == {"SELECT", "INSERT", "DELETE"}
        with engine(database_url).begin() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT subscription, stream_epoch, stream_seq, msg_id, outcome, subject,"
                    " fingerprint FROM eop.inbox ORDER BY subscription, stream_epoch, stream_seq"
                )
            ).all()
            columns = conn.execute(
                sa.text(
                    "SELECT column_name FROM information_schema.columns"
                    " WHERE table_schema = 'eop' AND table_name = 'watermarks'"
                )
            ).scalars()
            assert "lane" not in set(columns)
        assert [tuple(r[:5]) for r in rows] == sorted(OLD_ROWS, key=lambda r: r[:3])
        assert {(r[5], r[6]) for r in rows} == {("", fp(r[2])) for r in rows}
        migrate.upgrade(database_url)
        migrate.check(database_url)
    finally:
        with engine(database_url).begin() as conn:
            conn.execute(sa.text(f"DROP OWNED BY {role}"))
            conn.execute(sa.text(f"DROP ROLE {role}"))


def privileges(url: str, role: str) -> set[str]:
    with engine(url).begin() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT privilege_type FROM information_schema.role_table_grants"
                " WHERE table_schema = 'eop' AND table_name = 'inbox' AND grantee = :r"
            ),
            {"r": role},
        )
        return {str(p) for (p,) in rows}


def test_making_a_lane_that_exists_uses_up_no_lane(database_url: str) -> None:
    """A claim that finds some of its messages taken (every duplicate) asks for their lanes
    to be made: a lane that exists is left alone without taking a number from the lanes'
    sequence (an integer: used up once a duplicate, it would run out), and the next lane
    made follows the last."""
    t = models.tables()
    with engine(database_url).begin() as conn:
        first = conn.execute(*inbox_sql.create_lanes(t, "h", "S", [EPOCH_A])).scalars().all()
        for _ in range(5):
            assert conn.execute(*inbox_sql.create_lanes(t, "h", "S", [EPOCH_A])).all() == []
            assert conn.execute(*inbox_sql.create_watermark(t, "h", "S", EPOCH_A)).all() == []
        both = conn.execute(*inbox_sql.create_lanes(t, "h", "S", [EPOCH_A, EPOCH_B]))
        assert both.scalars().all() == [first[0] + 1]


def test_the_migration_survives_a_claim_queued_behind_it(database_url: str) -> None:
    """A rolling update under load: an old worker's claim is open (a slow handler) when
    eop_0011 starts, and another of its claims arrives while the migration waits. That
    claim takes the inbox's lock, then queues for the watermark row behind the migration;
    once the first commits, the migration holds the watermarks and asks for the inbox:
    each waits for the other. The migration must not be the one that fails: `eop db
    upgrade` run beside the old workers, as docs/deployment.md allows, has to commit (the
    queued claim may fail and be retried, as an old worker's claims do once it ran)."""
    migrate.downgrade(database_url, revision="eop_0010")
    failed: list[BaseException] = []

    def upgrade() -> None:
        try:
            migrate.upgrade(database_url)
        except Exception as exc:  # reported by the assertion below
            failed.append(exc)

    def queued_claim() -> None:
        with psycopg.connect(conninfo(database_url)) as conn:
            try:
                conn.execute(OLD_CLAIM, old_claim_params("h", EPOCH_A, 9, fp(9)))
                conn.commit()
            except psycopg.Error:
                conn.rollback()  # a deadlock or 42703 here is the old worker's to retry

    with psycopg.connect(conninfo(database_url)) as slow:
        assert slow.execute(OLD_CLAIM, old_claim_params("h", EPOCH_A, 3, fp(3))).fetchall()
        migration = threading.Thread(target=upgrade)
        migration.start()
        time.sleep(0.5)
        second = threading.Thread(target=queued_claim)
        second.start()
        # Longer than deadlock_timeout (1 s): the queued claim's one deadlock check finds
        # no cycle while the slow transaction is still open.
        time.sleep(2.0)
        assert migration.is_alive()
        assert second.is_alive()
        slow.commit()
        migration.join(timeout=60)
        second.join(timeout=60)
    assert not migration.is_alive()
    assert not second.is_alive()
    assert failed == [], f"eop db upgrade failed: {failed[0]!r}"
    assert migrate.current(database_url) == "eop_0011"
