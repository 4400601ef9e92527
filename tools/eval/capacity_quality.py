#!/usr/bin/env python3
"""Quality of capacity-aware scheduling on an embedded model (parallel/README.md): the default capserve-moe-tiny,
or the fine-grained capserve-moe-fine (--model, --name capacity_quality_fine_model, --main-only: the main
setting's variants alone, no granularity / scope grid).

Runs capserve-eval-heldout under mpirun over a grid of capacity factors gamma x policies (drop by gate score,
by order, at random; reroute R = 1..3; expanded drop m = 1, 2) x granularity x scope, and writes
<out-dir>/capacity_quality.json (every run's raw figures), capacity_quality.md (tables and the paper's
orderings, checked numerically) and capacity_quality.png.

    python3 tools/eval/capacity_quality.py --build-dir build --np 2 --windows 40

The runs need only the Python standard library. The report step measures the router's probabilities with HF
transformers (once; kept in the JSON) and draws the plot with matplotlib: when this interpreter lacks them it
runs under tools/.venv/bin/python (the same script with --report-only). --report-only rewrites the report and
plot from an existing capacity_quality.json. Each run's output is kept in --work-dir; with --resume, runs whose
output is there (same windows and ranks) are not repeated.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "deploy" / "models" / "capserve-moe-tiny"
CORPUS = ROOT.parent / "shared" / "data" / "corpus"
DOMAINS = ["arxiv", "books", "code", "web", "wikipedia"]
GAMMAS = ["3", "2", "1.5", "1.25", "1", "0.75"]
BATCH_WINDOWS = 8

VARIANTS = {
    "drop-gate": ["--capacity-policy", "drop", "--capacity-score", "gate"],
    "drop-order": ["--capacity-policy", "drop", "--capacity-score", "order"],
    "drop-random": ["--capacity-policy", "drop", "--capacity-score", "random"],
    "reroute-R1": ["--capacity-policy", "reroute", "--capacity-rounds", "1"],
    "reroute-R2": ["--capacity-policy", "reroute", "--capacity-rounds", "2"],
    "reroute-R3": ["--capacity-policy", "reroute", "--capacity-rounds", "3"],
    "expanded-m1": ["--capacity-policy", "expanded", "--capacity-local-experts", "1"],
    "expanded-m2": ["--capacity-policy", "expanded", "--capacity-local-experts", "2"],
}
MAIN_SETTING = ("expert", "global")
OTHER_SETTINGS = [("expert", "local"), ("device", "global"), ("device", "local")]
OTHER_VARIANTS = ["drop-gate", "reroute-R1", "expanded-m1"]
REROUTES = ["reroute-R1", "reroute-R2", "reroute-R3", "expanded-m1", "expanded-m2"]


# ---------------------------------------------------------------------------------------------- running


def grid(gammas: list[str], main_only: bool = False) -> list[dict]:
    """Every run: two gamma=inf references (the grid's windows, and all windows), then the grid."""
    runs = [
        {"id": "inf", "variant": "none", "granularity": "expert", "scope": "global", "gamma": "inf"},
        {"id": "inf-all-windows", "variant": "none", "granularity": "expert", "scope": "global",
         "gamma": "inf", "all_windows": True},
    ]
    settings = [(MAIN_SETTING, list(VARIANTS))] + ([] if main_only else [(s, OTHER_VARIANTS)
                                                                          for s in OTHER_SETTINGS])
    for (granularity, scope), variants in settings:
        for variant in variants:
            for gamma in gammas:
                runs.append({"id": f"{granularity}-{scope}-{variant}-g{gamma}", "variant": variant,
                             "granularity": granularity, "scope": scope, "gamma": gamma})
    return runs


def rel(path: Path) -> str:
    """A path as the runs see it (they run in the repository root)."""
    return os.path.relpath(path, ROOT)


def command(run: dict, args: argparse.Namespace, json_path: Path) -> list[str]:
    cmd = [args.mpirun, "-np", str(args.np), "--oversubscribe",
           rel(args.build_dir / "tools" / "capserve-eval-heldout"),
           "--model", rel(args.model), "--corpus", rel(args.corpus), "--threads", "1",
           "--batch-windows", str(BATCH_WINDOWS), "--max-windows",
           "0" if run.get("all_windows") else str(args.windows),
           "--capacity-factor", run["gamma"], "--capacity-granularity", run["granularity"],
           "--capacity-scope", run["scope"], "--json", str(json_path)]
    return cmd + VARIANTS.get(run["variant"], [])


def mpi_env() -> dict:
    env = dict(os.environ)
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "OMPI_MCA_btl": "self,vader", "OMPI_MCA_btl_vader_single_copy_mechanism": "none"})
    return env


def reusable(path: Path, run: dict, args: argparse.Namespace) -> dict | None:
    if not args.resume or not path.exists():
        return None
    result = json.loads(path.read_text())
    windows = 0 if run.get("all_windows") else args.windows
    return result if result["max_windows"] == windows and result["ranks"] == args.np else None


def trimmed(result: dict) -> dict:
    """The eval's JSON without its timings and traffic figures (not meaningful here)."""
    drop = ("seconds", "wire_bytes", "rows_dispatched", "rank_max", "routed_rank")
    for layer in result["moe"]["layers"]:
        for key in [k for k in layer if any(d in k for d in drop)]:
            del layer[key]
    return result


def dump(data: dict) -> str:
    """JSON with one run per line."""
    head = json.dumps({k: v for k, v in data.items() if k != "runs"}, indent=1)[:-2]
    runs = ",\n".join(json.dumps(r) for r in data["runs"])
    return f'{head},\n "runs": [\n{runs}\n ]\n}}\n'


def run_grid(args: argparse.Namespace) -> dict:
    args.work_dir.mkdir(parents=True, exist_ok=True)
    runs = grid(args.gammas, args.main_only)
    env = mpi_env()
    start = time.monotonic()
    for i, run in enumerate(runs, 1):
        json_path = args.work_dir / f"{run['id']}.json"
        cmd = command(run, args, json_path)
        run["command"] = " ".join(cmd)
        result = reusable(json_path, run, args)
        if result is None:
            t0 = time.monotonic()
            with open(args.work_dir / f"{run['id']}.log", "w") as log:
                done = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
            if done.returncode != 0:
                sys.exit(f"{run['id']} failed (exit {done.returncode}); see {args.work_dir / run['id']}.log")
            run["seconds"] = round(time.monotonic() - t0, 2)
            result = json.loads(json_path.read_text())
        run["result"] = trimmed(result)
        print(f"[{i}/{len(runs)}] {run['id']}: {run.get('seconds', 'reused')} s, mean ppl "
              f"{mean_ppl(run):.3f}, dropped {100 * result['moe']['drop_fraction']:.2f}%", flush=True)
    return {
        "protocol": {
            "model": rel(args.model),
            "domains": DOMAINS, "windows_per_domain": args.windows, "window_text_tokens": 255,
            "batch_windows": BATCH_WINDOWS, "ranks": args.np, "threads_per_rank": 1,
            "placement": "contiguous", "gammas": args.gammas, "main_only": args.main_only,
            "name": args.name, **model_shape(args.model),
            "mean": "geometric mean of the five domains' perplexities; increase = mean / mean at gamma=inf - 1",
            "cpus": os.cpu_count(),
        },
        "grid_seconds": round(time.monotonic() - start, 1),
        "runs": runs,
    }


# ---------------------------------------------------------------------------------------------- figures


def model_shape(model_dir: Path) -> dict:
    """What the report's formulas need of the model: its name, experts, top-k and MoE layers."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return {"model_name": model_dir.name, "experts": cfg["num_experts"], "top_k": cfg["num_experts_per_tok"],
            "moe_layers": cfg["num_hidden_layers"]}


# the measurement (tools/measure_default_model.py) each embedded model's gamma=inf check compares with
REFERENCE_EVAL = {"capserve-moe-tiny": "default_model_eval.json", "capserve-moe-fine": "fine_model_eval.json"}


def mean_ppl(run: dict) -> float:
    ppl = [run["result"]["domains"][d]["perplexity"] for d in DOMAINS]
    return math.exp(sum(math.log(p) for p in ppl) / len(ppl))


class Grid:
    """Lookup of the runs by (granularity, scope, variant, gamma)."""

    def __init__(self, data: dict):
        self.data = data
        self.runs = {(r["granularity"], r["scope"], r["variant"], r["gamma"]): r
                     for r in data["runs"] if "all_windows" not in r}
        self.base = self.runs[("expert", "global", "none", "inf")]
        self.full = next(r for r in data["runs"] if r.get("all_windows"))
        self.gammas = data["protocol"]["gammas"]

    def run(self, setting, variant, gamma) -> dict:
        return self.runs[(*setting, variant, gamma)]

    def increase(self, setting, variant, gamma) -> float:
        return mean_ppl(self.run(setting, variant, gamma)) / mean_ppl(self.base) - 1

    def dropped(self, setting, variant, gamma) -> float:
        return self.run(setting, variant, gamma)["result"]["moe"]["drop_fraction"]

    def rerouted(self, setting, variant, gamma) -> float:
        return self.run(setting, variant, gamma)["result"]["moe"]["reroute_fraction"]

    def accuracy(self, setting, variant, gamma) -> float | None:
        """Next-token accuracy over all domains (None in a grid measured before capserve-eval-heldout had it)."""
        return self.run(setting, variant, gamma)["result"]["all"].get("accuracy")

    def has(self, setting, variant) -> bool:
        return (*setting, variant, self.gammas[0]) in self.runs


def pct(x: float, digits: int = 1) -> str:
    return f"{100 * x:.{digits}f}%"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    align = ["---"] + ["---:"] * (len(header) - 1)
    return ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"] + [
        "| " + " | ".join(r) + " |" for r in rows]


def pivot(g: Grid, setting, variants, cell) -> list[str]:
    return table(["variant"] + [f"γ={x}" for x in g.gammas],
                 [[v] + [cell(setting, v, x) for x in g.gammas] for v in variants if g.has(setting, v)])


def reference_check(g: Grid) -> list[str]:
    ref_name = REFERENCE_EVAL[g.data["protocol"].get("model_name", "capserve-moe-tiny")]
    ref_path = ROOT / "tools" / "results" / ref_name
    ref = json.loads(ref_path.read_text())["domains"]
    rows, worst = [], 0.0
    for d in DOMAINS:
        mine = g.full["result"]["domains"][d]
        rel = abs(mine["perplexity"] - ref[d]["perplexity"]) / ref[d]["perplexity"]
        worst = max(worst, rel)
        rows.append([d, str(mine["windows"]), f"{mine['perplexity']:.4f}", f"{ref[d]['perplexity']:.4f}",
                     f"{rel:.1e}", f"{g.base['result']['domains'][d]['perplexity']:.3f}"])
    return ([f"γ = inf under mpirun -np {g.data['protocol']['ranks']} on all held-out windows, against the "
             f"HF transformers figures of `{ref_name}` (worst relative difference "
             f"{worst:.1e}); last column: the grid's own baseline on its first "
             f"{g.data['protocol']['windows_per_domain']} windows per domain.", ""] +
            table(["domain", "windows", "perplexity (C++, np ranks)", "HF", "rel diff",
                   "grid baseline"], rows))


def domain_table(g: Grid, setting) -> list[str]:
    rows = [["none", "inf"] + [f"{g.base['result']['domains'][d]['perplexity']:.2f}" for d in DOMAINS] +
            [f"{mean_ppl(g.base):.2f}", "0.0%", "0.00%", "0.00%"]]
    for v in VARIANTS:
        if not g.has(setting, v):
            continue
        for x in g.gammas:
            r = g.run(setting, v, x)
            rows.append([v, x] + [f"{r['result']['domains'][d]['perplexity']:.2f}" for d in DOMAINS] +
                        [f"{mean_ppl(r):.2f}", pct(g.increase(setting, v, x)), pct(g.dropped(setting, v, x), 2),
                         pct(g.rerouted(setting, v, x), 2)])
    return table(["variant", "γ"] + DOMAINS + ["mean", "increase", "dropped", "rerouted"], rows)


def layer_drop_table(g: Grid, setting, variants) -> list[str]:
    layers = [l["layer"] for l in g.base["result"]["moe"]["layers"]]
    rows = []
    for v in variants:
        for x in g.gammas:
            fr = [l["drop_fraction"] for l in g.run(setting, v, x)["result"]["moe"]["layers"]]
            rows.append([v, x] + [pct(f) for f in fr])
    return table(["variant", "γ"] + [f"layer {l}" for l in layers], rows)


def concentration(g: Grid) -> list[tuple[int, float, int]]:
    """Per MoE layer at gamma=inf: the share of tokens whose top-k holds the busiest expert, and that expert."""
    out = []
    for l in g.base["result"]["moe"]["layers"]:
        load = l["routed_load"]
        e = max(range(len(load)), key=load.__getitem__)
        out.append((l["layer"], load[e] / l["tokens"], e))
    return out


def checks(g: Grid) -> list[str]:
    m = MAIN_SETTING
    lines = []
    inc = lambda v, x: g.increase(m, v, x)  # noqa: E731

    gate_wins = [x for x in g.gammas if inc("drop-gate", x) < inc("drop-order", x) and
                 inc("drop-gate", x) < inc("drop-random", x)]
    detail = "; ".join(f"γ={x}: gate {pct(inc('drop-gate', x))}, order {pct(inc('drop-order', x))}, "
                       f"random {pct(inc('drop-random', x))}" for x in g.gammas)
    lines.append(f"- **Drop by gate score beats order and random: holds at {len(gate_wins)} of "
                 f"{len(g.gammas)} γ** (mean perplexity increase over γ=inf; {detail}).")
    order_vs_random = [x for x in g.gammas if inc("drop-order", x) < inc("drop-random", x)]
    lines.append(f"  Order beats random at {len(order_vs_random)} of {len(g.gammas)} γ.")

    for v in REROUTES:
        rec = {x: 1 - inc(v, x) / inc("drop-gate", x) for x in g.gammas if inc("drop-gate", x) > 0}
        most = [x for x in rec if rec[x] >= 0.5]
        lines.append(f"- **{v} recovers most (≥ 50%) of drop-gate's loss at {len(most)} of {len(rec)} γ**: "
                     + ", ".join(f"γ={x}: {pct(rec[x], 0)} ({pct(inc(v, x))} vs {pct(inc('drop-gate', x))})"
                                 for x in rec) + ".")

    fewer = [(s, v, x) for s in [m] + OTHER_SETTINGS for v in REROUTES if g.has(s, v) for x in g.gammas
             if g.dropped(s, v, x) >= g.dropped(s, "drop-gate", x) and g.dropped(s, "drop-gate", x) > 0]
    compared = sum(1 for s in [m] + OTHER_SETTINGS for v in REROUTES if g.has(s, v) for x in g.gammas
                   if g.dropped(s, "drop-gate", x) > 0)
    lines.append(f"- Reroute and expanded drop fewer assignments than drop-gate in {compared - len(fewer)} of "
                 f"{compared} runs where drop-gate drops any" +
                 (" (not in " + ", ".join(f"{s[0]}/{s[1]} {v} γ={x}" for s, v, x in fewer) + ")" if fewer else "")
                 + ".")

    not_monotone = []
    for s in [m] + OTHER_SETTINGS:
        for v in VARIANTS:
            if g.has(s, v):
                fr = [g.dropped(s, v, x) for x in sorted(g.gammas, key=float)]
                if any(b > a for a, b in zip(fr, fr[1:])):
                    not_monotone.append(f"{s[0]}/{s[1]} {v}")
    lines.append("- The fraction dropped falls as γ grows in every variant and setting." if not not_monotone else
                 "- The fraction dropped does not fall monotonically with γ for: " + ", ".join(not_monotone))
    return lines


def span(values: list[float], digits: int = 1) -> str:
    return f"{pct(min(values), digits)}–{pct(max(values), digits)}"


def explanation(g: Grid) -> list[str]:
    """Why the orderings come out as they do on this model, with the figures behind each reason."""
    m, xs = MAIN_SETTING, g.gammas
    inc = lambda v, x: g.increase(m, v, x)  # noqa: E731
    layer_drop = lambda v, x: [l["drop_fraction"] for l in g.run(m, v, x)["result"]["moe"]["layers"]]  # noqa
    lines = []
    ratio = [min(inc("drop-order", x), inc("drop-random", x)) / inc("drop-gate", x) for x in xs]
    one = "1" if "1" in xs else xs[0]
    lines.append(
        f"**Gate score vs order and random.** The three drop rules drop the same number of assignments "
        f"(e.g. γ={one}: {pct(g.dropped(m, 'drop-gate', one))}, {pct(g.dropped(m, 'drop-order', one))}, "
        f"{pct(g.dropped(m, 'drop-random', one))}), but by gate score an over-full expert sheds its "
        f"lowest-weight assignments, those that add least to the tokens' outputs, while order and random shed "
        f"high-weight first choices as often as any; the better of order and random costs "
        f"{min(ratio):.1f}–{max(ratio):.1f}x gate's increase. Order is the worst: it sheds the step's last "
        f"tokens in every layer, so the losses pile up on the same tokens layer after layer, where random "
        f"(seeded per layer) spreads them.")
    top = max(xs, key=float)
    rec = [1 - inc(v, x) / inc("drop-gate", x) for v in REROUTES for x in xs]
    l3 = concentration(g)[-1]
    router = g.data.get("router")
    weights = ""
    if router:
        p = [l["mean_sorted_probability"] for l in router]
        weights = (
            f" (1) The router is peaked and the model does not renormalize its top-2 (norm_topk_prob = false), "
            f"so a slot's gate weight is its expert's router probability. Averaged over the same text positions "
            f"(HF transformers, `router` in the JSON), a token's 1st, 2nd, 3rd and 4th choices carry "
            + "; ".join(f"layer {l['layer']}: " + " / ".join(f"{v:.2f}" for v in l["mean_sorted_probability"])
                        for l in router)
            + f". A rerouted slot gets its new expert's probability, the 3rd choice's or less "
            f"({min(q[2] for q in p):.2f}–{max(q[2] for q in p):.2f}), for a dropped slot that carried "
            f"{min(q[1] for q in p):.2f}–{max(q[1] for q in p):.2f} (a 2nd choice) or "
            f"{min(q[0] for q in p):.2f}–{max(q[0] for q in p):.2f} (a 1st), and from an expert that is not a "
            f"substitute for the one lost.")
    capacity_share = float(top) * 2 / 16
    lines.append(
        f"**Reroute and expanded drop do not recover most of drop's loss here** (recovery "
        f"{pct(min(rec), 0)}–{pct(max(rec), 0)} over all γ), although they do place the slots: at γ={top} "
        f"reroute-R3 drops {pct(g.dropped(m, 'reroute-R3', top), 2)} of assignments against drop-gate's "
        f"{pct(g.dropped(m, 'drop-gate', top))}, and its increase is {pct(inc('reroute-R3', top))} against "
        f"{pct(inc('drop-gate', top))}. Two properties of this model make a placed slot worth little." + weights +
        f" (2) The overload is far beyond any γ of the grid: at layer {l3[0]} expert e{l3[2]} is in the top-2 "
        f"of {pct(l3[1], 0)} of the tokens (pooled; every step holds one domain, whose own hot experts add to "
        f"this), while its capacity ⌈γ N̄⌉ is γ k / E = {pct(capacity_share, 1)} of a step's tokens at "
        f"γ={top}, so most tokens lose their layer-{l3[0]} expert whatever the policy; drop-gate drops "
        f"{pct(layer_drop('drop-gate', top)[-1])} of layer {l3[0]}'s assignments at γ={top} "
        f"({pct(layer_drop('drop-gate', min(xs, key=float))[-1])} at γ={min(xs, key=float)}). The claim needs "
        f"an overflow that is a small, low-weight fraction of the assignments and reroute targets of comparable "
        f"weight, as in the paper's large pretrained MoEs; this 4-layer, 16-expert model is the opposite "
        f"extreme.")
    dev_setting = ("device", "global")
    dev = [g.increase(dev_setting, "drop-gate", x) for x in xs]
    # The device-granularity run that drops about as much as per-expert drop-gate at the largest gamma.
    like = min(xs, key=lambda x: abs(g.dropped(dev_setting, "drop-gate", x) - g.dropped(m, "drop-gate", top)))
    loc = [g.increase(("expert", "local"), v, x) - g.increase(m, v, x) for v in OTHER_VARIANTS for x in xs]
    lines.append(
        f"**Granularity and scope.** Device granularity bounds the sum over a rank's 8 experts by 8 ⌈γ N̄⌉, so "
        f"only the imbalance between the two ranks counts: drop-gate costs {span(dev)} there against "
        f"{span([inc('drop-gate', x) for x in xs])} per expert. What costs is the weight dropped, not the count: "
        f"device / global drop-gate at γ={like} drops {pct(g.dropped(dev_setting, 'drop-gate', like))} of the "
        f"assignments for {pct(g.increase(dev_setting, 'drop-gate', like))}, expert / global at γ={top} "
        f"{pct(g.dropped(m, 'drop-gate', top))} for {pct(inc('drop-gate', top))}: over a rank's 8 experts the "
        f"lowest gate weights are nearly weightless slots, at one hot expert they are not. Local scope (each "
        f"rank enforces its own "
        f"⌈γ T_r k / E⌉ on its half of the step) changes the increase by {min(loc) * 100:+.1f} to "
        f"{max(loc) * 100:+.1f} points against global scope: with one domain per step both ranks see the "
        f"same routing distribution.")
    return lines


# The capacity-aware inference paper (arXiv 2503.05066) as issue 30 quotes it: the quality cost of its operating
# point and the MoE-layer speedup it buys on 8 GPUs.
PAPER_ROWS = [("OLMoE-1B-7B (paper)", "+0.9%", "about 1.3x (\"30%\")"),
              ("Mixtral-8x7B (paper)", "+0.2% at γ = 1.5", "1.85x at 8 GPUs")]


def beside_paper(g: "Grid", name: str) -> list[str]:
    """Our drop-by-gate operating points beside the paper's figures (speedups on routing counts: lever_table.md)."""
    m = MAIN_SETTING
    rows = [[label, quality, speed] for label, quality, speed in PAPER_ROWS]
    for x in g.gammas:
        if x != "inf":
            rows.append([f"{name}, γ = {x} (drop by gate score)", f"{pct(g.increase(m, 'drop-gate', x))} "
                         f"({pct(g.dropped(m, 'drop-gate', x))} of assignments dropped)", "see lever_table.md"])
    return (["## Beside the paper", "",
             "The paper's operating points (mean perplexity increase; MoE-layer speedup from the straggler's "
             "load) and ours on this model; the speedup on this model's and on real OLMoE / Mixtral routing "
             "counts per γ: `lever_table.md` (routing counts) and `planner_projection.md` (8-GPU steps).", ""]
            + table(["model, setting", "perplexity increase", "MoE-layer speedup"], rows) + [""])


def report(data: dict) -> str:
    g = Grid(data)
    p = data["protocol"]
    m = MAIN_SETTING
    conc = concentration(g)
    seconds = [r["seconds"] for r in data["runs"] if "seconds" in r and not r.get("all_windows")]
    name, E, k = p.get("model_name", "capserve-moe-tiny"), p.get("experts", 16), p.get("top_k", 2)
    stem = p.get("name", "capacity_quality")
    lines = [
        f"# Capacity-aware scheduling: quality on {name}",
        "",
        f"Generated by `tools/eval/capacity_quality.py` (raw figures: `{stem}.json`; plot: "
        f"`{stem}.png`). Held-out perplexity per domain (protocol of `{REFERENCE_EVAL[name][:-5]}.md`: "
        f"windows of one `<|endoftext|>` + 255 text tokens) by `capserve-eval-heldout` under "
        f"`mpirun -np {p['ranks']}` ({p['threads_per_rank']} thread per rank, {p['placement']} expert "
        f"placement: each rank hosts a block of {E} / {p['ranks']} consecutive experts), the first **{p['windows_per_domain']} windows "
        f"per domain**, each step {p['batch_windows']} windows of one domain split over the ranks (so a step "
        f"has {p['batch_windows'] * 256} tokens, N̄ = {p['batch_windows'] * 256} x {k} / {E} = "
        f"{p['batch_windows'] * 256 * k // E} assignments per expert, capacity ⌈γ N̄⌉). Capacity applies to "
        f"every MoE layer. \"mean\" is the geometric mean of the five domains' perplexities, \"increase\" "
        f"its ratio to γ = inf minus one; \"dropped\" / \"rerouted\" are fractions of all (token, slot) "
        f"assignments over the {p.get('moe_layers', 4)} MoE layers. Grid wall time: {data['grid_seconds'] / 60:.1f} min for "
        f"{len(data['runs'])} runs on {p['cpus']} cores shared with other jobs (a {p['windows_per_domain']}-window "
        f"run took {min(seconds):.0f}–{max(seconds):.0f} s).",
        "",
        f"Reproduce: `python3 tools/eval/capacity_quality.py --build-dir <build> --np {p['ranks']} --windows "
        f"{p['windows_per_domain']}"
        + (f" --model {p['model']} --name {stem} --main-only --gammas {' '.join(g.gammas)}" if p.get("main_only")
           else "")
        + "` (the build's `capserve-eval-heldout`; mpirun with --oversubscribe).",
        "",
        "## Check: γ = inf",
        "",
    ] + reference_check(g) + [
        "",
        f"## Main grid: granularity expert, scope global",
        "",
        "Mean perplexity increase over γ = inf:",
        "",
    ] + pivot(g, m, VARIANTS, lambda s, v, x: pct(g.increase(s, v, x))) + [
        "",
        "Fraction of assignments dropped (rerouted):",
        "",
    ] + pivot(g, m, VARIANTS, lambda s, v, x: pct(g.dropped(s, v, x)) + (
        f" ({pct(g.rerouted(s, v, x))})" if v in REROUTES else "")) + [
        "",
        "Fraction dropped per MoE layer:",
        "",
    ] + layer_drop_table(g, m, ["drop-gate", "reroute-R1", "expanded-m1"]) + [""]
    base_accuracy = g.base["result"]["all"].get("accuracy")
    if base_accuracy is not None:
        lines += [
            f"Next-token accuracy, the task score (the share of held-out positions whose most probable next token "
            f"is the text's, as greedy decoding would write it; γ = inf: {pct(base_accuracy)}), and its change in "
            "points:",
            "",
        ] + pivot(g, m, VARIANTS, lambda s, v, x: f"{pct(g.accuracy(s, v, x))} "
                  f"({100 * (g.accuracy(s, v, x) - base_accuracy):+.1f})") + [""]
    settings = [m] + ([] if p.get("main_only") else OTHER_SETTINGS)
    if not p.get("main_only"):
        lines += ["## Other granularities and scopes", "", "Mean perplexity increase over γ = inf (dropped):", ""]
        rows = []
        for s in settings:
            for v in OTHER_VARIANTS:
                rows.append([f"{s[0]} / {s[1]} / {v}"] + [
                    f"{pct(g.increase(s, v, x))} ({pct(g.dropped(s, v, x))})" for x in g.gammas])
        lines += table(["granularity / scope / variant"] + [f"γ={x}" for x in g.gammas], rows) + [""]
    lines += beside_paper(g, name)
    lines += ["## What it shows", ""]
    lines += checks(g)
    lines += ["", f"Routing concentration at γ = inf (share of tokens whose top-{k} holds the layer's busiest "
              "expert): " + ", ".join(f"layer {l}: {pct(c, 0)} (e{e})" for l, c, e in conc) + ".", ""]
    if not p.get("main_only"):  # the reasons are this grid's (granularity and scope) and the tiny model's
        for paragraph in explanation(g):
            lines += [paragraph, ""]
    for s in settings:
        lines += [f"## Per domain: {s[0]} / {s[1]}", ""] + domain_table(g, s) + [""]
    return "\n".join(lines)


def router_probabilities(model_dir: Path, corpus: Path, windows: int) -> list[dict]:
    """Per MoE layer: the router's probabilities sorted per token, averaged over the text positions of the grid's
    windows (HF transformers, float32), i.e. the gate weight a token's 1st, 2nd, 3rd, 4th choice carries (the
    model does not renormalize its top-k, so a rerouted slot weighs its new expert's probability)."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    captured: list = []
    hooks = [r.register_forward_hook(lambda mod, a, out: captured.append(out[0])) for r in routers]
    sums = torch.zeros(len(routers), 4, dtype=torch.float64)
    positions = 0
    try:
        for domain in DOMAINS:
            data = (corpus / f"{domain}.txt").read_bytes()
            heldout = data[data.index(b"\n", math.floor(len(data) * 0.95)) + 1:].decode("utf-8")
            ids = tokenizer.encode(heldout, add_special_tokens=False).ids
            n = min(len(ids) // 255, windows)
            x = torch.tensor([[0] + ids[w * 255:(w + 1) * 255] for w in range(n)])
            for first in range(0, n, BATCH_WINDOWS):
                captured.clear()
                with torch.no_grad():
                    model(input_ids=x[first:first + BATCH_WINDOWS])
                for layer, logits in enumerate(captured):
                    probs = logits.view(-1, 256, logits.shape[-1])[:, 1:].softmax(-1)
                    sums[layer] += probs.sort(-1, descending=True).values[..., :4].double().sum((0, 1))
                positions += captured[0].shape[0] // 256 * 255
    finally:
        for h in hooks:
            h.remove()
    return [{"layer": layer, "mean_sorted_probability": [round(v, 4) for v in (sums[layer] / positions).tolist()]}
            for layer in range(len(routers))]


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = Grid(data)
    xs = sorted(g.gammas, key=float)
    main_only = data["protocol"].get("main_only", False)
    fig, axes = plt.subplots(1, 2 if main_only else 3, figsize=(12 if main_only else 18, 5.5))
    styles = {"drop": "-", "reroute": "--", "expanded": ":"}
    for v in VARIANTS:
        style = styles[v.split("-")[0]]
        axes[0].plot([float(x) for x in xs], [100 * g.increase(MAIN_SETTING, v, x) for x in xs], style,
                     marker="o", label=v)
        axes[1].plot([float(x) for x in xs], [100 * g.dropped(MAIN_SETTING, v, x) for x in xs], style,
                     marker="o", label=v)
    for s, color in zip([] if main_only else [MAIN_SETTING] + OTHER_SETTINGS, ["C0", "C1", "C2", "C3"]):
        for v in OTHER_VARIANTS:
            axes[2].plot([float(x) for x in xs], [100 * g.increase(s, v, x) for x in xs],
                         styles[v.split("-")[0]], color=color, marker="o", label=f"{s[0]}/{s[1]} {v}")
    axes[0].set_title("expert / global: mean perplexity increase over γ=inf")
    axes[1].set_title("expert / global: assignments dropped")
    if not main_only:
        axes[2].set_title("granularity / scope: mean perplexity increase")
    for ax, ylabel in zip(axes, ["increase (%)", "dropped (% of assignments)", "increase (%)"]):
        ax.set_xlabel("capacity factor γ")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in (axes[0],) if main_only else (axes[0], axes[2]):
        ax.set_yscale("symlog", linthresh=1)
    fig.suptitle(f"{data['protocol'].get('model_name', 'capserve-moe-tiny')}, {data['protocol']['windows_per_domain']} held-out windows per domain, "
                 f"mpirun -np {data['protocol']['ranks']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_outputs(data: dict, args: argparse.Namespace) -> None:
    """The router statistics (once, into the raw JSON), report and plot: they need matplotlib, torch and
    transformers, so without them this step runs again under tools/.venv/bin/python."""
    try:
        import matplotlib  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        venv = ROOT / "tools" / ".venv"
        if Path(sys.prefix).resolve() == venv.resolve() or not venv.exists():
            raise
        subprocess.run([str(venv / "bin" / "python"), __file__, "--report-only", "--out-dir", str(args.out_dir),
                        "--model", str(args.model), "--corpus", str(args.corpus), "--name", args.name],
                       check=True)
        return
    if "router" not in data:
        data["router"] = router_probabilities(args.model, args.corpus, data["protocol"]["windows_per_domain"])
        (args.out_dir / f"{args.name}.json").write_text(dump(data))
    (args.out_dir / f"{args.name}.md").write_text(report(data) + "\n")
    plot(data, args.out_dir / f"{args.name}.png")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-dir", type=Path, default=ROOT / "build")
    ap.add_argument("--np", type=int, default=2, help="MPI ranks")
    ap.add_argument("--windows", type=int, default=40, help="held-out windows per domain")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "tools" / "results")
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--corpus", type=Path, default=CORPUS)
    ap.add_argument("--gammas", nargs="+", default=GAMMAS)
    ap.add_argument("--name", default="capacity_quality", help="the results' file names (NAME.json, .md, .png)")
    ap.add_argument("--main-only", action="store_true",
                    help="the main setting (expert granularity, global scope) alone")
    ap.add_argument("--mpirun", default="mpirun")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/capacity_quality_runs"))
    ap.add_argument("--resume", action="store_true", help="reuse the runs already in --work-dir")
    ap.add_argument("--report-only", action="store_true",
                    help="rewrite the report and plot from <out-dir>/NAME.json")
    args = ap.parse_args()
    for name in ("build_dir", "out_dir", "model", "corpus", "work_dir"):
        setattr(args, name, getattr(args, name).resolve())
    raw = args.out_dir / f"{args.name}.json"
    if args.report_only:
        data = json.loads(raw.read_text())
    else:
        data = run_grid(args)
        args.out_dir.mkdir(parents=True, exist_ok=True)
        raw.write_text(dump(data))
    write_outputs(data, args)


if __name__ == "__main__":
    main()
