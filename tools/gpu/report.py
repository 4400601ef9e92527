"""Joins capserve-bench-kernels' rows with torch_peer.py's into one markdown table: each row's time, its bound
and the ratio to it, PyTorch's time and capserve's time over PyTorch's (over 1: PyTorch is faster).

    python3 tools/gpu/report.py capserve.jsonl [torch.jsonl] > kernels.md
"""

import json
import sys


def rows(path):
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def main():
    ours = rows(sys.argv[1])
    peer = {r["name"]: r for r in rows(sys.argv[2])} if len(sys.argv) > 2 else {}
    device = ours[0]["device"] if ours else "?"
    print(f"Kernel benchmark on {device}: capserve's CUDA backend, its bound (bytes at the measured copy bandwidth"
          " or FLOPs at the measured bf16 GEMM rate), and the same operation through PyTorch.\n")
    print("| row | shape | capserve ms | bound ms | capserve / bound | torch ms | capserve / torch |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in ours:
        p = peer.get(r["name"])
        bound = f"{r['bound_ms']:.4f}" if r["bound_ms"] > 0 else "-"
        ratio = f"{r['ratio']:.2f}" if r["bound_ms"] > 0 else "-"
        torch_ms = f"{p['ms']:.4f}" if p else "n/a"
        vs = f"{r['ms'] / p['ms']:.2f}" if p and p["ms"] > 0 else "n/a"
        print(f"| {r['name']} | {r['shape']} | {r['ms']:.4f} | {bound} | {ratio} | {torch_ms} | {vs} |")
    notes = [f"{name}: {p['how']}" for name, p in peer.items() if "torch" not in p.get("how", "torch")]
    for n in notes:
        print(f"\nPeer note: {n}")


if __name__ == "__main__":
    main()
