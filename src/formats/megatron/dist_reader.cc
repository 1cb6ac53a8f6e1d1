#include "formats/megatron/dist_reader.h"

#include <re2/re2.h>
#include <sys/stat.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "formats/byte_reader.h"
#include "formats/dcp/dcp_reader.h"
#include "formats/megatron/dist_optim.h"
#include "formats/megatron/megatron_common.h"
#include "formats/megatron/run_config.h"
#include "formats/pickle_writer.h"
#include "formats/torch_file.h"
#include "formats/zarr/zarr_reader.h"

namespace ckptfs::formats {
namespace {

// Fragments of layer `i` of a stacked tensor: the slice at index i of axis 0.
std::vector<Fragment> SliceLayer(const std::vector<Fragment>& frags, int64_t i) {
  std::vector<Fragment> out;
  for (const Fragment& f : frags) {
    if (f.offsets.empty() || i < f.offsets[0] || i >= f.offsets[0] + f.lengths[0]) continue;
    Fragment s = f;
    const uint64_t skip = static_cast<uint64_t>((i - f.offsets[0]) * f.strides[0]) * DTypeSize(f.dtype);
    s.offsets.erase(s.offsets.begin());
    s.lengths.erase(s.lengths.begin());
    s.strides.erase(s.strides.begin());
    s.data_offset += skip;
    s.data_length = f.data_length > skip ? f.data_length - skip : 0;
    out.push_back(std::move(s));
  }
  return out;
}

constexpr int64_t kMaxStacked = 65536;  // layers or experts one stacked tensor may hold

// Splits record k along its leading axis into one record per index
// (`fqn_of(i)`, key "<key>[i]"); the stack itself stays as other/<key>.
// Returns false (noting why) when the axis is longer than any model has: a
// damaged or hostile .metadata would otherwise make millions of records.
template <typename FqnOf>
bool SplitLeading(Checkpoint& ck, size_t k, const char* what, FqnOf fqn_of) {
  const TensorRecord whole = ck.tensors[k];
  if (whole.shape[0] > kMaxStacked) {
    ck.info.problems.push_back("'" + whole.key + "' stacks " + std::to_string(whole.shape[0]) + " " + what +
                               " (more than " + std::to_string(kMaxStacked) + "): kept whole, not split");
    return false;
  }
  const std::vector<Fragment> whole_frags = ck.fragments.Get(k);
  for (int64_t i = 0; i < whole.shape[0]; ++i) {
    TensorRecord one = whole;
    one.key = whole.key + "[" + std::to_string(i) + "]";
    one.fqn = fqn_of(i);
    one.shape.erase(one.shape.begin());
    one.alias = false;
    std::vector<Fragment> frags = SliceLayer(whole_frags, i);
    ck.AddTensor(std::move(one), std::move(frags));
  }
  TensorRecord& w = ck.tensors[k];
  w.role = Role::kOther;
  w.fqn = w.key;
  w.state.clear();
  w.alias = true;
  return true;
}

// fully_sharded_model_space (mcore 0.8-0.14, torch strategy
// sharded_tensor_to_torch_sharded_tensor): a DistOpt state whose ShardedTensors
// carry a flattened_range is stored "N-D flattened": for a parameter of global
// shape O sharded into local chunks of shape c, the DCP tensor has shape
// [O_0/c_0, ..., O_n-1/c_n-1, prod(c)] and each chunk is one DP rank's flat
// range [a, a+k) of one local chunk. Rewrites `t` / `frags` to the parameter's
// shape: each flat range becomes the boxes of that chunk it covers (no bytes
// move). Returns why not when the shapes do not fit that reading.
std::string Unflatten(TensorRecord& t, std::vector<Fragment>& frags, const std::vector<int64_t>& global) {
  const size_t n = global.size();
  if (t.shape.size() != n + 1) return "not one more axis than its parameter";
  std::vector<int64_t> chunk(n);
  int64_t numel = 1;
  for (size_t d = 0; d < n; ++d) {
    if (t.shape[d] <= 0 || global[d] % t.shape[d] != 0) return "axis " + std::to_string(d) + " is not a chunk grid";
    chunk[d] = global[d] / t.shape[d];
    numel *= chunk[d];
  }
  if (numel != t.shape[n]) return "its last axis is not the size of one chunk";
  const auto strides = ContiguousStrides(chunk);
  const uint64_t isz = DTypeSize(t.dtype);
  std::vector<Fragment> out;
  for (const Fragment& f : frags) {
    if (f.offsets.size() != n + 1 || f.strides.size() != n + 1 || (f.lengths[n] > 1 && f.strides[n] != 1)) {
      return "a chunk is not a flat range";
    }
    for (size_t d = 0; d < n; ++d) {
      if (f.lengths[d] != 1) return "a chunk spans several local chunks";
    }
    const int64_t a = f.offsets[n], k = f.lengths[n];
    for (const Box& b : DecomposeRange(chunk, static_cast<uint64_t>(a), static_cast<uint64_t>(a + k))) {
      Fragment g = f;
      g.offsets.resize(n);
      for (size_t d = 0; d < n; ++d) g.offsets[d] = f.offsets[d] * chunk[d] + b.offsets[d];
      g.lengths = b.lengths;
      g.strides = strides;
      const int64_t first = FlatIndex(b.offsets, strides);
      int64_t last = first;
      for (size_t d = 0; d < n; ++d) last += (b.lengths[d] - 1) * strides[d];
      g.data_offset = f.data_offset + static_cast<uint64_t>(first - a) * isz;
      g.data_length = static_cast<uint64_t>(last - first + 1) * isz;
      out.push_back(std::move(g));
    }
  }
  t.shape = global;
  frags = std::move(out);
  t.num_fragments = static_cast<uint32_t>(frags.size());
  return "";
}

// Assigns Megatron roles and splits layer stacks (see the header).
void Classify(Checkpoint& ck) {
  // Names are untrusted: RE2 (linear time, no recursion), bytes as Latin-1.
  // chained_<i>.: a ChainedOptimizer's members (MoE: dense and expert optimizers).
  // NeMo 2's MegatronParallel puts "module." before every mcore key (its
  // Lightning module wraps the mcore model); Megatron's own keys never start so.
  static const RE2 kOptState(
      R"((?:chained_\d+\.)?optimizer\.state\.(param|fp32_param|exp_avg|exp_avg_sq)\.(?:module\.)?(.+))", RE2::Latin1);
  static const RE2 kStack(R"((.*(?:^|\.)layers)\.([^0-9].*))", RE2::Latin1);
  // SequentialMLP's sharded key: the expert axis after the layer axis
  // (...mlp.experts.experts.linear_fc1.weight [E, ...] once split per layer),
  // served under the model's own names with global expert indices.
  static const RE2 kExperts(R"((.*\.experts)\.experts\.(.+))", RE2::Latin1);
  std::map<std::string, std::vector<int64_t>> param_shapes;
  for (TensorRecord& t : ck.tensors) {
    t.role = Role::kOther;
    t.fqn = t.key;
    t.state.clear();
    if (t.encoding != Encoding::kTensor) continue;
    std::string state, fqn;
    if (RE2::FullMatch(t.key, kOptState, &state, &fqn)) {
      t.role = Role::kOptimState;
      t.fqn = fqn;
      t.state = state == "exp_avg" || state == "exp_avg_sq" ? state : "fp32";
    } else if (t.key.rfind("optimizer.", 0) != 0 && t.key.rfind("chained_", 0) != 0 &&
               t.key.rfind("rng_state", 0) != 0 && t.key.rfind("rerun_state_machine", 0) != 0) {
      t.role = Role::kParam;
      t.state = "param";
      if (t.fqn.rfind("module.", 0) == 0) t.fqn.erase(0, 7);
      param_shapes[t.fqn] = t.shape;
    }
  }
  for (size_t i = 0; i < ck.tensors.size(); ++i) {
    TensorRecord& t = ck.tensors[i];
    if (t.role != Role::kOptimState) continue;
    auto it = param_shapes.find(t.fqn);
    if (it == param_shapes.end() || it->second == t.shape) continue;
    const std::vector<int64_t> before = t.shape;
    std::vector<Fragment> frags = ck.fragments.Get(i);
    const std::string why = Unflatten(t, frags, it->second);
    ck.fragments.Set(i, frags);
    if (!why.empty()) {
      ck.info.problems.push_back("'" + t.key + "' has shape " + ShapeStr(before) + ", its parameter " +
                                 ShapeStr(it->second) + " (read as an N-D flattened DistOpt state: " + why +
                                 "): kept under other/, not mapped");
      t.role = Role::kOther;
      t.fqn = t.key;
      t.state.clear();
    }
  }
  const size_t n = ck.tensors.size();
  for (size_t k = 0; k < n; ++k) {
    if (ck.tensors[k].role == Role::kOther || ck.tensors[k].shape.empty()) continue;
    std::string prefix, rest;
    if (!RE2::FullMatch(ck.tensors[k].fqn, kStack, &prefix, &rest)) continue;
    SplitLeading(ck, k, "layers", [&](int64_t i) { return prefix + "." + std::to_string(i) + "." + rest; });
  }
  for (size_t k = 0; k < ck.tensors.size(); ++k) {  // per-layer records included
    if (ck.tensors[k].role == Role::kOther || ck.tensors[k].shape.empty()) continue;
    std::string prefix, rest;
    if (!RE2::FullMatch(ck.tensors[k].fqn, kExperts, &prefix, &rest)) continue;
    SplitLeading(ck, k, "experts",
                 [&](int64_t i) { return prefix + ".local_experts." + std::to_string(i) + "." + rest; });
  }
}

// common.pt, served verbatim (its iteration and args describe the
// checkpoint), kept open with the per-DP-rank objects' param groups: dcp/'s
// param groups are made once the parameters are known.
struct Common {
  megatron::ModelFacts facts;
  std::unique_ptr<Source> src;
  megatron::PerDpRankGroups groups;  // DistOptimizerParamGroups
};
Common AddCommon(const std::string& dir, const std::string& rel, Checkpoint& ck) {
  Common c;
  megatron::ModelFacts& facts = c.facts;
  std::unique_ptr<Source>& src = c.src;
  Files files;
  files.dir = dir;
  files.ck = &ck;
  files.pickle = PickleOptions{};
  files.pickle.extra_modules = {"megatron"};
  src = files.Open(rel);
  if (!src->error.empty()) ck.info.problems.push_back(src->error);
  if (const PyValue* root = src->root(); root != nullptr && root->kind == PyKind::kDict) {
    if (auto it = megatron::ArgInt(root, "iteration"); it) ck.info.step = *it;
    // NeMo 2 saves Lightning's checkpoint dict: global_step, no iteration.
    if (auto it = megatron::ArgInt(root, "global_step"); it && ck.info.step < 0) ck.info.step = *it;
    if (const PyValue* args = root->Get("args"); args != nullptr && args->kind != PyKind::kNone) {
      megatron::ExportArgsJson(args, ck);
      facts = megatron::FactsOf(args);
    }
  }
  c.groups = megatron::DistOptimizerParamGroups(dir, ck);
  megatron::ExportTorchDistCommon(src->root(), ck, c.groups);
  TensorRecord t;
  t.key = "common.pt";
  if (src->fd < 0) t.error = src->error;
  ck.AddFileBytes(src->file, std::move(t));
  return c;
}

// dcp/'s param groups: common.pt's, or the per-DP-rank objects' where the
// distributed optimizer's layout keeps them there (dp_reshardable).
void AddParamGroups(const Common& common, Checkpoint& ck) {
  const PyValue* opt = megatron::CommonOptimizer(common.src != nullptr ? common.src->root() : nullptr);
  if (opt == nullptr) return;  // no optimizer saved
  const std::string& rel = common.src->rel;
  // The layout of an optimizer state that keeps its groups per DP rank
  // ({param_state_sharding_type} alone), else null.
  auto per_dp_rank = [](const PyValue* o) -> const PyValue* {
    if (o == nullptr || o->kind != PyKind::kDict || o->Get("optimizer") != nullptr ||
        o->Get("param_groups") != nullptr) {
      return nullptr;
    }
    const PyValue* layout = o->Get("param_state_sharding_type");
    return layout != nullptr && layout->IsStr() ? layout : nullptr;
  };
  // The groups of the per-DP-rank objects (one list per optimizer), one
  // after another, as ExportParamGroups gives a chained optimizer's.
  auto from_objects = [&](const std::vector<std::string>& lists) -> Status {
    const std::string what = "the param groups of the distributed optimizer's per-DP-rank objects";
    std::vector<PyHandle> held;
    PyValue all;
    all.kind = PyKind::kList;
    for (const std::string& ops : lists) {
      PickleWriter w;
      w.Raw(ops);
      ASSIGN_OR_RETURN(PyHandle groups, Unpickle(w.Finish(), what));
      if (!groups->IsSeq()) return Invalid(what + ": not a list");
      all.items.insert(all.items.end(), groups->items.begin(), groups->items.end());
      held.push_back(std::move(groups));
    }
    return megatron::ExportParamGroupList(all, what, ck);
  };
  auto members = megatron::ChainedMembers(*opt);
  Status st = Status::Ok();
  if (!members.ok()) {
    st = members.status().Annotate(rel);
  } else if (opt->kind != PyKind::kDict) {
    st = Invalid(rel + ": the optimizer state is not a dict");
  } else if (const PyValue* layout = per_dp_rank(opt)) {
    if (common.groups.single.empty()) {
      st = Unsupported("the distributed optimizer's " + layout->s +
                       " layout keeps them in per-DP-rank objects, and none of those can be read");
    } else {
      st = from_objects({common.groups.single});
    }
  } else if (std::any_of(members->begin(), members->end(), per_dp_rank)) {
    // A MoE run's ChainedOptimizer: each member's groups in chained_<i>.'s objects.
    st = common.groups.members.size() == members->size()
             ? from_objects(common.groups.members)
             : Unsupported("a MoE run's ChainedOptimizer keeps each member's groups per DP rank, and " +
                           std::to_string(common.groups.members.size()) + " of its " + std::to_string(members->size()) +
                           " members' can be read");
  } else {
    st = megatron::ExportParamGroups(*opt, rel, ck);
  }
  if (!st.ok()) ck.info.problems.push_back("dcp/ has no optim.param_groups: " + st.message());
}

// The run configuration a wrapper keeps instead of args: Megatron-Bridge's
// iter_N/run_config.yaml, NeMo 2's <checkpoint>/context/model.yaml (weights/'s
// sibling). Read inside the mount source (OpenSourceFile), at most 4 MiB.
// A config that cannot be read is a problem, not a failure: the weights are
// still served, the distributed-optimizer states stay under other/.
Result<std::string> ReadConfigFile(const std::string& dir, const std::string& rel) {
  ASSIGN_OR_RETURN(int fd, OpenSourceFile(dir, rel));
  struct stat st {};
  const uint64_t size = ::fstat(fd, &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
  if (size > (4u << 20)) {
    ::close(fd);
    return Invalid("cannot read " + dir + "/" + rel + ": " + std::to_string(size) + " bytes (at most 4 MiB)");
  }
  FileSliceReader r(fd, 0, size, dir + "/" + rel);
  auto res = size == 0 ? Result<std::string>(std::string()) : r.ReadAt(0, size);
  ::close(fd);
  return res;
}

megatron::ModelFacts ConfigFacts(const std::string& dir, const megatron::IterDir& iter, Checkpoint& ck) {
  struct Candidate {
    std::string rel, model, ddp, strategy;  // strategy: NeMo 2's io.json
  };
  const std::string prefix = iter.rel.empty() ? "" : iter.rel + "/";
  std::vector<Candidate> candidates = {{prefix + "run_config.yaml", "model.", "ddp.", ""}};
  if (!iter.wrapper.empty() && EndsWith(iter.rel, "weights")) {
    const std::string context = iter.rel.substr(0, iter.rel.size() - 7) + "context/";
    candidates.push_back({context + "model.yaml", "config.", "strategy.ddp.", context + "io.json"});
  }
  for (const Candidate& c : candidates) {
    struct stat st {};
    if (::stat((dir + "/" + c.rel).c_str(), &st) != 0) continue;
    auto text = ReadConfigFile(dir, c.rel);
    Result<std::map<std::string, std::string>> kv = text.ok()
                                                        ? megatron::YamlScalars(*text, dir + "/" + c.rel)
                                                        : Result<std::map<std::string, std::string>>(text.status());
    if (kv.ok() && !c.strategy.empty()) {
      // NeMo 2: the parallel sizes are MegatronStrategy's (1 where the run left the default).
      auto json = ReadConfigFile(dir, c.strategy);
      auto strategy = json.ok() ? megatron::Nemo2StrategyArgs(*json, dir + "/" + c.strategy)
                                : Result<std::map<std::string, std::string>>(json.status());
      if (!strategy.ok()) {
        kv = strategy.status();
      } else {
        for (const char* size : {"tensor_model_parallel_size", "pipeline_model_parallel_size",
                                 "virtual_pipeline_model_parallel_size", "expert_model_parallel_size"}) {
          auto it = strategy->find(std::string("strategy.") + size);
          (*kv)[c.model + size] = it == strategy->end() ? (Contains(size, "virtual") ? "null" : "1") : it->second;
        }
        kv->insert(strategy->begin(), strategy->end());
      }
    }
    if (!kv.ok()) {
      ck.info.problems.push_back(kv.status().message() + " (the model's parallel layout is unknown)");
      continue;
    }
    megatron::ModelFacts f = megatron::FactsOfConfig(*kv, c.model, c.ddp);
    if (f.tp > 0) {
      ck.info.format_note += (ck.info.format_note.empty() ? "" : "; ") + std::string("layout from ") + c.rel +
                             (c.strategy.empty() ? "" : " and io.json");
      return f;
    }
  }
  return {};
}

// Without args or a config (a NeMo 2 checkpoint without context/, a wrapper
// ckptfs does not know): the TP degree and whether linear_fc1 holds two SwiGLU
// halves, from how mcore sharded them. A row-parallel linear_fc2 weight is
// saved in TP chunks along dim 1; linear_fc1 in TP chunks along dim 0, or 2 x TP
// with SwiGLU (mcore's swiglu sharded factory saves each half's shard apart).
// Anything else stays unknown: the distributed-optimizer buffers are not
// replayed (the note says why) and topo/ splits no fused QKV by query groups.
void InferFacts(const Checkpoint& ck, megatron::ModelFacts& facts) {
  auto chunks_along = [&](const char* suffix, size_t dim) -> int64_t {
    for (size_t i = 0; i < ck.tensors.size(); ++i) {
      const TensorRecord& t = ck.tensors[i];
      if (t.role != Role::kParam || t.shape.size() != 2 || !EndsWith(t.fqn, suffix) ||
          t.fqn.find(".experts.") != std::string::npos) {  // experts may have their own TP size
        continue;
      }
      std::set<int64_t> starts;
      for (const Fragment& f : ck.fragments.Get(i)) {
        if (f.offsets.size() == 2) starts.insert(f.offsets[dim]);
      }
      return static_cast<int64_t>(starts.size());
    }
    return 0;
  };
  const int64_t row = chunks_along(".linear_fc2.weight", 1), col = chunks_along(".linear_fc1.weight", 0);
  if (row <= 0 || col <= 0) return;
  if (col == 2 * row) {
    facts.swiglu = true;
  } else if (col != row) {
    return;  // neither: leave it unknown
  }
  facts.tp = row;
}

}  // namespace

bool LooksLikeMegatronDist(const std::string& dir) {
  auto it = megatron::FindIterDir(dir);
  if (!it.ok()) return megatron::IsNemo2Root(dir);  // none to choose: let the reader say why
  struct stat st {};
  return ::stat((it->path + "/metadata.json").c_str(), &st) == 0;
}

Result<Checkpoint> ReadMegatronDist(const std::string& dir) {
  ASSIGN_OR_RETURN(megatron::IterDir iter, megatron::FindIterDir(dir));
  const std::string meta = iter.path + "/metadata.json";
  ASSIGN_OR_RETURN(std::string text, ReadWholeFile(meta, 1 << 20));
  nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("sharded_backend") || !j["sharded_backend"].is_string()) {
    return Invalid("cannot parse " + meta + ": not a dist_checkpointing config (no sharded_backend)");
  }
  const std::string backend = j["sharded_backend"].get<std::string>();
  const std::string prefix = iter.rel.empty() ? "" : iter.rel + "/";
  Checkpoint ck;
  if (backend == "torch_dist") {
    ASSIGN_OR_RETURN(ck, ReadDcp(iter.path));
    for (SourceFile& f : ck.files) f.rel_path = prefix + f.rel_path;
  } else if (backend == "zarr") {
    RETURN_IF_ERROR(ReadZarrArrays(dir, iter.rel, ck));
    if (ck.tensors.empty())
      return Invalid("cannot read " + iter.path + ": metadata.json says zarr but no array has a .zarray");
  } else {
    return Unsupported("cannot read " + iter.path + ": sharded_backend '" + backend +
                       "' (ckptfs reads torch_dist and zarr)");
  }
  ck.info.family = backend == "zarr" ? Family::kMegatronZarr : Family::kMegatronTorchDist;
  ck.info.format_note = "Megatron-LM dist_checkpointing, " + backend + " backend" +
                        (ck.info.format_note.empty() ? "" : " (" + ck.info.format_note + ")") +
                        (iter.wrapper.empty() ? "" : ", " + iter.wrapper);
  struct stat st {};
  megatron::ModelFacts facts;
  Common common;
  if (::stat((iter.path + "/common.pt").c_str(), &st) == 0) {
    common = AddCommon(dir, prefix + "common.pt", ck);
    facts = common.facts;
  } else {
    ck.info.problems.push_back(iter.path + "/common.pt is missing (args and iteration unknown)");
  }
  if (ck.info.step < 0) ck.info.step = iter.step;
  if (facts.tp <= 0) facts = ConfigFacts(dir, iter, ck);
  Classify(ck);
  megatron::ModelFacts seen;  // what the chunks say
  InferFacts(ck, seen);
  if (facts.tp <= 0 && seen.tp > 0) {
    facts.tp = seen.tp;
    facts.swiglu = seen.swiglu;
    ck.info.format_note += std::string(ck.info.format_note.empty() ? "" : "; ") + "no args or run config: TP " +
                           std::to_string(facts.tp) + (facts.swiglu ? ", SwiGLU" : "") +
                           " read from the chunk geometry";
  } else if (facts.tp > 0 && seen.tp > 0 && seen.tp != facts.tp) {
    ck.info.problems.push_back("the run's args or config say TP " + std::to_string(facts.tp) +
                               ", but linear_fc2 is "
                               "saved in " +
                               std::to_string(seen.tp) + " tensor-parallel chunks: the chunks are used");
    facts.tp = seen.tp;
  }
  megatron::MapBucketStates(dir, facts, ck);
  AddParamGroups(common, ck);
  megatron::SetSplits(facts, ck);
  return ck;
}

}  // namespace ckptfs::formats
