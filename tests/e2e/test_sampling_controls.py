"""Sampling controls end to end (2 ranks, gRPC and HTTP): logit_bias +100 on one token makes greedy decoding emit
only it, -100 on the greedy token makes it emit another, and the HTTP API's chat answers as the gRPC one under the
same bias; min_tokens keeps the stop ids out of the first min_tokens tokens; presence / frequency / repetition
penalties change a greedy output that repeats itself; bad values are refused naming the field (HTTP 400, gRPC
INVALID_ARGUMENT). The exact definitions are checked against references in the unit and cuda-emu tests
(tests/unit/kernels/sampling_controls_checks.h, tests/unit/server/test_rank_worker.cpp)."""

import grpc

from capserve_e2e import ServerTestCase, chat_request, http_chat, main, pb

PROMPT = [5, 17, 300, 42, 7, 99, 1000, 3]


class SamplingControlsTest(ServerTestCase):
    def generate(self, max_tokens, **options):
        """Greedy Generate of PROMPT: its token ids and finish reason."""
        sampling = pb.SamplingOptions(max_tokens=max_tokens, **options)
        chunks = list(self.stub.Generate(pb.GenerateRequest(input_ids=PROMPT, sampling=sampling), timeout=120))
        return [t for c in chunks for t in c.token_ids], chunks[-1].finish_reason

    def test_logit_bias_steers_greedy_decoding(self):
        plain, _ = self.generate(8, ignore_eos=True)
        favoured = next(t for t in range(10, 1000) if t not in plain)
        biased, _ = self.generate(8, ignore_eos=True, logit_bias={favoured: 100.0})
        self.assertEqual(biased, [favoured] * 8)
        other, _ = self.generate(1, ignore_eos=True, logit_bias={plain[0]: -100.0})
        self.assertNotEqual(other, plain[:1])

    def test_http_chat_equals_grpc_chat_under_logit_bias(self):
        plain = self.stub.Chat(chat_request("Hello there", max_tokens=12), timeout=120).text
        grpc_biased = self.stub.Chat(chat_request("Hello there", max_tokens=12, logit_bias={300: 100.0},
                                                  presence_penalty=1.0), timeout=120).text
        self.assertNotEqual(grpc_biased, plain)
        code, body = http_chat(self.server.http_port, {
            "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 12, "temperature": 0,
            "logit_bias": {"300": 100}, "presence_penalty": 1})
        self.assertEqual(code, 200, body)
        self.assertEqual(body["choices"][0]["message"]["content"], grpc_biased)

    def test_min_tokens_delays_the_stop_ids(self):
        plain, _ = self.generate(8, ignore_eos=True)
        stop = plain[0]
        # Generate's output leaves the stop token out: at once, nothing.
        tokens, finish = self.generate(8, ignore_eos=True, stop_token_ids=[stop])
        self.assertEqual((tokens, finish), ([], pb.FINISH_REASON_STOP))
        tokens, _ = self.generate(8, ignore_eos=True, stop_token_ids=[stop], min_tokens=3)
        self.assertGreaterEqual(len(tokens), 3)
        self.assertNotIn(stop, tokens)

    def test_penalties_change_a_repeating_output(self):
        plain, _ = self.generate(24, ignore_eos=True)
        self.assertLess(len(set(plain)), len(plain), "greedy output repeats no token: the check below cannot fail")
        for options in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 3.0}):
            penalized, _ = self.generate(24, ignore_eos=True, **options)
            self.assertNotEqual(penalized, plain, options)

    def test_bad_values_are_refused_naming_the_field(self):
        for body, field in (({"logit_bias": {"1": 500}}, "logit_bias"), ({"min_p": 2}, "min_p"),
                            ({"presence_penalty": -3}, "presence_penalty"), ({"min_tokens": -1}, "min_tokens"),
                            ({"stop_token_ids": ["x"]}, "stop_token_ids")):
            code, answer = http_chat(self.server.http_port,
                                     {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **body})
            self.assertEqual(code, 400, answer)
            self.assertEqual(answer["error"]["param"], field)
        with self.assertRaises(grpc.RpcError) as refused:
            self.generate(4, repetition_penalty=-1.0)
        self.assertEqual(refused.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertTrue(refused.exception.details().startswith("sampling.repetition_penalty: "),
                        refused.exception.details())


if __name__ == "__main__":
    main()
