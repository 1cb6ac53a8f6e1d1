#include "formats/megatron/dist_optim.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <tuple>
#include <nlohmann/json.hpp>
#include <re2/re2.h>

#include "common/json_text.h"
#include "formats/byte_reader.h"
#include "formats/torch_save.h"
#include "formats/tp_merge.h"

namespace ckptfs::formats::megatron {
namespace {

constexpr int64_t kParamAlign = 64;          // _pad_start_of_param_if_needed
constexpr uint64_t kMaxObjectBytes = 1 << 20;  // per_bucket_numel objects are a few numbers
constexpr const char* kStates[] = {"param", "exp_avg", "exp_avg_sq"};
constexpr uint32_t kNone = UINT32_MAX;

struct Bucket {
  int64_t numel = -1;                          // the tensors' global size (unpadded)
  uint32_t rec[3] = {kNone, kNone, kNone};     // param, exp_avg, exp_avg_sq
};
struct Buffer {
  std::string dtype;  // "(torch.bfloat16, torch.float32)"
  std::map<int64_t, Bucket> buckets;
};

// One model parameter of a chunk, with its TP-local geometry.
struct Member {
  uint32_t rec = 0;  // the parameter's record
  std::vector<int64_t> local_shape;
  int64_t numel = 0;
  std::tuple<int, int64_t, int, uint32_t> order;  // module order (see OrderOf)
};

// Where the parameter sits: bucket and element offset in it.
struct Placement {
  int64_t bucket = 0, start = 0;
};

// mcore's module registration order inside one TransformerLayer, by sharded
// key suffix. The local spec has separate input_layernorm / pre_mlp_layernorm
// modules (saved under the fused names linear_qkv.layer_norm_* and
// linear_fc1.layer_norm_*) registered before the attention / MLP; Transformer
// Engine fuses them into linear_qkv / linear_fc1, registered first inside
// them. Attention registers linear_proj before SelfAttention adds linear_qkv.
int LayerRank(const std::string& suffix, bool local) {
  static const std::map<std::string, int> kCommon = {
      {"input_layernorm.weight", 0}, {"input_layernorm.bias", 1},
      {"self_attention.linear_proj.weight", 10}, {"self_attention.linear_proj.bias", 11},
      {"self_attention.linear_qkv.weight", 14}, {"self_attention.linear_qkv.bias", 15},
      {"self_attention.q_layernorm.weight", 16}, {"self_attention.q_layernorm.bias", 17},
      {"self_attention.k_layernorm.weight", 18}, {"self_attention.k_layernorm.bias", 19},
      {"pre_mlp_layernorm.weight", 30}, {"pre_mlp_layernorm.bias", 31},
      {"mlp.linear_fc1.weight", 42}, {"mlp.linear_fc1.bias", 43},
      {"mlp.linear_fc2.weight", 44}, {"mlp.linear_fc2.bias", 45},
  };
  static const std::map<std::string, int> kLocal = {
      {"self_attention.linear_qkv.layer_norm_weight", 0}, {"self_attention.linear_qkv.layer_norm_bias", 1},
      {"mlp.linear_fc1.layer_norm_weight", 30}, {"mlp.linear_fc1.layer_norm_bias", 31},
  };
  static const std::map<std::string, int> kTe = {
      {"self_attention.linear_qkv.layer_norm_weight", 12}, {"self_attention.linear_qkv.layer_norm_bias", 13},
      {"mlp.linear_fc1.layer_norm_weight", 40}, {"mlp.linear_fc1.layer_norm_bias", 41},
  };
  const auto& fused = local ? kLocal : kTe;
  if (auto it = fused.find(suffix); it != fused.end()) return it->second;
  if (auto it = kCommon.find(suffix); it != kCommon.end()) return it->second;
  return -1;
}

// (top-level module, layer, rank inside it, record index) for GPTModel:
// embedding, decoder.layers, decoder.final_layernorm, output_layer.
// nullopt: a name ckptfs does not know the place of.
std::optional<std::tuple<int, int64_t, int, uint32_t>> OrderOf(const std::string& fqn, uint32_t rec, bool local) {
  static const RE2 kLayer(R"(decoder\.layers\.(\d{1,9})\.(.+))", RE2::Latin1);
  static const std::map<std::string, int> kTop = {
      {"embedding.word_embeddings.weight", 0}, {"embedding.position_embeddings.weight", 1},
      {"embedding.tokentype_embeddings.weight", 2}, {"decoder.final_layernorm.weight", 0},
      {"decoder.final_layernorm.bias", 1}, {"output_layer.weight", 0}, {"output_layer.bias", 1},
  };
  int64_t layer = 0;
  std::string suffix;
  if (RE2::FullMatch(fqn, kLayer, &layer, &suffix)) {
    const int r = LayerRank(suffix, local);
    if (r < 0) return std::nullopt;
    return std::make_tuple(1, layer, r, rec);
  }
  auto it = kTop.find(fqn);
  if (it == kTop.end()) return std::nullopt;
  const int top = fqn.rfind("embedding.", 0) == 0 ? 0 : fqn.rfind("decoder.", 0) == 0 ? 2 : 3;
  return std::make_tuple(top, int64_t{0}, it->second, rec);
}

// The chunk (pp, vp) that holds `fqn`; nullopt when it cannot be placed.
std::optional<std::pair<int, int>> ChunkOf(const std::string& fqn, const ModelFacts& f, const PipelineShape& shape) {
  static const RE2 kLayer(R"(decoder\.layers\.(\d{1,9})\..+)", RE2::Latin1);
  int64_t layer = 0;
  if (RE2::FullMatch(fqn, kLayer, &layer)) {
    for (int p = 0; p < f.pp; ++p) {
      for (int v = 0; v < f.vp; ++v) {
        auto off = LayerOffset(shape, p, v);
        auto n = LayersPerChunk(shape, p);
        if (off.ok() && n.ok() && layer >= *off && layer < *off + *n) return std::make_pair(p, v);
      }
    }
    return std::nullopt;
  }
  if (fqn.rfind("embedding.", 0) == 0) return std::make_pair(0, 0);
  if (fqn.rfind("decoder.final_layernorm.", 0) == 0 || fqn.rfind("output_layer.", 0) == 0) {
    return std::make_pair(static_cast<int>(f.pp) - 1, static_cast<int>(f.vp) - 1);
  }
  return std::nullopt;
}

// The TP-local shape of `t` (every TP rank's is the same in Megatron).
Result<std::vector<int64_t>> LocalShape(const TensorRecord& t, const std::optional<Rule>& rule, int64_t tp) {
  std::vector<int64_t> s = t.shape;
  if (tp == 1) return s;
  if (!rule) return Invalid("no tensor-parallel split rule for '" + t.fqn + "'");
  if (rule->kind == Merge::kReplicated) return s;
  const int dim = rule->kind == Merge::kSub2 ? 0 : rule->cat_dim;
  if (rule->kind != Merge::kCat && rule->kind != Merge::kSub2) {
    return Invalid("'" + t.fqn + "': its split rule cannot be replayed");
  }
  if (static_cast<size_t>(dim) >= s.size() || s[static_cast<size_t>(dim)] % (rule->kind == Merge::kSub2 ? 2 * tp : tp) != 0) {
    return Invalid("'" + t.fqn + "' " + ShapeStr(s) + " does not divide among " + std::to_string(tp) + " TP ranks");
  }
  s[static_cast<size_t>(dim)] /= tp;
  return s;
}

// per_bucket_numel[_unpadded] of one model-parallel rank: [gbuf][bucket]
// (the single dtype entry of each buffer). nullopt with `why` when unreadable.
std::optional<std::vector<std::vector<int64_t>>> ReadPerBucket(const std::string& dir, const Checkpoint& ck, uint32_t rec,
                                                                std::string* why) {
  const TensorRecord& t = ck.tensors[rec];
  const auto& frags = ck.fragments[rec];
  if (!t.error.empty()) {
    *why = t.error;
    return std::nullopt;
  }
  if (frags.size() != 1 || frags[0].compression != Compression::kNone || frags[0].data_length > kMaxObjectBytes) {
    *why = "'" + t.key + "' is not a small uncompressed object";
    return std::nullopt;
  }
  const Fragment& f = frags[0];
  const std::string path = dir + "/" + ck.files[f.file.v].rel_path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    *why = "cannot open " + path;
    return std::nullopt;
  }
  FileSliceReader r(fd, f.data_offset, f.data_length, ck.files[f.file.v].rel_path + " '" + t.key + "'");
  auto a = ReadTorchSave(r);
  ::close(fd);
  if (!a.ok()) {
    *why = a.status().message();
    return std::nullopt;
  }
  std::vector<std::vector<int64_t>> out;
  const PyValue* root = a->root.get();
  if (root == nullptr || !root->IsSeq()) {
    *why = "'" + t.key + "' is not a list";
    return std::nullopt;
  }
  // [[{dtypes: [numel, ...]}, ...]] (mcore 0.16: one list per optimizer
  // instance) or [{...}, ...]: buffers in gbuf_idx order either way.
  std::vector<PyRef> bufs;
  for (PyRef g : root->items) {
    if (g->IsSeq()) {
      bufs.insert(bufs.end(), g->items.begin(), g->items.end());
    } else {
      bufs.push_back(g);
    }
  }
  for (PyRef g : bufs) {
    if (g->kind != PyKind::kDict || g->dict.size() != 1 || !g->dict[0].second->IsSeq()) {
      *why = "'" + t.key + "': a buffer entry is not {dtypes: [numel, ...]}";
      return std::nullopt;
    }
    std::vector<int64_t> n;
    for (PyRef v : g->dict[0].second->items) {
      if (v->kind != PyKind::kInt) {
        *why = "'" + t.key + "': a bucket size is not an int";
        return std::nullopt;
      }
      n.push_back(v->i);
    }
    out.push_back(std::move(n));
  }
  return out;
}

class Mapper {
 public:
  Mapper(const std::string& dir, const ModelFacts& facts, Checkpoint& ck) : dir_(dir), f_(facts), ck_(ck) {}
  void Run();

 private:
  bool Collect();
  void MapBuffer(int t, int p, int v, const Buffer& buf, const std::vector<Member>& members);
  std::string Replay(const Buffer& buf, const std::vector<Member>& ordered, std::vector<Placement>& out) const;
  std::string CheckBoundaries(const Buffer& buf, const std::vector<Member>& ordered, const std::vector<Placement>& at,
                              const std::vector<int64_t>* padded) const;
  void Emit();

  const std::string& dir_;
  const ModelFacts& f_;
  Checkpoint& ck_;
  std::map<std::pair<int64_t, int64_t>, Buffer> buffers_;  // (M, gbuf)
  std::map<int64_t, uint32_t> unpadded_rec_, padded_rec_;  // M -> per_bucket_numel[_unpadded]
  // Per parameter record and state: fragments gathered over TP ranks, or why not.
  struct StateOut {
    std::vector<Fragment> frags;
    std::string error;
    DType dtype = DType::kF32;
    int ranks = 0;
  };
  std::map<uint32_t, std::array<StateOut, 3>> out_;
  std::set<uint32_t> members_;  // every parameter record placed in some chunk
};

bool Mapper::Collect() {
  static const RE2 kBucket(
      R"(optimizer\.distributed\.dp_group_idx_(\d{1,6})\.gbuf_idx_(\d{1,6})\.dtype_(.*)\.bucket_idx_(\d{1,9})\.(param|exp_avg|exp_avg_sq))",
      RE2::Latin1);
  static const RE2 kPerBucket(R"(optimizer\.distributed\.dp_group_idx_(\d{1,6})\.per_bucket_numel(_unpadded)?/shard_.*)",
                              RE2::Latin1);
  for (uint32_t i = 0; i < ck_.tensors.size(); ++i) {
    const TensorRecord& t = ck_.tensors[i];
    int64_t m = 0, g = 0, b = 0;
    std::string dtype, state, unpadded;
    if (t.encoding == Encoding::kTensor && RE2::FullMatch(t.key, kBucket, &m, &g, &dtype, &b, &state)) {
      Buffer& buf = buffers_[{m, g}];
      buf.dtype = dtype;
      Bucket& bk = buf.buckets[b];
      const size_t s = state == "param" ? 0 : state == "exp_avg" ? 1 : 2;
      bk.rec[s] = i;
      if (t.shape.size() == 1) bk.numel = t.shape[0];
    } else if (t.encoding == Encoding::kBytes && RE2::FullMatch(t.key, kPerBucket, &m, &unpadded)) {
      (unpadded.empty() ? padded_rec_ : unpadded_rec_)[m] = i;
    }
  }
  return !buffers_.empty();
}

// Places `ordered` (named_parameters order) in the buckets, last parameter
// first. Returns why the buckets contradict the parameters, or "".
std::string Mapper::Replay(const Buffer& buf, const std::vector<Member>& ordered, std::vector<Placement>& at) const {
  std::vector<int64_t> sizes;
  for (const auto& [b, bk] : buf.buckets) {
    if (b != static_cast<int64_t>(sizes.size())) return "bucket " + std::to_string(sizes.size()) + " is missing";
    if (bk.numel < 0) return "bucket " + std::to_string(b) + " is not a flat tensor";
    sizes.push_back(bk.numel);
  }
  at.assign(ordered.size(), Placement{});
  size_t b = 0;
  int64_t pos = 0;
  for (size_t k = ordered.size(); k-- > 0;) {
    const Member& m = ordered[k];
    if (m.numel == 0) continue;
    if (b >= sizes.size()) {
      return "the buckets end before '" + ck_.tensors[m.rec].fqn + "' (" + std::to_string(k + 1) + " parameters left)";
    }
    const int64_t start = (pos + kParamAlign - 1) / kParamAlign * kParamAlign;
    if (start + m.numel > sizes[b]) {
      return "'" + ck_.tensors[m.rec].fqn + "' (" + std::to_string(m.numel) + " elements at " + std::to_string(start) +
             ") overruns bucket " + std::to_string(b) + " of " + std::to_string(sizes[b]) + " elements";
    }
    at[k] = Placement{static_cast<int64_t>(b), start};
    pos = start + m.numel;
    if (pos == sizes[b]) {
      ++b;
      pos = 0;
    }
  }
  if (b != sizes.size()) {
    return "bucket " + std::to_string(b) + " holds " + std::to_string(sizes[b]) + " elements, its parameters fill " +
           std::to_string(pos);
  }
  return "";
}

// Every parameter boundary must be a recorded chunk boundary, and (DP known)
// every chunk boundary a parameter, padding or DP-shard boundary.
std::string Mapper::CheckBoundaries(const Buffer& buf, const std::vector<Member>& ordered, const std::vector<Placement>& at,
                                    const std::vector<int64_t>* padded) const {
  for (const auto& [b, bk] : buf.buckets) {
    for (int s = 0; s < 3; ++s) {
      if (bk.rec[s] == kNone || !ck_.tensors[bk.rec[s]].error.empty()) continue;
      std::set<int64_t> chunk_edges;
      for (const Fragment& fr : ck_.fragments[bk.rec[s]]) {
        if (fr.offsets.size() != 1) continue;
        chunk_edges.insert(fr.offsets[0]);
        chunk_edges.insert(fr.offsets[0] + fr.lengths[0]);
      }
      std::set<int64_t> param_edges = {0, bk.numel};
      for (size_t k = 0; k < ordered.size(); ++k) {
        if (at[k].bucket != b || ordered[k].numel == 0) continue;
        param_edges.insert(at[k].start);
        param_edges.insert(at[k].start + ordered[k].numel);
        if (!chunk_edges.count(at[k].start) || !chunk_edges.count(at[k].start + ordered[k].numel)) {
          return "'" + ck_.tensors[ordered[k].rec].fqn + "' would span [" + std::to_string(at[k].start) + ", " +
                 std::to_string(at[k].start + ordered[k].numel) + ") of bucket " + std::to_string(b) +
                 ", which the writer's chunks do not bound";
        }
      }
      if (padded == nullptr || f_.dp <= 0 || static_cast<size_t>(b) >= padded->size() || (*padded)[b] % f_.dp != 0) continue;
      // Padding between parameters runs from one's end to the next's start,
      // so its chunk edges are parameter edges too.
      const int64_t shard = (*padded)[b] / f_.dp;
      for (int64_t e : chunk_edges) {
        if (param_edges.count(e) || (shard > 0 && e % shard == 0)) continue;
        return "a chunk of bucket " + std::to_string(b) + " ends at " + std::to_string(e) +
               ", inside a parameter of the replayed layout";
      }
    }
  }
  return "";
}

void Mapper::MapBuffer(int t, int p, int v, const Buffer& buf, const std::vector<Member>& members) {
  const int64_t mp = t + f_.tp * p;
  const std::string where = "distributed-optimizer buffer " + std::to_string(v) + " of TP rank " + std::to_string(t) +
                            ", PP rank " + std::to_string(p) + " (dp_group_idx_" + std::to_string(mp) + ")";
  std::string why;
  // Bucket sizes against per_bucket_numel_unpadded.
  std::optional<std::vector<std::vector<int64_t>>> unpadded, padded;
  if (auto it = unpadded_rec_.find(mp); it != unpadded_rec_.end()) {
    std::string e;
    unpadded = ReadPerBucket(dir_, ck_, it->second, &e);
    if (!unpadded) why = "cannot read per_bucket_numel_unpadded: " + e;
  }
  if (auto it = padded_rec_.find(mp); it != padded_rec_.end()) {
    std::string e;
    padded = ReadPerBucket(dir_, ck_, it->second, &e);
  }
  if (why.empty() && unpadded) {
    const auto& u = *unpadded;
    std::vector<int64_t> have;
    for (const auto& [b, bk] : buf.buckets) have.push_back(bk.numel);
    if (static_cast<size_t>(v) >= u.size() || u[static_cast<size_t>(v)] != have) {
      nlohmann::json d;
      d["per_bucket_numel_unpadded"] = static_cast<size_t>(v) < u.size() ? nlohmann::json(u[static_cast<size_t>(v)]) : nlohmann::json();
      d["bucket_tensors"] = have;
      why = "per_bucket_numel_unpadded " + (static_cast<size_t>(v) < u.size() ? nlohmann::json(u[static_cast<size_t>(v)]).dump() : "(no entry)") +
            " contradicts the bucket tensors " + nlohmann::json(have).dump();
      ck_.info.Flag(Check::kGeometry, Severity::kError, "", ck_.files[ck_.fragments[unpadded_rec_[mp]][0].file.v].rel_path,
                    where + ": " + why, JsonText(d));
    }
  }
  const std::vector<int64_t>* pad =
      padded && static_cast<size_t>(v) < padded->size() ? &(*padded)[static_cast<size_t>(v)] : nullptr;
  std::vector<Member> ordered = members;
  std::vector<Placement> at;
  if (why.empty()) {
    // The layer spec args name first, then the other one (a mismatch shows in
    // the chunk boundaries; equal-sized neighbours are in the same order in both).
    for (bool local : {f_.local_impl, !f_.local_impl}) {
      for (Member& m : ordered) {
        auto o = OrderOf(ck_.tensors[m.rec].fqn, m.rec, local);
        m.order = *o;  // members only hold placeable names
      }
      std::sort(ordered.begin(), ordered.end(), [](const Member& a, const Member& b) { return a.order < b.order; });
      std::string w = Replay(buf, ordered, at);
      if (w.empty()) w = CheckBoundaries(buf, ordered, at, pad);
      if (w.empty()) {
        why.clear();
        break;
      }
      if (why.empty()) why = w;  // report the first spec's reason
    }
    if (!why.empty()) {
      ck_.info.Flag(Check::kGeometry, Severity::kError, "", "", where + ": " + why + "; its optimizer states are unreadable",
                    "");
    }
  }
  for (size_t k = 0; k < ordered.size(); ++k) {
    const Member& m = ordered[k];
    auto rule = SplitRule(ck_.tensors[m.rec].fqn, f_.swiglu);
    if (f_.tp > 1 && rule && rule->kind == Merge::kReplicated && t != 0) continue;  // served from TP rank 0
    auto& outs = out_[m.rec];
    for (int s = 0; s < 3; ++s) {
      StateOut& so = outs[static_cast<size_t>(s)];
      ++so.ranks;
      if (!so.error.empty()) continue;
      if (!why.empty()) {
        so.error = where + ": " + why;
        continue;
      }
      if (m.numel == 0) continue;
      const Bucket& bk = buf.buckets.at(at[k].bucket);
      if (bk.rec[s] == kNone) {
        so.error = where + ": bucket " + std::to_string(at[k].bucket) + " has no " + kStates[s] + " tensor";
        continue;
      }
      const TensorRecord& br = ck_.tensors[bk.rec[s]];
      if (!br.error.empty()) {
        so.error = br.error;
        continue;
      }
      so.dtype = br.dtype;
      Rule r = rule.value_or(Rule{Merge::kReplicated});
      if (f_.tp == 1) r = Rule{Merge::kReplicated};
      Merger merger(r, std::vector<std::vector<int64_t>>(static_cast<size_t>(std::max<int64_t>(f_.tp, 1)), m.local_shape), -1);
      const int64_t begin = at[k].start, end = at[k].start + m.numel;
      int64_t covered = 0;
      for (const Fragment& fr : ck_.fragments[bk.rec[s]]) {
        if (fr.offsets.size() != 1) continue;
        const int64_t a = std::max(begin, fr.offsets[0]), e = std::min(end, fr.offsets[0] + fr.lengths[0]);
        if (a >= e) continue;
        const size_t first = so.frags.size();
        const uint64_t base = fr.data_offset + static_cast<uint64_t>(a - fr.offsets[0]) * DTypeSize(fr.dtype);
        AddRangeFragments(merger, f_.tp == 1 ? 0 : t, m.local_shape, a - begin, e - a, fr.file, fr.dtype, base, so.frags);
        for (size_t i = first; i < so.frags.size(); ++i) {
          so.frags[i].compression = fr.compression;
          so.frags[i].item_offset = fr.item_offset;
          so.frags[i].item_length = fr.item_length;
        }
        covered += e - a;
      }
      if (covered != m.numel) {
        so.error = where + ": the " + kStates[s] + " chunks cover " + std::to_string(covered) + " of the " +
                   std::to_string(m.numel) + " elements of '" + ck_.tensors[m.rec].fqn + "'";
      }
    }
  }
}

void Mapper::Emit() {
  for (auto& [rec, outs] : out_) {
    const TensorRecord p = ck_.tensors[rec];
    auto rule = SplitRule(p.fqn, f_.swiglu);
    const int want = f_.tp > 1 && rule && rule->kind == Merge::kReplicated ? 1 : static_cast<int>(f_.tp);
    for (int s = 0; s < 3; ++s) {
      StateOut& so = outs[static_cast<size_t>(s)];
      TensorRecord st;
      st.role = Role::kOptimState;
      st.fqn = p.fqn;
      st.state = s == 0 ? "fp32" : kStates[s];
      st.key = "optimizer/" + p.fqn + "/" + st.state;
      st.shape = p.shape;
      st.dtype = so.dtype;
      st.error = so.error;
      if (st.error.empty() && so.ranks != want) {
        st.error = "'" + p.fqn + "': " + std::to_string(so.ranks) + " of " + std::to_string(want) +
                   " TP ranks have a distributed-optimizer buffer for it";
      }
      if (!st.error.empty()) so.frags.clear();
      ck_.AddTensor(std::move(st), std::move(so.frags));
    }
  }
}

void Mapper::Run() {
  if (!Collect()) return;
  if (f_.tp <= 0 || f_.num_layers < 0) {
    ck_.info.problems.push_back(
        "distributed-optimizer states (dp_reshardable buckets) are shown under other/ and not mapped: common.pt has no "
        "args with tensor_model_parallel_size and num_layers to replay the buffers");
    return;
  }
  PipelineShape shape;
  shape.num_layers = f_.num_layers;
  shape.pp = static_cast<int>(f_.pp);
  shape.vp = static_cast<int>(f_.vp);
  shape.first_stage_layers = f_.first_stage_layers;
  shape.last_stage_layers = f_.last_stage_layers;

  // The parameters of every chunk (p, v), with their TP-local shapes.
  std::map<std::pair<int, int>, std::vector<Member>> chunks;
  std::vector<std::string> unplaced;
  bool experts = false;
  for (uint32_t i = 0; i < ck_.tensors.size(); ++i) {
    const TensorRecord& t = ck_.tensors[i];
    if (t.role != Role::kParam || t.encoding != Encoding::kTensor) continue;
    experts |= t.fqn.find(".experts.") != std::string::npos;
    auto c = ChunkOf(t.fqn, f_, shape);
    if (!c || !OrderOf(t.fqn, i, f_.local_impl)) {
      unplaced.push_back(t.fqn);
      continue;
    }
    Member m;
    m.rec = i;
    auto ls = LocalShape(t, SplitRule(t.fqn, f_.swiglu), f_.tp);
    if (!ls.ok()) {
      unplaced.push_back(t.fqn + " (" + ls.status().message() + ")");
      continue;
    }
    m.local_shape = *ls;
    m.numel = NumelOf(m.local_shape);
    chunks[*c].push_back(std::move(m));
  }
  if (experts || !unplaced.empty()) {
    const std::string why = experts ? "MoE expert buffers are not replayed"
                                    : "ckptfs does not know the module order of '" + unplaced.front() + "'" +
                                          (unplaced.size() > 1 ? " and " + std::to_string(unplaced.size() - 1) + " more" : "");
    ck_.info.problems.push_back("distributed-optimizer states (dp_reshardable buckets) are shown under other/ and not mapped: " + why);
    return;
  }
  for (const auto& [key, buf] : buffers_) {
    const auto [mp, g] = key;
    const int t = static_cast<int>(mp % f_.tp), p = static_cast<int>(mp / f_.tp), v = static_cast<int>(g);
    auto it = chunks.find({p, v});
    if (p >= f_.pp || it == chunks.end()) {
      ck_.info.Flag(Check::kGeometry, Severity::kError, "", "",
                    "distributed-optimizer buffer dp_group_idx_" + std::to_string(mp) + ".gbuf_idx_" + std::to_string(g) +
                        " belongs to no model chunk of TP " + std::to_string(f_.tp) + ", PP " + std::to_string(f_.pp) +
                        ", VP " + std::to_string(f_.vp) + " (a buffer per dtype is not replayed)",
                    "");
      continue;
    }
    MapBuffer(t, p, v, buf, it->second);
  }
  // A chunk whose buffer is missing: its parameters' states are unreadable.
  for (const auto& [c, members] : chunks) {
    for (const Member& m : members) out_[m.rec];
  }
  Emit();
}

}  // namespace

void MapBucketStates(const std::string& dir, const ModelFacts& facts, Checkpoint& ck) {
  Mapper(dir, facts, ck).Run();
}

}  // namespace ckptfs::formats::megatron
