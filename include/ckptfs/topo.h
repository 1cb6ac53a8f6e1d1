// Resharded per-topology views (topo/) and the consolidated safetensors view
// (hf/): the planner that decides which slice of which global tensor every
// rank of a new parallel layout holds, and the file layouts that present
// those slices. Nothing is converted: a rank file is a list of segments, each
// a sub-box of a global tensor read at read time through the index.
//
// Design note. A view is named tp<T>-pp<P>[-dp<D>][-ep<E>]. For every
// parameter and optimizer state the planner picks a TP split rule — a rules
// file entry (--rules), else the rule the family reader recorded (Megatron
// layer types, DeepSpeed universal_checkpoint_info), else name conventions
// (Megatron, torchtitan, Hugging Face Llama names), else replication — and a
// pipeline stage: layer <i> of "layers.<i>." goes to the stage whose range
// holds it (even split, or --pp-layers), embeddings to the first stage,
// everything else outside the layer stack to the last. A rank's tensor is a
// list of global boxes concatenated along dim 0 (one box; two for SwiGLU's
// [W_r; V_r]). A dimension that does not divide is an error naming the
// tensor, never a silently wrong shard. With -ep<E>, MoE experts
// ("...local_experts.<g>...", global g) are dealt to expert-parallel rank
// g / (experts / E) of their stage; everything else is held by every EP rank.
#ifndef CKPTFS_TOPO_H_
#define CKPTFS_TOPO_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/common.h"
#include "ckptfs/geometry.h"
#include "ckptfs/index.h"
#include "ckptfs/model.h"
#include "ckptfs/topo_plan.h"

namespace re2 {
class RE2;
}  // namespace re2

namespace ckptfs {

// One override of the --rules file: the first entry whose regex (RE2 syntax,
// searched anywhere in the FQN, linear time) decides its split and/or stage.
struct RuleEntry {
  std::string pattern;
  std::shared_ptr<const re2::RE2> re;
  std::optional<TensorSplit> split;
  std::optional<std::string> stage;  // "first" | "last"
};
struct TopoOptions {
  std::vector<RuleEntry> rules;
  std::vector<int64_t> pp_layers;  // layers per stage (--pp-layers); empty: even split
  uint64_t hf_shard_bytes = 5'000'000'000;
  // hf/ (views/hf_export.h): --hf-arch NAME, --hf-config FILE (a config.json
  // used as the target), --hf-dtype model|source|fp32|bf16|fp16|master,
  // --hf-rope auto|interleaved|halves (how the source pairs RoPE dimensions).
  std::string hf_arch, hf_config, hf_dtype, hf_rope;
};
// The names --hf-arch ("llama", "mistral", ...) and --hf-dtype take.
std::vector<std::string> HfArchNames();
std::vector<std::string> HfDtypeNames();
// The names --hf-rope takes ("auto", "interleaved", "halves").
std::vector<std::string> HfRopeNames();
// The --rules file (JSON):
//   {"rules": [{"match": "<regex>", "split": "replicate"|"dim"|"sub2",
//               "dim": 1, "groups": 8, "stage": "first"|"last"}, ...],
//    "pp_layers": [3, 5]}
// Errors name the file and the entry.
Status ParseRulesFile(const std::string& path, TopoOptions& opts);
// "3,5" -> {3, 5}.
Result<std::vector<int64_t>> ParsePpLayers(std::string_view text);

Result<TopoPlan> PlanTopology(const Index& index, const Topology& topo, const TopoOptions& opts);

// Layer index of "...layers.<i>..." (also layer, h, blocks); -1 when none.
int64_t LayerOf(const std::string& fqn);

// Global MoE expert index of "...local_experts.<g>..."; -1 when none.
int64_t ExpertOf(const std::string& fqn);

}  // namespace ckptfs

#endif  // CKPTFS_TOPO_H_
