#!/usr/bin/env python3
"""Create the random Mixtral checkpoint used by the CPU runtime benchmark.

The model is a mid-size MixtralForCausalLM: hidden 1024, 8 layers, 16 heads
(8 KV heads, head_dim 64), 16 experts top-2, expert FFN 1408, vocab 32000,
rope_theta 1e6. Weights are N(0, 0.02) (RMSNorm weights are 1), seeded, and
stored as bf16 in one `model.safetensors` under the Hugging Face Hub's classic
Mixtral names (`model.layers.N.block_sparse_moe.experts.E.w1/w2/w3.weight`,
`model.layers.N.block_sparse_moe.gate.weight`, ...), written here directly so
the layout does not depend on how the installed transformers version saves MoE
experts. `config.json` uses the classic (transformers 4.x / Hub) field names.

A small sentencepiece `tokenizer.model` (byte fallback) is also written: only
llama.cpp's GGUF converter needs one. The benchmark feeds token ids directly, so
its content does not matter; the converter pads the vocab to 32000 entries.

Run (main venv, needs torch, safetensors, sentencepiece):
    tools/.venv/bin/python tools/bench/make_bench_model.py --out tools/.cache/bench_model
"""

import argparse
import io
import json
import random
from pathlib import Path

import sentencepiece as spm
import torch
from safetensors.torch import save_file

CONFIG = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 1024,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "num_local_experts": 16,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-05,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "sliding_window": None,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.02,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "use_cache": True,
    "torch_dtype": "bfloat16",
}

STD = 0.02
SEED = 1234
TOKENIZER_VOCAB = 1000


def tensor_shapes(cfg):
    """Yield (name, shape) for every tensor of the checkpoint, Hub naming."""
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    yield "model.embed_tokens.weight", (v, h)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        yield f"{p}.input_layernorm.weight", (h,)
        yield f"{p}.self_attn.q_proj.weight", (h, h)
        yield f"{p}.self_attn.k_proj.weight", (kv, h)
        yield f"{p}.self_attn.v_proj.weight", (kv, h)
        yield f"{p}.self_attn.o_proj.weight", (h, h)
        yield f"{p}.post_attention_layernorm.weight", (h,)
        yield f"{p}.block_sparse_moe.gate.weight", (cfg["num_local_experts"], h)
        for e in range(cfg["num_local_experts"]):
            q = f"{p}.block_sparse_moe.experts.{e}"
            yield f"{q}.w1.weight", (inter, h)
            yield f"{q}.w2.weight", (h, inter)
            yield f"{q}.w3.weight", (inter, h)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (v, h)


def make_weights(cfg):
    gen = torch.Generator().manual_seed(SEED)
    tensors = {}
    for name, shape in tensor_shapes(cfg):
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=gen) * STD).to(torch.bfloat16)
        tensors[name] = t
    return tensors


def write_tokenizer(out: Path):
    """Train a tiny byte-fallback BPE sentencepiece model on synthetic text."""
    rng = random.Random(SEED)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 8))) for _ in range(3000)]
    sentences = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(4000)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=model,
        model_type="bpe",
        vocab_size=TOKENIZER_VOCAB,
        byte_fallback=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    (out / "tokenizer.model").write_bytes(model.getvalue())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
    }, indent=2) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="output checkpoint directory")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    tensors = make_weights(CONFIG)
    n_params = sum(t.numel() for t in tensors.values())
    save_file(tensors, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    (args.out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    write_tokenizer(args.out)
    print(f"wrote {args.out}: {len(tensors)} tensors, {n_params / 1e6:.1f}M params, bf16")


if __name__ == "__main__":
    main()
