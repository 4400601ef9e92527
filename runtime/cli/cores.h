#pragma once
// How many threads the ranks of one host can run at once, and the start-up warning when --threads asks for
// more: a rank's OpenMP threads beyond the cores time-share them, and every step waits for the slowest of
// them (a 64-token chat took 10.7 s with --threads 64 on 2 cores instead of 0.2 s).
#include <sched.h>

#include <algorithm>
#include <string>
#include <thread>

namespace capserve::runtime {

// The cores this process may run on: its CPU affinity (a container's cpuset, taskset), else the machine's.
inline int available_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return static_cast<int>(std::max(1U, std::thread::hardware_concurrency()));
}

// The default --threads: the host's cores shared by its ranks, at least 1.
inline int default_threads(int local_ranks) {
  return std::max(1, available_cores() / std::max(1, local_ranks));
}

// "" when `threads` per rank times the host's `local_ranks` fit its `cores`, else the warning to print.
inline std::string oversubscription_warning(int threads, int local_ranks, int cores) {
  if (static_cast<long long>(threads) * local_ranks <= cores) return {};
  return "--threads " + std::to_string(threads) + " x " + std::to_string(local_ranks) +
         (local_ranks == 1 ? " rank" : " ranks") +
         " on this host = " + std::to_string(static_cast<long long>(threads) * local_ranks) + " threads on " +
         std::to_string(cores) + (cores == 1 ? " core" : " cores") +
         ": they time-share the cores and every step waits for the slowest; use at most " +
         std::to_string(std::max(1, cores / std::max(1, local_ranks))) + " (the default)";
}

}  // namespace capserve::runtime
