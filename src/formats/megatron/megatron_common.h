// Facts shared by the Megatron-LM readers (legacy torch, torch_dist, zarr):
// the iteration tracker, the tensor-parallel split of each parameter kind
// (megatron/core/tensor_parallel/layers.py and the checkpoint converters),
// and the layer numbering of pipeline stages. See
// docs/formats/notes/deepspeed-megatron.md section 4.
#ifndef CKPTFS_FORMATS_MEGATRON_MEGATRON_COMMON_H_
#define CKPTFS_FORMATS_MEGATRON_MEGATRON_COMMON_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ckptfs/common.h"
#include "ckptfs/model.h"
#include "formats/pickle.h"
#include "formats/tp_merge.h"

namespace ckptfs::formats::megatron {

// The directory of one saved iteration: `dir` itself when it holds rank
// directories or a metadata.json, else the one latest_checkpointed_iteration.txt
// names (iter_%07d or release; Megatron-LM and Megatron-Bridge). NeMo 2 roots:
// a checkpoint directory (weights/ + context/) reads its weights/; a
// checkpoints/ directory of several reads the one NeMo resumes from (see
// FindNemo2). `step` is set from the tracker or the name.
struct IterDir {
  std::string path;  // absolute or as given
  std::string rel;   // relative to the mount source ("" or "iter_0000007")
  int64_t step = -1;
  std::string wrapper;  // what wrote it when not Megatron-LM itself ("NeMo 2 checkpoint '<name>'")
};
Result<IterDir> FindIterDir(const std::string& dir);
bool HasTracker(const std::string& dir);
// A NeMo 2 checkpoint, or a directory of them (even when none can be chosen).
bool IsNemo2Root(const std::string& dir);

// How TP ranks of a parameter merge, from its name (mcore and legacy
// GPT/BERT names). nullopt: ckptfs knows no rule for the name.
//  * column parallel (dim 0): linear_qkv, query_key_value, linear_fc1,
//    dense_h_to_4h, word_embeddings, output_layer (weights and biases);
//    linear_fc1 / dense_h_to_4h as two sub-parameters when `swiglu`.
//  * row parallel (dim 1): linear_proj, self_attention.dense, linear_fc2,
//    dense_4h_to_h weights; their biases are replicated.
//  * replicated: norms, position embeddings, the MoE router.
std::optional<Rule> SplitRule(const std::string& name, bool swiglu);

// What the split rules need from the run's args: swiglu, and the query groups
// a fused QKV must not cut (num_query_groups, else num_attention_heads).
// The parallel layout (for the distributed-optimizer replay): tp/dp -1 and
// pipe.num_layers -1 when args do not say; `local_impl`: mcore's local layer
// spec (args.transformer_impl == "local"), else Transformer Engine's.
struct ModelFacts {
  bool swiglu = false;
  int64_t qkv_groups = 0;
  int64_t tp = -1, dp = -1;
  int64_t pp = 1, vp = 1;
  int64_t num_layers = -1, first_stage_layers = -1, last_stage_layers = -1;
  bool local_impl = false;
  // DDP bucketing (distributed-optimizer replay): overlap_grad_reduce turns
  // bucketing on, ddp_bucket_size (-1: Megatron's default) sets the size;
  // `tied`: embeddings shared with the output layer (untie_... false).
  bool overlap_grad_reduce = false;
  int64_t ddp_bucket_size = -1;
  bool tied = false;
  // MoE: experts per layer and the expert-parallel size (0 / 1 without).
  int64_t num_experts = 0, ep = 1;
  // args.vocab_size: the tokenizer's vocabulary, before Megatron pads it to
  // padded_vocab_size (-1: not recorded).
  int64_t vocab = -1;
};
ModelFacts FactsOf(const PyValue* args);  // args may be null
// Records each parameter's (and optimizer state's) TP split on its record for
// the topo/ views (SplitRule by name plus the facts), and where a padded
// vocabulary ends (TensorRecord::vocab_rows, from args.vocab_size).
void SetSplits(const ModelFacts& facts, Checkpoint& ck);

// A parameter name with "layers.<i>." renumbered: `offset` added to i.
// Returns the name unchanged when it has no layer index; `index` gets the
// global layer (or -1).
std::string RenumberLayer(const std::string& name, int64_t offset, int64_t* index);

// An MoE expert name ("...mlp.experts.local_experts.<k>...") with k
// renumbered: `offset` (expert-parallel rank x local experts) added. Returns
// the name unchanged when it names no expert; `index` gets the global expert
// (or -1).
std::string RenumberExpert(const std::string& name, int64_t offset, int64_t* index);

// The global index of the first layer of pipeline stage `pp`, model chunk
// `vp` (megatron/core/transformer/transformer_layer.py get_transformer_layer_offset):
// uniform stages, virtual pipeline chunks, and uneven first/last stages.
struct PipelineShape {
  int64_t num_layers = -1;
  int pp = 1, vp = 1;
  int64_t first_stage_layers = -1, last_stage_layers = -1;  // -1: uniform
};
Result<int64_t> LayerOffset(const PipelineShape& s, int pp, int vp);
// Layers held by one model chunk.
Result<int64_t> LayersPerChunk(const PipelineShape& s, int pp);

// mcore's local layer spec keeps its layer norms as modules of their own
// but saves them in sharded state dicts under the fused layers' names (the
// spec's sharded_state_dict_keys_map; Transformer Engine's own names):
// {module prefix, sharded-key prefix} within a layer.
struct NormKey {
  const char* module;
  const char* sharded;
};
inline constexpr NormKey kLocalSpecNormKeys[] = {{"input_layernorm.", "self_attention.linear_qkv.layer_norm_"},
                                                 {"pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"}};

// args.<name> as an int / bool / str when present (argparse.Namespace pickled).
std::optional<int64_t> ArgInt(const PyValue* args, const std::string& name);
std::optional<bool> ArgBool(const PyValue* args, const std::string& name);
std::optional<std::string> ArgStr(const PyValue* args, const std::string& name);

// Adds /args.json (ToJson of the run's args) to the checkpoint's exports, and
// the internal export kArgsPickle: the args Namespace as pickle opcodes (a
// PickleWriter::Fragment) that topo/'s Megatron-native files embed.
inline constexpr const char* kArgsPickle = "@megatron/args.pkl";
void ExportArgsJson(const PyValue* args, Checkpoint& ck);

// The torch_dist profile's common.pt (torch_dist_profile.h), made at index
// time from the run's non-sharded state: `root` is rank 0's
// model_optim_rng.pt (legacy) or common.pt (torch_dist, zarr). Its entries
// but the model, the RNG state and the optimizer's tensors, the optimizer as
// the distributed optimizer's fully_reshardable state dict keeps it in
// common.pt ({optimizer: {param_groups}, param_state_sharding_type}), as the
// internal export kCommonPickle (pickle opcodes of the dict); or, where that
// cannot be made, kCommonWhy with the reason.
inline constexpr const char* kCommonPickle = "@megatron/common.pkl";
inline constexpr const char* kCommonWhy = "@megatron/common.why";
// The optimizer entry of the run's common state `root` (common.pt,
// model_optim_rng.pt); null when none was saved. Lightning's list of its one
// optimizer's state (NeMo 2) is that state, which is also what a
// ChainedOptimizer of one member loads.
const PyValue* CommonOptimizer(const PyValue* root);

// The members of a ChainedOptimizer's state `opt` (MoE: the dense optimizer,
// then the expert one), in order: a list (the legacy format), or a dict whose
// keys are all 0, 1, ... (common.pt) or all chained_0, chained_1, .... Empty
// when `opt` is one optimizer's state. Members not numbered 0, 1, ..., or a
// member that is empty, are an error.
Result<std::vector<const PyValue*>> ChainedMembers(const PyValue& opt);

// The param groups a distributed optimizer keeps in its per-DP-rank objects
// instead of common.pt (dp_reshardable, dp_zero_gather_scatter;
// DistOptimizerParamGroups reads them), each as pickle opcodes of a list
// (PickleWriter::Fragment): `single` for one optimizer, `members[i]` for
// member i (chained_<i>.) of a ChainedOptimizer (MoE: dense, then experts).
struct PerDpRankGroups {
  std::string single;
  std::vector<std::string> members;
  bool empty() const { return single.empty() && members.empty(); }
};
// `groups`: for a torch_dist source whose layout keeps them out of common.pt.
void ExportTorchDistCommon(const PyValue* root, Checkpoint& ck, const PerDpRankGroups& groups = {});

// Megatron's default rules (megatron/core/optimizer _get_param_groups): no
// weight decay for biases and 1-D parameters; expert parameters (MoE) are
// held per expert-parallel rank and are not all-reduced across data
// parallelism (is_expert_parallel).
bool NoWeightDecay(const std::string& name, const std::vector<int64_t>& shape);
bool IsExpert(const std::string& name);

// A param group's key in _get_param_groups (weight decay or not, experts or
// not): which parameters it takes.
struct GroupKey {
  bool no_wd = false, expert = false;
  bool operator==(const GroupKey&) const = default;
  bool Takes(const std::string& name, const std::vector<int64_t>& shape) const {
    return NoWeightDecay(name, shape) == no_wd && IsExpert(name) == expert;
  }
};
// The keys of `groups` (saved param group dicts: wd_mult or weight_decay,
// is_expert_parallel), in order. A group that is not a dict or has neither,
// or two groups with one key (lr scaling: their members cannot be told
// apart), is an error.
Result<std::vector<GroupKey>> GroupKeysOf(const std::vector<const PyValue*>& groups);

// The optimizer's param groups for dcp/ (formats/param_groups.h) from
// `optimizer`, the "optimizer" entry a rank file (legacy) or common.pt saved
// (every rank steps with the same hyperparameters; the distributed optimizer
// deletes each group's "params"). Group i's FQNs are every parameter of `ck`
// with its (weight decay, expert) key, as _get_param_groups assigns them. A
// ChainedOptimizer's (MoE: a list of optimizers, or chained_<i> entries)
// groups follow one another, the dense optimizer's first. Two groups with one
// key (lr scaling), groups without those keys or a parameter no group takes
// are an error naming `what`, and nothing is added.
Status ExportParamGroups(const PyValue& optimizer, const std::string& what, Checkpoint& ck);
// The same from the param_groups list itself.
Status ExportParamGroupList(const PyValue& groups, const std::string& what, Checkpoint& ck);

// A JSON rendering of a pickled value (Namespace / dict / list / scalars; torch
// dtypes and other objects as their class name) for args.json.
std::string ToJson(const PyValue* v, int indent = 0);

}  // namespace ckptfs::formats::megatron

#endif  // CKPTFS_FORMATS_MEGATRON_MEGATRON_COMMON_H_
