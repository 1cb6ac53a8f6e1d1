#include "formats/megatron/dist_optim.h"

#include <fcntl.h>
#include <re2/re2.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <tuple>

#include "common/json_text.h"
#include "formats/byte_reader.h"
#include "formats/pickle_writer.h"
#include "formats/torch_save.h"
#include "formats/tp_merge.h"

namespace ckptfs::formats::megatron {
namespace {

constexpr int64_t kParamAlign = 64;  // _pad_start_of_param_if_needed
constexpr const char* kStates[] = {"param", "exp_avg", "exp_avg_sq"};

// One state (param, exp_avg, exp_avg_sq) of one bucket: 1-D fragments over
// [0, bucket numel), or why it is unreadable.
struct StateSrc {
  bool present = false;
  std::string error;
  DType dtype = DType::kInvalid;
  std::vector<Fragment> frags;
};
struct Bucket {
  int64_t numel = -1;  // unpadded
  StateSrc st[3];
};
struct Buffer {
  std::string dtype;                  // "(torch.bfloat16, torch.float32)"
  std::map<int64_t, Bucket> buckets;  // dp_reshardable: the writer's buckets
  bool chunked = false;               // each parameter's range is its own chunk (dp_reshardable)
  // dp_zero_gather_scatter: buckets[0] is the whole buffer, the buckets'
  // unpadded contents back to back; the replay finds their sizes.
  bool coalesced = false;
};

// One model parameter of a chunk, with its TP-local geometry.
struct Member {
  uint32_t rec = 0;  // the parameter's record
  // The last stage's copy of a tied embedding (output_layer.weight, saved
  // under the embedding's key): in the buffer, its states not served.
  bool copy = false;
  bool shared = false;  // shared_embedding: a bucket of its own
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
      {"input_layernorm.weight", 0},
      {"input_layernorm.bias", 1},
      {"self_attention.linear_proj.weight", 10},
      {"self_attention.linear_proj.bias", 11},
      {"self_attention.linear_qkv.weight", 14},
      {"self_attention.linear_qkv.bias", 15},
      {"self_attention.q_layernorm.weight", 16},
      {"self_attention.q_layernorm.bias", 17},
      {"self_attention.k_layernorm.weight", 18},
      {"self_attention.k_layernorm.bias", 19},
      {"pre_mlp_layernorm.weight", 30},
      {"pre_mlp_layernorm.bias", 31},
      {"mlp.linear_fc1.weight", 42},
      {"mlp.linear_fc1.bias", 43},
      {"mlp.linear_fc2.weight", 44},
      {"mlp.linear_fc2.bias", 45},
  };
  static const std::map<std::string, int> kLocal = {
      {"self_attention.linear_qkv.layer_norm_weight", 0},
      {"self_attention.linear_qkv.layer_norm_bias", 1},
      {"mlp.linear_fc1.layer_norm_weight", 30},
      {"mlp.linear_fc1.layer_norm_bias", 31},
  };
  static const std::map<std::string, int> kTe = {
      {"self_attention.linear_qkv.layer_norm_weight", 12},
      {"self_attention.linear_qkv.layer_norm_bias", 13},
      {"mlp.linear_fc1.layer_norm_weight", 40},
      {"mlp.linear_fc1.layer_norm_bias", 41},
  };
  // MoELayer: the router, then the experts (SequentialMLP: local_experts.<i>,
  // each linear_fc1 before linear_fc2). Expert parameters live in buffers of
  // their own, so only their order among themselves matters.
  static const RE2 kExpert(R"(mlp\.experts\.local_experts\.(\d{1,6})\.linear_fc([12])\.(weight|bias))", RE2::Latin1);
  const auto& fused = local ? kLocal : kTe;
  if (auto it = fused.find(suffix); it != fused.end()) return it->second;
  if (auto it = kCommon.find(suffix); it != kCommon.end()) return it->second;
  if (suffix == "mlp.router.weight") return 46;
  int expert = 0, fc = 0;
  std::string kind;
  if (RE2::FullMatch(suffix, kExpert, &expert, &fc, &kind)) return 100 + 4 * expert + 2 * (fc - 1) + (kind == "bias");
  return -1;
}

// (top-level module, layer, rank inside it, record index) for GPTModel:
// embedding, decoder.layers, decoder.final_layernorm, output_layer.
// nullopt: a name ckptfs does not know the place of.
std::optional<std::tuple<int, int64_t, int, uint32_t>> OrderOf(const std::string& fqn, uint32_t rec, bool local) {
  static const RE2 kLayer(R"(decoder\.layers\.(\d{1,9})\.(.+))", RE2::Latin1);
  static const std::map<std::string, int> kTop = {
      {"embedding.word_embeddings.weight", 0},
      {"embedding.position_embeddings.weight", 1},
      {"embedding.tokentype_embeddings.weight", 2},
      {"decoder.final_layernorm.weight", 0},
      {"decoder.final_layernorm.bias", 1},
      {"output_layer.weight", 0},
      {"output_layer.bias", 1},
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
  if (static_cast<size_t>(dim) >= s.size() ||
      s[static_cast<size_t>(dim)] % (rule->kind == Merge::kSub2 ? 2 * tp : tp) != 0) {
    return Invalid("'" + t.fqn + "' " + ShapeStr(s) + " does not divide among " + std::to_string(tp) + " TP ranks");
  }
  s[static_cast<size_t>(dim)] /= tp;
  return s;
}

// Opens the torch.save object a bytes record holds (a ShardedObject) and hands
// it to `use`, with the reader and the record's fragment. Returns why not.
std::string WithObject(
    const std::string& dir, const Checkpoint& ck, uint32_t rec,
    const std::function<std::string(const ByteReader&, const TorchSaveArchive&, const Fragment&)>& use) {
  const TensorRecord& t = ck.tensors[rec];
  const std::vector<Fragment> frags = ck.fragments.Get(rec);
  if (!t.error.empty()) return t.error;
  if (frags.size() != 1 || frags[0].compression != Compression::kNone)
    return "'" + t.key + "' is not an uncompressed object";
  const Fragment& f = frags[0];
  const std::string& rel = ck.files[f.file.v].rel_path;
  const std::string path = dir + "/" + rel;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "cannot open " + path;
  FileSliceReader r(fd, f.data_offset, f.data_length, rel + " '" + t.key + "'");
  auto a = ReadTorchSave(r);
  std::string why = a.ok() ? use(r, *a, f) : a.status().message();
  ::close(fd);
  return why;
}

// [[x, ...]] (one list per optimizer instance, mcore 0.16) or [x, ...]: the
// x in order.
std::vector<const PyValue*> Flatten(const PyValue* root) {
  std::vector<const PyValue*> out;
  if (root == nullptr) return out;
  if (!root->IsSeq()) {
    out.push_back(root);
    return out;
  }
  for (PyRef g : root->items) {
    if (g->IsSeq()) {
      out.insert(out.end(), g->items.begin(), g->items.end());
    } else {
      out.push_back(g);
    }
  }
  return out;
}

}  // namespace

PerDpRankGroups DistOptimizerParamGroups(const std::string& dir, const Checkpoint& ck) {
  static const RE2 kObject(
      R"((?:chained_(\d{1,3})\.)?optimizer\.distributed\.dp_group_idx_\d{1,6}\.optimizer/shard_.*)", RE2::Latin1);
  // By member (-1: an optimizer that is not chained): its groups' writer and
  // the identities it has.
  struct Member {
    PickleWriter w;
    std::set<std::string> seen;
  };
  std::map<int, Member> by_member;
  for (uint32_t i = 0; i < ck.tensors.size(); ++i) {
    const TensorRecord& t = ck.tensors[i];
    std::string chained;
    if (t.encoding != Encoding::kBytes || !RE2::FullMatch(t.key, kObject, &chained)) continue;
    Member& m = by_member[chained.empty() ? -1 : std::stoi(chained)];
    const std::string why =
        WithObject(dir, ck, i, [&](const ByteReader&, const TorchSaveArchive& a, const Fragment&) -> std::string {
          for (const PyValue* inst : Flatten(a.root.get())) {
            const PyValue* groups = inst->kind == PyKind::kDict ? inst->Get("param_groups") : nullptr;
            if (groups == nullptr || !groups->IsSeq()) return "no param_groups";
            for (const PyValue* g : groups->items) {
              if (g == nullptr || g->kind != PyKind::kDict || g->Get("step") == nullptr) return "a group without step";
              std::string id;
              for (const char* k : {"wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr"}) {
                id += ToJson(g->Get(k)) + ",";
              }
              if (!m.seen.insert(id).second) continue;
              if (m.seen.size() == 1) m.w.BeginList();
              Status st = m.w.Value(*g, [](PickleWriter&, const PyValue&) { return Unsupported("a tensor"); });
              if (!st.ok()) return st.message();
            }
          }
          return "";
        });
    if (!why.empty()) return {};
  }
  PerDpRankGroups out;
  for (auto& [i, m] : by_member) {
    if (m.seen.empty()) return {};
    m.w.EndList();
    if (i < 0) {
      out.single = m.w.Fragment();
    } else if (i == static_cast<int>(out.members.size())) {
      out.members.push_back(m.w.Fragment());
    } else {
      return {};  // not numbered 0, 1, ...
    }
  }
  if (!out.single.empty() && !out.members.empty()) return {};  // both: neither is the optimizer
  return out;
}

namespace {

// per_bucket_numel[_unpadded] of one model-parallel rank: [gbuf][bucket]
// (the single dtype entry of each buffer). nullopt with `why` when unreadable.
std::optional<std::vector<std::vector<int64_t>>> ReadPerBucket(const std::string& dir, const Checkpoint& ck,
                                                               uint32_t rec, std::string* why) {
  std::vector<std::vector<int64_t>> out;
  const std::string& key = ck.tensors[rec].key;
  *why = WithObject(dir, ck, rec, [&](const ByteReader&, const TorchSaveArchive& a, const Fragment&) -> std::string {
    for (const PyValue* g : Flatten(a.root.get())) {
      if (g->kind != PyKind::kDict || g->dict.size() != 1 || !g->dict[0].second->IsSeq()) {
        return "'" + key + "': a buffer entry is not {dtypes: [numel, ...]}";
      }
      std::vector<int64_t> n;
      for (PyRef v : g->dict[0].second->items) {
        if (v->kind != PyKind::kInt) return "'" + key + "': a bucket size is not an int";
        n.push_back(v->i);
      }
      out.push_back(std::move(n));
    }
    return "";
  });
  if (!why->empty()) return std::nullopt;
  return out;
}

// dp_zero_gather_scatter's `param_state` object of one model-parallel rank:
// {buckets_coalesced: True, gbuf: {dtypes: {param, exp_avg, exp_avg_sq:
// world tensors, numel_unpadded}}} (get_parameter_state_dp_zero on DP rank 0).
// Each buffer becomes a coalesced Buffer whose tensors are located in the file.
std::string ReadParamState(const std::string& dir, const Checkpoint& ck, uint32_t rec, std::map<int64_t, Buffer>* out) {
  const std::string& key = ck.tensors[rec].key;
  return WithObject(
      dir, ck, rec, [&](const ByteReader& r, const TorchSaveArchive& a, const Fragment& where) -> std::string {
        for (const PyValue* inst : Flatten(a.root.get())) {
          if (inst->kind != PyKind::kDict) return "'" + key + "' is not a dict";
          const PyValue* coalesced = inst->Get("buckets_coalesced");
          if (coalesced == nullptr || coalesced->kind != PyKind::kBool || !coalesced->b) {
            return "'" + key + "' holds per-bucket lists (before buckets_coalesced), which ckptfs does not replay";
          }
          for (const auto& [k, v] : inst->dict) {
            if (k->kind != PyKind::kInt) continue;
            if (v->kind != PyKind::kDict || v->dict.size() != 1 || v->dict[0].second->kind != PyKind::kDict) {
              return "'" + key + "': buffer " + std::to_string(k->i) + " is not {dtypes: {param, exp_avg, exp_avg_sq}}";
            }
            const PyValue* d = v->dict[0].second;
            const PyValue* n = d->Get("numel_unpadded");
            if (n == nullptr || n->kind != PyKind::kInt || n->i < 0) return "'" + key + "': no numel_unpadded";
            if (out->count(k->i)) return "'" + key + "': buffer " + std::to_string(k->i) + " appears twice";
            Buffer& buf = (*out)[k->i];
            buf.coalesced = true;
            Bucket& bk = buf.buckets[0];
            bk.numel = n->i;
            for (int s = 0; s < 3; ++s) {
              const PyValue* t = d->Get(kStates[s]);
              StateSrc& src = bk.st[s];
              src.present = t != nullptr;
              if (t == nullptr) continue;
              if (t->kind != PyKind::kTensor || t->tensor().shape.size() != 1 || t->tensor().shape[0] < bk.numel ||
                  (t->tensor().shape[0] > 1 && t->tensor().strides[0] != 1)) {
                src.error = "'" + key + "': " + kStates[s] + " of buffer " + std::to_string(k->i) +
                            " is not a flat tensor of " + std::to_string(bk.numel) + " elements";
                continue;
              }
              auto at = ResolveTensor(r, a, t->tensor());
              if (!at.ok()) {
                src.error = at.status().message();
                continue;
              }
              Fragment f;
              f.file = where.file;
              f.dtype = t->tensor().dtype;
              f.offsets = {0};
              f.lengths = {bk.numel};
              f.strides = {1};
              f.data_offset = where.data_offset + at->data_offset;
              const uint64_t isz = DTypeSize(f.dtype);
              f.data_length = static_cast<uint64_t>(bk.numel) * isz;
              if (isz == 0 ||
                  static_cast<uint64_t>(bk.numel) > at->data_length / isz) {  // no overflow on hostile sizes
                src.error = "'" + key + "': " + kStates[s] + " of buffer " + std::to_string(k->i) + " is cut short";
                continue;
              }
              src.dtype = f.dtype;
              src.frags.push_back(std::move(f));
            }
          }
        }
        return "";
      });
}

// With MoE, a ChainedOptimizer saves each member under chained_<i>.: the
// dense distributed optimizer first, the expert one last. Its dp_group_idx is
// the rank in the model-parallel group: t + TP * p for the dense buffers,
// t + TP * (e + EP * p) for the expert ones (the expert tensor-pipeline group
// of mcore's "tp-ep-dp-pp" rank order; expert TP = TP).
class Mapper {
 public:
  Mapper(const std::string& dir, const ModelFacts& facts, Checkpoint& ck) : dir_(dir), f_(facts), ck_(ck) {}
  void Run();

 private:
  bool Collect();
  // Maps the buffers of one optimizer (chain -1: unchained) over `experts` or
  // the dense parameters.
  void RunPart(int64_t chain, bool experts);
  void MapBuffer(int64_t mp, int t, int p, int v, const Buffer& buf, const std::vector<Member>& members);
  std::string Split(const Buffer& buf, const std::vector<Member>& ordered, int p, Buffer* out) const;
  std::string Replay(const Buffer& buf, const std::vector<Member>& ordered, std::vector<Placement>& out) const;
  std::string CheckBoundaries(const Buffer& buf, const std::vector<Member>& ordered, const std::vector<Placement>& at,
                              const std::vector<int64_t>* padded) const;
  void Emit();

  // No args and no run config (megatron-core driven by a loop of its own):
  // the layout facts the replay needs, read from the checkpoint itself.
  std::string InferLayout();

  const std::string& dir_;
  ModelFacts f_;  // a copy: InferLayout fills in what the run did not record
  Checkpoint& ck_;
  std::map<std::tuple<int64_t, int64_t, int64_t>, Buffer> buffers_;  // (chain, M, gbuf)
  std::map<std::pair<int64_t, int64_t>, uint32_t> unpadded_rec_,
      padded_rec_;                                                   // (chain, M) -> per_bucket_numel[_unpadded]
  std::map<std::pair<int64_t, int64_t>, uint32_t> param_state_rec_;  // (chain, M) -> param_state
  // The part being mapped: its chain and data-parallel size (experts: the
  // expert data-parallel group, DP / EP).
  int64_t chain_ = -1;
  bool experts_ = false;
  int64_t dp_ = -1;
  // Per parameter record and state: fragments gathered over TP ranks, or why not.
  struct StateOut {
    std::vector<Fragment> frags;
    std::string error;
    DType dtype = DType::kF32;
    int ranks = 0;
  };
  std::map<uint32_t, std::array<StateOut, 3>> out_;
};

bool Mapper::Collect() {
  static const RE2 kBucket(
      R"((?:chained_(\d{1,3})\.)?optimizer\.distributed\.dp_group_idx_(\d{1,6})\.gbuf_idx_(\d{1,6})\.)"
      R"(dtype_(.*)\.bucket_idx_(\d{1,9})\.(param|exp_avg|exp_avg_sq))",
      RE2::Latin1);
  static const RE2 kPerBucket(R"((?:chained_(\d{1,3})\.)?optimizer\.distributed\.dp_group_idx_(\d{1,6}))"
                              R"(\.per_bucket_numel(_unpadded)?/shard_.*)",
                              RE2::Latin1);
  static const RE2 kParamState(
      R"((?:chained_(\d{1,3})\.)?optimizer\.distributed\.dp_group_idx_(\d{1,6})\.param_state/shard_.*)", RE2::Latin1);
  for (uint32_t i = 0; i < ck_.tensors.size(); ++i) {
    const TensorRecord& t = ck_.tensors[i];
    int64_t m = 0, g = 0, b = 0;
    std::string chain_s, dtype, state, unpadded;
    auto chain = [&] { return chain_s.empty() ? int64_t{-1} : std::stoll(chain_s); };  // at most 3 digits
    if (t.encoding == Encoding::kTensor && RE2::FullMatch(t.key, kBucket, &chain_s, &m, &g, &dtype, &b, &state)) {
      Buffer& buf = buffers_[{chain(), m, g}];
      buf.dtype = dtype;
      buf.chunked = true;
      Bucket& bk = buf.buckets[b];
      StateSrc& src = bk.st[state == "param" ? 0 : state == "exp_avg" ? 1 : 2];
      src.present = true;
      src.error = t.error;
      src.dtype = t.dtype;
      for (const Fragment& f : ck_.fragments.Get(i)) {
        if (f.offsets.size() == 1) src.frags.push_back(f);
      }
      if (t.shape.size() == 1) bk.numel = t.shape[0];
    } else if (t.encoding == Encoding::kBytes && RE2::FullMatch(t.key, kPerBucket, &chain_s, &m, &unpadded)) {
      (unpadded.empty() ? padded_rec_ : unpadded_rec_)[{chain(), m}] = i;
    } else if (t.encoding == Encoding::kBytes && RE2::FullMatch(t.key, kParamState, &chain_s, &m)) {
      param_state_rec_[{chain(), m}] = i;
    }
  }
  for (const auto& [cm, rec] : param_state_rec_) {
    std::map<int64_t, Buffer> bufs;
    const std::string why = ReadParamState(dir_, ck_, rec, &bufs);
    if (!why.empty()) {
      ck_.info.Flag(
          Check::kUnreadable, Severity::kError, ck_.tensors[rec].key, "",
          "cannot read the distributed-optimizer state of dp_group_idx_" + std::to_string(cm.second) + ": " + why, "");
      continue;
    }
    for (auto& [g, buf] : bufs) buffers_[{cm.first, cm.second, g}] = std::move(buf);
  }
  return !buffers_.empty();
}

// dp_zero_gather_scatter: the bucket sizes Megatron's DDP made of `ordered`
// (param_and_grad_buffer.py: last parameter first, 64-aligned starts, a
// bucket closed once it holds ddp_bucket_size elements when
// overlap_grad_reduce, never on later pipeline stages, and a shared embedding
// alone), checked against the buffer's size; `out` is `buf` cut into them.
std::string Mapper::Split(const Buffer& buf, const std::vector<Member>& ordered, int p, Buffer* out) const {
  int64_t limit = -1;
  if (f_.overlap_grad_reduce && p == 0) {
    limit =
        f_.ddp_bucket_size > 0 ? f_.ddp_bucket_size : std::max<int64_t>(40000000, 1000000 * std::max<int64_t>(dp_, 1));
  }
  std::vector<int64_t> sizes;
  int64_t pos = 0;
  bool open = false;
  for (size_t k = ordered.size(); k-- > 0;) {
    const Member& m = ordered[k];
    int64_t start = (pos + kParamAlign - 1) / kParamAlign * kParamAlign;
    if (m.shared && open) {
      sizes.push_back(start);
      start = 0;
    }
    pos = start + m.numel;
    open = true;
    if ((limit > 0 && pos >= limit) || m.shared) {
      sizes.push_back(pos);
      pos = 0;
      open = false;
    }
  }
  if (open) sizes.push_back(pos);
  int64_t total = 0;
  for (int64_t n : sizes) total += n;
  const Bucket& whole = buf.buckets.begin()->second;
  if (total != whole.numel) {
    return "the buffer holds " + std::to_string(whole.numel) + " elements, its parameters in " +
           std::to_string(sizes.size()) + " bucket(s) fill " + std::to_string(total);
  }
  *out = Buffer{};
  out->dtype = buf.dtype;
  int64_t off = 0;
  for (size_t b = 0; b < sizes.size(); ++b) {
    Bucket& bk = out->buckets[static_cast<int64_t>(b)];
    bk.numel = sizes[b];
    for (int s = 0; s < 3; ++s) {
      bk.st[s] = whole.st[s];
      bk.st[s].frags.clear();
      for (const Fragment& f : whole.st[s].frags) {
        Fragment g = f;
        g.lengths = {sizes[b]};
        g.data_offset = f.data_offset + static_cast<uint64_t>(off) * DTypeSize(f.dtype);
        g.data_length = static_cast<uint64_t>(sizes[b]) * DTypeSize(f.dtype);
        bk.st[s].frags.push_back(std::move(g));
      }
    }
    off += sizes[b];
  }
  return "";
}

// Places `ordered` (named_parameters order) in the buckets, last parameter
// first. A bucket ends at its last parameter's end, or at the 64-aligned
// start of a shared embedding that opens the next one. Returns why the
// buckets contradict the parameters, or "".
std::string Mapper::Replay(const Buffer& buf, const std::vector<Member>& ordered, std::vector<Placement>& at) const {
  std::vector<int64_t> sizes;
  for (const auto& [b, bk] : buf.buckets) {
    if (b != static_cast<int64_t>(sizes.size())) return "bucket " + std::to_string(sizes.size()) + " is missing";
    if (bk.numel < 0) return "bucket " + std::to_string(b) + " is not a flat tensor";
    sizes.push_back(bk.numel);
  }
  auto align = [](int64_t x) { return (x + kParamAlign - 1) / kParamAlign * kParamAlign; };
  at.assign(ordered.size(), Placement{});
  size_t b = 0;
  int64_t pos = 0;
  for (size_t k = ordered.size(); k-- > 0;) {
    const Member& m = ordered[k];
    if (m.numel == 0) continue;
    if (b < sizes.size() && pos > 0 && (pos == sizes[b] || align(pos) == sizes[b])) {
      ++b;
      pos = 0;
    }
    if (b >= sizes.size()) {
      return "the buckets end before '" + ck_.tensors[m.rec].fqn + "' (" + std::to_string(k + 1) + " parameters left)";
    }
    const int64_t start = align(pos);
    if (start + m.numel > sizes[b]) {
      return "'" + ck_.tensors[m.rec].fqn + "' (" + std::to_string(m.numel) + " elements at " + std::to_string(start) +
             ") overruns bucket " + std::to_string(b) + " of " + std::to_string(sizes[b]) + " elements";
    }
    at[k] = Placement{static_cast<int64_t>(b), start};
    pos = start + m.numel;
  }
  if (b < sizes.size() && pos > 0 && (pos == sizes[b] || align(pos) == sizes[b])) ++b;
  if (b != sizes.size()) {
    return "bucket " + std::to_string(b) + " holds " + std::to_string(sizes[b]) + " elements, its parameters fill " +
           std::to_string(pos);
  }
  return "";
}

// Every parameter boundary must be a recorded chunk boundary, and (DP known)
// every chunk boundary a parameter or DP-shard boundary: padding between
// parameters runs from one's end to the next's start.
std::string Mapper::CheckBoundaries(const Buffer& buf, const std::vector<Member>& ordered,
                                    const std::vector<Placement>& at, const std::vector<int64_t>* padded) const {
  for (const auto& [b, bk] : buf.buckets) {
    for (int s = 0; s < 3; ++s) {
      if (!bk.st[s].present || !bk.st[s].error.empty()) continue;
      std::set<int64_t> chunk_edges;
      for (const Fragment& fr : bk.st[s].frags) {
        chunk_edges.insert(fr.offsets[0]);
        chunk_edges.insert(fr.offsets[0] + fr.lengths[0]);
      }
      std::set<int64_t> param_edges = {0, bk.numel};
      for (size_t k = 0; k < ordered.size(); ++k) {
        if (at[k].bucket != b || ordered[k].numel == 0) continue;
        const int64_t begin = at[k].start, end = at[k].start + ordered[k].numel;
        param_edges.insert(begin);
        param_edges.insert(end);
        if (!chunk_edges.count(begin) || !chunk_edges.count(end)) {
          return "'" + ck_.tensors[ordered[k].rec].fqn + "' would span [" + std::to_string(begin) + ", " +
                 std::to_string(end) + ") of bucket " + std::to_string(b) + ", which the writer's chunks do not bound";
        }
      }
      if (padded == nullptr || dp_ <= 0 || static_cast<size_t>(b) >= padded->size() || (*padded)[b] % dp_ != 0)
        continue;
      const int64_t shard = (*padded)[b] / dp_;
      for (int64_t e : chunk_edges) {
        if (param_edges.count(e) || (shard > 0 && e % shard == 0)) continue;
        return "a chunk of bucket " + std::to_string(b) + " ends at " + std::to_string(e) +
               ", inside a parameter of the replayed layout";
      }
    }
  }
  return "";
}

void Mapper::MapBuffer(int64_t mp, int t, int p, int v, const Buffer& buf, const std::vector<Member>& members) {
  const std::string where = "distributed-optimizer " + std::string(experts_ ? "expert " : "") + "buffer " +
                            std::to_string(v) + " of TP rank " + std::to_string(t) + ", PP rank " + std::to_string(p) +
                            " (" + (chain_ >= 0 ? "chained_" + std::to_string(chain_) + "." : "") + "dp_group_idx_" +
                            std::to_string(mp) + ")";
  std::string why;
  // Bucket sizes against per_bucket_numel_unpadded.
  std::optional<std::vector<std::vector<int64_t>>> unpadded, padded;
  if (auto it = unpadded_rec_.find({chain_, mp}); it != unpadded_rec_.end() && !buf.coalesced) {
    std::string e;
    unpadded = ReadPerBucket(dir_, ck_, it->second, &e);
    if (!unpadded) why = "cannot read per_bucket_numel_unpadded: " + e;
  }
  if (auto it = padded_rec_.find({chain_, mp}); it != padded_rec_.end() && !buf.coalesced) {
    std::string e;
    padded = ReadPerBucket(dir_, ck_, it->second, &e);
  }
  if (why.empty() && unpadded) {
    const auto& u = *unpadded;
    std::vector<int64_t> have;
    for (const auto& [b, bk] : buf.buckets) have.push_back(bk.numel);
    const bool listed = static_cast<size_t>(v) < u.size();
    if (!listed || u[static_cast<size_t>(v)] != have) {
      nlohmann::json d;
      d["per_bucket_numel_unpadded"] = listed ? nlohmann::json(u[static_cast<size_t>(v)]) : nlohmann::json();
      d["bucket_tensors"] = have;
      why = "per_bucket_numel_unpadded " +
            (listed ? d["per_bucket_numel_unpadded"].dump() : std::string("(no entry)")) +
            " contradicts the bucket tensors " + d["bucket_tensors"].dump();
      ck_.info.Flag(Check::kGeometry, Severity::kError, "",
                    ck_.files[ck_.fragments.Get(unpadded_rec_[{chain_, mp}])[0].file.v].rel_path, where + ": " + why,
                    JsonText(d));
    }
  }
  const std::vector<int64_t>* pad =
      padded && static_cast<size_t>(v) < padded->size() ? &(*padded)[static_cast<size_t>(v)] : nullptr;
  std::vector<Member> ordered = members;
  std::vector<Placement> at;
  Buffer view;
  if (why.empty()) {
    // The layer spec args name first, then the other one (a mismatch shows in
    // the sizes and chunk boundaries; equal-sized neighbours are in the same
    // order in both).
    for (bool local : {f_.local_impl, !f_.local_impl}) {
      for (Member& m : ordered) {
        m.order = *OrderOf(m.copy ? "output_layer.weight" : ck_.tensors[m.rec].fqn, m.rec, local);
      }
      std::sort(ordered.begin(), ordered.end(), [](const Member& a, const Member& b) { return a.order < b.order; });
      std::string w = buf.coalesced ? Split(buf, ordered, p, &view) : "";
      if (!buf.coalesced) view = buf;
      if (w.empty()) w = Replay(view, ordered, at);
      if (w.empty() && view.chunked) w = CheckBoundaries(view, ordered, at, pad);
      if (w.empty()) {
        why.clear();
        break;
      }
      if (why.empty()) why = w;  // report the first spec's reason
    }
    if (!why.empty()) {
      ck_.info.Flag(Check::kGeometry, Severity::kError, "", "",
                    where + ": " + why + "; its optimizer states are unreadable", "");
    }
  }
  for (size_t k = 0; k < ordered.size(); ++k) {
    const Member& m = ordered[k];
    if (m.copy) continue;  // the first stage's embedding is served
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
      const StateSrc& src = view.buckets.at(at[k].bucket).st[s];
      if (!src.present) {
        so.error = where + ": bucket " + std::to_string(at[k].bucket) + " has no " + kStates[s] + " tensor";
        continue;
      }
      if (!src.error.empty()) {
        so.error = src.error;
        continue;
      }
      so.dtype = src.dtype;
      const Rule replicated{Merge::kReplicated, 0, false, {}};
      Rule r = f_.tp == 1 ? replicated : rule.value_or(replicated);
      Merger merger(r,
                    std::vector<std::vector<int64_t>>(static_cast<size_t>(std::max<int64_t>(f_.tp, 1)), m.local_shape));
      const int64_t begin = at[k].start, end = at[k].start + m.numel;
      int64_t covered = 0;
      for (const Fragment& fr : src.frags) {
        const int64_t a = std::max(begin, fr.offsets[0]), e = std::min(end, fr.offsets[0] + fr.lengths[0]);
        if (a >= e) continue;
        const size_t first = so.frags.size();
        const uint64_t base = fr.data_offset + static_cast<uint64_t>(a - fr.offsets[0]) * DTypeSize(fr.dtype);
        AddRangeFragments(merger, f_.tp == 1 ? 0 : t, m.local_shape, a - begin, e - a, fr.file, fr.dtype, base,
                          so.frags);
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

// The facts a run without args or a run config leaves out, from the
// checkpoint: num_layers from the layer numbers of the parameters, PP from the
// model-parallel ranks that saved optimizer buffers (dp_group_idx_<M>, M over
// PP x TP), the embedding tied when no output_layer.weight was saved, the
// local layer spec when its norms are modules of their own; megatron-core's
// DDP defaults for the rest (no virtual pipeline, even stages, buckets as
// recorded). The replay checks every bucket against per_bucket_numel_unpadded,
// so a wrong guess is refused there, naming the bucket. Empty on success,
// else why nothing is inferred.
std::string Mapper::InferLayout() {
  int64_t layers = -1;
  bool output_layer = false, fused_norms = false, separate_norms = false, experts = false;
  for (const TensorRecord& t : ck_.tensors) {
    if (t.role != Role::kParam) continue;
    int64_t layer = -1;
    RenumberLayer(t.fqn, 0, &layer);
    layers = std::max(layers, layer);
    output_layer |= t.fqn == "output_layer.weight";
    fused_norms |= t.fqn.find(".linear_qkv.layer_norm_weight") != std::string::npos;
    separate_norms |= t.fqn.find(".input_layernorm.weight") != std::string::npos;
    experts |= t.fqn.find(".experts.") != std::string::npos;
  }
  if (layers < 0) return "no parameter has a layer number";
  if (layers >= static_cast<int64_t>(ck_.tensors.size())) {
    return "the layer numbers reach " + std::to_string(layers) + ", more than the checkpoint has records";
  }
  if (experts) return "an MoE model: the experts' parallel sizes are not in the checkpoint";
  std::set<int64_t> ranks;
  for (const auto& [key, buf] : buffers_) ranks.insert(std::get<1>(key));
  const int64_t mps = static_cast<int64_t>(ranks.size());
  if (mps == 0 || mps % f_.tp != 0 || *ranks.rbegin() != mps - 1) {
    return std::to_string(mps) + " model-parallel ranks saved optimizer buffers, not a multiple of TP " +
           std::to_string(f_.tp);
  }
  f_.num_layers = layers + 1;
  f_.pp = mps / f_.tp;
  f_.vp = 1;
  f_.tied = !output_layer;
  f_.local_impl = separate_norms && !fused_norms;
  ck_.info.format_note += std::string(ck_.info.format_note.empty() ? "" : "; ") + "distributed-optimizer layout " +
                          "read from the checkpoint: " + std::to_string(f_.num_layers) + " layers, PP " +
                          std::to_string(f_.pp) + (f_.tied ? ", tied embeddings" : "") +
                          ", megatron-core's DDP defaults, checked against per_bucket_numel_unpadded";
  return "";
}

void Mapper::Run() {
  if (!Collect()) return;
  if (f_.tp > 0 && f_.num_layers < 0) {
    if (std::string why = InferLayout(); !why.empty()) {
      ck_.info.problems.push_back(
          "distributed-optimizer states are shown under other/ and not mapped: neither args in common.pt nor a run "
          "config give the layout to replay the buffers, and it cannot be read from the checkpoint: " +
          why);
      return;
    }
  }
  if (f_.tp <= 0 || f_.num_layers < 0) {
    ck_.info.problems.push_back(
        "distributed-optimizer states are shown under other/ and not mapped: neither args in common.pt nor a run "
        "config (Megatron-Bridge run_config.yaml, NeMo 2 context/model.yaml) give tensor_model_parallel_size and "
        "num_layers to replay the buffers");
    return;
  }
  std::set<int64_t> chains;
  for (const auto& [key, buf] : buffers_) chains.insert(std::get<0>(key));
  bool experts = false;
  for (const TensorRecord& t : ck_.tensors) {
    experts |= t.role == Role::kParam && t.fqn.find(".experts.") != std::string::npos;
  }
  if (!experts) {
    RunPart(*chains.begin(), false);
    return;
  }
  if (chains.size() < 2 || f_.ep <= 0 || f_.num_experts <= 0 || f_.num_experts % f_.ep != 0 || f_.dp % f_.ep != 0) {
    ck_.info.problems.push_back(
        "distributed-optimizer states are shown under other/ and not mapped: an MoE checkpoint needs a dense and an "
        "expert optimizer (chained_0., chained_1.) and args num_experts / expert_model_parallel_size that divide");
    return;
  }
  RunPart(*chains.begin(), false);
  RunPart(*chains.rbegin(), true);
}

void Mapper::RunPart(int64_t chain, bool experts) {
  chain_ = chain;
  experts_ = experts;
  const int64_t ep = experts ? f_.ep : 1;
  dp_ = f_.dp > 0 ? f_.dp / ep : -1;
  const int64_t local_experts = experts ? f_.num_experts / f_.ep : 0;
  PipelineShape shape;
  shape.num_layers = f_.num_layers;
  shape.pp = static_cast<int>(f_.pp);
  shape.vp = static_cast<int>(f_.vp);
  shape.first_stage_layers = f_.first_stage_layers;
  shape.last_stage_layers = f_.last_stage_layers;

  // The parameters of every chunk (p, v) of EP rank e, with their TP-local shapes.
  static const RE2 kExpert(R"(.*\.experts\.local_experts\.(\d{1,9})\..*)", RE2::Latin1);
  std::map<std::tuple<int, int, int>, std::vector<Member>> chunks;
  std::vector<std::string> unplaced;
  const bool shared = !experts && f_.tied && f_.pp > 1;
  for (uint32_t i = 0; i < ck_.tensors.size(); ++i) {
    const TensorRecord& t = ck_.tensors[i];
    if (t.role != Role::kParam || t.encoding != Encoding::kTensor) continue;
    int64_t g = -1;
    if (t.fqn.find(".experts.") != std::string::npos) {
      if (!experts) continue;
      if (!RE2::FullMatch(t.fqn, kExpert, &g) || g >= f_.num_experts) {
        unplaced.push_back(t.fqn);
        continue;
      }
    } else if (experts) {
      continue;
    }
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
    if (shared && t.fqn == "embedding.word_embeddings.weight") {
      // Tied with PP > 1: the last stage holds its own copy as output_layer.weight.
      m.shared = true;
      Member copy = m;
      copy.copy = true;
      chunks[{static_cast<int>(f_.pp) - 1, static_cast<int>(f_.vp) - 1, 0}].push_back(copy);
    }
    const int e = g >= 0 ? static_cast<int>(g / local_experts) : 0;
    chunks[{c->first, c->second, e}].push_back(std::move(m));
  }
  if (!unplaced.empty()) {
    ck_.info.problems.push_back(
        "distributed-optimizer states are shown under other/ and not mapped: ckptfs does not know "
        "the module order of '" +
        unplaced.front() + "'" + (unplaced.size() > 1 ? " and " + std::to_string(unplaced.size() - 1) + " more" : ""));
    return;
  }
  for (const auto& [key, buf] : buffers_) {
    const auto [c, mp, g] = key;
    if (c != chain) continue;
    const int t = static_cast<int>(mp % f_.tp), e = static_cast<int>(mp / f_.tp % ep),
              p = static_cast<int>(mp / f_.tp / ep), v = static_cast<int>(g);
    auto it = chunks.find({p, v, e});
    if (p >= f_.pp || it == chunks.end()) {
      ck_.info.Flag(Check::kGeometry, Severity::kError, "", "",
                    "distributed-optimizer buffer dp_group_idx_" + std::to_string(mp) + ".gbuf_idx_" +
                        std::to_string(g) + " belongs to no model chunk of TP " + std::to_string(f_.tp) + ", PP " +
                        std::to_string(f_.pp) + ", VP " + std::to_string(f_.vp) +
                        (experts ? ", EP " + std::to_string(ep) : "") + " (a buffer per dtype is not replayed)",
                    "");
      continue;
    }
    MapBuffer(mp, t, p, v, buf, it->second);
  }
  // A chunk whose buffer is missing: its parameters' states are unreadable.
  for (const auto& [c, members] : chunks) {
    for (const Member& m : members) {
      if (!m.copy) out_[m.rec];
    }
  }
  Emit();
  out_.clear();
}

}  // namespace

void MapBucketStates(const std::string& dir, const ModelFacts& facts, Checkpoint& ck) { Mapper(dir, facts, ck).Run(); }

}  // namespace ckptfs::formats::megatron
