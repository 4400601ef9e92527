#!/usr/bin/env python3
"""Single-thread encode throughput, CapServe tokenizer vs Hugging Face `tokenizers` (Rust), side by side.

    tools/.venv/bin/python tools/bench/bench_tokenizer.py [--build build] [--repeats 3] [--out FILE]

For each tokenizer in ../shared/data/tokenizers/ and each corpus file in ../shared/data/corpus/ (one document
per line, no special tokens), both encode every line; the fastest of --repeats timed passes (after one warm-up
pass) counts. HF runs with its parallelism off (TOKENIZERS_PARALLELISM=false, RAYON_NUM_THREADS=1), through
encode_batch_fast (no offsets, as CapServe computes none) on the list of lines, so Python's per-call cost is
not counted against it. Both must produce the same number of tokens. Writes a Markdown table to
tools/results/bench_tokenizer.md.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["RAYON_NUM_THREADS"] = "1"

import tokenizers  # noqa: E402  (after the environment that configures it)

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data"
TOKENIZERS = ["qwen3", "deepseek_v3", "llama2"]
DOMAINS = ["arxiv", "books", "web", "code", "wikipedia"]


def hf_run(directory, path, repeats):
    tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    lines = path.read_bytes().decode("utf-8").split("\n")  # keep \r as it is
    if lines and lines[-1] == "":
        lines.pop()
    size = sum(len(line.encode("utf-8")) for line in lines)
    best = float("inf")
    tokens = 0
    for attempt in range(repeats + 1):
        start = time.perf_counter()
        encodings = tok.encode_batch_fast(lines, add_special_tokens=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(e.ids) for e in encodings)
        if attempt > 0:
            best = min(best, elapsed)
    return {"bytes": size, "tokens": tokens, "seconds": best, "mb_per_s": size / best / 1e6}


def capserve_run(binary, directory, paths, repeats):
    out = subprocess.run([str(binary), "--tokenizer", str(directory), "--repeats", str(repeats)] +
                         [str(p) for p in paths], check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines()]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=str(REPO / "build"), help="CMake build directory")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "tools" / "results" / "bench_tokenizer.md"))
    args = parser.parse_args()
    binary = Path(args.build) / "runtime" / "tokenizer" / "capserve-bench-tokenizer"
    if not binary.exists():
        sys.exit(f"{binary} is missing: build it with ninja -C {args.build} capserve-bench-tokenizer")
    paths = [SHARED / "corpus" / f"{d}.txt" for d in DOMAINS]

    rows = []
    summary = []
    for name in TOKENIZERS:
        directory = SHARED / "tokenizers" / name
        ours = capserve_run(binary, directory, paths, args.repeats)
        total = {"ours_s": 0.0, "hf_s": 0.0, "bytes": 0}
        for domain, path, mine in zip(DOMAINS, paths, ours):
            hf = hf_run(directory, path, args.repeats)
            if hf["tokens"] != mine["tokens"]:
                sys.exit(f"{name}/{domain}: token counts differ (HF {hf['tokens']}, CapServe {mine['tokens']})")
            ratio = mine["mb_per_s"] / hf["mb_per_s"]
            rows.append(f"| {name} | {domain} | {mine['bytes'] / 1e6:.2f} | {mine['tokens']} | "
                        f"{mine['mb_per_s']:.1f} | {hf['mb_per_s']:.1f} | {ratio:.2f}x |")
            print(rows[-1], flush=True)
            total["ours_s"] += mine["seconds"]
            total["hf_s"] += hf["seconds"]
            total["bytes"] += mine["bytes"]
        ours_mbs = total["bytes"] / total["ours_s"] / 1e6
        hf_mbs = total["bytes"] / total["hf_s"] / 1e6
        summary.append(f"| {name} | {ours_mbs:.1f} | {hf_mbs:.1f} | {ours_mbs / hf_mbs:.2f}x | "
                       f"{ours[0]['load_s']:.2f} |")
        print(summary[-1], flush=True)

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    text = "\n".join([
        "# Tokenizer encode throughput: CapServe vs Hugging Face tokenizers",
        "",
        f"Single thread, one document per line of `../shared/data/corpus/*.txt`, no special tokens; fastest of "
        f"{args.repeats} passes after a warm-up pass. HF `tokenizers` {tokenizers.__version__} (Rust) through "
        "`encode_batch_fast` with parallelism off. Same token counts from both. Machine: "
        f"{cpu}, shared with other jobs (expect a few percent of noise). Produced by "
        "`tools/bench/bench_tokenizer.py`.",
        "",
        "## All five corpora",
        "",
        "| tokenizer | CapServe MB/s | HF MB/s | ratio | CapServe load s |",
        "|---|---:|---:|---:|---:|",
        *summary,
        "",
        "## Per corpus",
        "",
        "| tokenizer | corpus | MB | tokens | CapServe MB/s | HF MB/s | ratio |",
        "|---|---|---:|---:|---:|---:|---:|",
        *rows,
        "",
    ])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
