// The command-line helpers every program shares (runtime/cli): a misspelt flag named with the closest known
// one, enum flags by name in help and errors, and the warning for more threads than cores.
#include "runtime/cli/cores.h"
#include "runtime/cli/flag_checks.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace capserve::runtime {
namespace {

enum class Policy { none, drop, reroute };

struct Flags {
  CLI::App app{"test"};
  int max_running = 4;
  std::string model;
  Policy policy = Policy::drop;

  Flags() {
    app.add_option("--max-running", max_running, "sequences at once");
    app.add_option("--model", model, "checkpoint");
    add_enum_option(app, "--policy", policy, "what to do",
                    {{"none", Policy::none}, {"drop", Policy::drop}, {"reroute", Policy::reroute}});
  }

  std::optional<std::string> unknown(std::vector<std::string> args) {
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    return unknown_flag(app, argv);
  }
};

TEST(FlagChecks, UnknownFlagNamesTheClosest) {
  Flags f;
  EXPECT_EQ(f.unknown({"--max-runing", "4"}), "unknown flag --max-runing (did you mean --max-running?)");
  EXPECT_EQ(f.unknown({"--modle", "x"}), "unknown flag --modle (did you mean --model?)");
  EXPECT_EQ(f.unknown({"--polcy=drop"}), "unknown flag --polcy (did you mean --policy?)");
  EXPECT_EQ(f.unknown({"--entirely-else"}), "unknown flag --entirely-else");
  EXPECT_EQ(f.unknown({"--model", "x", "--", "--not-a-flag"}), std::nullopt);
  EXPECT_EQ(f.unknown({"--help"}), std::nullopt);
}

TEST(FlagChecks, EnumOptionTakesNamesAndListsThem) {
  Flags f;
  const std::string help = f.app.help();
  EXPECT_NE(help.find("what to do; one of: none, drop, reroute"), std::string::npos) << help;
  EXPECT_NE(help.find("NAME=drop"), std::string::npos) << help;
  EXPECT_EQ(help.find("->"), std::string::npos) << help;
  f.app.parse(std::vector<std::string>{"reroute", "--policy"});  // CLI11 takes the arguments in reverse
  EXPECT_EQ(f.policy, Policy::reroute);
  try {
    f.app.parse(std::vector<std::string>{"2", "--policy"});  // a name, not the enum's number
    FAIL() << "accepted a number";
  } catch (const CLI::ValidationError& e) {
    EXPECT_EQ(std::string(e.what()), "--policy: 2 is not one of: none, drop, reroute");
  }
}

TEST(FlagChecks, MoreThreadsThanCoresIsAWarning) {
  EXPECT_EQ(oversubscription_warning(1, 2, 2), "");
  EXPECT_EQ(oversubscription_warning(8, 2, 16), "");
  EXPECT_EQ(
      oversubscription_warning(64, 1, 2),
      "--threads 64 x 1 rank on this host = 64 threads on 2 cores: they time-share the cores and every step "
      "waits for the slowest; use at most 2 (the default)");
  EXPECT_NE(oversubscription_warning(2, 2, 2).find("= 4 threads on 2 cores"), std::string::npos);
  EXPECT_GE(available_cores(), 1);
  EXPECT_GE(default_threads(64), 1);
}

}  // namespace
}  // namespace capserve::runtime
