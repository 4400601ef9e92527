#pragma once
// The weights of a decoder-only MoE model, fetched by the names an architecture gives, checked against the
// shapes its config implies, and uploaded through the backend: on the CPU views into the mmapped checkpoint
// (zero copy), on a device copies the weights own. Each rank uploads only its own routed experts.
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/backend.h"
#include "parallel/expert_placement.h"
#include "runtime/architectures/architecture.h"
#include "runtime/model_config.h"
#include "runtime/weights/checkpoint.h"

namespace capserve::runtime {

struct AttentionWeights {
  kernels::Tensor q, k, v, o;
  kernels::Tensor q_bias, k_bias, v_bias;  // empty without qkv_bias
  kernels::Tensor o_bias;                  // empty without o_bias
  kernels::Tensor q_norm, k_norm;          // empty without qk_norm
  // Multi-head latent attention: q is q_proj without q LoRA, else empty and q_a -> q_a_norm -> q_b;
  // kv_a_proj_with_mqa split into the rows giving the latent and those giving the rope key; biases empty
  // without attention_bias.
  kernels::Tensor q_a, q_a_bias, q_a_norm, q_b;
  kernels::Tensor kv_a_latent, kv_a_latent_bias, kv_a_rope, kv_a_rope_bias;
  kernels::Tensor kv_a_norm, kv_b;
};

struct MoeWeights {
  kernels::Tensor router;                       // [num_experts, hidden]
  kernels::Tensor router_bias;                  // f32 [num_experts]: selection-only correction; empty: none
  std::vector<kernels::ExpertWeights> experts;  // this rank's routed experts, by local index
  std::vector<kernels::ExpertWeights> shared;   // zero or one shared expert
  kernels::Tensor shared_gate;                  // [1, hidden]; empty: the shared expert is ungated
};

struct LayerWeights {
  kernels::Tensor input_norm;
  kernels::Tensor post_attention_norm;
  AttentionWeights attention;
  bool is_moe = false;
  MoeWeights moe;
  std::vector<kernels::ExpertWeights> dense_mlp;  // one entry on dense layers
};

// A multi-token-prediction layer (DeepSeek-V3's MTP module, speculative decoding's draft): its own decoder
// layer behind eh_proj([enorm(embed(next token)); hnorm(hidden state)]), then shared_head.norm and the head.
struct MtpWeights {
  kernels::Tensor eh_proj;         // [hidden, 2 * hidden]
  kernels::Tensor enorm, hnorm;    // [hidden]
  kernels::Tensor head_norm;       // [hidden]: shared_head.norm
  kernels::Tensor embed, lm_head;  // the layer's own copies when the checkpoint has them, else the model's
  LayerWeights layer;
};

struct ModelWeights {
  std::vector<kernels::Buffer>
      storage;  // device copies (empty on the CPU); the tensors below point into them
  kernels::Tensor embed;
  kernels::Tensor final_norm;
  kernels::Tensor lm_head;
  std::vector<LayerWeights> layers;
  // Loaded MTP layers, in order (empty unless asked for); layer i runs as model layer num_layers + i.
  std::vector<MtpWeights> mtp;
  // The bytes of the tensors above, the rank's own experts only: device copies (an FP8 weight's bytes plus
  // its f32 scales where the backend keeps FP8), or on the CPU the checkpoint's mapped bytes or bf16
  // dequantizations (which the backend never allocates).
  std::int64_t bytes = 0;
};

// Fetches every tensor (LoadError naming file and tensor on a missing one or a wrong shape) and then rejects
// tensors the architecture does not use. Routed experts are kept only where `placement` puts them on `rank`.
// The MTP layers (ModelConfig::mtp_layer_is_moe) are loaded when `load_mtp` (LoadError when the checkpoint
// lacks them; `placement` then covers num_layers + their count), else checked and skipped unread.
ModelWeights load_model_weights(Checkpoint& ckpt, const ModelConfig& config, const TensorNames& names,
                                const parallel::ExpertPlacement& placement, int rank,
                                kernels::Backend& backend, bool load_mtp = false);

// How the loader fetches a tensor, which decides the type it is held in (runtime/memory_plan.h): as the
// checkpoint stores it (an FP8 weight: kept FP8 with its scales by a backend that keeps FP8, else
// dequantized to bf16), as a router (widened to f32 on a device), always widened to f32 (the router's
// correction bias), or an FP8 weight always dequantized to bf16 (kv_b_proj, and a split inside a block).
enum class WeightFetch : std::uint8_t { as_stored, router, f32, bf16 };

// One upload of load_model_weights, without its data: a vector is one row. kv_a_proj_with_mqa, which the
// loader uploads as two parts, is two entries of the same name.
struct WeightShape {
  std::string name;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  WeightFetch fetch = WeightFetch::as_stored;
};

// What load_model_weights uploads on `rank`, in its order, by the same walk over the config's shapes alone
// (no checkpoint): every tensor is taken to exist with the shape the walk asks for, and the optional ones
// (an MTP layer, its own embed_tokens and shared_head.head copies) where `present` says so.
std::vector<WeightShape> model_weight_shapes(const ModelConfig& config, const TensorNames& names,
                                             const parallel::ExpertPlacement& placement, int rank,
                                             bool load_mtp,
                                             const std::function<bool(std::string_view)>& present);

}  // namespace capserve::runtime
