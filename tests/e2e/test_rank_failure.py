"""A rank that dies (SIGKILL to rank 1 mid-stream): every in-flight request ends with UNAVAILABLE and the job exits
non-zero, all within 10 s; nothing hangs."""

import os
import signal
import sys
import threading
import time

import grpc

from capserve_e2e import ServerTestCase, chat_request, main, metric, pb

TOKENS = 800
LIMIT_S = 10


class RankFailureTest(ServerTestCase):
    def test_killing_rank_1_ends_every_request_unavailable(self):
        calls = {
            "stream 0": lambda: self.stub.ChatStream(chat_request("A long story, please.", TOKENS, ignore_eos=True)),
            "stream 1": lambda: self.stub.ChatStream(chat_request("Another long story.", TOKENS, ignore_eos=True)),
            "generate": lambda: self.stub.Generate(pb.GenerateRequest(
                input_ids=[7, 8, 9], sampling=pb.SamplingOptions(max_tokens=TOKENS, ignore_eos=True))),
            "unary chat": lambda: [self.stub.Chat(chat_request("A long story.", TOKENS, ignore_eos=True))],
        }
        ended = {}

        def run(name):
            try:
                for _ in calls[name]():
                    pass
                ended[name] = (grpc.StatusCode.OK, time.monotonic())
            except grpc.RpcError as e:
                ended[name] = (e.code(), time.monotonic())

        threads = [threading.Thread(target=run, args=(name,), daemon=True) for name in calls]
        for t in threads:
            t.start()
        self.wait_for(lambda: metric(self.server.metrics(), "capserve_requests_running") == len(calls), 120,
                      "every request to be running")

        os.kill(self.server.ranks[1], signal.SIGKILL)
        killed = time.monotonic()
        for t in threads:
            t.join(max(0.0, killed + LIMIT_S - time.monotonic()))
        status = self.server.wait_exit(max(0.0, killed + LIMIT_S - time.monotonic()))
        print(f"rank 1 killed: requests ended after {[round(at - killed, 2) for _, at in ended.values()]} s, "
              f"job exit status {status} after {time.monotonic() - killed:.2f} s", file=sys.stderr)
        self.assertEqual(sorted(ended), sorted(calls), "requests still open 10 s after the rank died")
        for name, (code, at) in ended.items():
            self.assertEqual(code, grpc.StatusCode.UNAVAILABLE, name)
            self.assertLess(at - killed, LIMIT_S, name)
        self.assertIsNotNone(status, "the job still runs 10 s after a rank died")
        self.assertNotEqual(status, 0)


if __name__ == "__main__":
    main()
