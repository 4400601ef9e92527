#include "tools/loadgen/mooncake_trace.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

namespace capserve::loadgen {
namespace {

std::int64_t blocks_for(std::int64_t tokens, std::int64_t block_tokens) {
  return (tokens + block_tokens - 1) / block_tokens;
}

std::int64_t non_negative_integer(const nlohmann::json& line, const char* field) {
  const auto it = line.find(field);
  if (it == line.end()) throw std::invalid_argument(std::string("no \"") + field + "\"");
  if (!it->is_number_integer() || it->get<std::int64_t>() < 0)
    throw std::invalid_argument(std::string("\"") + field + "\" is " + it->dump() +
                                ", not a non-negative integer");
  return it->get<std::int64_t>();
}

}  // namespace

TraceFormat trace_format_for(const std::filesystem::path& path, std::string_view flag) {
  if (flag == "azure") return TraceFormat::azure;
  if (flag == "mooncake") return TraceFormat::mooncake;
  if (flag != "auto")
    throw std::invalid_argument("trace format '" + std::string(flag) + "' is not auto, azure or mooncake");
  const std::string ext = path.extension().string();
  if (ext == ".jsonl") return TraceFormat::mooncake;
  if (ext == ".csv") return TraceFormat::azure;
  throw std::invalid_argument("cannot tell the format of trace " + path.string() +
                              " from its extension (.jsonl: mooncake, .csv: azure); give --trace-format");
}

std::vector<TraceRecord> read_mooncake_trace(const std::filesystem::path& path, std::int64_t block_tokens) {
  if (block_tokens < 1) throw std::invalid_argument("trace block size must be >= 1 token");
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open trace " + path.string());
  std::vector<TraceRecord> rows;
  std::string text;
  std::int64_t number = 0;
  while (std::getline(in, text)) {
    ++number;
    if (!text.empty() && text.back() == '\r') text.pop_back();
    if (text.find_first_not_of(" \t") == std::string::npos) continue;
    try {
      const nlohmann::json line = nlohmann::json::parse(text);
      if (!line.is_object()) throw std::invalid_argument("not a JSON object");
      TraceRecord r;
      // Milliseconds for now; made relative seconds below.
      r.t_s = static_cast<double>(non_negative_integer(line, "timestamp"));
      r.context_tokens = non_negative_integer(line, "input_length");
      r.generated_tokens = non_negative_integer(line, "output_length");
      const auto ids = line.find("hash_ids");
      if (ids == line.end() || !ids->is_array()) throw std::invalid_argument("no \"hash_ids\" array");
      r.hash_ids.reserve(ids->size());
      for (const nlohmann::json& id : *ids) {
        if (!id.is_number_integer() || id.get<std::int64_t>() < 0)
          throw std::invalid_argument("hash id " + id.dump() + " is not a non-negative integer");
        r.hash_ids.push_back(id.get<std::int64_t>());
      }
      const std::int64_t want = blocks_for(r.context_tokens, block_tokens);
      if (static_cast<std::int64_t>(r.hash_ids.size()) != want)
        throw std::invalid_argument(std::to_string(r.hash_ids.size()) + " hash_ids for input_length " +
                                    std::to_string(r.context_tokens) + ": expected ceil(" +
                                    std::to_string(r.context_tokens) + " / " + std::to_string(block_tokens) +
                                    ") = " + std::to_string(want));
      rows.push_back(std::move(r));
    } catch (const nlohmann::json::exception& e) {
      throw std::runtime_error(path.string() + ":" + std::to_string(number) + ": not JSON: " + e.what());
    } catch (const std::invalid_argument& e) {
      throw std::runtime_error(path.string() + ":" + std::to_string(number) + ": " + e.what());
    }
  }
  if (rows.empty()) throw std::runtime_error("trace " + path.string() + " has no requests");
  std::stable_sort(rows.begin(), rows.end(),
                   [](const TraceRecord& x, const TraceRecord& y) { return x.t_s < y.t_s; });
  const double first_ms = rows.front().t_s;
  for (TraceRecord& r : rows) r.t_s = (r.t_s - first_ms) / 1000;
  return rows;
}

std::vector<TraceRecord> read_trace(const std::filesystem::path& path, TraceFormat format) {
  return format == TraceFormat::mooncake ? read_mooncake_trace(path) : read_azure_trace(path);
}

void write_mooncake_trace(std::ostream& out, std::span<const Arrival> arrivals,
                          std::span<const std::int64_t> prompt_tokens,
                          std::span<const std::int64_t> output_tokens, std::int64_t block_tokens) {
  if (prompt_tokens.size() != arrivals.size() || output_tokens.size() != arrivals.size())
    throw std::invalid_argument("write_mooncake_trace: one prompt and output size per arrival");
  std::int64_t next_id = 0;
  for (const Arrival& a : arrivals) {
    for (const std::int64_t id : a.hash_ids) next_id = std::max(next_id, id + 1);
  }
  for (std::size_t i = 0; i < arrivals.size(); ++i) {
    const Arrival& a = arrivals[i];
    const auto blocks = static_cast<std::size_t>(blocks_for(prompt_tokens[i], block_tokens));
    if (blocks > a.hash_ids.size())
      throw std::invalid_argument("write_mooncake_trace: request " + std::to_string(i) + " has " +
                                  std::to_string(a.hash_ids.size()) + " hash ids for " +
                                  std::to_string(blocks) + " blocks");
    std::vector<std::int64_t> ids(a.hash_ids.begin(),
                                  a.hash_ids.begin() + static_cast<std::ptrdiff_t>(blocks));
    // A last partial block gets an id of its own: AIPerf 0.13 gives each hash id one block size and refuses a
    // trace that uses one at two sizes, which scaling and capping make common. A KV cache of full blocks
    // cannot hit a partial block anyway.
    if (prompt_tokens[i] % block_tokens != 0) ids.back() = next_id++;
    const nlohmann::json line = {{"timestamp", static_cast<std::int64_t>(std::llround(a.at_s * 1000))},
                                 {"input_length", prompt_tokens[i]},
                                 {"output_length", output_tokens[i]},
                                 {"hash_ids", ids}};
    out << line.dump() << "\n";
  }
}

}  // namespace capserve::loadgen
