#!/usr/bin/env python3
"""Train CapServe's embedded models: a small OLMoE (HF transformers OlmoeForCausalLM) trained from scratch on the
domain corpus in ../shared/data/corpus/ (or $CAPSERVE_SHARED_DATA_DIR/corpus). `--preset tiny` (the default) is
the quickstart model capserve-moe-tiny (16 experts, top-2); `--preset fine` is capserve-moe-fine, OLMoE's shape in
miniature (64 experts, top-8, the same expert parameters in total and per token; see PRESETS).

Usage (from the repository root; CPU only: the committed run took 2,953 s for the default 1,200 steps on 2 AMD EPYC
cores, about 2.5 s per step (tools/results/default_model_train.json, "timing"), more when the machine is busy):

    tools/.venv/bin/python tools/train_default_model.py            # tokenizer + model + export + measurement
    tools/.venv/bin/python tools/train_default_model.py --preset fine   # the fine-grained model
    tools/.venv/bin/python tools/train_default_model.py --steps 20 --out /tmp/smoke   # quick smoke run

What it does, deterministically (fixed seeds, fixed step count; bit-for-bit identical reruns need the same torch
build and thread count, --threads, default 2):

 1. Data. Each domain file corpus/{arxiv,books,code,web,wikipedia}.txt is split at a line boundary into a training
    part and a held-out part (the last ~5% of the bytes): see `split_point` for the exact rule. The held-out part is
    never seen by the tokenizer trainer nor the model.
 2. Tokenizer. A byte-level BPE (HF `tokenizers`) trained on the training parts: GPT-2 regex split + ByteLevel
    (no prefix space, no normalizer), ByteLevel decoder, special tokens <|endoftext|> (bos/eos), <pad>, and the
    OLMoE-Instruct/Tulu chat markers <|system|>, <|user|>, <|assistant|>; tokenizer_config.json carries the
    OLMoE-1B-7B-0924-Instruct (Tulu) chat template.
 3. Model. OlmoeForCausalLM (see MODEL_CONFIG) trained with AdamW on packed sequences: every sequence is
    <|endoftext|> followed by SEQ_TEXT_TOKENS consecutive tokens of one domain's training stream at a random offset;
    every batch holds the same number of sequences from each domain. Loss = LM cross-entropy + router_aux_loss_coef *
    Switch-style load-balancing loss (transformers' own, output_router_logits=True).
 4. Export. Weights rounded to bf16 and saved with save_pretrained (model.safetensors, config.json,
    generation_config.json) plus tokenizer.json / tokenizer_config.json into deploy/models/capserve-moe-tiny/.
    Checks: the file holds exactly the classic per-expert Hub tensor names
    (model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight, model.layers.N.mlp.gate.weight, ...) with values
    equal to the in-memory (fused) experts; the directory re-loaded with from_pretrained gives identical logits.
 5. Measurement: tools/measure_default_model.py (per-domain held-out perplexity, routing tables, plot, model card
    tables); run automatically at the end unless --no-measure.

Writes a training log to tools/results/default_model_train.json (unless --out is not the default directory).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# ../shared/data beside the checkout, or CAPSERVE_SHARED_DATA_DIR (a worktree elsewhere), as the tests read it
CORPUS = Path(os.environ.get("CAPSERVE_SHARED_DATA_DIR", REPO.parent / "shared" / "data")) / "corpus"
DEFAULT_OUT = REPO / "deploy" / "models" / "capserve-moe-tiny"
RESULTS = REPO / "tools" / "results"

DOMAINS = ["arxiv", "books", "code", "web", "wikipedia"]
HELDOUT_FRACTION = 0.05

VOCAB_SIZE = 6144
SPECIAL_TOKENS = ["<|endoftext|>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]  # ids 0..4
EOS_TOKEN = BOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<pad>"
# GPT-2's pre-tokenization regex (the one GPT-NeoX / OLMoE's tokenizer applies through ByteLevel(use_regex=True)),
# written out as an explicit Split so that tokenizer.json carries it verbatim.
GPT2_SPLIT_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# allenai/OLMoE-1B-7B-0924-Instruct's chat template (open-instruct's "tulu" template with a leading bos_token), but
# an assistant message's null content is "" (OpenAI's tool round trip sends content null beside tool_calls; the
# original raised TypeError). Every other render is unchanged.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ '<|system|>\n' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'user' %}"
    "{{ '<|user|>\n' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{% if not loop.last %}"
    "{{ '<|assistant|>\n'  + (message['content'] if message['content'] is not none else '') + eos_token + '\n' }}"
    "{% else %}"
    "{{ '<|assistant|>\n'  + (message['content'] if message['content'] is not none else '') + eos_token }}"
    "{% endif %}"
    "{% endif %}"
    "{% if loop.last and add_generation_prompt %}"
    "{{ '<|assistant|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
)
MAX_POSITION_EMBEDDINGS = 1024

MODEL_CONFIG = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=256,
    intermediate_size=192,  # per expert
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    num_experts=16,
    num_experts_per_tok=2,
    norm_topk_prob=False,  # as OLMoE-1B-7B
    router_aux_loss_coef=0.003,
    output_router_logits=False,  # the training loop passes output_router_logits=True explicitly
    max_position_embeddings=MAX_POSITION_EMBEDDINGS,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    rms_norm_eps=1e-5,
    clip_qkv=None,
    hidden_act="silu",
    initializer_range=0.02,
    attention_bias=False,
    attention_dropout=0.0,
    tie_word_embeddings=False,
    pad_token_id=1,
    bos_token_id=0,
    eos_token_id=0,
)

# The embedded models the trainer builds. "tiny" is the quickstart default (16 experts, top-2). "fine" is OLMoE's
# shape in miniature: 64 experts, top-8, each a quarter of a tiny expert, so both models have the same total and
# active expert parameters (a granularity ablation); its balance loss is OLMoE-1B-7B's (coefficient 0.01).
PRESETS = {
    "tiny": dict(out=DEFAULT_OUT, results_prefix="default_model", config={}),
    "fine": dict(out=REPO / "deploy" / "models" / "capserve-moe-fine", results_prefix="fine_model",
                 config=dict(intermediate_size=48, num_experts=64, num_experts_per_tok=8, router_aux_loss_coef=0.01)),
}

# training hyper-parameters
SEQ_LEN = 256  # model input length: 1 <|endoftext|> + SEQ_TEXT_TOKENS text tokens
SEQ_TEXT_TOKENS = SEQ_LEN - 1
SEQS_PER_DOMAIN = 4  # batch = 5 domains x 4 sequences = 20 sequences = 5,100 text tokens
STEPS = 1200
LR = 3e-3
MIN_LR_FRAC = 0.1
WARMUP = 100
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
SEED = 20240901
TRAIN_EXPERTS_IMPL = "eager"  # fastest on CPU here (grouped_mm 5x slower, batched_mm runs out of memory)


def log(*a):
    print(*a, flush=True)


# --------------------------------------------------------------------------------------------------------------
# data


def split_point(data: bytes, fraction: float = HELDOUT_FRACTION) -> int:
    """Byte offset where a domain's held-out part starts.

    Rule: c = floor(len(data) * (1 - fraction)); the held-out part starts right after the first b'\\n' at or after
    byte c (so the training part ends with that newline and the held-out part starts at the beginning of a line).
    """
    c = int(len(data) * (1.0 - fraction))
    nl = data.index(b"\n", c)
    return nl + 1


def load_splits(corpus: Path = CORPUS):
    """{domain: (train_text, heldout_text, info)}; texts decoded as UTF-8 (the files are valid UTF-8)."""
    out = {}
    for d in DOMAINS:
        data = (corpus / f"{d}.txt").read_bytes()
        s = split_point(data)
        info = dict(
            file=f"corpus/{d}.txt",
            file_bytes=len(data),
            file_sha256=hashlib.sha256(data).hexdigest(),
            heldout_start_byte=s,
            heldout_bytes=len(data) - s,
        )
        out[d] = (data[:s].decode("utf-8"), data[s:].decode("utf-8"), info)
    return out


# --------------------------------------------------------------------------------------------------------------
# tokenizer


def train_tokenizer(train_texts: dict[str, str], vocab_size: int = VOCAB_SIZE):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(GPT2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def chunks():  # 32-line chunks (newlines kept, so "\n\n", indentation etc. become tokens), domains in order
        for d in DOMAINS:
            lines = train_texts[d].splitlines(keepends=True)
            for i in range(0, len(lines), 32):
                yield "".join(lines[i : i + 32])

    tok.train_from_iterator(chunks(), trainer=trainer)
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def make_hf_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=SPECIAL_TOKENS[2:],
        model_max_length=MAX_POSITION_EMBEDDINGS,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        add_bos_token=False,
        add_eos_token=False,
    )


def encode(tok, text: str):
    import numpy as np

    return np.asarray(tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)


# --------------------------------------------------------------------------------------------------------------
# model


def param_count(cfg) -> dict:
    H, I, L, E, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["num_experts"], cfg[
        "vocab_size"]
    hd = H // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    attn = H * H * 2 + H * kv * 2 + H + kv  # q,o + k,v + q_norm + k_norm
    experts = E * 3 * H * I
    layer = attn + experts + E * H + 2 * H
    emb = V * H * (1 if cfg["tie_word_embeddings"] else 2)
    total = L * layer + emb + H
    active = L * (attn + cfg["num_experts_per_tok"] * 3 * H * I + E * H + 2 * H) + emb + H
    return dict(total=total, experts=L * experts, embeddings=emb, attention=L * attn, active_per_token=active)


def build_model(cfg_dict, experts_impl: str):
    import torch
    from transformers import OlmoeConfig, OlmoeForCausalLM

    cfg = OlmoeConfig(**cfg_dict)
    model = OlmoeForCausalLM._from_config(cfg, attn_implementation="eager", experts_implementation=experts_impl,
                                          dtype=torch.float32)
    return model


def lr_at(step: int, steps: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    t = (step - WARMUP) / max(1, steps - WARMUP)
    return LR * (MIN_LR_FRAC + (1 - MIN_LR_FRAC) * 0.5 * (1 + math.cos(math.pi * t)))


def make_optimizer(named_parameters):
    """AdamW with weight decay on the matrices only (not on norms, biases, embeddings)."""
    import torch

    decay, no_decay = [], []
    for n, p in named_parameters:
        (no_decay if (p.ndim < 2 or "norm" in n or "embed_tokens" in n) else decay).append(p)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR, betas=BETAS, eps=1e-8,
    )


def sample_batch(rng, train_ids: dict):
    """One training batch [len(DOMAINS) * SEQS_PER_DOMAIN, SEQ_LEN]: <|endoftext|> then SEQ_TEXT_TOKENS tokens of
    one domain's stream at a random offset, SEQS_PER_DOMAIN sequences per domain."""
    import numpy as np
    import torch

    bos = MODEL_CONFIG["bos_token_id"]
    rows = []
    for d in DOMAINS:
        ids = train_ids[d]
        offs = rng.integers(0, len(ids) - SEQ_TEXT_TOKENS, size=SEQS_PER_DOMAIN)
        for o in offs:
            rows.append(np.concatenate([[bos], ids[o : o + SEQ_TEXT_TOKENS]]))
    return torch.from_numpy(np.stack(rows))


def train(model, train_ids: dict, steps: int, seed: int, log_every: int = 25):
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    opt = make_optimizer(model.named_parameters())
    history = []
    model.train()
    t0 = time.time()
    ema = None
    for step in range(steps):
        x = sample_batch(rng, train_ids)
        lr = lr_at(step, steps)
        for g in opt.param_groups:
            g["lr"] = lr
        out = model(input_ids=x, labels=x, output_router_logits=True)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        opt.step()
        aux = float(out.aux_loss.detach())
        lm = float(out.loss.detach()) - model.router_aux_loss_coef * aux
        ema = lm if ema is None else 0.98 * ema + 0.02 * lm
        if step % log_every == 0 or step == steps - 1:
            el = time.time() - t0
            rec = dict(step=step, lm_loss=round(lm, 4), lm_loss_ema=round(ema, 4), aux_loss=round(aux, 4),
                       grad_norm=round(float(gnorm), 3), lr=lr, elapsed_s=round(el, 1))
            history.append(rec)
            eta = el / (step + 1) * (steps - step - 1)
            log(f"step {step:5d}/{steps}  lm {lm:.4f} (ema {ema:.4f})  aux {aux:.4f}  |g| {float(gnorm):.2f}  "
                f"lr {lr:.2e}  {el:7.1f}s  eta {eta:6.0f}s")
    model.eval()
    return history, time.time() - t0


# --------------------------------------------------------------------------------------------------------------
# export + checks


def round_to_bf16_(model):
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))


def export(model, hf_tok, out: Path):
    import copy

    import torch
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    for f in ("model.safetensors", "model.safetensors.index.json", "config.json", "generation_config.json",
              "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out / f).unlink(missing_ok=True)
    m = copy.deepcopy(model).to(torch.bfloat16)
    m.config.output_router_logits = False
    m.generation_config = GenerationConfig(bos_token_id=MODEL_CONFIG["bos_token_id"],
                                           eos_token_id=MODEL_CONFIG["eos_token_id"],
                                           pad_token_id=MODEL_CONFIG["pad_token_id"])
    m.save_pretrained(str(out))
    hf_tok.save_pretrained(str(out))
    # transformers 5 writes tokenizer_config.json without the template when it also writes chat_template.jinja;
    # keep the classic single-file layout (template inside tokenizer_config.json) that servers read.
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    jinja = out / "chat_template.jinja"
    if jinja.exists():
        assert jinja.read_text() == CHAT_TEMPLATE
        jinja.unlink()
    tc["chat_template"] = CHAT_TEMPLATE
    tc["bos_token"], tc["eos_token"], tc["pad_token"] = BOS_TOKEN, EOS_TOKEN, PAD_TOKEN
    tc["model_max_length"] = MAX_POSITION_EMBEDDINGS
    # classic keys (transformers 4.x and 5.x both read them; 5.x would write its own "TokenizersBackend" class and
    # an "extra_special_tokens" list that 4.x cannot read)
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc.pop("extra_special_tokens", None)
    tc["additional_special_tokens"] = SPECIAL_TOKENS[2:]
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    (out / "special_tokens_map.json").unlink(missing_ok=True)


def check_export(model, out: Path, sample_ids):
    """Hub names + values (via gen_model_fixtures' checker), then re-load and compare logits exactly."""
    import torch

    sys.path.insert(0, str(REPO / "tools"))
    import gen_model_fixtures as gmf

    # exactly the Hub names of the model's type (per-expert, no fused gate_up_proj), each with its value
    files = gmf.check_checkpoint({"max_shard_size": None, "disk_dtype": torch.bfloat16}, out, model)
    reloaded = gmf.load_saved(out)
    x = torch.as_tensor(sample_ids)
    with torch.no_grad():
        a = model(input_ids=x).logits
        b = reloaded(input_ids=x).logits
    if not torch.equal(a, b):
        raise gmf.CheckFailed(f"re-loaded logits differ: max |diff| {float((a - b).abs().max())}")
    # tokenizer round trip through AutoTokenizer
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(out))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is an expert?"}]
    rendered = t.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    want = ("<|endoftext|><|system|>\nBe brief.\n<|user|>\nHi there\n<|assistant|>\nHello.<|endoftext|>\n"
            "<|user|>\nWhat is an expert?\n<|assistant|>\n")
    if rendered != want:
        raise gmf.CheckFailed(f"chat template renders {rendered!r}")
    ids = t(rendered, add_special_tokens=False)["input_ids"]
    assert ids[0] == 0 and 2 in ids and 3 in ids and 4 in ids, ids[:8]
    assert t.decode(ids) == rendered
    return [f.name for f in files]


# --------------------------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                    help="which embedded model (shape, output directory, results' names)")
    ap.add_argument("--out", type=Path, help="output directory (default: the preset's under deploy/models/)")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--aux-coef", type=float, help="router_aux_loss_coef (default: the preset's)")
    ap.add_argument("--train-experts-impl", default=TRAIN_EXPERTS_IMPL, choices=["eager", "grouped_mm", "batched_mm"])
    ap.add_argument("--no-measure", action="store_true")
    args = ap.parse_args()
    preset = PRESETS[args.preset]
    args.out = args.out or preset["out"]

    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))  # tokenizers' trainer
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    import numpy as np
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    T0 = time.time()
    timing = {}

    t = time.time()
    splits = load_splits()
    tok = train_tokenizer({d: splits[d][0] for d in DOMAINS})
    timing["tokenizer_s"] = round(time.time() - t, 1)
    hf_tok = make_hf_tokenizer(tok)
    log(f"tokenizer: vocab {tok.get_vocab_size()} trained in {timing['tokenizer_s']} s")

    t = time.time()
    train_ids = {d: encode(tok, splits[d][0]) for d in DOMAINS}
    held_ids = {d: encode(tok, splits[d][1]) for d in DOMAINS}
    timing["encode_s"] = round(time.time() - t, 1)
    data_info = {}
    for d in DOMAINS:
        info = dict(splits[d][2])
        info.update(train_tokens=int(len(train_ids[d])), heldout_tokens=int(len(held_ids[d])),
                    train_bytes_per_token=round(info["heldout_start_byte"] / len(train_ids[d]), 3))
        data_info[d] = info
        log(f"  {d:10s} train {len(train_ids[d]):8d} tok  held-out {len(held_ids[d]):7d} tok  "
            f"({info['train_bytes_per_token']} B/tok)")

    cfg = dict(MODEL_CONFIG, **preset["config"])
    if args.aux_coef is not None:
        cfg["router_aux_loss_coef"] = args.aux_coef
    pc = param_count(cfg)
    log(f"model: {json.dumps({k: cfg[k] for k in ('hidden_size', 'intermediate_size', 'num_hidden_layers', 'num_experts', 'num_experts_per_tok', 'vocab_size')})}"
        f"  params {pc['total'] / 1e6:.2f} M (bf16 {pc['total'] * 2 / 1e6:.1f} MB), active/token {pc['active_per_token'] / 1e6:.2f} M")
    torch.manual_seed(args.seed)
    model = build_model(cfg, args.train_experts_impl)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == pc["total"], (n_params, pc)

    history, train_s = train(model, train_ids, args.steps, args.seed)
    timing["train_s"] = round(train_s, 1)
    tokens_seen = args.steps * len(DOMAINS) * SEQS_PER_DOMAIN * SEQ_TEXT_TOKENS
    log(f"trained {args.steps} steps, {tokens_seen / 1e6:.2f} M text tokens in {train_s:.0f} s "
        f"({tokens_seen / train_s:.0f} tok/s)")

    # export: bf16-rounded weights, eager experts from here on
    round_to_bf16_(model)
    model.set_experts_implementation("eager")
    model.eval()
    t = time.time()
    export(model, hf_tok, args.out)
    sample = np.stack([np.concatenate([[0], held_ids[d][:63]]) for d in DOMAINS])
    files = check_export(model, args.out, sample)
    timing["export_check_s"] = round(time.time() - t, 1)
    size = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file() and f.suffix != ".md")
    log(f"exported to {args.out}: {files}, directory {size / 1e6:.2f} MB (without MODEL_CARD.md); "
        f"Hub tensor names and re-loaded logits checked")

    train_log = dict(
        preset=args.preset, seed=args.seed, threads=args.threads, steps=args.steps, train_experts_impl=args.train_experts_impl,
        seq_len=SEQ_LEN, seqs_per_domain=SEQS_PER_DOMAIN, batch_sequences=len(DOMAINS) * SEQS_PER_DOMAIN,
        tokens_seen=tokens_seen, lr=LR, min_lr_frac=MIN_LR_FRAC, warmup=WARMUP, betas=BETAS,
        weight_decay=WEIGHT_DECAY, grad_clip=GRAD_CLIP, model_config=cfg, params=pc, timing=timing,
        directory_bytes=size, data=data_info, tokenizer_sha256=hashlib.sha256(
            (args.out / "tokenizer.json").read_bytes()).hexdigest(),
        versions=dict(torch=torch.__version__, transformers=transformers.__version__,
                      tokenizers=__import__("tokenizers").__version__, numpy=np.__version__),
        cpu=_cpu_name(), cpu_count=os.cpu_count(), history=history,
    )
    committed = args.out.resolve() == preset["out"].resolve()  # results only for the preset's own directory
    if committed:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{preset['results_prefix']}_train.json").write_text(json.dumps(train_log, indent=1) + "\n")
    else:
        (args.out / "train_log.json").write_text(json.dumps(train_log, indent=1) + "\n")

    if not args.no_measure:
        sys.path.insert(0, str(REPO / "tools"))
        import measure_default_model

        t = time.time()
        measure_default_model.run(args.out, threads=args.threads,
                                  results_prefix=preset["results_prefix"] if committed else None)
        timing["measure_s"] = round(time.time() - t, 1)
    timing["total_s"] = round(time.time() - T0, 1)
    log(f"timing: {json.dumps(timing)}")


def _cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
