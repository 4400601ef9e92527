"""Hostile clients against one running server: malformed and probing HTTP requests, idle and slowloris sockets on
the metrics port, garbage on the gRPC port. Afterwards every rank is alive, a normal chat succeeds, and /metrics
answers within 1 s while the slow sockets are still open. (Before the hardening issue one `GET /` on the metrics
port killed rank 0 with SIGSEGV inside civetweb, and two idle sockets blocked /metrics for 30 s.)"""

import os
import socket
import time

from capserve_e2e import ServerTestCase, chat_request, main

# (request bytes, expected HTTP status). Each one crashed, confused or bypassed the civetweb exposer.
MALFORMED_HTTP = [
    (b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 404),
    (b"GET /favicon.ico HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 404),
    (b"GET /healthz HTTP/1.0\r\n\r\n", 404),
    (b"GET /../../etc/passwd HTTP/1.0\r\n\r\n", 404),
    (b"GET /metrics/ HTTP/1.0\r\n\r\n", 404),
    (b"GET /metricsX HTTP/1.0\r\n\r\n", 404),
    (b"GET /%2e%2e/%2e%2e/etc/passwd HTTP/1.0\r\n\r\n", 404),
    (b"OPTIONS * HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 404),
    (b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello", 405),
    (b"PUT /metrics HTTP/1.0\r\nContent-Length: 0\r\n\r\n", 405),
    (b"DELETE /metrics HTTP/1.0\r\n\r\n", 405),
    (b"PATCH /metrics HTTP/1.0\r\n\r\n", 405),
    (b"GET /metrics HTTP/1.0\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n", 431),
    (b"POST /metrics HTTP/1.0\r\nContent-Length: 10000000\r\n\r\n" + b"b" * 100000, 413),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", 400),
    (b"POST /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 405),  # refused on its head
    (b"GET /metrics HTTP/1.1\r\nBad Header: x\r\n\r\n", 400),
    (b"GET /metrics HTTP/9\r\n\r\n", 400),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 a TLS client hello", 400),
    (b"G\x00T /metrics HTTP/1.0\r\n\r\n", 400),
    (b"\r\n\r\n\r\n", 400),
    (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400),
]

HEAD = (b"HEAD /metrics HTTP/1.0\r\n\r\n", 200)


def connect(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.settimeout(10)
    return s


def exchange(port, request):
    """Sends `request`, returns everything the server answers until it closes the connection."""
    with connect(port) as s:
        try:
            s.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may answer and close before reading an oversized request to its end
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += chunk
        return out


def status(response):
    return int(response[9:12]) if response.startswith(b"HTTP/1.") else None


class HostileClientsTest(ServerTestCase):
    def assert_alive(self):
        for rank, pid in self.server.ranks.items():
            self.assertTrue(os.path.exists(f"/proc/{pid}"), f"rank {rank} (pid {pid}) died")
        self.assertIsNone(self.server.proc.poll(), "the job exited")

    def test_hostile_http_and_grpc_clients(self):
        port = self.server.metrics_port
        for request, expected in MALFORMED_HTTP + [HEAD]:
            with self.subTest(request=request[:40]):
                response = exchange(port, request)
                self.assertEqual(status(response), expected, response[:200])
        self.assert_alive()

        # Idle and slowloris sockets on the metrics port, garbage and idle sockets on the gRPC port.
        slow = [connect(port) for _ in range(4)]
        for s in slow:
            s.sendall(b"GET /metrics HTTP/1.1\r\n")
        idle = [connect(port) for _ in range(4)] + [connect(self.server.port) for _ in range(4)]
        for garbage in [os.urandom(4096), b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" +
                        b"\x00\x00\x04\x08\x00\x00\x00\x00\x00\xff\xff\xff\xff", b"\x16\x03\x01\x00\xff" * 100]:
            with connect(self.server.port) as g:
                g.sendall(garbage)
                g.settimeout(5)
                try:
                    g.recv(4096)
                except (socket.timeout, ConnectionResetError):
                    pass
        time.sleep(1)
        for s in slow:
            s.sendall(b"X-Slow: 1\r\n")  # one more header line: still not a complete request

        start = time.monotonic()
        text = self.server.metrics_text()
        elapsed = time.monotonic() - start
        print(f"e2e: /metrics answered in {elapsed * 1000:.1f} ms with {len(slow)} slowloris and {len(idle)} idle "
              "sockets open", flush=True)
        self.assertLess(elapsed, 1.0)
        self.assertIn("capserve_requests_total", text)

        reply = self.stub.Chat(chat_request("Hello after the attack", max_tokens=8), timeout=60)
        self.assertEqual(reply.usage.completion_tokens, 8)
        self.assertEqual(self.server.health(), "SERVING")
        self.assert_alive()

        # The slow sockets are cut at the read deadline instead of being held forever.
        for s in slow:
            s.settimeout(15)
            try:
                self.assertEqual(s.recv(4096), b"")
            except ConnectionResetError:
                pass
            s.close()
        for s in idle:
            s.close()


if __name__ == "__main__":
    main()
