// dcp/ (views/dcp_view.h) without torch: the tree is made from the index
// alone and deterministically; every item is one torch.save archive (a ZIP
// whose local header opens the item, whose end-of-central-directory closes
// it), items tile their data files, row-block chunks tile each tensor, and
// tensors a reader refused are left out by name. torch's own reader loading
// it is tests/integration/test_dcp_view.py.
#include "views/dcp_view.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "../fs_fixture.h"
#include "../test_util.h"
#include "ckptfs/fs.h"

namespace ckptfs {
namespace {

using testing::TempDir;

std::string ReadAll(Filesystem& fs, const std::string& path) {
  auto ino = fs.view().Resolve(path);
  EXPECT_TRUE(ino.ok()) << path;
  if (!ino.ok()) return "";
  auto a = fs.GetAttr(*ino);
  std::string out(a->size, '\0');
  for (uint64_t off = 0; off < out.size();) {
    auto n = fs.Read(*ino, off, std::min<size_t>(1 << 20, out.size() - off), out.data() + off);
    EXPECT_TRUE(n.ok()) << n.status().message();
    if (!n.ok() || *n == 0) break;
    off += *n;
  }
  return out;
}

TEST(DcpViewTest, MadeFromTheIndexDeterministically) {
  TempDir tmp;
  auto fs = testing::OpenFixtureCopy(tmp, "ds_py3112/z2_bf16_tp2_dp2");
  ASSERT_NE(fs, nullptr);
  auto a = dcp_view::DcpFiles(fs->index());
  auto b = dcp_view::DcpFiles(fs->index());
  ASSERT_TRUE(a.ok()) << a.status().message();
  ASSERT_TRUE(b.ok());
  ASSERT_EQ(a->files.size(), b->files.size());
  for (size_t i = 0; i < a->files.size(); ++i) {
    EXPECT_EQ(a->files[i].first, b->files[i].first);
    EXPECT_EQ(a->files[i].second.size, b->files[i].second.size);
  }
  EXPECT_EQ(a->files[0].first, ".metadata");
  EXPECT_TRUE(a->left_out.empty());
  EXPECT_GT(a->chunks, 0u);
}

// A .metadata past the spool size is written to an unlinked temporary file
// in pieces and read back from it: the same bytes as the one made in memory.
TEST(DcpViewTest, LargeMetadataIsSpooledToATemporaryFileWithTheSameBytes) {
  TempDir tmp;
  auto fs = testing::OpenFixtureCopy(tmp, "ds_py3112/z2_bf16_tp2_dp2");
  ASSERT_NE(fs, nullptr);
  auto memory = dcp_view::DcpFiles(fs->index());
  auto spooled = dcp_view::DcpFiles(fs->index(), /*spool_piece=*/512);
  ASSERT_TRUE(memory.ok() && spooled.ok());
  const FileLayout& a = memory->files[0].second;
  const FileLayout& b = spooled->files[0].second;
  ASSERT_EQ(a.segments.size(), 1u);
  ASSERT_EQ(b.segments.size(), 1u);
  EXPECT_EQ(a.segments[0].kind, SegmentKind::kLiteral);
  ASSERT_EQ(b.segments[0].kind, SegmentKind::kSpooled);
  ASSERT_EQ(b.size, a.size);
  std::string back(b.size, '\0');
  ASSERT_TRUE(b.segments[0].spooled->Read(0, back.size(), back.data()).ok());
  EXPECT_EQ(back, a.segments[0].literal);
  EXPECT_FALSE(b.segments[0].spooled->Read(b.size - 1, 2, back.data()).ok());  // past the end: an error
}

// Each item of a data file is a torch.save archive: "PK\3\4" where the
// metadata says it starts, an end-of-central-directory record ("PK\5\6") 22
// bytes before it ends (no comment), and the metadata's fqn in the pickle.
TEST(DcpViewTest, ItemsAreWholeArchivesTilingTheDataFiles) {
  TempDir tmp;
  auto fs = testing::OpenFixtureCopy(tmp, "meta_llama_mp2/mp2");
  ASSERT_NE(fs, nullptr);
  const std::string md = ReadAll(*fs, "dcp/.metadata");
  ASSERT_GT(md.size(), 100u);
  EXPECT_NE(md.find("torch.distributed.checkpoint.metadata\nMetadata\n"), std::string::npos);
  EXPECT_NE(md.find("_StorageInfo"), std::string::npos);
  const std::string data = ReadAll(*fs, "dcp/__0_0.distcp");
  ASSERT_GT(data.size(), 0u);
  uint64_t off = 0, items = 0;
  while (off < data.size()) {
    ASSERT_EQ(data.compare(off, 4, "PK\x03\x04"), 0) << "an item does not start at " << off;
    const size_t eocd = data.find("PK\x05\x06", off);
    ASSERT_NE(eocd, std::string::npos);
    off = eocd + 22;
    ++items;
  }
  EXPECT_EQ(off, data.size());
  auto tree = dcp_view::DcpFiles(fs->index());
  ASSERT_TRUE(tree.ok());
  EXPECT_EQ(items, tree->chunks);
}

TEST(DcpViewTest, ListedAtTheRootOnlyWithTensors) {
  TempDir tmp;
  auto fs = testing::OpenFixtureCopy(tmp, "dcp_single");
  ASSERT_NE(fs, nullptr);
  auto root = fs->ReadDir(kRootIno);
  ASSERT_TRUE(root.ok());
  bool dcp = false;
  for (const DirEntry& e : *root) dcp |= e.name == "dcp" && e.is_dir;
  EXPECT_TRUE(dcp);
  const std::string readme = ReadAll(*fs, "dcp/README.txt");
  EXPECT_NE(readme.find("dcp.load"), std::string::npos);
  EXPECT_NE(readme.find("Every tensor of the checkpoint is represented"), std::string::npos);
}

// DeepSpeed's universal info says the vocabulary is 30 rows, saved padded to
// 32 in two TP slices: params/ serves rows [0, 30) and the padding rows
// beside them, together exactly the stored tensor; dcp/'s chunks are the TP
// slices cut at row 30.
TEST(DcpViewTest, PaddedVocabularyChunksStopAtTheVocabulary) {
  TempDir tmp;
  auto fs = testing::OpenFixtureCopy(tmp, "ds_py3112/z2_bf16_tp2_dp2");
  ASSERT_NE(fs, nullptr);
  const auto& ts = fs->index().tensors();
  auto plan = dcp_view::PlanDcp(fs->index());
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  int padded = 0;
  int groups = 0;
  for (const auto& e : plan->entries) {
    if (e.tensor == dcp_view::DcpEntry::kLiteral) {  // the param groups DeepSpeed saved
      EXPECT_EQ(e.key.rfind("optim.param_groups.", 0), 0u) << e.key;
      EXPECT_EQ(e.literal.rfind("PK\3\4", 0), 0u) << e.key;  // a torch.save archive
      ++groups;
      continue;
    }
    const TensorRecord& t = ts[e.tensor];
    if (!t.VocabPadded()) continue;
    ++padded;
    EXPECT_EQ(t.vocab_rows, 30) << t.key;
    EXPECT_EQ(t.shape[0], 32) << t.key;
    ASSERT_EQ(e.chunks.size(), 2u) << t.key;
    EXPECT_EQ(e.chunks[0].lengths[0], 16);
    EXPECT_EQ(e.chunks[1].offsets[0], 16);
    EXPECT_EQ(e.chunks[1].lengths[0], 14);
    if (t.role != Role::kOptimState) continue;
    const std::string dir = "params/" + t.fqn + "/" + t.state;
    const std::string both = ReadAll(*fs, dir + ".raw") + ReadAll(*fs, dir + ".vocab_padding.raw");
    std::string whole(t.byte_size, '\0');
    ASSERT_TRUE(fs->ReadTensor(TensorId{e.tensor}, t.dtype, nullptr, whole.data(), whole.size()).ok());
    EXPECT_EQ(both, whole) << dir;
  }
  EXPECT_GE(padded, 2);   // the model's embedding and its fp32 master
  EXPECT_GE(groups, 10);  // lr, betas, eps, ..., params of group 0
}

}  // namespace
}  // namespace ckptfs
