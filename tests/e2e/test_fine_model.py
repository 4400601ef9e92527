"""The fine-grained embedded model, capserve-moe-fine (64 experts, top-8), served and scored: its held-out
log-likelihoods equal HF transformers' (tools/results/fine_model_eval.json, per window), the server finds the
model's learned load map on its own and runs the greedy batch selector over every MoE layer with it, a chat
completion streams its tokens with the MoE usage of 64 experts, and under a capacity factor that drops (gamma 1),
protected requests lose no assignment while the standard ones beside them lose many (test_capacity_classes.py's
check on the fine-grained routing)."""

import json
import math
import os
import subprocess
import tempfile
import threading

from capserve_e2e import MODEL, ServerTestCase, http_chat, main, pb
from test_capacity_classes import PROMPTS, body

FINE = os.path.join(os.path.dirname(MODEL), "capserve-moe-fine")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(MODEL))))
WINDOWS = 2


class FineModelTest(ServerTestCase):
    MODEL = FINE
    FLAGS = ["--batch-selector", "greedy"]

    def test_heldout_log_likelihood_equals_hf_transformers(self):
        with open(os.path.join(ROOT, "tools", "results", "fine_model_eval.json")) as f:
            reference = json.load(f)["domains"]
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "eval.json")
            subprocess.run([os.environ["CAPSERVE_EVAL_HELDOUT"], "--model", FINE, "--corpus",
                            os.path.join(ROOT, "..", "shared", "data", "corpus"), "--max-windows", str(WINDOWS),
                            "--threads", "1", "--json", out], check=True, capture_output=True, timeout=240)
            with open(out) as f:
                mine = json.load(f)["domains"]
        for domain, ref in reference.items():
            with self.subTest(domain=domain):
                want = math.fsum(ref["per_window_nll"][:WINDOWS])
                self.assertEqual(mine[domain]["windows"], WINDOWS)
                self.assertLess(abs(mine[domain]["total_nll"] - want) / want, 1e-5,
                                f"{mine[domain]['total_nll']} vs HF {want}")

    def test_the_learned_load_map_drives_selection_over_every_moe_layer(self):
        info = self.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        self.assertEqual(info.model.num_experts, 64)
        self.assertEqual(info.model.experts_per_token, 8)
        self.assertRegex(info.batch_selector, r"^strategy=greedy .* predictor=load_map predicted_layers=4$")
        status, reply = http_chat(self.server.http_port, {
            "messages": [{"role": "user", "content": "Explain how rivers form deltas."}], "max_tokens": 12,
            "temperature": 0})
        self.assertEqual(status, 200, reply)
        self.assertEqual(reply["usage"]["completion_tokens"], 12)
        self.assertEqual(reply["moe"]["assignments"], 8 * 4 * (reply["usage"]["prompt_tokens"] + 11))


class FineModelProtectedClassTest(ServerTestCase):
    MODEL = FINE
    FLAGS = ["--capacity-factor", "1", "--capacity-policy", "drop", "--max-protected-requests", "2"]

    def test_protected_requests_lose_no_assignment_under_load(self):
        classes = ["protected", "protected"] + ["standard"] * (len(PROMPTS) - 2)
        results = [None] * len(PROMPTS)

        def one(i):
            results[i] = http_chat(self.server.http_port, body(PROMPTS[i], classes[i]), timeout=300)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for (status, reply), c in zip(results, classes):
            self.assertEqual(status, 200, reply)
            if c == "protected":
                self.assertEqual(reply["moe"]["dropped"], 0, reply["moe"])
        standard = sum(r["moe"]["dropped"] for (_, r), c in zip(results, classes) if c == "standard")
        self.assertGreater(standard, 0, "gamma 1 dropped nothing of the standard requests")


if __name__ == "__main__":
    main()
