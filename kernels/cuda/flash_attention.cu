#include "kernels/cuda/flash_attention.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/wmma.h"

namespace capserve::kernels::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 16;                  // the WMMA shape: 16x16x16
constexpr int kKeys = 64;                  // keys per context tile
constexpr int kKeyBlocks = kKeys / kTile;  // 16-key column blocks of a score tile
constexpr int kPad = 8;  // elements after each shared row: fewer bank conflicts, 32-byte rows
constexpr std::int64_t kMaxDk = 576;
constexpr std::int64_t kMaxDv = 512;
constexpr std::size_t kMaxShared = 200 * 1024;  // of the 227 KB a Hopper block may opt into
constexpr int kMaxSplits = 32;
constexpr int kMinTilesPerSplit = 2;  // a split walks at least this many key tiles

using Frag16A = wmma::fragment<wmma::matrix_a, kTile, kTile, kTile, __nv_bfloat16, wmma::row_major>;
using Frag16BCol = wmma::fragment<wmma::matrix_b, kTile, kTile, kTile, __nv_bfloat16, wmma::col_major>;
using Frag16BRow = wmma::fragment<wmma::matrix_b, kTile, kTile, kTile, __nv_bfloat16, wmma::row_major>;
using Frag16C = wmma::fragment<wmma::accumulator, kTile, kTile, kTile, float>;

// Where a block's arrays live in its dynamic shared memory (byte offsets, each 128-aligned), for `rows` query
// rows (a multiple of 16).
struct Layout {
  int rows = 0;
  int ld_q = 0;  // bf16 [rows, dk]
  int ld_k = 0;  // bf16 [kKeys, dk]
  int ld_v = 0;  // bf16 [kKeys, dv], unless the values are the keys' first dims (v_in_k)
  int ld_s = 0;  // f32 [rows, kKeys]: scores
  int ld_p = 0;  // bf16 [rows, kKeys]: probabilities
  int ld_o = 0;  // f32 [rows, dv]: the running output
  bool v_in_k = false;
  std::size_t q = 0, k = 0, v = 0, s = 0, p = 0, o = 0, m = 0, l = 0, corr = 0, pos = 0, lo = 0;
  std::size_t bytes = 0;
};

std::size_t align128(std::size_t n) {
  return (n + 127) / 128 * 128;
}

bool values_in_keys(const SharedKvAttention& a) {
  return a.values == a.keys && a.value_stride == a.key_stride && a.value_head_stride == a.key_head_stride &&
         a.dv <= a.dk;
}

Layout layout(const SharedKvAttention& a, int rows) {
  Layout l;
  l.rows = rows;
  l.v_in_k = values_in_keys(a);
  l.ld_q = static_cast<int>(a.dk) + kPad;
  l.ld_k = static_cast<int>(a.dk) + kPad;
  l.ld_v = l.v_in_k ? l.ld_k : static_cast<int>(a.dv) + kPad;
  l.ld_s = kKeys + kPad;
  l.ld_p = kKeys + kPad;
  l.ld_o = static_cast<int>(a.dv) + kPad;
  const auto r = static_cast<std::size_t>(rows);
  std::size_t at = 0;
  const auto take = [&at](std::size_t bytes) {
    const std::size_t here = at;
    at += align128(bytes);
    return here;
  };
  l.q = take(2 * r * static_cast<std::size_t>(l.ld_q) * 2);  // the queries' two bf16 halves
  l.k = take(static_cast<std::size_t>(kKeys) * static_cast<std::size_t>(l.ld_k) * 2);
  l.v = l.v_in_k ? l.k : take(static_cast<std::size_t>(kKeys) * static_cast<std::size_t>(l.ld_v) * 2);
  l.s = take(r * static_cast<std::size_t>(l.ld_s) * 4);
  l.p = take(r * static_cast<std::size_t>(l.ld_p) * 2);
  l.o = take(r * static_cast<std::size_t>(l.ld_o) * 4);
  l.m = take(r * 4);
  l.l = take(r * 4);
  l.corr = take(r * 4);
  l.pos = take(r * 8);
  l.lo = take(r * 8);
  l.bytes = at;
  return l;
}

// 128-byte units, so that the dynamic shared memory starts aligned for WMMA's 32-byte rule on both sides.
struct alignas(128) SharedUnit {
  unsigned char bytes[128];
};

// 16 bytes (8 bf16) from global into shared memory.
__device__ inline void copy16(__nv_bfloat16* dst, const __nv_bfloat16* src) {
#if defined(__CUDACC__)
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
#else
  std::memcpy(dst, src, 16);
#endif
}

__device__ inline void zero16(__nv_bfloat16* dst) {
#if defined(__CUDACC__)
  *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
#else
  std::memset(dst, 0, 16);
#endif
}

__device__ inline float warp_max(float v) {
  for (int d = 16; d > 0; d /= 2) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFU, v, d));
  return v;
}

__device__ inline float warp_sum(float v) {
  for (int d = 16; d > 0; d /= 2) v += __shfl_xor_sync(0xFFFFFFFFU, v, d);
  return v;
}

// Block (x, sequence, K/V head), x = row tile * splits + split: query rows [tile * rows, (tile + 1) * rows)
// of the sequence's (token, head) pairs in token-major order, over the split's share of their key tiles.
// One split writes the output; several write partial[(row * heads + head) * splits + split] = the
// unnormalised output [dv], then the running maximum and sum.
__global__ void __launch_bounds__(kThreads)
    flash_attention_kernel(DeviceAttentionBatch batch, SharedKvAttention a, Layout L, int splits,
                           float* partial) {
  CAPSERVE_DYNAMIC_SHARED(SharedUnit, shared);
  auto* base = reinterpret_cast<unsigned char*>(shared);
  auto* q_s = reinterpret_cast<__nv_bfloat16*>(base + L.q);
  auto* k_s = reinterpret_cast<__nv_bfloat16*>(base + L.k);
  auto* v_s = reinterpret_cast<__nv_bfloat16*>(base + L.v);
  auto* s_s = reinterpret_cast<float*>(base + L.s);
  auto* p_s = reinterpret_cast<__nv_bfloat16*>(base + L.p);
  auto* o_s = reinterpret_cast<float*>(base + L.o);
  auto* m_s = reinterpret_cast<float*>(base + L.m);
  auto* l_s = reinterpret_cast<float*>(base + L.l);
  auto* corr_s = reinterpret_cast<float*>(base + L.corr);
  auto* pos_s = reinterpret_cast<std::int64_t*>(base + L.pos);
  auto* lo_s = reinterpret_cast<std::int64_t*>(base + L.lo);

  // 32-bit index arithmetic: 64-bit division is a call that makes ptxas spill (sizes are checked on the
  // host).
  const int seq = static_cast<int>(blockIdx.y);
  const int kv_head = static_cast<int>(blockIdx.z);
  const int group = static_cast<int>(a.group);
  const int dk = static_cast<int>(a.dk);
  const int dv = static_cast<int>(a.dv);
  const int flat_rows = batch.seq_tokens[seq] * group;
  const int split = static_cast<int>(blockIdx.x) % splits;
  const int f0 = static_cast<int>(blockIdx.x) / splits * L.rows;
  if (f0 >= flat_rows) return;  // the whole block: this sequence has fewer rows
  const int rows_here = min(L.rows, flat_rows - f0);
  const std::int64_t first_row = batch.seq_first_row[seq];
  const std::int32_t* table = batch.block_tables + static_cast<std::int64_t>(seq) * batch.max_blocks;
  const int block_size = static_cast<int>(a.block_size);
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;

  // The queries, rounded to bf16; each row's causal range.
  for (int i = static_cast<int>(threadIdx.x); i < L.rows * dk; i += kThreads) {
    const int r = i / dk;
    const int e = i % dk;
    float v = 0.0F;
    if (r < rows_here) {
      const int f = f0 + r;
      const std::int64_t row = first_row + f / group;
      const std::int64_t head = static_cast<std::int64_t>(kv_head) * group + f % group;
      v = a.q[(row * a.heads + head) * a.dk + e];
    }
    const __nv_bfloat16 hi = __float2bfloat16(v);
    q_s[r * L.ld_q + e] = hi;
    q_s[(L.rows + r) * L.ld_q + e] = __float2bfloat16(v - __bfloat162float(hi));
  }
  for (int r = static_cast<int>(threadIdx.x); r < L.rows; r += kThreads) {
    std::int64_t pos = -1;  // a padding row sees no key
    std::int64_t lo = 0;
    if (r < rows_here) {
      pos = batch.row_pos[first_row + (f0 + r) / group];
      lo = a.sliding_window > 0 ? max(std::int64_t{0}, pos - a.sliding_window + 1) : 0;
    }
    pos_s[r] = pos;
    lo_s[r] = lo;
    m_s[r] = -INFINITY;
    l_s[r] = 0.0F;
  }
  for (int i = static_cast<int>(threadIdx.x); i < L.rows * L.ld_o; i += kThreads) o_s[i] = 0.0F;
  const std::int64_t last_pos = batch.row_pos[first_row + (f0 + rows_here - 1) / group];
  const std::int64_t first_pos = batch.row_pos[first_row + f0 / group];
  const std::int64_t key_lo =
      a.sliding_window > 0 ? max(std::int64_t{0}, first_pos - a.sliding_window + 1) : std::int64_t{0};
  const int row_blocks = L.rows / kTile;
  const int k_chunks = dk / 8;
  const int v_chunks = dv / 8;
  __syncthreads();

  const auto key_tiles = static_cast<int>((last_pos - key_lo) / kKeys + 1);
  const int tiles_per_split = (key_tiles + splits - 1) / splits;
  const int end_tile = min(key_tiles, (split + 1) * tiles_per_split);
  for (int tile = split * tiles_per_split; tile < end_tile; ++tile) {
    const std::int64_t key0 = key_lo + static_cast<std::int64_t>(tile) * kKeys;
    // The tile's keys (and values), each row once for every query row of the block.
    for (int i = static_cast<int>(threadIdx.x); i < kKeys * k_chunks; i += kThreads) {
      const int j = i / k_chunks;
      const int c = (i % k_chunks) * 8;
      const std::int64_t p = key0 + j;
      __nv_bfloat16* dst = k_s + j * L.ld_k + c;
      if (p <= last_pos) {
        const auto p32 = static_cast<int>(p);
        const std::int64_t slot =
            static_cast<std::int64_t>(table[p32 / block_size]) * block_size + p32 % block_size;
        copy16(dst, a.keys + slot * a.key_stride + kv_head * a.key_head_stride + c);
      } else {
        zero16(dst);
      }
    }
    if (!L.v_in_k) {
      for (int i = static_cast<int>(threadIdx.x); i < kKeys * v_chunks; i += kThreads) {
        const int j = i / v_chunks;
        const int c = (i % v_chunks) * 8;
        const std::int64_t p = key0 + j;
        __nv_bfloat16* dst = v_s + j * L.ld_v + c;
        if (p <= last_pos) {
          const auto p32 = static_cast<int>(p);
          const std::int64_t slot =
              static_cast<std::int64_t>(table[p32 / block_size]) * block_size + p32 % block_size;
          copy16(dst, a.values + slot * a.value_stride + kv_head * a.value_head_stride + c);
        } else {
          zero16(dst);
        }
      }
    }
    __syncthreads();

    // Scores: S = Q K^T, one 16x16 block per warp at a time.
    for (int t = warp; t < row_blocks * kKeyBlocks; t += kWarps) {
      const int rb = t / kKeyBlocks;
      const int kb = t % kKeyBlocks;
      Frag16C acc;
      wmma::fill_fragment(acc, 0.0F);
      for (int e = 0; e < dk; e += kTile) {
        Frag16A qf;
        Frag16BCol kf;
        wmma::load_matrix_sync(kf, k_s + kb * kTile * L.ld_k + e, static_cast<unsigned>(L.ld_k));
        wmma::load_matrix_sync(qf, q_s + rb * kTile * L.ld_q + e, static_cast<unsigned>(L.ld_q));
        wmma::mma_sync(acc, qf, kf, acc);
        wmma::load_matrix_sync(qf, q_s + (L.rows + rb * kTile) * L.ld_q + e, static_cast<unsigned>(L.ld_q));
        wmma::mma_sync(acc, qf, kf, acc);
      }
      wmma::store_matrix_sync(s_s + rb * kTile * L.ld_s + kb * kTile, acc, static_cast<unsigned>(L.ld_s),
                              wmma::mem_row_major);
    }
    __syncthreads();

    // Online softmax, a warp per row, two keys per lane.
    for (int r = warp; r < L.rows; r += kWarps) {
      const std::int64_t pos = pos_s[r];
      const std::int64_t lo = lo_s[r];
      // Keys lane and lane + 32 of the tile.
      const std::int64_t p0 = key0 + lane;
      const std::int64_t p1 = p0 + 32;
      const float s0 = p0 >= lo && p0 <= pos ? s_s[r * L.ld_s + lane] * a.scale : -INFINITY;
      const float s1 = p1 >= lo && p1 <= pos ? s_s[r * L.ld_s + lane + 32] * a.scale : -INFINITY;
      const float tile_max = warp_max(fmaxf(s0, s1));
      const float m_old = m_s[r];
      const float m_new = fmaxf(m_old, tile_max);
      // A row that has seen no key yet keeps m = -inf and adds nothing.
      const bool empty = m_new == -INFINITY;
      const float corr = empty ? 1.0F : expf(m_old - m_new);
      const float e0 = empty || s0 == -INFINITY ? 0.0F : expf(s0 - m_new);
      const float e1 = empty || s1 == -INFINITY ? 0.0F : expf(s1 - m_new);
      p_s[r * L.ld_p + lane] = __float2bfloat16(e0);
      p_s[r * L.ld_p + lane + 32] = __float2bfloat16(e1);
      float sum = e0 + e1;
      sum = warp_sum(sum);
      if (lane == 0) {
        m_s[r] = m_new;
        l_s[r] = l_s[r] * corr + sum;
        corr_s[r] = corr;
      }
    }
    __syncthreads();
    for (int i = static_cast<int>(threadIdx.x); i < L.rows * dv; i += kThreads) {
      const int r = i / dv;
      o_s[r * L.ld_o + i % dv] *= corr_s[r];
    }
    __syncthreads();

    // O += P V, one 16x16 output block per warp at a time.
    const int col_blocks = dv / kTile;
    for (int t = warp; t < row_blocks * col_blocks; t += kWarps) {
      const int rb = t / col_blocks;
      const int cb = t % col_blocks;
      float* o = o_s + rb * kTile * L.ld_o + cb * kTile;
      Frag16C acc;
      wmma::load_matrix_sync(acc, o, static_cast<unsigned>(L.ld_o), wmma::mem_row_major);
      for (int kb = 0; kb < kKeyBlocks; ++kb) {
        Frag16A pf;
        Frag16BRow vf;
        wmma::load_matrix_sync(pf, p_s + rb * kTile * L.ld_p + kb * kTile, static_cast<unsigned>(L.ld_p));
        wmma::load_matrix_sync(vf, v_s + kb * kTile * L.ld_v + cb * kTile, static_cast<unsigned>(L.ld_v));
        wmma::mma_sync(acc, pf, vf, acc);
      }
      wmma::store_matrix_sync(o, acc, static_cast<unsigned>(L.ld_o), wmma::mem_row_major);
    }
    __syncthreads();
  }

  const int stats = dv + 2;
  for (int i = static_cast<int>(threadIdx.x); i < rows_here * stats; i += kThreads) {
    const int r = i / stats;
    const int e = i % stats;
    const int f = f0 + r;
    const std::int64_t row = first_row + f / group;
    const std::int64_t head = static_cast<std::int64_t>(kv_head) * group + f % group;
    if (splits == 1) {
      if (e < dv) a.out[(row * a.heads + head) * a.dv + e] = o_s[r * L.ld_o + e] / l_s[r];
    } else {
      const float v = e < dv ? o_s[r * L.ld_o + e] : e == dv ? m_s[r] : l_s[r];
      partial[((row * a.heads + head) * splits + split) * stats + e] = v;
    }
  }
}

// out[row, head] from its splits' partial results: a block per (row, head).
__global__ void __launch_bounds__(kThreads)
    combine_splits_kernel(const float* partial, std::int64_t dv, int splits, float* out) {
  const std::int64_t rh = blockIdx.x;
  const std::int64_t stats = dv + 2;
  const float* p = partial + rh * splits * stats;
  float m = -INFINITY;
  for (int s = 0; s < splits; ++s) m = fmaxf(m, p[s * stats + dv]);
  float l = 0.0F;
  for (int s = 0; s < splits; ++s) {
    const float ms = p[s * stats + dv];
    if (ms != -INFINITY) l += p[s * stats + dv + 1] * expf(ms - m);
  }
  for (std::int64_t e = threadIdx.x; e < dv; e += kThreads) {
    float acc = 0.0F;
    for (int s = 0; s < splits; ++s) {
      const float ms = p[s * stats + dv];
      if (ms != -INFINITY) acc += p[s * stats + e] * expf(ms - m);
    }
    out[rh * dv + e] = acc / l;
  }
}

}  // namespace

SharedKvAttention gqa_attention(const float* q, const DeviceKvLayer& cache, const AttentionParams& params,
                                float* out) {
  const auto* k = static_cast<const __nv_bfloat16*>(cache.k);
  const auto* v = static_cast<const __nv_bfloat16*>(cache.v);
  const std::int64_t width = cache.num_kv_heads * cache.head_dim;
  const std::int64_t group = cache.num_kv_heads > 0 ? params.num_heads / cache.num_kv_heads : 0;
  return {q,
          params.num_heads,
          group,
          cache.head_dim,
          cache.head_dim,
          k,
          v,
          width,
          width,
          cache.head_dim,
          cache.head_dim,
          cache.block_size,
          params.scale,
          params.sliding_window,
          out};
}

bool flash_attention_supports(const SharedKvAttention& a) {
  const auto multiple = [](std::int64_t v, std::int64_t of) { return v > 0 && v % of == 0; };
  return multiple(a.dk, kTile) && multiple(a.dv, kTile) && a.dk <= kMaxDk && a.dv <= kMaxDv && a.group > 0 &&
         a.heads % a.group == 0 && multiple(a.key_stride, 8) && multiple(a.value_stride, 8) &&
         a.key_head_stride % 8 == 0 && a.value_head_stride % 8 == 0 && a.block_size > 0 &&
         layout(a, kTile).bytes <= kMaxShared;
}

namespace {

// The row tile: 64 query rows share each key tile where a sequence has that many (token, head) pairs and
// they fit in shared memory; otherwise 16 (decode, or the 576-dim latent rows).
Layout batch_layout(const DeviceAttentionBatch& batch, const SharedKvAttention& a) {
  const std::int64_t flat_rows = batch.max_seq_tokens * a.group;
  const Layout wide = layout(a, 4 * kTile);
  return flat_rows <= kTile || wide.bytes > kMaxShared ? layout(a, kTile) : wide;
}

std::int64_t row_tiles(const DeviceAttentionBatch& batch, const SharedKvAttention& a, const Layout& L) {
  return (batch.max_seq_tokens * a.group + L.rows - 1) / L.rows;
}

int splits_for(const DeviceAttentionBatch& batch, const SharedKvAttention& a, const FlashWorkspace& ws,
               const Layout& L) {
  const std::int64_t blocks = row_tiles(batch, a, L) * batch.sequences * (a.heads / a.group);
  if (ws.partial == nullptr || ws.multiprocessors <= 0 || blocks >= ws.multiprocessors) return 1;
  const std::int64_t key_tiles = (batch.max_blocks * a.block_size + kKeys - 1) / kKeys;
  std::int64_t splits = std::min<std::int64_t>(
      {(2 * ws.multiprocessors + blocks - 1) / blocks, key_tiles / kMinTilesPerSplit, kMaxSplits});
  while (splits > 1 && batch.rows * a.heads * splits * (a.dv + 2) > ws.floats) --splits;
  return static_cast<int>(std::max<std::int64_t>(splits, 1));
}

}  // namespace

int flash_attention_splits(const DeviceAttentionBatch& batch, const SharedKvAttention& a,
                           const FlashWorkspace& workspace) {
  return splits_for(batch, a, workspace, batch_layout(batch, a));
}

void flash_attention(const DeviceAttentionBatch& batch, const SharedKvAttention& a,
                     const FlashWorkspace& workspace, cudaStream_t stream) {
  if (!flash_attention_supports(a)) {
    throw std::invalid_argument("flash_attention: dk " + std::to_string(a.dk) + ", dv " +
                                std::to_string(a.dv) + ", group " + std::to_string(a.group) + " of " +
                                std::to_string(a.heads) + " heads, strides " + std::to_string(a.key_stride) +
                                "/" + std::to_string(a.value_stride) + " are not shapes it takes");
  }
  if (batch.rows <= 0 || batch.sequences <= 0) return;
  const std::int64_t flat_rows = batch.max_seq_tokens * a.group;
  if (flat_rows > std::numeric_limits<std::int32_t>::max())
    throw std::invalid_argument("flash_attention: " + std::to_string(flat_rows) +
                                " query rows in one sequence");
  const Layout L = batch_layout(batch, a);
  const int splits = splits_for(batch, a, workspace, L);
  const dim3 grid(static_cast<unsigned>(row_tiles(batch, a, L) * splits),
                  static_cast<unsigned>(batch.sequences), static_cast<unsigned>(a.heads / a.group));
  CAPSERVE_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(flash_attention_kernel),
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(L.bytes)));
  launch(flash_attention_kernel, grid, kThreads, L.bytes, stream, batch, a, L, splits,
         splits > 1 ? workspace.partial : nullptr);
  CAPSERVE_CUDA_CHECK_LAUNCH();
  if (splits > 1) {
    launch(combine_splits_kernel, static_cast<unsigned>(batch.rows * a.heads), kThreads, 0, stream,
           static_cast<const float*>(workspace.partial), a.dv, splits, a.out);
    CAPSERVE_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace capserve::kernels::cuda
