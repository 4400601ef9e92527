#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/moe_kernels.h"
#include "kernels/moe/pipeline.h"

namespace capserve::kernels::cuda {
namespace {

constexpr int kThreads = 256;

template <class Body>
__global__ void for_each_kernel(std::int64_t n, Body body) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) body(i);
}

// Exclusive prefix sums of data[0..n) in one block, the total into data[n]: each thread scans a contiguous
// segment, then the segment totals are scanned in shared memory.
__global__ void exclusive_scan_kernel(std::int64_t* data, std::int64_t n) {
  __shared__ std::int64_t partial[kThreads];
  const std::int64_t per = (n + kThreads - 1) / kThreads;
  const std::int64_t begin = threadIdx.x * per;
  const std::int64_t end = begin + per < n ? begin + per : n;
  std::int64_t sum = 0;
  for (std::int64_t i = begin; i < end; ++i) sum += data[i];
  partial[threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    std::int64_t run = 0;
    for (int t = 0; t < kThreads; ++t) {
      const std::int64_t v = partial[t];
      partial[t] = run;
      run += v;
    }
    data[n] = run;
  }
  __syncthreads();
  std::int64_t run = partial[threadIdx.x];
  for (std::int64_t i = begin; i < end; ++i) {
    const std::int64_t v = data[i];
    data[i] = run;
    run += v;
  }
}

// Launches each thread body as one kernel on the stream.
struct CudaExec {
  static constexpr bool kReadsStateFreely = false;  // a read would be a device sync
  cudaStream_t stream;
  const DeviceReduce* reduce = nullptr;

  template <class Body>
  void for_each(std::int64_t n, const Body& body) {
    if (n <= 0) return;
    const auto blocks = static_cast<unsigned>((n + kThreads - 1) / kThreads);
    launch(for_each_kernel<Body>, blocks, kThreads, 0, stream, n, body);
    CAPSERVE_CUDA_CHECK_LAUNCH();
  }
  template <class T>
  void zero(T* data, std::int64_t n) {
    if (n > 0) CAPSERVE_CUDA_CHECK(cudaMemsetAsync(data, 0, static_cast<std::size_t>(n) * sizeof(T), stream));
  }
  void reduce_sum(std::int64_t* data, std::int64_t n) {
    if (reduce != nullptr && *reduce) (*reduce)(data, n, stream);
  }
  void exclusive_scan(std::int64_t* data, std::int64_t n) {
    launch(exclusive_scan_kernel, 1, kThreads, 0, stream, data, n);
    CAPSERVE_CUDA_CHECK_LAUNCH();
  }
};

__global__ void gather_rows_kernel(const float* h, std::int64_t hidden, const std::int32_t* row_token,
                                   const std::int64_t* rows, __nv_bfloat16* x) {
  const std::int64_t row = blockIdx.x;
  if (row >= *rows) return;
  const float* src = h + static_cast<std::int64_t>(row_token[row]) * hidden;
  __nv_bfloat16* dst = x + row * hidden;
  for (std::int64_t c = threadIdx.x; c < hidden; c += blockDim.x) dst[c] = __float2bfloat16(src[c]);
}

__global__ void combine_kernel(const float* y, std::int64_t hidden, const std::int64_t* position,
                               const float* weights, std::int64_t top_k, float* out) {
  const std::int64_t t = blockIdx.x;
  for (std::int64_t c = threadIdx.x; c < hidden; c += blockDim.x) {
    float acc = 0.0F;
    for (std::int64_t s = 0; s < top_k; ++s) {
      const std::int64_t row = position[t * top_k + s];
      if (row >= 0) acc += (weights != nullptr ? weights[t * top_k + s] : 1.0F) * y[row * hidden + c];
    }
    out[t * hidden + c] = acc;
  }
}

__global__ void take_rows_kernel(const float* src, std::int64_t width, const std::int32_t* index,
                                 float* dst) {
  const std::int64_t row = blockIdx.x;
  const std::int32_t from = index[row];
  float* out = dst + row * width;
  if (from < 0) {
    for (std::int64_t c = threadIdx.x; c < width; c += blockDim.x) out[c] = 0.0F;
    return;
  }
  const float* in = src + static_cast<std::int64_t>(from) * width;
  for (std::int64_t c = threadIdx.x; c < width; c += blockDim.x) out[c] = in[c];
}

// The router with a warp per token (RouteToken's decisions, its thread body's loops spread over the lanes):
// each lane scores the experts e = lane (mod 32), and every choice is a warp argmax with RouteToken's rule —
// the first eligible candidate in ascending id, replaced only by a strictly larger one — so ties go to the
// lower id and a NaN first candidate stays chosen, as on the host. Softmax sums in another order than the
// host's loop: probabilities may differ in the last bits, never the rule.
constexpr int kRouterWarps = 8;                   // tokens per block
constexpr std::int64_t kRouterMaxExperts = 2048;  // 64 per lane: a lane's chosen experts fit one mask word

// The warp's choice among each lane's candidate (value, id; id < 0: none): RouteToken's rule over ascending
// ids. `first` carries the lowest candidate id and its value.
struct WarpChoice {
  std::int64_t first = -1;
  float first_value = 0.0F;
  std::int64_t best = -1;  // the largest non-NaN value, ties to the lower id
  float best_value = 0.0F;

  __device__ void offer(std::int64_t id, float v) {
    if (first < 0) {
      first = id;
      first_value = v;
    }
    if (v == v && (best < 0 || v > best_value)) {
      best = id;
      best_value = v;
    }
  }
  __device__ void merge(const WarpChoice& o) {
    if (o.first >= 0 && (first < 0 || o.first < first)) {
      first = o.first;
      first_value = o.first_value;
    }
    if (o.best >= 0 &&
        (best < 0 || o.best_value > best_value || (o.best_value == best_value && o.best < best))) {
      best = o.best;
      best_value = o.best_value;
    }
  }
  // Every lane gets the warp's choice.
  __device__ std::int64_t reduce() {
    for (int d = 16; d > 0; d /= 2) {
      WarpChoice o;
      o.first = __shfl_xor_sync(0xFFFFFFFFU, first, d);
      o.first_value = __shfl_xor_sync(0xFFFFFFFFU, first_value, d);
      o.best = __shfl_xor_sync(0xFFFFFFFFU, best, d);
      o.best_value = __shfl_xor_sync(0xFFFFFFFFU, best_value, d);
      merge(o);
    }
    // Nothing replaces a NaN first candidate; otherwise the largest wins.
    return first >= 0 && first_value != first_value ? first : best;
  }
};

__device__ inline float warp_sum(float v) {
  for (int d = 16; d > 0; d /= 2) v += __shfl_xor_sync(0xFFFFFFFFU, v, d);
  return v;
}

__global__ void __launch_bounds__(kRouterWarps * 32) route_warp_kernel(moe::RouteToken r) {
  const moe::RouterParams& p = r.p;
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kRouterWarps + threadIdx.x / 32;
  if (t >= p.tokens) return;  // the whole warp: t is the warp's
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t E = p.num_experts;
  const std::int64_t k = p.top_k;
  const float* logit = r.logits + t * E;
  float* prob = r.probs + t * E;
  if (p.score == moe::RouterScore::softmax) {
    WarpChoice top;  // row_max's rule: a NaN first logit is the maximum, as on the host
    for (std::int64_t e = lane; e < E; e += 32) top.offer(e, logit[e]);
    const float mx = logit[top.reduce()];
    float sum = 0.0F;
    for (std::int64_t e = lane; e < E; e += 32) {
      prob[e] = moe::exp_f32(logit[e] - mx);
      sum += prob[e];
    }
    sum = warp_sum(sum);
    for (std::int64_t e = lane; e < E; e += 32) prob[e] /= sum;
  } else {
    for (std::int64_t e = lane; e < E; e += 32) prob[e] = 1.0F / (1.0F + moe::exp_f32(-logit[e]));
  }
  __syncwarp();  // group values read other lanes' probabilities

  const std::int64_t group_size = E / p.n_group;
  const bool limited = p.topk_group < p.n_group;
  std::uint64_t groups = 0;  // bit g: group g is eligible (the same on every lane)
  if (limited) {
    for (std::int64_t chosen = 0; chosen < p.topk_group; ++chosen) {
      WarpChoice c;
      for (std::int64_t g = lane; g < p.n_group; g += 32) {
        if (((groups >> g) & 1U) == 0) c.offer(g, r.group_value(prob, g * group_size, group_size));
      }
      groups |= std::uint64_t{1} << c.reduce();
    }
  }
  std::uint64_t taken = 0;  // bit j: this lane's expert lane + 32 j is chosen
  float total = 0.0F;
  for (std::int64_t s = 0; s < k; ++s) {
    WarpChoice c;
    for (std::int64_t e = lane, j = 0; e < E; e += 32, ++j) {
      if (limited && ((groups >> (e / group_size)) & 1U) == 0) continue;
      if ((taken >> j) & 1U) continue;
      c.offer(e, r.choice(prob, e));
    }
    const std::int64_t best = c.reduce();
    if (best % 32 == lane) taken |= std::uint64_t{1} << (best / 32);
    const float w = prob[best];
    total += w;
    if (lane == 0) {
      r.experts[t * k + s] = static_cast<std::int32_t>(best);
      r.weights[t * k + s] = w;
    }
  }
  if (lane == 0 && (p.normalize || p.scaling != 1.0F)) {
    for (std::int64_t s = 0; s < k; ++s) {
      float w = r.weights[t * k + s];
      if (p.normalize) w /= total;
      if (p.scaling != 1.0F) w *= p.scaling;
      r.weights[t * k + s] = w;
    }
  }
}

}  // namespace

void route(const moe::RouterParams& p, const float* logits, const float* bias, float* probs,
           std::int32_t* experts, float* weights, cudaStream_t stream) {
  if (p.n_group < 1 || p.n_group > 64 || p.num_experts % p.n_group != 0 || p.top_k > p.num_experts)
    throw std::invalid_argument(
        "route: n_group must divide num_experts (at most 64 groups), top_k <= experts");
  // The thread body takes topk_group groups, then top_k experts from them: both must exist.
  if (p.topk_group < 1 || p.topk_group > p.n_group || p.top_k > p.topk_group * (p.num_experts / p.n_group))
    throw std::invalid_argument(
        "route: topk_group must be in [1, n_group] and its groups hold at least top_k experts");
  if (p.group_score == moe::GroupScore::top2_sum && p.num_experts / p.n_group < 2)
    throw std::invalid_argument("route: groups ranked by their best two need two experts each");
  const moe::RouteToken body{p, logits, bias, probs, experts, weights};
  if (p.num_experts <= kRouterMaxExperts) {
    if (p.tokens <= 0) return;
    launch(route_warp_kernel, static_cast<unsigned>((p.tokens + kRouterWarps - 1) / kRouterWarps),
           kRouterWarps * 32, 0, stream, body);
    CAPSERVE_CUDA_CHECK_LAUNCH();
    return;
  }
  CudaExec x{stream};
  moe::run_router(x, body);
}

std::int64_t capacity_workspace_bytes(const moe::CapacityParams& p) {
  return moe::capacity_workspace(p).bytes;
}

void schedule_capacity(moe::CapacityView view, void* workspace, std::int64_t* totals, cudaStream_t stream,
                       const DeviceReduce& reduce) {
  const moe::CapacityParams& p = view.p;
  if (static_cast<std::uint64_t>(p.total_tokens) * static_cast<std::uint64_t>(p.top_k) > moe::kLow32)
    throw std::length_error("schedule_capacity: more than 2^32 assignments in one step");
  if ((view.owners == nullptr) != (view.bin_experts == nullptr))
    throw std::invalid_argument("schedule_capacity: device granularity needs owners and bin_experts");
  moe::bind_capacity_workspace(view, workspace);
  CudaExec x{stream, &reduce};
  moe::run_capacity(x, view);
  CAPSERVE_CUDA_CHECK(
      cudaMemcpyAsync(totals, view.totals, 2 * sizeof(std::int64_t), cudaMemcpyDeviceToDevice, stream));
}

std::int64_t permute_workspace_elements(const moe::PermuteParams& p) {
  return p.num_groups * moe::permute_chunks(p) + 1;
}

void permute(const moe::PermuteParams& p, const std::int32_t* experts, const std::int32_t* owners,
             const std::int32_t* local_index, std::int64_t* workspace, std::int64_t* offsets,
             std::int64_t* position, std::int32_t* row_token, cudaStream_t stream) {
  if (p.chunk <= 0) throw std::invalid_argument("permute: chunk must be positive");
  moe::PermuteView v;
  v.p = p;
  v.experts = experts;
  v.owners = owners;
  v.local_index = local_index;
  v.chunk_base = workspace;
  v.offsets = offsets;
  v.position = position;
  v.row_token = row_token;
  CudaExec x{stream};
  moe::run_permute(x, v);
}

void gather_rows(const float* h, std::int64_t hidden, const std::int32_t* row_token, const std::int64_t* rows,
                 std::int64_t max_rows, __nv_bfloat16* x, cudaStream_t stream) {
  if (max_rows <= 0) return;
  launch(gather_rows_kernel, static_cast<unsigned>(max_rows), kThreads, 0, stream, h, hidden, row_token, rows,
         x);
  CAPSERVE_CUDA_CHECK_LAUNCH();
}

void combine(const float* y, std::int64_t hidden, const std::int64_t* position, const float* weights,
             std::int64_t tokens, std::int64_t top_k, float* out, cudaStream_t stream) {
  if (tokens <= 0) return;
  launch(combine_kernel, static_cast<unsigned>(tokens), kThreads, 0, stream, y, hidden, position, weights,
         top_k, out);
  CAPSERVE_CUDA_CHECK_LAUNCH();
}

void plan_dispatch(const moe::DispatchPlanView& v, cudaStream_t stream) {
  CudaExec x{stream};
  moe::run_plan_dispatch(x, v);
}

void group_received(const moe::ReceivedView& v, cudaStream_t stream) {
  CudaExec x{stream};
  moe::run_group_received(x, v);
}

void group_received_blocks(const moe::ReceivedBlocksView& v, cudaStream_t stream) {
  CudaExec x{stream};
  moe::run_group_received_blocks(x, v);
}

void block_index(const moe::BlockIndex& body, std::int64_t places, cudaStream_t stream) {
  CudaExec x{stream};
  x.for_each(places, body);
}

void block_positions(const moe::BlockPositions& body, std::int64_t slots, cudaStream_t stream) {
  CudaExec x{stream};
  x.for_each(slots, body);
}

void count_experts(const std::int32_t* experts, std::int64_t slots, std::int64_t* counts,
                   cudaStream_t stream) {
  CudaExec x{stream};
  x.for_each(slots, moe::CountExperts{experts, counts});
}

void assign_copies(const moe::AssignCopies& body, std::int64_t entries, cudaStream_t stream) {
  CudaExec x{stream};
  x.for_each(entries, body);
}

void count_slot_states(const moe::CountSlotStates& body, std::int64_t tokens, cudaStream_t stream) {
  CudaExec x{stream};
  x.for_each(tokens, body);
}

void take_rows(const float* src, std::int64_t width, const std::int32_t* index, std::int64_t n, float* dst,
               cudaStream_t stream) {
  if (n <= 0) return;
  launch(take_rows_kernel, static_cast<unsigned>(n), kThreads, 0, stream, src, width, index, dst);
  CAPSERVE_CUDA_CHECK_LAUNCH();
}

}  // namespace capserve::kernels::cuda
