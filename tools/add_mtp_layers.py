#!/usr/bin/env python3
"""Appends DeepSeek-V3's multi-token-prediction (MTP) layers to a fixture checkpoint, with numpy only.

Usage (from the repository root; tools/gen_model_fixtures.py calls add_mtp_layers itself):

    python3 tools/add_mtp_layers.py [--no-shared] DIR [DIR ...]

DeepSeek-V3 / R1 as released store `num_nextn_predict_layers` MTP layers after the decoder's, as
`model.layers.{num_hidden_layers + i}.*`: a whole decoder layer (input_layernorm, MLA self_attn.*,
post_attention_layernorm, the MoE block under DeepSeek's layer rule: mlp.gate with its e_score_correction_bias,
mlp.experts.E.*, mlp.shared_experts.*) plus `enorm`, `hnorm`, `eh_proj` [hidden, 2 * hidden], `shared_head.norm`
and `embed_tokens` / `shared_head.head` [vocab, hidden] (conversions may drop these two, which equal the model's
own; `--no-shared` leaves them out). In an FP8 checkpoint (config.json's quantization_config) the attention and
MLP matrices are F8_E4M3 with a F32 `weight_scale_inv` per block, as the decoder's; `eh_proj`, the two
[vocab, hidden] matrices and the norms are BF16, the correction bias F32, as in the release.

transformers' DeepseekV3 does not load these tensors (unexpected keys), so a fixture's reference outputs are
those of the model without them. Every tensor already in model.safetensors keeps its bytes: the new ones are
appended behind the data section and listed in the rewritten header, so the file differs only in its header and
its tail. The values are random (the MTP layer is not run yet) at the generator's scales.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import numpy as np

FP8_MAX = 448.0
SEED_OFFSET = 1000  # the MTP values' generator seed is the fixture's seed plus this


def read_safetensors(path: Path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    return header, raw[8 + n:]


def write_safetensors(path: Path, header, data: bytes):
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def bf16_bytes(v):
    """Round-to-nearest-even f32 -> bf16."""
    bits = np.asarray(v, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2").tobytes()


def e4m3_values():
    """The finite float8_e4m3fn values (codes 0..126 non-negative; 127 is NaN), by code."""
    codes = np.arange(127)
    exp, mant = codes >> 3, codes & 7
    return np.where(exp == 0, mant / 8.0 * 2.0**-6, (1 + mant / 8.0) * 2.0**(exp - 7.0))


def fp8_quantize(w, block):
    """DeepSeek-V3's block quantization (scale = amax / 448 per block): F8_E4M3 codes (nearest value) and the
    F32 scale_inv [ceil(rows / br), ceil(cols / bc)]."""
    br, bc = block
    rows, cols = w.shape
    scale = np.ones((-(-rows // br), -(-cols // bc)), dtype=np.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            amax = np.abs(w[i * br:(i + 1) * br, j * bc:(j + 1) * bc]).max()
            scale[i, j] = amax / FP8_MAX if amax > 0 else 1.0
    full = np.repeat(np.repeat(scale, br, 0)[:rows], bc, 1)[:, :cols]
    x = w / full
    table = e4m3_values()
    code = np.abs(np.abs(x)[..., None] - table).argmin(-1).astype(np.uint8)
    code |= np.where(x < 0, 0x80, 0).astype(np.uint8)
    return code.tobytes(), scale


def mtp_tensors(cfg, layer, rng, shared):
    """(name, [rows, cols] or [n], kind) of MTP layer `layer` in DeepSeek-V3's layout, with values. kind:
    "norm", "linear" (quantized in FP8 checkpoints), "plain" (a matrix never quantized) or "bias"."""
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    nope, rope, v_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    q_lora, kv_lora = cfg.get("q_lora_rank") or 0, cfg["kv_lora_rank"]
    p = f"model.layers.{layer}."
    out = []

    def norm(name, n):
        out.append((p + name, 1.0 + 0.1 * rng.standard_normal(n), "norm"))

    def matrix(name, rows, cols, kind="linear", gain=1.0):
        out.append((p + name, gain / cols**0.5 * rng.standard_normal((rows, cols)), kind))

    if shared:
        out.append((p + "embed_tokens.weight", rng.standard_normal((vocab, h)), "plain"))
    norm("enorm.weight", h)
    norm("hnorm.weight", h)
    matrix("eh_proj.weight", h, 2 * h, "plain")
    norm("input_layernorm.weight", h)
    if q_lora > 0:
        matrix("self_attn.q_a_proj.weight", q_lora, h)
        norm("self_attn.q_a_layernorm.weight", q_lora)
        matrix("self_attn.q_b_proj.weight", heads * (nope + rope), q_lora, gain=2.0)
    else:
        matrix("self_attn.q_proj.weight", heads * (nope + rope), h, gain=2.0)
    matrix("self_attn.kv_a_proj_with_mqa.weight", kv_lora + rope, h)
    norm("self_attn.kv_a_layernorm.weight", kv_lora)
    matrix("self_attn.kv_b_proj.weight", heads * (nope + v_dim), kv_lora)
    matrix("self_attn.o_proj.weight", h, heads * v_dim)
    norm("post_attention_layernorm.weight", h)
    first_dense, freq = cfg.get("first_k_dense_replace", 0), cfg.get("moe_layer_freq", 1)
    if layer >= first_dense and layer % freq == 0:
        experts, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
        matrix("mlp.gate.weight", experts, h, "plain", gain=1.5)
        out.append((p + "mlp.gate.e_score_correction_bias", 0.1 * rng.standard_normal(experts), "bias"))
        for e in range(experts):
            matrix(f"mlp.experts.{e}.gate_proj.weight", inter, h)
            matrix(f"mlp.experts.{e}.up_proj.weight", inter, h)
            matrix(f"mlp.experts.{e}.down_proj.weight", h, inter)
        shared_inter = inter * cfg.get("n_shared_experts", 0)
        if shared_inter > 0:
            matrix("mlp.shared_experts.gate_proj.weight", shared_inter, h)
            matrix("mlp.shared_experts.up_proj.weight", shared_inter, h)
            matrix("mlp.shared_experts.down_proj.weight", h, shared_inter)
    else:
        inter = cfg["intermediate_size"]
        matrix("mlp.gate_proj.weight", inter, h)
        matrix("mlp.up_proj.weight", inter, h)
        matrix("mlp.down_proj.weight", h, inter)
    norm("shared_head.norm.weight", h)
    if shared:
        matrix("shared_head.head.weight", vocab, h, "plain", gain=2.0)
    return out


def add_mtp_layers(d: Path, seed: int, shared: bool = True):
    """Appends config.json's num_nextn_predict_layers MTP layers to d/model.safetensors; returns how many
    tensors it added."""
    cfg = json.loads((d / "config.json").read_text())
    path = d / "model.safetensors"
    header, data = read_safetensors(path)
    first = cfg["num_hidden_layers"]
    if any(k.startswith(f"model.layers.{first}.") for k in header):
        raise SystemExit(f"{path} already holds model.layers.{first}.*")
    fp8 = cfg.get("quantization_config", {}).get("weight_block_size")
    float_type = "F32" if cfg.get("dtype", "float32") == "float32" else "BF16"
    rng = np.random.default_rng(seed + SEED_OFFSET)
    entries = []  # (name, dtype, shape, bytes)
    for layer in range(first, first + cfg.get("num_nextn_predict_layers", 0)):
        for name, v, kind in mtp_tensors(cfg, layer, rng, shared):
            v = v.astype(np.float32)
            if kind == "linear" and fp8:
                codes, scale = fp8_quantize(v, fp8)
                entries.append((name, "F8_E4M3", list(v.shape), codes))
                entries.append((name + "_scale_inv", "F32", list(scale.shape), scale.astype("<f4").tobytes()))
            elif kind == "bias" or float_type == "F32":
                entries.append((name, "F32", list(v.shape), v.astype("<f4").tobytes()))
            else:
                entries.append((name, "BF16", list(v.shape), bf16_bytes(v)))
    # Widest elements first, so that every tensor starts aligned to its element size.
    width = {"F32": 4, "BF16": 2, "F8_E4M3": 1}
    entries.sort(key=lambda e: -width[e[1]])
    tail = bytearray()
    for name, dtype, shape, raw in entries:
        begin = len(data) + len(tail)
        assert begin % width[dtype] == 0, name
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, begin + len(raw)]}
        tail += raw
    write_safetensors(path, header, data + bytes(tail))
    return len(entries)


def main():
    args = sys.argv[1:]
    shared = "--no-shared" not in args
    dirs = [a for a in args if a != "--no-shared"]
    if not dirs:
        sys.exit(__doc__)
    for d in map(Path, dirs):
        ref = json.loads((d / "reference.json").read_text())
        print(f"{d}: {add_mtp_layers(d, ref['seed'], shared)} MTP tensors appended")


if __name__ == "__main__":
    main()
