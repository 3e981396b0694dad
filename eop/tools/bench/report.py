"""The report of ``eop bench``: the machine it ran on, and the table for people."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from eop.tools.bench import pgparts


def machine() -> dict[str, Any]:
    from eop.tools import embedded

    cpu = platform.machine()
    with contextlib.suppress(OSError):
        names = [line for line in Path("/proc/cpuinfo").read_text().splitlines()]
        cpu = next((n.split(":", 1)[1].strip() for n in names if n.startswith("model name")), cpu)
    nats_server = [str(embedded.nats_server_binary()), "--version"]
    postgres = [str(embedded.postgres_bin_dir() / "postgres"), "--version"]
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "system": platform.platform(),
        "python": platform.python_version(),
        "servers": [
            subprocess.run(argv, capture_output=True, text=True, check=False).stdout.strip()
            for argv in (nats_server, postgres)
        ],
        "load_average_start": round(os.getloadavg()[0], 2),
    }


def format_report(report: dict[str, Any]) -> str:
    """The report as a table for people."""
    o, m = report["options"], report["machine"]
    lines = [
        f"eop bench: runs {o['runs']}{' and the long run' if o['big'] else ''}; "
        f"{o['payload_bytes']}-byte messages; latency at {o['latency_load']:.0%} of "
        f"each run's rate for {o['latency_s']} s; fsync {'on' if o['fsync'] else 'off'}",
        f"machine: {m['cores']} cores ({m['cpu']}), {m['system']}, Python {m['python']}; "
        f"{'; '.join(m['servers'])}; load average {m['load_average_start']} -> "
        f"{m['load_average_end']}",
    ]
    if report["runs"]:
        lines += ["", *_runs(report)]
    if report.get("ceiling"):
        lines += ["", *_ceiling(report["ceiling"], o["pg_cpus"])]
    if report.get("relay"):
        lines += ["", *_relay(report["relay"], o, report["ratios"])]
    if report.get("flood"):
        lines += ["", *_flood(report["flood"], report["ratios"])]
    if report["big"]:
        lines += ["", *_big(report["big"])]
    commands = [f"  ({r['key']}) {r['command']}" for r in report["runs"]]
    if report.get("relay"):
        relay = report["relay"]
        commands += [f"  ({r['key']}) {r['command']}" for r in relay["rows"] + relay["latency"]]
    commands += [f"  ({r['key']}) {r['command']}" for r in report.get("flood") or []]
    lines += ["", "commands:", *commands]
    return "\n".join([*lines, f"took {report['seconds']:.0f} s"])


def _big(big: dict[str, Any]) -> list[str]:
    """The long run: the rate, the worker's CPU and memory, the inbox, early and late."""
    ratio = big["late_rate"] / max(big["early_rate"], 1e-9)
    rows_met = big["max_inbox"] <= big["inbox_bound"]
    return [
        f"long run: {big['messages']:,} messages through eop default in {big['seconds']:.0f} s "
        f"({big['effects']:,} effect rows); load average {big['load_start']} -> "
        f"{big['load_end']}; sampled every {big['sample_interval_s']} s ({big['samples']:,} "
        "samples)",
        f"  msg/s: {big['first_rate']:,.0f} at messages 1-10k, {big['early_rate']:,.0f} at "
        f"10k-20k, {big['late_rate']:,.0f} at the last 10k",
        f"  worker CPU us/msg: {_us(big['early_cpu_us'])} at 10k-20k, "
        f"{_us(big['late_cpu_us'])} at the last 10k",
        f"  worker RSS MiB (all its processes): {_mb(big['early_rss_mb'])} after 20k, "
        f"{_mb(big['late_rss_mb'])} at the end, {_mb(big['max_rss_mb'])} at most",
        f"  inbox rows: at most {big['early_inbox']:,} around 10k-20k, {big['late_inbox']:,} "
        f"around the last 10k, {big['max_inbox']:,} over the run; {big['end_inbox']:,} when "
        f"the last was acked, {big['settled_inbox']:,} a compaction interval later "
        f"(counted above the watermark of {big.get('count_lag_s', 1.0)} s before; full "
        f"counts at most {big.get('max_full_count_gap_s', 0)} s apart found at most "
        f"{big.get('unseen_rows', 0):,} rows more)",
        f"  inbox table and indexes MiB: {big['early_inbox_mb']:.1f} after 20k, "
        f"{big['late_inbox_mb']:.1f} at the end, {big['max_inbox_mb']:.1f} at most; "
        f"{big['autovacuums']} autovacuums of it",
        _target("late/early msg/s", ratio, ">=", 0.95),
        f"target inbox rows <= {big['inbox_bound']:,} (max_ack_pending + "
        f"compaction_after_messages): {big['max_inbox']:,} "
        f"{'met' if rows_met else 'MISSED'}",
    ]


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _runs(report: dict[str, Any]) -> list[str]:
    ratios = report["ratios"]
    lines = [
        f"{'run':<34}{'procs':>6}{'messages':>9}{'msg/s':>9}{'CPU us/msg':>11}{'nats us':>8}"
        f"{'pg us':>7}{'p50 ms':>8}{'p99 ms':>8}{'x lean':>8}{'x hand':>8}{'CPU x lean':>11}",
    ]
    for r in report["runs"]:
        key = r["key"]
        lines.append(
            f"({key}) {r['label']:<{31 - len(key)}}{r['processes']:>6}{r['messages']:>9,}"
            f"{r['rate']:>9,.0f}{_us(r['cpu_us']):>11}{_us(r['nats_us']):>8}{_us(r['pg_us']):>7}"
            f"{r['p50_ms']:>8.1f}{r['p99_ms']:>8.1f}{_ratio(ratios.get(f'{key}/lean')):>8}"
            f"{_ratio(ratios.get(f'{key}/hand')):>8}{_ratio(ratios.get(f'{key} cpu/lean')):>11}"
        )
        expected = r["messages"] + r["latency_messages"]
        if r["effects"] is not None and r["effects"] != expected:
            lines.append(f"    WARNING: {r['effects']} effect rows for {expected} messages")
    lines += [
        "",
        "x lean, x hand: msg/s over the lean raw loop's (a/an) and the hand-written "
        "consumer's (h/hn) with as many processes; CPU x lean: CPU us/msg over the lean loop's",
        "c/h, c/b: eop default's processes over one hand-written (naive) process, no target; "
        "floor: the leanest exactly-once loop (m/mn) with as many processes",
    ]
    lines += _pg_parts(report["runs"])
    shown = [f"{name} = {ratios[name]:.2f}" for name in _SHOWN if name in ratios]
    targets = [
        _target(name, ratios[name], op, bound) for name, op, bound in _TARGETS if name in ratios
    ]
    return [*lines, "   ".join(shown), *targets] if shown or targets else lines


def _pg_parts(runs: list[dict[str, Any]]) -> list[str]:
    """PostgreSQL's CPU a message of the hand-written and eop.Writes runs, by its processes:
    what the client connections' backends did, apart from the WAL writer and vacuum."""
    shown = [r for r in runs if r["key"] in _PG_PARTS_OF and r.get("pg_parts_us")]
    if not shown:
        return []
    lines = ["", f"{'pg us/msg by process':<34}" + "".join(f"{p:>12}" for p in pgparts.PARTS)]
    for r in shown:
        parts = r["pg_parts_us"]
        label = f"({r['key']}) {r['label']}"[:33]
        lines.append(f"{label:<34}" + "".join(f"{_us(parts.get(p)):>12}" for p in pgparts.PARTS))
    return lines


_PG_PARTS_OF = ("h", "hn", "hb", "m", "mn", "c1", "c")
_SHOWN = (
    "c/b",
    "c/h",
    "c pg/bounded",
    "o1/c1",
    "s1/c1",
    "k/c",
    "k1/c1",
    "c/floor",
    "c cpu/floor",
    "c pg/floor",
    "floor/hand",
    "floor cpu/lean",
    "floor p99/hand",
    "floor pg/hand",
)
_TARGETS: tuple[tuple[str, str, float], ...] = (
    ("c cpu/lean", "<=", 4.0),
    ("o/c", ">=", 0.8),
    ("s/c", ">=", 0.7),
    ("c/hand", ">=", 3.0),
    ("c p99/hand", "<=", 1.0),
    ("c pg/hand", "<=", 1.0),
)
"""The throughput targets: eop's worker CPU against the lean loop's, the README's handler
styles against eop.Writes, and eop default's msg/s, p99 at half load and PostgreSQL CPU
a message against the hand-written consumer's with as many processes (hn)."""


def _ceiling(ceiling: dict[str, dict[str, Any]], pg_cpus: float) -> list[str]:
    """Where each run saturated a PostgreSQL held to ``pg_cpus`` cores."""
    lines = [
        f"PostgreSQL held to {pg_cpus:g} cores (a cgroup CPU quota): the rate each run "
        "sustained, the cores PostgreSQL kept busy, and so one PostgreSQL core's ceiling"
    ]
    for key, c in ceiling.items():
        verdict = (
            f"saturated: {c['per_pg_core']:,.0f} msg/s a PostgreSQL core"
            if c["saturated"]
            else f"not saturated (the workers are the limit): over {c['per_pg_core']:,.0f} "
            "msg/s a PostgreSQL core"
        )
        lines.append(
            f"  ({key}) {c['rate']:>9,.0f} msg/s, {c['pg_cores_busy']:.2f} cores busy; {verdict}"
        )
    return lines


def _target(name: str, value: float, op: str, bound: float) -> str:
    met = value <= bound if op == "<=" else value >= bound
    return f"target {name} {op} {bound:g}: {value:.2f} {'met' if met else 'MISSED'}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _relay(relay: dict[str, Any], o: dict[str, Any], ratios: dict[str, float]) -> list[str]:
    lines = [
        f"outbox relay: {o['relay_messages']:,} rows of {o['relay_payload_bytes']} bytes, "
        f"committed 100 per transaction before the clock ({relay['fill_s']:.1f} s)",
        f"{'run':<44}{'messages':>9}{'msg/s':>9}{'CPU us/msg':>11}{'nats us':>8}{'pg us':>7}",
    ]
    for r in relay["rows"]:
        lines.append(
            f"({r['key']}) {r['label']:<{39 - len(r['key'])}}{r['messages']:>9,}"
            f"{r['rate']:>9,.0f}{_us(r['cpu_us']):>11}{_us(r['nats_us']):>8}{_us(r['pg_us']):>7}"
        )
        if r["delivered"] != r["messages"]:
            lines.append(f"    WARNING: {r['delivered']} delivered of {r['messages']}")
    lines += [
        f"r/rw = {ratios.get('r/rw', 0.0):.2f} (target >= 1: the relay keeps up with a worker)"
        f"   r/rp = {ratios.get('r/rp', 0.0):.2f}",
        "",
        f"commit to PubAck, one row per transaction at {o['relay_rate']:,.0f}/s for "
        f"{o['relay_latency_s']} s (outbox_poll_s {relay['poll_s']} s)",
        f"{'run':<36}{'rows':>7}{'rows/s':>8}{'p50 ms':>8}{'p99 ms':>8}{'max ms':>8}"
        f"{'CPU us/row':>11}{'nats us':>8}{'pg us':>7}",
    ]
    for r in relay["latency"]:
        lines.append(
            f"({r['key']}) {r['label']:<31}{r['rows']:>7,}{r['rate']:>8,.0f}{r['p50_ms']:>8.1f}"
            f"{r['p99_ms']:>8.1f}{r['max_ms']:>8.1f}{_us(r['cpu_us']):>11}"
            f"{_us(r['nats_us']):>8}{_us(r['pg_us']):>7}"
        )
        if r["delivered"] != r["rows"]:
            lines.append(f"    WARNING: {r['delivered']} in the stream of {r['rows']}")
    return lines


def _flood(rows: list[dict[str, Any]], ratios: dict[str, float]) -> list[str]:
    """The poison flood: time to the good messages and to the last dead letter, CPU per
    handler run, each row's exactly-once check, and eop over the hand-written consumer."""
    first = rows[0]
    lines = [
        f"poison flood: {first['poison']:,} messages whose handler raises, then "
        f"{first['good']:,} good ones; max_attempts {first['max_attempts']}, backoff 0.5 s "
        f"doubling to {first['backoff_max_s']:g} s; seconds from resuming the consumer",
        f"{'run':<36}{'procs':>6}{'to good s':>10}{'to drain s':>11}{'handler runs':>13}"
        f"{'CPU us/run':>11}{'nats us':>8}{'pg us':>7}",
    ]
    for r in rows:
        lines.append(
            f"({r['key']}) {r['label']:<{33 - len(r['key'])}}{r['processes']:>6}"
            f"{r['good_s']:>10.2f}{r['drain_s']:>11.2f}{r['handler_runs']:>13,}"
            f"{_us(r['cpu_us']):>11}{_us(r['nats_us']):>8}{_us(r['pg_us']):>7}"
        )
        if (r["effects"], r["dead"], r["dead_good"]) != (r["good"], r["poison"], 0):
            lines.append(
                f"    WARNING: {r['effects']} effect rows for {r['good']} good messages, "
                f"{r['dead']} dead letters for {r['poison']} failing ones "
                f"({r['dead_good']} of good ones)"
            )
    shown = [f"{name} = {ratios[name]:.2f}" for name in _FLOOD_SHOWN if name in ratios]
    return [*lines, "   ".join(shown)] if shown else lines


_FLOOD_SHOWN = ("f good/hand", "f drain/hand", "f cpu/hand")


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"
