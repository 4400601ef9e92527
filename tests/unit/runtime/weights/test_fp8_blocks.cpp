#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/dtype.h"
#include "runtime/load_error.h"
#include "runtime/weights/checkpoint.h"
#include "runtime/weights/fp8_blocks.h"
#include "tests/unit/runtime/weights/safetensors_test_files.h"

namespace {

using capserve::kernels::DType;
using capserve::runtime::Checkpoint;
using capserve::runtime::f8_e4m3_to_float;
using capserve::runtime::Fp8BlockShape;
using capserve::runtime::LoadError;
using capserve::testing::st_bytes;
using capserve::testing::TempDir;
using capserve::testing::write_file;

float bf16_value(std::uint16_t h) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16);
}

std::string f32_bytes(const std::vector<float>& v) {
  std::string out(v.size() * 4, '\0');
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

// The OCP FP8 E4M3 encodings at the edges of the format (the "fn" variant transformers and DeepSeek use).
TEST(Fp8E4m3, DecodesTheFormatsLandmarks) {
  EXPECT_EQ(f8_e4m3_to_float(0x00), 0.0f);
  EXPECT_TRUE(std::signbit(f8_e4m3_to_float(0x80)));
  EXPECT_EQ(f8_e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(f8_e4m3_to_float(0xC0), -2.0f);
  EXPECT_EQ(f8_e4m3_to_float(0x7E), 448.0f);                // the largest finite value
  EXPECT_EQ(f8_e4m3_to_float(0x08), std::ldexp(1.0f, -6));  // the smallest normal
  EXPECT_EQ(f8_e4m3_to_float(0x01), std::ldexp(1.0f, -9));  // the smallest subnormal
  EXPECT_EQ(f8_e4m3_to_float(0x07), 7 * std::ldexp(1.0f, -9));
  EXPECT_EQ(f8_e4m3_to_float(0x3D), 1.625f);
  EXPECT_TRUE(std::isnan(f8_e4m3_to_float(0x7F)));
  EXPECT_TRUE(std::isnan(f8_e4m3_to_float(0xFF)));
  EXPECT_EQ(f8_e4m3_to_float(0x78), 256.0f);  // S.1111.000 is a number: no infinities
}

// A 3 x 5 weight in 2 x 3 blocks: four scales, the last block row and column partial.
TEST(Fp8Blocks, EachElementTakesItsBlocksScaleRoundedToNearestEvenBf16) {
  const std::vector<std::uint8_t> q{0x38, 0x38, 0x38, 0x38, 0x38,  // 1.0 everywhere
                                    0x38, 0x38, 0x38, 0x38, 0x38,
                                    0x38, 0x38, 0x38, 0xC0, 0x38};  // -2.0 at [2, 3]
  // 1 + 2^-8 is halfway between two bf16 values (ties to even: 1.0); 1 + 2^-8 + 2^-10 rounds up.
  const std::vector<float> scales{1.0f + std::ldexp(1.0f, -8), 2.0f, 0.5f,
                                  1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -10)};
  capserve::runtime::TensorInfo w{
      "w", DType::f8_e4m3, {3, 5}, reinterpret_cast<const std::byte*>(q.data()), 15};
  capserve::runtime::TensorInfo s{
      "s", DType::f32, {2, 2}, reinterpret_cast<const std::byte*>(scales.data()), 16};
  std::vector<std::uint16_t> out(15);
  capserve::runtime::dequantize_fp8_blocks(w, s, Fp8BlockShape{2, 3}, out);
  const auto at = [&](int r, int c) { return bf16_value(out[static_cast<std::size_t>(r * 5 + c)]); };
  EXPECT_EQ(at(0, 0), 1.0f);
  EXPECT_EQ(at(1, 2), 1.0f);
  EXPECT_EQ(at(0, 3), 2.0f);
  EXPECT_EQ(at(1, 4), 2.0f);
  EXPECT_EQ(at(2, 0), 0.5f);
  EXPECT_EQ(at(2, 2), 0.5f);
  EXPECT_EQ(at(2, 4), 1.0f + std::ldexp(1.0f, -7));
  EXPECT_EQ(at(2, 3), -2.0f * (1.0f + std::ldexp(1.0f, -7)));
}

// A one-file checkpoint holding an F8_E4M3 [4, 6] weight and whatever scale tensor the case gives.
class Fp8Checkpoint : public ::testing::Test {
 protected:
  void write(const std::string& scale_entry, const std::string& scale_data) {
    const std::string header =
        R"({"w.weight": {"dtype": "F8_E4M3", "shape": [4, 6], "data_offsets": [0, 24]})" +
        (scale_entry.empty() ? std::string("}") : ", " + scale_entry + "}");
    std::string data(24, '\x38');  // 1.0
    write_file(dir_.path() / "model.safetensors", st_bytes(header, data + scale_data));
  }
  std::string error(std::optional<Fp8BlockShape> fp8 = Fp8BlockShape{4, 4}) {
    try {
      Checkpoint ckpt = Checkpoint::open(dir_.path(), fp8);
      ckpt.get("w.weight", {4, 6});
      ckpt.check_all_used();
    } catch (const LoadError& e) {
      return e.what();
    }
    return "";
  }
  TempDir dir_;
};

TEST_F(Fp8Checkpoint, DequantizesOnFetchAndMarksTheScaleUsed) {
  write(R"("w.weight_scale_inv": {"dtype": "F32", "shape": [1, 2], "data_offsets": [24, 32]})",
        f32_bytes({3.0f, 0.25f}));
  Checkpoint ckpt = Checkpoint::open(dir_.path(), Fp8BlockShape{4, 4});
  const capserve::kernels::WeightView v = ckpt.get("w.weight", {4, 6});
  ASSERT_EQ(v.dtype, DType::bf16);
  std::vector<std::uint16_t> h(24);
  std::memcpy(h.data(), v.data, 48);
  EXPECT_EQ(bf16_value(h[3]), 3.0f);
  EXPECT_EQ(bf16_value(h[4]), 0.25f);
  EXPECT_EQ(bf16_value(h[23]), 0.25f);
  EXPECT_NO_THROW(ckpt.check_all_used());
}

// For a backend that keeps FP8: the stored bytes and their scales (as stored), the scale marked used; a row
// range from a block's first row takes its scale rows along, one inside a block is refused.
TEST_F(Fp8Checkpoint, GetStoredGivesTheFp8BytesWithTheirScales) {
  write(R"("w.weight_scale_inv": {"dtype": "F32", "shape": [2, 2], "data_offsets": [24, 40]})",
        f32_bytes({3.0f, 0.25f, 5.0f, 7.0f}));
  Checkpoint ckpt = Checkpoint::open(dir_.path(), Fp8BlockShape{2, 4});
  const capserve::kernels::WeightView v = ckpt.get_stored("w.weight", {4, 6});
  ASSERT_EQ(v.dtype, DType::f8_e4m3);
  EXPECT_EQ(v.rows, 4);
  EXPECT_EQ(v.cols, 6);
  EXPECT_EQ(std::to_integer<int>(v.data[5]), 0x38);
  ASSERT_FALSE(v.scales.empty());
  EXPECT_EQ(v.scales.dtype, DType::f32);
  EXPECT_EQ(v.scales.block_rows, 2);
  EXPECT_EQ(v.scales.block_cols, 4);
  EXPECT_EQ(v.scales.grid_rows(v.rows), 2);
  EXPECT_EQ(v.scales.grid_cols(v.cols), 2);
  EXPECT_EQ(static_cast<const float*>(v.scales.data)[1], 0.25f);
  const capserve::kernels::WeightView lower = v.row_range(2, 2);
  EXPECT_EQ(lower.data, v.data + 12);
  EXPECT_EQ(static_cast<const float*>(lower.scales.data)[0], 5.0f);
  EXPECT_THROW((void)v.row_range(1, 2), std::invalid_argument);
  EXPECT_NO_THROW(ckpt.check_all_used());
}

TEST_F(Fp8Checkpoint, ErrorsNameTheTensorAndWhatIsWrong) {
  write(R"("w.weight_scale_inv": {"dtype": "F32", "shape": [1, 2], "data_offsets": [24, 32]})",
        f32_bytes({3.0f, 0.25f}));
  EXPECT_NE(error(std::nullopt).find("'w.weight' in"), std::string::npos);
  EXPECT_NE(error(std::nullopt).find("stored as F8_E4M3 but config.json has no FP8 quantization_config"),
            std::string::npos);
  EXPECT_NE(error(Fp8BlockShape{2, 4}).find("'w.weight_scale_inv' has shape [1, 2], expected [2, 2]"),
            std::string::npos)
      << error(Fp8BlockShape{2, 4});

  write("", "");
  EXPECT_NE(error().find("'w.weight_scale_inv' is missing"), std::string::npos) << error();

  write(R"("w.weight_scale_inv": {"dtype": "F16", "shape": [1, 2], "data_offsets": [24, 28]})",
        std::string(4, '\0'));
  EXPECT_NE(error().find("block scales must be F32 or BF16"), std::string::npos) << error();
}

}  // namespace
