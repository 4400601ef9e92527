#pragma once
// CUDA emulation: the opaque handles its APIs hand out (streams, events, cuBLAS handles, NCCL communicators),
// owned here and looked up on every use, so that a destroyed or made-up handle is an error, not a crash.
#include <map>
#include <memory>
#include <mutex>

namespace capserve::cuda_emu::detail {

template <class T>
class HandleRegistry {
 public:
  // Takes `object`; its address is the handle.
  T* add(std::unique_ptr<T> object) {
    T* p = object.get();
    const std::lock_guard lock(mutex_);
    live_.emplace(p, std::move(object));
    return p;
  }
  // The object behind a live handle, or null.
  T* find(const void* handle) {
    const std::lock_guard lock(mutex_);
    const auto it = live_.find(handle);
    return it == live_.end() ? nullptr : it->second.get();
  }
  // Destroys the object; false when the handle is not live.
  bool remove(const void* handle) {
    const std::lock_guard lock(mutex_);
    return live_.erase(handle) == 1;
  }

 private:
  std::mutex mutex_;
  std::map<const void*, std::unique_ptr<T>> live_;
};

// One registry per kind, for the process's life: handles may be released by static destructors that run after
// this library's own.
template <class T>
HandleRegistry<T>& handles() {
  static auto* const registry = new HandleRegistry<T>;  // deliberately never destroyed
  return *registry;
}

}  // namespace capserve::cuda_emu::detail
