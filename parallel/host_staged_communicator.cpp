#include "parallel/host_staged_communicator.h"

#include <utility>

namespace capserve::parallel {
namespace {

// Values as the bytes they occupy, and staged bytes as the values they hold (the staging buffers are aligned
// for any scalar type).
template <typename T>
std::span<T> as_values(std::span<std::byte> bytes) {
  return {reinterpret_cast<T*>(bytes.data()), bytes.size() / sizeof(T)};
}

}  // namespace

HostStagedCommunicator::HostStagedCommunicator(Communicator& host, std::unique_ptr<MemoryMover> mover)
    : host_(host), mover_(std::move(mover)) {}

HostStagedCommunicator::~HostStagedCommunicator() {
  try {
    mover_->wait_marked();
  } catch (...) {  // nothing else to do: the buffers are freed either way
  }
}

std::span<std::byte> HostStagedCommunicator::stage(Staging& staging, std::size_t bytes) {
  if (bytes > staging.bytes) {
    // Exact size: the step's shapes settle after the first few steps, and pinned memory is costly to
    // allocate.
    staging.buffer = mover_->allocate_host(bytes);
    staging.bytes = bytes;
  }
  return {staging.buffer.get(), bytes};
}

void HostStagedCommunicator::do_alltoall(std::span<const std::int64_t> send, std::span<std::int64_t> recv,
                                         Stream stream) {
  const auto n = static_cast<std::size_t>(size());
  check_entries(send.size(), n, "HostStagedCommunicator::alltoall", "send");
  check_entries(recv.size(), n, "HostStagedCommunicator::alltoall", "recv");
  mover_->wait_marked();
  const std::span<std::byte> out = stage(send_staging_, send.size_bytes());
  const std::span<std::byte> in = stage(recv_staging_, recv.size_bytes());
  mover_->copy_to_host(out, std::as_bytes(send), stream);
  mover_->synchronize(stream);
  host_.alltoall(as_values<const std::int64_t>(out), as_values<std::int64_t>(in));
  mover_->copy_to_device(std::as_writable_bytes(recv), in, stream);
  mover_->mark(stream);
}

void HostStagedCommunicator::do_alltoallv(std::span<const std::byte> send,
                                          std::span<const std::int64_t> send_counts,
                                          std::span<std::byte> recv,
                                          std::span<const std::int64_t> recv_counts, Stream stream) {
  static constexpr const char* kWho = "HostStagedCommunicator::alltoallv";
  const int me = rank();
  send_layout_.assign(send_counts, size(), kWho, "send_counts");
  recv_layout_.assign(recv_counts, size(), kWho, "recv_counts");
  check_alltoallv(send_layout_, send.size(), recv_layout_, recv.size(), me, kWho);
  const std::int64_t own = send_layout_.count(me);
  staged_send_counts_.assign(send_counts.begin(), send_counts.end());
  staged_recv_counts_.assign(recv_counts.begin(), recv_counts.end());
  staged_send_counts_[static_cast<std::size_t>(me)] = 0;
  staged_recv_counts_[static_cast<std::size_t>(me)] = 0;

  // The blocks for other ranks lie before and after the own block, so each buffer is two contiguous pieces,
  // and the staged buffers are the same pieces back to back.
  const auto pieces = [me](const BlockLayout& layout, auto buffer) {
    const auto before = static_cast<std::size_t>(layout.offset(me));
    const auto after = static_cast<std::size_t>(layout.offset(me + 1));
    return std::pair{buffer.first(before),
                     buffer.subspan(after, static_cast<std::size_t>(layout.total()) - after)};
  };
  const auto [send_before, send_after] = pieces(send_layout_, send);
  const auto [recv_before, recv_after] = pieces(recv_layout_, recv);

  mover_->wait_marked();  // the previous call's copies back to the device may still read the staging buffers
  const std::span<std::byte> out = stage(send_staging_, send_before.size() + send_after.size());
  const std::span<std::byte> in = stage(recv_staging_, recv_before.size() + recv_after.size());
  if (!send_before.empty()) mover_->copy_to_host(out.first(send_before.size()), send_before, stream);
  if (!send_after.empty()) mover_->copy_to_host(out.subspan(send_before.size()), send_after, stream);
  if (!out.empty()) mover_->synchronize(stream);
  // Enqueued after the wait, so the device copies its own block while the host exchanges the others.
  if (own > 0) mover_->copy_on_device(recv_layout_.block(recv, me), send_layout_.block(send, me), stream);
  host_.alltoallv(out, staged_send_counts_, in, staged_recv_counts_);
  if (!recv_before.empty()) mover_->copy_to_device(recv_before, in.first(recv_before.size()), stream);
  if (!recv_after.empty()) mover_->copy_to_device(recv_after, in.subspan(recv_before.size()), stream);
  mover_->mark(stream);
  count_sent(send_counts);
}

template <typename T, typename Op>
void HostStagedCommunicator::staged_in_place(std::span<T> values, Stream stream, Op op) {
  mover_->wait_marked();
  const std::span<std::byte> staged = stage(send_staging_, values.size_bytes());
  if (!values.empty()) {
    mover_->copy_to_host(staged, std::as_bytes(values), stream);
    mover_->synchronize(stream);
  }
  op(as_values<T>(staged));  // every rank joins, with zero elements too
  if (!values.empty()) mover_->copy_to_device(std::as_writable_bytes(values), staged, stream);
  mover_->mark(stream);
}

void HostStagedCommunicator::do_allreduce_sum(std::span<std::int64_t> values, Stream stream) {
  staged_in_place(values, stream, [this](std::span<std::int64_t> v) { host_.allreduce_sum(v); });
}

void HostStagedCommunicator::do_allreduce_max(std::span<double> values, Stream stream) {
  staged_in_place(values, stream, [this](std::span<double> v) { host_.allreduce_max(v); });
}

void HostStagedCommunicator::do_allgather(std::span<const std::int64_t> mine, std::span<std::int64_t> all,
                                          Stream stream) {
  check_entries(all.size(), mine.size() * static_cast<std::size_t>(size()),
                "HostStagedCommunicator::allgather", "all");
  mover_->wait_marked();
  const std::span<std::byte> out = stage(send_staging_, mine.size_bytes());
  const std::span<std::byte> in = stage(recv_staging_, all.size_bytes());
  if (!mine.empty()) {
    mover_->copy_to_host(out, std::as_bytes(mine), stream);
    mover_->synchronize(stream);
  }
  host_.allgather(as_values<const std::int64_t>(out), as_values<std::int64_t>(in));
  if (!all.empty()) mover_->copy_to_device(std::as_writable_bytes(all), in, stream);
  mover_->mark(stream);
}

}  // namespace capserve::parallel
