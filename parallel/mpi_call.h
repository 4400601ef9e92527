#pragma once
// Small helpers shared by the MPI-backed classes of parallel/: turning an MPI error code into an exception
// that names the call, and giving MPI a valid buffer address for zero-length transfers.
#include <mpi.h>

#include <stdexcept>
#include <string>

namespace capserve::parallel::mpi {

// Throws std::runtime_error "<who>: <what> failed: <MPI's message>" unless rc is MPI_SUCCESS.
inline void check(int rc, const char* who, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw std::runtime_error(std::string(who) + ": " + what + " failed: " + std::string(text, len));
}

// MPI calls need a valid address even for zero elements, and an empty span's or vector's data() may be null.
template <typename T>
T* address(T* p) {
  static T dummy{};
  return p != nullptr ? p : &dummy;
}

}  // namespace capserve::parallel::mpi
