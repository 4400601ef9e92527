// CudaBackend against CpuBackend through the Backend interface, operation by operation: the same inputs
// (weights uploaded through each backend, activations copied in with from_host), results copied out with
// to_host and compared — fp32 paths within 1e-5 relative, bf16 weights within the rounding of activations to
// bf16, FP8 weights against their dequantization. Also the backend's contract: device checks, host
// synchronisation counts, non-finite rows in sampling. Skipped where no CUDA device is usable; the cuda-emu
// label runs it on the emulation.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "runtime/weights/fp8_blocks.h"
#include "tests/gpu/gpu_test_support.h"

namespace capserve::kernels {
namespace {

using Rng = std::mt19937_64;

using test::relative_error;

std::vector<float> normal(Rng& rng, std::size_t n, float sd = 1.0F) {
  return test::normal_vector(rng, n, sd);
}

// A weight in `dtype` bytes (f32 as is; bf16 by truncation, which is exact to compare: both backends read the
// same bytes).
struct HostWeight {
  std::vector<std::byte> bytes;
  WeightView view;
};

HostWeight host_weight(const std::vector<float>& values, DType dtype, std::int64_t rows, std::int64_t cols) {
  HostWeight w;
  w.bytes.resize(values.size() * dtype_size(dtype));
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::f32) {
      std::memcpy(w.bytes.data() + 4 * i, &values[i], 4);
    } else {
      const auto h = static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(values[i]) >> 16);
      std::memcpy(w.bytes.data() + 2 * i, &h, 2);
    }
  }
  w.view = {dtype, w.bytes.data(), rows, cols};
  return w;
}

// A block-quantized FP8 weight [rows, cols] with blocks of block_rows x block_cols (the last ones partial
// where the sizes are not multiples): random E4M3 bytes (no NaN) and f32 scales (or bf16, which the device
// widens when uploading), and their bf16 dequantization by the checkpoint's code
// (runtime/weights/fp8_blocks.h), which the reference computes with.
struct Fp8Weight {
  std::vector<std::uint8_t> bytes;
  std::vector<float> scales;
  std::vector<std::uint16_t> bf16_scales;
  std::vector<std::uint16_t> bf16;
  WeightView fp8;
  WeightView dequantized;
};

Fp8Weight fp8_weight(Rng& rng, std::int64_t rows, std::int64_t cols, std::int64_t block_rows,
                     std::int64_t block_cols, DType scale_dtype = DType::f32) {
  Fp8Weight w;
  const BlockScales shape{DType::f32, nullptr, block_rows, block_cols};
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(0.5F / 448.0F, 2.0F / 448.0F);
  w.bytes.resize(static_cast<std::size_t>(rows * cols));
  for (std::uint8_t& b : w.bytes) {
    do {
      b = static_cast<std::uint8_t>(byte(rng));
    } while ((b & 0x7FU) == 0x7FU);  // NaN
  }
  w.scales.resize(static_cast<std::size_t>(shape.grid_rows(rows) * shape.grid_cols(cols)));
  for (float& f : w.scales) f = scale(rng);
  const auto* data = reinterpret_cast<const std::byte*>(w.bytes.data());
  const auto* scale_data = reinterpret_cast<const std::byte*>(w.scales.data());
  if (scale_dtype == DType::bf16) {
    for (const float f : w.scales)
      w.bf16_scales.push_back(static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(f) >> 16));
    scale_data = reinterpret_cast<const std::byte*>(w.bf16_scales.data());
  }
  const runtime::TensorInfo info{"w", DType::f8_e4m3, {rows, cols}, data, w.bytes.size()};
  const runtime::TensorInfo scale_info{"w_scale_inv",
                                       scale_dtype,
                                       {shape.grid_rows(rows), shape.grid_cols(cols)},
                                       scale_data,
                                       w.scales.size() * dtype_size(scale_dtype)};
  w.bf16.resize(w.bytes.size());
  runtime::dequantize_fp8_blocks(info, scale_info, {block_rows, block_cols}, w.bf16);
  w.fp8 = {DType::f8_e4m3, data, rows, cols, {scale_dtype, scale_data, block_rows, block_cols}};
  w.dequantized = {DType::bf16, reinterpret_cast<const std::byte*>(w.bf16.data()), rows, cols};
  return w;
}

// Both backends, and the means to put the same data on each and bring results back.
class BackendPair : public ::testing::Test {
 protected:
  void SetUp() override { CAPSERVE_REQUIRE_CUDA_DEVICE(); }

  cpu::CpuBackend cpu_{1};
  std::optional<cuda::CudaBackend> gpu_storage_;
  std::vector<Buffer> buffers_;

  cuda::CudaBackend& gpu() {
    if (!gpu_storage_) gpu_storage_.emplace(0);
    return *gpu_storage_;
  }
  // Host values as a tensor of `backend` (copied in; kept alive by the fixture).
  template <typename T>
  Tensor put(Backend& backend, const std::vector<T>& host, std::initializer_list<std::int64_t> shape) {
    buffers_.emplace_back();
    const Tensor t = backend.scratch(buffers_.back(), dtype_of<T>(), shape);
    backend.from_host(std::as_bytes(std::span(host)), t);
    return t;
  }
  Tensor weight(Backend& backend, const WeightView& w) {
    buffers_.emplace_back();
    return backend.upload(w, buffers_.back());
  }
  template <typename T>
  std::vector<T> get(Backend& backend, const Tensor& t) {
    std::vector<T> out(static_cast<std::size_t>(t.numel()));
    backend.to_host(t, std::as_writable_bytes(std::span(out)), HostSync::logits);
    return out;
  }
  Tensor zeros(Backend& backend, std::initializer_list<std::int64_t> shape) {
    std::int64_t n = 1;
    for (const std::int64_t d : shape) n *= d;
    return put(backend, std::vector<float>(static_cast<std::size_t>(n), 0.0F), shape);
  }
};

TEST_F(BackendPair, DenseOperationsAgree) {
  Rng rng(101);
  const std::int64_t rows = 9, hidden = 64, out_dim = 48, vocab = 30;
  const std::vector<float> x = normal(rng, static_cast<std::size_t>(rows * hidden));
  const std::vector<std::int32_t> ids = {3, 0, 29, 7, 7, 12, 1, 2, 28};
  for (const DType dtype : {DType::f32, DType::bf16}) {
    const double tol = dtype == DType::f32 ? 1e-5 : 1e-2;
    const HostWeight w =
        host_weight(normal(rng, static_cast<std::size_t>(out_dim * hidden), 0.2F), dtype, out_dim, hidden);
    const HostWeight bias = host_weight(normal(rng, static_cast<std::size_t>(out_dim)), dtype, 1, out_dim);
    const HostWeight norm = host_weight(normal(rng, static_cast<std::size_t>(hidden)), dtype, 1, hidden);
    const HostWeight table =
        host_weight(normal(rng, static_cast<std::size_t>(vocab * hidden)), dtype, vocab, hidden);
    std::vector<std::vector<float>> results[2];
    Backend* backends[2] = {&cpu_, &gpu()};
    for (int b = 0; b < 2; ++b) {
      Backend& be = *backends[b];
      const Tensor xt = put(be, x, {rows, hidden});
      const Tensor y = zeros(be, {rows, out_dim});
      be.linear(xt, weight(be, w.view), weight(be, bias.view), y);
      results[b].push_back(get<float>(be, y));
      const Tensor normed = zeros(be, {rows, hidden});
      be.rms_norm(xt, weight(be, norm.view), 1e-6F, normed);
      results[b].push_back(get<float>(be, normed));
      const Tensor embedded = zeros(be, {rows, hidden});
      be.embedding(put(be, ids, {rows}), weight(be, table.view), embedded);
      results[b].push_back(get<float>(be, embedded));
    }
    const char* names[] = {"linear", "rms_norm", "embedding"};
    for (std::size_t i = 0; i < results[0].size(); ++i) {
      const double bound = i == 0 ? tol : 1e-6;  // only the GEMM rounds its input to the weight type
      EXPECT_LT(relative_error(results[1][i], results[0][i]), bound) << names[i] << " " << dtype_name(dtype);
    }
  }

  // The residual-stream operations and rope, in sequence on each backend.
  const std::vector<float> src = normal(rng, x.size());
  const std::vector<float> gate = normal(rng, static_cast<std::size_t>(rows));
  const RotaryLayout layout{4, 16, 0, 16, false};
  const std::vector<float> cos = normal(rng, static_cast<std::size_t>(rows * 8));
  const std::vector<float> sin = normal(rng, cos.size());
  const std::int64_t picks[] = {8, 0, 3};
  std::vector<float> finals[2];
  Backend* backends[2] = {&cpu_, &gpu()};
  for (int b = 0; b < 2; ++b) {
    Backend& be = *backends[b];
    const Tensor xt = put(be, x, {rows, hidden});
    const Tensor st = put(be, src, {rows, hidden});
    be.add(xt, st);
    be.add_sigmoid_gated(xt, st, put(be, gate, {rows}));
    be.clamp(xt, 1.7F);
    be.rope(xt, layout, put(be, cos, {rows, 8}), put(be, sin, {rows, 8}));
    const Tensor picked = zeros(be, {3, hidden});
    be.gather_rows(xt, picks, picked);
    finals[b] = get<float>(be, picked);
  }
  EXPECT_LT(relative_error(finals[1], finals[0]), 1e-6);
}

// The MoE stages' operations on each backend from the same router logits. The router's probabilities and
// gate weights come from exp, which on a device may differ from the host's libm in the last bits (CUDA
// Programming Guide, "Mathematical Functions"): they agree within 1e-6, and the chosen experts exactly, as no
// token has two experts within rounding of each other. The stages after it (expert and slot counts, capacity
// (drop), the dispatch plan over 2 ranks, the grouping of what both ranks would receive, take_rows and
// combine) then run on both backends from the SAME probabilities, experts and weights (the CPU router's),
// so their index and byte results (the dispatch entries carry the weights) must be identical, and combine's
// sums within 1e-6.
TEST_F(BackendPair, MoeStagesAgree) {
  Rng rng(303);
  const std::int64_t T = 37, E = 8, k = 2, ranks = 2, hidden = 16;
  const std::vector<float> logits = normal(rng, static_cast<std::size_t>(T * E), 2.0F);
  const std::vector<float> h = normal(rng, static_cast<std::size_t>(T * hidden));
  const std::vector<std::int32_t> owners = {0, 0, 0, 0, 1, 1, 1, 1};
  const std::vector<std::int32_t> local_index = {0, 1, 2, 3, 0, 1, 2, 3};
  const std::vector<std::int32_t> local_list = {0, 1, 2, 3};
  Backend* backends[2] = {&cpu_, &gpu()};
  const auto zeros_of = [&](Backend& be, DType dtype, std::initializer_list<std::int64_t> shape) {
    buffers_.emplace_back();
    const Tensor t = be.scratch(buffers_.back(), dtype, shape);
    be.zero(t);
    return t;
  };

  // Softmax is monotonic: the top-k experts are the k largest logits. A gap far above a few ulps between the
  // k-th and the next keeps the choice the same on both backends.
  for (std::int64_t t = 0; t < T; ++t) {
    std::vector<float> row(logits.begin() + t * E, logits.begin() + (t + 1) * E);
    std::sort(row.begin(), row.end(), std::greater<>());
    ASSERT_GT(row[k - 1] - row[k], 1e-4F) << "token " << t << " has a near tie at its top-k boundary";
  }
  moe::RouterParams p;
  p.tokens = T;
  p.num_experts = E;
  p.top_k = k;
  p.normalize = true;
  std::vector<float> probs_of[2], weights_of[2];
  std::vector<std::int32_t> experts_of[2];
  for (int b = 0; b < 2; ++b) {
    Backend& be = *backends[b];
    const Tensor probs = zeros_of(be, DType::f32, {T, E});
    const Tensor experts = zeros_of(be, DType::i32, {T, k});
    const Tensor weights = zeros_of(be, DType::f32, {T, k});
    be.route(p, put(be, logits, {T, E}), {}, probs, experts, weights);
    probs_of[b] = get<float>(be, probs);
    experts_of[b] = get<std::int32_t>(be, experts);
    weights_of[b] = get<float>(be, weights);
  }
  EXPECT_EQ(experts_of[1], experts_of[0]);
  EXPECT_LT(relative_error(probs_of[1], probs_of[0]), 1e-6) << "router probabilities";
  EXPECT_LT(relative_error(weights_of[1], weights_of[0]), 1e-6) << "gate weights";

  std::vector<std::vector<std::int64_t>> ints[2];
  std::vector<std::vector<float>> floats[2];
  std::vector<std::vector<std::uint8_t>> bytes[2];
  for (int b = 0; b < 2; ++b) {
    Backend& be = *backends[b];
    const Tensor probs = put(be, probs_of[0], {T, E});
    const Tensor experts = put(be, experts_of[0], {T, k});
    const Tensor weights = put(be, weights_of[0], {T, k});
    const Tensor routed = zeros_of(be, DType::i64, {E});
    be.count_experts(experts, routed);

    CapacityCall call;
    call.params.tokens = T;
    call.params.top_k = k;
    call.params.num_experts = E;
    call.params.nbins = E;
    call.params.total_tokens = T;
    call.params.gamma = 0.5;
    call.params.normalized = true;
    call.probs = probs;
    call.local_list = put(be, local_list, {4});
    call.experts = experts;
    call.weights = weights;
    call.status = zeros_of(be, DType::u8, {T, k});
    call.totals = zeros_of(be, DType::i64, {2});
    be.schedule_capacity(call);
    const Tensor dropped = zeros_of(be, DType::i64, {T});
    const Tensor rerouted = zeros_of(be, DType::i64, {T});
    be.count_slot_states(call.status, dropped, rerouted);

    DispatchPlan plan;
    plan.row_offsets = zeros_of(be, DType::i64, {ranks + 1});
    plan.row_position = zeros_of(be, DType::i64, {T, k});
    plan.row_token = zeros_of(be, DType::i32, {T * k});
    plan.entry_offsets = zeros_of(be, DType::i64, {ranks + 1});
    plan.entries = zeros_of(be, DType::u8, {T * k, static_cast<std::int64_t>(sizeof(moe::DispatchEntry))});
    plan.counts = zeros_of(be, DType::i64, {2 * ranks});
    be.plan_dispatch(experts, weights, put(be, owners, {E}), put(be, local_index, {E}), plan);
    const std::vector<std::int64_t> row_offsets = get<std::int64_t>(be, plan.row_offsets);
    const std::vector<std::int64_t> entry_offsets = get<std::int64_t>(be, plan.entry_offsets);
    const std::int64_t rows = row_offsets.back();
    const std::int64_t entries = entry_offsets.back();

    // Both destinations' blocks as one receiver's: the sources are the two blocks.
    ReceivedGroups groups;
    groups.entries = plan.entries.rows(0, entries);
    groups.entry_start = plan.entry_offsets;
    groups.row_start = plan.row_offsets;
    groups.experts = zeros_of(be, DType::i32, {rows, k});
    groups.weights = zeros_of(be, DType::f32, {rows, k});
    groups.offsets = zeros_of(be, DType::i64, {5});
    groups.position = zeros_of(be, DType::i64, {rows, k});
    groups.row_source = zeros_of(be, DType::i32, {rows * k});
    be.group_received(groups);

    // The same exchange in fixed-size blocks: each destination's rows and entries in a block one larger than
    // the most any needs (so every block has padding), received and grouped in that layout.
    const std::int64_t row_block =
        1 + std::max(row_offsets[1] - row_offsets[0], row_offsets[2] - row_offsets[1]);
    const std::int64_t entry_block =
        1 + std::max(entry_offsets[1] - entry_offsets[0], entry_offsets[2] - entry_offsets[1]);
    const Tensor overflow = zeros_of(be, DType::i64, {1});
    const Tensor row_index = zeros_of(be, DType::i32, {ranks * row_block});
    be.block_index(plan.row_offsets, plan.row_token, row_block, row_index, overflow);
    const Tensor entry_index = zeros_of(be, DType::i32, {ranks * entry_block});
    be.block_index(plan.entry_offsets, {}, entry_block, entry_index, overflow);
    const Tensor entry_words(plan.entries.data(), DType::f32, be.device(), {T * k, 3});
    const Tensor block_entries = zeros_of(be, DType::u8, {ranks * entry_block, 12});
    be.take_rows(entry_words, entry_index,
                 Tensor(block_entries.data(), DType::f32, be.device(), {ranks * entry_block, 3}));
    const Tensor block_sent = zeros_of(be, DType::f32, {ranks * row_block, hidden});
    be.take_rows(put(be, h, {T, hidden}), row_index, block_sent);
    const Tensor block_position = zeros_of(be, DType::i64, {T, k});
    be.block_positions(plan.row_position, plan.row_offsets, row_block, block_position);
    ReceivedGroups blocks;
    blocks.entries = block_entries;
    blocks.entry_counts = plan.counts.rows(ranks, ranks);
    blocks.entry_block = entry_block;
    blocks.row_block = row_block;
    blocks.experts = zeros_of(be, DType::i32, {ranks * row_block, k});
    blocks.weights = zeros_of(be, DType::f32, {ranks * row_block, k});
    blocks.offsets = zeros_of(be, DType::i64, {5});
    blocks.position = zeros_of(be, DType::i64, {ranks * row_block, k});
    blocks.row_source = zeros_of(be, DType::i32, {ranks * row_block * k});
    be.group_received(blocks);
    const std::int64_t grouped = get<std::int64_t>(be, groups.offsets).back();
    const Tensor sent = zeros_of(be, DType::f32, {rows, hidden});
    be.take_rows(put(be, h, {T, hidden}), plan.row_token, sent);
    const Tensor grouped_rows = zeros_of(be, DType::f32, {grouped, hidden});
    be.take_rows(sent, groups.row_source, grouped_rows);
    const Tensor results = zeros_of(be, DType::f32, {rows, hidden});
    be.combine(grouped_rows, groups.position, groups.weights, results);
    const Tensor out = zeros_of(be, DType::f32, {T, hidden});
    be.combine(results, plan.row_position, {}, out);

    ints[b] = {get<std::int64_t>(be, routed),
               get<std::int64_t>(be, call.totals),
               get<std::int64_t>(be, dropped),
               get<std::int64_t>(be, rerouted),
               row_offsets,
               entry_offsets,
               get<std::int64_t>(be, plan.row_position),
               get<std::int64_t>(be, plan.counts),
               get<std::int64_t>(be, groups.offsets),
               get<std::int64_t>(be, groups.position),
               get<std::int64_t>(be, overflow),
               get<std::int64_t>(be, block_position),
               get<std::int64_t>(be, blocks.offsets),
               get<std::int64_t>(be, blocks.position)};
    // The blocks hold the counted exchange's rows and groups, padded.
    EXPECT_EQ(get<std::int64_t>(be, blocks.offsets), get<std::int64_t>(be, groups.offsets));
    EXPECT_EQ(get<std::int64_t>(be, overflow), std::vector<std::int64_t>{0});
    const std::vector<std::int32_t> ri = get<std::int32_t>(be, row_index);
    ints[b].emplace_back(ri.begin(), ri.end());
    floats[b].push_back(get<float>(be, block_sent));
    const std::vector<std::int32_t> t = get<std::int32_t>(be, plan.row_token);
    const std::vector<std::int32_t> g = get<std::int32_t>(be, groups.experts);
    ints[b].emplace_back(t.begin(), t.begin() + rows);
    ints[b].emplace_back(g.begin(), g.end());
    floats[b].push_back(get<float>(be, out));
    bytes[b] = {get<std::uint8_t>(be, call.status), get<std::uint8_t>(be, plan.entries.rows(0, entries))};
  }
  ASSERT_GT(ints[0][1][0], 0) << "gamma 0.5 dropped nothing: the capacity check is weaker than meant";
  for (std::size_t i = 0; i < ints[0].size(); ++i) EXPECT_EQ(ints[1][i], ints[0][i]) << "index result " << i;
  for (std::size_t i = 0; i < bytes[0].size(); ++i)
    EXPECT_EQ(bytes[1][i], bytes[0][i]) << "byte result " << i;
  for (std::size_t i = 0; i < floats[0].size(); ++i)
    EXPECT_LT(relative_error(floats[1][i], floats[0][i]), 1e-6) << "float result " << i;
}

TEST_F(BackendPair, AttentionOverPagedCachesAgrees) {
  Rng rng(103);
  const std::int64_t heads = 4, kv_heads = 2, d = 16, block = 4, blocks = 10;
  const std::vector<std::int32_t> table0 = {7, 2, 5};
  const std::vector<std::int32_t> table1 = {0, 9};
  const std::vector<SequenceSlice> seqs = {{0, 10, 0, table0}, {10, 3, 4, table1}};
  const std::int64_t rows = 13;
  const std::vector<float> q = normal(rng, static_cast<std::size_t>(rows * heads * d));
  const std::vector<float> k = normal(rng, static_cast<std::size_t>(rows * kv_heads * d));
  const std::vector<float> v = normal(rng, k.size());
  // Sequence 1's first 4 positions were cached by an earlier step.
  const std::vector<SequenceSlice> earlier = {{0, 4, 0, table1}};
  const std::vector<float> k0 = normal(rng, static_cast<std::size_t>(4 * kv_heads * d));
  const std::vector<float> v0 = normal(rng, k0.size());
  // Latent attention on the same slices.
  const std::int64_t dn = 8, dr = 4, dv = 6, r = 24;
  const std::vector<float> lq = normal(rng, static_cast<std::size_t>(rows * heads * (dn + dr)));
  const std::vector<float> latent = normal(rng, static_cast<std::size_t>(rows * r));
  const std::vector<float> rope_key = normal(rng, static_cast<std::size_t>(rows * dr));
  const std::vector<float> latent0 = normal(rng, static_cast<std::size_t>(4 * r));
  const std::vector<float> rope_key0 = normal(rng, static_cast<std::size_t>(4 * dr));
  const HostWeight kv_b = host_weight(normal(rng, static_cast<std::size_t>(heads * (dn + dv) * r), 0.3F),
                                      DType::bf16, heads * (dn + dv), r);
  std::vector<float> out[2][2];
  Backend* backends[2] = {&cpu_, &gpu()};
  for (int b = 0; b < 2; ++b) {
    Backend& be = *backends[b];
    const PagedKvLayer cache{zeros(be, {blocks, block, kv_heads, d}), zeros(be, {blocks, block, kv_heads, d}),
                             block, kv_heads, d};
    be.kv_store(earlier, put(be, k0, {4, kv_heads * d}), put(be, v0, {4, kv_heads * d}), cache);
    be.kv_store(seqs, put(be, k, {rows, kv_heads * d}), put(be, v, {rows, kv_heads * d}), cache);
    const Tensor attn = zeros(be, {rows, heads * d});
    be.paged_attention(seqs, put(be, q, {rows, heads * d}), cache, {heads, 0.25F, 0}, attn);
    out[b][0] = get<float>(be, attn);

    const PagedLatentLayer lcache{zeros(be, {blocks, block, r + dr}), block, r, dr};
    be.latent_store(earlier, put(be, latent0, {4, r}), put(be, rope_key0, {4, dr}), lcache);
    be.latent_store(seqs, put(be, latent, {rows, r}), put(be, rope_key, {rows, dr}), lcache);
    const Tensor lattn = zeros(be, {rows, heads * dv});
    be.latent_attention(seqs, put(be, lq, {rows, heads * (dn + dr)}), lcache, weight(be, kv_b.view),
                        {heads, dn, dr, dv, 0.3F, LatentForm::cheaper}, lattn);
    out[b][1] = get<float>(be, lattn);
  }
  EXPECT_LT(relative_error(out[1][0], out[0][0]), 1e-5) << "paged attention";
  EXPECT_LT(relative_error(out[1][1], out[0][1]), 1e-5) << "latent attention";
}

// The start-up self-check over a bf16 cache: the tensor-core attention agrees with the fp32 kernel and is
// used; a deliberately broken one is caught, reported with its figures, and the fp32 kernel serves instead
// (so the result equals the CPU backend's over the same rounded values to fp32 rounding, which the
// tensor-core kernel's bf16 products would not).
TEST_F(BackendPair, FastAttentionIsCheckedAtStartAndABrokenOneIsNotUsed) {
  const AttentionShapes shapes{8, 2, 32, 16, 0, DType::bf16, false};
  {
    cuda::CudaBackend good(0);
    const std::vector<FastKernelCheck> checks = good.check_fast_kernels(shapes);
    ASSERT_EQ(checks.size(), 1U);
    EXPECT_TRUE(checks[0].in_use) << checks[0].summary;
    EXPECT_NE(checks[0].summary.find("in use"), std::string::npos) << checks[0].summary;
    AttentionShapes f32_cache = shapes;
    f32_cache.cache_dtype = DType::f32;
    EXPECT_TRUE(good.check_fast_kernels(f32_cache).empty()) << "an f32 cache has no fast kernel to check";
    const AttentionShapes latent{8, 0, 0, 16, 0, DType::bf16, 32, 16};
    const std::vector<FastKernelCheck> latent_checks = good.check_fast_kernels(latent);
    ASSERT_EQ(latent_checks.size(), 1U);
    EXPECT_TRUE(latent_checks[0].in_use) << latent_checks[0].summary;
    EXPECT_NE(latent_checks[0].summary.find("latent"), std::string::npos) << latent_checks[0].summary;
  }
  gpu().use_fast_attention([](const cuda::DeviceAttentionBatch& batch, const cuda::SharedKvAttention& a,
                              const cuda::FlashWorkspace& workspace, cudaStream_t stream) {
    cuda::SharedKvAttention wrong = a;
    wrong.scale *= 4.0F;
    cuda::flash_attention(batch, wrong, workspace, stream);
  });
  const std::vector<FastKernelCheck> checks = gpu().check_fast_kernels(shapes);
  ASSERT_EQ(checks.size(), 1U);
  EXPECT_FALSE(checks[0].in_use);
  EXPECT_NE(checks[0].summary.find("NOT used"), std::string::npos) << checks[0].summary;

  Rng rng(109);
  const std::int64_t heads = 8, kv_heads = 2, d = 32, block = 16, blocks = 4, rows = 23;
  const std::vector<std::int32_t> table0 = {3, 1};
  const std::vector<std::int32_t> table1 = {0};
  const std::vector<SequenceSlice> seqs = {{0, 20, 0, table0}, {20, 3, 0, table1}};
  const auto rounded = [](std::vector<float> values) {
    for (float& x : values) {
      const auto u = std::bit_cast<std::uint32_t>(x);
      x = std::bit_cast<float>(((u + 0x7FFFU + ((u >> 16) & 1U)) >> 16) << 16);
    }
    return values;
  };
  const std::vector<float> q = normal(rng, static_cast<std::size_t>(rows * heads * d));
  const std::vector<float> k = rounded(normal(rng, static_cast<std::size_t>(rows * kv_heads * d)));
  const std::vector<float> v = rounded(normal(rng, k.size()));
  std::vector<float> out[2];
  Backend* backends[2] = {&cpu_, &gpu()};
  for (int b = 0; b < 2; ++b) {
    Backend& be = *backends[b];
    const DType dtype = b == 0 ? DType::f32 : DType::bf16;
    buffers_.emplace_back();
    const Tensor kc = be.scratch(buffers_.back(), dtype, {blocks, block, kv_heads, d});
    buffers_.emplace_back();
    const Tensor vc = be.scratch(buffers_.back(), dtype, {blocks, block, kv_heads, d});
    be.zero(kc);
    be.zero(vc);
    const PagedKvLayer cache{kc, vc, block, kv_heads, d};
    be.kv_store(seqs, put(be, k, {rows, kv_heads * d}), put(be, v, {rows, kv_heads * d}), cache);
    const Tensor attn = zeros(be, {rows, heads * d});
    be.paged_attention(seqs, put(be, q, {rows, heads * d}), cache, {heads, 0.25F, 0}, attn);
    out[b] = get<float>(be, attn);
  }
  EXPECT_LT(relative_error(out[1], out[0]), 1e-5) << "the fp32 kernel serves after the check refused";
}

TEST_F(BackendPair, GroupedExpertFfnAgrees) {
  Rng rng(107);
  const std::int64_t hidden = 32, ffn = 24;
  const std::vector<std::int64_t> offsets = {0, 5, 5, 12};
  const std::vector<float> x = normal(rng, static_cast<std::size_t>(12 * hidden));
  for (const DType dtype : {DType::f32, DType::bf16}) {
    std::vector<HostWeight> host;
    for (int e = 0; e < 3; ++e) {
      host.push_back(
          host_weight(normal(rng, static_cast<std::size_t>(ffn * hidden), 0.3F), dtype, ffn, hidden));
      host.push_back(
          host_weight(normal(rng, static_cast<std::size_t>(ffn * hidden), 0.3F), dtype, ffn, hidden));
      host.push_back(
          host_weight(normal(rng, static_cast<std::size_t>(hidden * ffn), 0.3F), dtype, hidden, ffn));
    }
    std::vector<float> out[2];
    Backend* backends[2] = {&cpu_, &gpu()};
    for (int b = 0; b < 2; ++b) {
      Backend& be = *backends[b];
      std::vector<ExpertWeights> experts;
      for (std::size_t e = 0; e < 3; ++e)
        experts.push_back({weight(be, host[3 * e].view), weight(be, host[3 * e + 1].view),
                           weight(be, host[3 * e + 2].view)});
      const Tensor y = zeros(be, {12, hidden});
      be.grouped_expert_ffn(put(be, x, {12, hidden}), offsets, experts, y);
      out[b] = get<float>(be, y);
    }
    EXPECT_LT(relative_error(out[1], out[0]), dtype == DType::f32 ? 1e-5 : 2e-2) << dtype_name(dtype);
  }
}

// FP8 weights stay FP8 on the device (keeps_fp8) and its linear layer reads them directly: against the CPU
// backend on their bf16 dequantization (the reference: the CPU keeps dequantizing) within the bf16 bound
// above, and against the device's own bf16 path on that dequantization within 1e-5, i.e. the same rounding
// of activations and weights, only the sums in another order. Every row count 1..70 (one tile of 32 rows,
// two, three), outputs and inputs not multiples of the tile (64) nor of the blocks (partial blocks), the
// released checkpoints' 128x128 blocks and the fixture's 16x16; inputs and blocks of widths that are
// multiples of 4 (the kernel's vectorised loads) and others (one element at a time).
TEST_F(BackendPair, Fp8LinearAgreesWithItsDequantizedWeight) {
  EXPECT_TRUE(gpu().keeps_fp8());
  EXPECT_FALSE(cpu_.keeps_fp8());
  Rng rng(113);
  struct Case {
    std::int64_t out_dim, in_dim, block_rows, block_cols;
    std::vector<std::int64_t> rows;
    DType scale_dtype = DType::f32;
  };
  std::vector<std::int64_t> every(70);
  for (std::size_t i = 0; i < every.size(); ++i) every[i] = static_cast<std::int64_t>(i) + 1;
  const Case cases[] = {{72, 84, 16, 16, every},
                        {200, 150, 128, 128, {1, 2, 33, 70}},
                        {40, 130, 16, 64, {5}, DType::bf16},
                        {130, 256, 128, 128, {1, 70}},
                        {30, 84, 8, 6, {3, 40}}};
  for (const Case& c : cases) {
    const Fp8Weight w = fp8_weight(rng, c.out_dim, c.in_dim, c.block_rows, c.block_cols, c.scale_dtype);
    const HostWeight bias =
        host_weight(normal(rng, static_cast<std::size_t>(c.out_dim)), DType::f32, 1, c.out_dim);
    const Tensor cpu_w = weight(cpu_, w.dequantized);
    const Tensor gpu_bf16 = weight(gpu(), w.dequantized);
    const Tensor gpu_fp8 = weight(gpu(), w.fp8);
    ASSERT_EQ(gpu_fp8.dtype(), DType::f8_e4m3);
    ASSERT_FALSE(gpu_fp8.block_scales().empty());
    double worst_cpu = 0.0, worst_bf16 = 0.0;
    for (const std::int64_t m : c.rows) {
      const std::vector<float> x = normal(rng, static_cast<std::size_t>(m * c.in_dim));
      const auto run = [&](Backend& be, const Tensor& wt) {
        const Tensor y = zeros(be, {m, c.out_dim});
        be.linear(put(be, x, {m, c.in_dim}), wt, weight(be, bias.view), y);
        return get<float>(be, y);
      };
      const std::vector<float> fp8 = run(gpu(), gpu_fp8);
      const double vs_cpu = relative_error(fp8, run(cpu_, cpu_w));
      const double vs_bf16 = relative_error(fp8, run(gpu(), gpu_bf16));
      EXPECT_LT(vs_cpu, 1e-2) << m << " rows of " << c.in_dim << " into " << c.out_dim;
      EXPECT_LT(vs_bf16, 1e-5) << m << " rows of " << c.in_dim << " into " << c.out_dim;
      worst_cpu = std::max(worst_cpu, vs_cpu);
      worst_bf16 = std::max(worst_bf16, vs_bf16);
    }
    std::printf(
        "[ fp8 ] linear %lldx%lld, blocks %lldx%lld, %s scales: vs CPU on the dequantized weight %.3g, vs "
        "the "
        "device's bf16 path %.3g\n",
        static_cast<long long>(c.out_dim), static_cast<long long>(c.in_dim),
        static_cast<long long>(c.block_rows), static_cast<long long>(c.block_cols),
        std::string(dtype_name(c.scale_dtype)).c_str(), worst_cpu, worst_bf16);
  }
}

// The SwiGLU experts (routed, shared and the dense MLP all go through grouped_expert_ffn) with FP8 weights,
// likewise: an empty expert, FFN widths that leave partial blocks, row counts up to 70.
TEST_F(BackendPair, Fp8GroupedExpertFfnAgreesWithItsDequantizedWeights) {
  Rng rng(127);
  const std::int64_t hidden = 96, ffn = 40, block = 16;
  const std::vector<std::int64_t> offsets = {0, 5, 5, 75, 76};
  const std::int64_t rows = offsets.back();
  const std::vector<float> x = normal(rng, static_cast<std::size_t>(rows * hidden));
  std::vector<Fp8Weight> host;
  for (int e = 0; e < 4; ++e) {
    host.push_back(fp8_weight(rng, ffn, hidden, block, block));
    host.push_back(fp8_weight(rng, ffn, hidden, block, block));
    host.push_back(fp8_weight(rng, hidden, ffn, block, block));
  }
  const auto run = [&](Backend& be, bool fp8) {
    std::vector<ExpertWeights> experts;
    const auto view = [&](std::size_t i) { return fp8 ? host[i].fp8 : host[i].dequantized; };
    for (std::size_t e = 0; e < 4; ++e)
      experts.push_back({weight(be, view(3 * e)), weight(be, view(3 * e + 1)), weight(be, view(3 * e + 2))});
    const Tensor y = zeros(be, {rows, hidden});
    be.grouped_expert_ffn(put(be, x, {rows, hidden}), offsets, experts, y);
    return get<float>(be, y);
  };
  const std::vector<float> fp8 = run(gpu(), true);
  const double vs_cpu = relative_error(fp8, run(cpu_, false));
  const double vs_bf16 = relative_error(fp8, run(gpu(), false));
  std::printf(
      "[ fp8 ] grouped expert FFN: vs CPU on the dequantized weights %.3g, vs the device's bf16 path "
      "%.3g\n",
      vs_cpu, vs_bf16);
  EXPECT_LT(vs_cpu, 2e-2);
  // The intermediate silu(gate) * up is rounded to bf16 in both paths; a sum in another order may move
  // one of its values by one bf16 step, hence more than the single GEMM's 1e-5.
  EXPECT_LT(vs_bf16, 1e-4);
}

TEST_F(BackendPair, SamplingAgreesOnGreedyAndReportsNonFiniteRows) {
  const std::int64_t vocab = 40;
  std::vector<float> logits(static_cast<std::size_t>(4 * vocab));
  for (std::size_t i = 0; i < logits.size(); ++i) logits[i] = std::sin(0.7F * static_cast<float>(i));
  logits[static_cast<std::size_t>(vocab + 17)] = std::numeric_limits<float>::quiet_NaN();
  logits[static_cast<std::size_t>(vocab + 30)] = std::numeric_limits<float>::infinity();
  logits[static_cast<std::size_t>(3 * vocab + 5)] = -std::numeric_limits<float>::infinity();
  const std::vector<SampleControls> controls = {{}, {}, {0.0F, 0, 1.0F, 1, 0}, {0.9F, 5, 0.9F, 3, 2}};
  std::vector<std::int32_t> tokens[2];
  Backend* backends[2] = {&cpu_, &gpu()};
  for (int b = 0; b < 2; ++b) {
    Backend& be = *backends[b];
    const Tensor drawn = put(be, std::vector<std::int32_t>(4, 0), {4});
    be.sample(put(be, logits, {4, vocab}), controls, drawn);
    tokens[b] = get<std::int32_t>(be, drawn);
  }
  EXPECT_EQ(tokens[1][0], tokens[0][0]);
  EXPECT_EQ(tokens[1][2], tokens[0][2]);
  for (int b = 0; b < 2; ++b) {
    EXPECT_EQ(tokens[b][1], non_finite_token(17)) << "backend " << b;
    EXPECT_EQ(tokens[b][3], non_finite_token(5)) << "backend " << b;
  }
}

TEST_F(BackendPair, TokenLogprobsAgreeOnValuesTopKTiesAndNan) {
  // Rows wider than a block (1000 > 256 threads), logits as spread as a trained model's, one row with a
  // four-way tie for the lead, one with a NaN; tokens include one outside the vocabulary.
  Rng rng(7);
  const std::int64_t rows = 5, vocab = 1000;
  std::vector<float> logits = normal(rng, static_cast<std::size_t>(rows * vocab), 4.0F);
  for (const std::int64_t id : {900, 17, 400, 3}) logits[static_cast<std::size_t>(2 * vocab + id)] = 30.0F;
  logits[static_cast<std::size_t>(3 * vocab + 55)] = std::numeric_limits<float>::quiet_NaN();
  const std::vector<std::int32_t> tokens = {0, 999, 400, 12, static_cast<std::int32_t>(vocab)};
  for (const std::int64_t k : {std::int64_t{0}, std::int64_t{20}}) {
    std::vector<float> values[2];
    std::vector<std::int32_t> ids[2];
    Backend* backends[2] = {&cpu_, &gpu()};
    for (int b = 0; b < 2; ++b) {
      Backend& be = *backends[b];
      const Tensor v = zeros(be, {rows, 1 + k});
      const Tensor top =
          put(be, std::vector<std::int32_t>(static_cast<std::size_t>(rows * k), -1), {rows, k});
      be.token_logprobs(put(be, logits, {rows, vocab}), put(be, tokens, {rows}), v, top);
      values[b] = get<float>(be, v);
      ids[b] = get<std::int32_t>(be, top);
    }
    EXPECT_EQ(ids[1], ids[0]) << "k " << k;
    for (std::size_t i = 0; i < values[0].size(); ++i) {
      const bool nan_row = i / static_cast<std::size_t>(1 + k) == 3;
      if (nan_row || (k == 0 && i == 4) || (k > 0 && i == static_cast<std::size_t>(4 * (1 + k)))) {
        EXPECT_TRUE(std::isnan(values[1][i]) && std::isnan(values[0][i])) << "value " << i << ", k " << k;
      } else {
        EXPECT_NEAR(values[1][i], values[0][i], 1e-4) << "value " << i << ", k " << k;
      }
    }
    if (k > 0) {
      const auto tied = std::vector<std::int32_t>(ids[1].begin() + 2 * k, ids[1].begin() + 2 * k + 4);
      EXPECT_EQ(tied, (std::vector<std::int32_t>{3, 17, 400, 900})) << "ties go to the lower id";
    }
  }
}

TEST_F(BackendPair, TensorsOfAnotherDeviceAndHostSynchronisationsAreChecked) {
  std::vector<float> host(8, 1.0F);
  const Tensor on_cpu = Tensor::host(std::span(host), {2, 4});
  const Tensor on_gpu = zeros(gpu(), {2, 4});
  try {
    gpu().add(on_gpu, on_cpu);
    ADD_FAILURE() << "a CPU tensor was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("a tensor on cpu"), std::string::npos) << e.what();
  }
  const std::int64_t before = gpu().host_syncs(HostSync::sampled_tokens);
  std::vector<float> back(8);
  gpu().to_host(on_gpu, std::as_writable_bytes(std::span(back)), HostSync::sampled_tokens);
  EXPECT_EQ(gpu().host_syncs(HostSync::sampled_tokens), before + 1);
  EXPECT_EQ(back, std::vector<float>(8, 0.0F));
}

// A backend for device 1 built while device 0 is current (as when no NCCL communicator made its device
// current first) runs its GEMMs there: its cuBLAS handle must be created with its own device current.
TEST(CudaBackendDevice, ABackendBuiltWhileAnotherDeviceIsCurrentRunsItsGemmsOnItsOwn) {
  CAPSERVE_REQUIRE_CUDA_DEVICE();
  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
  if (devices < 2) GTEST_SKIP() << "needs two CUDA devices (the cuda-emu run emulates two)";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  cuda::CudaBackend backend(1);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);  // whatever the constructor left current
  const std::vector<float> x = {1, 2, 3, 4};
  const std::vector<float> w = {1, 0, 0, 1, 1, 1};  // [3, 2]: y = [x0, x1, x0 + x1] per row
  Buffer x_slot, w_slot, y_slot;
  const Tensor xt = backend.scratch(x_slot, DType::f32, {2, 2});
  backend.from_host(std::as_bytes(std::span(x)), xt);
  const Tensor wt = backend.upload({DType::f32, reinterpret_cast<const std::byte*>(w.data()), 3, 2}, w_slot);
  const Tensor yt = backend.scratch(y_slot, DType::f32, {2, 3});
  backend.linear(xt, wt, {}, yt);
  std::vector<float> y(6);
  backend.to_host(yt, std::as_writable_bytes(std::span(y)), HostSync::logits);
  EXPECT_EQ(y, (std::vector<float>{1, 2, 3, 3, 4, 7}));
}

}  // namespace
}  // namespace capserve::kernels
