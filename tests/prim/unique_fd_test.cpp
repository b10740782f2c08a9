#include "prim/unique_fd.h"

#include <cerrno>
#include <fcntl.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "testing/status_matchers.h"

namespace memascend::prim {
namespace {

using ::memascend::testing::StatusIs;
using ::testing::HasSubstr;

bool IsOpen(int fd) { return fcntl(fd, F_GETFD) != -1 || errno != EBADF; }

TEST(UniqueFd, ClosesOnDestructionAndMoves) {
  int raw = -1;
  {
    ASSERT_OK_AND_ASSIGN(UniqueFd fd, Open("/dev/null", O_RDONLY));
    raw = fd.get();
    EXPECT_TRUE(IsOpen(raw));
    EXPECT_TRUE(fcntl(raw, F_GETFD) & FD_CLOEXEC);
    UniqueFd moved(std::move(fd));
    EXPECT_FALSE(fd.valid());  // NOLINT(bugprone-use-after-move): moved-from is empty
    EXPECT_EQ(moved.get(), raw);
    UniqueFd assigned;
    assigned = std::move(moved);
    EXPECT_EQ(assigned.get(), raw);
    EXPECT_TRUE(IsOpen(raw));
  }
  EXPECT_FALSE(IsOpen(raw));
}

TEST(UniqueFd, CloseReportsAndIsIdempotent) {
  ASSERT_OK_AND_ASSIGN(UniqueFd fd, Open("/dev/null", O_RDONLY));
  const int raw = fd.get();
  EXPECT_OK(fd.Close());
  EXPECT_FALSE(IsOpen(raw));
  EXPECT_OK(fd.Close());
}

TEST(UniqueFd, ReleaseGivesUpOwnership) {
  ASSERT_OK_AND_ASSIGN(UniqueFd fd, Open("/dev/null", O_RDONLY));
  const int raw = fd.Release();
  EXPECT_FALSE(fd.valid());
  EXPECT_TRUE(IsOpen(raw));
  ::close(raw);
}

TEST(Open, ErrorNamesThePath) {
  EXPECT_THAT(Open("/nonexistent/memascend-test", O_RDONLY),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("/nonexistent/memascend-test")));
}

// A file to make in a folder that is not there: the message says which folder.
TEST(Open, ACreateInAMissingFolderNamesTheFolder) {
  EXPECT_THAT(Open("/nonexistent/deeper/run.vol", O_RDWR | O_CREAT, 0644),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("the folder /nonexistent/deeper does not exist")));
}

}  // namespace
}  // namespace memascend::prim
