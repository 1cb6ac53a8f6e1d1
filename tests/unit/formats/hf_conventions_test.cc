// The families' hf/ conventions against the shared vocabulary
// (ckptfs/hf_names.h): their rules produce exactly the tensors each target
// architecture has, and the family table registers them.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <utility>

#include "ckptfs/formats.h"
#include "ckptfs/hf_names.h"
#include "formats/dcp/torchtitan_hf.h"
#include "formats/megatron/hf_convention.h"

namespace ckptfs::hf {
namespace {

std::set<std::pair<std::string, When>> Tensors(const Arch& a) {
  std::set<std::pair<std::string, When>> s;
  for (const ArchTensor& t : ArchTensors(a)) s.emplace(t.name, t.when);
  return s;
}

// Megatron's tables name every tensor of every architecture, under the same
// conditions.
TEST(HfConventionsTest, MegatronRulesCoverEachArchitecture) {
  const HfConvention& c = formats::megatron::MegatronHfConvention();
  for (const Arch& a : Archs()) {
    std::set<std::pair<std::string, When>> dst;
    for (const MapRule* r : c.rules(a).rules) dst.emplace(r->dst, r->when);
    EXPECT_EQ(dst, Tensors(a)) << a.name;
  }
}

// torchtitan's tables name every tensor of the architectures its checks
// accept (no linear biases; QK norms for Qwen3).
TEST(HfConventionsTest, TorchtitanRulesCoverTheArchitecturesItMapsTo) {
  const HfConvention& c = formats::TorchtitanHfConvention();
  for (const char* name : {"llama", "mistral", "qwen3", "qwen3_moe"}) {
    const Arch& a = *ArchByName(name);
    const bool qk_norm = std::string(name).rfind("qwen3", 0) == 0;
    std::set<std::string> dst, want;
    for (const MapRule* r : c.rules(a).rules) dst.insert(r->dst);
    for (const ArchTensor& t : ArchTensors(a)) {
      if (t.when == When::kAlways || t.when == When::kUntied || (qk_norm && t.when == When::kQkNorm)) {
        want.insert(t.name);
      }
    }
    EXPECT_EQ(dst, want) << name;
    EXPECT_EQ(c.rules(a).permute_rope, !qk_norm) << name;
  }
}

TEST(HfConventionsTest, TheFamilyTableRegistersThem) {
  std::set<std::pair<std::string, std::string>> rows;
  for (const FamilyReader& r : FamilyReaders()) {
    if (r.hf != nullptr) rows.emplace(r.name, r.hf->name);
  }
  EXPECT_EQ(rows, (std::set<std::pair<std::string, std::string>>{{"megatron-dist", "megatron"},
                                                                 {"megatron-legacy", "megatron"},
                                                                 {"pytorch-dcp", "torchtitan"},
                                                                 {"rank-files", "verl"},
                                                                 {"torch-save", "meta"}}));
}

}  // namespace
}  // namespace ckptfs::hf
