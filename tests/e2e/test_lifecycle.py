"""Process lifecycle of a running server: the start-up lines (weights in MB with a decimal, every listening
address, whole milliseconds) and the KV cache's size on /metrics before any request; health answers for the API's
service name like for "", a second server on the same port is a one-line error and a non-zero exit (no port
sharing), and SIGINT to the launcher's whole process group (Ctrl-C in a terminal, also when the launcher runs as a
background job of a script, which starts it with SIGINT ignored), SIGHUP to it (the terminal closed) or SIGTERM to
every process of the job (systemd's default KillMode) drains like SIGTERM to the launcher: running streams finish,
exit 0. SIGUSR2 (to rank 0 or to the whole group) is logged and changes nothing."""

import os
import re
import signal
import subprocess
import sys
import threading

import grpc

from capserve_e2e import (BIN, LAUNCH, MODEL, NP, Server, ServerTestCase, _descendants, chat_request, main, metric,
                          pb_grpc, reflection_services)

STREAMS = 3
TOKENS = 900  # long enough that the drain outlasts the first health poll on a loaded machine
SERVICE = "capserve.v1.Inference"


class LifecycleTest(ServerTestCase):
    def test_0_startup_lines(self):
        # Before any request has touched the KV cache.
        self.assertEqual(metric(self.server.metrics(), "capserve_kv_cache_total_blocks"), 1024)
        log = "".join(self.server.log)
        weights = re.findall(r"rank \d on \S+: (\S+) MB \((\S+) MiB\) of weights", log)
        self.assertEqual(len(weights), NP, log)
        self.assertGreater(sum(float(mb) for mb, _ in weights), 1.0, log)  # the tiny model's 27 MB, not "0 MiB"
        self.assertNotRegex(log, r"\b0 MiB of weights")
        self.assertIn(f"listening: gRPC at 0.0.0.0:{self.server.port}; HTTP API at 0.0.0.0:{self.server.http_port}; "
                      f"metrics (/metrics) at 0.0.0.0:{self.server.metrics_port}", log)
        self.assertIn(" max_wait_ms=2000 interval_ms=0 ", log)

    def test_1_health_of_the_service_name(self):
        self.assertEqual(self.server.health(service=SERVICE), "SERVING")
        self.assertEqual(self.server.health(), "SERVING")
        self.assertIn(SERVICE.encode(), reflection_services(self.server.channel))  # on without an API key

    def test_2_second_server_on_the_same_port_fails(self):
        cmd = ["bash", LAUNCH, str(NP), BIN, "--model", MODEL, "--port", str(self.server.port), "--metrics-port",
               "0", "--threads", "1"]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
        lines = [line for line in done.stdout.splitlines() if line.strip()]
        print(f"e2e: second server -> exit {done.returncode}:\n{done.stdout}", file=sys.stderr)
        self.assertNotEqual(done.returncode, 0, lines)
        self.assertEqual(lines[-1], f"capserve: cannot listen on 0.0.0.0:{self.server.port}: Address already in use")
        self.assertFalse(any("serving" in line or "MPI_ABORT" in line or "Primary job" in line for line in lines))
        # Every new connection still reaches the first server.
        for _ in range(4):
            with grpc.insecure_channel(self.server.address) as channel:
                reply = pb_grpc.InferenceStub(channel).Chat(chat_request("Hello?", max_tokens=2), timeout=60)
                self.assertEqual(reply.usage.completion_tokens, 2)

    def test_2_second_server_on_the_same_metrics_port_fails(self):
        cmd = ["bash", LAUNCH, str(NP), BIN, "--model", MODEL, "--port", "0", "--metrics-port",
               str(self.server.metrics_port), "--threads", "1"]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
        lines = [line for line in done.stdout.splitlines() if line.strip()]
        print(f"e2e: second metrics server -> exit {done.returncode}:\n{done.stdout}", file=sys.stderr)
        self.assertEqual(done.returncode, 1, lines)
        self.assertEqual(lines[-1],
                         f"capserve: cannot listen on 0.0.0.0:{self.server.metrics_port}: Address already in use")
        self.assertFalse(any("serving" in line or "MPI_ABORT" in line or "Primary job" in line for line in lines))
        self.assertIn("capserve_requests_total", self.server.metrics_text())

    def test_3_sigint_to_the_process_group_drains(self):
        # The launcher leads its process group, as in a terminal: this is Ctrl-C.
        drains(self, lambda: os.killpg(self.server.proc.pid, signal.SIGINT))


class HangupTest(ServerTestCase):
    def test_1_sigusr2_is_harmless(self):
        rank0 = self.server.ranks[0]
        for send in (lambda: os.kill(rank0, signal.SIGUSR2), lambda: os.killpg(self.server.proc.pid, signal.SIGUSR2)):
            send()
            self.wait_for(lambda: "SIGUSR2" in "".join(self.server.log), 30, "the SIGUSR2 log line")
            reply = self.stub.Chat(chat_request("Still there?", max_tokens=2), timeout=60)
            self.assertEqual(reply.usage.completion_tokens, 2)
            self.assertEqual(self.server.health(), "SERVING")
            self.assertIsNone(self.server.proc.poll())
            self.server.log.clear()

    def test_2_sighup_to_the_process_group_drains(self):
        drains(self, lambda: os.killpg(self.server.proc.pid, signal.SIGHUP))


class BackgroundLaunchTest(ServerTestCase):
    """deploy/launch.sh started with `&` by a script: bash gives such a job SIGINT ignored, which a bash script
    cannot trap and mpirun and the ranks inherit."""

    @classmethod
    def setUpClass(cls):
        # The script waits for the job without being stopped by the SIGINT itself, as a supervising script would.
        cls.server = Server(wrapper=["bash", "-c", 'trap "" INT; "$@" & wait $!', "background"])
        cls.addClassCleanup(cls.server.stop)
        cls.server.start()
        cls.stub = cls.server.stub

    def test_sigint_to_the_process_group_drains(self):
        drains(self, lambda: os.killpg(self.server.proc.pid, signal.SIGINT))


class ServiceStopTest(ServerTestCase):
    def test_sigterm_to_every_process_drains(self):
        # systemd's default KillMode=control-group: SIGTERM to the launcher, mpirun and every rank at once.
        def everyone():
            for pid in [self.server.proc.pid, *_descendants(self.server.proc.pid)]:
                os.kill(pid, signal.SIGTERM)
        drains(self, everyone)


def drains(test, stop):
    """Streams running, `stop()`: health NOT_SERVING, every stream finishes with all its tokens, exit 0."""
    results = [None] * STREAMS
    started = [threading.Event() for _ in range(STREAMS)]

    def stream(i):
        chunks = []
        try:
            request = chat_request(f"Tell me a long story, number {i}.", max_tokens=TOKENS, ignore_eos=True)
            for chunk in test.stub.ChatStream(request, timeout=600):
                chunks.append(chunk)
                started[i].set()
            results[i] = (grpc.StatusCode.OK, chunks)
        except grpc.RpcError as e:
            results[i] = (e.code(), e.details())
        finally:
            started[i].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    for s in started:
        test.assertTrue(s.wait(120), "a stream never started")
    stop()
    test.wait_for(lambda: test.server.health(service=SERVICE) == "NOT_SERVING", 10,
                  f"health of {SERVICE} to say NOT_SERVING")
    test.assertGreater(sum(t.is_alive() for t in threads), 0, "the streams ended before the signal")
    for t in threads:
        t.join(600)
    for code, chunks in results:
        test.assertEqual(code, grpc.StatusCode.OK, chunks)
        test.assertEqual(chunks[-1].usage.completion_tokens, TOKENS)
    test.assertEqual(test.server.wait_exit(60), 0, "the job's exit status after the drain")

if __name__ == "__main__":
    main()
