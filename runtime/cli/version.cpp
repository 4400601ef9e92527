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

void add_common_flags(CLI::App& app, std::string_view program) {
  app.set_version_flag("--version", version_line(program), "print the version and build, then exit");
  app.option_defaults()->always_capture_default();
}

}  // namespace capserve::runtime
