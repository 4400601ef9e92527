"""Structured output end to end (2 ranks, HTTP and gRPC) on the default model, checked with Python's jsonschema
(pinned in tests/e2e/requirements-openapi.txt, installed into an ignored venv by tools/setup_venv.sh).

- Every schema of the corpus (tests/fixtures/grammar/schemas.json, 62 schemas: objects, arrays, enums, nesting,
  required, patterns, formats, integer and number bounds, unions, $ref and recursion) under response_format
  json_schema: every output that ends ("stop") parses and validates against its schema. The tiny model left
  greedy writes a string's characters for ever in some schemas; with frequency_penalty 1 (what a client of a
  small model does) every output ends within 512 tokens (the server bounds a number's exponent to 3 digits, past
  which no double holds it: the model wrote a root number's exponent for ever).
- json_object, vLLM's structured_outputs (choice, regex, grammar, json), streamed and whole alike, n > 1.
- The same constraint over gRPC (SamplingOptions.output_constraint) gives the same text.
- A schema the engine does not support, and bad response_format / structured_outputs values, are 400s naming
  the field and the keyword; a constraint with ignore_eos or min_tokens is refused."""

import json
import os
import re
import unittest

from capserve_e2e import ServerTestCase, chat_request, http_chat, main, pb, pinned_venv

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(ROOT, "tests", "fixtures", "grammar", "schemas.json")
MISSING = pinned_venv(".venv-openapi", "tests/e2e/requirements-openapi.txt")
if not MISSING:
    import jsonschema

ASK = [{"role": "user", "content": "Reply in JSON."}]


def json_schema(schema, name="answer"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def sse_text(port, body):
    """The concatenated content (chat) or text (completions) of a streamed call, and its finish reason."""
    import urllib.request
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps({**body, "stream": True}).encode(),
                                     {"Content-Type": "application/json"})
    text, finish = "", None
    with urllib.request.urlopen(request, timeout=300) as response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += (choice.get("delta", {}).get("content") or "") if "delta" in choice else choice.get("text", "")
            finish = choice.get("finish_reason") or finish
    return text, finish


class StructuredOutputTest(ServerTestCase):
    def chat(self, body):
        code, reply = http_chat(self.server.http_port, {"messages": ASK, "temperature": 0, **body}, timeout=300)
        return code, reply

    @unittest.skipIf(MISSING, MISSING)
    def test_every_schema_of_the_corpus(self):
        with open(CORPUS, encoding="utf-8") as f:
            corpus = json.load(f)
        self.assertGreaterEqual(len(corpus), 50)
        ended, cut = 0, []
        for entry in corpus:
            with self.subTest(schema=entry["name"]):
                code, reply = self.chat({"response_format": json_schema(entry["schema"], entry["name"]),
                                         "max_tokens": 512, "frequency_penalty": 1.0})
                self.assertEqual(code, 200, reply)
                choice = reply["choices"][0]
                text = choice["message"]["content"]
                if choice["finish_reason"] == "length":
                    cut.append(entry["name"])
                    continue
                self.assertEqual(choice["finish_reason"], "stop")
                jsonschema.validate(json.loads(text), entry["schema"])
                ended += 1
        print(f"corpus: {len(corpus)} schemas, {ended} outputs ended and valid, {len(cut)} cut at 512 tokens: {cut}")
        self.assertEqual(cut, [])
        self.assertEqual(ended, len(corpus))

    @unittest.skipIf(MISSING, MISSING)
    def test_streamed_equals_whole_and_every_choice_is_valid(self):
        schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                  "required": ["name", "age"]}
        body = {"messages": ASK, "temperature": 0, "max_tokens": 64, "response_format": json_schema(schema)}
        code, whole = self.chat(body)
        self.assertEqual(code, 200, whole)
        streamed, finish = sse_text(self.server.http_port, body)
        self.assertEqual(streamed, whole["choices"][0]["message"]["content"])
        self.assertEqual(finish, "stop")
        code, sampled = self.chat({**body, "temperature": 1.0, "seed": 7, "n": 4})
        self.assertEqual(code, 200, sampled)
        for choice in sampled["choices"]:
            self.assertEqual(choice["finish_reason"], "stop", choice)
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)

    def test_json_object_and_vllm_structured_outputs(self):
        code, reply = self.chat({"response_format": {"type": "json_object"}, "max_tokens": 256,
                                 "frequency_penalty": 1.0})
        self.assertEqual(code, 200, reply)
        self.assertIsInstance(json.loads(reply["choices"][0]["message"]["content"]), dict)
        port = self.server.http_port
        for outputs, check in [
                ({"choice": ["positive", "negative", "neutral"]},
                 lambda t: self.assertIn(t, ["positive", "negative", "neutral"])),
                ({"regex": "[A-Z][a-z]{2,8} [0-9]{4}"},
                 lambda t: self.assertRegex(t, r"^[A-Z][a-z]{2,8} [0-9]{4}$")),
                ({"grammar": 'root ::= "yes" | "no" | ("maybe " [0-9])'},
                 lambda t: self.assertRegex(t, r"^(yes|no|maybe [0-9])$")),
                ({"json": json.dumps({"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3})},
                 lambda t: self.assertTrue(2 <= len(json.loads(t)) <= 3 and
                                           all(isinstance(v, bool) for v in json.loads(t))))]:
            with self.subTest(outputs=outputs):
                body = {"prompt": "The answer:", "max_tokens": 64, "temperature": 0, "structured_outputs": outputs}
                code, reply = http_chat(port, body, path="/v1/completions")
                self.assertEqual(code, 200, reply)
                text = reply["choices"][0]["text"]
                check(text)
                self.assertEqual(reply["choices"][0]["finish_reason"], "stop")
                self.assertEqual(sse_text(port, body), (text, "stop"))

    def test_grpc_carries_the_same_constraint(self):
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
                  "required": ["ok", "n"]}
        code, reply = self.chat({"response_format": json_schema(schema), "max_tokens": 64})
        self.assertEqual(code, 200, reply)
        request = chat_request("Reply in JSON.", max_tokens=64)
        request.sampling.output_constraint.json_schema = json.dumps(schema).encode()
        text = self.stub.Chat(request, timeout=120).text
        self.assertEqual(text, reply["choices"][0]["message"]["content"])

    def test_refusals_name_the_field_and_keyword(self):
        port = self.server.http_port
        for body, field, needle in [
                ({"response_format": json_schema({"type": "object", "properties": {"a": {"not": {}}}})},
                 "response_format", "'not'"),
                ({"response_format": json_schema({"type": "string", "pattern": "(a)\\1"})}, "response_format",
                 "'pattern'"),
                ({"response_format": json_schema({"type": "number", "minimum": 0.5})}, "response_format", "minimum"),
                ({"response_format": {"type": "xml"}}, "response_format", "xml"),
                ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "response_format"),
                ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens", "response_format"),
                ({"structured_outputs": {"regex": "(?=a)b"}}, "structured_outputs", "lookahead"),
                ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice")]:
            with self.subTest(body=body):
                code, reply = http_chat(port, {"messages": ASK, "max_tokens": 4, **body})
                self.assertEqual(code, 400, reply)
                self.assertEqual(reply["error"]["param"], field)
                self.assertIn(needle, reply["error"]["message"])


if __name__ == "__main__":
    main()
