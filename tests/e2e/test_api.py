"""The API on one default server (gamma = inf): health, the five RPCs, batching invariance, validation, deadlines,
cancellation and /metrics (series present and moving, `promtool check metrics`)."""

import os
import shutil
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from capserve_e2e import ServerTestCase, chat_request, delta, main, message, metric, pb

LONG = 900  # max_tokens of a request meant to be cut short (the model's context is 1024)


class ApiTest(ServerTestCase):
    FLAGS = ["--metrics-per-expert"]  # the per-expert token series are checked below

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.info = cls.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)

    def test_health_serving(self):
        self.assertEqual(self.server.health(), "SERVING")

    def test_list_models_and_server_info(self):
        models = self.stub.ListModels(pb.ListModelsRequest(), timeout=10).models
        self.assertEqual([m.id for m in models], [self.server.model_id])
        info = self.info
        self.assertEqual(info.ranks, 2)
        self.assertEqual(info.model, models[0])
        self.assertGreater(info.model.num_experts, 0)
        self.assertGreater(info.model.experts_per_token, 0)
        self.assertEqual(info.model.max_context, 1024)
        self.assertIn(info.placement, ["contiguous", "round-robin", "balanced"])
        self.assertEqual(len(info.experts_per_rank), 2)
        self.assertEqual(sum(info.experts_per_rank), info.model.num_experts)
        self.assertRegex(info.capacity, r"^gamma=inf ")  # the default: no capacity limit
        self.assertRegex(info.batch_selector, r"^strategy=fcfs ")
        # The model directory's learned load map is found on its own; it covers every MoE layer.
        self.assertIn(" predictor=load_map predicted_layers=4", info.batch_selector)
        self.assertGreater(info.max_running_sequences, 0)
        self.assertGreater(info.max_batched_tokens, 0)
        self.assertGreater(info.kv_blocks_per_rank, 0)

    def test_chat_and_stream_agree(self):
        request = chat_request("Tell me about the mixture of experts.", max_tokens=24, request_id="agree-1")
        reply = self.stub.Chat(request, timeout=120)
        self.assertEqual(reply.request_id, "agree-1")
        self.assertTrue(reply.text)
        self.assertIn(reply.finish_reason, [pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH])
        self.assertGreater(reply.usage.prompt_tokens, 0)
        self.assertTrue(0 < reply.usage.completion_tokens <= 24)
        self.assertGreater(reply.moe.assignments, 0)

        chunks = list(self.stub.ChatStream(request, timeout=120))
        self.assertGreater(len(chunks), 1)
        self.assertEqual("".join(c.delta for c in chunks), reply.text)
        self.assertEqual({c.request_id for c in chunks}, {"agree-1"})
        # finish_reason, usage and MoE statistics come on the last chunk only.
        self.assertEqual([c.finish_reason for c in chunks[:-1]], [pb.FINISH_REASON_UNSPECIFIED] * (len(chunks) - 1))
        self.assertEqual(chunks[-1].finish_reason, reply.finish_reason)
        # The same prompt again: its whole blocks come from the prefix cache, so fewer assignments are routed.
        usage = chunks[-1].usage
        self.assertEqual((usage.prompt_tokens, usage.completion_tokens),
                         (reply.usage.prompt_tokens, reply.usage.completion_tokens))
        self.assertEqual(reply.usage.cached_prompt_tokens, 0)
        self.assertEqual(usage.cached_prompt_tokens, (usage.prompt_tokens - 1) // 16 * 16)
        per_token = reply.moe.assignments // (reply.usage.prompt_tokens + reply.usage.completion_tokens - 1)
        self.assertEqual(chunks[-1].moe.assignments, reply.moe.assignments - usage.cached_prompt_tokens * per_token)
        self.assertEqual((chunks[-1].moe.dropped, chunks[-1].moe.rerouted), (reply.moe.dropped, reply.moe.rerouted))
        # Without a client id the server makes one that does not repeat across restarts (not a counter).
        ids = {self.stub.Chat(chat_request("Hi", max_tokens=1), timeout=120).request_id for _ in range(3)}
        self.assertEqual(len(ids), 3)
        for generated in ids:
            self.assertRegex(generated, r"^req-[0-9a-f]{24}$")

    def test_generate(self):
        request = pb.GenerateRequest(input_ids=[5, 17, 42, 99, 7], sampling=pb.SamplingOptions(max_tokens=12,
                                                                                              ignore_eos=True))
        runs = []
        for _ in range(2):
            chunks = list(self.stub.Generate(request, timeout=120))
            ids = [t for c in chunks for t in c.token_ids]
            self.assertEqual(len(ids), 12)
            self.assertTrue(all(0 <= t < 1_000_000 for t in ids))
            self.assertEqual(chunks[-1].finish_reason, pb.FINISH_REASON_LENGTH)
            self.assertEqual(chunks[-1].usage.prompt_tokens, 5)
            self.assertEqual(chunks[-1].usage.completion_tokens, 12)
            runs.append(ids)
        self.assertEqual(runs[0], runs[1])  # greedy

    def test_concurrent_equals_sequential(self):
        # 32 greedy requests batched together give what each gives alone (no capacity: gamma = inf).
        topics = ["cats", "the ocean", "prime numbers", "a red bicycle", "Paris", "coffee", "winter", "robots"]
        requests = [chat_request(f"Write two sentences about {topics[i % 8]} (variant {i}).", max_tokens=16)
                    for i in range(32)]

        def answer(request):
            r = self.stub.Chat(request, timeout=300)
            return r.text, r.finish_reason, r.usage.completion_tokens

        def steps():
            return metric(self.server.metrics(), "capserve_moe_steps_total")

        before = steps()
        alone = [answer(r) for r in requests]
        between = steps()
        barrier = threading.Barrier(32)

        def together(request):
            barrier.wait()
            return answer(request)

        with ThreadPoolExecutor(32) as pool:
            batched = list(pool.map(together, requests))
        after = steps()
        for i in range(32):
            self.assertEqual(batched[i], alone[i], f"request {i}")
        # They really were batched: far fewer engine steps than one request at a time.
        self.assertLess(after - between, (between - before) / 2)

    def test_invalid_arguments_name_the_field(self):
        def chat(**fields):
            return lambda: self.stub.Chat(pb.ChatRequest(**fields), timeout=30)

        user = [message("user", "Hello")]
        cases = [
            ("messages[0].role", chat(messages=[message("robot", "Hello")])),
            ("messages[1].role", lambda: list(self.stub.ChatStream(pb.ChatRequest(messages=[
                user[0], message("", "x")]), timeout=30))),
            ("messages", chat(messages=[])),
            ("sampling.temperature", chat(messages=user, sampling=pb.SamplingOptions(temperature=-0.5))),
            ("sampling.max_tokens", chat(messages=user, sampling=pb.SamplingOptions(max_tokens=100_000))),
            ("messages", chat(messages=[message("user", "hello world " * 2000)])),  # a prompt over the context
            ("model", chat(model=b"no-such-model", messages=user)),
            ("input_ids[1]", lambda: list(self.stub.Generate(pb.GenerateRequest(input_ids=[5, 1_000_000]),
                                                             timeout=30))),
            ("input_ids[0]", lambda: list(self.stub.Generate(pb.GenerateRequest(input_ids=[-1]), timeout=30))),
        ]
        before = metric(self.server.metrics(), "capserve_request_errors_total", code="INVALID_ARGUMENT")
        for field, call in cases:
            with self.subTest(field=field):
                with self.assertRaises(grpc.RpcError) as raised:
                    call()
                self.assertEqual(raised.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
                self.assertTrue(raised.exception.details().startswith(field + ":"), raised.exception.details())
        after = metric(self.server.metrics(), "capserve_request_errors_total", code="INVALID_ARGUMENT")
        self.assertEqual(after - before, len(cases))
        self.assertIn("4096", self._details(chat(messages=user, sampling=pb.SamplingOptions(max_tokens=5000))))

    def _details(self, call):
        try:
            call()
        except grpc.RpcError as e:
            return e.details()
        self.fail("the call succeeded")

    def _idle_metrics(self, finished=None):
        """/metrics once the server runs no request (and has ended `finished` requests in all, if given)."""
        def idle():
            m = self.server.metrics()
            if finished is not None and metric(m, "capserve_requests_total") != finished:
                return None
            return m if metric(m, "capserve_requests_running") == 0 else None
        return self.wait_for(idle, 10, "the server to free the request")

    def test_deadline(self):
        # Time a short generation (twice: the first may pay for warm-up) to set a deadline that cuts a LONG one off
        # after ~50 tokens, and certainly before a quarter of it.
        for _ in range(2):
            start = time.monotonic()
            list(self.stub.Generate(pb.GenerateRequest(input_ids=[3, 4, 5], sampling=pb.SamplingOptions(
                max_tokens=32, ignore_eos=True)), timeout=120))
            per_token = (time.monotonic() - start) / 32
        deadline = min(max(0.3, 50 * per_token), LONG * per_token / 4)
        before = self._idle_metrics()
        start = time.monotonic()
        with self.assertRaises(grpc.RpcError) as raised:
            self.stub.Chat(chat_request("Tell me a very long story.", max_tokens=LONG, ignore_eos=True),
                           timeout=deadline)
        self.assertEqual(raised.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertLess(time.monotonic() - start, deadline + 5)
        after = self._idle_metrics(metric(before, "capserve_requests_total") + 1)
        self.assertLess(delta(after, before, "capserve_generation_tokens_total"), LONG)  # freed early
        # The server ends it as DEADLINE_EXCEEDED (an error), not as a cancellation.
        self.assertEqual(delta(after, before, "capserve_request_errors_total", code="DEADLINE_EXCEEDED"), 1)
        self.assertEqual(delta(after, before, "capserve_requests_total", finish_reason="error"), 1)
        self.assertEqual(delta(after, before, "capserve_requests_total", finish_reason="cancelled"), 0)

    def _assert_cancelled_and_freed(self, before):
        after = self._idle_metrics(metric(before, "capserve_requests_total") + 1)
        self.assertEqual(delta(after, before, "capserve_requests_total", finish_reason="cancelled"), 1)
        self.assertLess(delta(after, before, "capserve_generation_tokens_total"), LONG)  # freed early

    def test_cancel_stream_frees_the_sequence(self):
        before = self._idle_metrics()
        call = self.stub.ChatStream(chat_request("Tell me a very long story.", max_tokens=LONG, ignore_eos=True),
                                    timeout=300)
        stream = iter(call)
        next(stream)
        next(stream)
        call.cancel()
        with self.assertRaises(grpc.RpcError) as raised:
            for _ in stream:
                pass
        self.assertEqual(raised.exception.code(), grpc.StatusCode.CANCELLED)
        self._assert_cancelled_and_freed(before)

    def test_cancel_unary_chat_frees_the_sequence(self):
        before = self._idle_metrics()
        future = self.stub.Chat.future(chat_request("Tell me a long story.", max_tokens=LONG, ignore_eos=True),
                                       timeout=300)

        def generating():
            return delta(self.server.metrics(), before, "capserve_generation_tokens_total") >= 2

        self.wait_for(generating, 60, "the chat to be generating")
        future.cancel()
        self.assertTrue(future.cancelled())
        self._assert_cancelled_and_freed(before)

    def test_metrics_move(self):
        text = self.server.metrics_text()
        before = self._idle_metrics()
        prompt = [11, 12, 13, 14, 15, 16]
        chunks = list(self.stub.Generate(pb.GenerateRequest(input_ids=prompt, sampling=pb.SamplingOptions(
            max_tokens=8, ignore_eos=True)), timeout=120))
        self.assertEqual(chunks[-1].usage.completion_tokens, 8)
        after = self._idle_metrics(metric(before, "capserve_requests_total") + 1)

        def d(name, **labels):
            return delta(after, before, name, **labels)

        self.assertEqual(d("capserve_requests_total", finish_reason="length"), 1)
        self.assertEqual(d("capserve_generation_tokens_total"), 8)
        self.assertEqual(d("capserve_prompt_tokens_total"), len(prompt))
        for histogram in ["time_to_first_token", "end_to_end_latency", "queue_time"]:
            self.assertEqual(d(f"capserve_{histogram}_seconds_count"), 1, histogram)
        self.assertEqual(d("capserve_inter_token_latency_seconds_count"), 7)
        self.assertIsNotNone(metric(after, "capserve_requests_waiting"))

        # Per MoE layer: the router's assignments (top_k per token that went through the layer), all computed
        # by some expert as nothing is dropped at gamma = inf.
        layers = {dict(ls)["layer"] for (n, ls) in after if n == "capserve_moe_assignments_total"}
        self.assertTrue(layers)
        top_k = self.info.model.experts_per_token
        tokens = len(prompt) + 8 - 1  # the last sampled token is never fed back
        for layer in sorted(layers):
            with self.subTest(layer=layer):
                self.assertEqual(d("capserve_moe_assignments_total", layer=layer), tokens * top_k)
                self.assertEqual(d("capserve_moe_expert_tokens_total", layer=layer), tokens * top_k)
                self.assertEqual(d("capserve_moe_rank_tokens_total", layer=layer), tokens * top_k)
                self.assertEqual(d("capserve_moe_dropped_assignments_total", layer=layer), 0)
                self.assertGreater(d("capserve_moe_phase_seconds_total", layer=layer), 0)
                self.assertGreaterEqual(d("capserve_moe_alltoall_bytes_total", layer=layer), 0)
                self.assertGreaterEqual(metric(after, "capserve_moe_rank_imbalance", layer=layer), 1)
        self.assertGreater(d("capserve_moe_steps_total"), 0)
        self.assertGreater(d("capserve_moe_alltoall_bytes_total"), 0)  # the ranks did exchange tokens
        self.assertIn("# TYPE capserve_time_to_first_token_seconds histogram", text)

    def test_cpp_client_loadgen(self):
        # The C++ client: capserve-loadgen (tools/loadgen) exits non-zero unless every request got exactly one
        # terminal status, and with --fail-on-error unless every status was OK.
        loadgen = os.environ.get("CAPSERVE_LOADGEN")
        if not loadgen:
            self.skipTest("capserve-loadgen is not part of this build (tools/loadgen)")
        before = self._idle_metrics()
        with tempfile.TemporaryDirectory() as corpus:
            with open(os.path.join(corpus, "e2e.txt"), "w") as f:
                f.write("The quick brown fox jumps over the lazy dog near the river bank. " * 100)
            run = subprocess.run([loadgen, "--target", self.server.address, "--concurrency", "4", "--max-requests",
                                  "12", "--duration-s", "120", "--corpus", corpus, "--domains", "e2e",
                                  "--prompt-tokens", "16", "--output-tokens", "8", "--progress-s", "0",
                                  "--metrics-url", f"http://127.0.0.1:{self.server.metrics_port}/metrics",
                                  "--fail-on-error"], capture_output=True, text=True, timeout=240)
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        after = self._idle_metrics()
        self.assertGreaterEqual(delta(after, before, "capserve_requests_total"), 12)
        self.assertEqual(delta(after, before, "capserve_request_errors_total"), 0)

    def test_promtool_check_metrics(self):
        promtool = shutil.which("promtool")
        if promtool is None:
            self.skipTest("promtool not found: install the Debian package 'prometheus' (deploy/install_deps.sh)")
        text = self.server.metrics_text()
        check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
        self.assertEqual(check.returncode, 0, check.stdout + check.stderr)


if __name__ == "__main__":
    main()
