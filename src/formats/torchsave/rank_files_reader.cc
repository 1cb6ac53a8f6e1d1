#include "formats/torchsave/rank_files_reader.h"

#include <re2/re2.h>

#include <map>
#include <set>

#include "formats/byte_reader.h"
#include "formats/param_groups.h"
#include "formats/state_dict_roles.h"
#include "formats/tiling.h"
#include "formats/torch_file.h"
#include "formats/torchsave/state_walk.h"

namespace ckptfs::formats {
namespace {

// verl: (model|optim)_world_size_<W>_rank_<R>.pt
const RE2& VerlFileRe() {
  static const RE2 re(R"((model|optim)_world_size_([0-9]{1,6})_rank_([0-9]{1,6})\.pt)");
  return re;
}
// Accelerate: pytorch_model_fsdp[_<N>]_rank<R>.bin / optimizer[_<N>]_rank<R>.bin
const RE2& AccelerateFileRe() {
  static const RE2 re(R"(((pytorch_model_fsdp|optimizer)(?:_[0-9]{1,4})?)_rank([0-9]{1,6})\.bin)");
  return re;
}

// One rank's piece of a tensor.
struct Piece {
  DType dtype = DType::kInvalid;
  std::vector<int64_t> global;  // the tensor's global shape
  Loc local;                    // the rank's elements (DTensor, plain tensor)
  int shard_dim = -1;           // DTensor Shard(d); -1: whole (Replicate, or a plain tensor)
  bool sharded_tensor = false;  // a ShardedTensor: its local shards, at their offsets
  std::vector<std::pair<std::vector<int64_t>, Loc>> placed;
  // A DTensor over an N-D mesh (N > 1: HSDP's ("ddp", "fsdp")): per mesh dim,
  // the tensor dim it shards (-1: Replicate), and this rank's mesh coordinate.
  std::vector<int> mesh_shards;
  std::vector<int64_t> coords;
  int64_t mesh_rank = -1;  // a DTensor's DeviceMesh._rank: the rank that saved it (-1: not recorded)
};

// Where a rank's piece of a DTensor lies, as torch computes it
// (compute_local_shape_and_global_offset): mesh dim by mesh dim, the current
// extent of the sharded tensor dim is cut like torch.chunk, and the rank's
// coordinate picks its chunk. `local` gets the piece's shape.
std::vector<int64_t> MeshOffsets(const std::vector<int64_t>& global, const std::vector<int>& mesh_shards,
                                 const std::vector<int64_t>& mesh_sizes, const std::vector<int64_t>& coords,
                                 std::vector<int64_t>* local) {
  *local = global;
  std::vector<int64_t> offsets(global.size(), 0);
  for (size_t i = 0; i < mesh_shards.size(); ++i) {
    if (mesh_shards[i] < 0) continue;
    const size_t d = static_cast<size_t>(mesh_shards[i]);
    const int64_t size = (*local)[d], n = mesh_sizes[i];
    const int64_t chunk = size / n + (size % n != 0);
    const int64_t start = std::min(size, chunk * coords[i]);
    (*local)[d] = std::min(size - start, chunk);
    offsets[d] += start;
  }
  return offsets;
}

// The dtype and global size a _rebuild_wrapper_subclass object was rebuilt
// with: args (cls, dtype, size, stride, ...).
Status WrapperDTypeAndSize(const PyValue* v, const char* cls, Piece& p) {
  size_t a0 = !v->args().empty() && v->args()[0]->kind == PyKind::kGlobal && v->args()[0]->name() == cls ? 1 : 0;
  if (v->args().size() < a0 + 2 || v->args()[a0]->kind != PyKind::kGlobal) return Invalid("no dtype and size");
  p.dtype = DTypeFromTorchName(v->args()[a0]->name());
  if (p.dtype == DType::kInvalid) return Invalid("unsupported dtype torch." + v->args()[a0]->name());
  ASSIGN_OR_RETURN(p.global, AsIntVector(v->args()[a0 + 1], "size"));
  uint64_t numel = 1;
  for (int64_t d : p.global) {
    if (d < 0) return Invalid("negative size");
    if (MulOverflow(numel, static_cast<uint64_t>(d), &numel) || numel > (uint64_t{1} << 56)) {
      return Invalid("size with more than 2^56 elements");
    }
  }
  return Status::Ok();
}

// A ShardedTensor (torch.distributed._shard): state (local_shards,
// ShardedTensorMetadata, ...) from its __getstate__; each local Shard holds
// its tensor and a ShardMetadata with shard_offsets / shard_sizes.
Result<Piece> ShardedTensorPiece(const Source& s, const PyValue* v, const std::string& what) {
  auto bad = [&](const std::string& why) {
    return Invalid("cannot read " + s.rel + ": " + what + ": ShardedTensor " + why);
  };
  Piece p;
  p.sharded_tensor = true;
  if (Status st = WrapperDTypeAndSize(v, "ShardedTensor", p); !st.ok()) return bad(st.message());
  const PyValue* st = v->state;
  if (st == nullptr || st->kind != PyKind::kTuple || st->items.empty() || !st->items[0]->IsSeq()) {
    return bad("without its local shards");
  }
  const std::vector<int64_t>& global = p.global;
  for (const PyValue* shard : st->items[0]->items) {
    const PyValue* tensor = shard->Attr("tensor");
    const PyValue* meta = shard->Attr("metadata");
    if (tensor == nullptr || meta == nullptr) return bad("local shard without tensor / metadata");
    auto offs = AsIntVector(meta->Attr("shard_offsets"), "shard_offsets");
    auto sizes = AsIntVector(meta->Attr("shard_sizes"), "shard_sizes");
    if (!offs.ok() || !sizes.ok()) return bad("local shard: " + (offs.ok() ? sizes : offs).status().message());
    ASSIGN_OR_RETURN(Loc loc, Resolve(s, tensor, what + " (local shard)"));
    if (loc.dtype != p.dtype) return bad("local shard dtype differs from the ShardedTensor's");
    if (offs->size() != global.size() || sizes->size() != global.size() || loc.shape != *sizes) {
      return bad("local shard shape disagrees with its ShardMetadata or the global size");
    }
    for (size_t d = 0; d < global.size(); ++d) {
      if ((*offs)[d] < 0 || (*offs)[d] > global[d] || (*sizes)[d] > global[d] - (*offs)[d]) {
        return bad("local shard at offsets outside the global size");
      }
    }
    p.placed.emplace_back(std::move(*offs), std::move(loc));
  }
  return p;
}

Result<Piece> PieceOf(const Source& s, const PyValue* v, const std::string& what) {
  Piece p;
  if (v->kind == PyKind::kTensor) {
    ASSIGN_OR_RETURN(p.local, Resolve(s, v, what));
    p.dtype = p.local.dtype;
    p.global = p.local.shape;
    return p;
  }
  if (IsShardedTensor(v)) return ShardedTensorPiece(s, v, what);
  auto bad = [&](const std::string& why) { return Invalid("cannot read " + s.rel + ": " + what + ": " + why); };
  // DTensor: args (DTensor, dtype, size, stride, ...) as _rebuild_wrapper_subclass
  // takes them; state {_local_tensor, _spec}, or (None, {...}) when pickled as
  // (__dict__, __slots__) state.
  if (Status st = WrapperDTypeAndSize(v, "DTensor", p); !st.ok()) return bad("DTensor " + st.message());
  const PyValue* st = v->state;
  if (st != nullptr && st->kind == PyKind::kTuple && st->items.size() == 2) {
    st = st->items[1] != nullptr && st->items[1]->kind == PyKind::kDict ? st->items[1] : st->items[0];
  }
  const PyValue* local = st != nullptr && st->kind == PyKind::kDict ? st->Get("_local_tensor") : nullptr;
  const PyValue* spec = st != nullptr && st->kind == PyKind::kDict ? st->Get("_spec") : nullptr;
  if (local == nullptr || spec == nullptr) return bad("DTensor without _local_tensor / _spec");
  ASSIGN_OR_RETURN(p.local, Resolve(s, local, what + " (local shard)"));
  if (p.local.dtype != p.dtype) return bad("local shard dtype differs from the DTensor's");
  const PyValue* placements = spec->Attr("placements");
  if (placements == nullptr || !placements->IsSeq()) return bad("DTensorSpec without placements");
  if (const PyValue* mesh = spec->Attr("mesh"); mesh != nullptr) {
    if (auto rank = AsInt(mesh->Attr("_rank"), "rank"); rank.ok()) p.mesh_rank = *rank;
  }
  if (placements->items.size() > 1) {
    // An N-D mesh: placed by the rank's coordinate, which the pickled
    // DeviceMesh records (_coordinate_on_dim).
    for (const PyValue* pl : placements->items) {
      const std::string cls(pl->ClassName());
      if (cls == "Replicate") {
        p.mesh_shards.push_back(-1);
        continue;
      }
      if (cls != "Shard") {
        return Unsupported("cannot read " + s.rel + ": " + what + ": placement " + cls + " on a " +
                           std::to_string(placements->items.size()) +
                           "-D device mesh is not supported (FSDP + TP strides its shards)");
      }
      auto dim = AsInt(pl->Attr("dim"), "Shard.dim");
      if (!dim.ok() || *dim < 0 || *dim >= static_cast<int64_t>(p.global.size())) return bad("Shard with a bad dim");
      p.mesh_shards.push_back(static_cast<int>(*dim));
    }
    const PyValue* mesh = spec->Attr("mesh");
    auto coords = AsIntVector(mesh != nullptr ? mesh->Attr("_coordinate_on_dim") : nullptr, "coordinate");
    if (!coords.ok() || coords->size() != p.mesh_shards.size()) {
      return bad("a DTensor over a " + std::to_string(p.mesh_shards.size()) +
                 "-D device mesh without this rank's mesh coordinate (DeviceMesh._coordinate_on_dim)");
    }
    for (int64_t c : *coords) {
      if (c < 0 || c >= (int64_t{1} << 20)) return bad("mesh coordinate out of range");
    }
    p.coords = std::move(*coords);
    if (p.local.shape.size() != p.global.size()) return bad("local shard rank differs from the global shape's");
    return p;
  }
  if (placements->items.empty()) return bad("DTensorSpec without placements");
  const PyValue* pl = placements->items[0];
  const std::string cls(pl->ClassName());
  if (cls == "Replicate") return p;
  if (cls != "Shard")
    return Unsupported("cannot read " + s.rel + ": " + what + ": placement " + cls + " is not supported");
  auto dim = AsInt(pl->Attr("dim"), "Shard.dim");
  if (!dim.ok() || *dim < 0 || *dim >= static_cast<int64_t>(p.global.size())) return bad("Shard with a bad dim");
  p.shard_dim = static_cast<int>(*dim);
  if (p.local.shape.size() != p.global.size()) return bad("local shard rank differs from the global shape's");
  for (size_t d = 0; d < p.global.size(); ++d) {
    if (static_cast<int>(d) != p.shard_dim && p.local.shape[d] != p.global[d])
      return bad("local shard shape disagrees");
  }
  return p;
}

struct RankFiles {
  bool verl = false;
  uint32_t world = 0;
  std::map<uint32_t, std::string> model, optim;
  std::string model_stem, optim_stem;  // Accelerate: pytorch_model_fsdp_0, optimizer_0
  std::set<std::string> other_stems;   // Accelerate: further models' / optimizers' files, not read

  std::string Name(bool is_model, uint32_t rank) const {
    const std::string r = std::to_string(rank);
    if (verl)
      return std::string(is_model ? "model" : "optim") + "_world_size_" + std::to_string(world) + "_rank_" + r + ".pt";
    return (is_model ? model_stem : optim_stem) + "_rank" + r + ".bin";
  }
};

RankFiles Scan(const std::string& dir) {
  RankFiles r;
  struct Stem {
    std::map<uint32_t, std::string> files;
  };
  std::map<std::string, Stem> model_stems, optim_stems;
  for (const std::string& n : ListDirectory(dir)) {
    std::string kind, stem;
    uint32_t w = 0, rank = 0;
    if (RE2::FullMatch(n, VerlFileRe(), &kind, &w, &rank)) {
      r.verl = true;
      r.world = std::max(r.world, w);
      (kind == "model" ? r.model : r.optim).emplace(rank, n);
    } else if (RE2::FullMatch(n, AccelerateFileRe(), &stem, &kind, &rank)) {
      (kind == "optimizer" ? optim_stems : model_stems)[stem].files.emplace(rank, n);
    }
  }
  if (r.verl || model_stems.empty()) return r;
  // The first model (pytorch_model_fsdp_rank<R> under LOCAL_STATE_DICT, else
  // pytorch_model_fsdp_0_rank<R>) and the first optimizer.
  auto pick = [&](std::map<std::string, Stem>& stems, std::string& name, std::map<uint32_t, std::string>& files) {
    if (stems.empty()) return;
    auto it = stems.count("pytorch_model_fsdp") ? stems.find("pytorch_model_fsdp") : stems.begin();
    name = it->first;
    files = std::move(it->second.files);
    for (const auto& [other, unused] : stems) {
      if (other != name) r.other_stems.insert(other);
    }
  };
  pick(model_stems, r.model_stem, r.model);
  pick(optim_stems, r.optim_stem, r.optim);
  for (const auto* m : {&r.model, &r.optim}) {
    if (!m->empty()) r.world = std::max(r.world, m->rbegin()->first + 1);
  }
  return r;
}

}  // namespace

bool LooksLikeRankFiles(const std::string& dir) { return !Scan(dir).model.empty(); }

Result<Checkpoint> ReadRankFiles(const std::string& dir) {
  const RankFiles rf = Scan(dir);
  if (rf.model.empty()) {
    return NotFound("cannot read " + dir + ": no model_world_size_W_rank_R.pt or pytorch_model_fsdp_0_rank<R>.bin");
  }
  // Every key holds a slot per rank: a world the present files cannot back
  // (a hostile or misnamed file) is refused before anything is sized by it.
  const size_t present = rf.model.size() + rf.optim.size();
  if (rf.world > 2 * present + 16) {
    return Invalid("cannot read " + dir + ": its rank files name a world of " + std::to_string(rf.world) +
                   " ranks, but only " + std::to_string(present) + " rank files are present");
  }
  Checkpoint ck;
  ck.info.family = rf.verl ? Family::kVerl : Family::kAccelerateFsdp;
  ck.info.world_size = rf.world;
  Files files;
  files.dir = dir;
  files.ck = &ck;
  // Every rank's files, opened in rank order; a missing or unreadable one is a finding.
  std::vector<std::unique_ptr<Source>> model(rf.world), optim(rf.world);
  size_t missing = 0;
  auto open_all = [&](const std::map<uint32_t, std::string>& names, bool is_model,
                      std::vector<std::unique_ptr<Source>>& out) {
    for (uint32_t r = 0; r < rf.world; ++r) {
      const std::string want = rf.Name(is_model, r);
      auto it = names.find(r);
      if (it == names.end() || it->second != want) {
        if (++missing <= 16) {  // the first 16 are named, the rest counted
          ck.info.Flag(Check::kCoverage, Severity::kError, "", want,
                       want + " is missing: rank " + std::to_string(r) + "'s shards are unknown");
        }
        continue;
      }
      out[r] = files.Open(want);
      if (!out[r]->error.empty()) {
        ck.info.Flag(Check::kCoverage, Severity::kError, "", want, out[r]->error);
        out[r].reset();
      }
    }
  };
  open_all(rf.model, true, model);
  if (!rf.optim.empty()) open_all(rf.optim, false, optim);
  if (missing > 16) {
    ck.info.Flag(Check::kCoverage, Severity::kError, "", "",
                 std::to_string(missing) + " rank files of " + std::to_string(rf.world) + " ranks are missing in " +
                     dir + " (the first 16 are listed)");
  }

  // key -> per-rank (source, value); the key order is the first rank's.
  struct Entry {
    std::vector<std::string> path;
    std::vector<std::pair<const Source*, const PyValue*>> ranks;
  };
  std::vector<Entry> entries;
  std::map<std::string, size_t> by_key;
  size_t skipped = 0;
  bool too_deep = false;
  // Whether a file set holds any DTensor / ShardedTensor: only then are its
  // plain tensors known to be replicas (FSDP leaves only those unsharded).
  bool model_pieces = false, optim_pieces = false;
  auto collect = [&](const std::vector<std::unique_ptr<Source>>& srcs, std::vector<std::string> prefix,
                     const std::map<std::string, std::string>& rename) {
    for (uint32_t r = 0; r < rf.world; ++r) {
      if (!srcs[r]) continue;
      std::vector<Leaf> leaves;
      std::vector<std::string> path = prefix;
      WalkStateDict(srcs[r]->root(), path, leaves, &skipped, &too_deep);
      for (Leaf& l : leaves) {
        if (l.v->kind != PyKind::kTensor) (prefix.empty() ? model_pieces : optim_pieces) = true;
        // optimizer.state.<id>.<k> -> optimizer.state.<fqn>.<k> when the ids map.
        if (l.path.size() >= 3 && !rename.empty()) {
          if (auto it = rename.find(l.path[2]); it != rename.end()) l.path[2] = it->second;
        }
        auto [it, inserted] = by_key.emplace(JoinPath(l.path), entries.size());
        if (inserted) entries.push_back(Entry{l.path, std::vector<std::pair<const Source*, const PyValue*>>(rf.world)});
        entries[it->second].ranks[r] = {srcs[r].get(), l.v};
      }
    }
  };
  collect(model, {}, {});
  const size_t n_model = entries.size();

  // verl's optimizer ids: its param_groups list them in model.parameters()
  // order, which is the model state dict's order for the parameters. Mapped
  // only if every id's states have its parameter's global shape. (FSDP's own
  // optimizer state dicts, Accelerate's, are keyed by parameter name.)
  std::map<std::string, std::string> id_to_fqn;
  if (rf.verl && !rf.optim.empty() && optim[0]) {
    std::vector<std::string> ids;
    const PyValue* groups = optim[0]->root()->kind == PyKind::kDict ? optim[0]->root()->Get("param_groups") : nullptr;
    for (size_t g = 0; groups != nullptr && groups->IsSeq() && g < groups->items.size(); ++g) {
      const PyValue* params = groups->items[g]->kind == PyKind::kDict ? groups->items[g]->Get("params") : nullptr;
      for (size_t i = 0; params != nullptr && params->IsSeq() && i < params->items.size(); ++i) {
        if (params->items[i]->kind == PyKind::kInt) ids.push_back(std::to_string(params->items[i]->i));
      }
    }
    const PyValue* state = optim[0]->root()->kind == PyKind::kDict ? optim[0]->root()->Get("state") : nullptr;
    bool ok = !ids.empty() && ids.size() <= n_model && state != nullptr && state->kind == PyKind::kDict;
    std::map<std::string, const PyValue*> by_id;  // "<id>" -> that parameter's states
    for (size_t k = 0; ok && k < state->dict.size(); ++k) {
      const auto& [key, v] = state->dict[k];
      if (key->kind == PyKind::kInt) by_id.emplace(std::to_string(key->i), v);
    }
    for (size_t i = 0; ok && i < ids.size(); ++i) {
      const Entry& e = entries[i];
      const PyValue* pv = e.ranks[0].second;
      auto param = pv ? PieceOf(*e.ranks[0].first, pv, JoinPath(e.path)) : Result<Piece>(Invalid(""));
      auto found = by_id.find(ids[i]);
      const PyValue* st = found == by_id.end() ? nullptr : found->second;
      const PyValue* avg = st != nullptr && st->kind == PyKind::kDict ? st->Get("exp_avg") : nullptr;
      auto s = avg ? PieceOf(*optim[0], avg, "state " + ids[i]) : Result<Piece>(Invalid(""));
      ok = param.ok() && (st == nullptr || (s.ok() && s->global == param->global));
      if (ok) id_to_fqn[ids[i]] = JoinPath(e.path);
    }
    if (!ok) {
      id_to_fqn.clear();
      ck.info.problems.push_back(
          "optimizer ids could not be matched to parameters by order and shape: its "
          "states are under other/optimizer.state.<id>");
    }
  }
  if (!rf.optim.empty()) collect(optim, {"optimizer"}, id_to_fqn);
  // Rank 0's param groups (every rank steps with the same hyperparameters)
  // for dcp/, their ids as FQNs (verl's by the order above; FSDP's optimizer
  // state dicts name them already).
  const PyValue* groups = !rf.optim.empty() && optim[0] && optim[0]->root()->kind == PyKind::kDict
                              ? optim[0]->root()->Get("param_groups")
                              : nullptr;
  if (groups != nullptr) {
    auto fqns = [&](size_t, const PyValue& params) -> Result<std::vector<std::string>> {
      if (!params.IsSeq()) return Invalid("its params are not a list");
      std::vector<std::string> out;
      for (const PyRef& p : params.items) {
        if (p->IsStr()) {
          out.push_back(p->s);
          continue;
        }
        auto it = p->kind == PyKind::kInt ? id_to_fqn.find(std::to_string(p->i)) : id_to_fqn.end();
        if (it == id_to_fqn.end()) return Invalid("a parameter id with no FQN");
        out.push_back(it->second);
      }
      return out;
    };
    if (Status st = AddParamGroupExports(*groups, optim[0]->rel, fqns, ck.exports); !st.ok()) {
      ck.info.problems.push_back("dcp/ has no optim.param_groups: " + st.message());
    }
  }

  // One record per key: the ranks' pieces placed in the global tensor.
  std::vector<std::vector<std::string>> paths;
  for (const Entry& e : entries) {
    const size_t ti = ck.tensors.size();
    ck.fragments.Resize(ti + 1);
    TensorRecord t;
    t.key = JoinPath(e.path);
    t.encoding = Encoding::kTensor;
    std::vector<Fragment> frags;
    std::string error;
    int64_t next = 0;                                          // Shard(d): where the next rank's rows start
    std::vector<std::pair<const Source*, Piece>> mesh_pieces;  // N-D mesh DTensors, placed once all are seen
    bool seen = false;                                         // some rank gave the tensor's dtype and shape
    for (uint32_t r = 0; r < rf.world && error.empty(); ++r) {
      const auto& [src, v] = e.ranks[r];
      if (v == nullptr) {
        if (model[r] || (e.path[0] == "optimizer" && optim[r])) {
          error = "rank " + std::to_string(r) + "'s file has no '" + t.key + "'";
        }
        continue;  // a missing file: a finding already; its rows stay a hole
      }
      auto p = PieceOf(*src, v, "'" + t.key + "'");
      if (!p.ok()) {
        error = p.status().message();
        break;
      }
      if (p->mesh_rank >= 0 && p->mesh_rank != r) {
        // A rank's file copied over another's: placed by its name, its shard
        // would land where the other rank's belongs.
        error = "cannot read " + src->rel + ": '" + t.key + "' is rank " + std::to_string(p->mesh_rank) +
                "'s shard (its DeviceMesh says so), not rank " + std::to_string(r) + "'s";
        break;
      }
      if (!seen) {
        t.dtype = p->dtype;
        t.shape = p->global;
        seen = true;
      }
      if (p->global != t.shape || p->dtype != t.dtype) {
        error = src->rel + " gives '" + t.key + "' another shape or dtype than rank 0";
        break;
      }
      if (!p->mesh_shards.empty() || !mesh_pieces.empty()) {
        if (p->mesh_shards.empty() || (!mesh_pieces.empty() && mesh_pieces[0].second.mesh_shards != p->mesh_shards)) {
          error = src->rel + " gives '" + t.key + "' another placement than " + mesh_pieces[0].first->rel;
          break;
        }
        mesh_pieces.emplace_back(src, std::move(*p));
        continue;
      }
      if (p->sharded_tensor) {  // placed where its ShardMetadata says
        for (const auto& [offsets, loc] : p->placed) {
          Fragment f = WholeFragment(loc, src->file);
          f.offsets = offsets;
          if (NumelOf(f.lengths) > 0) frags.push_back(std::move(f));
        }
        continue;
      }
      if (v->kind == PyKind::kTensor && rf.world > 1 && NumelOf(p->global) > 1 &&
          !(e.path[0] == "optimizer" ? optim_pieces : model_pieces)) {
        // Every rank's file holds a plain tensor under this key, and nothing in
        // these files is placed: a rank-local value (FSDP1's flat-parameter
        // optimizer state, optimizer.state_dict() under use_orig_params=False),
        // not a replica. Serving rank 0's would be a part as the whole.
        error = "cannot index '" + t.key + "': every rank's " + (e.path[0] == "optimizer" ? "optimizer" : "model") +
                " file holds its own plain tensor under it and none of them is a DTensor or ShardedTensor, so "
                "whether they are replicas or rank-local pieces (FSDP1 flat-parameter state) is unknown";
        break;
      }
      if (p->shard_dim < 0) {
        if (frags.empty()) frags.push_back(WholeFragment(p->local, src->file));  // replicated: the first copy
        continue;
      }
      if (!e.ranks[0].second && r > 0 && frags.empty() && next == 0) {
        // Rank 0's file is missing: where this rank's rows start is unknown.
        error = "rank 0's shard of '" + t.key + "' is missing; the others cannot be placed";
        break;
      }
      Fragment f = WholeFragment(p->local, src->file);
      f.offsets[p->shard_dim] = next;
      next += p->local.shape[p->shard_dim];
      if (f.lengths[p->shard_dim] > 0) frags.push_back(std::move(f));
    }
    if (error.empty() && !mesh_pieces.empty()) {
      // The mesh's extent along each dim: the largest coordinate any rank holds.
      std::vector<int64_t> sizes(mesh_pieces[0].second.coords.size(), 1);
      for (const auto& [src, p] : mesh_pieces) {
        for (size_t i = 0; i < sizes.size(); ++i) sizes[i] = std::max(sizes[i], p.coords[i] + 1);
      }
      std::set<std::vector<int64_t>> placed;  // replicas: the lowest rank's copy
      for (const auto& [src, p] : mesh_pieces) {
        std::vector<int64_t> local;
        std::vector<int64_t> offsets = MeshOffsets(t.shape, p.mesh_shards, sizes, p.coords, &local);
        if (local != p.local.shape) {
          error = "cannot read " + src->rel + ": '" + t.key + "': its local shard has shape " +
                  ShapeStr(p.local.shape) + ", but its mesh coordinate places a " + ShapeStr(local) +
                  " piece of the global " + ShapeStr(t.shape);
          break;
        }
        if (!placed.insert(offsets).second || NumelOf(local) == 0) continue;
        Fragment f = WholeFragment(p.local, src->file);
        f.offsets = std::move(offsets);
        frags.push_back(std::move(f));
      }
    }
    if (error.empty() && seen) {
      std::string detail;
      t.byte_size = NumelOf(t.shape) * DTypeSize(t.dtype);
      if (Status s = CheckTiling(t, frags, ck.files, &detail); !s.ok()) {
        error = s.Annotate("tensor '" + t.key + "' in " + dir).message();
        ck.info.Flag(Check::kCoverage, Severity::kError, t.key, "", error, detail);
      }
    }
    if (!error.empty() || !seen) {
      t.error = error.empty() ? "cannot index '" + t.key + "': no rank holds it" : error;
      if (t.dtype == DType::kInvalid) t.dtype = DType::kU8;
      t.shape.assign(1, 0);
      t.byte_size = 0;
    } else {
      ck.fragments.Set(ti, frags);
      t.num_fragments = static_cast<uint32_t>(frags.size());
    }
    paths.push_back(e.path);
    ck.tensors.push_back(std::move(t));
  }
  ClassifyStateDict(ck.tensors, paths);
  if (skipped > 0) {
    ck.info.problems.push_back(std::to_string(skipped) + " non-tensor entries (param_groups, counters) are not shown");
  }
  if (too_deep) ck.info.problems.push_back("entries nested deeper than 32 levels are not shown");
  if (std::string note = files.PlaceholderNote(); !note.empty()) ck.info.problems.push_back(std::move(note));
  if (rf.verl) {
    ck.info.format_note = "verl FSDP checkpoint: " + std::to_string(rf.world) + " ranks' model_world_size_*_rank_*.pt" +
                          (rf.optim.empty() ? "" : " + optim_…");
    static const RE2 kStepRe(R"(global_step_([0-9]{1,12}))");
    int64_t step = -1;
    if (RE2::PartialMatch(dir, kStepRe, &step)) ck.info.step = step;
  } else {
    ck.info.format_note =
        "Accelerate FSDP per-rank files (use_dcp=False / LOCAL_STATE_DICT): " + std::to_string(rf.world) + " ranks' " +
        rf.model_stem + "_rank*.bin" + (rf.optim.empty() ? "" : " + " + rf.optim_stem + "_rank*.bin");
    for (const std::string& other : rf.other_stems) {
      ck.info.problems.push_back(other + "_rank*.bin (another model or optimizer) is not read; only " + rf.model_stem +
                                 (rf.optim.empty() ? "" : " and " + rf.optim_stem) + " are shown");
    }
    ck.info.step = TrainerStateStep(dir);
  }
  return ck;
}

}  // namespace ckptfs::formats
