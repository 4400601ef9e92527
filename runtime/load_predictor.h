#pragma once
// What the server's batch selector asks before admitting a request: the expert load its prompt would put on
// each rank. An interface, so that the scheduler holds no engine: the server's implementation is
// RouterLoadPredictor (router_load_predictor.h); scheduler tests run without one.
#include <cstdint>
#include <span>

namespace capserve::runtime {

class LoadPredictor {
 public:
  virtual ~LoadPredictor() = default;

  // Overwrites rank_load (one entry per rank) with the prompt's predicted expert load on each rank: the
  // token-expert assignments of the first layers() MoE layers that land on it.
  virtual void predict(std::span<const std::int32_t> prompt, std::span<float> rank_load) = 0;
  // The MoE layers the prediction covers (the realized load it is compared with covers as many).
  [[nodiscard]] virtual std::int64_t layers() const = 0;
};

}  // namespace capserve::runtime
