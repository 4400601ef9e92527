"""The HTTP API's front end under hostile clients (issue 24): slow chat-template renders run on workers, not on the
I/O threads, so /health answers meanwhile, and a render whose client left (or a SIGTERM) is cancelled; `n` takes
n in-flight slots of its address; request framing other than a final `chunked` is refused (no smuggling); curl's
`Expect: 100-continue` is answered at once; HTTP/1.0 streams come unframed; connections per address are capped.

The chat template (written here, passed with --chat-template) renders normally unless the request's
chat_template_kwargs carry `spin`: then it loops `spin` times building a 10 MB string (seconds of work); the server's
work budget for a render (--chat-template-max-steps) is raised so far that only a cancellation ends such a render."""

import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import tempfile
import time
import unittest

from capserve_e2e import Server, ServerTestCase, main, metric

TEMPLATE = ("{% if spin is defined %}{% for i in range(spin) %}{% set x = 'a' * 10000000 %}{% endfor %}{% endif %}"
            "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PER_PEER = 8
CONNECTIONS_PER_PEER = 16  # above the slow POSTs and /health probes of one test at once
UNBOUNDED_RENDERS = ["--chat-template-max-steps", str(10**15)]


def write_template():
    fd, path = tempfile.mkstemp(suffix=".jinja")
    with os.fdopen(fd, "w") as f:
        f.write(TEMPLATE)
    return path


def slow_chat(spin):
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "chat_template_kwargs": {"spin": spin}}


def send_post(port, path, body, version="HTTP/1.1", extra=""):
    """A POST on a raw socket; returns the socket once the request is sent."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    payload = json.dumps(body).encode()
    s.sendall(f"POST {path} {version}\r\nHost: x\r\nContent-Type: application/json\r\n{extra}"
              f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return s


def read_all(s):
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except (ConnectionResetError, socket.timeout):
            break
        if not chunk:
            break
        out += chunk
    return out


def get(port, path, timeout=30):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def post(port, path, body, timeout=120):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"null")
    finally:
        conn.close()


def cpu_seconds(pid):
    """User and system CPU time a process has used."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cancelled(server):
    return metric(server.metrics(), "capserve_requests_total", finish_reason="cancelled") or 0


class HttpFrontendTest(ServerTestCase):
    TEMPLATE_PATH = write_template()
    FLAGS = ["--chat-template", TEMPLATE_PATH, *UNBOUNDED_RENDERS, "--max-requests-per-peer", str(PER_PEER),
             "--max-connections-per-peer", str(CONNECTIONS_PER_PEER)]

    def test_health_answers_while_slow_renders_run_and_leaving_cancels_them(self):
        port = self.server.http_port
        before = cancelled(self.server)
        # Four renders of minutes each: two run (one per worker), two wait in the queue.
        slow = [send_post(port, "/v1/chat/completions", slow_chat(100000)) for _ in range(4)]
        latencies = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            start = time.monotonic()
            code, body = get(port, "/health", timeout=30)
            latencies.append(time.monotonic() - start)
            self.assertEqual(code, 200, body)
        p50, worst = statistics.median(latencies), max(latencies)
        print(f"e2e: /health with 4 slow renders in flight: {len(latencies)} probes, p50 {p50 * 1000:.1f} ms, "
              f"max {worst * 1000:.1f} ms", flush=True)
        # The bound is 100 ms; a machine saturated by other work may take longer, never seconds.
        self.assertLess(worst, 1.0)
        # The renders are still running (none answered): the probes ran beside them.
        for s in slow:
            s.setblocking(False)
            with self.assertRaises(BlockingIOError):
                s.recv(1)
        # Their clients leave: the renders stop at once, each counted cancelled, and the workers are free again.
        for s in slow:
            s.close()
        self.wait_for(lambda: cancelled(self.server) - before >= 4, 60,
                      lambda: f"4 cancelled requests (got {cancelled(self.server) - before})")
        start = time.monotonic()
        code, body = post(port, "/v1/chat/completions", slow_chat(0))
        self.assertEqual(code, 200, body)
        self.assertLess(time.monotonic() - start, 60)

    def test_n_takes_a_slot_per_choice(self):
        code, body = post(self.server.http_port, "/v1/completions",
                          {"prompt": [5, 6], "max_tokens": 1, "n": PER_PEER + 1})
        self.assertEqual(code, 429, body)
        self.assertIn("--max-requests-per-peer", body["error"]["message"])
        # n = PER_PEER fits once every slot is free: an earlier test's call may still hold one for a moment (a
        # slot is released when the server has finished the call, which can follow the client's read of its end).
        def all_choices():
            code, body = post(self.server.http_port, "/v1/completions",
                              {"prompt": [5, 6], "max_tokens": 1, "n": PER_PEER})
            return None if code == 429 else (code, body)

        code, body = self.wait_for(all_choices, 30, "this client's slots to be free")
        self.assertEqual(code, 200, body)
        self.assertEqual(len(body["choices"]), PER_PEER)

    def test_framing_other_than_chunked_is_refused_and_nothing_is_smuggled(self):
        smuggled = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        for te in (b"xchunked", b"identity", b"gzip", b"chunked, identity", b"gzip, chunked"):
            with self.subTest(te=te):
                with socket.create_connection(("127.0.0.1", self.server.http_port), timeout=30) as s:
                    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: " + te +
                              b"\r\n\r\n" + smuggled)
                    answer = read_all(s)
                self.assertIn(int(answer[9:12]), (400, 501), answer)
                self.assertEqual(answer.count(b"HTTP/1.1 "), 1, answer)

    def test_curl_gets_100_continue_at_once(self):
        body = json.dumps({"prompt": [5] * 600, "max_tokens": 1})  # over curl's 1 KiB: it sends Expect
        self.assertGreater(len(body), 1024)
        out = subprocess.run(["curl", "-sS", "-v", "-o", "/dev/null", "-w", "%{http_code} %{time_total}",
                              "-H", "Content-Type: application/json", "-H", "Expect: 100-continue",
                              "--data-binary", body,
                              f"http://127.0.0.1:{self.server.http_port}/v1/completions"],
                             capture_output=True, text=True, timeout=120, check=True)
        code, seconds = out.stdout.split()
        print(f"e2e: curl POST of {len(body)} bytes: {code} in {float(seconds) * 1000:.0f} ms", flush=True)
        self.assertEqual(code, "200", out.stderr)
        self.assertIn("HTTP/1.1 100 Continue", out.stderr)

    def test_http10_stream_is_unframed_and_closed(self):
        s = send_post(self.server.http_port, "/v1/completions",
                      {"prompt": [5, 6], "max_tokens": 4, "stream": True}, version="HTTP/1.0")
        with s:
            answer = read_all(s)
        head, _, body = answer.partition(b"\r\n\r\n")
        self.assertTrue(head.startswith(b"HTTP/1.0 200"), head)
        self.assertNotIn(b"transfer-encoding", head.lower())
        events = [e for e in body.split(b"\n\n") if e]
        self.assertTrue(all(e.startswith(b"data: ") for e in events), body)
        self.assertEqual(events[-1], b"data: [DONE]")

    def test_connections_per_address_are_capped(self):
        port = self.server.metrics_port
        idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(CONNECTIONS_PER_PEER)]
        try:
            def refused():
                # Closed at accept: end of stream at once (an accepted one would stay open for the read timeout).
                with socket.create_connection(("127.0.0.1", port), timeout=30) as extra:
                    extra.settimeout(5)
                    try:
                        return extra.recv(1) == b""
                    except ConnectionResetError:
                        return True
                    except socket.timeout:
                        return False
            self.wait_for(refused, 30, "a connection beyond the per-address cap to be closed")
            # Another address of this host is another client.
            other = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=("127.0.0.2", 0))
            with other:
                other.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
                self.assertTrue(read_all(other).startswith(b"HTTP/1.0 200"))
        finally:
            for s in idle:
                s.close()
        self.wait_for(lambda: get(port, "/metrics")[0] == 200, 30, "/metrics once the idle sockets closed")


class SigtermDuringRenderTest(unittest.TestCase):
    """A SIGTERM while a render runs: the job exits at once instead of waiting for the render's end."""

    def test_sigterm_cancels_a_running_render(self):
        server = Server("--chat-template", HttpFrontendTest.TEMPLATE_PATH, *UNBOUNDED_RENDERS)
        self.addCleanup(server.stop)
        server.start()
        rank0 = server.ranks[0]
        spent = cpu_seconds(rank0)
        slow = send_post(server.http_port, "/v1/chat/completions", slow_chat(100000))
        self.addCleanup(slow.close)
        # The render runs: rank 0, idle before, burns CPU.
        deadline = time.monotonic() + 120
        while cpu_seconds(rank0) - spent < 1.0:
            self.assertLess(time.monotonic(), deadline, "the render never started")
            time.sleep(0.05)
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.wait_exit(60)
        print(f"e2e: exit {code} {time.monotonic() - start:.1f} s after SIGTERM during a render", flush=True)
        self.assertEqual(code, 0)
        self.assertLess(time.monotonic() - start, 30)


if __name__ == "__main__":
    main()
