"""Step costs of real MoE models on one node of 8 GPUs from published figures, for capserve-planner
(tools/planner/step_cost.h), every figure and assumption written into the cost file next to the
coefficients. When the first-GPU kit (tools/gpu) has measured our kernels on an H100/H200, its figures
replace these (the "measured" entries below are then filled from tools/results/gpu/).
"""
from __future__ import annotations

# Published hardware figures (NVIDIA H100 SXM5 and H200 SXM datasheets; DeepEP's README for the achieved
# all-to-all bandwidth of its intranode kernels on Hopper with NVLink, 8-way expert parallelism).
GPUS = {
    "h100": {"name": "H100 SXM5 80 GB", "bf16_flops": 989.4e12, "hbm_bytes_per_s": 3.35e12},
    "h200": {"name": "H200 SXM 141 GB", "bf16_flops": 989.4e12, "hbm_bytes_per_s": 4.8e12},
}
ALLTOALL_BYTES_PER_S = 155e9  # DeepEP intranode dispatch/combine, measured 153-158 GB/s per GPU
GEMM_EFFICIENCY = 0.6  # grouped expert GEMMs and dense projections, of the BF16 peak
ATTENTION_EFFICIENCY = 0.5  # prefill attention (FlashAttention-class kernels), of the BF16 peak
HBM_EFFICIENCY = 0.8  # streaming weights and KV cache, of the HBM peak
STEP_OVERHEAD_S = 0.5e-3  # scheduling, sampling and graph launch per engine step
LAYER_OVERHEAD_S = 50e-6  # per MoE layer: two all-to-all latencies (dispatch, combine) of about 25 us
ALLREDUCE_S = 20e-6  # a small NCCL allreduce over NVLink (latency-bound)

# Hugging Face configs (allenai/OLMoE-1B-7B-0924, mistralai/Mixtral-8x7B-v0.1).
MODELS = {
    "olmoe": {"name": "OLMoE-1B-7B", "routing_key": "olmoe", "hidden": 2048, "layers": 16, "heads": 16,
              "kv_heads": 16, "head_dim": 128, "expert_intermediate": 1024, "experts": 64, "top_k": 8,
              "vocab": 50304},
    "mixtral": {"name": "Mixtral-8x7B", "routing_key": "mistral", "hidden": 4096, "layers": 32, "heads": 32,
                "kv_heads": 8, "head_dim": 128, "expert_intermediate": 14336, "experts": 8, "top_k": 2,
                "vocab": 32000},
}
BYTES = 2  # bf16 weights, activations and KV cache


def dense_params(m: dict) -> float:
    """Weights every token passes through outside the experts: attention projections, router, LM head."""
    q_o = 2 * m["hidden"] * m["heads"] * m["head_dim"]
    k_v = 2 * m["hidden"] * m["kv_heads"] * m["head_dim"]
    return m["layers"] * (q_o + k_v + m["hidden"] * m["experts"]) + m["hidden"] * m["vocab"]


def expert_params(m: dict) -> float:
    return 3 * m["hidden"] * m["expert_intermediate"]  # gate, up, down


def step_cost(model: str, gpu: str) -> dict:
    m, g = MODELS[model], GPUS[gpu]
    flops = g["bf16_flops"] * GEMM_EFFICIENCY
    hbm = g["hbm_bytes_per_s"] * HBM_EFFICIENCY
    dense_weight_read = dense_params(m) * BYTES / hbm
    seconds = {
        "step": STEP_OVERHEAD_S + dense_weight_read,
        "token": 2 * dense_params(m) / flops,
        "pair": 4 * m["heads"] * m["head_dim"] * m["layers"] / (g["bf16_flops"] * ATTENTION_EFFICIENCY),
        "decode_pair": 2 * m["kv_heads"] * m["head_dim"] * BYTES * m["layers"] / hbm,
        "layer": LAYER_OVERHEAD_S,
        "assignment": 2 * expert_params(m) / flops,
        "active_expert": expert_params(m) * BYTES / hbm,
        "wire_byte": 1 / ALLTOALL_BYTES_PER_S,
        # Global capacity: the per-expert counts' allreduce, then two histogram rounds where an expert overflowed.
        "capacity_layer": ALLREDUCE_S,
        "capacity_refine": 2 * ALLREDUCE_S,
    }
    return {
        "name": f"{m['name']} on 8x {g['name']} (projected from published figures)",
        "model": {"moe_layers": m["layers"], "experts": m["experts"], "top_k": m["top_k"],
                  "row_bytes": m["hidden"] * BYTES},
        "cores": 0,
        "expert_time": "roofline",
        "seconds": seconds,
        "expert_bytes": expert_params(m) * BYTES,
        "assumptions": [
            f"{g['name']}: {g['bf16_flops'] / 1e12:.0f} TFLOPS dense BF16, {g['hbm_bytes_per_s'] / 1e12:.2f} TB/s "
            "HBM (NVIDIA datasheet); one rank per GPU, 8 ranks, expert parallelism over NVLink",
            f"GEMMs at {GEMM_EFFICIENCY:.0%} of peak, prefill attention at {ATTENTION_EFFICIENCY:.0%}, weights "
            f"and KV cache streamed at {HBM_EFFICIENCY:.0%} of HBM bandwidth",
            f"all-to-all at {ALLTOALL_BYTES_PER_S / 1e9:.0f} GB/s per GPU (DeepEP's intranode kernels, measured "
            "153-158 GB/s on Hopper); one hidden row per kept assignment each way (no per-rank deduplication)",
            f"per step {STEP_OVERHEAD_S * 1e3:.1f} ms overhead plus reading the {dense_params(m) / 1e9:.2f} B "
            "dense parameters once; added to the per-token compute (no overlap: conservative at small batch)",
            f"per MoE layer {LAYER_OVERHEAD_S * 1e6:.0f} us fixed (two all-to-all latencies)",
            f"global capacity: one {ALLREDUCE_S * 1e6:.0f} us allreduce per layer, two more where an expert "
            "overflowed (the top-C threshold's histogram rounds)",
            "an expert's rank pays the larger of its GEMM time and reading the active experts' weights "
            f"({expert_params(m) * BYTES / 1e6:.1f} MB each)",
            f"{m['name']}: hidden {m['hidden']}, {m['layers']} MoE layers, {m['experts']} experts top-{m['top_k']}, "
            f"expert intermediate {m['expert_intermediate']}, {m['heads']} heads / {m['kv_heads']} KV heads "
            "(Hugging Face config); BF16 throughout",
        ],
    }
