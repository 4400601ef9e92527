#pragma once
// For tests linked with mpi_gtest_main.cpp (capserve_add_mpi_test): the process's MpiWorld, created by main
// before any test runs. Every test runs on every rank, in the same order, so tests may call collectives; a
// test must not skip a collective on some ranks only (use EXPECT_*, or ASSERT_* only on conditions that all
// ranks share).
#include "parallel/mpi_world.h"

namespace capserve::test {

parallel::MpiWorld& mpi_world();

}  // namespace capserve::test
