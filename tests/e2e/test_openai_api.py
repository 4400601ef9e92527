"""The OpenAI-compatible HTTP API on one server (2 ranks), driven by the official `openai` Python client (installed
into an ignored venv by tests/e2e/openai_python.sh) and by raw sockets: chat and completions, whole and streamed,
greedy outputs equal to the gRPC API's, OpenAI-shaped errors for bad input, request ids, a disconnect mid-stream
that frees its sequence, hostile clients on the HTTP port, and many concurrent SSE streams on a bounded number of
threads. CAPSERVE_E2E_STREAMS / CAPSERVE_E2E_STREAM_SECONDS size the last one (default 200 streams for 20 s)."""

import json
import os
import re
import socket
import subprocess
import threading
import time
import unittest
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from capserve_e2e import ServerTestCase, chat_request, delta, main, metric, pb
from test_hostile_clients import MALFORMED_HTTP, connect, exchange, status


def _load_openai():
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "openai_python.sh")
    done = subprocess.run(["bash", script], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return None, "the openai client could not be installed (is PyPI reachable?): " + done.stderr[-400:]
    import sys
    sys.path.insert(0, done.stdout.strip())
    import openai
    return openai, None


openai, OPENAI_MISSING = _load_openai()

LONG = 900  # max_tokens of a request meant to be cut short (the model's context is 1024)


def http(port, method, path, body=None, headers=None, timeout=60):
    """(status, headers, parsed JSON or text) of one HTTP request."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status_code, hdrs, raw = r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        status_code, hdrs, raw = e.code, e.headers, e.read()
    try:
        return status_code, hdrs, json.loads(raw)
    except ValueError:
        return status_code, hdrs, raw.decode(errors="replace")


def sse_request(port, body, request_id=None):
    """A streaming POST on a raw socket; returns the connected socket after the request is sent."""
    s = connect(port)
    payload = json.dumps(body).encode()
    extra = f"X-Request-Id: {request_id}\r\n" if request_id else ""
    s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra}"
              f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return s


def read_sse(sock, timeout=120):
    """Every `data:` payload of a chunked SSE response until the server closes the connection."""
    sock.settimeout(timeout)
    raw = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    # De-chunk.
    text = b""
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        text += rest[:size]
        body = rest[size + 2:]
    return head.decode(), [line[6:] for line in text.decode().split("\n") if line.startswith("data: ")]


@unittest.skipIf(openai is None, OPENAI_MISSING)
class OpenAiApiTest(ServerTestCase):
    # Every stream of the concurrency test comes from this one address, beyond the default per-address cap (64).
    FLAGS = ["--max-connections-per-peer", "255"]

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.port = cls.server.http_port
        cls.client = openai.OpenAI(base_url=f"http://127.0.0.1:{cls.port}/v1", api_key="unused", max_retries=0,
                                   timeout=120)
        cls.model = cls.server.model_id

    def _idle_metrics(self):
        return self.wait_for(lambda: (lambda m: m if metric(m, "capserve_requests_running") == 0 else None)(
            self.server.metrics()), 30, "the server to run no request")

    def test_models_health_version_metrics(self):
        self.assertEqual([m.id for m in self.client.models.list().data], [self.model])
        code, _, body = http(self.port, "GET", "/health")
        self.assertEqual((code, body), (200, {"status": "ok"}))
        code, _, body = http(self.port, "GET", "/version")
        self.assertEqual(code, 200)
        self.assertTrue(body["version"])
        code, _, text = http(self.port, "GET", "/metrics")
        self.assertEqual(code, 200)
        self.assertIn("capserve_requests_total", text)

    def test_chat_equals_grpc_whole_and_streamed(self):
        grpc_reply = self.stub.Chat(chat_request("Hello there", max_tokens=24), timeout=120)
        r = self.client.chat.completions.create(model=self.model, messages=[{"role": "user", "content": "Hello there"}],
                                                max_tokens=24, temperature=0)
        self.assertEqual(r.choices[0].message.content, grpc_reply.text)
        self.assertEqual(r.choices[0].message.role, "assistant")
        self.assertEqual(r.object, "chat.completion")
        self.assertRegex(r.id, r"^chatcmpl-[0-9a-f]{24}$")
        self.assertEqual(r.usage.prompt_tokens, grpc_reply.usage.prompt_tokens)
        self.assertEqual(r.usage.completion_tokens, grpc_reply.usage.completion_tokens)
        self.assertEqual(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens)
        self.assertEqual(r.choices[0].finish_reason,
                         "stop" if grpc_reply.finish_reason == pb.FINISH_REASON_STOP else "length")
        moe = r.model_extra["moe"]
        self.assertEqual(moe["assignments"], grpc_reply.moe.assignments)

        chunks = list(self.client.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": "Hello there"}], max_completion_tokens=24,
            temperature=0, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        self.assertEqual(text, grpc_reply.text)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        self.assertEqual(finishes, [r.choices[0].finish_reason])
        self.assertEqual(chunks[-1].choices, [])
        self.assertEqual(chunks[-1].usage.completion_tokens, r.usage.completion_tokens)
        self.assertEqual(len({c.id for c in chunks}), 1)

    def test_completions_prompts_and_n(self):
        r = self.client.completions.create(model=self.model, prompt="Once upon a time", max_tokens=12,
                                           temperature=0)
        self.assertEqual(r.object, "text_completion")
        self.assertRegex(r.id, r"^cmpl-[0-9a-f]{24}$")
        text = r.choices[0].text
        streamed = "".join(c.choices[0].text for c in self.client.completions.create(
            model=self.model, prompt="Once upon a time", max_tokens=12, temperature=0, stream=True) if c.choices)
        self.assertEqual(streamed, text)
        # Token ids, as the gRPC Generate API takes them: the same number of tokens come back.
        ids = [11, 12, 13, 14, 15]
        tokens = [t for c in self.stub.Generate(pb.GenerateRequest(input_ids=ids, sampling=pb.SamplingOptions(
            max_tokens=10, ignore_eos=True)), timeout=120) for t in c.token_ids]
        r = self.client.completions.create(model=self.model, prompt=ids, max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
        self.assertEqual(r.usage.completion_tokens, len(tokens))
        self.assertEqual(r.usage.prompt_tokens, len(ids))
        # A list of prompts (strings and token lists), n choices each; greedy choices of one prompt agree.
        r = self.client.completions.create(model=self.model, prompt=[[11, 12, 13], [21, 22]], max_tokens=6,
                                           temperature=0, n=2)
        self.assertEqual([c.index for c in r.choices], [0, 1, 2, 3])
        self.assertEqual(r.choices[0].text, r.choices[1].text)
        self.assertEqual(r.choices[2].text, r.choices[3].text)
        self.assertEqual(r.usage.prompt_tokens, 5)
        r = self.client.completions.create(model=self.model, prompt=["Hello", "World"], max_tokens=4, temperature=0)
        self.assertEqual(len(r.choices), 2)
        # Sampling with a seed repeats; top_k (a vLLM extension) and stop are accepted.
        kw = dict(model=self.model, prompt="The", max_tokens=8, temperature=0.9, top_p=0.9, seed=7,
                  extra_body={"top_k": 20})
        self.assertEqual(self.client.completions.create(**kw).choices[0].text,
                         self.client.completions.create(**kw).choices[0].text)
        self.client.completions.create(model=self.model, prompt="The", max_tokens=8, stop=["\n", "."])

    def test_logprobs_equal_grpc(self):
        """Chat logprobs (whole and streamed) and completions' echo + logprobs (lm-eval's log-likelihood call)
        carry the same values as the gRPC API's entries for the same greedy request."""
        grpc_reply = self.stub.Chat(chat_request("Tell me", max_tokens=8, logprobs=True, top_logprobs=3),
                                    timeout=120)
        want = [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in grpc_reply.logprobs]
        self.assertEqual(len(want), grpc_reply.usage.completion_tokens - (grpc_reply.finish_reason ==
                                                                          pb.FINISH_REASON_STOP))
        kw = dict(model=self.model, messages=[{"role": "user", "content": "Tell me"}], max_tokens=8, temperature=0,
                  logprobs=True, top_logprobs=3)
        r = self.client.chat.completions.create(**kw)
        got = [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
               for e in r.choices[0].logprobs.content]
        self.assertEqual(got, want)
        for token, logprob, top in got:
            self.assertEqual((token, logprob), top[0], "greedy: the chosen token is the most likely")
            self.assertEqual([lp for _, lp in top], sorted((lp for _, lp in top), reverse=True))
            self.assertEqual(bytes(next(e for e in r.choices[0].logprobs.content if e.token == token).bytes),
                             token.encode())
        streamed = [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
                    for c in self.client.chat.completions.create(**kw, stream=True)
                    if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        self.assertEqual(streamed, want)

        ids = [11, 12, 13, 14, 15, 16]
        chunks = list(self.stub.Generate(pb.GenerateRequest(input_ids=ids, sampling=pb.SamplingOptions(
            max_tokens=1, ignore_eos=True, logprobs=True, prompt_logprobs=True, top_logprobs=1)), timeout=120))
        prompt_entries = [e for c in chunks for e in c.prompt_logprobs]
        generated = [e for c in chunks for e in c.logprobs]
        r = self.client.completions.create(model=self.model, prompt=ids, max_tokens=1, temperature=0, logprobs=1,
                                           echo=True, extra_body={"ignore_eos": True})
        lp = r.choices[0].logprobs
        self.assertEqual(len(lp.tokens), len(ids) + 1)
        self.assertIsNone(lp.token_logprobs[0])
        self.assertIsNone(lp.top_logprobs[0])
        self.assertEqual(lp.token_logprobs[1:], [e.logprob for e in prompt_entries + generated])
        self.assertEqual([len(t) for t in lp.top_logprobs[1:]], [1] * len(ids))
        self.assertEqual(lp.text_offset, [sum(len(t.encode()) for t in lp.tokens[:i]) for i in range(len(lp.tokens))])
        # Without echo: only the generated token's entry, and no prompt in the text (the prefill then computes
        # only the last row's logits, in a GEMM of another shape: equal up to float rounding).
        r = self.client.completions.create(model=self.model, prompt=ids, max_tokens=1, temperature=0, logprobs=0,
                                           extra_body={"ignore_eos": True})
        self.assertEqual(len(r.choices[0].logprobs.token_logprobs), 1)
        self.assertAlmostEqual(r.choices[0].logprobs.token_logprobs[0], generated[0].logprob, delta=1e-5)
        self.assertEqual(r.choices[0].logprobs.top_logprobs, [{}])

    def test_request_id_header(self):
        code, headers, body = http(self.port, "POST", "/v1/chat/completions",
                                   {"model": self.model, "messages": [{"role": "user", "content": "Hi"}],
                                    "max_tokens": 2}, headers={"X-Request-Id": "client-42"})
        self.assertEqual(code, 200, body)
        self.assertEqual(body["id"], "client-42")
        self.assertEqual(headers["X-Request-Id"], "client-42")
        code, headers, body = http(self.port, "POST", "/v1/completions",
                                   {"model": self.model, "prompt": "Hi", "max_tokens": 2})
        self.assertEqual(headers["X-Request-Id"], body["id"])
        ids = {http(self.port, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1})[2]["id"]
               for _ in range(3)}
        self.assertEqual(len(ids), 3)

    def test_errors_are_openai_shaped(self):
        chat = {"model": self.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        cases = [
            ("temperature", 400, "/v1/chat/completions", {**chat, "temperature": -1}),
            ("temperature", 400, "/v1/chat/completions", {**chat, "temperature": "hot"}),
            ("top_p", 400, "/v1/chat/completions", {**chat, "top_p": 2}),
            ("max_tokens", 400, "/v1/chat/completions", {**chat, "max_tokens": 100000}),
            ("max_tokens", 400, "/v1/chat/completions", {**chat, "max_tokens": 0}),
            ("n", 400, "/v1/chat/completions", {**chat, "n": 0}),
            ("stop", 400, "/v1/chat/completions", {**chat, "stop": 5}),
            ("stream_options", 400, "/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}}),
            ("messages", 400, "/v1/chat/completions", {**chat, "messages": []}),
            ("messages[0].role", 400, "/v1/chat/completions", {**chat, "messages": [{"role": "robot",
                                                                                     "content": "x"}]}),
            ("messages", 400, "/v1/chat/completions", {**chat, "messages": "Hi"}),
            ("messages", 400, "/v1/chat/completions", {**chat, "messages": [{"role": "user",
                                                                             "content": "hi " * 3000}]}),
            ("top_logprobs", 400, "/v1/chat/completions", {**chat, "top_logprobs": 2}),
            ("top_logprobs", 400, "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}),
            ("echo", 400, "/v1/chat/completions", {**chat, "echo": True}),
            ("logprobs", 400, "/v1/completions", {"prompt": "Hi", "logprobs": 21}),
            ("logprobs", 400, "/v1/completions", {"prompt": "Hi", "logprobs": True}),
            ("frequency_penalty", 400, "/v1/completions", {"prompt": "Hi", "frequency_penalty": 2.5}),
            ("prompt", 400, "/v1/completions", {"prompt": [1, 10**9]}),
            ("prompt", 400, "/v1/completions", {"prompt": [[1], "x", {}]}),
            ("prompt", 400, "/v1/completions", {}),
            ("model", 404, "/v1/chat/completions", {**chat, "model": "no-such-model"}),
            (None, 400, "/v1/chat/completions", b"{not json"),
            (None, 400, "/v1/chat/completions", b"[1, 2]"),
            (None, 404, "/v1/nothing", chat),
        ]
        for param, code, path, body in cases:
            with self.subTest(param=param, path=path, body=str(body)[:60]):
                got, _, answer = http(self.port, "POST", path, body)
                self.assertEqual(got, code, answer)
                error = answer["error"]
                self.assertEqual(set(error), {"message", "type", "param", "code"})
                self.assertTrue(error["message"])
                if param is not None:
                    self.assertEqual(error["param"], param, error)
        got, headers, answer = http(self.port, "GET", "/v1/chat/completions")
        self.assertEqual(got, 405)
        self.assertIn("error", answer)
        got, _, answer = http(self.port, "POST", "/v1/completions", {"prompt": "x"},
                              headers={"X-Request-Id": "bad id with spaces"})
        self.assertEqual(got, 400)
        self.assertEqual(answer["error"]["param"], "X-Request-Id")
        got, _, answer = http(self.port, "POST", "/v1/completions", b"{" + b" " * (5 << 20) + b"}")
        self.assertEqual(got, 413)
        self.assertIn("error", answer)
        # The client's typed exceptions follow from the statuses.
        with self.assertRaises(openai.BadRequestError) as raised:
            self.client.chat.completions.create(model=self.model, messages=[{"role": "user", "content": "x"}],
                                                top_logprobs=3)
        self.assertIn("top_logprobs", str(raised.exception))
        with self.assertRaises(openai.NotFoundError):
            self.client.completions.create(model="nope", prompt="x")

    def test_disconnect_mid_stream_frees_the_sequence(self):
        before = self._idle_metrics()
        s = sse_request(self.port, {"model": self.model, "messages": [{"role": "user", "content": "A long story"}],
                                    "max_tokens": LONG, "ignore_eos": True, "stream": True})
        s.settimeout(60)
        got = b""
        while got.count(b"data: ") < 3:
            got += s.recv(4096)
        self.assertTrue(got.startswith(b"HTTP/1.1 200"), got[:200])
        self.assertIn(b"text/event-stream", got)
        s.close()
        after = self._idle_metrics()
        self.assertEqual(delta(after, before, "capserve_requests_total", finish_reason="cancelled"), 1)
        self.assertLess(delta(after, before, "capserve_generation_tokens_total"), LONG / 2)

    def test_hostile_clients_on_the_http_port(self):
        port = self.port
        slow = [connect(port) for _ in range(4)]
        for s in slow:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")
        for request, expected in MALFORMED_HTTP:
            with self.subTest(request=request[:40]):
                self.assertEqual(status(exchange(port, request)), expected)
        # A body declared larger than the limit is refused before it is read; garbage gets a 400.
        self.assertEqual(status(exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                               b"Content-Length: 100000000\r\n\r\n" + b"x" * 65536)), 413)
        self.assertEqual(status(exchange(port, os.urandom(2048).replace(b"\n", b"_"))), 400)
        r = self.client.chat.completions.create(model=self.model, messages=[{"role": "user", "content": "still?"}],
                                                max_tokens=4)
        self.assertEqual(r.usage.completion_tokens, 4)
        for s in slow:  # cut at the read deadline (10 s) instead of being held forever
            s.settimeout(20)
            try:
                self.assertEqual(s.recv(4096), b"")
            except ConnectionResetError:
                pass
            s.close()
        for pid in self.server.ranks.values():
            self.assertTrue(os.path.exists(f"/proc/{pid}"))

    def test_many_concurrent_streams_on_bounded_threads(self):
        streams = int(os.environ.get("CAPSERVE_E2E_STREAMS", "200"))
        seconds = float(os.environ.get("CAPSERVE_E2E_STREAM_SECONDS", "20"))
        pid = self.server.ranks[0]

        def threads():
            return len(os.listdir(f"/proc/{pid}/task"))

        before = self._idle_metrics()
        baseline = threads()
        peak = [baseline]
        stop = threading.Event()

        def sample():
            while not stop.wait(0.2) and self.server.proc.poll() is None:
                peak[0] = max(peak[0], threads())

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        deadline = time.monotonic() + seconds

        def client(i):
            outcomes = []
            while time.monotonic() < deadline:
                s = sse_request(self.port, {"model": self.model, "max_tokens": 16, "stream": True,
                                            "messages": [{"role": "user", "content": f"stream {i}"}]})
                with s:
                    head, data = read_sse(s, timeout=300)
                if not head.startswith("HTTP/1.1 200") or data[-1:] != ["[DONE]"]:
                    outcomes.append(("bad", head[:40], data[-2:]))
                    continue
                finishes = [c["choices"][0]["finish_reason"] for c in map(json.loads, data[:-1])
                            if c["choices"] and c["choices"][0]["finish_reason"]]
                outcomes.append(("ok",) if len(finishes) == 1 else ("finishes", finishes))
            return outcomes

        with ThreadPoolExecutor(streams) as pool:
            results = [o for r in pool.map(client, range(streams)) for o in r]
        stop.set()
        sampler.join()
        after = self._idle_metrics()
        bad = [r for r in results if r != ("ok",)]
        finished = delta(after, before, "capserve_requests_total")
        print(f"e2e: {streams} concurrent SSE streams for {seconds:.0f} s: {len(results)} requests, "
              f"{len(results) - len(bad)} ended with exactly one finish_reason and [DONE]; the server counted "
              f"{finished:.0f}; rank 0 threads: {baseline} idle, {peak[0]} at most", flush=True)
        self.assertEqual(bad, [])
        self.assertEqual(finished, len(results))
        self.assertGreaterEqual(len(results), streams)
        self.assertLessEqual(peak[0], baseline + 4)


if __name__ == "__main__":
    main()
