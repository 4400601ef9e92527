#!/usr/bin/env python3
"""DeepSeek-V3's multi-token-prediction (MTP) draft forward in PyTorch, and its goldens for the fixtures.

Usage (from the repository root):

    tools/.venv/bin/python tools/mtp_reference.py [FIXTURE_DIR ...]

(default: tests/fixtures/models/deepseek_v3 and deepseek_v3_fp8). For each prompt of the fixture's reference.json
it writes `prompt{i}_mtp_logits.npy` [L, vocab] and `prompt{i}_mtp_chain_logits.npy` [3, vocab] and adds an `mtp`
section to reference.json, leaving every other key's bytes as they were.

transformers does not run the MTP layers (`model.layers.{num_hidden_layers + i}.*`, unexpected keys), so this is
written here after the public serving implementations: vLLM's `vllm/model_executor/models/deepseek_mtp.py` with
`vllm/v1/spec_decode/llm_base_proposer.py`, and SGLang's `python/sglang/srt/models/deepseek_nextn.py` with its
EAGLE worker. The decoder layer inside is transformers' own `DeepseekV3DecoderLayer` (MLA attention, YaRN rope,
sigmoid group-limited MoE), built with layer_idx = num_hidden_layers + i and loaded from the safetensors (FP8
matrices dequantized as tools/gen_model_fixtures.py does: fp8 x scale_inv in f32, rounded to bf16).

The MTP step, one row:

    x      = eh_proj( [ enorm(embed(token)) ; hnorm(hidden) ] )         embedding first, hidden second
    out    = DecoderLayer(x) at rotary position `pos`, attending to the MTP layer's own KV of earlier rows
    normed = shared_head.norm(out);  logits = head(normed)

Which hidden state and which positions (what both implementations do, read in the sources named):

- hidden (first step): the main model's last decoder layer output AFTER the final norm (`model.norm`), the same
  vector the main lm_head multiplies. vLLM: `GPUModelRunner` passes `target_hidden_states = hidden_states[:
  num_scheduled_tokens]`, the main model's forward output (DeepseekV2Model.forward ends in `self.norm`).
  SGLang: `LogitsProcessor.forward` returns as `hidden_states` the states it computed the logits from, and
  `EagleDraftInput` hands them to the draft (`spec_info.hidden_states`, read by `DeepseekModelNextN.forward`).
- alignment: row t combines the main hidden state at t with the embedding of token t+1, runs at rotary position
  t, and its logits predict token t+2. vLLM: `SpecDecodeBaseProposer.set_inputs_first_pass` shifts the input ids
  left by one, puts the newly sampled token in the last slot and keeps the target positions; SGLang:
  `EagleDraftInput.prepare_for_extend` sets input_ids = cat(input_ids[1:], verified_id), positions unchanged.
  A prompt of L tokens is one MTP "prefill" of L rows (the last row takes the main model's first sampled token).
- chain (k > 1 drafts with the one layer): the next step feeds the argmax draft's embedding with the MTP's OWN
  output hidden state at position + 1. The two differ on which output state: SGLang feeds it AFTER
  shared_head.norm (`DeepseekModelNextN.forward` returns `shared_head.norm(hidden_states, residual)`, the
  LogitsProcessor stores those, `EAGLEWorker.draft_forward` sets `hidden_states = logits_output.hidden_states`
  and `positions.add_(1)`); vLLM feeds it BEFORE (`DeepSeekMultiTokenPredictorLayer.forward` returns
  `residual + hidden_states`, the norm is applied only in `compute_logits` via `SharedHead.forward`, and
  `SpecDecodeBaseProposer.propose` loops on the forward's return). The goldens follow SGLang
  ("chain_hidden": "post_shared_head_norm"): the layer then always takes a normed state, as its first step does
  with the main model's; `checks.vllm_prenorm_chain_rel` measures the other choice.
- position 0: vLLM zeroes the embedding of the row at position 0 (`inputs_embeds[positions == 0] = 0` in
  `DeepSeekMultiTokenPredictorLayer.forward`), SGLang does not (nor does DeepSeek-V3's report, whose MTP uses
  every position). The goldens keep it ("position0_embedding": "kept"); `checks.vllm_position0_mask_rel`
  measures vLLM's choice.
- embedding and head: the layer's own `embed_tokens` / `shared_head.head` where the checkpoint has them (vLLM
  loads them, `DeepSeekMTP._rewrite_spec_layer_name` / `load_weights`), the main model's otherwise. SGLang always
  uses the main model's (`DeepseekV3ForCausalLMNextN.load_weights` skips both names); in the release they are
  equal. The fp8 fixture's are random and differ from the main model's; the section records which were used.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors import safe_open
from transformers.cache_utils import DynamicCache
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

from gen_model_fixtures import OUT_ROOT, fp8_dequantize, greedy_margin, load_saved, rel_diff, save_npy

FIXTURES = ["deepseek_v3", "deepseek_v3_fp8"]
CHAIN_STEPS = 3
TOLERANCE = 1e-4  # relative (max|a - b| / max|b|), issue 26's bound for the C++ draft logits
# The main model's hidden states come from a fresh load; deepseek_v3 reproduces its prompt_logits exactly,
# deepseek_v3_fp8 to 4.8e-6 abs (6e-7 relative) whichever way its weights are dequantized (they are bit-equal
# to the file's dequantized values): float rounding far under TOLERANCE.
MAIN_TOLERANCE = 1e-5
MIN_EFFECT = 1e-2  # a change to the MTP weights or conventions must move the logits at least this much


def load_main(d: Path, cfg: dict):
    """The main model as the fixture's reference computed it (f32; an FP8 checkpoint dequantized into bf16 by
    transformers, then run in f32), its weights in fresh storage as load_saved keeps them (an unaligned mapping
    can change BLAS rounding by an ulp)."""
    if "quantization_config" not in cfg:
        return load_saved(d)
    m = transformers.AutoModelForCausalLM.from_pretrained(
        str(d), quantization_config=transformers.FineGrainedFP8Config(dequantize=True), dtype=torch.bfloat16,
        attn_implementation="eager", experts_implementation="eager").float()
    m.eval()
    with torch.no_grad():
        for p in m.parameters():
            p.data = p.data.clone()
    return m


def read_mtp_tensors(d: Path, cfg: dict, layer: int):
    """{name without the model.layers.{layer}. prefix: f32 tensor}, FP8 matrices dequantized."""
    prefix = f"model.layers.{layer}."
    block = cfg.get("quantization_config", {}).get("weight_block_size")
    files = sorted(d.glob("*.safetensors"))
    raw = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                if k.startswith(prefix):
                    raw[k[len(prefix):]] = st.get_tensor(k)
    out = {}
    for name, t in raw.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            out[name] = fp8_dequantize(t, raw[name + "_scale_inv"], block)
        else:
            out[name] = t.to(torch.float32)
    if "eh_proj.weight" not in out:
        raise SystemExit(f"{d}: no MTP layer {layer} (model.layers.{layer}.eh_proj.weight)")
    return out


def module_state_dict(w: dict, n_experts: int):
    """The checkpoint's tensors of one MTP layer -> MTPLayer's state dict: the same names, but the per-expert
    matrices fused as transformers holds them ([E, 2I, H] gate then up, [E, H, I])."""
    sd = {k: v for k, v in w.items() if ".experts." not in k}
    if "mlp.experts.0.gate_proj.weight" in w:
        e = range(n_experts)
        sd["mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([w[f"mlp.experts.{i}.gate_proj.weight"], w[f"mlp.experts.{i}.up_proj.weight"]]) for i in e])
        sd["mlp.experts.down_proj"] = torch.stack([w[f"mlp.experts.{i}.down_proj.weight"] for i in e])
    return sd


def checkpoint_tensors(mtp, embed=None, head=None):
    """module_state_dict's inverse: {name inside model.layers.{layer}.: tensor} in DeepSeek-V3's per-expert layout;
    `embed` / `head` are written as the layer's embed_tokens / shared_head.head where given (the release stores
    copies of the main model's)."""
    out = {}
    for k, v in mtp.state_dict().items():
        if k == "mlp.experts.gate_up_proj":
            inter = v.shape[1] // 2
            for i in range(v.shape[0]):
                out[f"mlp.experts.{i}.gate_proj.weight"] = v[i, :inter]
                out[f"mlp.experts.{i}.up_proj.weight"] = v[i, inter:]
        elif k == "mlp.experts.down_proj":
            for i in range(v.shape[0]):
                out[f"mlp.experts.{i}.down_proj.weight"] = v[i]
        else:
            out[k] = v
    if embed is not None:
        out["embed_tokens.weight"] = embed
    if head is not None:
        out["shared_head.head.weight"] = head
    return {k: v.detach().contiguous() for k, v in out.items()}


class MTPLayer(DeepseekV3DecoderLayer):
    """One MTP module as a torch module, so that tools/train_mtp_model.py trains this very class: transformers'
    decoder layer (its parameters under the checkpoint's names: input_layernorm, self_attn.*, mlp.*) plus enorm,
    hnorm, eh_proj and shared_head.norm, and embed_tokens / shared_head.head where the layer has its own. Without
    them it uses the main model's (shared, as DeepSeek-V3's report, section 2.2, and SGLang do); those, and the
    rotary embedding, are held in a tuple so that they are not registered as this module's parameters."""

    def __init__(self, main, layer: int, own_embed: bool = False, own_head: bool = False):
        cfg = main.config
        super().__init__(cfg, layer_idx=layer)
        self.layer = layer
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = DeepseekV3RMSNorm(h, eps=eps)
        self.hnorm = DeepseekV3RMSNorm(h, eps=eps)
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        self.shared_head = torch.nn.Module()
        self.shared_head.norm = DeepseekV3RMSNorm(h, eps=eps)
        self.own_embed, self.own_head = own_embed, own_head
        if own_embed:
            self.embed_tokens = torch.nn.Embedding(cfg.vocab_size, h)
        if own_head:
            self.shared_head.head = torch.nn.Linear(h, cfg.vocab_size, bias=False)
        self.shared = (main.model.embed_tokens, main.lm_head, main.model.rotary_emb)

    @classmethod
    def from_checkpoint(cls, main, w: dict, layer: int):
        """The layer with the checkpoint's tensors `w` (read_mtp_tensors), f32, eval mode."""
        m = cls(main, layer, own_embed="embed_tokens.weight" in w, own_head="shared_head.head.weight" in w)
        m.load_state_dict(module_state_dict(w, main.config.n_routed_experts), strict=True)
        return m.float().eval()

    def forward(self, tokens, hidden, positions, cache=None, zero_position0=False, prenorm_out=False):
        """Rows [B, n]: tokens [B, n], hidden [B, n, H], positions [n] (consecutive, shared by the batch), the MTP
        layer's cache holding every earlier row (or None: no earlier rows, nothing cached). Returns (logits
        [B, n, vocab], the hidden state a chained step takes)."""
        embed_tokens, lm_head, rotary = self.shared
        e = (self.embed_tokens if self.own_embed else embed_tokens)(tokens)
        if zero_position0:
            e = torch.where((positions == 0)[None, :, None], torch.zeros_like(e), e)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden)], -1))
        pos = positions[None]
        n, past = tokens.shape[1], int(positions[0])
        mask = None
        if n > 1:  # causal over this block's rows; every cached row is earlier, so visible
            future = torch.arange(past + n)[None, :] > (past + torch.arange(n))[:, None]
            mask = torch.zeros(n, past + n).masked_fill(future, torch.finfo(torch.float32).min)[None, None]
        out = super().forward(x, attention_mask=mask, position_ids=pos, past_key_values=cache,
                              use_cache=cache is not None, position_embeddings=rotary(x, pos))
        normed = self.shared_head.norm(out)
        logits = (self.shared_head.head if self.own_head else lm_head)(normed)
        return logits, (out if prenorm_out else normed)

    def step(self, tokens, hidden, positions, cache, zero_position0=False, prenorm_out=False):
        """forward for the rows [n] of one sequence: tokens [n], hidden [n, H]."""
        logits, h = self(tokens[None], hidden[None], positions, cache, zero_position0, prenorm_out)
        return logits[0], h[0]


def main_hidden(main, ids):
    """The main model's hidden states of a prompt: after the final norm (the convention), and before it."""
    seen = {}
    hook = main.model.norm.register_forward_hook(lambda mod, args, out: seen.update(pre=args[0][0], post=out[0]))
    logits = main(input_ids=ids[None]).logits[0]
    hook.remove()
    return seen["post"], seen["pre"], logits


def prefill(mtp, ids, next_token, hidden, **kw):
    """The whole prompt as one MTP prefill: row t takes hidden[t] and token t+1 (the main model's next token for
    the last row) at position t."""
    tokens = torch.cat([ids[1:], torch.tensor([next_token])])
    return mtp.step(tokens, hidden, torch.arange(ids.shape[0]), DynamicCache(), **kw)[0]


def chain(mtp, ids, next_token, hidden, prenorm_out=False):
    """A serving engine's draft pass, row by row against the cache: rows 0..L-2 as a prefill, the last prompt
    row alone (the input row: its argmax is the first draft), then CHAIN_STEPS steps each fed the previous
    argmax and the previous row's output state at the next position. Returns (input row logits [vocab],
    chain logits [CHAIN_STEPS, vocab], draft ids [CHAIN_STEPS + 1])."""
    L = ids.shape[0]
    cache = DynamicCache()
    if L > 1:
        mtp.step(ids[1:], hidden[:L - 1], torch.arange(L - 1), cache, prenorm_out=prenorm_out)
    logits, h = mtp.step(torch.tensor([next_token]), hidden[L - 1:], torch.tensor([L - 1]), cache,
                         prenorm_out=prenorm_out)
    first = logits[0]
    drafts = [int(first.argmax())]
    rows = []
    for j in range(CHAIN_STEPS):
        logits, h = mtp.step(torch.tensor([drafts[-1]]), h, torch.tensor([L + j]), cache, prenorm_out=prenorm_out)
        rows.append(logits[0])
        drafts.append(int(logits[0].argmax()))
    return first, torch.stack(rows), drafts


def write_section(d: Path, section: dict):
    """Adds (or replaces) reference.json's `mtp` key; every other byte of the file stays as it was."""
    path = d / "reference.json"
    text = path.read_text()
    ref = json.loads(text)
    had_section = ref.pop("mtp", None) is not None
    base = json.dumps(ref, indent=1) + "\n"
    if not had_section and base != text:
        raise SystemExit(f"{path}: not in the generator's json.dumps(indent=1) form; refusing to rewrite it")
    ref["mtp"] = section
    new = json.dumps(ref, indent=1) + "\n"
    if not new.startswith(base[:-3]):  # base ends in "\n}\n": the new key is appended before the last brace
        raise SystemExit(f"{path}: adding the mtp section would change other keys")
    path.write_text(new)


def record(d: Path):
    cfg = json.loads((d / "config.json").read_text())
    ref = json.loads((d / "reference.json").read_text())
    if cfg.get("num_nextn_predict_layers", 0) != 1:
        raise SystemExit(f"{d}: expected one MTP layer")
    layer = cfg["num_hidden_layers"]
    main = load_main(d, cfg)
    w = read_mtp_tensors(d, cfg, layer)
    mtp = MTPLayer.from_checkpoint(main, w, layer)
    checks = {"main_logits_vs_reference_rel": 0.0, "chain_input_row_vs_prefill_last_row_rel": 0.0,
              "min_draft_margin_rel": float("inf"),
              "eh_proj_zeroed_rel": float("inf"), "pre_final_norm_hidden_rel": float("inf"),
              "vllm_position0_mask_rel": float("inf"), "vllm_prenorm_chain_rel": float("inf")}
    zeroed = MTPLayer.from_checkpoint(main, {**w, "eh_proj.weight": torch.zeros_like(w["eh_proj.weight"])}, layer)
    prompts = []
    for i, p in enumerate(ref["prompts"]):
        ids = torch.tensor(p["input_ids"])
        nxt = p["greedy_ids"][0]
        with torch.no_grad():
            post, pre, main_logits = main_hidden(main, ids)
            want = torch.from_numpy(np.load(d / p["prompt_logits"]))
            checks["main_logits_vs_reference_rel"] = max(checks["main_logits_vs_reference_rel"],
                                                         rel_diff(main_logits, want))
            logits = prefill(mtp, ids, nxt, post)
            first, rows, drafts = chain(mtp, ids, nxt, post)
            # (top1 - top2) / max|logit| of every draft: a C++ chain feeds back the same argmax unless this is
            # within its rounding
            checks["min_draft_margin_rel"] = min(checks["min_draft_margin_rel"],
                                                 greedy_margin(torch.cat([first[None], rows])))
            checks["chain_input_row_vs_prefill_last_row_rel"] = max(
                checks["chain_input_row_vs_prefill_last_row_rel"], rel_diff(first, logits[-1]))
            # Not vacuous: the weights and each convention choice visibly move the goldens.
            effects = {
                "eh_proj_zeroed_rel": rel_diff(prefill(zeroed, ids, nxt, post), logits),
                "pre_final_norm_hidden_rel": rel_diff(prefill(mtp, ids, nxt, pre), logits),
                "vllm_position0_mask_rel": rel_diff(prefill(mtp, ids, nxt, post, zero_position0=True), logits),
                "vllm_prenorm_chain_rel": rel_diff(chain(mtp, ids, nxt, post, prenorm_out=True)[1], rows),
            }
        for k, v in effects.items():
            checks[k] = min(checks[k], v)
        L = len(p["input_ids"])
        prompts.append({
            "input_ids": p["input_ids"][1:] + [nxt],
            "positions": [0, L - 1],
            "mtp_logits": save_npy(d, f"prompt{i}_mtp_logits.npy", logits),
            "mtp_chain": {
                "input_ids": drafts[:CHAIN_STEPS],
                "positions": [L, L + CHAIN_STEPS - 1],
                "logits": save_npy(d, f"prompt{i}_mtp_chain_logits.npy", rows),
                "draft_ids": drafts,
            },
        })
    if checks["main_logits_vs_reference_rel"] > MAIN_TOLERANCE:
        raise SystemExit(f"{d}: the main model does not reproduce prompt_logits "
                         f"({checks['main_logits_vs_reference_rel']:.3g})")
    if checks["chain_input_row_vs_prefill_last_row_rel"] > TOLERANCE:
        raise SystemExit(f"{d}: the cached input row differs from the prefill's last row")
    for k in ("eh_proj_zeroed_rel", "pre_final_norm_hidden_rel", "vllm_position0_mask_rel"):
        if checks[k] < MIN_EFFECT:
            raise SystemExit(f"{d}: {k} = {checks[k]:.3g} < {MIN_EFFECT}: the goldens would not tell it apart")
    if checks["vllm_prenorm_chain_rel"] < MIN_EFFECT:
        raise SystemExit(f"{d}: the chained hidden state's norm does not show in the chain logits")
    write_section(d, {
        "generator": "tools/mtp_reference.py",
        "layer": layer,
        "hidden": "post_final_norm",
        "chain_hidden": "post_shared_head_norm",
        "position0_embedding": "kept",
        "eh_proj_input": "[enorm(embed(token)), hnorm(hidden)]",
        "embed": "mtp_embed_tokens" if mtp.own_embed else "main_embed_tokens",
        "head": "mtp_shared_head_head" if mtp.own_head else "main_lm_head",
        "note": "prompts[i].mtp_logits [L, vocab]: the prompt as one MTP prefill; row t takes the main model's "
                "hidden state at t and input_ids[t] (= prompt token t+1; the last row the first greedy id) at "
                "rotary position t, with the MTP layer's own causal KV over the L rows; its logits predict "
                "token t+2. mtp_chain: the last row's argmax is draft_ids[0]; step j (0-based) takes "
                "input_ids[j] = draft_ids[j] and the previous row's MTP output after shared_head.norm at "
                "position L + j against the cache, and its logits [j] give draft_ids[j + 1]. positions are "
                "[first, last]. All f32 on CPU with transformers' DeepseekV3DecoderLayer (eager).",
        "prompts": prompts,
        "checks": checks,
    })
    print(f"{d}: {len(prompts)} prompts, checks {json.dumps(checks)}", flush=True)


def main():
    torch.set_num_threads(min(2, torch.get_num_threads()))
    torch.use_deterministic_algorithms(True)
    dirs = [Path(a) for a in sys.argv[1:]] or [OUT_ROOT / f for f in FIXTURES]
    for d in dirs:
        record(d)


if __name__ == "__main__":
    main()
