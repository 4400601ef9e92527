// CUDA emulation: an NCCL stand-in over MPI for the calls CapServe makes, declared by the real nccl.h. Device
// memory is host memory here, so every operation is the matching MPI operation on the buffers. It enforces
// the API's contracts that a GPU run would break on (a hang, garbage, or an error):
//   - ncclCommInitRank / ncclCommInitRankConfig: MPI must be running, every rank of MPI_COMM_WORLD joins,
//   with
//     the same id and size, each passing its MPI_COMM_WORLD rank; the communicator keeps the device that was
//     current. The config must come from NCCL_CONFIG_INITIALIZER.
//   - Non-blocking communicators (config.blocking = 0): init returns ncclInProgress and joins the other ranks
//     (MPI_Comm_idup, then MPI_Iallgather of the ids) only as ncclCommGetAsyncError is polled. Every
//     operation (ncclGroupEnd, a collective, a send or receive outside a group) returns ncclInProgress and
//     stays so for two polls. Using the communicator while it is ncclInProgress fails with ncclInvalidUsage
//     (not kept as its async error: polling goes on). Aborting it while it still joins parks the pending MPI
//     request and its buffers for the process's life: MPI can neither cancel nor free a collective request,
//     and MPI_Finalize does not wait for it.
//   - ncclGroupStart/End nest; sends and receives queued in a group start together at the outermost End (so
//     a rank may send to and receive from a peer in one group). Sends and receives must pair up between the
//     ranks (one left without a partner for CAPSERVE_CUDA_EMU_NCCL_TIMEOUT_S seconds fails, where a GPU would
//     hang), and a receive must get exactly the bytes it asked for (the sender's count travels with the
//     data).
//   - Collectives are checked to be the same call on every rank, in the same order (kind, count, type, op).
//   - Buffers must be device memory, the stream must belong to the communicator's device, and that device
//     must be current.
// A failed check returns the error NCCL would (ncclInvalidArgument / ncclInvalidUsage), names the fault in
// ncclGetLastError, and is kept as the communicator's async error (ncclCommGetAsyncError). A rank whose send
// or receive failed tells the others, which see ncclRemoteError only when they poll ncclCommGetAsyncError, as
// with NCCL (no earlier than the poll after their operation left ncclInProgress): their own calls are not
// stopped by it. Everything completes before the call returns, so streams are trivially in order, except a
// send or receive with a rank that failed (cuda_emu::crash_at_next_nccl_exchange, or a failed check there):
// the call returns as if enqueued and the stream hangs, as behind an NCCL kernel that waits forever, until
// ncclCommAbort (emu_state.h, hang_stream).
#include <mpi.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cuda_emu.h"
#include "emu_state.h"
#include "handle_registry.h"

namespace cd = capserve::cuda_emu::detail;

namespace capserve::cuda_emu::detail {

// A communicator's initialisation, until it completes; MPI writes into it asynchronously, so it has a stable
// address and outlives an abort.
struct Join {
  enum class Stage : std::uint8_t { delayed, duplicating, gathering };
  Stage stage = Stage::delayed;
  std::chrono::steady_clock::time_point start_at;  // delay_next_nccl_init
  MPI_Comm mpi = MPI_COMM_NULL;
  MPI_Request request = MPI_REQUEST_NULL;
  std::int64_t mine[3] = {};  // rank, nranks, the id's nonce
  std::vector<std::int64_t> all;
};

}  // namespace capserve::cuda_emu::detail

struct ncclComm {
  MPI_Comm mpi = MPI_COMM_NULL;
  int rank = 0;
  int size = 1;
  int device = 0;
  bool blocking = true;
  std::uint64_t collectives = 0;  // issued so far, for the order check
  ncclResult_t async_error = ncclSuccess;
  std::string last_error;
  std::unique_ptr<capserve::cuda_emu::detail::Join> join;  // set while initialising
  int polls_in_progress = 0;  // non-blocking: polls before the last operation leaves ncclInProgress
  // Streams its sends and receives with a failed peer hang (capserve::cuda_emu::detail::hang_stream), until
  // ncclCommAbort.
  std::vector<std::shared_ptr<capserve::cuda_emu::detail::StreamHang>> hangs;
};

namespace capserve::cuda_emu::detail {
namespace {

constexpr char kIdMagic[] = "capserve-emu-nccl";
constexpr int kTagSize = 1;
constexpr int kTagData = 2;
constexpr int kTagNotice = 3;  // a rank's failure, for the others' ncclCommGetAsyncError

thread_local std::string global_last_error;

// One queued send or receive of a group.
struct PointToPoint {
  ncclComm* comm;
  bool send;
  void* buffer;
  std::int64_t bytes;
  int peer;
  cudaStream_t stream;
};

// An exchange's byte counts on the wire and the sends it gave up on (a failed peer): MPI may still read them,
// so they are kept for the process's life.
struct Wire {
  std::vector<std::int64_t> sizes;
  std::vector<MPI_Request> abandoned_sends;
};
std::vector<std::unique_ptr<Wire>>& parked_wires() {
  static auto* const wires = new std::vector<std::unique_ptr<Wire>>;  // deliberately never destroyed
  return *wires;
}

std::atomic<bool> crash_next_exchange{false};  // crash_at_next_nccl_exchange

struct GroupState {
  int depth = 0;
  std::vector<PointToPoint> queued;
  ncclResult_t error = ncclSuccess;  // a call in the group failed: End reports it
};
thread_local GroupState group;

// Tells the other ranks that this one failed: as with NCCL, they learn it only by polling
// ncclCommGetAsyncError (their own calls go on, and may wait forever for this rank).
void notify_peers(ncclComm* comm, const std::string& what) {
  static std::deque<std::string> sent;  // buffers of sends never waited for: kept for the process's life
  sent.push_back("rank " + std::to_string(comm->rank) + " failed: " + what);
  for (int r = 0; r < comm->size; ++r) {
    if (r == comm->rank) continue;
    MPI_Request request = MPI_REQUEST_NULL;
    MPI_Isend(sent.back().data(), static_cast<int>(sent.back().size()), MPI_CHAR, r, kTagNotice, comm->mpi,
              &request);
    MPI_Request_free(&request);
  }
}

// `sticky`: kept as the communicator's async error (it is then failed for good).
ncclResult_t nccl_fail(ncclComm* comm, ncclResult_t rc, std::string what, bool sticky = true) {
  global_last_error = what;
  if (handles<ncclComm>().find(comm) != nullptr) {
    comm->last_error = std::move(what);
    if (sticky) comm->async_error = rc;
  }
  if (group.depth > 0 && group.error == ncclSuccess) group.error = rc;
  return rc;
}

std::size_t type_bytes(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
      return 8;
    default:
      return 0;
  }
}

MPI_Datatype mpi_type(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
      return MPI_INT8_T;
    case ncclUint8:
      return MPI_UINT8_T;
    case ncclInt32:
      return MPI_INT32_T;
    case ncclUint32:
      return MPI_UINT32_T;
    case ncclInt64:
      return MPI_INT64_T;
    case ncclUint64:
      return MPI_UINT64_T;
    case ncclFloat32:
      return MPI_FLOAT;
    case ncclFloat64:
      return MPI_DOUBLE;
    default:
      return MPI_DATATYPE_NULL;  // fp16/bf16 reductions: not emulated
  }
}

MPI_Op mpi_op(ncclRedOp_t op) {
  switch (op) {
    case ncclSum:
      return MPI_SUM;
    case ncclProd:
      return MPI_PROD;
    case ncclMax:
      return MPI_MAX;
    case ncclMin:
      return MPI_MIN;
    default:
      return MPI_OP_NULL;
  }
}

// The communicator is usable from this thread on `stream`, with `bytes` of device memory at each buffer.
ncclResult_t check_call(ncclComm* comm, const char* call, cudaStream_t stream,
                        std::initializer_list<std::pair<const void*, std::size_t>> buffers) {
  if (handles<ncclComm>().find(comm) == nullptr)
    return nccl_fail(nullptr, ncclInvalidArgument, std::string(call) + ": not a live communicator");
  if (comm->join != nullptr)
    return nccl_fail(
        comm, ncclInvalidUsage,
        std::string(call) +
            ": the communicator is still initialising (ncclCommInitRankConfig returned "
            "ncclInProgress); poll ncclCommGetAsyncError until it is no longer ncclInProgress first",
        false);
  if (comm->polls_in_progress > 0)
    return nccl_fail(
        comm, ncclInvalidUsage,
        std::string(call) +
            ": the communicator's previous operation is still ncclInProgress; poll "
            "ncclCommGetAsyncError until it is no longer ncclInProgress first (non-blocking mode)",
        false);
  if (comm->async_error != ncclSuccess)
    return nccl_fail(comm, comm->async_error,
                     std::string(call) + ": the communicator failed before (" + comm->last_error + ")");
  if (current_device() != comm->device)
    return nccl_fail(comm, ncclInvalidUsage,
                     std::string(call) + ": the communicator's device " + std::to_string(comm->device) +
                         " is not current on this thread (device " + std::to_string(current_device()) + ")");
  if (std::string why = check_launch_stream(stream); !why.empty())
    return nccl_fail(comm, ncclInvalidUsage, std::string(call) + ": " + why);
  for (const auto& [p, bytes] : buffers) {
    if (bytes == 0) continue;
    if (std::string why = check_range(p, bytes, MemoryKind::device, "buffer"); !why.empty())
      return nccl_fail(comm, ncclInvalidArgument, std::string(call) + ": " + why);
  }
  return ncclSuccess;
}

// Every rank must issue the same collective as its n-th: compare (kind, count, type, op) across the ranks.
ncclResult_t check_order(ncclComm* comm, const char* call, std::int64_t kind, std::int64_t count,
                         std::int64_t type, std::int64_t op) {
  const std::int64_t mine[4] = {kind, count, type, op};
  std::vector<std::int64_t> all(static_cast<std::size_t>(comm->size) * 4);
  MPI_Allgather(mine, 4, MPI_INT64_T, all.data(), 4, MPI_INT64_T, comm->mpi);
  const std::uint64_t index = comm->collectives++;
  for (int r = 0; r < comm->size; ++r) {
    const std::int64_t* theirs = all.data() + static_cast<std::ptrdiff_t>(r) * 4;
    if (std::equal(mine, mine + 4, theirs)) continue;
    return nccl_fail(comm, ncclInvalidUsage,
                     std::string(call) + ": collective #" + std::to_string(index) +
                         " differs between ranks: rank " + std::to_string(comm->rank) + " issued kind " +
                         std::to_string(kind) + " count " + std::to_string(count) + " type " +
                         std::to_string(type) + " op " + std::to_string(op) + ", rank " + std::to_string(r) +
                         " kind " + std::to_string(theirs[0]) + " count " + std::to_string(theirs[1]) +
                         " type " + std::to_string(theirs[2]) + " op " + std::to_string(theirs[3]) +
                         " (collectives must be issued in the same order everywhere)");
  }
  return ncclSuccess;
}

// The result of an operation that succeeded: a non-blocking communicator reports ncclInProgress and stays so
// for two polls of ncclCommGetAsyncError, so that a caller that polls once, or not at all, is caught.
ncclResult_t started(ncclComm* comm) {
  if (comm->blocking) return ncclSuccess;
  comm->polls_in_progress = 2;
  return ncclInProgress;
}

std::chrono::steady_clock::duration next_init_delay{};  // delay_next_nccl_init

// Joins parked by ncclCommAbort while MPI may still write into them.
std::vector<std::unique_ptr<Join>>& abandoned_joins() {
  static auto* const joins = new std::vector<std::unique_ptr<Join>>;  // deliberately never destroyed
  return *joins;
}

// Why the ranks' (rank, nranks, nonce) rule out one communicator over MPI_COMM_WORLD, or "".
std::string join_error(const Join& join, int world_rank, int world_size) {
  const auto nranks = join.mine[1];
  if (nranks != world_size)
    return "ncclCommInitRank: nranks " + std::to_string(nranks) + " but " + std::to_string(world_size) +
           " ranks joined with this id";
  if (join.mine[0] != world_rank)
    return "ncclCommInitRank: rank " + std::to_string(join.mine[0]) + " outside [0, " +
           std::to_string(nranks) + ") or not this process's MPI_COMM_WORLD rank " +
           std::to_string(world_rank) + " (the stand-in needs them equal)";
  for (int r = 0; r < world_size; ++r) {
    const std::int64_t* theirs = join.all.data() + static_cast<std::ptrdiff_t>(r) * 3;
    if (theirs[0] != r || theirs[1] != nranks || theirs[2] != join.mine[2])
      return "ncclCommInitRank: the ranks joining are not 0.." + std::to_string(world_size - 1) +
             " each once with one id and nranks (rank " + std::to_string(r) + " passed rank " +
             std::to_string(theirs[0]) + ", nranks " + std::to_string(theirs[1]) + ")";
  }
  return {};
}

// One step of the join, without waiting; clears comm->join once it completed (comm->async_error says how).
void advance_join(ncclComm* comm) {
  Join& join = *comm->join;
  if (join.stage == Join::Stage::delayed) {
    if (std::chrono::steady_clock::now() < join.start_at) return;
    MPI_Comm_idup(MPI_COMM_WORLD, &join.mpi, &join.request);
    join.stage = Join::Stage::duplicating;
  }
  int done = 0;
  MPI_Test(&join.request, &done, MPI_STATUS_IGNORE);
  if (done == 0) return;
  if (join.stage == Join::Stage::duplicating) {
    MPI_Comm_set_errhandler(join.mpi, MPI_ERRORS_ARE_FATAL);
    int size = 0;
    MPI_Comm_size(join.mpi, &size);
    join.all.resize(static_cast<std::size_t>(size) * 3);
    MPI_Iallgather(join.mine, 3, MPI_INT64_T, join.all.data(), 3, MPI_INT64_T, join.mpi, &join.request);
    join.stage = Join::Stage::gathering;
    return;
  }
  int world_rank = 0;
  int world_size = 0;
  MPI_Comm_rank(join.mpi, &world_rank);
  MPI_Comm_size(join.mpi, &world_size);
  comm->mpi = join.mpi;
  const std::string error = join_error(join, world_rank, world_size);
  comm->join.reset();
  if (!error.empty()) nccl_fail(comm, ncclInvalidArgument, error);
}

// The requests of an exchange and the operation of each.
struct Requests {
  std::vector<MPI_Request> requests;
  std::vector<std::size_t> op_of;
};

enum class Waited : std::uint8_t { done, timed_out, peer_failed };

// Waits for every request until the deadline (those still pending then stay unmatched). Stops early when a
// rank that a pending request waits for has failed (its notice is there, left for ncclCommGetAsyncError):
// then `failed_rank` is that rank.
Waited wait_until(Requests& list, const std::vector<PointToPoint>& ops,
                  std::chrono::steady_clock::time_point deadline, int& failed_rank) {
  ncclComm* comm = ops.front().comm;
  for (;;) {
    int done = 0;
    MPI_Testall(static_cast<int>(list.requests.size()), list.requests.data(), &done, MPI_STATUSES_IGNORE);
    if (done != 0) return Waited::done;
    int noticed = 0;
    MPI_Status status;
    MPI_Iprobe(MPI_ANY_SOURCE, kTagNotice, comm->mpi, &noticed, &status);
    for (std::size_t i = 0; noticed != 0 && i < list.requests.size(); ++i) {
      if (list.requests[i] == MPI_REQUEST_NULL || ops[list.op_of[i]].peer != status.MPI_SOURCE) continue;
      failed_rank = status.MPI_SOURCE;
      return Waited::peer_failed;
    }
    if (std::chrono::steady_clock::now() > deadline) return Waited::timed_out;
    std::this_thread::yield();
  }
}

// The exchange waits for a rank that failed: on a GPU its kernels would wait forever, the call itself having
// returned. Hangs the streams of its operations until ncclCommAbort. Its pending receives are cancelled; its
// pending sends (MPI cannot cancel a send) are parked with their byte counts.
ncclResult_t hang_on(const std::vector<PointToPoint>& ops, std::unique_ptr<Wire> wire,
                     std::initializer_list<Requests*> pending, int failed_rank) {
  for (Requests* list : pending) {
    for (std::size_t i = 0; i < list->requests.size(); ++i) {
      MPI_Request& r = list->requests[i];
      if (r == MPI_REQUEST_NULL) continue;
      if (ops[list->op_of[i]].send) {
        wire->abandoned_sends.push_back(r);
        continue;
      }
      MPI_Cancel(&r);
      MPI_Wait(&r, MPI_STATUS_IGNORE);
    }
  }
  ncclComm* comm = ops.front().comm;
  for (const PointToPoint& o : ops) {
    comm->hangs.push_back(hang_stream(
        o.stream, std::string(o.send ? "ncclSend to" : "ncclRecv from") + " rank " + std::to_string(o.peer) +
                      " on rank " + std::to_string(comm->rank) + ", in an exchange with rank " +
                      std::to_string(failed_rank) + ", which failed"));
  }
  parked_wires().push_back(std::move(wire));
  return ncclSuccess;
}

// The first operation still waiting, for the message.
std::string unpaired(const std::vector<PointToPoint>& ops, const Requests& list) {
  for (std::size_t i = 0; i < list.requests.size(); ++i) {
    if (list.requests[i] == MPI_REQUEST_NULL) continue;
    const PointToPoint& o = ops[list.op_of[i]];
    return std::string(o.send ? "ncclSend to" : "ncclRecv from") + " rank " + std::to_string(o.peer) +
           " on rank " + std::to_string(o.comm->rank) + " found no matching " +
           (o.send ? "ncclRecv" : "ncclSend") +
           " (sends and receives must pair up between the ranks, in the same order)";
  }
  return "a send or receive found no partner";
}

// crash_at_next_nccl_exchange: once every peer this rank receives from has posted its send (so that they are
// past enqueueing it), tells them this rank failed and fails here.
ncclResult_t crash(const std::vector<PointToPoint>& ops, std::chrono::steady_clock::time_point deadline) {
  ncclComm* comm = ops.front().comm;
  for (const PointToPoint& o : ops) {
    int posted = 0;
    while (!o.send && posted == 0 && std::chrono::steady_clock::now() < deadline) {
      MPI_Iprobe(o.peer, kTagSize, comm->mpi, &posted, MPI_STATUS_IGNORE);
      std::this_thread::yield();
    }
  }
  const std::string why = "the process died in an exchange (cuda_emu::crash_at_next_nccl_exchange)";
  notify_peers(comm, why);
  return nccl_fail(comm, ncclSystemError, "rank " + std::to_string(comm->rank) + ": " + why);
}

// Starts every send and receive, then waits for all. A receive learns the sender's byte count first.
ncclResult_t run_point_to_point(std::vector<PointToPoint>& ops) {
  ncclResult_t rc = ncclSuccess;
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                             std::chrono::duration<double>(nccl_timeout()));
  if (crash_next_exchange.exchange(false)) return crash(ops, deadline);
  auto wire = std::make_unique<Wire>();
  wire->sizes.resize(ops.size());
  Requests size_requests;
  Requests data_requests;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    PointToPoint& o = ops[i];
    MPI_Request r = MPI_REQUEST_NULL;
    if (o.send) {
      wire->sizes[i] = o.bytes;
      MPI_Isend(&wire->sizes[i], 1, MPI_INT64_T, o.peer, kTagSize, o.comm->mpi, &r);
      size_requests.requests.push_back(r);
      size_requests.op_of.push_back(i);
      MPI_Isend(o.buffer, static_cast<int>(o.bytes), MPI_BYTE, o.peer, kTagData, o.comm->mpi, &r);
      data_requests.requests.push_back(r);
      data_requests.op_of.push_back(i);
    } else {
      MPI_Irecv(&wire->sizes[i], 1, MPI_INT64_T, o.peer, kTagSize, o.comm->mpi, &r);
      size_requests.requests.push_back(r);
      size_requests.op_of.push_back(i);
    }
  }
  int failed_rank = -1;
  switch (wait_until(size_requests, ops, deadline, failed_rank)) {
    case Waited::done:
      break;
    case Waited::peer_failed:
      return hang_on(ops, std::move(wire), {&size_requests, &data_requests}, failed_rank);
    case Waited::timed_out: {
      const std::string why = unpaired(ops, size_requests);
      parked_wires().push_back(std::move(wire));  // MPI may still write into the sizes
      notify_peers(ops.front().comm, why);
      return nccl_fail(ops.front().comm, ncclInvalidUsage, why);
    }
  }
  // Receives whose sizes agree take the data; the others drain it into scratch and fail.
  std::vector<std::vector<std::byte>> scratch;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    PointToPoint& o = ops[i];
    if (o.send) continue;
    void* into = o.buffer;
    const std::int64_t sent = wire->sizes[i];
    if (sent != o.bytes) {
      rc = nccl_fail(o.comm, ncclInvalidUsage,
                     "ncclRecv on rank " + std::to_string(o.comm->rank) + " expects " +
                         std::to_string(o.bytes) + " bytes from rank " + std::to_string(o.peer) +
                         ", which sent " + std::to_string(sent) +
                         " (send and receive counts and types must match)");
      scratch.emplace_back(static_cast<std::size_t>(sent));
      into = scratch.back().data();
    }
    MPI_Request r = MPI_REQUEST_NULL;
    MPI_Irecv(into, static_cast<int>(sent), MPI_BYTE, o.peer, kTagData, o.comm->mpi, &r);
    data_requests.requests.push_back(r);
    data_requests.op_of.push_back(i);
  }
  switch (wait_until(data_requests, ops, deadline, failed_rank)) {
    case Waited::done:
      break;
    case Waited::peer_failed:
      return hang_on(ops, std::move(wire), {&data_requests}, failed_rank);
    case Waited::timed_out: {
      const std::string why = unpaired(ops, data_requests);
      parked_wires().push_back(std::move(wire));
      notify_peers(ops.front().comm, why);
      return nccl_fail(ops.front().comm, ncclInvalidUsage, why);
    }
  }
  if (rc != ncclSuccess) notify_peers(ops.front().comm, ops.front().comm->last_error);
  return rc;
}

ncclResult_t point_to_point(ncclComm* comm, bool send, void* buffer, std::size_t count, ncclDataType_t type,
                            int peer, cudaStream_t stream) {
  const char* call = send ? "ncclSend" : "ncclRecv";
  const std::size_t bytes = count * type_bytes(type);
  if (type_bytes(type) == 0)
    return nccl_fail(comm, ncclInvalidArgument, std::string(call) + ": unknown datatype");
  if (const ncclResult_t rc = check_call(comm, call, stream, {{buffer, bytes}}); rc != ncclSuccess) return rc;
  if (peer < 0 || peer >= comm->size)
    return nccl_fail(comm, ncclInvalidArgument,
                     std::string(call) + ": peer " + std::to_string(peer) + " outside [0, " +
                         std::to_string(comm->size) + ")");
  PointToPoint op{comm, send, buffer, static_cast<std::int64_t>(bytes), peer, stream};
  if (group.depth > 0) {
    group.queued.push_back(op);
    return ncclSuccess;
  }
  std::vector<PointToPoint> single{op};
  const ncclResult_t rc = run_point_to_point(single);
  return rc == ncclSuccess ? started(comm) : rc;
}

}  // namespace
}  // namespace capserve::cuda_emu::detail

namespace d = capserve::cuda_emu::detail;

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      return "unhandled cuda error";
    case ncclSystemError:
      return "unhandled system error";
    case ncclInternalError:
      return "internal error";
    case ncclInvalidArgument:
      return "invalid argument";
    case ncclInvalidUsage:
      return "invalid usage";
    case ncclRemoteError:
      return "remote process exited or there was a network error";
    case ncclInProgress:
      return "NCCL operation in progress";
    default:
      return "unknown result code";
  }
}

const char* ncclGetLastError(ncclComm_t comm) {
  return d::handles<ncclComm>().find(comm) != nullptr ? comm->last_error.c_str()
                                                      : d::global_last_error.c_str();
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (id == nullptr) return d::nccl_fail(nullptr, ncclInvalidArgument, "ncclGetUniqueId: null id");
  std::memset(id->internal, 0, sizeof id->internal);
  std::memcpy(id->internal, d::kIdMagic, sizeof d::kIdMagic);
  const std::uint64_t nonce = std::random_device{}();
  std::memcpy(id->internal + 64, &nonce, sizeof nonce);
  return ncclSuccess;
}

void capserve::cuda_emu::delay_next_nccl_init(std::chrono::steady_clock::duration delay) {
  d::next_init_delay = delay;
}

void capserve::cuda_emu::crash_at_next_nccl_exchange() {
  d::crash_next_exchange = true;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t* config) {
  if (comm == nullptr) return d::nccl_fail(nullptr, ncclInvalidArgument, "ncclCommInitRank: null comm");
  *comm = nullptr;
  int running = 0;
  MPI_Initialized(&running);
  if (running == 0)
    return d::nccl_fail(nullptr, ncclSystemError,
                        "ncclCommInitRank: the NCCL stand-in runs over MPI; MPI is not initialised");
  if (std::memcmp(id.internal, d::kIdMagic, sizeof d::kIdMagic) != 0)
    return d::nccl_fail(nullptr, ncclInvalidArgument,
                        "ncclCommInitRank: the id does not come from ncclGetUniqueId");
  const ncclConfig_t defaults = NCCL_CONFIG_INITIALIZER;
  if (config != nullptr && (config->size != defaults.size || config->magic != defaults.magic))
    return d::nccl_fail(nullptr, ncclInvalidArgument,
                        "ncclCommInitRankConfig: the config was not set from NCCL_CONFIG_INITIALIZER");
  // NCCL's default (NCCL_COMM_BLOCKING unset) is blocking.
  const bool blocking =
      config == nullptr || config->blocking == NCCL_CONFIG_UNDEF_INT || config->blocking != 0;

  auto join = std::make_unique<d::Join>();
  join->start_at = std::chrono::steady_clock::now() + d::next_init_delay;
  d::next_init_delay = {};
  std::uint64_t nonce = 0;
  std::memcpy(&nonce, id.internal + 64, sizeof nonce);
  join->mine[0] = rank;
  join->mine[1] = nranks;
  join->mine[2] = static_cast<std::int64_t>(nonce & 0x7FFFFFFFFFFFFFFF);
  auto state = std::make_unique<ncclComm>();
  state->rank = rank;
  state->size = nranks;
  state->device = cd::current_device();
  state->blocking = blocking;
  state->join = std::move(join);
  ncclComm* made = d::handles<ncclComm>().add(std::move(state));
  if (!blocking) {
    *comm = made;
    return ncclInProgress;
  }
  // Blocking: every rank of MPI_COMM_WORLD takes part, as every rank of ours does.
  std::this_thread::sleep_until(made->join->start_at);
  while (made->join != nullptr) {
    d::advance_join(made);
    std::this_thread::yield();
  }
  if (made->async_error != ncclSuccess) {
    const ncclResult_t rc = made->async_error;
    MPI_Comm_free(&made->mpi);
    d::handles<ncclComm>().remove(made);
    return rc;  // the last error is set
  }
  *comm = made;
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  return ncclCommInitRankConfig(comm, nranks, id, rank, nullptr);
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (d::handles<ncclComm>().find(comm) == nullptr)
    return d::nccl_fail(nullptr, ncclInvalidArgument, "ncclCommDestroy: not a live communicator");
  if (comm->join != nullptr)
    return d::nccl_fail(comm, ncclInvalidUsage,
                        "ncclCommDestroy: the communicator is still initialising; ncclCommAbort it", false);
  MPI_Comm_free(&comm->mpi);
  d::handles<ncclComm>().remove(comm);
  return ncclSuccess;
}

// Abort may run while peers wait elsewhere: nothing collective, the MPI communicator is left as it is. A join
// under way is parked (see the top of this file).
ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (d::handles<ncclComm>().find(comm) == nullptr)
    return d::nccl_fail(nullptr, ncclInvalidArgument, "ncclCommAbort: not a live communicator");
  if (comm->join != nullptr && comm->join->stage != d::Join::Stage::delayed)
    d::abandoned_joins().push_back(std::move(comm->join));
  // As NCCL's abort ends the communicator's kernels, so that the streams behind them go on.
  for (const auto& hang : comm->hangs) hang->released = true;
  d::handles<ncclComm>().remove(comm);
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async_error) {
  if (d::handles<ncclComm>().find(comm) == nullptr || async_error == nullptr)
    return d::nccl_fail(nullptr, ncclInvalidArgument, "ncclCommGetAsyncError: not a live communicator");
  if (comm->join != nullptr) d::advance_join(comm);
  if (comm->join != nullptr) {
    *async_error = ncclInProgress;
    return ncclSuccess;
  }
  // The poll that ends an operation's ncclInProgress reports it enqueued: a peer's failure shows at a later
  // poll, as NCCL's proxy learns of it while progressing the enqueued operation.
  if (comm->async_error == ncclSuccess && comm->polls_in_progress > 0) {
    *async_error = --comm->polls_in_progress > 0 ? ncclInProgress : ncclSuccess;
    return ncclSuccess;
  }
  if (comm->async_error == ncclSuccess) {
    int arrived = 0;
    MPI_Status status;
    MPI_Iprobe(MPI_ANY_SOURCE, d::kTagNotice, comm->mpi, &arrived, &status);
    if (arrived != 0) {
      int length = 0;
      MPI_Get_count(&status, MPI_CHAR, &length);
      std::string notice(static_cast<std::size_t>(length), '\0');
      MPI_Recv(notice.data(), length, MPI_CHAR, status.MPI_SOURCE, d::kTagNotice, comm->mpi,
               MPI_STATUS_IGNORE);
      comm->async_error = ncclRemoteError;
      comm->last_error = notice;
    }
  }
  *async_error = comm->async_error;
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  if (d::handles<ncclComm>().find(comm) == nullptr || count == nullptr) return ncclInvalidArgument;
  *count = comm->size;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  if (d::handles<ncclComm>().find(comm) == nullptr || rank == nullptr) return ncclInvalidArgument;
  *rank = comm->rank;
  return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device) {
  if (d::handles<ncclComm>().find(comm) == nullptr || device == nullptr) return ncclInvalidArgument;
  *device = comm->device;
  return ncclSuccess;
}

ncclResult_t ncclGroupStart() {
  ++d::group.depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  if (d::group.depth == 0)
    return d::nccl_fail(nullptr, ncclInvalidUsage, "ncclGroupEnd without a matching ncclGroupStart");
  if (--d::group.depth > 0) return ncclSuccess;
  std::vector<d::PointToPoint> ops;
  ops.swap(d::group.queued);
  const ncclResult_t failed = d::group.error;
  d::group.error = ncclSuccess;
  // A failed call drops the whole group on this rank; its peers' matching calls would wait forever, so the
  // caller must make the ranks agree (as NcclCommunicator does) rather than go on.
  if (failed != ncclSuccess) return failed;
  if (ops.empty()) return ncclSuccess;
  if (const ncclResult_t rc = d::run_point_to_point(ops); rc != ncclSuccess) return rc;
  ncclResult_t rc = ncclSuccess;
  for (const d::PointToPoint& o : ops) {
    if (d::started(o.comm) == ncclInProgress) rc = ncclInProgress;
  }
  return rc;
}

ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return d::point_to_point(comm, true, const_cast<void*>(sendbuff), count, datatype, peer, stream);
}

ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return d::point_to_point(comm, false, recvbuff, count, datatype, peer, stream);
}

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  const std::size_t bytes = count * d::type_bytes(datatype);
  if (d::mpi_type(datatype) == MPI_DATATYPE_NULL || d::mpi_op(op) == MPI_OP_NULL)
    return d::nccl_fail(comm, ncclInvalidArgument, "ncclAllReduce: datatype or op not emulated");
  if (const ncclResult_t rc =
          d::check_call(comm, "ncclAllReduce", stream, {{sendbuff, bytes}, {recvbuff, bytes}});
      rc != ncclSuccess)
    return rc;
  if (const ncclResult_t rc =
          d::check_order(comm, "ncclAllReduce", 1, static_cast<std::int64_t>(count), datatype, op);
      rc != ncclSuccess)
    return rc;
  MPI_Allreduce(sendbuff == recvbuff ? MPI_IN_PLACE : sendbuff, recvbuff, static_cast<int>(count),
                d::mpi_type(datatype), d::mpi_op(op), comm->mpi);
  return d::started(comm);
}

ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream) {
  const std::size_t bytes = sendcount * d::type_bytes(datatype);
  if (d::type_bytes(datatype) == 0)
    return d::nccl_fail(comm, ncclInvalidArgument, "ncclAllGather: unknown datatype");
  if (d::handles<ncclComm>().find(comm) == nullptr)
    return d::nccl_fail(nullptr, ncclInvalidArgument, "ncclAllGather: not a live communicator");
  if (const ncclResult_t rc =
          d::check_call(comm, "ncclAllGather", stream,
                        {{sendbuff, bytes}, {recvbuff, bytes * static_cast<std::size_t>(comm->size)}});
      rc != ncclSuccess)
    return rc;
  if (const ncclResult_t rc =
          d::check_order(comm, "ncclAllGather", 2, static_cast<std::int64_t>(sendcount), datatype, -1);
      rc != ncclSuccess)
    return rc;
  const bool in_place =
      static_cast<const std::byte*>(sendbuff) ==
      static_cast<const std::byte*>(recvbuff) + bytes * static_cast<std::size_t>(comm->rank);
  MPI_Allgather(in_place ? MPI_IN_PLACE : sendbuff, static_cast<int>(bytes), MPI_BYTE, recvbuff,
                static_cast<int>(bytes), MPI_BYTE, comm->mpi);
  return d::started(comm);
}
