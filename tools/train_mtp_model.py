#!/usr/bin/env python3
"""Train capserve-dsv3-mtp-tiny: a small DeepSeek-V3-shaped model (transformers' DeepseekV3ForCausalLM) with one
multi-token-prediction (MTP) layer, trained on the five-domain corpus so that speculative decoding's acceptance
rates measured on it are real (issue 26, "A model to measure it on").

Usage (from the repository root; CPU only; the per-step seconds are printed, see tools/README.md for the full
run's figure):

    tools/.venv/bin/python tools/train_mtp_model.py                     # -> deploy/models/capserve-dsv3-mtp-tiny
    tools/.venv/bin/python tools/train_mtp_model.py --steps 20 --out /tmp/mtp_smoke   # smoke run

What it does, deterministically (fixed seeds and step count, --threads as for train_default_model.py):

 1. Data: train_default_model.py's split of each domain file (split_point: the last ~5% held out) and its batches
    (sample_batch: <|endoftext|> + 255 tokens of one domain, 4 sequences per domain), encoded with
    deploy/models/capserve-moe-tiny's tokenizer.json (not retrained: both models share the vocabulary and the
    exported tokenizer files are checked to be byte-identical to the default model's).
 2. Model: MODEL_CONFIG, DeepSeek-V3's shape scaled down (layer 0 dense, then MoE layers of 16 sigmoid-routed
    experts, top-2 within the best 2 of 4 groups, 1 shared expert; MLA with a q LoRA rank; YaRN; interleaved
    rope) with num_nextn_predict_layers 1, plus ONE MTP module: tools/mtp_reference.py's MTPLayer, the very class
    the reference forward loads from a checkpoint, so training and reference cannot drift. It is layer
    num_hidden_layers; its embedding and output head are the main model's (shared, as in the report).
 3. Loss (DeepSeek-V3 Technical Report, arXiv:2412.19437, section 2.2 "Multi-Token Prediction", "MTP Training
    Objective"): L = L_main + lambda / D * sum_k L_MTP^k with depth D = 1 and lambda = 0.3, the report's value
    for the first 10T tokens (section 4.2, "Training Hyper-Parameters": 0.3, then 0.1 for the remaining 4.8T;
    at this scale the whole run is "early"). The MTP row t takes the main model's hidden state at t after the
    final norm and the embedding of token t+1 (tools/mtp_reference.py's conventions, the ones the C++ follows)
    and predicts token t+2. Nothing is detached: L_MTP's gradients reach the main model through its hidden
    states and the shared embedding and head, as in the report (the MTP modules are dropped only at inference).
    Routing balance as in the report (section 2.1.2), the MTP layer's MoE included: auxiliary-loss-free, after
    every step each MoE layer's e_score_correction_bias moves by gamma against its expert's load over the step
    (b_i -= gamma * sign(load_i - mean load)), plus alpha times the complementary sequence-wise balance loss;
    gamma = 0.001 (section 4.2) and alpha = 0.01, not the report's 0.0001 (see BALANCE_ALPHA);
    --bias-update-speed and --balance-alpha change them.
    Optimizer and schedule: train_default_model.py's (AdamW, warmup + cosine, clip 1.0).
 4. Held-out eval: EVAL_SEQS_PER_DOMAIN windows per domain of the held-out split: main and MTP cross-entropy,
    the MTP top-1 accuracy against the text's token t+2, and its agreement with the main model's greedy token
    at t+1 (= the greedy draft acceptance at draft position 0 on held-out text).
 5. Export in the released layout: train_default_model.export (bf16 model.safetensors, config.json,
    generation_config.json, tokenizer files) with e_score_correction_bias in F32 as DeepSeek-V3 ships it, checked
    by train_default_model.check_export (exact Hub names and values, re-loaded logits identical, tokenizer); then
    the MTP layer appended as model.layers.{num_hidden_layers}.* under tools/add_mtp_layers.py's names (its
    decoder layer's, enorm, hnorm, eh_proj, shared_head.norm and copies of the shared embed_tokens /
    shared_head.head, as released). Checks after that: transformers still loads it (ignoring the MTP tensors)
    with identical logits; mtp_reference.py's forward from the exported files reproduces the trained module's
    MTP logits (relative 1e-5); capserve-generate loads it (MTP layer recognised and skipped) and its logits
    match transformers'.

Writes train_log.json (configuration, timing, per-step history, held-out figures) into the output directory.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_model_fixtures as gmf  # noqa: E402
import mtp_reference  # noqa: E402
import train_default_model as tdm  # noqa: E402

REPO = tdm.REPO
DEFAULT_OUT = REPO / "deploy" / "models" / "capserve-dsv3-mtp-tiny"
TOKENIZER_DIR = tdm.DEFAULT_OUT  # deploy/models/capserve-moe-tiny
GENERATE = REPO / "build" / "runtime" / "capserve-generate"

MTP_LAMBDA = 0.3  # DeepSeek-V3 report, section 4.2: 0.3 for the first 10T tokens
BIAS_UPDATE_SPEED = 0.001  # gamma, section 4.2 (aux-loss-free balancing, section 2.1.2)
# alpha of the sequence-wise balance loss: the report's 0.0001 (section 4.2) leaves the balancing to the bias, whose
# gamma moves it at most 0.001 a step, enough over the report's ~10^5 steps but not over 1,200: in 20-step runs one
# layer's routing collapsed onto 2 experts (max/mean expert load 8.0 at steps 16-19; 5.5-6.3 with gamma 0.01),
# while alpha 0.01 held it at 2.6-4.4.
BALANCE_ALPHA = 0.01
EVAL_SEQS_PER_DOMAIN = 8
MAIN_TOLERANCE = 1e-5  # the reference MTP forward from the exported files against the trained module (relative)
GENERATE_TOLERANCE = 1e-3  # capserve-generate's logits against transformers' (relative; bf16 weights, f32 compute)

# DeepSeek-V3 (hidden 7168, 61 layers, 3 dense, 256 routed experts top-8 in 8 groups / best 4, 1 shared expert,
# MLA q LoRA 1536 / kv LoRA 512 / nope 128 / rope 64 / v 128, YaRN factor 40 over 4096) scaled down.
MODEL_CONFIG = dict(
    vocab_size=tdm.VOCAB_SIZE,
    hidden_size=256,
    intermediate_size=1024,  # the dense layer 0
    moe_intermediate_size=128,  # per routed expert and the shared one
    num_hidden_layers=4,
    first_k_dense_replace=1,
    n_routed_experts=16,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=4,  # 4 experts per group; a token's experts come from its best topk_group groups
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=96,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    rope_interleave=True,
    max_position_embeddings=tdm.MAX_POSITION_EMBEDDINGS,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": tdm.SEQ_LEN, "beta_fast": 32,
                     "beta_slow": 1},
    rms_norm_eps=1e-6,
    hidden_act="silu",
    initializer_range=0.02,
    attention_bias=False,
    attention_dropout=0.0,
    tie_word_embeddings=False,
    num_nextn_predict_layers=1,
    pad_token_id=tdm.MODEL_CONFIG["pad_token_id"],
    bos_token_id=tdm.MODEL_CONFIG["bos_token_id"],
    eos_token_id=tdm.MODEL_CONFIG["eos_token_id"],
)


def log(*a):
    print(*a, flush=True)


def build(seed: int):
    """(main model, MTP module), f32, eager attention and experts, initialised as transformers initialises the
    main model."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM._from_config(DeepseekV3Config(**MODEL_CONFIG), attn_implementation="eager",
                                               experts_implementation="eager", dtype=torch.float32)
    mtp = mtp_reference.MTPLayer(model, MODEL_CONFIG["num_hidden_layers"])
    with torch.no_grad():
        for m in mtp.modules():
            model._init_weights(m)
    return model, mtp


def routers(model, mtp):
    """Every MoE router: the main model's and the MTP layer's."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    return [m for m in list(model.modules()) + list(mtp.modules()) if isinstance(m, DeepseekV3TopkRouter)]


def forward(model, mtp, x):
    """Main logits [B, T, V] and MTP logits [B, T-2, V] of a batch x [B, T]: MTP row t takes the main model's
    post-final-norm hidden state at t and token t+1, and predicts token t+2 (rows whose target is past the
    sequence are not computed)."""
    h = model.model(input_ids=x).last_hidden_state
    logits = model.lm_head(h)
    t = x.shape[1]
    mtp_logits, _ = mtp(x[:, 1:t - 1], h[:, :t - 2], torch.arange(t - 2))
    return logits, mtp_logits


def ce(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def sequence_balance_loss(routed, batch: int):
    """DeepSeek-V3's complementary sequence-wise balance loss (report, section 2.1.2, eqs. 17-20) without its
    alpha, summed over the MoE layers and averaged over the sequences: sum_i f_i P_i with f_i = N_r / (K_r T) *
    (tokens of the sequence routed to expert i) and P_i the sequence's mean of expert i's normalised sigmoid score."""
    total = 0.0
    for router_logits, topk_indices in routed:
        n_experts = router_logits.shape[-1]
        scores = torch.sigmoid(router_logits).view(batch, -1, n_experts)
        p = (scores / scores.sum(-1, keepdim=True)).mean(1)
        idx = topk_indices.view(batch, -1)
        counts = torch.zeros(batch, n_experts).scatter_add_(1, idx, torch.ones(idx.shape))
        f = counts * n_experts / idx.shape[1]  # idx holds T * K_r entries per sequence
        total = total + (f * p).sum(-1).mean()
    return total


def train(model, mtp, train_ids: dict, steps: int, seed: int, mtp_lambda: float, bias_speed: float,
          balance_alpha: float, log_every: int):
    rng = np.random.default_rng(seed)
    params = list(model.named_parameters()) + list(mtp.named_parameters())
    opt = tdm.make_optimizer(params)
    routed = []  # (router, router logits, top-k indices) of this step's forward

    def record(router, args, out):
        if router.training:
            routed.append((router, out[0], out[2]))

    hooks = [r.register_forward_hook(record) for r in routers(model, mtp)]
    model.train()
    mtp.train()
    history, step_s = [], []
    t0 = time.time()
    for step in range(steps):
        ts = time.time()
        x = tdm.sample_batch(rng, train_ids)
        lr = tdm.lr_at(step, steps)
        for g in opt.param_groups:
            g["lr"] = lr
        routed.clear()
        logits, mtp_logits = forward(model, mtp, x)
        main_loss = ce(logits[:, :-1], x[:, 1:])
        mtp_loss = ce(mtp_logits, x[:, 2:])
        bal_loss = sequence_balance_loss([r[1:] for r in routed], x.shape[0])
        opt.zero_grad(set_to_none=True)
        (main_loss + mtp_lambda * mtp_loss + balance_alpha * bal_loss).backward()
        gnorm = torch.nn.utils.clip_grad_norm_([p for _, p in params], tdm.GRAD_CLIP)
        opt.step()
        imbalance = []
        with torch.no_grad():
            for r, _, idx in routed:
                load = torch.bincount(idx.flatten(), minlength=r.num_experts).float()
                r.e_score_correction_bias -= bias_speed * torch.sign(load - load.mean())
                imbalance.append(float(load.max() / load.mean()))
        step_s.append(time.time() - ts)
        if step % log_every == 0 or step == steps - 1:
            el = time.time() - t0
            rec = dict(step=step, main_loss=round(main_loss.item(), 4), mtp_loss=round(mtp_loss.item(), 4),
                       balance_loss=round(bal_loss.item(), 4),
                       grad_norm=round(float(gnorm), 3), lr=lr, max_expert_load_over_mean=round(max(imbalance), 3),
                       step_s=round(step_s[-1], 3), elapsed_s=round(el, 1))
            history.append(rec)
            log(f"step {step:5d}/{steps}  main {rec['main_loss']:.4f}  mtp {rec['mtp_loss']:.4f}  "
                f"|g| {rec['grad_norm']:.2f}  lr {lr:.2e}  load max/mean {rec['max_expert_load_over_mean']:.2f}  "
                f"{step_s[-1]:.2f} s/step (mean {el / (step + 1):.2f})  "
                f"eta {el / (step + 1) * (steps - step - 1):.0f} s")
    for hk in hooks:
        hk.remove()
    model.eval()
    mtp.eval()
    return history, step_s


def heldout_batch(held_ids: dict):
    """EVAL_SEQS_PER_DOMAIN consecutive windows of each domain's held-out tokens, each after <|endoftext|>."""
    bos = MODEL_CONFIG["bos_token_id"]
    n = tdm.SEQ_TEXT_TOKENS
    rows = [np.concatenate([[bos], held_ids[d][i * n:(i + 1) * n]])
            for d in tdm.DOMAINS for i in range(min(EVAL_SEQS_PER_DOMAIN, len(held_ids[d]) // n))]
    return torch.from_numpy(np.stack(rows))


def evaluate(model, mtp, x):
    """Held-out main and MTP cross-entropy, MTP top-1 accuracy against the text, and the draft acceptance at
    position 0 under greedy verification (the MTP's argmax for token t+2 equals the main model's argmax at t+1)."""
    with torch.no_grad():
        logits, mtp_logits = forward(model, mtp, x)
        draft = mtp_logits.argmax(-1)
        return dict(sequences=int(x.shape[0]), main_loss=round(float(ce(logits[:, :-1], x[:, 1:])), 4),
                    mtp_loss=round(float(ce(mtp_logits, x[:, 2:])), 4),
                    mtp_top1_vs_text=round(float((draft == x[:, 2:]).float().mean()), 4),
                    mtp_accept_greedy_pos0=round(float((draft == logits[:, 1:-1].argmax(-1)).float().mean()), 4))


def rewrite_safetensors(path: Path, tensors: dict):
    """Adds (or replaces) tensors in a single-file checkpoint."""
    from safetensors.torch import load_file, save_file

    all_tensors = load_file(str(path))
    all_tensors.update({k: v.contiguous() for k, v in tensors.items()})
    save_file(all_tensors, str(path), metadata={"format": "pt"})


def export(model, mtp, hf_tok, out: Path, sample):
    layer = MODEL_CONFIG["num_hidden_layers"]
    tdm.export(model, hf_tok, out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (out / f).read_bytes() != (TOKENIZER_DIR / f).read_bytes():
            raise gmf.CheckFailed(f"{out / f} differs from {TOKENIZER_DIR / f}")
    # export() writes every tensor in bf16; the correction bias is F32 in DeepSeek-V3's release
    rewrite_safetensors(out / "model.safetensors", {
        k: v for k, v in model.state_dict().items() if k.endswith("e_score_correction_bias")})
    files = tdm.check_export(model, out, sample)
    prefix = f"model.layers.{layer}."
    mtp_tensors = mtp_reference.checkpoint_tensors(mtp, embed=model.model.embed_tokens.weight,
                                                   head=model.lm_head.weight)
    rewrite_safetensors(out / "model.safetensors", {
        prefix + k: v if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)
        for k, v in mtp_tensors.items()})
    return files, len(mtp_tensors)


def check_mtp_export(model, mtp, out: Path, sample):
    """transformers loads the directory (the MTP tensors ignored) with identical logits, and mtp_reference's
    forward from the exported files reproduces the trained module's MTP logits. Returns the largest relative
    difference of the latter."""
    from safetensors import safe_open

    cfg = json.loads((out / "config.json").read_text())
    layer = cfg["num_hidden_layers"]
    if cfg.get("num_nextn_predict_layers") != 1:
        raise gmf.CheckFailed("config.json lacks num_nextn_predict_layers 1")
    with safe_open(str(out / "model.safetensors"), "pt") as s:
        names = set(s.keys())
    want = {f"model.layers.{layer}.{n}" for n in mtp_reference.checkpoint_tensors(mtp, model.model.embed_tokens.weight,
                                                                                 model.lm_head.weight)}
    if want - names or names - gmf.expected_hub_names(model.config) - want:
        raise gmf.CheckFailed(f"MTP tensor names: missing {sorted(want - names)[:4]}")
    main = mtp_reference.load_main(out, cfg)
    ref = mtp_reference.MTPLayer.from_checkpoint(main, mtp_reference.read_mtp_tensors(out, cfg, layer), layer)
    worst = 0.0
    with torch.no_grad():
        for ids in torch.as_tensor(sample):
            post, _, main_logits = mtp_reference.main_hidden(main, ids)
            h = model.model(input_ids=ids[None]).last_hidden_state[0]
            if not torch.equal(main_logits, model.lm_head(h)):
                raise gmf.CheckFailed("re-loaded main logits differ with the MTP tensors in the file")
            nxt = int(main_logits[-1].argmax())
            want_logits = mtp.step(torch.cat([ids[1:], torch.tensor([nxt])]), h, torch.arange(ids.shape[0]), None)[0]
            worst = max(worst, gmf.rel_diff(mtp_reference.prefill(ref, ids, nxt, post), want_logits))
    if worst > MAIN_TOLERANCE:
        raise gmf.CheckFailed(f"mtp_reference's forward from {out} differs from the trained module: {worst:.3g}")
    return worst


def check_generate(binary: Path, model, out: Path):
    """capserve-generate loads the directory (the MTP layer recognised and skipped) and its logits for the prompt
    "1 2 3" match transformers' greedy steps. Returns (its token ids, the largest relative logit difference)."""
    prompt, steps = [1, 2, 3], 4
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp) / "logits.npy"
        r = subprocess.run([str(binary), "--model", str(out), "--input-ids", " ".join(map(str, prompt)),
                            "--max-new-tokens", str(steps), "--ignore-eos", "--dump-logits", str(dump)],
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise gmf.CheckFailed(f"capserve-generate failed ({r.returncode}): {r.stderr[-2000:]}")
        got = torch.from_numpy(np.load(dump))
    ids = [int(t) for t in r.stdout.split()]
    seq, want = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            want.append(model(input_ids=torch.tensor([seq])).logits[0, -1])
            seq.append(int(want[-1].argmax()))
    rel = gmf.rel_diff(got, torch.stack(want))
    if ids[-steps:] != seq[len(prompt):] or rel > GENERATE_TOLERANCE:
        raise gmf.CheckFailed(f"capserve-generate: ids {ids} vs transformers {seq[len(prompt):]}, logits rel {rel:.3g}")
    return ids, rel


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=tdm.STEPS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=tdm.SEED)
    ap.add_argument("--mtp-lambda", type=float, default=MTP_LAMBDA)
    ap.add_argument("--bias-update-speed", type=float, default=BIAS_UPDATE_SPEED)
    ap.add_argument("--balance-alpha", type=float, default=BALANCE_ALPHA)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--capserve-generate", type=Path, default=GENERATE,
                    help="the binary that must load the result (default: this checkout's build; skipped if absent)")
    args = ap.parse_args()

    import tokenizers
    import transformers

    torch.set_num_threads(args.threads)
    t_start = time.time()
    timing = {}

    t = time.time()
    tok = tokenizers.Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    hf_tok = tdm.make_hf_tokenizer(tok)
    splits = tdm.load_splits(tdm.CORPUS)
    train_ids = {d: tdm.encode(tok, splits[d][0]) for d in tdm.DOMAINS}
    held_ids = {d: tdm.encode(tok, splits[d][1]) for d in tdm.DOMAINS}
    timing["data_s"] = round(time.time() - t, 1)
    log(f"data: {tdm.CORPUS}, train {sum(map(len, train_ids.values()))} tokens, held-out "
        f"{sum(map(len, held_ids.values()))} tokens ({timing['data_s']} s)")

    model, mtp = build(args.seed)
    n_main = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in mtp.parameters())
    log(f"model: DeepseekV3ForCausalLM {n_main / 1e6:.2f} M parameters + MTP layer {n_mtp / 1e6:.2f} M "
        f"(embedding and head shared), lambda {args.mtp_lambda}")

    history, step_s = train(model, mtp, train_ids, args.steps, args.seed, args.mtp_lambda,
                                  args.bias_update_speed, args.balance_alpha, args.log_every)
    timing["train_s"] = round(sum(step_s), 1)
    # the first steps pay for allocation warm-up; the median is what a long run averages to
    timing["step_s_median"] = round(float(np.median(step_s)), 3)
    log(f"trained {args.steps} steps in {timing['train_s']} s: median {timing['step_s_median']} s/step "
        f"({args.threads} threads)")

    tdm.round_to_bf16_(model)
    tdm.round_to_bf16_(mtp)
    heldout = evaluate(model, mtp, heldout_batch(held_ids))
    log(f"held-out: {json.dumps(heldout)}")

    t = time.time()
    sample = np.stack([np.concatenate([[0], held_ids[d][:63]]) for d in tdm.DOMAINS])
    files, n_mtp_tensors = export(model, mtp, hf_tok, args.out, sample)
    mtp_rel = check_mtp_export(model, mtp, args.out, sample)
    log(f"exported to {args.out}: {files} with {n_mtp_tensors} MTP tensors (model.layers."
        f"{MODEL_CONFIG['num_hidden_layers']}.*); transformers re-load exact, mtp_reference vs trained module "
        f"rel {mtp_rel:.3g}")
    checks = dict(mtp_reference_vs_trained_rel=mtp_rel)
    if args.capserve_generate.exists():
        ids, rel = check_generate(args.capserve_generate, model, args.out)
        checks.update(capserve_generate_ids=ids, capserve_generate_logits_rel=rel)
        log(f"{args.capserve_generate} loads it: ids {ids}, logits vs transformers rel {rel:.3g}")
    else:
        log(f"{args.capserve_generate} not found: capserve-generate's load not checked")
    timing["export_check_s"] = round(time.time() - t, 1)
    timing["total_s"] = round(time.time() - t_start, 1)

    (args.out / "train_log.json").write_text(json.dumps(dict(
        seed=args.seed, threads=args.threads, steps=args.steps, mtp_lambda=args.mtp_lambda,
        bias_update_speed=args.bias_update_speed, balance_alpha=args.balance_alpha, seq_len=tdm.SEQ_LEN,
        batch_sequences=len(tdm.DOMAINS) * tdm.SEQS_PER_DOMAIN,
        lr=tdm.LR, warmup=tdm.WARMUP, model_config=MODEL_CONFIG, params=dict(main=n_main, mtp=n_mtp),
        heldout=heldout, checks=checks, timing=timing,
        versions=dict(torch=torch.__version__, transformers=transformers.__version__), cpu=tdm._cpu_name(),
        history=history), indent=1) + "\n")
    log(f"timing: {json.dumps(timing)}")


if __name__ == "__main__":
    main()
