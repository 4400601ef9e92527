"""Chunked prefill and the prefix cache on the real server (issue 28): a prompt of four times the step's token budget
is served while a running stream keeps getting a token every step; a prompt that repeats an earlier one's blocks is
served from the cache with the same greedy output as when it is computed whole; a request goes to the rank whose
cache holds its prefix; the access line and the metrics say so."""

import json
import re
import threading
import time
import urllib.request

from capserve_e2e import ServerTestCase, delta, main, metric, pb

BUDGET = 64  # --max-batched-tokens
BLOCK = 16   # the server's KV block size


def generate(ids, max_tokens, request_id="", **sampling):
    return pb.GenerateRequest(input_ids=ids, request_id=request_id.encode(),
                              sampling=pb.SamplingOptions(max_tokens=max_tokens, ignore_eos=True, temperature=0,
                                                          **sampling))


class PrefixCacheTest(ServerTestCase):
    FLAGS = ["--max-batched-tokens", str(BUDGET)]

    def tokens(self, request):
        return [t for c in self.stub.Generate(request, timeout=120) for t in c.token_ids]

    def test_long_prompt_is_prefilled_in_chunks_while_a_stream_decodes(self):
        before = self.server.metrics()
        arrivals = []  # monotonic times of the running stream's tokens
        started = threading.Event()

        def stream():
            for chunk in self.stub.Generate(generate([11, 12, 13], 300, "chunk-stream"), timeout=300):
                for _ in chunk.token_ids:
                    arrivals.append(time.monotonic())
                    started.set()

        runner = threading.Thread(target=stream)
        runner.start()
        self.assertTrue(started.wait(120), "the running stream never started")
        long_ids = [(7 * i) % 900 + 50 for i in range(4 * BUDGET)]
        sent = time.monotonic()
        first = None
        for chunk in self.stub.Generate(generate(long_ids, 4, "chunk-long"), timeout=300):
            if chunk.token_ids and first is None:
                first = time.monotonic()
        runner.join()
        self.assertIsNotNone(first, "the long prompt produced no token")
        during = [t for t in arrivals if sent <= t <= first]
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if sent <= b <= first]
        # 256 prompt tokens at 63 a step beside the stream's decode: 5 chunks, and the stream got a token in each
        # step but the first (it may have been under way when the prompt arrived).
        self.assertGreaterEqual(len(during), 4, f"stream tokens while the long prompt prefilled: {len(during)}")
        ttft = first - sent
        print(f"long prompt ttft {ttft * 1e3:.1f} ms; running stream: {len(during)} tokens meanwhile, "
              f"max gap {max(gaps) * 1e3:.1f} ms", flush=True)
        self.assertLess(max(gaps), ttft, "a gap of the running stream spanned the whole long prefill")
        after = self.wait_for(lambda: (lambda m: m if delta(m, before, "capserve_chunked_prefills_total") >= 1
                                       else None)(self.server.metrics()), 30, "the chunked prefill to be counted")
        self.assertGreaterEqual(delta(after, before, "capserve_prefill_chunks_total"), 5)
        line = self.wait_for(lambda: next((x for x in self.server.log if "id=chunk-long " in x), None), 30,
                             "the long request's access line")
        self.assertRegex(line, r" prefill_chunks=[5-9]")

    def test_cached_prefix_gives_the_output_of_a_whole_prefill(self):
        shared = [(13 * i) % 700 + 30 for i in range(5 * BLOCK + 3)]
        self.tokens(generate(shared, 2, "cache-first"))
        before = self.server.metrics()
        follow_up = shared[:4 * BLOCK] + [901, 902, 903, 904, 905]
        cached = self.tokens(generate(follow_up, 12, "cache-hit"))
        after = self.server.metrics()
        hit = delta(after, before, "capserve_prefix_cache_hit_tokens_total")
        self.assertEqual(hit, 4 * BLOCK, "the follow-up's four shared blocks were not taken from the cache")
        self.assertEqual(delta(after, before, "capserve_prefix_cache_query_tokens_total"), len(follow_up))
        self.assertEqual(delta(after, before, "capserve_prefill_tokens_computed_total"), len(follow_up) - 4 * BLOCK)
        # Prompt log-probabilities need every prompt position's logits: such a request is computed whole.
        whole = self.tokens(generate(follow_up, 12, "cache-whole", prompt_logprobs=True))
        self.assertEqual(cached, whole)
        self.assertEqual(delta(self.server.metrics(), after, "capserve_prefix_cache_hit_tokens_total"), 0)
        line = self.wait_for(lambda: next((x for x in self.server.log if "id=cache-hit " in x), None), 30,
                             "the cached request's access line")
        self.assertIn(f" cached_tokens={4 * BLOCK}", line)
        # The usage says so too: gRPC's cached_prompt_tokens, HTTP's usage.prompt_tokens_details.cached_tokens.
        last = list(self.stub.Generate(generate(follow_up, 1, "cache-usage"), timeout=120))[-1]
        self.assertEqual(last.usage.cached_prompt_tokens, 4 * BLOCK)
        body = json.dumps({"prompt": follow_up, "max_tokens": 1, "temperature": 0}).encode()
        with urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{self.server.http_port}/v1/completions", data=body,
                headers={"Content-Type": "application/json"}), timeout=120) as response:
            usage = json.load(response)["usage"]
        self.assertEqual(usage["prompt_tokens_details"], {"cached_tokens": 4 * BLOCK})

    def test_a_client_that_leaves_mid_prefill_leaves_a_cache_that_serves_the_prompt_right(self):
        # A client gives up on a long prompt (14 chunks) as soon as the server has computed its first chunk: the
        # request ends cancelled and is freed, and the blocks its chunks left in the cache serve the same prompt
        # later with the output of a whole prefill. (/metrics is read back to back, so the cancel lands a chunk
        # or two in, unless the machine stalls the client that long; the count is printed.)
        long_ids = [(11 * i) % 850 + 60 for i in range(14 * BUDGET)]
        before = self.server.metrics()
        call = self.stub.Generate(generate(long_ids, 200, "leave-mid-prefill"), timeout=300)
        deadline = time.monotonic() + 60
        while delta(self.server.metrics(), before, "capserve_prefill_chunks_total") < 1:
            self.assertLess(time.monotonic(), deadline, "the long prompt's first chunk was never computed")
        call.cancel()
        line = self.wait_for(lambda: next((x for x in self.server.log if "id=leave-mid-prefill " in x), None), 60,
                             "the cancelled request's access line")
        chunks = re.search(r" prefill_chunks=(\d+)", line)
        print(f"cancelled after {chunks.group(1) if chunks else 1} of 14 chunks", flush=True)
        self.assertIn("finish_reason=cancelled", line)
        self.wait_for(lambda: metric(self.server.metrics(), "capserve_requests_running") == 0, 60,
                      "the server to free the cancelled request")
        again = self.tokens(generate(long_ids, 4, "after-leave"))
        whole = self.tokens(generate(long_ids, 4, "after-leave-whole", prompt_logprobs=True))
        self.assertEqual(again, whole)

    def test_a_request_goes_to_the_rank_that_holds_its_prefix(self):
        shared = [(17 * i) % 800 + 40 for i in range(3 * BLOCK + 5)]
        self.tokens(generate(shared, 1, "affinity-first"))  # on rank 0: both ranks were idle
        # Another request keeps rank 0 busier than rank 1 while the follow-up arrives; within the slack, the
        # follow-up still goes to rank 0, where its prefix is.
        busy = self.stub.Generate(generate([5, 6, 7], 200, "affinity-busy"), timeout=300)
        next(iter(busy))
        before = self.server.metrics()
        self.tokens(generate(shared[:3 * BLOCK] + [77], 2, "affinity-follow"))
        self.assertEqual(delta(self.server.metrics(), before, "capserve_prefix_cache_hit_tokens_total"), 3 * BLOCK)
        busy.cancel()
        self.assertGreater(metric(self.server.metrics(), "capserve_prefix_cache_cached_blocks", rank="0"), 0)


if __name__ == "__main__":
    main()
