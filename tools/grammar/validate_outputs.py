"""Validates capserve-bench-grammar's outputs (JSON lines on stdin) against their schemas with jsonschema.

Usage: build/runtime/grammar/capserve-bench-grammar ... | tools/.venv-xgrammar/bin/python tools/grammar/validate_outputs.py
Prints each output that is not valid JSON or not valid under its schema, and each schema refused, then the
counts; exits 1 if any.
An output cut at --max-tokens (not terminated) is counted apart: it is a prefix, not an output.
"""
import json
import sys

import jsonschema

CORPUS = "tests/fixtures/grammar/schemas.json"


def main():
    schemas = {e["name"]: e["schema"] for e in json.load(open(sys.argv[1] if len(sys.argv) > 1 else CORPUS))}
    valid = invalid = cut = refused = 0
    for line in sys.stdin:
        r = json.loads(line)
        if "error" in r:
            refused += 1
            print(f"{r['name']}: refused: {r['error']}")
            continue
        if "text" not in r:
            continue
        if not r["terminated"]:
            cut += 1
            continue
        try:
            jsonschema.validate(json.loads(r["text"]), schemas[r["name"]])
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            invalid += 1
            print(f"{r['name']}: {r['text']!r}: {str(e).splitlines()[0]}")
    print(f"outputs: {valid} valid, {invalid} invalid, {cut} cut at the token limit; {refused} schemas refused")
    return 1 if invalid or refused else 0


if __name__ == "__main__":
    sys.exit(main())
