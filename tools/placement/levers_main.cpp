// capserve-levers: the balance levers side by side on routing counts (tools/placement/lever_table.h):
// placement, EPLB-style replication, capacity factors and their combinations, per model and rank count, with
// the expert memory and the assignments each costs. Prints a Markdown report; --json writes the figures.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "runtime/cli/flag_checks.h"
#include "runtime/cli/version.h"
#include "tools/placement/expert_counts.h"
#include "tools/placement/lever_table.h"

namespace {

// "LABEL=PATH" or "LABEL=PATH#MODEL" (the model key of a shared counts file).
struct Source {
  std::string label, path, model;
};

Source parse_source(const std::string& text) {
  const auto eq = text.find('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == text.size())
    throw std::invalid_argument("--source " + text + ": expected LABEL=PATH or LABEL=PATH#MODEL");
  Source s{text.substr(0, eq), text.substr(eq + 1), ""};
  if (const auto hash = s.path.find('#'); hash != std::string::npos) {
    s.model = s.path.substr(hash + 1);
    s.path.resize(hash);
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  capserve::runtime::log_to_stderr();
  using namespace capserve;
  CLI::App app{"Placement, replication and capacity side by side on routing counts"};
  capserve::runtime::add_common_flags(app, "capserve-levers");
  std::vector<std::string> sources;
  std::vector<int> ranks{4, 8};
  std::string json_path;
  app.add_option("--source", sources,
                 "LABEL=PATH[#MODEL]: a routing-counts file capserve-placement reads (repeatable)")
      ->required();
  app.add_option("--ranks", ranks, "rank counts")->delimiter(',')->capture_default_str();
  app.add_option("--json", json_path, "write the figures here");
  if (const auto bad = runtime::flag_with_empty_value({argv + 1, static_cast<std::size_t>(argc - 1)})) {
    std::cerr << "capserve-levers: " << *bad << " has an empty value\n";
    return 2;
  }
  CLI11_PARSE(app, argc, argv);

  try {
    const std::vector<tools::Lever> levers = tools::standard_levers();
    nlohmann::json out = nlohmann::json::array();
    for (const std::string& text : sources) {
      const Source source = parse_source(text);
      const tools::ExpertCounts counts = tools::read_expert_counts(source.path, source.model);
      std::string groups;
      for (const tools::CountsGroup& g : counts.groups) groups += (groups.empty() ? "" : ", ") + g.name;
      std::printf("## %s\n\n`%s`%s: %lld experts%s, %zu layers, workloads (groups): %s.\n\n",
                  source.label.c_str(), source.path.c_str(),
                  source.model.empty() ? "" : (" (" + source.model + ")").c_str(),
                  static_cast<long long>(counts.num_experts),
                  counts.top_k ? (", top-" + std::to_string(*counts.top_k)).c_str() : "",
                  counts.groups.front().layers.size(), groups.c_str());
      for (const int r : ranks) {
        if (r > counts.num_experts) continue;  // fewer experts than ranks: some would host none
        std::printf(
            "%d ranks:\n\n| lever | max/mean (mean) | max/mean (worst) | MoE-layer speedup | dropped | "
            "expert "
            "slots per rank | expert memory |\n|---|---:|---:|---:|---:|---:|---:|\n",
            r);
        for (const tools::LeverResult& row : tools::lever_table(counts, r, levers)) {
          std::printf("| %s | %.3f | %.3f | %.2fx | %.2f%% | %lld | %+.0f%% |\n", row.lever.c_str(),
                      row.mean_max_over_mean, row.worst_max_over_mean, row.speedup, 100 * row.dropped,
                      static_cast<long long>(row.slots_per_rank), 100 * row.memory_vs_contiguous);
          nlohmann::json j = tools::to_json(row);
          j["source"] = source.label;
          j["ranks"] = r;
          out.push_back(j);
        }
        std::printf("\n");
      }
    }
    if (!json_path.empty()) {
      std::ofstream f(json_path);
      f << out.dump(1) << "\n";
      if (!f.flush()) throw std::runtime_error("cannot write " + json_path);
    }
  } catch (const std::exception& e) {
    std::cerr << "capserve-levers: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
