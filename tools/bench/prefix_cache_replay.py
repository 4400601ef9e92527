#!/usr/bin/env python3
"""The prefix cache on and off, side by side in one run, on a slice of the Mooncake trace.

Starts `capserve` (deploy/launch.sh, --np ranks, the embedded default model) twice with the same flags but for
the cache flag, `--prefix-cache` and then `--no-prefix-cache` (--on-args / --off-args, or the environment
variables CAPSERVE_PREFIX_ON_ARGS / CAPSERVE_PREFIX_OFF_ARGS, replace them), and replays the same slice of
../shared/data/traces/mooncake_synthetic.jsonl against each with capserve-loadgen: lengths x1/32 so that a hash
block is 16 tokens, the server's KV block (tools/README.md, "Mooncake traces"), prompts capped to the model's
1024-token context, token-id prompts whose shared prefixes follow the trace's hash_ids, --ignore-eos so that
each request generates the trace's output length. Builds nothing: it needs the build's server/capserve and
tools/capserve-loadgen.

    /usr/bin/python3 tools/bench/prefix_cache_replay.py --build-dir build

reports, for each run: prompt tokens sent and prefill tokens the server computed, the cache's hit rate in tokens
and in blocks (and the trace slice's own repeat rate, the most any cache could hit), evictions, TTFT and
end-to-end p50/p99, requests/s, prompt and output tokens/s. Server figures come from /metrics
(capserve_prefill_tokens_computed_total, capserve_prefix_cache_{query,hit}_{tokens,blocks}_total,
capserve_prefix_cache_evictions_total, read by the loadgen); one the server does not export is "n/a". Writes
<out-dir>/<name>.json (both loadgen reports, per request), <name>.md (the table) and <name>.png (TTFT and
end-to-end CDFs, on vs off). The slice: trace seconds [--trace-start-s, + --duration-s / --time-scale), default
the trace's last two minutes (900 s on: 513 requests whose full 16-token blocks repeat one earlier in the slice 68%
of the time, against under 10% in its first minutes) at 0.8x speed (--time-scale 1.25, 150 s): at real speed,
about 2,200 prompt tokens/s, the default model on 2 ranks of the shared 2-core machine saturated (TTFT p50 rising
to 5 s by the end of the slice) without a cache. Runs need only the standard library; the
plot needs matplotlib: when this interpreter lacks it, the report step runs under tools/.venv or
tools/.venv-bench (--report-only rewrites the report and plot from an existing JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from launched_server import LaunchedServer  # noqa: E402  (tools/)

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "deploy" / "models" / "capserve-moe-tiny"
TRACE = ROOT.parent / "shared" / "data" / "traces" / "mooncake_synthetic.jsonl"
VARIANTS = ("on", "off")


def slice_args(a: argparse.Namespace) -> list[str]:
    """The loadgen flags that choose and size the requests: the same for both runs and --write-trace."""
    args = ["--trace", str(a.trace), "--length-scale", str(a.length_scale), "--time-scale", str(a.time_scale),
            "--trace-start-s", str(a.trace_start_s), "--duration-s", str(a.duration_s), "--max-prompt-tokens",
            str(a.max_prompt_tokens), "--max-tokens", str(a.max_tokens), "--seed", str(a.seed)]
    if a.max_requests > 0:
        args += ["--max-requests", str(a.max_requests)]
    return args


def loadgen(a: argparse.Namespace, server: LaunchedServer, out: Path) -> dict:
    cmd = [str(a.build / "tools" / "capserve-loadgen"), "--target", server.target, "--metrics-url", server.metrics,
           "--mode", "generate", "--tokenizer", str(MODEL), "--ignore-eos", "--per-request", "--progress-s", "0",
           "--drain-timeout-s", str(a.drain_timeout_s), "--json", str(out), *slice_args(a)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"prefix_cache_replay: loadgen failed ({done.returncode}): {shlex.join(cmd)}\n{done.stderr}")
    return json.loads(out.read_text())


def slice_repeat_rate(a: argparse.Namespace, work: Path) -> dict:
    """The slice as sent (capserve-loadgen --write-trace): how many of its full blocks repeat an earlier one."""
    path = work / "slice.jsonl"
    cmd = [str(a.build / "tools" / "capserve-loadgen"), "--write-trace", str(path), "--max-context",
           str(a.context), *slice_args(a)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"prefix_cache_replay: {shlex.join(cmd)} failed:\n{done.stderr}")
    block = round(512 * a.length_scale)
    seen, blocks, repeats, requests = set(), 0, 0, 0
    for line in path.read_text().splitlines():
        r = json.loads(line)
        requests += 1
        for h in r["hash_ids"][: r["input_length"] // block]:
            blocks += 1
            repeats += h in seen
            seen.add(h)
    return {"requests": requests, "block_tokens": block, "full_blocks": blocks, "repeated_blocks": repeats,
            "repeat_rate": repeats / blocks if blocks else None, "loadgen": done.stdout.strip()}


def run_all(a: argparse.Namespace) -> dict:
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    flags = {"on": a.server_args + a.on_args, "off": a.server_args + a.off_args}
    if flags["on"] == flags["off"]:
        print("prefix_cache_replay: CHECK RUN: both servers get the same flags; this is not a cache comparison",
              file=sys.stderr)
    data = {"trace": str(a.trace), "slice": slice_args(a), "np": a.np, "flags": flags,
            "slice_repeats": slice_repeat_rate(a, work), "runs": {}}
    started = time.time()
    for variant in VARIANTS:
        print(f"prefix_cache_replay: cache {variant}: capserve {shlex.join(flags[variant])}", file=sys.stderr)
        with LaunchedServer(a.build, a.np, flags[variant], work / f"server_{variant}.log", a.start_timeout_s) as server:
            data["runs"][variant] = loadgen(a, server, work / f"loadgen_{variant}.json")
            data["runs"][variant]["server_command"] = server.command
    data["elapsed_s"] = time.time() - started
    return data


def ratio(part, whole):
    return part / whole if part is not None and whole else None


def figures(run: dict) -> dict:
    c, s = run["client"], run.get("server", {})
    sent_prompt = sum(r["prompt_tokens"] for r in run.get("requests", []) if r["status"] == "OK")
    return {
        "requests": c["sent"], "ok": c["ok"], "wall_s": c["wall_s"],
        "prompt_tokens": sent_prompt,
        "prefill_tokens_computed": s.get("prefill_tokens_computed"),
        "hit_rate_tokens": ratio(s.get("prefix_cache_hit_tokens"), s.get("prefix_cache_query_tokens")),
        "hit_rate_blocks": ratio(s.get("prefix_cache_hit_blocks"), s.get("prefix_cache_query_blocks")),
        "hit_tokens": s.get("prefix_cache_hit_tokens"), "hit_blocks": s.get("prefix_cache_hit_blocks"),
        "evictions": s.get("prefix_cache_evictions"),
        "ttft_p50_s": c["ttft_s"].get("p50"), "ttft_p99_s": c["ttft_s"].get("p99"),
        "e2e_p50_s": c["e2e_s"].get("p50"), "e2e_p99_s": c["e2e_s"].get("p99"),
        "requests_per_s": c["requests_per_s"], "output_tokens_per_s": c["output_tokens_per_s"],
        "prompt_tokens_per_s": sent_prompt / c["wall_s"] if c["wall_s"] else None,
    }


ROWS = [  # key, label, format
    ("requests", "requests sent", "{:.0f}"),
    ("ok", "requests OK", "{:.0f}"),
    ("prompt_tokens", "prompt tokens sent", "{:,.0f}"),
    ("prefill_tokens_computed", "prefill tokens computed", "{:,.0f}"),
    ("hit_rate_tokens", "cache hit rate, tokens", "{:.1%}"),
    ("hit_rate_blocks", "cache hit rate, blocks", "{:.1%}"),
    ("evictions", "cache evictions", "{:,.0f}"),
    ("ttft_p50_s", "TTFT p50 (ms)", "ms"),
    ("ttft_p99_s", "TTFT p99 (ms)", "ms"),
    ("e2e_p50_s", "end-to-end p50 (ms)", "ms"),
    ("e2e_p99_s", "end-to-end p99 (ms)", "ms"),
    ("requests_per_s", "requests/s", "{:.2f}"),
    ("prompt_tokens_per_s", "prompt tokens/s", "{:,.0f}"),
    ("output_tokens_per_s", "output tokens/s", "{:.1f}"),
]


def cell(value, fmt: str) -> str:
    if value is None:
        return "n/a"
    return f"{value * 1e3:,.0f}" if fmt == "ms" else fmt.format(value)


def write_report(data: dict, out_dir: Path, name: str) -> None:
    figs = {v: figures(data["runs"][v]) for v in VARIANTS}
    rep = data["slice_repeats"]
    run0 = data["runs"]["on"]["run"]
    lines = [f"# Prefix cache on vs off: Mooncake trace replay ({name})", ""]
    if data["flags"]["on"] == data["flags"]["off"]:
        lines += ["**CHECK RUN: both servers ran the same flags; not a cache comparison.**", ""]
    lines += [
        f"`tools/bench/prefix_cache_replay.py`: capserve on {data['np']} ranks, the default model, started twice; "
        f"capserve-loadgen replays the same slice against each, one run after the other ({data['elapsed_s']:.0f} s "
        "in all).", "",
        f"- slice: {run0['arrivals']}",
        f"- lengths: {run0.get('length_caps_summary', 'n/a')}",
        f"- the slice's own repeats: {rep['repeated_blocks']:,} of its {rep['full_blocks']:,} full "
        f"{rep['block_tokens']}-token blocks repeat one earlier in the slice "
        f"({cell(rep['repeat_rate'], '{:.1%}')}): the hit rate of an unbounded cache",
        f"- cache on: `capserve {shlex.join(data['flags']['on'])}`",
        f"- cache off: `capserve {shlex.join(data['flags']['off'])}`",
        f"- server: {run0['server_info'].get('model')}, {run0['server_info'].get('kv_blocks_per_rank')} KV blocks "
        f"per rank, max_batched_tokens {run0['server_info'].get('max_batched_tokens')}",
        "",
        "| | cache on | cache off | on / off |",
        "|---|---:|---:|---:|",
    ]
    for key, label, fmt in ROWS:
        on, off = figs["on"][key], figs["off"][key]
        r = on / off if on is not None and off else None
        lines.append(f"| {label} | {cell(on, fmt)} | {cell(off, fmt)} | {cell(r, '{:.2f}')} |")
    lines += ["", "n/a: the server does not export that metric. TTFT and end-to-end latency as the client measured "
              "them (OK requests); throughput over the run's wall time."]
    (out_dir / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(data, out_dir / f"{name}.png")


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, title in ((axes[0], "ttft_s", "time to first token"), (axes[1], "e2e_s", "end-to-end latency")):
        for variant, style in (("on", "-"), ("off", "--")):
            values = sorted(r[key] * 1e3 for r in data["runs"][variant]["requests"]
                            if r["status"] == "OK" and r[key] is not None)
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], style,
                        label=f"cache {variant} (n={len(values)})")
        ax.set_xscale("log")
        ax.set_xlabel(f"{title} (ms, log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("Mooncake trace replay, prefix cache on vs off: " + data["runs"]["on"]["run"]["arrivals"],
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", default="build")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--server-args", default="", type=shlex.split, help="capserve flags for both runs")
    p.add_argument("--on-args", default=os.environ.get("CAPSERVE_PREFIX_ON_ARGS", "--prefix-cache"),
                   type=shlex.split, help="the cache-on run's own flags [$CAPSERVE_PREFIX_ON_ARGS or --prefix-cache]")
    p.add_argument("--off-args", default=os.environ.get("CAPSERVE_PREFIX_OFF_ARGS", "--no-prefix-cache"),
                   type=shlex.split,
                   help="the cache-off run's own flags [$CAPSERVE_PREFIX_OFF_ARGS or --no-prefix-cache]")
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--length-scale", type=float, default=1 / 32)
    p.add_argument("--trace-start-s", type=float, default=900)
    p.add_argument("--duration-s", type=float, default=150, help="of the run (the slice after --time-scale)")
    p.add_argument("--time-scale", type=float, default=1.25, help="run time = trace time x this")
    p.add_argument("--max-requests", type=int, default=0)
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--context", type=int, default=1024, help="the served context, for the slice's repeat rate")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--drain-timeout-s", type=float, default=300)
    p.add_argument("--start-timeout-s", type=float, default=300)
    p.add_argument("--name", default="prefix_cache_replay", help="results file name (without extension)")
    p.add_argument("--out-dir", default=str(ROOT / "tools" / "results"))
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "capserve_prefix_cache_replay"))
    p.add_argument("--report-only", action="store_true", help="rewrite the report from <out-dir>/<name>.json")
    a = p.parse_args()
    a.build = Path(a.build_dir).resolve()
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / f"{a.name}.json"
    if not a.report_only:
        for binary in ("server/capserve", "tools/capserve-loadgen"):
            if not os.access(a.build / binary, os.X_OK):
                raise SystemExit(f"prefix_cache_replay: {a.build / binary} is not built")
        results.write_text(json.dumps(run_all(a), indent=1))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        for venv in (".venv", ".venv-bench"):
            python = ROOT / "tools" / venv / "bin" / "python"
            if python.exists():
                return subprocess.call([str(python), __file__, "--report-only", "--out-dir", str(out_dir), "--name",
                                        a.name])
        raise SystemExit("prefix_cache_replay: the plot needs matplotlib (tools/.venv); the JSON is written")
    write_report(json.loads(results.read_text()), out_dir, a.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
