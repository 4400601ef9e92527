// capserve-bench-kernels: the CUDA backend's operations at the shapes of real models (DeepSeek-V3,
// Qwen3-MoE-235B, Mixtral), timed with CUDA events on the backend's stream, each row beside its bound: the
// fewest bytes it must move at the device's measured copy bandwidth, or its FLOPs at the measured bf16 matrix
// rate, whichever is larger. The two ceilings are measured first in the same run (a device-to-device copy;
// one large bf16 cuBLAS GEMM). tools/gpu/torch_peer.py times the same rows through PyTorch and
// tools/gpu/report.py joins the two (tools/gpu/README.md).
//
//   --shapes real   the model shapes (a GPU with ~10 GB free)
//   --shapes tiny   the same rows at toy sizes: the harness under the CUDA emulation in CI (correct, not
//   timed)
//
// One JSON object per row on stdout (--json FILE as well): name, shape, ms (median of the timed repetitions),
// bytes, flops, bound_ms and ratio (ms / bound_ms).
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <regex>
#include <span>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/gemm.h"
#include "runtime/cli/version.h"

namespace {

using namespace capserve;
using kernels::Backend;
using kernels::Buffer;
using kernels::DType;
using kernels::Tensor;
using nlohmann::json;

// The sizes of every row; `real` and `tiny` differ only in these numbers.
struct Shapes {
  // DeepSeek-V3 latent attention.
  std::int64_t mla_seqs, mla_heads, mla_rank, mla_rope, mla_nope, mla_v, mla_short, mla_long, mla_prefill;
  // Qwen3-MoE-235B grouped-query attention.
  std::int64_t gqa_seqs, gqa_heads, gqa_kv_heads, gqa_dim, gqa_context, gqa_prefill;
  // Grouped expert FFN (DeepSeek-V3 expert: hidden 7168, intermediate 2048).
  std::int64_t ffn_experts, ffn_rows, ffn_hidden, ffn_inter;
  // Router and dispatch plan (DeepSeek-V3: 256 experts, top-8, 8 groups, 4 chosen).
  std::int64_t router_small, router_large, router_experts, router_k, router_groups, router_topk_groups, ranks;
  // Sampling (DeepSeek-V3 vocabulary).
  std::int64_t sample_rows, vocab;
  // Ceilings and copies.
  std::int64_t peak_gemm, copy_bytes, h2d_bytes;
  std::int64_t noise;  // elements of the random block large tensors repeat (TensorPool)
  int reps, launches;
};

constexpr Shapes kReal{.mla_seqs = 64,
                       .mla_heads = 128,
                       .mla_rank = 512,
                       .mla_rope = 64,
                       .mla_nope = 128,
                       .mla_v = 128,
                       .mla_short = 1024,
                       .mla_long = 4096,
                       .mla_prefill = 2048,
                       .gqa_seqs = 64,
                       .gqa_heads = 64,
                       .gqa_kv_heads = 4,
                       .gqa_dim = 128,
                       .gqa_context = 4096,
                       .gqa_prefill = 2048,
                       .ffn_experts = 32,
                       .ffn_rows = 16,
                       .ffn_hidden = 7168,
                       .ffn_inter = 2048,
                       .router_small = 64,
                       .router_large = 512,
                       .router_experts = 256,
                       .router_k = 8,
                       .router_groups = 8,
                       .router_topk_groups = 4,
                       .ranks = 8,
                       .sample_rows = 64,
                       .vocab = 129280,
                       .peak_gemm = 8192,
                       .copy_bytes = std::int64_t{2} << 30,
                       .h2d_bytes = std::int64_t{256} << 20,
                       .noise = std::int64_t{32} << 20,
                       .reps = 20,
                       .launches = 1000};
constexpr Shapes kTiny{.mla_seqs = 2,
                       .mla_heads = 4,
                       .mla_rank = 16,
                       .mla_rope = 4,
                       .mla_nope = 8,
                       .mla_v = 8,
                       .mla_short = 8,
                       .mla_long = 16,
                       .mla_prefill = 12,
                       .gqa_seqs = 2,
                       .gqa_heads = 4,
                       .gqa_kv_heads = 2,
                       .gqa_dim = 16,
                       .gqa_context = 16,
                       .gqa_prefill = 12,
                       .ffn_experts = 3,
                       .ffn_rows = 4,
                       .ffn_hidden = 32,
                       .ffn_inter = 16,
                       .router_small = 4,
                       .router_large = 12,
                       .router_experts = 16,
                       .router_k = 4,
                       .router_groups = 4,
                       .router_topk_groups = 2,
                       .ranks = 2,
                       .sample_rows = 3,
                       .vocab = 50,
                       .peak_gemm = 32,
                       .copy_bytes = std::int64_t{1} << 16,
                       .h2d_bytes = std::int64_t{1} << 16,
                       .noise = 1000,
                       .reps = 2,
                       .launches = 4};

// Timing with CUDA events on the backend's stream: `reps` event pairs around `inner` calls, median per call.
class Timer {
 public:
  explicit Timer(cudaStream_t stream) : stream_(stream) {
    CAPSERVE_CUDA_CHECK(cudaEventCreate(&start_));
    CAPSERVE_CUDA_CHECK(cudaEventCreate(&stop_));
  }
  ~Timer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;

  double median_ms(int reps, int inner, const std::function<void()>& call) {
    for (int w = 0; w < 2; ++w) call();  // warm: module load, handles, grow-only scratch
    std::vector<double> ms;
    for (int r = 0; r < reps; ++r) {
      CAPSERVE_CUDA_CHECK(cudaEventRecord(start_, stream_));
      for (int i = 0; i < inner; ++i) call();
      CAPSERVE_CUDA_CHECK(cudaEventRecord(stop_, stream_));
      CAPSERVE_CUDA_CHECK(cudaEventSynchronize(stop_));
      float elapsed = 0.0F;
      CAPSERVE_CUDA_CHECK(cudaEventElapsedTime(&elapsed, start_, stop_));
      ms.push_back(static_cast<double>(elapsed) / inner);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  }

 private:
  cudaStream_t stream_;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

// Device tensors of random (never zero) contents, kept alive by the pool. A large tensor repeats one block of
// normal noise (generated once: drawing gigabytes of normals on the host would take minutes), at a period
// larger than the L2 cache, so that reading it still streams from device memory.
class TensorPool {
 public:
  TensorPool(Backend& backend, std::int64_t noise_elements) : backend_(backend) {
    std::mt19937_64 rng(7);
    std::normal_distribution<float> normal(0.0F, 1.0F);
    noise_.resize(static_cast<std::size_t>(noise_elements));
    for (float& v : noise_) v = normal(rng);
  }

  Tensor random(DType dtype, std::initializer_list<std::int64_t> shape, float sd = 1.0F) {
    buffers_.emplace_back();
    const Tensor t = backend_.scratch(buffers_.back(), dtype, shape);
    const std::int64_t n = t.numel();
    const std::int64_t period = std::min<std::int64_t>(n, static_cast<std::int64_t>(noise_.size()));
    const std::size_t size = kernels::dtype_size(dtype);
    std::vector<std::byte> block(static_cast<std::size_t>(period) * size);
    for (std::int64_t i = 0; i < period; ++i) {
      const float v = sd * noise_[static_cast<std::size_t>(i)];
      if (dtype == DType::f32) {
        std::memcpy(block.data() + 4 * i, &v, 4);
      } else if (dtype == DType::f8_e4m3) {  // bits of the noise with exponent bit 0 clear: never NaN
        block[static_cast<std::size_t>(i)] =
            static_cast<std::byte>((std::bit_cast<std::uint32_t>(v) >> 16) & 0xF7U);
      } else {
        const auto h = static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(v) >> 16);
        std::memcpy(block.data() + 2 * i, &h, 2);
      }
    }
    auto* base = static_cast<std::byte*>(t.data());
    for (std::int64_t first = 0; first < n; first += period) {
      const std::int64_t count = std::min(period, n - first);
      const Tensor part(base + static_cast<std::size_t>(first) * size, dtype, t.device(), {count});
      backend_.from_host(std::span(block).first(static_cast<std::size_t>(count) * size), part);
    }
    CAPSERVE_CUDA_CHECK(cudaStreamSynchronize(backend_.stream()));  // the host block may go now
    return t;
  }
  // A block-quantized FP8 weight [rows, cols] with f32 scales per block x block (what a DeepSeek-V3
  // checkpoint's F8_E4M3 weights become on the device): bytes from the noise (exponents below 15, so never
  // NaN) and scales of about 1/448.
  Tensor random_fp8(std::int64_t rows, std::int64_t cols, std::int64_t block) {
    const Tensor bytes = random(DType::f8_e4m3, {rows, cols});
    const kernels::BlockScales shape{DType::f32, nullptr, block, block};
    const std::vector<float> scales(static_cast<std::size_t>(shape.grid_rows(rows) * shape.grid_cols(cols)),
                                    1.0F / 448.0F);
    const Tensor s = values(scales, {static_cast<std::int64_t>(scales.size())});
    return bytes.with_block_scales({DType::f32, s.data(), block, block});
  }
  template <typename T>
  Tensor values(const std::vector<T>& host, std::initializer_list<std::int64_t> shape) {
    buffers_.emplace_back();
    const Tensor t = backend_.scratch(buffers_.back(), kernels::dtype_of<T>(), shape);
    backend_.from_host(std::as_bytes(std::span(host)), t);
    CAPSERVE_CUDA_CHECK(cudaStreamSynchronize(backend_.stream()));
    return t;
  }
  Tensor empty(DType dtype, std::initializer_list<std::int64_t> shape) {
    buffers_.emplace_back();
    const Tensor t = backend_.scratch(buffers_.back(), dtype, shape);
    backend_.zero(t);
    return t;
  }
  void clear() { buffers_.clear(); }

 private:
  Backend& backend_;
  std::vector<Buffer> buffers_;
  std::vector<float> noise_;
};

// `seqs` sequences of `new_tokens` each after `cached` tokens, each with its own blocks of a shared pool: the
// slices an attention call takes, and the causal (query, key) pairs they make.
struct RaggedBatch {
  std::int64_t blocks_per_seq = 0;
  std::vector<std::vector<std::int32_t>> tables;
  std::vector<kernels::SequenceSlice> slices;
  double pairs = 0;

  RaggedBatch(std::int64_t seqs, std::int64_t new_tokens, std::int64_t cached, std::int64_t block)
      : blocks_per_seq((cached + new_tokens + block - 1) / block), tables(static_cast<std::size_t>(seqs)) {
    for (std::int64_t i = 0; i < seqs; ++i) {
      auto& table = tables[static_cast<std::size_t>(i)];
      for (std::int64_t j = 0; j < blocks_per_seq; ++j)
        table.push_back(static_cast<std::int32_t>(i * blocks_per_seq + j));
      slices.push_back({i * new_tokens, new_tokens, cached, table});
    }
    for (std::int64_t t = 0; t < new_tokens; ++t) pairs += static_cast<double>(cached + t + 1);
    pairs *= static_cast<double>(seqs);
  }
};

std::string size_text(std::int64_t bytes) {
  return bytes >= (std::int64_t{1} << 20) ? std::to_string(bytes >> 20) + " MiB"
                                          : std::to_string(bytes >> 10) + " KiB";
}

struct Row {
  std::string name, shape;
  double ms = 0, bytes = 0, flops = 0;
};

class Bench {
 public:
  Bench(const Shapes& s, kernels::cuda::CudaBackend& gpu)
      : s_(s), gpu_(gpu), pool_(gpu, s.noise), timer_(gpu.stream()) {}

  // The ceilings, then every group of rows whose name `groups` matches.
  void run_all(const std::regex& groups, const std::function<void(const Row&)>& emit) {
    ceilings(emit);
    const auto each = [&](const char* group, void (Bench::*rows)(const std::function<void(const Row&)>&)) {
      if (!std::regex_search(group, groups)) return;
      (this->*rows)(emit);
      pool_.clear();
    };
    each("mla_decode", &Bench::latent_decode);
    each("mla_prefill", &Bench::latent_prefill);
    each("gqa", &Bench::gqa);
    each("expert_ffn", &Bench::expert_ffn);
    each("expert_ffn_fp8", &Bench::expert_ffn_fp8);
    each("router_dispatch", &Bench::router_and_plan);
    each("sample", &Bench::sampling);
    each("launch", &Bench::launch_overhead);
    each("h2d", &Bench::host_copies);
  }

  [[nodiscard]] double bandwidth() const { return bandwidth_; }
  [[nodiscard]] double flop_rate() const { return flop_rate_; }

 private:
  // Copy bandwidth (bytes read + written per second) and the bf16 GEMM rate.
  void ceilings(const std::function<void(const Row&)>& emit) {
    const Tensor a = pool_.random(DType::f32, {s_.copy_bytes / 4});
    const Tensor b = pool_.empty(DType::f32, {s_.copy_bytes / 4});
    Row copy{"ceiling_copy", size_text(s_.copy_bytes) + " d2d", 0, 2.0 * static_cast<double>(s_.copy_bytes),
             0};
    copy.ms = timer_.median_ms(s_.reps, 1, [&] { gpu_.copy(a, b); });
    bandwidth_ = copy.bytes / (copy.ms * 1e-3);
    emit(copy);

    const std::int64_t n = s_.peak_gemm;
    const Tensor x = pool_.random(DType::bf16, {n, n});
    const Tensor w = pool_.random(DType::bf16, {n, n});
    const Tensor y = pool_.empty(DType::bf16, {n, n});
    cublasHandle_t handle = nullptr;
    CAPSERVE_CUBLAS_CHECK(cublasCreate(&handle));
    CAPSERVE_CUBLAS_CHECK(cublasSetStream(handle, gpu_.stream()));
    Row gemm{"ceiling_gemm_bf16", std::to_string(n) + "^3", 0, 3.0 * 2 * n * n, 2.0 * n * n * n};
    gemm.ms = timer_.median_ms(s_.reps, 1, [&] {
      kernels::cuda::gemm_xwt(handle, x.data(), w.data(), CUDA_R_16BF, n, n, n, y.data(), CUDA_R_16BF);
    });
    cublasDestroy(handle);
    flop_rate_ = gemm.flops / (gemm.ms * 1e-3);
    emit(gemm);
  }

  // 64 decoding sequences of one context length, each its own block table over a shared bf16 latent pool.
  void latent_decode(const std::function<void(const Row&)>& emit) {
    for (const std::int64_t context : {s_.mla_short, s_.mla_long}) latent_case(emit, s_.mla_seqs, 1, context);
  }
  void latent_prefill(const std::function<void(const Row&)>& emit) {
    latent_case(emit, 1, s_.mla_prefill, 0);
  }

  void latent_case(const std::function<void(const Row&)>& emit, std::int64_t seqs, std::int64_t new_tokens,
                   std::int64_t cached) {
    const std::int64_t block = 64, h = s_.mla_heads, r = s_.mla_rank, dr = s_.mla_rope, dn = s_.mla_nope,
                       dv = s_.mla_v;
    const RaggedBatch batch(seqs, new_tokens, cached, block);
    const Tensor rows = pool_.random(DType::bf16, {seqs * batch.blocks_per_seq, block, r + dr}, 0.5F);
    const std::int64_t T = seqs * new_tokens;
    const Tensor q = pool_.random(DType::f32, {T, h * (dn + dr)});
    const Tensor kv_b = pool_.random(DType::bf16, {h * (dn + dv), r}, 0.05F);
    const Tensor out = pool_.empty(DType::f32, {T, h * dv});
    const kernels::PagedLatentLayer cache{rows, block, r, dr};
    const kernels::LatentAttentionParams params{
        h, dn, dr, dv, 1.0F / std::sqrt(static_cast<float>(dn + dr)), kernels::LatentForm::cheaper};
    // Causal context summed over the new tokens; the absorbed form's multiply-adds per (token, head): the
    // query through kv_b's key half, the scores and values over the latent rows, the output through its
    // value half.
    const double pairs = batch.pairs;
    const double absorbed =
        2.0 * h * (static_cast<double>(T) * (dn * r + r * dv) + pairs * static_cast<double>(2 * r + dr));
    const double expanded = 2.0 * h *
                            (static_cast<double>(seqs * (cached + new_tokens)) * r * (dn + dv) +
                             pairs * static_cast<double>(dn + dr + dv));
    Row row{new_tokens == 1 ? "mla_decode_ctx" + std::to_string(cached) : "mla_prefill",
            std::to_string(seqs) + "x" + std::to_string(new_tokens) + " tok, " + std::to_string(h) +
                " heads, rank " + std::to_string(r) + ", ctx " + std::to_string(cached + new_tokens),
            0,
            static_cast<double>(seqs * (cached + new_tokens) * (r + dr) * 2 + kv_b.bytes() + q.bytes() +
                                out.bytes()),
            std::min(absorbed, expanded)};
    row.ms = timer_.median_ms(s_.reps, 1,
                              [&] { gpu_.latent_attention(batch.slices, q, cache, kv_b, params, out); });
    emit(row);
  }

  // Qwen3-MoE-235B attention: 64 decoding sequences at a long context, and one prefill, over bf16 K/V.
  void gqa(const std::function<void(const Row&)>& emit) {
    const std::int64_t block = 16, h = s_.gqa_heads, kvh = s_.gqa_kv_heads, d = s_.gqa_dim;
    for (const bool decode : {true, false}) {
      const std::int64_t seqs = decode ? s_.gqa_seqs : 1;
      const std::int64_t new_tokens = decode ? 1 : s_.gqa_prefill;
      const std::int64_t cached = decode ? s_.gqa_context - 1 : 0;
      const RaggedBatch batch(seqs, new_tokens, cached, block);
      const std::int64_t pool_blocks = seqs * batch.blocks_per_seq;
      const kernels::PagedKvLayer cache{pool_.random(DType::bf16, {pool_blocks, block, kvh, d}),
                                        pool_.random(DType::bf16, {pool_blocks, block, kvh, d}), block, kvh,
                                        d};
      const std::int64_t T = seqs * new_tokens;
      const Tensor q = pool_.random(DType::f32, {T, h * d});
      const Tensor out = pool_.empty(DType::f32, {T, h * d});
      Row row{decode ? "gqa_decode_ctx" + std::to_string(s_.gqa_context) : "gqa_prefill",
              std::to_string(seqs) + "x" + std::to_string(new_tokens) + " tok, " + std::to_string(h) + "/" +
                  std::to_string(kvh) + " heads x " + std::to_string(d),
              0,
              static_cast<double>(2 * seqs * (cached + new_tokens) * kvh * d * 2 + q.bytes() + out.bytes()),
              4.0 * batch.pairs * static_cast<double>(h * d)};
      row.ms = timer_.median_ms(s_.reps, 1, [&] {
        gpu_.paged_attention(batch.slices, q, cache, {h, 1.0F / std::sqrt(static_cast<float>(d)), 0}, out);
      });
      emit(row);
      pool_.clear();
    }
  }

  // 32 local experts x 16 rows each through gate/up/down, against one dense GEMM reading the same weights.
  void expert_ffn(const std::function<void(const Row&)>& emit) {
    const std::int64_t E = s_.ffn_experts, m = s_.ffn_rows, H = s_.ffn_hidden, F = s_.ffn_inter;
    // One [3F, H] weight block per expert (gate, up, then down as [H, F] reshaped): distinct device memory.
    const Tensor all = pool_.random(DType::bf16, {3 * E * F, H}, 0.02F);
    std::vector<kernels::ExpertWeights> experts;
    for (std::int64_t e = 0; e < E; ++e) {
      const Tensor block = all.rows(3 * e * F, 3 * F);
      const Tensor down = block.rows(2 * F, F);
      experts.push_back(
          {block.rows(0, F), block.rows(F, F), Tensor(down.data(), DType::bf16, down.device(), {H, F})});
    }
    std::vector<std::int64_t> offsets;
    for (std::int64_t e = 0; e <= E; ++e) offsets.push_back(e * m);
    const Tensor x = pool_.random(DType::f32, {E * m, H});
    const Tensor y = pool_.empty(DType::f32, {E * m, H});
    Row grouped{"expert_ffn_grouped",
                std::to_string(E) + " experts x " + std::to_string(m) + " rows, " + std::to_string(H) + "->" +
                    std::to_string(F),
                0, static_cast<double>(all.bytes() + x.bytes() + y.bytes()),
                2.0 * 3 * static_cast<double>(E * m * H * F)};
    grouped.ms = timer_.median_ms(s_.reps, 1, [&] { gpu_.grouped_expert_ffn(x, offsets, experts, y); });
    emit(grouped);

    const Tensor xd = pool_.random(DType::f32, {m, H});
    const Tensor yd = pool_.empty(DType::f32, {m, 3 * E * F});
    Row dense{"dense_gemm_same_bytes",
              std::to_string(m) + " x " + std::to_string(H) + " -> " + std::to_string(3 * E * F), 0,
              static_cast<double>(all.bytes() + xd.bytes() + yd.bytes()),
              2.0 * static_cast<double>(m * H * 3 * E * F)};
    dense.ms = timer_.median_ms(s_.reps, 1, [&] { gpu_.linear(xd, all, {}, yd); });
    emit(dense);
  }

  // The same two rows with the weights in FP8 with 128x128 block scales, as DeepSeek-V3 ships them and the
  // CUDA backend keeps them (kernels/README.md, "FP8 weights kept FP8"): half the weight bytes of the bf16
  // rows, which at these few rows should halve their times.
  void expert_ffn_fp8(const std::function<void(const Row&)>& emit) {
    const std::int64_t E = s_.ffn_experts, m = s_.ffn_rows, H = s_.ffn_hidden, F = s_.ffn_inter;
    constexpr std::int64_t kBlock = 128;
    std::vector<kernels::ExpertWeights> experts;
    double weight_bytes = 0;
    const auto scale_bytes = [](std::int64_t rows, std::int64_t cols) {
      return 4.0 * static_cast<double>(((rows + kBlock - 1) / kBlock) * ((cols + kBlock - 1) / kBlock));
    };
    for (std::int64_t e = 0; e < E; ++e) {
      experts.push_back(
          {pool_.random_fp8(F, H, kBlock), pool_.random_fp8(F, H, kBlock), pool_.random_fp8(H, F, kBlock)});
      weight_bytes += 3.0 * static_cast<double>(F * H) + 2 * scale_bytes(F, H) + scale_bytes(H, F);
    }
    std::vector<std::int64_t> offsets;
    for (std::int64_t e = 0; e <= E; ++e) offsets.push_back(e * m);
    const Tensor x = pool_.random(DType::f32, {E * m, H});
    const Tensor y = pool_.empty(DType::f32, {E * m, H});
    Row grouped{"expert_ffn_grouped_fp8",
                std::to_string(E) + " experts x " + std::to_string(m) + " rows, " + std::to_string(H) + "->" +
                    std::to_string(F) + ", FP8 128x128",
                0, weight_bytes + static_cast<double>(x.bytes() + y.bytes()),
                2.0 * 3 * static_cast<double>(E * m * H * F)};
    grouped.ms = timer_.median_ms(s_.reps, 1, [&] { gpu_.grouped_expert_ffn(x, offsets, experts, y); });
    emit(grouped);

    const Tensor all = pool_.random_fp8(3 * E * F, H, kBlock);
    const Tensor xd = pool_.random(DType::f32, {m, H});
    const Tensor yd = pool_.empty(DType::f32, {m, 3 * E * F});
    Row dense{
        "dense_gemm_fp8_same_bytes",
        std::to_string(m) + " x " + std::to_string(H) + " -> " + std::to_string(3 * E * F) + ", FP8 128x128",
        0, static_cast<double>(all.bytes() + xd.bytes() + yd.bytes()) + scale_bytes(3 * E * F, H),
        2.0 * static_cast<double>(m * H * 3 * E * F)};
    dense.ms = timer_.median_ms(s_.reps, 1, [&] { gpu_.linear(xd, all, {}, yd); });
    emit(dense);
  }

  // DeepSeek-V3's sigmoid router with group-limited top-k and a correction bias, then the dispatch plan.
  void router_and_plan(const std::function<void(const Row&)>& emit) {
    const std::int64_t E = s_.router_experts, k = s_.router_k, ranks = s_.ranks;
    for (const std::int64_t T : {s_.router_small, s_.router_large}) {
      kernels::moe::RouterParams p;
      p.tokens = T;
      p.num_experts = E;
      p.top_k = k;
      p.score = kernels::moe::RouterScore::sigmoid;
      p.n_group = s_.router_groups;
      p.topk_group = s_.router_topk_groups;
      p.group_score = kernels::moe::GroupScore::top2_sum;
      p.normalize = true;
      p.scaling = 2.5F;
      const Tensor logits = pool_.random(DType::f32, {T, E});
      const Tensor bias = pool_.random(DType::f32, {E}, 0.01F);
      const Tensor probs = pool_.empty(DType::f32, {T, E});
      const Tensor experts = pool_.empty(DType::i32, {T, k});
      const Tensor weights = pool_.empty(DType::f32, {T, k});
      Row route{"router_T" + std::to_string(T),
                std::to_string(T) + " x " + std::to_string(E) + " sigmoid, groups, top-" + std::to_string(k),
                0, static_cast<double>(logits.bytes() + probs.bytes() + experts.bytes() + weights.bytes()),
                0};
      route.ms = timer_.median_ms(s_.reps, 10, [&] { gpu_.route(p, logits, bias, probs, experts, weights); });
      emit(route);

      std::vector<std::int32_t> owners, local;
      for (std::int64_t e = 0; e < E; ++e) {
        owners.push_back(static_cast<std::int32_t>(e * ranks / E));
        local.push_back(static_cast<std::int32_t>(e - (e * ranks / E) * (E / ranks)));
      }
      kernels::DispatchPlan plan;
      plan.row_offsets = pool_.empty(DType::i64, {ranks + 1});
      plan.row_position = pool_.empty(DType::i64, {T, k});
      plan.row_token = pool_.empty(DType::i32, {T * k});
      plan.entry_offsets = pool_.empty(DType::i64, {ranks + 1});
      plan.entries =
          pool_.empty(DType::u8, {T * k, static_cast<std::int64_t>(sizeof(kernels::moe::DispatchEntry))});
      plan.counts = pool_.empty(DType::i64, {2 * ranks});
      const Tensor owner_t = pool_.values(owners, {E});
      const Tensor local_t = pool_.values(local, {E});
      Row dispatch{
          "dispatch_plan_T" + std::to_string(T),
          std::to_string(T) + " x top-" + std::to_string(k) + " to " + std::to_string(ranks) + " ranks", 0,
          static_cast<double>(experts.bytes() + weights.bytes() + plan.row_position.bytes() +
                              plan.row_token.bytes() + plan.entries.bytes()),
          0};
      dispatch.ms = timer_.median_ms(s_.reps, 10,
                                     [&] { gpu_.plan_dispatch(experts, weights, owner_t, local_t, plan); });
      emit(dispatch);
    }
  }

  // Temperature + top-p sampling over DeepSeek-V3's vocabulary.
  void sampling(const std::function<void(const Row&)>& emit) {
    const std::int64_t rows = s_.sample_rows, V = s_.vocab;
    const Tensor logits = pool_.random(DType::f32, {rows, V}, 3.0F);
    const Tensor tokens = pool_.empty(DType::i32, {rows});
    std::vector<kernels::SampleControls> controls(static_cast<std::size_t>(rows));
    std::uint64_t step = 0;
    for (auto& c : controls) c = {0.7F, 0, 0.9F, 1234, 0};
    Row row{"sample_top_p", std::to_string(rows) + " x " + std::to_string(V) + ", T 0.7, top-p 0.9", 0,
            static_cast<double>(logits.bytes() + tokens.bytes()), 0};
    row.ms = timer_.median_ms(s_.reps, 1, [&] {
      for (auto& c : controls) c.step = step;
      ++step;
      gpu_.sample(logits, controls, tokens);
    });
    emit(row);
  }

  // The cost of one tiny operation: a launch and its argument checks, back to back.
  void launch_overhead(const std::function<void(const Row&)>& emit) {
    const Tensor a = pool_.random(DType::f32, {1, 32});
    const Tensor b = pool_.random(DType::f32, {1, 32});
    Row row{"launch_overhead", "add of 32 floats, " + std::to_string(s_.launches) + " back to back", 0, 256,
            0};
    row.ms = timer_.median_ms(s_.reps, s_.launches, [&] { gpu_.add(a, b); });
    emit(row);
  }

  // What a host-to-device copy costs the HOST when the stream is busy: from pageable memory cudaMemcpyAsync
  // returns only after the queued work and the copy; from pinned memory it returns at once. The row's time is
  // the host's wait in the copy call (steady clock), its bytes those copied.
  void host_copies(const std::function<void(const Row&)>& emit) {
    const std::int64_t n = s_.h2d_bytes;
    const Tensor dst = pool_.empty(DType::u8, {n});
    const Tensor busy_x = pool_.random(DType::f32, {s_.peak_gemm, s_.peak_gemm});
    const Tensor busy_w = pool_.random(DType::f32, {s_.peak_gemm, s_.peak_gemm});
    const Tensor busy_y = pool_.empty(DType::f32, {s_.peak_gemm, s_.peak_gemm});
    std::vector<std::byte> pageable(static_cast<std::size_t>(n), std::byte{1});
    void* pinned_raw = nullptr;
    CAPSERVE_CUDA_CHECK(cudaMallocHost(&pinned_raw, static_cast<std::size_t>(n)));
    const std::unique_ptr<void, decltype(&cudaFreeHost)> pinned(pinned_raw, &cudaFreeHost);
    std::memset(pinned.get(), 1, static_cast<std::size_t>(n));
    for (const bool is_pinned : {false, true}) {
      const void* src = is_pinned ? pinned.get() : static_cast<const void*>(pageable.data());
      std::vector<double> waits;
      for (int r = 0; r < s_.reps; ++r) {
        gpu_.linear(busy_x, busy_w, {}, busy_y);  // ~ms of queued work (f32 GEMM)
        const auto t0 = std::chrono::steady_clock::now();
        CAPSERVE_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src, static_cast<std::size_t>(n),
                                            cudaMemcpyHostToDevice, gpu_.stream()));
        waits.push_back(
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
        CAPSERVE_CUDA_CHECK(cudaStreamSynchronize(gpu_.stream()));
      }
      std::sort(waits.begin(), waits.end());
      emit({is_pinned ? "h2d_pinned_host_wait" : "h2d_pageable_host_wait",
            size_text(n) + " behind a queued GEMM (host ms in the call)", waits[waits.size() / 2], 0, 0});
    }
  }

  Shapes s_;
  kernels::cuda::CudaBackend& gpu_;
  TensorPool pool_;
  Timer timer_;
  double bandwidth_ = 0, flop_rate_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  capserve::runtime::log_to_stderr();
  CLI::App app{
      "capserve-bench-kernels: the CUDA backend's operations at real model shapes against their bounds"};
  runtime::add_common_flags(app, "capserve-bench-kernels");
  std::string shapes = "real";
  std::string json_path;
  std::string groups = ".";
  int device = 0;
  int reps = 0;
  app.add_option("--shapes", shapes, "real (model sizes) or tiny (the harness under the emulation)")
      ->check(CLI::IsMember({"real", "tiny"}));
  app.add_option(
      "--rows", groups,
      "only the groups of rows this regular expression finds in their names: mla_decode, mla_prefill, "
      "gqa, expert_ffn, expert_ffn_fp8, router_dispatch, sample, launch, h2d (the ceilings always run)");
  app.add_option("--reps", reps, "timed repetitions of each row (0: the shapes' own, 20 at real shapes)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--json", json_path, "also write the rows as JSON lines here");
  app.add_option("--device", device, "CUDA device index")->check(CLI::NonNegativeNumber);
  if (const auto exit_code = runtime::parse_flags(app, argc, argv, "capserve-bench-kernels", true))
    return *exit_code;

  try {
    kernels::cuda::CudaBackend gpu(device);
    cudaDeviceProp prop{};
    CAPSERVE_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    std::ofstream json_out;
    if (!json_path.empty()) json_out.open(json_path);
    Shapes chosen = shapes == "real" ? kReal : kTiny;
    if (reps > 0) chosen.reps = reps;
    Bench bench(chosen, gpu);
    std::printf("# capserve-bench-kernels on %s (%d SMs), shapes %s\n", prop.name, prop.multiProcessorCount,
                shapes.c_str());
    std::printf("%-24s %10s %10s %7s  %s\n", "row", "ms", "bound_ms", "ratio", "shape");
    bench.run_all(std::regex(groups), [&](const Row& row) {
      if (!std::isfinite(row.ms) || row.ms < 0) throw std::runtime_error(row.name + ": no valid time");
      const double bw = bench.bandwidth(), rate = bench.flop_rate();
      const double bound_ms =
          std::max(bw > 0 ? row.bytes / bw : 0.0, rate > 0 ? row.flops / rate : 0.0) * 1e3;
      const double ratio = bound_ms > 0 ? row.ms / bound_ms : 0.0;
      json line{{"name", row.name},   {"shape", row.shape},  {"ms", row.ms},
                {"bytes", row.bytes}, {"flops", row.flops},  {"bound_ms", bound_ms},
                {"ratio", ratio},     {"device", prop.name}, {"source", "capserve"}};
      if (json_out) json_out << line.dump() << "\n";
      std::printf("%-24s %10.4f %10.4f %7.2f  %s\n", row.name.c_str(), row.ms, bound_ms, ratio,
                  row.shape.c_str());
      std::fflush(stdout);
    });
    std::printf("# ceilings: copy %.0f GB/s, bf16 GEMM %.1f TFLOP/s\n", bench.bandwidth() * 1e-9,
                bench.flop_rate() * 1e-12);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "capserve-bench-kernels: %s\n", e.what());
    return 1;
  }
  return 0;
}
