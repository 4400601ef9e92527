#!/usr/bin/env python3
"""Checks lm-eval's per-request log-likelihoods (its --log_samples file of a loglikelihood task whose contexts
start with <|endoftext|>, such as tools/eval/lm_eval_tasks/capserve_lambada_books.yaml) against
capserve-eval-heldout on the same tokens:

    tools/eval/compare_lm_eval_heldout.py --samples SAMPLES.jsonl [--count 5] [--build build] [--json OUT]

capserve-eval-heldout scores a window of W text tokens after <|endoftext|>, so for a request (context,
continuation) the continuation's log-likelihood is nll(W = context + continuation tokens) - nll(W = context tokens),
two runs on a document that holds the request's text. The token ids are capserve-tokenize's, checked to split as
lm-eval splits them (the context's ids a prefix of the whole text's). Exit status 1 when a difference exceeds
--tolerance (1e-4) or the tokens do not split. Debian's python3 suffices."""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EOT = "<|endoftext|>"


def tokenize(build, model, text):
    out = subprocess.run([os.path.join(build, "runtime/tokenizer/capserve-tokenize"), "--tokenizer", model],
                         input=text, check=True, capture_output=True, text=True, timeout=120).stdout
    return [int(t) for t in out.split()]


def heldout_nll(build, model, text, window):
    """capserve-eval-heldout's total negative log-likelihood of the first `window` tokens of `text`."""
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "doc.txt"), "w") as f:
            f.write("header\n" + text)  # --heldout-fraction 1: the text after the first line
        out = os.path.join(tmp, "eval.json")
        subprocess.run([os.path.join(build, "tools/capserve-eval-heldout"), "--model", model, "--corpus", tmp,
                        "--domains", "doc", "--window", str(window), "--max-windows", "1", "--batch-windows", "1",
                        "--heldout-fraction", "1", "--threads", "1", "--json", out],
                       check=True, capture_output=True, timeout=300)
        with open(out) as f:
            figures = json.load(f)["domains"]["doc"]
    if figures["tokens"] != window:
        raise RuntimeError(f"capserve-eval-heldout scored {figures['tokens']} tokens, not {window}")
    return figures["total_nll"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", required=True, help="lm-eval's samples_TASK_*.jsonl (--log_samples)")
    parser.add_argument("--count", type=int, default=5, help="requests to check (the first ones)")
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--model", default=os.path.join(ROOT, "deploy/models/capserve-moe-tiny"))
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--json", help="write the per-request figures here")
    args = parser.parse_args()
    with open(args.samples) as f:
        samples = [json.loads(line) for line in f if line.strip()][:args.count]
    if not samples:
        sys.exit(f"compare_lm_eval_heldout: no samples in {args.samples}")
    rows, worst = [], 0.0
    for s in samples:
        request = s["arguments"]["gen_args_0"]
        context, continuation = request["arg_0"], request["arg_1"]
        if not context.startswith(EOT):
            sys.exit(f"compare_lm_eval_heldout: doc {s['doc_id']}: the context does not start with {EOT}")
        text = context[len(EOT):] + continuation
        # The document goes on after the request's text, so its windows lie inside it; its ids must begin with
        # the request's ids (lm-eval scores the continuation's ids after the context's).
        context_ids = tokenize(args.build, args.model, context[len(EOT):])
        whole_ids = tokenize(args.build, args.model, text)
        document = text + "\n" + text + "\n"
        if whole_ids[:len(context_ids)] != context_ids or \
                tokenize(args.build, args.model, document)[:len(whole_ids)] != whole_ids:
            sys.exit(f"compare_lm_eval_heldout: doc {s['doc_id']}: the tokens do not split at the context")
        heldout = heldout_nll(args.build, args.model, document, len(context_ids)) - \
            heldout_nll(args.build, args.model, document, len(whole_ids))
        lm_eval = float(s["resps"][0][0][0])
        worst = max(worst, abs(lm_eval - heldout))
        rows.append({"doc_id": s["doc_id"], "continuation": continuation,
                     "continuation_tokens": len(whole_ids) - len(context_ids), "lm_eval_loglikelihood": lm_eval,
                     "capserve_eval_heldout_loglikelihood": heldout, "abs_diff": abs(lm_eval - heldout)})
        print(f"doc {s['doc_id']:>3} {continuation!r:>16} {rows[-1]['continuation_tokens']} tokens: lm-eval "
              f"{lm_eval:.6f}  capserve-eval-heldout {heldout:.6f}  |diff| {abs(lm_eval - heldout):.2e}")
    print(f"compare_lm_eval_heldout: {len(rows)} requests, max |diff| {worst:.2e} (tolerance {args.tolerance:g})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"samples": os.path.basename(args.samples), "max_abs_diff": worst,
                       "tolerance": args.tolerance, "requests": rows}, f, indent=1)
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
