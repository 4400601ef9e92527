#!/usr/bin/env python3
"""Writes the local data sets of tools/eval/lm_eval_tasks/ into tools/.cache/lm_eval_data/ (the Hugging Face hub,
where lm-eval's own tasks read theirs, is not reachable from the project's machines):

- lambada_books.jsonl: LAMBADA-style passages `{"text": ...}` whose last word is the target, cut from the
  held-out tail of ../shared/data/corpus/books.txt (the part tools/train_default_model.py did not train on): the
  first 40 words of each paragraph of at least 40 words whose 40th word is purely alphabetic.
- gsm8k_test.jsonl: ../shared/data/prompts/gsm8k_test.jsonl as it is (question, answer).

Standard library only; deterministic."""

import argparse
import json
import os
import shutil

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HELDOUT_FRACTION = 0.05  # tools/train_default_model.py's held-out tail
WORDS = 40


def heldout_tail(path):
    """The text after the first newline at or after (1 - HELDOUT_FRACTION) of the file, as the trainer splits it."""
    with open(path, "rb") as f:
        data = f.read()
    cut = data.index(b"\n", int(len(data) * (1.0 - HELDOUT_FRACTION))) + 1
    return data[cut:].decode()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=os.path.join(ROOT, "../shared/data"))
    parser.add_argument("--out", default=os.path.join(ROOT, "tools/.cache/lm_eval_data"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    passages = []
    for line in heldout_tail(os.path.join(args.data, "corpus/books.txt")).splitlines():
        words = line.split()
        if len(words) >= WORDS and words[WORDS - 1].isalpha():
            passages.append({"text": " ".join(words[:WORDS])})
    with open(os.path.join(args.out, "lambada_books.jsonl"), "w") as f:
        f.writelines(json.dumps(p) + "\n" for p in passages)
    shutil.copyfile(os.path.join(args.data, "prompts/gsm8k_test.jsonl"), os.path.join(args.out, "gsm8k_test.jsonl"))
    print(f"make_lm_eval_data: {len(passages)} passages, gsm8k copied, in {args.out}")


if __name__ == "__main__":
    main()
