#!/usr/bin/env python3
"""The trace-driven planner (tools/planner/README.md): calibration here, validation against the live server,
and the 8-GPU projection.

    python3 tools/planner/planner_eval.py calibrate --build-dir build   # live runs with --step-trace, fit
    python3 tools/planner/planner_eval.py validate --build-dir build    # planner vs measured live runs
    python3 tools/planner/planner_eval.py project --build-dir build     # the lever grid: 8x H100 / H200, here

calibrate: starts capserve on the fine-grained model (deploy/launch.sh) at 4 and 8 ranks with --step-trace,
drives it with capserve-loadgen over calibration workloads (Poisson 3/s, the Azure code trace's burst at 1/3
speed, Poisson 6/s past saturation; fcfs, gamma inf and 1.5; seeds 11-13), and fits each rank count's step
cost (tools/planner/step_cost.h) to the traced steps by non-negative least squares:
tools/results/planner_cost_fine_model_{4,8}ranks.json.
validate: replays every run of the earlier live evaluations (tools/results/selector_eval_fine_model_*.json:
other workloads, seeds and strategies than the calibration's, so held back) through capserve-planner with
the same arrivals, sizes, prompt domains and server settings, and tabulates predicted vs measured p50 / p99
TTFT and end-to-end latency, throughput and imbalance: tools/results/planner_validation.{md,json,png}.
project: prices OLMoE-1B-7B and Mixtral-8x7B steps on 8x H100 and 8x H200 from published figures
(gpu_costs.py) and runs the lever grid (fcfs / greedy / power_of_d, gamma inf / 1.5 / 1.25, contiguous /
balanced / replication) over the real routing counts (../shared/data/routing) under Poisson and bursty
arrivals, prompts in runs of one domain or mixed, and the same grid for capserve-moe-fine on this machine's 8
CPU ranks (the fitted cost): tools/results/planner_projection.{md,json,png}.
Needs numpy (Debian's python3-numpy: run with /usr/bin/python3); the plots need matplotlib (tools/.venv).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tools" / "eval"))
from launched_server import LaunchedServer  # noqa: E402
from selector_eval import TRACE, loadgen, workload_args  # noqa: E402

FINE = ROOT / "deploy" / "models" / "capserve-moe-fine"
FINE_ROUTING = ROOT / "tools" / "results" / "fine_model_eval.json"
RESULTS = ROOT / "tools" / "results"
CALIBRATION_WORKLOADS = ["poisson:3", "trace:3", "poisson:6"]  # light, bursty, overloaded
CALIBRATION_SEED = 11  # not a seed of the validation runs (1-3, 21-22)
TERMS = ["step", "token", "pair", "decode_pair", "assignment", "active_expert", "wire_byte", "capacity_layer",
         "capacity_refine"]


# --------------------------------------------------------------------------------------------- calibrate

def collect(a: argparse.Namespace, np_: int, work: Path) -> list[dict]:
    build = Path(a.build_dir).resolve()
    steps = []
    for gamma in a.gammas:
        trace = work / f"steps-{np_}-{gamma}.jsonl"
        flags = ["--step-trace", str(trace), "--capacity-factor", gamma]
        with LaunchedServer(build, np_, flags, work / f"server-{np_}-{gamma}.log", model=FINE) as server:
            loadgen(build, server, ["--concurrency", "4", "--max-requests", "8", "--duration-s", "30"],
                    work / "warmup.json", 99, FINE)
            for w, spec in enumerate(CALIBRATION_WORKLOADS):
                loadgen(build, server, workload_args(spec, a.duration_s), work / f"cal-{np_}-{gamma}-{w}.json",
                        CALIBRATION_SEED + w, FINE)
        traced = read_steps(trace, gamma)
        steps += traced
        print(f"{np_} ranks, gamma {gamma}: {len(traced)} steps traced", flush=True)
    return steps


def read_steps(trace: Path, gamma: str) -> list[dict]:
    """Every step a trace holds (the warm-up's too: the same server, its first-touch steps no slower than
    later ones of their size)."""
    return [dict(json.loads(line), capacity=gamma != "inf") for line in trace.read_text().splitlines()]


def features(step: dict, cores: int, ranks: int, coef: dict | None = None) -> list[float]:
    """The step cost's terms (TERMS) for one traced step, composed as step_cost.h composes them: each phase
    (the dense layers, each MoE layer's experts) costs the larger of its slowest rank and its total over the
    cores. Which one a phase takes depends on the coefficients: `coef` (none: the total, the first guess)."""
    def phase(per_rank: list[list[float]], weights: list[float]) -> list[float]:
        totals = [sum(col) / cores for col in zip(*per_rank)]
        if coef is None:
            return totals
        work = [sum(w * v for w, v in zip(weights, row)) for row in per_rank]
        slowest = max(range(len(work)), key=work.__getitem__)
        return per_rank[slowest] if work[slowest] > sum(work) / cores else totals

    dense = phase([[t, p, d] for t, p, d in zip(step["tokens"], step["attention_pairs"], step["decode_pairs"])],
                  [coef[k] for k in ("token", "pair", "decode_pair")] if coef else [])
    experts = [0.0, 0.0]
    for load, active in zip(step["expert_load"], step["active_experts"]):
        part = phase([[x, e] for x, e in zip(load, active)],
                     [coef[k] for k in ("assignment", "active_expert")] if coef else [])
        experts = [experts[0] + part[0], experts[1] + part[1]]
    layers = len(step["expert_load"])
    capacity = step["capacity"]
    return [1.0, *dense, *experts, sum(step["wire_bytes"]) / ranks, layers if capacity else 0,
            sum(1 for d in step["dropped"] if d > 0) if capacity else 0]


def nnls(x, y):
    """Least squares with every coefficient >= 0 (an active set: drop the most negative term and refit)."""
    import numpy as np
    keep = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (coef >= 0).all():
            out = np.zeros(x.shape[1])
            out[keep] = coef
            return out
        keep.pop(int(np.argmin(coef)))


def fit(steps: list[dict], ranks: int, cores: int) -> tuple[dict, dict]:
    import numpy as np
    y = np.array([s["seconds"] for s in steps])
    # Half the steps fit, the other half (every other step) measure the fit. Rows weigh 1/sqrt(seconds): a
    # compromise between the long prefill steps (which dominate absolute error) and the many one-token decode
    # steps (which dominate relative error). Which rank sets each phase's pace depends on the fit: refit
    # until that settles.
    w = 1 / np.sqrt(y)
    named = None
    for _ in range(6):
        x = np.array([features(s, cores, ranks, named) for s in steps])
        coef = nnls(x[0::2] * w[0::2, None], y[0::2] * w[0::2])
        named = dict(zip(TERMS, coef))
    pred = x[1::2] @ coef
    held = y[1::2]
    err = np.abs(pred - held) / held
    quality = {"steps": len(steps), "held_out_steps": int(len(held)),
               "median_abs_rel_error": float(np.median(err)), "p90_abs_rel_error": float(np.quantile(err, 0.9)),
               "r2": float(1 - ((pred - held) ** 2).sum() / ((held - held.mean()) ** 2).sum()),
               "measured_total_s": float(held.sum()), "predicted_total_s": float(pred.sum())}
    return dict(zip(TERMS, (float(c) for c in coef))), quality


def calibrate(a: argparse.Namespace) -> None:
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    config = json.loads((FINE / "config.json").read_text())
    layers = config["num_hidden_layers"]
    for np_ in a.np:
        steps = collect(a, np_, work) if not a.fit_only else [
            s for g in a.gammas for s in read_steps(work / f"steps-{np_}-{g}.jsonl", g)]
        seconds, quality = fit(steps, np_, a.cores)
        seconds["layer"] = 0.0  # a fixed count of MoE layers: folded into "step"
        cost = {"name": f"capserve-moe-fine, {np_} CPU ranks on {a.cores} cores (fitted here)",
                "model": {"moe_layers": layers, "experts": config["num_experts"],
                          "top_k": config["num_experts_per_tok"], "row_bytes": 4 * config["hidden_size"]},
                "cores": a.cores, "expert_time": "sum", "seconds": seconds,
                "fit": quality,
                "assumptions": [
                    f"fitted by non-negative least squares to {quality['steps']} steps the live server traced "
                    f"(--step-trace) at {np_} ranks, 1 thread each, on this machine's {a.cores} cores, under "
                    f"{', '.join(CALIBRATION_WORKLOADS)} (seed {CALIBRATION_SEED}+), gamma {', '.join(a.gammas)}",
                    "shared cores: each phase takes the total work over the cores (4-8 ranks on 2 cores)",
                    "held-out steps (every other one): median |error| "
                    f"{100 * quality['median_abs_rel_error']:.1f}%, R^2 {quality['r2']:.3f}, their total time "
                    f"{quality['predicted_total_s']:.1f} s predicted vs {quality['measured_total_s']:.1f} s"]}
        out = RESULTS / f"planner_cost_fine_model_{np_}ranks.json"
        out.write_text(json.dumps(cost, indent=1) + "\n")
        print(f"{out.relative_to(ROOT)}: {seconds}; held-out median |error| "
              f"{100 * quality['median_abs_rel_error']:.1f}%, R^2 {quality['r2']:.3f}", flush=True)


# --------------------------------------------------------------------------------------------- planner runs

def planner(build: Path, args: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [str(build / "tools" / "capserve-planner"), *args, "--json", out.name]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"planner_eval: capserve-planner failed ({done.returncode}): {' '.join(cmd)}\n"
                             f"{done.stderr}")
        return json.loads(Path(out.name).read_text())


def live_workload_args(spec: str, duration_s: float) -> list[str]:
    """The arrivals of a selector_eval workload (capserve-loadgen's flags, which the planner shares)."""
    return ["--trace", str(TRACE), *workload_args(spec, duration_s)]


# --------------------------------------------------------------------------------------------- validate

LIVE_RUNS = ["selector_eval_fine_model_4ranks", "selector_eval_fine_model_8ranks",
             "selector_eval_fine_model_4ranks_repeated", "selector_eval_fine_model_8ranks_balanced",
             "selector_eval_fine_model_8ranks_repeated", "selector_eval_fine_model_8ranks_balanced_repeated",
             "selector_eval_fine_model_4ranks_balanced_repeated"]
METRICS = [("ttft p50", "ttft_s", "p50"), ("ttft p99", "ttft_s", "p99"), ("e2e p50", "e2e_s", "p50"),
           ("e2e p99", "e2e_s", "p99")]


def server_flags(server_args: list[str]) -> list[str]:
    """The live run's server flags the planner models (the placement file becomes the planner's own
    balanced placement from the same routing counts)."""
    out, i = [], 0
    while i < len(server_args):
        flag = server_args[i]
        if flag == "--expert-placement":
            out += ["--placement", "balanced"]
        elif flag in ("--selector-max-wait-ms", "--selector-min-queue"):
            out += [flag, server_args[i + 1]]
        else:
            raise SystemExit(f"planner_eval: the planner does not model the live run's {flag}")
        i += 2
    return out


def validate(a: argparse.Namespace) -> dict:
    build = Path(a.build_dir).resolve()
    rows = []
    for name in LIVE_RUNS:
        data = json.loads((RESULTS / f"{name}.json").read_text())
        cost = RESULTS / f"planner_cost_fine_model_{data['np']}ranks.json"
        for run in data["runs"]:
            report = run["report"]
            info = report["run"]["server_info"]
            args = ["--routing", str(FINE_ROUTING), "--cost", str(cost), "--ranks", str(data["np"]),
                    "--batch-selector", run["strategy"], "--capacity-factor", run["gamma"],
                    "--seed", str(report["run"]["seed"]), "--tokenizer", str(FINE),
                    "--prompt-mix", data.get("prompt_mix", "bursts"),
                    "--max-prompt-tokens", "512", "--max-tokens", "64", "--max-context", str(info["max_context"]),
                    "--extra-prompt-tokens", str(a.extra_prompt_tokens),
                    "--max-batched-tokens", str(info["max_batched_tokens"]),
                    "--max-running", str(info["max_running_sequences"]),
                    "--kv-blocks", str(info["kv_blocks_per_rank"]),
                    *live_workload_args(run["workload"], data["duration_s"]), *server_flags(data["server_args"])]
            predicted = planner(build, args)
            client = report["client"]
            measured = {"ttft_s": client["ttft_s"], "e2e_s": client["e2e_s"],
                        "output_tokens_per_s": client["output_tokens_per_s"],
                        "imbalance": report["server"].get("imbalance_mean")}
            rows.append({"source": name, "ranks": data["np"], "rep": run["rep"], "gamma": run["gamma"],
                         "strategy": run["strategy"], "workload": run["workload"],
                         "measured": measured, "predicted": predicted})
            print(f"{name} {run['workload']:>10} {run['strategy']:>10} gamma {run['gamma']:>4}: TTFT p50 "
                  f"{measured['ttft_s']['p50']:.3f} vs {predicted['ttft_s']['p50']:.3f} s, e2e p99 "
                  f"{measured['e2e_s']['p99']:.3f} vs {predicted['e2e_s']['p99']:.3f} s", flush=True)
    return {"extra_prompt_tokens": a.extra_prompt_tokens, "rows": rows}


def rel(p: float, m: float) -> float:
    return (p - m) / m if m else float("nan")


def median(values: list[float]) -> float:
    v = sorted(x for x in values if x == x)
    if not v:
        return float("nan")
    return v[len(v) // 2] if len(v) % 2 else 0.5 * (v[len(v) // 2 - 1] + v[len(v) // 2])


def validation_report(data: dict) -> str:
    rows = data["rows"]
    lines = ["# The planner against the live server (capserve-moe-fine, this machine)", "",
             "`/usr/bin/python3 tools/planner/planner_eval.py validate --build-dir build`: every run of the live "
             "batch-selection evaluations (`selector_eval_fine_model_*.json`: 4 and 8 oversubscribed ranks, "
             "fcfs / greedy / power_of_d, gamma inf and 1.5, Poisson and the Azure code trace's burst, "
             "contiguous and balanced placement) replayed through `capserve-planner` with the same arrivals, "
             "sizes, prompt domains and server settings. The step cost is the one fitted on separate calibration "
             "runs (`planner_eval.py calibrate`: other workloads and seeds), so every run here is held back.", ""]
    lines += ["## Error of the prediction, per rank count", "",
              "Median and worst |predicted - measured| / measured over the runs.", "",
              "| ranks | runs | " + " | ".join(f"{m} median | {m} worst" for m, _, _ in METRICS) +
              " | throughput median | imbalance median |",
              "|---:|---:|" + "---:|---:|" * len(METRICS) + "---:|---:|"]
    for ranks in sorted({r["ranks"] for r in rows}):
        sel = [r for r in rows if r["ranks"] == ranks]
        cells = []
        for _, key, q in METRICS:
            errs = [abs(rel(r["predicted"][key][q], r["measured"][key][q])) for r in sel]
            cells += [f"{100 * median(errs):.0f}%", f"{100 * max(errs):.0f}%"]
        thr = [abs(rel(r["predicted"]["output_tokens_per_s"], r["measured"]["output_tokens_per_s"])) for r in sel]
        imb = [abs(rel(r["predicted"]["imbalance"], r["measured"]["imbalance"])) for r in sel
               if r["measured"]["imbalance"]]
        lines.append(f"| {ranks} | {len(sel)} | " + " | ".join(cells) +
                     f" | {100 * median(thr):.0f}% | {100 * median(imb):.0f}% |")
    # The live runs' own noise: the same cell measured in several repetitions.
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["source"], r["gamma"], r["strategy"], r["workload"]), []).append(r)
    repeated = [c for c in cells.values() if len(c) > 1]
    if repeated:
        spread = []
        for _, key, q in METRICS:
            v = [max(x["measured"][key][q] for x in c) / min(x["measured"][key][q] for x in c) - 1 for c in repeated]
            spread.append(f"{100 * median(v):.0f}% (worst {100 * max(v):.0f}%)")
        lines += ["", f"For scale, the live server's own spread: {len(repeated)} cells measured in 2-3 repetitions "
                  "(same requests at the same times), max / min - 1 of each figure, median over the cells: " +
                  ", ".join(f"{m} {v}" for (m, _, _), v in zip(METRICS, spread)) + "."]
    # Does the planner order the strategies as the live runs do?
    agree = total = 0
    for r in rows:
        if r["strategy"] == "fcfs":
            continue
        base = [b for b in rows if b["source"] == r["source"] and b["rep"] == r["rep"] and b["gamma"] == r["gamma"]
                and b["workload"] == r["workload"] and b["strategy"] == "fcfs"]
        if not base:
            continue
        b = base[0]
        for _, key, q in METRICS:
            dm = r["measured"][key][q] - b["measured"][key][q]
            dp = r["predicted"][key][q] - b["predicted"][key][q]
            total += 1
            agree += (dm > 0) == (dp > 0)
    lines += ["", f"Sign of (strategy - fcfs) in the same cell, predicted vs measured, over the four latency "
              f"figures: the same in {agree} of {total} comparisons.", ""]
    lines += ["## Every run", "",
              "| source | ranks | rep | gamma | workload | strategy | TTFT p50 meas / pred (s) | TTFT p99 | e2e p50 | "
              "e2e p99 | tokens/s | imbalance |", "|---|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        m, p = r["measured"], r["predicted"]
        cells = [f"{m[k][q]:.3f} / {p[k][q]:.3f}" for _, k, q in METRICS]
        lines.append(f"| {r['source'].replace('selector_eval_fine_model_', '')} | {r['ranks']} | {r['rep']} | "
                     f"{r['gamma']} | {r['workload']} | {r['strategy']} | " + " | ".join(cells) +
                     f" | {m['output_tokens_per_s']:.1f} / {p['output_tokens_per_s']:.1f} | "
                     f"{(m['imbalance'] or float('nan')):.3f} / {p['imbalance']:.3f} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------- project

SHARED_ROUTING = ROOT.parent / "shared" / "data" / "routing" / "olmoe_mixtral_expert_counts.json"
# An unbounded queue: every request is served, so the levers' latencies are those of the same requests.
GPU_SERVER = ["--max-batched-tokens", "16384", "--max-running", "512", "--kv-blocks", "20000",
              "--max-context", "4096", "--max-prompt-tokens", "3840", "--max-tokens", "256", "--max-queue", "100000"]
PLACEMENTS = {"contiguous": ["--placement", "contiguous"], "balanced": ["--placement", "balanced"],
              "replication +1": ["--redundant-experts", "1"]}
# Capacity settings: gamma over all ranks' tokens (global scope, the server's default: its collectives priced by
# the cost), and gamma 1.5 per rank (--capacity-scope local: no collective).
CAPACITIES = {"inf": ["--capacity-factor", "inf"], "1.5": ["--capacity-factor", "1.5"],
              "1.25": ["--capacity-factor", "1.25"],
              "1.5 local": ["--capacity-factor", "1.5", "--capacity-scope", "local"]}


def saturation(build: Path, base: list[str]) -> float:
    """The node's capacity in requests per second under fcfs, gamma inf: 3,000 requests arriving at once (an
    unbounded queue), over the time the node takes to finish them."""
    r = planner(build, [*base, "--rate", "100000", "--max-requests", "3000", "--duration-s", "1"])
    return r["requests"] / r["makespan_s"]


def targets(a: argparse.Namespace) -> list[dict]:
    """What the grid runs on: each real model on 8 GPUs of each kind (published figures), and the fine model on
    this machine's 8 CPU ranks (the fitted cost, the live evaluations' request caps)."""
    sys.path.insert(0, str(HERE))
    import gpu_costs
    out = []
    for model in a.models:
        for gpu in a.gpus:
            name = f"{model}-{gpu}"
            if a.targets and name not in a.targets:
                continue
            cost = gpu_costs.step_cost(model, gpu)
            path = RESULTS / f"planner_cost_{model}_{gpu}.json"
            path.write_text(json.dumps(cost, indent=1) + "\n")
            out.append({"name": name, "model": gpu_costs.MODELS[model]["name"], "hardware": f"8x {gpu_costs.GPUS[gpu]['name']}",
                        "cost": path, "expert_bytes": cost["expert_bytes"], "server": GPU_SERVER,
                        "routing": ["--routing", str(SHARED_ROUTING), "--routing-model",
                                    gpu_costs.MODELS[model]["routing_key"]]})
    if not a.targets or "fine-cpu8" in a.targets:
        config = json.loads((FINE / "config.json").read_text())
        out.append({"name": "fine-cpu8", "model": "capserve-moe-fine",
                    "hardware": "8 CPU ranks on this machine's 2 cores (fitted cost)",
                    "cost": RESULTS / "planner_cost_fine_model_8ranks.json",
                    # float32 weights
                    "expert_bytes": 3 * config["hidden_size"] * config["intermediate_size"] * 4,
                    "server": ["--max-context", "1024", "--max-prompt-tokens", "512", "--max-tokens", "64",
                               "--extra-prompt-tokens", "6", "--tokenizer", str(FINE), "--max-queue", "100000"],
                    "routing": ["--routing", str(FINE_ROUTING)]})
    return out


def project(a: argparse.Namespace) -> dict:
    build = Path(a.build_dir).resolve()
    path = RESULTS / "planner_projection.json"
    out = json.loads(path.read_text()) if a.targets and path.exists() else {"duration_s": a.duration_s, "grids": []}
    for t in targets(a):
        cost = json.loads(t["cost"].read_text())
        base = [*t["routing"], "--cost", str(t["cost"]), "--ranks", "8", "--trace", str(TRACE), *t["server"],
                "--seed", "1"]
        rate = saturation(build, base)
        # The code trace's mean rate over its hour is 2.6/s: replayed so that its mean is 70% of saturation.
        burst = ["--trace-start-s", "848", "--time-scale", f"{2.6 / (0.7 * rate):.4f}", "--duration-s",
                 str(a.duration_s)]
        workloads = {f"Poisson {a.load:.0%} of saturation, domain bursts":
                     ["--rate", f"{a.load * rate:.3f}", "--duration-s", str(a.duration_s)],
                     "Azure code trace (burst from 848 s), domain bursts": [*burst],
                     "Azure code trace (burst from 848 s), mixed domains": [*burst, "--prompt-mix", "mixed"]}
        grid = {"name": t["name"], "model": t["model"], "hardware": t["hardware"], "cost": t["cost"].name,
                "server": t["server"], "saturation_rate": rate, "expert_bytes": t["expert_bytes"],
                "moe_layers": cost["model"]["moe_layers"], "runs": []}
        print(f"{grid['model']} on {grid['hardware']}: capacity {rate:.1f} requests/s", flush=True)
        for wname, wargs in workloads.items():
            for pname, pargs in PLACEMENTS.items():
                for gamma, cargs in CAPACITIES.items():
                    for strategy in ["fcfs", "greedy", "power_of_d"]:
                        r = planner(build, [*base, *wargs, *pargs, *cargs, "--batch-selector", strategy])
                        grid["runs"].append({"workload": wname, "placement": pname, "gamma": gamma,
                                             "strategy": strategy, "result": r})
            print(f"  {wname}: done", flush=True)
        out["grids"] = [g for g in out["grids"] if g.get("name") != t["name"]] + [grid]
    return out


LEVERS = [("baseline: contiguous, gamma inf, fcfs", "contiguous", "inf", "fcfs"),
          ("balanced placement", "balanced", "inf", "fcfs"),
          ("replication +1 slot per rank", "replication +1", "inf", "fcfs"),
          ("capacity gamma 1.5", "contiguous", "1.5", "fcfs"),
          ("capacity gamma 1.25", "contiguous", "1.25", "fcfs"),
          ("capacity gamma 1.5, local scope (no collectives)", "contiguous", "1.5 local", "fcfs"),
          ("batch selection greedy", "contiguous", "inf", "greedy"),
          ("batch selection power_of_d", "contiguous", "inf", "power_of_d"),
          ("balanced + greedy", "balanced", "inf", "greedy"),
          ("balanced + gamma 1.25 + greedy", "balanced", "1.25", "greedy"),
          ("replication +1 + gamma 1.25 + greedy", "replication +1", "1.25", "greedy"),
          ("balanced + gamma 1.5 local + greedy", "balanced", "1.5 local", "greedy")]


def size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def lever_table(grid: dict) -> list[str]:
    """Each lever alone and a few combinations against the baseline, on every workload of the grid."""
    lines = ["| lever | " + " | ".join(f"{w}: p99 TTFT / p99 e2e / MoE-layer speedup / dropped"
                                       for w in dict.fromkeys(r["workload"] for r in grid["runs"])) +
             " | expert memory per rank |", "|---|" + "---:|" * (1 + len({r["workload"] for r in grid["runs"]}))]
    per_step = lambda y: y["moe_s"] / max(y["steps"], 1)  # noqa: E731
    for label, placement, gamma, strategy in LEVERS:
        cells, memory = [], ""
        for w in dict.fromkeys(r["workload"] for r in grid["runs"]):
            find = lambda p, g, st: next(r["result"] for r in grid["runs"]  # noqa: E731
                                         if (r["workload"], r["placement"], r["gamma"], r["strategy"]) == (w, p, g, st))
            base, x = find("contiguous", "inf", "fcfs"), find(placement, gamma, strategy)
            cells.append(f"{100 * (x['ttft_s']['p99'] / base['ttft_s']['p99'] - 1):+.0f}% / "
                         f"{100 * (x['e2e_s']['p99'] / base['e2e_s']['p99'] - 1):+.0f}% / "
                         f"{per_step(base) / per_step(x):.2f}x / {100 * x['dropped_share']:.1f}%")
            memory = size(x["slots_per_rank"] * grid["expert_bytes"] * grid["moe_layers"])
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {memory} |")
    return lines


def projection_report(data: dict) -> str:
    lines = ["# Planner projection: 8-GPU nodes with real routing counts, and this machine", "",
             "`/usr/bin/python3 tools/planner/planner_eval.py project --build-dir build`: `capserve-planner` "
             "(the server's scheduler and batch selector on a simulated clock). Last grid: capserve-moe-fine on "
             "this machine's 8 CPU ranks with the step cost fitted here (`planner_validation.md` says how well it "
             "predicts the live server), the one setting where the levers' table can be set beside live runs. "
             "The others: OLMoE-1B-7B's and Mixtral-8x7B's real per-domain routing counts (`../shared/data/routing`, layers 0 / 7 / 15 "
             "standing for all layers in turn), request sizes from the Azure code trace, prompts in runs of one "
             "domain (16 requests) or mixed, steps priced from published H100 / H200 figures "
             "(`planner_cost_<model>_<gpu>.json`: every assumption listed there and below). A projection, not a "
             "measurement: the first-GPU kit's kernel figures replace the published ones once it has run.", "",
             f"8 ranks; each run {data['duration_s']:.0f} s of arrivals. Speedup: the MoE layers' time per step against fcfs / contiguous / gamma inf on the same "
             "workload (the capacity-aware paper's figure of merit). Expert memory: the busiest rank's expert "
             "weights.", ""]
    for grid in data["grids"]:
        lines += [f"## {grid['model']} on {grid['hardware']}", "",
                  f"Server: `{' '.join(grid['server'])}`; step cost `{grid['cost']}`.", "",
                  f"Capacity (3,000 requests at once, fcfs, gamma inf, contiguous): {grid['saturation_rate']:.1f} "
                  "requests/s; the Poisson rate and the trace's speed below are set from it.", "",
                  "Each lever against the baseline (p99 changes: negative is better):", ""] + lever_table(grid) + [""]
        for wname in dict.fromkeys(r["workload"] for r in grid["runs"]):
            runs = [r for r in grid["runs"] if r["workload"] == wname]
            base = next(r["result"] for r in runs
                        if r["placement"] == "contiguous" and r["gamma"] == "inf" and r["strategy"] == "fcfs")
            lines += [f"### {wname}", "",
                      "| placement | gamma | strategy | TTFT p50 / p99 (s) | e2e p50 / p99 (s) | output tok/s | "
                      "imbalance | dropped | MoE-layer speedup | p99 TTFT vs fcfs | expert memory per rank | served |",
                      "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for r in runs:
                x = r["result"]
                fcfs = next(f["result"] for f in runs if f["placement"] == r["placement"]
                            and f["gamma"] == r["gamma"] and f["strategy"] == "fcfs")
                per_step = lambda y: y["moe_s"] / max(y["steps"], 1)  # noqa: E731
                memory = size(x["slots_per_rank"] * grid["expert_bytes"] * grid["moe_layers"])
                lines.append(
                    f"| {r['placement']} | {r['gamma']} | {r['strategy']} | {x['ttft_s']['p50']:.3f} / "
                    f"{x['ttft_s']['p99']:.3f} | {x['e2e_s']['p50']:.3f} / {x['e2e_s']['p99']:.3f} | "
                    f"{x['output_tokens_per_s']:.0f} | {x['imbalance']:.3f} | {100 * x['dropped_share']:.1f}% | "
                    f"{per_step(base) / per_step(x):.2f}x | "
                    f"{100 * (x['ttft_s']['p99'] / fcfs['ttft_s']['p99'] - 1):+.0f}% | {memory} | "
                    f"{x['ok']} / {x['requests']} |")
            lines.append("")
    lines += ["## Beside the published results", "",
              "MoE-layer speedup against gamma inf (drops in brackets): the capacity-aware paper's figures as "
              "issue 30 quotes them; the straggler model on the real routing counts (each domain's whole "
              "measurement as one step, 8 ranks, contiguous: `lever_table.json`); the planner's MoE-layer time "
              "per step under Poisson traffic at 90% of capacity (fcfs, contiguous; the 8-GPU grids above), which "
              "adds what the counts leave out: steps of a few hundred tokens, the exchange, capacity's "
              "collectives, and reading each active expert's weights (a decode step is memory-bound: dropping "
              "assignments does not shorten it). \"1.5 local\": each rank bounds its own tokens "
              "(`--capacity-scope local`), no collective (its selection kernels taken as free).", "",
              "| model | gamma | paper | routing counts | planner, 8x H100 | planner, 8x H200 |",
              "|---|---|---|---|---|---|"]
    counts = json.loads((RESULTS / "lever_table.json").read_text()) if (RESULTS / "lever_table.json").exists() else []
    paper = {("OLMoE-1B-7B", "1.5"): "about 1.3x for +0.9% perplexity", ("Mixtral-8x7B", "1.5"): "1.85x at 8 GPUs"}
    poisson = lambda g: next(w for w in dict.fromkeys(r["workload"] for r in g["runs"]) if w.startswith("Poisson"))  # noqa: E731
    for model in ("OLMoE-1B-7B", "Mixtral-8x7B"):
        for gamma in ("1.5", "1.5 local", "1.25"):
            c = next((r for r in counts if r["source"] == f"{model} (real routing)" and r["ranks"] == 8
                      and r["lever"] == f"capacity gamma {gamma}"), None)
            cells = []
            for hardware in ("H100", "H200"):
                grid = next((g for g in data["grids"] if g["model"] == model and hardware in g["hardware"]), None)
                if grid is None:
                    cells.append("")
                    continue
                w = poisson(grid)
                find = lambda gm: next(r["result"] for r in grid["runs"] if (r["workload"], r["placement"], r["gamma"], r["strategy"]) == (w, "contiguous", gm, "fcfs"))  # noqa: E731
                base, x = find("inf"), find(gamma)
                speed = (base["moe_s"] / base["steps"]) / (x["moe_s"] / x["steps"])
                cells.append(f"{speed:.2f}x ({100 * x['dropped_share']:.1f}%)")
            counted = f"{c['speedup_vs_contiguous']:.2f}x ({100 * c['dropped_fraction']:.1f}%)" if c else ""
            lines.append(f"| {model} | {gamma} | {paper.get((model, gamma), '')} | {counted} | " + " | ".join(cells) + " |")
    lines += ["", "- CAPS (router-assisted batch selection, the seed): P99 latency -18% to -47% under bursty traffic. "
              "The lever tables' batch-selection rows are the same comparison under this planner's assumptions.",
              "- Our measured quality cost of gamma on a trained fine-grained model: `capacity_quality_fine_model.md` "
              "(+5.3% perplexity at gamma 1.5, drop by gate score).", ""]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------- plots

def plot_validation(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401
    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 3.8))
    for ax, (title, key, q) in zip(axes, METRICS):
        for ranks, marker in ((4, "o"), (8, "s")):
            rows = [r for r in data["rows"] if r["ranks"] == ranks]
            for workload, color in (("poisson", "tab:blue"), ("trace", "tab:red")):
                sel = [r for r in rows if r["workload"].startswith(workload)]
                ax.scatter([r["measured"][key][q] for r in sel], [r["predicted"][key][q] for r in sel], s=14,
                           marker=marker, color=color, alpha=0.7, label=f"{ranks} ranks, {workload}")
        lo, hi = ax.get_xlim()
        ax.plot([lo, hi], [lo, hi], color="gray", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("measured (s)")
        ax.set_ylabel("planner (s)")
        ax.set_title(title)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_projection(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    grids = data["grids"]
    fig, axes = plt.subplots(len(grids), 3, figsize=(19, 3.6 * len(grids)), squeeze=False)
    for row, grid in enumerate(grids):
        workloads = list(dict.fromkeys(r["workload"] for r in grid["runs"]))
        for col, workload in enumerate(workloads):
            ax = axes[row][col]
            runs = [r for r in grid["runs"] if r["workload"] == workload]
            groups = list(dict.fromkeys((r["placement"], r["gamma"]) for r in runs))
            for i, strategy in enumerate(["fcfs", "greedy", "power_of_d"]):
                values = [next(r["result"]["ttft_s"]["p99"] for r in runs if (r["placement"], r["gamma"]) == g
                               and r["strategy"] == strategy) for g in groups]
                ax.bar([x + (i - 1) * 0.27 for x in range(len(groups))], values, 0.27, label=strategy)
            ax.set_xticks(range(len(groups)), [f"{p}\ngamma {g}" for p, g in groups], fontsize=6)
            ax.set_ylabel("p99 TTFT (s)")
            ax.set_title(f"{grid['model']}, {grid['hardware']}: {workload}", fontsize=8)
        axes[row][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def with_plot(plot, data: dict, path: Path, command: str) -> None:
    """Plots with matplotlib, or has tools/.venv's interpreter redo the report step when this one lacks it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        venv = ROOT / "tools" / ".venv" / "bin" / "python"
        if not venv.exists():
            print(f"planner_eval: no matplotlib (tools/.venv) for {path.name}; the tables are written")
            return
        subprocess.check_call([str(venv), __file__, command, "--report-only"])
        return
    plot(data, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("calibrate")
    c.add_argument("--build-dir", default="build")
    c.add_argument("--np", type=int, nargs="+", default=[4, 8])
    c.add_argument("--gammas", nargs="+", default=["inf", "1.5"])
    c.add_argument("--cores", type=int, default=2, help="the cores the ranks share on this machine")
    c.add_argument("--duration-s", type=float, default=30)
    c.add_argument("--fit-only", action="store_true", help="refit the traces already in --work-dir")
    c.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "capserve_planner_eval"))
    v = sub.add_parser("validate")
    v.add_argument("--build-dir", default="build")
    v.add_argument("--extra-prompt-tokens", type=int, default=6,
                   help="tokens the chat template adds to every prompt (the live runs' 512 became 518)")
    v.add_argument("--report-only", action="store_true")
    j = sub.add_parser("project")
    j.add_argument("--build-dir", default="build")
    j.add_argument("--models", nargs="+", default=["olmoe", "mixtral"])
    j.add_argument("--gpus", nargs="+", default=["h100", "h200"])
    j.add_argument("--duration-s", type=float, default=30)
    j.add_argument("--load", type=float, default=0.9, help="the Poisson rate, as a share of saturation")
    j.add_argument("--targets", nargs="*", default=[],
                   help="only these grids (olmoe-h100, ..., fine-cpu8), merged into the existing JSON")
    j.add_argument("--report-only", action="store_true")
    a = p.parse_args()
    if a.command == "calibrate":
        calibrate(a)
        return 0
    run, report, plot = {"project": (project, projection_report, plot_projection),
                         "validate": (validate, validation_report, plot_validation)}[a.command]
    name = f"planner_{'projection' if a.command == 'project' else 'validation'}"
    path = RESULTS / f"{name}.json"
    data = json.loads(path.read_text()) if a.report_only else run(a)
    path.write_text(json.dumps(data, indent=1) + "\n")
    (RESULTS / f"{name}.md").write_text(report(data))
    with_plot(plot, data, RESULTS / f"{name}.png", a.command)
    print((RESULTS / f"{name}.md").read_text().split("## ")[1][:1500])
    return 0


if __name__ == "__main__":
    sys.exit(main())
