// capserve-bench-runtime: prefill and decode throughput of the runtime (--device cpu or cuda) for a batch of
// equal-length random prompts; prints one JSON line (the format tools/bench/bench_cpu_runtime.py reads for
// every contender).
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include <CLI/CLI.hpp>

#include <optional>

#include "kernels/cpu/cpu_backend.h"
#include "parallel/mpi_world.h"
#include "runtime/cli/rank_devices.h"
#include "runtime/cli/version.h"
#include "runtime/engine.h"
#include "runtime/model.h"

namespace {

using Clock = std::chrono::steady_clock;
using capserve::runtime::Engine;
using capserve::runtime::SequenceId;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Prefills every prompt in one step, then decodes `steps` tokens for all of them; returns {prefill s, decode
// s}.
std::pair<double, double> run(Engine& engine, const std::vector<std::vector<std::int32_t>>& prompts,
                              int steps, SequenceId first_id) {
  std::vector<Engine::Work> work;
  for (std::size_t i = 0; i < prompts.size(); ++i) work.push_back({first_id + i, prompts[i], false});
  const auto t0 = Clock::now();
  if (auto s = engine.step(work); !s.ok()) throw std::runtime_error(s.message());
  const double prefill = seconds_since(t0);
  std::vector<std::int32_t> next(prompts.size());
  const std::vector<capserve::kernels::SampleControls> greedy(prompts.size());  // temperature 0: argmax
  const auto t1 = Clock::now();
  for (int step = 0; step < steps; ++step) {
    engine.sample(greedy, next);
    for (std::size_t i = 0; i < prompts.size(); ++i)
      work[i].tokens = std::span<const std::int32_t>(&next[i], 1);
    if (auto s = engine.step(work); !s.ok()) throw std::runtime_error(s.message());
  }
  const double decode = seconds_since(t1);
  for (std::size_t i = 0; i < prompts.size(); ++i) engine.release(first_id + i);
  return {prefill, decode};
}

}  // namespace

int main(int argc, char** argv) {
  capserve::runtime::log_to_stderr();
  CLI::App app{"CapServe runtime throughput benchmark"};
  capserve::runtime::add_common_flags(app, "capserve-bench-runtime");
  std::string model_dir;
  std::string device = "cpu";
  std::string kv_dtype = "auto";
  int batch = 1;
  int prompt_len = 128;
  int decode_steps = 32;
  int threads = 2;
  int seed = 0;
  app.add_option("--model", model_dir)->required()->check(CLI::ExistingDirectory);
  app.add_option("--batch", batch)->check(CLI::PositiveNumber);
  app.add_option("--prompt-len", prompt_len)->check(CLI::PositiveNumber);
  app.add_option("--decode-steps", decode_steps)->check(CLI::PositiveNumber);
  app.add_option("--threads", threads)->check(CLI::PositiveNumber);
  app.add_option("--seed", seed);
  capserve::runtime::add_device_flag(app, device);
  capserve::runtime::add_kv_dtype_flag(app, kv_dtype);
  CLI11_PARSE(app, argc, argv);

  try {
    // One rank. MPI only where the device needs it (NCCL's set-up), so a CPU run measures the runtime alone.
    std::optional<capserve::parallel::MpiWorld> world;
    if (device != "cpu") world.emplace(argc, argv);
    capserve::runtime::RankDevices devices;
    if (world) {
      devices = capserve::runtime::make_rank_devices(device, threads, *world);
    } else {
      devices.backend = std::make_unique<capserve::kernels::cpu::CpuBackend>(threads);
    }
    const auto model = capserve::runtime::Model::load(model_dir, *devices.backend);
    capserve::runtime::EngineOptions options;
    options.kv_dtype = capserve::runtime::kv_dtype_for(kv_dtype, devices.backend->device());
    options.kv_blocks = batch * ((prompt_len + decode_steps) / options.kv_block_size + 2);
    Engine engine(*model, options);

    std::mt19937 rng(static_cast<unsigned>(seed));
    std::uniform_int_distribution<std::int32_t> token(
        0, static_cast<std::int32_t>(model->config().vocab_size - 1));
    std::vector<std::vector<std::int32_t>> prompts(static_cast<std::size_t>(batch));
    for (auto& p : prompts) {
      p.resize(static_cast<std::size_t>(prompt_len));
      for (auto& t : p) t = token(rng);
    }
    // Warm-up: touches every buffer and pages in the weights the routing reaches.
    run(engine, prompts, 2, 1'000'000);
    const auto [prefill, decode] = run(engine, prompts, decode_steps, 0);

    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    std::printf(
        "{\"engine\":\"capserve\",\"device\":\"%s\",\"batch\":%d,\"prompt_len\":%d,\"decode_steps\":%d,"
        "\"threads\":%d,"
        "\"prefill_tok_s\":%.3f,\"decode_tok_s\":%.3f,\"peak_rss_mb\":%.1f}\n",
        device.c_str(), batch, prompt_len, decode_steps, threads, batch * prompt_len / prefill,
        batch * decode_steps / decode, static_cast<double>(usage.ru_maxrss) / 1024.0);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "capserve-bench-runtime: %s\n", e.what());
    return 1;
  }
  return 0;
}
