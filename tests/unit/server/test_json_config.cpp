// capserve --config: a JSON file of long flag names. Unknown keys and values of the wrong kind are refused
// with the key named; good files set the flags, and the command line overrides them.
#include "server/json_config.h"

#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace capserve::server {
namespace {

struct Flags {
  std::int64_t max_running = 64;
  std::uint32_t seed = 0;
  double factor = 1;
  std::string selector = "fcfs";
  std::vector<std::string> stops;
  bool per_expert = false;
};

class JsonConfigTest : public ::testing::Test {
 protected:
  Flags flags_;
  CLI::App app_{"test"};
  std::filesystem::path file_ = std::filesystem::temp_directory_path() /
                                ("capserve_json_config_" + std::to_string(::getpid()) + ".json");

  void SetUp() override {
    app_.add_option("--max-running", flags_.max_running);
    app_.add_option("--seed", flags_.seed);
    app_.add_option("--factor", flags_.factor);
    app_.add_option("--batch-selector", flags_.selector)->check(CLI::IsMember({"fcfs", "greedy"}));
    app_.add_option("--stop", flags_.stops);
    app_.add_flag("--metrics-per-expert", flags_.per_expert);
    app_.set_config("--config");
    app_.config_formatter(std::make_shared<JsonConfig>(app_));
  }
  void TearDown() override { std::filesystem::remove(file_); }

  // Parses `--config FILE` (holding `json`) plus `extra`; the error message, or "" when it parsed.
  std::string parse(const std::string& json, std::vector<std::string> extra = {}) {
    std::ofstream(file_) << json;
    std::vector<std::string> args{"test", "--config", file_.string()};
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<const char*> argv;
    for (const auto& a : args) argv.push_back(a.c_str());
    try {
      app_.parse(static_cast<int>(argv.size()), argv.data());
    } catch (const CLI::ParseError& e) {
      return e.what();
    }
    return {};
  }
};

TEST_F(JsonConfigTest, SetsFlagsAndTheCommandLineWins) {
  EXPECT_EQ(parse(R"({"max-running": 8, "factor": "1.5", "batch-selector": "greedy", "stop": ["a", "b"],
                      "metrics-per-expert": true, "seed": 3})",
                  {"--seed", "4"}),
            "");
  EXPECT_EQ(flags_.max_running, 8);
  EXPECT_EQ(flags_.factor, 1.5);
  EXPECT_EQ(flags_.selector, "greedy");
  EXPECT_EQ(flags_.stops, (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(flags_.per_expert);
  EXPECT_EQ(flags_.seed, 4U);
}

TEST_F(JsonConfigTest, UnknownKeyIsRefusedByName) {
  const std::string why = parse(R"({"max-runing": 8})");
  EXPECT_NE(why.find("unknown key \"max-runing\""), std::string::npos) << why;
  EXPECT_NE(why.find("did you mean \"max-running\""), std::string::npos) << why;
  EXPECT_EQ(flags_.max_running, 64);
  const std::string far = parse(R"({"colour": "blue"})");
  EXPECT_NE(far.find("unknown key \"colour\""), std::string::npos) << far;
  EXPECT_EQ(far.find("did you mean"), std::string::npos) << far;
  EXPECT_NE(parse(R"({"config": "other.json"})").find("unknown key \"config\""), std::string::npos);
}

TEST_F(JsonConfigTest, WrongTypesAreRefusedByName) {
  const std::vector<std::pair<std::string, std::string>> cases{
      {R"({"max-running": "eight"})", "\"max-running\" must be an integer"},
      {R"({"max-running": 8.5})", "\"max-running\" must be an integer"},
      {R"({"max-running": true})", "\"max-running\" takes a string or a number"},
      {R"({"max-running": [1, 2]})", "\"max-running\" takes one value, not an array"},
      {R"({"max-running": null})", "\"max-running\" takes a string or a number"},
      {R"({"seed": -1})", "\"seed\" must be a non-negative integer"},
      {R"({"factor": "fast"})", "\"factor\" must be a number"},
      {R"({"metrics-per-expert": 1})", "\"metrics-per-expert\" is a flag: true or false"},
      {R"({"stop": [{"x": 1}]})", "\"stop\" takes a string or a number"},
      {R"([1, 2])", "must hold one JSON object"},
      {R"({"max-running": )", "not valid JSON"},
  };
  for (const auto& [json, expected] : cases) {
    const std::string why = parse(json);
    EXPECT_NE(why.find(expected), std::string::npos) << json << " -> " << why;
  }
}

}  // namespace
}  // namespace capserve::server
