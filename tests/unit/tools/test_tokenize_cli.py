"""capserve-tokenize as a program: exact strings through --jsonl (newlines, empty strings) against the HF goldens
of tests/fixtures/tokenizers, and ids without a token as errors naming the id and the vocabulary size.

Usage: test_tokenize_cli.py CAPSERVE_TOKENIZE SOURCE_DIR SHARED_DATA_DIR
"""
import gzip
import json
import subprocess
import sys
import unittest
from pathlib import Path

TOKENIZE, SOURCE, SHARED = (Path(a) for a in sys.argv[1:4])
FIXTURES = SOURCE / "tests/fixtures/tokenizers"


def run(args, stdin):
    return subprocess.run([str(TOKENIZE), *args], input=stdin.encode(), capture_output=True, timeout=120)


def goldens(name):
    strings = [json.loads(l) for l in gzip.open(FIXTURES / "strings.jsonl.gz", "rt", encoding="utf-8")]
    rows = [json.loads(l) for l in gzip.open(FIXTURES / f"{name}.jsonl.gz", "rt", encoding="utf-8")]
    where = rows[0]["where"]
    directory = (SHARED if where["root"] == "shared" else SOURCE) / where["path"]
    return strings, rows[1:], directory


class JsonlMode(unittest.TestCase):
    def check_encode(self, name):
        strings, rows, directory = goldens(name)
        if not directory.is_dir():
            self.fail(f"tokenizer directory {directory} is missing (../shared/data next to the repository)")
        encodings = [r for r in rows if "ids" in r]
        with_newline = [r for r in encodings if "\n" in strings[r["i"]]][:300]
        empty = [r for r in encodings if strings[r["i"]] == ""][:5]
        cases = with_newline + empty
        self.assertGreater(len(with_newline), 100)
        self.assertTrue(empty)
        stdin = "".join(json.dumps(strings[r["i"]]) + "\n" for r in cases)
        p = run(["--tokenizer", str(directory), "--jsonl"], stdin)
        self.assertEqual(p.returncode, 0, p.stderr.decode())
        out = p.stdout.decode().split("\n")
        self.assertEqual(len(out), len(cases) + 1)  # one line per record, then the final newline
        for r, line in zip(cases, out):
            self.assertEqual(json.loads(line), r["ids"], f"string {r['i']}: {strings[r['i']]!r}")

    def check_decode(self, name):
        _, rows, directory = goldens(name)
        decodings = [r for r in rows if "decode_ids" in r]
        cases = [r for r in decodings if "\n" in r["text"]][:50] + decodings[:50]
        self.assertTrue(any("\n" in r["text"] for r in cases))
        stdin = "".join(json.dumps(r["decode_ids"]) + "\n" for r in cases)
        for flags, key in (([], "text"), (["--no-special-tokens"], "text_skip")):
            p = run(["--tokenizer", str(directory), "--jsonl", "--decode", *flags], stdin)
            self.assertEqual(p.returncode, 0, p.stderr.decode())
            out = p.stdout.decode().split("\n")
            self.assertEqual(len(out), len(cases) + 1)
            for r, line in zip(cases, out):
                self.assertEqual(json.loads(line), r[key], r["decode_ids"])

    def test_encode_qwen3(self):
        self.check_encode("qwen3")

    def test_encode_llama2(self):
        self.check_encode("llama2")

    def test_decode_qwen3(self):
        self.check_decode("qwen3")

    def test_decode_llama2(self):
        self.check_decode("llama2")

    def test_bad_records_are_errors_and_lose_nothing(self):
        _, _, directory = goldens("qwen3")
        p = run(["--tokenizer", str(directory), "--jsonl"], '"a\\nb"\n[1, 2]\nnot json\n"c"\n')
        self.assertEqual(p.returncode, 1)
        out = p.stdout.decode().split("\n")
        self.assertEqual(out[1:3], ["null", "null"])
        self.assertEqual(json.loads(out[3]), json.loads(run(["--tokenizer", str(directory), "--jsonl"],
                                                            '"c"\n').stdout))
        err = p.stderr.decode()
        self.assertIn("line 2: expected a JSON string", err)
        self.assertIn("line 3: not valid JSON", err)


class Flags(unittest.TestCase):
    def test_empty_flag_value_is_an_error(self):
        p = run(["--tokenizer=", "--jsonl"], "")
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("--tokenizer= has an empty value", p.stderr.decode())


class IdsWithoutToken(unittest.TestCase):
    def test_out_of_vocabulary_id_is_an_error(self):
        _, _, directory = goldens("qwen3")
        vocab = len(json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"])
        for flags, stdin in (([], "9906 99999999 1917\n"), (["--jsonl"], "[9906, 99999999, 1917]\n")):
            p = run(["--tokenizer", str(directory), "--decode", *flags], stdin)
            self.assertNotEqual(p.returncode, 0, flags)
            err = p.stderr.decode()
            self.assertIn("99999999", err)
            self.assertIn("outside the vocabulary", err)
            # The vocabulary size: the model's tokens plus the added ones, so at least the model's.
            size = int(err.split("outside the vocabulary (")[1].split(" ")[0])
            self.assertGreaterEqual(size, vocab)
            self.assertLess(size, 99999999)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
