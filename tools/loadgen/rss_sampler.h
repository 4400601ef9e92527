#pragma once
// Resident memory of the server's processes over a run (the soak check: RSS flat after warm-up), read from
// /proc/<pid>/status (VmRSS) every interval on a thread of its own.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace capserve::loadgen {

// A "Key:" value of /proc/<pid>/status (VmRSS in KiB, Threads, ...); nullopt when the process is gone or the
// key is missing.
std::optional<std::int64_t> read_proc_status(int pid, std::string_view key);

inline std::optional<std::int64_t> read_vm_rss_kib(int pid) {
  return read_proc_status(pid, "VmRSS");
}

// Processes whose command name (/proc/<pid>/comm) is exactly `name`, in pid order.
std::vector<int> find_pids_by_name(const std::string& name);

// The ranks of the server listening on TCP `port`: the process called `name` that holds the listening socket
// (rank 0) and its siblings of the same name (the other ranks, children of the same mpirun). Empty when no
// such process is found (e.g. the server runs on another machine or as another user).
std::vector<int> find_server_pids(const std::string& name, int port);

struct RssSeries {
  int pid = 0;
  std::vector<double> t_s;            // since the sampler started
  std::vector<std::int64_t> kib;      // one per t_s while the process lived
  std::vector<std::int64_t> threads;  // idem: the process's thread count
  std::optional<double> exited_at_s;  // when it was first found gone
};

struct RssVerdict {
  int pid = 0;
  std::int64_t at_warmup_kib = 0;  // the first sample at or after the warm-up
  std::int64_t last_kib = 0;       // the last sample of the load period
  std::int64_t max_kib = 0;
  double growth_pct = 0;         // (last - at_warmup) / at_warmup
  double slope_kib_per_min = 0;  // least-squares over the samples after warm-up
  bool exited = false;
  bool flat = false;  // alive, and growth within the tolerance
};

class RssSampler {
 public:
  RssSampler(std::vector<int> pids, std::chrono::milliseconds interval);
  ~RssSampler();  // stops the thread
  RssSampler(const RssSampler&) = delete;
  RssSampler& operator=(const RssSampler&) = delete;

  // Stops sampling after one last sample; idempotent.
  void stop();
  // Seconds since sampling started (the time axis of the series).
  [[nodiscard]] double elapsed_s() const;
  [[nodiscard]] std::vector<RssSeries> series() const;

 private:
  void sample_once(double t_s);

  std::chrono::steady_clock::time_point start_;
  std::chrono::milliseconds interval_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::vector<RssSeries> series_;
  std::thread thread_;
};

// One verdict per series, over the samples in [warmup_s, until_s] (the load period: after it, threads exit
// and memory drops, which would hide growth): growth from the first of them to the last; flat when the
// process never exited and grew by at most tolerance_pct percent.
std::vector<RssVerdict> judge_rss(const std::vector<RssSeries>& series, double warmup_s, double until_s,
                                  double tolerance_pct);

}  // namespace capserve::loadgen
