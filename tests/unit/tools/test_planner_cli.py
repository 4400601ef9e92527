"""capserve-planner as a program, and its calibration's fit: a run on the fine model's routing counts serves
every request and writes its steps in the server's --step-trace format; a cost for another model, a domain the
counts lack and a malformed cost file are refused naming the fault; and planner_eval.py's fit, given the
planner's own step trace, recovers the cost it was priced with (the fit's composition is the planner's).

Usage: test_planner_cli.py CAPSERVE_PLANNER SOURCE_DIR SHARED_DATA_DIR
"""
import importlib.util
import json
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

PLANNER, SOURCE, SHARED = (Path(a) for a in sys.argv[1:4])
ROUTING = SOURCE / "tools/results/fine_model_eval.json"
TRACE = SHARED / "traces/azure_llm_2023_code.csv"
COST = {"name": "test", "model": {"moe_layers": 4, "experts": 64, "top_k": 8, "row_bytes": 1024}, "cores": 2,
        "expert_time": "sum",
        "seconds": {"step": 2e-3, "token": 5e-5, "pair": 3e-7, "decode_pair": 2e-6, "layer": 0.0,
                    "assignment": 3e-6, "active_expert": 7e-5, "wire_byte": 3e-9, "capacity_layer": 1.5e-3,
                    "capacity_refine": 5e-3}}


def planner_eval():
    spec = importlib.util.spec_from_file_location("planner_eval", SOURCE / "tools/planner/planner_eval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Planner(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = Path(self.tmp.name)

    def tearDown(self):
        self.tmp.cleanup()

    def cost(self, doc, name="cost.json"):
        path = self.dir / name
        path.write_text(json.dumps(doc))
        return path

    def run_planner(self, *flags, cost=None, rate="3"):
        args = [PLANNER, "--routing", ROUTING, "--cost", cost or self.cost(COST), "--ranks", "4", "--trace", TRACE,
                "--rate", rate, "--duration-s", "10", "--max-prompt-tokens", "256", "--max-tokens", "16",
                "--max-context", "1024", *flags]
        return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=120)

    def test_a_run_serves_every_request_and_traces_its_steps(self):
        out, trace = self.dir / "out.json", self.dir / "steps.jsonl"
        p = self.run_planner("--batch-selector", "greedy", "--capacity-factor", "1.5", "--json", out,
                             "--step-trace", trace)
        self.assertEqual(p.returncode, 0, p.stderr)
        r = json.loads(out.read_text())
        self.assertGreater(r["requests"], 10)
        self.assertEqual(r["ok"], r["requests"])
        self.assertGreater(r["dropped_share"], 0)
        self.assertLessEqual(r["ttft_s"]["p50"], r["ttft_s"]["p99"])
        self.assertLessEqual(r["ttft_s"]["p99"], r["e2e_s"]["p99"])
        steps = [json.loads(line) for line in trace.read_text().splitlines()]
        self.assertEqual(len(steps), r["steps"])
        self.assertEqual(len(steps[0]["tokens"]), 4)
        self.assertEqual(len(steps[0]["expert_load"]), 4)
        self.assertAlmostEqual(sum(s["seconds"] for s in steps), r["busy_s"], delta=1e-6 * len(steps))  # microseconds

    def test_what_it_cannot_use_is_refused_by_name(self):
        other = json.loads(json.dumps(COST))
        other["model"]["experts"] = 16
        p = self.run_planner(cost=self.cost(other, "other.json"))
        self.assertEqual(p.returncode, 1)
        self.assertIn("16 experts", p.stderr)
        p = self.run_planner("--domains", "arxiv,poetry")
        self.assertEqual(p.returncode, 1)
        self.assertIn("poetry", p.stderr)
        broken = json.loads(json.dumps(COST))
        del broken["seconds"]["token"]
        path = self.cost(broken, "broken.json")
        p = self.run_planner(cost=path)
        self.assertEqual(p.returncode, 1)
        self.assertIn('"token"', p.stderr)
        self.assertIn(str(path), p.stderr)

    def test_the_calibration_fit_recovers_the_cost_that_priced_a_trace(self):
        pe = planner_eval()
        steps = []
        for gamma in ("inf", "1.5"):
            trace = self.dir / f"steps-{gamma}.jsonl"
            p = self.run_planner("--capacity-factor", gamma, "--step-trace", trace, rate="6")
            self.assertEqual(p.returncode, 0, p.stderr)
            steps += pe.read_steps(trace, gamma)
        seconds, quality = pe.fit(steps, 4, 2)
        self.assertLess(quality["median_abs_rel_error"], 1e-3, quality)  # the trace rounds to microseconds
        for term in ("step", "token", "pair", "decode_pair", "assignment", "capacity_layer"):
            self.assertAlmostEqual(seconds[term] / COST["seconds"][term], 1, delta=0.02, msg=term)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1])
