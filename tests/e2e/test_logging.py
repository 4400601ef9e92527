"""capserve's log under mpirun (stderr is a pipe): --log-format json writes one valid JSON object per line, the
start-up summary, and one access line per finished request with its fields (request id, peer, tokens, finish
reason, queue time, TTFT, e2e, dropped / rerouted); the text format writes the same access line as key=value
pairs; no ANSI colour codes in either."""

import json
import re

from capserve_e2e import ServerTestCase, chat_request, main, pb


class JsonLogTest(ServerTestCase):
    FLAGS = ["--log-format", "json"]

    def json_lines(self):
        """Every line of the job's output that is a JSON object (the log), parsed; fails on one that is not."""
        lines = []
        for line in list(self.server.log):
            if line.startswith("{"):
                try:
                    lines.append(json.loads(line))
                except json.JSONDecodeError as e:
                    self.fail(f"not a JSON line ({e}): {line!r}")
        return lines

    def access_line(self, request_id):
        found = [r for r in self.json_lines() if r.get("logger") == "access" and r.get("request_id") == request_id]
        return found[0] if found else None

    def test_access_lines_have_every_field(self):
        reply = self.stub.Chat(chat_request("Name a colour.", max_tokens=6, request_id="log-chat-1"), timeout=120)
        record = self.wait_for(lambda: self.access_line("log-chat-1"), 10, "the access line of log-chat-1")
        self.assertEqual(record["level"], "info")
        self.assertRegex(record["peer"], r"^ipv[46]:")
        self.assertEqual(record["prompt_tokens"], reply.usage.prompt_tokens)
        self.assertEqual(record["completion_tokens"], reply.usage.completion_tokens)
        self.assertIn(record["finish_reason"], ("stop", "length"))
        self.assertGreaterEqual(record["queue_s"], 0)
        self.assertGreaterEqual(record["ttft_s"], record["queue_s"])
        self.assertGreaterEqual(record["e2e_s"], record["ttft_s"])
        self.assertEqual(record["dropped"], reply.moe.dropped)
        self.assertEqual(record["rerouted"], reply.moe.rerouted)

        # A request that generates: length; one cut short by its deadline while queued or running: its own reason.
        chunks = list(self.stub.Generate(pb.GenerateRequest(
            input_ids=[1, 2, 3], request_id=b"log-gen-2", sampling=pb.SamplingOptions(max_tokens=4, ignore_eos=True)),
            timeout=120))
        self.assertEqual(chunks[-1].usage.completion_tokens, 4)
        record = self.wait_for(lambda: self.access_line("log-gen-2"), 10, "the access line of log-gen-2")
        self.assertEqual((record["finish_reason"], record["prompt_tokens"], record["completion_tokens"]),
                         ("length", 3, 4))

    def test_start_up_summary_and_no_colour(self):
        messages = [r["message"] for r in self.json_lines() if r.get("logger") == "capserve"]
        for expected in ("layers", "placement", "rank 0:", "rank 1:", "scheduler:", "listening: gRPC at"):
            self.assertTrue(any(expected in m for m in messages), f"no start-up line with {expected!r}: {messages}")
        self.assertTrue(all(set(r) >= {"time", "level", "rank", "logger"} for r in self.json_lines()))
        self.assertFalse([line for line in self.server.log if "\x1b[" in line])


class TextLogTest(ServerTestCase):
    def test_access_line_and_no_colour(self):
        self.stub.Chat(chat_request("Name a fruit.", max_tokens=4, request_id="log-text-1"), timeout=120)
        pattern = re.compile(r"\[info\] request id=log-text-1 peer=ipv[46]:\S+ prompt_tokens=\d+ completion_tokens=4 "
                             r"finish_reason=length queue_s=[\d.]+ ttft_s=[\d.]+ e2e_s=[\d.]+ dropped=0 rerouted=0$")
        self.wait_for(lambda: any(pattern.search(line.rstrip("\n")) for line in list(self.server.log)), 10,
                      lambda: "a text access line for log-text-1 in:\n" + "".join(self.server.log[-10:]))
        self.assertTrue(any("[info] listening: gRPC at" in line for line in self.server.log))
        self.assertFalse([line for line in self.server.log if "\x1b[" in line])


if __name__ == "__main__":
    main()
