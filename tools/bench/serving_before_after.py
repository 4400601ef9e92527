#!/usr/bin/python3
"""CPU serving throughput of two capserve builds side by side in one run (e.g. before and after a change).

    /usr/bin/python3 tools/bench/serving_before_after.py --before OLD_BUILD --after build [--rounds 2]

Starts each build's `capserve` (deploy/launch.sh, 2 ranks, the embedded default model, its default flags plus
--server-args, and --before-args / --after-args for one side: the same build twice compares two settings) and drives it with the AFTER build's capserve-loadgen in a closed loop (--concurrency streams of
chat requests from the corpus, --ignore-eos, --max-tokens each) for --duration-s; the builds alternate
(before, after, before, after, ...) so that the machine's drift hits both. Prints each run's output tokens/s,
requests/s and TTFT / ITL p50, the medians per build and the after/before ratio; writes
tools/results/serving_before_after.{md,json}. Only Debian's python3 is needed."""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from launched_server import LaunchedServer  # noqa: E402  (tools/)

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT.parent / "shared" / "data" / "corpus"


def run(a, build: Path, side_args: str, work: Path, name: str) -> dict:
    log = work / f"{name}.log"
    flags = ["--http-port", "-1", *a.server_args.split(), *side_args.split()]
    with LaunchedServer(build, 2, flags, log, 180) as server:
        out = work / f"{name}.json"
        cmd = [str(a.after / "tools" / "capserve-loadgen"), "--target", server.target, "--metrics-url",
               server.metrics, "--concurrency", str(a.concurrency), "--duration-s", str(a.duration_s),
               "--max-tokens", str(a.max_tokens), "--ignore-eos", "--progress-s", "0", "--corpus", str(CORPUS),
               "--json", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"serving_before_after: loadgen failed: {' '.join(cmd)}\n{done.stderr}")
        client = json.loads(out.read_text())["client"]
    return {"output_tokens_per_s": client["output_tokens_per_s"], "requests_per_s": client["requests_per_s"],
            "ttft_p50_ms": client["ttft_s"]["p50"] * 1e3, "itl_p50_ms": client["itl_s"]["p50"] * 1e3,
            "ok": client["ok"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, required=True, help="the build directory of the old capserve")
    p.add_argument("--after", type=Path, required=True, help="the build directory of the new one")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--duration-s", type=float, default=30)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--server-args", default="", help="extra flags for both servers")
    p.add_argument("--before-args", default="", help="extra flags for the BEFORE server only")
    p.add_argument("--after-args", default="", help="extra flags for the AFTER server only (e.g. one build, "
                   "two settings: --before build --after build --after-args=--no-prefix-cache)")
    p.add_argument("--out-dir", type=Path, default=ROOT / "tools" / "results")
    a = p.parse_args()
    a.before, a.after = a.before.resolve(), a.after.resolve()
    runs = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for side, build, side_args in (("before", a.before, a.before_args), ("after", a.after, a.after_args)):
                figures = run(a, build, side_args, Path(tmp), f"{side}{r}")
                runs[side].append(figures)
                print(f"round {r} {side:6}: {figures['output_tokens_per_s']:8.1f} output tokens/s, "
                      f"{figures['requests_per_s']:.2f} requests/s, TTFT p50 {figures['ttft_p50_ms']:.1f} ms, "
                      f"ITL p50 {figures['itl_p50_ms']:.1f} ms", flush=True)
    med = {side: {k: statistics.median(f[k] for f in v) for k in v[0]} for side, v in runs.items()}
    ratio = med["after"]["output_tokens_per_s"] / med["before"]["output_tokens_per_s"]
    print(f"median output tokens/s: before {med['before']['output_tokens_per_s']:.1f}, "
          f"after {med['after']['output_tokens_per_s']:.1f}; after / before = {ratio:.3f}")
    a.out_dir.mkdir(parents=True, exist_ok=True)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if k != "out_dir"}
    (a.out_dir / "serving_before_after.json").write_text(
        json.dumps({"settings": settings, "runs": runs, "median": med, "after_over_before": ratio}, indent=2) + "\n")
    rows = "\n".join(f"| {side} | {f['output_tokens_per_s']:.1f} | {f['requests_per_s']:.2f} | "
                     f"{f['ttft_p50_ms']:.1f} | {f['itl_p50_ms']:.1f} |" for side in ("before", "after")
                     for f in runs[side])
    (a.out_dir / "serving_before_after.md").write_text(
        "# CPU serving throughput, two builds side by side\n\n"
        f"`tools/bench/serving_before_after.py` ({a.rounds} alternating rounds, {a.concurrency} concurrent chat "
        f"streams, {a.max_tokens} tokens each, {a.duration_s:.0f} s per run, 2 ranks, the default model, this "
        "2-core machine).\n\n| build | output tokens/s | requests/s | TTFT p50 ms | ITL p50 ms |\n|---|---|---|---|---|\n"
        f"{rows}\n\nMedian output tokens/s after / before: **{ratio:.3f}**.\n")


if __name__ == "__main__":
    main()
