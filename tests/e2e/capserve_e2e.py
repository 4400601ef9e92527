"""Shared fixture of the end-to-end tests: a real `capserve` under mpirun (deploy/launch.sh), a gRPC stub, /metrics.

The build passes the paths in the environment (tests/e2e/CMakeLists.txt): CAPSERVE_BIN, CAPSERVE_LAUNCH,
CAPSERVE_MODEL and CAPSERVE_PROTO_PYTHON (the generated Python stubs). A Server always tears down: SIGTERM to the
launcher (rank 0 drains and stops every rank), then SIGKILL to the launcher's process group and to every rank
(Open MPI puts each rank in a process group of its own).
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import unittest
import urllib.error
import urllib.request

try:
    sys.path.insert(0, os.environ["CAPSERVE_PROTO_PYTHON"])
    BIN = os.environ["CAPSERVE_BIN"]
    LAUNCH = os.environ["CAPSERVE_LAUNCH"]
    MODEL = os.environ["CAPSERVE_MODEL"]
except KeyError as missing:
    sys.exit(f"capserve_e2e: {missing} is not set; run the e2e tests through ctest (ctest -L e2e)")

import grpc  # Debian: python3-grpcio (deploy/install_deps.sh)
from google.protobuf import descriptor_pb2, message_factory

from capserve.v1 import inference_pb2 as pb
from capserve.v1 import inference_pb2_grpc as pb_grpc

NP = 2
START_LINE = re.compile(r"capserve: serving (\S+) on (\S+):(\d+), metrics on port (\d+), (\d+) ranks")
HTTP_API = re.compile(r"HTTP API on port (\d+)")


def _health_messages():
    """grpc.health.v1 request/response classes built from their descriptor (Debian ships no grpc_health)."""
    f = descriptor_pb2.FileDescriptorProto(name="capserve_e2e/health.proto", package="grpc.health.v1")
    f.syntax = "proto3"
    T = descriptor_pb2.FieldDescriptorProto
    req = f.message_type.add(name="HealthCheckRequest")
    req.field.add(name="service", number=1, type=T.TYPE_STRING, label=T.LABEL_OPTIONAL)
    resp = f.message_type.add(name="HealthCheckResponse")
    status = resp.enum_type.add(name="ServingStatus")
    for number, name in enumerate(["UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"]):
        status.value.add(name=name, number=number)
    resp.field.add(name="status", number=1, type=T.TYPE_ENUM, label=T.LABEL_OPTIONAL,
                   type_name=".grpc.health.v1.HealthCheckResponse.ServingStatus")
    classes = message_factory.GetMessages([f])
    return classes["grpc.health.v1.HealthCheckRequest"], classes["grpc.health.v1.HealthCheckResponse"]


HealthCheckRequest, HealthCheckResponse = _health_messages()


def pinned_venv(name, requirements):
    """Puts the site-packages of the ignored venv tools/setup_venv.sh makes (`name`, with the pinned
    `requirements`, a path from the repository root) on sys.path: None, or why it could not (is PyPI
    reachable?)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(["bash", os.path.join(root, "tools", "setup_venv.sh"), name, requirements],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return f"the venv {name} could not be installed (is PyPI reachable?): " + done.stderr[-400:]
    python = os.path.join(done.stdout.strip(), "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['platlib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    sys.path.insert(0, site)
    return None


def utf8(text):
    """Request text fields are UTF-8 `bytes` (proto/capserve/v1/inference.proto); raw bytes pass unchanged."""
    return text if isinstance(text, bytes) else text.encode()


def message(role, content):
    return pb.ChatMessage(role=utf8(role), content=utf8(content))


def chat_request(content, max_tokens=16, request_id="", stop=(), **sampling):
    """A chat request with one user message (greedy unless `sampling` says otherwise)."""
    sampling = pb.SamplingOptions(max_tokens=max_tokens, stop=[utf8(s) for s in stop], **sampling)
    return pb.ChatRequest(messages=[message("user", content)], request_id=utf8(request_id), sampling=sampling)


def http_chat(port, body, timeout=60, path="/v1/chat/completions"):
    """POSTs `body` (a dict, or bytes sent as they are) to the HTTP API's /v1/chat/completions (or `path`); the
    status and the decoded answer, errors included."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def reflection_services(channel, metadata=()):
    """The raw answer of gRPC server reflection's list_services (bytes naming every service); raises
    grpc.RpcError when the server refuses it."""
    call = channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")  # bytes as is
    list_services = b"\x3a\x00"  # ServerReflectionRequest{list_services: ""}
    return b"".join(call(iter([list_services]), metadata=metadata, timeout=30))


def parse_metrics(text):
    """Prometheus text exposition -> {(name, ((label, value), ...)): value}."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)", line)
        labels = tuple(sorted(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or "")))
        samples[(m.group(1), labels)] = float(m.group(3))
    return samples


def metric(samples, name, **labels):
    """The sum of every sample of `name` whose labels include `labels`; None when there is none."""
    values = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls)]
    return sum(values) if values else None


def delta(after, before, name, **labels):
    """How much `name` (summed over the samples with `labels`) grew from scrape `before` to scrape `after`."""
    a, b = metric(after, name, **labels), metric(before, name, **labels)
    if a is None or b is None:
        raise AssertionError(f"{name} {labels} is missing from /metrics")
    return a - b


def _descendants(pid):
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [d for c in children for d in [int(c), *_descendants(int(c))]]


def _capserve_rank(pid):
    """The MPI rank of process `pid` if it is a capserve rank, else None."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            if not os.path.basename(BIN).startswith(f.read().strip()):
                return None
        with open(f"/proc/{pid}/environ", "rb") as f:
            for kv in f.read().split(b"\0"):
                if kv.startswith(b"OMPI_COMM_WORLD_RANK="):
                    return int(kv.split(b"=")[1])
    except OSError:
        pass
    return None


class Server:
    """`deploy/launch.sh [LAUNCH_ARGS] NP capserve --model MODEL --port 0 --metrics-port 0 --http-port 0 --threads 1
    FLAGS...`.

    `launch_args` are launch.sh's host options (a job across hosts); `connect_host` is where rank 0's gRPC and
    /metrics ports are reached from this process; `model` a checkpoint directory other than CAPSERVE_MODEL."""

    def __init__(self, *flags, start_timeout=180, np=NP, launch_args=(), connect_host="127.0.0.1", model=MODEL,
                 grpc_credentials=None, metrics_ssl_context=None, wrapper=()):
        """`grpc_credentials` (grpc.ssl_channel_credentials) and `metrics_ssl_context` (an ssl.SSLContext) reach a
        server started with --tls-cert; `wrapper` is a command line that runs the launcher's (e.g. a shell that
        starts it as a background job)."""
        self.wrapper = list(wrapper)
        self.flags = list(flags)
        self.model = model
        self.grpc_credentials = grpc_credentials
        self.metrics_ssl_context = metrics_ssl_context
        self.start_timeout = start_timeout
        self.np = np
        self.launch_args = list(launch_args)
        self.connect_host = connect_host
        self.log = []
        self.proc = None
        self.channel = None
        self.ranks = {}  # rank -> pid

    def start(self):
        cmd = [*self.wrapper, "bash", LAUNCH, *self.launch_args, str(self.np), BIN, "--model", self.model, "--port",
               "0", "--metrics-port", "0", "--http-port", "0", "--threads", "1", *self.flags]
        print("e2e: starting", " ".join(cmd), file=sys.stderr, flush=True)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        started = threading.Event()

        def pump():
            for line in self.proc.stdout:
                self.log.append(line)
                print("[capserve]", line, end="", file=sys.stderr, flush=True)
                m = START_LINE.search(line)
                if m and not started.is_set():
                    self.model_id, self.port, self.metrics_port = m.group(1), int(m.group(3)), int(m.group(4))
                    http = HTTP_API.search(line)
                    self.http_port = int(http.group(1)) if http else None
                    started.set()

        self._pump = threading.Thread(target=pump, daemon=True)
        self._pump.start()
        deadline = time.monotonic() + self.start_timeout
        while not started.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"capserve did not start (exit {self.proc.poll()}):\n" + "".join(self.log[-40:]))
        self.address = f"{self.connect_host}:{self.port}"
        self.channel = (grpc.secure_channel(self.address, self.grpc_credentials) if self.grpc_credentials
                        else grpc.insecure_channel(self.address))
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self._health = self.channel.unary_unary("/grpc.health.v1.Health/Check",
                                                request_serializer=HealthCheckRequest.SerializeToString,
                                                response_deserializer=HealthCheckResponse.FromString)
        self.ranks = {_capserve_rank(p): p for p in _descendants(self.proc.pid) if _capserve_rank(p) is not None}
        if sorted(self.ranks) != list(range(self.np)):
            raise RuntimeError(f"expected {self.np} capserve ranks under the launcher, found {self.ranks}")
        return self

    def health(self, timeout=10, service=""):
        """The grpc.health.v1 status name of `service` ("": the whole server): "SERVING", "NOT_SERVING", ..."""
        status = self._health(HealthCheckRequest(service=service), timeout=timeout).status
        return HealthCheckResponse.DESCRIPTOR.enum_types_by_name["ServingStatus"].values_by_number[status].name

    def metrics_text(self):
        scheme = "https" if self.metrics_ssl_context else "http"
        with urllib.request.urlopen(f"{scheme}://{self.connect_host}:{self.metrics_port}/metrics", timeout=10,
                                    context=self.metrics_ssl_context) as r:
            return r.read().decode()

    def metrics(self):
        return parse_metrics(self.metrics_text())

    def wait_exit(self, timeout):
        """The launcher's exit status, or None if it is still running after `timeout` seconds."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self):
        """Tears the job down whatever state it is in; safe to call more than once."""
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # launch.sh: rank 0 drains, then every rank stops
            self.wait_exit(15)
        if self.proc.poll() is None:  # not reaped yet, so its process group is still ours
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in self.ranks.values():
            if _capserve_rank(pid) is not None:  # still alive (and still ours)
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)
        self._pump.join(5)
        # A process that outlived the job may still hold the pipe; closing it under the reading pump would block.
        if not self._pump.is_alive():
            self.proc.stdout.close()
        self.proc = None


class ServerTestCase(unittest.TestCase):
    """One server shared by the test methods of a class; FLAGS are its extra capserve flags, MODEL its
    checkpoint."""

    FLAGS = []
    MODEL = MODEL
    server = None

    @classmethod
    def setUpClass(cls):
        cls.server = Server(*cls.FLAGS, model=cls.MODEL)
        cls.addClassCleanup(cls.server.stop)
        cls.server.start()
        cls.stub = cls.server.stub

    def wait_for(self, condition, timeout, what):
        """Polls `condition` until it returns something truthy; fails naming `what` (or what() returns)."""
        deadline = time.monotonic() + timeout
        while True:
            value = condition()
            if value:
                return value
            if time.monotonic() > deadline:
                self.fail(f"timed out after {timeout} s waiting for {what() if callable(what) else what}")
            time.sleep(0.05)


def main():
    """unittest.main, but exit code 77 (CTest SKIP_RETURN_CODE) when every test was skipped."""
    program = unittest.main(exit=False, verbosity=2)
    result = program.result
    if result.testsRun and len(result.skipped) == result.testsRun:
        sys.exit(77)
    sys.exit(not result.wasSuccessful())
