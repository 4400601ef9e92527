"""capserve-placement as a program: every counts-file shape (shared counts file, SGLang dump 2-D and 3-D, our
--moe-stats, a model measurement), clear errors for other shapes, and its output given to --expert-placement of a
real 2-rank run, which then loads exactly the per-rank loads the tool reported. capserve-levers on the same
files: the levers' costs and effects in the directions they must go.

Usage: test_placement_cli.py CAPSERVE_PLACEMENT CAPSERVE_GENERATE SOURCE_DIR SHARED_DATA_DIR CAPSERVE_LEVERS
"""
import json
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

PLACEMENT, GENERATE, SOURCE, SHARED, LEVERS = (Path(a) for a in sys.argv[1:6])
COUNTS = SHARED / "routing/olmoe_mixtral_expert_counts.json"
MODEL = SOURCE / "deploy/models/capserve-moe-tiny"


def run(args, **kw):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=300, **kw)


class Placement(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = Path(self.tmp.name)

    def tearDown(self):
        self.tmp.cleanup()

    def place(self, counts, *flags, ok=True):
        out = self.dir / "placement.json"
        out.unlink(missing_ok=True)
        p = run([PLACEMENT, "--counts", counts, *flags, "--out", out])
        if ok:
            self.assertEqual(p.returncode, 0, p.stderr)
            return json.loads(out.read_text()), p.stdout
        self.assertNotEqual(p.returncode, 0, p.stdout)
        self.assertFalse(out.exists())
        return None, p.stderr

    def write(self, name, doc):
        path = self.dir / name
        path.write_text(json.dumps(doc))
        return path

    def check_balanced(self, doc, ranks, experts):
        for layer in doc["layers"]:
            owners = layer["owners"]
            self.assertEqual(len(owners), experts)
            # Every rank hosts its contiguous quota of experts (memory as even as the counts allow).
            for r in range(ranks):
                self.assertEqual(owners.count(r), experts // ranks + (1 if r < experts % ranks else 0))
            per_rank = [sum(l for l, o in zip(layer["routed_load"], owners) if o == r) for r in range(ranks)]
            self.assertEqual(per_rank, layer["rank_load"])
            self.assertLessEqual(max(layer["rank_load"]), max(layer["contiguous_rank_load"]))
        self.assertLessEqual(doc["sum_max_rank_load"], doc["contiguous_sum_max_rank_load"])

    def test_shared_counts_file(self):
        doc, stdout = self.place(COUNTS, "--ranks", 4, "--counts-model", "olmoe", "--domains", "arxiv,github")
        self.assertEqual([l["layer"] for l in doc["layers"]], [0, 7, 15])
        self.assertEqual(doc["domains"], ["arxiv", "github"])
        self.assertEqual(doc["top_k"], 8)
        raw = json.loads(COUNTS.read_text())["olmoe"]["expert_counts"]
        self.assertEqual(doc["layers"][1]["routed_load"],
                         [a + b for a, b in zip(raw["arxiv"]["7"], raw["github"]["7"])])
        self.check_balanced(doc, 4, 64)
        self.assertLess(doc["sum_max_rank_load"], doc["contiguous_sum_max_rank_load"])
        self.assertIn("contiguous max/mean", stdout)
        # Several models and none named: an error listing them.
        _, err = self.place(COUNTS, "--ranks", 4, ok=False)
        self.assertIn("olmoe", err)
        self.assertIn("--counts-model", err)
        _, err = self.place(COUNTS, "--ranks", 4, "--counts-model", "olmoe", "--domains", "nope", ok=False)
        self.assertIn('no domain "nope"', err)

    def test_sglang_dumps(self):
        two = [[1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1]]
        doc, _ = self.place(self.write("sg2.json", {"logical_count": two}), "--ranks", 3)
        self.assertEqual([l["routed_load"] for l in doc["layers"]], two)
        self.check_balanced(doc, 3, 6)
        steps = [two, [[0, 0, 0, 0, 0, 9], [1, 0, 0, 0, 0, 0]]]
        doc, _ = self.place(self.write("sg3.json", {"logical_count": steps, "rank": 0}), "--ranks", 4)
        self.assertEqual([l["routed_load"] for l in doc["layers"]],
                         [[1, 2, 3, 4, 5, 15], [7, 5, 4, 3, 2, 1]])
        self.check_balanced(doc, 4, 6)
        for bad in ([1, 2], [[1, 2], [3]], [[[1, 2]], [[1, 2], [3, 4]]], [["a"]], [[-1, 2]]):
            path = self.write("bad.json", {"logical_count": bad})
            _, err = self.place(path, "--ranks", 2, ok=False)
            self.assertIn(str(path), err)

    def test_other_shapes_are_clear_errors(self):
        for doc in ([1, 2], {"x": 1}, {"layers": [{"layer": 0}]}):
            path = self.write("bad.json", doc)
            _, err = self.place(path, "--ranks", 2, ok=False)
            self.assertIn(str(path), err)
        _, err = self.place(self.write("bad.json", [1]), "--ranks", 2, ok=False)
        self.assertIn("logical_count", err)  # names the shapes it expects
        p = run([PLACEMENT, "--counts=", "--ranks", "2"])
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("--counts= has an empty value", p.stderr)

    def test_moe_stats_round_trip_through_expert_placement(self):
        ids = "1 5 9 13 17 21 25 29 33 37 41 45"
        stats = self.dir / "stats.json"
        p = run([GENERATE, "--model", MODEL, "--input-ids", ids, "--max-new-tokens", 4, "--moe-stats", stats])
        self.assertEqual(p.returncode, 0, p.stderr)
        doc, _ = self.place(stats, "--ranks", 2)
        self.assertEqual(doc["format"], "moe-stats")
        self.assertEqual(doc["top_k"], 2)
        experts = len(doc["layers"][0]["owners"])
        self.check_balanced(doc, 2, experts)
        placement = self.dir / "placement.json"
        placed_stats = self.dir / "placed_stats.json"
        p = run([SOURCE / "deploy/launch.sh", 2, GENERATE, "--model", MODEL, "--input-ids", ids,
                 "--max-new-tokens", 4, "--expert-placement", placement, "--moe-stats", placed_stats])
        self.assertEqual(p.returncode, 0, p.stderr)
        placed = json.loads(placed_stats.read_text())["layers"]
        self.assertEqual([l["rank_routed_load"] for l in placed], [l["rank_load"] for l in doc["layers"]])

    def test_a_model_measurement(self):
        doc, _ = self.place(SOURCE / "tools/results/fine_model_eval.json", "--ranks", "4")
        self.assertEqual(doc["num_experts"], 64)
        self.assertEqual(doc["top_k"], 8)
        self.assertEqual([l["layer"] for l in doc["layers"]], [0, 1, 2, 3])
        self.assertEqual(doc["domains"], ["arxiv", "books", "code", "web", "wikipedia"])

    def test_levers_side_by_side(self):
        out = self.dir / "levers.json"
        p = run([LEVERS, "--source", f"olmoe={COUNTS}#olmoe", "--source",
                 f"fine={SOURCE / 'tools/results/fine_model_eval.json'}", "--ranks", "4,8", "--json", out])
        self.assertEqual(p.returncode, 0, p.stderr)
        rows = json.loads(out.read_text())
        for source in ("olmoe", "fine"):
            for ranks in (4, 8):
                with self.subTest(source=source, ranks=ranks):
                    mine = {r["lever"]: r for r in rows if r["source"] == source and r["ranks"] == ranks}
                    base = mine["contiguous placement (baseline)"]
                    self.assertEqual((base["speedup_vs_contiguous"], base["dropped_fraction"]), (1.0, 0.0))
                    self.assertEqual(base["expert_slots_per_rank"], 64 // ranks)
                    for extra in (1, 2):
                        rep = mine[f"replication +{extra} slot{'s' if extra > 1 else ''} per rank"]
                        self.assertEqual(rep["expert_slots_per_rank"], 64 // ranks + extra)
                        self.assertEqual(rep["dropped_fraction"], 0.0)
                        self.assertGreater(rep["speedup_vs_contiguous"], 1.0)
                    drops = [mine[f"capacity gamma {g}"]["dropped_fraction"] for g in ("1.5", "1.25", "1.0")]
                    self.assertTrue(0 < drops[0] < drops[1] < drops[2], drops)
                    self.assertLessEqual(mine["capacity gamma 1.0"]["worst_max_over_mean"], 1.0 + 1e-9,
                                         "no expert keeps more than the mean: no rank does")
        bad = run([LEVERS, "--source", "no-label-here"])
        self.assertEqual(bad.returncode, 1)
        self.assertIn("expected LABEL=PATH", bad.stderr)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
