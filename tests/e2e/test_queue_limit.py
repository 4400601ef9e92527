"""The queue limit: a flood against --max-queue 2 --max-running 1 is partly refused with RESOURCE_EXHAUSTED, and
every request ends with exactly one terminal status (client side and in the server's own counts)."""

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc

from capserve_e2e import ServerTestCase, chat_request, delta, main, pb

FLOOD = 16


class QueueLimitTest(ServerTestCase):
    FLAGS = ["--max-queue", "2", "--max-running", "1"]

    def test_flood(self):
        before = self.server.metrics()
        barrier = threading.Barrier(FLOOD)

        def send(i):
            """(status code, finish reasons seen) of one streamed request."""
            barrier.wait()
            request = chat_request(f"Flood request {i}.", max_tokens=48, ignore_eos=True)
            reasons = []
            try:
                for chunk in self.stub.ChatStream(request, timeout=300):
                    reasons.append(chunk.finish_reason)
            except grpc.RpcError as e:
                return e.code(), reasons, e.details()
            return grpc.StatusCode.OK, reasons, ""

        with ThreadPoolExecutor(FLOOD) as pool:
            outcomes = list(pool.map(send, range(FLOOD)))
        codes = [code for code, _, _ in outcomes]
        self.assertEqual(set(codes) - {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, set(), outcomes)
        served = codes.count(grpc.StatusCode.OK)
        refused = codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.assertGreater(refused, 0)
        self.assertGreater(served, 0)
        for code, reasons, details in outcomes:
            if code == grpc.StatusCode.OK:
                # Exactly one final chunk, the last one.
                self.assertNotIn(pb.FINISH_REASON_UNSPECIFIED, reasons[-1:])
                self.assertEqual(reasons[:-1], [pb.FINISH_REASON_UNSPECIFIED] * (len(reasons) - 1))
            else:
                self.assertEqual(reasons, [])
                self.assertIn("queue", details)

        def counted():
            m = self.server.metrics()
            return m if delta(m, before, "capserve_requests_total") == served else None

        after = self.wait_for(counted, 30, "the server to count every served request")
        self.assertEqual(delta(after, before, "capserve_request_errors_total", code="RESOURCE_EXHAUSTED"), refused)
        self.assertEqual(delta(after, before, "capserve_request_errors_total"), refused)
        self.assertEqual(delta(after, before, "capserve_requests_total", finish_reason="error"), 0)

        # The server is still healthy and serves normally once the flood is over.
        reply = self.stub.Chat(chat_request("Still there?", max_tokens=4), timeout=120)
        self.assertNotEqual(reply.finish_reason, pb.FINISH_REASON_UNSPECIFIED)


if __name__ == "__main__":
    main()
