#pragma once
// When requests arrive and how big they are: replayed from a trace (an Azure LLM inference CSV,
// ../shared/data/traces/azure_llm_2023_{code,conv}.csv: TIMESTAMP,ContextTokens,GeneratedTokens; or a
// Mooncake JSONL, mooncake_trace.h), time-scaled and sliced, or drawn as a seeded Poisson process.
#include <cstdint>
#include <filesystem>
#include <random>
#include <string_view>
#include <vector>

namespace capserve::loadgen {

// One row of a trace: seconds since the trace's first request, its token counts, and (Mooncake traces) the
// hashes of its prompt's blocks, which say which prompts share a prefix.
struct TraceRecord {
  double t_s = 0;
  std::int64_t context_tokens = 0;
  std::int64_t generated_tokens = 0;
  std::vector<std::int64_t> hash_ids;
};

// One request to send: when (seconds after the run starts) and the sizes the trace asked for (uncapped).
struct Arrival {
  double at_s = 0;
  std::int64_t context_tokens = 0;
  std::int64_t generated_tokens = 0;
  std::vector<std::int64_t> hash_ids;
};

// "2023-11-16 18:17:03.9799600" as seconds since 1970-01-01 (UTC assumed; only differences matter). Throws
// std::invalid_argument on anything else.
double parse_trace_timestamp(std::string_view text);

// Reads a whole trace, sorted by time, times relative to its first row. Throws std::runtime_error naming the
// file and line on a malformed row, and when the file has no rows.
std::vector<TraceRecord> read_azure_trace(const std::filesystem::path& path);

struct TraceSlice {
  double start_s = 0;             // in the trace's own seconds
  double duration_s = 0;          // of the run, i.e. after scaling; 0: to the end of the trace
  double time_scale = 1;          // run time = trace time * time_scale (0.1 replays ten times faster)
  std::int64_t max_requests = 0;  // 0: no limit
};

// The trace's requests in [start_s, start_s + duration_s / time_scale) of trace time, shifted so that the
// slice starts at 0 and scaled. Throws std::invalid_argument on a non-positive time_scale.
std::vector<Arrival> slice_trace(const std::vector<TraceRecord>& trace, const TraceSlice& slice);

// Request sizes for arrivals that do not come from a trace's rows: drawn uniformly from a trace's rows when
// `rows` is not empty (the trace's size distribution with other timing), else the fixed values.
class SizeSource {
 public:
  SizeSource(std::vector<TraceRecord> rows, std::int64_t context_tokens, std::int64_t generated_tokens,
             std::uint64_t seed);
  // Fills a's token counts.
  void draw(Arrival& a);

 private:
  std::vector<TraceRecord> rows_;
  std::int64_t context_tokens_;
  std::int64_t generated_tokens_;
  std::mt19937_64 rng_;
};

struct PoissonSpec {
  double rate = 1;  // requests per second
  double duration_s = 60;
  std::int64_t max_requests = 0;  // 0: no limit
  std::uint64_t seed = 1;
};

std::vector<Arrival> poisson_arrivals(const PoissonSpec& spec, SizeSource& sizes);

}  // namespace capserve::loadgen
