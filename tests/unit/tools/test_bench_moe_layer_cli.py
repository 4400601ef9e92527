"""capserve-bench-moe-layer (synthetic mode, a tiny layer, one process) on counts files it was not written for:
top-k from the file's own counts or --top-k, never from the model key's spelling; SGLang's expert-distribution
dumps; an empty --expert-cost-rows= is an error; the default counts file is found from any directory.

Usage: test_bench_moe_layer_cli.py CAPSERVE_BENCH_MOE_LAYER SHARED_DATA_DIR
"""
import json
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

BENCH, SHARED = (Path(a) for a in sys.argv[1:3])
COUNTS = SHARED / "routing/olmoe_mixtral_expert_counts.json"
TINY = ["--tokens", "16", "--hidden", "32", "--ffn", "16", "--reps", "1", "--warmup", "0", "--gammas", "1",
        "--reroute-gammas", "1", "--granularities", "expert", "--no-expert-cost"]


class BenchCounts(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = Path(self.tmp.name)

    def tearDown(self):
        self.tmp.cleanup()

    def bench(self, *flags, ok=True, tiny=TINY):
        out = self.dir / "out.json"
        out.unlink(missing_ok=True)
        # From a directory unrelated to the source tree.
        p = subprocess.run([str(BENCH), *tiny, *map(str, flags), "--out", str(out)], cwd=self.dir,
                           capture_output=True, text=True, timeout=300)
        if ok:
            self.assertEqual(p.returncode, 0, p.stderr)
            return json.loads(out.read_text())["meta"]
        self.assertNotEqual(p.returncode, 0, p.stdout)
        self.assertFalse(out.exists())
        return p.stderr

    def write(self, name, doc):
        path = self.dir / name
        path.write_text(json.dumps(doc))
        return path

    def test_default_counts_file_from_any_directory(self):
        meta = self.bench("--domains", "github")
        self.assertTrue(Path(meta["counts_file"]).is_file())
        self.assertEqual((meta["experts"], meta["top_k"]), (64, 8))

    def test_top_k_comes_from_the_file_not_the_key(self):
        olmoe = json.loads(COUNTS.read_text())["olmoe"]
        keep = lambda counts: {"arxiv": counts["arxiv"]}  # noqa: E731
        # OLMoE's counts under a key without "olmoe" in it: top-8 from counts / top-1 counts.
        path = self.write("renamed.json", {"model-a": {"expert_counts": keep(olmoe["expert_counts"]),
                                                       "expert_counts_top1": keep(olmoe["expert_counts_top1"])}})
        meta = self.bench("--counts", path, "--counts-model", "model-a")
        self.assertEqual((meta["experts"], meta["top_k"]), (64, 8))
        # A key with "olmoe" in it but no top-1 counts: the file cannot tell; an error unless --top-k.
        path = self.write("no_top1.json", {"olmoe-x": {"expert_counts": keep(olmoe["expert_counts"])}})
        err = self.bench("--counts", path, "--counts-model", "olmoe-x", ok=False)
        self.assertIn("pass --top-k", err)
        self.assertIn(str(path), err)
        self.assertEqual(self.bench("--counts", path, "--counts-model", "olmoe-x", "--top-k", 4)["top_k"], 4)
        err = self.bench("--counts", path, "--counts-model", "olmoe-x", "--top-k", 65, ok=False)
        self.assertIn("exceeds the 64 experts", err)

    def test_sglang_dumps(self):
        layers = [[5, 1, 1, 1, 2, 3, 4, 9], [1, 1, 1, 1, 1, 1, 1, 9], [3, 3, 3, 3, 3, 3, 3, 3]]
        for doc in ({"logical_count": layers}, {"logical_count": [layers, layers], "rank": 0}):
            path = self.write("dump.json", doc)
            err = self.bench("--counts", path, ok=False)
            self.assertIn("pass --top-k", err)
            meta = self.bench("--counts", path, "--top-k", 2)
            self.assertEqual((meta["experts"], meta["top_k"], meta["count_layers"]), (8, 2, ["0", "1", "2"]))
            self.assertEqual(meta["counts_format"], "sglang")
        path = self.write("bad.json", {"logical_count": [1, 2, 3]})
        err = self.bench("--counts", path, "--top-k", 2, ok=False)
        self.assertIn(str(path), err)
        self.assertIn("[layer][expert] or [step][layer][expert]", err)

    def test_expert_cost_rows(self):
        tiny = [a for a in TINY if a != "--no-expert-cost"]
        meta = self.bench("--domains", "github", "--expert-cost-rows", "1,3", tiny=tiny)
        self.assertEqual([c["rows"] for c in meta["expert_cost"]], [1, 3])
        self.assertEqual(self.bench("--domains", "github")["expert_cost"], [])
        err = self.bench("--expert-cost-rows=", "--domains", "github", tiny=tiny, ok=False)
        self.assertIn("--expert-cost-rows= has an empty value", err)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
