#pragma once
// A loaded model: what is fixed once loading ends (config, weights on the backend, expert placement, capacity
// options), shared read-only by every ForwardPass (forward_pass.h) that runs it. Under expert parallelism
// every rank holds a Model with the replicated weights and only its own routed experts.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "parallel/capacity_config.h"
#include "parallel/communicator.h"
#include "parallel/expert_placement.h"
#include "parallel/placement_tables.h"
#include "runtime/architectures/architecture.h"
#include "runtime/model_config.h"
#include "runtime/model_weights.h"
#include "runtime/rope.h"
#include "runtime/weights/checkpoint.h"

namespace capserve::runtime {

// How a model is spread over ranks and how its MoE layers treat capacity.
struct ParallelOptions {
  std::string placement = "contiguous";  // contiguous | round-robin | a --moe-stats file
  // EPLB-style replication: extra expert copies per MoE layer, over all ranks, given to the experts the
  // statistics file shows hottest (ExpertPlacement::replicated); 0: none.
  std::int64_t redundant_experts = 0;
  parallel::CapacityConfig capacity;
  // Load the checkpoint's multi-token-prediction layers (speculative decoding's MTP draft); off, they are
  // checked and skipped unread.
  bool mtp = false;
};

// A config.json parsed by its architecture and validated, with the architecture's tensor names: what loading
// starts from, and all the memory plan (memory_plan.h) reads.
struct ModelDescription {
  ModelConfig config;
  TensorNames names;
};
// LoadError naming the key at fault. generation_config.json is not read.
ModelDescription read_model_config(const std::filesystem::path& config_json);

// The expert placement a model loads with on `ranks` ranks: over the decoder's layers, and the MTP layers
// after them when they load (a statistics file covers the decoder's layers only: the MTP layers are placed
// contiguously, or with replication get their extra copies spread evenly). LoadError on a bad placement
// option, or replication with a capacity that needs one rank per expert (device granularity, expanded).
parallel::ExpertPlacement model_placement(const ModelConfig& config, const ParallelOptions& options,
                                          int ranks);

class Model {
 public:
  // Reads config.json and the safetensors checkpoint in `dir` and uploads the weights through `backend`,
  // which then runs every forward pass; LoadError naming the key, file or tensor at fault (or a bad placement
  // or capacity option, or communicators that do not fit the backend). Two communicators over the same ranks:
  // `data` moves the MoE layers' rows and counts in the backend's memory (MPI on the CPU; NCCL or host-staged
  // on a GPU), `control` reduces the step's statistics and token counts in host memory. The single-process
  // form owns a group of one of each; the others keep references (one host communicator may serve as both on
  // the CPU). Backend and communicators must outlive the model.
  static std::unique_ptr<Model> load(const std::filesystem::path& dir, kernels::Backend& backend,
                                     const ParallelOptions& options = {});
  static std::unique_ptr<Model> load(const std::filesystem::path& dir, kernels::Backend& backend,
                                     parallel::Communicator& comm, const ParallelOptions& options);
  static std::unique_ptr<Model> load(const std::filesystem::path& dir, kernels::Backend& backend,
                                     parallel::Communicator& data, parallel::Communicator& control,
                                     const ParallelOptions& options);

  // Backend and communicators stay mutable through a const Model: a forward pass runs on them.
  [[nodiscard]] kernels::Backend& backend() const { return *backend_; }
  // The data plane, on the backend's device.
  [[nodiscard]] parallel::Communicator& communicator() const { return *data_; }
  // The control plane, on host memory.
  [[nodiscard]] parallel::Communicator& control() const { return *control_; }

  [[nodiscard]] const ModelConfig& config() const { return config_; }
  [[nodiscard]] const ModelWeights& weights() const { return weights_; }
  [[nodiscard]] const parallel::ExpertPlacement& placement() const { return placement_; }
  // The placement on the backend, for the MoE kernels.
  [[nodiscard]] const parallel::PlacementTables& tables() const { return tables_; }
  [[nodiscard]] const Rope& rope() const { return rope_; }
  [[nodiscard]] const parallel::CapacityConfig& capacity() const { return capacity_; }
  // Indices of the MoE layers.
  [[nodiscard]] std::span<const std::int64_t> moe_layers() const { return moe_layers_; }
  // A layer's index among the MoE layers of its stack (the decoder's, or the MTP layers'), -1 for a dense
  // layer.
  [[nodiscard]] std::int64_t moe_index(std::int64_t layer) const {
    return moe_index_[static_cast<std::size_t>(layer)];
  }
  // The loaded multi-token-prediction layers (ParallelOptions::mtp): layer i runs as model layer
  // num_layers + i, with its experts placed as a layer of the placement, its KV in the cache's layer of that
  // index. Their MoE layers, and the capacity they run under: --capacity-gamma's value when it is one,
  // else infinity (a per-layer list names the decoder's layers only).
  [[nodiscard]] std::int64_t mtp_layers() const { return static_cast<std::int64_t>(weights_.mtp.size()); }
  [[nodiscard]] std::span<const std::int64_t> mtp_moe_layers() const { return mtp_moe_layers_; }
  [[nodiscard]] const parallel::CapacityConfig& mtp_capacity() const { return mtp_capacity_; }
  // A layer's weights, decoder or MTP.
  [[nodiscard]] const LayerWeights& layer(std::int64_t layer) const;

 private:
  // The communicators a model runs over; `owned` holds those it owns (single-process).
  struct Communicators {
    parallel::Communicator* data = nullptr;
    parallel::Communicator* control = nullptr;
    std::vector<std::unique_ptr<parallel::Communicator>> owned;
  };
  static std::unique_ptr<Model> load_with(const std::filesystem::path& dir, kernels::Backend& backend,
                                          Communicators comms, const ParallelOptions& options);
  Model(ModelConfig config, Checkpoint checkpoint, const TensorNames& names, kernels::Backend& backend,
        Communicators comms, const ParallelOptions& options);

  ModelConfig config_;
  kernels::Backend* backend_;
  std::vector<std::unique_ptr<parallel::Communicator>> own_comms_;  // single-process models only
  parallel::Communicator* data_;
  parallel::Communicator* control_;
  parallel::ExpertPlacement placement_;
  Checkpoint checkpoint_;  // owns the mappings the weight views point into
  ModelWeights weights_;
  parallel::PlacementTables tables_;
  Rope rope_;
  parallel::CapacityConfig capacity_;
  parallel::CapacityConfig mtp_capacity_;
  std::vector<std::int64_t> moe_layers_;
  std::vector<std::int64_t> mtp_moe_layers_;
  std::vector<std::int64_t> moe_index_;
};

}  // namespace capserve::runtime
