#!/usr/bin/env python3
"""Batch selection (CAPS, server/README.md) against the live server: fcfs vs greedy vs power_of_d.

Starts `capserve` under mpirun (deploy/launch.sh, --np ranks, the embedded default model or --model) once per
(capacity factor, strategy), drives each with capserve-loadgen over the same workloads — Poisson arrivals at
several rates and the bursty Azure code trace replayed at several speeds, prompts drawn from the corpus in
semantic bursts (runs of one domain), token counts from the code trace — and compares every strategy with
fcfs on the same workload: p99 time to first token and end-to-end latency, throughput, the per-rank load
imbalance of the MoE layers (server /metrics, mean over steps) and the load predictor's accuracy (cosine of
predicted vs realized per-layer per-rank load, mean over steps; the model's learned load map when it has one).

    python3 tools/eval/selector_eval.py --build-dir build

writes <out-dir>/selector_eval.json (every run's loadgen report), selector_eval.md (the tables) and
selector_eval.png. Each workload uses the same seed for every strategy, so they see the same requests at the
same times; the strategies' order rotates from one capacity factor (and repetition) to the next, so slow
drift of this shared machine does not always favour the same one. Runs need only the standard library; the
plot needs matplotlib: when this interpreter lacks it, the report step runs under tools/.venv/bin/python
(--report-only rewrites the report and plot from an existing JSON).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from launched_server import LaunchedServer  # noqa: E402  (tools/)

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "deploy" / "models" / "capserve-moe-tiny"
TRACE = ROOT.parent / "shared" / "data" / "traces" / "azure_llm_2023_code.csv"
CORPUS = ROOT.parent / "shared" / "data" / "corpus"
STRATEGIES = ["fcfs", "greedy", "power_of_d"]
BASELINE = "fcfs"


def workload_args(spec: str, duration_s: float) -> list[str]:
    """poisson:RATE (requests/s) or trace:SCALE (replay time = trace time x SCALE)."""
    kind, _, value = spec.partition(":")
    if kind == "poisson":
        return ["--rate", value, "--duration-s", str(duration_s)]
    if kind == "trace":
        # From second 848 the trace ramps into its largest burst (11 requests/s rising to 67/s by second 862,
        # against a mean of 2.6/s): scale 4 replays the ramp, scale 2 the ramp and the burst's peak.
        return ["--time-scale", value, "--trace-start-s", "848", "--duration-s", str(duration_s)]
    raise SystemExit(f"selector_eval: unknown workload {spec!r} (poisson:RATE or trace:SCALE)")


def describe_workload(spec: str) -> str:
    kind, _, value = spec.partition(":")
    if kind == "poisson":
        return f"Poisson {value}/s"
    return f"code trace {1 / float(value):.3g}x speed"


def loadgen(build: Path, server: LaunchedServer, args: list[str], out: Path, seed: int, model: Path,
            prompt_mix: str = "bursts") -> dict:
    cmd = [str(build / "tools" / "capserve-loadgen"), "--target", server.target, "--metrics-url",
           server.metrics, "--trace", str(TRACE), "--corpus", str(CORPUS), "--tokenizer", str(model),
           "--prompt-mix", prompt_mix, "--max-prompt-tokens", "512", "--max-tokens", "64", "--seed", str(seed),
           "--progress-s", "0", "--json", str(out), *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"selector_eval: loadgen failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr}")
    return json.loads(out.read_text())


def run_all(a: argparse.Namespace) -> dict:
    build = Path(a.build_dir).resolve()
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    runs = []
    started = time.time()
    settings = [(rep, gamma) for rep in range(a.reps) for gamma in a.gammas]
    for turn, (rep, gamma) in enumerate(settings):
        order = a.strategies[turn % len(a.strategies):] + a.strategies[:turn % len(a.strategies)]
        for strategy in order:
            extra = ["--batch-selector", strategy, "--capacity-factor", gamma, *a.server_args]
            if gamma != "inf":
                extra += ["--capacity-policy", a.capacity_policy]
            name = f"r{rep}-g{gamma}-{strategy}"
            with LaunchedServer(build, a.np, extra, work / f"{name}.server.log", model=Path(a.model)) as server:
                # Warm-up, not recorded: first-touch of weights and caches.
                loadgen(build, server, ["--concurrency", "4", "--max-requests", "8", "--duration-s", "30"],
                        work / f"{name}.warmup.json", 99, Path(a.model))
                for w, spec in enumerate(a.workloads):
                    report = loadgen(build, server, workload_args(spec, a.duration_s), work / f"{name}-{w}.json",
                                     a.seed + w, Path(a.model), a.prompt_mix)
                    runs.append({"rep": rep, "gamma": gamma, "strategy": strategy, "workload": spec,
                                 "report": report})
                    c = report["client"]
                    print(f"[{time.time() - started:6.0f}s] gamma={gamma:>4} {strategy:>10} "
                          f"{describe_workload(spec):>18}: {c['ok']} ok, lost {c['lost']}, "
                          f"p99 TTFT {c['ttft_s']['p99'] * 1e3:7.0f} ms, p99 e2e {c['e2e_s']['p99'] * 1e3:7.0f} ms, "
                          f"{c['output_tokens_per_s']:6.1f} tok/s, imbalance "
                          f"{report['server'].get('imbalance_mean') or float('nan'):.3f}", flush=True)
    return {"np": a.np, "model": Path(a.model).name, "server_args": a.server_args, "duration_s": a.duration_s, "reps": a.reps, "gammas": a.gammas,
            "workloads": a.workloads, "strategies": a.strategies, "capacity_policy": a.capacity_policy, "seed": a.seed, "prompt_mix": a.prompt_mix,
            "wall_s": time.time() - started, "runs": runs}


# --------------------------------------------------------------------------------------------- reporting


def figures(run: dict) -> dict:
    c, s = run["report"]["client"], run["report"]["server"]
    return {
        "ttft_p99": c["ttft_s"]["p99"], "e2e_p99": c["e2e_s"]["p99"], "ttft_p50": c["ttft_s"]["p50"],
        "tok_s": c["output_tokens_per_s"], "req_s": c["requests_per_s"],
        "imbalance": s.get("imbalance_mean"), "cosine": s.get("predictor_cosine"),
        "predicted": s.get("selector_predicted_imbalance"), "realized": s.get("selector_realized_imbalance"),
        "queue_ms": (s.get("queue_time_mean_s") or 0) * 1e3, "ok": c["ok"], "lost": c["lost"],
        "sent": c["sent"], "decision_us": (s.get("selector_decision_mean_s") or 0) * 1e6,
        "decisions": s.get("selector_decisions"),
    }


def mean(values: list[float]) -> float:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def averaged(data: dict) -> dict:
    """(gamma, workload, strategy) -> figures averaged over the repetitions."""
    cells: dict = {}
    for run in data["runs"]:
        cells.setdefault((run["gamma"], run["workload"], run["strategy"]), []).append(figures(run))
    return {key: {k: mean([f[k] for f in fs]) for k in fs[0]} for key, fs in cells.items()}


def pct(new: float, old: float) -> float:
    return 100.0 * (new - old) / old if old else float("nan")


def write_report(data: dict, out_dir: Path, name: str) -> None:
    cells = averaged(data)
    lines = [
        "# Batch selection against the live server (fcfs vs greedy vs power_of_d)",
        "",
        f"Generated by `tools/eval/selector_eval.py`: `capserve` under mpirun -np {data['np']} with "
        f"{data.get('model', 'the default model')}, one server per (gamma, strategy), each workload {data['duration_s']:g} s of arrivals "
        f"({data['reps']} repetition(s), strategies' order rotated), prompts from the corpus "
        + ("each from a random domain" if data.get("prompt_mix") == "mixed" else "in bursts of one domain")
        + ", sizes from the Azure code trace (prompt <= 512, output <= 64 tokens), greedy decoding. "
        f"Capacity policy at finite gamma: {data['capacity_policy']}. Extra server flags: "
        f"`{' '.join(data.get('server_args', [])) or 'none'}`. Wall time {data['wall_s'] / 60:.0f} min.",
        "",
        "Improvements are versus fcfs on the same workload (same requests, same arrival times): positive = "
        "better (lower p99 latency, more output tokens/s, lower mean per-rank imbalance over the MoE layers' "
        "steps). The cosine is the load predictor's per-layer per-rank load vs the realized one (mean over "
        "steps). Selections: admissions where the selector chose (below the minimum queue depth, for overdue "
        "requests and for fcfs, admission is first come first served).",
        "",
    ]
    for gamma in data["gammas"]:
        lines += [f"## gamma = {gamma}", "",
                  "| workload | strategy | sent | selections | p99 TTFT ms | p99 e2e ms | tok/s | imbalance | cosine | "
                  "predicted / realized imb. | TTFT p99 gain | e2e p99 gain | throughput gain | imbalance "
                  "reduction |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for spec in data["workloads"]:
            base = cells.get((gamma, spec, BASELINE))
            for strategy in data.get("strategies", STRATEGIES):
                f = cells.get((gamma, spec, strategy))
                if f is None or base is None:
                    continue
                gains = ["", "", "", ""] if strategy == BASELINE else [
                    f"{-pct(f['ttft_p99'], base['ttft_p99']):+.1f}%", f"{-pct(f['e2e_p99'], base['e2e_p99']):+.1f}%",
                    f"{pct(f['tok_s'], base['tok_s']):+.1f}%",
                    f"{-pct(f['imbalance'] - 1, base['imbalance'] - 1):+.1f}% of excess"]
                lines.append(
                    f"| {describe_workload(spec)} | {strategy} | {f['sent']:.0f} | "
                    f"{'n/a' if f['decisions'] is None else format(f['decisions'], '.0f')} | "
                    f"{f['ttft_p99'] * 1e3:.0f} | "
                    f"{f['e2e_p99'] * 1e3:.0f} | {f['tok_s']:.1f} | {f['imbalance']:.3f} | {f['cosine']:.3f} | "
                    f"{f['predicted']:.3f} / {f['realized']:.3f} | " + " | ".join(gains) + " |")
        lines.append("")
    if data["reps"] > 1:
        lines += spread(data)
    (out_dir / f"{name}.md").write_text("\n".join(lines))
    print("\n".join(lines))
    plot(data, cells, out_dir / f"{name}.png")


def spread(data: dict) -> list[str]:
    """Each strategy's gains over fcfs repetition by repetition (each against the fcfs run of its own
    repetition): an effect is one whose sign holds across the repetitions, not one mean."""
    runs = {(r["rep"], r["gamma"], r["workload"], r["strategy"]): figures(r) for r in data["runs"]}
    lines = ["## Spread over the repetitions", "",
             "Gain over fcfs in each repetition (min .. max, then every value in repetition order).", "",
             "| gamma | workload | strategy | TTFT p99 gain | e2e p99 gain | imbalance reduction (of excess) |",
             "|---|---|---|---|---|---|"]
    for gamma in data["gammas"]:
        for spec in data["workloads"]:
            for strategy in data.get("strategies", STRATEGIES):
                if strategy == BASELINE:
                    continue
                gains: dict = {"ttft": [], "e2e": [], "imb": []}
                for rep in range(data["reps"]):
                    f, base = runs.get((rep, gamma, spec, strategy)), runs.get((rep, gamma, spec, BASELINE))
                    if f is None or base is None:
                        continue
                    gains["ttft"].append(-pct(f["ttft_p99"], base["ttft_p99"]))
                    gains["e2e"].append(-pct(f["e2e_p99"], base["e2e_p99"]))
                    gains["imb"].append(-pct(f["imbalance"] - 1, base["imbalance"] - 1))
                if not gains["ttft"]:
                    continue
                cell = lambda v: (f"{min(v):+.1f}% .. {max(v):+.1f}% ("  # noqa: E731
                                  + ", ".join(f"{x:+.1f}" for x in v) + ")")
                lines.append(f"| {gamma} | {describe_workload(spec)} | {strategy} | {cell(gains['ttft'])} | "
                             f"{cell(gains['e2e'])} | {cell(gains['imb'])} |")
    return lines + [""]


def plot(data: dict, cells: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("ttft_p99", "p99 TTFT (s)"), ("e2e_p99", "p99 end-to-end (s)"), ("tok_s", "output tokens/s"),
              ("imbalance", "mean per-rank imbalance")]
    fig, axes = plt.subplots(len(data["gammas"]), len(panels), figsize=(4.2 * len(panels), 3.4 * len(data["gammas"])),
                             squeeze=False)
    labels = [describe_workload(w) for w in data["workloads"]]
    strategies = data.get("strategies", STRATEGIES)
    width = 0.8 / len(strategies)
    for row, gamma in enumerate(data["gammas"]):
        for col, (key, title) in enumerate(panels):
            ax = axes[row][col]
            for i, strategy in enumerate(strategies):
                values = [cells.get((gamma, w, strategy), {}).get(key, float("nan")) for w in data["workloads"]]
                ax.bar([x + (i - 1) * width for x in range(len(labels))], values, width, label=strategy)
            ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
            ax.set_title(f"{title}, gamma={gamma}", fontsize=9)
            if key == "imbalance":
                ax.set_ylim(bottom=1.0)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", default="build")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--model", default=str(MODEL), help="the model directory the servers serve")
    p.add_argument("--gammas", default="inf,1.5", type=lambda s: s.split(","))
    p.add_argument("--capacity-policy", default="drop")
    p.add_argument("--strategies", default=",".join(STRATEGIES), type=lambda s: s.split(","),
                   help="the batch selectors to run, comma-separated (fcfs first: the baseline)")
    p.add_argument("--server-args", default=[], type=lambda s: s.split(),
                   help="extra capserve flags for every server, e.g. \"--selector-max-wait-ms 10000\"")
    p.add_argument("--name", default="selector_eval", help="results file name (without extension)")
    p.add_argument("--workloads", default="poisson:3,poisson:6,poisson:9,trace:4,trace:2",
                   type=lambda s: s.split(","), help="poisson:RATE and trace:TIME_SCALE, comma-separated")
    p.add_argument("--duration-s", type=float, default=45)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--prompt-mix", default="bursts", choices=["bursts", "mixed"],
                   help="prompts in runs of one domain (bursts of 16) or each from a random domain")
    p.add_argument("--out-dir", default=str(ROOT / "tools" / "results"))
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "capserve_selector_eval"))
    p.add_argument("--report-only", action="store_true", help="rewrite the report from <out-dir>/selector_eval.json")
    a = p.parse_args()
    if BASELINE not in a.strategies or any(x not in STRATEGIES for x in a.strategies):
        raise SystemExit(f"selector_eval: --strategies takes {', '.join(STRATEGIES)} and must include {BASELINE}")
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / f"{a.name}.json"
    if not a.report_only:
        results.write_text(json.dumps(run_all(a), indent=1))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        venv = ROOT / "tools" / ".venv" / "bin" / "python"
        if not venv.exists():
            raise SystemExit("selector_eval: the plot needs matplotlib (tools/.venv); the JSON is written")
        return subprocess.call([str(venv), __file__, "--report-only", "--out-dir", str(out_dir), "--name", a.name])
    write_report(json.loads(results.read_text()), out_dir, a.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
