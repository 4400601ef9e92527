#!/usr/bin/python3
"""Turns a capserve-loadgen --soak-report JSON (from tools/soak/run_soak.sh) into a short Markdown table and a
verdict. Exit status 0 when every check passed, 1 otherwise.

The loadgen's processes are in --server-pids order, which run_soak.sh gives as rank 0, rank 1.
"""

import argparse
import json
import sys


def ms(d, key):
    v = d.get(key)
    return "n/a" if v is None else f"{v * 1e3:.0f}"


def load_window(p, warmup_s, load_end_s):
    """The samples judge_rss uses: from the first at/after the warm-up to the last within the load period."""
    t, k = p["t_s"], p["rss_kib"]
    to = len(t)
    while to > 1 and t[to - 1] > load_end_s:
        to -= 1
    first = 0
    while first + 1 < to and t[first] < warmup_s:
        first += 1
    return first, to


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", required=True)
    ap.add_argument("--md", required=True)
    ap.add_argument("--loadgen-status", type=int, required=True)
    ap.add_argument("--server-status", type=int, required=True)
    ap.add_argument("--ranks-alive", type=int, required=True)
    ap.add_argument("--drain-s", default="n/a")
    ap.add_argument("--command", default="")
    a = ap.parse_args()

    r = json.load(open(a.json))
    c = r["client"]
    soak = r.get("soak")
    info = r["run"].get("server_info", {})
    checks = []  # (what, passed, detail)

    checks.append(("no request lost (each got exactly one terminal status)",
                   c["lost"] == 0 and c["unterminated"] == 0 and c["terminated"] == c["sent"],
                   f"sent {c['sent']}, terminated {c['terminated']}, lost {c['lost']}, "
                   f"unterminated {c['unterminated']}"))
    checks.append(("stream contract held", c["protocol_errors"] == 0, f"protocol errors {c['protocol_errors']}"))
    checks.append(("every status OK", c["ok"] == c["sent"],
                   ", ".join(f"{k} {v}" for k, v in sorted(c["status_counts"].items())) or "none"))
    checks.append(("no crash (both ranks alive after the load)", a.ranks_alive == 1, ""))

    rows, timeline = [], []
    requests_per_s = c["requests_per_s"]
    if soak:
        for rank, p in enumerate(soak["processes"]):
            first, to = load_window(p, soak["warmup_s"], soak["load_end_s"])
            span_s = p["t_s"][to - 1] - p["t_s"][first] if to > first else 0
            grown_bytes = (p["last_kib"] - p["at_warmup_kib"]) * 1024
            per_request = grown_bytes / (requests_per_s * span_s) if requests_per_s > 0 and span_s > 0 else 0
            rows.append((rank, p, span_s, per_request, max(p["threads"]) if p["threads"] else 0))
            checks.append((f"rank {rank} resident memory flat after warm-up (growth <= {soak['tolerance_pct']:g}%)",
                           p["flat"] and not p["exited"],
                           f"{p['growth_pct']:+.2f}%, {p['slope_kib_per_min']:+.0f} KiB/min"))
        # A coarse timeline: every 30 s of the first process's samples.
        step = 30.0
        next_t = 0.0
        for i, t in enumerate(soak["processes"][0]["t_s"]):
            if t + 1e-9 >= next_t or i == len(soak["processes"][0]["t_s"]) - 1:
                timeline.append((t, [q["rss_kib"][i] / 1024 if i < len(q["rss_kib"]) else None
                                     for q in soak["processes"]],
                                 [q["threads"][i] if i < len(q["threads"]) else None for q in soak["processes"]]))
                next_t = t + step
    else:
        checks.append(("resident memory sampled", False, "the report has no soak section"))
    checks.append(("SIGTERM drained and the job exited 0", a.server_status == 0,
                   f"exit {a.server_status} after {a.drain_s} s"))
    checks.append(("capserve-loadgen exit status 0", a.loadgen_status == 0, f"exit {a.loadgen_status}"))
    passed = all(ok for _, ok, _ in checks)

    out = []
    out.append("# Soak: capserve under sustained concurrent streams (issue 6, acceptance 6)\n")
    out.append(f"Verdict: **{'PASS' if passed else 'FAIL'}**\n")
    if a.command:
        out.append(f"Command: `{a.command.strip()}` (under `flock /tmp/capserve-heavy.lock`)\n")
    out.append(f"Load: {r['run'].get('summary', '')}. Server: {info.get('ranks', '?')} ranks, model "
               f"{info.get('model', '?')}, max running {info.get('max_running_sequences', '?')}, "
               f"selector `{info.get('batch_selector', '?')}`, capacity `{info.get('capacity', '?')}`.\n")
    out.append("| figure | value |\n| --- | --- |")
    out.append(f"| duration (load + drain of the client) | {c['wall_s']:.0f} s |")
    out.append(f"| streams (closed loop; mean / max in flight) | {c['mean_in_flight']:.0f} / {c['max_in_flight']} |")
    out.append(f"| requests sent / terminated / OK | {c['sent']} / {c['terminated']} / {c['ok']} |")
    out.append(f"| terminal statuses | {', '.join(f'{k} {v}' for k, v in sorted(c['status_counts'].items()))} |")
    out.append(f"| finish reasons (OK) | {', '.join(f'{k} {v}' for k, v in sorted(c['finish_reasons'].items()))} |")
    out.append(f"| lost / unterminated / protocol errors | {c['lost']} / {c['unterminated']} / "
               f"{c['protocol_errors']} |")
    out.append(f"| throughput | {requests_per_s:.1f} requests/s, {c['output_tokens_per_s']:.0f} output tokens/s |")
    out.append(f"| TTFT p50 / p99 | {ms(c['ttft_s'], 'p50')} / {ms(c['ttft_s'], 'p99')} ms |")
    out.append(f"| inter-token latency p50 / p99 | {ms(c['itl_s'], 'p50')} / {ms(c['itl_s'], 'p99')} ms |")
    out.append(f"| end-to-end p50 / p99 | {ms(c['e2e_s'], 'p50')} / {ms(c['e2e_s'], 'p99')} ms |")
    out.append(f"| SIGTERM drain | exit {a.server_status} after {a.drain_s} s |")
    out.append("")
    if soak:
        out.append(f"Resident memory (VmRSS, sampled every few seconds; growth from the first sample at or after "
                   f"{soak['warmup_s']:g} s of warm-up to the last sample of the load at {soak['load_end_s']:.0f} s; "
                   f"flat: growth <= {soak['tolerance_pct']:g}%):\n")
        out.append("| rank | pid | warm-up end MiB | end MiB | max MiB | growth | slope KiB/min | bytes/request | "
                   "max threads | flat |")
        out.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for rank, p, span_s, per_request, threads in rows:
            out.append(f"| {rank} | {p['pid']} | {p['at_warmup_kib'] / 1024:.1f} | {p['last_kib'] / 1024:.1f} | "
                       f"{p['max_kib'] / 1024:.1f} | {p['growth_pct']:+.2f}% | {p['slope_kib_per_min']:+.0f} | "
                       f"{per_request:+.0f} | {threads} | {'yes' if p['flat'] and not p['exited'] else 'NO'} |")
        out.append("\n(bytes/request: growth after warm-up / requests completed in that time.)\n")
        out.append("RSS over time (MiB; threads):\n")
        out.append("| t (s) | " + " | ".join(f"rank {i}" for i in range(len(soak["processes"]))) + " |")
        out.append("| --- |" + " --- |" * len(soak["processes"]))
        for t, mib, th in timeline:
            cells = [f"{m:.1f} ({n})" if m is not None else "gone" for m, n in zip(mib, th)]
            out.append(f"| {t:.0f} | " + " | ".join(cells) + " |")
        out.append("")
    out.append("Checks:\n")
    for what, ok, detail in checks:
        out.append(f"- [{'x' if ok else ' '}] {what}{': ' + detail if detail else ''}")
    out.append("")
    text = "\n".join(out)
    with open(a.md, "w") as f:
        f.write(text)
    print(text)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
