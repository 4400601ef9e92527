// capserve's log on stderr: JSON lines that stay valid JSON whatever the message holds, access lines with
// every field, text without colour codes when stderr is not a terminal (here: a file).
#include "server/logging.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace capserve::server {
namespace {

// Runs `body` with stderr going to a temporary file; returns the lines written.
template <typename Body>
std::vector<std::string> capture_stderr(Body body) {
  char path[] = "/tmp/capserve_logging_XXXXXX";
  const int fd = ::mkstemp(path);
  EXPECT_GE(fd, 0);
  std::fflush(stderr);
  const int saved = ::dup(STDERR_FILENO);
  ::dup2(fd, STDERR_FILENO);
  body();
  spdlog::default_logger()->flush();
  if (auto access = spdlog::get("access")) access->flush();
  std::fflush(stderr);
  ::dup2(saved, STDERR_FILENO);
  ::close(saved);
  ::close(fd);
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  std::remove(path);
  return lines;
}

AccessRecord record() {
  return {.request_id = "req-\"1\"",
          .peer = "ipv4:127.0.0.1:5555",
          .prompt_tokens = 12,
          .completion_tokens = 8,
          .finish_reason = finish_reason(Terminal::ok_length),
          .queue_s = 0.25,
          .ttft_s = std::nullopt,
          .e2e_s = 1.5,
          .dropped = 3,
          .rerouted = 4,
          .drafted = std::nullopt,
          .accepted = std::nullopt};
}

TEST(Logging, JsonLinesAreValidJsonWithTheAccessFields) {
  const auto lines = capture_stderr([] {
    configure_logging("info", LogFormat::json, 3);
    spdlog::info("a \"quoted\" message\nwith a newline and \x01 a control byte and \xff bad UTF-8");
    spdlog::debug("below the level: not written");
    log_access(record());
  });
  ASSERT_EQ(lines.size(), 2U);
  const auto message = nlohmann::json::parse(lines[0]);
  EXPECT_EQ(message["level"], "info");
  EXPECT_EQ(message["logger"], "capserve");
  EXPECT_EQ(message["rank"], 3);
  EXPECT_NE(message["message"].get<std::string>().find("\"quoted\" message\nwith"), std::string::npos);
  EXPECT_TRUE(message["time"].get<std::string>().ends_with("Z"));
  const auto access = nlohmann::json::parse(lines[1]);
  EXPECT_EQ(access["logger"], "access");
  EXPECT_EQ(access["request_id"], "req-\"1\"");
  EXPECT_EQ(access["peer"], "ipv4:127.0.0.1:5555");
  EXPECT_EQ(access["prompt_tokens"], 12);
  EXPECT_EQ(access["completion_tokens"], 8);
  EXPECT_EQ(access["finish_reason"], "length");
  EXPECT_DOUBLE_EQ(access["queue_s"].get<double>(), 0.25);
  EXPECT_TRUE(access["ttft_s"].is_null());
  EXPECT_DOUBLE_EQ(access["e2e_s"].get<double>(), 1.5);
  EXPECT_EQ(access["dropped"], 3);
  EXPECT_EQ(access["rerouted"], 4);
}

TEST(Logging, TextHasNoColourOffATerminal) {
  const auto lines = capture_stderr([] {
    configure_logging("warn", LogFormat::text, 0);
    spdlog::info("not at warn");
    spdlog::error("an error");
    configure_logging("info", LogFormat::text, 0);
    log_access(record());
  });
  ASSERT_EQ(lines.size(), 2U);
  EXPECT_NE(lines[0].find("] [rank 0] [error] an error"), std::string::npos) << lines[0];
  EXPECT_EQ(lines[1].substr(lines[1].find("] request ")),
            "] request id=req-\"1\" peer=ipv4:127.0.0.1:5555 prompt_tokens=12 completion_tokens=8 "
            "finish_reason=length queue_s=0.250000 ttft_s=- e2e_s=1.500000 dropped=3 rerouted=4");
  for (const auto& line : lines) EXPECT_EQ(line.find('\x1b'), std::string::npos) << line;
}

// With speculative decoding the access line ends with the request's drafts verified and kept, in both
// formats.
TEST(Logging, TheAccessLineCountsDraftsWhenPresent) {
  AccessRecord speculative = record();
  speculative.drafted = 30;
  speculative.accepted = 17;
  const auto lines = capture_stderr([&] {
    configure_logging("info", LogFormat::text, 0);
    log_access(speculative);
    configure_logging("info", LogFormat::json, 0);
    log_access(speculative);
    log_access(record());
  });
  ASSERT_EQ(lines.size(), 3U);
  EXPECT_TRUE(lines[0].ends_with(" dropped=3 rerouted=4 drafted=30 accepted=17")) << lines[0];
  const auto access = nlohmann::json::parse(lines[1]);
  EXPECT_EQ(access["drafted"], 30);
  EXPECT_EQ(access["accepted"], 17);
  EXPECT_EQ(access["rerouted"], 4);
  EXPECT_FALSE(nlohmann::json::parse(lines[2]).contains("drafted"));
}

TEST(Logging, UnknownLevelIsRefused) {
  EXPECT_THROW(configure_logging("verbose", LogFormat::text, 0), std::invalid_argument);
}

TEST(Logging, FinishReasonsNameEveryTerminal) {
  EXPECT_EQ(finish_reason(Terminal::ok_stop), "stop");
  EXPECT_EQ(finish_reason(Terminal::cancelled), "cancelled");
  EXPECT_EQ(finish_reason(Terminal::deadline_exceeded), "deadline_exceeded");
  EXPECT_EQ(finish_reason(Terminal::unavailable), "unavailable");
  EXPECT_EQ(finish_reason(Terminal::internal), "internal");
  EXPECT_EQ(finish_reason(Terminal::invalid_argument), "invalid_argument");
}

}  // namespace
}  // namespace capserve::server
