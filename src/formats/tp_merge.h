// How the tensor-parallel slices of one parameter merge into the global
// tensor, shared by the DeepSpeed (universal_checkpoint_info patterns) and
// Megatron (layer-type split rules) readers: concatenation on a dimension,
// replication, two sub-parameters concatenated on dim 0 (SwiGLU: each rank
// holds [W_r; V_r], the global tensor is [W_0..W_n; V_0..V_n]) and where a
// padded vocabulary ends. A merge is expressed as placement of boxes
// of each rank's local tensor into the global one, so a merged parameter is a
// set of fragments over the rank files and no bytes are moved at index time.
#ifndef CKPTFS_FORMATS_TP_MERGE_H_
#define CKPTFS_FORMATS_TP_MERGE_H_

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "ckptfs/common.h"
#include "ckptfs/geometry.h"
#include "ckptfs/model.h"
#include "formats/torch_file.h"

namespace ckptfs::formats {

// kAverage: every rank holds a full copy and the tensor is their mean
// (fragments carry replica = the rank; TensorRecord::replicas = the TP
// degree). kSubParams is a DeepSpeed rule ckptfs recognises but does not
// merge (the readers report it).
enum class Merge { kCat, kReplicated, kSub2, kAverage, kSubParams };
// kSubParams (DeepSpeed's parameter_with_sub_params, e.g. a fused QKV): along
// `dim` the tensor is sub-parameters of `sizes[j]` rows each, and TP rank t
// holds `widths[j][t]` rows of each, in sub-parameter order. Each rank's
// tensor is read as `logical` with dim `dim` = its own widths (a view of the
// contiguous slice); the merged tensor is `logical`.
struct SubParams {
  int dim = 0;
  std::vector<int64_t> logical;
  std::vector<int64_t> sizes;
  std::vector<std::vector<int64_t>> widths;  // [sub-parameter][tp rank]
  std::vector<int64_t> ViewShape(size_t t) const {
    std::vector<int64_t> v = logical;
    v[static_cast<size_t>(dim)] = 0;
    for (const auto& w : widths) v[static_cast<size_t>(dim)] += w[t];
    return v;
  }
};
struct Rule {
  Merge kind = Merge::kCat;
  int cat_dim = 0;
  bool vocab = false;
  SubParams sub;  // kSubParams
};

// The same rule as the split recorded for topo/ (kAverage: every rank holds
// the mean, i.e. a replicated tensor; kSubParams: unknown).
TensorSplit SplitOf(const Rule& r);

// The tensor-parallel split of a linear layer by its name, for checkpoints
// that record no rule: Meta / torchtitan Llama names (fairscale's
// ColumnParallelLinear wq wk wv w1 w3, RowParallelLinear wo w2) and Hugging
// Face Llama names (q/k/v/gate/up_proj, o/down_proj). 0 or 1: the split
// dimension; -1: a row-parallel layer's bias (replicated); nullopt: not such
// a layer. Embeddings, norms and the output layer are the caller's: their
// split differs between conventions.
std::optional<int> LlamaLinearSplitDim(std::string_view fqn);

// Maps a box of TP rank t's local tensor to boxes of the global tensor; each
// result carries the local offsets of its first element.
struct Placed {
  Box global;
  std::vector<int64_t> local_offsets;
};

// TensorRecord::vocab_rows for a merged tensor of `shape` under `rule`:
// `true_vocab` (the checkpoint's own record of it) where the rule is a
// vocabulary's, the tensor a matrix of rows (never a flat state) and the rows
// padded past it, else -1.
inline int64_t VocabRows(const Rule& rule, int64_t true_vocab, const std::vector<int64_t>& shape) {
  return rule.vocab && true_vocab >= 0 && shape.size() >= 2 && true_vocab < shape[0] ? true_vocab : -1;
}

// `local_shapes`: each TP rank's tensor shape. A vocabulary's padding rows
// are kept (TensorRecord::vocab_rows says where the vocabulary ends).
class Merger {
 public:
  Merger(Rule rule, std::vector<std::vector<int64_t>> local_shapes) : rule_(rule), local_(std::move(local_shapes)) {}

  // An error when the local shapes cannot be merged by the rule.
  Result<std::vector<int64_t>> GlobalShape() const;
  // Where box `b` of rank t's local tensor lands.
  std::vector<Placed> Place(int t, const Box& b) const;
  // Replicated parameters are served from rank 0 only.
  bool UsesRank(int t) const { return t == 0 || (rule_.kind != Merge::kReplicated); }
  // The shape boxes of rank t's tensor are given in: its own shape, or for
  // kSubParams its view (SubParams::ViewShape).
  std::vector<int64_t> LocalShape(int t) const;
  // How many copies the merged tensor averages (1 unless kAverage).
  uint32_t Copies() const {
    return rule_.kind == Merge::kAverage && !local_.empty() ? static_cast<uint32_t>(local_.size()) : 1;
  }
  // The copy a fragment of rank t belongs to.
  uint32_t CopyOf(int t) const { return rule_.kind == Merge::kAverage ? static_cast<uint32_t>(t) : 0; }

 private:
  Rule rule_;
  std::vector<std::vector<int64_t>> local_;
};

// Fragments of the whole TP-local tensor `l` of rank t (any strides) in file
// `file`; a contiguous tensor whose shape is not Merger::LocalShape(t) is read
// through that view.
void AddWholeFragments(const Merger& m, int t, const Loc& l, FileId file, std::vector<Fragment>& out);

// Fragments of one box-mapped source: the TP-local tensor of rank t whose
// flat range [start, start+numel) sits at byte `base` (element `start`).
void AddRangeFragments(const Merger& m, int t, const std::vector<int64_t>& local_shape, int64_t start, int64_t numel,
                       FileId file, DType dt, uint64_t base, std::vector<Fragment>& out);

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_TP_MERGE_H_
