"""Speculative decoding in the server on 2 ranks: `capserve --speculative ngram` answers the same chat completions
and the same Generate tokens as a server without speculation (greedy, and seeded sampling at temperature > 0),
and its drafts reach the capserve_spec_ metrics and the access lines (drafted=, accepted=). The same tests run
with `--speculative mtp` on capserve-dsv3-mtp-tiny, whose trained MTP layer drafts (a collective on every rank,
its experts spread over both)."""

import os
import re

from capserve_e2e import MODEL, Server, ServerTestCase, chat_request, delta, main, metric, pb

# Prompts that repeat themselves, so the n-gram lookup has something to propose from the first decode.
PROMPTS = [
    "Repeat after me five times: the red fox jumps, the red fox jumps, the red fox jumps,",
    "Count: one two three, one two three, one two three, one two three,",
    "Name a fruit.",
]
MAX_TOKENS = 40
INPUT_IDS = [5, 17, 300, 42, 7, 99, 1000, 3, 5, 17, 300, 42, 7, 99, 1000, 3]


class SpeculativeTest(ServerTestCase):
    FLAGS = ["--speculative", "ngram", "--num-speculative-tokens", "3"]

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.plain = Server(model=cls.MODEL)
        cls.addClassCleanup(cls.plain.stop)
        cls.plain.start()

    @staticmethod
    def chat(stub, content, request_id="", **sampling):
        reply = stub.Chat(chat_request(content, max_tokens=MAX_TOKENS, request_id=request_id, **sampling),
                          timeout=300)
        return reply.text, reply.finish_reason, reply.usage.completion_tokens

    @staticmethod
    def generate(stub, **sampling):
        options = pb.SamplingOptions(max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
        chunks = stub.Generate(pb.GenerateRequest(input_ids=INPUT_IDS, sampling=options), timeout=300)
        return [t for c in chunks for t in c.token_ids]

    def test_prefix_cache_is_off_with_speculation(self):
        # Its default: on, but not with --speculative (the scheduler's mirror of the KV blocks does not follow
        # draft blocks yet); the start-up summary says which.
        for server, state in ((self.server, "off"), (self.plain, "on")):
            self.wait_for(lambda: any(f"; prefix cache {state};" in line for line in list(server.log)), 10,
                          lambda: f"'prefix cache {state}' in the start-up summary of:\n" + "".join(server.log[-20:]))

    def test_greedy_and_seeded_completions_equal_a_server_without_speculation(self):
        before = self.server.metrics()
        for sampling in ({"temperature": 0.0}, {"temperature": 0.8, "seed": 1234}):
            for i, prompt in enumerate(PROMPTS):
                self.assertEqual(self.chat(self.stub, prompt, **sampling),
                                 self.chat(self.plain.stub, prompt, **sampling), f"prompt {i}, {sampling}")
            self.assertEqual(self.generate(self.stub, **sampling), self.generate(self.plain.stub, **sampling),
                             f"Generate, {sampling}")
        after = self.server.metrics()
        drafted = delta(after, before, "capserve_spec_draft_tokens_total")
        accepted = delta(after, before, "capserve_spec_accepted_tokens_total")
        self.assertGreater(drafted, 0, "no draft was verified")
        self.assertGreater(accepted, 0, "no draft was kept")
        self.assertLessEqual(accepted, drafted)
        self.assertEqual(delta(after, before, "capserve_spec_position_draft_tokens_total"), drafted)
        self.assertEqual(delta(after, before, "capserve_spec_position_accepted_tokens_total"), accepted)
        first = delta(after, before, "capserve_spec_position_draft_tokens_total", position="0")
        self.assertGreater(first, 0)
        self.assertGreaterEqual(first, delta(after, before, "capserve_spec_position_draft_tokens_total",
                                             position="2"), "a later position is verified at most as often")
        self.assertIsNone(metric(self.plain.metrics(), "capserve_spec_draft_tokens_total"),
                          "a server without speculation has no capserve_spec_ series")

    def test_the_access_line_counts_the_requests_drafts(self):
        self.chat(self.stub, PROMPTS[0], request_id="spec-access-1")
        pattern = re.compile(r"request id=spec-access-1 .* rerouted=\d+ drafted=(\d+) accepted=(\d+)$")

        def found():
            for line in list(self.server.log):
                m = pattern.search(line.rstrip("\n"))
                if m:
                    return m
            return None

        m = self.wait_for(found, 60, lambda: "an access line for spec-access-1 in:\n" + "".join(self.server.log[-10:]))
        self.assertGreater(int(m.group(1)), 0)
        self.assertLessEqual(int(m.group(2)), int(m.group(1)))
        self.chat(self.plain.stub, PROMPTS[0], request_id="spec-access-2")
        self.wait_for(lambda: any("request id=spec-access-2 " in line for line in list(self.plain.log)), 60,
                      "the plain server's access line")
        line = next(line for line in list(self.plain.log) if "request id=spec-access-2 " in line)
        self.assertNotIn("drafted=", line)


class MtpSpeculativeTest(SpeculativeTest):
    FLAGS = ["--speculative", "mtp", "--num-speculative-tokens", "3"]
    MODEL = os.path.join(os.path.dirname(MODEL), "capserve-dsv3-mtp-tiny")


if __name__ == "__main__":
    main()
