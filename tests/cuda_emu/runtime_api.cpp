// CUDA emulation: the runtime API subset CapServe calls, on host memory, declared by the real
// cuda_runtime_api.h. Work runs when it is enqueued, so every stream is always idle; what the emulation adds
// is the checks a device makes (pointers, handles, the current device) and counters of host synchronisations
// and allocations.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "emu_state.h"
#include "handle_registry.h"

namespace capserve::cuda_emu::detail {
namespace {

struct LastError {
  cudaError_t pending = cudaSuccess;   // for cudaGetLastError
  cudaError_t detailed = cudaSuccess;  // the error `detail` belongs to
  std::string detail;
  std::string text;  // cudaGetErrorString's answer for `detailed`
};
thread_local LastError last;

Counters totals;

thread_local int device = 0;
thread_local int emulation_depth = 0;

struct EmuStream {
  int device = 0;
};
struct EmuEvent {
  int device = 0;
  bool timing = true;
  bool recorded = false;
  std::chrono::steady_clock::time_point at;
  std::shared_ptr<StreamHang>
      behind;               // recorded behind work that never completes: not reached until released
  bool in_capture = false;  // last recorded on a stream capturing a graph
};

// Graph capture (cudaStreamBeginCapture in cudaStreamCaptureModeGlobal): while a stream captures, calls that
// would make the host wait for the device or change memory outside the stream's order (cudaMalloc,
// cudaFree, cudaMallocHost, cudaFreeHost, cudaMemcpy, the synchronize calls, a query of the capturing stream
// or of an event recorded in the capture, a copy from pageable memory) are refused with
// cudaErrorStreamCaptureUnsupported, and the capture is invalidated, as on a device. The captured work
// itself runs at once, as all work here does: what the emulation checks is that a captured sequence makes
// none of those calls, not a graph's replay.
struct EmuGraph {};
struct Captures {
  std::mutex mutex;
  std::vector<cudaStream_t> streams;  // capturing now
  std::string violation;              // the first refused call since the oldest capture began
};
Captures& captures() {
  static Captures c;
  return c;
}
bool capturing(cudaStream_t stream) {
  Captures& c = captures();
  const std::lock_guard lock(c.mutex);
  return std::find(c.streams.begin(), c.streams.end(), stream) != c.streams.end();
}

// cudaSuccess when `what` may be called now; else the refusal, recorded against the captures.
cudaError_t refuse_during_capture(const char* what) {
  Captures& c = captures();
  std::string message;
  {
    const std::lock_guard lock(c.mutex);
    if (c.streams.empty()) return cudaSuccess;
    message = std::string(what) + " while a stream captures a graph (cudaStreamCaptureModeGlobal)";
    if (c.violation.empty()) c.violation = message;
  }
  return fail(cudaErrorStreamCaptureUnsupported, message);
}

// cudaFuncAttributeMaxDynamicSharedMemorySize per kernel.
struct SharedLimits {
  std::mutex mutex;
  std::map<const void*, int> bytes;
};
SharedLimits& shared_limits() {
  static auto* const limits = new SharedLimits;  // never destroyed, like the handles
  return *limits;
}

constexpr int kDefaultDynamicShared = 48 * 1024;
constexpr int kOptInDynamicShared = 227 * 1024;

bool special_stream(cudaStream_t s) {
  return s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread;
}

// The hung streams (hang_stream), each by its handle (null for the special streams, which stand for their
// device's) and device.
struct HungStream {
  const void* stream;
  int device;
  std::shared_ptr<StreamHang> hang;
};
struct Hangs {
  std::mutex mutex;
  std::vector<HungStream> list;
};
Hangs& hangs() {
  static auto* const all = new Hangs;  // never destroyed, like the handles
  return *all;
}

// The hang holding `stream` of `device` (any stream of it when `stream` is all_streams), or null.
const void* const all_streams = &all_streams;
std::shared_ptr<StreamHang> hang_of(const void* stream, int device) {
  Hangs& h = hangs();
  const std::lock_guard lock(h.mutex);
  std::erase_if(h.list, [](const HungStream& s) { return s.hang->released.load(); });
  for (const HungStream& s : h.list) {
    if (s.device == device && (stream == all_streams || s.stream == stream)) return s.hang;
  }
  return nullptr;
}

// Why work on `stream` of `device` never completes, or "".
std::string hung(const void* stream, int device) {
  const std::shared_ptr<StreamHang> hang = hang_of(stream, device);
  return hang != nullptr ? hang->why : std::string();
}

// A host wait for work that `why_hung` says never completes ("" once it does): returns once it completes, or
// fails after nccl_timeout().
template <class WhyHung>
cudaError_t wait_while_hung(const char* call, const WhyHung& why_hung) {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    const std::string why = why_hung();
    if (why.empty()) return cudaSuccess;
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited > nccl_timeout())
      return fail(cudaErrorLaunchTimeout,
                  std::string(call) + ": waited " + std::to_string(static_cast<int>(waited)) +
                      " s for device work that never completes: " + why +
                      " (a GPU would wait here forever; poll the stream and ncclCommGetAsyncError instead, "
                      "and ncclCommAbort on an error)");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// A host wait on `stream` of `device`.
cudaError_t wait_for_hangs(const char* call, const void* stream, int device) {
  return wait_while_hung(call, [&] { return hung(stream, device); });
}

std::string not_reached(const EmuEvent& e) {
  return e.behind != nullptr && !e.behind->released.load() ? e.behind->why : std::string();
}

EmuStream* find_stream(cudaStream_t s) {
  return handles<EmuStream>().find(s);
}

EmuEvent* find_event(cudaEvent_t e) {
  return handles<EmuEvent>().find(e);
}

cudaError_t check_stream(cudaStream_t s) {
  if (std::string why = check_launch_stream(s); !why.empty())
    return fail(cudaErrorInvalidResourceHandle, why);
  return cudaSuccess;
}

const char* error_name(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration:
      return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle:
      return "cudaErrorInvalidResourceHandle";
    case cudaErrorIllegalAddress:
      return "cudaErrorIllegalAddress";
    case cudaErrorLaunchFailure:
      return "cudaErrorLaunchFailure";
    case cudaErrorNotSupported:
      return "cudaErrorNotSupported";
    case cudaErrorNoDevice:
      return "cudaErrorNoDevice";
    case cudaErrorInvalidDevicePointer:
      return "cudaErrorInvalidDevicePointer";
    case cudaErrorNotReady:
      return "cudaErrorNotReady";
    case cudaErrorLaunchTimeout:
      return "cudaErrorLaunchTimeout";
    case cudaErrorIllegalState:
      return "cudaErrorIllegalState";
    case cudaErrorStreamCaptureUnsupported:
      return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated:
      return "cudaErrorStreamCaptureInvalidated";
    default:
      return "cudaErrorUnknown";
  }
}

const char* error_text(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle:
      return "invalid resource handle";
    case cudaErrorIllegalAddress:
      return "an illegal memory access was encountered";
    case cudaErrorLaunchFailure:
      return "unspecified launch failure";
    case cudaErrorNotSupported:
      return "operation not supported";
    case cudaErrorNoDevice:
      return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevicePointer:
      return "invalid device pointer";
    case cudaErrorNotReady:
      return "device not ready";
    case cudaErrorLaunchTimeout:
      return "the launch timed out and was terminated";
    case cudaErrorIllegalState:
      return "the operation cannot be performed in the present state";
    case cudaErrorStreamCaptureUnsupported:
      return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated:
      return "operation failed due to a previous error during capture";
    default:
      return "unknown error";
  }
}

bool is_device(const void* p) {
  return find_memory(p).kind == MemoryKind::device;
}

// The copy's pointers against its direction, as the runtime checks them.
cudaError_t copy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind, const char* call,
                 bool async) {
  count(&Counters::copies);
  if (bytes == 0) return cudaSuccess;
  if (kind == cudaMemcpyDefault) {
    const bool d = is_device(dst);
    const bool s = is_device(src);
    kind = d ? (s ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
             : (s ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
  }
  if (async && kind == cudaMemcpyHostToDevice && find_memory(src).kind != MemoryKind::pinned_host) {
    if (const cudaError_t e = refuse_during_capture("cudaMemcpyAsync from pageable memory"); e != cudaSuccess)
      return e;
    count(&Counters::pageable_async_copies);
  }
  const bool dst_device = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool src_device = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  std::string why = dst_device ? check_range(dst, bytes, MemoryKind::device, "destination")
                    : is_device(dst) || find_memory(dst).kind == MemoryKind::freed_device
                        ? std::string("destination is device memory, but the copy's kind says host")
                        : std::string();
  if (why.empty()) {
    why = src_device ? check_range(src, bytes, MemoryKind::device, "source")
          : is_device(src) || find_memory(src).kind == MemoryKind::freed_device
              ? std::string("source is device memory, but the copy's kind says host")
              : std::string();
  }
  if (!why.empty()) return fail(cudaErrorInvalidValue, std::string(call) + ": " + why);
  std::memmove(dst, src, bytes);
  return cudaSuccess;
}

cudaError_t set(void* dst, int value, std::size_t bytes, const char* call) {
  if (bytes == 0) return cudaSuccess;
  if (std::string why = check_range(dst, bytes, MemoryKind::device, "destination"); !why.empty())
    return fail(cudaErrorInvalidValue, std::string(call) + ": " + why);
  std::memset(dst, value, bytes);
  return cudaSuccess;
}

}  // namespace

cudaError_t fail(cudaError_t code, std::string detail) {
  last.pending = code;
  last.detailed = code;
  last.detail = std::move(detail);
  return code;
}

cudaError_t last_error(bool clear) {
  const cudaError_t e = last.pending;
  if (clear) last.pending = cudaSuccess;
  return e;
}

void count(std::int64_t Counters::*field) {
  std::atomic_ref<std::int64_t>(totals.*field).fetch_add(1, std::memory_order_relaxed);
}

int current_device() {
  return device;
}

int device_count() {
  static const int n = [] {
    const char* env = std::getenv("CAPSERVE_CUDA_EMU_DEVICES");
    return env != nullptr ? std::atoi(env) : 1;
  }();
  return n;
}

std::string check_launch_stream(cudaStream_t stream) {
  if (special_stream(stream)) return {};
  const EmuStream* s = find_stream(stream);
  if (s == nullptr)
    return "stream " + std::to_string(reinterpret_cast<std::uintptr_t>(stream)) +
           " was never created or is destroyed";
  if (s->device != device)
    return "the stream belongs to device " + std::to_string(s->device) + " but device " +
           std::to_string(device) + " is current on this thread (cudaSetDevice first)";
  return {};
}

int stream_device(cudaStream_t stream) {
  if (special_stream(stream)) return device;
  const EmuStream* s = find_stream(stream);
  return s == nullptr ? -1 : s->device;
}

std::shared_ptr<StreamHang> hang_stream(cudaStream_t stream, std::string why) {
  auto hang = std::make_shared<StreamHang>();
  hang->why = std::move(why);
  Hangs& h = hangs();
  const std::lock_guard lock(h.mutex);
  h.list.push_back({special_stream(stream) ? nullptr : stream, stream_device(stream), hang});
  return hang;
}

double nccl_timeout() {
  static const double seconds = [] {
    const char* env = std::getenv("CAPSERVE_CUDA_EMU_NCCL_TIMEOUT_S");
    return env != nullptr ? std::atof(env) : 30.0;
  }();
  return seconds;
}

int max_dynamic_shared(const void* kernel) {
  SharedLimits& limits = shared_limits();
  const std::lock_guard lock(limits.mutex);
  const auto it = limits.bytes.find(kernel);
  return it == limits.bytes.end() ? kDefaultDynamicShared : it->second;
}

}  // namespace capserve::cuda_emu::detail

namespace capserve::cuda_emu {

Counters counters() {
  Counters c;
  const auto load = [](std::int64_t& from) {
    return std::atomic_ref<std::int64_t>(from).load(std::memory_order_relaxed);
  };
  c.host_syncs = load(detail::totals.host_syncs);
  c.device_allocations = load(detail::totals.device_allocations);
  c.device_frees = load(detail::totals.device_frees);
  c.host_allocations = load(detail::totals.host_allocations);
  c.kernel_launches = load(detail::totals.kernel_launches);
  c.copies = load(detail::totals.copies);
  c.pageable_async_copies = load(detail::totals.pageable_async_copies);
  return c;
}

bool inside_emulation() {
  return detail::emulation_depth > 0;
}

detail::EmulationScope::EmulationScope() {
  ++emulation_depth;
}

detail::EmulationScope::~EmulationScope() {
  --emulation_depth;
}

void reset_counters() {
  for (std::int64_t Counters::*f :
       {&Counters::host_syncs, &Counters::device_allocations, &Counters::device_frees,
        &Counters::host_allocations, &Counters::kernel_launches, &Counters::copies,
        &Counters::pageable_async_copies})
    std::atomic_ref<std::int64_t>(detail::totals.*f).store(0, std::memory_order_relaxed);
}

ScopedStreamHang::ScopedStreamHang(CUstream_st* stream, std::string why)
    : hang_(detail::hang_stream(stream, std::move(why))) {}

ScopedStreamHang::~ScopedStreamHang() {
  hang_->released = true;
}

}  // namespace capserve::cuda_emu

namespace d = capserve::cuda_emu::detail;
using capserve::cuda_emu::Counters;

cudaError_t cudaGetLastError() {
  return d::last_error(true);
}

cudaError_t cudaPeekAtLastError() {
  return d::last_error(false);
}

const char* cudaGetErrorName(cudaError_t error) {
  return d::error_name(error);
}

const char* cudaGetErrorString(cudaError_t error) {
  if (error != d::last.detailed || d::last.detail.empty()) return d::error_text(error);
  d::last.text = std::string(d::error_text(error)) + " [CUDA emulation: " + d::last.detail + "]";
  return d::last.text.c_str();
}

cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return d::fail(cudaErrorInvalidValue, "cudaGetDeviceCount: null count");
  *count = d::device_count();
  // As the real runtime on a machine without a GPU.
  if (*count == 0) return d::fail(cudaErrorNoDevice, "CAPSERVE_CUDA_EMU_DEVICES=0");
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return d::fail(cudaErrorInvalidValue, "cudaGetDevice: null device");
  *device = d::device;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= d::device_count())
    return d::fail(cudaErrorInvalidDevice, "cudaSetDevice(" + std::to_string(device) + "): " +
                                               std::to_string(d::device_count()) + " emulated device(s)");
  d::device = device;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (prop == nullptr || device < 0 || device >= d::device_count())
    return d::fail(cudaErrorInvalidDevice, "cudaGetDeviceProperties(" + std::to_string(device) + ")");
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof prop->name, "CapServe CUDA emulator (sm_90)");
  // The same device index is the same GPU in every process of the node, as with real UUIDs.
  std::memcpy(prop->uuid.bytes, "capserve-emu-", 13);
  prop->uuid.bytes[15] = static_cast<char>(device);
  prop->totalGlobalMem = d::device_memory_total();
  prop->sharedMemPerBlock = 48 * 1024;
  prop->sharedMemPerBlockOptin = 227 * 1024;
  prop->regsPerBlock = 65536;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->maxThreadsDim[0] = 1024;
  prop->maxThreadsDim[1] = 1024;
  prop->maxThreadsDim[2] = 64;
  prop->maxGridSize[0] = 0x7FFFFFFF;
  prop->maxGridSize[1] = 65535;
  prop->maxGridSize[2] = 65535;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 132;
  prop->maxThreadsPerMultiProcessor = 2048;
  prop->unifiedAddressing = 1;
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize() {
  if (const cudaError_t e = d::refuse_during_capture("cudaDeviceSynchronize"); e != cudaSuccess) return e;
  d::count(&Counters::host_syncs);
  return d::wait_for_hangs("cudaDeviceSynchronize", d::all_streams, d::device);
}

cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaSuccess;  // no effect on the host
  if (value < 0 || value > d::kOptInDynamicShared)
    return d::fail(cudaErrorInvalidValue, "cudaFuncSetAttribute: " + std::to_string(value) +
                                              " bytes of dynamic shared memory, above the device's " +
                                              std::to_string(d::kOptInDynamicShared));
  d::SharedLimits& limits = d::shared_limits();
  const std::lock_guard lock(limits.mutex);
  limits.bytes[func] = std::max(value, d::kDefaultDynamicShared);
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** ptr, std::size_t size) {
  if (ptr == nullptr) return d::fail(cudaErrorInvalidValue, "cudaMalloc: null pointer to the result");
  if (const cudaError_t e = d::refuse_during_capture("cudaMalloc"); e != cudaSuccess) return e;
  d::count(&Counters::device_allocations);
  *ptr = d::allocate_device(size, d::device);
  if (*ptr == nullptr)
    return d::fail(cudaErrorMemoryAllocation, "cudaMalloc(" + std::to_string(size) +
                                                  "): " + std::to_string(d::device_memory_in_use(d::device)) +
                                                  " of " + std::to_string(d::device_memory_total()) +
                                                  " bytes in use");
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(std::size_t* free, std::size_t* total) {
  if (free == nullptr || total == nullptr)
    return d::fail(cudaErrorInvalidValue, "cudaMemGetInfo: null pointer");
  *total = d::device_memory_total();
  *free = *total - d::device_memory_in_use(d::device);
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  if (const cudaError_t e = d::refuse_during_capture("cudaFree"); e != cudaSuccess) return e;
  d::count(&Counters::device_frees);
  if (d::release(ptr, d::MemoryKind::device)) return cudaSuccess;
  const d::MemoryRange m = d::find_memory(ptr);
  return d::fail(cudaErrorInvalidValue,
                 m.kind == d::MemoryKind::freed_device ? "cudaFree: the memory is already freed"
                 : m.kind != d::MemoryKind::none       ? "cudaFree: not the start of a cudaMalloc allocation"
                                                       : "cudaFree: not device memory");
}

cudaError_t cudaMallocHost(void** ptr, std::size_t size) {
  if (ptr == nullptr) return d::fail(cudaErrorInvalidValue, "cudaMallocHost: null pointer to the result");
  if (const cudaError_t e = d::refuse_during_capture("cudaMallocHost"); e != cudaSuccess) return e;
  d::count(&Counters::host_allocations);
  *ptr = d::allocate_pinned(size);
  if (*ptr == nullptr) return d::fail(cudaErrorMemoryAllocation, "cudaMallocHost: no host memory left");
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* ptr) {
  if (ptr != nullptr) {
    if (const cudaError_t e = d::refuse_during_capture("cudaFreeHost"); e != cudaSuccess) return e;
  }
  if (ptr == nullptr || d::release(ptr, d::MemoryKind::pinned_host)) return cudaSuccess;
  return d::fail(cudaErrorInvalidValue, "cudaFreeHost: not the start of a cudaMallocHost allocation");
}

cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t count, cudaMemcpyKind kind) {
  if (const cudaError_t e = d::refuse_during_capture("cudaMemcpy"); e != cudaSuccess) return e;
  d::count(&Counters::host_syncs);
  if (const cudaError_t e = d::wait_for_hangs("cudaMemcpy", d::all_streams, d::device); e != cudaSuccess)
    return e;
  return d::copy(dst, src, count, kind, "cudaMemcpy", false);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t count, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  const d::EmulationScope emulation;
  if (const cudaError_t e = d::check_stream(stream); e != cudaSuccess) return e;
  return d::copy(dst, src, count, kind, "cudaMemcpyAsync", true);
}

cudaError_t cudaMemset(void* dst, int value, std::size_t count) {
  return d::set(dst, value, count, "cudaMemset");
}

cudaError_t cudaMemsetAsync(void* dst, int value, std::size_t count, cudaStream_t stream) {
  const d::EmulationScope emulation;
  if (const cudaError_t e = d::check_stream(stream); e != cudaSuccess) return e;
  return d::set(dst, value, count, "cudaMemsetAsync");
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int) {
  if (stream == nullptr)
    return d::fail(cudaErrorInvalidValue, "cudaStreamCreate: null pointer to the result");
  *stream = reinterpret_cast<cudaStream_t>(
      d::handles<d::EmuStream>().add(std::make_unique<d::EmuStream>(d::EmuStream{d::device})));
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  if (!d::handles<d::EmuStream>().remove(stream))
    return d::fail(cudaErrorInvalidResourceHandle, "cudaStreamDestroy: not a live stream");
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  if (const cudaError_t e = d::refuse_during_capture("cudaStreamSynchronize"); e != cudaSuccess) return e;
  d::count(&Counters::host_syncs);
  if (d::special_stream(stream)) return d::wait_for_hangs("cudaStreamSynchronize", nullptr, d::device);
  if (d::find_stream(stream) != nullptr)
    return d::wait_for_hangs("cudaStreamSynchronize", stream, d::stream_device(stream));
  return d::fail(cudaErrorInvalidResourceHandle, "cudaStreamSynchronize: not a live stream");
}

// Not ready only behind a hang (streams are otherwise idle). Finding the work complete ends a polled host
// wait, so it counts as a host synchronisation, as cudaStreamSynchronize does.
cudaError_t cudaStreamQuery(cudaStream_t stream) {
  if (!d::special_stream(stream) && d::find_stream(stream) == nullptr)
    return d::fail(cudaErrorInvalidResourceHandle, "cudaStreamQuery: not a live stream");
  if (d::capturing(stream)) return d::refuse_during_capture("cudaStreamQuery of the capturing stream");
  if (!d::hung(d::special_stream(stream) ? nullptr : stream, d::stream_device(stream)).empty())
    return cudaErrorNotReady;  // not an error: nothing for cudaGetLastError
  d::count(&Counters::host_syncs);
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int) {
  if (const cudaError_t e = d::check_stream(stream); e != cudaSuccess) return e;
  if (d::find_event(event) == nullptr)
    return d::fail(cudaErrorInvalidResourceHandle, "cudaStreamWaitEvent: not a live event");
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  return cudaEventCreateWithFlags(event, cudaEventDefault);
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  if (event == nullptr) return d::fail(cudaErrorInvalidValue, "cudaEventCreate: null pointer to the result");
  *event = reinterpret_cast<cudaEvent_t>(d::handles<d::EmuEvent>().add(std::make_unique<d::EmuEvent>(
      d::EmuEvent{d::device, (flags & cudaEventDisableTiming) == 0, false, {}, nullptr})));
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  if (!d::handles<d::EmuEvent>().remove(event))
    return d::fail(cudaErrorInvalidResourceHandle, "cudaEventDestroy: not a live event");
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  d::EmuEvent* e = d::find_event(event);
  if (e == nullptr) return d::fail(cudaErrorInvalidResourceHandle, "cudaEventRecord: not a live event");
  if (const cudaError_t rc = d::check_stream(stream); rc != cudaSuccess) return rc;
  if (e->device != d::device)
    return d::fail(cudaErrorInvalidResourceHandle, "cudaEventRecord: the event belongs to device " +
                                                       std::to_string(e->device) + ", the stream to device " +
                                                       std::to_string(d::device));
  e->recorded = true;
  e->in_capture = d::capturing(stream);
  e->at = std::chrono::steady_clock::now();
  e->behind = d::hang_of(d::special_stream(stream) ? nullptr : stream, d::stream_device(stream));
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (const cudaError_t e = d::refuse_during_capture("cudaEventSynchronize"); e != cudaSuccess) return e;
  d::count(&Counters::host_syncs);
  const d::EmuEvent* e = d::find_event(event);
  if (e == nullptr) return d::fail(cudaErrorInvalidResourceHandle, "cudaEventSynchronize: not a live event");
  return d::wait_while_hung("cudaEventSynchronize", [e] { return d::not_reached(*e); });
}

// Not ready only when recorded behind a hang (the work before it is otherwise complete).
cudaError_t cudaEventQuery(cudaEvent_t event) {
  const d::EmuEvent* e = d::find_event(event);
  if (e == nullptr) return d::fail(cudaErrorInvalidResourceHandle, "cudaEventQuery: not a live event");
  if (e->in_capture) return d::refuse_during_capture("cudaEventQuery of an event recorded in the capture");
  if (!d::not_reached(*e).empty()) return cudaErrorNotReady;  // not an error: nothing for cudaGetLastError
  return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
  if (d::special_stream(stream) || d::find_stream(stream) == nullptr)
    return d::fail(cudaErrorStreamCaptureUnsupported, "cudaStreamBeginCapture: not a created stream");
  if (mode != cudaStreamCaptureModeGlobal)
    return d::fail(cudaErrorInvalidValue,
                   "cudaStreamBeginCapture: the emulation captures in global mode only");
  d::Captures& c = d::captures();
  const std::lock_guard lock(c.mutex);
  if (std::find(c.streams.begin(), c.streams.end(), stream) != c.streams.end())
    return d::fail(cudaErrorIllegalState, "cudaStreamBeginCapture: the stream is already capturing");
  if (c.streams.empty()) c.violation.clear();
  c.streams.push_back(stream);
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  if (graph == nullptr)
    return d::fail(cudaErrorInvalidValue, "cudaStreamEndCapture: null pointer to the result");
  d::Captures& c = d::captures();
  std::string violation;
  {
    const std::lock_guard lock(c.mutex);
    const auto it = std::find(c.streams.begin(), c.streams.end(), stream);
    if (it == c.streams.end())
      return d::fail(cudaErrorIllegalState, "cudaStreamEndCapture: the stream is not capturing");
    c.streams.erase(it);
    violation = c.violation;
  }
  *graph = nullptr;
  if (!violation.empty())
    return d::fail(cudaErrorStreamCaptureInvalidated,
                   "cudaStreamEndCapture: the capture was invalidated by " + violation);
  *graph = reinterpret_cast<cudaGraph_t>(d::handles<d::EmuGraph>().add(std::make_unique<d::EmuGraph>()));
  return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) {
  if (status == nullptr) return d::fail(cudaErrorInvalidValue, "cudaStreamIsCapturing: null pointer");
  *status = d::capturing(stream) ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  if (!d::handles<d::EmuGraph>().remove(graph))
    return d::fail(cudaErrorInvalidResourceHandle, "cudaGraphDestroy: not a live graph");
  return cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  const d::EmuEvent* a = d::find_event(start);
  const d::EmuEvent* b = d::find_event(end);
  if (ms == nullptr || a == nullptr || b == nullptr)
    return d::fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: not live events");
  if (!a->timing || !b->timing)
    return d::fail(cudaErrorInvalidResourceHandle,
                   "cudaEventElapsedTime: an event has cudaEventDisableTiming");
  if (!a->recorded || !b->recorded)
    return d::fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: an event was never recorded");
  *ms = std::chrono::duration<float, std::milli>(b->at - a->at).count();
  return cudaSuccess;
}
