// The Python str semantics the Jinja engine relies on, checked against what CPython returns.
#include <gtest/gtest.h>

#include "runtime/chat/python_str.h"

namespace capserve::runtime::chat {
namespace {

TEST(PythonStr, StripRemovesUnicodeWhitespaceLikeStrIsspace) {
  EXPECT_EQ(py_strip(" \t\n\v\f\r\x1c\x1d\x1e\x1fx \r\n"), "x");
  // U+00A0, U+3000, U+2003 | U+0085, U+2028, U+2029, U+1680, U+202F, U+205F
  EXPECT_EQ(py_strip("\xc2\xa0\xe3\x80\x80x\xe2\x80\x83"), "x");
  EXPECT_EQ(py_strip("\xc2\x85\xe2\x80\xa8x y\xe2\x80\xa9\xe1\x9a\x80\xe2\x80\xaf\xe2\x81\x9f"), "x y");
  EXPECT_EQ(py_strip("   "), "");
  EXPECT_EQ(py_strip(""), "");
}

TEST(PythonStr, StripKeepsWhatPythonKeeps) {
  // U+200B (zero width space) and U+FEFF (BOM) are not whitespace to Python; neither is NUL.
  EXPECT_EQ(py_strip("\xe2\x80\x8bx\xef\xbb\xbf"), "\xe2\x80\x8bx\xef\xbb\xbf");
  EXPECT_EQ(py_strip(std::string_view("\0x\0", 3)), std::string_view("\0x\0", 3));
  // Invalid UTF-8 is left alone rather than misread.
  EXPECT_EQ(py_strip("\x85x\xa0"), "\x85x\xa0");
}

}  // namespace
}  // namespace capserve::runtime::chat
