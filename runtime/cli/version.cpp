#include "runtime/cli/version.h"

#include <cstdio>
#include <memory>
#include <span>

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "runtime/cli/flag_checks.h"
#include "runtime/cli/version_git.h"

namespace capserve::runtime {

const BuildInfo& build_info() {
  static const BuildInfo info{CAPSERVE_VERSION, CAPSERVE_GIT_COMMIT, CAPSERVE_BUILD_TYPE,
                              CAPSERVE_CUDA_SUPPORT != 0};
  return info;
}

void log_to_stderr() {
  spdlog::set_default_logger(
      std::make_shared<spdlog::logger>("", std::make_shared<spdlog::sinks::stderr_color_sink_mt>()));
}

std::string version_line(std::string_view program) {
  const BuildInfo& b = build_info();
  return std::string(program) + " " + std::string(b.version) + " (git " + std::string(b.git_commit) + ", " +
         std::string(b.build_type) + ", CUDA support: " + (b.cuda ? "yes" : "no") + ")";
}

namespace {

// Defaults that say nothing are left out of --help: none for a required option (it has to be given), none for
// an empty list.
void drop_empty_defaults(CLI::App& app) {
  for (CLI::Option* opt : app.get_options()) {
    if (opt->get_required() || opt->get_default_str() == "[]") opt->default_str("");
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) drop_empty_defaults(*sub);
}

}  // namespace

void add_common_flags(CLI::App& app, std::string_view program) {
  app.set_version_flag("--version", version_line(program), "print the version and build, then exit");
  app.option_defaults()->always_capture_default();
  // Before the arguments are read, so before --help prints; every option exists by then.
  app.preparse_callback([&app](std::size_t) { drop_empty_defaults(app); });
}

std::optional<int> parse_flags(CLI::App& app, int argc, char** argv, std::string_view program, bool report) {
  const std::span<char* const> args(argv + 1, static_cast<std::size_t>(argc - 1));
  const auto refuse = [&](std::string_view why) {
    if (report)
      std::fprintf(stderr, "%.*s: %.*s\n", static_cast<int>(program.size()), program.data(),
                   static_cast<int>(why.size()), why.data());
    return 2;
  };
  if (const auto bad = flag_with_empty_value(args)) return refuse(std::string(*bad) + " has an empty value");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // A misspelt flag shows as an unexpected argument, or as a required flag missing (`--modle`).
    if (dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr ||
        dynamic_cast<const CLI::RequiredError*>(&e) != nullptr) {
      if (const auto unknown = unknown_flag(app, args)) return refuse(*unknown);
    }
    const int code = report ? app.exit(e) : e.get_exit_code();
    return code == 0 ? 0 : 2;
  }
  return std::nullopt;
}

}  // namespace capserve::runtime
