#include <gtest/gtest.h>

#include <cstdlib>
#include <random>
#include <tuple>
#include <vector>

#include "ckptfs/model.h"

namespace ckptfs {
namespace {

std::vector<ChecksumRange> Drain(const ChecksumSet& s) {
  std::vector<ChecksumRange> out;
  Status st = s.ForEach([&](const ChecksumRange& r) {
    out.push_back(r);
    return Status::Ok();
  });
  EXPECT_TRUE(st.ok()) << st.message();
  return out;
}

// What ForEach must give: sorted by (file, offset), the first added of a repeat.
std::vector<ChecksumRange> Expected(const std::vector<ChecksumRange>& added) {
  std::vector<ChecksumRange> v = added;
  std::stable_sort(v.begin(), v.end(), [](const ChecksumRange& a, const ChecksumRange& b) {
    return std::tie(a.file.v, a.offset) < std::tie(b.file.v, b.offset);
  });
  std::vector<ChecksumRange> out;
  for (const auto& r : v) {
    if (!out.empty() && out.back().file.v == r.file.v && out.back().offset == r.offset) continue;
    out.push_back(r);
  }
  return out;
}

void ExpectSame(const std::vector<ChecksumRange>& got, const std::vector<ChecksumRange>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].file.v, want[i].file.v) << i;
    EXPECT_EQ(got[i].offset, want[i].offset) << i;
    EXPECT_EQ(got[i].length, want[i].length) << i;
    EXPECT_EQ(got[i].crc32, want[i].crc32) << i;
    EXPECT_EQ(got[i].name, want[i].name) << i;
  }
}

std::vector<ChecksumRange> RandomRanges(size_t n, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::vector<ChecksumRange> v;
  for (size_t i = 0; i < n; ++i) {
    // Few files and offsets, so repeats land in different runs; names of
    // every length up to 40 (empty included) and distinct per addition.
    ChecksumRange r{FileId{static_cast<uint32_t>(rng() % 5)}, (rng() % 4000) * 64, rng() % 100000,
                    static_cast<uint32_t>(rng()), std::string(rng() % 41, static_cast<char>('a' + i % 26))};
    if (!r.name.empty()) r.name += std::to_string(i);
    v.push_back(std::move(r));
  }
  return v;
}

TEST(ChecksumSetTest, InMemoryIsSortedWithTheFirstOfARepeat) {
  std::vector<ChecksumRange> added = RandomRanges(3000, 1);
  ChecksumSet s;
  for (const auto& r : added) s.Add(r);
  EXPECT_EQ(s.size(), added.size());
  EXPECT_EQ(s.spilled_runs(), 0u);
  ExpectSame(Drain(s), Expected(added));
}

TEST(ChecksumSetTest, SpilledRunsMergeToTheSameOrderAsInMemory) {
  std::vector<ChecksumRange> added = RandomRanges(20000, 2);
  // ~4 KiB budget: dozens of runs, each with repeats of the others.
  ChecksumSet s(4096);
  for (const auto& r : added) s.Add(r);
  EXPECT_GT(s.spilled_runs(), 20u);
  ExpectSame(Drain(s), Expected(added));
  // A second pass reads the runs again (ForEach leaves the set as it was).
  ExpectSame(Drain(s), Expected(added));
  // Moved, it keeps its runs.
  ChecksumSet moved = std::move(s);
  ExpectSame(Drain(moved), Expected(added));
}

TEST(ChecksumSetTest, ManyRangesGoThroughASmallBudgetInRuns) {
  // 500k ranges (~20 MB as records) through a 256 KiB budget: dozens of runs
  // on disk, merged back in order with every name. (The peak RSS this bounds
  // is measured by bench/scale_bench.py, not here: sanitizer allocators keep
  // freed memory.)
  constexpr uint64_t kRanges = 500000;
  ChecksumSet s(size_t{256} << 10);
  for (uint64_t i = 0; i < kRanges; ++i) {
    // Interleaved over 7 files, so each run holds pieces of every file.
    s.Add(ChecksumRange{FileId{static_cast<uint32_t>(i % 7)}, i * 4096, 4096, static_cast<uint32_t>(i),
                        "d" + std::to_string(i)});
  }
  EXPECT_GE(s.spilled_runs(), kRanges * 32 / (size_t{256} << 10));
  uint64_t n = 0;
  uint32_t last_file = 0;
  uint64_t last_offset = 0;
  Status st = s.ForEach([&](const ChecksumRange& r) {
    if (n > 0 && std::tie(r.file.v, r.offset) <= std::tie(last_file, last_offset)) return Invalid("out of order");
    if (r.file.v != (r.offset / 4096) % 7 || r.crc32 != r.offset / 4096 ||
        r.name != "d" + std::to_string(r.offset / 4096)) {
      return Invalid("fields of another range at offset " + std::to_string(r.offset));
    }
    last_file = r.file.v;
    last_offset = r.offset;
    ++n;
    return Status::Ok();
  });
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(n, kRanges);
}

TEST(ChecksumSetTest, AnErrorFromTheCallerStopsTheMerge) {
  ChecksumSet s(1024);
  for (uint64_t i = 0; i < 500; ++i) s.Add(ChecksumRange{FileId{0}, i, 1, 0, "x"});
  int calls = 0;
  Status st = s.ForEach([&](const ChecksumRange&) { return ++calls == 10 ? Invalid("stop here") : Status::Ok(); });
  EXPECT_EQ(st.message(), "stop here");
  EXPECT_EQ(calls, 10);
}

TEST(ChecksumSetTest, AnUnwritableTmpdirIsAnErrorNamingIt) {
  const char* old = std::getenv("TMPDIR");
  std::string saved = old ? old : "";
  ::setenv("TMPDIR", "/nonexistent-ckptfs-tmpdir", 1);
  ChecksumSet s(256);
  for (uint64_t i = 0; i < 100; ++i) s.Add(ChecksumRange{FileId{0}, i, 1, 0, "x"});
  if (old)
    ::setenv("TMPDIR", saved.c_str(), 1);
  else
    ::unsetenv("TMPDIR");
  Status st = s.ForEach([](const ChecksumRange&) { return Status::Ok(); });
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("/nonexistent-ckptfs-tmpdir"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("TMPDIR"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace ckptfs
