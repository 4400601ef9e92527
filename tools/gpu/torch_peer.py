"""The side-by-side peer of capserve-bench-kernels: the same rows (names and shapes of
tools/bench/bench_kernels.cpp's `real` shapes) through the machine's PyTorch, timed with CUDA events (median of
20 after warm-up). One JSON object per row on stdout and in --json. Dense tensors stand in for the paged caches,
bf16 throughout, so each row is what a PyTorch server would run for that operation.

    python3 tools/gpu/torch_peer.py --json torch.jsonl [--rows REGEX]
"""

import argparse
import json
import math
import re
import sys
import time

import torch
import torch.nn.functional as F

REPS = 20
dev = torch.device("cuda")
bf16 = torch.bfloat16


def timed(fn, reps=REPS, inner=1):
    for _ in range(2):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = []
    for _ in range(reps):
        start.record()
        for _ in range(inner):
            fn()
        stop.record()
        stop.synchronize()
        ms.append(start.elapsed_time(stop) / inner)
    ms.sort()
    return ms[len(ms) // 2]


def randn(*shape, dtype=bf16, sd=1.0):
    return (torch.randn(*shape, device=dev, dtype=torch.float32) * sd).to(dtype)


def ceilings(emit):
    n = (2 << 30) // 4
    a, b = randn(n, dtype=torch.float32), torch.empty(n, device=dev)
    emit("ceiling_copy", timed(lambda: b.copy_(a)))
    del a, b
    x, w = randn(8192, 8192), randn(8192, 8192)
    emit("ceiling_gemm_bf16", timed(lambda: x @ w.T))


def mla_decode(emit):
    """The absorbed form as batched matrix products over the shared latent rows (no per-head copy of the cache):
    queries through kv_b's key half, scores against the latents, softmax, values from the latents, then kv_b's
    value half."""
    seqs, h, r, dr, dn, dv = 64, 128, 512, 64, 128, 128
    w_uk, w_uv = randn(h, dn, r, sd=0.05), randn(h, r, dv, sd=0.05)
    for ctx in (1024, 4096):
        q_nope, q_rope = randn(seqs, h, dn), randn(seqs, h, dr)
        latent = randn(seqs, ctx, r + dr, sd=0.5)

        def run():
            q_lat = torch.einsum("shd,hdr->shr", q_nope, w_uk)
            q = torch.cat([q_lat, q_rope], dim=-1)  # [seqs, h, r + dr]
            p = torch.softmax(torch.bmm(q, latent.transpose(1, 2)).float() / math.sqrt(dn + dr), dim=-1)
            o = torch.bmm(p.to(bf16), latent[..., :r])  # [seqs, h, r]
            return torch.einsum("shr,hrv->shv", o, w_uv)

        emit(f"mla_decode_ctx{ctx}", timed(run))


def mla_prefill(emit):
    t, h, r, dr, dn, dv = 2048, 128, 512, 64, 128, 128
    kv_b = randn(h * (dn + dv), r, sd=0.05)
    q = randn(1, h, t, dn + dr)
    latent, k_rope = randn(t, r, sd=0.5), randn(1, 1, t, dr)

    def run():
        kv = (latent @ kv_b.T).view(t, h, dn + dv).transpose(0, 1).unsqueeze(0)
        k = torch.cat([kv[..., :dn], k_rope.expand(1, h, t, dr)], dim=-1)
        return F.scaled_dot_product_attention(q, k, kv[..., dn:], is_causal=True, scale=1 / math.sqrt(dn + dr))

    emit("mla_prefill", timed(run))


def gqa(emit):
    h, kvh, d = 64, 4, 128
    q, k, v = randn(64, h, 1, d), randn(64, kvh, 4096, d), randn(64, kvh, 4096, d)
    emit("gqa_decode_ctx4096", timed(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)))
    q, k, v = randn(1, h, 2048, d), randn(1, kvh, 2048, d), randn(1, kvh, 2048, d)
    emit("gqa_prefill",
         timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)))


def expert_ffn(emit):
    e, m, hid, inter = 32, 16, 7168, 2048
    x = randn(e * m, hid)
    # Column-major expert weights ([G, N, K] transposed), the layout torch._grouped_mm takes on Hopper.
    w13 = randn(e, 2 * inter, hid, sd=0.02).transpose(-2, -1)
    w2 = randn(e, hid, inter, sd=0.02).transpose(-2, -1)
    offs = torch.arange(m, e * m + 1, m, device=dev, dtype=torch.int32)

    def grouped():
        gu = torch._grouped_mm(x, w13, offs=offs)
        a = F.silu(gu[:, :inter]) * gu[:, inter:]
        return torch._grouped_mm(a, w2, offs=offs)

    def looped():
        outs = []
        for i in range(e):
            gu = x[i * m:(i + 1) * m] @ w13[i]
            outs.append((F.silu(gu[:, :inter]) * gu[:, inter:]) @ w2[i])
        return torch.cat(outs)

    try:
        emit("expert_ffn_grouped", timed(grouped), "torch._grouped_mm")
    except (RuntimeError, AttributeError) as e_:
        emit("expert_ffn_grouped", timed(looped), f"a loop of matmuls (torch._grouped_mm: {e_})")
    del w13, w2
    xd, wd = randn(m, hid), randn(3 * e * inter, hid, sd=0.02)
    emit("dense_gemm_same_bytes", timed(lambda: xd @ wd.T))


def router_dispatch(emit):
    experts, k, groups, topk_groups, ranks = 256, 8, 8, 4, 8
    bias = randn(experts, dtype=torch.float32, sd=0.01)
    for t in (64, 512):
        logits = randn(t, experts, dtype=torch.float32)

        def route():  # DeepSeek-V3's reference: sigmoid, group top-2 sums, top groups, top-k, normalize
            scores = logits.sigmoid()
            biased = scores + bias
            group_scores = biased.view(t, groups, -1).topk(2, dim=-1).values.sum(-1)
            top_groups = group_scores.topk(topk_groups, dim=-1).indices
            mask = torch.zeros_like(group_scores).scatter_(1, top_groups, 1.0)
            mask = mask.unsqueeze(-1).expand(t, groups, experts // groups).reshape(t, -1)
            idx = biased.masked_fill(mask == 0, float("-inf")).topk(k, dim=-1).indices
            w = scores.gather(1, idx)
            return idx, w / w.sum(-1, keepdim=True) * 2.5

        emit(f"router_T{t}", timed(route, inner=10))
        idx, _ = route()

        def plan():  # rows grouped by destination rank: a stable sort of the slots by rank, and the counts
            dest = idx // (experts // ranks)
            order = torch.sort(dest.view(-1), stable=True).indices
            return order, torch.bincount(dest.view(-1), minlength=ranks)

        emit(f"dispatch_plan_T{t}", timed(plan, inner=10))


def sample(emit):
    logits = randn(64, 129280, dtype=torch.float32, sd=3.0)

    def run():
        probs = torch.softmax(logits / 0.7, dim=-1)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < 0.9
        sorted_p = sorted_p * keep
        return order.gather(1, torch.multinomial(sorted_p, 1))

    emit("sample_top_p", timed(run))


def launch(emit):
    a, b = randn(1, 32, dtype=torch.float32), randn(1, 32, dtype=torch.float32)
    emit("launch_overhead", timed(lambda: a.add_(b), inner=1000))


def h2d(emit):
    n = 256 << 20
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    x, w = randn(8192, 8192, dtype=torch.float32), randn(8192, 8192, dtype=torch.float32)
    for pinned in (False, True):
        src = torch.ones(n, dtype=torch.uint8, pin_memory=pinned)
        waits = []
        for _ in range(REPS):
            x @ w.T
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            waits.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
        waits.sort()
        emit("h2d_pinned_host_wait" if pinned else "h2d_pageable_host_wait", waits[len(waits) // 2])


GROUPS = [("ceiling", ceilings), ("mla_decode", mla_decode), ("mla_prefill", mla_prefill), ("gqa", gqa),
          ("expert_ffn", expert_ffn), ("router_dispatch", router_dispatch), ("sample", sample),
          ("launch", launch), ("h2d", h2d)]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", required=True)
    ap.add_argument("--rows", default=".", help="regular expression over the groups, as capserve-bench-kernels")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    with open(args.json, "w") as out:
        def emit(name, ms, how="torch " + torch.__version__):
            row = {"name": name, "ms": ms, "source": "torch", "how": how}
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(f"{name:24s} {ms:10.4f}  {how}", flush=True)

        for group, fn in GROUPS:
            if group != "ceiling" and not re.search(args.rows, group):
                continue
            try:
                fn(emit)
            except Exception as e:  # one failing row must not hide the others
                print(f"{group}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
