#include "server/step_trace.h"

#include <algorithm>
#include <cstdio>
#include <stdexcept>

namespace capserve::server {
namespace {

template <typename Range, typename Value>
void append_list(std::string& line, const Range& values, Value value) {
  line += '[';
  bool first = true;
  for (const auto& v : values) {
    if (!first) line += ',';
    first = false;
    line += std::to_string(value(v));
  }
  line += ']';
}

}  // namespace

void active_experts(const parallel::MoeStepStats& stats, const parallel::ExpertPlacement& placement,
                    std::vector<std::int64_t>& out) {
  out.clear();
  for (const parallel::MoeLayerStats& layer : stats.layers) {
    // The placement's slots: experts, or with replication their copies (each a weight read of its own).
    const std::vector<std::int64_t>& load = layer.slot_load.empty() ? layer.expert_load : layer.slot_load;
    for (int r = 0; r < placement.num_ranks(); ++r) {
      const auto slots = placement.local_experts(layer.layer, r);
      out.push_back(std::count_if(slots.begin(), slots.end(), [&](std::int32_t s) {
        return static_cast<std::size_t>(s) < load.size() && load[static_cast<std::size_t>(s)] > 0;
      }));
    }
  }
}

StepTraceWriter::StepTraceWriter(const std::filesystem::path& path)
    : path_(path), out_(path, std::ios::trunc) {
  if (!out_) throw std::runtime_error("--step-trace: cannot create " + path.string());
}

bool StepTraceWriter::write(std::chrono::steady_clock::time_point start, double seconds,
                            std::span<const RankWork> ranks, const parallel::MoeStepStats& stats,
                            std::span<const std::int64_t> active_experts) {
  if (!first_) first_ = start;
  char head[96];
  std::snprintf(head, sizeof head, R"({"start_s":%.6f,"seconds":%.6f,"tokens":)",
                std::chrono::duration<double>(start - *first_).count(), seconds);
  line_ = head;
  append_list(line_, ranks, [](const RankWork& w) { return w.tokens; });
  line_ += R"(,"decodes":)";
  append_list(line_, ranks, [](const RankWork& w) { return w.decodes; });
  line_ += R"(,"attention_pairs":)";
  append_list(line_, ranks, [](const RankWork& w) { return w.attention_pairs; });
  line_ += R"(,"decode_pairs":)";
  append_list(line_, ranks, [](const RankWork& w) { return w.decode_pairs; });
  line_ += R"(,"expert_load":[)";
  for (std::size_t l = 0; l < stats.layers.size(); ++l) {
    if (l > 0) line_ += ',';
    append_list(line_, stats.layers[l].rank_load, [](std::int64_t v) { return v; });
  }
  line_ += R"(],"active_experts":[)";
  for (std::size_t l = 0; l < stats.layers.size(); ++l) {
    if (l > 0) line_ += ',';
    append_list(line_, active_experts.subspan(l * ranks.size(), ranks.size()),
                [](std::int64_t v) { return v; });
  }
  line_ += R"(],"dropped":)";
  append_list(line_, stats.layers, [](const parallel::MoeLayerStats& l) { return l.dropped; });
  line_ += R"(,"wire_bytes":)";
  append_list(line_, stats.layers, [](const parallel::MoeLayerStats& l) { return l.wire_bytes; });
  line_ += "}\n";
  out_ << line_;
  out_.flush();
  return static_cast<bool>(out_);
}

}  // namespace capserve::server
