"""The report of ``eop bench``: the machine it ran on, and the table for people."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from pathlib import Path
from typing import Any


def machine() -> dict[str, Any]:
    from eop import embedded

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
    if report.get("relay"):
        lines += ["", *_relay(report["relay"], o, report["ratios"])]
    big = report["big"]
    if big:
        lines += [
            f"long run: {big['messages']:,} messages in {big['seconds']:.0f} s "
            f"({big['effects']:,} effect rows): {big['early_rate']:,.0f} msg/s at 10k-20k, "
            f"{big['late_rate']:,.0f} msg/s at the last 10k "
            f"(ratio {big['late_rate'] / max(big['early_rate'], 1e-9):.2f}, target >= 0.9)",
            f"worker CPU: {_us(big['early_cpu_us'])} us/msg at 10k-20k, "
            f"{_us(big['late_cpu_us'])} us/msg at the last 10k",
            f"inbox rows: at most {big['early_inbox']:,} at 10k-20k, {big['late_inbox']:,} at "
            f"the last 10k, {big['max_inbox']:,} over the whole run",
        ]
    commands = [f"  ({r['key']}) {r['command']}" for r in report["runs"]]
    if report.get("relay"):
        relay = report["relay"]
        commands += [f"  ({r['key']}) {r['command']}" for r in relay["rows"] + relay["latency"]]
    lines += ["", "commands:", *commands]
    return "\n".join([*lines, f"took {report['seconds']:.0f} s"])


def _runs(report: dict[str, Any]) -> list[str]:
    ratios = report["ratios"]
    lines = [
        f"{'run':<36}{'messages':>9}{'msg/s':>9}{'CPU us/msg':>11}{'nats us':>8}{'pg us':>7}"
        f"{'p50 ms':>8}{'p99 ms':>8}  latency load",
    ]
    for r in report["runs"]:
        lines.append(
            f"({r['key']}) {r['label']:<32}{r['messages']:>9,}{r['rate']:>9,.0f}"
            f"{_us(r['cpu_us']):>11}{_us(r['nats_us']):>8}{_us(r['pg_us']):>7}"
            f"{r['p50_ms']:>8.1f}{r['p99_ms']:>8.1f}  {r['latency_rate']:,.0f} msg/s"
        )
        expected = r["messages"] + r["latency_messages"]
        if r["effects"] is not None and r["effects"] != expected:
            lines.append(f"    WARNING: {r['effects']} effect rows for {expected} messages")
    targets = {"c/a": " (target >= 0.6)", "c/b": " (target >= 15)"}
    shown = [
        f"{name} = {value:.1f}{targets.get(name, '')}"
        if name.endswith("/b")
        else f"{name} = {value:.2f}{targets.get(name, '')}"
        for name, value in ratios.items()
        if not name.startswith("r")
    ]
    return [*lines, "", "   ".join(shown)] if shown else lines


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


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"
