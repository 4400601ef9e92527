// CUDA emulation: kernel launches. Blocks run one after another; the threads of a block are fibers.
//
// A "worker" fiber starts threads in schedule order and runs each to its end; only when a thread must wait
// (a barrier or warp collective the others have not reached) does the worker park with it, and the scheduler
// starts a new worker for the threads not yet started. The last thread to arrive at a barrier releases the
// others and carries on without switching. So a kernel without barriers costs one fiber per block, and one
// with barriers two switches per waiting thread and barrier.
//
// Under ThreadSanitizer (a program built with -fsanitize=thread) every CUDA thread also has its own TSan
// fiber; switches between them carry no ordering, and only what CUDA orders is published: the launch (and
// each block) before its threads, the threads before the launch's end, __syncthreads, warp collectives. So
// an access to memory another thread of the block wrote without a barrier between is a TSan report.
#include <sys/mman.h>
#include <boost/context/fiber.hpp>
#include <boost/context/stack_context.hpp>

#include <algorithm>
#include <bit>
#include <exception>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "capserve_cuda_emu.h"
#include "emu_state.h"

namespace capserve::cuda_emu::detail {

thread_local const ThreadIndex* current_thread = nullptr;

namespace {

namespace bc = boost::context;

// The TSan fiber interface (<sanitizer/tsan_interface.h>), declared weak: present only when the program is
// built with -fsanitize=thread, so this one library serves both builds.
extern "C" {
__attribute__((weak)) void* __tsan_get_current_fiber();
__attribute__((weak)) void* __tsan_create_fiber(unsigned flags);
__attribute__((weak)) void __tsan_destroy_fiber(void* fiber);
__attribute__((weak)) void __tsan_switch_to_fiber(void* fiber, unsigned flags);
__attribute__((weak)) void __tsan_acquire(void* address);
__attribute__((weak)) void __tsan_release(void* address);
__attribute__((weak)) void AnnotateIgnoreReadsBegin(const char* file, int line);
__attribute__((weak)) void AnnotateIgnoreReadsEnd(const char* file, int line);
__attribute__((weak)) void AnnotateIgnoreWritesBegin(const char* file, int line);
__attribute__((weak)) void AnnotateIgnoreWritesEnd(const char* file, int line);
}

namespace race {

constexpr unsigned kNoSync = 1;  // __tsan_switch_to_fiber_no_sync

bool enabled() {
  return __tsan_create_fiber != nullptr;
}
void switch_to(void* fiber) {
  if (fiber != nullptr) __tsan_switch_to_fiber(fiber, kNoSync);
}
// What the running thread did happens before what any later acquire of `sync` does.
void release(void* sync) {
  if (enabled()) __tsan_release(sync);
}
void acquire(void* sync) {
  if (enabled()) __tsan_acquire(sync);
}

// The scheduler's own bookkeeping, shared by the threads of a block, is no race (TSan sees its memcpy calls).
struct IgnoreAccesses {
  IgnoreAccesses() {
    if (enabled()) {
      AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
      AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
    }
  }
  ~IgnoreAccesses() {
    if (enabled()) {
      AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
      AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
    }
  }
  IgnoreAccesses(const IgnoreAccesses&) = delete;
  IgnoreAccesses& operator=(const IgnoreAccesses&) = delete;
};

struct FiberDeleter {
  void operator()(void* fiber) const noexcept { __tsan_destroy_fiber(fiber); }
};
// A CUDA thread's TSan fiber; null without TSan.
using Fiber = std::unique_ptr<void, FiberDeleter>;
Fiber make_fiber() {
  return Fiber(enabled() ? __tsan_create_fiber(0) : nullptr);
}

}  // namespace race

constexpr int kWarp = 32;
constexpr std::size_t kStackBytes = 64 * 1024;
constexpr std::size_t kGuardBytes = 4096;

// Fiber stacks, reused: mmap'ed once per host thread, with a guard page below each.
class StackPool {
 public:
  StackPool() = default;
  StackPool(const StackPool&) = delete;
  StackPool& operator=(const StackPool&) = delete;
  ~StackPool() {
    for (const bc::stack_context& s : free_) unmap(s);
  }

  bc::stack_context take() {
    if (!free_.empty()) {
      const bc::stack_context s = free_.back();
      free_.pop_back();
      return s;
    }
    void* base = mmap(nullptr, kStackBytes + kGuardBytes, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) throw std::bad_alloc();
    mprotect(base, kGuardBytes, PROT_NONE);
    bc::stack_context s;
    s.size = kStackBytes;
    s.sp = static_cast<char*>(base) + kGuardBytes + kStackBytes;
    return s;
  }
  void give(const bc::stack_context& s) noexcept {
    // Under TSan a stack is mapped afresh for every CUDA thread: one thread's stack accesses must not look
    // like another's, unordered, at the same addresses (munmap clears TSan's record of them).
    if (race::enabled()) {
      unmap(s);
      return;
    }
    free_.push_back(s);
  }

 private:
  static void unmap(const bc::stack_context& s) noexcept {
    munmap(static_cast<char*>(s.sp) - s.size - kGuardBytes, s.size + kGuardBytes);
  }

  std::vector<bc::stack_context> free_;
};

thread_local StackPool stack_pool;

// Boost.Context's StackAllocator over the pool.
struct PooledStack {
  bc::stack_context allocate() { return stack_pool.take(); }
  void deallocate(bc::stack_context& s) noexcept { stack_pool.give(s); }
};

enum class State : std::uint8_t { unstarted, running, ready, at_barrier, at_warp, done };

struct EmuThread {
  ThreadIndex index{};
  int linear = 0;
  State state = State::unstarted;
  bc::fiber parked;                // while waiting
  bc::fiber* scheduler = nullptr;  // in the worker running this thread
  // The collective or barrier it waits in.
  Collective op = Collective::syncwarp;
  unsigned mask = 0;
  std::uint64_t value = 0;
  int arg = 0;
  int width = kWarp;
  std::uint64_t result = 0;
  BlockSync sync = BlockSync::plain;
  int predicate = 0;
  void* race_fiber = nullptr;  // its TSan fiber, owned by the Block
};

const char* collective_name(Collective c) {
  switch (c) {
    case Collective::syncwarp:
      return "__syncwarp";
    case Collective::shfl_idx:
      return "__shfl_sync";
    case Collective::shfl_up:
      return "__shfl_up_sync";
    case Collective::shfl_down:
      return "__shfl_down_sync";
    case Collective::shfl_xor:
      return "__shfl_xor_sync";
    case Collective::ballot:
      return "__ballot_sync";
    case Collective::all:
      return "__all_sync";
    case Collective::any:
      return "__any_sync";
  }
  return "?";
}

std::string hex(unsigned v) {
  char text[16];
  std::snprintf(text, sizeof text, "0x%08x", v);
  return text;
}

// An emulator finding inside a kernel: the launch fails with this message.
class KernelFault : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Block {
  void (*run)(const void*) = nullptr;
  const void* params = nullptr;
  uint3 block_idx{};
  dim3 block_dim;
  dim3 grid_dim;
  std::vector<EmuThread> threads;
  std::vector<int> start_order;
  std::size_t next_start = 0;
  std::vector<int> ready;
  std::vector<int> batch;         // the ready threads being resumed
  std::vector<int> warp_waiting;  // per warp: lanes in a collective still incomplete
  int live = 0;
  int at_barrier = 0;
  EmuThread* suspended = nullptr;  // the thread whose worker last switched back
  EmuThread* self = nullptr;       // the thread running now
  std::exception_ptr error;
  std::vector<unsigned char> dynamic_shared;
  // TSan: one fiber per thread slot, kept across launches (TSan's thread ids are finite); the host's; the
  // objects the ordering CUDA guarantees is published through. A barrier alternates between two objects, so
  // a thread still leaving one barrier never acquires what another did after it.
  std::vector<race::Fiber> race_fibers;
  void* host_race_fiber = nullptr;
  char block_start = 0;
  char block_end = 0;
  char barrier_sync[2] = {};
  unsigned barrier_generation = 0;
  std::vector<char> warp_sync;
};

struct ScheduleState {
  Schedule schedule = Schedule::in_order;
  std::mt19937_64 rng;
};

ScheduleState initial_schedule() {
  ScheduleState s;
  if (const char* env = std::getenv("CAPSERVE_CUDA_EMU_SCHEDULE")) {
    const std::string text = env;
    if (text.rfind("shuffled", 0) == 0) {
      s.schedule = Schedule::shuffled;
      const auto colon = text.find(':');
      s.rng.seed(colon == std::string::npos ? 0 : std::stoull(text.substr(colon + 1)));
    }
  }
  return s;
}

thread_local ScheduleState schedule_state = initial_schedule();
thread_local std::uint64_t schedule_seed = 0;
thread_local Block* running_block = nullptr;

void set_current(Block& b, EmuThread& t) {
  b.self = &t;
  current_thread = &t.index;
}

// Switches back to the scheduler until this thread is released.
void suspend(Block& b, EmuThread& t) {
  b.suspended = &t;
  race::switch_to(b.host_race_fiber);
  *t.scheduler = std::move(*t.scheduler).resume();
  set_current(b, t);
}

void make_ready(Block& b, EmuThread& t) {
  t.state = State::ready;
  b.ready.push_back(t.linear);
}

// The barrier every live thread has reached: hand each its result and release them.
int release_barrier(Block& b, EmuThread& me) {
  int count = 0;
  int waiting = 0;
  for (EmuThread& t : b.threads) {
    if (t.state != State::at_barrier && &t != &me) continue;
    if (t.sync != me.sync)
      throw KernelFault("__syncthreads variants differ between threads " + std::to_string(t.linear) +
                        " and " + std::to_string(me.linear) + " at one barrier");
    count += t.predicate != 0 ? 1 : 0;
    ++waiting;
  }
  int result = 0;
  switch (me.sync) {
    case BlockSync::plain:
      break;
    case BlockSync::count:
      result = count;
      break;
    case BlockSync::all:
      result = count == waiting ? 1 : 0;
      break;
    case BlockSync::any:
      result = count > 0 ? 1 : 0;
      break;
  }
  for (EmuThread& t : b.threads) {
    if (t.state != State::at_barrier) continue;
    t.result = static_cast<std::uint64_t>(result);
    make_ready(b, t);
  }
  b.at_barrier = 0;
  ++b.barrier_generation;
  return result;
}

// The lanes of `warp` in `mask` that exist in this block, or a fault naming the lanes that do not.
EmuThread* warp_thread(Block& b, int warp, int lane) {
  const int i = warp * kWarp + lane;
  return i < static_cast<int>(b.threads.size()) ? &b.threads[static_cast<std::size_t>(i)] : nullptr;
}

int source_lane(const EmuThread& t, int lane) {
  const int w = t.width;
  switch (t.op) {
    case Collective::shfl_idx:
      return (lane & ~(w - 1)) + (((t.arg % w) + w) % w);
    case Collective::shfl_up:
      return (lane % w) >= t.arg ? lane - t.arg : lane;
    case Collective::shfl_down:
      return (lane % w) + t.arg < w ? lane + t.arg : lane;
    case Collective::shfl_xor: {
      const int src = lane ^ t.arg;
      return src >= kWarp || src / w > lane / w ? lane : src;  // later segments give the own value
    }
    default:
      return lane;
  }
}

// Every lane of the mask has arrived: compute each one's result.
void complete_collective(Block& b, int warp, const EmuThread& me) {
  const unsigned mask = me.mask;
  std::uint64_t ballot = 0;
  for (int lane = 0; lane < kWarp; ++lane) {
    if ((mask >> lane) & 1U) ballot |= (warp_thread(b, warp, lane)->value != 0 ? 1ULL : 0ULL) << lane;
  }
  for (int lane = 0; lane < kWarp; ++lane) {
    if (((mask >> lane) & 1U) == 0) continue;
    EmuThread& t = *warp_thread(b, warp, lane);
    switch (me.op) {
      case Collective::syncwarp:
        t.result = 0;
        break;
      case Collective::ballot:
        t.result = ballot;
        break;
      case Collective::all:
        t.result = ballot == mask ? 1 : 0;
        break;
      case Collective::any:
        t.result = ballot != 0 ? 1 : 0;
        break;
      default: {
        const int src = source_lane(t, lane);
        if (((mask >> src) & 1U) == 0)
          throw KernelFault(std::string(collective_name(me.op)) + " in warp " + std::to_string(warp) +
                            ": lane " + std::to_string(lane) + " reads lane " + std::to_string(src) +
                            ", which is not in the mask " + hex(mask) + " (its value is undefined)");
        t.result = warp_thread(b, warp, src)->value;
      }
    }
    if (&t != &me) {
      make_ready(b, t);
      --b.warp_waiting[static_cast<std::size_t>(warp)];
    }
  }
}

// A thread has ended: barriers no longer wait for it, and no warp collective may.
void finish_thread(Block& b, EmuThread& me) {
  me.state = State::done;
  --b.live;
  const int warp = me.linear / kWarp;
  const int lane = me.linear % kWarp;
  for (int l = 0; l < kWarp && b.warp_waiting[static_cast<std::size_t>(warp)] > 0; ++l) {
    const EmuThread* t = warp_thread(b, warp, l);
    if (t != nullptr && t->state == State::at_warp && ((t->mask >> lane) & 1U) != 0)
      throw KernelFault("thread " + std::to_string(me.linear) + " (warp " + std::to_string(warp) + ", lane " +
                        std::to_string(lane) + ") exited while lane " + std::to_string(l) +
                        " waits for it in " + collective_name(t->op) + "(mask " + hex(t->mask) + ")");
  }
  if (b.live > 0 && b.at_barrier == b.live) {
    // The last threads still running all wait at a barrier: exited threads count as arrived.
    EmuThread* first = nullptr;
    for (EmuThread& t : b.threads) {
      if (t.state == State::at_barrier) {
        first = &t;
        break;
      }
    }
    first->state = State::running;
    --b.at_barrier;
    first->result = static_cast<std::uint64_t>(release_barrier(b, *first));
    make_ready(b, *first);
  }
}

bc::fiber worker(Block& b, bc::fiber&& scheduler) {
  // Under TSan one thread per worker, each on its own stack (StackPool::give).
  const std::size_t last = race::enabled() ? b.next_start + 1 : b.start_order.size();
  while (b.next_start < last && !b.error) {
    EmuThread& t = b.threads[static_cast<std::size_t>(b.start_order[b.next_start++])];
    t.scheduler = &scheduler;
    t.state = State::running;
    set_current(b, t);
    race::switch_to(t.race_fiber);
    race::acquire(&b.block_start);
    try {
      b.run(b.params);
      race::release(&b.block_end);
      race::switch_to(b.host_race_fiber);
      finish_thread(b, t);
    } catch (const bc::detail::forced_unwind&) {
      race::switch_to(b.host_race_fiber);
      throw;
    } catch (...) {
      race::switch_to(b.host_race_fiber);
      if (!b.error) b.error = std::current_exception();
    }
  }
  return std::move(scheduler);
}

void resume(Block& b, bc::fiber&& f) {
  bc::fiber back = std::move(f).resume();
  if (back) b.suspended->parked = std::move(back);
}

std::string deadlock_report(const Block& b) {
  std::string report = "deadlock: no thread of the block can go on;";
  int shown = 0;
  for (const EmuThread& t : b.threads) {
    if (t.state == State::at_warp && shown < 4) {
      report += " thread " + std::to_string(t.linear) + " waits in " + collective_name(t.op) + "(mask " +
                hex(t.mask) + ");";
      ++shown;
    }
  }
  report += ' ';
  report +=
      std::to_string(b.at_barrier) + " of " + std::to_string(b.live) + " live threads wait at __syncthreads";
  return report;
}

// The threads of every block of a launch (their indices, the order they start in), set once per launch.
void prepare_threads(Block& b) {
  const int n = static_cast<int>(b.block_dim.x * b.block_dim.y * b.block_dim.z);
  b.threads.clear();
  b.threads.resize(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) {
    EmuThread& t = b.threads[static_cast<std::size_t>(i)];
    t.linear = i;
    t.index.thread_idx = {static_cast<unsigned>(i) % b.block_dim.x,
                          static_cast<unsigned>(i) / b.block_dim.x % b.block_dim.y,
                          static_cast<unsigned>(i) / (b.block_dim.x * b.block_dim.y)};
    t.index.block_idx = &b.block_idx;
    t.index.block_dim = &b.block_dim;
    t.index.grid_dim = &b.grid_dim;
  }
  b.start_order.resize(static_cast<std::size_t>(n));
  std::iota(b.start_order.begin(), b.start_order.end(), 0);
  b.warp_waiting.assign(static_cast<std::size_t>((n + kWarp - 1) / kWarp), 0);
  if (race::enabled()) {
    while (b.race_fibers.size() < static_cast<std::size_t>(n)) b.race_fibers.push_back(race::make_fiber());
    for (int i = 0; i < n; ++i)
      b.threads[static_cast<std::size_t>(i)].race_fiber = b.race_fibers[static_cast<std::size_t>(i)].get();
    b.host_race_fiber = __tsan_get_current_fiber();
    b.warp_sync.resize(b.warp_waiting.size());
  }
}

void run_block(Block& b) {
  const int n = static_cast<int>(b.threads.size());
  for (EmuThread& t : b.threads) t.state = State::unstarted;
  std::fill(b.warp_waiting.begin(), b.warp_waiting.end(), 0);
  const bool shuffled = schedule_state.schedule == Schedule::shuffled;
  if (shuffled) std::shuffle(b.start_order.begin(), b.start_order.end(), schedule_state.rng);
  b.next_start = 0;
  b.ready.clear();
  b.live = n;
  b.at_barrier = 0;
  b.barrier_generation = 0;
  b.error = nullptr;
  race::release(&b.block_start);
  // Uninitialised, as on a device: poisoned so that a read before any write shows.
  std::fill(b.dynamic_shared.begin(), b.dynamic_shared.end(), static_cast<unsigned char>(0xFF));

  std::vector<int>& batch = b.batch;
  while (!b.error) {
    if (b.next_start < b.start_order.size()) {
      resume(b, bc::fiber(std::allocator_arg, PooledStack{},
                          [&b](bc::fiber&& scheduler) { return worker(b, std::move(scheduler)); }));
      continue;
    }
    if (!b.ready.empty()) {
      batch.swap(b.ready);
      b.ready.clear();
      if (shuffled) std::shuffle(batch.begin(), batch.end(), schedule_state.rng);
      for (const int i : batch) {
        EmuThread& t = b.threads[static_cast<std::size_t>(i)];
        if (t.state != State::ready || b.error) continue;
        t.state = State::running;
        set_current(b, t);
        race::switch_to(t.race_fiber);
        resume(b, std::move(t.parked));
      }
      batch.clear();
      continue;
    }
    if (b.live == 0) break;
    b.error = std::make_exception_ptr(KernelFault(deadlock_report(b)));
  }
  current_thread = nullptr;
  // Parked fibers of a failed block unwind here, each in its own TSan fiber.
  for (EmuThread& t : b.threads) {
    if (!t.parked) continue;
    race::switch_to(t.race_fiber);
    t.parked = {};
  }
  race::acquire(&b.block_end);
  if (b.error) std::rethrow_exception(b.error);
}

}  // namespace

std::uint64_t warp_collective(Collective kind, unsigned mask, std::uint64_t value, int arg, int width) {
  const race::IgnoreAccesses ignore;
  Block& b = *running_block;
  EmuThread& me = *b.self;
  const int warp = me.linear / kWarp;
  const int lane = me.linear % kWarp;
  const auto where = [&] {  // only when something is wrong: no allocation on the way
    return std::string(collective_name(kind)) + "(mask " + hex(mask) + ") in thread " +
           std::to_string(me.linear) + " (warp " + std::to_string(warp) + ", lane " + std::to_string(lane) +
           ")";
  };
  if (((mask >> lane) & 1U) == 0) throw KernelFault(where() + ": the calling lane is not in the mask");
  if (width < 1 || width > kWarp || (width & (width - 1)) != 0)
    throw KernelFault(where() + ": width " + std::to_string(width) + " is not a power of 2 up to 32");
  me.op = kind;
  me.mask = mask;
  me.value = value;
  me.arg = arg;
  me.width = width;
  const int lanes_here = std::min(kWarp, static_cast<int>(b.threads.size()) - warp * kWarp);
  const unsigned existing = lanes_here == kWarp ? 0xFFFFFFFFU : (1U << lanes_here) - 1;
  if ((mask & ~existing) != 0)
    throw KernelFault(where() + ": lanes " + hex(mask & ~existing) + " are beyond the block's " +
                      std::to_string(b.threads.size()) + " threads");
  int& waiting = b.warp_waiting[static_cast<std::size_t>(warp)];
  // Fewer lanes wait than the others of the mask: incomplete, no need to look at them.
  bool complete = waiting >= std::popcount(mask) - 1;
  for (int l = 0; l < kWarp && complete; ++l) {
    if (((mask >> l) & 1U) == 0 || l == lane) continue;
    const EmuThread* t = warp_thread(b, warp, l);
    if (t->state == State::done)
      throw KernelFault(where() + ": lane " + std::to_string(l) + " has already exited");
    if (t->state != State::at_warp) {
      complete = false;
      continue;
    }
    if (t->op != kind || t->mask != mask)
      throw KernelFault(where() + ": lane " + std::to_string(l) + " waits in " + collective_name(t->op) +
                        "(mask " + hex(t->mask) + ") instead");
  }
  // One object per warp: a lane may acquire more than its collective published (a missed report), never less.
  void* sync = race::enabled() ? &b.warp_sync[static_cast<std::size_t>(warp)] : nullptr;
  race::release(sync);
  if (complete) {
    complete_collective(b, warp, me);
    race::acquire(sync);
    return me.result;
  }
  me.state = State::at_warp;
  ++waiting;
  suspend(b, me);
  race::acquire(sync);
  return me.result;
}

int block_barrier(BlockSync kind, int predicate) {
  const race::IgnoreAccesses ignore;
  Block& b = *running_block;
  EmuThread& me = *b.self;
  me.sync = kind;
  me.predicate = predicate;
  char* sync = &b.barrier_sync[b.barrier_generation % 2];
  race::release(sync);
  if (b.at_barrier + 1 == b.live) {
    const int result = release_barrier(b, me);
    race::acquire(sync);
    return result;
  }
  ++b.at_barrier;
  me.state = State::at_barrier;
  suspend(b, me);
  race::acquire(sync);
  return static_cast<int>(me.result);
}

unsigned active_mask() {
  Block& b = *running_block;
  const int warp = b.self->linear / kWarp;
  unsigned mask = 0;
  for (int l = 0; l < kWarp; ++l) {
    const EmuThread* t = warp_thread(b, warp, l);
    if (t != nullptr && t->state != State::done) mask |= 1U << l;
  }
  return mask;
}

void trap(const char* what) {
  throw KernelFault(std::string(what) + " in thread " + std::to_string(running_block->self->linear));
}

void* dynamic_shared_memory() {
  return running_block->dynamic_shared.data();
}

void launch_kernel(const void* kernel, dim3 grid, dim3 block, std::size_t shared_bytes, cudaStream_t stream,
                   void (*run)(const void*), const void* params, std::span<const PointerArgument> pointers) {
  count(&Counters::kernel_launches);
  const auto dims = [](dim3 d) {
    std::string text(1, '(');  // not "(" + ...: GCC 12 warns falsely (-Wrestrict) on that at -O3
    text += std::to_string(d.x) + ", " + std::to_string(d.y) + ", " + std::to_string(d.z) + ")";
    return text;
  };
  const std::uint64_t threads = std::uint64_t{block.x} * block.y * block.z;
  if (block.x == 0 || block.y == 0 || block.z == 0 || block.x > 1024 || block.y > 1024 || block.z > 64 ||
      threads > 1024) {
    fail(cudaErrorInvalidConfiguration,
         "block " + dims(block) + ": at most (1024, 1024, 64) and 1024 threads in all");
    return;
  }
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7FFFFFFFU || grid.y > 65535 || grid.z > 65535) {
    fail(cudaErrorInvalidConfiguration, "grid " + dims(grid) + ": at most (2^31 - 1, 65535, 65535), none 0");
    return;
  }
  const int allowed = max_dynamic_shared(kernel);
  if (shared_bytes > static_cast<std::size_t>(allowed)) {
    fail(cudaErrorInvalidValue, std::to_string(shared_bytes) + " bytes of dynamic shared memory, above the " +
                                    std::to_string(allowed) +
                                    " allowed (above 48 KB needs cudaFuncSetAttribute("
                                    "cudaFuncAttributeMaxDynamicSharedMemorySize))");
    return;
  }
  if (std::string why = check_launch_stream(stream); !why.empty()) {
    fail(cudaErrorInvalidResourceHandle, why);
    return;
  }
  for (const PointerArgument& p : pointers) {
    if (std::string why = check_device_pointer(p.pointer); !why.empty()) {
      fail(cudaErrorIllegalAddress, "kernel argument " + std::to_string(p.index) + " " + why);
      return;
    }
  }
  if (running_block != nullptr) {
    fail(cudaErrorNotSupported, "a kernel launch from inside a kernel");
    return;
  }
  thread_local Block b;
  b.run = run;
  b.params = params;
  b.block_dim = block;
  b.grid_dim = grid;
  b.dynamic_shared.resize(shared_bytes);
  prepare_threads(b);
  running_block = &b;
  try {
    for (unsigned z = 0; z < grid.z; ++z) {
      for (unsigned y = 0; y < grid.y; ++y) {
        for (unsigned x = 0; x < grid.x; ++x) {
          b.block_idx = {x, y, z};
          run_block(b);
        }
      }
    }
  } catch (const std::exception& e) {
    fail(cudaErrorLaunchFailure,
         std::string(e.what()) + " (block " + dims(dim3(b.block_idx.x, b.block_idx.y, b.block_idx.z)) + ")");
  }
  running_block = nullptr;
}

}  // namespace capserve::cuda_emu::detail

namespace capserve::cuda_emu {

void set_schedule(Schedule schedule, std::uint64_t seed) {
  detail::schedule_state.schedule = schedule;
  detail::schedule_state.rng.seed(seed);
  detail::schedule_seed = seed;
}

ScopedSchedule::ScopedSchedule(Schedule schedule, std::uint64_t seed)
    : previous_(detail::schedule_state.schedule), previous_seed_(detail::schedule_seed) {
  set_schedule(schedule, seed);
}

ScopedSchedule::~ScopedSchedule() {
  set_schedule(previous_, previous_seed_);
}

}  // namespace capserve::cuda_emu
