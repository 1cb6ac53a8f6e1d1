// The DeepSpeed reader's entry points and its order of steps: Discover (the
// files and their pickles), ComputeGeometry (every fragment's place) and Emit
// (checkpoint.json facts, params/ records, universal/). ds_internal.h says
// which file holds each step.
#include "formats/deepspeed/ds_reader.h"

#include <re2/re2.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <string>

#include "formats/deepspeed/ds_internal.h"

namespace ckptfs::formats::deepspeed {

Status Reader::Run() {
  RETURN_IF_ERROR(Discover());
  ComputeGeometry();
  return Emit();
}

// What the read found, as the checkpoint's records: checkpoint.json facts and
// problems, the params/ records, and (ZeRO-1/2/3) the universal/ tree.
Status Reader::Emit() {
  ck.info.family = Family::kDeepSpeed;
  const PyValue* root0 = models[root].src->root();
  std::string version;
  if (const PyValue* v = root0->Get("ds_version"); v && v->IsStr()) version = v->s;
  if (const PyValue* v = root0->Get("global_steps"); v && v->kind == PyKind::kInt) ck.info.step = v->i;
  if (const PyValue* v = root0->Get("iteration"); ck.info.step < 0 && v && v->kind == PyKind::kInt) ck.info.step = v->i;
  ck.info.world_size = static_cast<uint32_t>(std::max(tp, 1) * pp * std::max(dp, 1));
  // stage 0: no optimizer file could be read; say whether there were any.
  std::string stage_name = stage != 0          ? "ZeRO-" + std::to_string(stage)
                           : optim_on_disk > 0 ? std::to_string(optim_on_disk) + " ZeRO optimizer files, none readable"
                                               : "no ZeRO optimizer files";
  if (bf16_optimizer) stage_name = "BF16_Optimizer (ZeRO-1 geometry)";
  ck.info.format_note = std::string(pipeline ? "PipelineEngine, " : "") + stage_name + ", TP=" + std::to_string(tp) +
                        " PP=" + std::to_string(pp) + " DP=" + std::to_string(dp) +
                        (version.empty() ? "" : ", ds_version " + version);
  Patterns pats(models[root].uci);
  patterns = &pats;
  if (!pats.present && stage != 0 && stage != 3) {
    problems.push_back(models[root].src->rel +
                       " has no universal_checkpoint_info: every parameter is concatenated on "
                       "dim 0 across TP ranks (as ds_to_universal.py --inject_missing_state does)");
  }
  for (const auto& bad : pats.Unusable()) {
    problems.push_back(models[root].src->rel + ": universal_checkpoint_info pattern '" + bad +
                       "' is not a regular expression ckptfs can compile; parameters it would match are merged as "
                       "if it were absent");
  }
  const bool ucp = stage == 1 || stage == 2 || stage == 3;

  // Optimizer-backed parameters, then the module copy and universal/.
  std::set<std::string> have_fp32;
  for (Param& p : params) EmitParam(p, pats, ucp, have_fp32);
  EmitLostStages();
  std::map<std::string, uint32_t> module_record = EmitModule(pats);
  // An expert whose expert file is missing or unreadable: its model copy is
  // an unreadable record (EIO), never absent.
  for (const std::string& name : experts) {
    bool held = false;
    for (const ModuleCopy& c : module) held = held || c.by_name.count(name) > 0;
    if (held) continue;
    std::string id = "?";
    int i = 0;
    if (RE2::FullMatch(name, ExpertNameRe(), nullptr, &i, nullptr)) id = std::to_string(i);
    TensorRecord rec;
    rec.key = name;
    rec.role = Role::kParam;
    rec.fqn = name;
    rec.state = "param";
    rec.dtype = DType::kF32;
    rec.error = "no expert file holds '" + name + "' (" + prefix + "layer_*_expert_" + id +
                "_mp_rank_*_model_states.pt is missing or unreadable)";
    ck.AddTensor(std::move(rec), {});
  }
  // (Under PipelineEngine the mp_rank files hold no module: the script has
  // nothing to fall back to.)
  if ((stage == 1 || stage == 2) && !pipeline) {
    for (const auto& [name, e] : module[0].entries) {
      if (have_fp32.count(name) || !module_record.count(name) || experts.count(name)) continue;
      const uint32_t id = module_record[name];
      const TensorRecord& t = ck.tensors[id];
      if (!t.error.empty()) continue;
      if (t.dtype != DType::kF32 && t.dtype != DType::kBF16 && t.dtype != DType::kF16) {
        problems.push_back("universal/zero/" + name + "/fp32.pt is not generated: '" + name + "' is " +
                           std::string(DTypeName(t.dtype)) + ", and ckptfs widens only floating types to float32");
        continue;
      }
      Status st = ExportState(name, "fp32", id, Rule{Merge::kReplicated, 0, false, {}}, /*dict=*/true);
      if (!st.ok()) problems.push_back("universal/zero/" + name + "/fp32.pt: " + st.message());
    }
  }
  if (ucp && !experts.empty()) {
    problems.push_back("universal/ leaves out the " + std::to_string(experts.size()) +
                       " MoE expert parameters: "
                       "ds_to_universal.py merges DeepSpeed MoE experts by their expert-parallel-local names, which at "
                       "EP > 1 concatenates different experts (it fails), and DeepSpeed's universal loader looks "
                       "them up by local name; params/ serves every expert under its global name "
                       "(deepspeed_experts.<E>, as the expert files name it)");
  }
  if (stage != 0 && !optim.empty()) {
    Status st = ExportParamGroups();
    if (!st.ok()) problems.push_back("dcp/ has no optim.param_groups: " + st.message());
  }
  if (ucp) {
    Status st = ExportOptimizerState();
    if (!st.ok()) problems.push_back("universal/zero/optimizer_state.pt is not available: " + st.message());
    ExportCopies();
    ExportFile latest;
    latest.path = "latest_universal";
    latest.parts.push_back(ExportPart{PartKind::kLiteral, "universal", 0, DType::kInvalid, 9, {}});
    ck.exports.push_back(std::move(latest));
  }
  for (TensorRecord& t : ck.tensors) {
    if (t.role != Role::kParam && t.role != Role::kOptimState) continue;
    t.split =
        pats.present ? SplitOf(pats.For(t.fqn)) : TensorSplit{tp > 1 ? SplitKind::kDim : SplitKind::kUnknown, 0, 0};
  }
  ck.info.topology =
      "tp" + std::to_string(std::max(tp, 1)) + "-pp" + std::to_string(pp) + "-dp" + std::to_string(std::max(dp, 1));
  if (std::string note = files.PlaceholderNote(); !note.empty()) problems.push_back(std::move(note));
  ck.info.problems = std::move(problems);
  return Status::Ok();
}

}  // namespace ckptfs::formats::deepspeed

namespace ckptfs::formats {

namespace fs = std::filesystem;

bool LooksLikeDeepSpeed(const std::string& dir) {
  std::error_code ec;
  if (fs::is_regular_file(dir + "/latest", ec)) return true;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::string n = e.path().filename().string();
    if (RE2::FullMatch(n, deepspeed::ModelRe()) || RE2::FullMatch(n, deepspeed::Zero3ModelRe())) return true;
  }
  return false;
}

Result<Checkpoint> ReadDeepSpeed(const std::string& dir) {
  deepspeed::Reader r;
  r.dir = dir;
  RETURN_IF_ERROR(r.Run());
  return std::move(r.ck);
}

}  // namespace ckptfs::formats
