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
#include "formats/orbax/maxtext_hf.h"

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
    if (a.layout == Layout::kGemma2) {  // refused by its fits check
      std::vector<std::string> why;
      EXPECT_FALSE(c.fits(HfSource{Family::kMegatronTorchDist, {}, {}, {}, ""}, a, json::object(), why));
      continue;
    }
    std::set<std::pair<std::string, When>> dst;
    for (const MapRule* r : c.rules(a, json::object()).rules) dst.emplace(r->dst, r->when);
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
    for (const MapRule* r : c.rules(a, json::object()).rules) dst.insert(r->dst);
    for (const ArchTensor& t : ArchTensors(a)) {
      if (t.when == When::kAlways || t.when == When::kUntied || (qk_norm && t.when == When::kQkNorm)) {
        want.insert(t.name);
      }
    }
    EXPECT_EQ(dst, want) << name;
    EXPECT_EQ(c.rules(a, json::object()).permute_rope, !qk_norm) << name;
  }
}

// MaxText's table names every tensor of Llama and Mistral, scanned (one
// stack per tensor, axis 1) and unscanned (layers_<N>) alike; its RoPE pairing
// is halves unless the config is a Llama 3.x, where only --hf-rope can tell.
TEST(HfConventionsTest, MaxTextRulesCoverLlamaAndMistralScannedOrNot) {
  const HfConvention& c = formats::MaxTextHfConvention();
  for (const char* name : {"llama", "mistral"}) {
    const Arch& a = *ArchByName(name);
    std::set<std::string> scanned, unscanned, want;
    const HfRules rules = c.rules(a, json::object());
    for (const MapRule* r : rules.rules) {
      const bool per_layer = std::string(r->dst).find("{L}") != std::string::npos;
      const bool stacked = r->stack_axis >= 0, layers_n = std::string(r->src).find("{L}") != std::string::npos;
      if (!per_layer || stacked) scanned.insert(r->dst);
      if (!per_layer || layers_n) unscanned.insert(r->dst);
      EXPECT_FALSE(stacked && layers_n) << r->src;
      EXPECT_EQ(r->scale == Scale::kSqrtHeadDim, std::string(r->dst).find("q_proj") != std::string::npos) << r->src;
    }
    for (const ArchTensor& t : ArchTensors(a)) {
      if (t.when == When::kAlways || t.when == When::kUntied) want.insert(t.name);
    }
    EXPECT_EQ(scanned, want) << name;
    EXPECT_EQ(unscanned, want) << name;
    EXPECT_FALSE(rules.permute_rope);
    EXPECT_TRUE(rules.rope_undecided.empty());
  }
  // Gemma 2: scanned only, each MaxText layer a local (Hugging Face 2l) and a
  // global (2l + 1) block; norms -1, the embedding over sqrt(hidden).
  const Arch& gemma2 = *ArchByName("gemma2");
  std::set<std::string> dst, want;
  for (const MapRule* r : c.rules(gemma2, json::object()).rules) {
    dst.insert(r->dst);
    const std::string src = r->src, to = r->dst;
    if (to.find("{L}") != std::string::npos) {
      EXPECT_EQ(r->stack_axis, 1) << src;
      EXPECT_EQ(r->layer_stride, 2) << src;
      EXPECT_EQ(r->layer_offset, src.find("_global") != std::string::npos ? 1 : 0) << src;
    }
    EXPECT_EQ(r->add, to.find("norm") != std::string::npos ? -1 : 0) << src;
  }
  for (const ArchTensor& t : ArchTensors(gemma2)) {
    if (t.when == When::kAlways) want.insert(t.name);
  }
  EXPECT_EQ(dst, want);
  const json llama3 = json::parse(R"({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}})");
  EXPECT_FALSE(c.rules(*ArchByName("llama"), llama3).rope_undecided.empty());
  const json llama3_4x = json::parse(R"({"rope_scaling": {"rope_type": "llama3"}})");
  EXPECT_FALSE(c.rules(*ArchByName("llama"), llama3_4x).rope_undecided.empty());
}

TEST(HfConventionsTest, TheFamilyTableRegistersThem) {
  std::set<std::pair<std::string, std::string>> rows;
  for (const FamilyReader& r : FamilyReaders()) {
    if (r.hf != nullptr) rows.emplace(r.name, r.hf->name);
  }
  EXPECT_EQ(rows, (std::set<std::pair<std::string, std::string>>{{"megatron-dist", "megatron"},
                                                                 {"megatron-legacy", "megatron"},
                                                                 {"orbax", "maxtext"},
                                                                 {"pytorch-dcp", "torchtitan"},
                                                                 {"rank-files", "verl"},
                                                                 {"torch-save", "meta"}}));
}

}  // namespace
}  // namespace ckptfs::hf
