#pragma once
// What every program prints for --version and capserve exports as capserve_build_info: one place, so that the
// binaries of one build can never disagree about which build they are. And what every program sets up first:
// its logs on stderr.
#include <optional>
#include <string>
#include <string_view>

#include <CLI/CLI.hpp>

namespace capserve::runtime {

struct BuildInfo {
  std::string_view version;     // the project's version (CMakeLists.txt)
  std::string_view git_commit;  // short hash of the checkout at build time, "+dirty" when it had changes
  std::string_view build_type;  // CMAKE_BUILD_TYPE
  bool cuda = false;            // built with the CUDA backend (--device cuda available where a GPU is)
};

[[nodiscard]] const BuildInfo& build_info();

// Sends spdlog's default logger, which the libraries log through, to stderr: its default writes to stdout,
// where the programs print their results (capserve-generate's token ids) for scripts to read. Call first in
// main, before anything can log.
void log_to_stderr();

// "capserve-generate 0.1.0 (git 1a2b3c4d5e6f, Release, CUDA support: no)".
[[nodiscard]] std::string version_line(std::string_view program);

// The flags every program shares: --version (prints version_line and exits 0), and every option's default in
// --help. Call right after creating the app, before adding options: CLI11 applies option defaults to options
// created afterwards.
void add_common_flags(CLI::App& app, std::string_view program);

// Parses the command line. nullopt: go on; else the program's exit code: 0 after --help or --version, 2 for a
// refused command line, after printing why on stderr when `report` (under mpirun every rank parses, rank 0
// alone reports): `--flag=` with nothing after '=', an unknown flag with the closest known one, or CLI11's
// message naming the flag.
[[nodiscard]] std::optional<int> parse_flags(CLI::App& app, int argc, char** argv, std::string_view program,
                                             bool report);

}  // namespace capserve::runtime
