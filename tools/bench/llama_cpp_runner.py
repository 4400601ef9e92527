#!/usr/bin/env python3
"""llama.cpp contender of the CPU runtime benchmark (llama-cpp-python, low-level API).

  prefill: B sequences (distinct seq_ids) of P random token ids (fixed seed)
           submitted in one llama_decode call (n_batch = n_ubatch = B*P); logits
           only for the last token of each sequence.
  decode:  D steps; each submits one token per sequence (greedy argmax of that
           sequence's previous logits, argmax included in the timing) in one
           llama_decode call.

Context: n_seq_max = B, n_ctx >= B*(P+D), n_threads = n_threads_batch = THREADS,
llama.cpp defaults otherwise (mmap'd weights, f16 KV cache, flash attention
"auto"). A warmup (the same B x P prefill plus two decode steps, then the KV
memory is cleared) runs first. Prints one JSON line:
  {"engine":"llama.cpp","batch":B,"prefill_tok_s":...,"decode_tok_s":...,"peak_rss_mb":...,...}

Run (llama venv, see bench_cpu_runtime.py for how it is built):
    tools/.venv-llama/bin/python tools/bench/llama_cpp_runner.py \
        --gguf tools/.cache/bench_model/bench-bf16.gguf --batch 16 --threads 2
"""

import argparse
import ctypes
import json
import resource
import time

import llama_cpp as L
import numpy as np

SEED = 0
GGML_LOG_LEVEL_ERROR = 4  # ggml.h: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5


@L.llama_log_callback
def _quiet_log(level, text, user_data):
    if level == GGML_LOG_LEVEL_ERROR:
        print(text.decode(errors="replace"), end="", flush=True)


class Runner:
    def __init__(self, gguf, batch, n_ctx, n_tokens_max, threads):
        self.batch = batch
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self.model = L.llama_model_load_from_file(gguf.encode(), mparams)
        if not self.model:
            raise SystemExit(f"failed to load {gguf}")
        cparams = L.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_tokens_max
        cparams.n_ubatch = n_tokens_max
        cparams.n_seq_max = batch
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise SystemExit("failed to create llama context")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.lbatch = L.llama_batch_init(n_tokens_max, 0, 1)

    def close(self):
        L.llama_batch_free(self.lbatch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)

    def _decode(self, tokens, pos0):
        """tokens: [B, T] ids at positions pos0..pos0+T-1; returns next greedy id per sequence."""
        b, t = tokens.shape
        lb = self.lbatch
        lb.n_tokens = b * t
        i = 0
        for s in range(b):
            for j in range(t):
                lb.token[i] = int(tokens[s, j])
                lb.pos[i] = pos0 + j
                lb.n_seq_id[i] = 1
                lb.seq_id[i][0] = s
                lb.logits[i] = j == t - 1
                i += 1
        if L.llama_decode(self.ctx, lb) != 0:
            raise SystemExit("llama_decode failed")
        nxt = np.empty((b, 1), dtype=np.int32)
        for s in range(b):
            row = np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, s * t + t - 1), shape=(self.n_vocab,))
            nxt[s, 0] = row.argmax()
        return nxt

    def run(self, ids, steps):
        """Prefill `ids` [B, P] then decode `steps` tokens; returns (prefill_s, decode_s)."""
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        p = ids.shape[1]
        t0 = time.perf_counter()
        nxt = self._decode(ids, 0)
        t1 = time.perf_counter()
        for k in range(steps):
            nxt = self._decode(nxt, p + k)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    L.llama_log_set(_quiet_log, ctypes.c_void_p())
    L.llama_backend_init()
    b, p, d = args.batch, args.prompt_len, args.decode_steps
    runner = Runner(args.gguf, b, n_ctx=b * (p + d), n_tokens_max=b * p, threads=args.threads)
    rng = np.random.default_rng(SEED)
    ids = rng.integers(3, runner.n_vocab, size=(b, p), dtype=np.int32)

    runner.run(ids, 2)
    prefill_s, decode_s = runner.run(ids, d)
    runner.close()

    print(json.dumps({
        "engine": "llama.cpp",
        "batch": b,
        "prompt_len": p,
        "decode_steps": d,
        "threads": args.threads,
        "prefill_tok_s": b * p / prefill_s,
        "decode_tok_s": b * d / decode_s,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "notes": f"llama-cpp-python {L.__version__}, {args.gguf.rsplit('/', 1)[-1]}",
    }))


if __name__ == "__main__":
    main()
