// verl's per-rank FSDP2 files (tests/data/verl_fsdp2, written by verl 0.9.1's
// own FSDPCheckpointManager): DTensors kept as objects by the pickle VM and
// placed by the verl reader.
#include <gtest/gtest.h>

#include <filesystem>

#include "../test_util.h"
#include "formats/byte_reader.h"
#include "formats/torch_save.h"
#include "formats/torchsave/state_walk.h"
#include "formats/torchsave/rank_files_reader.h"

namespace ckptfs::formats {
namespace {

const std::string kActor = std::string(CKPTFS_TEST_DATA) + "/verl_fsdp2/global_step_1/actor";

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

}  // namespace
}  // namespace ckptfs::formats
