#include "runtime/model.h"

#include <algorithm>
#include <limits>

#include "parallel/self_communicator.h"
#include "runtime/architectures/architecture.h"
#include "runtime/load_error.h"

namespace capserve::runtime {
namespace {

std::vector<std::int64_t> moe_layer_indices(const ModelConfig& config) {
  std::vector<std::int64_t> layers;
  for (std::int64_t l = 0; l < config.num_layers; ++l) {
    if (config.layer_is_moe[static_cast<std::size_t>(l)]) layers.push_back(l);
  }
  return layers;
}

std::vector<std::int64_t> mtp_moe_layer_indices(const ModelConfig& config, std::int64_t loaded) {
  std::vector<std::int64_t> layers;
  for (std::int64_t i = 0; i < loaded; ++i) {
    if (config.mtp_layer_is_moe[static_cast<std::size_t>(i)]) layers.push_back(config.num_layers + i);
  }
  return layers;
}

// The MTP layers' capacity: a per-layer --capacity-gamma list names the decoder's layers only.
parallel::CapacityConfig capacity_for_mtp(const parallel::CapacityConfig& capacity) {
  parallel::CapacityConfig c = capacity;
  if (c.gamma.size() != 1) c.gamma = {std::numeric_limits<double>::infinity()};
  return c;
}

}  // namespace

parallel::ExpertPlacement model_placement(const ModelConfig& config, const ParallelOptions& options,
                                          int ranks) {
  const std::int64_t layers =
      config.num_layers + (options.mtp ? static_cast<std::int64_t>(config.mtp_layer_is_moe.size()) : 0);
  if (options.redundant_experts > 0 &&
      (options.capacity.granularity == parallel::CapacityGranularity::device ||
       options.capacity.policy == parallel::CapacityPolicy::expanded))
    throw LoadError(
        "--redundant-experts: replicas split an expert over ranks, which --capacity-granularity "
        "device and --capacity-policy expanded cannot (they need one rank per expert)");
  try {
    return parallel::ExpertPlacement::from_spec(options.placement, layers, config.num_experts, ranks,
                                                options.redundant_experts);
  } catch (const std::exception& e) {
    throw LoadError(e.what());
  }
}

ModelDescription read_model_config(const std::filesystem::path& config_json) {
  const nlohmann::json json = read_json_file(config_json);
  if (!json.is_object()) throw LoadError(config_json.string() + ": must be a JSON object");
  const Architecture& arch = find_architecture(json);
  ModelConfig config = arch.parse_config(ConfigReader(json));
  config.validate();
  return {std::move(config), arch.tensor_names()};
}

std::unique_ptr<Model> Model::load(const std::filesystem::path& dir, kernels::Backend& backend,
                                   const ParallelOptions& options) {
  Communicators comms;
  // The data plane in the backend's memory: its copies are the backend's.
  comms.owned.push_back(std::make_unique<parallel::SelfCommunicator>(
      backend.device(),
      [&backend](std::span<std::byte> dst, std::span<const std::byte> src, kernels::Stream) {
        const auto n = static_cast<std::int64_t>(src.size());
        backend.copy(
            kernels::Tensor(const_cast<std::byte*>(src.data()), kernels::DType::u8, backend.device(), {n}),
            kernels::Tensor(dst.data(), kernels::DType::u8, backend.device(), {n}));
      }));
  comms.owned.push_back(std::make_unique<parallel::SelfCommunicator>());
  comms.data = comms.owned[0].get();
  comms.control = comms.owned[1].get();
  return load_with(dir, backend, std::move(comms), options);
}

std::unique_ptr<Model> Model::load(const std::filesystem::path& dir, kernels::Backend& backend,
                                   parallel::Communicator& comm, const ParallelOptions& options) {
  return load(dir, backend, comm, comm, options);
}

std::unique_ptr<Model> Model::load(const std::filesystem::path& dir, kernels::Backend& backend,
                                   parallel::Communicator& data, parallel::Communicator& control,
                                   const ParallelOptions& options) {
  Communicators comms;
  comms.data = &data;
  comms.control = &control;
  return load_with(dir, backend, std::move(comms), options);
}

std::unique_ptr<Model> Model::load_with(const std::filesystem::path& dir, kernels::Backend& backend,
                                        Communicators comms, const ParallelOptions& options) {
  const parallel::Communicator& data = *comms.data;
  const parallel::Communicator& control = *comms.control;
  if (data.device() != backend.device())
    throw LoadError("the data-plane communicator is on " + to_string(data.device()) + ", the backend on " +
                    to_string(backend.device()) + ": on a GPU it must be NCCL or host-staged");
  if (control.device() != kernels::kCpu)
    throw LoadError("the control-plane communicator must be on the host, not " + to_string(control.device()));
  if (data.size() != control.size() || data.rank() != control.rank())
    throw LoadError("the data and control communicators are different groups (rank " +
                    std::to_string(data.rank()) + " of " + std::to_string(data.size()) + " and " +
                    std::to_string(control.rank()) + " of " + std::to_string(control.size()) + ")");
  auto [config, names] = read_model_config(dir / "config.json");
  config.generation = read_generation_config(dir, config.vocab_size);
  for (const std::int32_t id : config.generation.eos_token_ids) {
    if (std::find(config.eos_token_ids.begin(), config.eos_token_ids.end(), id) == config.eos_token_ids.end())
      config.eos_token_ids.push_back(id);
  }
  if (const std::string why = options.capacity.validate(config.num_layers); !why.empty())
    throw LoadError(why);
  // The MTP drafter runs one layer (DeepSeek-V3 and R1 ship one; SGLang and vLLM's DeepSeek MTP read one).
  if (options.mtp && config.mtp_layer_is_moe.size() != 1) {
    throw LoadError(config.architecture +
                    ": MTP speculation needs exactly one multi-token-prediction layer " +
                    "(config.json's num_nextn_predict_layers); this model declares " +
                    std::to_string(config.mtp_layer_is_moe.size()));
  }
  std::optional<Fp8BlockShape> fp8 = config.fp8_blocks;
  return std::unique_ptr<Model>(
      new Model(std::move(config), Checkpoint::open(dir, fp8), names, backend, std::move(comms), options));
}

Model::Model(ModelConfig config, Checkpoint checkpoint, const TensorNames& names, kernels::Backend& backend,
             Communicators comms, const ParallelOptions& options)
    : config_(std::move(config)),
      backend_(&backend),
      own_comms_(std::move(comms.owned)),
      data_(comms.data),
      control_(comms.control),
      placement_(model_placement(config_, options, data_->size())),
      checkpoint_(std::move(checkpoint)),
      weights_(
          load_model_weights(checkpoint_, config_, names, placement_, data_->rank(), backend, options.mtp)),
      tables_(backend, placement_, data_->rank()),
      rope_(config_.rotary_dim(), config_.rope_theta, config_.rope_scaling),
      capacity_(options.capacity),
      mtp_capacity_(capacity_for_mtp(options.capacity)),
      moe_layers_(moe_layer_indices(config_)),
      mtp_moe_layers_(mtp_moe_layer_indices(config_, mtp_layers())),
      moe_index_(static_cast<std::size_t>(config_.num_layers + mtp_layers()), -1) {
  for (const std::vector<std::int64_t>* stack : {&moe_layers_, &mtp_moe_layers_}) {
    std::int64_t i = 0;
    for (const std::int64_t l : *stack) moe_index_[static_cast<std::size_t>(l)] = i++;
  }
}

const LayerWeights& Model::layer(std::int64_t layer) const {
  return layer < config_.num_layers
             ? weights_.layers[static_cast<std::size_t>(layer)]
             : weights_.mtp[static_cast<std::size_t>(layer - config_.num_layers)].layer;
}

}  // namespace capserve::runtime
