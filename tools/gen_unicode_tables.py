#!/usr/bin/env python3
"""Writes runtime/tokenizer/unicode_tables.h: the Unicode-version corrections that make the C++ tokenizer's
libraries (PCRE2 10.42, utf8proc 2.8) agree with Hugging Face tokenizers on every code point.

1. Regex general categories. PCRE2 10.42 (Debian 12) has Unicode 14.0 tables; the Oniguruma inside HF tokenizers
   matches \\p{L}, \\p{N}, ... with Unicode 16.0 tables. The table lists, by category, the code points Unicode 14.0
   leaves unassigned and 16.0 assigns; the regex translation adds them to each \\p{...}. (U+1171E also moved from
   Mn to Mc; it stays a mark.)
2. NFC. HF normalizes with old Unicode data (about 10.0): to it, marks encoded since then have combining class 0
   and decompose to nothing, so it neither reorders nor composes them; utf8proc (Unicode 15.0) does. The table
   lists the code points where the two differ, found by asking both libraries, plus the second parts of the
   decompositions they disagree on. The normalizer keeps these characters as they are and normalizes the text
   between them separately, which is exactly what the old data does.

Needs Python 3.11 (its unicodedata is Unicode 14.0, PCRE2 10.42's version), unicodedata2 16.0.0, the `tokenizers`
of tools/.venv and libutf8proc.so.2:
    tools/.venv/bin/pip install unicodedata2==16.0.0
    tools/.venv/bin/python tools/gen_unicode_tables.py
"""
import ctypes
import sys
import unicodedata
from pathlib import Path

import unicodedata2
from tokenizers import normalizers

OUT = Path(__file__).resolve().parent.parent / "runtime" / "tokenizer" / "unicode_tables.h"


def ranges(code_points):
    out = []
    for c in sorted(code_points):
        if out and out[-1][1] == c - 1:
            out[-1][1] = c
        else:
            out.append([c, c])
    return out


def class_literals(code_points):
    """The ranges as PCRE2 class text in C++ string literals of at most ~90 characters (joined by the compiler)."""
    parts = [f"\\\\x{{{lo:X}}}" if lo == hi else f"\\\\x{{{lo:X}}}-\\\\x{{{hi:X}}}" for lo, hi in ranges(code_points)]
    literals, current = [], ""
    for part in parts:
        if len(current) + len(part) > 90:
            literals.append(current)
            current = ""
        current += part
    literals.append(current)
    return literals


def category_additions():
    added = {}
    for c in range(0x110000):
        if 0xD800 <= c <= 0xDFFF:
            continue
        old = unicodedata.category(chr(c))
        new = unicodedata2.category(chr(c))
        if old == "Cn" and new != "Cn":
            added.setdefault(new, []).append(c)
    return added


class Utf8proc:
    def __init__(self):
        self.lib = ctypes.CDLL("libutf8proc.so.2")
        self.libc = ctypes.CDLL("libc.so.6")
        self.libc.free.argtypes = [ctypes.c_void_p]
        self.lib.utf8proc_get_property.restype = ctypes.POINTER(ctypes.c_int16 * 2)
        for name in ("utf8proc_NFD", "utf8proc_NFC"):
            getattr(self.lib, name).restype = ctypes.c_void_p
            getattr(self.lib, name).argtypes = [ctypes.c_char_p]

    def _call(self, fn, text):
        p = fn(text.encode("utf-8"))
        out = ctypes.string_at(p).decode("utf-8")
        self.libc.free(p)
        return out

    def nfd(self, text):
        return self._call(self.lib.utf8proc_NFD, text)

    def nfc(self, text):
        return self._call(self.lib.utf8proc_NFC, text)

    def combining_class(self, c):
        return self.lib.utf8proc_get_property(c).contents[1]


def nfc_blockers():
    up = Utf8proc()
    hf_nfd = normalizers.NFD()
    hf_nfc = normalizers.NFC()
    blockers = set()
    for c in range(1, 0x110000):  # NUL cannot pass through the C API, and both leave it alone
        ch = chr(c)
        if unicodedata2.category(ch) in ("Cn", "Cs"):
            continue
        if (hf_nfd.normalize_str(ch) != ch) != (up.nfd(ch) != ch):
            blockers.add(c)
            # Decomposed text must not be composed into it either: stop at its later parts too.
            if hf_nfc.normalize_str(up.nfd(ch)) != up.nfc(up.nfd(ch)):
                blockers.update(ord(p) for p in up.nfd(ch)[1:])
        combining = unicodedata2.combining(ch)
        if combining or up.combining_class(c):
            # Reordering shows whether a library gives the character a combining class: after U+0301 (230) when
            # it is below 230, before U+0334 (1) otherwise.
            probe = "a\u0301" + ch if combining < 230 else "a" + ch + "\u0334"
            if hf_nfd.normalize_str(probe) != up.nfd(probe):
                blockers.add(c)
    return sorted(blockers)


def main():
    if unicodedata.unidata_version != "14.0.0" or unicodedata2.unidata_version != "16.0.0":
        sys.exit(f"needs unicodedata 14.0.0 (Python 3.11) and unicodedata2 16.0.0, have "
                 f"{unicodedata.unidata_version} and {unicodedata2.unidata_version}")
    added = category_additions()
    blockers = nfc_blockers()
    lines = [
        "#pragma once",
        "// Generated by tools/gen_unicode_tables.py; do not edit. Unicode-version corrections that make PCRE2 10.42",
        "// (Unicode 14) and utf8proc 2.8 (Unicode 15) agree with Hugging Face tokenizers; see that script.",
        "#include <cstdint>",
        "#include <string_view>",
        "",
        "namespace capserve::runtime::unicode {",
        "",
        "struct CategoryAdditions {",
        "  std::string_view category;",
        "  std::string_view ranges;  // PCRE2 character-class text",
        "};",
        "",
        "// By general category: code points unassigned in Unicode 14.0 and assigned in 16.0.",
        "inline constexpr CategoryAdditions kUnicode16Additions[] = {",
    ]
    for category in sorted(added):
        literals = class_literals(added[category])
        lines.append(f'    {{"{category}",')
        lines += [f'     "{text}"' for text in literals[:-1]]
        lines.append(f'     "{literals[-1]}"}},')
    lines += ["};", "",
              "// Code points HF's NFC leaves in place (unknown to its Unicode data) where utf8proc would reorder or",
              "// compose them; sorted.",
              "inline constexpr char32_t kNfcBlockers[] = {"]
    row = []
    for c in blockers:
        row.append(f"0x{c:X},")
        if len(" ".join(row)) > 96:
            lines.append("    " + " ".join(row))
            row = []
    if row:
        lines.append("    " + " ".join(row))
    lines += ["};", "", "}  // namespace capserve::runtime::unicode", ""]
    OUT.write_text("\n".join(lines), encoding="utf-8")
    print(f"wrote {OUT}: {sum(map(len, added.values()))} category additions, {len(blockers)} NFC blockers")


if __name__ == "__main__":
    main()
