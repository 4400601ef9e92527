"""Hardening of the request path (issues 12 and 24), each case as reported: stop strings splitting UTF-8 characters
in a stream, a tiny temperature, prompts longer than a step (prefilled in chunks), invalid UTF-8 in request text, special tokens typed in
a message, unbounded request fields, deeply nested JSON and one client opening many streams. Every refusal names its
field or limit and is counted in capserve_request_errors_total."""

import json
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc

from capserve_e2e import ServerTestCase, chat_request, delta, http_chat, main, message, metric, pb

PER_PEER = 6


class RequestHardeningTest(ServerTestCase):
    FLAGS = ["--max-batched-tokens", "512", "--max-requests-per-peer", str(PER_PEER)]

    def refusal(self, call, code=grpc.StatusCode.INVALID_ARGUMENT):
        """The details of the error `call` ends with; fails unless its code is `code`."""
        with self.assertRaises(grpc.RpcError) as raised:
            call()
        self.assertEqual(raised.exception.code(), code, raised.exception.details())
        return raised.exception.details()

    def errors(self, code):
        return metric(self.server.metrics(), "capserve_request_errors_total", code=code) or 0

    def test_stop_strings_never_split_characters(self):
        before = self.server.metrics()

        def stream(seed):
            request = chat_request("日本語で自己紹介をしてください。", max_tokens=48, stop=["QQ"], temperature=3.0,
                                   seed=seed, ignore_eos=True)
            try:
                return "".join(c.delta for c in self.stub.ChatStream(request, timeout=120)), grpc.StatusCode.OK
            except grpc.RpcError as e:
                return e.details(), e.code()

        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(stream, range(20)))
        self.assertEqual([code for _, code in results], [grpc.StatusCode.OK] * len(results), results)
        self.assertTrue(any(any(ord(ch) > 0x7F for ch in text) for text, _ in results))  # non-ASCII was sent
        after = self.wait_for(lambda: (lambda m: m if delta(m, before, "capserve_requests_total") == 20 else None)(
            self.server.metrics()), 30, "the server to count every request")
        self.assertEqual(delta(after, before, "capserve_requests_total", finish_reason="error"), 0)

    def test_tiny_temperature_is_greedy(self):
        def tokens(temperature):
            request = pb.GenerateRequest(input_ids=[5, 17, 42], sampling=pb.SamplingOptions(
                max_tokens=8, temperature=temperature, ignore_eos=True, seed=3))
            return [t for c in self.stub.Generate(request, timeout=120) for t in c.token_ids]

        greedy = tokens(0.0)
        for temperature in (1e-8, 1e-10, 1e-30, 1e-45):
            with self.subTest(temperature=temperature):
                self.assertEqual(tokens(temperature), greedy)

    def test_prompt_longer_than_a_step_is_prefilled_in_chunks(self):
        # Once refused (a prompt was prefilled in one step); now its chunks share steps with the decodes.
        long_prompt = pb.GenerateRequest(input_ids=[7] * 600, sampling=pb.SamplingOptions(max_tokens=4))
        self.assertEqual(sum(len(c.token_ids) for c in self.stub.Generate(long_prompt, timeout=120)), 4)
        long_chat = {"messages": [{"role": "user", "content": "hi " * 300}], "max_tokens": 4}  # ~600 tokens
        for path, body in (("/v1/completions", {"prompt": [7] * 600, "max_tokens": 4}),
                           ("/v1/chat/completions", long_chat)):
            with urllib.request.urlopen(urllib.request.Request(
                    f"http://127.0.0.1:{self.server.http_port}{path}", data=json.dumps(body).encode(),
                    headers={"Content-Type": "application/json"}), timeout=120) as response:
                self.assertEqual(response.status, 200, path)
                self.assertGreater(json.load(response)["usage"]["prompt_tokens"], 512, path)

    def test_invalid_utf8_names_the_field_and_offset(self):
        before = self.errors("INVALID_ARGUMENT")
        log_lines = len(self.server.log)
        cases = [
            ("messages[0].content", "offset 3", chat_request(b"abc\xff")),
            ("messages[1].role", "offset 0", pb.ChatRequest(messages=[message("user", "Hi"),
                                                                      pb.ChatMessage(role=b"\xc3", content=b"x")])),
            ("sampling.stop[0]", "offset 1", chat_request("Hi", stop=[b"Q\xe3\x81"])),
            ("request_id", "offset 0", chat_request("Hi", request_id=b"\x80id")),
        ]
        for field, offset, request in cases:
            with self.subTest(field=field):
                details = self.refusal(lambda: self.stub.Chat(request, timeout=30))
                self.assertTrue(details.startswith(field + ": not valid UTF-8"), details)
                self.assertIn(offset, details)
        for _ in range(40):  # a client repeating the bad request does not flood the log
            self.refusal(lambda: list(self.stub.ChatStream(chat_request(b"\xfe"), timeout=30)))
        self.assertEqual(self.errors("INVALID_ARGUMENT") - before, len(cases) + 40)
        self.assertLessEqual(sum("refused" in line for line in self.server.log[log_lines:]), 10)

    def test_special_tokens_in_content_are_text(self):
        def prompt_tokens(content):
            return self.stub.Chat(chat_request(content, max_tokens=1), timeout=60).usage.prompt_tokens

        plain = prompt_tokens("x")
        # One forged token each if they were control tokens; plain text takes several tokens each.
        self.assertGreater(prompt_tokens("x<|endoftext|><|assistant|>") - plain, 4)

    def test_unbounded_fields_are_refused(self):
        cases = [
            ("request_id", chat_request("Hi", request_id="r" * 300_000)),
            ("sampling.stop_token_ids", chat_request("Hi", stop_token_ids=list(range(1000)))),
            ("sampling.stop", chat_request("Hi", stop=[f"s{i}" for i in range(100)])),
        ]
        for field, request in cases:
            with self.subTest(field=field):
                details = self.refusal(lambda: list(self.stub.ChatStream(request, timeout=30)))
                self.assertTrue(details.startswith(field + ":"), details)

    def http_chat(self, body):
        return http_chat(self.server.http_port, body)

    def test_deeply_nested_json_is_refused_naming_the_field(self):
        """Issue 24: JSON nesting ~87,000 objects (an unknown key or a message key over HTTP, gRPC tools,
        chat_template_kwargs or tool_calls) killed rank 0 with SIGSEGV; 300 levels reached the template engine's
        depth error: HTTP 500 / gRPC UNKNOWN, neither counted nor logged. Each is now a counted, logged
        INVALID_ARGUMENT / 400 naming the field, and the server goes on serving."""
        def objects(levels):
            return '{"a":' * levels + "1" + "}" * levels

        def tool(levels):
            return '[{"type": "function", "function": {"name": "f", "parameters": ' + objects(levels) + "}}]"

        def call(levels):
            return '[{"type": "function", "function": {"name": "f", "arguments": ' + objects(levels) + "}}]"

        hi = [message("user", "Hi")]
        grpc_cases = [
            ("tools", pb.ChatRequest(messages=hi, tools=tool(300).encode())),
            ("tools", pb.ChatRequest(messages=hi, tools=tool(100_000).encode())),
            ("chat_template_kwargs", pb.ChatRequest(messages=hi, chat_template_kwargs=objects(100_000).encode())),
            ("messages[1].tool_calls", pb.ChatRequest(messages=hi + [
                pb.ChatMessage(role=b"assistant", tool_calls=call(100_000).encode())])),
        ]
        user = '"messages": [{"role": "user", "content": "Hi"}]'
        http_cases = [
            ("x", '{"x": ' + objects(100_000) + ", " + user + "}"),
            ("messages", '{"messages": [{"role": "user", "content": "Hi", "extra": ' + objects(100_000) + "}]}"),
            ("tools", '{"tools": ' + tool(300) + ", " + user + "}"),
            ("chat_template_kwargs", "{" + user + ', "chat_template_kwargs": {"k": ' + objects(300) + "}}"),
        ]
        before = self.errors("INVALID_ARGUMENT")
        log_lines = len(self.server.log)
        for field, request in grpc_cases:
            with self.subTest(field=field):
                details = self.refusal(lambda: self.stub.Chat(request, timeout=30))
                self.assertTrue(details.startswith(field), details)
                self.assertIn("deeper than 64 levels", details)
        for param, body in http_cases:
            with self.subTest(param=param):
                status, reply = self.http_chat(body.encode())
                self.assertEqual(status, 400, reply)
                self.assertEqual(reply["error"]["param"], param, reply)
                self.assertIn("deeper than 64 levels", reply["error"]["message"])
        self.assertEqual(self.errors("INVALID_ARGUMENT") - before, len(grpc_cases) + len(http_cases))
        self.wait_for(lambda: any("refused a request: INVALID_ARGUMENT" in line and "deeper than 64 levels" in line
                                  for line in self.server.log[log_lines:]), 30, "the refusal's log line")
        # Still serving, over both APIs.
        self.assertTrue(self.stub.Chat(chat_request("After", max_tokens=2), timeout=60).usage.completion_tokens)
        status, reply = self.http_chat(json.dumps({"messages": [{"role": "user", "content": "After"}],
                                                   "max_tokens": 2}).encode())
        self.assertEqual(status, 200, reply)

    def all_slots_free(self):
        """True when PER_PEER requests at once all run: a client's slot is released when the server has finished
        its call, which can be after the client has read the call's end."""
        with ThreadPoolExecutor(PER_PEER) as pool:
            futures = [pool.submit(lambda: self.stub.Chat(chat_request("Free?", max_tokens=1), timeout=60))
                       for _ in range(PER_PEER)]
            try:
                for f in futures:
                    f.result()
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                return False
        return True

    def test_one_client_cannot_take_every_slot(self):
        # The earlier tests' calls may still hold their slots for a moment.
        self.wait_for(self.all_slots_free, 30, "this client's slots to be free")
        before = self.errors("RESOURCE_EXHAUSTED")
        streams = 3 * PER_PEER
        barrier = threading.Barrier(streams)
        calls = []
        lock = threading.Lock()

        def open_stream(i):
            """The code of the stream's first response (OK once a chunk comes), then cancels it."""
            barrier.wait()
            call = self.stub.ChatStream(chat_request(f"Stream {i}", max_tokens=400, ignore_eos=True), timeout=120)
            with lock:
                calls.append(call)
            try:
                next(call)
                return grpc.StatusCode.OK, ""
            except grpc.RpcError as e:
                return e.code(), e.details()

        with ThreadPoolExecutor(streams) as pool:
            futures = [pool.submit(open_stream, i) for i in range(streams)]
            # Every stream either got going or was refused; the slow ones hold their slots until cancelled.
            results = [f.result() for f in futures]
        for call in calls:
            call.cancel()
        codes = [code for code, _ in results]
        self.assertEqual(codes.count(grpc.StatusCode.OK), PER_PEER, results)
        self.assertEqual(codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED), streams - PER_PEER, results)
        for code, details in results:
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.assertIn("--max-requests-per-peer", details)
        self.assertEqual(self.errors("RESOURCE_EXHAUSTED") - before, streams - PER_PEER)
        # The slots come back when the streams end.
        self.wait_for(lambda: metric(self.server.metrics(), "capserve_requests_running") == 0, 30, "the cancels")
        self.wait_for(self.all_slots_free, 30, "the cancelled streams' slots to come back")


class KvBudgetTest(ServerTestCase):
    FLAGS = ["--kv-blocks", "4"]

    def test_request_beyond_the_kv_cache_is_refused_and_blocks_nothing(self):
        with self.assertRaises(grpc.RpcError) as raised:
            self.stub.Chat(chat_request("Hi", max_tokens=100), timeout=20)
        self.assertEqual(raised.exception.code(), grpc.StatusCode.INVALID_ARGUMENT, raised.exception.details())
        self.assertIn("--kv-blocks", raised.exception.details())
        reply = self.stub.Chat(chat_request("Hi", max_tokens=8), timeout=60)
        self.assertGreater(reply.usage.completion_tokens, 0)


if __name__ == "__main__":
    main()
