"""The step watchdog (--step-timeout-s 3). Rank 1 stopped (SIGSTOP) for less than the bound: nothing is lost.
Stopped for longer: health turns NOT_SERVING, every in-flight request ends UNAVAILABLE naming rank 1, and the job
exits non-zero, all within LIMIT_S of the SIGSTOP."""

import os
import signal
import sys
import threading
import time

import grpc

from capserve_e2e import ServerTestCase, chat_request, main, metric, pb

BOUND_S = 3
LIMIT_S = BOUND_S + 10
TOKENS = 800


class StepWatchdogTest(ServerTestCase):
    FLAGS = ["--step-timeout-s", str(BOUND_S)]

    def start(self, calls):
        ended = {}

        def run(name):
            try:
                last = None
                for last in calls[name]():
                    pass
                ended[name] = (grpc.StatusCode.OK, last, time.monotonic())
            except grpc.RpcError as e:
                ended[name] = (e.code(), e.details(), time.monotonic())

        threads = [threading.Thread(target=run, args=(name,), daemon=True) for name in calls]
        for t in threads:
            t.start()
        self.wait_for(lambda: metric(self.server.metrics(), "capserve_requests_running") == len(calls), 120,
                      "every request to be running")
        return threads, ended

    def test_1_stop_shorter_than_the_bound_loses_nothing(self):
        tokens = 300
        calls = {f"stream {i}": (lambda i=i: self.stub.ChatStream(
            chat_request(f"A story, number {i}.", tokens, ignore_eos=True))) for i in range(2)}
        threads, ended = self.start(calls)
        os.kill(self.server.ranks[1], signal.SIGSTOP)
        time.sleep(BOUND_S / 2)
        in_flight = sum(t.is_alive() for t in threads)
        os.kill(self.server.ranks[1], signal.SIGCONT)
        self.assertEqual(in_flight, len(calls), "the streams ended while rank 1 was stopped")
        for t in threads:
            t.join(300)
        for name, (code, last, _) in ended.items():
            self.assertEqual(code, grpc.StatusCode.OK, f"{name}: {last}")
            self.assertEqual(last.usage.completion_tokens, tokens, name)
        self.assertEqual(self.server.health(), "SERVING")

    def test_2_stop_longer_than_the_bound_fails_every_request_and_ends_the_job(self):
        calls = {
            "stream 0": lambda: self.stub.ChatStream(chat_request("A long story, please.", TOKENS, ignore_eos=True)),
            "stream 1": lambda: self.stub.ChatStream(chat_request("Another long story.", TOKENS, ignore_eos=True)),
            "generate": lambda: self.stub.Generate(pb.GenerateRequest(
                input_ids=[7, 8, 9], sampling=pb.SamplingOptions(max_tokens=TOKENS, ignore_eos=True))),
            "unary chat": lambda: [self.stub.Chat(chat_request("A long story.", TOKENS, ignore_eos=True))],
        }
        threads, ended = self.start(calls)
        health = {}

        def watch_health():
            while "NOT_SERVING" not in health:
                try:
                    health.setdefault(self.server.health(timeout=1), time.monotonic())
                except grpc.RpcError:
                    return  # the server is gone
                time.sleep(0.05)

        os.kill(self.server.ranks[1], signal.SIGSTOP)
        stopped = time.monotonic()
        watcher = threading.Thread(target=watch_health, daemon=True)
        watcher.start()
        for t in threads:
            t.join(max(0.0, stopped + LIMIT_S - time.monotonic()))
        status = self.server.wait_exit(max(0.0, stopped + LIMIT_S - time.monotonic()))
        exited = time.monotonic()
        watcher.join(1)
        print(f"rank 1 stopped: requests ended after {sorted(round(at - stopped, 2) for *_, at in ended.values())} "
              f"s, health NOT_SERVING after {round(health.get('NOT_SERVING', float('nan')) - stopped, 2)} s, "
              f"job exit status {status} after {exited - stopped:.2f} s", file=sys.stderr)
        self.assertEqual(sorted(ended), sorted(calls), f"requests still open {LIMIT_S} s after the SIGSTOP")
        for name, (code, details, at) in ended.items():
            self.assertEqual(code, grpc.StatusCode.UNAVAILABLE, f"{name}: {details}")
            self.assertIn("rank 1 stopped responding", details, name)
            self.assertGreater(at - stopped, BOUND_S - 1, f"{name} ended before the bound")
        self.assertIn("NOT_SERVING", health, "health never said NOT_SERVING")
        self.assertIsNotNone(status, f"the job still runs {LIMIT_S} s after the SIGSTOP")
        self.assertNotEqual(status, 0)


if __name__ == "__main__":
    main()
