// capserve-placement: a balanced expert placement from routing counts, offline. Reads our --moe-stats output,
// a shared counts file ({model: {"expert_counts": ...}}) or SGLang's expert-distribution dump, places the
// experts of every layer over the ranks as the model run would (parallel::ExpertPlacement::balanced), prints
// each layer's per-rank imbalance (max / mean rank load) against the contiguous placement, and writes a file
// that `--expert-placement` accepts.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "runtime/cli/flag_checks.h"
#include "runtime/cli/version.h"
#include "tools/placement/expert_counts.h"
#include "tools/placement/placement_plan.h"

int main(int argc, char** argv) {
  capserve::runtime::log_to_stderr();
  using namespace capserve;
  CLI::App app{"Balanced expert placement from routing counts (written for --expert-placement)"};
  capserve::runtime::add_common_flags(app, "capserve-placement");
  std::string counts_path;
  std::string model_key;
  std::vector<std::string> domains;
  int ranks = 0;
  std::string out_path;
  app.add_option("--counts", counts_path,
                 "--moe-stats output, a counts file {model: {expert_counts: ...}} or SGLang's "
                 "{\"logical_count\": ...} dump")
      ->required()
      ->check(CLI::ExistingFile);
  app.add_option("--ranks", ranks, "number of ranks to place the experts on")
      ->required()
      ->check(CLI::PositiveNumber);
  app.add_option("--counts-model", model_key,
                 "the model key in a counts file (needed when it holds several)");
  app.add_option("--domains", domains, "sum only these domains of a counts file (default: all)")
      ->delimiter(',');
  app.add_option("--out", out_path, "placement JSON for --expert-placement");
  if (const auto bad = runtime::flag_with_empty_value({argv + 1, static_cast<std::size_t>(argc - 1)})) {
    std::cerr << "capserve-placement: " << *bad << " has an empty value\n";
    return 2;
  }
  CLI11_PARSE(app, argc, argv);

  try {
    const tools::ExpertCounts counts = tools::read_expert_counts(counts_path, model_key);
    const nlohmann::json doc = tools::placement_document(counts, domains, ranks);
    std::printf("%s (%s): %lld experts%s, %d ranks, domains %s\n", counts_path.c_str(), counts.format.c_str(),
                static_cast<long long>(counts.num_experts),
                counts.top_k ? (" top-" + std::to_string(*counts.top_k)).c_str() : "", ranks,
                doc["domains"].dump().c_str());
    std::printf("%6s %22s %22s\n", "layer", "contiguous max/mean", "balanced max/mean");
    for (const nlohmann::json& l : doc["layers"]) {
      std::printf("%6lld %22.3f %22.3f\n", l["layer"].get<long long>(),
                  l["contiguous_max_over_mean"].get<double>(), l["max_over_mean"].get<double>());
    }
    const double before = doc["contiguous_sum_max_rank_load"].get<double>();
    const double after = doc["sum_max_rank_load"].get<double>();
    std::printf("sum over layers of the most loaded rank's load: contiguous %.6g, balanced %.6g (%.3fx)\n",
                before, after, after > 0 ? before / after : 1.0);
    if (!out_path.empty()) {
      std::ofstream out(out_path);
      out << doc.dump(1) << "\n";
      if (!out.flush()) {
        std::cerr << "capserve-placement: cannot write " << out_path << "\n";
        return 1;
      }
      std::printf("wrote %s\n", out_path.c_str());
    }
  } catch (const std::exception& e) {
    std::cerr << "capserve-placement: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
