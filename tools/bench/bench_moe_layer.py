#!/usr/bin/env python3
"""MoE layer speed vs capacity factor gamma: measured speedup next to the ideal ratio.

Runs capserve-bench-moe-layer (tools/bench/bench_moe_layer.cpp) under mpirun, twice:
  (b) --mode synthetic: a large random layer (64 experts top-8, hidden 2048, expert FFN 1024, bf16) whose
      routing follows the real per-domain OLMoE expert counts of
      ../shared/data/routing/olmoe_mixtral_expert_counts.json (layers 0, 7, 15: one layer call each per step);
  (a) --mode model: the default model (deploy/models/capserve-moe-tiny) on bursts of one domain's held-out
      corpus text.
Every capacity configuration runs side by side in one process group, interleaved round-robin across
repetitions (median of --reps). Per configuration: the slowest rank's MoE layer time (scheduler + dispatch +
expert + combine), measured speedup t(inf) / t(config), ideal ratio (largest rank load under gamma = inf /
under the config, a rank's load being the assignments its experts compute), measured / ideal, the scheduler's
share of the layer time and the fraction of assignments dropped.

Writes tools/results/bench_moe_layer.{json,md,png}. Goal of the issue: measured >= 0.8 x ideal and scheduler
<= 3 % of the layer.

Run (from the repository root, after building capserve-bench-moe-layer; matplotlib from tools/.venv):
    tools/.venv/bin/python tools/bench/bench_moe_layer.py --bin build/tools/capserve-bench-moe-layer
On a shared machine, run the final measurement under `flock /tmp/capserve-heavy.lock`.

Before / after (--baseline-bin): a change against another build (e.g. the previous commit, built side by side
in a git worktree), in one run. Each mode then runs both binaries with the same arguments, one repetition per
MPI job (`--reps 1` after the binary's own warm-up; --reps / --model-reps such jobs per build), alternating:
repetition r runs the baseline first when r is even and --bin first when it is odd. Per (domain, config) the
median over the jobs of each build, rows 'all' the mean over the domains of those medians; the table shows the
layer time before, after and after / before (model mode: also the slowest rank's own sum and the step time),
the phases' ratios, and whether both builds routed and capped identically; ratios above 1.03 are marked.
Writes tools/results/<--out-stem>.{json,md,png} (json: also every job's own rows) instead of the gamma report:
    tools/.venv/bin/python tools/bench/bench_moe_layer.py --bin build/tools/capserve-bench-moe-layer \
        --baseline-bin ../prev/build/tools/capserve-bench-moe-layer --out-stem bench_moe_layer_change
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine_load import cpu_jiffies, log, wait_for_idle

ROOT = Path(__file__).resolve().parents[2]
GOAL_EFFICIENCY = 0.8
GOAL_SCHEDULER_SHARE = 0.03
# Rows whose ideal ratio is below this are "nothing to gain": measured / ideal there is noise around 1.
MIN_IDEAL_FOR_GOAL = 1.05






def cpu_name():
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def mpi_env():
    env = dict(os.environ)
    env.update({
        "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_btl": "self,vader", "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
    })
    return env






def run_bench(args, mode, extra, binary=None):
    """Runs one mode (of args.bin, or of `binary`); returns its JSON document, with how busy the cores were
    before and during the run."""
    binary = binary or args.bin
    busy_before = wait_for_idle(args.max_idle_wait)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{mode}.json"
        cmd = ["mpirun", "-np", str(args.np), "--oversubscribe", str(binary), "--mode", mode,
               "--threads", str(args.threads), "--out", str(out)] + extra
        log("$ " + " ".join(cmd))
        tick = os.sysconf("SC_CLK_TCK")
        la0 = os.getloadavg()[0]
        t0, i0 = cpu_jiffies()
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=mpi_env(), stdout=subprocess.PIPE)
        _, status, _ = os.wait4(proc.pid, 0)
        stdout = proc.stdout.read().decode(errors="replace")
        wall = time.monotonic() - start
        t1, i1 = cpu_jiffies()
        if os.waitstatus_to_exitcode(status) != 0:
            sys.exit(f"{mode} run failed:\n{stdout}")
        print(stdout, flush=True)
        doc = json.loads(out.read_text())
        busy_s = ((t1 - t0) - (i1 - i0)) / tick
        doc["meta"]["wall_s"] = wall
        doc["meta"]["cores_busy_before"] = busy_before
        # The ranks alone keep np cores busy (they spin while waiting in MPI); more than that is other work.
        doc["meta"]["cores_busy_during"] = busy_s / (wall * os.cpu_count())
        doc["meta"]["loadavg_start_end"] = [la0, os.getloadavg()[0]]
        shown = [x for i, x in enumerate(cmd) if x != "--out" and (i == 0 or cmd[i - 1] != "--out")]
        shown[4] = Path(binary).name
        doc["meta"]["command"] = " ".join(shown)
        return doc


def add_cost_model(doc):
    """Synthetic mode: the speedup that the grouped expert FFN alone predicts, from its measured cost per
    expert against row count (meta.expert_cost) and the per-expert loads of each configuration: the rank time
    is the sum of its experts' costs, the layer time the largest rank time, summed over the layer calls. Its
    ratio to the ideal isolates the kernel's per-expert fixed costs and row-count-dependent efficiency; the
    rest of the gap to the measured speedup is communication, scheduling, gathering and noise."""
    curve = sorted((c["rows"], c["ms"]) for c in doc["meta"].get("expert_cost", []))
    if not curve:
        return

    def cost(n):
        if n <= 0:
            return 0.0
        for (n0, t0), (n1, t1) in zip(curve, curve[1:]):
            if n0 <= n <= n1:
                return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
        if n < curve[0][0]:
            return curve[0][1]
        return curve[-1][1] * n / curve[-1][0]  # beyond the largest count: per-row cost of the largest

    experts, ranks = doc["meta"]["experts"], doc["meta"]["ranks"]
    sizes = [experts // ranks + (1 if r < experts % ranks else 0) for r in range(ranks)]  # contiguous
    starts = [sum(sizes[:r]) for r in range(ranks)]
    per_domain = [r for r in doc["results"] if r["domain"] != "all"]
    for r in per_domain:
        r["cost_model_ms"] = sum(max(sum(cost(n) for n in layer[starts[q]:starts[q] + sizes[q]])
                                     for q in range(ranks)) for layer in r["expert_load"])
    for r in doc["results"]:
        if r["domain"] == "all":
            r["cost_model_ms"] = sum(x["cost_model_ms"] for x in per_domain if x["config"] == r["config"])
    base = {r["domain"]: r["cost_model_ms"] for r in doc["results"] if r["config"] == "inf"}
    for r in doc["results"]:
        r["cost_model_speedup"] = base[r["domain"]] / r["cost_model_ms"]
        r["cost_model_over_ideal"] = r["cost_model_speedup"] / r["ideal_ratio"]
        r["measured_over_cost_model"] = r["measured_speedup"] / r["cost_model_speedup"]


def fmt_gamma(g):
    return "inf" if g == "inf" else f"{g:g}"


def table(rows, with_step=False):
    synth = "scheduler_min_share" in rows[0]
    head = ("| domain | config | layer ms | sched ms | dispatch ms | expert ms | combine ms | measured speedup "
            "| ideal ratio | measured / ideal | scheduler share |")
    sep = "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    if synth:
        head += " sched share, fastest rank |"
        sep += "---:|"
    net = "scheduler_net_share" in rows[0]
    if net:
        head += (" layer ms, slowest rank's own sum | arrival wait ms | sched net ms | sched net share "
                 "| layer ms net of arrival wait "
                 "| speedup net of arrival wait | net / ideal |")
        sep += "---:|---:|---:|---:|---:|---:|---:|"
    model_cols = "cost_model_speedup" in rows[0]
    if model_cols:
        head += " kernel-model speedup | kernel-model / ideal |"
        sep += "---:|---:|"
    head += " dropped | rerouted |"
    sep += "---:|---:|"
    if with_step:
        head += " step ms |"
        sep += "---:|"
    lines = [head, sep]
    for r in rows:
        eff = r["measured_over_ideal"]
        mark = "" if r["ideal_ratio"] < MIN_IDEAL_FOR_GOAL or eff >= GOAL_EFFICIENCY else " ✗"
        line = (f"| {r['domain']} | {r['config']} | {r['layer_ms']:.2f} | {r['scheduler_ms']:.3f} "
                f"| {r['dispatch_ms']:.2f} | {r['expert_ms']:.2f} | {r['combine_ms']:.2f} "
                f"| {r['measured_speedup']:.3f} | {r['ideal_ratio']:.3f} | {eff:.3f}{mark} "
                f"| {100 * r['scheduler_share']:.2f}% |")
        if synth:
            line += f" {100 * r['scheduler_min_share']:.2f}% |"
        if net:
            net_eff = r["measured_net_over_ideal"]
            net_mark = "" if r["ideal_ratio"] < MIN_IDEAL_FOR_GOAL or net_eff >= GOAL_EFFICIENCY else " ✗"
            line += (f" {r['layer_rank_ms']:.2f} | {r['arrival_wait_ms']:.3f} | {r['scheduler_net_ms']:.3f} "
                     f"| {100 * r['scheduler_net_share']:.2f}% | {r['layer_net_ms']:.2f} "
                     f"| {r['measured_speedup_net']:.3f} | {net_eff:.3f}{net_mark} |")
        if model_cols:
            line += f" {r['cost_model_speedup']:.3f} | {r['cost_model_over_ideal']:.3f} |"
        line += f" {100 * r['dropped_fraction']:.1f}% | {100 * r['rerouted_fraction']:.1f}% |"
        if with_step:
            line += f" {r['step_ms']:.1f} |"
        lines.append(line)
    return lines


def goal_status(doc):
    """(worst measured/ideal over rows with something to gain, its row, worst scheduler share, its row)."""
    rows = [r for r in doc["results"] if r["config"] != "inf"]
    gain = [r for r in rows if r["ideal_ratio"] >= MIN_IDEAL_FOR_GOAL]
    worst_eff = min(gain, key=lambda r: r["measured_over_ideal"]) if gain else None
    worst_sched = max(doc["results"], key=lambda r: r["scheduler_share"])
    return worst_eff, worst_sched, gain


def summary_lines(name, doc):
    worst_eff, worst_sched, gain = goal_status(doc)
    all_gain = [r for r in gain if r["domain"] == "all"]
    passed = sum(r["measured_over_ideal"] >= GOAL_EFFICIENCY for r in gain)
    lines = [f"**{name}**: measured >= {GOAL_EFFICIENCY} x ideal in {passed} of {len(gain)} rows with an ideal "
             f"ratio >= {MIN_IDEAL_FOR_GOAL} (per domain and all domains)"]
    if all_gain:
        lo = min(all_gain, key=lambda r: r["measured_over_ideal"])
        lines[-1] += (f"; all domains pooled: measured / ideal {min(r['measured_over_ideal'] for r in all_gain):.2f}"
                      f" ({lo['config']}) to {max(r['measured_over_ideal'] for r in all_gain):.2f}")
    if worst_eff:
        lines[-1] += (f"; lowest {worst_eff['measured_over_ideal']:.2f} ({worst_eff['domain']}, "
                      f"{worst_eff['config']}: speedup {worst_eff['measured_speedup']:.2f} vs ideal "
                      f"{worst_eff['ideal_ratio']:.2f})")
    lines[-1] += (f". Scheduler share (slowest rank) at most {100 * worst_sched['scheduler_share']:.2f}% "
                  f"({worst_sched['domain']}, {worst_sched['config']}): goal <= {100 * GOAL_SCHEDULER_SHARE:.0f}% "
                  f"{'met' if worst_sched['scheduler_share'] <= GOAL_SCHEDULER_SHARE else 'NOT met'}")
    for key, what in (("scheduler_min_share", "fastest rank"),
                      ("scheduler_net_share", "net of the wait for the other rank in its first collective")):
        if key in doc["results"][0]:
            w = max(doc["results"], key=lambda r: r[key])
            lines[-1] += (f"; {what}: at most {100 * w[key]:.2f}% ({w['domain']}, {w['config']}), "
                          f"{'met' if w[key] <= GOAL_SCHEDULER_SHARE else 'NOT met'}")
    lines[-1] += "."
    if "measured_net_over_ideal" in doc["results"][0]:
        net_rows = [r for r in gain]
        lo = min(net_rows, key=lambda r: r["measured_net_over_ideal"])
        pooled = [r["measured_net_over_ideal"] for r in net_rows if r["domain"] == "all"]
        lines.append(f"{name}, layer time net of the arrival wait: measured >= {GOAL_EFFICIENCY} x ideal in "
                     f"{sum(r['measured_net_over_ideal'] >= GOAL_EFFICIENCY for r in net_rows)} of "
                     f"{len(net_rows)} rows; all domains pooled {min(pooled):.2f} to {max(pooled):.2f}; lowest "
                     f"{lo['measured_net_over_ideal']:.2f} ({lo['domain']}, {lo['config']}).")
    return lines


def plot(docs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    for ax, (name, doc) in zip(axes[:2], docs):
        rows = [r for r in doc["results"] if r["domain"] == "all" and r["policy"] in ("drop", "none")]
        for gran, color in (("expert", "tab:blue"), ("device", "tab:orange")):
            pts = sorted(((float(r["gamma"]), r) for r in rows
                          if r["gamma"] != "inf" and r["granularity"] == gran), key=lambda p: -p[0])
            xs = [0.0] + [1 / g for g, _ in pts]
            ax.plot(xs, [1.0] + [r["measured_speedup"] for _, r in pts], "o-", color=color,
                    label=f"measured, drop {gran}")
            ax.plot(xs, [1.0] + [r["ideal_ratio"] for _, r in pts], "s--", color=color, alpha=0.6,
                    label=f"ideal, drop {gran}")
            if pts and "measured_speedup_net" in pts[0][1]:
                ax.plot(xs, [1.0] + [r["measured_speedup_net"] for _, r in pts], "^:", color=color,
                        alpha=0.8, label=f"measured net of arrival wait, drop {gran}")
        ticks = [0.0] + sorted({1 / float(r["gamma"]) for r in rows if r["gamma"] != "inf"})
        ax.set_xticks(ticks)
        ax.set_xticklabels(["inf"] + [f"{1 / t:g}" for t in ticks[1:]])
        ax.set_xlabel("capacity factor gamma (axis: 1/gamma)")
        ax.set_ylabel("t(inf) / t(gamma)  or  max rank load ratio")
        ax.set_title(name + " (all domains)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[2]
    top = 1.0
    for (name, doc), marker in zip(docs, ("o", "^")):
        rows = [r for r in doc["results"] if r["config"] != "inf" and r["domain"] != "all"]
        for pol, color in (("drop", "tab:blue"), ("reroute", "tab:green"), ("expanded", "tab:red")):
            sel = [r for r in rows if r["policy"] == pol]
            ax.scatter([r["ideal_ratio"] for r in sel], [r["measured_speedup"] for r in sel], s=14,
                       marker=marker, color=color, alpha=0.6, label=f"{name.split(':')[0]} {pol}")
            top = max([top] + [r["ideal_ratio"] for r in sel] + [r["measured_speedup"] for r in sel])
    xs = [1.0, top * 1.05]
    ax.plot(xs, xs, "k-", lw=0.8, label="measured = ideal")
    ax.plot(xs, [GOAL_EFFICIENCY * x for x in xs], "k--", lw=0.8, label=f"{GOAL_EFFICIENCY} x ideal")
    ax.set_xlabel("ideal ratio (max rank load before / after)")
    ax.set_ylabel("measured speedup")
    ax.set_title("every domain x config", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def linear_fit(points):
    """Least-squares (intercept, slope) of [(x, y)]."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - slope * mx, slope


def pooled(doc, config):
    return next(r for r in doc["results"] if r["domain"] == "all" and r["config"] == config)


def notes(synth, model):
    """The 'what limits measured vs ideal' section, with this run's figures."""
    out = ["## What limits measured vs ideal", ""]
    if synth and len([c for c in synth["meta"].get("expert_cost", []) if c["rows"] >= 64]) >= 2:
        m = synth["meta"]
        cost = [(c["rows"], c["ms"]) for c in m["expert_cost"]]
        fixed, per_row = linear_fit([(n, t) for n, t in cost if n >= 64])
        n_bar = m["ranks"] * m["tokens_per_rank"] * m["top_k"] // m["experts"]
        t_bar = fixed + per_row * n_bar
        small = [(n, t) for n, t in cost if n <= 32]
        d1 = pooled(synth, "drop expert 1")
        inf = pooled(synth, "inf")
        gap = 1 - d1["measured_over_ideal"]
        kgap = 1 - d1["cost_model_over_ideal"]
        out += [
            f"**(b) synthetic layer.** The expert phase is {100 * inf['expert_ms'] / inf['layer_ms']:.0f}% of "
            "the layer (gamma = inf, slowest rank), so the layer time follows the grouped expert FFN, and that "
            "is not proportional to the rows it computes. Fitted over 64..1024 rows, one expert costs "
            f"**{fixed:.1f} ms + {per_row:.3f} ms per row**: at the mean load of {n_bar} rows the fixed part "
            f"is {100 * fixed / t_bar:.0f}% of the expert's time, and dropping rows never removes it. The "
            "fixed part is in `kernels/cpu/cpu_backend.cpp`: above 32 rows `CpuBackend::linear` widens the "
            "whole bf16 weight matrix to a float32 copy (`convert_to_f32` into `widened_weight_`: "
            f"{3 * m['hidden'] * m['expert_ffn'] / 1e6:.1f} M elements, "
            f"{3 * m['hidden'] * m['expert_ffn'] * 4 / 2**20:.0f} MiB written per expert per call for gate, "
            "up and down) and `cblas_sgemm` then packs that copy again (OpenBLAS `sgemm_incopy`); both stream "
            "the full weights whatever the row count. A perf profile of one rank (2026-11-21, inf and gamma 1 "
            "configurations) put `sgemm_kernel` at 53% of its cycles, `sgemm_incopy` (packing the widened "
            "weights) at 15% and `convert_to_f32` at 3.6%. Per-row efficiency also grows with rows "
            f"({6 * m['hidden'] * m['expert_ffn'] * cost[-1][0] / (cost[-1][1] * 1e6):.0f} "
            f"GFLOP/s at {cost[-1][0]} rows, "
            f"{6 * m['hidden'] * m['expert_ffn'] * 128 / (dict(cost).get(128, t_bar) * 1e6):.0f} at 128), so "
            "capping a hot expert moves its rows to a less efficient size; at 32 rows and below the direct "
            f"bf16 kernel runs ({small[0][1]:.2f} ms for 1 row, {small[-1][1]:.2f} ms for {small[-1][0]}), and "
            "the switch to the sgemm path costs a step (32 -> 33 rows in the cost table).",
            "",
            f"The *kernel-model* column applies that measured curve to every configuration's per-expert loads: "
            f"pooled over the domains, drop / expert / gamma 1 is predicted at {d1['cost_model_over_ideal']:.3f} "
            f"of the ideal and measured at {d1['measured_over_ideal']:.3f}: "
            + (f"the kernel curve accounts for {100 * kgap / gap:.0f}% of the shortfall, communication, "
               "scheduling and noise for the rest. " if 0 < kgap < gap else
               "the kernel curve alone accounts for the whole shortfall (the rest is within noise). ")
            + "Dispatch and combine move a token's row once per destination rank, and with top-8 over "
            "2 ranks nearly every token goes to both ranks whatever is dropped, so their bytes hardly shrink "
            f"(dispatch {inf['dispatch_ms']:.1f} ms per layer call at gamma = inf); the slowest rank's combine "
            f"({inf['combine_ms']:.1f} ms) is mostly waiting for the other rank's experts (expert phase "
            f"{inf['expert_ms']:.0f} ms on the slowest rank, {inf['expert_min_ms']:.0f} ms on the fastest).",
            "",
            "The ideal ratios themselves are modest here: with 2 ranks and a contiguous placement each rank "
            "hosts 32 experts, which averages the hot experts out (max/mean rank load 1.01-1.23 in the real "
            "counts), so device-granularity capacity drops nothing until gamma = 1 (ideal ratio 1.00, measured "
            "~1.00: the no-op cost of the scheduler), and expert-granularity capacity gains by removing work "
            "from both ranks rather than by balancing them.",
            "",
        ]
    if model:
        inf = pooled(model, "inf")
        worst = max(model["results"], key=lambda r: r["scheduler_share"])
        worst_net = max(model["results"], key=lambda r: r["scheduler_net_share"])
        out += [
            f"**(a) default model.** Hidden 256 and expert FFN 192: a row costs ~0.3 MFLOP per expert. At "
            f"gamma = inf a MoE layer takes {inf['layer_ms']:.1f} ms as the sum of the phases' slowest ranks, "
            f"{inf['layer_rank_ms']:.1f} ms as the slowest rank's own sum and {inf['layer_net_ms']:.1f} ms net "
            f"of the arrival wait (expert phase {inf['expert_ms']:.1f} ms on the slowest rank), out of a "
            f"{inf['step_ms']:.0f} ms forward step in which attention and the rest are the larger part; "
            "fixed costs (per-call overheads, MPI latency, the rows' copies, a dispatch whose rows hardly "
            "shrink since most tokens keep an expert on each rank) weigh more than on the large layer. The "
            "ideal ratios are larger than on the synthetic layer because this model's routing is very skewed "
            "(max/mean up to 7.7 per expert) and only 16 experts share 2 ranks.",
            "",
            "The scheduler's measured time is dominated by waiting: the two ranks reach each MoE layer at "
            "different times (attention and routing of their own sequences), and the first collective of the "
            "layer absorbs the difference. With capacity on that collective is the scheduler's count "
            "allreduce (`CapacityStage::apply` -> `Communicator::allreduce_sum` of the per-bin counts); "
            "with capacity off it is the dispatcher's first `alltoall`, where the same wait is charged to "
            f"dispatch. Hence the scheduler share of up to {100 * worst['scheduler_share']:.1f}% "
            f"({worst['domain']}, {worst['config']}: {worst['scheduler_ms']:.2f} ms of which "
            f"{worst['arrival_wait_in_scheduler_ms']:.2f} ms waiting). The wait differs between the "
            "configurations' model instances but is stable across domains and repetitions (the order rotates "
            "each repetition) in the run of 2026-11-21, so it is a property of a model instance on one rank (a guess: the alignment of "
            "that instance's activation buffers), not of the MoE work. Net of it, the scheduler costs "
            f"at most {100 * worst_net['scheduler_net_share']:.2f}% of the layer ({worst_net['domain']}, "
            f"{worst_net['config']}: {worst_net['scheduler_net_ms']:.3f} ms). Its own work is small: on one "
            "core, `apply` for 1024 tokens, 16 experts, top-2 takes ~0.025 ms (drop), ~0.08 ms (reroute), "
            "~0.1 ms (expanded, mostly the fallback-expert scan of the reroute), measured "
            "alone with a size-1 communicator; in global scope each selection adds one count allreduce and "
            "one 256-bucket histogram allreduce per key byte until every full bin's threshold is exact "
            "(typically 2-4 rounds), each a few tens of microseconds between two ranks on one machine.",
            "",
            "Under oversubscription (other jobs on the same two cores) those sequential small collectives "
            "are the weak point: each waits for the peer rank to be scheduled, and development runs on the "
            "loaded machine saw 15-30 ms of scheduler time per tiny layer. Folding the count allreduce into "
            "the first histogram round (counts and the top-byte histograms of all bins in one allreduce) "
            "would save one round trip per selection with identical results; it is not done here.",
            "",
        ]
    out += [
        "**Both parts.** The two ranks share the machine's 2 cores and busy-poll in MPI while waiting, so "
        "any other process steals time from one rank and shows up as skew; the driver waits for idle cores "
        "before each run and records the load. Medians of interleaved repetitions absorb most of it, but "
        "differences of a few percent between configurations with the same ideal ratio (e.g. the no-op "
        "device rows) are noise.",
        "",
    ]
    return "\n".join(out)


def load_text(m):
    la = m["loadavg_start_end"]
    return (f"cores {100 * m['cores_busy_before']:.0f}% busy before the run, {100 * m['cores_busy_during']:.0f}% "
            f"during it (the ranks themselves account for up to {100 * m['ranks'] / os.cpu_count():.0f}%), "
            f"load average {la[0]:.1f} at start, {la[1]:.1f} at end")


def render(synth, model, notes, png="bench_moe_layer.png"):
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = ["# MoE layer speed vs capacity factor", ""]
    lines += [f"{date}, {cpu_name()}, {os.cpu_count()} cores. Generated by `tools/bench/bench_moe_layer.py`; "
              "every configuration runs side by side in one MPI job, interleaved round-robin across "
              "repetitions, median of the repetitions.", ""]
    lines += ["Columns: *layer ms* = the slowest rank's scheduler + dispatch + expert + combine time per MoE "
              "layer call (median); the phase columns are each the slowest rank's; *measured speedup* = "
              "t(inf) / t(config); *ideal ratio* = largest rank load under gamma = inf / under the config "
              "(rank load = (token, expert) assignments its experts compute), summed over the layer calls; "
              "*scheduler share* = scheduler ms / layer ms; *dropped* / *rerouted* = share of the "
              "assignments. Rows 'all' pool the domains: ratios from the sums of the domains' medians and loads, "
              "times as means per layer call. Capacity scope "
              "global, score gate, contiguous placement. ✗ marks measured / ideal < "
              f"{GOAL_EFFICIENCY} where the ideal ratio is >= {MIN_IDEAL_FOR_GOAL}.", ""]
    lines += ["## Goal status", ""]
    for name, doc in (("(b) synthetic layer", synth), ("(a) default model", model)):
        if doc:
            lines += ["- " + x for x in summary_lines(name, doc)]
    lines.append("")
    if synth:
        m = synth["meta"]
        lines += ["## (b) Synthetic layer: OLMoE routing", "",
                  f"{m['experts']} experts top-{m['top_k']}, hidden {m['hidden']}, expert FFN {m['expert_ffn']}, "
                  f"bf16 random weights (each rank allocates only its own experts), {m['ranks']} ranks x "
                  f"{m['threads_per_rank']} thread, {m['tokens_per_rank']} tokens per rank per step "
                  f"({m['ranks'] * m['tokens_per_rank']} per step, mean {m['ranks'] * m['tokens_per_rank'] * m['top_k'] // m['experts']} rows per expert: a prefill-sized burst "
                  "in which even the experts capped at gamma = 1 stay above the CPU backend's 32-row switch to "
                  "its sgemm path, and short enough for every configuration x domain x repetition in one run). "
                  f"One step = one domain burst = one layer call per count layer ({', '.join(m['count_layers'])}) "
                  f"of `{Path(m['counts_file']).name}` ({m['counts_model']}), routing drawn with exactly the "
                  f"real per-expert inclusion probabilities. {m['reps']} repetitions after {m['warmup']} warm-up "
                  f"pass; run took {m['wall_s']:.0f} s; {load_text(m)}. "
                  f"Command: `{m['command']}`.", "",
                  "Every step starts after a barrier. *sched share, fastest rank*: the scheduler time of the "
                  "rank that spent least in it (the other one also waits in the first allreduce for its peer). "
                  "*kernel-model speedup*: what the grouped expert FFN alone predicts, from its cost per expert "
                  "against row count measured in the same run (below) and each configuration's per-expert "
                  "loads (rank time = sum of its experts' costs, layer = slowest rank); *kernel-model / ideal* "
                  "isolates the kernel's per-expert fixed cost and row-count-dependent efficiency.", "",
                  "### All domains pooled", ""]
        lines += table([r for r in synth["results"] if r["domain"] == "all"])
        lines += ["", "### Per domain", ""]
        lines += table([r for r in synth["results"] if r["domain"] != "all"])
        lines.append("")
        cost = m.get("expert_cost", [])
        if cost:
            lines += ["### Grouped expert FFN: cost of one expert against its rows (rank 0 alone, best of 3)", "",
                      "| rows | ms per expert | ms per row | GFLOP/s |", "|---:|---:|---:|---:|"]
            flop_per_row = 6 * m["hidden"] * m["expert_ffn"]
            for c in cost:
                lines.append(f"| {c['rows']} | {c['ms']:.3f} | {c['ms'] / c['rows']:.4f} "
                             f"| {flop_per_row * c['rows'] / (c['ms'] * 1e6):.1f} |")
            lines.append("")
    if model:
        m = model["meta"]
        lines += ["## (a) Default model on corpus bursts", "",
                  f"`{m['model']}` ({m['experts']} experts top-{m['top_k']}, hidden {m['hidden']}, "
                  f"{int(m['moe_layers'])} MoE layers), {m['ranks']} ranks x {m['threads_per_rank']} thread; one "
                  f"step = one prefill of {m['windows_per_rank']} windows x {m['window_tokens']} tokens per rank "
                  f"({m['ranks'] * m['tokens_per_rank']} tokens) of one domain's held-out text. MoE time from "
                  "`Engine::last_moe_stats()` (each phase the slowest rank's), per MoE layer; *step ms* is the "
                  f"whole forward step (slowest rank). The model's communicator is wrapped to time every "
                  "collective and to read each rank's own phase times: *arrival wait* is the time (slowest "
                  "rank) spent in the first collective of each MoE layer, i.e. waiting for the other rank to "
                  "finish attention and routing; with capacity on that collective is the scheduler's count "
                  "allreduce, so the scheduler's measured time contains it (with capacity off the dispatcher's "
                  "first exchange does). *sched net* = each rank's scheduler time less the wait in it, slowest "
                  "rank; *layer ms net of arrival wait* = each rank's own MoE time (sum of its phases) less its "
                  "arrival waits, slowest rank; the speedup and its ratio to the ideal on that basis follow. *layer ms* "
                  "as the issue defines it (the sum of each phase's slowest rank) counts the imbalance between the "
                  "ranks twice, once in the slow rank's expert phase and once in the fast rank's combine, where it "
                  "waits for the slow one: it overstates the layer when the ranks are imbalanced (gamma = inf most "
                  "of all), which is why some measured speedups on that basis exceed the ideal; *layer ms, "
                  "slowest rank's own sum* is the largest per-rank sum of phases. "
                  f"{m['reps']} repetitions after {m['warmup']} warm-up pass; "
                  f"run took {m['wall_s']:.0f} s; {load_text(m)}. Command: `{m['command']}`.", "",
                  "### All domains pooled", ""]
        lines += table([r for r in model["results"] if r["domain"] == "all"], with_step=True)
        lines += ["", "### Per domain", ""]
        lines += table([r for r in model["results"] if r["domain"] != "all"], with_step=True)
        lines.append("")
    lines += [notes.rstrip(), ""]
    lines += [f"![speedup vs gamma]({png})", ""]
    return "\n".join(lines)


# --baseline-bin: the same run of two builds, interleaved, compared configuration by configuration.
COMPARE_FIELDS = {
    "synthetic": ["layer_ms", "scheduler_ms", "dispatch_ms", "expert_ms", "combine_ms"],
    "model": ["layer_ms", "layer_rank_ms", "scheduler_ms", "dispatch_ms", "expert_ms", "combine_ms", "step_ms"],
}
SAME_WORK_FIELDS = ["assignments", "dropped_fraction", "rerouted_fraction", "max_rank_load_sum"]
REGRESSION_TOLERANCE = 0.03  # a ratio after / before above 1 + this is a regression


def run_interleaved(args, mode, extra, reps):
    """Runs `mode` of the baseline build and of args.bin alternately, one repetition (--reps 1, with the
    binary's own warm-up) per process: repetition r runs before then after when r is even, after then before
    when it is odd. Returns {"before": [docs], "after": [docs]}."""
    docs = {"before": [], "after": []}
    order = [("before", args.baseline_bin), ("after", args.bin)]
    for rep in range(reps):
        log(f"{mode}: repetition {rep + 1}/{reps}")
        for side, binary in (order if rep % 2 == 0 else order[::-1]):
            doc = run_bench(args, mode, ["--reps", "1"] + extra, binary)
            doc["meta"]["side"] = side
            doc["meta"]["repetition"] = rep
            docs[side].append(doc)
    return docs


def merge_side(docs, fields):
    """Median over the processes of each (domain, config) row's fields; rows 'all' = mean over the domains of
    those medians (the binary's own pooling: times as means per layer call). Returns {(domain, config): row}."""
    import statistics

    rows = {}
    for r in docs[0]["results"]:
        if r["domain"] == "all":
            continue
        key = (r["domain"], r["config"])
        found = [next(x for x in d["results"] if (x["domain"], x["config"]) == key) for d in docs]
        row = {"domain": r["domain"], "config": r["config"]}
        for f in fields:
            row[f] = statistics.median(x[f] for x in found)
            row[f + "_runs"] = [x[f] for x in found]
        for f in SAME_WORK_FIELDS:
            row[f] = r[f]
        rows[key] = row
    domains = list(dict.fromkeys(k[0] for k in rows))
    for c in dict.fromkeys(k[1] for k in rows):
        per = [rows[(d, c)] for d in domains]
        row = {"domain": "all", "config": c}
        for f in fields:
            row[f] = sum(x[f] for x in per) / len(per)
        row["assignments"] = sum(x["assignments"] for x in per)
        row["max_rank_load_sum"] = sum(x["max_rank_load_sum"] for x in per)
        for f in ("dropped_fraction", "rerouted_fraction"):
            row[f] = sum(x[f] * x["assignments"] for x in per) / row["assignments"]
        rows[("all", c)] = row
    return rows


def compare(mode, docs):
    """Rows of before, after and after / before per (domain, config), pooled rows first."""
    fields = COMPARE_FIELDS[mode]
    before, after = merge_side(docs["before"], fields), merge_side(docs["after"], fields)
    out = []
    for key in sorted(after, key=lambda k: (k[0] != "all", k[0])):  # stable: config order within a domain
        if key not in before:
            continue
        b, a = before[key], after[key]
        row = {"domain": key[0], "config": key[1]}
        for f in fields:
            row[f] = {"before": b[f], "after": a[f], "ratio": a[f] / b[f] if b[f] else None}
            if f + "_runs" in a:
                row[f]["before_runs"], row[f]["after_runs"] = b[f + "_runs"], a[f + "_runs"]
        # Both builds should route and cap identically (same seed, same data): flag any difference.
        row["same_work"] = all(abs(a[f] - b[f]) <= 1e-9 * max(1.0, abs(b[f])) for f in SAME_WORK_FIELDS)
        row["dropped_fraction"] = a["dropped_fraction"]
        out.append(row)
    return out


def compare_table(rows, fields):
    names = {"layer_ms": "layer", "layer_rank_ms": "layer, slowest rank's own sum", "scheduler_ms": "sched",
             "dispatch_ms": "dispatch", "expert_ms": "expert", "combine_ms": "combine", "step_ms": "step"}
    main = fields[:2] if fields[1] == "layer_rank_ms" else fields[:1]
    extra = [f for f in fields if f == "step_ms"]
    head = "| domain | config |"
    sep = "|---|---|"
    for f in main + extra:
        head += f" {names[f]} ms before | {names[f]} ms after | {names[f]} after / before |"
        sep += "---:|---:|---:|"
    phases = [f for f in fields if f not in main + extra]
    head += "".join(f" {names[f]} after / before |" for f in phases) + " same work |"
    sep += "---:|" * len(phases) + "---|"
    lines = [head, sep]
    for r in rows:
        line = f"| {r['domain']} | {r['config']} |"
        for f in main + extra:
            q = r[f]["ratio"]
            mark = " ✗" if q is not None and q > 1 + REGRESSION_TOLERANCE else ""
            line += f" {r[f]['before']:.2f} | {r[f]['after']:.2f} | {fmt_ratio(q)}{mark} |"
        line += "".join(f" {fmt_ratio(r[f]['ratio'])} |" for f in phases)
        line += " yes |" if r["same_work"] else " **no** |"
        lines.append(line)
    return lines


def fmt_ratio(q):
    return "n/a" if q is None else f"{q:.3f}"


def compare_summary(name, rows, field="layer_ms"):
    worst = max(rows, key=lambda r: r[field]["ratio"] or 0)
    pooled = [r for r in rows if r["domain"] == "all"]
    worst_pooled = max(pooled, key=lambda r: r[field]["ratio"] or 0)
    over = [r for r in rows if (r[field]["ratio"] or 0) > 1 + REGRESSION_TOLERANCE]
    mean_pooled = sum(r[field]["ratio"] for r in pooled) / len(pooled)
    text = (f"**{name}**, {field} after / before: pooled rows {min(r[field]['ratio'] for r in pooled):.3f} to "
            f"{worst_pooled[field]['ratio']:.3f} (mean {mean_pooled:.3f}, worst {worst_pooled['config']}); "
            f"all rows worst {worst[field]['ratio']:.3f} ({worst['domain']}, {worst['config']}); "
            f"{len(over)} of {len(rows)} rows worse than {1 + REGRESSION_TOLERANCE:.2f}")
    if any(not r["same_work"] for r in rows):
        text += f"; {sum(not r['same_work'] for r in rows)} rows route or cap differently between the builds"
    return text + "."


def render_compare(results, args):
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = ["# MoE layer: before / after", "",
             f"{date}, {cpu_name()}, {os.cpu_count()} cores. Generated by `tools/bench/bench_moe_layer.py "
             "--baseline-bin`: *before* = `" + str(args.baseline_bin) + "`, *after* = `" + str(args.bin) + "`. "
             "Each repetition runs both builds as separate MPI jobs with the same arguments and `--reps 1` "
             "(after the binary's own warm-up), before first in even repetitions and after first in odd ones; "
             "per (domain, config) the median over the repetitions, rows 'all' the mean over the domains of "
             "those medians (per layer call). Times as in `bench_moe_layer.md`: *layer* = the slowest rank's "
             "scheduler + dispatch + expert + combine per MoE layer call; the phase ratios are each the slowest "
             "rank's. A ratio after / before > 1 is slower; ✗ marks > "
             f"{1 + REGRESSION_TOLERANCE:.2f}. *same work*: both builds computed the same assignments, drops, "
             "reroutes and rank loads.", "", "## Summary", ""]
    for mode, name in (("synthetic", "(b) synthetic layer"), ("model", "(a) default model")):
        if mode in results:
            lines.append("- " + compare_summary(name, results[mode]["rows"]))
            if mode == "model":
                lines.append("- " + compare_summary(name, results[mode]["rows"], "layer_rank_ms"))
                lines.append("- " + compare_summary(name, results[mode]["rows"], "step_ms"))
    lines.append("")
    for mode, title in (("synthetic", "(b) Synthetic layer: OLMoE routing"), ("model", "(a) Default model on corpus bursts")):
        if mode not in results:
            continue
        res = results[mode]
        rows = res["rows"]
        lines += [f"## {title}", "", f"{res['reps']} repetitions per build; run took {res['wall_s']:.0f} s; "
                  f"command per process: `{res['command']}`; cores busy with other work before the runs: "
                  f"{res['busy_before']}.", "", "### All domains pooled", ""]
        lines += compare_table([r for r in rows if r["domain"] == "all"], COMPARE_FIELDS[mode])
        lines += ["", "### Per domain", ""]
        lines += compare_table([r for r in rows if r["domain"] != "all"], COMPARE_FIELDS[mode])
        lines.append("")
    return "\n".join(lines)


def plot_compare(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in ("synthetic", "model") if m in results]
    fig, axes = plt.subplots(1, len(modes), figsize=(8 * len(modes), 5.5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        rows = [r for r in results[mode]["rows"] if r["domain"] == "all"]
        xs = range(len(rows))
        ax.bar(xs, [r["layer_ms"]["ratio"] for r in rows], color="tab:blue")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(1 + REGRESSION_TOLERANCE, color="tab:red", ls="--", lw=0.8,
                   label=f"{1 + REGRESSION_TOLERANCE:.2f}")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([r["config"] for r in rows], rotation=70, ha="right", fontsize=7)
        lo = min(r["layer_ms"]["ratio"] for r in rows)
        hi = max(r["layer_ms"]["ratio"] for r in rows)
        ax.set_ylim(min(lo, 0.95) - 0.02, max(hi, 1.05) + 0.02)
        ax.set_ylabel("layer time after / before")
        ax.set_title(f"{mode}: all domains pooled", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main_compare(args):
    if not args.baseline_bin.is_file():
        sys.exit(f"{args.baseline_bin} not found: build the baseline's capserve-bench-moe-layer first")
    results = {}
    plan = []
    if not args.skip_synthetic:
        plan.append(("synthetic", ["--tokens", str(args.tokens)] + args.synthetic_args.split(), args.reps))
    if not args.skip_model:
        plan.append(("model", args.model_args.split(), args.model_reps or args.reps))
    for mode, extra, reps in plan:
        start = time.monotonic()
        docs = run_interleaved(args, mode, extra, reps)
        some = docs["after"][0]["meta"]
        results[mode] = {
            "reps": reps, "wall_s": time.monotonic() - start,
            "command": some["command"],
            "busy_before": ", ".join(f"{100 * d['meta']['cores_busy_before']:.0f}%"
                                     for side in ("before", "after") for d in docs[side]),
            "rows": compare(mode, docs),
            # Each process's own medians (one repetition each), without the per-expert loads.
            "processes": {side: [{"meta": {k: v for k, v in d["meta"].items() if k != "expert_cost"},
                                  "expert_cost": d["meta"].get("expert_cost", []),
                                  "results": [{k: v for k, v in r.items() if k != "expert_load"}
                                              for r in d["results"]]} for d in docs[side]]
                          for side in docs},
        }
    md = render_compare(results, args)
    print(md)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_stem
    (args.out_dir / f"{stem}.md").write_text(md)
    (args.out_dir / f"{stem}.json").write_text(json.dumps(
        {"before_bin": str(args.baseline_bin), "after_bin": str(args.bin), **results}, indent=1) + "\n")
    plot_compare(results, args.out_dir / f"{stem}.png")
    log(f"wrote {args.out_dir / stem}.md, .json, .png")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", type=Path, default=ROOT / "build" / "tools" / "capserve-bench-moe-layer")
    ap.add_argument("--baseline-bin", type=Path,
                    help="capserve-bench-moe-layer of another build (e.g. the previous commit): run both "
                         "interleaved and write a before / after table instead of the gamma report")
    ap.add_argument("--out-stem", default="bench_moe_layer", help="file name of the .json, .md and .png results")
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--model-reps", type=int, help="repetitions of the model run (default --reps)")
    ap.add_argument("--tokens", type=int, default=512, help="synthetic: tokens per rank per step")
    ap.add_argument("--synthetic-args", default="", help="extra flags for the synthetic run")
    ap.add_argument("--model-args", default="", help="extra flags for the model run")
    ap.add_argument("--skip-synthetic", action="store_true")
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--max-idle-wait", type=float, default=300,
                    help="seconds to wait before each run for other load on the cores to stop")
    ap.add_argument("--notes", type=Path, help="markdown file with the notes section (default: built in)")
    ap.add_argument("--from-json", type=Path,
                    help="re-render the table and plot from a bench_moe_layer.json instead of measuring")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "tools" / "results")
    args = ap.parse_args()

    if args.baseline_bin and not args.from_json:
        if not args.bin.is_file():
            sys.exit(f"{args.bin} not found: build capserve-bench-moe-layer first")
        main_compare(args)
        return
    synth = model = None
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        synth, model = saved["synthetic"], saved["model"]
        if synth:
            add_cost_model(synth)

    elif not args.bin.is_file():
        sys.exit(f"{args.bin} not found: build capserve-bench-moe-layer first")
    if not args.from_json and not args.skip_synthetic:
        synth = run_bench(args, "synthetic", ["--tokens", str(args.tokens), "--reps", str(args.reps)]
                          + args.synthetic_args.split())
        add_cost_model(synth)
    if not args.from_json and not args.skip_model:
        model = run_bench(args, "model", ["--reps", str(args.model_reps or args.reps)] + args.model_args.split())
    text = args.notes.read_text() if args.notes else notes(synth, model)
    md = render(synth, model, text, png=f"{args.out_stem}.png")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.out_stem}.md").write_text(md)
    (args.out_dir / f"{args.out_stem}.json").write_text(
        json.dumps({"synthetic": synth, "model": model}, indent=1) + "\n")
    docs = [(n, d) for n, d in (("(b) synthetic: OLMoE routing", synth), ("(a) default model", model)) if d]
    plot(docs, args.out_dir / f"{args.out_stem}.png")
    for name, doc in docs:
        for line in summary_lines(name, doc):
            print(line)
    log(f"wrote {args.out_dir / args.out_stem}.md, .json, .png")


if __name__ == "__main__":
    main()
