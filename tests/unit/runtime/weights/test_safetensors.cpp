#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <random>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "kernels/dtype.h"
#include "runtime/load_error.h"
#include "runtime/weights/safetensors_file.h"
#include "tests/unit/runtime/weights/safetensors_test_files.h"

namespace {

namespace fs = std::filesystem;
using capserve::kernels::DType;
using capserve::runtime::LoadError;
using capserve::runtime::SafetensorsFile;
using capserve::runtime::TensorInfo;
using capserve::testing::le_u64;
using capserve::testing::st_bytes;
using capserve::testing::TempDir;
using capserve::testing::write_file;

template <typename T>
std::string raw(std::initializer_list<T> values) {
  std::string out(values.size() * sizeof(T), '\0');
  std::memcpy(out.data(), values.begin(), out.size());
  return out;
}

float bf16_to_float(std::uint16_t bits) {
  const std::uint32_t u = static_cast<std::uint32_t>(bits) << 16;
  float f = 0;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <typename T>
T read_at(const std::byte* p, std::size_t index) {
  T v{};
  std::memcpy(&v, p + index * sizeof(T), sizeof(T));
  return v;
}

// Opens `p`, expecting a LoadError; returns its message (empty and a test failure when nothing was thrown).
std::string open_error(const fs::path& p) {
  try {
    SafetensorsFile::open(p);
  } catch (const LoadError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected LoadError opening " << p;
  return {};
}

bool has(const std::string& msg, const std::string& part) {
  return msg.find(part) != std::string::npos;
}

class SafetensorsTest : public ::testing::Test {
 protected:
  // Writes `bytes` to a fresh file; expects EXPECT_THROW(LoadError) and a message naming the file and each
  // part.
  void expect_error(const std::string& bytes, std::initializer_list<std::string> parts) {
    const fs::path p = dir_.path() / ("case" + std::to_string(n_++) + ".safetensors");
    write_file(p, bytes);
    EXPECT_THROW(SafetensorsFile::open(p), LoadError);
    const std::string msg = open_error(p);
    EXPECT_TRUE(has(msg, p.string())) << "message does not name the file: " << msg;
    for (const auto& part : parts) EXPECT_TRUE(has(msg, part)) << "missing '" << part << "' in: " << msg;
  }

  // Header with one tensor "w" whose entry is `entry`, with 16 data bytes.
  void expect_entry_error(const std::string& entry, std::initializer_list<std::string> parts) {
    expect_error(st_bytes(R"({"w": )" + entry + "}", std::string(16, '\0')), parts);
  }

  fs::path write(const std::string& name, const std::string& bytes) {
    const fs::path p = dir_.path() / name;
    write_file(p, bytes);
    return p;
  }

  TempDir dir_;
  int n_ = 0;
};

// ---------------------------------------------------------------- valid files

TEST_F(SafetensorsTest, ReadsF32Bf16F16Tensors) {
  const std::string data = raw<float>({1.5f, -2.0f, 3.25f, 4.0f, 5.0f, -6.5f}) +   // a: [2, 3] F32 @ 0..24
                           raw<std::uint16_t>({0x3F80, 0xC000, 0x4040, 0x0000}) +  // b: [4] BF16 @ 24..32
                           raw<std::uint16_t>({0x3C00, 0x3800, 0xC000, 0x7BFF});   // c: [2, 2] F16 @ 32..40
  const std::string header = R"({"__metadata__": {"format": "pt", "note": ""},
      "c": {"dtype": "F16", "shape": [2, 2], "data_offsets": [32, 40]},
      "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
      "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]}})";
  const auto p = write("ok.safetensors", st_bytes(header, data));
  const auto f = SafetensorsFile::open(p);
  EXPECT_EQ(f.path(), p);
  ASSERT_EQ(f.tensors().size(), 3u);
  EXPECT_EQ(f.tensors()[0].name, "a");  // sorted by name
  EXPECT_EQ(f.tensors()[1].name, "b");
  EXPECT_EQ(f.tensors()[2].name, "c");
  EXPECT_EQ(f.find("__metadata__"), nullptr);
  EXPECT_EQ(f.find("d"), nullptr);
  EXPECT_EQ(f.find(""), nullptr);

  const TensorInfo* a = f.find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dtype, DType::f32);
  EXPECT_EQ(a->shape, (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(a->nbytes, 24u);
  const float expected_a[] = {1.5f, -2.0f, 3.25f, 4.0f, 5.0f, -6.5f};
  for (std::size_t i = 0; i < 6; ++i) EXPECT_EQ(read_at<float>(a->data, i), expected_a[i]) << i;

  const TensorInfo* b = f.find("b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->dtype, DType::bf16);
  EXPECT_EQ(b->shape, (std::vector<std::int64_t>{4}));
  EXPECT_EQ(b->nbytes, 8u);
  EXPECT_EQ(b->data, a->data + 24);
  const float expected_b[] = {1.0f, -2.0f, 3.0f, 0.0f};
  for (std::size_t i = 0; i < 4; ++i)
    EXPECT_EQ(bf16_to_float(read_at<std::uint16_t>(b->data, i)), expected_b[i]);

  const TensorInfo* c = f.find("c");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->dtype, DType::f16);
  EXPECT_EQ(c->shape, (std::vector<std::int64_t>{2, 2}));
  EXPECT_EQ(c->nbytes, 8u);
  const std::uint16_t expected_c[] = {0x3C00, 0x3800, 0xC000, 0x7BFF};
  for (std::size_t i = 0; i < 4; ++i) EXPECT_EQ(read_at<std::uint16_t>(c->data, i), expected_c[i]);
}

TEST_F(SafetensorsTest, EmptyHeaderIsValid) {
  EXPECT_TRUE(SafetensorsFile::open(write("e1.safetensors", st_bytes("{}"))).tensors().empty());
  EXPECT_TRUE(SafetensorsFile::open(write("e2.safetensors", st_bytes("{}", "trailing"))).tensors().empty());
  EXPECT_TRUE(
      SafetensorsFile::open(write("e3.safetensors", st_bytes(R"({"__metadata__": {}})"))).tensors().empty());
  EXPECT_TRUE(SafetensorsFile::open(write("e4.safetensors", st_bytes(R"({"__metadata__": {"a": "b"}})")))
                  .tensors()
                  .empty());
}

TEST_F(SafetensorsTest, HeaderPaddingWhitespaceAllowed) {
  // Writers pad the header with spaces so the data section is 8-byte aligned.
  const auto p =
      write("pad.safetensors", st_bytes(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}   )"
                                        "     ",
                                        raw<float>({7.0f})));
  const auto f = SafetensorsFile::open(p);
  ASSERT_NE(f.find("x"), nullptr);
  EXPECT_EQ(read_at<float>(f.find("x")->data, 0), 7.0f);
}

TEST_F(SafetensorsTest, TrailingDataBytesAllowed) {
  const auto p =
      write("trail.safetensors", st_bytes(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                                          raw<float>({1.0f, 2.0f}) + std::string(100, 'z')));
  const auto f = SafetensorsFile::open(p);
  ASSERT_EQ(f.tensors().size(), 1u);
  EXPECT_EQ(read_at<float>(f.find("x")->data, 1), 2.0f);
}

TEST_F(SafetensorsTest, DataNeedNotStartAtZero) {
  const auto p = write(
      "gap.safetensors",
      st_bytes(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})", raw<float>({0.0f, 0.0f, 9.0f})));
  EXPECT_EQ(read_at<float>(SafetensorsFile::open(p).find("x")->data, 0), 9.0f);
}

TEST_F(SafetensorsTest, ZeroSizeTensorsNeverOverlap) {
  // "z" sits inside "x"'s range and "y" at the same offset; both are empty, so neither overlaps anything.
  const std::string header = R"({
      "x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "z": {"dtype": "F32", "shape": [0, 5], "data_offsets": [4, 4]},
      "y": {"dtype": "BF16", "shape": [3, 0], "data_offsets": [4, 4]},
      "end": {"dtype": "F16", "shape": [0], "data_offsets": [8, 8]}})";
  const auto f = SafetensorsFile::open(write("zero.safetensors", st_bytes(header, raw<float>({1.0f, 2.0f}))));
  ASSERT_EQ(f.tensors().size(), 4u);
  EXPECT_EQ(f.find("z")->nbytes, 0u);
  EXPECT_EQ(f.find("z")->shape, (std::vector<std::int64_t>{0, 5}));
  EXPECT_EQ(f.find("end")->nbytes, 0u);
}

TEST_F(SafetensorsTest, ScalarShape) {
  const auto f = SafetensorsFile::open(
      write("scalar.safetensors",
            st_bytes(R"({"s":{"dtype":"F32","shape":[],"data_offsets":[0,4]}})", raw<float>({3.0f}))));
  EXPECT_TRUE(f.find("s")->shape.empty());
  EXPECT_EQ(f.find("s")->nbytes, 4u);
}

TEST_F(SafetensorsTest, AdjacentRangesDoNotOverlap) {
  const std::string header = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},
                                  "b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})";
  EXPECT_EQ(SafetensorsFile::open(write("adj.safetensors", st_bytes(header, std::string(8, '\0'))))
                .tensors()
                .size(),
            2u);
}

TEST_F(SafetensorsTest, UnknownEntryFieldsIgnored) {
  const std::string header = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"extra":[1,2]}})";
  EXPECT_NE(
      SafetensorsFile::open(write("extra.safetensors", st_bytes(header, std::string(4, '\0')))).find("a"),
      nullptr);
}

TEST_F(SafetensorsTest, MoveKeepsDataValid) {
  const auto p =
      write("move.safetensors",
            st_bytes(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", raw<float>({5.0f})));
  auto f = SafetensorsFile::open(p);
  const std::byte* data = f.find("x")->data;
  SafetensorsFile g = std::move(f);
  EXPECT_EQ(g.find("x")->data, data);
  EXPECT_EQ(read_at<float>(g.find("x")->data, 0), 5.0f);
  auto h = SafetensorsFile::open(write("empty.safetensors", st_bytes("{}")));
  h = std::move(g);
  EXPECT_EQ(h.path(), p);
  EXPECT_EQ(read_at<float>(h.find("x")->data, 0), 5.0f);
}

// ---------------------------------------------------------------- file-level errors

TEST_F(SafetensorsTest, MissingFile) {
  const fs::path p = dir_.path() / "absent.safetensors";
  EXPECT_THROW(SafetensorsFile::open(p), LoadError);
  EXPECT_TRUE(has(open_error(p), p.string()));
}

TEST_F(SafetensorsTest, DirectoryIsNotAFile) {
  const fs::path p = dir_.path() / "sub.safetensors";
  fs::create_directory(p);
  const auto msg = open_error(p);
  EXPECT_TRUE(has(msg, p.string())) << msg;
  EXPECT_TRUE(has(msg, "regular file")) << msg;
}

TEST_F(SafetensorsTest, ShorterThanEightBytes) {
  for (std::size_t n = 0; n < 8; ++n) {
    SCOPED_TRACE(n);
    expect_error(std::string(n, '\0'), {"shorter than the 8-byte"});
  }
}

TEST_F(SafetensorsTest, HeaderLengthBeyondFile) {
  expect_error(le_u64(3) + "{}", {"header length 3", "exceeds"});
  expect_error(le_u64(100) + "{}", {"header length 100"});
  expect_error(le_u64(1) + "", {"header length 1"});
  expect_error(le_u64(0xFFFFFFFFFFFFFFFFull) + "{}", {"header length 18446744073709551615"});
  expect_error(le_u64(0x8000000000000000ull) + std::string(64, ' '), {"header length"});
}

TEST_F(SafetensorsTest, HeaderLengthZero) {
  expect_error(le_u64(0), {"not valid JSON"});
}

TEST_F(SafetensorsTest, AbsurdHeaderLengthRejectedEvenWhenFileIsThatLarge) {
  // A sparse file of 100 MB + 9 bytes; the header length claims all of it.
  const fs::path p = dir_.path() / "huge.safetensors";
  const std::uint64_t n = 100'000'001;
  write_file(p, le_u64(n));
  fs::resize_file(p, 8 + n);
  const auto msg = open_error(p);
  EXPECT_TRUE(has(msg, p.string())) << msg;
  EXPECT_TRUE(has(msg, "limit")) << msg;
}

TEST_F(SafetensorsTest, HeaderNotValidJson) {
  expect_error(st_bytes("{"), {"not valid JSON"});
  expect_error(st_bytes("not json"), {"not valid JSON"});
  expect_error(st_bytes(R"({"a": 1,})"), {"not valid JSON"});
  expect_error(st_bytes("{} {}"), {"not valid JSON"});
  expect_error(st_bytes(std::string("{\"\xff\": 1}")), {"not valid JSON"});  // invalid UTF-8
  expect_error(st_bytes(std::string("{}\0", 3)), {"not valid JSON"});        // nlohmann stops at NUL
  expect_error(st_bytes(std::string("{}\0garbage", 10)), {"not valid JSON"});
  expect_error(st_bytes(std::string("{\"a\0\": 1}", 10)), {"not valid JSON"});
  expect_error(st_bytes(std::string("{}        \0\0\0\0", 14)), {"not valid JSON"});
  expect_error(st_bytes(""), {"not valid JSON"});
}

TEST_F(SafetensorsTest, HeaderNotAnObject) {
  expect_error(st_bytes("[]"), {"must be a JSON object", "array"});
  expect_error(st_bytes("42"), {"must be a JSON object", "number"});
  expect_error(st_bytes(R"("str")"), {"must be a JSON object", "string"});
  expect_error(st_bytes("null"), {"must be a JSON object", "null"});
}

TEST_F(SafetensorsTest, DuplicateTensorName) {
  const std::string header = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},
                                  "a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})";
  expect_error(st_bytes(header, std::string(8, '\0')), {"'a'", "more than once"});
}

TEST_F(SafetensorsTest, NestedDuplicateKeysAreNotTopLevelDuplicates) {
  // A repeated key inside an entry is not a duplicated tensor; nlohmann keeps the last value.
  const std::string header = R"({"a":{"dtype":"I8","dtype":"F32","shape":[1],"data_offsets":[0,4]},
                                  "b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})";
  EXPECT_EQ(SafetensorsFile::open(write("nested.safetensors", st_bytes(header, std::string(8, '\0'))))
                .tensors()
                .size(),
            2u);
}

// ---------------------------------------------------------------- metadata

TEST_F(SafetensorsTest, MetadataMustBeObjectOfStrings) {
  expect_error(st_bytes(R"({"__metadata__": []})"), {"__metadata__", "must be an object"});
  expect_error(st_bytes(R"({"__metadata__": "x"})"), {"__metadata__", "must be an object"});
  expect_error(st_bytes(R"({"__metadata__": null})"), {"__metadata__", "must be an object"});
  expect_error(st_bytes(R"({"__metadata__": {"format": 1}})"),
               {"__metadata__", "'format'", "must be a string"});
  expect_error(st_bytes(R"({"__metadata__": {"ok": "x", "nested": {}}})"), {"'nested'", "must be a string"});
  expect_error(st_bytes(R"({"__metadata__": {"n": null}})"), {"'n'", "must be a string"});
}

// ---------------------------------------------------------------- tensor entry errors

TEST_F(SafetensorsTest, EntryNotAnObject) {
  expect_entry_error("1", {"'w'", "must be a JSON object"});
  expect_entry_error("[]", {"'w'", "must be a JSON object"});
  expect_entry_error(R"("F32")", {"'w'", "must be a JSON object"});
  expect_entry_error("null", {"'w'", "must be a JSON object"});
}

TEST_F(SafetensorsTest, DtypeMissingOrWrongType) {
  expect_entry_error(R"({"shape": [4], "data_offsets": [0, 16]})", {"'w'", "missing \"dtype\""});
  expect_entry_error(R"({"dtype": 4, "shape": [4], "data_offsets": [0, 16]})",
                     {"'w'", "\"dtype\" must be a string"});
  expect_entry_error(R"({"dtype": ["F32"], "shape": [4], "data_offsets": [0, 16]})",
                     {"'w'", "\"dtype\" must be a string"});
}

TEST_F(SafetensorsTest, UnsupportedDtype) {
  for (const char* dt : {"I8", "F64", "U8", "BOOL", "F8_E5M2", "f32", ""}) {
    SCOPED_TRACE(dt);
    expect_entry_error(std::string(R"({"dtype": ")") + dt + R"(", "shape": [4], "data_offsets": [0, 4]})",
                       {"'w'", "unsupported dtype '" + std::string(dt) + "'", "F32, F16, BF16, F8_E4M3"});
  }
}

TEST_F(SafetensorsTest, ShapeMissingOrWrongType) {
  expect_entry_error(R"({"dtype": "F32", "data_offsets": [0, 16]})", {"'w'", "missing \"shape\""});
  expect_entry_error(R"({"dtype": "F32", "shape": 4, "data_offsets": [0, 16]})",
                     {"'w'", "\"shape\" must be an array"});
  expect_entry_error(R"({"dtype": "F32", "shape": {"0": 4}, "data_offsets": [0, 16]})",
                     {"'w'", "\"shape\" must be an array"});
  expect_entry_error(R"({"dtype": "F32", "shape": [4.0], "data_offsets": [0, 16]})",
                     {"'w'", "\"shape\" entries must be integers"});
  expect_entry_error(R"({"dtype": "F32", "shape": ["4"], "data_offsets": [0, 16]})",
                     {"'w'", "\"shape\" entries must be integers"});
  expect_entry_error(R"({"dtype": "F32", "shape": [true], "data_offsets": [0, 16]})",
                     {"'w'", "\"shape\" entries must be integers"});
  expect_entry_error(R"({"dtype": "F32", "shape": [[4]], "data_offsets": [0, 16]})",
                     {"'w'", "\"shape\" entries must be integers"});
}

TEST_F(SafetensorsTest, NegativeShapeDimension) {
  expect_entry_error(R"({"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]})",
                     {"'w'", "negative shape dimension -4"});
  expect_entry_error(R"({"dtype": "F32", "shape": [-2, -2], "data_offsets": [0, 16]})",
                     {"'w'", "negative shape dimension"});
  expect_entry_error(R"({"dtype": "F32", "shape": [0, -1], "data_offsets": [0, 0]})",
                     {"'w'", "negative shape dimension"});
}

TEST_F(SafetensorsTest, ShapeOverflow) {
  // 2^32 x 2^32 wraps to 0 elements in 64 bits; 2^62 x 4 bytes wraps to 0 bytes.
  expect_entry_error(R"({"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]})",
                     {"'w'", "overflows"});
  expect_entry_error(R"({"dtype": "F32", "shape": [4611686018427387904], "data_offsets": [0, 0]})",
                     {"'w'", "overflows"});
  expect_entry_error(R"({"dtype": "BF16", "shape": [65536, 65536, 65536, 65536], "data_offsets": [0, 0]})",
                     {"'w'", "overflows"});
  expect_entry_error(R"({"dtype": "F32", "shape": [9223372036854775808], "data_offsets": [0, 0]})",
                     {"'w'", "too large"});
  expect_entry_error(R"({"dtype": "F32", "shape": [18446744073709551615], "data_offsets": [0, 0]})",
                     {"'w'", "too large"});
}

TEST_F(SafetensorsTest, HugeShapeWithZeroDimensionIsEmpty) {
  const std::string header =
      R"({"w": {"dtype": "F32", "shape": [4294967296, 0, 4294967296, 4294967296], "data_offsets": [0, 0]}})";
  const auto f = SafetensorsFile::open(write("zerohuge.safetensors", st_bytes(header)));
  EXPECT_EQ(f.find("w")->nbytes, 0u);
}

TEST_F(SafetensorsTest, DataOffsetsMissingOrWrongType) {
  expect_entry_error(R"({"dtype": "F32", "shape": [4]})", {"'w'", "missing \"data_offsets\""});
  expect_entry_error(R"({"dtype": "F32", "shape": [4], "data_offsets": 0})",
                     {"'w'", "\"data_offsets\" must be"});
  expect_entry_error(R"({"dtype": "F32", "shape": [4], "data_offsets": [16]})",
                     {"'w'", "\"data_offsets\" must be"});
  expect_entry_error(R"({"dtype": "F32", "shape": [4], "data_offsets": []})",
                     {"'w'", "\"data_offsets\" must be"});
  expect_entry_error(R"({"dtype": "F32", "shape": [4], "data_offsets": [0, 16, 16]})",
                     {"'w'", "\"data_offsets\" must be"});
  expect_entry_error(R"({"dtype": "F32", "shape": [4], "data_offsets": {"0": 0, "1": 16}})",
                     {"'w'", "\"data_offsets\" must be"});
  expect_entry_error(R"({"dtype": "F32", "shape": [4], "data_offsets": [0, "16"]})",
                     {"'w'", "\"data_offsets\" entries must be integers"});
  expect_entry_error(R"({"dtype": "F32", "shape": [4], "data_offsets": [0.0, 16]})",
                     {"'w'", "\"data_offsets\" entries must be integers"});
  expect_entry_error(R"({"dtype": "F32", "shape": [4], "data_offsets": [null, 16]})",
                     {"'w'", "\"data_offsets\" entries must be integers"});
}

TEST_F(SafetensorsTest, NegativeDataOffsets) {
  expect_entry_error(R"({"dtype": "F32", "shape": [4], "data_offsets": [-16, 0]})",
                     {"'w'", "negative \"data_offsets\" entry -16"});
  expect_entry_error(R"({"dtype": "F32", "shape": [0], "data_offsets": [0, -1]})",
                     {"'w'", "negative \"data_offsets\""});
}

TEST_F(SafetensorsTest, BeginAfterEnd) {
  expect_entry_error(R"({"dtype": "F32", "shape": [1], "data_offsets": [8, 4]})",
                     {"'w'", "[8, 4]", "begin > end"});
  expect_entry_error(R"({"dtype": "F32", "shape": [0], "data_offsets": [18446744073709551615, 0]})",
                     {"'w'", "begin > end"});
}

TEST_F(SafetensorsTest, EndBeyondDataSection) {
  // The data section is 16 bytes.
  expect_entry_error(R"({"dtype": "F32", "shape": [5], "data_offsets": [0, 20]})",
                     {"'w'", "[0, 20]", "beyond the data section of 16 bytes"});
  expect_entry_error(R"({"dtype": "F32", "shape": [1], "data_offsets": [16, 20]})",
                     {"'w'", "beyond the data"});
  expect_entry_error(R"({"dtype": "F32", "shape": [0], "data_offsets": [17, 17]})",
                     {"'w'", "beyond the data"});
  expect_entry_error(
      R"({"dtype": "F32", "shape": [4611686018427387903], "data_offsets": [0, 18446744073709551612]})",
      {"'w'", "beyond the data"});
}

TEST_F(SafetensorsTest, ShapeDoesNotMatchByteRange) {
  expect_entry_error(R"({"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]})",
                     {"'w'", "[2, 2]", "F32", "16 bytes", "span 12 bytes"});
  expect_entry_error(R"({"dtype": "BF16", "shape": [4], "data_offsets": [0, 16]})",
                     {"'w'", "BF16", "8 bytes", "span 16 bytes"});
  expect_entry_error(R"({"dtype": "F16", "shape": [], "data_offsets": [0, 4]})",
                     {"'w'", "2 bytes", "span 4"});
  expect_entry_error(R"({"dtype": "F32", "shape": [0], "data_offsets": [0, 4]})",
                     {"'w'", "0 bytes", "span 4"});
}

TEST_F(SafetensorsTest, OverlappingRanges) {
  const std::string data(16, '\0');
  // Partial overlap.
  expect_error(st_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
                            "b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                        data),
               {"'a'", "'b'", "overlap"});
  // Identical ranges.
  expect_error(st_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
                            "b":{"dtype":"BF16","shape":[4],"data_offsets":[0,8]}})",
                        data),
               {"'a'", "'b'", "overlap"});
  // One inside another.
  expect_error(st_bytes(R"({"outer":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},
                            "inner":{"dtype":"F16","shape":[1],"data_offsets":[6,8]}})",
                        data),
               {"'outer'", "'inner'", "overlap"});
  // Overlap between non-adjacent names once sorted by offset.
  expect_error(st_bytes(R"({"z":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},
                            "a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]},
                            "m":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                        data),
               {"'a'", "'m'", "overlap"});
}

TEST_F(SafetensorsTest, ErrorNamesTheOffendingTensorAmongOthers) {
  const std::string header = R"({"good.weight":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},
                                  "layers.3.bad":{"dtype":"F32","shape":[2],"data_offsets":[4,8]}})";
  expect_error(st_bytes(header, std::string(8, '\0')), {"'layers.3.bad'"});
}

// ---------------------------------------------------------------- fuzz-ish robustness

void try_open(const fs::path& p, std::size_t file_size, int& loaded, int& rejected) {
  try {
    const auto f = SafetensorsFile::open(p);
    // Touch every byte of every tensor so a bad pointer or range shows up (under ASan or as a crash).
    unsigned sum = 0;
    for (const auto& t : f.tensors()) {
      EXPECT_LE(t.nbytes, file_size) << t.name;
      EXPECT_EQ(t.nbytes, [&] {
        std::size_t n = capserve::kernels::dtype_size(t.dtype);
        for (auto d : t.shape) n *= static_cast<std::size_t>(d);
        return n;
      }()) << t.name;
      for (std::size_t i = 0; i < t.nbytes; ++i) sum += std::to_integer<unsigned>(t.data[i]);
      EXPECT_EQ(f.find(t.name), &t);
    }
    volatile unsigned sink = sum;
    (void)sink;
    ++loaded;
  } catch (const LoadError&) {
    ++rejected;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "unexpected exception type: " << e.what();
  }
}

TEST_F(SafetensorsTest, TruncationAndHeaderCorruptionNeverCrash) {
  const std::string header = R"({"__metadata__":{"format":"pt"},)"
                             R"("a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},)"
                             R"("b":{"dtype":"BF16","shape":[3],"data_offsets":[16,22]},)"
                             R"("c":{"dtype":"F16","shape":[1,1],"data_offsets":[22,24]},)"
                             R"("e":{"dtype":"F32","shape":[0],"data_offsets":[24,24]}})";
  std::string data;
  for (int i = 0; i < 24; ++i) data.push_back(static_cast<char>(i * 7 + 1));
  const std::string good = st_bytes(header, data);
  int loaded = 0;
  int rejected = 0;
  int variant_id = 0;
  // Each variant gets a new file: rewriting one file in place makes ext4 flush it on every close.
  const auto check = [&](const std::string& bytes) {
    const fs::path p = dir_.path() / ("fuzz" + std::to_string(variant_id++) + ".safetensors");
    write_file(p, bytes);
    try_open(p, bytes.size(), loaded, rejected);
    std::error_code ec;
    fs::remove(p, ec);
  };

  // The intact file loads.
  check(good);
  ASSERT_EQ(loaded, 1);

  // Truncated at every length: everything shorter than the whole file fails (the last tensor ends at the
  // end).
  for (std::size_t len = 0; len < good.size(); ++len) {
    const int before = rejected;
    check(good.substr(0, len));
    EXPECT_EQ(rejected, before + 1) << "truncated to " << len;
  }

  // Header truncated with the length prefix fixed up to match, data intact.
  for (std::size_t len = 0; len <= header.size(); ++len) {
    check(st_bytes(header.substr(0, len), data));
  }

  // Random byte corruption of the length prefix and header.
  std::mt19937 rng(12345);
  const std::string interesting = "{}[]\":,-0123456789eE. \\u\xff\x80";
  const std::size_t header_end = 8 + header.size();
  for (int variant = 0; variant < 600; ++variant) {
    std::string bytes = good;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < flips; ++k) {
      // Mostly the header; now and then the length prefix.
      const std::size_t pos = (rng() % 10 == 0) ? rng() % 8 : 8 + rng() % (header_end - 8);
      if (rng() % 2 == 0) {
        bytes[pos] = static_cast<char>(bytes[pos] ^ static_cast<char>(1 + rng() % 255));
      } else {
        bytes[pos] = interesting[rng() % interesting.size()];
      }
    }
    check(bytes);
  }
  RecordProperty("loaded", loaded);
  RecordProperty("rejected", rejected);
  EXPECT_GT(loaded, 1);
  EXPECT_GT(rejected, 100);
}

}  // namespace
