"""Compares capserve's structured-output masks with xgrammar's (tools/grammar/requirements-xgrammar.txt) on the
default model's tokenizer, at every state of token walks through each schema of a corpus.

Walks: valid instances of each schema (generated here; checked with jsonschema), tokenized as the model would
write them, compact and indented; then from random points of those, random continuations that xgrammar allows.
At every state both engines' masks must be equal, and both must accept every token of the instances.

Usage: tools/.venv-xgrammar/bin/python tools/grammar/compare_xgrammar.py [--corpus F] [--tool T] [--model DIR]
Prints one line per schema and a summary; exits 1 on any difference but those the corpus lists under
"xgrammar_differs" (xgrammar's own departures from JSON, which capserve does not copy).
"""
import argparse
import copy
import json
import random
import re
import subprocess
import sys

import jsonschema
import numpy as np
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

WORDS = ["alpha", "beta", "hello world", "Zürich", "naïve café", "a\"quote", "back\\slash", "tab\tline\n", "東京", ""]


# vLLM's other constraint kinds (guided regex, grammar, choice), with texts to walk.
REGEXES = [
    ("regex_email", r"[a-z0-9._]+@[a-z]+\.(com|org)", ["john.doe@example.com", "a_b@x.org"]),
    ("regex_phone", r"\(\d{3}\) \d{3}-\d{4}", ["(555) 123-4567"]),
    ("regex_date_words", r"(Mon|Tue|Wed), \d{1,2} [A-Z][a-z]+ 20\d\d", ["Mon, 3 March 2025", "Wed, 12 May 2031"]),
    ("regex_unicode", r"[^\n]{1,12}!", ["héllo wörld!", "東京!"]),
    ("regex_sentence", r"[A-Z][a-z ,]*[.?]", ["The cat sat on the mat.", "Why, though?"]),
    ("regex_number_list", r"\[(\d+(, \d+)*)?\]", ["[1, 22, 333]", "[]"]),
]
GRAMMARS = [
    ("ebnf_arithmetic", """root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+ ("." [0-9]+)?
""", ["1+2*3", "(4.5-1)/2", "((7))"]),
    ("ebnf_pairs", """root ::= pair ("," " "? pair){0,3}
pair ::= key "=" value   # a key, then its value
key ::= [a-z_]+
value ::= "\\"" [^"\\n]* "\\"" | [0-9]+
""", ['a=1, b="x y"', 'k_="\u00e9t\u00e9",z=22']),
    ("ebnf_answer", """# an answer
root ::= ("yes" | "no")
    "\\n"?
""", ["yes", "no\n"]),
]
CHOICES = [
    ("choice_sentiment", ["positive", "negative", "neutral"]),
    ("choice_prefixes", ["yes", "yes please", "no"]),
]


def resolve(ref, root):
    node = root
    for part in ref.lstrip("#/").split("/"):
        if part:
            node = node[part]
    return node


def instance(schema, root, rng, depth=0):
    """A random value valid under `schema` (the subset the corpus uses; patterns take their `examples`)."""
    if schema is True or schema == {}:
        return rng.choice([1, "x", None, True, [1, 2], {"k": "v"}])
    if "$ref" in schema:
        return instance(resolve(schema["$ref"], root), root, rng, depth)
    if "examples" in schema:
        return rng.choice(schema["examples"])
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return rng.choice(schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return instance(rng.choice(schema[key]), root, rng, depth)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = rng.choice(kind)
    if kind is None:
        kind = "object" if "properties" in schema or "additionalProperties" in schema else "string"
    if kind == "object":
        out = {}
        required = set(schema.get("required", []))
        for name, sub in schema.get("properties", {}).items():
            if name in required or (depth < 3 and rng.random() < 0.5):
                out[name] = instance(sub, root, rng, depth + 1)
        extra = schema.get("additionalProperties", not schema.get("properties"))
        if extra is not False and rng.random() < 0.6:
            for i in range(rng.randint(1, 2)):
                out[f"extra_{i}"] = instance(extra if isinstance(extra, dict) else True, root, rng, depth + 1)
        return out
    if kind == "array":
        lo = schema.get("minItems", 0)
        hi = min(schema.get("maxItems", lo + 3), lo + 3)
        if depth >= 3:
            hi = lo
        return [instance(schema.get("items", True), root, rng, depth + 1) for _ in range(rng.randint(lo, hi))]
    if kind == "string":
        lo, hi = schema.get("minLength", 0), schema.get("maxLength", None)
        if "minLength" in schema or "maxLength" in schema:
            n = rng.randint(lo, hi if hi is not None else lo + 8)
            return "".join(rng.choice("abcdé xyz") for _ in range(n))
        return rng.choice(WORDS)
    if kind == "integer":
        lo = schema.get("minimum", schema.get("exclusiveMinimum", -10**6 - 1) + 1)
        hi = schema.get("maximum", schema.get("exclusiveMaximum", 10**6 + 1) - 1)
        return rng.choice([lo, hi, rng.randint(lo, hi)])
    if kind == "number":
        lo = max(schema.get("minimum", -1e9), schema.get("exclusiveMinimum", -1e9) + 1e-3)
        hi = min(schema.get("maximum", 1e9), schema.get("exclusiveMaximum", 1e9) - 1e-3)
        return rng.choice([x for x in (0, -3, 2.5, 0.125, 123456.789, -0.25, 1) if lo <= x <= hi] or [lo])
    if kind == "boolean":
        return rng.choice([True, False])
    if kind == "null":
        return None
    raise ValueError(f"no instance for {schema}")


def byte_decoder():
    """GPT-2's byte-level alphabet, character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def ends_inside_character(data):
    """Whether the bytes end with the lead (and maybe some continuation bytes) of a multi-byte character."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b < 0x80:
            return False
        if b >= 0xC0:
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return back < need
    return False


def fnv1a64(words):
    """FNV-1a (64-bit) of the mask's words as little-endian bytes: what the recorded walks keep of a mask."""
    h = 0xCBF29CE484222325
    for b in words.astype("<u4").tobytes():
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def xgrammar_masks(compiled, tokens, words, special):
    """xgrammar's mask at every state of the walk (stopping at its first refusal) and which tokens it accepted."""
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    masks, accepted = [], []

    def fill():
        if matcher.is_terminated():  # xgrammar refuses a mask then; ours is all zeros
            masks.append(np.zeros(words, dtype=np.uint32))
            return
        matcher.fill_next_token_bitmask(bitmask)
        masks.append(bitmask[0].numpy()[:words].astype(np.uint32) & ~special)

    fill()
    for t in tokens:
        ok = matcher.accept_token(t)
        accepted.append(ok)
        if not ok:
            break
        fill()
    return masks, accepted


def random_continuation(compiled, prefix, rng, steps, words, special):
    matcher = xgr.GrammarMatcher(compiled)
    for t in prefix:
        assert matcher.accept_token(t)
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    out = list(prefix)
    for _ in range(steps):
        if matcher.is_terminated():
            break
        matcher.fill_next_token_bitmask(bitmask)
        allowed_words = bitmask[0].numpy()[:words].astype(np.uint32) & ~special
        bits = np.unpackbits(allowed_words.astype("<u4").view(np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits)
        if len(allowed) == 0:
            break
        t = int(rng.choice(list(allowed)))
        assert matcher.accept_token(t)
        out.append(t)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--corpus", default="tests/fixtures/grammar/schemas.json")
    p.add_argument("--tool", default="build/runtime/grammar/capserve-grammar-tool")
    p.add_argument("--model", default="deploy/models/capserve-moe-tiny")
    p.add_argument("--instances", type=int, default=3)
    p.add_argument("--detours", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--random-walks", type=int, default=0,
                   help="instead of the instances' tokens, this many random walks of 40 xgrammar-allowed tokens from"
                        " the start (for tokenizers whose encode() prefixes a space, sentencepiece's)")
    p.add_argument("--record", help="write the walks and xgrammar's mask hashes here (JSON lines) for the unit test")
    p.add_argument("--whitespace", default="any", help="any, compact, or a number (at most that many at each place)")
    args = p.parse_args()
    rng = random.Random(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    vocab_size = len(tok)
    words = (vocab_size + 31) // 32
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size, stop_token_ids=[tok.eos_token_id])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    # xgrammar lets special tokens (other than the stop token) stand for their text inside strings; capserve
    # never allows them (the detokenizer drops them, so the text would not be what the grammar checked).
    special = np.zeros(words, dtype=np.uint32)
    for i in tok.all_special_ids:
        if i != tok.eos_token_id:
            special[i // 32] |= np.uint32(1 << (i % 32))
    corpus = json.load(open(args.corpus))

    total_states = equal_states = failures = known_differences = 0
    record = open(args.record, "w") if args.record else None
    to_byte = byte_decoder()
    utf8_states = 0

    sentencepiece = "<0x0A>" in tok.get_vocab()

    def token_bytes(t):
        if not sentencepiece:
            return bytes(to_byte[c] for c in t)
        if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", t):
            return bytes([int(t[3:5], 16)])
        return t.replace("\u2581", " ").encode()

    def partial_character_difference(our, their, prefix):
        text = b"".join(token_bytes(t) for t in tok.convert_ids_to_tokens(prefix))
        return bool(np.all(our & ~their == 0)) and ends_inside_character(text)
    # (name, our constraint, xgrammar's compiled grammar, texts to walk, known difference or None)
    cases = []
    for entry in corpus:
        schema = entry["schema"]
        if args.whitespace == "any":
            ws_options, constraint = {"any_whitespace": True}, {"json_schema": schema}
        elif args.whitespace == "compact":
            ws_options, constraint = {"any_whitespace": False}, {"json_schema": schema, "whitespace": "compact"}
        else:
            n = int(args.whitespace)
            ws_options = {"any_whitespace": True, "max_whitespace_cnt": n}
            constraint = {"json_schema": schema, "whitespace": n}
        compiled = compiler.compile_json_schema(json.dumps(schema), strict_mode=True, **ws_options)
        texts = []
        for i in range(args.instances):
            value = instance(schema, schema, rng)
            jsonschema.validate(value, schema)
            texts.append(json.dumps(value, ensure_ascii=False))
            if args.whitespace == "any":
                texts.append(json.dumps(value, ensure_ascii=False, indent=2))
            elif args.whitespace != "compact":
                texts.append(json.dumps(value, ensure_ascii=False, separators=(",", ":")))
        cases.append((entry["name"], constraint, compiled, texts, entry.get("xgrammar_differs")))
    if args.whitespace == "any":  # regexes and choices have no JSON whitespace
        for name, pattern, examples in REGEXES:
            cases.append((name, {"regex": pattern}, compiler.compile_regex(pattern), examples, None))
        for name, text, examples in GRAMMARS:
            cases.append((name, {"grammar": text}, compiler.compile_grammar(text), examples, None))
        for name, choices in CHOICES:
            pattern = "(" + "|".join(re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", c) for c in choices) + ")"
            cases.append((name, {"choice": choices}, compiler.compile_regex(pattern), choices, None))

    for name, constraint, compiled, texts, known in cases:
        if args.random_walks:
            walks = [random_continuation(compiled, [], rng, 40, words, special) for _ in range(args.random_walks)]
        else:
            walks = [tok.encode(text, add_special_tokens=False) + [tok.eos_token_id] for text in texts]
        for w in list(walks):
            for _ in range(args.detours):
                cut = rng.randrange(len(w))
                walks.append(random_continuation(compiled, w[:cut], rng, 8, words, special))
        records = "".join(json.dumps({"constraint": constraint, "tokens": w}) + "\n" for w in walks)
        ours = subprocess.run([args.tool, "--model", args.model], input=records, capture_output=True, text=True,
                              check=True).stdout.splitlines()
        problems = []
        states = same = 0
        recorded = []
        for w, line in zip(walks, ours):
            r = json.loads(line)
            if "error" in r:
                problems.append("refused: " + r["error"])
                break
            theirs, their_accepted = xgrammar_masks(compiled, w, words, special)
            # null: a state after part of a character, where xgrammar allows invalid UTF-8 (not replayed).
            hashes = [fnv1a64(m) for m in theirs]
            recorded.append({"name": name, "constraint": constraint, "tokens": w,
                             "accepted": their_accepted, "masks": hashes})
            if r["accepted"] != their_accepted:
                k = next(i for i, (a, b) in enumerate(zip(r["accepted"] + [None], their_accepted + [None])) if a != b)
                our_k = np.frombuffer(bytes.fromhex(r["masks"][k]), dtype=">u4").astype(np.uint32)
                # A token that completes a character only xgrammar's UTF-8 allows (counted with the masks below).
                if not partial_character_difference(our_k, theirs[k], w[:k]):
                    problems.append(f"accepted differ: ours {r['accepted']} xgrammar {their_accepted}")
            for k, (hex_mask, their) in enumerate(zip(r["masks"], theirs)):
                our = np.frombuffer(bytes.fromhex(hex_mask), dtype=">u4").astype(np.uint32)
                states += 1
                if np.array_equal(our, their):
                    same += 1
                elif partial_character_difference(our, their, w[:k]):
                    hashes[k] = None
                    # xgrammar completes a character begun by the last token with any continuation byte,
                    # encoded surrogates (ED A0..BF) and code points past U+10FFFF (F4 90..) included;
                    # capserve allows only valid UTF-8.
                    utf8_states += 1
                elif len(problems) < 3:
                    bits_o = np.unpackbits(our.astype("<u4").view(np.uint8), bitorder="little")
                    bits_t = np.unpackbits(their.astype("<u4").view(np.uint8), bitorder="little")
                    only_o = [tok.convert_ids_to_tokens(int(i)) for i in np.flatnonzero(bits_o & ~bits_t)[:8]]
                    only_t = [tok.convert_ids_to_tokens(int(i)) for i in np.flatnonzero(bits_t & ~bits_o)[:8]]
                    problems.append(f"state {k} after {tok.decode(w[:k])!r}: only ours {only_o} only xgrammar {only_t}")
        total_states += states
        equal_states += same
        if record is not None and not known:
            for r in recorded:
                record.write(json.dumps(r, ensure_ascii=False) + "\n")
        if problems and known:
            known_differences += 1
            problems = ["known difference: " + known]
        else:
            failures += bool(problems)
        print(f"{name:28s} walks {len(walks):3d} states {states:5d} equal {same:5d}"
              + ("" if not problems else "  " + " | ".join(problems)))
    print(f"constraints {len(cases)} ({len(corpus)} schemas), with differences {failures} (and {known_differences} known, listed in the corpus);"
          f" states {total_states}, equal {equal_states}, after part of a character where xgrammar allows invalid"
          f" UTF-8 {utf8_states}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
