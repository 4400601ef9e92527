#!/usr/bin/env python3
"""Writes the tokenizer goldens the C++ tokenizer tests compare against: Hugging Face `tokenizers` ids and
decoded text for a fixed, deterministic set of strings.

Run with the tools venv (tools/requirements.txt, the `tokenizers` it pulls in, and unicodedata2==16.0.0):

    tools/.venv/bin/python tools/gen_tokenizer_goldens.py            # default tokenizer set
    tools/.venv/bin/python tools/gen_tokenizer_goldens.py DIR ...    # only these tokenizer directories

Default tokenizers: the real ones in ../shared/data/tokenizers/ (qwen3, deepseek_v3, llama2), every
deploy/models/*/ with a tokenizer.json, and the small synthetic tokenizers in
tests/fixtures/tokenizers/synthetic/ (trained here, on first run or with --rebuild-synthetic, to cover the
tokenizer.json features the real files do not use: Metaspace, unk, split behaviours, lstrip/rstrip/single_word,
TemplateProcessing with BOS and EOS, ignore_merges, other decoders).

Output, under tests/fixtures/tokenizers/ (gzip, fixed mtime so reruns are byte-identical):
  strings.jsonl.gz   one JSON string per line, shared by all tokenizers: corpus lines, multi-line chunks and
                     random substrings of every domain in ../shared/data/corpus/, the GSM8K questions and
                     HumanEval prompts in ../shared/data/prompts/, edge cases, random Unicode strings and
                     random assigned code points with combining marks (Unicode 16.0).
  <name>.jsonl.gz    line 1: header (where the tokenizer lives, FNV-1a hash of its tokenizer.json, versions);
                     then per string {"i": index, "ids": encode(add_special_tokens=True)} plus "plain":
                     encode(add_special_tokens=False) for every 5th string, and the HF decode of "ids"
                     (skip_special_tokens=False) as "decode" or "decode_prefix" (when it is a prefix + the
                     string) when it differs from the string;
                     then {"decode_ids": random ids, "text": decode(skip_special_tokens=False),
                     "text_skip": decode(skip_special_tokens=True)} cases.
"""
import argparse
import gzip
import hashlib
import io
import json
import math
import os
import random
import sys
from pathlib import Path

import tokenizers
import unicodedata2
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared" / "data"
OUT = REPO / "tests" / "fixtures" / "tokenizers"
SYNTHETIC = OUT / "synthetic"
DOMAINS = ["arxiv", "books", "web", "code", "wikipedia"]
SEED = 20240607


def write_gzip_lines(path, lines):
    raw = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz:
        for line in lines:
            gz.write(line.encode("utf-8"))
            gz.write(b"\n")
    path.write_bytes(raw.getvalue())


def fnv1a64(data):
    """FNV-1a 64-bit: lets the C++ tests notice a tokenizer.json that changed since the goldens were made."""
    h = 0xcbf29ce484222325
    for b in data:
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def dumps(value):
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


# --------------------------------------------------------------------------------------------------- strings

def substring(rng, text, max_len):
    length = int(math.exp(rng.uniform(0, math.log(max_len))))
    start = rng.randrange(0, max(1, len(text) - length))
    return text[start:start + length]


def corpus_strings(rng):
    out = []
    for domain in DOMAINS:
        text = (SHARED / "corpus" / f"{domain}.txt").read_bytes().decode("utf-8")
        lines = text.split("\n")
        out += [rng.choice(lines) for _ in range(1200)]
        for _ in range(500):
            start = rng.randrange(len(lines))
            out.append("\n".join(lines[start:start + rng.randint(2, 6)]))
        out += [substring(rng, text, 1500) for _ in range(1300)]
    return out


def prompt_strings():
    out = []
    with open(SHARED / "prompts" / "gsm8k_test.jsonl", encoding="utf-8") as f:
        out += [json.loads(line)["question"] for line in f if line.strip()]
    with open(SHARED / "prompts" / "humaneval.jsonl", encoding="utf-8") as f:
        out += [json.loads(line)["prompt"] for line in f if line.strip()]
    return out


EDGE_CASES = [
    "", " ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\n\n\n", "\r\n", "\r", "\r\n\r\n", " \n ", "\n ", " \n",
    "a\r\nb", "a\rb", "\t\tx", "x  ", "  x", "x\t", " \t \n", "a  b   c    d", "x\u3000y", "\u3000\u3000",
    "I'm", "I'M", "he'S", "they're", "We'VE", "'s", "'ll've", "don\u2019t", "rock 'n' roll", "x'\u017f", "'\u212a",
    "''", "'", "it's'", "l'amour", "123", "1234567", "3.14159", "1,000,000", "-42", "0x1F", "1e-10", "2024-06-07",
    "\u0663\u0664\u0665", "\uff11\uff12\uff13", "\u216b", "\u00bd", "\u00b2\u00b3", "12abc34", "a1b2c3",
    "\U0001f600", "\U0001f44d\U0001f3fd", "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466",
    "\U0001f3f3\ufe0f\u200d\U0001f308", "\U0001f1fa\U0001f1f8\U0001f1ef\U0001f1f5", "\u2764\ufe0f", "a\U0001f600b",
    "e\u0301", "\u00e9", "e\u0301\u0302", "a\u0308\u0304", "\u1100\u1161\u11a8", "\ud55c\uad6d\uc5b4",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8", "\u4e2d\u6587\u6d4b\u8bd5", "\u30ab\u30bf\u30ab\u30ca",
    "\uff76\uff80\uff76\uff85", "\u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac", "\u0420\u0443\u0441\u0441\u043a\u0438\u0439",
    "\u05e2\u05d1\u05e8\u05d9\u05ea", "\u0627\u0644\u0639\u0631\u0628\u064a\u0629", "\u0939\u093f\u0928\u094d\u0926\u0940",
    "\u0e44\u0e17\u0e22", "ti\u1ebfng Vi\u1ec7t", "\u200b", "\u200d", "\ufeffBOM", "\u00a0", "a\u00a0b", "\u180e",
    "a\u180eb", "\u0085", "a\u0085b", "\u2028", "\u2029", "\x00", "a\x00b", "\x1f", "\x1c\x1d", "\x7f", "\x0b\x0c",
    "\u2126", "\u212b", "\u00c5", "A\u030a", "\u01c5", "\u0130stanbul", "\u00df", "\ufb01", "\u2163", "\u1e9e",
    "\U00031350", "\U0001faf8", "\ue000", "\uffff", "\U0010ffff", "\ufffd", "\u034f", "\ufe0f",
    "<|endoftext|>", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<s>", "</s>", "<unk>",
    "<s>hello</s>", " <s> ", "a<s>b", "<<s>>", "<s", "s>", "<0x41>", "<0xE2><0x82><0xAC>", "\u2581", "\u2581\u2581hello",
    "\u2581 \u2581", "<\uff5cbegin\u2581of\u2581sentence\uff5c>Hi", "<think>\n</think>\n\n", "<tool_call>{}</tool_call>",
    "\\n", "```python\ndef f():\n    return 1\n```", "    indented", "\t\tdef f(x):", "x" * 300,
    "https://example.com/path?query=1&b=2#frag", "user@example.com", "camelCaseWord", "snake_case_word",
    "ALLCAPS WORDS", "MiXeD CaSe", "hello.world", "a.b.c", "...", "!!!???", "(a)[b]{c}", "#!/bin/bash",
    "$$x^2$$", "C++", "foo->bar", "a==b", "x+=1", "i++", "\"quoted\"", "\u201csmart quotes\u201d", "\u2014\u2013",
    "hello world", " hello world", "hello world ", "Hello, World!", "HELLO", "hello\nworld", "hello\tworld",
    "<mask>", " <mask> ", "a<mask>b", "[SEP]", "x [SEP]  y", "hello", "xhello", "hello_", "say hello!", "w\u00f6rld",
    "wo\u0308rld", "<|bos|>", "<|user|>", " [X] ", "a[X]b",
]


def edge_strings(rng, added_contents):
    out = list(EDGE_CASES)
    for token in sorted(added_contents):
        out += [token, " " + token, token + " ", "x" + token + "y", token + token, "\n" + token + "\n",
                "Hi " + token + " there", token[:-1]]
    # Pairs of edge cases: boundaries between scripts, spaces and special tokens.
    pool = list(out)
    out += [rng.choice(pool) + rng.choice(pool) for _ in range(600)]
    out += [rng.choice(pool) + " " + rng.choice(pool) + "\n" + rng.choice(pool) for _ in range(200)]
    return out


CHAR_POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789",
    " \t\n\r\u00a0\u3000\u2028\u180e\u0085\u200b\ufeff\x0b\x0c",
    "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    "\u00e0\u00e9\u00ee\u00f5\u00fc\u00f1\u00e7\u00df\u00c5\u00d8\u00e6",
    "\u0300\u0301\u0302\u0308\u0327\u0323\u034f\u20dd",
    "\u4e00\u4e8c\u4e09\u4eba\u5927\u5b66\u65e5\u672c\u8a9e\u9f8d\u9fa5",
    "\u3042\u3044\u3046\u30a2\u30a4\u30a6\u30fc\u3001\u3002",
    "\u1100\u1161\u11a8\uac00\ud7a3",
    "\u0627\u0644\u0639\u05d0\u05d1\u0915\u093f\u094d\u0e01\u0e34",
    "\U0001f600\U0001f44d\U0001f3fd\u200d\u2764\ufe0f\U0001f1fa\U0001f1f8\U0001f308",
    "\u0663\uff11\u216b\u00bd\u00b2",
    "\u2126\u212b\u01c5\u0130\ufb01\u017f\u212a",
    "\u2581<>|s/",
    "\x00\x01\x1f\x7f\ue000\uffff\U0010ffff",
]


def random_unicode_strings(rng, count):
    out = []
    for _ in range(count):
        pools = rng.sample(CHAR_POOLS, rng.randint(1, 4))
        alphabet = "".join(pools)
        out.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))))
    return out


def unicode_stress_strings(rng, count):
    """Random assigned code points, combining marks and canonically decomposable characters (Unicode 16.0, as HF's
    regex engine sees it): where library Unicode versions and normalization data can disagree."""
    assigned, marks, decomposable = [], [], []
    for c in range(0x110000):
        ch = chr(c)
        category = unicodedata2.category(ch)
        if category in ("Cn", "Cs"):
            continue
        assigned.append(c)
        if category.startswith("M"):
            marks.append(c)
        decomposition = unicodedata2.decomposition(ch)
        if decomposition and not decomposition.startswith("<"):
            decomposable.append(c)
    pools = [assigned, marks, decomposable, [0x20, 0x41, 0x61, 0x27, 0x73, 0x31]]
    out = []
    for _ in range(count):
        out.append("".join(chr(rng.choice(rng.choices(pools, weights=[5, 3, 2, 1])[0]))
                           for _ in range(rng.randint(1, 12))))
    return out


def large_strings(rng):
    web = (SHARED / "corpus" / "web.txt").read_bytes().decode("utf-8").split("\n")
    line = ""
    while len(line) < 100_000:
        line += rng.choice(web) + " "
    return [line[:100_000], "1234567890" * 10_000, "a" * 60_000, " " * 30_000 + "x",
            "\U0001f600" * 5_000, "\u4e2d\u6587" * 10_000]


def build_strings(added_contents):
    rng = random.Random(SEED)
    strings = corpus_strings(rng) + prompt_strings() + edge_strings(rng, added_contents)
    strings += random_unicode_strings(rng, 3000) + unicode_stress_strings(rng, 3000) + large_strings(rng)
    return strings


# ------------------------------------------------------------------------------------- synthetic tokenizers

BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]


def training_text():
    rng = random.Random(SEED + 1)
    lines = []
    for domain in DOMAINS:
        text = (SHARED / "corpus" / f"{domain}.txt").read_bytes().decode("utf-8").split("\n")
        lines += rng.sample(text, 1500)
    return lines


def with_byte_tokens(tok):
    """Appends the <0xXX> byte-fallback tokens to a trained model's vocabulary."""
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for t in BYTE_TOKENS:
        if t not in vocab:
            vocab[t] = len(vocab)
    return Tokenizer.from_str(json.dumps(spec))


def legacy_merges(tok):
    """Rewrites the merges in the "a b" string encoding."""
    spec = json.loads(tok.to_str())
    spec["model"]["merges"] = [" ".join(m) for m in spec["model"]["merges"]]
    return Tokenizer.from_str(json.dumps(spec))


def synthetic_metaspace(lines):
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    tok.train_from_iterator(lines, BpeTrainer(vocab_size=1200, special_tokens=["<unk>", "<s>", "</s>"],
                                              limit_alphabet=150, show_progress=False))
    tok = legacy_merges(with_byte_tokens(tok))
    tok.decoder = decoders.Sequence([decoders.Metaspace(replacement="\u2581", prepend_scheme="first"),
                                     decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True),
                            AddedToken("[SEP]", rstrip=True, special=True)])
    tok.add_tokens([AddedToken("hello", single_word=True, normalized=True),
                    AddedToken("w\u00f6rld", normalized=True), AddedToken(" spaced", normalized=False)])
    return tok


def synthetic_bytelevel(lines):
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    tok.train_from_iterator(lines, BpeTrainer(vocab_size=1500, special_tokens=["<|bos|>", "<|eos|>"],
                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                              show_progress=False))
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|bos|> $A <|eos|>", special_tokens=[("<|bos|>", 0), ("<|eos|>", 1)])])
    tok.add_special_tokens([AddedToken("<|user|>", special=True, single_word=True)])
    tok.add_tokens([AddedToken("[X]", lstrip=True, rstrip=True, normalized=False)])
    return tok


def split_pre_tokenizer():
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(" ", behavior="merged_with_next"),
        pre_tokenizers.Split(Regex(r"[.,;:!?]"), behavior="merged_with_previous"),
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="contiguous"),
        pre_tokenizers.Split(Regex(r"[\r\n]+"), behavior="removed"),
        pre_tokenizers.Split(Regex(r"[aeiouAEIOU]+"), behavior="isolated", invert=True),
    ])


def synthetic_split(lines):
    tok = Tokenizer(models.BPE(unk_token="[UNK]", fuse_unk=False))
    tok.normalizer = normalizers.Sequence([normalizers.Replace("\t", "    "), normalizers.NFC(),
                                           normalizers.Prepend("_")])
    tok.pre_tokenizer = split_pre_tokenizer()
    tok.train_from_iterator(lines, BpeTrainer(vocab_size=700, special_tokens=["[UNK]"], limit_alphabet=70,
                                              show_progress=False))
    # (Strip with both sides set panics in HF on a token made only of the stripped character.)
    tok.decoder = decoders.Sequence([decoders.Replace("_", " "), decoders.Strip(" ", 1, 0)])
    return tok


def synthetic_nodecoder(lines):
    tok = synthetic_split(lines)
    tok.decoder = None
    tok.normalizer = normalizers.Sequence([normalizers.Replace("\t", "    "), normalizers.NFC()])
    return tok


def synthetic_strip(lines):
    tok = synthetic_metaspace(lines)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 0, 2)])
    return tok


SYNTHETIC_BUILDERS = {
    "metaspace": synthetic_metaspace,
    "bytelevel": synthetic_bytelevel,
    "split": synthetic_split,
    "nodecoder": synthetic_nodecoder,
    "strip": synthetic_strip,
}


def build_synthetic(rebuild):
    lines = None
    for name, builder in SYNTHETIC_BUILDERS.items():
        path = SYNTHETIC / name / "tokenizer.json"
        if path.exists() and not rebuild:
            continue
        lines = lines or training_text()
        path.parent.mkdir(parents=True, exist_ok=True)
        builder(lines).save(str(path), pretty=False)
        print(f"trained {path.relative_to(REPO)}")


# ------------------------------------------------------------------------------------------------- goldens

def tokenizer_sets(args):
    """(name, directory, where) for every tokenizer to write goldens for; `where` is how tests find it."""
    if args.dirs:
        out = []
        for d in args.dirs:
            d = Path(d).resolve()
            if d.is_relative_to(SHARED):
                out.append((d.name, d, {"root": "shared", "path": str(d.relative_to(SHARED))}))
            elif d.is_relative_to(SYNTHETIC):
                out.append(("synthetic_" + d.name, d, {"root": "repo", "path": str(d.relative_to(REPO))}))
            else:
                out.append(("deploy_" + d.name, d, {"root": "repo", "path": str(d.relative_to(REPO))}))
        return out
    out = [(n, SHARED / "tokenizers" / n, {"root": "shared", "path": f"tokenizers/{n}"})
           for n in ["qwen3", "deepseek_v3", "llama2"]]
    for d in sorted((REPO / "deploy" / "models").glob("*/")):
        if (d / "tokenizer.json").exists():
            out.append(("deploy_" + d.name, d, {"root": "repo", "path": str(d.relative_to(REPO))}))
    for name in SYNTHETIC_BUILDERS:
        d = SYNTHETIC / name
        out.append(("synthetic_" + name, d, {"root": "repo", "path": str(d.relative_to(REPO))}))
    return out


def random_decode_cases(tok, rng, count):
    vocab = tok.get_vocab(with_added_tokens=True)
    max_id = max(vocab.values())
    by_id = {i: t for t, i in vocab.items()}
    byte_level_alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    # Ids that stand for single bytes: where streaming decode must hold back partial UTF-8.
    byteish = sorted(i for t, i in vocab.items()
                     if t in BYTE_TOKENS or (len(t) == 1 and t in byte_level_alphabet and ord(t) >= 0xA1))
    added = sorted(tok.get_added_tokens_decoder().keys())
    cases = []
    for _ in range(count):
        ids = []
        for _ in range(rng.randint(1, 40)):
            r = rng.random()
            if r < 0.45 and byteish:
                ids.append(rng.choice(byteish))
            elif r < 0.55 and added:
                ids.append(rng.choice(added))
            else:
                ids.append(rng.randint(0, max_id))
        ids = [i for i in ids if i in by_id]
        cases.append({"decode_ids": ids, "text": tok.decode(ids, skip_special_tokens=False),
                      "text_skip": tok.decode(ids, skip_special_tokens=True)})
    return cases


def write_goldens(name, directory, where, strings, strings_sha, stride):
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    content = (directory / "tokenizer.json").read_bytes()
    indices = list(range(0, len(strings), stride))
    texts = [strings[i] for i in indices]
    with_special = tok.encode_batch(texts, add_special_tokens=True)
    plain_indices = [k for k, i in enumerate(indices) if i % 5 == 0]
    plain = tok.encode_batch([texts[k] for k in plain_indices], add_special_tokens=False)
    plain_by_k = dict(zip(plain_indices, plain))
    decoded = tok.decode_batch([e.ids for e in with_special], skip_special_tokens=False)
    header = {"tokenizer": name, "where": where, "tokenizer_json_fnv1a64": fnv1a64(content),
              "tokenizers_version": tokenizers.__version__, "strings_sha256": strings_sha,
              "strings": len(strings), "stride": stride}
    lines = [dumps(header)]
    for k, i in enumerate(indices):
        record = {"i": i, "ids": with_special[k].ids}
        if k in plain_by_k:
            record["plain"] = plain_by_k[k].ids
        text = decoded[k]
        if text != strings[i]:
            if strings[i] and text.endswith(strings[i]):
                record["decode_prefix"] = text[:len(text) - len(strings[i])]
            else:
                record["decode"] = text
        lines.append(dumps(record))
    rng = random.Random(SEED + sum(map(ord, name)))
    lines += [dumps(c) for c in random_decode_cases(tok, rng, 600)]
    path = OUT / f"{name}.jsonl.gz"
    write_gzip_lines(path, lines)
    print(f"{path.relative_to(REPO)}: {len(indices)} strings, {path.stat().st_size / 1e6:.2f} MB")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="*", help="tokenizer directories (default: the standard set)")
    parser.add_argument("--rebuild-synthetic", action="store_true", help="retrain the synthetic tokenizers")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    OUT.mkdir(parents=True, exist_ok=True)
    build_synthetic(args.rebuild_synthetic)
    sets = tokenizer_sets(args)

    # Added tokens to embed in text, from the fixed tokenizers only, so that the strings (and every golden) stay
    # the same when deploy/models changes.
    added = set()
    for name, d, _ in tokenizer_sets(argparse.Namespace(dirs=[])):
        if not name.startswith("deploy_"):
            spec = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
            added |= {t["content"] for t in spec.get("added_tokens", [])}
    strings = build_strings(added)
    lines = [dumps(s) for s in strings]
    strings_sha = hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()
    write_gzip_lines(OUT / "strings.jsonl.gz", lines)
    print(f"strings.jsonl.gz: {len(strings)} strings, {(OUT / 'strings.jsonl.gz').stat().st_size / 1e6:.2f} MB")
    for name, directory, where in sets:
        stride = 4 if name.startswith("synthetic_") else 1
        write_goldens(name, directory, where, strings, strings_sha, stride)
    return 0


if __name__ == "__main__":
    sys.exit(main())
