// Optimizer-state parsing: one `[bf16_|fp16_]zero_pp_rank_D_mp_rank_M_optim_states.pt`
// into an OptimRank: its ZeRO stage (BF16_Optimizer writes none), and per flat
// group the fp32 partition, Adam states, step, recorded padding, partition
// count, param_slice_mappings and alignment gaps. Contract: locations only, no
// geometry (zero_geometry.cc checks them); a value of the wrong kind, or a
// flat partition that is not a contiguous 1-D tensor, makes the rank unreadable.
#include <string>

#include "formats/deepspeed/ds_internal.h"
#include "formats/pickle.h"
#include "formats/torch_file.h"

namespace ckptfs::formats::deepspeed {
namespace {

// The torch optimizer's per-group state {step, exp_avg, exp_avg_sq} of flat
// group `g` (absent when the group never took a step: no fragments need it).
Status ParseAdamState(const Source& s, const PyValue* state, size_t g, const std::string& what, OptimGroup& og) {
  const PyValue* st = nullptr;
  if (state != nullptr) {
    for (const auto& [k, v] : state->dict) {
      if (k->kind == PyKind::kInt && k->i == static_cast<int64_t>(g)) st = v;
    }
  }
  if (st == nullptr) return Status::Ok();
  if (const PyValue* x = st->Get("exp_avg")) {
    ASSIGN_OR_RETURN(og.exp_avg, Resolve(s, x, what + " exp_avg"));
  }
  if (const PyValue* x = st->Get("exp_avg_sq")) {
    ASSIGN_OR_RETURN(og.exp_avg_sq, Resolve(s, x, what + " exp_avg_sq"));
  }
  if (const PyValue* x = st->Get("step")) {
    if (x->kind == PyKind::kTensor) {
      ASSIGN_OR_RETURN(og.step, Resolve(s, x, what + " step"));
    } else {
      og.step_value = x;  // a Python number (older torch)
    }
  }
  return Status::Ok();
}

}  // namespace

Status ParseOptim(OptimRank& o) {
  const Source& s = *o.src;
  const PyValue* root = s.root();
  const PyValue* osd = root ? root->Get("optimizer_state_dict") : nullptr;
  if (osd == nullptr || osd->kind != PyKind::kDict) return Invalid(s.rel + ": no optimizer_state_dict");
  o.osd = osd;
  const PyValue* zs = osd->Get("zero_stage");
  if (zs == nullptr) {
    if (osd->Get("single_partition_of_fp32_groups") == nullptr) {
      return Invalid(s.rel + ": no zero_stage and no single_partition_of_fp32_groups: not a ZeRO optimizer state");
    }
    o.stage = 1;
    o.bf16_optimizer = true;  // BF16_Optimizer writes no zero_stage
  } else {
    ASSIGN_OR_RETURN(int64_t stage, EnumValue(zs, s.rel + ": zero_stage"));  // ZeroStageEnum, either pickle form
    if (stage < 1 || stage > 3) return Unsupported(s.rel + ": unknown ZeRO stage " + std::to_string(stage));
    o.stage = static_cast<int>(stage);
  }
  if (o.stage <= 2) {
    const PyValue* base = osd->Get("base_optimizer_state");
    const PyValue* fp32 = osd->Get("single_partition_of_fp32_groups");
    if (base == nullptr || fp32 == nullptr || !fp32->IsSeq()) {
      return Invalid(s.rel + ": no base_optimizer_state / single_partition_of_fp32_groups");
    }
    const PyValue* state = base->Get("state");
    if (state == nullptr || state->kind != PyKind::kDict) {
      return Unsupported(s.rel + ": base_optimizer_state has no 'state' dict (legacy elastic checkpoint)");
    }
    const PyValue* paddings = osd->Get("group_paddings");
    const PyValue* counts = osd->Get("partition_count");
    const PyValue* maps = osd->Get("param_slice_mappings");
    const PyValue* align = osd->Get("param_alignment_paddings");
    o.groups.resize(fp32->items.size());
    for (size_t g = 0; g < o.groups.size(); ++g) {
      OptimGroup& og = o.groups[g];
      const std::string gs = "group " + std::to_string(g);
      ASSIGN_OR_RETURN(og.fp32,
                       Resolve(s, fp32->items[g], "single_partition_of_fp32_groups[" + std::to_string(g) + "]"));
      RETURN_IF_ERROR(ParseAdamState(s, state, g, gs, og));
      if (paddings && paddings->IsSeq() && g < paddings->items.size()) {
        ASSIGN_OR_RETURN(og.recorded_pad, AsInt(paddings->items[g], s.rel + ": group_paddings"));
      }
      if (counts && counts->IsSeq() && g < counts->items.size()) {
        ASSIGN_OR_RETURN(og.partition_count, AsInt(counts->items[g], s.rel + ": partition_count"));
      } else if (counts && counts->kind == PyKind::kInt) {
        og.partition_count = counts->i;
      }
      if (maps && maps->IsSeq() && g < maps->items.size()) og.mapping = maps->items[g];
      if (align && align->IsSeq() && g < align->items.size()) {
        ASSIGN_OR_RETURN(og.align, AsIntVector(align->items[g], s.rel + ": param_alignment_paddings"));
      }
    }
  } else {
    const PyValue* flat = osd->Get("fp32_flat_groups");
    const PyValue* inner = osd->Get("optimizer_state_dict");
    const PyValue* state = inner ? inner->Get("state") : nullptr;
    if (flat == nullptr || !flat->IsSeq()) return Invalid(s.rel + ": ZeRO-3 state without fp32_flat_groups");
    int64_t count = -1;
    if (const PyValue* c = osd->Get("partition_count")) {
      if (c->kind == PyKind::kInt) count = c->i;
      if (c->IsSeq() && !c->items.empty()) {
        ASSIGN_OR_RETURN(count, AsInt(c->items[0], s.rel + ": partition_count"));
      }
    }
    o.groups.resize(flat->items.size());
    for (size_t g = 0; g < o.groups.size(); ++g) {
      OptimGroup& og = o.groups[g];
      og.partition_count = count;
      ASSIGN_OR_RETURN(og.fp32, Resolve(s, flat->items[g], "fp32_flat_groups[" + std::to_string(g) + "]"));
      RETURN_IF_ERROR(ParseAdamState(s, state, g, "sub-group " + std::to_string(g), og));
    }
  }
  for (const OptimGroup& og : o.groups) {
    for (const auto* l : {&og.fp32, &og.exp_avg, &og.exp_avg_sq}) {
      if (l->has_value() && (!(*l)->Contiguous() || (*l)->shape.size() != 1)) {
        return Unsupported(s.rel + ": a flat partition that is not a contiguous 1-D tensor");
      }
    }
  }
  return Status::Ok();
}

}  // namespace ckptfs::formats::deepspeed
