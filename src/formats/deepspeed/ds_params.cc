// The records of params/: per optimizer-backed parameter its fp32 master and
// Adam states (TP-merged by the patterns' rules, DP fragments joined) and its
// step; the model's own copy (module) and buffers; unreadable records for what
// a lost model-states file hides. Contract: every failure is a per-record
// error (EIO when read), never a missing file; the universal/ archives of the
// same tensors are requested from universal_export.cc as records are made.
#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "ckptfs/geometry.h"
#include "formats/deepspeed/ds_internal.h"
#include "formats/pickle_writer.h"
#include "formats/torch_file.h"
#include "formats/tp_merge.h"

namespace ckptfs::formats::deepspeed {
namespace {

std::string DictKey(const std::string& name, const std::string& state) { return name + "/" + state; }

}  // namespace

// params/<p>/step and universal/zero/<p>/step.pt: the group's step on (dp 0,
// tp 0) of the parameter's stage; that the ranks agree is for `ckptfs verify`
// to check.
Status Reader::EmitStep(const Param& p, bool ucp) {
  const OptimRank& o = optim[0][p.tp[0].mp];
  if (!o.error.empty() || static_cast<size_t>(p.tp[0].group) >= o.groups.size()) return Status::Ok();
  const OptimGroup& og = o.groups[static_cast<size_t>(p.tp[0].group)];
  PickleWriter w;
  std::vector<ArchiveStorage> storages;
  if (og.step.has_value() && og.step->Numel() == 1) {
    const Loc& l = *og.step;
    TensorRecord rec;
    rec.key = DictKey(p.name, "step");
    rec.role = Role::kOptimState;
    rec.fqn = p.name;
    rec.state = "step";
    rec.dtype = l.dtype;
    rec.shape = l.shape;
    Fragment f;
    f.file = o.src->file;
    f.dtype = l.dtype;
    f.offsets.assign(l.shape.size(), 0);
    f.lengths = l.shape;
    f.strides = l.strides;
    f.data_offset = l.data_offset;
    f.data_length = DTypeSize(l.dtype);
    uint32_t id = ck.AddTensor(std::move(rec), {std::move(f)});
    RETURN_IF_ERROR(w.Tensor("0", l.dtype, 1, 0, l.shape, ContiguousStrides(l.shape)));
    storages.push_back(ArchiveStorage{id, l.dtype, DTypeSize(l.dtype), {}});
  } else if (og.step_value != nullptr) {
    RETURN_IF_ERROR(w.Value(*og.step_value, [](PickleWriter&, const PyValue&) { return Unsupported("a tensor"); }));
  } else {
    return Status::Ok();
  }
  if (ucp) AddArchive("universal/zero/" + p.name + "/step.pt", "step", w.Finish(), storages);
  return Status::Ok();
}

// The fp32 master and Adam states of one optimizer-backed parameter: params/
// records (TP-merged, DP fragments joined) and their universal/ archives.
void Reader::EmitParam(Param& p, const Patterns& pats, bool ucp, std::set<std::string>& have_fp32) {
  // Plain ZeRO-3 merges over DP only and saves bare flat tensors; with TP it
  // takes the stage-1/2 TP merge (ds_to_universal.py does the same).
  const bool as_dict = stage != 3 || tp > 1;
  Rule rule = as_dict ? pats.For(p.name) : Rule{};
  std::vector<std::vector<int64_t>> local;
  std::string err = p.error;
  for (int t = 0; t < tp && err.empty(); ++t) {
    if (!p.tp[t].present) {
      if (rule.kind == Merge::kReplicated && t > 0) {
        local.push_back(p.tp[0].shape);
        continue;
      }
      std::string why;
      for (int m = t; m < mp; m += tp) {
        if (!models[m].error.empty()) why = " (" + models[m].error + ")";
      }
      err = "parameter '" + p.name + "' is missing from TP rank " + std::to_string(t) + "'s param_shapes" + why;
    } else {
      local.push_back(p.tp[t].shape);
    }
  }
  if (err.empty() && rule.kind == Merge::kSubParams) {
    Status st = pats.ResolveSub(p.name, local, rule);
    if (!st.ok()) err = "parameter '" + p.name + "': " + st.message();
  }
  Merger merger(rule, local);
  std::vector<int64_t> gshape;
  if (err.empty()) {
    auto gs = merger.GlobalShape();
    if (!gs.ok()) {
      err = "parameter '" + p.name + "': " + gs.status().message();
    } else {
      gshape = *gs;
    }
  }
  std::vector<Fragment> fp32_frags;  // ZeRO-3: the master the weight is rebuilt from
  for (const char* state : {"fp32", "exp_avg", "exp_avg_sq"}) {
    TensorRecord rec;
    rec.key = DictKey(p.name, state);
    rec.role = Role::kOptimState;
    rec.fqn = p.name;
    rec.state = state;
    rec.dtype = DType::kF32;
    rec.shape = gshape;
    rec.vocab_rows = VocabRows(rule, pats.original_vocab, gshape);
    rec.error = err;
    rec.replicas = err.empty() ? merger.Copies() : 1;
    std::vector<Fragment> frags;
    for (int t = 0; t < tp && rec.error.empty(); ++t) {
      if (!merger.UsesRank(t)) continue;
      const LocalParam& lp = p.tp[t];
      for (const Piece& pc : lp.pieces) {
        const OptimRank& o = optim[pc.dp][lp.mp];
        if (!o.error.empty()) {
          rec.error = "parameter '" + p.name + "' needs " + o.src->rel + ": " + o.error;
          break;
        }
        const OptimGroup& og = o.groups[static_cast<size_t>(lp.group)];
        const std::optional<Loc>& l = std::string(state) == "fp32"      ? og.fp32
                                      : std::string(state) == "exp_avg" ? og.exp_avg
                                                                        : og.exp_avg_sq;
        if (!l.has_value()) {
          rec.error = o.src->rel + ": group " + std::to_string(lp.group) + " has no " + state;
          break;
        }
        if (l->dtype != DType::kF32) {
          rec.dtype = l->dtype;
        }
        if (pc.at + pc.numel > l->Numel()) {
          rec.error = o.src->rel + ": group " + std::to_string(lp.group) + " " + state + " has " +
                      std::to_string(l->Numel()) + " elements, '" + p.name + "' needs [" + std::to_string(pc.at) +
                      ", " + std::to_string(pc.at + pc.numel) + ")";
          break;
        }
        AddRangeFragments(merger, t, merger.LocalShape(t), pc.start, pc.numel, o.src->file, l->dtype,
                          l->data_offset + static_cast<uint64_t>(pc.at) * DTypeSize(l->dtype), frags);
      }
    }
    if (!rec.error.empty()) frags.clear();
    const bool bad = !rec.error.empty();
    if (!bad && stage == 3 && std::string(state) == "fp32" && rec.dtype == DType::kF32) fp32_frags = frags;
    uint32_t id = ck.AddTensor(std::move(rec), std::move(frags));
    if (!bad && ucp && ck.tensors[id].dtype == DType::kF32 && !experts.count(p.name)) {
      Status st = ExportState(p.name, state, id, rule, as_dict);
      if (!st.ok()) problems.push_back("universal/zero/" + p.name + "/" + state + ".pt: " + st.message());
      if (std::string(state) == "fp32") have_fp32.insert(p.name);
    } else if (bad && ucp && std::string(state) == "fp32") {
      have_fp32.insert(p.name);  // ds_to_universal would fail here too: no silent substitute
    }
  }
  if (!fp32_frags.empty())
    EmitZero3Weight(p, gshape, VocabRows(rule, pats.original_vocab, gshape), merger.Copies(), std::move(fp32_frags));
  if (stage != 3 && err.empty() && p.tp[0].present && p.tp[0].group >= 0) {
    Status st = EmitStep(p, ucp && !experts.count(p.name));
    if (!st.ok()) problems.push_back("no step for '" + p.name + "': " + st.message());
  }
}

// An unreadable model-states file hides its stage's param_shapes: under
// PipelineEngine the layer files still name that stage's parameters, whose
// optimizer states are then unreadable records naming the file (EIO, never
// absent); it is listed in any case.
void Reader::EmitLostStages() {
  std::set<std::string> lost;
  for (int m = 0; m < mp; ++m) {
    if (models[m].error.empty()) continue;
    problems.push_back(models[m].error + ": the optimizer states of pipeline stage " + std::to_string(m / tp) +
                       ", TP rank " + std::to_string(m % tp) + " have no view");
    if (!pipeline) continue;
    for (const auto& [name, e] : module[m % tp].entries) {
      if (param_index.count(name) || !e.error.empty() || !lost.insert(name).second) continue;
      for (const char* state : {"fp32", "exp_avg", "exp_avg_sq"}) {
        TensorRecord rec;
        rec.key = DictKey(name, state);
        rec.role = Role::kOptimState;
        rec.fqn = name;
        rec.state = state;
        rec.dtype = DType::kF32;
        rec.error = "'" + name + "' needs the param_shapes of " + models[m].error;
        ck.AddTensor(std::move(rec), {});
      }
    }
  }
}

// ZeRO-3 saves no weights (the module holds empty placeholders): the weight
// is what the engine rebuilds when it gathers a parameter, the fp32 master
// cast to the model's dtype (round to nearest even), served as `param`,
// derived and marked so in info.json.
void Reader::EmitZero3Weight(const Param& p, const std::vector<int64_t>& shape, int64_t vocab_rows, uint32_t copies,
                             std::vector<Fragment> master) {
  const DType model = models[p.tp[0].mp].model_dtype;
  TensorRecord rec;
  rec.key = DictKey(p.name, "param");
  rec.role = Role::kParam;
  rec.fqn = p.name;
  rec.state = "param";
  rec.dtype = model == DType::kInvalid ? DType::kF32 : model;
  rec.shape = shape;
  rec.vocab_rows = vocab_rows;
  rec.replicas = copies;
  rec.derived = rec.dtype == DType::kF32
                    ? "ZeRO-3 saves no weights: the fp32 master, which the engine gathers as the weight" +
                          std::string(model == DType::kInvalid ? " (the checkpoint records no model dtype)" : "")
                    : "ZeRO-3 saves no weights: the fp32 master cast to " + std::string(DTypeName(rec.dtype)) +
                          " (round to nearest even), as the engine gathers it";
  ck.AddTensor(std::move(rec), std::move(master));
}

// The model's own copy (module): param per parameter, TP-merged like the
// optimizer states; buffers under other/. ZeRO-3 saves no module. Returns, per
// name, the record holding mp_rank_00's tensor (ds_to_universal.py's fp32.pt
// fallback for names without optimizer state).
std::map<std::string, uint32_t> Reader::EmitModule(const Patterns& pats) {
  std::map<std::string, uint32_t> module_record;
  std::set<std::string> buffers;
  for (const ModelStates& m : models) buffers.insert(m.buffers.begin(), m.buffers.end());
  // TP rank 0's names (a later rank's when rank 0's model states are unreadable).
  size_t lead = 0;
  while (lead + 1 < module.size() && module[lead].entries.empty()) ++lead;
  for (const auto& [name, e0] : module[lead].entries) {
    const bool buffer = buffers.count(name) > 0;
    Rule rule = buffer ? Rule{Merge::kReplicated, 0, false, {}} : pats.For(name);
    std::vector<std::vector<int64_t>> local;
    std::vector<std::optional<Loc>> locs(tp);
    std::vector<ModuleEntry> entries(tp);
    std::string err;
    for (int t = 0; t < tp; ++t) {
      if (t > 0 && rule.kind == Merge::kReplicated) {
        local.push_back(local[0]);
        continue;
      }
      auto found = module[t].by_name.find(name);
      if (found == module[t].by_name.end()) {
        err = "'" + name + "' is missing from TP rank " + std::to_string(t) + "'s model states" +
              (module[t].error.empty() ? std::string() : " (" + module[t].error + ")");
        break;
      }
      entries[t] = found->second;
      if (!found->second.error.empty()) {
        err = "'" + name + "' needs " + found->second.error;
        break;
      }
      auto l = Resolve(*found->second.src, found->second.v, "module['" + name + "']");
      if (!l.ok()) {
        err = l.status().message();
        break;
      }
      locs[t] = *l;
      local.push_back(l->shape);
    }
    if (err.empty() && rule.kind == Merge::kSubParams) {
      Status st = pats.ResolveSub(name, local, rule);
      if (!st.ok()) err = "'" + name + "': " + st.message();
      for (int t = 0; t < tp && err.empty(); ++t) {
        if (!locs[t]->Contiguous())
          err = "'" + name + "' on TP rank " + std::to_string(t) +
                " is not contiguous: its sub-parameter view cannot be taken";
      }
    }
    Merger merger(rule, local);
    TensorRecord rec;
    rec.key = name;
    rec.role = buffer ? Role::kOther : Role::kParam;
    rec.fqn = name;
    rec.state = buffer ? "" : "param";
    rec.dtype = locs[0].has_value() ? locs[0]->dtype : DType::kF32;
    std::vector<Fragment> frags;
    if (err.empty()) {
      auto gs = merger.GlobalShape();
      if (!gs.ok()) {
        err = "'" + name + "': " + gs.status().message();
      } else {
        rec.shape = *gs;
        rec.vocab_rows = VocabRows(rule, pats.original_vocab, rec.shape);
      }
    }
    for (int t = 0; t < tp && err.empty(); ++t) {
      if (!merger.UsesRank(t)) continue;
      AddWholeFragments(merger, t, *locs[t], entries[t].src->file, frags);
    }
    rec.error = err;
    rec.replicas = err.empty() ? merger.Copies() : 1;
    if (!err.empty()) frags.clear();
    uint32_t id = ck.AddTensor(std::move(rec), std::move(frags));
    // ds_to_universal's fallback for names without optimizer state: mp_rank_00's
    // (TP-local) tensor as fp32.
    if (tp == 1 || rule.kind == Merge::kReplicated) {
      module_record[name] = id;
    } else if (locs[0].has_value()) {
      TensorRecord hidden;
      hidden.key = name + " (mp_rank_00)";
      hidden.role = Role::kHidden;
      hidden.dtype = locs[0]->dtype;
      hidden.shape = locs[0]->shape;
      module_record[name] = ck.AddTensor(std::move(hidden), {WholeFragment(*locs[0], entries[0].src->file)});
    }
  }
  return module_record;
}

}  // namespace ckptfs::formats::deepspeed
