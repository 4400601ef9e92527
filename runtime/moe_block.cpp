#include "runtime/moe_block.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace capserve::runtime {

void route_softmax_topk(std::span<const float> router_logits, std::int64_t rows, std::int64_t num_experts,
                        std::int64_t top_k, bool normalize, Routing& out) {
  out.experts.resize(static_cast<std::size_t>(rows * top_k));
  out.weights.resize(static_cast<std::size_t>(rows * top_k));
  out.probs.resize(static_cast<std::size_t>(rows * num_experts));
  for (std::int64_t t = 0; t < rows; ++t) {
    const float* logit = router_logits.data() + t * num_experts;
    float* probs = out.probs.data() + t * num_experts;
    const float mx = *std::max_element(logit, logit + num_experts);
    float sum = 0.0F;
    for (std::int64_t e = 0; e < num_experts; ++e) {
      probs[e] = std::exp(logit[e] - mx);
      sum += probs[e];
    }
    for (std::int64_t e = 0; e < num_experts; ++e) probs[e] /= sum;
    std::int32_t* ids = out.experts.data() + t * top_k;
    float* w = out.weights.data() + t * top_k;
    // Selection of the k best by repeated scan: k is small (2..8) and E modest, so this beats a sort.
    for (std::int64_t s = 0; s < top_k; ++s) {
      std::int64_t best = -1;
      for (std::int64_t e = 0; e < num_experts; ++e) {
        if (std::find(ids, ids + s, static_cast<std::int32_t>(e)) != ids + s) continue;
        if (best < 0 || probs[e] > probs[best]) best = e;
      }
      ids[s] = static_cast<std::int32_t>(best);
      w[s] = probs[best];
    }
    if (normalize) {
      float total = 0.0F;
      for (std::int64_t s = 0; s < top_k; ++s) total += w[s];
      for (std::int64_t s = 0; s < top_k; ++s) w[s] /= total;
    }
  }
}

void moe_block(kernels::Backend& backend, const ModelConfig& config, const MoeWeights& weights,
               std::span<const float> h, std::int64_t rows, std::span<float> out, MoeScratch& s) {
  const std::int64_t hidden = config.hidden_size;
  const std::int64_t num_experts = config.num_experts;
  const std::int64_t top_k = config.top_k;
  const auto hidden_bytes = static_cast<std::size_t>(hidden) * sizeof(float);

  s.router_logits.resize(static_cast<std::size_t>(rows * num_experts));
  backend.linear(h, rows, weights.router, {}, s.router_logits);
  route_softmax_topk(s.router_logits, rows, num_experts, top_k, config.norm_topk_prob, s.routing);

  // Permute: a counting sort of the (token, slot) assignments by expert, stable in token order.
  s.offsets.assign(static_cast<std::size_t>(num_experts + 1), 0);
  for (const std::int32_t e : s.routing.experts) ++s.offsets[static_cast<std::size_t>(e) + 1];
  for (std::int64_t e = 0; e < num_experts; ++e)
    s.offsets[static_cast<std::size_t>(e) + 1] += s.offsets[static_cast<std::size_t>(e)];
  const std::int64_t assignments = rows * top_k;
  s.slot_row.resize(static_cast<std::size_t>(assignments));
  s.permuted_in.resize(static_cast<std::size_t>(assignments * hidden));
  s.permuted_out.resize(static_cast<std::size_t>(assignments * hidden));
  {
    std::vector<std::int64_t>& cursor = s.offsets;  // advanced while filling, then restored below
    for (std::int64_t a = 0; a < assignments; ++a) {
      const auto e = static_cast<std::size_t>(s.routing.experts[static_cast<std::size_t>(a)]);
      const std::int64_t row = cursor[e]++;
      s.slot_row[static_cast<std::size_t>(a)] = row;
      std::memcpy(s.permuted_in.data() + row * hidden, h.data() + (a / top_k) * hidden, hidden_bytes);
    }
    for (std::int64_t e = num_experts; e > 0; --e)
      cursor[static_cast<std::size_t>(e)] = cursor[static_cast<std::size_t>(e) - 1];
    cursor[0] = 0;
  }

  backend.grouped_expert_ffn(s.permuted_in, s.offsets, weights.experts, s.permuted_out);

  // Unpermute with gate weights, summing each token's experts in slot order.
  std::fill(out.begin(), out.begin() + rows * hidden, 0.0F);
  for (std::int64_t a = 0; a < assignments; ++a) {
    const float w = s.routing.weights[static_cast<std::size_t>(a)];
    const float* src = s.permuted_out.data() + s.slot_row[static_cast<std::size_t>(a)] * hidden;
    float* dst = out.data() + (a / top_k) * hidden;
    for (std::int64_t i = 0; i < hidden; ++i) dst[i] += w * src[i];
  }

  if (!weights.shared.empty()) {
    s.shared_out.resize(static_cast<std::size_t>(rows * hidden));
    s.shared_gate.resize(static_cast<std::size_t>(rows));
    const std::int64_t whole[2] = {0, rows};
    backend.grouped_expert_ffn(h, whole, weights.shared, s.shared_out);
    backend.linear(h, rows, weights.shared_gate, {}, s.shared_gate);
    for (std::int64_t t = 0; t < rows; ++t) {
      const float g = 1.0F / (1.0F + std::exp(-s.shared_gate[static_cast<std::size_t>(t)]));
      const float* src = s.shared_out.data() + t * hidden;
      float* dst = out.data() + t * hidden;
      for (std::int64_t i = 0; i < hidden; ++i) dst[i] += g * src[i];
    }
  }
}

}  // namespace capserve::runtime
