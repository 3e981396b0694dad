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
    o, m, ratios = report["options"], report["machine"], report["ratios"]
    lines = [
        f"eop bench: {o['payload_bytes']}-byte messages; latency at {o['latency_load']:.0%} of "
        f"each run's rate for {o['latency_s']} s; fsync {'on' if o['fsync'] else 'off'}",
        f"machine: {m['cores']} cores ({m['cpu']}), {m['system']}, Python {m['python']}; "
        f"{'; '.join(m['servers'])}; load average {m['load_average_start']} -> "
        f"{m['load_average_end']}",
        "",
        f"{'run':<34}{'messages':>9}{'msg/s':>9}{'CPU us/msg':>11}{'p50 ms':>8}{'p99 ms':>8}"
        "  latency load",
    ]
    for r in report["runs"]:
        cpu = _us(r["cpu_us"])
        lines.append(
            f"({r['key']}) {r['label']:<30}{r['messages']:>9,}{r['rate']:>9,.0f}{cpu:>11}"
            f"{r['p50_ms']:>8.1f}{r['p99_ms']:>8.1f}  {r['latency_rate']:,.0f} msg/s"
        )
        expected = r["messages"] + r["latency_messages"]
        if r["effects"] is not None and r["effects"] != expected:
            lines.append(f"    WARNING: {r['effects']} effect rows for {expected} messages")
    lines += [
        "",
        f"c/a = {ratios['c/a']:.2f} (target >= 0.6)   c/b = {ratios['c/b']:.1f} (target >= 15)"
        f"   d/a = {ratios['d/a']:.2f}   e/a = {ratios['e/a']:.2f}   e/b = {ratios['e/b']:.1f}"
        f"   f/a = {ratios['f/a']:.2f}   f/b = {ratios['f/b']:.1f}",
    ]
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
    lines += ["", "consumers:"] + [f"  ({r['key']}) {r['command']}" for r in report["runs"]]
    return "\n".join([*lines, f"took {report['seconds']:.0f} s"])


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"
