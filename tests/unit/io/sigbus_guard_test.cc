// The SIGBUS guard under mapped conversions: a read of a mapping whose file
// was cut short is reported to the guarded call, and the process goes on; a
// fault outside a guarded call still kills the process as it would have.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include "../test_util.h"
#include "ckptfs/io.h"

namespace ckptfs {
namespace {

using ckptfs::testing::TempDir;

// Two pages of a file, mapped, then the file cut to nothing: the second page
// is past the end.
struct CutMapping {
  TempDir t;
  int fd = -1;
  char* base = nullptr;
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));

  CutMapping() {
    ckptfs::testing::WriteFile(t.path() + "/src", std::string(2 * page, 'a'));
    fd = ::open((t.path() + "/src").c_str(), O_RDWR | O_CLOEXEC);
    void* m = fd < 0 ? MAP_FAILED : ::mmap(nullptr, 2 * page, PROT_READ, MAP_SHARED, fd, 0);
    if (m != MAP_FAILED) base = static_cast<char*>(m);
  }
  ~CutMapping() {
    if (base != nullptr) ::munmap(base, 2 * page);
    if (fd >= 0) ::close(fd);
  }
};

struct Touch {
  const volatile char* at;
  char seen = 0;
  static void Run(void* self) {
    auto* t = static_cast<Touch*>(self);
    t->seen = *t->at;
  }
};

// Skips where there is no guard (a ThreadSanitizer build).
#define INSTALL_OR_SKIP()                                                            \
  do {                                                                               \
    Status installed = InstallSigbusGuard();                                         \
    if (installed.code() == Code::kUnsupported) GTEST_SKIP() << installed.message(); \
    ASSERT_TRUE(installed.ok()) << installed.message();                              \
  } while (0)

TEST(SigbusGuardTest, AFaultInAGuardedReadIsReportedAndTheProcessGoesOn) {
  INSTALL_OR_SKIP();
  ASSERT_TRUE(InstallSigbusGuard().ok());  // once per process; again is a no-op
  EXPECT_TRUE(SigbusGuardInstalled());
  CutMapping m;
  ASSERT_NE(m.base, nullptr);
  Touch ok{m.base + m.page};
  ASSERT_TRUE(RunGuarded(&Touch::Run, &ok));
  EXPECT_EQ(ok.seen, 'a');
  ASSERT_EQ(::ftruncate(m.fd, 0), 0);
  for (int i = 0; i < 3; ++i) {  // again and again: the handler stays armed
    Touch cut{m.base + m.page};
    EXPECT_FALSE(RunGuarded(&Touch::Run, &cut));
  }
  // Bytes of other mappings still read after a fault.
  std::string other(64, 'b');
  Touch fine{other.data()};
  EXPECT_TRUE(RunGuarded(&Touch::Run, &fine));
  EXPECT_EQ(fine.seen, 'b');
}

// Killed by SIGBUS, or under a sanitizer, whose handler the guard passes the
// fault on to, ended by its report.
TEST(SigbusGuardDeathTest, AFaultOutsideAGuardedReadStillKillsTheProcess) {
  INSTALL_OR_SKIP();
  EXPECT_DEATH(
      {
        CutMapping m;
        if (m.base == nullptr || ::ftruncate(m.fd, 0) != 0) ::_exit(3);
        volatile char c = m.base[m.page];
        (void)c;
        ::_exit(0);
      },
      "");
}

}  // namespace
}  // namespace ckptfs
