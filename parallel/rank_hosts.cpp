#include "parallel/rank_hosts.h"

#include <cstring>
#include <optional>
#include <span>

#include "parallel/mpi_call.h"

namespace capserve::parallel {
namespace {

// One string-valued MPI_T control variable, or nullopt when the library has no such variable (another MPI, or
// a component not built). Needs MPI_T_init_thread.
std::optional<std::string> string_cvar(const char* name) {
  int index = 0;
  if (MPI_T_cvar_get_index(name, &index) != MPI_SUCCESS) return std::nullopt;
  MPI_Datatype type = MPI_DATATYPE_NULL;
  int name_len = 0;
  int verbosity = 0;
  int bind = 0;
  int scope = 0;
  if (MPI_T_cvar_get_info(index, nullptr, &name_len, &verbosity, &type, nullptr, nullptr, nullptr, &bind,
                          &scope) != MPI_SUCCESS ||
      type != MPI_CHAR)
    return std::nullopt;
  MPI_T_cvar_handle handle = nullptr;
  int count = 0;
  if (MPI_T_cvar_handle_alloc(index, nullptr, &handle, &count) != MPI_SUCCESS) return std::nullopt;
  // A string variable's count is its buffer size; a longer buffer keeps the terminator in any case.
  std::vector<char> value(static_cast<std::size_t>(count) + 256, '\0');
  const bool read = MPI_T_cvar_read(handle, value.data()) == MPI_SUCCESS;
  MPI_T_cvar_handle_free(&handle);
  if (!read) return std::nullopt;
  return std::string(value.data());
}

}  // namespace

std::vector<RankHost> gather_rank_hosts(MpiWorld& world) {
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  mpi::check(MPI_Get_processor_name(name, &len), "gather_rank_hosts", "MPI_Get_processor_name");
  // Local rank and size first (two ints), then the name's bytes.
  std::vector<std::byte> mine(2 * sizeof(int) + static_cast<std::size_t>(len));
  const int local[2] = {world.local_rank(), world.local_size()};
  std::memcpy(mine.data(), local, sizeof local);
  std::memcpy(mine.data() + sizeof local, name, static_cast<std::size_t>(len));
  std::vector<RankHost> hosts;
  for (const std::vector<std::byte>& bytes : world.gather(mine, 0)) {
    int theirs[2] = {0, 1};
    std::memcpy(theirs, bytes.data(), sizeof theirs);
    const auto text = std::span(bytes).subspan(sizeof theirs);
    hosts.push_back(
        {std::string(reinterpret_cast<const char*>(text.data()), text.size()), theirs[0], theirs[1]});
  }
  return hosts;
}

std::string mpi_transport() {
  int provided = 0;
  if (MPI_T_init_thread(MPI_THREAD_SINGLE, &provided) != MPI_SUCCESS) return "unknown";
  const auto pml = string_cvar("pml");
  const auto btl = string_cvar("btl");
  const auto tcp_if = string_cvar("btl_tcp_if_include");
  MPI_T_finalize();
  if (!pml && !btl) return "unknown";
  const auto or_any = [](const std::optional<std::string>& v) { return v && !v->empty() ? *v : "any"; };
  std::string text = "pml " + or_any(pml) + ", btl " + or_any(btl);
  // The interface list matters only where TCP may carry traffic.
  const std::string btls = or_any(btl);
  if (tcp_if && !tcp_if->empty() && (btls == "any" || btls.find("tcp") != std::string::npos))
    text += " on " + *tcp_if;
  return text;
}

}  // namespace capserve::parallel
