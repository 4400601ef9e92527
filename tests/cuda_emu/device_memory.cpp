// CUDA emulation: device and page-locked host memory on host pages, with the faults a device would take.
// Every allocation gets its own mapping between two inaccessible guard pages: its end against the upper one
// (cudaMalloc's 256-byte alignment leaves at most 255 bytes of slack before it), so an overrun faults at
// once; an underrun faults once it passes the rest of the first page (less than 4 KiB of slack below the
// start). Freed memory stays mapped inaccessible for a while, so a kernel reading it faults; the fault
// handler names the allocation before the process dies.
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iterator>
#include <map>
#include <mutex>

#include "emu_state.h"

namespace capserve::cuda_emu::detail {
namespace {

constexpr std::size_t kPage = 4096;
constexpr std::size_t kAlign = 256;
// Freed mappings kept inaccessible before their address space is given back.
constexpr std::size_t kQuarantineBytes = std::size_t{8} << 30;

std::size_t round_up(std::size_t n, std::size_t to) {
  return (n + to - 1) / to * to;
}

struct Allocation {
  std::uintptr_t begin = 0;
  std::size_t bytes = 0;
  std::uintptr_t map_base = 0;
  std::size_t map_bytes = 0;
  MemoryKind kind = MemoryKind::none;
  int device = 0;
};

struct Registry {
  std::mutex mutex;
  std::map<std::uintptr_t, Allocation> live;   // by begin
  std::map<std::uintptr_t, Allocation> freed;  // by map_base
  std::deque<std::uintptr_t> freed_order;
  std::size_t freed_bytes = 0;
  std::map<int, std::size_t> in_use;  // device -> bytes of live cudaMalloc allocations
};

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: frees may come from static destructors
  return *r;
}

// The allocation whose mapping (guard pages included) contains p, in `m` (keyed by begin or map_base), or
// null. Keyed by begin, p in the lower guard page sorts before its allocation's key, so both neighbours are
// candidates.
const Allocation* containing(const std::map<std::uintptr_t, Allocation>& m, std::uintptr_t p) {
  const auto holds = [p](const Allocation& a) { return p >= a.map_base && p < a.map_base + a.map_bytes; };
  const auto next = m.upper_bound(p);
  if (next != m.end() && holds(next->second)) return &next->second;
  if (next == m.begin()) return nullptr;
  const Allocation& before = std::prev(next)->second;
  return holds(before) ? &before : nullptr;
}

void write_stderr(const char* text) {
  const ssize_t ignored = ::write(STDERR_FILENO, text, std::strlen(text));
  (void)ignored;
}

// A fault on an emulated allocation: say which, then let the default action end the process.
void on_fault(int sig, siginfo_t* info, void*) {
  const auto p = reinterpret_cast<std::uintptr_t>(info->si_addr);
  Registry& r = registry();
  char message[256];
  message[0] = '\0';
  if (const Allocation* a = containing(r.freed, p)) {
    std::snprintf(message, sizeof message,
                  "CUDA emulation: illegal address: access to device memory freed by cudaFree (allocation of "
                  "%zu bytes at %p, offset %td)\n",
                  a->bytes, reinterpret_cast<void*>(a->begin),
                  static_cast<std::ptrdiff_t>(p) - static_cast<std::ptrdiff_t>(a->begin));
  } else if (const Allocation* b = containing(r.live, p)) {
    if (p < b->begin) {
      std::snprintf(
          message, sizeof message,
          "CUDA emulation: illegal address: access %td bytes before the start of a %zu-byte allocation "
          "at %p\n",
          static_cast<std::ptrdiff_t>(b->begin - p), b->bytes, reinterpret_cast<void*>(b->begin));
    } else {
      std::snprintf(
          message, sizeof message,
          "CUDA emulation: illegal address: access %td bytes past the end of a %zu-byte allocation at "
          "%p\n",
          static_cast<std::ptrdiff_t>(p - (b->begin + b->bytes)), b->bytes,
          reinterpret_cast<void*>(b->begin));
    }
  }
  write_stderr(message);
  signal(sig, SIG_DFL);  // returning re-runs the access, which now takes the default action
}

void install_fault_handler() {
  static const bool installed = [] {
    struct sigaction action {};
    action.sa_sigaction = on_fault;
    action.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    sigaction(SIGSEGV, &action, nullptr);
    return true;
  }();
  (void)installed;
}

void* map_allocation(std::size_t bytes, MemoryKind kind, int device) {
  install_fault_handler();
  const std::size_t data = round_up(bytes == 0 ? 1 : bytes, kAlign);
  const std::size_t accessible = round_up(data, kPage);
  const std::size_t total = kPage + accessible + kPage;
  void* base = mmap(nullptr, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) return nullptr;
  const auto map_base = reinterpret_cast<std::uintptr_t>(base);
  if (mprotect(reinterpret_cast<void*>(map_base + kPage), accessible, PROT_READ | PROT_WRITE) != 0) {
    munmap(base, total);
    return nullptr;
  }
  const std::uintptr_t begin = map_base + kPage + accessible - data;
  Registry& r = registry();
  const std::lock_guard lock(r.mutex);
  r.live[begin] = Allocation{begin, bytes, map_base, total, kind, device};
  return reinterpret_cast<void*>(begin);
}

}  // namespace

std::size_t device_memory_total() {
  static const std::size_t total = [] {
    const char* env = std::getenv("CAPSERVE_CUDA_EMU_DEVICE_MEMORY_MIB");
    return env != nullptr ? static_cast<std::size_t>(std::atoll(env)) << 20 : std::size_t{80} << 30;
  }();
  return total;
}

std::size_t device_memory_in_use(int device) {
  Registry& r = registry();
  const std::lock_guard lock(r.mutex);
  return r.in_use[device];
}

void* allocate_device(std::size_t bytes, int device) {
  {
    Registry& r = registry();
    const std::lock_guard lock(r.mutex);
    if (r.in_use[device] + bytes > device_memory_total()) return nullptr;
    r.in_use[device] += bytes;
  }
  void* p = map_allocation(bytes, MemoryKind::device, device);
  if (p == nullptr) {
    Registry& r = registry();
    const std::lock_guard lock(r.mutex);
    r.in_use[device] -= bytes;
  }
  return p;
}

void* allocate_pinned(std::size_t bytes) {
  return map_allocation(bytes, MemoryKind::pinned_host, 0);
}

bool release(void* p, MemoryKind kind) {
  Registry& r = registry();
  const std::lock_guard lock(r.mutex);
  const auto it = r.live.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == r.live.end() || it->second.kind != kind) return false;
  const Allocation a = it->second;
  r.live.erase(it);
  if (kind == MemoryKind::device) r.in_use[a.device] -= a.bytes;
  if (kind == MemoryKind::pinned_host) {
    munmap(reinterpret_cast<void*>(a.map_base), a.map_bytes);
    return true;
  }
  // Keep the range reserved and inaccessible (its pages given back), so later reads fault.
  mprotect(reinterpret_cast<void*>(a.map_base), a.map_bytes, PROT_NONE);
  madvise(reinterpret_cast<void*>(a.map_base), a.map_bytes, MADV_DONTNEED);
  r.freed[a.map_base] = a;
  r.freed_order.push_back(a.map_base);
  r.freed_bytes += a.map_bytes;
  while (r.freed_bytes > kQuarantineBytes) {
    const auto old = r.freed.find(r.freed_order.front());
    r.freed_order.pop_front();
    r.freed_bytes -= old->second.map_bytes;
    munmap(reinterpret_cast<void*>(old->second.map_base), old->second.map_bytes);
    r.freed.erase(old);
  }
  return true;
}

MemoryRange find_memory(const void* p) {
  const auto u = reinterpret_cast<std::uintptr_t>(p);
  Registry& r = registry();
  const std::lock_guard lock(r.mutex);
  // One past the end still belongs to an allocation (an empty view at its end).
  auto it = r.live.upper_bound(u);
  if (it != r.live.begin()) {
    --it;
    const Allocation& a = it->second;
    if (u <= a.begin + a.bytes) return {a.kind, a.begin, a.bytes, a.device};
  }
  if (const Allocation* f = containing(r.freed, u))
    return {MemoryKind::freed_device, f->begin, f->bytes, f->device};
  return {};
}

std::string check_range(const void* p, std::size_t bytes, MemoryKind kind, const char* role) {
  const MemoryRange m = find_memory(p);
  const std::string what = std::string(role) + " " + std::to_string(reinterpret_cast<std::uintptr_t>(p));
  const char* wanted = kind == MemoryKind::device ? "device memory (cudaMalloc)" : "page-locked host memory";
  if (m.kind == MemoryKind::freed_device)
    return what + " points into device memory already freed by cudaFree (" + std::to_string(m.bytes) +
           "-byte allocation)";
  if (m.kind != kind) return what + " is not " + wanted;
  const auto offset = reinterpret_cast<std::uintptr_t>(p) - m.begin;
  if (offset + bytes > m.bytes)
    return what + ": " + std::to_string(bytes) + " bytes at offset " + std::to_string(offset) +
           " overrun its " + std::to_string(m.bytes) + "-byte allocation";
  return {};
}

std::string check_device_pointer(const void* p) {
  if (p == nullptr) return {};
  const MemoryRange m = find_memory(p);
  switch (m.kind) {
    case MemoryKind::device:
    case MemoryKind::pinned_host:
      return {};
    case MemoryKind::freed_device:
      return "points into device memory already freed by cudaFree (" + std::to_string(m.bytes) +
             "-byte allocation)";
    case MemoryKind::none:
      break;
  }
  return "points to memory that neither cudaMalloc nor cudaMallocHost returned (host memory: a device would "
         "fault)";
}

}  // namespace capserve::cuda_emu::detail
