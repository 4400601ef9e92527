// main for the MPI GoogleTest programs: every rank runs every test; rank 0 prints the usual report, the other
// ranks print only their failures (prefixed with their rank); the exit status is non-zero on every rank when
// any rank failed.
#include <gtest/gtest.h>

#include <cstdio>

#include "tests/mpi/mpi_gtest_main.h"

namespace capserve::test {
namespace {

parallel::MpiWorld* g_world = nullptr;

class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}

  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_,
                 result.file_name() != nullptr ? result.file_name() : "unknown file", result.line_number(),
                 result.message());
  }

  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (info.result()->Failed()) {
      std::fprintf(stderr, "[rank %d] FAILED %s.%s\n", rank_, info.test_suite_name(), info.name());
    }
  }

 private:
  int rank_;
};

}  // namespace

parallel::MpiWorld& mpi_world() {
  return *g_world;
}

}  // namespace capserve::test

int main(int argc, char** argv) {
  capserve::parallel::MpiWorld world(argc, argv);
  capserve::test::g_world = &world;
  ::testing::InitGoogleTest(&argc, argv);
  if (world.rank() != 0) {
    ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new capserve::test::FailurePrinter(world.rank()));
  }
  const int rc = RUN_ALL_TESTS();
  const bool all_passed = world.all_agree(rc == 0);
  if (!all_passed && world.rank() == 0) {
    std::fprintf(stderr, "mpi_gtest_main: a test failed on at least one of %d ranks (see [rank N] lines)\n",
                 world.size());
  }
  capserve::test::g_world = nullptr;
  return all_passed ? 0 : 1;
}
