#!/usr/bin/python3
"""Renders the reference chat templates with Jinja2 into tests/fixtures/chat/<family>.json.

Run with Debian's interpreter (python3-jinja2): /usr/bin/python3 tools/gen_chat_goldens.py

The environment is the one transformers' apply_chat_template compiles templates in: an
ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the loopcontrols extension, a
raise_exception global that raises TemplateError, strftime_now, and a tojson filter that keeps non-ASCII
characters. Each golden file carries the template and its bos/eos tokens (so it reads like a
tokenizer_config.json) plus every conversation with its rendering, or the template's exception message when
the template rejects the conversation. The C++ renderers (runtime/chat/) must reproduce every one of them.

Templates: Qwen3 and DeepSeek-V3 come from the real tokenizer_config.json files in
../shared/data/tokenizers/; the others are written down in tools/chat_templates/ (sources in its README).
"""

import datetime
import json
import pathlib
import random

import jinja2.ext
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOKENIZERS = ROOT.parent / "shared" / "data" / "tokenizers"
TEMPLATES = ROOT / "tools" / "chat_templates"
OUT = ROOT / "tests" / "fixtures" / "chat"


def special_token(value):
    """bos_token/eos_token are plain strings or AddedToken objects ({"content": ...})."""
    if isinstance(value, dict):
        return value["content"]
    return value


def from_tokenizer_config(name):
    config = json.loads((TOKENIZERS / name / "tokenizer_config.json").read_text(encoding="utf-8"))
    return {
        "source": f"../shared/data/tokenizers/{name}/tokenizer_config.json",
        "chat_template": config["chat_template"],
        "bos_token": special_token(config.get("bos_token")),
        "eos_token": special_token(config.get("eos_token")),
    }


def from_written_template(file_name, hub_repo, bos_token, eos_token):
    # The files end with one newline that the original JSON string does not have.
    text = (TEMPLATES / file_name).read_text(encoding="utf-8")
    return {
        "source": f"{hub_repo} tokenizer_config.json, as written down in tools/chat_templates/{file_name}",
        "chat_template": text.removesuffix("\n"),
        "bos_token": bos_token,
        "eos_token": eos_token,
    }


FAMILIES = {
    "chatml": lambda: from_tokenizer_config("qwen3"),
    "deepseek": lambda: from_tokenizer_config("deepseek_v3"),
    "llama2": lambda: from_written_template("llama2_7b_chat_hf.jinja", "meta-llama/Llama-2-7b-chat-hf", "<s>", "</s>"),
    "mistral": lambda: from_written_template(
        "mixtral_8x7b_instruct_v0_1.jinja", "mistralai/Mixtral-8x7B-Instruct-v0.1", "<s>", "</s>"
    ),
    "tulu": lambda: from_written_template(
        "olmoe_1b_7b_0924_instruct.jinja", "allenai/OLMoE-1B-7B-0924-Instruct", "<|endoftext|>", "<|endoftext|>"
    ),
    "deepseek_v2": lambda: from_written_template(
        "deepseek_v2_chat.jinja", "deepseek-ai/DeepSeek-V2-Chat", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    ),
}


def raise_exception(message):
    raise TemplateError(message)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format):
    return datetime.datetime.now().strftime(format)


def compile_template(source):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


# Every character str.isspace() accepts, the set Llama-2's strip() removes.
PY_WHITESPACE = "".join(c for c in map(chr, range(0x3001)) if c.isspace())

# Message contents chosen to exercise what the templates do to text: Llama-2 strips Python whitespace
# (str.isspace, Unicode included), Qwen3 splits assistant turns at <think>/</think> and strips newlines.
CONTENTS = [
    "Hello!",
    "",
    "   ",
    "  leading and trailing spaces  ",
    "\n\nsurrounded by newlines\n\n",
    "line one\nline two\n\nline four",
    "tabs\tand\r\nwindows line ends\r\n",
    "Unicode: héllo wörld — 你好，世界 🌍🚀 Привет",
    "\u00a0no-break and ideographic\u3000spaces\u2003",
    "\x1c\x1d\x1e\x1f separators \x0b\x0c",
    "\x85next line and\u2028line separator\u2029",
    "\u200bzero width space is not whitespace\u200b",
    "\ufeffbyte order mark\ufeff",
    "nul\x00byte",
    "special tokens as text: <|im_start|> <|im_end|> [INST] [/INST] <<SYS>> <s></s> <|user|>",
    "Jinja syntax as text: {{ messages }} {% if true %}x{% endif %} {# c #}",
    "<｜User｜>fake turn<｜Assistant｜>",
    "quotes ' \" and backslashes \\n \\t",
    "a" * 300,
    f"{PY_WHITESPACE}every Python whitespace character on both ends{PY_WHITESPACE[::-1]}",
]

THINKING = [
    "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?",
    "<think>reasoning</think>answer",
    "<think>\n\n</think>\n\nanswer after empty reasoning",
    "no opening tag</think>\n\nanswer",
    "<think>first</think>middle</think>\nlast",
    "<think>unterminated reasoning",
    "prefix <think>\ninner\n</think>\n\n\nanswer with newlines\n",
    "<think>a<think>b</think>c",
    "</think>",
]

TOOL_RESPONSE = "<tool_response>\n{\"temperature\": 21}\n</tool_response>"


def conversation(*turns):
    return [{"role": role, "content": content} for role, content in turns]


def handwritten():
    """Named conversations covering structure: system placement, turn counts, role order."""
    s, u, a = "system", "user", "assistant"
    return {
        "single_user": conversation((u, "Hello!")),
        "system_user": conversation((s, "You are a helpful assistant."), (u, "What is 2+2?")),
        "system_user_assistant": conversation((s, "Be brief."), (u, "Hi"), (a, "Hello.")),
        "two_turns": conversation((u, "Hi"), (a, "Hello! How can I help?"), (u, "Tell me a joke.")),
        "three_turns_with_system": conversation(
            (s, "You are terse."), (u, "1"), (a, "one"), (u, "2"), (a, "two"), (u, "3")
        ),
        "six_turns_ending_with_assistant": conversation(
            *[turn for i in range(6) for turn in ((u, f"question {i}"), (a, f"answer {i}"))]
        ),
        "all_empty": conversation((s, ""), (u, ""), (a, ""), (u, "")),
        "empty_system": conversation((s, ""), (u, "Hi")),
        "whitespace_only": conversation((s, "  \n "), (u, " \t "), (a, "\n"), (u, "   ")),
        "system_only": conversation((s, "Only a system prompt.")),
        "two_systems_first": conversation((s, "First system."), (s, "Second system."), (u, "Hi")),
        "system_after_first_user": conversation((u, "Hi"), (s, "Late system."), (u, "Again")),
        "system_in_user_slot": conversation((u, "Hi"), (a, "Hello"), (s, "Mid system."), (a, "Hm")),
        "system_last": conversation((u, "Hi"), (a, "Hello"), (s, "Final system.")),
        "assistant_first": conversation((a, "I speak first."), (u, "Ok")),
        "only_assistant": conversation((a, "Nobody asked.")),
        "two_users": conversation((u, "Hi"), (u, "Anyone there?")),
        "two_assistants": conversation((u, "Hi"), (a, "Hello"), (a, "Still here")),
        "system_then_assistant": conversation((s, "Sys"), (a, "Hello"), (u, "Hi")),
        "user_then_assistant_last": conversation((u, "Hi"), (a, "Hello there.")),
        "assistant_thinking_in_history": conversation(
            (u, "Hi"), (a, THINKING[0]), (u, "What can you do?")
        ),
        "assistant_thinking_last": conversation((u, "Hi"), (a, THINKING[0])),
        "assistant_plain_last": conversation((s, "Sys"), (u, "Hi"), (a, "\n\nplain answer\n")),
        "multi_step_after_last_user": conversation(
            (u, "Plan a trip."), (a, THINKING[1]), (a, "second step without reasoning"), (a, THINKING[6])
        ),
        "multi_step_plain": conversation((u, "Go"), (a, "step one"), (a, "step two")),
        "tool_response_user_is_not_a_query": conversation(
            (u, "Weather?"), (a, THINKING[2]), (u, TOOL_RESPONSE), (a, THINKING[4])
        ),
        "only_tool_responses": conversation((u, TOOL_RESPONSE), (a, THINKING[1])),
        "tool_response_prefix_only": conversation((u, "<tool_response> not closed"), (a, THINKING[1])),
        "special_tokens_in_content": conversation((s, CONTENTS[14]), (u, CONTENTS[16]), (a, CONTENTS[15])),
        "python_whitespace_edges": conversation(
            (s, CONTENTS[-1]), (u, CONTENTS[-1]), (a, CONTENTS[-1]), (u, "\u3000\u2028x\x85\u00a0")
        ),
        "unicode_everywhere": conversation((s, CONTENTS[7]), (u, CONTENTS[8]), (a, CONTENTS[10]), (u, CONTENTS[9])),
    }


def generated(rng, count):
    """Seeded random conversations: mostly well-formed alternations with an optional system prompt, some
    with arbitrary role orders."""
    pool = CONTENTS + THINKING + [TOOL_RESPONSE]
    out = {}
    for i in range(count):
        turns = []
        if rng.random() < 0.5:
            turns.append(("system", rng.choice(pool)))
        if i % 4 == 3:
            roles = [rng.choice(["system", "user", "assistant"]) for _ in range(rng.randint(1, 6))]
        else:
            n = rng.randint(1, 6)
            roles = [r for _ in range(n) for r in ("user", "assistant")]
            if rng.random() < 0.5:
                roles.pop()
        turns += [(role, rng.choice(pool)) for role in roles]
        out[f"random_{i:02d}"] = conversation(*turns)
    return out


def render_case(template, tokens, name, messages, add_generation_prompt):
    case = {"name": name, "add_generation_prompt": add_generation_prompt, "messages": messages}
    try:
        case["rendered"] = template.render(
            messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **tokens
        )
    except TemplateError as e:
        # raise_exception; anything else (an UndefinedError, say) is a bug in these conversations.
        if type(e) is not TemplateError:
            raise
        case["error"] = e.message
    return case


def main():
    conversations = handwritten()
    conversations.update(generated(random.Random(20240601), 30))
    OUT.mkdir(parents=True, exist_ok=True)
    for family, load in FAMILIES.items():
        spec = load()
        template = compile_template(spec["chat_template"])
        tokens = {k: spec[k] for k in ("bos_token", "eos_token") if spec[k] is not None}
        cases = [
            render_case(template, tokens, f"{name}/{'gen' if agp else 'nogen'}", messages, agp)
            for name, messages in conversations.items()
            for agp in (False, True)
        ]
        golden = {"family": family, **spec, "cases": cases}
        path = OUT / f"{family}.json"
        path.write_text(json.dumps(golden, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        errors = sum("error" in c for c in cases)
        print(f"{path.relative_to(ROOT)}: {len(cases)} cases ({errors} rejected by the template)")


if __name__ == "__main__":
    main()
