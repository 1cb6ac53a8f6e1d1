// The reader conformance suite: every committed fixture directory
// (tests/data, written by the real producers) and every fuzz seed
// (tests/fuzz/corpus, packed from real producer checkpoints) goes through
// read -> index -> views, and each reader must give:
//   - the family the table says (and the detection order that picks it);
//   - valid geometry, and fragments that tile each tensor exactly: every
//     element of each copy covered once, no box outside the shape;
//   - names that are valid UTF-8;
//   - the same records in the same order when read twice;
//   - an index that round-trips (records, fragments, info);
//   - a tree whose params/ and other/ files all open and read to their size,
//     and a checkpoint.json naming the family.
// Runs without Python, FUSE or a network: scripts/test.sh --quick.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "../../fuzz/dir_archive.h"
#include "../test_util.h"
#include "ckptfs/formats.h"
#include "ckptfs/fs.h"
#include "ckptfs/index.h"

namespace ckptfs {
namespace {

namespace fs = std::filesystem;

struct Case {
  std::string name;  // test name (alphanumerics and _)
  std::string dir;   // a committed fixture directory, or "" for a seed
  std::string seed;  // a tests/fuzz/corpus/<target>/<name>.bin file
  Family family = Family::kUnknown;
  // Tensors the reader refuses on purpose (their error says why), e.g.
  // verl's FSDP + TP shards. Anything else in error fails the suite.
  size_t refused = 0;
  std::string subdir;  // a seed: the checkpoint's directory inside the archive
};

void PrintTo(const Case& c, std::ostream* os) { *os << (c.dir.empty() ? c.seed : c.dir); }

const std::string kData = CKPTFS_TEST_DATA;
const std::string kCorpus = kData + "/../fuzz/corpus";

std::string TestName(std::string s) {
  for (char& c : s) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return s;
}

// The committed fixtures, with the family each must read as. A new fixture
// directory is added here (the suite fails on a recognised directory under
// tests/data that no row names).
std::vector<Case> FixtureCases() {
  std::vector<Case> out;
  auto add = [&](const std::string& rel, Family f, size_t refused = 0) {
    out.push_back({TestName(rel), kData + "/" + rel, "", f, refused, ""});
  };
  add("dcp_single", Family::kPytorchDcp);
  // The README's bundled sample (samples/, beside tests/).
  out.push_back({"samples_dcp_tiny", kData + "/../../samples/dcp-tiny", "", Family::kPytorchDcp, 0, ""});
  add("dcp_torch113/ckpt", Family::kPytorchDcp);
  for (const auto& e : fs::directory_iterator(kData + "/dcp_torch2x")) {
    add("dcp_torch2x/" + e.path().filename().string() + "/ckpt", Family::kPytorchDcp);
  }
  add("dcp_hf_sharded", Family::kSafetensors);
  add("accelerate_fsdp1_rank", Family::kAccelerateFsdp);
  for (const auto& e : fs::directory_iterator(kData + "/ds_py3112")) {
    const std::string n = e.path().filename().string();
    if (e.is_directory() && n.find(".ucp") == std::string::npos) add("ds_py3112/" + n, Family::kDeepSpeed);
  }
  add("megatron_bridge/megatron", Family::kMegatronLegacy);
  add("megatron_bridge/bridge", Family::kSafetensors);
  for (const auto& e : fs::directory_iterator(kData + "/megatron_versions")) {
    if (e.is_directory()) add("megatron_versions/" + e.path().filename().string(), Family::kMegatronTorchDist);
  }
  add("megatron_wrappers/bridge-dist_distopt_tp2_dp2", Family::kMegatronTorchDist);
  add("megatron_wrappers/nemo2-dist_distopt_tp2_dp2/checkpoints", Family::kMegatronTorchDist);
  add("meta_llama_mp2/mp2", Family::kMetaConsolidated);
  add("meta_llama_mp2", Family::kTorchSave);
  add("verl_fsdp1", Family::kTorchSave);
  add("verl_fsdp1/global_step_1/actor", Family::kVerl, 6);  // FSDP1 flat-parameter optimizer states
  add("verl_fsdp2/global_step_1/actor", Family::kVerl);
  add("verl_fsdp2/merged", Family::kSafetensors);
  add("verl_hsdp/global_step_1/actor", Family::kVerl);
  add("verl_hsdp/merged", Family::kSafetensors);
  for (const auto& e : fs::directory_iterator(kData + "/orbax")) {
    if (e.is_directory()) add("orbax/" + e.path().filename().string() + "/ckpt", Family::kOrbax);
  }
  // MaxText's own saves (OCDBT + zarr3, scanned layers, RNG keys) and the
  // Hugging Face directories made from them.
  add("orbax_maxtext/llama_tiny/checkpoints", Family::kOrbax);
  add("orbax_maxtext/llama31_tiny/checkpoints", Family::kOrbax);
  add("orbax_maxtext/llama_tiny/hf_from_mapping", Family::kSafetensors);
  add("orbax_maxtext/llama31_tiny/hf_reference", Family::kSafetensors);
  return out;
}

// The family each fuzz seed reads as, by file name (the seed's own name in
// tests/fuzz/make_corpus.py). A seed with no row fails EverySeedIsListed;
// hostile seeds (hand-made damage) are the fuzzers' alone.
struct Seed {
  Family family;
  std::string subdir;  // where in the archive the checkpoint is ("" : its root)
  Seed(Family f, std::string d = "") : family(f), subdir(std::move(d)) {}
};
const std::map<std::string, Seed>& SeedFamilies() {
  static const std::map<std::string, Seed> kSeeds = {
      {"2.0.1_ckpt", Family::kPytorchDcp},
      {"data_accelerate_fsdp1_rank", Family::kAccelerateFsdp},
      {"data_dcp_single", Family::kPytorchDcp},
      {"data_dcp_torch113", {Family::kPytorchDcp, "ckpt"}},
      {"fixtures_dtensor_dim1_w2", Family::kPytorchDcp},
      {"fixtures_fsdp2_bf16_w2", Family::kPytorchDcp},
      {"fixtures_hf_sharded_w2", Family::kSafetensors},
      {"fixtures_hf_storage_w2", Family::kSafetensors},
      {"fixtures_ranklocal_w2", Family::kPytorchDcp},
      {"fixtures_st_format_w2", Family::kPytorchDcp},
      {"fixtures_zstd", Family::kPytorchDcp},
      {"global_step_1_actor", Family::kVerl},
      {"meta_llama_mp2_mp2", Family::kMetaConsolidated},
      {"verl_hsdp_global_step_1_actor", Family::kVerl},
      {"deepspeed_moe_dp2_ep2_s2_fp32", Family::kDeepSpeed},
      {"deepspeed_pipe_pp2_dp2_fp32", Family::kDeepSpeed},
      {"ds_py3112_padspan_z2_dp4", Family::kDeepSpeed},
      {"ds_py3112_z1_fp32_dp1", Family::kDeepSpeed},
      {"ds_py3112_moe_z2_bf16_dp2_ep2", Family::kDeepSpeed},
      {"megatron_dist_moe_dpreshard_tp2_pp2_ep2", Family::kMegatronTorchDist},
      {"megatron_dist_tp2_pp2_dp2", Family::kMegatronTorchDist},
      {"megatron_zarr_tp2_pp2", Family::kMegatronZarr},
      {"megatron_legacy_tp1_pp1", Family::kMegatronLegacy},
      {"orbax_v0_bf16", Family::kOrbax},
      {"orbax_v0_zarr3", Family::kOrbax},
      {"orbax_multiprocess", Family::kOrbax},
      {"orbax_no_ocdbt_zarr3", Family::kOrbax},
  };
  return kSeeds;
}

std::vector<std::string> SeedFiles() {
  std::vector<std::string> out;
  for (const auto& target : fs::directory_iterator(kCorpus)) {
    if (!target.is_directory()) continue;
    for (const auto& e : fs::directory_iterator(target.path())) {
      if (e.path().extension() == ".bin" && e.path().stem().string().find("hostile") == std::string::npos) {
        out.push_back(e.path().string());
      }
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<Case> AllCases() {
  std::vector<Case> out = FixtureCases();
  for (const std::string& seed : SeedFiles()) {
    const std::string stem = fs::path(seed).stem().string();
    const auto it = SeedFamilies().find(stem);
    const std::string target = fs::path(seed).parent_path().filename().string();
    Case c{TestName("seed_" + target + "_" + stem), "", seed, Family::kUnknown, 0, ""};
    if (it != SeedFamilies().end()) {
      c.family = it->second.family;
      c.subdir = it->second.subdir;
    }
    out.push_back(std::move(c));
  }
  return out;
}

// Whether the boxes of one copy cover [0, shape) exactly once: volumes add
// up to numel and no two boxes overlap (every box is inside the shape:
// CheckTensorGeometry).
std::string TilingProblem(const TensorRecord& t, const std::vector<Fragment>& frags) {
  std::map<uint32_t, std::vector<const Fragment*>> copies;
  for (const Fragment& f : frags) copies[f.replica].push_back(&f);
  if (copies.size() != t.replicas) {
    return std::to_string(copies.size()) + " copies, record says " + std::to_string(t.replicas);
  }
  for (const auto& [r, boxes] : copies) {
    uint64_t volume = 0;
    for (const Fragment* f : boxes) {
      uint64_t v = 1;
      for (int64_t l : f->lengths) v *= static_cast<uint64_t>(l);
      volume += v;
    }
    if (volume != t.Numel()) {
      return "copy " + std::to_string(r) + ": fragments hold " + std::to_string(volume) + " elements of " +
             std::to_string(t.Numel());
    }
    if (boxes.size() > 4096) continue;  // volumes checked; pairwise overlap would be quadratic
    for (size_t i = 0; i < boxes.size(); ++i) {
      for (size_t j = i + 1; j < boxes.size(); ++j) {
        bool overlap = true;
        for (size_t d = 0; d < t.shape.size() && overlap; ++d) {
          const int64_t lo = std::max(boxes[i]->offsets[d], boxes[j]->offsets[d]);
          const int64_t hi =
              std::min(boxes[i]->offsets[d] + boxes[i]->lengths[d], boxes[j]->offsets[d] + boxes[j]->lengths[d]);
          overlap = lo < hi;
        }
        if (overlap && t.Numel() > 0)
          return "copy " + std::to_string(r) + ": fragments " + std::to_string(i) + " and " + std::to_string(j) +
                 " overlap";
      }
    }
  }
  return "";
}

bool SameFragment(const Fragment& a, const Fragment& b) {
  return a.file == b.file && a.offsets == b.offsets && a.lengths == b.lengths && a.strides == b.strides &&
         a.dtype == b.dtype && a.data_offset == b.data_offset && a.data_length == b.data_length &&
         a.compression == b.compression && a.item_offset == b.item_offset && a.item_length == b.item_length &&
         a.replica == b.replica;
}

class ReaderConformance : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    const Case& c = GetParam();
    if (c.dir.empty()) {
      std::ifstream in(c.seed, std::ios::binary);
      const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      src_ = tmp_.path() + "/src";
      fs::create_directories(src_);
      fuzz::UnpackArchive(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), src_);
      if (!c.subdir.empty()) src_ += "/" + c.subdir;
    } else {
      src_ = c.dir;
    }
  }
  testing::TempDir tmp_;
  std::string src_;
};

TEST_P(ReaderConformance, ReadIndexAndViews) {
  const Case& c = GetParam();
  ASSERT_NE(c.family, Family::kUnknown) << c.seed << ": add the seed's family to SeedFamilies()";

  // Detection: the expected family, by the first reader in the table whose
  // probe recognises the directory.
  const FamilyReader* first = nullptr;
  for (const FamilyReader& r : FamilyReaders()) {
    if (r.looks(src_)) {
      first = &r;
      break;
    }
  }
  ASSERT_NE(first, nullptr) << src_ << " is not recognised";
  EXPECT_EQ(first, ReaderFor(c.family)) << src_ << " is picked by " << first->name;

  auto a = ReadCheckpoint(src_);
  ASSERT_TRUE(a.ok()) << a.status().message();
  EXPECT_EQ(a->info.family, c.family) << FamilyName(a->info.family);
  ASSERT_FALSE(a->tensors.empty());

  // Geometry, tiling, names.
  size_t refused = 0;
  for (size_t i = 0; i < a->tensors.size(); ++i) {
    const TensorRecord& t = a->tensors[i];
    for (const std::string* s : {&t.key, &t.fqn, &t.state}) EXPECT_TRUE(IsUtf8(*s)) << *s;
    if (!t.error.empty()) {
      ++refused;
      EXPECT_EQ(a->fragments.Get(i).size(), 0u) << t.key;
      continue;
    }
    if (t.encoding != Encoding::kTensor) continue;
    const std::vector<Fragment> frags = a->fragments.Get(i);
    EXPECT_EQ(frags.size(), t.num_fragments) << t.key;
    EXPECT_EQ(CheckTensorGeometry(t, frags), "") << t.key;
    EXPECT_EQ(t.byte_size, t.Numel() * DTypeSize(t.dtype)) << t.key;
    if (!t.alias) {
      EXPECT_EQ(TilingProblem(t, frags), "") << t.key;
    }
  }
  // A seed's data files were cut to fit the fuzzers: tensors over them are
  // in error (naming the file), which is what the reader must do.
  if (!c.dir.empty()) {
    EXPECT_EQ(refused, c.refused) << "tensors in error";
  }

  // Deterministic: a second read gives the same records in the same order.
  auto b = ReadCheckpoint(src_);
  ASSERT_TRUE(b.ok()) << b.status().message();
  ASSERT_EQ(a->tensors.size(), b->tensors.size());
  for (size_t i = 0; i < a->tensors.size(); ++i) {
    ASSERT_EQ(a->tensors[i].key, b->tensors[i].key) << i;
    const auto fa = a->fragments.Get(i), fb = b->fragments.Get(i);
    ASSERT_EQ(fa.size(), fb.size()) << a->tensors[i].key;
    for (size_t k = 0; k < fa.size(); ++k) EXPECT_TRUE(SameFragment(fa[k], fb[k])) << a->tensors[i].key << " #" << k;
  }
  ASSERT_EQ(a->files.size(), b->files.size());
  for (size_t i = 0; i < a->files.size(); ++i) EXPECT_EQ(a->files[i].rel_path, b->files[i].rel_path);

  // The index round-trips.
  const std::string ix = tmp_.path() + "/ix";
  ASSERT_TRUE(Index::Build(*a, ix).ok());
  auto opened = Index::Open(ix, src_);
  ASSERT_TRUE(opened.ok()) << opened.status().message();
  const Index& index = **opened;
  EXPECT_EQ(index.info().family, c.family);
  EXPECT_EQ(index.info().step, a->info.step);
  EXPECT_EQ(index.info().topology, a->info.topology);
  ASSERT_EQ(index.tensors().size(), a->tensors.size());
  for (size_t i = 0; i < a->tensors.size(); ++i) {
    const TensorRecord &x = a->tensors[i], &y = index.tensors()[i];
    EXPECT_TRUE(x.key == y.key && x.fqn == y.fqn && x.state == y.state && x.role == y.role && x.dtype == y.dtype &&
                x.shape == y.shape && x.byte_size == y.byte_size && x.error == y.error && x.replicas == y.replicas)
        << x.key;
    auto frags = index.Fragments(TensorId{static_cast<uint32_t>(i)});
    ASSERT_TRUE(frags.ok());
    const auto want = a->fragments.Get(i);
    ASSERT_EQ(frags->size(), want.size()) << x.key;
    for (size_t k = 0; k < want.size(); ++k) EXPECT_TRUE(SameFragment((*frags)[k], want[k])) << x.key;
  }
  opened->reset();

  // Views: every params/ and other/ file reads to its size (a seed's big
  // data files were cut to fit the fuzzers: its files are looked up, not
  // read); checkpoint.json names the family.
  const bool read_bytes = !c.dir.empty();
  FsOptions o;
  o.src = src_;
  o.index_dir = ix;
  o.engine = EngineKind::kPread;
  o.gpu = GpuMode::kOff;
  auto f = Filesystem::Open(o);
  ASSERT_TRUE(f.ok()) << f.status().message();
  Filesystem& fsys = **f;
  auto cj = fsys.Lookup(1, "checkpoint.json");
  ASSERT_TRUE(cj.ok());
  ASSERT_TRUE(fsys.OpenFile(cj->ino).ok());
  std::string text(cj->size, '\0');
  ASSERT_TRUE(fsys.Read(cj->ino, 0, text.size(), text.data()).ok());
  EXPECT_EQ(nlohmann::json::parse(text).value("family", ""), FamilyName(c.family));
  size_t files = 0, unreadable = 0;
  std::vector<char> buf(1 << 20);
  std::function<void(uint64_t, int)> walk = [&](uint64_t ino, int depth) {
    auto entries = fsys.ReadDir(ino);
    ASSERT_TRUE(entries.ok());
    for (const DirEntry& e : *entries) {
      if (e.name == "." || e.name == "..") continue;
      auto attr = fsys.Lookup(ino, e.name);
      ASSERT_TRUE(attr.ok()) << e.name;
      if (e.is_dir) {
        walk(e.ino, depth + 1);
        continue;
      }
      ++files;
      if (!read_bytes) continue;
      if (!fsys.OpenFile(e.ino).ok()) {
        ++unreadable;
        continue;
      }
      uint64_t got = 0;
      while (got < attr->size) {
        auto n = fsys.Read(e.ino, got, buf.size(), buf.data());
        if (!n.ok() || *n == 0) break;
        got += *n;
      }
      if (got != attr->size) ++unreadable;
    }
  };
  for (const char* top : {"params", "other"}) {
    if (auto d = fsys.Lookup(1, top); d.ok()) walk(d->ino, 0);
  }
  EXPECT_GT(files, 0u);
  // A refused tensor's files are EIO (its .npy, .raw); nothing else is.
  EXPECT_LE(unreadable, 2 * c.refused) << "files that did not read to their size";
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ReaderConformance, ::testing::ValuesIn(AllCases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

// Every seed has a family row (else the parameterized case fails too, but
// this names the file to add).
TEST(ReaderConformanceTable, EverySeedIsListed) {
  for (const std::string& seed : SeedFiles()) {
    EXPECT_TRUE(SeedFamilies().count(fs::path(seed).stem().string())) << seed;
  }
}

// Every reader of the family table is fuzzed: some seed of the fuzz corpus
// (whose directory names a fuzz target, tests/fuzz/corpus/<target>/) is
// picked by it. A new family adds its seeds there (tests/fuzz/make_corpus.py).
TEST(ReaderConformanceTable, EveryReaderIsFuzzed) {
  std::map<std::string_view, int> seeds;
  for (const Case& c : AllCases()) {
    if (c.seed.empty() || c.family == Family::kUnknown) continue;
    if (const FamilyReader* r = ReaderFor(c.family)) ++seeds[r->name];
  }
  for (const FamilyReader& r : FamilyReaders()) EXPECT_GT(seeds[r.name], 0) << r.name << " has no fuzz seed";
}

// The detection table's order is data: priorities unique and ascending,
// every family yielded by exactly one reader, every reader named.
TEST(FamilyTable, PrioritiesAndYields) {
  int last = -1;
  std::map<Family, int> yielded;
  for (const FamilyReader& r : FamilyReaders()) {
    EXPECT_GT(r.priority, last) << r.name;
    last = r.priority;
    EXPECT_FALSE(r.name.empty());
    EXPECT_FALSE(r.marks.empty()) << r.name;
    EXPECT_NE(r.looks, nullptr) << r.name;
    EXPECT_NE(r.read, nullptr) << r.name;
    for (const FamilyTraits& f : r.yields) ++yielded[f.id];
  }
  // Every id of family.h has its row (kTorchSave is the last id).
  for (int i = 1; i <= static_cast<int>(Family::kTorchSave); ++i) {
    EXPECT_NE(ReaderFor(static_cast<Family>(i)), nullptr) << "family id " << i << " has no row";
  }
  std::set<std::string_view> names;
  for (const FamilyTraits& t : AllFamilies()) EXPECT_TRUE(names.insert(t.name).second) << t.name;
  for (const FamilyTraits& t : AllFamilies()) {
    EXPECT_EQ(yielded[t.id], 1) << t.name;
    EXPECT_EQ(FamilyFromName(t.name), t.id);
    EXPECT_EQ(FamilyName(t.id), t.name);
  }
  EXPECT_EQ(FamilyFromName("megatron"), std::nullopt);
  EXPECT_EQ(ReaderFor(Family::kUnknown), nullptr);
}

// Two readers claim a Megatron torch_dist directory (it is a DCP with
// metadata.json beside it): the table picks Megatron; --family pytorch-dcp
// reads it as the plain DCP; --family deepspeed is refused by its probe
// before anything is read.
TEST(FamilyTable, ForcedFamily) {
  const std::string dir = kData + "/megatron_versions/mcore0.15.0-dist_tp2_pp2/iter_0000007";
  auto detected = ReadCheckpoint(dir);
  ASSERT_TRUE(detected.ok()) << detected.status().message();
  EXPECT_EQ(detected->info.family, Family::kMegatronTorchDist);
  auto dcp = ReadCheckpoint(dir, Family::kPytorchDcp);
  ASSERT_TRUE(dcp.ok()) << dcp.status().message();
  EXPECT_EQ(dcp->info.family, Family::kPytorchDcp);
  EXPECT_TRUE(Recognise(dir, Family::kPytorchDcp).ok());
  auto ds = ReadCheckpoint(dir, Family::kDeepSpeed);
  ASSERT_FALSE(ds.ok());
  EXPECT_NE(ds.status().message().find("--family deepspeed: " + dir + " has no latest /"), std::string::npos)
      << ds.status().message();
  EXPECT_FALSE(Recognise(dir, Family::kDeepSpeed).ok());
  // The rank-files reader yields verl or Accelerate by what it finds.
  auto verl = ReadCheckpoint(kData + "/accelerate_fsdp1_rank", Family::kVerl);
  ASSERT_FALSE(verl.ok());
  EXPECT_NE(verl.status().message().find("reads as accelerate-fsdp"), std::string::npos) << verl.status().message();
}

// An index built under --family is rebuilt when another family is asked for,
// and reused when it is the same.
TEST(FamilyTable, ForcedFamilyRebuildsAnotherFamilysIndex) {
  testing::TempDir tmp;
  const std::string dir = kData + "/megatron_versions/mcore0.15.0-dist_tp2_pp2/iter_0000007", ix = tmp.path() + "/ix";
  auto a = OpenOrBuild(dir, ix, false, Family::kPytorchDcp);
  ASSERT_TRUE(a.ok()) << a.status().message();
  EXPECT_TRUE(a->built);
  EXPECT_EQ(a->index->info().family, Family::kPytorchDcp);
  a->index.reset();
  auto same = OpenOrBuild(dir, ix, false, Family::kPytorchDcp);
  ASSERT_TRUE(same.ok());
  EXPECT_FALSE(same->built);
  same->index.reset();
  auto detect = OpenOrBuild(dir, ix);  // no --family: a fresh index is reused as it is
  ASSERT_TRUE(detect.ok());
  EXPECT_FALSE(detect->built);
  detect->index.reset();
  auto other = OpenOrBuild(dir, ix, false, Family::kMegatronTorchDist);
  ASSERT_TRUE(other.ok()) << other.status().message();
  EXPECT_TRUE(other->built);
  EXPECT_NE(other->why_rebuilt.find("the index holds pytorch-dcp"), std::string::npos) << other->why_rebuilt;
  EXPECT_EQ(other->index->info().family, Family::kMegatronTorchDist);
}

}  // namespace
}  // namespace ckptfs
