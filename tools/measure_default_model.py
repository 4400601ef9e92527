#!/usr/bin/env python3
"""Measure an embedded model (deploy/models/capserve-moe-tiny/, the default, or capserve-moe-fine/): per-domain
held-out perplexity and per-domain expert routing, with HF transformers as the reference (float32, eager attention,
eager experts loop), and the routing's skew next to real OLMoE-1B-7B's on the same domains.

Usage (from the repository root):

    tools/.venv/bin/python tools/measure_default_model.py [--preset tiny|fine] [--model DIR]

Writes (for a preset's own directory): tools/results/PREFIX_eval.json, PREFIX_eval.md, PREFIX_routing.png, and the
model directory's MODEL_CARD.md (from tools/results/PREFIX_train.json + the measurements); PREFIX is default_model
(tiny) or fine_model (fine). Another directory gets DIR/eval.json only.

Evaluation protocol (reproduced by the C++ tools; all of it is also written into default_model_eval.json):
  * held-out text of domain D: the bytes of ../shared/data/corpus/D.txt from `heldout_start_byte` to the end, where
    heldout_start_byte = 1 + (offset of the first b"\\n" at or after floor(0.95 * file size)); decoded as UTF-8.
  * token ids: tokenizer.json applied to the whole held-out text as one string, no special tokens added
    (t[0..N-1]; their sha256 over little-endian int32 is recorded).
  * windows: W = 255 text tokens; n = floor(N / W) windows; window j is the 256-token input
    [<|endoftext|> (id 0)] + t[j*W : (j+1)*W], positions 0..255, evaluated independently (no state carried between
    windows); the last N - n*W tokens are not used.
  * NLL: for i = 0..254, -log softmax(logits[i])[input[i+1]] (natural log, logits in float32): every text token of
    every window is scored exactly once, predicted from <|endoftext|> and the preceding tokens of its window.
    total_nll = sum over windows and positions (accumulated in float64); scored_tokens = 255 * n;
    perplexity = exp(total_nll / scored_tokens).
  * routing: in every MoE layer, the router's top-k expert ids (softmax over router logits, top-k; k = 2) of the 255
    text-token positions 1..255 of each window (the <|endoftext|> position 0 is not counted); counts[e] = number of
    (token, slot) assignments to expert e; sum(counts) = 255 * n * k. max/mean = max(counts) / (sum(counts) / E);
    cosine(D1, D2) = cosine similarity of the two domains' count vectors in that layer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))

import train_default_model as tdm  # noqa: E402

WINDOW_TEXT_TOKENS = 255
IDLE_FRACTION = 0.05  # an expert is 'idle' in a layer when its load, all domains pooled, is < 5% of the mean
BATCH = 8


def log(*a):
    print(*a, flush=True)


def _ids_sha256(ids) -> str:
    import numpy as np

    return hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest()


def evaluate(model, held_ids: dict, top_k: int, n_experts: int):
    """Per-domain NLL / routing counts, per the protocol above."""
    import numpy as np
    import torch

    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    captured = []
    hooks = [r.register_forward_hook(lambda mod, a, out: captured.append(out[2].detach().clone())) for r in routers]
    W = WINDOW_TEXT_TOKENS
    res = {}
    try:
        for d, ids in held_ids.items():
            n = len(ids) // W
            windows = np.concatenate([np.zeros((n, 1), dtype=np.int64), ids[: n * W].reshape(n, W)], axis=1)
            total = 0.0
            per_window = []
            counts = np.zeros((len(routers), n_experts), dtype=np.int64)
            for b in range(0, n, BATCH):
                x = torch.from_numpy(windows[b : b + BATCH])
                captured.clear()
                with torch.no_grad():
                    logits = model(input_ids=x).logits.float()
                lp = torch.log_softmax(logits[:, :-1], dim=-1)
                nll = -lp.gather(-1, x[:, 1:, None])[..., 0].double()  # [B, 255]
                per_window += [float(v) for v in nll.sum(1)]
                total += float(nll.sum())
                assert len(captured) == len(routers)
                for li, idx in enumerate(captured):
                    idx = idx.view(x.shape[0], x.shape[1], top_k)[:, 1:]  # drop position 0 (<|endoftext|>)
                    counts[li] += np.bincount(idx.reshape(-1).numpy(), minlength=n_experts)
            res[d] = dict(n_windows=n, scored_tokens=n * W, total_nll=total, per_window_nll=per_window,
                          counts=counts)
    finally:
        for h in hooks:
            h.remove()
    return res


def unigram_nll(train_ids_list, held_scored, vocab):
    """Add-one-smoothed unigram model from the given training ids; total NLL of held_scored (nats)."""
    import numpy as np

    c = np.zeros(vocab, dtype=np.float64)
    for ids in train_ids_list:
        c += np.bincount(ids, minlength=vocab)
    p = (c + 1.0) / (c.sum() + vocab)
    return float(-np.log(p[held_scored]).sum())


def cosine(a, b):
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def run(model_dir: Path, threads: int = 2, results_prefix: str | None = None):
    import numpy as np
    import torch
    from tokenizers import Tokenizer

    import gen_model_fixtures as gmf

    torch.set_num_threads(threads)
    t0 = time.time()
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    vocab = cfg["vocab_size"]
    top_k, n_experts, n_layers = cfg["num_experts_per_tok"], cfg["num_experts"], cfg["num_hidden_layers"]
    splits = tdm.load_splits()
    for d in tdm.DOMAINS:
        for s in tdm.SPECIAL_TOKENS:
            assert s not in splits[d][0] and s not in splits[d][1], (d, s)
    held_ids = {d: tdm.encode(tok, splits[d][1]) for d in tdm.DOMAINS}
    train_ids = {d: tdm.encode(tok, splits[d][0]) for d in tdm.DOMAINS}
    model = gmf.load_saved(model_dir)  # float32, eager attention, eager experts
    assert model.config._experts_implementation == "eager"
    log(f"measuring {model_dir} ({n_layers} layers, {n_experts} experts top-{top_k}, vocab {vocab})")
    ev = evaluate(model, held_ids, top_k, n_experts)

    W = WINDOW_TEXT_TOKENS
    # UTF-8 bytes per token id: a byte-level BPE token is a string over the 256-symbol ByteLevel alphabet, one
    # symbol per byte (special tokens never occur in the scored text)
    from tokenizers.pre_tokenizers import ByteLevel

    alpha = set(ByteLevel.alphabet())
    id_bytes = np.zeros(vocab, dtype=np.int64)
    for s, i in tok.get_vocab().items():
        id_bytes[i] = len(s) if all(ch in alpha for ch in s) else len(s.encode("utf-8"))
    domains = {}
    for d in tdm.DOMAINS:
        r = ev[d]
        ids = held_ids[d]
        scored = ids[: r["n_windows"] * W]
        info = splits[d][2]
        uni_all = unigram_nll([train_ids[x] for x in tdm.DOMAINS], scored, vocab)
        uni_dom = unigram_nll([train_ids[d]], scored, vocab)
        nbytes = int(id_bytes[scored].sum())
        counts = r["counts"]
        domains[d] = dict(
            file=info["file"], file_sha256=info["file_sha256"], file_bytes=info["file_bytes"],
            heldout_start_byte=info["heldout_start_byte"], heldout_bytes=info["heldout_bytes"],
            heldout_tokens=int(len(ids)), heldout_token_ids_sha256=_ids_sha256(ids),
            heldout_first_token_ids=[int(v) for v in ids[:16]],
            n_windows=r["n_windows"], scored_tokens=r["scored_tokens"], scored_bytes=nbytes,
            total_nll=r["total_nll"], mean_nll=r["total_nll"] / r["scored_tokens"],
            perplexity=math.exp(r["total_nll"] / r["scored_tokens"]),
            bits_per_byte=r["total_nll"] / math.log(2) / nbytes,
            unigram_perplexity_all_domains=math.exp(uni_all / r["scored_tokens"]),
            unigram_perplexity_same_domain=math.exp(uni_dom / r["scored_tokens"]),
            per_window_nll=r["per_window_nll"],
            expert_counts={str(li): [int(v) for v in counts[li]] for li in range(n_layers)},
        )
        log(f"  {d:10s} windows {r['n_windows']:4d}  ppl {domains[d]['perplexity']:8.2f}  "
            f"(unigram {domains[d]['unigram_perplexity_all_domains']:7.1f} / same-domain "
            f"{domains[d]['unigram_perplexity_same_domain']:7.1f})  bpb {domains[d]['bits_per_byte']:.3f}")
    tot_nll = sum(v["total_nll"] for v in domains.values())
    tot_tok = sum(v["scored_tokens"] for v in domains.values())

    routing = {}
    best_ratio, best_cos = (0.0, None, None), (2.0, None, None)
    for li in range(n_layers):
        L = {}
        ratios = {}
        for d in tdm.DOMAINS:
            c = np.array(domains[d]["expert_counts"][str(li)], np.float64)
            mean = c.sum() / n_experts
            ratios[d] = dict(max_over_mean=float(c.max() / mean), min_over_mean=float(c.min() / mean),
                             argmax_expert=int(c.argmax()), cv=float(c.std() / mean),
                             load_over_mean=[round(float(v / mean), 4) for v in c])
            if ratios[d]["max_over_mean"] > best_ratio[0]:
                best_ratio = (ratios[d]["max_over_mean"], li, d)
        cos = {}
        for a in tdm.DOMAINS:
            cos[a] = {}
            for b in tdm.DOMAINS:
                cos[a][b] = round(cosine(domains[a]["expert_counts"][str(li)], domains[b]["expert_counts"][str(li)]), 4)
                if a < b and cos[a][b] < best_cos[0]:
                    best_cos = (cos[a][b], li, f"{a}/{b}")
        pooled = sum(np.array(domains[d]["expert_counts"][str(li)], np.float64) for d in tdm.DOMAINS)
        pooled_ratio = pooled / (pooled.sum() / n_experts)
        L["all_domains"] = dict(max_over_mean=float(pooled_ratio.max()),
                                load_over_mean=[round(float(v), 4) for v in pooled_ratio],
                                idle_experts=[int(e) for e in np.nonzero(pooled_ratio < IDLE_FRACTION)[0]])
        L["per_domain"] = ratios
        L["cosine"] = cos
        routing[str(li)] = L
    summary = dict(
        max_max_over_mean=dict(value=round(best_ratio[0], 4), layer=best_ratio[1], domain=best_ratio[2]),
        min_cosine=dict(value=best_cos[0], layer=best_cos[1], domains=best_cos[2]),
        overall_perplexity=math.exp(tot_nll / tot_tok),
        requirement_met=bool(best_ratio[0] >= 2.0 and best_cos[0] < 0.9),
    )
    log(f"  overall ppl {summary['overall_perplexity']:.2f}; max max/mean {best_ratio[0]:.2f} (layer {best_ratio[1]}, "
        f"{best_ratio[2]}); min cosine {best_cos[0]:.3f} (layer {best_cos[1]}, {best_cos[2]})")

    out = dict(
        model_dir=str(model_dir.relative_to(tdm.REPO)) if model_dir.resolve().is_relative_to(tdm.REPO) else str(model_dir),
        reference="HF transformers OlmoeForCausalLM.from_pretrained(dtype=float32, attn_implementation='eager', "
                  "experts_implementation='eager') on the bf16 checkpoint (weights upcast to float32)",
        protocol=dict(
            heldout_rule="heldout_start_byte = 1 + offset of the first b'\\n' at or after floor(0.95 * file_bytes); "
                         "held-out text = file[heldout_start_byte:], decoded as UTF-8",
            tokenization="tokenizer.json on the whole held-out text as one string, no special tokens added; "
                         "heldout_token_ids_sha256 = sha256 of the ids as little-endian int32",
            window_text_tokens=W,
            window_input="[0 (<|endoftext|>)] + t[j*255:(j+1)*255] for j in 0..n_windows-1, n_windows = "
                         "floor(heldout_tokens / 255); positions 0..255; each window independent; remainder unused",
            nll="sum over windows and i=0..254 of -log_softmax(float32 logits[i])[input[i+1]] (natural log), "
                "accumulated in float64; perplexity = exp(total_nll / scored_tokens), scored_tokens = 255 * n_windows",
            bits_per_byte="total_nll / ln 2 / scored_bytes, scored_bytes = UTF-8 bytes of the scored tokens",
            routing="per MoE layer: router top-k ids (k=num_experts_per_tok) at window positions 1..255 (position 0 "
                    "excluded); expert_counts[layer][e] = number of (token, slot) assignments; max_over_mean = "
                    "max(counts) / (sum(counts) / num_experts); cosine between domains' count vectors",
            unigram_baselines="add-one-smoothed unigram token model from the training split token counts (all "
                              "domains pooled / the same domain only), on the same scored tokens",
            batch=f"windows evaluated in batches of {BATCH} (no padding; same result as one at a time up to "
                  f"float rounding)",
        ),
        config={k: cfg[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                     "num_attention_heads", "num_key_value_heads", "num_experts",
                                     "num_experts_per_tok", "norm_topk_prob", "router_aux_loss_coef")},
        summary=summary,
        domains=domains,
        routing=routing,
        olmoe_comparison=olmoe_comparison(domains, n_layers, n_experts),
        seconds=round(time.time() - t0, 1),
    )
    if results_prefix:
        name = model_dir.resolve().name
        tdm.RESULTS.mkdir(parents=True, exist_ok=True)
        (tdm.RESULTS / f"{results_prefix}_eval.json").write_text(json.dumps(out, indent=1) + "\n")
        plot(out, tdm.RESULTS / f"{results_prefix}_routing.png", name)
        md = tables_md(out)
        (tdm.RESULTS / f"{results_prefix}_eval.md").write_text(
            f"# {name}: held-out perplexity and routing\n\nGenerated by `tools/measure_default_model.py`"
            f" (protocol in `{results_prefix}_eval.json` and the model card).\n\n" + md)
        write_model_card(model_dir, out, md, results_prefix)
    else:
        (model_dir / "eval.json").write_text(json.dumps(out, indent=1) + "\n")
    log(f"measured in {time.time() - t0:.0f} s")
    return out


# our domain -> the same text's name in ../shared/data/routing/olmoe_mixtral_expert_counts.json
OLMOE_DOMAINS = {"arxiv": "arxiv", "books": "book", "code": "github", "web": "c4", "wikipedia": "wikipedia"}
ROUTING_COUNTS = tdm.CORPUS.parent / "routing" / "olmoe_mixtral_expert_counts.json"


def skew_stats(counts_by_domain: dict) -> dict:
    """One layer's skew: per-domain max/mean and coefficient of variation of tokens per expert, and the divergence
    between domains (mean pairwise Jensen-Shannon divergence of the per-domain load distributions, bits; smallest
    pairwise cosine)."""
    import numpy as np

    dists = {d: np.asarray(c, np.float64) / np.sum(c) for d, c in counts_by_domain.items()}
    n = len(next(iter(dists.values())))

    def js(p, q):
        m = (p + q) / 2

        def kl(a, b):
            nz = a > 0
            return float(np.sum(a[nz] * np.log2(a[nz] / b[nz])))

        return (kl(p, m) + kl(q, m)) / 2

    pairs = [(a, b) for a in dists for b in dists if a < b]
    return dict(
        max_over_mean={d: round(float(p.max() * n), 3) for d, p in dists.items()},
        cv={d: round(float(p.std() * n), 3) for d, p in dists.items()},
        mean_pairwise_js_bits=round(float(np.mean([js(dists[a], dists[b]) for a, b in pairs])), 4),
        min_pairwise_cosine=round(min(cosine(dists[a], dists[b]) for a, b in pairs), 4),
    )


def olmoe_comparison(domains: dict, n_layers: int, n_experts: int) -> dict:
    """This model's per-layer skew beside real OLMoE-1B-7B's (64 experts, top-8; layers 0, 7, 15 of 16) on the same
    five domains' text."""
    real = json.loads(ROUTING_COUNTS.read_text())["olmoe"]["expert_counts"]
    ours = {str(li): skew_stats({d: domains[d]["expert_counts"][str(li)] for d in tdm.DOMAINS})
            for li in range(n_layers)}
    theirs = {layer: skew_stats({d: real[o][layer] for d, o in OLMOE_DOMAINS.items()})
              for layer in sorted(real["arxiv"], key=int)}
    return dict(source=f"../shared/data/routing/{ROUTING_COUNTS.name} (olmoe, expert_counts; domains "
                       + ", ".join(f"{d}={o}" for d, o in OLMOE_DOMAINS.items()) + ")",
                this_model=dict(experts=n_experts, layers=ours), olmoe_1b_7b=dict(experts=64, layers=theirs))


def comparison_md(cmp: dict) -> str:
    D = tdm.DOMAINS
    s = ["## Routing skew beside real OLMoE-1B-7B\n",
         f"Source of OLMoE's counts: {cmp['source']}. max/mean = the busiest expert's tokens over the mean; JS = mean "
         "Jensen-Shannon divergence (bits) between two domains' load distributions; cosine = the least similar pair.\n",
         "| model | layer | " + " | ".join(f"{d} max/mean" for d in D) + " | mean JS (bits) | min cosine |",
         "| --- | ---: |" + " ---: |" * (len(D) + 2)]
    for label, key in (("this model", "this_model"), ("OLMoE-1B-7B", "olmoe_1b_7b")):
        for li, st in cmp[key]["layers"].items():
            s.append(f"| {label} ({cmp[key]['experts']} experts) | {li} | "
                     + " | ".join(f"{st['max_over_mean'][d]:.2f}" for d in D)
                     + f" | {st['mean_pairwise_js_bits']:.3f} | {st['min_pairwise_cosine']:.3f} |")
    return "\n".join(s) + "\n"


def tables_md(ev) -> str:
    D = tdm.DOMAINS
    s = []
    s.append("## Held-out perplexity (per domain)\n")
    s.append("| domain | windows | scored tokens | total NLL (nats) | perplexity | bits/byte | unigram ppl (all "
             "domains) | unigram ppl (same domain) |")
    s.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for d in D:
        v = ev["domains"][d]
        s.append(f"| {d} | {v['n_windows']} | {v['scored_tokens']} | {v['total_nll']:.3f} | {v['perplexity']:.2f} | "
                 f"{v['bits_per_byte']:.3f} | {v['unigram_perplexity_all_domains']:.1f} | "
                 f"{v['unigram_perplexity_same_domain']:.1f} |")
    s.append(f"| all | | {sum(ev['domains'][d]['scored_tokens'] for d in D)} | | "
             f"{ev['summary']['overall_perplexity']:.2f} | | | |\n")
    sm = ev["summary"]
    s.append("## Routing (top-k assignments over the held-out tokens)\n")
    s.append(f"Largest max/mean: **{sm['max_max_over_mean']['value']:.2f}** (layer {sm['max_max_over_mean']['layer']}, "
             f"{sm['max_max_over_mean']['domain']}); smallest domain-pair cosine: **{sm['min_cosine']['value']:.3f}** "
             f"(layer {sm['min_cosine']['layer']}, {sm['min_cosine']['domains']}).\n")
    s.append("Summary per layer: max/mean per domain and with all domains pooled; smallest domain-pair cosine; idle "
             "experts (load, all domains pooled, below 5% of the mean):\n")
    s.append("| layer | " + " | ".join(D) + " | pooled | min cosine | idle experts |")
    s.append("| --- |" + " ---: |" * (len(D) + 2) + " --- |")
    for li, L in ev["routing"].items():
        mc = min((L["cosine"][a][b], a, b) for a in D for b in D if a < b)
        idle = L["all_domains"]["idle_experts"]
        s.append(f"| {li} | " + " | ".join(f"{L['per_domain'][d]['max_over_mean']:.2f}" for d in D) +
                 f" | {L['all_domains']['max_over_mean']:.2f} | {mc[0]:.3f} ({mc[1]}/{mc[2]}) | "
                 f"{len(idle)}: {', '.join(f'e{e}' for e in idle) or '-'} |")
    s.append("")
    s.append(comparison_md(ev["olmoe_comparison"]))
    E = ev["config"]["num_experts"]
    for li, L in ev["routing"].items():
        s.append(f"### Layer {li}\n")
        s.append("Tokens per expert / mean (mean = scored tokens x k / experts):\n")
        s.append("| domain | " + " | ".join(f"e{e}" for e in range(E)) + " | max/mean |")
        s.append("| --- |" + " ---: |" * (E + 1))
        for d in D:
            p = L["per_domain"][d]
            s.append(f"| {d} | " + " | ".join(f"{v:.2f}" for v in p["load_over_mean"]) +
                     f" | **{p['max_over_mean']:.2f}** |")
        s.append("\nCosine similarity of the domains' expert-load vectors:\n")
        s.append("| | " + " | ".join(D) + " |")
        s.append("| --- |" + " ---: |" * len(D))
        for a in D:
            s.append(f"| {a} | " + " | ".join(f"{L['cosine'][a][b]:.3f}" for b in D) + " |")
        s.append("")
    return "\n".join(s) + "\n"


def plot(ev, path: Path, name: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    D = tdm.DOMAINS
    layers = list(ev["routing"].keys())
    E = ev["config"]["num_experts"]
    fig, axes = plt.subplots(len(layers), 1, figsize=(12 if E <= 16 else 20, 2.6 * len(layers)), sharex=True)
    width = 0.8 / len(D)
    x = np.arange(E)
    for ax, li in zip(np.atleast_1d(axes), layers):
        for k, d in enumerate(D):
            ax.bar(x - 0.4 + width * (k + 0.5), ev["routing"][li]["per_domain"][d]["load_over_mean"], width,
                   label=d)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_ylabel(f"layer {li}\nload / mean")
        mm = max(ev["routing"][li]["per_domain"][d]["max_over_mean"] for d in D)
        mc = min(ev["routing"][li]["cosine"][a][b] for a in D for b in D)
        ax.set_title(f"layer {li}: max max/mean {mm:.2f}, min domain-pair cosine {mc:.3f}", fontsize=9)
    ax.set_xticks(x)
    ax.set_xticklabels([f"e{e}" for e in x], fontsize=8 if E <= 16 else 6, rotation=0 if E <= 16 else 90)
    ax.set_xlabel("expert")
    np.atleast_1d(axes)[0].legend(ncol=len(D), fontsize=8, loc="upper right")
    fig.suptitle(f"{name}: per-domain expert load over held-out tokens "
                 f"(top-{ev['config']['num_experts_per_tok']} assignments)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cpu_desc(tl) -> str:
    import os

    return f"{tl.get('cpu_count', os.cpu_count())} cores"


def _step_times(hist) -> str:
    """Median and fastest seconds per step over the logged 25-step intervals (the machine may be shared)."""
    import numpy as np

    iv = [(b["elapsed_s"] - a["elapsed_s"]) / (b["step"] - a["step"]) for a, b in zip(hist[1:], hist[2:])
          if b["step"] > a["step"]]
    if not iv:
        return "no step timings logged"
    return (f"median {float(np.median(iv)):.2f} s/step, fastest 25-step interval {min(iv):.2f} s/step; the wall clock "
            f"depends on other load on the machine")


# what each embedded model is for, and why its balance-loss coefficient is what it is
CARD_PURPOSE = {
    "default_model": (
        "CapServe's embedded default model: a small mixture-of-experts language model",
        "It exists to give the server a real model out of the box whose routing shows real, domain-dependent expert "
        "imbalance.",
        "The coefficient is deliberately light: routing is left free to specialize by domain and to concentrate, as in "
        "real OLMoE; the price is that some experts end up nearly idle in the deeper layers (see \"idle experts\" "
        "below)."),
    "fine_model": (
        "CapServe's fine-grained expert model: OLMoE's shape in miniature (64 experts, top-8), a mixture-of-experts "
        "language model",
        "It is the model the capacity and batch-selection levers are evaluated on: many small experts that specialize "
        "by domain, as in OLMoE, where the tiny default model has 16 experts top-2. Each expert is a quarter of a "
        "capserve-moe-tiny expert, so both models have the same total and active expert parameters and were trained "
        "identically otherwise (same tokenizer, data, steps and schedule): the difference is granularity.",
        "The coefficient is OLMoE-1B-7B's (0.01)."),
}


def write_model_card(model_dir: Path, ev, tables: str, results_prefix: str):
    headline, purpose, aux_note = CARD_PURPOSE[results_prefix]
    preset = next(k for k, v in tdm.PRESETS.items() if v["results_prefix"] == results_prefix)
    tl_path = tdm.RESULTS / f"{results_prefix}_train.json"
    tl = json.loads(tl_path.read_text()) if tl_path.exists() else {}
    cfg = json.loads((model_dir / "config.json").read_text())
    files = sorted(f for f in model_dir.iterdir() if f.is_file() and f.name != "MODEL_CARD.md")
    size = sum(f.stat().st_size for f in files)
    pc = tl.get("params", {})
    timing = tl.get("timing", {})
    data = tl.get("data", {})
    hist = tl.get("history", [])
    last = hist[-1] if hist else {}
    D = tdm.DOMAINS
    keys = ["architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "num_experts", "num_experts_per_tok", "norm_topk_prob",
            "router_aux_loss_coef", "max_position_embeddings", "rope_parameters", "rms_norm_eps", "clip_qkv",
            "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "dtype"]
    cfg_lines = "\n".join(f"| `{k}` | `{json.dumps(cfg.get(k))}` |" for k in keys if k in cfg)
    data_rows = "\n".join(
        f"| {d} | {data[d]['file_bytes']:,} | {data[d]['heldout_start_byte']:,} | {data[d]['heldout_bytes']:,} | "
        f"{data[d]['train_tokens']:,} | {data[d]['heldout_tokens']:,} |" for d in D if d in data)
    file_rows = "\n".join(f"| `{f.name}` | {f.stat().st_size:,} |" for f in files)
    card = f"""# {model_dir.resolve().name}

{headline} (HF transformers `OlmoeForCausalLM`,
the OLMoE architecture) trained from scratch on CPU on the project's domain corpus (arXiv LaTeX, books, GitHub code,
C4 web text, multilingual Wikipedia). It is a genuine Hugging Face checkpoint: `from_pretrained` loads it, and its
tensors carry the classic per-expert Hub names of OLMoE (`model.layers.N.mlp.gate.weight`,
`model.layers.N.mlp.experts.E.{{gate,up,down}}_proj.weight`). {purpose} It is tiny and briefly trained on 2 CPU cores: its
text is locally plausible but it knows nothing and follows no instructions (it saw no chat data; the chat markers are
special tokens with untrained embeddings).

## Files

| file | bytes |
| --- | ---: |
{file_rows}
| total | {size:,} ({size / 1e6:.2f} MB) |

Weights are stored as **bf16** (trained in float32, rounded to bf16 for export; every measurement below uses exactly
those bf16 values upcast to float32).

## Configuration

| key | value |
| --- | --- |
{cfg_lines}

Parameters: {pc.get('total', 0) / 1e6:.2f} M in total ({pc.get('experts', 0) / 1e6:.2f} M in experts,
{pc.get('embeddings', 0) / 1e6:.2f} M in the input embedding + untied `lm_head`, {pc.get('attention', 0) / 1e6:.2f} M
in attention); {pc.get('active_per_token', 0) / 1e6:.2f} M active per token. Head dim
{cfg['hidden_size'] // cfg['num_attention_heads']}; router: softmax over {cfg['num_experts']} experts, top-{cfg['num_experts_per_tok']},
weights not renormalized (`norm_topk_prob` false, as OLMoE-1B-7B); OLMoE's q_norm/k_norm over the whole q/k vectors.

## Tokenizer

Byte-level BPE trained with HF `tokenizers` {tl.get('versions', {}).get('tokenizers', '')} on the training split of
all five domains (32-line chunks): vocabulary {cfg['vocab_size']} (5 special tokens + 256 byte symbols + merges,
min frequency 2); pre-tokenizer = `Split` with GPT-2's regex
(`{tdm.GPT2_SPLIT_REGEX}`, isolated) followed by `ByteLevel` (no prefix space, `use_regex` false), no normalizer,
`ByteLevel` decoder; the post-processor transformers writes is a `TemplateProcessing` that adds nothing (no bos/eos
is added when encoding; the chat template writes `<|endoftext|>` itself).
Special tokens: `<|endoftext|>` = 0 (bos and eos), `<pad>` = 1, `<|system|>` = 2, `<|user|>` = 3, `<|assistant|>` = 4.
`tokenizer_config.json` has `bos_token`/`eos_token` `<|endoftext|>`, `pad_token` `<pad>`, `model_max_length`
{tdm.MAX_POSITION_EMBEDDINGS}, and the chat template of allenai/OLMoE-1B-7B-0924-Instruct (open-instruct's Tulu
template with a leading `bos_token`):

```
<|endoftext|><|system|>
{{system}}
<|user|>
{{user}}
<|assistant|>
{{assistant}}<|endoftext|>
<|user|>
{{user}}
<|assistant|>
```

## Data and split

`../shared/data/corpus/{{arxiv,books,code,web,wikipedia}}.txt` (the text OLMoE's routing analysis was run on; see
`../shared/data/README.md`). Each file is split at a line boundary: the held-out part starts right after the first
newline at or after byte floor(0.95 x size); the training part (the first ~95%) is everything before. The held-out
parts were seen by neither the tokenizer trainer nor the model.

| domain | file bytes | held-out start byte | held-out bytes | train tokens | held-out tokens |
| --- | ---: | ---: | ---: | ---: | ---: |
{data_rows}

## Training

OLMoE initialization (normal, std 0.02), then AdamW (betas {tuple(tl.get('betas', ()))}, weight decay
{tl.get('weight_decay')} on matrices, none on norms and the input embedding), peak learning rate {tl.get('lr')} with
{tl.get('warmup')} warm-up steps and cosine decay to {tl.get('min_lr_frac')} x peak, gradient clipping
{tl.get('grad_clip')}, {tl.get('steps')} steps. Each step: {tl.get('batch_sequences')} sequences of {tl.get('seq_len')}
tokens = `<|endoftext|>` + 255 consecutive training tokens of one domain at a uniformly random offset,
{tl.get('seqs_per_domain')} per domain (every batch mixes all domains equally); {tl.get('tokens_seen', 0) / 1e6:.2f} M
text tokens in all (about {tl.get('tokens_seen', 0) / max(1, sum(data[d]['train_tokens'] for d in D if d in data)):.2f}
epochs). Loss = cross-entropy + `router_aux_loss_coef` ({cfg['router_aux_loss_coef']}) x transformers' Switch-style
load-balancing loss (`output_router_logits=True`; its value is top-k = {cfg['num_experts_per_tok']} for perfectly
balanced routing). {aux_note} Final
training loss (EMA) {last.get('lm_loss_ema')}, aux loss {last.get('aux_loss')}. Training used transformers'
`{tl.get('train_experts_impl')}` experts implementation; export and all measurements use the eager loop.

Hardware and time: {tl.get('cpu', 'CPU')} ({_cpu_desc(tl)}), {tl.get('threads')} threads, CPU only, torch
{tl.get('versions', {}).get('torch', '')}, transformers {tl.get('versions', {}).get('transformers', '')}. Tokenizer
training {timing.get('tokenizer_s')} s, model training {timing.get('train_s')} s ({timing.get('train_s', 0) / 60:.1f} min
wall clock; {_step_times(hist)}), export + checks {timing.get('export_check_s')} s, measurement {ev['seconds']} s.
Seed {tl.get('seed')}.

## Evaluation protocol

Reference: HF transformers `from_pretrained(dtype=float32, attn_implementation="eager", experts_implementation="eager")`
on this directory. Per domain:

1. held-out text = `corpus/D.txt` from `heldout_start_byte` (table above) to the end, decoded as UTF-8;
2. token ids t[0..N-1] = `tokenizer.json` on that whole text as one string, no special tokens added;
3. windows: n = floor(N / 255); window j = `[0]` (`<|endoftext|>`) + t[j*255 : (j+1)*255], 256 tokens, positions
   0..255, each evaluated independently; the last N - 255n tokens are unused;
4. NLL = sum over windows and i = 0..254 of -log softmax(float32 logits[i])[window[i+1]] (natural log, accumulated in
   float64); scored tokens = 255n; perplexity = exp(NLL / scored tokens);
5. routing: each MoE layer's router top-{cfg['num_experts_per_tok']} expert ids at window positions 1..255 (the text
   tokens; position 0 is not counted); tokens per expert = number of (token, slot) assignments.

`tools/results/{results_prefix}_eval.json` stores, per domain, the held-out start byte, token count, sha256 of the
held-out token ids (little-endian int32), the per-window and total NLL, and the per-layer expert counts.

{tables}
For comparison (`../shared/data/routing/`): real OLMoE-1B-7B (64 experts, top-8) reaches max/mean 2.5-7.8 on the
same domains, Mixtral-8x7B (8 experts, top-2) 1.08-1.33.

![per-domain expert load](../../../tools/results/{results_prefix}_routing.png)

## Regenerate

```
python3 -m venv tools/.venv && tools/.venv/bin/pip install -r tools/requirements.txt
tools/.venv/bin/python tools/train_default_model.py --preset {preset}   # tokenizer, training, export, checks, measurement
tools/.venv/bin/python tools/measure_default_model.py --preset {preset} # measurement only (rewrites this card's numbers)
```

Deterministic (fixed seeds and step count); bit-identical weights need the same torch build and thread count
(`--threads`, default 2).

## License and provenance

Trained by CapServe's `tools/train_default_model.py` on text from allenai/OLMoE's repository (Apache-2.0; text from
Dolma sources). Architecture and chat template follow allenai/OLMoE-1B-7B-0924(-Instruct).
"""
    (model_dir / "MODEL_CARD.md").write_text(card)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(tdm.PRESETS), default="tiny")
    ap.add_argument("--model", type=Path, help="model directory (default: the preset's)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    preset = tdm.PRESETS[args.preset]
    model = args.model or preset["out"]
    own = model.resolve() == preset["out"].resolve()
    run(model, args.threads, results_prefix=preset["results_prefix"] if own else None)


if __name__ == "__main__":
    main()
