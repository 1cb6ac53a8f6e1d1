// The policy trusts a GPU backend only after its bytes matched the CPU's:
// fake GPU backends (the CPU backend with one byte of one kind of output
// corrupted) must be caught by the check before the first plan or by the
// calibration, disabled for the mount (every plan on the CPU, `on` included)
// and reported by an error log line naming the kind and the first differing
// byte; an honest one stays in use.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

#include "../test_util.h"
#include "ckptfs/io.h"
#include "ckptfs/transforms.h"

namespace ckptfs {
namespace {

using ckptfs::testing::TempDir;

enum class Fault {
  kNone,
  kWiden,      // byte 1001 of every widen plan's output
  kLargeCopy,  // a byte of copy plans of 1 MiB and more only (the check plans are smaller)
  kMean,       // byte 7 of every mean
  kCrc,        // the low byte of every non-empty range's CRC
};

class FakeGpu final : public Transforms {
 public:
  explicit FakeGpu(Fault f) : fault_(f) {}
  const char* name() const override { return "fake-gpu"; }

  Status Gather(const char* src, uint64_t src_len, std::span<const GatherOp> ops, DType out, char* dst,
                uint64_t dst_len) override {
    ++plans_;
    RETURN_IF_ERROR(CpuTransforms().Gather(src, src_len, ops, out, dst, dst_len));
    const TransformKind k = ClassifyPlan(ops, out);
    if (fault_ == Fault::kWiden && k == TransformKind::kWiden && dst_len > 1001) dst[1001] ^= 0x10;
    if (fault_ == Fault::kLargeCopy && k == TransformKind::kCopy && dst_len >= (1u << 20)) dst[dst_len - 3] ^= 1;
    return Status::Ok();
  }
  Status Mean(const char* src, uint32_t copies, uint64_t numel, DType dt, char* dst) override {
    RETURN_IF_ERROR(CpuTransforms().Mean(src, copies, numel, dt, dst));
    if (fault_ == Fault::kMean && numel * DTypeSize(dt) > 7) dst[7] ^= 0x40;
    return Status::Ok();
  }
  Status Crc32c(const char* data, uint64_t len, std::span<const ByteRange> ranges, uint32_t* out) override {
    RETURN_IF_ERROR(CpuTransforms().Crc32c(data, len, ranges, out));
    for (size_t i = 0; i < ranges.size(); ++i) {
      if (fault_ == Fault::kCrc && ranges[i].length > 0) out[i] ^= 1;
    }
    return Status::Ok();
  }
  Result<std::unique_ptr<Pipeline>> Begin() override { return CpuTransforms().Begin(); }
  int plans() const { return plans_; }

 private:
  Fault fault_;
  int plans_ = 0;
};

int& LogCount() {
  static int n = 0;
  return n;
}

// The log lines written while `f` runs.
template <typename F>
std::string CaptureLog(const TempDir& t, F f) {
  const std::string path = t.path() + "/log" + std::to_string(++LogCount());  // a new file each time: the log appends
  SetLogFile(path);
  f();
  SetLogFile("");
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(GpuTrustTest, TheCpuPassesItsOwnCheck) {
  Status s = CheckAgainstCpu(CpuTransforms());
  EXPECT_TRUE(s.ok()) << s.message();
  Status honest = CheckAgainstCpu(*std::make_unique<FakeGpu>(Fault::kNone));
  EXPECT_TRUE(honest.ok()) << honest.message();
}

TEST(GpuTrustTest, OneWrongWidenedByteDisablesTheGpuLoudly) {
  for (GpuMode mode : {GpuMode::kAuto, GpuMode::kOn}) {
    TempDir t;
    auto p = TransformPolicy::MakeWith(mode, std::make_unique<FakeGpu>(Fault::kWiden), "");
    ASSERT_NE(p->gpu(), nullptr);
    Transforms* picked = nullptr;
    const std::string log = CaptureLog(t, [&] { picked = &p->For(TransformKind::kWiden, 64ull << 20); });
    EXPECT_EQ(picked, &CpuTransforms());
    EXPECT_TRUE(p->gpu_disabled());
    const std::string why = p->disabled_reason();
    EXPECT_NE(why.find("fake-gpu output differs from the cpu's on a widen plan (bfloat16 -> float32"),
              std::string::npos)
        << why;
    EXPECT_NE(why.find("first differing byte at offset 1001 "), std::string::npos) << why;
    EXPECT_NE(log.find(" error: gpu transforms DISABLED for this mount"), std::string::npos) << log;
    EXPECT_NE(log.find("widen plan"), std::string::npos) << log;
    EXPECT_NE(log.find("first differing byte at offset 1001 "), std::string::npos) << log;
    // Every kind and size stays on the CPU from now on, and nothing is logged again.
    const std::string later = CaptureLog(t, [&] {
      for (int k = 0; k < kTransformKinds; ++k) {
        EXPECT_EQ(&p->For(static_cast<TransformKind>(k), 1ull << 30), &CpuTransforms());
        EXPECT_EQ(&p->For(static_cast<TransformKind>(k), 4096), &CpuTransforms());
      }
    });
    EXPECT_EQ(later.find("error"), std::string::npos) << later;
    EXPECT_NE(p->Describe().find("disabled"), std::string::npos) << p->Describe();
  }
}

TEST(GpuTrustTest, AWrongMeanOrCrcIsCaughtToo) {
  struct C {
    Fault f;
    const char* what;
  };
  for (const C& c : {C{Fault::kMean, "on a mean plan (float32, 3 copies of 1001): first differing byte at offset 7 "},
                     C{Fault::kCrc, "on a crc32c plan (9 bytes): first differing byte at offset 0 "}}) {
    TempDir t;
    auto p = TransformPolicy::MakeWith(GpuMode::kOn, std::make_unique<FakeGpu>(c.f), "");
    const std::string log = CaptureLog(t, [&] { EXPECT_EQ(&p->For(TransformKind::kCopy, 1), &CpuTransforms()); });
    EXPECT_NE(p->disabled_reason().find(c.what), std::string::npos) << p->disabled_reason();
    EXPECT_NE(log.find(c.what), std::string::npos) << log;
  }
}

// The check plans are small; a GPU wrong only on large plans passes them, and
// the calibration, which compares every output it times, catches it. Nothing
// is cached, so the next mount checks again.
TEST(GpuTrustTest, CalibrationComparesEveryOutputItTimes) {
  TempDir t;
  FakeGpu large(Fault::kLargeCopy);
  EXPECT_TRUE(CheckAgainstCpu(large).ok());
  auto c = Calibrate(large);
  ASSERT_TRUE(c.ok());
  EXPECT_NE(c->mismatch.find(
                "copy plan (float32 -> float32, 2 ops, 67108864 bytes out): first differing byte at offset 67108861 "),
            std::string::npos)
      << c->mismatch;
  for (uint64_t x : c->crossover) EXPECT_EQ(x, Calibration::kNever);

  const std::string cache = t.path() + "/gpu-calibration.json";
  auto p = TransformPolicy::MakeWith(GpuMode::kAuto, std::make_unique<FakeGpu>(Fault::kLargeCopy), cache);
  const std::string log =
      CaptureLog(t, [&] { EXPECT_EQ(&p->For(TransformKind::kCopy, 64ull << 20), &CpuTransforms()); });
  EXPECT_TRUE(p->gpu_disabled());
  EXPECT_NE(log.find("gpu transforms DISABLED for this mount, every transform runs on the cpu: calibration: fake-gpu "
                     "output differs from the cpu's on a copy plan"),
            std::string::npos)
      << log;
  EXPECT_FALSE(std::ifstream(cache).good());
}

// A cached calibration says how fast the device was, not that it is right:
// the check still runs before the first plan.
TEST(GpuTrustTest, ACachedCalibrationDoesNotSkipTheCheck) {
  TempDir t;
  const std::string cache = t.path() + "/gpu-calibration.json";
  std::ofstream(cache) << R"({"device": "fake-gpu", "crossover": [1048576, 1048576, 1048576, 1048576]})";
  auto honest = TransformPolicy::MakeWith(GpuMode::kAuto, std::make_unique<FakeGpu>(Fault::kNone), cache);
  EXPECT_EQ(&honest->For(TransformKind::kWiden, 1ull << 30), honest->gpu());  // the cache applies
  EXPECT_FALSE(honest->gpu_disabled());
  auto wrong = TransformPolicy::MakeWith(GpuMode::kAuto, std::make_unique<FakeGpu>(Fault::kWiden), cache);
  const std::string log =
      CaptureLog(t, [&] { EXPECT_EQ(&wrong->For(TransformKind::kWiden, 1ull << 30), &CpuTransforms()); });
  EXPECT_TRUE(wrong->gpu_disabled());
  EXPECT_NE(log.find("first differing byte at offset 1001 "), std::string::npos) << log;
}

// An honest GPU stays in use, and `auto` neither checks nor calibrates for
// plans under 1 MiB.
TEST(GpuTrustTest, AnHonestGpuIsUsed) {
  auto fake = std::make_unique<FakeGpu>(Fault::kNone);
  FakeGpu* f = fake.get();
  auto on = TransformPolicy::MakeWith(GpuMode::kOn, std::move(fake), "");
  EXPECT_EQ(&on->For(TransformKind::kTinyRuns, 1), f);
  EXPECT_FALSE(on->gpu_disabled());
  EXPECT_EQ(on->disabled_reason(), "");
  auto fake2 = std::make_unique<FakeGpu>(Fault::kNone);
  FakeGpu* f2 = fake2.get();
  auto aut = TransformPolicy::MakeWith(GpuMode::kAuto, std::move(fake2), "");
  EXPECT_EQ(&aut->For(TransformKind::kWiden, 4096), &CpuTransforms());
  EXPECT_EQ(f2->plans(), 0);
  auto off = TransformPolicy::MakeWith(GpuMode::kOff, std::make_unique<FakeGpu>(Fault::kWiden), "");
  EXPECT_EQ(off->gpu(), nullptr);
  EXPECT_EQ(&off->For(TransformKind::kWiden, 1ull << 30), &CpuTransforms());
}

}  // namespace
}  // namespace ckptfs
