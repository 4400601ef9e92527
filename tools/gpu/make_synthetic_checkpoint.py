"""A synthetic OLMoE checkpoint (random bf16 weights, Hugging Face names and config) larger than the default
model, with the default model's tokenizer: what the GPU runner serves on cuda and cpu to compare greedy text at a
size where the GPU's kernels take their real paths (many experts per token, wide rows). numpy only, written
tensor by tensor, so it runs on a bare GPU machine and here.

    python3 tools/gpu/make_synthetic_checkpoint.py --out DIR --tokenizer-from deploy/models/capserve-moe-tiny
"""

import argparse
import json
import shutil
import struct
from pathlib import Path

import numpy as np


def tensors(c):
    h, f, e, v = c["hidden_size"], c["intermediate_size"], c["num_experts"], c["vocab_size"]
    yield "model.embed_tokens.weight", (v, h), 1.0
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,), None
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            yield p + f"self_attn.{name}.weight", (h, h), h ** -0.5
        yield p + "self_attn.q_norm.weight", (h,), None
        yield p + "self_attn.k_norm.weight", (h,), None
        yield p + "post_attention_layernorm.weight", (h,), None
        yield p + "mlp.gate.weight", (e, h), h ** -0.5
        for j in range(e):
            yield p + f"mlp.experts.{j}.gate_proj.weight", (f, h), h ** -0.5
            yield p + f"mlp.experts.{j}.up_proj.weight", (f, h), h ** -0.5
            yield p + f"mlp.experts.{j}.down_proj.weight", (h, f), f ** -0.5
    yield "model.norm.weight", (h,), None
    yield "lm_head.weight", (v, h), h ** -0.5


def bf16_bytes(x):
    """float32 -> bf16 bit patterns, rounded to nearest even."""
    bits = x.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).tobytes()


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer-from", required=True, help="a model folder whose tokenizer files are copied")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    src, out = Path(args.tokenizer_from), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config.update(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                  num_experts=args.experts, num_experts_per_tok=args.top_k, num_attention_heads=args.heads,
                  num_key_value_heads=args.heads, dtype="bfloat16")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)

    specs = list(tensors(config))
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, _ in specs:
        size = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    rng = np.random.default_rng(args.seed)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape, sd in specs:
            if sd is None:  # norm scales: near 1
                values = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
            else:
                values = sd * rng.standard_normal(shape, dtype=np.float32)
            f.write(bf16_bytes(values))
    print(f"{out}: {offset / 1e9:.2f} GB of bf16 weights, {config['num_hidden_layers']} layers, "
          f"{config['num_experts']} experts top-{config['num_experts_per_tok']}, hidden {config['hidden_size']}")


if __name__ == "__main__":
    main()
