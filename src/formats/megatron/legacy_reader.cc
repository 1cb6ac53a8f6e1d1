#include "formats/megatron/legacy_reader.h"

#include <re2/re2.h>
#include <sys/stat.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "common/json_text.h"
#include "formats/megatron/megatron_common.h"
#include "formats/torch_file.h"
#include "formats/tp_merge.h"

namespace ckptfs::formats {
namespace {

using megatron::ArgBool;
using megatron::ArgInt;
using megatron::IsExpert;

constexpr uint64_t kMaxCompareBytes = 256ull << 20;  // replicas larger than this are not compared
constexpr int64_t kParamAlign = 64;                  // DDP buffer: each parameter starts at a multiple

const PickleOptions& MegatronPickleOptions() {
  static const PickleOptions o = [] {
    PickleOptions p;
    p.extra_modules = {"megatron", "transformer_engine"};
    return p;
  }();
  return o;
}

const PyValue* GetInt(const PyValue* d, int64_t key) {
  if (d == nullptr || d->kind != PyKind::kDict) return nullptr;
  for (const auto& [k, v] : d->dict) {
    if (k->kind == PyKind::kInt && k->i == key) return v;
  }
  return nullptr;
}

// One local tensor of a model chunk, in state_dict order.
struct Entry {
  std::string local;
  const PyValue* v = nullptr;
};

struct OptStates {
  FileId file;  // the file all four live in
  std::optional<Loc> fp32, exp_avg, exp_avg_sq, step;
};

// One mp_rank_TT[_PPP][_EEE] directory.
struct RankFile {
  int tp = 0, pp = 0, ep = 0;
  std::string dir;  // relative to the iteration directory's parent (the mount source)
  std::unique_ptr<Source> src;
  std::unique_ptr<Source> distopt;                                // distrib_optim.pt, when present
  std::vector<std::vector<Entry>> chunks;                         // model / model0, model1, ...
  std::map<std::pair<int, std::string>, const PyValue*> by_name;  // (chunk, local name) -> tensor
  std::map<std::pair<int, std::string>, OptStates> opt;           // (chunk, local name) -> states
  std::string opt_unavailable;                                    // why optimizer states are not shown
  std::string error;
};

// Flattens nested state dicts (legacy language_model/{embedding, encoder}) to dotted names.
void Flatten(const PyValue* d, const std::string& prefix, std::vector<Entry>& out, int* skipped) {
  for (const auto& [k, v] : d->dict) {
    if (!k->IsStr()) continue;
    const std::string name = prefix.empty() ? k->s : prefix + "." + k->s;
    if (v->kind == PyKind::kDict) {
      Flatten(v, name, out, skipped);
    } else if (v->kind == PyKind::kTensor && name.find("_extra_state") == std::string::npos) {
      out.push_back(Entry{name, v});
    } else if (v->kind == PyKind::kTensor || name.find("_extra_state") != std::string::npos) {
      ++*skipped;  // Transformer Engine's serialized FP8 metadata: not a parameter
    }
  }
}

// A contiguous tensor viewed with `shape` (same number of elements).
Result<Loc> AsShape(Loc l, const std::vector<int64_t>& shape, const std::string& what) {
  if (l.Numel() != NumelOf(shape)) {
    return Invalid(what + " has " + std::to_string(l.Numel()) + " elements, the parameter " + ShapeStr(shape));
  }
  if (!l.Contiguous()) return Unsupported(what + " is not contiguous");
  l.shape = shape;
  l.strides = ContiguousStrides(shape);
  return l;
}

struct Holder {
  int pp = 0, ep = 0, chunk = 0;
  std::string local;
};

struct Global {
  std::string name;
  int64_t layer = -1;
  std::vector<Holder> holders;  // normally one; more: the same name on several stages
};

struct Reader {
  std::string dir;
  megatron::IterDir iter;
  Checkpoint ck;
  Files files;
  std::vector<std::unique_ptr<RankFile>> ranks;
  std::map<std::tuple<int, int, int>, RankFile*> by_rank;  // (tp, pp, ep)
  int tp = 1, pp = 1, vp = 1, ep = 1;
  int64_t local_experts = -1;  // per expert-parallel rank (MoE); -1: counted from the files
  const PyValue* args = nullptr;
  bool swiglu = false;
  std::vector<std::string> problems;
  int skipped_extra = 0;

  Status Run();
  Status Discover();
  void ParseModel(RankFile& r);
  void MapOptimizer(RankFile& r);
  RankFile* FirstValid(int p, int e);
  void MapDistOpt(RankFile& r);
  void MapDistOptBuffers(RankFile& r, const PyValue* state, bool experts);
  Status Emit();
  void CompareReplicas(const std::string& name, const std::vector<std::pair<std::string, Loc>>& copies,
                       const std::vector<const Source*>& srcs, const std::string& across);
};

std::string RankDirName(int t, int p, int e, int pp, int ep) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "mp_rank_%02d", t);
  std::string n = buf;
  if (pp > 1) {
    std::snprintf(buf, sizeof buf, "_%03d", p);
    n += buf;
  }
  if (ep > 1) {
    std::snprintf(buf, sizeof buf, "_%03d", e);
    n += buf;
  }
  return n;
}

Status Reader::Discover() {
  ASSIGN_OR_RETURN(iter, megatron::FindIterDir(dir));
  // megatron/training/checkpointing.py get_checkpoint_name: mp_rank_TT, then
  // _PPP when PP > 1, then _EEE when EP > 1. "mp_rank_TT_XXX" is a pipeline
  // stage unless args say PP = 1 and EP > 1.
  static const RE2 kRank(R"(mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?)");
  struct Named {
    int tp, second = -1, third = -1;
  };
  std::vector<Named> names;
  for (const auto& n : ListDirectory(iter.path)) {
    std::string tp_s, pp_s, ep_s;
    if (!RE2::FullMatch(n, kRank, &tp_s, &pp_s, &ep_s)) continue;
    auto r = std::make_unique<RankFile>();
    r->dir = (iter.rel.empty() ? "" : iter.rel + "/") + n;
    names.push_back(Named{std::stoi(tp_s), pp_s.empty() ? -1 : std::stoi(pp_s), ep_s.empty() ? -1 : std::stoi(ep_s)});
    ranks.push_back(std::move(r));  // the pattern bounds the numbers to three digits
  }
  if (ranks.empty()) return NotFound("cannot find mp_rank_XX directories in " + iter.path);
  for (auto& r : ranks) {
    r->src = files.Open(r->dir + "/model_optim_rng.pt");
    if (!r->src->error.empty()) {
      r->error = r->src->error;
      continue;
    }
    if (args == nullptr) {
      if (const PyValue* a = r->src->root()->Get("args"); a != nullptr && a->kind != PyKind::kNone) args = a;
    }
  }
  const int64_t args_pp = ArgInt(args, "pipeline_model_parallel_size").value_or(0);
  const int64_t args_ep = ArgInt(args, "expert_model_parallel_size").value_or(1);
  for (size_t i = 0; i < ranks.size(); ++i) {
    RankFile& r = *ranks[i];
    const Named& n = names[i];
    r.tp = n.tp;
    if (n.third >= 0) {
      r.pp = n.second;
      r.ep = n.third;
    } else if (n.second >= 0 && args_pp == 1 && args_ep > 1) {
      r.ep = n.second;
    } else {
      r.pp = std::max(n.second, 0);
    }
    if (!by_rank.emplace(std::make_tuple(r.tp, r.pp, r.ep), &r).second) {
      return Invalid("cannot read " + iter.path + ": two rank directories name TP " + std::to_string(r.tp) + ", PP " +
                     std::to_string(r.pp) + ", EP " + std::to_string(r.ep) + " (" + r.dir + ")");
    }
    tp = std::max(tp, r.tp + 1);
    pp = std::max(pp, r.pp + 1);
    ep = std::max(ep, r.ep + 1);
  }
  // args decide the topology; a rank directory that is absent is then a
  // missing shard (its parameters fail) rather than a smaller model.
  if (auto v = ArgInt(args, "tensor_model_parallel_size"); v && *v > tp) tp = static_cast<int>(*v);
  if (args_pp > pp) pp = static_cast<int>(args_pp);
  if (args_ep > ep) ep = static_cast<int>(args_ep);
  if (auto n = ArgInt(args, "num_experts"); n && *n > 0 && *n % ep == 0) local_experts = *n / ep;
  for (int e = 0; e < ep; ++e) {
    for (int p = 0; p < pp; ++p) {
      for (int t = 0; t < tp; ++t) {
        if (by_rank.count({t, p, e})) continue;
        const std::string rel = iter.path + "/" + RankDirName(t, p, e, pp, ep) + "/model_optim_rng.pt";
        ck.info.Flag(
            Check::kCoverage, Severity::kError, "", rel,
            rel + " is missing (TP=" + std::to_string(tp) + ", PP=" + std::to_string(pp) +
                (ep > 1 ? ", EP=" + std::to_string(ep) : "") + "): the parameters it holds are unreadable",
            nlohmann::json({{"tp_rank", t}, {"pp_rank", p}, {"ep_rank", e}, {"tp", tp}, {"pp", pp}, {"ep", ep}})
                .dump());
      }
    }
  }
  swiglu = ArgBool(args, "swiglu").value_or(false);
  return Status::Ok();
}

RankFile* Reader::FirstValid(int p, int e) {
  for (int t = 0; t < tp; ++t) {
    auto it = by_rank.find({t, p, e});
    if (it != by_rank.end() && it->second->error.empty()) return it->second;
  }
  return nullptr;
}

void Reader::ParseModel(RankFile& r) {
  const PyValue* root = r.src->root();
  if (root == nullptr || root->kind != PyKind::kDict) {
    r.error = r.src->rel + ": top level is not a dict";
    return;
  }
  if (const PyValue* m = root->Get("model"); m != nullptr && m->kind == PyKind::kDict) {
    r.chunks.emplace_back();
    Flatten(m, "", r.chunks.back(), &skipped_extra);
  } else {
    for (int v = 0;; ++v) {
      const PyValue* m = root->Get("model" + std::to_string(v));
      if (m == nullptr || m->kind != PyKind::kDict) break;
      r.chunks.emplace_back();
      Flatten(m, "", r.chunks.back(), &skipped_extra);
    }
  }
  if (r.chunks.empty()) r.error = r.src->rel + ": no 'model' (or 'model0') state dict";
  for (size_t c = 0; c < r.chunks.size(); ++c) {
    for (const Entry& e : r.chunks[c]) r.by_name.emplace(std::make_pair(static_cast<int>(c), e.local), e.v);
  }
  vp = std::max(vp, static_cast<int>(r.chunks.size()));
}

// The non-distributed optimizer ({optimizer: torch Adam state dict,
// fp32_from_fp16_params} for fp16/bf16, the bare Adam state dict for fp32),
// or a list of those (ChainedOptimizer: with MoE, one for the dense and one
// for the expert parameters).
void Reader::MapOptimizer(RankFile& r) {
  const PyValue* opt = r.src->root()->Get("optimizer");
  std::vector<const PyValue*> subs;
  if (opt != nullptr && opt->kind == PyKind::kDict) {
    subs.push_back(opt);
  } else if (opt != nullptr && opt->IsSeq()) {
    for (PyRef o : opt->items) subs.push_back(o);
  }
  if (subs.empty()) {
    r.opt_unavailable = "no optimizer state was saved";
    return;
  }
  struct Cand {
    int chunk;
    const Entry* e;
    std::vector<int64_t> shape;
  };
  std::vector<Cand> cands;
  for (size_t c = 0; c < r.chunks.size(); ++c) {
    for (const Entry& e : r.chunks[c]) cands.push_back(Cand{static_cast<int>(c), &e, e.v->tensor().shape});
  }
  // Megatron's _get_param_groups: one group per (weight decay, lr scale,
  // expert) key; the members of a group are the model's parameters with that
  // key, in model order.
  struct Group {
    const PyValue* state;        // the optimizer's state {param id: {...}}
    const PyValue* fp32_groups;  // its fp32_from_fp16_params, or null
    size_t index;                // within its optimizer
    const PyValue* params;       // param ids
    megatron::GroupKey key;      // set from all groups at once (GroupKeysOf)
  };
  std::vector<Group> groups;
  std::vector<const PyValue*> saved;  // each group's dict, as `groups`
  for (size_t s = 0; s < subs.size(); ++s) {
    const PyValue* sub = subs[s];
    const std::string which = subs.size() > 1 ? "optimizer " + std::to_string(s) + ": " : "";
    if (sub->kind != PyKind::kDict) {
      r.opt_unavailable = which + "not a dict";
      return;
    }
    const PyValue* adam = sub->Get("optimizer") ? sub->Get("optimizer") : sub;
    const PyValue* state = adam->Get("state");
    const PyValue* gs = adam->Get("param_groups");
    if (state == nullptr || state->kind != PyKind::kDict || gs == nullptr || !gs->IsSeq()) {
      r.opt_unavailable = which + "the optimizer state dict has no state / param_groups";
      return;
    }
    for (size_t g = 0; g < gs->items.size(); ++g) {
      const PyValue* grp = gs->items[g];
      groups.push_back(Group{
          state, sub->Get("fp32_from_fp16_params"), g, grp->kind == PyKind::kDict ? grp->Get("params") : nullptr, {}});
      saved.push_back(grp);
    }
  }
  auto keys = megatron::GroupKeysOf(saved);
  if (!keys.ok()) {
    r.opt_unavailable = keys.status().message();
    return;
  }
  for (size_t i = 0; i < groups.size(); ++i) groups[i].key = (*keys)[i];
  for (const Group& grp : groups) {
    const std::string group_name =
        std::string(grp.key.no_wd ? "no weight decay" : "weight decay") + (grp.key.expert ? ", experts" : "");
    std::vector<const Cand*> members;
    for (const Cand& c : cands) {
      if (grp.key.Takes(c.e->local, c.shape)) members.push_back(&c);
    }
    const PyValue* ids = grp.params;
    if (ids == nullptr || !ids->IsSeq() || ids->items.size() != members.size()) {
      r.opt_unavailable = "param group " + std::to_string(grp.index) + " (" + group_name + ") lists " +
                          std::to_string(ids && ids->IsSeq() ? ids->items.size() : 0) + " parameters, the model has " +
                          std::to_string(members.size());
      return;
    }
    const PyValue* fp32_groups = grp.fp32_groups;
    const size_t g = grp.index;
    const PyValue* fp32 =
        fp32_groups && fp32_groups->IsSeq() && g < fp32_groups->items.size() ? fp32_groups->items[g] : nullptr;
    for (size_t i = 0; i < members.size(); ++i) {
      const Cand& c = *members[i];
      const std::string what = r.src->rel + ": optimizer state of '" + c.e->local + "'";
      auto idx = AsInt(ids->items[i], "param id");
      if (!idx.ok()) {
        r.opt_unavailable = "a param id is not an int";
        return;
      }
      OptStates os;
      os.file = r.src->file;
      const PyValue* st = GetInt(grp.state, *idx);
      auto load = [&](const PyValue* v, const char* name) -> Result<std::optional<Loc>> {
        if (v == nullptr) return std::optional<Loc>();
        if (v->kind != PyKind::kTensor) return std::optional<Loc>();
        ASSIGN_OR_RETURN(Loc l, Resolve(*r.src, v, name));
        if (std::string(name) == "step") return std::optional<Loc>(l);
        ASSIGN_OR_RETURN(Loc s, AsShape(l, c.shape, what + " " + name));
        return std::optional<Loc>(s);
      };
      Status bad = Status::Ok();
      auto take = [&](const PyValue* v, const char* name, std::optional<Loc>& dst) {
        if (!bad.ok()) return;
        auto l = load(v, name);
        if (!l.ok()) {
          bad = l.status();
        } else {
          dst = *l;
        }
      };
      if (st != nullptr && st->kind == PyKind::kDict) {
        take(st->Get("exp_avg"), "exp_avg", os.exp_avg);
        take(st->Get("exp_avg_sq"), "exp_avg_sq", os.exp_avg_sq);
        take(st->Get("step"), "step", os.step);
      }
      if (fp32 != nullptr && fp32->IsSeq()) {
        if (i >= fp32->items.size()) {
          bad = Invalid(r.src->rel + ": fp32_from_fp16_params[" + std::to_string(g) +
                        "] is shorter than its param group");
        } else {
          take(fp32->items[i], "fp32", os.fp32);
        }
      } else if (fp32_groups == nullptr && c.e->v->tensor().dtype == DType::kF32) {
        take(c.e->v, "fp32", os.fp32);  // FP32Optimizer: the fp32 parameters are the master weights
      }
      if (!bad.ok()) {
        r.opt_unavailable = bad.message();
        r.opt.clear();
        return;
      }
      r.opt[{c.chunk, c.e->local}] = std::move(os);
    }
  }
}

// distrib_optim.pt (get_parameter_state_dp_zero): per DDP buffer, the whole
// (DP-gathered) fp32 param / exp_avg / exp_avg_sq with bucket-end padding
// removed. A ChainedOptimizer (MoE) saves a list, one entry per member: the
// dense optimizer's (None on EP ranks that are not its DP rank 0), then the
// expert optimizer's, whose buffers hold this EP rank's experts.
void Reader::MapDistOpt(RankFile& r) {
  const PyValue* root = r.distopt->root();
  if (root != nullptr && root->kind == PyKind::kDict) {
    MapDistOptBuffers(r, root, false);
    return;
  }
  if (root == nullptr || !root->IsSeq() || root->items.empty() || root->items.size() > 2) {
    r.opt_unavailable = r.distopt->rel + ": top level is neither a dict nor a list of one or two optimizers' states";
    return;
  }
  for (size_t i = 0; i < root->items.size() && r.opt_unavailable.empty(); ++i) {
    const PyValue* member = root->items[i];
    if (member->kind == PyKind::kNone) continue;  // another EP rank's directory holds it
    MapDistOptBuffers(r, member, i == 1);
  }
}

void Reader::MapDistOptBuffers(RankFile& r, const PyValue* root, bool experts) {
  if (root == nullptr || root->kind != PyKind::kDict) {
    r.opt_unavailable = r.distopt->rel + ": an optimizer's state is not a dict";
    return;
  }
  const PyValue* coalesced = root->Get("buckets_coalesced");
  if (coalesced == nullptr || coalesced->kind != PyKind::kBool || !coalesced->b) {
    r.opt_unavailable =
        r.distopt->rel + ": per-bucket (pre-coalesced) layout; re-save with a current Megatron to map it";
    return;
  }
  const std::string which = experts ? "expert buffer " : "buffer ";
  for (size_t c = 0; c < r.chunks.size(); ++c) {
    std::vector<const Entry*> members;  // the buffer's parameters: experts or the rest
    for (const Entry& e : r.chunks[c]) {
      if (IsExpert(e.local) == experts) members.push_back(&e);
    }
    if (members.empty()) continue;
    const PyValue* gbuf = GetInt(root, static_cast<int64_t>(c));
    if (gbuf == nullptr || gbuf->kind != PyKind::kDict || gbuf->dict.size() != 1) {
      r.opt_unavailable =
          r.distopt->rel + ": " + which + std::to_string(c) +
          (gbuf == nullptr ? " is missing" : " holds several dtypes (mixed-precision buffers are not mapped)");
      return;
    }
    const PyValue* b = gbuf->dict[0].second;
    auto numel = AsInt(b->Get("numel_unpadded"), "numel_unpadded");
    // Replay param_and_grad_buffer.py: parameters in reverse, 64-aligned starts.
    std::vector<int64_t> start(members.size());
    int64_t pos = 0;
    for (size_t i = members.size(); i-- > 0;) {
      pos = (pos + kParamAlign - 1) / kParamAlign * kParamAlign;
      start[i] = pos;
      pos += NumelOf(members[i]->v->tensor().shape);
    }
    if (!numel.ok() || *numel != pos) {
      r.opt_unavailable = r.distopt->rel + ": " + which + std::to_string(c) + " holds " +
                          (numel.ok() ? std::to_string(*numel) : std::string("?")) +
                          " elements; one bucket of this model's parameters (reverse order, 64-aligned) needs " +
                          std::to_string(pos) + " (several buckets or another layout version)";
      return;
    }
    std::map<std::string, Loc> flat;
    for (const char* s : {"param", "exp_avg", "exp_avg_sq"}) {
      auto l = Resolve(*r.distopt, b->Get(s), which + std::to_string(c) + " " + s);
      if (!l.ok() || !l->Contiguous() || l->Numel() < pos) {
        r.opt_unavailable = l.ok() ? r.distopt->rel + ": " + which + std::to_string(c) + " " + s + " is too short"
                                   : l.status().message();
        return;
      }
      flat[s] = *l;
    }
    for (size_t i = 0; i < members.size(); ++i) {
      const auto& shape = members[i]->v->tensor().shape;
      auto at = [&](const Loc& f) {
        Loc l;
        l.dtype = f.dtype;
        l.shape = shape;
        l.strides = ContiguousStrides(shape);
        l.data_offset = f.data_offset + static_cast<uint64_t>(start[i]) * DTypeSize(f.dtype);
        l.data_length = static_cast<uint64_t>(NumelOf(shape)) * DTypeSize(f.dtype);
        return l;
      };
      OptStates os;
      os.file = r.distopt->file;
      os.fp32 = at(flat["param"]);
      os.exp_avg = at(flat["exp_avg"]);
      os.exp_avg_sq = at(flat["exp_avg_sq"]);
      r.opt[{static_cast<int>(c), members[i]->local}] = std::move(os);
    }
  }
}

// Reads each copy and compares it with the first; reports the difference.
void Reader::CompareReplicas(const std::string& name, const std::vector<std::pair<std::string, Loc>>& copies,
                             const std::vector<const Source*>& srcs, const std::string& across) {
  const Loc& l0 = copies[0].second;
  const uint64_t bytes = static_cast<uint64_t>(l0.Numel()) * DTypeSize(l0.dtype);
  if (bytes == 0) return;
  if (bytes > kMaxCompareBytes || !l0.Contiguous()) {
    problems.push_back("'" + name + "': " + across + " copies not compared (" +
                       (l0.Contiguous() ? "larger than 256 MiB" : "not contiguous") + ")");
    return;
  }
  auto base = srcs[0]->reader->ReadAt(l0.data_offset, bytes);
  if (!base.ok()) return;  // unreadable: the read itself will say so
  for (size_t i = 1; i < copies.size(); ++i) {
    const Loc& li = copies[i].second;
    if (li.dtype != l0.dtype || li.shape != l0.shape || !li.Contiguous()) {
      ck.info.Flag(Check::kDrift, Severity::kError, name, copies[i].first,
                   "'" + name + "': " + across + " copies differ in dtype or shape (" + copies[0].first + " " +
                       std::string(DTypeName(l0.dtype)) + ShapeStr(l0.shape) + ", " + copies[i].first + " " +
                       std::string(DTypeName(li.dtype)) + ShapeStr(li.shape) + "); serving " + copies[0].first);
      continue;
    }
    auto other = srcs[i]->reader->ReadAt(li.data_offset, bytes);
    if (!other.ok()) continue;
    // By hash first (what the report shows), then by value.
    const uint64_t h0 = XXH3_64bits(base->data(), base->size()), hi = XXH3_64bits(other->data(), other->size());
    if (h0 == hi) continue;
    const size_t isz = DTypeSize(l0.dtype);
    double max_diff = 0;
    uint64_t differing = 0;
    for (uint64_t e = 0; e < bytes / isz; ++e) {
      if (std::equal(base->data() + e * isz, base->data() + (e + 1) * isz, other->data() + e * isz)) continue;
      ++differing;
      double a, b;
      if (ElementAsDouble(base->data() + e * isz, l0.dtype, &a) &&
          ElementAsDouble(other->data() + e * isz, l0.dtype, &b)) {
        max_diff = std::max(max_diff, std::isnan(a - b) ? INFINITY : std::fabs(a - b));
      }
    }
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.6g", max_diff);
    nlohmann::ordered_json d;
    d["across"] = across;
    d["copies"] = {{{"file", copies[0].first}, {"xxh3", Hex64(h0)}}, {{"file", copies[i].first}, {"xxh3", Hex64(hi)}}};
    d["differing_elements"] = differing;
    d["elements"] = bytes / isz;
    d["max_abs_diff"] = max_diff;
    d["served"] = copies[0].first;
    ck.info.Flag(Check::kDrift, Severity::kError, name, copies[i].first,
                 "replica drift: '" + name + "' differs between " + across + " copies " + copies[0].first + " and " +
                     copies[i].first + " (" + std::to_string(differing) + " of " + std::to_string(bytes / isz) +
                     " elements, max |diff| " + buf + "); serving " + copies[0].first,
                 JsonText(d));
  }
}

Status Reader::Emit() {
  megatron::PipelineShape shape;
  shape.num_layers = ArgInt(args, "num_layers").value_or(-1);
  shape.pp = pp;
  shape.vp = vp;
  shape.first_stage_layers = ArgInt(args, "decoder_first_pipeline_num_layers").value_or(-1);
  shape.last_stage_layers = ArgInt(args, "decoder_last_pipeline_num_layers").value_or(-1);
  if (shape.num_layers < 0) {
    // Without args, stages are assumed uniform and sized by what rank (0, 0) holds.
    problems.push_back("no args.num_layers: pipeline stages are numbered assuming equal stages");
  }

  // Global names, in stage / chunk / state_dict order.
  std::vector<Global> globals;
  std::map<std::string, size_t> index;
  std::set<int64_t> layers_seen;
  std::set<int64_t> experts_seen;
  for (int p = 0; p < pp; ++p) {
    // Dense parameters from the first EP rank that has the stage (every EP
    // rank holds them); each run of expert parameters from every EP rank in
    // turn, renumbered to global experts: the order of the model at EP = 1.
    std::vector<RankFile*> by_ep(static_cast<size_t>(ep));
    RankFile* r0 = nullptr;
    for (int e = ep; e-- > 0;) {
      by_ep[static_cast<size_t>(e)] = FirstValid(p, e);
      if (by_ep[static_cast<size_t>(e)] != nullptr) r0 = by_ep[static_cast<size_t>(e)];
    }
    if (r0 == nullptr) continue;
    int64_t experts_here = local_experts;  // from args, else what the file holds
    if (experts_here < 0) {
      experts_here = 0;
      for (const auto& chunk : r0->chunks) {
        for (const Entry& x : chunk) {
          int64_t k;
          megatron::RenumberExpert(x.local, 0, &k);
          experts_here = std::max(experts_here, k + 1);
        }
      }
    }
    for (size_t v = 0; v < r0->chunks.size(); ++v) {
      int64_t offset = 0;
      if (shape.num_layers >= 0) {
        auto o = megatron::LayerOffset(shape, p, static_cast<int>(v));
        if (!o.ok()) return o.status().Annotate("cannot number the layers of " + r0->src->rel);
        offset = *o;
      } else {
        std::set<int64_t> local;
        for (const Entry& e : r0->chunks[v]) {
          int64_t i;
          megatron::RenumberLayer(e.local, 0, &i);
          if (i >= 0) local.insert(i);
        }
        offset = static_cast<int64_t>(p * static_cast<int>(r0->chunks.size()) + static_cast<int>(v)) *
                 static_cast<int64_t>(local.size());
      }
      auto add = [&](int e, const Entry& x) {
        int64_t layer, expert;
        std::string g = megatron::RenumberLayer(x.local, offset, &layer);
        g = megatron::RenumberExpert(g, e * experts_here, &expert);
        if (expert >= 0) experts_seen.insert(expert);
        if (layer >= 0) layers_seen.insert(layer);
        auto [it, inserted] = index.emplace(g, globals.size());
        if (inserted) globals.push_back(Global{g, layer, {}});
        globals[it->second].holders.push_back(Holder{p, e, static_cast<int>(v), x.local});
      };
      const std::vector<Entry>& entries = r0->chunks[v];
      for (size_t i = 0; i < entries.size();) {
        if (!IsExpert(entries[i].local)) {
          add(r0->ep, entries[i++]);
          continue;
        }
        size_t j = i;
        while (j < entries.size() && IsExpert(entries[j].local)) ++j;
        for (int e = 0; e < ep; ++e) {  // the same run in each EP rank's file (Megatron: same structure)
          const RankFile* re = by_ep[static_cast<size_t>(e)];
          if (re == nullptr || v >= re->chunks.size()) continue;
          for (size_t k = i; k < j && k < re->chunks[v].size(); ++k) {
            if (IsExpert(re->chunks[v][k].local)) add(e, re->chunks[v][k]);
          }
        }
        i = j;
      }
    }
  }
  if (local_experts > 0 && static_cast<int64_t>(experts_seen.size()) < local_experts * ep) {
    problems.push_back("experts held: " + std::to_string(experts_seen.size()) + " of args.num_experts " +
                       std::to_string(local_experts * ep) + " (expert-parallel rank directories missing)");
  }
  if (shape.num_layers >= 0) {
    std::vector<std::string> missing;
    for (int64_t i = 0; i < shape.num_layers; ++i) {
      if (!layers_seen.count(i)) missing.push_back(std::to_string(i));
    }
    if (!missing.empty()) {
      std::string list;
      for (size_t i = 0; i < missing.size() && i < 16; ++i) list += (i ? ", " : "") + missing[i];
      ck.info.Flag(Check::kCollision, Severity::kError, "", "",
                   "layers missing from the checkpoint (args.num_layers = " + std::to_string(shape.num_layers) +
                       "): " + list + (missing.size() > 16 ? ", ..." : "") +
                       " (pipeline stages that reuse layer names leave this signature, torchtitan #474)",
                   nlohmann::json({{"configured_layers", shape.num_layers}, {"missing_layers", missing}}).dump());
    }
  }

  const int64_t padded_vocab = ArgInt(args, "padded_vocab_size").value_or(-1);
  for (const Global& g : globals) {
    const Holder& h = g.holders[0];
    auto rule_or = megatron::SplitRule(g.name, swiglu);
    Rule rule = rule_or.value_or(Rule{});
    std::string err;
    if (!rule_or.has_value() && tp > 1) {
      err = "no tensor-parallel split rule is known for '" + g.name + "' (TP=" + std::to_string(tp) + ")";
    }
    // The name held by several stages: a shared parameter or a collision.
    if (g.holders.size() > 1 && err.empty()) {
      std::vector<std::pair<std::string, Loc>> copies;
      std::vector<const Source*> srcs;
      for (const Holder& x : g.holders) {
        auto it = by_rank.find({0, x.pp, x.ep});
        if (it == by_rank.end() || !it->second->error.empty()) continue;
        auto found = it->second->by_name.find({x.chunk, x.local});
        if (found == it->second->by_name.end()) continue;
        auto l = Resolve(*it->second->src, found->second, x.local);
        if (l.ok()) {
          copies.emplace_back(it->second->src->rel, *l);
          srcs.push_back(it->second->src.get());
        }
      }
      if (copies.size() > 1) {
        if (g.layer >= 0) {
          std::vector<std::string> holders;
          for (const auto& c : copies) holders.push_back(c.first);
          ck.info.Flag(Check::kCollision, Severity::kError, g.name, copies[1].first,
                       "name collision: '" + g.name + "' is written by " + std::to_string(g.holders.size()) +
                           " pipeline stages (stage layer numbering overlaps); serving " + copies[0].first,
                       JsonText(nlohmann::json({{"files", holders}})));
        }
        CompareReplicas(g.name, copies, srcs, "pipeline-stage");
      }
    }
    std::vector<std::optional<Loc>> locs(static_cast<size_t>(tp));
    std::vector<std::vector<int64_t>> local;
    for (int t = 0; t < tp && err.empty(); ++t) {
      auto it = by_rank.find({t, h.pp, h.ep});
      if (it == by_rank.end()) {
        err = "'" + g.name + "' needs TP rank " + std::to_string(t) + " of stage " + std::to_string(h.pp) +
              (ep > 1 ? ", EP rank " + std::to_string(h.ep) : "") + " (" + iter.path + "/" +
              RankDirName(t, h.pp, h.ep, pp, ep) + "/model_optim_rng.pt), which is missing";
        break;
      }
      RankFile& r = *it->second;
      if (!r.error.empty()) {
        err = "'" + g.name + "' needs " + r.error;
        break;
      }
      auto found = r.by_name.find({h.chunk, h.local});
      const PyValue* v = found == r.by_name.end() ? nullptr : found->second;
      if (v == nullptr) {
        err = "'" + g.name + "' is missing from " + r.src->rel;
        break;
      }
      auto l = Resolve(*r.src, v, "model['" + h.local + "']");
      if (!l.ok()) {
        err = l.status().message();
        break;
      }
      locs[static_cast<size_t>(t)] = *l;
      local.push_back(l->shape);
    }
    Merger merger(rule, local);
    std::vector<int64_t> gshape;
    if (err.empty()) {
      auto gs = merger.GlobalShape();
      if (!gs.ok()) {
        err = "'" + g.name + "': " + gs.status().message();
      } else {
        gshape = *gs;
      }
    }
    if (err.empty() && rule.vocab && padded_vocab > 0 && !gshape.empty() && gshape[0] != padded_vocab) {
      problems.push_back("'" + g.name + "' has " + std::to_string(gshape[0]) + " rows; args.padded_vocab_size is " +
                         std::to_string(padded_vocab));
    }
    if (err.empty() && rule.kind == Merge::kReplicated && tp > 1) {
      std::vector<std::pair<std::string, Loc>> copies;
      std::vector<const Source*> srcs;
      for (int t = 0; t < tp; ++t) {
        const RankFile& r = *by_rank.at({t, h.pp, h.ep});
        copies.emplace_back(r.src->rel, *locs[static_cast<size_t>(t)]);
        srcs.push_back(r.src.get());
      }
      CompareReplicas(g.name, copies, srcs, "TP-replicated");
    }
    TensorRecord rec;
    rec.key = g.name;
    rec.role = Role::kParam;
    rec.fqn = g.name;
    rec.state = "param";
    rec.dtype = locs[0].has_value() ? locs[0]->dtype : DType::kF32;
    rec.shape = gshape;
    rec.error = err;
    std::vector<Fragment> frags;
    for (int t = 0; t < tp && err.empty(); ++t) {
      if (merger.UsesRank(t))
        AddWholeFragments(merger, t, *locs[static_cast<size_t>(t)], by_rank.at({t, h.pp, h.ep})->src->file, frags);
    }
    ck.AddTensor(std::move(rec), std::move(frags));
    if (!err.empty()) continue;

    // Optimizer states, merged like the parameter.
    struct StateSel {
      const char* name;
      std::optional<Loc> OptStates::*field;
    };
    for (StateSel s : {StateSel{"fp32", &OptStates::fp32}, StateSel{"exp_avg", &OptStates::exp_avg},
                       StateSel{"exp_avg_sq", &OptStates::exp_avg_sq}}) {
      TensorRecord st;
      st.key = "optimizer/" + g.name + "/" + s.name;
      st.role = Role::kOptimState;
      st.fqn = g.name;
      st.state = s.name;
      st.shape = gshape;
      st.dtype = DType::kF32;
      std::vector<Fragment> sf;
      bool any = false;
      for (int t = 0; t < tp && st.error.empty(); ++t) {
        if (!merger.UsesRank(t)) continue;
        RankFile& r = *by_rank.at({t, h.pp, h.ep});
        auto it = r.opt.find({h.chunk, h.local});
        if (it == r.opt.end() || !(it->second.*s.field).has_value()) {
          if (any) st.error = "'" + g.name + "': TP rank " + std::to_string(t) + " has no " + s.name + " state";
          if (t == 0) break;
          continue;
        }
        any = true;
        const Loc& l = *(it->second.*s.field);
        st.dtype = l.dtype;
        AddWholeFragments(merger, t, l, it->second.file, sf);
      }
      if (any) ck.AddTensor(std::move(st), std::move(sf));
    }
    // step: TP rank 0's (every rank takes the same number of steps).
    if (auto it = by_rank.at({0, h.pp, h.ep})->opt.find({h.chunk, h.local});
        it != by_rank.at({0, h.pp, h.ep})->opt.end() && it->second.step.has_value()) {
      const Loc& l = *it->second.step;
      TensorRecord st;
      st.key = "optimizer/" + g.name + "/step";
      st.role = Role::kOptimState;
      st.fqn = g.name;
      st.state = "step";
      st.dtype = l.dtype;
      st.shape = l.shape;
      ck.AddTensor(std::move(st), {WholeFragment(l, it->second.file)});
    }
  }
  return Status::Ok();
}

Status Reader::Run() {
  files.dir = dir;
  files.ck = &ck;
  files.pickle = MegatronPickleOptions();
  RETURN_IF_ERROR(Discover());
  for (auto& r : ranks) {
    if (!r->error.empty()) continue;
    ParseModel(*r);
    if (!r->error.empty()) continue;
    const std::string distopt_rel = r->dir + "/distrib_optim.pt";
    struct stat st {};
    if (::stat((dir + "/" + distopt_rel).c_str(), &st) == 0) {
      r->distopt = files.Open(distopt_rel);
      if (!r->distopt->error.empty()) {
        r->opt_unavailable = r->distopt->error;
      } else {
        MapDistOpt(*r);
      }
    } else if (ArgBool(args, "use_distributed_optimizer").value_or(false)) {
      r->opt_unavailable = "args.use_distributed_optimizer is set but " + distopt_rel + " is missing";
    } else {
      MapOptimizer(*r);
    }
    if (!r->opt_unavailable.empty()) {
      problems.push_back("optimizer states of " + r->dir + " are unavailable: " + r->opt_unavailable);
    }
  }
  RETURN_IF_ERROR(Emit());

  const PyValue* root = nullptr;
  for (auto& r : ranks) {
    if (r->error.empty() && r->src->root() != nullptr) {
      root = r->src->root();
      // Every rank steps with the same hyperparameters: this rank's groups,
      // each over the whole model's parameters.
      if (const PyValue* o = root->Get("optimizer"); o != nullptr && o->kind != PyKind::kNone) {
        Status st = megatron::ExportParamGroups(*o, r->src->rel, ck);
        if (!st.ok()) problems.push_back("dcp/ has no optim.param_groups: " + st.message());
      }
      break;
    }
  }
  ck.info.family = Family::kMegatronLegacy;
  std::string note = "Megatron-LM torch checkpoint";
  if (root != nullptr) {
    if (const PyValue* v = root->Get("checkpoint_version"); v && v->kind == PyKind::kFloat) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%g", v->f);
      note += ", checkpoint_version " + std::string(buf);
      if (v->f < 2.0 && tp > 1) {
        problems.push_back("checkpoint_version " + std::string(buf) +
                           " stores QKV as [3, heads, dim] or [heads, dim, 3]; params/ concatenates TP ranks as saved, "
                           "which is not the global QKV order");
      }
    }
    if (auto it = ArgInt(root, "iteration"); it) ck.info.step = *it;
  }
  if (ck.info.step < 0) ck.info.step = iter.step;
  note += ", TP=" + std::to_string(tp) + " PP=" + std::to_string(pp) + (vp > 1 ? " VP=" + std::to_string(vp) : "") +
          (ep > 1 ? " EP=" + std::to_string(ep) : "");
  if (local_experts > 0 || ep > 1) note += ", MoE";
  bool distopt = std::any_of(ranks.begin(), ranks.end(), [](const auto& r) { return r->distopt != nullptr; });
  if (distopt) note += ", distributed optimizer";
  if (skipped_extra > 0) note += ", " + std::to_string(skipped_extra) + " _extra_state entries not shown";
  ck.info.format_note = note;
  ck.info.world_size = static_cast<uint32_t>(ranks.size());
  if (args != nullptr) megatron::ExportArgsJson(args, ck);
  megatron::ExportTorchDistCommon(root, ck);
  megatron::SetSplits(megatron::FactsOf(args), ck);
  ck.info.topology =
      "tp" + std::to_string(tp) + "-pp" + std::to_string(pp) + (ep > 1 ? "-ep" + std::to_string(ep) : "");
  if (std::string note = files.PlaceholderNote(); !note.empty()) problems.push_back(std::move(note));
  ck.info.problems = std::move(problems);
  return Status::Ok();
}

}  // namespace

bool LooksLikeMegatronLegacy(const std::string& dir) {
  auto it = megatron::FindIterDir(dir);
  if (!it.ok()) return megatron::HasTracker(dir);  // a broken tracker: let the reader report it
  const auto names = ListDirectory(it->path);
  return std::any_of(names.begin(), names.end(), [](const std::string& n) { return n.rfind("mp_rank_", 0) == 0; });
}

Result<Checkpoint> ReadMegatronLegacy(const std::string& dir) {
  Reader r;
  r.dir = dir;
  RETURN_IF_ERROR(r.Run());
  return std::move(r.ck);
}

}  // namespace ckptfs::formats
