#pragma once
// What the server's batch selector asks before admitting a request: the expert load its prompt would put on
// each rank in each MoE layer (an MoE layer is as slow as its most loaded rank, layer by layer). An
// interface, so that the scheduler holds no engine: the server's implementation is RouterLoadPredictor
// (router_load_predictor.h); scheduler tests run without one.
#include <cstdint>
#include <span>

namespace capserve::runtime {

class LoadPredictor {
 public:
  virtual ~LoadPredictor() = default;

  // Overwrites rank_load ([layers(), ranks], row-major) with the prompt's predicted expert load on each rank
  // in each of the first layers() MoE layers: the token-expert assignments that land on it.
  virtual void predict(std::span<const std::int32_t> prompt, std::span<float> rank_load) = 0;
  // The MoE layers the prediction covers (the realized load it is compared with covers as many).
  [[nodiscard]] virtual std::int64_t layers() const = 0;
};

}  // namespace capserve::runtime
