#pragma once
// Mooncake's trace format (kvcache-ai/Mooncake, FAST'25; AIPerf reads it as its `mooncake_trace` dataset
// type): JSONL, one request a line, {"timestamp": ms, "input_length": tokens, "output_length": tokens,
// "hash_ids": [..]}. hash_ids[i] names the prompt's i-th block of 512 tokens together with everything before
// it, so two requests whose hash_ids start alike share that token prefix
// (../shared/data/traces/mooncake_synthetic.jsonl).
#include <cstdint>
#include <filesystem>
#include <ostream>
#include <span>
#include <string_view>
#include <vector>

#include "tools/loadgen/arrivals.h"

namespace capserve::loadgen {

enum class TraceFormat { azure, mooncake };

// The tokens per hash id in Mooncake's published traces.
inline constexpr std::int64_t kMooncakeBlockTokens = 512;

// --trace-format: "azure", "mooncake", or "auto" (by extension: .jsonl is Mooncake, .csv Azure). Throws
// std::invalid_argument naming the file when "auto" cannot tell.
TraceFormat trace_format_for(const std::filesystem::path& path, std::string_view flag);

// Reads a Mooncake trace, sorted by time, times relative to its first request. Throws std::runtime_error
// naming the file and line on a malformed line (not a JSON object; a field missing, not an integer or
// negative; hash_ids not ceil(input_length / block_tokens) long), and when the file has no requests.
std::vector<TraceRecord> read_mooncake_trace(const std::filesystem::path& path,
                                             std::int64_t block_tokens = kMooncakeBlockTokens);

// read_azure_trace or read_mooncake_trace.
std::vector<TraceRecord> read_trace(const std::filesystem::path& path, TraceFormat format);

// The arrivals as a Mooncake trace (timestamps in whole milliseconds), each with the sizes it is sent with:
// `prompt_tokens[i]` and `output_tokens[i]`, and the hash ids of the blocks that prompt still covers, so that
// every line keeps len(hash_ids) == ceil(input_length / block_tokens). A last partial block's id is replaced
// by a new one, above every id of the arrivals and used once, so that each id keeps one block size.
void write_mooncake_trace(std::ostream& out, std::span<const Arrival> arrivals,
                          std::span<const std::int64_t> prompt_tokens,
                          std::span<const std::int64_t> output_tokens, std::int64_t block_tokens);

}  // namespace capserve::loadgen
