// Progress: the line it draws, thread-safe counting, and ambient scopes.
#include "ckptfs/progress.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace ckptfs {
namespace {

TEST(ProgressTest, HumanBytesUsesBinaryUnits) {
  EXPECT_EQ(HumanBytes(0), "0 B");
  EXPECT_EQ(HumanBytes(1023), "1023 B");
  EXPECT_EQ(HumanBytes(1024), "1.0 KiB");
  EXPECT_EQ(HumanBytes(uint64_t{3} << 29), "1.5 GiB");
}

TEST(ProgressTest, LineShowsDoneTotalPercentRateAndEta) {
  Progress p("verifying /ck", uint64_t{4} << 20);
  p.Add(uint64_t{1} << 20);
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const std::string line = p.Line(false);
  EXPECT_EQ(line.rfind("verifying /ck: 1.0 MiB / 4.0 MiB (25%), ", 0), 0u) << line;
  EXPECT_NE(line.find("/s, ETA "), std::string::npos) << line;
  const std::string fin = p.Line(true);
  EXPECT_EQ(fin.rfind("verifying /ck: 1.0 MiB in ", 0), 0u) << fin;
  EXPECT_NE(fin.find("/s"), std::string::npos) << fin;
}

TEST(ProgressTest, UnknownTotalHasNoPercentOrEta) {
  Progress p("indexing /ck", 0, Progress::Unit::kItems, "files");
  p.Add(3);
  const std::string line = p.Line(false);
  EXPECT_EQ(line.rfind("indexing /ck: 3 files, ", 0), 0u) << line;
  EXPECT_EQ(line.find('%'), std::string::npos) << line;
  EXPECT_EQ(line.find("ETA"), std::string::npos) << line;
  EXPECT_NE(line.find("files/s"), std::string::npos) << line;
}

TEST(ProgressTest, AddIsThreadSafe) {
  Progress p("x", 0);
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t) {
    ts.emplace_back([&] {
      for (int i = 0; i < 10000; ++i) p.Add(3);
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(p.done(), 4u * 10000u * 3u);
  p.Finish();
  p.Finish();  // idempotent
}

TEST(ProgressTest, ScopesRouteReportsToTheInnermostAndRestore) {
  ReportProgress(5);  // no scope: dropped
  Progress outer("outer", 0), inner("inner", 0);
  {
    ProgressScope a(&outer);
    ReportProgress(2);
    {
      ProgressScope b(&inner);
      ReportProgress(7);
    }
    ReportProgress(1);
  }
  ReportProgress(100);
  EXPECT_EQ(outer.done(), 3u);
  EXPECT_EQ(inner.done(), 7u);
}

}  // namespace
}  // namespace ckptfs
