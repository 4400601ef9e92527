"""Token log-probabilities through the gRPC API on 2 ranks: Generate's sampled tokens score what log_softmax of
capserve-generate's dumped logits gives them (1e-4), prompt log-probabilities of the same tokens agree with the
decode-time ones, prompt log-probabilities through gRPC and through the HTTP API's echo (what lm-eval's
local-completions model sums) equal capserve-eval-heldout's (the top entries its next-token accuracy), Chat's entries spell its text chunk by chunk, and
out-of-range requests are refused."""

import json
import math
import os
import subprocess
import tempfile
import urllib.request

import grpc
import numpy as np

from capserve_e2e import MODEL, ServerTestCase, chat_request, main, pb

PROMPT = [5, 17, 300, 42, 7, 99, 1000, 3]
NEW = 12
TOP = 5
TEXT = ("The mixture of experts routes every token to a few of its experts, so a model can hold many parameters and "
        "still spend little compute on each token it reads or writes.")
WINDOW = 24


def log_softmax(row):
    row = row.astype(np.float64)
    top = row.max()
    return row - top - math.log(np.exp(row - top).sum())


class LogprobsTest(ServerTestCase):
    def generate(self, ids, max_tokens, **options):
        sampling = pb.SamplingOptions(max_tokens=max_tokens, ignore_eos=True, **options)
        return list(self.stub.Generate(pb.GenerateRequest(input_ids=ids, sampling=sampling), timeout=120))

    def test_generate_logprobs_equal_log_softmax_of_the_logits(self):
        chunks = self.generate(PROMPT, NEW, logprobs=True, top_logprobs=TOP, prompt_logprobs=True)
        tokens = [t for c in chunks for t in c.token_ids]
        entries = [e for c in chunks for e in c.logprobs]
        self.assertEqual(len(tokens), NEW)
        self.assertEqual([e.token_id for e in entries], tokens)
        for c in chunks:
            self.assertEqual(len(c.logprobs), len(c.token_ids), "entries are aligned with each chunk's tokens")
        self.assertEqual([e.token_id for e in chunks[0].prompt_logprobs], PROMPT[1:])
        self.assertEqual(sum(len(c.prompt_logprobs) for c in chunks[1:]), 0, "prompt entries come once")

        with tempfile.TemporaryDirectory() as tmp:
            dump = os.path.join(tmp, "logits.npy")
            subprocess.run([os.environ["CAPSERVE_GENERATE"], "--model", MODEL, "--input-ids",
                            " ".join(map(str, PROMPT)), "--max-new-tokens", str(NEW), "--ignore-eos",
                            "--dump-logits", dump], check=True, capture_output=True, timeout=120)
            logits = np.load(dump)
        self.assertEqual(logits.shape[0], NEW)
        for i, (token, entry) in enumerate(zip(tokens, entries)):
            expected = log_softmax(logits[i])
            self.assertAlmostEqual(entry.logprob, expected[token], delta=1e-4, msg=f"token {i}")
            ranked = sorted(range(len(expected)), key=lambda t: (-logits[i][t], t))[:TOP]
            self.assertEqual([t.token_id for t in entry.top_logprobs], ranked, f"token {i}")
            for t in entry.top_logprobs:
                self.assertAlmostEqual(t.logprob, expected[t.token_id], delta=1e-4, msg=f"token {i}")
            # Greedy: the sampled token is the most likely one.
            self.assertEqual(entry.top_logprobs[0].token_id, token)

        # The same tokens as a prompt: each scored from its prefix at prefill, as it was at decode.
        again = self.generate(PROMPT + tokens, 1, prompt_logprobs=True)
        prompt_entries = again[0].prompt_logprobs
        self.assertEqual(len(prompt_entries), len(PROMPT) + NEW - 1)
        for i, entry in enumerate(prompt_entries[len(PROMPT) - 1:]):
            self.assertEqual(entry.token_id, tokens[i])
            self.assertAlmostEqual(entry.logprob, entries[i].logprob, delta=1e-4, msg=f"token {i}")
            self.assertEqual(len(entry.top_logprobs), 0)
        self.assertEqual(sum(len(c.logprobs) for c in again), 0, "logprobs were not asked for")

    def test_chat_entries_spell_the_text_of_each_chunk(self):
        request = chat_request("Tell me about the mixture of experts.", max_tokens=20, logprobs=True,
                               top_logprobs=2)
        reply = self.stub.Chat(request, timeout=120)
        self.assertTrue(reply.text)
        # Tokens decoded alone spell the text, except where a character spans tokens (U+FFFD each).
        if not any("\ufffd" in e.token for e in reply.logprobs):
            self.assertEqual("".join(e.token for e in reply.logprobs), reply.text)
        eos = 1 if reply.finish_reason == pb.FINISH_REASON_STOP else 0  # the stop token has no entry
        self.assertEqual(len(reply.logprobs), reply.usage.completion_tokens - eos)
        for e in reply.logprobs:
            self.assertEqual(len(e.top_logprobs), 2)
            self.assertLessEqual(e.logprob, e.top_logprobs[0].logprob + 1e-6)
            self.assertGreaterEqual(e.top_logprobs[0].logprob, e.top_logprobs[1].logprob)
        self.assertEqual(len(reply.prompt_logprobs), 0)

        chunks = list(self.stub.ChatStream(request, timeout=120))
        self.assertEqual([e.token_id for c in chunks for e in c.logprobs], [e.token_id for e in reply.logprobs])
        for c in chunks:
            if not any("\ufffd" in e.token for e in c.logprobs):
                self.assertEqual("".join(e.token for e in c.logprobs), c.delta, "a chunk's entries")

    def heldout_window(self):
        """capserve-eval-heldout's figures for the first `window` text tokens of TEXT, and those token ids.

        It scores windows of `window` text tokens after <|endoftext|> (id 0); with --heldout-fraction 1 its text
        is the file after its first line."""
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "doc.txt"), "w") as f:
                f.write("header\n" + TEXT + "\n")
            out = os.path.join(tmp, "eval.json")
            subprocess.run([os.environ["CAPSERVE_EVAL_HELDOUT"], "--model", MODEL, "--corpus", tmp, "--domains",
                            "doc", "--window", str(WINDOW), "--max-windows", "1", "--batch-windows", "1",
                            "--heldout-fraction", "1", "--threads", "1", "--json", out],
                           check=True, capture_output=True, timeout=120)
            with open(out) as f:
                figures = json.load(f)["domains"]["doc"]
            ids = subprocess.run([os.environ["CAPSERVE_TOKENIZE"], "--tokenizer", MODEL], input=TEXT + "\n",
                                 check=True, capture_output=True, text=True, timeout=60).stdout.split()
        self.assertEqual(figures["tokens"], WINDOW)
        self.assertGreater(len(ids), WINDOW + 4, "the window lies inside the text")
        return figures, [int(t) for t in ids[:WINDOW]]

    def test_prompt_logprobs_equal_capserve_eval_heldout_for_the_same_text(self):
        # Its task score too: the positions whose most probable token (the top entry) is the text's.
        figures, ids = self.heldout_window()
        chunks = self.generate([0] + ids, 1, prompt_logprobs=True, top_logprobs=1)
        entries = chunks[0].prompt_logprobs
        self.assertEqual(len(entries), WINDOW)
        self.assertAlmostEqual(-sum(e.logprob for e in entries), figures["total_nll"], delta=1e-4)
        correct = sum(e.top_logprobs[0].token_id == e.token_id for e in entries)
        self.assertEqual(correct, figures["correct"])
        self.assertGreater(correct, 0, "the model predicts some of the text")
        self.assertAlmostEqual(figures["accuracy"], correct / WINDOW)

    def test_http_echo_logprobs_equal_capserve_eval_heldout_for_the_same_text(self):
        # What lm-eval's local-completions model asks for a log-likelihood: the prompt as token ids, echo,
        # logprobs, max_tokens 1; the prompt's entries (the first null) sum to its log-likelihood.
        figures, ids = self.heldout_window()
        body = json.dumps({"model": self.server.model_id, "prompt": [0] + ids, "echo": True, "logprobs": 1,
                           "max_tokens": 1, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.server.http_port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            logprobs = json.load(r)["choices"][0]["logprobs"]
        self.assertEqual(len(logprobs["token_logprobs"]), WINDOW + 2, "the prompt's entries and the new token's")
        self.assertIsNone(logprobs["token_logprobs"][0])
        prompt = logprobs["token_logprobs"][1:WINDOW + 1]
        self.assertEqual(len(prompt), WINDOW)
        self.assertAlmostEqual(-sum(prompt), figures["total_nll"], delta=1e-4)

    def test_out_of_range_requests_are_refused(self):
        for options, field in [(dict(logprobs=True, top_logprobs=21), "sampling.top_logprobs: must be in [0, 20]"),
                               (dict(top_logprobs=3), "needs sampling.logprobs or sampling.prompt_logprobs")]:
            with self.assertRaises(grpc.RpcError) as caught:
                self.generate(PROMPT, 2, **options)
            self.assertEqual(caught.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn(field, caught.exception.details())


if __name__ == "__main__":
    main()
