#include "runtime/cli/version.h"

#include "runtime/cli/version_git.h"

namespace capserve::runtime {

const BuildInfo& build_info() {
  static const BuildInfo info{CAPSERVE_VERSION, CAPSERVE_GIT_COMMIT, CAPSERVE_BUILD_TYPE,
                              CAPSERVE_CUDA_SUPPORT != 0};
  return info;
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

}  // namespace capserve::runtime
