"""TLS, mutual TLS and the API key on one server each (2 ranks), with a CA, server and client certificates made
here by the openssl CLI in a temporary directory: the `openai` client (when it can be installed), raw TLS sockets
and a gRPC secure channel succeed with the key and the CA; without the key they get 401 in OpenAI's shape /
UNAUTHENTICATED, over plain TCP nothing; /health and the metrics port stay open, gRPC reflection is off (it
cannot check the key); a silent TLS client is cut off
by the read deadline; under mTLS a client without a certificate is refused. Start-up refuses unreadable and
mismatched files with a message naming them."""

import atexit
import json
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import unittest

import grpc

from capserve_e2e import Server, ServerTestCase, chat_request, main, pb, pb_grpc, reflection_services
from test_openai_api import OPENAI_MISSING, openai

KEY = "sk-capserve-e2e-0123456789"
CERTS = tempfile.mkdtemp(prefix="capserve-e2e-tls-")
atexit.register(shutil.rmtree, CERTS, ignore_errors=True)


def _path(name):
    return os.path.join(CERTS, name)


def _openssl(*args):
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def _make_certificates():
    """ca.pem signs server.pem (localhost, 127.0.0.1) and client.pem; other.key belongs to neither."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", _path("ca.key"), "-out", _path("ca.pem"), "-days", "2", "-subj",
             "/CN=capserve e2e CA")
    for name, extensions in [("server", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth"),
                             ("client", "extendedKeyUsage=clientAuth")]:
        with open(_path(name + ".ext"), "w") as f:
            f.write(extensions + "\n")
        _openssl("req", *ec, "-keyout", _path(name + ".key"), "-out", _path(name + ".csr"), "-subj", "/CN=" + name)
        _openssl("x509", "-req", "-in", _path(name + ".csr"), "-CA", _path("ca.pem"), "-CAkey", _path("ca.key"),
                 "-CAcreateserial", "-days", "2", "-out", _path(name + ".pem"), "-extfile", _path(name + ".ext"))
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-out", _path("other.key"))
    with open(_path("api.key"), "w") as f:
        f.write(KEY + "\n")


_make_certificates()


def read_file(name):
    with open(_path(name), "rb") as f:
        return f.read()


def client_context(certificate=True):
    """Trusts the test CA; with `certificate`, presents client.pem (for mTLS)."""
    context = ssl.create_default_context(cafile=_path("ca.pem"))
    if certificate:
        context.load_cert_chain(_path("client.pem"), _path("client.key"))
    return context


def grpc_credentials(certificate=False):
    if certificate:
        return grpc.ssl_channel_credentials(read_file("ca.pem"), read_file("client.key"), read_file("client.pem"))
    return grpc.ssl_channel_credentials(read_file("ca.pem"))


def https(port, method, path, body=None, key=None, context=None):
    """(status, headers dict with lower-case names, parsed JSON or text) over a raw TLS socket."""
    payload = json.dumps(body).encode() if body is not None else b""
    auth = f"Authorization: Bearer {key}\r\n" if key is not None else ""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
        with (context or client_context(False)).wrap_socket(raw, server_hostname="localhost") as s:
            s.sendall(f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n{auth}"
                      f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
    head, _, body_bytes = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    try:
        return int(lines[0][9:12]), headers, json.loads(body_bytes)
    except ValueError:
        return int(lines[0][9:12]), headers, body_bytes.decode(errors="replace")


def plain_http_answer(port):
    """What the server sends back to plain HTTP on its TLS port (b"" when it just closes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            return s.recv(65536)
        except ConnectionResetError:
            return b""


CHAT = {"model": "capserve-moe-tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


class TlsApiKeyTest(ServerTestCase):
    FLAGS = ["--tls-cert", _path("server.pem"), "--tls-key", _path("server.key"), "--api-key-file",
             _path("api.key"), "--host", "0.0.0.0", "--metrics-host", "127.0.0.1"]

    @classmethod
    def setUpClass(cls):
        cls.server = Server(*cls.FLAGS, grpc_credentials=grpc_credentials(),
                            metrics_ssl_context=client_context(False))
        cls.addClassCleanup(cls.server.stop)
        cls.server.start()
        cls.stub = cls.server.stub

    def test_http_api_needs_the_key(self):
        port = self.server.http_port
        code, headers, body = https(port, "POST", "/v1/chat/completions", CHAT, key=KEY)
        self.assertEqual(code, 200, body)
        self.assertTrue(body["choices"][0]["message"]["content"] is not None)
        for key in (None, "wrong", KEY + "x", KEY[:-1]):
            code, headers, body = https(port, "POST", "/v1/chat/completions", CHAT, key=key)
            self.assertEqual(code, 401, (key, body))
            self.assertEqual(body["error"]["code"], "invalid_api_key")
            self.assertEqual(body["error"]["type"], "invalid_request_error")
            self.assertEqual(headers.get("www-authenticate"), "Bearer")
        for path in ("/v1/models", "/version", "/metrics"):
            self.assertEqual(https(port, "GET", path)[0], 401, path)
            self.assertEqual(https(port, "GET", path, key=KEY)[0], 200, path)
        # Probes carry no key.
        self.assertEqual(https(port, "GET", "/health")[0], 200)

    def test_plain_tcp_gets_no_answer(self):
        self.assertFalse(plain_http_answer(self.server.http_port).startswith(b"HTTP/"))
        self.assertFalse(plain_http_answer(self.server.metrics_port).startswith(b"HTTP/"))
        with grpc.insecure_channel(f"127.0.0.1:{self.server.port}") as channel:
            with self.assertRaises(grpc.RpcError) as refused:
                pb_grpc.InferenceStub(channel).ListModels(pb.ListModelsRequest(), timeout=5,
                                                          metadata=[("authorization", "Bearer " + KEY)])
            self.assertEqual(refused.exception.code(), grpc.StatusCode.UNAVAILABLE)

    def test_grpc_needs_the_key(self):
        auth = [("authorization", "Bearer " + KEY)]
        self.assertEqual(self.stub.ListModels(pb.ListModelsRequest(), metadata=auth, timeout=30).models[0].id,
                         self.server.model_id)
        reply = self.stub.Chat(chat_request("hello", max_tokens=4), metadata=auth, timeout=60)
        self.assertGreater(len(reply.text) + reply.usage.completion_tokens, 0)
        for metadata in ([], [("authorization", "Bearer wrong")], [("authorization", KEY)]):
            for call in (lambda: self.stub.ListModels(pb.ListModelsRequest(), metadata=metadata, timeout=30),
                         lambda: self.stub.Chat(chat_request("hello", max_tokens=4), metadata=metadata, timeout=30),
                         lambda: list(self.stub.ChatStream(chat_request("hi", max_tokens=4), metadata=metadata,
                                                           timeout=30))):
                with self.assertRaises(grpc.RpcError) as refused:
                    call()
                self.assertEqual(refused.exception.code(), grpc.StatusCode.UNAUTHENTICATED, metadata)
        self.assertEqual(self.server.health(), "SERVING")  # the health service needs no key

    def test_grpc_reflection_is_off_with_a_key(self):
        # The reflection plugin cannot check the key, so it is not served: it once answered without one.
        for metadata in ([], [("authorization", "Bearer " + KEY)]):
            with self.assertRaises(grpc.RpcError) as refused:
                reflection_services(self.server.channel, metadata)
            self.assertEqual(refused.exception.code(), grpc.StatusCode.UNIMPLEMENTED, metadata)

    def test_metrics_port_is_tls_on_its_own_host_without_key(self):
        self.assertIn("capserve_", self.server.metrics_text())
        self.assertTrue(any("metrics (/metrics) at 127.0.0.1:" in line for line in self.server.log))

    def test_silent_tls_client_is_cut_off(self):
        """A client that connects and never starts the handshake is closed by the 10 s read deadline."""
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", self.server.http_port), timeout=30) as s:
            try:
                self.assertEqual(s.recv(1), b"")
            except ConnectionResetError:
                pass
        self.assertLess(time.monotonic() - started, 20)

    def test_slowloris_over_tls_is_cut_off(self):
        """Handshake, then a head trickled a byte a second: one 10 s deadline covers both."""
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", self.server.http_port), timeout=30) as raw:
            with client_context(False).wrap_socket(raw, server_hostname="localhost") as s:
                closed = False
                for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 40:
                    try:
                        s.sendall(bytes([byte]))
                    except (ssl.SSLError, OSError):
                        closed = True
                        break
                    time.sleep(1)
                self.assertTrue(closed, "the server still reads after 60 s")
        self.assertLess(time.monotonic() - started, 20)

    @unittest.skipIf(openai is None, OPENAI_MISSING)
    def test_openai_client(self):
        base = f"https://localhost:{self.server.http_port}/v1"
        client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0,
                               http_client=openai.DefaultHttpxClient(verify=client_context(False)))
        reply = client.chat.completions.create(model=self.server.model_id, messages=CHAT["messages"], max_tokens=4)
        self.assertEqual(reply.object, "chat.completion")
        chunks = list(client.chat.completions.create(model=self.server.model_id, messages=CHAT["messages"],
                                                     max_tokens=4, stream=True))
        self.assertEqual(chunks[-1].choices[0].finish_reason, "length")
        keyless = openai.OpenAI(base_url=base, api_key="wrong", max_retries=0,
                                http_client=openai.DefaultHttpxClient(verify=client_context(False)))
        with self.assertRaises(openai.AuthenticationError):
            keyless.models.list()
        plain = openai.OpenAI(base_url=f"http://127.0.0.1:{self.server.http_port}/v1", api_key=KEY, max_retries=0)
        with self.assertRaises(openai.APIConnectionError):
            plain.models.list()


class MutualTlsTest(ServerTestCase):
    FLAGS = ["--tls-cert", _path("server.pem"), "--tls-key", _path("server.key"), "--tls-client-ca",
             _path("ca.pem")]

    @classmethod
    def setUpClass(cls):
        cls.server = Server(*cls.FLAGS, grpc_credentials=grpc_credentials(certificate=True),
                            metrics_ssl_context=client_context(True))
        cls.addClassCleanup(cls.server.stop)
        cls.server.start()
        cls.stub = cls.server.stub

    def test_client_certificate_required(self):
        port = self.server.http_port
        self.assertEqual(https(port, "GET", "/v1/models", context=client_context(True))[0], 200)
        with self.assertRaises((ssl.SSLError, ConnectionResetError, BrokenPipeError, ValueError, IndexError)):
            https(port, "GET", "/v1/models", context=client_context(False))
        self.assertEqual(self.stub.ListModels(pb.ListModelsRequest(), timeout=30).models[0].id, self.server.model_id)
        with grpc.secure_channel(self.server.address, grpc_credentials(certificate=False)) as channel:
            with self.assertRaises(grpc.RpcError) as refused:
                pb_grpc.InferenceStub(channel).ListModels(pb.ListModelsRequest(), timeout=10)
            self.assertEqual(refused.exception.code(), grpc.StatusCode.UNAVAILABLE)


class StartupErrorsTest(unittest.TestCase):
    def refused(self, *flags):
        server = Server(*flags, start_timeout=120)
        self.addCleanup(server.stop)
        with self.assertRaises(RuntimeError) as failed:
            server.start()
        return str(failed.exception)

    def test_bad_files_are_named(self):
        missing = _path("missing.pem")
        log = self.refused("--tls-cert", missing, "--tls-key", _path("server.key"))
        self.assertIn(f"--tls-cert {missing}: cannot read", log)
        log = self.refused("--tls-cert", _path("server.pem"), "--tls-key", _path("other.key"))
        self.assertIn("does not match the certificate", log)
        log = self.refused("--tls-cert", _path("server.pem"), "--tls-key", _path("api.key"))
        self.assertIn(f"--tls-key {_path('api.key')}: not a PEM file", log)
        log = self.refused("--api-key-file", missing)
        self.assertIn(f"--api-key-file {missing}", log)


if __name__ == "__main__":
    main()
