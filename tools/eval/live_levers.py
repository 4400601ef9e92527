#!/usr/bin/env python3
"""The levers side by side on the live server: placement, replication, capacity and batch selection, alone and
combined, on the same requests, with what each costs in memory and quality.

Reads the reports `selector_eval.py` wrote for one grid (same --np, --seed, --workloads, --reps, --gammas) run
three times: with the contiguous placement, with `--expert-placement STATS.json` (balanced) and with
`--expert-placement STATS.json --redundant-experts N` (EPLB replication). Every lever is then a cell of those
runs: the placement (contiguous / balanced / replicated), the capacity factor (inf / the finite one) and the
batch selector (fcfs / greedy / power_of_d). Each row gives p50 / p99 TTFT, p99 end-to-end latency, output
tokens/s and the mean per-rank imbalance (mean over repetitions), the change of p99 TTFT and throughput against
the baseline (contiguous, fcfs, gamma = inf) in every repetition (each against its own repetition's baseline:
an effect is one whose sign holds), the assignments dropped, the expert weights each rank holds
(`capserve-memory-plan`, the loader's own count) and the quality at that capacity factor: held-out perplexity
change and next-token accuracy (`capacity_quality.py`'s JSON for the same model: placement, replication and
selection compute the exact model).

    python3 tools/eval/live_levers.py --build-dir build \\
        --contiguous tools/results/selector_eval_fine_model_8ranks_repeated.json \\
        --balanced tools/results/selector_eval_fine_model_8ranks_balanced_repeated.json \\
        --replicated tools/results/selector_eval_fine_model_8ranks_replicated_repeated.json \\
        --placement-stats /tmp/place/fine_balanced_8.json --redundant-experts 8 \\
        --quality tools/results/capacity_quality_fine_model.json --name live_levers_fine_model_8ranks

writes <out-dir>/<name>.md, .json and .png (the plot needs matplotlib: tools/.venv when this interpreter lacks
it).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASELINE = ("contiguous", "inf", "fcfs")


def describe_workload(spec: str) -> str:
    kind, _, value = spec.partition(":")
    return f"Poisson {value}/s" if kind == "poisson" else f"code trace {1 / float(value):.3g}x speed"


def load_runs(path: Path, placement: str) -> tuple[dict, dict]:
    """(placement, gamma, strategy, workload, rep) -> the run's figures, and the grid's settings."""
    data = json.loads(path.read_text())
    cells = {}
    for run in data["runs"]:
        c, s = run["report"]["client"], run["report"]["server"]
        assignments = s.get("assignments") or 0
        cells[(placement, run["gamma"], run["strategy"], run["workload"], run["rep"])] = {
            "ttft_p50": c["ttft_s"]["p50"], "ttft_p99": c["ttft_s"]["p99"], "e2e_p99": c["e2e_s"]["p99"],
            "tok_s": c["output_tokens_per_s"], "imbalance": s.get("imbalance_mean"),
            "dropped": (s.get("dropped") or 0) / assignments if assignments else 0.0, "ok": c["ok"],
            "lost": c["lost"]}
    settings = {k: data[k] for k in ("np", "model", "seed", "workloads", "reps", "duration_s")}
    return cells, settings


def expert_bytes_per_rank(build: Path, model: Path, ranks: int, placement: str, redundant: int) -> int:
    """The most routed-expert bytes one rank holds: the expert weights capserve-memory-plan counts per rank (the
    loader's walk; its "experts" column, all MoE layers) times one expert's gate, up and down projections."""
    cmd = [str(build / "runtime" / "capserve-memory-plan"), "--model-config", str(model / "config.json"),
           "--ranks", str(ranks), "--device-memory", "141GB", "--device", "cpu", "--expert-placement", placement,
           "--redundant-experts", str(redundant)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode not in (0, 3):
        raise SystemExit(f"live_levers: {' '.join(cmd)} failed ({done.returncode}):\n{done.stderr}")
    counts = [int(m.group(2)) for m in re.finditer(r"^\s*(\d+)\s+(\d+)\s", done.stdout, re.MULTILINE)]
    if len(counts) != ranks:
        raise SystemExit(f"live_levers: no per-rank expert counts in the memory plan:\n{done.stdout}")
    config = json.loads((model / "config.json").read_text())
    width = config.get("moe_intermediate_size") or config["intermediate_size"]
    element = {"bfloat16": 2, "float16": 2, "float32": 4}[config.get("dtype") or config.get("torch_dtype")]
    return max(counts) * 3 * config["hidden_size"] * width * element


def quality(path: Path) -> dict:
    """gamma -> held-out perplexity change and next-token accuracy of the drop policy (gate score, global scope,
    expert granularity)."""
    runs = json.loads(path.read_text())["runs"]
    base = next(r for r in runs if r["id"] == "inf")["result"]["all"]
    out = {"inf": {"perplexity_change": 0.0, "accuracy": base.get("accuracy")}}
    for r in runs:
        if r["variant"] == "drop-gate" and r["granularity"] == "expert" and r["scope"] == "global":
            out[r["gamma"]] = {"perplexity_change": r["result"]["all"]["perplexity"] / base["perplexity"] - 1,
                               "accuracy": r["result"]["all"].get("accuracy")}
    return out


def levers(gamma: str) -> list[tuple[str, tuple[str, str, str]]]:
    """Each lever alone, then combined: (label, (placement, gamma, strategy))."""
    return [
        ("baseline: contiguous, fcfs, gamma inf", BASELINE),
        ("balanced placement", ("balanced", "inf", "fcfs")),
        ("replication", ("replicated", "inf", "fcfs")),
        (f"capacity gamma {gamma}", ("contiguous", gamma, "fcfs")),
        ("selection greedy", ("contiguous", "inf", "greedy")),
        ("selection power_of_d", ("contiguous", "inf", "power_of_d")),
        (f"balanced + capacity {gamma}", ("balanced", gamma, "fcfs")),
        (f"replication + capacity {gamma}", ("replicated", gamma, "fcfs")),
        ("balanced + greedy", ("balanced", "inf", "greedy")),
        ("replication + greedy", ("replicated", "inf", "greedy")),
        (f"balanced + capacity {gamma} + greedy", ("balanced", gamma, "greedy")),
        (f"replication + capacity {gamma} + greedy", ("replicated", gamma, "greedy")),
    ]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def pct(new: float, old: float) -> float:
    return 100.0 * (new - old) / old


def build_table(cells: dict, settings: dict, gamma: str, memory: dict, ppl: dict) -> dict:
    table = {}
    for spec in settings["workloads"]:
        rows = []
        for label, (placement, g, strategy) in levers(gamma):
            reps = [cells.get((placement, g, strategy, spec, r)) for r in range(settings["reps"])]
            bases = [cells.get((*BASELINE, spec, r)) for r in range(settings["reps"])]
            if any(x is None for x in reps) or any(b is None for b in bases):
                continue
            rows.append({
                "lever": label, "placement": placement, "gamma": g, "strategy": strategy,
                **{k: mean([x[k] for x in reps]) for k in ("ttft_p50", "ttft_p99", "e2e_p99", "tok_s", "imbalance",
                                                           "dropped")},
                "ttft_p99_change": [pct(x["ttft_p99"], b["ttft_p99"]) for x, b in zip(reps, bases)],
                "e2e_p99_change": [pct(x["e2e_p99"], b["e2e_p99"]) for x, b in zip(reps, bases)],
                "tok_s_change": [pct(x["tok_s"], b["tok_s"]) for x, b in zip(reps, bases)],
                "lost": sum(x["lost"] for x in reps),
                "expert_bytes_per_rank": memory[placement],
                "perplexity_change": ppl[g]["perplexity_change"], "accuracy": ppl[g]["accuracy"]})
        table[spec] = rows
    return table


def write_report(out: dict, out_dir: Path, name: str) -> None:
    s = out["settings"]
    lines = [
        "# The levers side by side on the live server",
        "",
        f"Generated by `tools/eval/live_levers.py` from three `selector_eval.py` grids on the same requests: "
        f"`capserve` under mpirun -np {s['np']} with {s['model']}, each workload {s['duration_s']:g} s of "
        f"arrivals, {s['reps']} repetitions (seed {s['seed']}), prompts from the corpus in bursts of one domain, "
        "sizes from the Azure code trace. Placements: contiguous; balanced (`--expert-placement "
        f"{out['placement_stats']}`); replicated (the same file with `--redundant-experts "
        f"{out['redundant_experts']}`: EPLB copies of the hottest experts, at most one per rank). Capacity: drop, "
        "gate score, global scope. Sources: " + ", ".join(f"`{p}`" for p in out["sources"]) + ".",
        "",
        "Changes are against the baseline (contiguous, fcfs, gamma inf) of the same repetition, one value per "
        "repetition: negative latency change and positive throughput change are better. Expert memory: the most "
        "routed-expert bytes one rank holds (`capserve-memory-plan`). Quality at that gamma "
        "(`capacity_quality.py`; placement, replication and selection compute the exact model): the held-out "
        "perplexity change, and the task score, next-token accuracy (the share of held-out positions whose most "
        "probable next token is the text's).",
        "",
    ]
    base_memory = out["memory"]["contiguous"]
    for spec, rows in out["table"].items():
        lines += [f"## {describe_workload(spec)}", "",
                  "| lever | p50 TTFT ms | p99 TTFT ms | p99 e2e ms | tok/s | imbalance | dropped | p99 TTFT change "
                  "| p99 e2e change | throughput change | expert memory / rank | perplexity | next-token accuracy |",
                  "|---|---:|---:|---:|---:|---:|---:|---|---|---|---:|---:|---:|"]
        for r in rows:
            change = lambda v: ", ".join(f"{x:+.0f}%" for x in v)  # noqa: E731
            memory = r["expert_bytes_per_rank"]
            lines.append(
                f"| {r['lever']} | {r['ttft_p50'] * 1e3:.0f} | {r['ttft_p99'] * 1e3:.0f} | {r['e2e_p99'] * 1e3:.0f} | "
                f"{r['tok_s']:.1f} | {r['imbalance']:.3f} | {100 * r['dropped']:.1f}% | "
                f"{change(r['ttft_p99_change'])} | {change(r['e2e_p99_change'])} | {change(r['tok_s_change'])} | "
                f"{memory / 1024:.0f} KiB ({pct(memory, base_memory):+.1f}%) | "
                + ("exact" if not r["perplexity_change"] else f"{100 * r['perplexity_change']:+.1f}%") + " | "
                + ("n/a" if r["accuracy"] is None else f"{100 * r['accuracy']:.1f}%") + " |")
        lines.append("")
    (out_dir / f"{name}.md").write_text("\n".join(lines))
    print("\n".join(lines))


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    specs = list(out["table"])
    fig, axes = plt.subplots(1, len(specs), figsize=(7 * len(specs), 5), squeeze=False)
    for ax, spec in zip(axes[0], specs):
        rows = out["table"][spec]
        for r in rows:
            ys = r["ttft_p99_change"]
            xs = r["tok_s_change"]
            marker = {"contiguous": "o", "balanced": "s", "replicated": "^"}[r["placement"]]
            ax.plot(xs, ys, marker=marker, linestyle=":", label=r["lever"])
        ax.axhline(0, color="grey", linewidth=0.5)
        ax.axvline(0, color="grey", linewidth=0.5)
        ax.set_xlabel("throughput change vs baseline (%)")
        ax.set_ylabel("p99 TTFT change vs baseline (%)")
        ax.set_title(f"{describe_workload(spec)}: each repetition a point", fontsize=9)
    axes[0][0].legend(fontsize=6, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", default="build")
    p.add_argument("--contiguous", help="selector_eval JSON, contiguous placement")
    p.add_argument("--balanced", help="selector_eval JSON, --expert-placement STATS")
    p.add_argument("--replicated", help="selector_eval JSON, STATS + --redundant-experts")
    p.add_argument("--placement-stats", help="the STATS.json those servers were given")
    p.add_argument("--redundant-experts", type=int, default=0)
    p.add_argument("--quality", help="capacity_quality.py JSON of the same model")
    p.add_argument("--model", default=str(ROOT / "deploy" / "models" / "capserve-moe-fine"))
    p.add_argument("--name", default="live_levers")
    p.add_argument("--out-dir", default=str(ROOT / "tools" / "results"))
    p.add_argument("--report-only", action="store_true", help="rewrite the report and plot from <name>.json")
    a = p.parse_args()
    out_dir = Path(a.out_dir)
    results = out_dir / f"{a.name}.json"
    if not a.report_only:
        needed = ("contiguous", "balanced", "replicated", "placement_stats", "quality")
        if any(getattr(a, k) is None for k in needed) or a.redundant_experts < 1:
            raise SystemExit("live_levers: give --contiguous, --balanced, --replicated, --placement-stats, "
                             "--redundant-experts and --quality (or --report-only)")
        cells, settings = {}, None
        for placement, path in (("contiguous", a.contiguous), ("balanced", a.balanced),
                                ("replicated", a.replicated)):
            c, s = load_runs(Path(path), placement)
            if settings is not None and s != settings:
                raise SystemExit(f"live_levers: {path} ran another grid ({s}) than the others ({settings})")
            cells.update(c)
            settings = s
        gammas = sorted({k[1] for k in cells if k[1] != "inf"})
        if len(gammas) != 1:
            raise SystemExit(f"live_levers: the grids need exactly one finite gamma, not {gammas}")
        build = Path(a.build_dir)
        ranks = settings["np"]
        memory = {"contiguous": expert_bytes_per_rank(build, Path(a.model), ranks, "contiguous", 0),
                  "balanced": expert_bytes_per_rank(build, Path(a.model), ranks, a.placement_stats, 0),
                  "replicated": expert_bytes_per_rank(build, Path(a.model), ranks, a.placement_stats,
                                                      a.redundant_experts)}
        out = {"settings": settings, "gamma": gammas[0], "placement_stats": a.placement_stats,
               "redundant_experts": a.redundant_experts, "memory": memory,
               "sources": [a.contiguous, a.balanced, a.replicated, a.quality],
               "table": build_table(cells, settings, gammas[0], memory, quality(Path(a.quality)))}
        results.write_text(json.dumps(out, indent=1))
    out = json.loads(results.read_text())
    write_report(out, out_dir, a.name)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        venv = ROOT / "tools" / ".venv" / "bin" / "python"
        if not venv.exists():
            raise SystemExit("live_levers: the plot needs matplotlib (tools/.venv); the JSON and table are written")
        return subprocess.call([str(venv), __file__, "--report-only", "--out-dir", str(out_dir), "--name", a.name])
    plot(out, out_dir / f"{a.name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
