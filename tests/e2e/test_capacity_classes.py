"""Capacity classes end to end (2 ranks, HTTP and gRPC): under a capacity factor that drops (gamma 0.5, drop),
protected requests lose no expert assignment however loaded the steps they share with standard requests, and
decode exactly as the model without capacity would (their greedy text equals a server at gamma infinity); the
standard ones beside them lose some. The response's `moe.dropped` says so per request and
capserve_capacity_class_* per class. The operator's cap (--max-protected-requests) refuses one more protected
request in flight (429 / RESOURCE_EXHAUSTED), a server with the cap at 0 refuses the class (400 naming
capacity_class), and an unknown class is a 400."""

import threading

import grpc

from capserve_e2e import Server, ServerTestCase, chat_request, delta, http_chat, main, metric, pb

PROTECTED = 2
PROMPTS = ["Write a long story about a dragon who learns to cook.", "Explain how rivers form deltas, in detail.",
           "List the planets and describe each one.", "Tell me about the history of printing presses.",
           "Describe a day in the life of a lighthouse keeper.", "What makes bread rise? Explain the chemistry."]


def body(prompt, capacity_class=None):
    b = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    if capacity_class:
        b["capacity_class"] = capacity_class
    return b


class CapacityClassTest(ServerTestCase):
    FLAGS = ["--capacity-factor", "0.5", "--capacity-policy", "drop", "--max-protected-requests", str(PROTECTED)]

    def concurrent(self, bodies):
        results = [None] * len(bodies)

        def one(i):
            results[i] = http_chat(self.server.http_port, bodies[i], timeout=300)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results

    def test_protected_requests_are_never_dropped_and_decode_as_the_exact_model(self):
        before = self.server.metrics()
        classes = ["protected" if i < PROTECTED else "standard" for i in range(len(PROMPTS))]
        results = self.concurrent([body(p, c) for p, c in zip(PROMPTS, classes)])
        for (code, reply), c in zip(results, classes):
            self.assertEqual(code, 200, reply)
        protected = [r for (_, r), c in zip(results, classes) if c == "protected"]
        standard = [r for (_, r), c in zip(results, classes) if c == "standard"]
        for reply in protected:
            self.assertEqual(reply["moe"]["dropped"], 0, reply["moe"])
        self.assertGreater(sum(r["moe"]["dropped"] for r in standard), 0, "gamma 0.5 dropped nothing")
        after = self.wait_for(lambda: (lambda m: m if delta(m, before, "capserve_capacity_class_requests_total")
                                       == len(PROMPTS) else None)(self.server.metrics()), 30, "the class counters")
        self.assertEqual(delta(after, before, "capserve_capacity_class_requests_total", capacity_class="protected"),
                         PROTECTED)
        self.assertEqual(delta(after, before, "capserve_capacity_class_dropped_assignments_total",
                               capacity_class="protected"), 0)
        self.assertGreater(delta(after, before, "capserve_capacity_class_dropped_assignments_total",
                                 capacity_class="standard"), 0)
        # The same prompts on a server without capacity: the protected texts are the exact model's.
        exact = Server()
        self.addCleanup(exact.stop)
        exact.start()
        for prompt, reply in zip(PROMPTS, protected):
            code, plain = http_chat(exact.http_port, body(prompt), timeout=300)
            self.assertEqual(code, 200, plain)
            self.assertEqual(reply["choices"][0]["message"]["content"], plain["choices"][0]["message"]["content"])

    def test_grpc_carries_the_class(self):
        request = chat_request(PROMPTS[0], max_tokens=8, capacity_class=b"protected")
        response = self.stub.Chat(request, timeout=120)
        self.assertEqual(response.moe.dropped, 0)
        with self.assertRaises(grpc.RpcError) as refused:
            self.stub.Chat(chat_request(PROMPTS[0], max_tokens=8, capacity_class=b"gold"), timeout=120)
        self.assertEqual(refused.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("sampling.capacity_class", refused.exception.details())

    def test_the_operator_caps_protected_requests_in_flight(self):
        # n choices are requests in flight each: one call asking for more than the cap is refused whole.
        code, reply = http_chat(self.server.http_port, {**body(PROMPTS[0], "protected"), "n": PROTECTED + 1})
        self.assertEqual(code, 429, reply)
        self.assertIn("--max-protected-requests", reply["error"]["message"])
        code, reply = http_chat(self.server.http_port, {**body(PROMPTS[0], "protected"), "n": PROTECTED})
        self.assertEqual(code, 200, reply)
        code, reply = http_chat(self.server.http_port, body(PROMPTS[0], "platinum"))
        self.assertEqual(code, 400, reply)
        self.assertEqual(reply["error"]["param"], "capacity_class")


class NoProtectedRequestsTest(ServerTestCase):
    def test_a_server_with_the_cap_at_zero_refuses_the_class(self):
        code, reply = http_chat(self.server.http_port, body(PROMPTS[0], "protected"))
        self.assertEqual(code, 400, reply)
        self.assertEqual(reply["error"]["param"], "capacity_class")
        self.assertIn("--max-protected-requests", reply["error"]["message"])
        code, reply = http_chat(self.server.http_port, body(PROMPTS[0], "standard"))
        self.assertEqual(code, 200, reply)


if __name__ == "__main__":
    main()
