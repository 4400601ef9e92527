#include "tools/loadgen/rss_sampler.h"

#include <algorithm>
#include <charconv>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string_view>

namespace capserve::loadgen {

std::optional<std::int64_t> read_proc_status(int pid, std::string_view key) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (!line.starts_with(key) || line.size() <= key.size() || line[key.size()] != ':') continue;
    std::string_view v(line);
    v.remove_prefix(key.size() + 1);
    while (!v.empty() && (v.front() == ' ' || v.front() == '\t')) v.remove_prefix(1);
    std::int64_t value = 0;
    const auto [end, error] = std::from_chars(v.data(), v.data() + v.size(), value);
    if (error != std::errc()) return std::nullopt;
    return value;
  }
  return std::nullopt;
}

std::vector<int> find_pids_by_name(const std::string& name) {
  std::vector<int> pids;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string stem = entry.path().filename().string();
    int pid = 0;
    const auto [end, error] = std::from_chars(stem.data(), stem.data() + stem.size(), pid);
    if (error != std::errc() || end != stem.data() + stem.size()) continue;
    std::ifstream comm(entry.path() / "comm");
    std::string command;
    if (std::getline(comm, command) && command == name) pids.push_back(pid);
  }
  std::sort(pids.begin(), pids.end());
  return pids;
}

namespace {

// Inodes of the sockets listening on `port` (IPv4 and IPv6).
std::vector<std::string> listening_inodes(int port) {
  std::vector<std::string> inodes;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >> inode;
      const std::size_t colon = local.rfind(':');
      if (colon == std::string::npos || state != "0A") continue;  // 0A: LISTEN
      if (std::stoi(local.substr(colon + 1), nullptr, 16) == port) inodes.push_back("socket:[" + inode + "]");
    }
  }
  return inodes;
}

bool holds_any(int pid, const std::vector<std::string>& targets) {
  std::error_code ec;
  for (const auto& fd : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec)) {
    const std::filesystem::path link = std::filesystem::read_symlink(fd.path(), ec);
    if (!ec && std::find(targets.begin(), targets.end(), link.string()) != targets.end()) return true;
  }
  return false;
}

int parent_of(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.starts_with("PPid:")) return std::stoi(line.substr(5));
  }
  return -1;
}

}  // namespace

std::vector<int> find_server_pids(const std::string& name, int port) {
  const std::vector<int> candidates = find_pids_by_name(name);
  const std::vector<std::string> inodes = listening_inodes(port);
  if (inodes.empty()) return {};
  for (const int pid : candidates) {
    if (!holds_any(pid, inodes)) continue;
    const int parent = parent_of(pid);
    std::vector<int> ranks;
    for (const int other : candidates) {
      if (other == pid || parent_of(other) == parent) ranks.push_back(other);
    }
    return ranks;
  }
  return {};
}

RssSampler::RssSampler(std::vector<int> pids, std::chrono::milliseconds interval)
    : start_(std::chrono::steady_clock::now()), interval_(interval) {
  for (const int pid : pids) series_.push_back({pid, {}, {}, {}, std::nullopt});
  sample_once(0);
  thread_ = std::thread([this] {
    std::unique_lock lock(mutex_);
    for (;;) {
      if (wake_.wait_for(lock, interval_, [this] { return stopping_; })) return;
      lock.unlock();
      sample_once(elapsed_s());
      lock.lock();
    }
  });
}

RssSampler::~RssSampler() {
  stop();
}

void RssSampler::stop() {
  {
    std::lock_guard lock(mutex_);
    if (stopping_) return;
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
  sample_once(elapsed_s());
}

void RssSampler::sample_once(double t_s) {
  std::lock_guard lock(mutex_);
  for (RssSeries& s : series_) {
    if (s.exited_at_s) continue;
    if (const std::optional<std::int64_t> kib = read_vm_rss_kib(s.pid)) {
      s.t_s.push_back(t_s);
      s.kib.push_back(*kib);
      s.threads.push_back(read_proc_status(s.pid, "Threads").value_or(0));
    } else {
      s.exited_at_s = t_s;
    }
  }
}

double RssSampler::elapsed_s() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

std::vector<RssSeries> RssSampler::series() const {
  std::lock_guard lock(mutex_);
  return series_;
}

std::vector<RssVerdict> judge_rss(const std::vector<RssSeries>& series, double warmup_s, double until_s,
                                  double tolerance_pct) {
  std::vector<RssVerdict> out;
  for (const RssSeries& s : series) {
    RssVerdict v;
    v.pid = s.pid;
    v.exited = s.exited_at_s.has_value();
    // The samples of the load period after the warm-up: [from, to).
    std::size_t to = s.t_s.size();
    while (to > 1 && s.t_s[to - 1] > until_s) --to;
    std::size_t from = 0;
    while (from + 1 < to && s.t_s[from] < warmup_s) ++from;
    if (to == 0) {
      out.push_back(v);
      continue;
    }
    v.at_warmup_kib = s.kib[from];
    v.last_kib = s.kib[to - 1];
    v.max_kib = *std::max_element(s.kib.begin() + static_cast<std::ptrdiff_t>(from),
                                  s.kib.begin() + static_cast<std::ptrdiff_t>(to));
    v.growth_pct = v.at_warmup_kib > 0 ? 100.0 * static_cast<double>(v.last_kib - v.at_warmup_kib) /
                                             static_cast<double>(v.at_warmup_kib)
                                       : 0;
    // Least-squares slope of kib over time.
    const auto n = static_cast<double>(to - from);
    double st = 0, sk = 0, stt = 0, stk = 0;
    for (std::size_t i = from; i < to; ++i) {
      const double t = s.t_s[i] / 60.0;
      const auto k = static_cast<double>(s.kib[i]);
      st += t;
      sk += k;
      stt += t * t;
      stk += t * k;
    }
    const double denom = n * stt - st * st;
    v.slope_kib_per_min = n > 1 && denom > 0 ? (n * stk - st * sk) / denom : 0;
    v.flat = !v.exited && v.growth_pct <= tolerance_pct;
    out.push_back(v);
  }
  return out;
}

}  // namespace capserve::loadgen
