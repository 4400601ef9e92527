#!/usr/bin/env python3
"""CPU runtime benchmark: CapServe vs llama.cpp vs HF transformers, side by side.

Model: the random mid-size Mixtral of make_bench_model.py (hidden 1024, 8 layers,
16 experts top-2, expert FFN 1408, bf16 safetensors). For each batch size
(default 1 and 16) every contender runs as its own subprocess, contenders
interleaved, --reps times; the best prefill and best decode tok/s of each are
kept, with the largest peak RSS (ru_maxrss of the subprocess, from wait4).

Contenders (each prints one JSON line with prefill_tok_s / decode_tok_s):
  capserve     --capserve-bin (default build/tools/capserve-bench-runtime)
               --model DIR --batch B --prompt-len P --decode-steps D --threads T [--device cuda]
  llama.cpp    llama_cpp_runner.py in tools/.venv-llama on the BF16 GGUF
               (--llama-f32 adds a row on the F32 GGUF)
  transformers hf_runner.py in this interpreter (f32 compute, eager); may be
               given fewer decode steps (--hf-decode-steps); rates are per token.
A missing contender is skipped with a message. Setup done here when missing:
the checkpoint (tools/.cache/bench_model) and the GGUF files
(tools/.cache/bench_gguf, via llama.cpp's convert_hf_to_gguf.py from the sdist
that setup_llama_cpp.sh unpacks).

Prints a table with ratios capserve/llama.cpp and capserve/transformers and writes
tools/results/bench_cpu_runtime.json and .md. Other load on the machine skews
the numbers: before each run the driver waits (up to --max-idle-wait seconds)
for the cores to be idle, measures how much of the cores other processes used
during the run, and takes the best only over undisturbed runs (other load
< 10%) when there are any; the table counts them.

Run (main venv; llama.cpp side built once by `bash tools/bench/setup_llama_cpp.sh`):
    tools/.venv/bin/python tools/bench/bench_cpu_runtime.py
A change against the previous commit (built side by side, e.g. in a git worktree), in one run:
    tools/.venv/bin/python tools/bench/bench_cpu_runtime.py --no-hf --llama-python /nonexistent \
        --baseline-bin ../prev/build/tools/capserve-bench-runtime --out-stem bench_cpu_runtime_change
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
BENCH = ROOT / "tools" / "bench"
CACHE = ROOT / "tools" / ".cache"
CLEAN_LOAD = 0.10  # a run during which other processes used more of the cores is "disturbed"








def run_measured(cmd):
    """Run cmd; return (returncode, stdout, stderr, peak RSS MB of that process,
    share of the cores' time that other processes used while it ran)."""
    tick = os.sysconf("SC_CLK_TCK")
    t0, i0 = cpu_jiffies()
    start = time.monotonic()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - start
        t1, i1 = cpu_jiffies()
        busy_s = ((t1 - t0) - (i1 - i0)) / tick
        others = max(busy_s - usage.ru_utime - usage.ru_stime, 0.0) / (wall * os.cpu_count())
        out.seek(0)
        err.seek(0)
        return (proc.returncode, out.read().decode(errors="replace"),
                err.read().decode(errors="replace"), usage.ru_maxrss / 1024, others)




def ensure_model(model_dir):
    if (model_dir / "model.safetensors").is_file():
        return
    log(f"creating bench model in {model_dir}")
    subprocess.run([sys.executable, str(BENCH / "make_bench_model.py"), "--out", str(model_dir)],
                   check=True, cwd=ROOT)


def llama_src():
    """vendor/llama.cpp of the newest unpacked llama-cpp-python sdist, or None."""
    found = sorted(CACHE.glob("llama-sdist/llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    return found[-1].parent if found else None


def ensure_gguf(model_dir, gguf, outtype):
    if gguf.is_file():
        return True
    src = llama_src()
    if src is None:
        log(f"no convert_hf_to_gguf.py under {CACHE / 'llama-sdist'}: run tools/bench/setup_llama_cpp.sh")
        return False
    log(f"converting {model_dir} to {gguf} ({outtype})")
    gguf.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"))
    subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(model_dir),
                    "--outtype", outtype, "--outfile", str(gguf)],
                   check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    return True


def contenders(args):
    """[(label, argv prefix without the shape flags, decode steps)], skipping missing ones."""
    shape = ["--prompt-len", str(args.prompt_len), "--threads", str(args.threads)]
    found = []
    if args.capserve_bin.is_file():
        # --device only when asked: a baseline build may predate the flag.
        device = [] if args.device == "cpu" else ["--device", args.device]
        found.append(("capserve", [str(args.capserve_bin), "--model", str(args.model_dir)] + shape + device,
                      args.decode_steps))
    else:
        log(f"SKIP capserve: {args.capserve_bin} not found (build the C++ tree first)")
    if args.baseline_bin:
        # Another build of CapServe (e.g. the previous commit), side by side: the ratio capserve/capserve-baseline
        # is the change's effect.
        if args.baseline_bin.is_file():
            found.append(("capserve-baseline", [str(args.baseline_bin), "--model", str(args.model_dir)] + shape,
                          args.decode_steps))
        else:
            log(f"SKIP capserve-baseline: {args.baseline_bin} not found")
    if not args.llama_python.is_file():
        log(f"SKIP llama.cpp: {args.llama_python} not found (run tools/bench/setup_llama_cpp.sh)")
    else:
        ggufs = [("llama.cpp", "bf16")] + ([("llama.cpp-f32", "f32")] if args.llama_f32 else [])
        for label, outtype in ggufs:
            gguf = args.gguf_dir / f"bench-{outtype}.gguf"
            if ensure_gguf(args.model_dir, gguf, outtype):
                found.append((label, [str(args.llama_python), str(BENCH / "llama_cpp_runner.py"),
                                      "--gguf", str(gguf)] + shape, args.decode_steps))
    if not args.no_hf:
        found.append(("transformers", [sys.executable, str(BENCH / "hf_runner.py"),
                                       "--model", str(args.model_dir)] + shape,
                      args.hf_decode_steps or args.decode_steps))
    return found


def measure(label, argv, batch, steps, max_wait_s):
    busy = wait_for_idle(max_wait_s)
    rc, out, err, rss, others = run_measured(argv + ["--batch", str(batch), "--decode-steps", str(steps)])
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if rc != 0 or not lines:
        log(f"FAIL {label} batch {batch} (rc {rc}):\n{err[-2000:]}")
        return None
    rep = json.loads(lines[-1])
    rep.update(label=label, wait4_peak_rss_mb=rss, cpu_busy_before=busy, other_load_during=others)
    log(f"  {label:14s} b={batch:<3d} prefill {rep['prefill_tok_s']:9.1f} tok/s  "
        f"decode {rep['decode_tok_s']:8.2f} tok/s  rss {rss:7.0f} MB  "
        f"(cores busy with other work: {busy:.0%} before, {others:.0%} during)")
    return rep


def best_of(runs):
    """Best rates over the runs that other work did not disturb (all runs if none)."""
    clean = [r for r in runs if r["other_load_during"] < CLEAN_LOAD] or runs
    return {
        "prefill_tok_s": max(r["prefill_tok_s"] for r in clean),
        "decode_tok_s": max(r["decode_tok_s"] for r in clean),
        "peak_rss_mb": max(r["wait4_peak_rss_mb"] for r in runs),
        "decode_steps": runs[0]["decode_steps"],
        "undisturbed_runs": sum(r["other_load_during"] < CLEAN_LOAD for r in runs),
        "notes": runs[0].get("notes", ""),
    }


def cpu_name():
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def ratio(a, b):
    return a / b if a and b else None


def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def render(results, ratios, meta):
    lines = [
        "# CPU runtime benchmark",
        "",
        f"{meta['date']}, {meta['cpu']}, {meta['threads']} threads, prompt {meta['prompt_len']} tokens, "
        f"best of {meta['reps']} runs. Model: {meta['model']}.",
        "",
        "| engine | batch | prefill tok/s | decode tok/s | decode steps | peak RSS MB | undisturbed runs |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(f"| {r['label']} | {r['batch']} | {r['prefill_tok_s']:.1f} | {r['decode_tok_s']:.2f} "
                     f"| {r['decode_steps']} | {r['peak_rss_mb']:.0f} | {r['undisturbed_runs']}/{meta['reps']} |")
    lines += ["", "| ratio | batch | prefill | decode | peak RSS |", "|---|---:|---:|---:|---:|"]
    for q in ratios:
        lines.append(f"| {q['ratio']} | {q['batch']} | {fmt(q['prefill'], '.2f')} | "
                     f"{fmt(q['decode'], '.2f')} | {fmt(q['peak_rss'], '.2f')} |")
    if not ratios:
        lines.append("| (no capserve result) | | | | |")
    lines += ["", "Notes:"] + [f"- {r['label']}: {r['notes']}" for r in results
                               if r["batch"] == meta["batches"][0] and r["notes"]]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capserve-bin", type=Path, default=ROOT / "build" / "tools" / "capserve-bench-runtime")
    ap.add_argument("--baseline-bin", type=Path,
                    help="capserve-bench-runtime of another build (e.g. the previous commit) to run side by side")
    ap.add_argument("--out-stem", default="bench_cpu_runtime", help="file name of the .json and .md results")
    ap.add_argument("--model-dir", type=Path, default=CACHE / "bench_model")
    ap.add_argument("--gguf-dir", type=Path, default=CACHE / "bench_gguf")
    ap.add_argument("--llama-python", type=Path, default=ROOT / "tools" / ".venv-llama" / "bin" / "python")
    ap.add_argument("--llama-f32", action="store_true", help="also run llama.cpp on an F32 GGUF")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers contender")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--hf-decode-steps", type=int,
                    help="decode steps for transformers (default: --decode-steps)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where CapServe computes (capserve-bench-runtime --device); the others stay on the CPU")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-idle-wait", type=float, default=120,
                    help="seconds to wait before each run for other load on the cores to stop")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "tools" / "results")
    args = ap.parse_args()

    ensure_model(args.model_dir)
    engines = contenders(args)
    runs = {}
    for batch in args.batches:
        for rep in range(args.reps):
            log(f"batch {batch}, repetition {rep + 1}/{args.reps}")
            for label, argv, steps in engines:
                r = measure(label, argv, batch, steps, args.max_idle_wait)
                if r:
                    runs.setdefault((label, batch), []).append(r)

    results = [dict(label=label, batch=batch, **best_of(rs)) for (label, batch), rs in runs.items()]
    by_key = {(r["label"], r["batch"]): r for r in results}
    ratios = []
    for batch in args.batches:
        cap = by_key.get(("capserve", batch))
        for label, _, _ in engines:
            other = by_key.get((label, batch))
            if cap and other and label != "capserve":
                ratios.append({"ratio": f"capserve/{label}", "batch": batch,
                               "prefill": ratio(cap["prefill_tok_s"], other["prefill_tok_s"]),
                               "decode": ratio(cap["decode_tok_s"], other["decode_tok_s"]),
                               "peak_rss": ratio(cap["peak_rss_mb"], other["peak_rss_mb"])})

    cfg = json.loads((args.model_dir / "config.json").read_text())
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": f"{cpu_name()}, {os.cpu_count()} cores",
        "model": (f"Mixtral random, hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
                  f"{cfg['num_local_experts']} experts top-{cfg['num_experts_per_tok']}, "
                  f"expert FFN {cfg['intermediate_size']}, vocab {cfg['vocab_size']}, bf16 file"),
        "threads": args.threads, "prompt_len": args.prompt_len, "decode_steps": args.decode_steps,
        "reps": args.reps, "batches": args.batches,
    }
    md = render(results, ratios, meta)
    print(md)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.out_stem}.json").write_text(json.dumps(
        {"meta": meta, "results": results, "ratios": ratios,
         "runs": [r for rs in runs.values() for r in rs]}, indent=2) + "\n")
    (args.out_dir / f"{args.out_stem}.md").write_text(md)
    log(f"wrote {args.out_dir / (args.out_stem + '.json')} and .md")


if __name__ == "__main__":
    main()
