#pragma once
// Where the ranks of a job run and how they talk, for the start-up log of a job that may span machines: each
// rank's host (MPI_Get_processor_name) and place among the ranks of that host, and the transport Open MPI was
// told to use (its MCA selection, read through the MPI tool interface).
#include <string>
#include <vector>

#include "parallel/mpi_world.h"

namespace capserve::parallel {

struct RankHost {
  std::string host;
  int local_rank = 0;
  int local_size = 1;
};

// Collective over `world`: rank 0 gets one entry per rank (index = rank), the other ranks an empty vector.
std::vector<RankHost> gather_rank_hosts(MpiWorld& world);

// This process's transport selection, e.g. "pml ob1, btl self,vader,tcp on 10.0.0.0/24": Open MPI's pml and
// btl control variables ("any" where unset: Open MPI picks the best it finds) and the TCP interface list when
// one is set. "unknown" when the MPI library exposes none of them.
std::string mpi_transport();

}  // namespace capserve::parallel
