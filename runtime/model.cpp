#include "runtime/model.h"

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

parallel::ExpertPlacement make_placement(const ModelConfig& config, const std::string& spec, int ranks) {
  try {
    return parallel::ExpertPlacement::from_spec(spec, config.num_layers, config.num_experts, ranks);
  } catch (const std::exception& e) {
    throw LoadError(e.what());
  }
}

}  // namespace

std::unique_ptr<Model> Model::load(const std::filesystem::path& dir, kernels::Backend& backend) {
  auto self = std::make_unique<parallel::SelfCommunicator>();
  parallel::Communicator& comm = *self;
  return load_with(dir, backend, std::move(self), comm, ParallelOptions{});
}

std::unique_ptr<Model> Model::load(const std::filesystem::path& dir, kernels::Backend& backend,
                                   parallel::Communicator& comm, const ParallelOptions& options) {
  return load_with(dir, backend, nullptr, comm, options);
}

std::unique_ptr<Model> Model::load_with(const std::filesystem::path& dir, kernels::Backend& backend,
                                        std::unique_ptr<parallel::Communicator> own_comm,
                                        parallel::Communicator& comm, const ParallelOptions& options) {
  const nlohmann::json json = read_json_file(dir / "config.json");
  if (!json.is_object()) throw LoadError((dir / "config.json").string() + ": must be a JSON object");
  const Architecture& arch = find_architecture(json);
  ModelConfig config = arch.parse_config(ConfigReader(json));
  config.validate();
  if (const std::string why = options.capacity.validate(config.num_layers); !why.empty())
    throw LoadError(why);
  return std::unique_ptr<Model>(new Model(std::move(config), Checkpoint::open(dir), arch.tensor_names(),
                                          backend, std::move(own_comm), comm, options));
}

Model::Model(ModelConfig config, Checkpoint checkpoint, const TensorNames& names, kernels::Backend& backend,
             std::unique_ptr<parallel::Communicator> own_comm, parallel::Communicator& comm,
             const ParallelOptions& options)
    : config_(std::move(config)),
      backend_(&backend),
      own_comm_(std::move(own_comm)),
      comm_(&comm),
      placement_(make_placement(config_, options.placement, comm.size())),
      checkpoint_(std::move(checkpoint)),
      weights_(load_model_weights(checkpoint_, config_, names, placement_, comm.rank(), backend)),
      tables_(backend, placement_, comm.rank()),
      rope_(config_.rotary_dim(), config_.rope_theta, config_.rope_scaling),
      capacity_(options.capacity),
      moe_layers_(moe_layer_indices(config_)),
      moe_index_(static_cast<std::size_t>(config_.num_layers), -1) {
  std::int64_t i = 0;
  for (const std::int64_t l : moe_layers_) moe_index_[static_cast<std::size_t>(l)] = i++;
}

}  // namespace capserve::runtime
