"""capserve-loadgen run from a directory unrelated to the source tree finds its default corpus: it gets as far as
connecting (to a port nobody listens on) instead of failing on a relative ../shared path. The e2e loadgen smoke
test runs it against the real server from such a directory too. A Mooncake trace, scaled and capped, written
back out with --write-trace (what AIPerf replays), and its errors, all without a server.

Usage: test_loadgen_cli.py CAPSERVE_LOADGEN
"""
import json
import math
import os
import subprocess
import sys
import tempfile
import unittest

# Four requests of a Mooncake trace: the second and fourth share the first's first two 512-token blocks; the
# third is longer than the 1024-token context at scale 1/32 (1255 tokens).
MOONCAKE = [
    {"timestamp": 0, "input_length": 1500, "output_length": 64, "hash_ids": [0, 1, 2]},
    {"timestamp": 500, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 3]},
    {"timestamp": 1000, "input_length": 40160, "output_length": 6, "hash_ids": list(range(4, 83))},
    {"timestamp": 2000, "input_length": 2048, "output_length": 320, "hash_ids": [0, 1, 83, 84]},
]


class DefaultPaths(unittest.TestCase):
    def test_default_corpus_from_another_directory(self):
        with tempfile.TemporaryDirectory() as cwd:
            p = subprocess.run([sys.argv[1], "--target", "127.0.0.1:1", "--rate", "1", "--duration-s", "1",
                                "--connect-timeout-s", "1"], cwd=cwd, capture_output=True, text=True, timeout=60)
        self.assertNotEqual(p.returncode, 0)
        self.assertNotIn("corpus", p.stderr)
        self.assertIn("cannot connect to 127.0.0.1:1", p.stderr)

    def test_empty_flag_value_is_an_error(self):
        # CLI11 would take the next flag as --model's value.
        p = subprocess.run([sys.argv[1], "--model=", "--rate", "1", "--target", "127.0.0.1:1"],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 2)
        self.assertIn("--model= has an empty value", p.stderr)


class MooncakeTrace(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.trace = os.path.join(self.dir.name, "trace.jsonl")
        with open(self.trace, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in MOONCAKE)

    def tearDown(self):
        self.dir.cleanup()

    def loadgen(self, *args):
        return subprocess.run([sys.argv[1], *args], capture_output=True, text=True, timeout=60)

    def test_write_trace_scales_caps_and_says_so(self):
        out = os.path.join(self.dir.name, "scaled.jsonl")
        p = self.loadgen("--trace", self.trace, "--length-scale", "0.03125", "--max-context", "1024",
                         "--max-prompt-tokens", "1024", "--max-tokens", "8", "--time-scale", "0.5",
                         "--write-trace", out)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("block size 16 tokens", p.stdout)
        self.assertIn("lengths x0.03125", p.stdout)
        # 1255 - (1024 - 1); outputs 64 / 32 = 2, 3 / 32 = 0 -> 1, 6 / 32 = 0 -> 1, 320 / 32 = 10 -> 8.
        self.assertIn("capped 1 of 4 prompts (232 tokens cut in all, at most 232 from one)", p.stdout)
        self.assertIn("1 of 4 outputs (2 tokens cut in all, at most 2 from one) to --max-tokens 8", p.stdout)
        with open(out) as f:
            rows = [json.loads(line) for line in f]
        self.assertEqual([r["timestamp"] for r in rows], [0, 250, 500, 1000])
        self.assertEqual([r["input_length"] for r in rows], [47, 34, 1023, 64])
        self.assertEqual([r["output_length"] for r in rows], [2, 1, 1, 8])
        # The hash ids the prompt covers; a last partial block (all but the fourth) a new id of its own.
        fresh = set()
        for written, original in zip(rows, MOONCAKE):
            ids = written["hash_ids"]
            self.assertEqual(len(ids), math.ceil(written["input_length"] / 16))
            self.assertEqual(ids[:-1], original["hash_ids"][:len(ids) - 1])
            if written["input_length"] % 16 == 0:
                self.assertEqual(ids[-1], original["hash_ids"][len(ids) - 1])
            else:
                fresh.add(ids[-1])
        self.assertEqual(fresh, {85, 86, 87})  # above the trace's largest id, 84

    def test_malformed_line_is_named(self):
        with open(self.trace, "a") as f:
            f.write('{"timestamp": 3000, "input_length": 600, "output_length": 1, "hash_ids": [9]}\n')
        p = self.loadgen("--trace", self.trace, "--write-trace", os.path.join(self.dir.name, "x.jsonl"))
        self.assertEqual(p.returncode, 2)
        self.assertIn(f"{self.trace}:5: 1 hash_ids for input_length 600: expected ceil(600 / 512) = 2", p.stderr)

    def test_replay_needs_token_ids(self):
        p = self.loadgen("--trace", self.trace, "--target", "127.0.0.1:1", "--connect-timeout-s", "1")
        self.assertEqual(p.returncode, 2)
        self.assertIn("a Mooncake trace is sent as token ids", p.stderr)
        p = self.loadgen("--trace", self.trace, "--trace-format", "azure", "--target", "127.0.0.1:1")
        self.assertEqual(p.returncode, 2)
        self.assertIn("trace.jsonl:1:", p.stderr)  # read as a CSV, as asked


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
