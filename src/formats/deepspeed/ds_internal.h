// Internals of the DeepSpeed reader (ds_reader.h has the design note), shared
// by its files. One read is one Reader: ds_discovery.cc finds and opens the
// files and parses the model states, ds_optimizer.cc parses the optimizer
// states, zero_geometry.cc places every parameter's fragments, ds_params.cc
// makes the params/ records, universal_patterns.cc reads
// universal_checkpoint_info and universal_export.cc lays out universal/;
// ds_reader.cc runs the steps in that order. Not a public interface.
#ifndef CKPTFS_FORMATS_DEEPSPEED_DS_INTERNAL_H_
#define CKPTFS_FORMATS_DEEPSPEED_DS_INTERNAL_H_

#include <re2/re2.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ckptfs/common.h"
#include "ckptfs/model.h"
#include "formats/pickle.h"
#include "formats/pickle_writer.h"
#include "formats/torch_file.h"
#include "formats/torch_save_writer.h"
#include "formats/tp_merge.h"

namespace ckptfs::formats::deepspeed {

// ---- file names (ds_discovery.cc) ------------------------------------------

// mp_rank_XX_model_states.pt (ZeRO-1/2, one per model-parallel rank).
const RE2& ModelRe();
// [bf16_|fp16_]zero_pp_rank_{dp}_mp_rank_{mp}_model_states.pt (ZeRO-3).
const RE2& Zero3ModelRe();

// ---- model and optimizer states --------------------------------------------

// param_shapes: a list (one per group) of OrderedDict name -> torch.Size.
using Shapes = std::vector<std::pair<std::string, std::vector<int64_t>>>;

// An expert parameter is `<prefix>deepspeed_experts.<i>.<rest>`
// (deepspeed/moe/experts.py); in param_shapes and the optimizer files i is
// local to the expert-parallel rank, in the expert files it is global.
// Defined in zero_geometry.cc.
const RE2& ExpertNameRe();

struct ModelStates {
  std::unique_ptr<Source> src;
  std::vector<Shapes> groups;
  std::vector<std::pair<std::string, const PyValue*>> module;  // state_dict entries, in order
  std::map<std::string, const PyValue*> module_by_name;        // the same, by name
  std::set<std::string> buffers;
  const PyValue* uci = nullptr;
  // The model's dtype: its parameters' (ZeRO-3's empty placeholders
  // included), else ds_config's bf16 / fp16; kInvalid when neither says.
  DType model_dtype = DType::kInvalid;
  std::string error;
};

struct OptimGroup {
  std::optional<Loc> fp32, exp_avg, exp_avg_sq, step;
  const PyValue* step_value = nullptr;  // a Python number (older torch)
  int64_t recorded_pad = -1;
  int64_t partition_count = -1;
  const PyValue* mapping = nullptr;  // OrderedDict name -> fragment_address
  std::vector<int64_t> align;        // per-parameter alignment gaps (param_alignment_paddings)
};

struct OptimRank {
  std::unique_ptr<Source> src;
  int stage = 0;  // 1, 2, 3
  bool bf16_optimizer = false;
  std::vector<OptimGroup> groups;
  const PyValue* osd = nullptr;  // optimizer_state_dict
  std::string error;
};

// Fills `o` (stage, flat groups, Adam states, recorded paddings and mappings)
// from the optimizer_state_dict of its opened source; an error makes the rank
// unreadable. Defined in ds_optimizer.cc.
Status ParseOptim(OptimRank& o);

// ---- universal_checkpoint_info (universal_patterns.cc) ---------------------

// Python's re.match: anchored at the start only. The patterns come from the
// checkpoint (untrusted), so they run on RE2 (linear time, bounded memory, no
// backtracking); a pattern RE2 cannot compile (Python-only syntax such as
// backreferences or lookaround) is reported, never silently ignored.
class PatternList {
 public:
  PatternList() = default;
  explicit PatternList(std::vector<std::string> ps);
  bool Match(const std::string& name) const;
  const std::vector<std::string>& bad() const { return bad_; }

 private:
  std::vector<std::shared_ptr<RE2>> res_;
  std::vector<std::string> bad_;
};

// The TP merge rules of universal_checkpoint_info, as ds_to_universal.py
// applies them; `present` is false when the checkpoint records none.
struct Patterns {
  PatternList replicated, average, row, vocab, sub2, sub_params;
  int64_t original_vocab = -1;
  bool present = false;
  double version = 0;  // universal_checkpoint_version
  // parameter_with_sub_params: each entry (a dict of SubparamShape's fields)
  // with its patterns, in order; sub_param_shard_widths (UCP >= 0.4).
  struct SubEntry {
    const PyValue* v = nullptr;
    std::vector<std::pair<std::string, PatternList>> patterns;
    const PyValue* Field(std::string_view k) const { return v->kind == PyKind::kDict ? v->Get(k) : v->Attr(k); }
  };
  std::vector<SubEntry> subs;
  const PyValue* shard_widths = nullptr;

  explicit Patterns(const PyValue* uci);
  static bool Any(const PatternList& ps, const std::string& n) { return ps.Match(n); }

  // The first sub-parameter entry and pattern matching `name` (the order
  // ds_to_universal.py's get_matched_sub_params_pattern searches).
  std::pair<const SubEntry*, std::string> SubFor(const std::string& name) const;

  // Fills rule.sub for a kSubParams parameter whose TP ranks hold `local`
  // shapes, as ds_to_universal.py's merge_tp_slices reads the entry: sizes
  // from a tuple at partition_dim (before UCP 0.4 a scalar there is the
  // number of equal sub-parameters), widths from sub_param_shard_widths
  // (UCP >= 0.4) or an even split.
  Status ResolveSub(const std::string& name, const std::vector<std::vector<int64_t>>& local, Rule& rule) const;

  // ds_to_universal.py's sub_param_shape value: SubparamShape(patterns,
  // shape, partition_dim) as the entry gives it, with a legacy scalar count
  // replaced by the tuple of sizes.
  Status WriteSubparamShape(PickleWriter& w, const std::string& name, const Rule& rule) const;
  // Patterns RE2 cannot compile (Python-only syntax): reported, never silently ignored.
  std::vector<std::string> Unusable() const;
  // The merge rule of parameter `name`.
  Rule For(const std::string& name) const;
};

// ---- geometry --------------------------------------------------------------

// One piece of a TP-local parameter held by one DP rank: the flat range
// [start, start+numel) of the TP-local tensor, at element `at` of the rank's
// flat partition of group `group`.
struct Piece {
  int dp = 0;
  int64_t start = 0, numel = 0, at = 0;
};

struct LocalParam {
  bool present = false;
  int mp = -1;  // the model-parallel file (pp * TP + tp) whose flat groups hold it
  int group = -1;
  std::vector<int64_t> shape;
  std::vector<Piece> pieces;
};

struct Param {
  std::string name;
  std::vector<LocalParam> tp;  // per TP rank
  std::string error;           // geometry contradiction
};

// ---- the model's own copy --------------------------------------------------

// One tensor of the model's own (low-precision) copy.
struct ModuleEntry {
  const Source* src = nullptr;
  const PyValue* v = nullptr;
  std::string error;  // no source holds it (a missing or unreadable layer file)
};
// The model's copy as TP rank t holds it: mp_rank_XX's `module`, or with
// PipelineEngine the layer files of every stage (global names).
struct ModuleCopy {
  std::vector<std::pair<std::string, ModuleEntry>> entries;  // in file order
  std::map<std::string, ModuleEntry> by_name;
  std::string error;  // a source that could not be read
  void Add(const std::string& name, ModuleEntry e) {
    if (by_name.emplace(name, e).second) entries.emplace_back(name, e);
  }
};

// ---- one read --------------------------------------------------------------

struct Reader {
  std::string dir, prefix;
  Checkpoint ck;
  Files files;
  // Model-parallel files, indexed mp = pp * tp + t (PipelineEngine's
  // ds_model_rank; without a pipeline, mp = t).
  std::vector<ModelStates> models;
  std::vector<std::unique_ptr<Source>> z3_copies;     // ZeRO-3 model states of DP ranks > 0 (copied, not parsed)
  std::vector<std::unique_ptr<Source>> layer_files;   // PipelineEngine layer_XX-model_TT files
  std::vector<ModuleCopy> module;                     // per TP rank
  std::vector<std::unique_ptr<Source>> expert_files;  // MoE layer_L_expert_E_mp_rank_MM files
  std::vector<std::unique_ptr<Source>> expp_files;    // DeepSpeed <= 0.15's expp_rank_<r>_mp_rank_MM optim files
  std::set<std::string> experts;                      // MoE expert parameters (global names)
  std::vector<std::vector<OptimRank>> optim;          // [dp][mp]
  int mp = 0, tp = 0, pp = 1, dp = 0, stage = 0;
  int root = 0;                 // the first readable model-states file
  bool data_before_ep = false;  // ds_config use_data_before_expert_parallelism (another MoE rank layout)
  int optim_on_disk = 0;        // optimizer state files found (readable or not)
  bool pipeline = false;
  const Patterns* patterns = nullptr;  // universal_checkpoint_info, during Emit
  bool bf16_optimizer = false;
  std::vector<Param> params;  // flat-group order of TP rank 0
  std::map<std::string, size_t> param_index;
  std::vector<std::string> problems;

  // ds_reader.cc: the whole read, and the emission it ends with.
  Status Run();
  Status Emit();

  // ds_discovery.cc: the tag directory, its files, the parallel degrees, the
  // parsed model and optimizer states and the model's own copy.
  Status Discover();
  Status Topology(const std::map<std::pair<int, int>, std::string>& layers);
  void ReadModule(const std::map<std::pair<int, int>, std::string>& layers);
  // ds_param_shapes.cc: a model-states file without param_shapes (DeepSpeed
  // <= 0.15's MoE saves), rebuilt from the optimizer files' slice mappings.
  Status SynthesizeParamShapes(int mi);

  // zero_geometry.cc: where every fragment of every parameter lies.
  void ComputeGeometry();
  void ZeroStage12Geometry(int m);
  void CheckSliceMappings(const OptimRank& o, size_t g, std::map<std::string, std::pair<int64_t, int64_t>> placed,
                          const std::function<std::string(const std::string&)>& global);
  void MarkParamBroken(const std::string& name, const std::string& why);  // first reason wins
  void ZeroStage3Geometry(int m);

  // ds_params.cc: the records of params/ (optimizer states, step, module copy).
  Status EmitStep(const Param& p, bool ucp);
  void EmitParam(Param& p, const Patterns& pats, bool ucp, std::set<std::string>& have_fp32);
  void EmitZero3Weight(const Param& p, const std::vector<int64_t>& shape, int64_t vocab_rows, uint32_t copies,
                       std::vector<Fragment> master);
  std::map<std::string, uint32_t> EmitModule(const Patterns& pats);
  // dcp_groups.cc: the param groups as dcp/'s optim.param_groups.<i>.<name>.
  Status ExportParamGroups();
  void EmitLostStages();

  // universal_export.cc: the archives and copies of universal/.
  Status ExportState(const std::string& name, const std::string& state, uint32_t tensor, const Rule& rule, bool dict);
  void AddArchive(const std::string& path, const std::string& stem, const std::string& pickle,
                  const std::vector<ArchiveStorage>& storages);
  Status ExportOptimizerState();
  void ExportCopies();
};

}  // namespace ckptfs::formats::deepspeed

#endif  // CKPTFS_FORMATS_DEEPSPEED_DS_INTERNAL_H_
