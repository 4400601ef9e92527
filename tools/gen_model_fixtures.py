#!/usr/bin/env python3
"""Generate tiny random Hugging Face MoE checkpoints and record HF transformers' reference outputs.

Usage (from the repository root):

    tools/.venv/bin/python tools/gen_model_fixtures.py [FIXTURE ...]

Writes tests/fixtures/models/<fixture>/ (deleting tests/fixtures/models/ first; with FIXTURE names, only those
directories are rewritten) and tests/fixtures/models/README.md:

    config.json, generation_config.json          as written by save_pretrained
    model.safetensors  or  model-0000X-of-0000N.safetensors + model.safetensors.index.json
    reference.json + *.npy                       HF reference outputs (see README.md written next to them)

The checkpoints use the classic per-expert Hub tensor names (Mixtral `block_sparse_moe.experts.E.w1/w2/w3`,
OLMoE/Qwen2-MoE/DeepSeek-V2 `mlp.experts.E.{gate,up,down}_proj`). transformers v5 fuses the experts in memory
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) and its save_pretrained reverses that
conversion; this script checks the written names and values tensor by tensor against the in-memory model, and
computes every reference output from the directory re-loaded with from_pretrained (checking it reproduces the
in-memory model's logits exactly).

Everything runs on CPU in float32 with eager attention and the eager experts loop. Deterministic: fixed seeds.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

import transformers
from safetensors import safe_open

from add_mtp_layers import add_mtp_layers
from transformers.models.deepseek_v2 import modeling_deepseek_v2
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
)

REPO = Path(__file__).resolve().parent.parent
OUT_ROOT = REPO / "tests" / "fixtures" / "models"

PROMPT_LENGTHS = [1, 5, 13, 29]
BATCH_LENGTHS = [3, 9, 17, 6]
NEW_TOKENS = 16
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2  # prompts draw ids from [3, vocab) so none of these appear in inputs
FIRST_PROMPT_ID = 3
INPUT_SEED = 1234  # token ids of prompts / batch (shared by all fixtures)

GREEDY_MARGIN_REL = 1e-3  # top1 - top2 >= this * max|logit| at every recorded greedy step
ROUTER_GAP_MIN = 1e-4  # p[k-1] - p[k] (sorted router softmax) for every routed token of the recorded cases
BATCH_REL_TOL = 1e-5  # batched vs unbatched last logits: max|diff| / max|unbatched|
CACHE_REL_TOL = 1e-4  # greedy (KV-cache) logits vs one full forward of prompt+generated

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    pad_token_id=PAD_ID,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
)

FIXTURES = [
    dict(
        name="mixtral_sharded",
        cls=MixtralForCausalLM,
        config_cls=MixtralConfig,
        config=dict(
            COMMON,
            head_dim=16,
            num_hidden_layers=2,
            intermediate_size=96,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=12,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            tie_word_embeddings=False,
        ),
        disk_dtype=torch.float32,
        max_shard_size="1MB",
        seed=1,
        description=(
            "MixtralForCausalLM, f32, 2 shards + index; 2 layers, 8 experts top-2 (softmax -> top-2 -> renormalize), "
            "intermediate 96, rope_theta 1e6, sliding_window 12, untied lm_head."
        ),
    ),
    dict(
        name="olmoe_bf16",
        cls=OlmoeForCausalLM,
        config_cls=OlmoeConfig,
        config=dict(
            COMMON,
            num_hidden_layers=2,
            intermediate_size=32,
            num_experts=16,
            num_experts_per_tok=4,
            norm_topk_prob=False,
            clip_qkv=None,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            tie_word_embeddings=False,
        ),
        disk_dtype=torch.bfloat16,
        max_shard_size=None,
        seed=2,
        description=(
            "OlmoeForCausalLM, weights stored as BF16 (reference computed in f32 from exactly those values); 2 layers, "
            "16 experts top-4, norm_topk_prob false, q_norm/k_norm over the whole q/k projection, linear RoPE "
            "scaling factor 2.0 (rope_theta 1e4), untied lm_head."
        ),
    ),
    dict(
        name="qwen2_moe",
        cls=Qwen2MoeForCausalLM,
        config_cls=Qwen2MoeConfig,
        config=dict(
            COMMON,
            num_hidden_layers=3,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            norm_topk_prob=False,
            qkv_bias=True,
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            tie_word_embeddings=True,
        ),
        disk_dtype=torch.float32,
        max_shard_size=None,
        seed=23,
        description=(
            "Qwen2MoeForCausalLM, f32; 3 layers: 0 and 2 MoE (8 experts top-2, moe_intermediate 32, shared expert "
            "64 with sigmoid shared_expert_gate), layer 1 dense MLP (mlp_only_layers [1], intermediate 96); q/k/v "
            "bias; tied embeddings (no lm_head.weight in the file); norm_topk_prob false."
        ),
    ),
    dict(
        name="qwen2_moe_sparse_step",
        cls=Qwen2MoeForCausalLM,
        config_cls=Qwen2MoeConfig,
        config=dict(
            COMMON,
            num_hidden_layers=4,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=2,
            mlp_only_layers=[],
            norm_topk_prob=True,
            qkv_bias=True,
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            tie_word_embeddings=False,
        ),
        disk_dtype=torch.float32,
        max_shard_size=None,
        seed=4,
        description=(
            "Qwen2MoeForCausalLM, f32; 4 layers, decoder_sparse_step 2 -> layers 1 and 3 MoE, 0 and 2 dense "
            "(intermediate 96); 8 experts top-2, norm_topk_prob true; shared expert; q/k/v bias; untied lm_head."
        ),
    ),
    dict(
        name="qwen3_moe",
        cls=Qwen3MoeForCausalLM,
        config_cls=Qwen3MoeConfig,
        config=dict(
            COMMON,
            head_dim=24,
            num_hidden_layers=3,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            norm_topk_prob=True,
            attention_bias=False,
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            tie_word_embeddings=False,
        ),
        disk_dtype=torch.float32,
        max_shard_size=None,
        seed=37,
        description=(
            "Qwen3MoeForCausalLM, f32; 3 layers: 0 and 2 MoE (8 experts top-2, moe_intermediate 32, no shared "
            "expert, norm_topk_prob true), layer 1 dense MLP (mlp_only_layers [1], intermediate 96); head_dim 24 "
            "(not hidden / heads) with q_norm / k_norm over each head; no q/k/v bias; untied lm_head."
        ),
    ),
]

# DeepSeek-V2: multi-head latent attention with its own head sizes (every head has its own keys and values, so
# num_key_value_heads = num_attention_heads as in the released configs), YaRN RoPE on the 16 rope dims with
# original_max_position_embeddings 32: with rope_theta 1e4 the correction range is dims [0, 2), so rope dim
# pair 0 keeps its frequency, pair 1 is blended and pairs 2..7 are interpolated by `factor`, and the longest
# cases (29-token prompt + 16 generated) run past position 32.
DEEPSEEK_COMMON = dict(
    COMMON,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    intermediate_size=96,
    moe_intermediate_size=16,
    n_shared_experts=2,
    first_k_dense_replace=1,
    tie_word_embeddings=False,
)

FIXTURES += [
    dict(
        name="deepseek_v2_lite",
        cls=DeepseekV2ForCausalLM,
        config_cls=DeepseekV2Config,
        config=dict(
            DEEPSEEK_COMMON,
            num_hidden_layers=3,
            max_position_embeddings=40 * 32,  # factor x original, as the released config
            q_lora_rank=None,
            n_routed_experts=16,
            num_experts_per_tok=4,
            topk_method="greedy",
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            moe_layer_freq=1,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 0.707,
                             "mscale_all_dim": 0.707, "original_max_position_embeddings": 32, "beta_fast": 32,
                             "beta_slow": 1},
        ),
        disk_dtype=torch.float32,
        max_shard_size=None,
        seed=10,
        description=(
            "DeepseekV2ForCausalLM shaped like DeepSeek-V2-Lite, f32; 3 layers: layer 0 dense (first_k_dense_replace "
            "1, intermediate 96), 1 and 2 MoE (16 routed experts top-4 greedy, moe_intermediate 16, 2 shared experts, "
            "routed_scaling_factor 1, norm_topk_prob false); MLA without q LoRA (q_proj), kv_lora_rank 32, "
            "qk_nope/qk_rope/v head dims 16/16/16, 4 heads; YaRN factor 40, mscale = mscale_all_dim = 0.707 (the "
            "released values), original_max_position_embeddings 32, max_position_embeddings 1280."
        ),
    ),
    dict(
        name="deepseek_v2",
        cls=DeepseekV2ForCausalLM,
        config_cls=DeepseekV2Config,
        config=dict(
            DEEPSEEK_COMMON,
            num_hidden_layers=5,
            q_lora_rank=48,
            attention_bias=True,
            n_routed_experts=16,
            num_experts_per_tok=3,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            norm_topk_prob=False,
            routed_scaling_factor=2.5,
            moe_layer_freq=2,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "mscale": 1.0,
                             "mscale_all_dim": 0.707, "original_max_position_embeddings": 32, "beta_fast": 32,
                             "beta_slow": 1},
        ),
        disk_dtype=torch.float32,
        max_shard_size=None,
        seed=27,
        description=(
            "DeepseekV2ForCausalLM shaped like DeepSeek-V2, f32; 5 layers, first_k_dense_replace 1 and moe_layer_freq "
            "2: layers 2 and 4 MoE (16 routed experts in 4 groups, group_limited_greedy top-3 within the best 2 "
            "groups, routed_scaling_factor 2.5, 2 shared experts), 0, 1 and 3 dense; MLA with q LoRA (q_a_proj, "
            "q_a_layernorm, q_b_proj; q_lora_rank 48), kv_lora_rank 32, attention_bias (q_a/kv_a/o biases, which "
            "the released checkpoints lack); YaRN factor 8, mscale 1.0 != mscale_all_dim 0.707 (so cos/sin carry "
            "an attention factor besides the softmax mscale), original_max_position_embeddings 32."
        ),
    ),    dict(
        name="deepseek_v3",
        cls=DeepseekV3ForCausalLM,
        config_cls=DeepseekV3Config,
        config=dict(
            DEEPSEEK_COMMON,
            num_hidden_layers=3,
            q_lora_rank=48,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            n_shared_experts=1,
            rope_interleave=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "mscale": 1.0,
                             "mscale_all_dim": 1.0, "original_max_position_embeddings": 32, "beta_fast": 32,
                             "beta_slow": 1},
        ),
        disk_dtype=torch.float32,
        max_shard_size=None,
        seed=43,
        mtp_shared=False,  # the MTP layer without embed_tokens and shared_head.head, as some conversions store it
        description=(
            "DeepseekV3ForCausalLM, f32; 3 layers: layer 0 dense (first_k_dense_replace 1), 1 and 2 MoE: sigmoid "
            "router with a random e_score_correction_bias (selection only), 16 routed experts in 4 groups ranked by "
            "the sum of their best two, top-4 within the best 2 groups, norm_topk_prob then routed_scaling_factor "
            "2.5, 1 shared expert; MLA with q LoRA 48, kv_lora_rank 32, interleaved rope; YaRN factor 8, "
            "mscale = mscale_all_dim = 1.0 (as V3), original_max_position_embeddings 32."
        ),
    ),
]

FIXTURES += [
    dict(
        name="deepseek_v3_fp8",
        cls=DeepseekV3ForCausalLM,
        config_cls=DeepseekV3Config,
        config=dict(next(f for f in FIXTURES if f["name"] == "deepseek_v3")["config"]),
        disk_dtype=torch.bfloat16,
        fp8_block=(16, 16),
        max_shard_size=None,
        seed=47,
        mtp_shared=True,  # the MTP layer as released, with its own embed_tokens and shared_head.head
        description=(
            "DeepseekV3ForCausalLM as deepseek_v3, block-quantized FP8 as DeepSeek-V3 ships it: every linear "
            "weight of attention and the MLPs (not embeddings, lm_head, norms, the router) stored as F8_E4M3 with a "
            "F32 `weight_scale_inv` per 16x16 block (every dimension here a multiple of 16, as the released "
            "checkpoints with 128x128 blocks) = amax / 448, the other tensors BF16, quantization_config fp8 / e4m3 / "
            "dynamic. The reference is the f32 forward of the dequantized weights (fp8 x scale in f32, rounded "
            "to bf16), i.e. the model re-loaded from a BF16 copy of exactly those values, and equal bit for bit to "
            "transformers' own FP8 loading (FineGrainedFP8Config(dequantize=True) into bf16) run in f32."
        ),
    ),
]

# Dynamic (NTK) RoPE: max_position_embeddings 16, so the 29-token prompt (one forward of seq_len 29), the
# continuations of the 5- and 13-token prompts (which cross position 16 while decoding) and the 17-token batch
# sequence all run past it, where transformers recomputes the frequencies from each forward's sequence length.
FIXTURES += [
    dict(
        name="mixtral_dynamic_rope",
        cls=MixtralForCausalLM,
        config_cls=MixtralConfig,
        config=dict(
            COMMON,
            head_dim=16,
            max_position_embeddings=16,
            num_hidden_layers=2,
            intermediate_size=96,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=None,
            rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
            tie_word_embeddings=False,
        ),
        disk_dtype=torch.float32,
        max_shard_size=None,
        seed=65,
        description=(
            "MixtralForCausalLM, f32; 2 layers, 8 experts top-2, intermediate 96, no sliding window, untied "
            "lm_head; dynamic (NTK) RoPE factor 4 (rope_theta 1e4) with max_position_embeddings 16: every forward "
            "whose sequence length L = max(position_ids) + 1 exceeds 16 uses base rope_theta * (4 L / 16 - 3) ^ "
            "(16 / 14), cached keys keep the frequencies they were rotated with. The batch reference is the "
            "unbatched one (see below)."
        ),
    ),
]

MAX_SEED_TRIES = 200
# init scales (see reinit_)
LM_HEAD_ROW_TAIL = 0.0  # >0 gives log-normal lm_head row scales; makes greedy collapse onto a few tokens
TIED_EMBED_GAIN = 1.0
QK_GAIN = 2.0  # sharper attention -> continuations depend on context instead of collapsing to a fixed point
MIN_DISTINCT_GREEDY = 4  # every recorded 16-token continuation must contain at least this many distinct ids


class CheckFailed(Exception):
    pass


def log(*args):
    print(*args, flush=True)


# --------------------------------------------------------------------------------------------------------------
# model construction


def _deepseek_layer_rule():
    """transformers' DeepseekV2 makes every layer from first_k_dense_replace on an MoE layer and ignores
    moe_layer_freq; DeepSeek's own modeling code (which wrote the released checkpoints) makes layer i MoE iff
    i >= first_k_dense_replace and i % moe_layer_freq == 0, so a checkpoint with moe_layer_freq > 1 holds dense
    MLP tensors on the other layers. The decoder layer is patched to follow that rule with transformers' own
    blocks (no-op for moe_layer_freq 1, the released value)."""
    layer_cls = modeling_deepseek_v2.DeepseekV2DecoderLayer
    original_init = layer_cls.__init__

    def init(self, config, layer_idx):
        original_init(self, config, layer_idx)
        if isinstance(self.mlp, modeling_deepseek_v2.DeepseekV2Moe) and layer_idx % getattr(
                config, "moe_layer_freq", 1) != 0:
            self.mlp = modeling_deepseek_v2.DeepseekV2MLP(config)

    layer_cls.__init__ = init


_deepseek_layer_rule()


def build_config(fx):
    return build_config_with(fx)


def build_config_with(fx, **overrides):
    cfg = fx["config_cls"](**{**fx["config"], **overrides})
    cfg._attn_implementation = "eager"
    return cfg


def new_model(fx):
    model = fx["cls"]._from_config(build_config(fx), attn_implementation="eager", experts_implementation="eager",
                                   dtype=torch.float32)
    model.eval()
    return model


def reinit_(model, seed, round_to=None):
    """Re-initialize every parameter with larger scales than HF's std 0.02 so logits/routing have clear margins."""
    gen = torch.Generator().manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=gen, dtype=torch.float32)

    tied = model.config.tie_word_embeddings
    with torch.no_grad():
        for name, p in model.named_parameters():  # deterministic order; tied lm_head is not listed separately
            fan_in = p.shape[-1]
            if name.endswith("norm.weight"):  # input/post_attention/final norm, q_norm, k_norm
                v = 1.0 + 0.1 * randn(p.shape)
            elif name.endswith(".bias"):
                v = 0.2 * randn(p.shape)
            elif name == "lm_head.weight" or (tied and name == "model.embed_tokens.weight"):
                # logits O(1..10); rows of the special ids 0..2 (pad/bos/eos) scaled down so greedy never picks
                # them (LM_HEAD_ROW_TAIL = 0: the row scale draw only advances the generator)
                row_scale = torch.exp(LM_HEAD_ROW_TAIL * randn((p.shape[0], 1)))
                row_scale[: FIRST_PROMPT_ID] *= 0.1
                gain = TIED_EMBED_GAIN if tied else 2.0  # tied: the same matrix is the input embedding
                v = gain / fan_in**0.5 * row_scale * randn(p.shape)
            elif name == "model.embed_tokens.weight":
                v = randn(p.shape)
            elif name.endswith("mlp.gate.weight"):  # router [E, H]: logit std ~1.5 (best top-k spacing)
                v = 1.5 / fan_in**0.5 * randn(p.shape)
            elif name.endswith(("q_proj.weight", "k_proj.weight", "q_b_proj.weight")):
                v = QK_GAIN / fan_in**0.5 * randn(p.shape)
            elif name.endswith("shared_expert_gate.weight"):  # [1, H]
                v = 1.0 / fan_in**0.5 * randn(p.shape)
            else:  # linear / fused expert matrices: [.., out, in]
                v = 1.0 / fan_in**0.5 * randn(p.shape)
            if round_to is not None:
                v = v.to(round_to).to(torch.float32)  # exactly representable in the on-disk dtype
            p.copy_(v)
        # DeepSeek-V3's selection-only correction bias is a buffer: of the sigmoid scores' scale, so it changes
        # which experts win without deciding alone
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * randn(b.shape))


# --------------------------------------------------------------------------------------------------------------
# checkpoint checks


def expected_hub_names(cfg):
    mt = cfg.model_type
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        if mt == "mixtral":
            names.add(p + "block_sparse_moe.gate.weight")
            for e in range(cfg.num_local_experts):
                names |= {p + f"block_sparse_moe.experts.{e}.{w}.weight" for w in ("w1", "w2", "w3")}
        elif mt == "olmoe":
            names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight", p + "mlp.gate.weight"}
            for e in range(cfg.num_experts):
                names |= {p + f"mlp.experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down")}
        elif mt == "deepseek_v2":
            names.remove(p + "self_attn.q_proj.weight")
            names.remove(p + "self_attn.k_proj.weight")
            names.remove(p + "self_attn.v_proj.weight")
            a = p + "self_attn."
            if cfg.q_lora_rank is None:
                names.add(a + "q_proj.weight")
            else:
                names |= {a + "q_a_proj.weight", a + "q_a_layernorm.weight", a + "q_b_proj.weight"}
            names |= {a + "kv_a_proj_with_mqa.weight", a + "kv_a_layernorm.weight", a + "kv_b_proj.weight"}
            if cfg.attention_bias:
                names |= {a + "kv_a_proj_with_mqa.bias", a + "o_proj.bias"}
                if cfg.q_lora_rank is not None:
                    names.add(a + "q_a_proj.bias")
            if is_deepseek_moe_layer(cfg, i):
                names.add(p + "mlp.gate.weight")
                names |= {p + f"mlp.shared_experts.{w}_proj.weight" for w in ("gate", "up", "down")}
                for e in range(cfg.n_routed_experts):
                    names |= {p + f"mlp.experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down")}
            else:
                names |= {p + f"mlp.{w}_proj.weight" for w in ("gate", "up", "down")}
        elif mt == "qwen3_moe":
            names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
            if is_qwen_moe_layer(cfg, i):
                names.add(p + "mlp.gate.weight")
                for e in range(cfg.num_experts):
                    names |= {p + f"mlp.experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down")}
            else:
                names |= {p + f"mlp.{w}_proj.weight" for w in ("gate", "up", "down")}
        elif mt == "deepseek_v3":
            a = p + "self_attn."
            names -= {a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"}
            names |= {a + "q_a_proj.weight", a + "q_a_layernorm.weight", a + "q_b_proj.weight"}
            names |= {a + "kv_a_proj_with_mqa.weight", a + "kv_a_layernorm.weight", a + "kv_b_proj.weight"}
            if i >= cfg.first_k_dense_replace:
                names |= {p + "mlp.gate.weight", p + "mlp.gate.e_score_correction_bias"}
                names |= {p + f"mlp.shared_experts.{w}_proj.weight" for w in ("gate", "up", "down")}
                for e in range(cfg.n_routed_experts):
                    names |= {p + f"mlp.experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down")}
            else:
                names |= {p + f"mlp.{w}_proj.weight" for w in ("gate", "up", "down")}
        elif mt == "qwen2_moe":
            names |= {p + f"self_attn.{x}_proj.bias" for x in "qkv"}
            if is_qwen_moe_layer(cfg, i):
                names |= {p + "mlp.gate.weight", p + "mlp.shared_expert_gate.weight"}
                names |= {p + f"mlp.shared_expert.{w}_proj.weight" for w in ("gate", "up", "down")}
                for e in range(cfg.num_experts):
                    names |= {p + f"mlp.experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down")}
            else:
                names |= {p + f"mlp.{w}_proj.weight" for w in ("gate", "up", "down")}
        else:
            raise ValueError(mt)
    return names


def is_qwen_moe_layer(cfg, i):
    # HF Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer rule
    return i not in cfg.mlp_only_layers and cfg.num_experts > 0 and (i + 1) % cfg.decoder_sparse_step == 0


def is_deepseek_moe_layer(cfg, i):
    # DeepSeek's own rule (see _deepseek_layer_rule)
    return i >= cfg.first_k_dense_replace and i % cfg.moe_layer_freq == 0


def read_checkpoint(d: Path):
    files = sorted(d.glob("*.safetensors"))
    tensors, dtypes, where = {}, {}, {}
    for f in files:
        with safe_open(str(f), "pt") as s:
            for k in s.keys():
                if k in tensors:
                    raise CheckFailed(f"duplicate tensor {k}")
                t = s.get_tensor(k)
                tensors[k], dtypes[k], where[k] = t, t.dtype, f.name
    return files, tensors, dtypes, where


def check_checkpoint(fx, d: Path, model):
    cfg = model.config
    files, tensors, dtypes, where = read_checkpoint(d)
    if fx["max_shard_size"]:
        if len(files) < 2:
            raise CheckFailed(f"expected >= 2 shards, got {[f.name for f in files]}")
        n = len(files)
        want = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        if [f.name for f in files] != want:
            raise CheckFailed(f"shard names {[f.name for f in files]}")
        index = json.loads((d / "model.safetensors.index.json").read_text())
        if index["weight_map"] != where:
            raise CheckFailed("index weight_map does not match shard contents")
    elif [f.name for f in files] != ["model.safetensors"]:
        raise CheckFailed(f"expected a single model.safetensors, got {[f.name for f in files]}")

    want = expected_hub_names(cfg)
    got = set(tensors)
    if got != want:
        raise CheckFailed(f"tensor names differ from Hub names: missing {sorted(want - got)[:8]}, "
                          f"unexpected {sorted(got - want)[:8]}")
    bad = {k: str(v) for k, v in dtypes.items()
           if v != (torch.float32 if k.endswith("e_score_correction_bias") else fx["disk_dtype"])}
    if bad:
        raise CheckFailed(f"unexpected on-disk dtypes {list(bad.items())[:4]}")

    # Independent of HF's (reverse) conversion mapping: compare every stored tensor with the in-memory parameter
    # it must equal, given the semantics of the in-memory modules (gate_up_proj.chunk(2, -1) -> (gate, up),
    # act(gate) * up, then down_proj).
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)

    def expect(hub_name, value):
        t = tensors[hub_name].to(torch.float32)
        if not torch.equal(t, value.to(torch.float32)):
            raise CheckFailed(f"{hub_name} does not hold the expected values")

    consumed = set()
    for k, v in sd.items():
        if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj"):
            continue
        hub = k.replace(".mlp.", ".block_sparse_moe.") if cfg.model_type == "mixtral" else k
        expect(hub, v)
        consumed.add(hub)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts."
        if p + "gate_up_proj" not in sd:
            continue
        gu, dn = sd[p + "gate_up_proj"], sd[p + "down_proj"]
        inter = gu.shape[1] // 2
        for e in range(gu.shape[0]):
            if cfg.model_type == "mixtral":
                h = f"model.layers.{i}.block_sparse_moe.experts.{e}."
                names = (h + "w1.weight", h + "w3.weight", h + "w2.weight")  # gate, up, down
            else:
                h = f"model.layers.{i}.mlp.experts.{e}."
                names = (h + "gate_proj.weight", h + "up_proj.weight", h + "down_proj.weight")
            expect(names[0], gu[e, :inter])
            expect(names[1], gu[e, inter:])
            expect(names[2], dn[e])
            consumed |= set(names)
    if consumed != got:
        raise CheckFailed(f"tensors not cross-checked: {sorted(got - consumed)[:8]}")
    return files


def load_saved(d: Path):
    m = transformers.AutoModelForCausalLM.from_pretrained(
        str(d), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    m.eval()
    # the weights are memory-mapped from the files at arbitrary (unaligned) addresses, which can change BLAS
    # rounding by an ulp; give them freshly allocated storage (same values) so results match bit for bit
    with torch.no_grad():
        for p in m.parameters():
            p.data = p.data.clone()
    return m


# --------------------------------------------------------------------------------------------------------------
# reference outputs


class RouterRecorder:
    """Records router logits of every MoE layer (forward hooks on the *TopKRouter / *TopkRouter modules)."""

    def __init__(self, model):
        cfg = model.config
        self.top_k = cfg.num_experts_per_tok
        # DeepSeek-V2 group_limited_greedy: the best topk_group groups (by their best expert) first; DeepSeek-V3:
        # groups by the sum of their best two choice values (sigmoid + correction bias)
        self.v3 = cfg.model_type == "deepseek_v3"
        self.groups = (cfg.n_group, cfg.topk_group) if getattr(cfg, "topk_method", None) == "group_limited_greedy" \
            or (self.v3 and cfg.topk_group < cfg.n_group) else None
        self.calls = []
        self.handles = []
        for mod in model.modules():
            if type(mod).__name__.lower().endswith("topkrouter"):
                self.handles.append(mod.register_forward_hook(self._hook))
        if not self.handles:
            raise CheckFailed("no router modules found")
        self.n_layers = len(self.handles)

    def _hook(self, mod, args, out):
        bias = getattr(mod, "e_score_correction_bias", None)
        self.calls.append((out[0].detach().float().clone(), None if bias is None else bias.detach().float().clone()))

    def min_gap(self):
        """min over recorded tokens and layers of p[k-1] - p[k] (router softmax sorted descending; with group
        limiting also g[topk_group-1] - g[topk_group] of the sorted group scores, and p over the kept groups)."""
        gaps = []
        for logits, bias in self.calls:
            # the values experts are chosen by: softmax, or (V3) sigmoid plus the correction bias
            p = torch.sigmoid(logits.float()) + bias if self.v3 else torch.softmax(logits.float(), dim=-1)
            if self.groups:
                n_group, topk_group = self.groups
                grouped = p.view(p.shape[0], n_group, -1)
                g = grouped.topk(2, dim=-1).values.sum(-1) if self.v3 else grouped.amax(-1)
                gs = g.sort(dim=-1, descending=True).values
                gaps.append((gs[:, topk_group - 1] - gs[:, topk_group]).min().item())
                keep = torch.zeros_like(g).scatter_(1, g.topk(topk_group, dim=-1).indices, 1.0)
                p = p.masked_fill(keep.repeat_interleave(p.shape[1] // n_group, dim=-1) == 0, float("-inf"))
            p = p.sort(dim=-1, descending=True).values
            gaps.append((p[:, self.top_k - 1] - p[:, self.top_k]).min().item())
        self.calls = []
        return min(gaps)

    def remove(self):
        for h in self.handles:
            h.remove()


def greedy(model, ids, mask=None):
    """HF generate, greedy, exactly NEW_TOKENS new tokens; returns (new_ids [B, N], raw logits [B, N, V])."""
    if mask is None:
        mask = torch.ones_like(ids)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=BOS_ID,
    )
    new = out.sequences[:, ids.shape[1]:]
    logits = torch.stack(out.logits, dim=1).float()
    if new.shape[1] != NEW_TOKENS:
        raise CheckFailed(f"generated {new.shape[1]} tokens")
    if not torch.equal(logits.argmax(-1), new):
        raise CheckFailed("a generated token is not the argmax of its raw logits (EOS suppression?)")
    return new, logits


def greedy_margin(logits):
    """min over steps of (top1 - top2) / max|logit|."""
    top2 = logits.topk(2, dim=-1).values
    return ((top2[..., 0] - top2[..., 1]) / logits.abs().amax(-1)).min().item()


def rel_diff(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def save_npy(d: Path, name, t):
    arr = np.ascontiguousarray(t.detach().cpu().numpy(), dtype="<f4")
    np.save(d / name, arr, allow_pickle=False)
    # plain format 1.0 header
    with open(d / name, "rb") as f:
        if f.read(8) != b"\x93NUMPY\x01\x00":
            raise CheckFailed(f"{name}: not a version 1.0 .npy")
    return name


def make_inputs(vocab):
    g = torch.Generator().manual_seed(INPUT_SEED)
    prompts = [torch.randint(FIRST_PROMPT_ID, vocab, (n,), generator=g) for n in PROMPT_LENGTHS]
    batch = [torch.randint(FIRST_PROMPT_ID, vocab, (n,), generator=g) for n in BATCH_LENGTHS]
    return prompts, batch


def is_dynamic_rope(cfg):
    return (cfg.rope_parameters or {}).get("rope_type") == "dynamic"


def reset_dynamic_rope_before_each_forward(model):
    """transformers' dynamic RoPE keeps state between forwards: the frequencies of the longest sequence seen
    so far (max_seq_len_cached) are reused by a later, shorter forward unless that one is under
    max_position_embeddings. Restoring the freshly loaded state before every forward makes each result that of
    a newly loaded model, so it never depends on the cases recorded before it: a forward of sequence length
    L > max_position_embeddings computes the frequencies of L, a shorter one the original ones. generate()'s
    decode steps only grow L, so they compute exactly what they compute in one fresh generate()."""
    def reset(mod, args):
        mod.register_buffer("inv_freq", mod.original_inv_freq.clone(), persistent=False)
        mod.max_seq_len_cached = mod.original_max_seq_len

    rotary = [m for m in model.modules() if hasattr(m, "original_inv_freq") and m.rope_type == "dynamic"]
    if not rotary:
        raise CheckFailed("no dynamic rotary embedding module found")
    for m in rotary:
        m.register_forward_pre_hook(reset)


@torch.no_grad()
def record_reference(model, d: Path, stats):
    vocab = model.config.vocab_size
    prompts, batch = make_inputs(vocab)
    rec = RouterRecorder(model)
    ref_prompts = []
    margins, router_gaps, cache_diffs = [], [], []
    # Dynamic RoPE: a full forward of prompt + continuation rotates every key with the frequencies of its own
    # length, the cached decode kept each key's from the step that wrote it, so the two differ by design; the
    # routing margins are measured on the tokens generate() itself ran instead.
    dynamic = is_dynamic_rope(model.config)

    def unbatched_case(ids_1d):
        ids = ids_1d[None]
        logits = model(input_ids=ids).logits[0].float()
        rec.calls = []
        new, glogits = greedy(model, ids)
        new, glogits = new[0], glogits[0]
        if dynamic:
            router_gaps.append(rec.min_gap())
        margins.append(greedy_margin(glogits))
        if margins[-1] < GREEDY_MARGIN_REL:
            raise CheckFailed(f"greedy margin {margins[-1]:.3g} < {GREEDY_MARGIN_REL}")
        if len(set(new.tolist())) < MIN_DISTINCT_GREEDY:
            raise CheckFailed(f"degenerate greedy continuation {new.tolist()}")
        # one full forward (no cache) of prompt + generated[:-1]: routing decisiveness for every token the
        # model ever processes, and consistency of the cached decode with the plain causal/sliding mask
        rec.calls = []
        full = torch.cat([ids_1d, new[:-1]])[None]
        full_logits = model(input_ids=full).logits[0].float()
        router_gaps.append(rec.min_gap())
        if router_gaps[-1] < ROUTER_GAP_MIN:
            raise CheckFailed(f"router top-k gap {router_gaps[-1]:.3g} < {ROUTER_GAP_MIN}")
        cache_diffs.append(rel_diff(glogits, full_logits[ids.shape[1] - 1:]))
        if not dynamic and not torch.equal(full_logits[ids.shape[1] - 1:].argmax(-1), new):
            raise CheckFailed("full-sequence forward disagrees with cached greedy decode")
        return logits, new, glogits

    for i, p in enumerate(prompts):
        logits, new, glogits = unbatched_case(p)
        ref_prompts.append(
            {
                "input_ids": p.tolist(),
                "prompt_logits": save_npy(d, f"prompt{i}_logits.npy", logits),
                "greedy_ids": new.tolist(),
                "greedy_logits": save_npy(d, f"prompt{i}_greedy_logits.npy", glogits),
            }
        )

    # unbatched runs of the batch sequences
    single_last, single_new = [], []
    for s in batch:
        logits, new, _ = unbatched_case(s)
        single_last.append(logits[-1])
        single_new.append(new)

    # one left-padded batch
    maxlen = max(BATCH_LENGTHS)
    padded = torch.full((len(batch), maxlen), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(batch), maxlen), dtype=torch.long)
    for r, s in enumerate(batch):
        padded[r, maxlen - len(s):] = s
        mask[r, maxlen - len(s):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # each sequence's real tokens at positions 0..len-1
    rec.calls = []
    blogits = model(input_ids=padded, attention_mask=mask, position_ids=pos).logits.float()
    # routing of the real (non-pad) rows of the batched forward
    keep = mask.reshape(-1).bool()
    rec.calls = [(c[keep], bias) for c, bias in rec.calls]
    router_gaps.append(rec.min_gap())
    last = blogits[:, -1]
    bnew, bglogits = greedy(model, padded, mask)
    if not dynamic:
        margins.append(greedy_margin(bglogits))
    rec.remove()

    batch_rel = max(rel_diff(last[r], single_last[r]) for r in range(len(batch)))
    if dynamic:
        # transformers computes one sequence length for the whole padded batch (its largest position + 1), so
        # its batched rows differ from each sequence alone; the engine computes it per sequence (a result never
        # depends on what else is in the batch), so the batch reference is the unbatched one.
        stats["dynamic_hf_padded_batch_vs_unbatched_last_logits_rel"] = batch_rel
        last = torch.stack(single_last)
        bnew = torch.stack(single_new)
        batch_rel = 0.0
    if batch_rel > BATCH_REL_TOL:
        raise CheckFailed(f"batched last logits differ from unbatched: rel {batch_rel:.3g}")
    for r in range(len(batch)):
        if not torch.equal(bnew[r], single_new[r]):
            raise CheckFailed(f"batched greedy continuation of sequence {r} differs from its unbatched one")

    stats.update(
        min_greedy_margin_rel=min(margins),
        min_router_gap=min(router_gaps),
        **{"dynamic_cached_vs_full_forward_rel" if dynamic else "max_cached_vs_full_forward_rel": max(cache_diffs)},
        batched_vs_unbatched_last_logits_rel=batch_rel,
        max_abs_batch_last_logit=last.abs().max().item(),
    )
    if stats["min_greedy_margin_rel"] < GREEDY_MARGIN_REL:
        raise CheckFailed(f"greedy margin {stats['min_greedy_margin_rel']:.3g} < {GREEDY_MARGIN_REL}")
    if stats["min_router_gap"] < ROUTER_GAP_MIN:
        raise CheckFailed(f"router top-k gap {stats['min_router_gap']:.3g} < {ROUTER_GAP_MIN}")
    if not dynamic and stats["max_cached_vs_full_forward_rel"] > CACHE_REL_TOL:
        raise CheckFailed(f"cached decode vs full forward rel {stats['max_cached_vs_full_forward_rel']:.3g}")

    return {
        "prompts": ref_prompts,
        "batch": {
            "input_ids": [s.tolist() for s in batch],
            "padding_side": "left",
            "pad_token_id": PAD_ID,
            "padded_input_ids": padded.tolist(),
            "attention_mask": mask.tolist(),
            "position_ids": pos.tolist(),
            "last_logits": save_npy(d, "batch_last_logits.npy", last),
            "greedy_ids": bnew.tolist(),
            **({"note": "dynamic RoPE: last_logits and greedy_ids are each sequence's unbatched results"}
               if dynamic else {}),
        },
    }


# --------------------------------------------------------------------------------------------------------------


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def fp8_quantize(w, block):
    """DeepSeek-V3's block quantization of one [rows, cols] matrix: scale = amax / 448 per block (1 for an
    all-zero block), q = w / scale in float8_e4m3fn; returns (q, scale_inv [ceil(rows/br), ceil(cols/bc)] f32)."""
    br, bc = block
    rows, cols = w.shape
    sr, sc = -(-rows // br), -(-cols // bc)
    scale = torch.ones((sr, sc), dtype=torch.float32)
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn)
    for i in range(sr):
        for j in range(sc):
            blk = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc].to(torch.float32)
            amax = blk.abs().max().item()
            s_ = amax / FP8_MAX if amax > 0 else 1.0
            scale[i, j] = s_
            q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (blk / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def fp8_dequantize(q, scale_inv, block):
    """q x its block's scale in f32, rounded to bf16 (what the C++ loader keeps), as f32."""
    br, bc = block
    full = scale_inv.repeat_interleave(br, 0)[: q.shape[0]].repeat_interleave(bc, 1)[:, : q.shape[1]]
    return (q.to(torch.float32) * full).to(torch.bfloat16).to(torch.float32)


def fp8_quantize_model_(model, block):
    """Replaces every linear weight DeepSeek-V3 quantizes by its dequantized FP8 value; returns
    {hub name: (q, scale_inv)} for the checkpoint."""
    quantized = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                prefix = name.rsplit(".", 1)[0] + "."
                for e in range(p.shape[0]):
                    parts = ([("gate_proj", slice(0, p.shape[1] // 2)), ("up_proj", slice(p.shape[1] // 2, None))]
                             if name.endswith("gate_up_proj") else [("down_proj", slice(None))])
                    for hub, rows in parts:
                        q, s_ = fp8_quantize(p[e, rows], block)
                        p[e, rows] = fp8_dequantize(q, s_, block)
                        quantized[f"{prefix}{e}.{hub}.weight"] = (q, s_)
            elif name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight"):
                q, s_ = fp8_quantize(p, block)
                p.copy_(fp8_dequantize(q, s_, block))
                quantized[name] = (q, s_)
    return quantized


def fp8_rewrite_checkpoint(d: Path, quantized, block):
    """Stores the quantized matrices (with their _scale_inv) in place of their BF16 copies, checking that each
    dequantizes to exactly the BF16 value saved, and adds quantization_config to config.json."""
    from safetensors.torch import load_file, save_file
    path = d / "model.safetensors"
    tensors = load_file(str(path))
    for name, (q, s_) in quantized.items():
        if not torch.equal(fp8_dequantize(q, s_, block), tensors[name].to(torch.float32)):
            raise CheckFailed(f"{name}: the FP8 tensor does not dequantize to the saved BF16 values")
        tensors[name] = q.contiguous()
        tensors[name + "_scale_inv"] = s_.contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return len(quantized)


def check_transformers_fp8_load(d: Path, ref):
    """transformers' own loading of the FP8 checkpoint (FineGrainedFP8Config(dequantize=True) into bf16, then
    the f32 forward every reference here uses) must give exactly the recorded prompt logits."""
    m = transformers.AutoModelForCausalLM.from_pretrained(
        str(d), quantization_config=transformers.FineGrainedFP8Config(dequantize=True), dtype=torch.bfloat16,
        attn_implementation="eager", experts_implementation="eager").float()
    m.eval()
    worst = 0.0
    for i, p in enumerate(ref["prompts"]):
        with torch.no_grad():
            logits = m(input_ids=torch.tensor([p["input_ids"]])).logits[0]
        worst = max(worst, (logits - torch.from_numpy(np.load(d / f"prompt{i}_logits.npy"))).abs().max().item())
    if worst != 0.0:
        raise CheckFailed(f"transformers' FP8 load differs from the reference by {worst}")
    return worst


def generate_fixture(fx, seed):
    d = OUT_ROOT / fx["name"]
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)

    torch.manual_seed(seed)
    model = new_model(fx)
    round_to = fx["disk_dtype"] if fx["disk_dtype"] != torch.float32 else None
    reinit_(model, seed, round_to=round_to)
    quantized = fp8_quantize_model_(model, fx["fp8_block"]) if "fp8_block" in fx else None

    save_kwargs = {}
    if fx["max_shard_size"]:
        save_kwargs["max_shard_size"] = fx["max_shard_size"]
    if fx["disk_dtype"] != torch.float32:
        to_save = new_model(fx)
        to_save.load_state_dict(model.state_dict())
        to_save.to(fx["disk_dtype"])
        # DeepSeek-V3 ships its selection-only correction bias in F32 beside BF16 (or FP8) weights
        for name, b in to_save.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.data = model.get_buffer(name).detach().clone()
    else:
        to_save = model
    to_save.save_pretrained(str(d), **save_kwargs)
    del to_save

    check_checkpoint(fx, d, model)

    # reload: the reference is computed from the files, and must equal the in-memory model exactly
    loaded = load_saved(d)
    probe = torch.tensor([[5, 77, 300, 12, 9, 401, 33, 250, 18, 99, 123, 7, 64, 500, 42, 3, 11, 270]])
    with torch.no_grad():
        a = model(input_ids=probe).logits
        b = loaded(input_ids=probe).logits
    reload_diff = (a - b).abs().max().item()
    if reload_diff != 0.0:
        raise CheckFailed(f"from_pretrained reload changes logits by {reload_diff}")
    del model

    stats = {"reload_max_abs_logit_diff": reload_diff}
    if is_dynamic_rope(loaded.config):
        reset_dynamic_rope_before_each_forward(loaded)
    ref = record_reference(loaded, d, stats)
    if quantized is not None:
        stats["fp8_quantized_matrices"] = fp8_rewrite_checkpoint(d, quantized, fx["fp8_block"])
        stats["transformers_fp8_dequantized_max_abs_logit_diff"] = check_transformers_fp8_load(d, ref)
    if "mtp_shared" in fx:
        # Last: transformers does not load the MTP layers, so the reference above is the model's without them.
        add_mtp_layers(d, seed, shared=fx["mtp_shared"])

    extra = {}
    cfg = loaded.config
    if fx["name"] == "mixtral_sharded":
        # the sliding window must matter for these cases: the same weights without it give different logits
        with torch.no_grad():
            prompts, _ = make_inputs(cfg.vocab_size)
            ids = prompts[-1][None]
            with_w = loaded(input_ids=ids).logits
            sw = cfg.sliding_window
            cfg.sliding_window = None
            without_w = loaded(input_ids=ids).logits
            cfg.sliding_window = sw
        extra["sliding_window_effect_rel_on_prompt3"] = rel_diff(with_w, without_w)
        if extra["sliding_window_effect_rel_on_prompt3"] < 1e-3:
            raise CheckFailed("sliding window has no visible effect")

    if cfg.model_type == "deepseek_v2":
        # YaRN must matter for these cases: the same weights with plain RoPE (no frequency interpolation, no
        # attention factor on cos/sin, no mscale in the softmax scale) give different logits
        plain = fx["cls"]._from_config(build_config_with(fx, rope_parameters={
            "rope_type": "default", "rope_theta": fx["config"]["rope_parameters"]["rope_theta"]}),
            attn_implementation="eager", experts_implementation="eager", dtype=torch.float32)
        plain.load_state_dict(loaded.state_dict())
        plain.eval()
        with torch.no_grad():
            prompts, _ = make_inputs(cfg.vocab_size)
            ids = torch.cat([prompts[-1], torch.tensor(ref["prompts"][-1]["greedy_ids"])])[None]
            yarn_logits = loaded(input_ids=ids).logits
            plain_logits = plain(input_ids=ids).logits
        extra["yarn_effect_rel_on_prompt3_plus_greedy"] = rel_diff(yarn_logits, plain_logits)
        if extra["yarn_effect_rel_on_prompt3_plus_greedy"] < 1e-2:
            raise CheckFailed("YaRN scaling has no visible effect")

    if is_dynamic_rope(cfg):
        prompts, _ = make_inputs(cfg.vocab_size)
        # The reset before each forward changes nothing a fresh model would do: each prompt's greedy run on a
        # newly loaded model (no hook) gives exactly the recorded logits.
        worst = 0.0
        for i, p in enumerate(prompts):
            _, glogits = greedy(load_saved(d), p[None])
            worst = max(worst, (glogits[0] - torch.from_numpy(np.load(d / f"prompt{i}_greedy_logits.npy"))).abs()
                        .max().item())
        extra["dynamic_fresh_model_greedy_max_abs_logit_diff"] = worst
        if worst != 0.0:
            raise CheckFailed(f"a freshly loaded model's greedy logits differ from the recorded ones by {worst}")
        # Dynamic scaling must matter for what the tests compare: the same weights with plain RoPE give
        # different prompt logits for the 29-token prompt (one forward past max_position_embeddings) and
        # different logits for its recorded continuation (teacher-forced).
        plain = fx["cls"]._from_config(build_config_with(fx, rope_parameters={
            "rope_type": "default", "rope_theta": fx["config"]["rope_parameters"]["rope_theta"]}),
            attn_implementation="eager", experts_implementation="eager", dtype=torch.float32)
        plain.load_state_dict(loaded.state_dict())
        plain.eval()
        with torch.no_grad():
            ids = torch.cat([prompts[-1], torch.tensor(ref["prompts"][-1]["greedy_ids"][:-1])])[None]
            plain_logits = plain(input_ids=ids).logits[0]
        n = len(prompts[-1])
        extra["dynamic_effect_rel_on_prompt3_logits"] = rel_diff(
            torch.from_numpy(np.load(d / "prompt3_logits.npy")), plain_logits[:n])
        extra["dynamic_effect_rel_on_prompt3_greedy_logits"] = rel_diff(
            torch.from_numpy(np.load(d / "prompt3_greedy_logits.npy")), plain_logits[n - 1:])
        if min(extra["dynamic_effect_rel_on_prompt3_logits"],
               extra["dynamic_effect_rel_on_prompt3_greedy_logits"]) < 1e-2:
            raise CheckFailed("dynamic RoPE scaling has no visible effect")

    cfg_json = json.loads((d / "config.json").read_text())
    reference = {
        "generator": "tools/gen_model_fixtures.py",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "fixture": fx["name"],
        "architecture": cfg_json["architectures"][0],
        "description": fx["description"],
        "seed": seed,
        "on_disk_dtype": (f"float8_e4m3fn linear weights ({fx['fp8_block'][0]}x{fx['fp8_block'][1]} blocks), "
                          if "fp8_block" in fx else "") + str(fx["disk_dtype"]).replace("torch.", ""),
        "compute_dtype": "float32",
        "attn_implementation": "eager",
        "experts_implementation": "eager",
        "generation": {
            "do_sample": False,
            "max_new_tokens": NEW_TOKENS,
            "min_new_tokens": NEW_TOKENS,
            "note": "greedy_ids are the new tokens only; each equals argmax of the raw (unprocessed) logits "
            "recorded for that step; no EOS/BOS/PAD id (0,1,2) occurs in the inputs",
        },
        "checks": {**stats, **extra},
        **ref,
    }
    (d / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
    return d, reference


def dir_size(d: Path):
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def write_readme(results):
    lines = [
        "# Tiny random MoE checkpoints + HF transformers reference outputs",
        "",
        "Generated by `tools/gen_model_fixtures.py` (do not edit by hand). Regenerate from the repository root:",
        "",
        "```",
        "python3 -m venv tools/.venv && tools/.venv/bin/pip install -r tools/requirements.txt   # once",
        "tools/.venv/bin/python tools/gen_model_fixtures.py",
        "```",
        "",
        f"Versions used: transformers {transformers.__version__}, torch {torch.__version__}, "
        f"safetensors {__import__('safetensors').__version__}, numpy {np.__version__}.",
        "",
        "Each directory is a genuine Hub-style checkpoint written by `save_pretrained` (`config.json`, "
        "`generation_config.json`, `model.safetensors` or shards + `model.safetensors.index.json`) with the classic "
        "per-expert tensor names (transformers v5 fuses experts in memory and un-fuses them on save; the script "
        "checks every stored tensor against the in-memory model and that `from_pretrained` of the directory "
        "reproduces the logits exactly). No tokenizer files: inputs are raw token ids.",
        "",
        "| fixture | size | what |",
        "|---|---|---|",
    ]
    for d, ref in results:
        lines.append(f"| `{d.name}` | {dir_size(d) / 1e3:.0f} kB | {ref['description']} |")
    lines += [
        "",
        "Common: hidden 64, 4 heads, 2 KV heads (GQA; DeepSeek: MLA, see below), head_dim 16, vocab 512, max_position_embeddings 256, "
        "rms_norm_eps 1e-5, silu, pad/bos/eos ids 0/1/2 (never in the inputs, never generated). Weights are "
        "re-initialized with larger scales than HF's std 0.02 (embeddings N(0,1); matrices N(0, 1/fan_in); q/k "
        "projections (and DeepSeek's q_b_proj) N(0, 4/fan_in); routers N(0, 2.25/fan_in); lm_head N(0, 4/fan_in), tied embedding "
        "N(0, 1/fan_in), rows 0..2 x0.1; norms 1 + 0.1 N(0,1); biases 0.2 N(0,1)). Seeds were picked so that every "
        "recorded greedy step has top1 - top2 >= 1e-3 max|logit|, every routed token has router p[k-1] - p[k] >= 1e-4 "
        "(group-limited routing: also between the topk_group-th and the next group), and no continuation is degenerate (>= 4 distinct ids in 16); measured values are in each `checks`.",
        "",
        "MTP layers: `deepseek_v3` and `deepseek_v3_fp8` (num_nextn_predict_layers 1) also hold DeepSeek-V3's multi-token-prediction layer, `model.layers.3.*` in the released layout, appended behind the other tensors by `tools/add_mtp_layers.py` (numpy only; random values at the scales above): a decoder layer's tensors (MLA attention, MoE with the correction bias, shared expert, both norms) plus `enorm`, `hnorm`, `eh_proj` [64, 128] and `shared_head.norm`; `deepseek_v3_fp8` also its own `embed_tokens` and `shared_head.head` (BF16 like `eh_proj` and the norms, the attention and expert matrices F8_E4M3 with their scales, as released), `deepseek_v3` without those two (as some conversions store it). transformers does not load them (unexpected keys), so the references are those of the model without them; every other tensor keeps its bytes. `tools/mtp_reference.py` (run by the generator after each of them) computes the MTP layer's draft logits in PyTorch (transformers' `DeepseekV3DecoderLayer` with the layer's weights, the norms, `eh_proj` and head as vLLM's and SGLang's DeepSeekMTP; its docstring cites the lines) and adds `prompt{i}_mtp_logits.npy` [len, vocab] (the prompt as one MTP prefill: row t takes the main model's hidden state at t after the final norm and token t+1, the last row the first greedy id, at rotary position t, with the layer's own causal KV) and `prompt{i}_mtp_chain_logits.npy` [3, vocab] (3 greedy draft steps after the last row, each fed the previous argmax and the previous row's output after `shared_head.norm`, at positions len, len+1, len+2) with an `mtp` section in `reference.json` (the conventions, ids, draft ids and `checks`: the main model's logits reproduced, the cached chain's first row equal to the prefill's last, the smallest draft margin, and how far zeroing `eh_proj`, the pre-norm hidden state, vLLM's position-0 masking and vLLM's pre-norm chaining move the logits).",
        "",
        "HF semantics these fixtures pin down (transformers " + transformers.__version__ + "):",
        "",
        "- Router, all three: `softmax(x W_gate^T)` over all experts in f32, then top-k of the probabilities; Mixtral "
        "always renormalizes the k weights to sum 1; OLMoE/Qwen2-MoE only if `norm_topk_prob` (else raw softmax "
        "probabilities). Expert = `down(silu(gate x) * up x)` (Mixtral w1 = gate, w3 = up, w2 = down).",
        "- Qwen2-MoE: layer i is MoE iff `i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0`, else a "
        "dense MLP of `intermediate_size`; MoE output = routed experts + `sigmoid(x w_shared_gate^T) * "
        "shared_expert(x)`; q/k/v have biases (`qkv_bias`), o_proj none.",
        "- OLMoE: `q_norm`/`k_norm` are RMSNorms over the whole projected q [heads*head_dim] / k "
        "[kv_heads*head_dim], applied before RoPE; `clip_qkv` (null here) would clamp q, k, v to [-c, c] after the "
        "norms.",
        "- Mixtral sliding window W: query at position i attends to keys j with `i - W < j <= i` (itself and the W-1 "
        "previous tokens).",
        "- DeepSeek-V2 (MLA): q = `q_proj x` or `q_b_proj(q_a_layernorm(q_a_proj x))`, per head [qk_nope | qk_rope]; "
        "`kv_a_proj_with_mqa x` = [latent (kv_lora_rank) | shared rope key (qk_rope_head_dim)], the latent through "
        "`kv_a_layernorm` (q_a_layernorm and kv_a_layernorm use eps 1e-6, not rms_norm_eps); `kv_b_proj` maps the latent to per-head [k_nope | v]; RoPE on the rope parts rotates "
        "interleaved pairs (2i, 2i+1) (complex form), cos/sin times YaRN's attention factor; softmax scale "
        "(qk_nope + qk_rope)^-0.5 * mscale(factor, mscale_all_dim)^2. Router: softmax, `greedy` top-k or "
        "`group_limited_greedy` (groups ranked by their best expert, top-k among the best `topk_group` groups), "
        "weights times `routed_scaling_factor` (transformers ignores `norm_topk_prob`; false here, as in the released "
        "checkpoints); plus the `shared_experts` MLP (moe_intermediate_size * n_shared_experts), ungated. Layer i "
        "is MoE iff i >= first_k_dense_replace and i % moe_layer_freq == 0 (DeepSeek's rule; transformers ignores "
        "moe_layer_freq, so the generator builds those layers from transformers' own dense MLP block).",
        "- RoPE config is v5's `rope_parameters` (`{rope_type, rope_theta[, factor]}`); `linear` divides the inverse "
        "frequencies (equivalently the positions) by `factor`. Real Hub configs written by transformers 4.x use "
        "top-level `rope_theta` + `rope_scaling` instead.",
        "- Dynamic (NTK) RoPE (`mixtral_dynamic_rope`): a forward whose sequence length L = max(position_ids) + 1 "
        "exceeds max_position_embeddings M rotates its new tokens with base rope_theta * (factor L / M - (factor - "
        "1)) ^ (dim / (dim - 2)) (float32), a shorter one with the plain frequencies; cached keys keep the "
        "frequencies of the step that wrote them, so a cached decode differs from one full forward of the same "
        "tokens (`dynamic_cached_vs_full_forward_rel`). transformers keeps the longest L seen as module state and "
        "reuses its frequencies for shorter forwards above M; the generator restores the freshly loaded state "
        "before every forward, so each case is what a newly loaded model computes (checked: "
        "`dynamic_fresh_model_greedy_max_abs_logit_diff` 0). A left-padded HF batch uses the batch's largest L "
        "for every row (`dynamic_hf_padded_batch_vs_unbatched_last_logits_rel`); the engine uses each "
        "sequence's own, so this fixture's `batch` reference holds each sequence's unbatched results. "
        "`dynamic_effect_rel_*`: the same weights with plain RoPE, on the 29-token prompt's logits and on its "
        "continuation's.",
        "",
        "`reference.json` (all computed in float32, eager attention, from the saved files re-loaded with "
        "`from_pretrained`; BF16 weights are upcast exactly):",
        "",
        "- `prompts[i]`: `input_ids` (lengths 1, 5, 13, 29); `prompt_logits` .npy [len, vocab] = logits at every "
        "position of one unpadded forward; `greedy_ids` = the 16 new tokens of `generate(do_sample=False, "
        "max_new_tokens=16, min_new_tokens=16)`; `greedy_logits` .npy [16, vocab] = raw logits that produced each "
        "of them (KV-cache decode).",
        "- `batch`: 4 sequences (`input_ids`, lengths 3, 9, 17, 6) run as one left-padded batch (`padded_input_ids`, "
        "`attention_mask`, pad id 0, `position_ids` = 0..len-1 per sequence as HF generate uses); `last_logits` "
        ".npy [4, vocab] = logits at each sequence's last token; `greedy_ids` = batched greedy continuation "
        "(16 each), checked equal to the unbatched one.",
        "- `checks`: margins and tolerances measured at generation time (min top1-top2 gap / max|logit|, min "
        "router p[k-1]-p[k], cached-decode vs full-forward and batched vs unbatched relative differences; mixtral: "
        "the sliding window's effect on prompt 3's logits; DeepSeek: YaRN's effect on the logits of prompt 3 plus "
        "its continuation (45 positions, past original_max_position_embeddings 32), against the same weights "
        "with plain RoPE).",
        "",
        ".npy files: little-endian float32, C order, format version 1.0.",
        "",
    ]
    (OUT_ROOT / "README.md").write_text("\n".join(lines))


def main():
    torch.set_num_threads(min(2, torch.get_num_threads()))
    torch.use_deterministic_algorithms(True)
    wanted = set(sys.argv[1:])
    unknown = wanted - {fx["name"] for fx in FIXTURES}
    if unknown:
        sys.exit(f"unknown fixtures {sorted(unknown)}")
    if not wanted and OUT_ROOT.exists():
        shutil.rmtree(OUT_ROOT)
    OUT_ROOT.mkdir(parents=True, exist_ok=True)
    results = []
    for fx in FIXTURES:
        if wanted and fx["name"] not in wanted:
            d = OUT_ROOT / fx["name"]
            results.append((d, json.loads((d / "reference.json").read_text())))
            continue
        for attempt in range(MAX_SEED_TRIES):
            seed = fx["seed"] + attempt
            try:
                d, ref = generate_fixture(fx, seed)
                break
            except CheckFailed as e:
                log(f"{fx['name']}: seed {seed} rejected: {e}")
        else:
            sys.exit(f"{fx['name']}: no seed passed the checks")
        if seed != fx["seed"]:
            log(f"WARNING: {fx['name']} used seed {seed}, not the configured {fx['seed']}; update FIXTURES")
        if "mtp_shared" in fx:
            # The MTP draft goldens (reference.json's mtp section) need the finished checkpoint; a separate
            # process, since tools/mtp_reference.py imports this module's helpers.
            subprocess.run([sys.executable, str(REPO / "tools" / "mtp_reference.py"), str(d)], check=True)
            ref = json.loads((d / "reference.json").read_text())
        results.append((d, ref))
        log(f"{fx['name']}: seed {seed}, {dir_size(d) / 1e3:.0f} kB, checks {json.dumps(ref['checks'])}")
    write_readme(results)
    total = dir_size(OUT_ROOT)
    log(f"total {total / 1e6:.2f} MB in {OUT_ROOT.relative_to(REPO)}")


if __name__ == "__main__":
    main()
