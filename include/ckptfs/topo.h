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

namespace re2 {
class RE2;
}  // namespace re2

namespace ckptfs {

struct Topology {
  int tp = 1, pp = 1;
  int dp = 0, ep = 0;  // 0: not part of the name
  // "tp4-pp2", "tp2-pp1-dp4", "tp1-pp1-ep2"; nullopt for anything else.
  static std::optional<Topology> Parse(std::string_view name);
  std::string Name() const;
};

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
  // used as the target), --hf-dtype model|source|fp32|bf16|fp16|master.
  std::string hf_arch, hf_config, hf_dtype;
};
// The names --hf-arch ("llama", "mistral", ...) and --hf-dtype take.
std::vector<std::string> HfArchNames();
std::vector<std::string> HfDtypeNames();
// The --rules file (JSON):
//   {"rules": [{"match": "<regex>", "split": "replicate"|"dim"|"sub2",
//               "dim": 1, "groups": 8, "stage": "first"|"last"}, ...],
//    "pp_layers": [3, 5]}
// Errors name the file and the entry.
Status ParseRulesFile(const std::string& path, TopoOptions& opts);
// "3,5" -> {3, 5}.
Result<std::vector<int64_t>> ParsePpLayers(std::string_view text);

// A tensor as rank (tp, pp[, ep]) holds it.
struct RankTensor {
  TensorId id;
  std::string name;             // safetensors key: <fqn> or optimizer.state.<fqn>.<state>
  std::vector<int64_t> shape;   // the rank's local shape
  std::vector<Box> pieces;      // global boxes, concatenated along dim 0 in order
  uint64_t zero_tail = 0;       // then this many zero elements (vocabulary padding rows)
  std::string rule;             // "dim 0 (megatron)", "replicated (no rule)", ...
  DType out = DType::kInvalid;  // rendered as (kInvalid: the source dtype)
  // The pieces (whole rows of a 2-D tensor) concatenated, then transposed:
  // `shape` is [columns, rows] (hf/ GPT-2 Conv1D weights).
  bool transposed = false;
};
struct RankPlan {
  int tp = 0, pp = 0, ep = 0;
  std::vector<RankTensor> tensors;
};
struct TopoPlan {
  Topology topo;
  std::vector<std::pair<int64_t, int64_t>> stage_layers;  // [first, end) global layers per stage
  int64_t num_layers = 0;
  int64_t num_experts = 0;      // MoE experts per layer (local_experts.<i>.), 0: none
  std::vector<RankPlan> ranks;  // index (pp * EP + ep) * TP + tp, EP = max(topo.ep, 1)
  std::vector<std::string> notes;
};
Result<TopoPlan> PlanTopology(const Index& index, const Topology& topo, const TopoOptions& opts);

// Layer index of "...layers.<i>..." (also layer, h, blocks); -1 when none.
int64_t LayerOf(const std::string& fqn);

// Global MoE expert index of "...local_experts.<g>..."; -1 when none.
int64_t ExpertOf(const std::string& fqn);

}  // namespace ckptfs

#endif  // CKPTFS_TOPO_H_
