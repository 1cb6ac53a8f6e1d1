// Device-resident output (TensorReader::ReadToDevice, the Python package's
// device= reads), without a GPU: a backend whose "device memory" is host
// memory runs the device pipeline exactly as cuda_transforms.cu's does (the
// staged spans copied to a fresh device buffer from their 16-byte aligned
// start, BuildDeviceOutputOps, the kernels' own bodies from io/kernels.h
// through the emulated launch grid, writing straight into the destination;
// means averaged from the staged copies, then widened by a second gather).
// Every tensor of committed checkpoints written by real producers (DeepSpeed
// ZeRO padding strips and TP-averaged replicas, Meta's model-parallel merges,
// verl FSDP2 shards, DCP) is read whole and as a column box (a Shard(1)
// slice), in its own dtype and widened to float32, and must equal the host
// path's bytes. A device that fails mid-read falls back to the host path and
// uploads; untrusted kernels never run.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../fs_fixture.h"
#include "../test_util.h"
#include "ckptfs/fs.h"
#include "ckptfs/index.h"
#include "ckptfs/io.h"
#include "ckptfs/transforms.h"
#include "io/kernels.h"
#include "io/transform_internal.h"

namespace ckptfs {
namespace {

using kernels::DevOp;
using kernels::Launch;
using testing::TempDir;

struct HostFp8 {
  uint32_t operator()(int table, unsigned char b) const {
    return kernels::FloatToBits(Fp8DecodeTable(kernels::kFp8Dtypes[table])[b]);
  }
};

// Device memory as cudaMalloc gives it: 256-byte aligned, garbage inside.
struct DeviceBytes {
  explicit DeviceBytes(uint64_t n) : n(n) {
    p = static_cast<unsigned char*>(std::aligned_alloc(256, std::max<uint64_t>(256, (n + 255) / 256 * 256)));
    std::memset(p, 0xA5, std::max<uint64_t>(n, 1));
  }
  ~DeviceBytes() { std::free(p); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  unsigned char* p;
  uint64_t n;
};

void RunGather(const unsigned char* dsrc, unsigned char* dst, const kernels::KernelOps& kops) {
  const Launch l = kernels::GatherLaunch(kops.total);
  for (uint32_t b = 0; b < l.blocks; ++b) {
    for (uint32_t t = 0; t < l.threads; ++t) {
      kernels::GatherThread(b, l.threads, t, l.blocks, dsrc, dst, kops.ops.data(), static_cast<int>(kops.ops.size()),
                            kops.total, HostFp8{});
    }
  }
}

struct Counters {
  int pipelines = 0, gathers = 0, means = 0, uploads = 0;
  uint64_t uploaded = 0, staged_up = 0;
  int fail_after_gathers = -1;  // Submit fails once this many gathers ran (-1: never)
};

// cuda_transforms.cu's device pipeline with the launches emulated.
class EmulatedDevicePipeline final : public Transforms::Pipeline {
 public:
  explicit EmulatedDevicePipeline(Counters& c) : c_(c) {}
  Result<char*> Staging(int slot, uint64_t bytes) override {
    std::vector<char>& s = staging_[slot & 1];
    if (s.size() < bytes) s.resize(bytes);
    return s.data();
  }
  Status Submit(int slot, uint64_t src_len, std::span<const GatherOp> ops, DType out, char* dst,
                uint64_t dst_len) override {
    if (c_.fail_after_gathers >= 0 && c_.gathers >= c_.fail_after_gathers) {
      return Internal("emulated: an illegal memory access was encountered");
    }
    RETURN_IF_ERROR(ValidateOps(src_len, ops, out, dst_len));
    const PlanExtent ext = ExtentOf(ops, out);
    if (ext.elements == 0) return Status::Ok();
    const uint64_t sbase = ext.src_lo & ~15ull, sbytes = ext.src_hi - sbase;
    DeviceBytes dsrc(sbytes);
    std::memcpy(dsrc.p, staging_[slot & 1].data() + sbase, sbytes);
    c_.staged_up += sbytes;
    const kernels::KernelOps kops = kernels::BuildDeviceOutputOps(ops, out, sbase, reinterpret_cast<uintptr_t>(dst));
    RunGather(dsrc.p, reinterpret_cast<unsigned char*>(dst), kops);
    ++c_.gathers;
    return Status::Ok();
  }
  Status SubmitMean(int slot, uint32_t copies, uint64_t numel, DType dt, DType out, char* dst) override {
    RETURN_IF_ERROR(CheckMean(copies, dt));
    const uint64_t esz = DTypeSize(dt), in = numel * esz * copies;
    DeviceBytes dsrc(in), mean(numel * esz);
    std::memcpy(dsrc.p, staging_[slot & 1].data(), in);
    c_.staged_up += in;
    unsigned char* target = dt == out ? reinterpret_cast<unsigned char*>(dst) : mean.p;
    const Launch l = kernels::MeanLaunch(numel);
    for (uint32_t b = 0; b < l.blocks; ++b) {
      for (uint32_t t = 0; t < l.threads; ++t) {
        kernels::MeanThread(b, l.threads, t, l.blocks, dsrc.p, numel * esz, copies, dt, numel, target);
      }
    }
    if (dt != out) {
      const GatherOp op = kernels::ContiguousOp(numel, dt);
      RunGather(
          mean.p, reinterpret_cast<unsigned char*>(dst),
          kernels::BuildDeviceOutputOps(std::span<const GatherOp>(&op, 1), out, 0, reinterpret_cast<uintptr_t>(dst)));
    }
    ++c_.means;
    return Status::Ok();
  }
  Status Wait(int) override { return Status::Ok(); }

 private:
  Counters& c_;
  std::vector<char> staging_[2];
};

class EmulatedDevice final : public Transforms {
 public:
  const char* name() const override { return "emulated-device"; }
  Status Gather(const char* src, uint64_t src_len, std::span<const GatherOp> ops, DType out, char* dst,
                uint64_t dst_len) override {
    return CpuTransforms().Gather(src, src_len, ops, out, dst, dst_len);
  }
  Status Mean(const char* src, uint32_t copies, uint64_t numel, DType dt, char* dst) override {
    return CpuTransforms().Mean(src, copies, numel, dt, dst);
  }
  Status Crc32c(const char* data, uint64_t len, std::span<const ByteRange> ranges, uint32_t* out) override {
    return CpuTransforms().Crc32c(data, len, ranges, out);
  }
  Result<std::unique_ptr<Pipeline>> Begin() override { return CpuTransforms().Begin(); }
  Result<std::unique_ptr<Pipeline>> BeginDevice(void*) override {
    ++c.pipelines;
    return std::unique_ptr<Pipeline>(new EmulatedDevicePipeline(c));
  }
  Status Upload(const char* host, uint64_t n, char* dst, void*) override {
    ++c.uploads;
    c.uploaded += n;
    std::memcpy(dst, host, n);
    return Status::Ok();
  }
  int device() const override { return 0; }
  Counters c;
};

struct Coverage {
  int reads = 0, widened = 0, boxes = 0, merged = 0, means = 0;
};

// Host bytes vs device bytes of one rendering; `shift`: the destination
// starts that many bytes into a device allocation (a view into a tensor).
void Compare(Filesystem& fs, EmulatedDevice& dev, TensorId id, DType out, const Box* box, uint64_t shift,
             const std::string& what) {
  const TensorRecord& t = fs.index().tensors()[id.v];
  const uint64_t numel = box != nullptr ? static_cast<uint64_t>(NumelOf(box->lengths)) : t.Numel();
  const uint64_t len = numel * DTypeSize(out);
  std::vector<char> want(len);
  Status h = fs.ReadTensor(id, out, box, want.data(), len);
  ASSERT_TRUE(h.ok()) << what << ": " << h.message();
  DeviceBytes mem(len + shift);
  DeviceTarget target{&dev, nullptr, true};
  char* dst = reinterpret_cast<char*>(mem.p) + shift;
  Status d = fs.ReadTensor(id, out, box, dst, len, &target);
  ASSERT_TRUE(d.ok()) << what << ": " << d.message();
  ASSERT_EQ(0, std::memcmp(want.data(), dst, len)) << what << " differs from the host path";
}

// Every tensor: whole (own dtype, float32 when it widens), and a column box.
Coverage CheckAllTensors(const std::string& rel) {
  TempDir tmp;
  auto fs = testing::OpenFixtureCopy(tmp, rel);
  Coverage cov;
  if (fs == nullptr) return cov;
  EmulatedDevice dev;
  const auto& ts = fs->index().tensors();
  for (uint32_t i = 0; i < ts.size(); ++i) {
    const TensorRecord& t = ts[i];
    if (t.encoding != Encoding::kTensor || !t.error.empty() || t.Numel() == 0) continue;
    const std::string what = rel + " " + t.key;
    const int means0 = dev.c.means;
    Compare(*fs, dev, TensorId{i}, t.dtype, nullptr, 0, what);
    ++cov.reads;
    if (WidensToF32(t.dtype)) {
      Compare(*fs, dev, TensorId{i}, DType::kF32, nullptr, (i % 2) * 4, what + " as float32");
      ++cov.widened;
    }
    if (t.shape.size() >= 2 && t.shape[1] >= 2) {
      // A Shard(1) slice: the middle half of the columns, every row.
      Box b;
      b.offsets.assign(t.shape.size(), 0);
      b.lengths = t.shape;
      b.offsets[1] = t.shape[1] / 4;
      b.lengths[1] = std::max<int64_t>(1, t.shape[1] / 2);
      Compare(*fs, dev, TensorId{i}, WidensToF32(t.dtype) ? DType::kF32 : t.dtype, &b, 0, what + " column box");
      ++cov.boxes;
    }
    if (t.replicas > 1) cov.means += dev.c.means > means0;
    auto frags = fs->index().Fragments(TensorId{i});
    if (frags.ok() && frags->size() > 1) ++cov.merged;
    if (::testing::Test::HasFatalFailure()) return cov;
  }
  // Device reads never upload rendered bytes: only staged spans go up.
  EXPECT_EQ(dev.c.uploads, 0) << rel;
  EXPECT_GT(dev.c.staged_up, 0u) << rel;
  return cov;
}

TEST(DeviceOutputTest, ZeroPaddingStripsAndTpMergesEqualTheHostPath) {
  Coverage a = CheckAllTensors("ds_py3112/padspan_z2_dp4");
  Coverage b = CheckAllTensors("ds_py3112/z2_bf16_tp2_dp2");
  EXPECT_GT(a.reads + b.reads, 10);
  EXPECT_GT(a.merged + b.merged, 0);
  EXPECT_GT(a.widened + b.widened, 0);
  EXPECT_GT(a.boxes + b.boxes, 0);
}

TEST(DeviceOutputTest, MetaModelParallelMergesEqualTheHostPath) {
  Coverage c = CheckAllTensors("meta_llama_mp2/mp2");
  EXPECT_GT(c.merged, 0);
  EXPECT_GT(c.boxes, 0);
}

TEST(DeviceOutputTest, VerlFsdp2ShardsEqualTheHostPath) {
  Coverage c = CheckAllTensors("verl_fsdp2/global_step_1/actor");
  EXPECT_GT(c.merged, 0);
}

TEST(DeviceOutputTest, DcpEqualsTheHostPath) {
  Coverage c = CheckAllTensors("dcp_single");
  EXPECT_GT(c.reads, 0);
}

TEST(DeviceOutputTest, MegatronTorchDistEqualsTheHostPath) {
  Coverage c = CheckAllTensors("megatron_versions/mcore0.15.0-dist_tp2_pp2");
  EXPECT_GT(c.reads, 0);
}

// A mean of replicas (DeepSpeed's TP-averaged parameters,
// parameter_to_average_patterns: every TP rank holds a full copy and the
// tensor is their mean; no committed fixture has one, so it is built here):
// 3 copies, each split in two row fragments, over two 4 MiB steps, so both
// slots run; bf16 averaged in bf16, then also widened to float32.
TEST(DeviceOutputTest, MeansOfReplicasAreAveragedOnTheDevice) {
  TempDir tmp;
  const std::vector<int64_t> shape = {1100, 2048};
  const uint64_t numel = 1100 * 2048;
  Checkpoint ck;
  ck.info.family = Family::kUnknown;
  ck.files.push_back(SourceFile{"data.bin", 0, 0, 0});
  std::string data;
  std::mt19937 rng(11);
  for (DType dt : {DType::kBF16, DType::kF32}) {
    TensorRecord t;
    t.key = t.fqn = std::string("avg.") + std::string(DTypeName(dt));
    t.state = "param";
    t.role = Role::kParam;
    t.dtype = dt;
    t.shape = shape;
    t.replicas = 3;
    t.byte_size = numel * DTypeSize(dt);
    std::vector<Fragment> frags;
    for (uint32_t r = 0; r < 3; ++r) {
      for (int64_t half = 0; half < 2; ++half) {
        Fragment f = testing::WholeFragment({550, 2048}, dt, data.size());
        f.offsets = {half * 550, 0};
        f.replica = r;
        std::string bytes(f.data_length, '\0');
        // Finite values (bit patterns of a bf16 / f32 around 1), so the
        // mean's rounding, not NaN propagation, is what is compared.
        for (uint64_t k = 0; k < f.data_length / DTypeSize(dt); ++k) {
          if (dt == DType::kBF16) {
            const uint16_t v = static_cast<uint16_t>(0x3F00 + rng() % 0x200);
            std::memcpy(bytes.data() + 2 * k, &v, 2);
          } else {
            const uint32_t v = 0x3F000000u + static_cast<uint32_t>(rng() % 0x2000000);
            std::memcpy(bytes.data() + 4 * k, &v, 4);
          }
        }
        data += bytes;
        frags.push_back(f);
      }
    }
    t.num_fragments = static_cast<uint32_t>(frags.size());
    ck.tensors.push_back(t);
    ck.fragments.Append(frags);
  }
  testing::WriteFile(tmp.path() + "/data.bin", data);
  testing::FillStat(tmp.path(), &ck.files[0]);
  ASSERT_TRUE(Index::Build(ck, tmp.path() + "/index").ok());
  auto ix = Index::Open(tmp.path() + "/index", tmp.path());
  ASSERT_TRUE(ix.ok()) << ix.status().message();
  auto reader = TensorReader::Open(**ix, EngineKind::kPread);
  ASSERT_TRUE(reader.ok()) << reader.status().message();
  EmulatedDevice dev;
  DeviceTarget target{&dev, nullptr, true};
  int compared = 0;
  for (uint32_t id = 0; id < 2; ++id) {
    const DType src = (*ix)->tensors()[id].dtype;
    for (DType out : {src, DType::kF32}) {
      const uint64_t len = numel * DTypeSize(out);
      std::vector<char> want(len);
      ASSERT_TRUE((*reader)->ReadBox(TensorId{id}, out, nullptr, 0, len, want.data()).ok());
      DeviceBytes mem(len);
      const int means0 = dev.c.means;
      Status s = (*reader)->ReadToDevice(TensorId{id}, out, nullptr, target, reinterpret_cast<char*>(mem.p), len);
      ASSERT_TRUE(s.ok()) << s.message();
      EXPECT_EQ(0, std::memcmp(want.data(), mem.p, len)) << DTypeName(src) << " -> " << DTypeName(out);
      EXPECT_GE(dev.c.means - means0, src == DType::kBF16 ? 2 : 1);
      ++compared;
    }
  }
  EXPECT_EQ(compared, 4);
  EXPECT_EQ(dev.c.uploads, 0);
}

TEST(DeviceOutputTest, AFailingDeviceFallsBackToTheHostPathAndUploads) {
  TempDir tmp;
  auto fs = testing::OpenFixtureCopy(tmp, "ds_py3112/z2_bf16_tp2_dp2");
  ASSERT_NE(fs, nullptr);
  EmulatedDevice dev;
  dev.c.fail_after_gathers = 0;
  const auto& ts = fs->index().tensors();
  uint32_t id = 0;
  while (id < ts.size() && (ts[id].encoding != Encoding::kTensor || ts[id].replicas > 1 || ts[id].Numel() < 16)) ++id;
  ASSERT_LT(id, ts.size());
  const uint64_t len = ts[id].Numel() * 4;
  std::vector<char> want(len);
  ASSERT_TRUE(fs->ReadTensor(TensorId{id}, DType::kF32, nullptr, want.data(), len).ok());
  DeviceBytes mem(len);
  DeviceTarget target{&dev, nullptr, true};
  const uint64_t fallbacks0 = fs->reader().transform_counts().gpu_fallbacks;
  Status s = fs->ReadTensor(TensorId{id}, DType::kF32, nullptr, reinterpret_cast<char*>(mem.p), len, &target);
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_EQ(0, std::memcmp(want.data(), mem.p, len));
  EXPECT_EQ(dev.c.uploaded, len);
  EXPECT_EQ(fs->reader().transform_counts().gpu_fallbacks, fallbacks0 + 1);
}

TEST(DeviceOutputTest, UntrustedKernelsNeverRunOnlyUploads) {
  TempDir tmp;
  auto fs = testing::OpenFixtureCopy(tmp, "meta_llama_mp2/mp2");
  ASSERT_NE(fs, nullptr);
  EmulatedDevice dev;
  const auto& ts = fs->index().tensors();
  for (uint32_t i = 0; i < ts.size(); ++i) {
    if (ts[i].encoding != Encoding::kTensor || ts[i].Numel() == 0) continue;
    const uint64_t len = ts[i].Numel() * DTypeSize(ts[i].dtype);
    std::vector<char> want(len);
    ASSERT_TRUE(fs->ReadTensor(TensorId{i}, ts[i].dtype, nullptr, want.data(), len).ok());
    DeviceBytes mem(len);
    DeviceTarget target{&dev, nullptr, /*kernels_trusted=*/false};
    ASSERT_TRUE(fs->ReadTensor(TensorId{i}, ts[i].dtype, nullptr, reinterpret_cast<char*>(mem.p), len, &target).ok());
    EXPECT_EQ(0, std::memcmp(want.data(), mem.p, len)) << ts[i].key;
  }
  EXPECT_EQ(dev.c.pipelines, 0);
  EXPECT_EQ(dev.c.gathers, 0);
  EXPECT_GT(dev.c.uploads, 0);
}

TEST(DeviceOutputTest, BadArgumentsAreRefusedBeforeAnyDeviceWork) {
  TempDir tmp;
  auto fs = testing::OpenFixtureCopy(tmp, "dcp_single");
  ASSERT_NE(fs, nullptr);
  EmulatedDevice dev;
  DeviceTarget target{&dev, nullptr, true};
  const auto& ts = fs->index().tensors();
  uint32_t id = 0;
  while (id < ts.size() && ts[id].encoding != Encoding::kTensor) ++id;
  ASSERT_LT(id, ts.size());
  DeviceBytes mem(64);
  // A buffer of the wrong size, and a box outside the shape.
  EXPECT_FALSE(fs->ReadTensor(TensorId{id}, ts[id].dtype, nullptr, reinterpret_cast<char*>(mem.p), 3, &target).ok());
  Box b;
  b.offsets.assign(ts[id].shape.size(), 0);
  b.lengths = ts[id].shape;
  if (!b.lengths.empty()) b.lengths[0] += 1;
  if (!b.lengths.empty()) {
    EXPECT_FALSE(fs->ReadTensor(TensorId{id}, ts[id].dtype, &b, reinterpret_cast<char*>(mem.p), 8, &target).ok());
  }
  EXPECT_EQ(dev.c.pipelines, 0);
}

// The device-output ops themselves: a destination not 16-byte aligned takes
// the byte path (no typed store may be misaligned), aligned ones keep it.
TEST(DeviceOutputTest, UnalignedDestinationsTakeTheBytePath) {
  SyntheticPlan p = MakeMergePlan(DType::kBF16, 64, 2, 1 << 12);
  kernels::KernelOps aligned = kernels::BuildDeviceOutputOps(p.ops, DType::kF32, 0, 256);
  kernels::KernelOps shifted = kernels::BuildDeviceOutputOps(p.ops, DType::kF32, 0, 256 + 4);
  bool any = false;
  for (const DevOp& op : aligned.ops) any |= op.aligned != 0;
  EXPECT_TRUE(any);
  for (const DevOp& op : shifted.ops) EXPECT_EQ(op.aligned, 0);
  // And the bytes are the same either way.
  std::vector<char> want(p.out_bytes), got(p.out_bytes + 4);
  ASSERT_TRUE(CpuTransforms().Gather(p.src.data(), p.src.size(), p.ops, DType::kF32, want.data(), want.size()).ok());
  RunGather(reinterpret_cast<const unsigned char*>(p.src.data()), reinterpret_cast<unsigned char*>(got.data() + 4),
            kernels::BuildDeviceOutputOps(p.ops, DType::kF32, 0, reinterpret_cast<uintptr_t>(got.data() + 4)));
  EXPECT_EQ(0, std::memcmp(want.data(), got.data() + 4, want.size()));
}

// --- On a real device (skipped without one): the CUDA backend's device
// pipeline on the same fixtures, bytes copied back and compared.

class RealDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CudaOptions o;
    o.reset_when_idle = false;
    auto tf = MakeCudaTransforms(o);
    if (!tf.ok()) GTEST_SKIP() << tf.status().message();
    gpu_ = std::move(*tf);
  }
  // Every tensor whole (own dtype, float32 when it widens) and as a column
  // box, at a 16-byte aligned and a 4-byte shifted destination.
  void CheckAll(const std::string& rel) {
    TempDir tmp;
    auto fs = testing::OpenFixtureCopy(tmp, rel);
    ASSERT_NE(fs, nullptr);
    const auto& ts = fs->index().tensors();
    int n = 0;
    for (uint32_t i = 0; i < ts.size(); ++i) {
      const TensorRecord& t = ts[i];
      if (t.encoding != Encoding::kTensor || !t.error.empty() || t.Numel() == 0) continue;
      std::vector<std::pair<DType, std::optional<Box>>> cases = {{t.dtype, std::nullopt}};
      if (WidensToF32(t.dtype)) cases.push_back({DType::kF32, std::nullopt});
      if (t.shape.size() >= 2 && t.shape[1] >= 2) {
        Box b;
        b.offsets.assign(t.shape.size(), 0);
        b.lengths = t.shape;
        b.offsets[1] = t.shape[1] / 4;
        b.lengths[1] = std::max<int64_t>(1, t.shape[1] / 2);
        cases.push_back({WidensToF32(t.dtype) ? DType::kF32 : t.dtype, b});
      }
      for (auto& [out, box] : cases) {
        const Box* bp = box ? &*box : nullptr;
        const uint64_t numel = bp ? static_cast<uint64_t>(NumelOf(bp->lengths)) : t.Numel();
        const uint64_t len = numel * DTypeSize(out);
        std::vector<char> want(len), got(len);
        ASSERT_TRUE(fs->ReadTensor(TensorId{i}, out, bp, want.data(), len).ok());
        for (uint64_t shift : {0, 4}) {
          auto mem = AllocDeviceBytes(0, len + shift);
          ASSERT_TRUE(mem.ok()) << mem.status().message();
          DeviceTarget target{gpu_.get(), nullptr, true};
          Status s = fs->ReadTensor(TensorId{i}, out, bp, mem->get() + shift, len, &target);
          ASSERT_TRUE(s.ok()) << rel << " " << t.key << ": " << s.message();
          ASSERT_TRUE(DownloadDeviceBytes(0, mem->get() + shift, len, got.data()).ok());
          ASSERT_EQ(0, std::memcmp(want.data(), got.data(), len))
              << rel << " " << t.key << " as " << DTypeName(out) << (bp ? " (column box)" : "") << " shift " << shift;
          ++n;
        }
      }
    }
    EXPECT_GT(n, 0);
    EXPECT_EQ(fs->reader().transform_counts().gpu_fallbacks, 0u) << rel;
  }
  std::unique_ptr<Transforms> gpu_;
};

TEST_F(RealDeviceTest, FixturesEqualTheHostPath) {
  for (const char* rel :
       {"ds_py3112/padspan_z2_dp4", "ds_py3112/z2_bf16_tp2_dp2", "ds_py3112/bf16opt_dp2", "meta_llama_mp2/mp2",
        "verl_fsdp2/global_step_1/actor", "dcp_single", "megatron_versions/mcore0.15.0-dist_tp2_pp2"}) {
    SCOPED_TRACE(rel);
    CheckAll(rel);
    if (HasFatalFailure()) return;
  }
}

TEST_F(RealDeviceTest, IdleBuffersAreReleased) {
  // The Python package's backend keeps the context but frees every buffer
  // idle_ms after the last read.
  CudaOptions o;
  o.reset_when_idle = false;
  o.idle_ms = 200;
  auto tf = MakeCudaTransforms(o);
  ASSERT_TRUE(tf.ok());
  SyntheticPlan p = MakeMergePlan(DType::kBF16, 1024, 4, 8 << 20);
  std::vector<char> out(p.out_bytes);
  ASSERT_TRUE((*tf)->Gather(p.src.data(), p.src.size(), p.ops, DType::kF32, out.data(), out.size()).ok());
  EXPECT_GT((*tf)->HeldBytes(), 0u);
  for (int i = 0; i < 100 && (*tf)->HeldBytes() != 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ((*tf)->HeldBytes(), 0u);
}

}  // namespace
}  // namespace ckptfs
