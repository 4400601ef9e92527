#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "kernels/dtype.h"
#include "runtime/load_error.h"
#include "runtime/weights/checkpoint.h"
#include "tests/unit/runtime/weights/safetensors_test_files.h"

namespace {

namespace fs = std::filesystem;
using capserve::kernels::DType;
using capserve::kernels::WeightView;
using capserve::runtime::Checkpoint;
using capserve::runtime::LoadError;
using capserve::testing::st_bytes;
using capserve::testing::TempDir;
using capserve::testing::write_file;

float f32_at(const WeightView& w, std::int64_t i) {
  float v = 0;
  std::memcpy(&v, w.data + static_cast<std::size_t>(i) * sizeof(float), sizeof v);
  return v;
}

bool has(const std::string& msg, const std::string& part) {
  return msg.find(part) != std::string::npos;
}

// A safetensors file of F32 tensors laid out back to back; values are 100 * tensor index + element index.
struct TensorSpec {
  std::string name;
  std::vector<std::int64_t> shape;
};
std::string f32_file(const std::vector<TensorSpec>& tensors) {
  std::string header = "{";
  std::string data;
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    std::int64_t n = 1;
    std::string shape;
    for (auto d : tensors[t].shape) {
      n *= d;
      if (!shape.empty()) shape += ',';
      shape += std::to_string(d);
    }
    const std::size_t begin = data.size();
    for (std::int64_t i = 0; i < n; ++i) {
      const float v = static_cast<float>(100 * t + static_cast<std::size_t>(i));
      data.append(reinterpret_cast<const char*>(&v), sizeof v);
    }
    if (t != 0) header += ",";
    header += "\"" + tensors[t].name + R"(":{"dtype":"F32","shape":[)" + shape + R"(],"data_offsets":[)" +
              std::to_string(begin) + "," + std::to_string(data.size()) + "]}";
  }
  header += "}";
  return st_bytes(header, data);
}

class CheckpointTest : public ::testing::Test {
 protected:
  fs::path write(const std::string& name, const std::string& bytes) {
    const fs::path p = dir_.path() / name;
    write_file(p, bytes);
    return p;
  }
  void write_index(const std::string& json) { write("model.safetensors.index.json", json); }

  // Expects Checkpoint::open(dir) to throw LoadError whose message contains every part.
  void expect_open_error(std::initializer_list<std::string> parts) {
    EXPECT_THROW(Checkpoint::open(dir_.path()), LoadError);
    try {
      Checkpoint::open(dir_.path());
    } catch (const LoadError& e) {
      const std::string msg = e.what();
      for (const auto& part : parts) EXPECT_TRUE(has(msg, part)) << "missing '" << part << "' in: " << msg;
    }
  }

  // Two shards: a.safetensors {x [2,3], y [4]}, b.safetensors {z [2,2,2]}.
  void write_two_shards() {
    write("a.safetensors", f32_file({{"x", {2, 3}}, {"y", {4}}}));
    write("b.safetensors", f32_file({{"z", {2, 2, 2}}}));
  }

  TempDir dir_;
};

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const LoadError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected LoadError";
  return {};
}

// ---------------------------------------------------------------- single file

TEST_F(CheckpointTest, SingleFileViews) {
  write("model.safetensors", f32_file({{"vec", {3}}, {"mat", {2, 3}}, {"cube", {2, 3, 4}}, {"s", {}}}));
  auto ckpt = Checkpoint::open(dir_.path());
  EXPECT_EQ(ckpt.dir(), dir_.path());
  EXPECT_TRUE(ckpt.contains("vec"));
  EXPECT_TRUE(ckpt.contains("cube"));
  EXPECT_FALSE(ckpt.contains("nope"));
  EXPECT_FALSE(ckpt.contains("__metadata__"));

  const WeightView vec = ckpt.get("vec", {3});
  EXPECT_EQ(vec.dtype, DType::f32);
  EXPECT_EQ(vec.rows, 1);
  EXPECT_EQ(vec.cols, 3);
  EXPECT_EQ(f32_at(vec, 0), 0.0f);
  EXPECT_EQ(f32_at(vec, 2), 2.0f);

  const WeightView mat = ckpt.get("mat", {2, 3});
  EXPECT_EQ(mat.rows, 2);
  EXPECT_EQ(mat.cols, 3);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(f32_at(mat, i), 100.0f + static_cast<float>(i));
  EXPECT_EQ(f32_at(mat.row_range(1, 1), 0), 103.0f);

  const WeightView cube = ckpt.get("cube", {2, 3, 4});
  EXPECT_EQ(cube.rows, 6);
  EXPECT_EQ(cube.cols, 4);
  EXPECT_EQ(cube.numel(), 24);
  EXPECT_EQ(f32_at(cube, 23), 223.0f);

  const WeightView s = ckpt.get("s", {});
  EXPECT_EQ(s.numel(), 1);
  EXPECT_EQ(f32_at(s, 0), 300.0f);

  EXPECT_NO_THROW(ckpt.check_all_used());
}

TEST_F(CheckpointTest, Bf16ViewKeepsDtype) {
  const std::uint16_t bits[] = {0x3F80, 0x4000};
  std::string data(4, '\0');
  std::memcpy(data.data(), bits, 4);
  write("model.safetensors", st_bytes(R"({"b":{"dtype":"BF16","shape":[1,2],"data_offsets":[0,4]}})", data));
  auto ckpt = Checkpoint::open(dir_.path());
  const WeightView w = ckpt.get("b", {1, 2});
  EXPECT_EQ(w.dtype, DType::bf16);
  std::uint16_t got[2];
  std::memcpy(got, w.data, 4);
  EXPECT_EQ(got[0], 0x3F80);
  EXPECT_EQ(got[1], 0x4000);
}

TEST_F(CheckpointTest, MovedCheckpointStillServesTensors) {
  write("model.safetensors", f32_file({{"a", {2}}, {"b", {1}}}));
  auto first = Checkpoint::open(dir_.path());
  (void)first.get("a", {2});
  Checkpoint second = std::move(first);
  EXPECT_EQ(f32_at(second.get("b", {1}), 0), 100.0f);
  EXPECT_NO_THROW(second.check_all_used());  // "a" was marked used before the move
}

TEST_F(CheckpointTest, NoSafetensorsInDirectory) {
  write("config.json", "{}");
  write("pytorch_model.bin", "x");
  expect_open_error({"no model.safetensors or model.safetensors.index.json in " + dir_.path().string()});
}

TEST_F(CheckpointTest, NonexistentDirectory) {
  const fs::path missing = dir_.path() / "does_not_exist";
  const auto msg = error_of([&] { Checkpoint::open(missing); });
  EXPECT_TRUE(has(msg, "no model.safetensors or model.safetensors.index.json in " + missing.string())) << msg;
}

TEST_F(CheckpointTest, BadSingleFilePropagatesWithPath) {
  const auto p =
      write("model.safetensors", st_bytes(R"({"w":{"dtype":"I8","shape":[1],"data_offsets":[0,1]}})", "x"));
  expect_open_error({p.string(), "'w'", "unsupported dtype"});
}

TEST_F(CheckpointTest, GetMissingTensor) {
  write("model.safetensors", f32_file({{"a", {2}}}));
  auto ckpt = Checkpoint::open(dir_.path());
  EXPECT_THROW((void)ckpt.get("model.missing", {2}), LoadError);
  const auto msg = error_of([&] { (void)ckpt.get("model.missing", {2}); });
  EXPECT_TRUE(has(msg, "tensor 'model.missing' not found in checkpoint " + dir_.path().string())) << msg;
}

TEST_F(CheckpointTest, GetWrongShape) {
  const auto p = write("model.safetensors", f32_file({{"w", {2, 3}}}));
  auto ckpt = Checkpoint::open(dir_.path());
  EXPECT_THROW((void)ckpt.get("w", {3, 2}), LoadError);
  const auto check = [&](const std::string& msg, const std::string& expected_text) {
    EXPECT_TRUE(has(msg, "'w'")) << msg;
    EXPECT_TRUE(has(msg, p.string())) << msg;
    EXPECT_TRUE(has(msg, "has shape [2, 3]")) << msg;
    EXPECT_TRUE(has(msg, "expected " + expected_text)) << msg;
  };
  check(error_of([&] { (void)ckpt.get("w", {3, 2}); }), "[3, 2]");
  check(error_of([&] { (void)ckpt.get("w", {6}); }), "[6]");
  check(error_of([&] { (void)ckpt.get("w", {2, 3, 1}); }), "[2, 3, 1]");
  check(error_of([&] { (void)ckpt.get("w", {}); }), "[]");
  // A failed get does not mark the tensor used.
  const auto unused = error_of([&] { ckpt.check_all_used(); });
  EXPECT_TRUE(has(unused, "'w'")) << unused;
}

TEST_F(CheckpointTest, CheckAllUsedListsUnusedSorted) {
  const auto p =
      write("model.safetensors", f32_file({{"zeta", {1}}, {"alpha", {1}}, {"mid", {1}}, {"used", {1}}}));
  auto ckpt = Checkpoint::open(dir_.path());
  (void)ckpt.get("used", {1});
  (void)ckpt.get("used", {1});  // fetching twice is fine
  EXPECT_THROW(ckpt.check_all_used(), LoadError);
  const auto msg = error_of([&] { ckpt.check_all_used(); });
  EXPECT_TRUE(has(msg, dir_.path().string())) << msg;
  EXPECT_TRUE(has(msg, "3 tensors")) << msg;
  EXPECT_TRUE(has(msg, "'alpha' (" + p.string() + ")")) << msg;
  EXPECT_FALSE(has(msg, "'used'")) << msg;
  const auto a = msg.find("'alpha'");
  const auto m = msg.find("'mid'");
  const auto z = msg.find("'zeta'");
  ASSERT_NE(a, std::string::npos);
  ASSERT_NE(m, std::string::npos);
  ASSERT_NE(z, std::string::npos);
  EXPECT_LT(a, m);
  EXPECT_LT(m, z);

  (void)ckpt.get("alpha", {1});
  (void)ckpt.get("mid", {1});
  (void)ckpt.get("zeta", {1});
  EXPECT_NO_THROW(ckpt.check_all_used());
}

TEST_F(CheckpointTest, CheckAllUsedCapsTheList) {
  std::vector<TensorSpec> specs;
  for (int i = 0; i < 25; ++i) {
    std::string name = i < 10 ? "t0" : "t";
    name += std::to_string(i);
    specs.push_back({name, {1}});
  }
  write("model.safetensors", f32_file(specs));
  auto ckpt = Checkpoint::open(dir_.path());
  const auto msg = error_of([&] { ckpt.check_all_used(); });
  EXPECT_TRUE(has(msg, "25 tensors")) << msg;
  EXPECT_TRUE(has(msg, "'t00'")) << msg;
  EXPECT_TRUE(has(msg, "'t19'")) << msg;
  EXPECT_FALSE(has(msg, "'t20'")) << msg;
  EXPECT_TRUE(has(msg, "5 more")) << msg;
}

// ---------------------------------------------------------------- sharded

TEST_F(CheckpointTest, ShardedHappyPath) {
  write_two_shards();
  write_index(R"({"metadata": {"total_size": 84},
                  "weight_map": {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors"}})");
  auto ckpt = Checkpoint::open(dir_.path());
  EXPECT_TRUE(ckpt.contains("x"));
  EXPECT_TRUE(ckpt.contains("z"));
  const auto x = ckpt.get("x", {2, 3});
  EXPECT_EQ(f32_at(x, 5), 5.0f);
  const auto y = ckpt.get("y", {4});
  EXPECT_EQ(f32_at(y, 3), 103.0f);
  const auto msg = error_of([&] { ckpt.check_all_used(); });
  EXPECT_TRUE(has(msg, "'z' (" + (dir_.path() / "b.safetensors").string() + ")")) << msg;
  const auto z = ckpt.get("z", {2, 2, 2});
  EXPECT_EQ(z.rows, 4);
  EXPECT_EQ(z.cols, 2);
  EXPECT_EQ(f32_at(z, 7), 7.0f);
  EXPECT_NO_THROW(ckpt.check_all_used());
}

TEST_F(CheckpointTest, IndexWinsOverSingleFile) {
  write_two_shards();
  write_index(R"({"weight_map": {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors"}})");
  write("model.safetensors", f32_file({{"other", {1}}}));
  auto ckpt = Checkpoint::open(dir_.path());
  EXPECT_TRUE(ckpt.contains("z"));
  EXPECT_FALSE(ckpt.contains("other"));
}

TEST_F(CheckpointTest, EmptyWeightMap) {
  write_index(R"({"weight_map": {}})");
  auto ckpt = Checkpoint::open(dir_.path());
  EXPECT_FALSE(ckpt.contains("x"));
  EXPECT_NO_THROW(ckpt.check_all_used());
}

TEST_F(CheckpointTest, IndexNotValidJson) {
  write_index(R"({"weight_map": {"x": "a.safetensors",})");
  expect_open_error({"model.safetensors.index.json", "not valid JSON"});
  write_index(std::string(R"({"weight_map": {}})") + std::string(1, '\0') + "garbage");
  expect_open_error({"model.safetensors.index.json", "not valid JSON"});
  write_index("");
  expect_open_error({"model.safetensors.index.json", "not valid JSON"});
}

TEST_F(CheckpointTest, IndexNotAnObject) {
  write_index(R"(["weight_map"])");
  expect_open_error({"model.safetensors.index.json", "must be a JSON object"});
}

TEST_F(CheckpointTest, IndexMissingWeightMap) {
  write_index(R"({"metadata": {}})");
  expect_open_error({"model.safetensors.index.json", "missing \"weight_map\""});
}

TEST_F(CheckpointTest, IndexWeightMapNotAnObject) {
  write_index(R"({"weight_map": [["x", "a.safetensors"]]})");
  expect_open_error({"model.safetensors.index.json", "\"weight_map\" must be an object"});
}

TEST_F(CheckpointTest, IndexShardNotAString) {
  write_two_shards();
  write_index(R"({"weight_map": {"x": 1}})");
  expect_open_error({"model.safetensors.index.json", "'x'", "must be a string"});
}

TEST_F(CheckpointTest, IndexShardNamesMustBePlainFileNames) {
  write_two_shards();
  fs::create_directory(dir_.path() / "sub");
  write("sub/a.safetensors", f32_file({{"x", {2, 3}}}));
  for (const std::string bad : {"sub/a.safetensors", "../a.safetensors", "..", ".", "",
                                "sub\\\\a.safetensors", "/etc/passwd", "./a.safetensors"}) {
    SCOPED_TRACE(bad);
    write_index(R"({"weight_map": {"x": ")" + bad + R"("}})");
    expect_open_error({"model.safetensors.index.json", "'x'", "plain file name"});
  }
}

TEST_F(CheckpointTest, IndexShardMissing) {
  write_two_shards();
  write_index(R"({"weight_map": {"x": "a.safetensors", "y": "a.safetensors", "z": "c.safetensors"}})");
  expect_open_error({"model.safetensors.index.json", "'c.safetensors'", "'z'", "does not exist"});
}

TEST_F(CheckpointTest, IndexShardIsADirectory) {
  write_two_shards();
  fs::create_directory(dir_.path() / "d.safetensors");
  write_index(R"({"weight_map": {"x": "d.safetensors"}})");
  expect_open_error({"'d.safetensors'", "does not exist"});
}

TEST_F(CheckpointTest, IndexListsTensorAbsentFromShard) {
  write_two_shards();
  write_index(R"({"weight_map": {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors",
                                 "ghost": "b.safetensors"}})");
  expect_open_error({"'ghost'", "'b.safetensors'", "does not contain"});
}

TEST_F(CheckpointTest, IndexPlacesTensorInWrongShard) {
  write_two_shards();
  write_index(R"({"weight_map": {"x": "a.safetensors", "y": "b.safetensors", "z": "b.safetensors"}})");
  expect_open_error({"'y'", "'b.safetensors'"});
}

TEST_F(CheckpointTest, ShardTensorNotListedInIndex) {
  write_two_shards();
  write_index(R"({"weight_map": {"x": "a.safetensors", "z": "b.safetensors"}})");
  expect_open_error({"'y'", "'a.safetensors'", "not listed"});
}

TEST_F(CheckpointTest, TensorInTwoShards) {
  write("a.safetensors", f32_file({{"x", {2, 3}}, {"dup", {4}}}));
  write("b.safetensors", f32_file({{"dup", {4}}, {"z", {1}}}));
  write_index(R"({"weight_map": {"x": "a.safetensors", "dup": "a.safetensors", "z": "b.safetensors"}})");
  expect_open_error({"'dup'", "two shards", "'a.safetensors'", "'b.safetensors'"});
}

TEST_F(CheckpointTest, BadShardPropagatesWithShardPath) {
  write("a.safetensors", f32_file({{"x", {2, 3}}}));
  const auto bad = write("b.safetensors", "short");
  write_index(R"({"weight_map": {"x": "a.safetensors", "z": "b.safetensors"}})");
  expect_open_error({bad.string(), "shorter than"});
}

}  // namespace
