#include "kernels/cuda/cuda_backend.h"

#include <algorithm>
#include <bit>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/latent_attention.h"
#include "kernels/cuda/row_kernels.h"
#include "kernels/cuda/stream_wait.h"

namespace capserve::kernels::cuda {
namespace {

// Frees device memory with its device current (and the caller's current device restored after).
void release_device(void* data, Device device) noexcept {
  int current = 0;
  cudaGetDevice(&current);
  cudaSetDevice(device.index);
  cudaFree(data);
  cudaSetDevice(current);
}

float* f32(const Tensor& t) {
  return t.ptr<float>();
}

void check_float_weight(const Tensor& w, const char* what) {
  if (!is_float(w.dtype()))
    throw std::invalid_argument(std::string("CudaBackend: ") + what + " of type " +
                                std::string(dtype_name(w.dtype())));
}

DeviceKvLayer device_layer(const PagedKvLayer& cache) {
  if (cache.v.dtype() != cache.k.dtype())
    throw std::invalid_argument("CudaBackend: a KV cache with K in " +
                                std::string(dtype_name(cache.k.dtype())) + " and V in " +
                                std::string(dtype_name(cache.v.dtype())));
  return {cache.k.data(),   cache.v.data(),     cache.k.dtype(),
          cache.block_size, cache.num_kv_heads, cache.head_dim};
}

DeviceLatentLayer device_layer(const PagedLatentLayer& cache) {
  return {cache.rows.data(), cache.rows.dtype(), cache.block_size, cache.kv_lora_rank, cache.rope_dim};
}

// The page-locked staging ring (host_staging.h): four chunks, so a weight upload fills one while the device
// reads the others, and a step's metadata (kilobytes to a few MiB) never laps it.
constexpr std::size_t kStagingBytes = std::size_t{32} << 20;
// Split-K attention's partial results: a decode batch of 8 rows x 128 heads x 16 splits of 512-dim values.
constexpr std::size_t kFlashPartialBytes = std::size_t{32} << 20;
constexpr int kStagingChunks = 4;

// Makes `device` current and returns it; std::runtime_error with the runtime's reason when it does not exist
// (before cuBLAS, whose own error would not say why). It runs first among the members' initialisers: the
// cuBLAS handle of `linear_` belongs to the device current at its creation.
int make_current(int device) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || device < 0 || device >= count) {
    throw std::runtime_error("CudaBackend: no CUDA device " + std::to_string(device) + " (" +
                             (e != cudaSuccess ? std::string(cudaGetErrorString(e))
                                               : std::to_string(count) + " device(s) visible") +
                             ")");
  }
  CAPSERVE_CUDA_CHECK(cudaSetDevice(device));
  return device;
}

}  // namespace

CudaBackend::CudaBackend(int device) : device_(make_current(device)) {
  CAPSERVE_CUDA_CHECK(cudaStreamCreate(&stream_));
  staging_ = std::make_unique<HostStaging>(allocate(kStagingBytes), kStagingChunks);
  cudaDeviceProp prop{};
  CAPSERVE_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
  flash_partial_ = allocate(kFlashPartialBytes);
  const auto floats = static_cast<std::int64_t>(kFlashPartialBytes / sizeof(float));
  flash_workspace_ = FlashWorkspace{flash_partial_.view(DType::f32, {floats}).ptr<float>(), floats,
                                    prop.multiProcessorCount};
}

void CudaBackend::set_wait_check(std::function<void()> check) {
  staging_->set_wait_check(check);
  wait_check_ = std::move(check);
}

CudaBackend::~CudaBackend() {
  cudaSetDevice(device_);
  cudaStreamSynchronize(stream_);
  cudaStreamDestroy(stream_);
}

void CudaBackend::enter(std::initializer_list<const Tensor*> tensors) const {
  CAPSERVE_CUDA_CHECK(cudaSetDevice(device_));
  for (const Tensor* t : tensors) {
    if (t->dims() > 0 && t->device() != device()) {
      throw std::invalid_argument("CudaBackend (" + to_string(device()) + "): a tensor on " +
                                  to_string(t->device()));
    }
  }
}

Buffer CudaBackend::allocate_memory(std::size_t bytes) {
  CAPSERVE_CUDA_CHECK(cudaSetDevice(device_));
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, std::max<std::size_t>(bytes, 1));
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // not sticky: the device stays usable
    std::size_t free = 0;
    std::size_t total = 0;
    cudaMemGetInfo(&free, &total);
    const auto mib = [](std::size_t b) { return std::to_string((b + (1U << 20) - 1) >> 20) + " MiB"; };
    throw std::runtime_error("out of device memory on " + to_string(device()) + ": " + mib(bytes) +
                             " more needed with " + mib(allocated_bytes()) + " already held, " + mib(free) +
                             " free of " + mib(total) +
                             " (weights, KV cache and workspace do not fit: fewer --kv-blocks, more ranks)");
  }
  CAPSERVE_CUDA_CHECK(e);
  return {p, bytes, device(), release_device};
}

void CudaBackend::check_kv_dtype(DType dtype) const {
  cuda::check_cache_dtype(dtype, "CudaBackend: --kv-cache-dtype");
}

Tensor CudaBackend::upload(const WeightView& host, Buffer& storage) {
  const std::size_t bytes = static_cast<std::size_t>(host.numel()) * dtype_size(host.dtype);
  if (host.dtype == DType::f8_e4m3) return upload_fp8(host, bytes, storage);
  storage = allocate(bytes);
  const Tensor t = storage.view(host.dtype, {host.rows, host.cols});
  // Chunk by chunk through the page-locked ring: the host memory may go as soon as this returns.
  staging_->copy({host.data, bytes}, t.data(), stream_);
  return t;
}

Tensor CudaBackend::upload_fp8(const WeightView& host, std::size_t bytes, Buffer& storage) {
  const BlockScales& s = host.scales;
  if (s.empty() || s.block_rows <= 0 || s.block_cols <= 0 ||
      (s.dtype != DType::f32 && s.dtype != DType::bf16))
    throw std::invalid_argument("CudaBackend::upload: an F8_E4M3 weight [" + std::to_string(host.rows) +
                                ", " + std::to_string(host.cols) + "] without f32 or bf16 block scales");
  // The kernels read f32 scales: a bf16 checkpoint's are widened (exactly) on the host first.
  const auto count = static_cast<std::size_t>(s.grid_rows(host.rows) * s.grid_cols(host.cols));
  std::vector<float> wide;
  const void* scales = s.data;
  if (s.dtype == DType::bf16) {
    wide.resize(count);
    const auto* half = static_cast<const std::uint16_t*>(s.data);
    for (std::size_t i = 0; i < count; ++i) wide[i] = std::bit_cast<float>(std::uint32_t{half[i]} << 16);
    scales = wide.data();
  }
  // One buffer: the FP8 bytes, then (256-byte aligned) the scales.
  const std::size_t scale_offset = (bytes + 255) / 256 * 256;
  storage = allocate(scale_offset + count * sizeof(float));
  const Tensor t = storage.view(DType::f8_e4m3, {host.rows, host.cols});
  auto* device_scales = static_cast<std::byte*>(t.data()) + scale_offset;
  staging_->copy({host.data, bytes}, t.data(), stream_);
  staging_->copy({static_cast<const std::byte*>(scales), count * sizeof(float)}, device_scales, stream_);
  return t.with_block_scales({DType::f32, device_scales, s.block_rows, s.block_cols});
}

void CudaBackend::copy_to_host(const Tensor& src, std::span<std::byte> dst) {
  enter({&src});
  // An empty copy still completes the queued later copies: to_host promises them delivered.
  if (dst.empty() && !readback_.outstanding()) return;
  if (!dst.empty())
    CAPSERVE_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), dst.size(), cudaMemcpyDeviceToHost, stream_));
  wait_for_stream(stream_, wait_check_);
  readback_.deliver();
}

bool CudaBackend::copy_to_host_later(const Tensor& src, std::span<std::byte> dst) {
  enter({&src});
  if (dst.empty()) return false;
  // Copies queued beyond the room (more than one step's report between two waits) wait for the earlier ones,
  // a synchronisation the emulation's counters show; growing frees the memory the queued copies land in.
  if (!readback_.fits(dst.size()) && readback_.outstanding()) finish_copies_to_host();
  if (!readback_.fits(dst.size())) {
    if (scratch_sealed()) {
      throw std::length_error("host readback: " + std::to_string(dst.size()) +
                              " bytes do not fit (sized at start-up for the engine's largest step)");
    }
    readback_.grow(2 * HostReadback::room(dst.size()));
  }
  readback_.queue(src.data(), dst, stream_);
  return true;
}

void CudaBackend::finish_copies_to_host() {
  CAPSERVE_CUDA_CHECK(cudaSetDevice(device_));
  wait_for_stream(stream_, wait_check_);
  readback_.deliver();
}

void CudaBackend::copy_from_host(std::span<const std::byte> src, const Tensor& dst) {
  enter({&dst});
  if (src.empty()) return;
  // Through the page-locked ring, so the host does not wait and `src` may change right after.
  staging_->copy(src, dst.data(), stream_);
}

template <typename T>
const T* CudaBackend::stage(std::span<const T> host) {
  return static_cast<const T*>(staging_->stage(std::as_bytes(host), stream_));
}

DeviceAttentionBatch CudaBackend::attention_batch(std::span<const SequenceSlice> seqs) {
  attention_batch_arrays(seqs, arrays_);
  const auto rows = static_cast<std::int64_t>(arrays_.row_pos.size());
  return {rows,
          stage(std::span<const std::int32_t>(arrays_.row_pos)),
          stage(std::span<const std::int32_t>(arrays_.row_seq)),
          stage(std::span<const std::int32_t>(arrays_.block_tables)),
          arrays_.max_blocks,
          stage(std::span<const std::int32_t>(arrays_.seq_first_row)),
          stage(std::span<const std::int32_t>(arrays_.seq_tokens)),
          static_cast<std::int64_t>(arrays_.seq_tokens.size()),
          arrays_.max_seq_tokens};
}

void CudaBackend::run_linear(const float* x, std::int64_t m, std::int64_t k, const Tensor& w,
                             const Tensor& bias, float* y) {
  if (w.dtype() != DType::f8_e4m3 || w.block_scales().empty()) check_float_weight(w, "a weight");
  const std::int64_t n = w.dim(0);
  if (w.row_numel() != k) {
    throw std::invalid_argument("CudaBackend::linear: x of width " + std::to_string(k) + " for a weight " +
                                w.shape_text());
  }
  if (bias.dims() > 0) check_float_weight(bias, "a bias");
  const Tensor ws = scratch(linear_workspace_, DType::u8,
                            {std::max<std::int64_t>(1, Linear::workspace_bytes(m, k, w.dtype()))});
  linear_.run(x, m, k, w.data(), w.dtype(), w.block_scales(), n, bias.dims() > 0 ? bias.data() : nullptr,
              bias.dtype(), y, ws.data(), stream_);
}

void CudaBackend::linear(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& y) {
  enter({&x, &w, &bias, &y});
  const std::int64_t m = x.dims() == 0 ? 0 : x.dim(0);
  if (y.numel() != m * w.dim(0)) {
    throw std::invalid_argument("CudaBackend::linear: y " + y.shape_text() + " for x " + x.shape_text() +
                                " and a weight " + w.shape_text());
  }
  run_linear(f32(x), m, x.row_numel(), w, bias, f32(y));
}

void CudaBackend::embedding(const Tensor& ids, const Tensor& table, const Tensor& out) {
  enter({&ids, &table, &out});
  check_float_weight(table, "an embedding table");
  const std::int64_t cols = table.row_numel();
  if (out.numel() != ids.numel() * cols)
    throw std::invalid_argument("CudaBackend::embedding: out " + out.shape_text() + " for " +
                                std::to_string(ids.numel()) + " ids of width " + std::to_string(cols));
  cuda::embedding(ids.ptr<const std::int32_t>(), ids.numel(), table.data(), table.dtype(), table.dim(0), cols,
                  f32(out), stream_);
}

void CudaBackend::rms_norm(const Tensor& x, const Tensor& weight, float eps, const Tensor& out) {
  enter({&x, &weight, &out});
  check_float_weight(weight, "a norm weight");
  const std::int64_t cols = x.row_numel();
  if (weight.numel() != cols || out.numel() != x.numel())
    throw std::invalid_argument("CudaBackend::rms_norm: x " + x.shape_text() + ", out " + out.shape_text() +
                                ", weight " + weight.shape_text());
  cuda::rms_norm(f32(x), x.dims() == 0 ? 0 : x.numel() / std::max<std::int64_t>(cols, 1), cols, weight.data(),
                 weight.dtype(), eps, f32(out), stream_);
}

void CudaBackend::rope(const Tensor& x, const RotaryLayout& layout, const Tensor& cos, const Tensor& sin) {
  enter({&x, &cos, &sin});
  const std::int64_t tokens = x.dims() == 0 ? 0 : x.dim(0);
  cuda::rope(f32(x), tokens, layout, f32(cos), f32(sin), stream_);
}

void CudaBackend::add(const Tensor& dst, const Tensor& src) {
  enter({&dst, &src});
  if (dst.numel() != src.numel())
    throw std::invalid_argument("CudaBackend::add: dst " + dst.shape_text() + " and src " + src.shape_text());
  cuda::add(f32(dst), f32(src), dst.numel(), stream_);
}

void CudaBackend::add_sigmoid_gated(const Tensor& dst, const Tensor& src, const Tensor& gate) {
  enter({&dst, &src, &gate});
  const std::int64_t rows = gate.numel();
  if (dst.numel() != src.numel() || dst.dims() == 0 || dst.dim(0) != rows)
    throw std::invalid_argument("CudaBackend::add_sigmoid_gated: dst " + dst.shape_text() + ", src " +
                                src.shape_text() + ", gate " + gate.shape_text());
  cuda::add_sigmoid_gated(f32(dst), f32(src), f32(gate), rows, dst.row_numel(), stream_);
}

void CudaBackend::copy(const Tensor& src, const Tensor& dst) {
  enter({&src, &dst});
  if (src.bytes() != dst.bytes())
    throw std::invalid_argument("CudaBackend::copy: " + src.shape_text() + " into " + dst.shape_text());
  if (!src.empty())
    CAPSERVE_CUDA_CHECK(
        cudaMemcpyAsync(dst.data(), src.data(), src.bytes(), cudaMemcpyDeviceToDevice, stream_));
}

void CudaBackend::zero(const Tensor& t) {
  enter({&t});
  if (!t.empty()) CAPSERVE_CUDA_CHECK(cudaMemsetAsync(t.data(), 0, t.bytes(), stream_));
}

void CudaBackend::clamp(const Tensor& x, float limit) {
  enter({&x});
  cuda::clamp(f32(x), x.numel(), limit, stream_);
}

void CudaBackend::gather_rows(const Tensor& src, std::span<const std::int64_t> rows, const Tensor& dst) {
  enter({&src, &dst});
  const std::int64_t width = src.row_numel();
  if (dst.dims() == 0 || dst.dim(0) != static_cast<std::int64_t>(rows.size()) || dst.row_numel() != width)
    throw std::invalid_argument("CudaBackend::gather_rows: " + std::to_string(rows.size()) + " rows of " +
                                src.shape_text() + " into " + dst.shape_text());
  for (const std::int64_t r : rows) {
    if (r < 0 || r >= src.dim(0))
      throw std::out_of_range("CudaBackend::gather_rows: row " + std::to_string(r) + " of " +
                              src.shape_text());
  }
  cuda::gather_rows(f32(src), stage(rows), static_cast<std::int64_t>(rows.size()), width, f32(dst), stream_);
}

void CudaBackend::kv_store(std::span<const SequenceSlice> seqs, const Tensor& k, const Tensor& v,
                           const PagedKvLayer& cache) {
  enter({&k, &v, &cache.k, &cache.v});
  cuda::kv_store(attention_batch(seqs), f32(k), f32(v), device_layer(cache), stream_);
}

void CudaBackend::paged_attention(std::span<const SequenceSlice> seqs, const Tensor& q,
                                  const PagedKvLayer& cache, const AttentionParams& params,
                                  const Tensor& out) {
  enter({&q, &cache.k, &cache.v, &out});
  const DeviceAttentionBatch batch = attention_batch(seqs);
  const DeviceKvLayer layer = device_layer(cache);
  if (layer.dtype == DType::bf16) {
    const SharedKvAttention fast = gqa_attention(f32(q), layer, params, f32(out));
    if (fast_attention_serves(fast, {params.num_heads, layer.num_kv_heads, layer.head_dim, layer.head_dim,
                                     layer.block_size, params.sliding_window, false})) {
      fast_attention_(batch, fast, flash_workspace_, stream_);
      return;
    }
  }
  cuda::paged_attention(batch, f32(q), layer, params, f32(out), stream_);
}

bool CudaBackend::fast_attention_serves(const SharedKvAttention& problem,
                                        const FastAttentionShape& shape) const {
  const auto refused = [&shape](const auto& c) { return c.first == shape && !c.second.in_use; };
  return flash_attention_supports(problem) && std::ranges::none_of(attention_checks_, refused);
}

std::vector<FastKernelCheck> CudaBackend::check_fast_kernels(const AttentionShapes& shapes) {
  // An f32 cache keeps the fp32 kernels by choice: nothing to check.
  if (shapes.cache_dtype != DType::bf16) return {};
  FastAttentionShape shape;
  SharedKvAttention problem;
  if (shapes.kv_lora_rank > 0) {
    shape = {shapes.num_heads,
             1,
             shapes.kv_lora_rank + shapes.rope_dim,
             shapes.kv_lora_rank,
             shapes.block_size,
             0,
             true};
    const DeviceLatentLayer layer{nullptr, DType::bf16, shape.block_size, shapes.kv_lora_rank,
                                  shapes.rope_dim};
    problem = latent_attention_problem(nullptr, layer, shape.num_heads, 1.0F, nullptr);
  } else {
    if (shapes.num_kv_heads <= 0) return {};
    shape = {shapes.num_heads,
             shapes.num_kv_heads,
             shapes.head_dim,
             shapes.head_dim,
             shapes.block_size,
             shapes.sliding_window,
             false};
    const DeviceKvLayer layer{nullptr, nullptr, DType::bf16, shape.block_size, shape.num_kv_heads, shape.dk};
    problem = gqa_attention(nullptr, layer, {shape.num_heads, 1.0F, shape.sliding_window}, nullptr);
  }
  if (!flash_attention_supports(problem)) return {};
  for (const auto& [checked, found] : attention_checks_)
    if (checked == shape) return {found};
  enter({});
  const KernelCheck check = check_fast_attention(shape, fast_attention_, flash_workspace_, stream_);
  attention_checks_.emplace_back(shape, FastKernelCheck{check.summary(), check.passed()});
  return {attention_checks_.back().second};
}

void CudaBackend::latent_store(std::span<const SequenceSlice> seqs, const Tensor& latent,
                               const Tensor& rope_key, const PagedLatentLayer& cache) {
  enter({&latent, &rope_key, &cache.rows});
  cuda::latent_store(attention_batch(seqs), f32(latent), f32(rope_key), device_layer(cache), stream_);
}

void CudaBackend::latent_attention(std::span<const SequenceSlice> seqs, const Tensor& q,
                                   const PagedLatentLayer& cache, const Tensor& kv_b,
                                   const LatentAttentionParams& params, const Tensor& out) {
  enter({&q, &cache.rows, &kv_b, &out});
  check_float_weight(kv_b, "kv_b_proj");
  const std::int64_t rows = q.dims() == 0 ? 0 : q.dim(0);
  const std::int64_t r = cache.kv_lora_rank;
  const std::int64_t heads = params.num_heads;
  const std::int64_t dn = params.qk_nope_head_dim;
  if (params.qk_rope_head_dim != cache.rope_dim || q.numel() != rows * heads * (dn + cache.rope_dim) ||
      out.numel() != rows * heads * params.v_head_dim || kv_b.dim(0) != heads * (dn + params.v_head_dim) ||
      kv_b.row_numel() != r) {
    throw std::invalid_argument(
        "CudaBackend::latent_attention: q " + q.shape_text() + ", out " + out.shape_text() + ", kv_b " +
        kv_b.shape_text() + " for " + std::to_string(heads) + " heads, kv_lora_rank " + std::to_string(r) +
        " and rope dims " + std::to_string(params.qk_rope_head_dim) + "/" + std::to_string(cache.rope_dim));
  }
  const DeviceAttentionBatch batch = attention_batch(seqs);
  const DeviceLatentLayer layer = device_layer(cache);
  const Tensor ws = scratch(latent_workspace_, DType::u8,
                            {std::max<std::int64_t>(1, LatentAttention::workspace_bytes(rows, params, r))});
  const auto core = [&](const float* q_abs, float* o_lat) {
    if (layer.dtype == DType::bf16) {
      const SharedKvAttention fast = latent_attention_problem(q_abs, layer, heads, params.scale, o_lat);
      if (fast_attention_serves(fast, {heads, 1, r + layer.rope_dim, r, layer.block_size, 0, true})) {
        fast_attention_(batch, fast, flash_workspace_, stream_);
        return;
      }
    }
    latent_attention_core(batch, q_abs, layer, heads, params.scale, o_lat, stream_);
  };
  latent_.run(rows, f32(q), r, kv_b.data(), kv_b.dtype(), params, LatentCore(core), f32(out), ws.data(),
              stream_);
}

void CudaBackend::grouped_expert_ffn(const Tensor& x, std::span<const std::int64_t> offsets,
                                     std::span<const ExpertWeights> experts, const Tensor& out) {
  enter({&x, &out});
  if (experts.empty()) return;
  if (offsets.size() != experts.size() + 1)
    throw std::invalid_argument("CudaBackend::grouped_expert_ffn: " + std::to_string(offsets.size()) +
                                " offsets for " + std::to_string(experts.size()) + " experts");
  const std::int64_t hidden = x.row_numel();
  for (std::size_t e = 0; e + 1 < offsets.size(); ++e) {
    const std::int64_t first = offsets[e];
    const std::int64_t n = offsets[e + 1] - first;
    if (n == 0) continue;
    const ExpertWeights& w = experts[e];
    enter({&w.gate, &w.up, &w.down});
    const std::int64_t ffn = w.gate.dim(0);
    const Tensor gate = scratch(gate_, DType::f32, {n, ffn});
    const Tensor up = scratch(up_, DType::f32, {n, ffn});
    const float* xe = f32(x) + first * hidden;
    run_linear(xe, n, hidden, w.gate, {}, f32(gate));
    run_linear(xe, n, hidden, w.up, {}, f32(up));
    swiglu(f32(gate), f32(up), n * ffn, f32(gate), stream_);
    run_linear(f32(gate), n, ffn, w.down, {}, f32(out) + first * hidden);
  }
}

cuda::DeviceSampleInputs CudaBackend::stage_sample_inputs(const SampleInputs& inputs, std::int64_t rows,
                                                          std::int64_t vocab) {
  if (static_cast<std::int64_t>(inputs.controls.size()) != rows ||
      (!inputs.allowed.empty() &&
       static_cast<std::int64_t>(inputs.allowed.size()) != rows * allowed_words(vocab)))
    throw std::invalid_argument("CudaBackend::sample: " + std::to_string(inputs.controls.size()) +
                                " controls and " + std::to_string(inputs.allowed.size()) +
                                " bitmask words for " + std::to_string(rows) + " rows of vocabulary " +
                                std::to_string(vocab));
  for (const SampleControls& c : inputs.controls) check_sample_ranges(c, inputs);
  return {.controls = stage(inputs.controls),
          .history = nullptr,
          .history_offset = 0,
          .banned = inputs.banned.empty() ? nullptr : stage(inputs.banned),
          .biases = inputs.biases.empty() ? nullptr : stage(inputs.biases),
          .allowed = inputs.allowed.empty() ? nullptr : stage(inputs.allowed)};
}

namespace {

// The entries of inputs.history the penalized ones of `rows` read: from the lowest start to the highest end
// of theirs (SampleBatch lays them out in row order, so about their sum); empty when none is penalized.
IndexRange history_extent(const SampleInputs& inputs, std::span<const std::int32_t> rows) {
  IndexRange extent{std::numeric_limits<std::int64_t>::max(), 0};
  for (const std::int32_t r : rows) {
    const SampleControls& c = inputs.controls[static_cast<std::size_t>(r)];
    if (!c.penalized()) continue;
    extent.begin = std::min(extent.begin, c.history.begin);
    extent.end = std::max(extent.end, c.history.end);
  }
  return extent.end == 0 ? IndexRange{} : extent;
}

}  // namespace

std::int64_t CudaBackend::sample_chunk_rows(const SampleInputs& inputs, std::int64_t first) const {
  const auto end = std::min(first + kSampleChunkRows, static_cast<std::int64_t>(sample_rows_.size()));
  const auto limit = static_cast<std::int64_t>(staging_->chunk_bytes() / sizeof(std::int32_t));
  const std::span<const std::int32_t> rows(sample_rows_);
  // The row that would take the chunk's histories past one staging chunk starts the next chunk.
  for (std::int64_t b = first + 1; b < end; ++b) {
    const IndexRange extent = history_extent(
        inputs, rows.subspan(static_cast<std::size_t>(first), static_cast<std::size_t>(b + 1 - first)));
    if (extent.end - extent.begin > limit) return b - first;
  }
  return end - first;
}

cuda::DeviceSampleInputs CudaBackend::with_history(cuda::DeviceSampleInputs device,
                                                   const SampleInputs& inputs, std::int64_t first,
                                                   std::int64_t count) {
  const IndexRange extent =
      history_extent(inputs, std::span<const std::int32_t>(sample_rows_)
                                 .subspan(static_cast<std::size_t>(first), static_cast<std::size_t>(count)));
  if (extent.end == extent.begin) return device;
  const std::span<const std::int32_t> part = inputs.history.subspan(
      static_cast<std::size_t>(extent.begin), static_cast<std::size_t>(extent.end - extent.begin));
  if (part.size_bytes() > staging_->chunk_bytes())
    throw std::length_error("CudaBackend::sample: a row's " + std::to_string(part.size()) +
                            " tokens of penalty history exceed the staging chunk of " +
                            std::to_string(staging_->chunk_bytes()) + " bytes");
  device.history = stage(part);
  device.history_offset = extent.begin;
  return device;
}

Tensor CudaBackend::sample_chunk_counts(std::int64_t vocab) {
  return scratch(sample_counts_, DType::i32, {kSampleChunkRows, vocab});
}

void CudaBackend::adjust_logits(const Tensor& logits, const SampleInputs& inputs, const Tensor& adjusted) {
  enter({&logits, &adjusted});
  const std::int64_t rows = logits.dims() == 0 ? 0 : logits.dim(0);
  const std::int64_t vocab = logits.row_numel();
  if (adjusted.numel() != logits.numel())
    throw std::invalid_argument("CudaBackend::adjust_logits: logits " + logits.shape_text() + ", adjusted " +
                                adjusted.shape_text());
  const Tensor counts = sample_chunk_counts(vocab);
  if (rows == 0) return;
  const cuda::DeviceSampleInputs device = stage_sample_inputs(inputs, rows, vocab);
  sample_rows_.resize(static_cast<std::size_t>(rows));
  std::iota(sample_rows_.begin(), sample_rows_.end(), 0);
  const std::int32_t* row_ids = stage(std::span<const std::int32_t>(sample_rows_));
  for (std::int64_t first = 0, count = 0; first < rows; first += count) {
    count = sample_chunk_rows(inputs, first);
    cuda::adjust_logits(f32(logits), vocab, with_history(device, inputs, first, count), row_ids + first,
                        count, f32(adjusted) + first * vocab, counts.ptr<std::int32_t>(), stream_);
  }
}

void CudaBackend::sample(const Tensor& logits, const SampleInputs& inputs, const Tensor& tokens) {
  enter({&logits, &tokens});
  const std::int64_t rows = logits.dims() == 0 ? 0 : logits.dim(0);
  const std::int64_t vocab = logits.row_numel();
  if (tokens.numel() != rows)
    throw std::invalid_argument("CudaBackend::sample: logits " + logits.shape_text() + ", " +
                                std::to_string(inputs.controls.size()) + " controls, tokens " +
                                tokens.shape_text());
  // Sized on every call (a fixed chunk of rows, whatever the step), so that the engine's start-up step sizes
  // them before it seals the scratch.
  const Tensor adjusted = scratch(sample_adjusted_, DType::f32, {kSampleChunkRows, vocab});
  const Tensor counts = sample_chunk_counts(vocab);
  if (rows == 0) return;
  const cuda::DeviceSampleInputs device = stage_sample_inputs(inputs, rows, vocab);
  std::int32_t* drawn = tokens.ptr<std::int32_t>();
  // Every row from its raw logits, then the rows with adjustments again, a chunk at a time, from their
  // adjusted ones (a chunk's scratch is reused once the stream has sampled it).
  cuda::sample(f32(logits), rows, vocab, device.controls, drawn, stream_);
  sample_rows_.clear();
  for (std::int64_t r = 0; r < rows; ++r) {
    if (adjusts_row(inputs, static_cast<std::size_t>(r)))
      sample_rows_.push_back(static_cast<std::int32_t>(r));
  }
  if (!sample_rows_.empty()) {
    const std::int32_t* row_ids = stage(std::span<const std::int32_t>(sample_rows_));
    const auto adjusted_rows = static_cast<std::int64_t>(sample_rows_.size());
    for (std::int64_t first = 0, count = 0; first < adjusted_rows; first += count) {
      count = sample_chunk_rows(inputs, first);
      cuda::adjust_logits(f32(logits), vocab, with_history(device, inputs, first, count), row_ids + first,
                          count, f32(adjusted), counts.ptr<std::int32_t>(), stream_);
      cuda::sample(f32(adjusted), count, vocab, device.controls, drawn, stream_, row_ids + first);
    }
  }
  mark_non_finite_rows(f32(logits), rows, vocab, drawn, stream_);
}

void CudaBackend::token_logprobs(const Tensor& logits, const Tensor& tokens, const Tensor& values,
                                 const Tensor& top_ids) {
  enter({&logits, &tokens, &values, &top_ids});
  const LogprobShape s = logprob_shape(logits, tokens, values, top_ids);
  cuda::token_logprobs(f32(logits), s.rows, s.vocab, tokens.ptr<std::int32_t>(), s.top_k, f32(values),
                       top_ids.ptr<std::int32_t>(), stream_);
}

}  // namespace capserve::kernels::cuda
