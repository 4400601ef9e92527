// Mooncake trace replay in capserve-loadgen: the JSONL reader, the shared token prefixes made from hash_ids,
// length scaling and the cap report, the trace written for AIPerf, and the prefix-cache figures from
// /metrics.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "tools/loadgen/mooncake_trace.h"
#include "tools/loadgen/prefix_tokens.h"
#include "tools/loadgen/prometheus_text.h"
#include "tools/loadgen/server_figures.h"
#include "tools/loadgen/trace_lengths.h"

namespace capserve::loadgen {
namespace {

const std::filesystem::path kSource(CAPSERVE_SOURCE_DIR);
const std::filesystem::path kMooncake = kSource / "../shared/data/traces/mooncake_synthetic.jsonl";

std::filesystem::path write_file(const std::string& name, const std::string& text) {
  const std::filesystem::path p =
      std::filesystem::temp_directory_path() / ("trace_replay_" + std::to_string(::getpid()) + "_" + name);
  std::ofstream(p, std::ios::binary) << text;
  return p;
}

// The message read_mooncake_trace throws for `text`, or "" when it reads it.
std::string reader_error(const std::string& text, const std::string& name) {
  const std::filesystem::path p = write_file(name, text);
  std::string message;
  try {
    read_mooncake_trace(p);
  } catch (const std::runtime_error& e) {
    message = e.what();
  }
  std::filesystem::remove(p);
  return message;
}

std::vector<std::int32_t> iota_vocabulary(std::int32_t n) {
  std::vector<std::int32_t> v(static_cast<std::size_t>(n));
  for (std::int32_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = i;
  return v;
}

TEST(MooncakeTrace, ReadsSortsAndMakesSecondsRelative) {
  const std::filesystem::path p = write_file(
      "ok.jsonl",
      "{\"timestamp\": 2500, \"input_length\": 1025, \"output_length\": 7, \"hash_ids\": [0, 1, 5]}\r\n"
      "\n"
      "{\"timestamp\": 1500, \"input_length\": 512, \"output_length\": 3, \"hash_ids\": [0]}\n"
      "{\"hash_ids\": [0, 1], \"output_length\": 0, \"input_length\": 513, \"timestamp\": 2000}\n");
  const std::vector<TraceRecord> rows = read_mooncake_trace(p);
  std::filesystem::remove(p);
  ASSERT_EQ(rows.size(), 3U);
  EXPECT_DOUBLE_EQ(rows[0].t_s, 0.0);
  EXPECT_EQ(rows[0].context_tokens, 512);
  EXPECT_EQ(rows[0].generated_tokens, 3);
  EXPECT_EQ(rows[0].hash_ids, (std::vector<std::int64_t>{0}));
  EXPECT_DOUBLE_EQ(rows[1].t_s, 0.5);
  EXPECT_EQ(rows[1].hash_ids, (std::vector<std::int64_t>{0, 1}));
  EXPECT_DOUBLE_EQ(rows[2].t_s, 1.0);
  EXPECT_EQ(rows[2].context_tokens, 1025);
  EXPECT_EQ(rows[2].hash_ids, (std::vector<std::int64_t>{0, 1, 5}));
}

TEST(MooncakeTrace, NamesTheFileAndLineOfAMalformedLine) {
  const std::string good =
      "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [0]}\n";
  const struct {
    std::string line;
    std::string why;
  } cases[] = {
      {"{\"timestamp\": 0, \"input_length\": 10", "not JSON"},
      {"[1, 2]", "not a JSON object"},
      {"{\"input_length\": 10, \"output_length\": 1, \"hash_ids\": [0]}", "no \"timestamp\""},
      {"{\"timestamp\": 0, \"input_length\": -3, \"output_length\": 1, \"hash_ids\": []}",
       "\"input_length\" is -3, not a non-negative integer"},
      {"{\"timestamp\": 0, \"input_length\": 10.5, \"output_length\": 1, \"hash_ids\": [0]}",
       "\"input_length\" is 10.5"},
      {"{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1}", "no \"hash_ids\" array"},
      {"{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [\"a\"]}",
       "hash id \"a\" is not a non-negative integer"},
      {"{\"timestamp\": 0, \"input_length\": 513, \"output_length\": 1, \"hash_ids\": [0]}",
       "1 hash_ids for input_length 513: expected ceil(513 / 512) = 2"},
      {"{\"timestamp\": 0, \"input_length\": 512, \"output_length\": 1, \"hash_ids\": [0, 1]}",
       "2 hash_ids for input_length 512: expected ceil(512 / 512) = 1"},
  };
  for (const auto& c : cases) {
    const std::string message = reader_error(good + good + c.line + "\n" + good, "bad.jsonl");
    EXPECT_NE(message.find("bad.jsonl:3: "), std::string::npos) << message;
    EXPECT_NE(message.find(c.why), std::string::npos) << message;
  }
  EXPECT_NE(reader_error("\n\n", "empty.jsonl").find("has no requests"), std::string::npos);
  EXPECT_THROW(read_mooncake_trace("/nonexistent/trace.jsonl"), std::runtime_error);
}

TEST(MooncakeTrace, ReadsTheSyntheticTrace) {
  if (!std::filesystem::exists(kMooncake)) GTEST_SKIP() << "no " << kMooncake;
  const std::vector<TraceRecord> rows = read_mooncake_trace(kMooncake);
  ASSERT_EQ(rows.size(), 3993U);
  EXPECT_NEAR(rows.back().t_s, 1022.025, 1e-9);
  // ../shared/data/README.md: 64% of the blocks repeat an earlier one.
  std::unordered_set<std::int64_t> seen;
  std::int64_t blocks = 0;
  std::int64_t repeats = 0;
  for (const TraceRecord& r : rows) {
    for (const std::int64_t id : r.hash_ids) {
      ++blocks;
      repeats += seen.insert(id).second ? 0 : 1;
    }
  }
  EXPECT_NEAR(static_cast<double>(repeats) / static_cast<double>(blocks), 0.64, 0.005);
}

TEST(TraceFormat, FromTheFlagOrTheExtension) {
  EXPECT_EQ(trace_format_for("t.jsonl", "auto"), TraceFormat::mooncake);
  EXPECT_EQ(trace_format_for("t.csv", "auto"), TraceFormat::azure);
  EXPECT_EQ(trace_format_for("t.txt", "mooncake"), TraceFormat::mooncake);
  EXPECT_EQ(trace_format_for("t.jsonl", "azure"), TraceFormat::azure);
  EXPECT_THROW(trace_format_for("t.txt", "auto"), std::invalid_argument);
  EXPECT_THROW(trace_format_for("t.csv", "parquet"), std::invalid_argument);
}

TEST(PrefixTokens, SharedHashIdsGiveSharedPrefixes) {
  const std::vector<std::int32_t> vocabulary = {3, 5, 8, 13, 21, 34, 55, 89, 144};
  const PrefixTokens tokens(vocabulary, 16, 7);
  const std::vector<std::int64_t> a = {0, 1, 2, 3};
  const std::vector<std::int64_t> b = {0, 1, 9, 10};
  const std::vector<std::int32_t> pa = tokens.prompt(a, 60);
  const std::vector<std::int32_t> pb = tokens.prompt(b, 40);
  ASSERT_EQ(pa.size(), 60U);
  ASSERT_EQ(pb.size(), 40U);
  EXPECT_TRUE(std::equal(pa.begin(), pa.begin() + 32, pb.begin()));  // blocks 0 and 1
  EXPECT_FALSE(std::equal(pa.begin() + 32, pa.begin() + 40, pb.begin() + 32));
  // A prompt is its blocks, in order, cut to its length; every id from the vocabulary.
  std::vector<std::int32_t> blocks;
  for (const std::int64_t id : a) {
    const std::vector<std::int32_t> block = tokens.block(id);
    ASSERT_EQ(block.size(), 16U);
    blocks.insert(blocks.end(), block.begin(), block.end());
  }
  EXPECT_TRUE(std::equal(pa.begin(), pa.end(), blocks.begin()));
  const std::set<std::int32_t> allowed(vocabulary.begin(), vocabulary.end());
  for (const std::int32_t id : blocks) EXPECT_TRUE(allowed.contains(id)) << id;
  EXPECT_THROW((void)tokens.prompt(a, 65), std::invalid_argument);
  EXPECT_TRUE(tokens.prompt({}, 0).empty());
}

TEST(PrefixTokens, DeterministicDistinctAndSeeded) {
  const PrefixTokens tokens(iota_vocabulary(6000), 16, 1);
  const PrefixTokens again(iota_vocabulary(6000), 16, 1);
  const PrefixTokens other_seed(iota_vocabulary(6000), 16, 2);
  std::set<std::vector<std::int32_t>> distinct;
  for (std::int64_t id = 0; id < 2000; ++id) {
    const std::vector<std::int32_t> block = tokens.block(id);
    EXPECT_EQ(block, again.block(id));
    EXPECT_NE(block, other_seed.block(id));
    distinct.insert(block);
  }
  EXPECT_EQ(distinct.size(), 2000U);  // different hash ids, different blocks
  // Ids spread over the vocabulary rather than sticking to a corner of it.
  std::set<std::int32_t> used;
  for (std::int64_t id = 0; id < 2000; ++id) {
    for (const std::int32_t t : tokens.block(id)) used.insert(t);
  }
  EXPECT_GT(used.size(), 5900U);
  EXPECT_THROW(PrefixTokens({}, 16, 1), std::invalid_argument);
  EXPECT_THROW(PrefixTokens({1}, 0, 1), std::invalid_argument);
}

TEST(PrefixTokens, OrdinaryIdsOfTheDefaultModel) {
  const std::filesystem::path model = kSource / "deploy/models/capserve-moe-tiny";
  if (!std::filesystem::exists(model / "tokenizer.json")) GTEST_SKIP() << "no default model";
  const runtime::Tokenizer tokenizer = runtime::Tokenizer::load(model);
  const std::vector<std::int32_t> ids = ordinary_token_ids(tokenizer);
  ASSERT_FALSE(ids.empty());
  EXPECT_LT(ids.size(), static_cast<std::size_t>(tokenizer.vocab_size()));  // the specials are left out
  EXPECT_LT(ids.back(), tokenizer.vocab_size());
  for (const std::int32_t id : ids) EXPECT_FALSE(tokenizer.is_special(id)) << id;
  const std::optional<std::int32_t> eos = tokenizer.eos_id();
  ASSERT_TRUE(eos.has_value());
  EXPECT_FALSE(std::binary_search(ids.begin(), ids.end(), *eos));
}

TEST(TraceLengths, ScalesLengthsAndBlocks) {
  EXPECT_EQ(scaled_block_tokens(512, 1.0 / 32), 16);
  EXPECT_EQ(scaled_block_tokens(512, 0.1), 51);
  EXPECT_EQ(scaled_block_tokens(512, 0.0001), 1);
  std::vector<TraceRecord> rows = {{0, 40160, 6, std::vector<std::int64_t>(79)},
                                   {1, 5120, 100, std::vector<std::int64_t>(10)},
                                   {2, 300, 50, {}}};
  std::vector<TraceRecord> at_32 = rows;
  scale_lengths(at_32, 1.0 / 32, 16);
  EXPECT_EQ(at_32[0].context_tokens, 1255);  // 40160 / 32
  EXPECT_EQ(at_32[0].generated_tokens, 0);   // 0.19 rounds to 0; the cap makes it 1
  EXPECT_EQ(at_32[1].context_tokens, 160);
  EXPECT_EQ(at_32[1].generated_tokens, 3);
  EXPECT_EQ(at_32[2].context_tokens, 9);
  // At 0.1 a block is 51 tokens: 10 blocks hold 510 of the 512 that rounding gives.
  scale_lengths(rows, 0.1, 51);
  EXPECT_EQ(rows[1].context_tokens, 510);
  EXPECT_EQ(rows[2].context_tokens, 30);  // no hash ids: no block bound
  EXPECT_THROW(scale_lengths(rows, 0, 1), std::invalid_argument);
}

TEST(TraceLengths, CapsToTheContextAndCountsTheCuts) {
  LengthCaps caps({1024, 128, 1024});
  const Lengths over = caps.fit(1255, 2);  // the context less the output
  EXPECT_EQ(over.prompt, 1022);
  EXPECT_EQ(over.output, 2);
  const Lengths long_output = caps.fit(300, 200);
  EXPECT_EQ(long_output.prompt, 300);
  EXPECT_EQ(long_output.output, 128);
  const Lengths both = caps.fit(1100, 500);
  EXPECT_EQ(both.output, 128);
  EXPECT_EQ(both.prompt, 896);
  const Lengths empty = caps.fit(0, 0);  // raised to 1, not a cut
  EXPECT_EQ(empty.prompt, 1);
  EXPECT_EQ(empty.output, 1);
  EXPECT_EQ(caps.prompts().requests, 4);
  EXPECT_EQ(caps.prompts().capped, 2);
  EXPECT_EQ(caps.prompts().tokens_cut, 233 + 204);
  EXPECT_EQ(caps.prompts().max_cut, 233);
  EXPECT_EQ(caps.outputs().capped, 2);
  EXPECT_EQ(caps.outputs().tokens_cut, 72 + 372);
  EXPECT_EQ(caps.summary(),
            "capped 2 of 4 prompts (437 tokens cut in all, at most 233 from one) to --max-prompt-tokens 1024 "
            "and the 1024-token context less the output, 2 of 4 outputs (444 tokens cut in all, at most 372 "
            "from one) to --max-tokens 128");
  const nlohmann::json j = caps.to_json();
  EXPECT_EQ(j["prompts"]["capped"], 2);
  EXPECT_EQ(j["outputs"]["max_cut"], 372);
  EXPECT_EQ(j["context"], 1024);

  // Without a context only the flags cap; the Azure clamp of today, now counted.
  LengthCaps flags_only({512, 64, 0});
  EXPECT_EQ(flags_only.fit(2000, 10).prompt, 512);
  EXPECT_EQ(
      flags_only.summary(),
      "capped 1 of 1 prompts (1488 tokens cut in all, at most 1488 from one) to --max-prompt-tokens 512, "
      "0 of 1 outputs to --max-tokens 64");
}

TEST(TraceLengths, TheSyntheticTraceAtOneThirtySecond) {
  if (!std::filesystem::exists(kMooncake)) GTEST_SKIP() << "no " << kMooncake;
  std::vector<TraceRecord> rows = read_mooncake_trace(kMooncake);
  const std::int64_t block = scaled_block_tokens(kMooncakeBlockTokens, 1.0 / 32);
  scale_lengths(rows, 1.0 / 32, block);
  const PrefixTokens tokens(iota_vocabulary(6000), block, 1);
  LengthCaps caps({1024, 128, 1024});
  // Two requests sharing their first k hash ids share exactly k blocks of 16 tokens, capped or not.
  // Each request against the last one before it that starts with the same block.
  std::map<std::int64_t, std::size_t> last_with_first_block;
  std::int64_t pairs = 0;
  for (std::size_t i = 0; i < rows.size() && pairs < 200; ++i) {
    const TraceRecord& y = rows[i];
    const auto [earlier, first_time] = last_with_first_block.try_emplace(y.hash_ids.front(), i);
    if (first_time) continue;
    const TraceRecord& x = rows[std::exchange(earlier->second, i)];
    const auto [mx, my] =
        std::mismatch(x.hash_ids.begin(), x.hash_ids.end(), y.hash_ids.begin(), y.hash_ids.end());
    const auto k = static_cast<std::int64_t>(mx - x.hash_ids.begin());
    if (k == 0 || mx == x.hash_ids.end() || my == y.hash_ids.end()) continue;
    const std::vector<std::int32_t> px = tokens.prompt(x.hash_ids, caps.fit(x.context_tokens, 1).prompt);
    const std::vector<std::int32_t> py = tokens.prompt(y.hash_ids, caps.fit(y.context_tokens, 1).prompt);
    if (static_cast<std::int64_t>(std::min(px.size(), py.size())) <= k * block) continue;
    const auto shared = std::mismatch(px.begin(), px.end(), py.begin(), py.end()).first - px.begin();
    EXPECT_GE(shared, k * block);
    EXPECT_LT(shared, (k + 1) * block);  // and they part in block k
    ++pairs;
  }
  EXPECT_EQ(pairs, 200);
  // 672 requests are longer than 32 x 1000 tokens: the cap names them.
  LengthCaps all({1024, 128, 1024});
  for (const TraceRecord& r : rows) all.fit(r.context_tokens, r.generated_tokens);
  EXPECT_GT(all.prompts().capped, 600);
  EXPECT_LT(all.prompts().capped, 700);
}

TEST(MooncakeTrace, WritesWhatItReadsBackWithOneSizePerHashId) {
  const std::vector<Arrival> arrivals = {
      {0.0, 40, 3, {7, 8, 9}}, {1.2345, 20, 2, {7, 11}}, {2.0, 40, 2, {7, 11, 2}}};
  std::ostringstream text;
  write_mooncake_trace(text, arrivals, std::vector<std::int64_t>{33, 16, 20},
                       std::vector<std::int64_t>{3, 1, 2}, 16);
  // Cut to the blocks the prompt covers; each last partial block a new id (above 11), once.
  EXPECT_EQ(text.str(),
            "{\"hash_ids\":[7,8,12],\"input_length\":33,\"output_length\":3,\"timestamp\":0}\n"
            "{\"hash_ids\":[7],\"input_length\":16,\"output_length\":1,\"timestamp\":1235}\n"
            "{\"hash_ids\":[7,13],\"input_length\":20,\"output_length\":2,\"timestamp\":2000}\n");
  const std::filesystem::path p = write_file("written.jsonl", text.str());
  const std::vector<TraceRecord> back = read_mooncake_trace(p, 16);
  std::filesystem::remove(p);
  ASSERT_EQ(back.size(), 3U);
  EXPECT_DOUBLE_EQ(back[1].t_s, 1.235);
  EXPECT_EQ(back[1].hash_ids, (std::vector<std::int64_t>{7}));
  std::ostringstream unused;
  EXPECT_THROW(write_mooncake_trace(unused, arrivals, std::vector<std::int64_t>{49, 16},
                                    std::vector<std::int64_t>{1, 1}, 16),
               std::invalid_argument);  // 49 tokens need 4 blocks; the request has 3
}

TEST(ServerFigures, PrefixCacheCountersOrNothing) {
  const Scrape before = parse_prometheus_text(
      "capserve_prefix_cache_query_tokens_total 100\ncapserve_prefix_cache_hit_tokens_total 40\n"
      "capserve_prefill_tokens_computed_total 60\n");
  const Scrape after = parse_prometheus_text(
      "capserve_prefix_cache_query_tokens_total 1100\ncapserve_prefix_cache_hit_tokens_total 640\n"
      "capserve_prefill_tokens_computed_total 460\ncapserve_prefix_cache_query_blocks_total 70\n"
      "capserve_prefix_cache_hit_blocks_total 40\ncapserve_prefix_cache_evictions_total 3\n");
  const ServerFigures f = server_figures(before, after);
  EXPECT_EQ(f.prefix_cache_query_tokens, 1000);
  EXPECT_EQ(f.prefix_cache_hit_tokens, 600);
  EXPECT_EQ(f.prefill_tokens_computed, 400);
  EXPECT_EQ(f.prefix_cache_query_blocks, 70);
  EXPECT_EQ(f.prefix_cache_hit_blocks, 40);
  EXPECT_EQ(f.prefix_cache_evictions, 3);
  const ServerFigures none = server_figures(Scrape{}, parse_prometheus_text("capserve_requests_running 0\n"));
  EXPECT_FALSE(none.prefix_cache_hit_tokens);
  EXPECT_FALSE(none.prefill_tokens_computed);
}

}  // namespace
}  // namespace capserve::loadgen
