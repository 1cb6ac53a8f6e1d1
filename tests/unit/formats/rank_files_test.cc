// Per-rank torch.save files: verl's FSDP2 files (tests/data/verl_fsdp2,
// written by verl 0.9.1's own FSDPCheckpointManager), DTensors kept as objects
// by the pickle VM; Accelerate's FSDP1 use_dcp=False files
// (tests/data/accelerate_fsdp1_rank, accelerate's own save_fsdp_model /
// save_fsdp_optimizer), ShardedTensors placed by their ShardMetadata.
#include <gtest/gtest.h>

#include <filesystem>

#include "../test_util.h"
#include "formats/byte_reader.h"
#include "formats/torch_save.h"
#include "formats/torchsave/rank_files_reader.h"
#include "formats/torchsave/state_walk.h"

namespace ckptfs::formats {
namespace {

const std::string kActor = std::string(CKPTFS_TEST_DATA) + "/verl_fsdp2/global_step_1/actor";
const std::string kFsdp1 = std::string(CKPTFS_TEST_DATA) + "/accelerate_fsdp1_rank";

const TensorRecord* Find(const Checkpoint& ck, const std::string& key, size_t* index = nullptr) {
  for (size_t i = 0; i < ck.tensors.size(); ++i) {
    if (ck.tensors[i].key == key) {
      if (index) *index = i;
      return &ck.tensors[i];
    }
  }
  return nullptr;
}

// A copy of the FSDP1 files in a temporary directory, for damaging.
void CopyFsdp1(const std::string& to) {
  for (const auto& e : std::filesystem::directory_iterator(kFsdp1)) {
    std::filesystem::copy_file(e.path(), std::filesystem::path(to) / e.path().filename());
  }
}

TEST(VerlTest, DTensorIsAnObjectNotATensor) {
  const std::string path = kActor + "/model_world_size_2_rank_1.pt";
  uint64_t size = 0;
  auto fd = OpenBoundedFile(path, uint64_t{1} << 30, &size);
  ASSERT_TRUE(fd.ok()) << fd.status().message();
  FileSliceReader r(*fd, 0, size, path);
  auto a = ReadTorchSave(r);
  ASSERT_TRUE(a.ok()) << a.status().message();
  const PyValue* w = a->root->Get("model.embed_tokens.weight");
  ASSERT_NE(w, nullptr);
  EXPECT_TRUE(IsDTensor(w));
  EXPECT_NE(w->kind, PyKind::kTensor);
  ::close(*fd);
}

TEST(VerlTest, RanksShardsArePlacedInRankOrder) {
  ASSERT_TRUE(LooksLikeRankFiles(kActor));
  auto ck = ReadRankFiles(kActor);
  ASSERT_TRUE(ck.ok()) << ck.status().message();
  EXPECT_EQ(ck->info.world_size, 2u);
  EXPECT_EQ(ck->info.step, 1);
  size_t params = 0, states = 0;
  for (size_t i = 0; i < ck->tensors.size(); ++i) {
    const TensorRecord& t = ck->tensors[i];
    EXPECT_TRUE(t.error.empty()) << t.key << ": " << t.error;
    params += t.role == Role::kParam;
    states += t.role == Role::kOptimState;
    if (t.key == "model.embed_tokens.weight") {
      EXPECT_EQ(t.shape, (std::vector<int64_t>{67, 16}));
      auto frags = ck->fragments.Get(i);
      ASSERT_EQ(frags.size(), 2u);
      EXPECT_EQ(frags[0].offsets, (std::vector<int64_t>{0, 0}));
      EXPECT_EQ(frags[1].offsets, (std::vector<int64_t>{34, 0}));  // torch's ceil(67 / 2) rows on rank 0
      EXPECT_EQ(frags[1].lengths, (std::vector<int64_t>{33, 16}));
    }
  }
  EXPECT_EQ(params, 21u);
  EXPECT_EQ(states, 63u);  // step, exp_avg, exp_avg_sq of each, under the parameter's name
}

TEST(RankFilesTest, Fsdp1ShardedTensorsArePlacedByTheirShardMetadata) {
  ASSERT_TRUE(LooksLikeRankFiles(kFsdp1));
  auto ck = ReadRankFiles(kFsdp1);
  ASSERT_TRUE(ck.ok()) << ck.status().message();
  EXPECT_EQ(ck->info.family, Family::kAccelerateFsdp);
  EXPECT_EQ(ck->info.world_size, 2u);
  EXPECT_EQ(ck->info.step, 1);  // trainer_state.json
  EXPECT_TRUE(ck->info.findings.empty());
  size_t params = 0, states = 0;
  for (const TensorRecord& t : ck->tensors) {
    EXPECT_TRUE(t.error.empty()) << t.key << ": " << t.error;
    params += t.role == Role::kParam;
    states += t.role == Role::kOptimState;
  }
  EXPECT_EQ(params, 6u);
  EXPECT_EQ(states, 18u);
  size_t i = 0;
  const TensorRecord* w = Find(*ck, "proj.weight", &i);
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->shape, (std::vector<int64_t>{10, 6}));
  auto frags = ck->fragments.Get(i);
  ASSERT_EQ(frags.size(), 2u);  // FSDP1 flattens and splits evenly: rows 0-4 on rank 0, 5-9 on rank 1
  EXPECT_EQ(frags[0].offsets, (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(frags[1].offsets, (std::vector<int64_t>{5, 0}));
  EXPECT_EQ(ck->files[frags[1].file.v].rel_path, "pytorch_model_fsdp_0_rank1.bin");
  // The optimizer step is a plain tensor on every rank: rank 0's copy.
  const TensorRecord* step = Find(*ck, "optimizer.state.proj.weight.step", &i);
  ASSERT_NE(step, nullptr);
  frags = ck->fragments.Get(i);
  ASSERT_EQ(frags.size(), 1u);
  EXPECT_EQ(ck->files[frags[0].file.v].rel_path, "optimizer_0_rank0.bin");
}

TEST(RankFilesTest, Fsdp1RankFileCopiedOverAnotherIsAnOverlapNotAValue) {
  testing::TempDir dir;
  CopyFsdp1(dir.path());
  // rank 1's model file replaced by rank 0's: both claim rows 0-4, nobody rows 5-9.
  std::filesystem::copy_file(dir.path() + "/pytorch_model_fsdp_0_rank0.bin",
                             dir.path() + "/pytorch_model_fsdp_0_rank1.bin",
                             std::filesystem::copy_options::overwrite_existing);
  auto ck = ReadRankFiles(dir.path());
  ASSERT_TRUE(ck.ok()) << ck.status().message();
  const TensorRecord* w = Find(*ck, "proj.weight");
  ASSERT_NE(w, nullptr);
  EXPECT_NE(w->error.find("proj.weight"), std::string::npos) << w->error;
  EXPECT_NE(w->error.find("overlap"), std::string::npos) << w->error;
  // The optimizer files are intact.
  const TensorRecord* m = Find(*ck, "optimizer.state.proj.weight.exp_avg");
  ASSERT_NE(m, nullptr);
  EXPECT_TRUE(m->error.empty()) << m->error;
}

TEST(RankFilesTest, Fsdp1MissingRankZeroIsAFindingAndItsRowsAreHoles) {
  testing::TempDir dir;
  CopyFsdp1(dir.path());
  std::filesystem::remove(dir.path() + "/pytorch_model_fsdp_0_rank0.bin");
  auto ck = ReadRankFiles(dir.path());
  ASSERT_TRUE(ck.ok()) << ck.status().message();
  bool named = false;
  for (const auto& f : ck->info.findings)
    named |= f.message.find("pytorch_model_fsdp_0_rank0.bin is missing") != std::string::npos;
  EXPECT_TRUE(named);
  const TensorRecord* w = Find(*ck, "proj.weight");
  ASSERT_NE(w, nullptr);
  EXPECT_NE(w->error.find("hole"), std::string::npos) << w->error;
}

TEST(RankFilesTest, AWorldTheFilesCannotBackIsRefusedBeforeAnythingIsSizedByIt) {
  testing::TempDir dir;
  // One real verl rank file, renamed to claim a world of 999999 ranks.
  std::filesystem::copy_file(kActor + "/model_world_size_2_rank_0.pt",
                             dir.path() + "/model_world_size_999999_rank_0.pt");
  auto ck = ReadRankFiles(dir.path());
  ASSERT_FALSE(ck.ok());
  EXPECT_NE(ck.status().message().find("world of 999999 ranks, but only 1 rank files are present"), std::string::npos)
      << ck.status().message();
}

}  // namespace
}  // namespace ckptfs::formats
