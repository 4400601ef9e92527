#!/usr/bin/env python3
"""Renders the Jinja2 feature cases below with Python Jinja2 in transformers' chat-template environment and
writes tests/fixtures/chat/jinja_cases.json, which tests/unit/runtime/chat/test_jinja_engine.cpp checks the
C++ engine against: each case is a template and its variables, and the output or the exception class. It also
writes tests/fixtures/chat/jinja_builtins.json, the names of Jinja2's built-in filters, tests and default globals,
each of which the engine must implement or refuse at compile time by name.

Run with Debian's interpreter (python3-jinja2): /usr/bin/python3 tools/gen_jinja_cases.py
The environment is the one ../shared/data/chat_templates/render_goldens.py builds (imported from there)."""
import json
import os
import sys
from datetime import datetime

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(os.environ.get("CAPSERVE_SHARED_DATA_DIR", os.path.join(ROOT, "..", "shared", "data")),
                                "chat_templates"))
from render_goldens import make_env  # noqa: E402

MSGS = [{"role": "system", "content": "sys"}, {"role": "user", "content": " Hi there "},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Ünï 日本 🚀"}]
TOOLS = [{"type": "function", "function": {"name": "f", "description": "d\n\"q\"", "parameters": {
    "type": "object", "properties": {"b": {"type": "number"}, "a": {"type": "string", "enum": ["x", "y"]}}}}}]

CASES = [
    # whitespace control
    ("ws_trim_lstrip", "a\n  {% if true %}\n  b\n  {% endif %}\nc\n", {}),
    ("ws_minus", "a  {%- if true -%}  b  {%- endif -%}  c", {}),
    ("ws_plus", "a\n  {%+ if true +%}\nb{% endif %}", {}),
    ("ws_var_minus", "x  {{- 1 -}}  y", {}),
    ("ws_comment", "a\n  {# c #}\nb {#- d -#} c", {}),
    ("trailing_newline", "line\n", {}),
    # expressions
    ("arith", "{{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 1 + 2 * 3 - 4 }} {{ 10 / 4 * 2 }}", {}),
    ("floats", "{{ 1.0 }} {{ 1e16 }} {{ 0.0001 }} {{ 0.00001 }} {{ 2.5 }} {{ 1/3 }} {{ 3 * 1.1 }} {{ 1e300 * 1e10 }}", {}),
    ("repr", "{{ ['a', \"b'c\", 1, none, true, 2.0] }} {{ {'k': 'v', 'n': [1]} }} {{ ('t',) }}", {}),
    ("concat_tilde", "{{ 'a' ~ 1 ~ none ~ undefined_var ~ [1] }}", {}),
    ("in_notin", "{{ 'a' in 'cat' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 'z' not in 'cat' }} {{ 'x' in undefined_var }}", {}),
    ("compare_chain", "{{ 1 < 2 < 3 }} {{ 1 < 3 < 2 }} {{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }} {{ 1 == 1.0 }} {{ true == 1 }}", {}),
    ("cond_expr", "{{ 'y' if x else 'n' }}|{{ 'only' if x }}|{{ 'a' if false else 'b' if true else 'c' }}", {"x": 0}),
    ("and_or_values", "{{ 0 or 'b' }} {{ 'a' and 'b' }} {{ '' and 'b' }}|{{ none or [] }}|{{ not 0 }}", {}),
    ("slicing", "{{ m[::-1] }} {{ m[1:3] }} {{ m[-2:] }} {{ s[::-1] }} {{ s[1:-1] }} {{ s[::2] }} {{ m[10:] }}",
     {"m": [1, 2, 3, 4, 5], "s": "héllo→"}),
    ("indexing", "{{ m[0] }} {{ m[-1] }} {{ s[1] }} {{ d['k'] }} {{ d.k }} {{ m[9] is defined }} {{ d.zz is defined }}",
     {"m": [1, 2], "s": "hé", "d": {"k": "v"}}),
    ("percent_format", "{{ '%s-%d' % ('a', 3) }} {{ 'x%sy' % 5 }} {{ '100%%' % () }}", {}),
    ("string_literals", "{{ 'a\\nb\\t\\'c\\' \\u00e9 \\x41' }}{{ \"d\" 'e' }}", {}),
    ("dict_int_keys", "{% set d = {1: 'a', 2: 'b'} %}{{ d[1] }}{{ d[2] }}{% for k, v in d | dictsort %}{{ k }}{{ v }}{% endfor %}", {}),
    # statements
    ("for_loop_vars", "{% for x in m %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}"
     "{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.previtem }}{{ loop.nextitem }}{{ loop.cycle('a', 'b') }};{% endfor %}",
     {"m": ["x", "y", "z"]}),
    ("for_filter_else", "{% for x in m if x > 1 %}{{ x }}{{ loop.length }}{% else %}none{% endfor %}|"
     "{% for x in [] %}{{ x }}{% else %}empty{% endfor %}", {"m": [1, 2, 3]}),
    ("for_unpack_dict", "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for k in d %}{{ k }}{% endfor %}",
     {"d": {"b": 1, "a": 2}}),
    ("break_continue", "{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 5 %}{% break %}{% endif %}{{ x }}{% endfor %}", {}),
    ("scoping", "{% set c = 0 %}{% for i in [1, 2] %}{% set c = c + i %}{{ c }}{% endfor %}{{ c }}", {}),
    ("namespace", "{% set ns = namespace(c=0, items=[]) %}{% for i in [1, 2, 3] %}{% set ns.c = ns.c + i %}"
     "{% set ns.items = ns.items + [i] %}{% endfor %}{{ ns.c }} {{ ns.items }}", {}),
    ("set_block", "{% set x %}  inner {{ 1 + 1 }}\n{% endset %}[{{ x }}]", {}),
    ("set_tuple", "{% set a, b = [1, 2] %}{{ b }}{{ a }}", {}),
    ("macro", "{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('A') }} {{ greet('B', punct='?') }} {{ greet(punct='.', name='C') }}", {}),
    ("macro_scope", "{% set outer = 'o' %}{% macro m() %}{{ outer }}{{ inner is defined }}{% endmacro %}{% set inner = 1 %}{{ m() }}", {}),
    ("call_block", "{% macro wrap(tag) %}<{{ tag }}>{{ caller() }}</{{ tag }}>{% endmacro %}{% call wrap('b') %}bold {{ 1 }}{% endcall %}", {}),
    ("call_block_args", "{% macro each(xs) %}{% for x in xs %}{{ caller(x) }}{% endfor %}{% endmacro %}{% call(v) each([1, 2]) %}[{{ v }}]{% endcall %}", {}),
    ("filter_block", "{% filter upper %}hello {{ 'x' }}{% endfilter %}", {}),
    ("generation_block", "a{% generation %}gen {{ 1 }}{% endgeneration %}b", {}),
    ("if_elif", "{% for x in [1, 2, 3] %}{% if x == 1 %}one{% elif x == 2 %}two{% else %}many{% endif %}{% endfor %}", {}),
    ("star_args", "{% macro f(a, b) %}{{ a }}{{ b }}{% endmacro %}{{ f(*[1, 2]) }}{{ f(**{'a': 3, 'b': 4}) }}", {}),
    # filters
    ("tojson", "{{ t | tojson }}\n{{ t | tojson(indent=2) }}\n{{ t | tojson(sort_keys=true) }}\n"
     "{{ {'a': 'é'} | tojson(ensure_ascii=true) }}{{ [1, 2] | tojson(separators=(',', ':')) }}{{ 1.5 | tojson }}"
     "{{ none | tojson }}{{ 'a\\u0001\\n\"' | tojson }}", {"t": TOOLS}),
    ("tojson_indent_str", "{{ {'a': [1, {}], 'b': []} | tojson(indent='\\t') }}", {}),
    ("string_filters", "{{ ' Ab cD ' | trim }}|{{ 'xxaxx' | trim('x') }}|{{ 'hello world-wide (x)' | title }}|{{ 'hELLO' | capitalize }}|"
     "{{ 'a' | upper }}{{ 'B' | lower }}|{{ 'aaa' | replace('a', 'b', 2) }}|{{ 'a b  c' | wordcount }}", {}),
    ("indent", "{{ 'a\\nb\\n\\nc' | indent }}|{{ 'a\\nb' | indent(2, true) }}|{{ 'a\\n\\nb' | indent('> ', blank=true) }}", {}),
    ("list_filters", "{{ m | length }} {{ m | first }} {{ m | last }} {{ m | join(', ') }} {{ m | reverse | list }} {{ m | sort }} "
     "{{ m | unique | list }} {{ m | sum }} {{ [] | first is defined }} {{ 'abc' | list }}", {"m": [3, 1, 2, 1]}),
    ("select_map", "{{ ms | selectattr('role', 'equalto', 'user') | map(attribute='content') | join('|') }} "
     "{{ ms | rejectattr('role', 'in', ['user', 'system']) | list | length }} {{ [0, 1, 2] | select | list }} "
     "{{ [1, 2, 3] | select('odd') | list }} {{ ['a', 'b'] | map('upper') | join }} {{ ms | map(attribute='x', default='-') | join }}",
     {"ms": MSGS}),
    ("dictsort_items", "{{ d | dictsort }} {{ d | dictsort(by='value', reverse=true) }} {{ d | items | list }}",
     {"d": {"b": 2, "A": 3, "c": 1}}),
    ("default", "{{ u | default('d') }} {{ '' | default('e') }} {{ '' | default('f', true) }} {{ none | default('g') }} {{ u | d('h') }}", {}),
    ("numbers", "{{ '42' | int }} {{ '4.7' | int }} {{ 'x' | int(7) }} {{ 3.9 | int }} {{ '2.5' | float }} {{ -3 | abs }} "
     "{{ 2.5 | round }} {{ 3.14159 | round(2) }} {{ 2.1 | round(0, 'ceil') }} {{ 5 | string }}", {}),
    ("sort_attr", "{{ ms | sort(attribute='role') | map(attribute='content') | join(',') }}", {"ms": MSGS}),
    ("escape", "{{ '<a href=\"x\">&\\'' | e }}", {}),
    # the rest of Jinja2's built-in filters (tests/unit/runtime/chat/test_jinja_engine.cpp checks that each is
    # either here or refused at compile time)
    ("min_max", "{{ m | min }} {{ m | max }} {{ ['b', 'A', 'a', 'B'] | min }} {{ ['b', 'A', 'a', 'B'] | max }} "
     "{{ ['b', 'A', 'a', 'B'] | min(case_sensitive=true) }} {{ ['b', 'A', 'a', 'B'] | max(true) }} "
     "{{ ms | min(attribute='role') | tojson }} {{ ms | max(attribute='content') | tojson }} [{{ [] | max }}] "
     "{{ [] | min is undefined }} {{ [2.5, 1, true] | min }} {{ 'hello' | max }} {{ {'b': 1, 'a': 2} | min }} "
     "{{ [[1, 2], [1, 1]] | max }} {{ [{'a': 1}] | max(attribute='x') }} {{ [[3, 'b'], [1, 'c']] | min(attribute='0') }}",
     {"m": [3, 1, 2, 1], "ms": MSGS}),
    ("min_max_tool_args", "{% for p in props | dictsort %}{{ p[0] }}{% endfor %} {{ props.values() | map(attribute='type') | max }}",
     {"props": TOOLS[0]["function"]["parameters"]["properties"]}),
    ("err_min_mixed", "{{ [1, 'a'] | min }}", {}),
    ("err_max_missing_attr", "{{ [{'a': 1}, {}] | max(attribute='a') }}", {}),
    ("batch_slice", "{{ m | batch(2) | list }} {{ m | batch(3, 'x') | list }} {% for row in m | batch(4) %}{{ row | join }};{% endfor %} "
     "{{ m | slice(2) | list }} {{ m | slice(3, 0) | list }} {{ m | slice(7) | list }} {{ [] | batch(2) | list }}",
     {"m": [1, 2, 3, 4, 5]}),
    ("err_slice_zero", "{{ [1] | slice(0) | list }}", {}),
    ("center_truncate", "[{{ 'ab' | center(7) }}][{{ 'abc' | center(8) }}][{{ 'é' | center(4) }}][{{ 'long' | center(2) }}]"
     "[{{ 'x' | center }}][{{ s | truncate(20) }}][{{ s | truncate(20, true) }}][{{ s | truncate(20, false, '…', 0) }}]"
     "[{{ 'short' | truncate(4) }}][{{ 'short one' | truncate(5, leeway=0) }}][{{ s | truncate }}]",
     {"s": "The quick brown fox jumps over the lazy dög"}),
    ("format", "{{ '%s-%d' | format('a', 3) }} {{ '%s' | format([1, 2]) }} {{ 'x%sy' | format(none) }} {{ '100%%' | format }}", {}),
    ("filesizeformat", "{{ 0 | filesizeformat }} {{ 1 | filesizeformat }} {{ 999 | filesizeformat }} {{ 1000 | filesizeformat }} "
     "{{ 1500000 | filesizeformat }} {{ 1024 | filesizeformat(true) }} {{ 3.7e9 | filesizeformat }} {{ 1e30 | filesizeformat }} "
     "{{ '2048' | filesizeformat(binary=true) }} {{ -5 | filesizeformat }} {{ 1.5 | filesizeformat }} {{ true | filesizeformat }}", {}),
    ("urlencode", "{{ 'a b&c=d/é~_.-' | urlencode }} {{ {'q': 'a b', 'n': 1, 'x/y': none} | urlencode }} "
     "{{ [('k', 'v w'), ('z', '/')] | urlencode }} {{ 42 | urlencode }} [{{ u | urlencode }}]", {}),
    ("groupby", "{% for g in ms | groupby('role') %}{{ g.grouper }}={{ g.list | map(attribute='content') | join(',') }};{% endfor %} "
     "{% for role, items in ms | groupby('role') %}{{ role }}{{ items | length }}{% endfor %} "
     "{{ [{'k': 'B'}, {'k': 'b'}, {'k': 'a'}] | groupby('k') | map(attribute='grouper') | join }} "
     "{{ [{'k': 'B'}, {'k': 'b'}, {'k': 'a'}] | groupby('k', case_sensitive=true) | map(attribute='grouper') | join }} "
     "{{ [{'k': 1}, {}] | groupby('k', default=0) | list }} {{ [[1, 'a'], [0, 'b'], [1, 'c']] | groupby(0) | list }} "
     "{{ (ms | groupby('role'))[0].list | length }}", {"ms": MSGS}),
    ("forceescape", "{{ '<a>&\\'\"' | forceescape }}", {}),
    ("tests_filter_test", "{{ 'upper' is filter }} {{ 'nope' is filter }} {{ 'xmlattr' is filter }} {{ 'odd' is test }} "
     "{{ 'filter' is test }} {{ 'min' is filter }}", {}),
    # tests
    ("tests", "{{ none is none }} {{ 1 is number }} {{ true is number }} {{ 1 is integer }} {{ true is integer }} {{ 1.0 is float }} "
     "{{ 's' is string }} {{ {} is mapping }} {{ [] is iterable }} {{ 's' is sequence }} {{ u is iterable }} {{ true is boolean }} "
     "{{ false is false }} {{ 0 is false }} {{ 3 is odd }} {{ 4 is even }} {{ 9 is divisibleby 3 }} {{ 'ab' is lower }} "
     "{{ u is undefined }} {{ 1 is eq 1 }} {{ 2 is gt 1 }} {{ 'a' is in 'abc' }} {{ none is not none }} {{ range is callable }}", {}),
    # methods
    ("str_methods", "{{ ' a b '.strip() }}|{{ 'xyx'.strip('x') }}|{{ '  l'.lstrip() }}|{{ 'r  '.rstrip() }}|{{ 'a,b,,c'.split(',') }}|"
     "{{ ' a  b '.split() }}|{{ 'a b c'.split(' ', 1) }}|{{ 'a b c'.rsplit(' ', 1) }}|{{ 'abc'.startswith('a') }}|"
     "{{ 'abc'.endswith(('x', 'c')) }}|{{ 'aXa'.replace('a', 'b') }}|{{ 'ab cd'.title() }}|{{ 'x'.upper() }}|{{ 'abcb'.find('b') }}|"
     "{{ 'abcb'.rfind('b') }}|{{ 'abcb'.count('b') }}|{{ '-'.join(['a', 'b']) }}|{{ 'a\\nb\\r\\nc'.splitlines() }}|{{ '12'.isdigit() }}", {}),
    ("dict_methods", "{{ d.get('a') }} {{ d.get('z') }} {{ d.get('z', 5) }} {{ d.keys() | list }} {{ d.values() | list }} {{ d.items() | list }}",
     {"d": {"a": 1, "b": [2]}}),
    ("list_methods", "{{ m.count(1) }} {{ m.index(2) }}", {"m": [1, 2, 1]}),
    ("globals", "{{ range(3) | list }} {{ range(1, 7, 2) | list }} {{ range(5, 0, -2) | list }} {{ dict(a=1, b='x') }} "
     "{{ strftime_now('%Y-%m-%d %H:%M %A %B %d') }}", {}),
    ("unicode_len", "{{ s | length }} {{ s[0] }} {{ s[-1] }} {{ s.upper() }}", {"s": "日本語🚀"}),
    # errors
    ("err_raise", "{{ raise_exception('bad ' ~ 1) }}", {}),
    ("err_undefined_attr", "{{ missing.attr }}", {}),
    ("err_undefined_add", "{{ missing + 'x' }}", {}),
    ("err_none_iter", "{% for x in none %}{% endfor %}", {}),
    ("err_none_add", "{{ none + 'x' }}", {}),
    ("err_none_in", "{{ 'a' in none }}", {}),
    ("err_tojson_undefined", "{{ missing | tojson }}", {}),
    ("err_unpack", "{% for a, b in [[1, 2, 3]] %}{% endfor %}", {}),
    ("err_ns_underscore", "{% set ns = namespace() %}{% set ns._x = 1 %}", {}),
    ("err_list_append", "{% set l = [] %}{{ l.append(1) }}", {}),
    ("err_set_attr_non_ns", "{% set d = {} %}{% set d.x = 1 %}", {}),
    ("err_call_str", "{{ 'x'() }}", {}),
    ("err_compare", "{{ 1 < 'a' }}", {}),
    ("err_div_zero", "{{ 1 / 0 }}", {}),
    ("err_undefined_method", "{{ none.strip() }}", {}),
]


def main():
    env = make_env(datetime.fromisoformat("2025-01-15T10:30:00"))
    out = []
    for name, source, variables in CASES:
        record = {"name": name, "template": source, "variables": variables}
        try:
            record["output"] = env.from_string(source).render(**variables)
        except Exception as e:  # the exception class is the expected outcome
            record["error"] = type(e).__name__
        out.append(record)
    path = os.path.join(ROOT, "tests", "fixtures", "chat", "jinja_cases.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"{len(out)} cases -> {path}")
    import jinja2.defaults
    builtins = {"jinja2": jinja2.__version__, "filters": sorted(env.filters), "tests": sorted(env.tests),
                "globals": sorted(jinja2.defaults.DEFAULT_NAMESPACE)}
    path = os.path.join(ROOT, "tests", "fixtures", "chat", "jinja_builtins.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(builtins, f, indent=1)
        f.write("\n")
    print(f"{len(builtins['filters'])} filters, {len(builtins['tests'])} tests, {len(builtins['globals'])} globals -> {path}")


if __name__ == "__main__":
    main()
