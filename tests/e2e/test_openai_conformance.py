"""The OpenAI API against OpenAI's published OpenAPI document (../shared/data/openai/openapi.yaml) and against the
server's own list of accepted fields (server/README.md, "Request fields").

1. Every response and stream chunk of /v1/chat/completions and /v1/completions (whole and streamed, with
   logprobs, n > 1, echo, usage chunks), the models routes and the errors validate against the document's
   schemas, $refs resolved (jsonschema + referencing, pinned in tests/e2e/requirements-openapi.txt and installed
   into an ignored venv by tools/setup_venv.sh). Where the document itself is wrong the test says so
   (spec_fixes) and validates against the corrected schema.
2. Every field the README lists as accepted changes the response in a test here, or is on the README's no-op
   list (and then changes nothing); a field on neither list is refused with a 400 naming it.

The server runs the default model with a chat template that also renders `tools` and a `greeting` template
kwarg, so that both visibly reach the template."""

import copy
import json
import os
import re
import sys
import tempfile
import unittest
import urllib.error
import urllib.request

from capserve_e2e import MODEL, ServerTestCase, main, pinned_venv

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED = os.environ.get("CAPSERVE_SHARED_DATA_DIR", os.path.join(ROOT, "..", "shared", "data"))
SPEC = os.path.join(SHARED, "openai", "openapi.yaml")
README = os.path.join(ROOT, "server", "README.md")


def _load_validator():
    """jsonschema, referencing and yaml from the pinned venv; (modules, None) or (None, why not)."""
    missing = pinned_venv(".venv-openapi", "tests/e2e/requirements-openapi.txt")
    if missing:
        return None, missing
    import jsonschema
    import referencing
    import referencing.jsonschema
    import yaml
    return (jsonschema, referencing, yaml), None


VALIDATOR, VALIDATOR_MISSING = _load_validator()


def allow_null(schema):
    return {"anyOf": [schema, {"type": "null"}]}


def nullable_to_json_schema(node):
    """The document is OpenAPI 3.1 (plain JSON Schema 2020-12) but still marks some schemas `nullable: true`,
    OpenAPI 3.0's keyword, which JSON Schema ignores: read literally, a stream chunk's `"usage": null`,
    `"logprobs": null` and `"finish_reason": null` (which the same document describes as sent) would be invalid.
    Each such schema becomes anyOf [itself, null], as the document means."""
    if isinstance(node, list):
        return [nullable_to_json_schema(x) for x in node]
    if not isinstance(node, dict):
        return node
    node = {k: nullable_to_json_schema(v) for k, v in node.items()}
    if node.pop("nullable", False) is True:
        return allow_null(node)
    return node


def spec_fixes(schemas):
    """Where OpenAI's document disagrees with OpenAI's own API (and vLLM's), corrected here."""
    # CreateCompletionResponse.choices[].logprobs: with echo, the prompt's first token has no log-probability,
    # and OpenAI's legacy completions (and vLLM) send null for it in token_logprobs and top_logprobs; the
    # document types those items as number / object only.
    choice = schemas["CreateCompletionResponse"]["properties"]["choices"]["items"]
    logprobs = next(s for s in choice["properties"]["logprobs"]["anyOf"] if s.get("type") == "object")
    for name in ("token_logprobs", "top_logprobs"):
        logprobs["properties"][name]["items"] = allow_null(logprobs["properties"][name]["items"])
    # The document has no schema for a streamed completions chunk: OpenAI streams CreateCompletionResponse
    # objects, whose finish_reason is null until a choice ends and whose usage is null but in the usage chunk
    # (as CreateChatCompletionStreamResponse says for chat).
    chunk = copy.deepcopy(schemas["CreateCompletionResponse"])
    chunk_choice = chunk["properties"]["choices"]["items"]["properties"]
    chunk_choice["finish_reason"] = allow_null(chunk_choice["finish_reason"])
    chunk["properties"]["usage"] = allow_null(chunk["properties"]["usage"])
    schemas["CreateCompletionStreamResponse (not in the document)"] = chunk


class Schemas:
    """Validators for the document's component schemas, $refs resolved within the document."""

    def __init__(self):
        jsonschema, referencing, yaml = VALIDATOR
        with open(SPEC, encoding="utf-8") as f:
            document = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        components = nullable_to_json_schema(document["components"])
        spec_fixes(components["schemas"])
        self.root = {"components": components}
        resource = referencing.Resource.from_contents(self.root, default_specification=referencing.jsonschema.DRAFT202012)
        self.registry = referencing.Registry().with_resource("urn:openai", resource)
        self.jsonschema = jsonschema

    def errors(self, name, instance):
        """Every violation of components.schemas[name] by `instance`, as text (empty: valid)."""
        validator = self.jsonschema.Draft202012Validator({"$ref": f"urn:openai#/components/schemas/{name}"},
                                                         registry=self.registry)
        return [f"{'/'.join(map(str, e.absolute_path)) or '.'}: {e.message[:300]}"
                for e in validator.iter_errors(instance)]


def call(port, method, path, body=None):
    """(status, body): parsed JSON, or for an event stream the list of its `data:` payloads (JSON parsed,
    "[DONE]" kept as the string)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, content_type, raw = r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        status, content_type, raw = e.code, e.headers.get("Content-Type", ""), e.read()
    if content_type.startswith("text/event-stream"):
        events = [line[len("data: "):] for line in raw.decode().split("\n") if line.startswith("data: ")]
        return status, [e if e == "[DONE]" else json.loads(e) for e in events]
    return status, json.loads(raw)


# The default model's template, plus `tools` and a `greeting` kwarg rendered first: both reach the prompt.
def chat_template():
    with open(os.path.join(MODEL, "tokenizer_config.json"), encoding="utf-8") as f:
        template = json.load(f)["chat_template"]
    extra = ("{% if tools %}{{ '<|system|>\n' + (tools | tojson) + '\n' }}{% endif %}"
             "{% if greeting is defined %}{{ greeting + '\n' }}{% endif %}")
    return template.replace("{{ bos_token }}", "{{ bos_token }}" + extra, 1)


def readme_fields(heading):
    """The fields of the table under `heading` in server/README.md: {name: endpoints cell}."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    at = text.index(heading)
    fields = {}
    for line in text[at:].split("\n")[1:]:
        if line.startswith("#"):
            break
        m = re.match(r"\| `([a-z_]+)` \| ([a-z ,]+) \|", line)
        if m:
            fields[m.group(1)] = m.group(2).strip()
    return fields


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Tell me a story"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


class OpenAiConformance(ServerTestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="capserve-conformance-")
        cls.addClassCleanup(cls.tmp.cleanup)
        template = os.path.join(cls.tmp.name, "template.jinja")
        with open(template, "w", encoding="utf-8") as f:
            f.write(chat_template())
        # A parser, so that tool_choice "auto" parses the output (its message and deltas validate too).
        cls.FLAGS = ["--chat-template", template, "--tool-call-parser", "hermes"]
        super().setUpClass()
        cls.port = cls.server.http_port
        cls.schemas = Schemas() if VALIDATOR else None

    def post(self, path, body):
        return call(self.port, "POST", path, {"model": self.server.model_id, **body})

    def base(self, path):
        """A greedy request of `path` that leaves room to show each field's effect."""
        content = {"messages": MESSAGES} if path == CHAT else {"prompt": "Once upon a time"}
        return {**content, "max_tokens": 8, "temperature": 0, "seed": 1}

    # 1. OpenAI's schemas.

    validated = {}  # schema name -> documents validated, printed at the end

    @classmethod
    def tearDownClass(cls):
        print("openapi: validated", ", ".join(f"{n} {name}" for name, n in sorted(cls.validated.items())),
              file=sys.stderr)
        super().tearDownClass()

    def assert_valid(self, name, instance):
        self.validated[name] = self.validated.get(name, 0) + 1
        errors = self.schemas.errors(name, instance)
        self.assertEqual(errors, [], f"{name}: {json.dumps(instance)[:2000]}")

    def assert_chunks_valid(self, name, events):
        self.assertEqual(events[-1], "[DONE]")
        self.assertGreater(len(events), 2)
        for chunk in events[:-1]:
            self.assert_valid(name, chunk)

    @unittest.skipIf(VALIDATOR is None, VALIDATOR_MISSING)
    def test_chat_responses_and_chunks_validate(self):
        for extra in [{}, {"n": 3, "temperature": 1, "logprobs": True, "top_logprobs": 2},
                      {"tools": TOOLS, "tool_choice": "auto", "max_completion_tokens": 4}]:
            with self.subTest(extra=extra):
                status, body = self.post(CHAT, {**self.base(CHAT), **extra})
                self.assertEqual(status, 200, body)
                self.assert_valid("CreateChatCompletionResponse", body)
                message = body["choices"][0]["message"]
                self.assertIsNone(message["refusal"])
                if "logprobs" in extra:
                    self.assertIsNone(body["choices"][0]["logprobs"]["refusal"])
                    self.assertEqual(len(body["choices"]), 3)
                status, events = self.post(CHAT, {**self.base(CHAT), **extra, "stream": True,
                                                  "stream_options": {"include_usage": True}})
                self.assertEqual(status, 200, events)
                self.assert_chunks_valid("CreateChatCompletionStreamResponse", events)
                self.assertEqual(events[-2]["choices"], [])
                self.assertGreater(events[-2]["usage"]["completion_tokens"], 0)

    @unittest.skipIf(VALIDATOR is None, VALIDATOR_MISSING)
    def test_completions_responses_and_chunks_validate(self):
        for extra in [{}, {"n": 2, "temperature": 1, "logprobs": 3}, {"echo": True, "logprobs": 1},
                      {"prompt": ["One", [5, 6, 7]], "n": 2}]:
            with self.subTest(extra=extra):
                status, body = self.post(COMPLETIONS, {**self.base(COMPLETIONS), **extra})
                self.assertEqual(status, 200, body)
                self.assert_valid("CreateCompletionResponse", body)
                if extra.get("echo"):
                    self.assertIsNone(body["choices"][0]["logprobs"]["token_logprobs"][0])
                status, events = self.post(COMPLETIONS, {**self.base(COMPLETIONS), **extra, "stream": True,
                                                         "stream_options": {"include_usage": True}})
                self.assertEqual(status, 200, events)
                self.assert_chunks_valid("CreateCompletionStreamResponse (not in the document)", events)

    @unittest.skipIf(VALIDATOR is None, VALIDATOR_MISSING)
    def test_models_and_errors_validate(self):
        status, models = call(self.port, "GET", "/v1/models")
        self.assertEqual(status, 200)
        self.assert_valid("ListModelsResponse", models)
        status, card = call(self.port, "GET", f"/v1/models/{self.server.model_id}")
        self.assertEqual(status, 200)
        self.assert_valid("Model", card)
        self.assertEqual(card, models["data"][0])
        status, missing = call(self.port, "GET", "/v1/models/no-such-model")
        self.assertEqual(status, 404)
        self.assert_valid("ErrorResponse", missing)
        self.assertEqual(missing["error"]["code"], "model_not_found")
        for path, body, code in [(CHAT, {"messages": MESSAGES, "response_format": {"type": "xml"}}, 400),
                                 (CHAT, {"messages": MESSAGES, "model": "nope"}, 404),
                                 (COMPLETIONS, {"prompt": "x", "suffix": "y"}, 400),
                                 (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400)]:
            status, error = call(self.port, "POST", path, body)
            self.assertEqual(status, code, error)
            self.assert_valid("ErrorResponse", error)

    # 2. The accepted fields.

    def changed(self, path, field, variant, base=None):
        """Asserts that `variant` (the base plus `field`) gets another response than the base; returns both."""
        base = base or self.base(path)
        before = self.post(path, base)
        after = self.post(path, {**base, **variant})
        self.assertNotEqual(strip(after), strip(before), f"{path}: {field} changed nothing")
        return before, after

    def test_every_accepted_field_changes_the_response(self):
        sampled = {"temperature": 2.0, "seed": 1, "max_tokens": 16}
        effects = {
            "model": lambda p: self.changed(p, "model", {"model": "no-such-model"}),
            "messages": lambda p: self.changed(p, "messages", {"messages": [{"role": "user", "content": "Hi"}]}),
            "prompt": lambda p: self.changed(p, "prompt", {"prompt": "The weather"}),
            "temperature": lambda p: self.changed(p, "temperature", {"temperature": 2.0}),
            "top_p": lambda p: self.changed(p, "top_p", {"top_p": 1e-9}, {**self.base(p), **sampled}),
            "top_k": lambda p: self.changed(p, "top_k", {"top_k": 1}, {**self.base(p), **sampled}),
            "seed": lambda p: self.changed(p, "seed", {"seed": 2}, {**self.base(p), **sampled}),
            "max_tokens": lambda p: self.changed(p, "max_tokens", {"max_tokens": 2}),
            "max_completion_tokens": lambda p: self.changed(p, "max_completion_tokens",
                                                            {"max_completion_tokens": 2}),
            "n": lambda p: self.changed(p, "n", {"n": 2}),
            "stop": self.stop_changes,
            "ignore_eos": lambda p: None,  # IgnoreEos below: this model does not end its outputs itself
            "logprobs": lambda p: self.changed(p, "logprobs", {"logprobs": True if p == CHAT else 0}),
            "top_logprobs": lambda p: self.changed(p, "top_logprobs", {"top_logprobs": 3},
                                                   {**self.base(p), "logprobs": True}),
            "echo": lambda p: self.changed(p, "echo", {"echo": True}),
            "stream": lambda p: self.changed(p, "stream", {"stream": True}),
            "stream_options": lambda p: self.changed(p, "stream_options", {"stream_options": {"include_usage": True}},
                                                     {**self.base(p), "stream": True}),
            # Greedy output of 16 tokens repeats itself: the penalties change it.
            "presence_penalty": lambda p: self.changed(p, "presence_penalty", {"presence_penalty": 2.0},
                                                       {**self.base(p), "max_tokens": 16}),
            "frequency_penalty": lambda p: self.changed(p, "frequency_penalty", {"frequency_penalty": 2.0},
                                                        {**self.base(p), "max_tokens": 16}),
            "repetition_penalty": lambda p: self.changed(p, "repetition_penalty", {"repetition_penalty": 2.0},
                                                         {**self.base(p), "max_tokens": 16}),
            "min_p": lambda p: self.changed(p, "min_p", {"min_p": 0.99}, {**self.base(p), **sampled}),
            "logit_bias": lambda p: self.changed(p, "logit_bias", {"logit_bias": {"42": 100}}),
            # The base output holds token ids; making its first one a stop id ends the output there.
            "stop_token_ids": self.stop_token_ids_change,
            # min_tokens blocks the stop ids until that many tokens are out: with an output token as a stop
            # id, min_tokens = max_tokens lets the output run past it.
            "min_tokens": self.min_tokens_changes,
            # The base output is prose: under a constraint it is JSON, or one of the choices.
            "response_format": lambda p: self.changed(p, "response_format",
                                                      {"response_format": {"type": "json_object"}}),
            "structured_outputs": lambda p: self.changed(p, "structured_outputs",
                                                         {"structured_outputs": {"choice": ["yes", "no"]}}),
            # This server admits no protected request (--max-protected-requests 0): the class is refused here;
            # test_capacity_classes shows it acting where it is admitted.
            "capacity_class": lambda p: self.changed(p, "capacity_class", {"capacity_class": "protected"}),
            # logit_bias makes the model write a special token, which only skip_special_tokens false spells.
            "skip_special_tokens": lambda p: self.changed(p, "skip_special_tokens", {"skip_special_tokens": False},
                                                          {**self.base(p), "logit_bias": {"3": 100}}),
            "tools": lambda p: self.changed(p, "tools", {"tools": TOOLS}),
            # "none" hides the tools from the template.
            "tool_choice": lambda p: self.changed(p, "tool_choice", {"tool_choice": "none"},
                                                  {**self.base(p), "tools": TOOLS}),
            # test_openai_tool_calls (unit) shows it: this model writes no tool calls of its own.
            "parallel_tool_calls": lambda p: None,
            "chat_template_kwargs": lambda p: self.changed(p, "chat_template_kwargs",
                                                           {"chat_template_kwargs": {"greeting": "Hello there"}}),
            "add_generation_prompt": lambda p: self.changed(p, "add_generation_prompt",
                                                            {"add_generation_prompt": False}),
            "continue_final_message": lambda p: self.changed(
                p, "continue_final_message", {"continue_final_message": True},
                {**self.base(p), "add_generation_prompt": False,
                 "messages": MESSAGES + [{"role": "assistant", "content": "Once"}]}),
        }
        accepted = readme_fields("#### Accepted request fields")
        self.assertGreater(len(accepted), 10)
        for field, endpoints in accepted.items():
            for path in ([CHAT] if "chat" in endpoints or endpoints == "both" else []) + \
                        ([COMPLETIONS] if "completions" in endpoints or endpoints == "both" else []):
                with self.subTest(field=field, path=path):
                    self.assertIn(field, effects, "the README accepts a field no test shows acting")
                    effects[field](path)

    def first_token(self, path):
        """The id of the first token of the base output whose text tokenizes back to it alone."""
        status, body = self.post(path, {**self.base(path), "logprobs": True if path == CHAT else 0})
        self.assertEqual(status, 200, body)
        choice = body["choices"][0]
        texts = ([e["token"] for e in choice["logprobs"]["content"]] if path == CHAT
                 else choice["logprobs"]["tokens"])
        for text in texts:
            status, ids = self.post("/tokenize", {"prompt": text, "add_special_tokens": False})
            self.assertEqual(status, 200, ids)
            if len(ids["tokens"]) == 1:
                return ids["tokens"][0]
        self.fail(f"no output token of {texts} tokenizes back to itself")

    def stop_token_ids_change(self, path):
        before, after = self.changed(path, "stop_token_ids", {"stop_token_ids": [self.first_token(path)]})
        self.assertEqual(after[1]["choices"][0]["finish_reason"], "stop")

    def min_tokens_changes(self, path):
        base = {**self.base(path), "stop_token_ids": [self.first_token(path)]}
        self.changed(path, "min_tokens", {"min_tokens": base["max_tokens"]}, base)

    def stop_changes(self, path):
        status, body = self.post(path, self.base(path))
        self.assertEqual(status, 200, body)
        text = body["choices"][0]["message"]["content"] if path == CHAT else body["choices"][0]["text"]
        self.assertGreater(len(text.strip()), 1)
        before, after = self.changed(path, "stop", {"stop": [text.strip()[-1]]})
        self.assertEqual(after[1]["choices"][0]["finish_reason"], "stop")

    def test_no_op_fields_change_nothing(self):
        no_ops = readme_fields("#### No-op request fields")
        values = {"user": "user-1", "metadata": {"team": "a"}, "store": False, "service_tier": "auto",
                  "safety_identifier": "hash-1", "prompt_cache_key": "key-1", "prompt_cache_retention": "24h"}
        self.assertEqual(set(no_ops), set(values))
        for field, endpoints in no_ops.items():
            for path in [CHAT, COMPLETIONS] if endpoints == "both" else [CHAT]:
                with self.subTest(field=field, path=path):
                    base = self.base(path)
                    self.assertEqual(strip(self.post(path, {**base, field: values[field]})),
                                     strip(self.post(path, base)))

    def test_other_fields_are_refused_naming_them(self):
        for path, field, value in [(CHAT, "tool_choice", "required"),
                                   (CHAT, "reasoning_effort", "low"), (CHAT, "prompt", "x"),
                                   (COMPLETIONS, "suffix", "!"), (COMPLETIONS, "best_of", 2),
                                   (COMPLETIONS, "messages", MESSAGES), (COMPLETIONS, "max_completion_tokens", 2)]:
            with self.subTest(path=path, field=field):
                status, body = self.post(path, {**self.base(path), field: value})
                self.assertEqual(status, 400, body)
                self.assertEqual(body["error"]["param"], field)
                self.assertIn(field, body["error"]["message"])

    def test_an_unset_temperature_samples(self):
        """OpenAI and vLLM sample at temperature 1 when neither the request nor generation_config.json sets a
        temperature (the default model's sets none): eight choices are not all the greedy one."""
        for path in [CHAT, COMPLETIONS]:
            with self.subTest(path=path):
                unset = {k: v for k, v in self.base(path).items() if k not in ("temperature", "seed")}
                status, greedy = self.post(path, {**unset, "temperature": 0, "n": 8})
                self.assertEqual(status, 200, greedy)
                self.assertEqual(len({json.dumps(c.get("message", c.get("text"))) for c in greedy["choices"]}), 1)
                status, sampled = self.post(path, {**unset, "n": 8})
                self.assertEqual(status, 200, sampled)
                self.assertGreater(len({json.dumps(c.get("message", c.get("text"))) for c in sampled["choices"]}), 1)

    def test_text_parts_are_joined_with_newlines(self):
        """vLLM's string content format: a message's text parts joined with "\\n" (same prompt as the joined
        string)."""
        parts = [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "a story"}]
        joined = self.post(CHAT, {**self.base(CHAT), "messages": [{"role": "user", "content": "Tell me\na story"}]})
        self.assertEqual(strip(self.post(CHAT, {**self.base(CHAT), "messages": [{"role": "user", "content": parts}]})),
                         strip(joined))

    def test_tokenize_and_detokenize_as_vllm(self):
        """vLLM's /tokenize (a prompt, or messages through the chat template) and /detokenize: the ids are the
        ones a completion's prompt gets (usage.prompt_tokens), and decode back."""
        for path, content in [(CHAT, {"messages": MESSAGES, "tools": TOOLS}), (COMPLETIONS, {"prompt": "Once upon"})]:
            with self.subTest(path=path):
                status, tokens = self.post("/tokenize", {**content, "return_token_strs": True})
                self.assertEqual(status, 200, tokens)
                self.assertEqual(set(tokens), {"count", "max_model_len", "tokens", "token_strs"})
                self.assertEqual(tokens["count"], len(tokens["tokens"]))
                self.assertEqual(len(tokens["token_strs"]), tokens["count"])
                status, body = self.post(path, {**self.base(path), **content, "max_tokens": 1})
                self.assertEqual(status, 200, body)
                self.assertEqual(tokens["count"], body["usage"]["prompt_tokens"])
                status, text = self.post("/detokenize", {"tokens": tokens["tokens"]})
                self.assertEqual(status, 200, text)
                if path == COMPLETIONS:
                    self.assertTrue(text["prompt"].endswith("Once upon"), text)
                else:
                    self.assertIn("get_weather", text["prompt"])
        status, plain = self.post("/tokenize", {"prompt": "Once upon", "add_special_tokens": False})
        self.assertEqual(status, 200, plain)
        # (This tokenizer adds no BOS of its own, so here both are the same ids.)
        self.assertEqual(plain["tokens"], tokens["tokens"][len(tokens["tokens"]) - plain["count"]:])
        for path, body in [("/tokenize", {"prompt": "x", "n": 2}), ("/detokenize", {"tokens": [10 ** 6]})]:
            status, error = self.post(path, body)
            self.assertEqual(status, 400, error)
            if self.schemas:
                self.assert_valid("ErrorResponse", error)

    def test_created_is_the_responses_time(self):
        import time
        before = int(time.time())
        status, body = self.post(COMPLETIONS, self.base(COMPLETIONS))
        self.assertEqual(status, 200, body)
        self.assertGreaterEqual(body["created"], before)
        self.assertLessEqual(body["created"], int(time.time()))


class IgnoreEos(ServerTestCase):
    """ignore_eos changes the response: the default model, trained without end-of-text tokens between
    documents, never ends an output itself, so this server's copy of it also ends outputs at "." (its
    generation_config.json lists it as an EOS token, as checkpoints list several)."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="capserve-ignore-eos-")
        cls.addClassCleanup(cls.tmp.cleanup)
        cls.MODEL = os.path.join(cls.tmp.name, "capserve-moe-tiny")
        os.mkdir(cls.MODEL)
        for name in os.listdir(MODEL):
            if name != "generation_config.json":
                os.symlink(os.path.join(MODEL, name), os.path.join(cls.MODEL, name))
        with open(os.path.join(MODEL, "generation_config.json"), encoding="utf-8") as f:
            config = json.load(f)
        with open(os.path.join(MODEL, "tokenizer.json"), encoding="utf-8") as f:
            dot = json.load(f)["model"]["vocab"]["."]
        config["eos_token_id"] = [config["eos_token_id"], dot]
        with open(os.path.join(cls.MODEL, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f)
        super().setUpClass()

    def test_ignore_eos_generates_past_the_end(self):
        for path, content in [(COMPLETIONS, {"prompt": "Once upon a time"}), (CHAT, {"messages": MESSAGES})]:
            with self.subTest(path=path):
                body = {"model": self.server.model_id, **content, "max_tokens": 64, "temperature": 0}
                status, ended = call(self.server.http_port, "POST", path, body)
                self.assertEqual(status, 200, ended)
                self.assertEqual(ended["choices"][0]["finish_reason"], "stop")
                self.assertLess(ended["usage"]["completion_tokens"], 64)
                status, ignored = call(self.server.http_port, "POST", path, {**body, "ignore_eos": True})
                self.assertEqual(status, 200, ignored)
                self.assertEqual(ignored["choices"][0]["finish_reason"], "length")
                self.assertEqual(ignored["usage"]["completion_tokens"], 64)


def strip(response):
    """A response without what differs between any two calls (ids, times)."""
    status, body = response
    body = copy.deepcopy(body)
    for item in body if isinstance(body, list) else [body]:
        if isinstance(item, dict):
            for volatile in ("id", "created", "moe"):  # moe: the MoE layers' statistics, not the output
                item.pop(volatile, None)
            # The prefix cache serves a repeated prompt's tokens: not the output either.
            ((item.get("usage") or {}).get("prompt_tokens_details") or {}).pop("cached_tokens", None)
    return status, body


if __name__ == "__main__":
    main()
