// The plan of a resharded view (topo/): which sub-boxes of which global
// tensors each rank of a new parallel layout holds. Plain data, made by the
// views layer's planner (topo.h PlanTopology) and read by it and by the
// family hooks that lay out a family's native files at the new layout
// (formats.h FamilyReader::native_files); it depends on nothing above the
// data model.
#ifndef CKPTFS_TOPO_PLAN_H_
#define CKPTFS_TOPO_PLAN_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ckptfs/geometry.h"
#include "ckptfs/model.h"

namespace ckptfs {

struct Topology {
  int tp = 1, pp = 1;
  int dp = 0, ep = 0;  // 0: not part of the name
  // "tp4-pp2", "tp2-pp1-dp4", "tp1-pp1-ep2"; nullopt for anything else.
  static std::optional<Topology> Parse(std::string_view name);
  std::string Name() const;
};

// A tensor as rank (tp, pp[, ep]) holds it.
struct RankTensor {
  TensorId id;
  std::string name;             // safetensors key: <fqn> or optimizer.state.<fqn>.<state>
  std::vector<int64_t> shape;   // the rank's local shape
  std::vector<Box> pieces;      // global boxes, concatenated along dim 0 in order
  uint64_t zero_tail = 0;       // then this many zero elements (vocabulary padding rows)
  std::string rule;             // "dim 0 (megatron)", "replicated (no rule)", ...
  DType out = DType::kInvalid;  // rendered as (kInvalid: the source dtype)
  // The pieces as matrices under `how` (geometry.h Transpose), their rows
  // concatenated, then transposed: `shape` is [columns, rows] (hf/ GPT-2
  // Conv1D weights, Flax kernels).
  bool transposed = false;
  Transpose how;
  // Every element multiplied by `scale`, then `add` added, in double, rounded
  // once to `out` (hf/: MaxText's query kernels, Gemma's embedding and norms).
  double scale = 1.0, add = 0.0;
};
// The global shape a layout places `t` from: a vocabulary the family says
// loaders re-pad (TensorSplit::pad_rows, DeepSpeed universal) by its true
// rows; any other (Megatron's padded vocabulary) as stored.
inline std::vector<int64_t> PlacedShape(const TensorRecord& t) { return t.split.pad_rows ? t.VocabShape() : t.shape; }

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
}  // namespace ckptfs

#endif  // CKPTFS_TOPO_PLAN_H_
