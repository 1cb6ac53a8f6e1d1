// Saved plans (views/plan_cache.h): a plan saved beside the index loads back
// as the same layouts (every segment kind, spooled bytes included); a plan
// file that is damaged, cut short, of another index or under another name is
// ignored; one that cannot be saved leaves nothing; a mount that finds one
// serves the same bytes without planning; hf/'s plan is keyed by its options
// and the files beside the checkpoint.
#include "views/plan_cache.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "../fs_fixture.h"
#include "../test_util.h"
#include "ckptfs/fs.h"
#include "views/dcp_view.h"
#include "views/hf_export.h"

namespace ckptfs {
namespace {

using testing::ReadAll;
using testing::TempDir;

std::string SpooledText(const Segment& s) {
  std::string out(s.size, '\0');
  EXPECT_TRUE(s.spooled() != nullptr && s.spooled()->Read(0, s.size, out.data()).ok());
  return out;
}

void ExpectSamePlan(const plan_cache::Plan& a, const plan_cache::Plan& b) {
  ASSERT_EQ(a.notes, b.notes);
  ASSERT_EQ(a.files.size(), b.files.size());
  for (size_t f = 0; f < a.files.size(); ++f) {
    const auto& [name, x] = a.files[f];
    const FileLayout& y = b.files[f].second;
    EXPECT_EQ(name, b.files[f].first);
    EXPECT_EQ(x.size, y.size) << name;
    EXPECT_EQ(x.starts, y.starts) << name;
    ASSERT_EQ(x.segments.size(), y.segments.size()) << name;
    for (size_t k = 0; k < x.segments.size(); ++k) {
      const Segment& s = x.segments[k];
      const Segment& t = y.segments[k];
      SCOPED_TRACE(name + " segment " + std::to_string(k));
      EXPECT_EQ(s.kind, t.kind);
      EXPECT_EQ(s.out_dtype, t.out_dtype);
      EXPECT_EQ(s.transposed, t.transposed);
      EXPECT_EQ(s.lead_ones, t.lead_ones);
      EXPECT_EQ(s.tensor.v, t.tensor.v);
      EXPECT_EQ(s.size, t.size);
      EXPECT_EQ(s.boxes, t.boxes);
      EXPECT_EQ(s.how(), t.how());
      EXPECT_EQ(s.scale(), t.scale());
      EXPECT_EQ(s.add(), t.add());
      EXPECT_EQ(s.literal(), t.literal());
      if (s.kind == SegmentKind::kSpooled) {
        EXPECT_EQ(SpooledText(s), SpooledText(t));
      }
    }
  }
}

// dcp/'s own plan with its .metadata spooled, and a file of every other kind.
plan_cache::Plan SomePlan(const Index& index) {
  auto tree = dcp_view::DcpFiles(index, /*spool_piece=*/512);
  EXPECT_TRUE(tree.ok()) << tree.status().message();
  plan_cache::Plan p{std::move(tree->files), {"a.key: a reason", "b.key: another"}};
  EXPECT_EQ(p.files[0].second.segments[0].kind, SegmentKind::kSpooled);
  FileLayout l;
  l.Add(LiteralSegment("header"));
  Segment t;
  t.kind = SegmentKind::kTensor;
  t.tensor = TensorId{1};
  t.out_dtype = DType::kBF16;
  t.size = 48;
  t.transposed = true;
  t.boxes = {Box{{0, 2}, {3, -1}}, Box{{5}, {7}}};
  t.set_render({Transpose{2, 64}, 0.125, -3.5});
  l.Add(t);
  Segment c;
  c.kind = SegmentKind::kCrc32;
  c.tensor = TensorId{0};
  c.out_dtype = DType::kF32;
  c.size = 4;
  l.Add(c);
  Segment h;
  h.kind = SegmentKind::kHash;
  h.size = 16;
  l.Add(h);
  p.files.emplace_back("sub/other.bin", std::move(l));
  return p;
}

TEST(PlanCacheTest, ASavedPlanLoadsAsTheSamePlan) {
  TempDir tmp;
  auto fs = testing::OpenFixtureCopy(tmp, "ds_py3112/z2_bf16_tp2_dp2");
  ASSERT_NE(fs, nullptr);
  ASSERT_FALSE(plan_cache::BuildId().empty()) << "the test binary has no GNU build id";
  const plan_cache::Plan plan = SomePlan(fs->index());
  EXPECT_FALSE(plan_cache::Load(fs->index(), "dcp").has_value());  // nothing saved yet
  ASSERT_TRUE(plan_cache::Save(fs->index(), "dcp", plan).ok());
  auto back = plan_cache::Load(fs->index(), "dcp");
  ASSERT_TRUE(back.has_value());
  ExpectSamePlan(plan, *back);
  struct stat st {};
  ASSERT_EQ(::stat(plan_cache::PathOf(fs->index(), "dcp").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0644u);
}

TEST(PlanCacheTest, DamagedShortForeignOrMisnamedPlansAreIgnored) {
  TempDir tmp;
  auto fs = testing::OpenFixtureCopy(tmp, "ds_py3112/z2_bf16_tp2_dp2");
  ASSERT_NE(fs, nullptr);
  const Index& index = fs->index();
  const std::string path = plan_cache::PathOf(index, "dcp");
  ASSERT_TRUE(plan_cache::Save(index, "dcp", SomePlan(index)).ok());
  const auto size = std::filesystem::file_size(path);
  const std::string good = testing::ReadFile(path);
  auto put = [&](const std::string& bytes) { std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes; };
  // A flipped byte anywhere past the head (records, blobs, trailer).
  for (uint64_t at : {size / 3, size / 2, size - 20, size - 1}) {
    std::string bad = good;
    bad[at] ^= 0x40;
    put(bad);
    EXPECT_FALSE(plan_cache::Load(index, "dcp").has_value()) << "byte " << at;
  }
  // Cut short, or empty.
  for (uint64_t keep : {uint64_t{0}, uint64_t{10}, size / 2, size - 1}) {
    put(good.substr(0, keep));
    EXPECT_FALSE(plan_cache::Load(index, "dcp").has_value()) << keep << " bytes";
  }
  // Under another name.
  put(good);
  std::filesystem::copy_file(path, plan_cache::PathOf(index, "profile-torch_dist"));
  EXPECT_FALSE(plan_cache::Load(index, "profile-torch_dist").has_value());
  EXPECT_TRUE(plan_cache::Load(index, "dcp").has_value());
  // Of another build of the index (RocksDB writes a new IDENTITY each time).
  std::ofstream(index.dir() + "/IDENTITY", std::ios::trunc) << "another-index\n";
  EXPECT_FALSE(plan_cache::Load(index, "dcp").has_value());
}

// A plan that cannot be put in place (here a directory holds its name) is an
// error naming the file, and leaves no temporary file behind.
TEST(PlanCacheTest, APlanThatCannotBeSavedLeavesNothing) {
  TempDir tmp;
  auto fs = testing::OpenFixtureCopy(tmp, "ds_py3112/z2_bf16_tp2_dp2");
  ASSERT_NE(fs, nullptr);
  const std::string path = plan_cache::PathOf(fs->index(), "dcp");
  std::filesystem::create_directory(path);
  const auto before = std::distance(std::filesystem::directory_iterator(fs->index().dir()), {});
  Status s = plan_cache::Save(fs->index(), "dcp", SomePlan(fs->index()));
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("dcp.plan"), std::string::npos) << s.message();
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(fs->index().dir()), {}), before);
  EXPECT_FALSE(plan_cache::Load(fs->index(), "dcp").has_value());
}

// Every file of `dir` (names and bytes), read through `fs`.
std::map<std::string, std::string> FilesOf(Filesystem& fs, const std::string& dir) {
  std::map<std::string, std::string> out;
  auto d = fs.view().Resolve(dir);
  EXPECT_TRUE(d.ok());
  if (!d.ok()) return out;
  auto entries = fs.ReadDir(*d);
  EXPECT_TRUE(entries.ok());
  if (!entries.ok()) return out;
  for (const DirEntry& e : *entries) {
    if (!e.is_dir) out[e.name] = ReadAll(fs, dir + "/" + e.name);
  }
  return out;
}

// Options for another mount of the copy OpenFixtureCopy made in `tmp`.
FsOptions CopyOptions(const TempDir& tmp) {
  FsOptions o;
  o.src = tmp.path() + "/ck";
  o.index_dir = tmp.path() + "/index";
  o.gpu = GpuMode::kOff;
  return o;
}

// The first mount plans dcp/ and saves it; the next serves the saved plan:
// the same names and the same bytes.
TEST(PlanCacheTest, TheNextMountServesTheSavedPlan) {
  TempDir tmp;
  std::map<std::string, std::string> first;
  {
    auto fs = testing::OpenFixtureCopy(tmp, "ds_py3112/z2_bf16_tp2_dp2");
    ASSERT_NE(fs, nullptr);
    first = FilesOf(*fs, "dcp");
    EXPECT_TRUE(std::filesystem::exists(plan_cache::PathOf(fs->index(), "dcp")));
  }
  auto fs = Filesystem::Open(CopyOptions(tmp));
  ASSERT_TRUE(fs.ok()) << fs.status().message();
  ASSERT_TRUE(plan_cache::Load((*fs)->index(), "dcp").has_value());
  std::map<std::string, std::string> second = FilesOf(**fs, "dcp");
  EXPECT_EQ(first.size(), second.size());
  EXPECT_GE(first.size(), 3u);
  for (const auto& [name, bytes] : first) EXPECT_TRUE(second[name] == bytes) << name;
}

// hf/'s plan is saved under a key of its options and of the files beside
// the checkpoint: the next mount serves it, and a tokenizer file added beside
// the checkpoint, or another --hf-dtype, makes hf/ planned again.
TEST(PlanCacheTest, HfPlansFollowTheirOptionsAndTheFilesBesideTheCheckpoint) {
  TempDir tmp;
  const std::string fixture = "meta_llama_mp2/mp2";
  std::map<std::string, std::string> first;
  std::string key;
  {
    auto fs = testing::OpenFixtureCopy(tmp, fixture);
    ASSERT_NE(fs, nullptr);
    first = FilesOf(*fs, "hf");
    key = hf::InputsKey(fs->index(), TopoOptions{});
    EXPECT_TRUE(plan_cache::Load(fs->index(), "hf", key).has_value());
  }
  ASSERT_TRUE(first.count("config.json")) << "the fixture's hf/ has no architecture";
  ASSERT_GE(first.size(), 4u);
  const FsOptions o = CopyOptions(tmp);
  {
    auto fs = Filesystem::Open(o);
    ASSERT_TRUE(fs.ok()) << fs.status().message();
    EXPECT_EQ(hf::InputsKey((*fs)->index(), TopoOptions{}), key);
    EXPECT_EQ(FilesOf(**fs, "hf"), first);
    TopoOptions other;
    other.hf_dtype = "fp32";
    EXPECT_NE(hf::InputsKey((*fs)->index(), other), key);
  }
  // A tokenizer file appears beside the checkpoint: another key, and hf/
  // passes the new file through.
  std::ofstream(o.src + "/tokenizer_config.json") << "{\"model_max_length\": 77}\n";
  auto fs = Filesystem::Open(o);
  ASSERT_TRUE(fs.ok()) << fs.status().message();
  const std::string key2 = hf::InputsKey((*fs)->index(), TopoOptions{});
  EXPECT_NE(key2, key);
  EXPECT_FALSE(plan_cache::Load((*fs)->index(), "hf", key2).has_value());
  std::map<std::string, std::string> third = FilesOf(**fs, "hf");
  EXPECT_EQ(third["tokenizer_config.json"], "{\"model_max_length\": 77}\n");
  third.erase("tokenizer_config.json");
  EXPECT_EQ(third, first);
  EXPECT_TRUE(plan_cache::Load((*fs)->index(), "hf", key2).has_value());
  EXPECT_FALSE(plan_cache::Load((*fs)->index(), "hf", key).has_value());
}

// `ckptfs index --plan-views`: a Megatron source's dcp/, torch_dist/
// profile and hf/ planned and saved without a listing; a later view loads each.
TEST(PlanCacheTest, PlanSavedViewsSavesDcpTheProfileAndHf) {
  TempDir tmp;
  auto fs = testing::OpenFixtureCopy(tmp, "megatron_versions/mcore0.14.0-dist_distopt_tp2_pp2_dp2");
  ASSERT_NE(fs, nullptr);
  const std::vector<std::string> saved = fs->view().PlanSavedViews();
  ASSERT_EQ(saved.size(), 3u);
  EXPECT_EQ(saved[0], plan_cache::PathOf(fs->index(), "dcp"));
  EXPECT_EQ(saved[1], plan_cache::PathOf(fs->index(), "profile-torch_dist"));
  EXPECT_EQ(saved[2], plan_cache::PathOf(fs->index(), "hf"));
  EXPECT_TRUE(plan_cache::Load(fs->index(), "dcp").has_value());
  EXPECT_TRUE(plan_cache::Load(fs->index(), "profile-torch_dist").has_value());
  EXPECT_TRUE(plan_cache::Load(fs->index(), "hf", hf::InputsKey(fs->index(), TopoOptions{})).has_value());
  // Planned once: a second call saves nothing new and keeps both.
  const auto mtime = std::filesystem::last_write_time(saved[0]);
  EXPECT_EQ(fs->view().PlanSavedViews(), saved);
  EXPECT_EQ(std::filesystem::last_write_time(saved[0]), mtime);
}

}  // namespace
}  // namespace ckptfs
