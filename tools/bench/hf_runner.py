#!/usr/bin/env python3
"""Hugging Face transformers contender of the CPU runtime benchmark.

Loads the bf16 checkpoint with MixtralForCausalLM, upcast to float32 (the
compute type of CapServe's CPU engine, and much faster than bf16 matmuls in
torch on CPU), eager PyTorch (no torch.compile), attention and (transformers v5)
experts implementation "eager" by default, torch.set_num_threads(THREADS).

  prefill: one forward of B sequences x P random token ids (fixed seed) that
           fills a DynamicCache; logits only for the last position (as
           llama.cpp and CapServe do).
  decode:  D steps; each feeds one token per sequence (greedy argmax of the
           previous logits) through the cache, batch B.

A warmup (the same B x P prefill plus two decode steps) runs first.
Prints one JSON line:
  {"engine":"transformers","batch":B,"prefill_tok_s":...,"decode_tok_s":...,"peak_rss_mb":...,...}

Run (main venv):
    tools/.venv/bin/python tools/bench/hf_runner.py --model tools/.cache/bench_model \
        --batch 1 --prompt-len 128 --decode-steps 32 --threads 2
"""

import argparse
import json
import resource
import time

import torch
import transformers
from transformers import DynamicCache, MixtralForCausalLM

SEED = 0


def load_model(path, attn, experts):
    kwargs = {"dtype": torch.float32, "attn_implementation": attn}
    if int(transformers.__version__.split(".")[0]) >= 5:
        kwargs["experts_implementation"] = experts
    model = MixtralForCausalLM.from_pretrained(path, **kwargs)
    model.eval()
    return model


def run(model, ids, steps):
    """Prefill `ids` then decode `steps` greedy tokens; returns (prefill_s, decode_s)."""
    cache = DynamicCache()
    t0 = time.perf_counter()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    t1 = time.perf_counter()
    for _ in range(steps):
        nxt = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
        out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--attn-implementation", default="eager")
    ap.add_argument("--experts-implementation", default="eager",
                    help="transformers v5 only (ignored by 4.x, whose experts are always eager)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    model = load_model(args.model, args.attn_implementation, args.experts_implementation)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(SEED)
    ids = torch.randint(3, vocab, (args.batch, args.prompt_len), generator=gen)

    with torch.inference_mode():
        run(model, ids, 2)
        prefill_s, decode_s = run(model, ids, args.decode_steps)

    print(json.dumps({
        "engine": "transformers",
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "decode_steps": args.decode_steps,
        "threads": args.threads,
        "prefill_tok_s": args.batch * args.prompt_len / prefill_s,
        "decode_tok_s": args.batch * args.decode_steps / decode_s,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "notes": f"transformers {transformers.__version__}, torch {torch.__version__}, f32 compute, "
                 f"attn={model.config._attn_implementation}, "
                 f"experts={getattr(model.config, '_experts_implementation', 'eager')}",
    }))


if __name__ == "__main__":
    main()
