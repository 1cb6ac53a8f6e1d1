// The dcp/ view: see dcp_view.h for what it is; here, how it is laid out.
//
// The .metadata pickle is what torch 2.15's FileSystemWriter pickles (read
// back by torch 2.0 and later): dataclasses as NEWOBJ + BUILD of their
// __dict__, torch.Size as REDUCE of a tuple, a TensorProperties as its
// 5-tuple __getstate__ (dtype, layout, requires_grad, memory format
// encoding, pin_memory), dtypes as globals of the torch module.
#include "views/dcp_view.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <variant>

#include "ckptfs/formats.h"
#include "common/temp_file.h"
#include "formats/pickle_writer.h"
#include "formats/state_dict_roles.h"
#include "formats/torch_save_writer.h"

namespace ckptfs::dcp_view {
namespace {

using formats::PickleWriter;

// Globals and strings through the pickle memo: a .metadata names the same
// classes, field names and keys once per chunk, and a loader unpickles it
// on every rank (torch's own writer memoizes likewise).
class Memo {
 public:
  explicit Memo(PickleWriter& w) : w_(w) {}
  void Global(std::string_view module, std::string_view name) {
    // Most names are literals: a slot keyed by where they live finds them
    // without building or hashing a key. The text is still compared (with
    // the memo's own copy), so an address reused for other text only misses.
    Slot& g = globals_seen_[SlotOf(module.data(), name.data())];
    if (g.a == module.data() && g.b == name.data() && g.key != nullptr &&
        g.key->size() == module.size() + 1 + name.size() && g.key->starts_with(module) && g.key->ends_with(name)) {
      w_.Get(g.id);
      return;
    }
    key_.assign(module).append("\n").append(name);
    const auto [key, id] = Emit(globals_, key_, [&] { w_.Global(module, name); });
    g = Slot{module.data(), name.data(), key, id};
  }
  // Returns its memo id, for Get.
  uint32_t Str(std::string_view v) {
    Slot& s = strs_seen_[SlotOf(v.data(), nullptr)];
    if (s.a == v.data() && s.key != nullptr && *s.key == v) {
      w_.Get(s.id);
      return s.id;
    }
    const auto [key, id] = Emit(strs_, v, [&] { w_.Str(v); });
    s = Slot{v.data(), nullptr, key, id};
    return id;
  }
  // A string no later Str asks for (a state dict key: later sections find
  // it by the returned id), written and memoized without a table entry.
  uint32_t Unique(std::string_view v) {
    w_.Str(v);
    const uint32_t id = next_++;
    w_.Put(id);
    return id;
  }
  // A string memoized before, by the id Str or Unique gave.
  void Get(uint32_t id) { w_.Get(id); }
  PickleWriter& w() { return w_; }

 private:
  // Found without making a string: a .metadata looks up millions.
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  using Ids = std::unordered_map<std::string, uint32_t, Hash, std::equal_to<>>;
  struct Slot {
    const char* a = nullptr;  // where the text was
    const char* b = nullptr;
    const std::string* key = nullptr;  // the memo's key (a map node's: stable)
    uint32_t id = 0;
  };
  static constexpr int kSlotBits = 6;
  static size_t SlotOf(const char* a, const char* b) {
    const uint64_t h = (reinterpret_cast<uintptr_t>(a) ^ reinterpret_cast<uintptr_t>(b) * 0xff51afd7ed558ccdull) *
                       0x9E3779B97F4A7C15ull;
    return static_cast<size_t>(h >> (64 - kSlotBits));
  }
  // `key`'s memo entry: a Get of the memoized value, or the value written
  // and memoized.
  template <typename Fn>
  std::pair<const std::string*, uint32_t> Emit(Ids& ids, std::string_view key, Fn write) {
    auto it = ids.find(key);
    if (it != ids.end()) {
      w_.Get(it->second);
      return {&it->first, it->second};
    }
    write();
    const uint32_t id = next_++;
    it = ids.emplace(std::string(key), id).first;
    w_.Put(id);
    return {&it->first, id};
  }
  PickleWriter& w_;
  Ids globals_, strs_;
  std::array<Slot, size_t{1} << kSlotBits> globals_seen_{}, strs_seen_{};
  uint32_t next_ = 0;
  std::string key_;  // Global's key, reused
};

// The chunk boxes of tensor `t` (of a padded vocabulary, its vocabulary's
// rows, as params/ serves it; with `stored`, its stored rows): the source's
// row blocks where its fragments (the first copy's) tile dim 0 with whole
// rows; else the whole tensor, in row blocks of at most kDcpMaxChunkBytes.
// `frags`: the tensor's fragments (null: unknown).
std::vector<Box> ChunksFrom(const std::vector<Fragment>* frags, const TensorRecord& t, bool stored) {
  const std::vector<int64_t> shape = stored ? t.shape : t.VocabShape();
  const size_t rank = shape.size();
  Box whole;
  whole.offsets.assign(rank, 0);
  whole.lengths = shape;
  const uint64_t numel = static_cast<uint64_t>(NumelOf(shape));
  if (rank == 0 || numel == 0) return {whole};
  if (frags != nullptr) {
    std::vector<Box> blocks;
    bool rows = true;
    for (const Fragment& f : *frags) {
      if (f.replica != 0) continue;
      if (f.offsets.size() != rank || f.lengths.size() != rank) {
        rows = false;
        break;
      }
      for (size_t d = 1; d < rank && rows; ++d) rows = f.offsets[d] == 0 && f.lengths[d] == shape[d];
      if (!rows) break;
      const int64_t end = std::min(f.offsets[0] + f.lengths[0], shape[0]);  // padding rows cut
      if (end <= f.offsets[0]) continue;
      Box b;
      b.offsets = f.offsets;
      b.lengths = f.lengths;
      b.lengths[0] = end - f.offsets[0];
      blocks.push_back(std::move(b));
    }
    if (rows && blocks.size() > 1) {
      std::sort(blocks.begin(), blocks.end(), [](const Box& a, const Box& b) { return a.offsets[0] < b.offsets[0]; });
      blocks.erase(
          std::unique(blocks.begin(), blocks.end(),
                      [](const Box& a, const Box& b) { return a.offsets == b.offsets && a.lengths == b.lengths; }),
          blocks.end());
      int64_t next = 0;
      for (const Box& b : blocks) {
        if (b.offsets[0] != next) {
          rows = false;
          break;
        }
        next += b.lengths[0];
      }
      if (rows && next == shape[0]) return blocks;
    }
  }
  const uint64_t row_bytes = numel / static_cast<uint64_t>(shape[0]) * DTypeSize(t.dtype);
  const uint64_t total = row_bytes * static_cast<uint64_t>(shape[0]);
  if (total <= kDcpMaxChunkBytes || shape[0] < 2 || row_bytes == 0) return {whole};
  const int64_t per = static_cast<int64_t>(std::max<uint64_t>(1, kDcpMaxChunkBytes / row_bytes));
  std::vector<Box> out;
  for (int64_t r = 0; r < shape[0]; r += per) {
    Box b = whole;
    b.offsets[0] = r;
    b.lengths[0] = std::min(per, shape[0] - r);
    out.push_back(std::move(b));
  }
  return out;
}

std::vector<Box> ChunksOf(const Index& index, TensorId id, const TensorRecord& t, bool stored = false) {
  auto frags = index.Fragments(id);
  return ChunksFrom(frags.ok() ? &*frags : nullptr, t, stored);
}

void WriteSize(Memo& m, const std::vector<int64_t>& dims) {
  PickleWriter& w = m.w();
  m.Global("torch", "Size");
  w.BeginTuple();
  w.BeginTuple();
  for (int64_t d : dims) w.Int(d);
  w.EndTuple();
  w.EndTuple();
  w.Reduce();
}

// An instance of dataclass `module.cls` with its __dict__ written by `fields`.
template <typename Fn>
void WriteDataclass(Memo& m, std::string_view module, std::string_view cls, Fn fields) {
  PickleWriter& w = m.w();
  m.Global(module, cls);
  w.BeginTuple();
  w.EndTuple();
  w.NewObj();
  w.BeginDict();
  fields();
  w.EndDict();
  w.Build();
}

constexpr std::string_view kMd = "torch.distributed.checkpoint.metadata";

void WriteTensorMetadata(Memo& m, const DcpEntry& e) {
  PickleWriter& w = m.w();
  WriteDataclass(m, kMd, "TensorStorageMetadata", [&] {
    m.Str("properties");
    m.Global(kMd, "TensorProperties");
    w.BeginTuple();
    w.EndTuple();
    w.NewObj();
    w.BeginTuple();  // __getstate__: (dtype, layout, requires_grad, memory format, pin_memory)
    m.Global("torch", DTypeName(e.dtype));
    m.Global("torch.serialization", "_get_layout");
    w.BeginTuple();
    m.Str("torch.strided");
    w.EndTuple();
    w.Reduce();
    w.Bool(false);
    m.Global(kMd, "_MEM_FORMAT_ENCODING");
    w.BeginTuple();
    w.Int(0);  // TORCH_CONTIGUOUS_FORMAT
    w.EndTuple();
    w.Reduce();
    w.Bool(false);
    w.EndTuple();
    w.Build();
    m.Str("size");
    WriteSize(m, e.size);
    m.Str("chunks");
    w.BeginList();
    for (const Box& c : e.chunks) {
      WriteDataclass(m, kMd, "ChunkStorageMetadata", [&] {
        m.Str("offsets");
        WriteSize(m, c.offsets);
        m.Str("sizes");
        WriteSize(m, c.lengths);
      });
    }
    w.EndList();
  });
}

struct Item {
  size_t entry = 0;
  int chunk = -1;  // -1: a bytes entry
  uint32_t file = 0;
  uint64_t offset = 0, length = 0;
};

std::string ReadmeHead() {
  return "dcp/: this checkpoint as a PyTorch Distributed Checkpoint (torch.distributed.checkpoint),\n"
         "the directory torch's FileSystemWriter writes. Load it at any world size and placement:\n\n"
         "    import torch.distributed.checkpoint as dcp\n"
         "    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict\n"
         "    model_sd, optim_sd = get_state_dict(model, optim)\n"
         "    sd = {\"model\": model_sd, \"optim\": optim_sd}\n"
         "    dcp.load(sd, checkpoint_id=\"<mount>/dcp\")\n"
         "    set_state_dict(model, optim, model_state_dict=sd[\"model\"], optim_state_dict=sd[\"optim\"])\n\n"
         "Keys: model.<fqn> for each parameter: the fp32 master copy where the checkpoint holds one,\n"
         "else the weight (params/<fqn>/info.json says which); optim.state.<fqn>.<state> for every\n"
         "other optimizer state (exp_avg, exp_avg_sq, step, ...), also offered as\n"
         "optimizer.state.<fqn>.<state> (Lightning Fabric, Accelerate; the same bytes, read once);\n"
         "the optimizer's param groups, where the source saved them, as optim.param_groups.<i>.<name>\n"
         "(and optimizer.param_groups.<i>.<name>); other entries under their own keys.\n"
         "meta.pt (torch.save of an empty dict) makes this directory one that Lightning Fabric's load\n"
         "takes: fabric.load(\"<mount>/dcp\", {\"model\": model, \"optimizer\": optimizer}).\n"
         "Each tensor's chunks are the source's row blocks where those tile it, else row blocks of\n"
         "at most 256 MiB. A vocabulary padded for tensor parallelism has its true rows, as under\n"
         "params/ (the padding rows are params/<fqn>/<state>.vocab_padding.npy). Nothing is\n"
         "converted ahead: every item is rendered from the source shards when it is read.\n\n";
}

// The README's counts and what is left out.
std::string ReadmeTail(const DcpPlan& plan, bool masters) {
  std::string s = std::to_string(plan.entries.size()) + " keys" +
                  (masters ? " (" + std::to_string(plan.from_master) + " parameters from fp32 masters)" : "") + ", " +
                  std::to_string(plan.chunks) + " chunks.\n";
  if (plan.left_out.empty()) {
    s += "Every tensor of the checkpoint is represented.\n";
  } else {
    s += "\nLeft out (dcp.load fails with a missing-key error for these):\n";
    for (const std::string& l : plan.left_out) s += "  " + l + "\n";
  }
  return s;
}

}  // namespace

namespace {

// "<i>.<hyperparameter>" of a source key <root>.param_groups.<i>.<h>, root an
// optimizer's (formats::IsOptimizerRoot) other than Lightning's second and
// later optimizers; empty for any other key.
std::string_view ParamGroupsRest(std::string_view key) {
  constexpr std::string_view kGroups = ".param_groups.";
  const size_t at = key.find(kGroups);
  if (at == std::string_view::npos || at + kGroups.size() >= key.size()) return {};
  const std::string_view root = key.substr(0, at);
  if (!formats::IsOptimizerRoot(root) || (root.rfind("optimizer_", 0) == 0 && root != "optimizer_0")) return {};
  return key.substr(at + kGroups.size());
}

}  // namespace

std::vector<std::pair<std::string, std::string>> FamilyEntries(const Index& index, std::vector<std::string>* left_out) {
  constexpr std::string_view kDcpExport = "@dcp/";
  std::vector<std::pair<std::string, std::string>> out;
  for (const ExportFile& x : index.exports()) {
    if (x.path.compare(0, kDcpExport.size(), kDcpExport) != 0) continue;
    std::string key = x.path.substr(kDcpExport.size());
    std::string bytes;
    bool literal = true;
    for (const ExportPart& p : x.parts) {
      literal = literal && p.kind == PartKind::kLiteral;
      bytes += p.literal;
    }
    if (!literal || key.empty()) {
      left_out->push_back(key + ": its bytes are not literal");
      continue;
    }
    out.emplace_back(std::move(key), std::move(bytes));
  }
  return out;
}

Result<DcpPlan> PlanDcp(const Index& index) {
  DcpPlan plan;
  const auto& ts = index.tensors();
  // The fp32 master of each parameter, where one is readable and has the
  // parameter's shape.
  std::unordered_map<std::string, uint32_t> params, masters;
  for (uint32_t i = 0; i < ts.size(); ++i) {
    const TensorRecord& t = ts[i];
    if (t.encoding != Encoding::kTensor || !t.error.empty()) continue;
    if (t.role == Role::kParam) params.emplace(t.fqn, i);
    if (t.role == Role::kOptimState && t.state == "fp32" && t.dtype == DType::kF32) masters.emplace(t.fqn, i);
  }
  // Every tensor's chunks from one scan of the index (a lookup per tensor
  // opened an iterator each); on a failure, per tensor as they are needed.
  std::vector<std::vector<Box>> chunks(ts.size());
  std::vector<bool> chunked(ts.size(), false);
  Status scan = index.ForEachFragments([&](TensorId id, std::vector<Fragment>& frags) {
    if (ts[id.v].encoding == Encoding::kTensor) {
      chunks[id.v] = ChunksFrom(&frags, ts[id.v], /*stored=*/false);
      chunked[id.v] = true;
    }
    return Status::Ok();
  });
  if (!scan.ok()) std::fill(chunked.begin(), chunked.end(), false);
  std::map<std::string, DcpEntry> entries;  // by key: the items' order
  std::set<std::string> groups_seen;
  auto add = [&](std::string key, std::vector<PathElem> path, uint32_t id) {
    const TensorRecord& t = ts[id];
    auto [it, fresh] = entries.try_emplace(key);
    if (!fresh) {
      plan.left_out.push_back(key + ": named by both '" + ts[it->second.tensor].key + "' and '" + t.key + "'");
      return;
    }
    it->second.key = key;
    it->second.path = std::move(path);
    it->second.tensor = id;
    if (t.encoding == Encoding::kTensor) {
      it->second.size = t.VocabShape();
      it->second.dtype = t.dtype;
      if (chunked[id]) {
        it->second.chunks = std::move(chunks[id]);
        chunked[id] = false;  // taken
      } else {
        it->second.chunks = ChunksOf(index, TensorId{id}, t);
      }
      plan.chunks += it->second.chunks.size();
    }
  };
  for (uint32_t i = 0; i < ts.size(); ++i) {
    const TensorRecord& t = ts[i];
    // Hidden records, and layer stacks whose layers are keys of their own
    // (each byte is offered once, as under params/).
    if (t.role == Role::kHidden || t.alias) continue;
    const std::string name = t.fqn.empty() ? t.key : t.fqn;
    if (!t.error.empty()) {
      plan.left_out.push_back(t.key + ": " + t.error);
      continue;
    }
    if (t.encoding == Encoding::kBytes && t.raw_bytes) {
      plan.left_out.push_back(t.key + ": not a torch.save payload (torch's loader would torch.load it); under other/");
      continue;
    }
    if (t.encoding == Encoding::kTensor && StorageClassName(t.dtype).empty()) {
      plan.left_out.push_back(t.key + ": torch.save has no storage for " + std::string(DTypeName(t.dtype)));
      continue;
    }
    if (t.role == Role::kParam || (t.role == Role::kOptimState && t.state == "fp32")) {
      // model.<fqn>: the fp32 master where there is one (of the weight's
      // shape, or with no weight beside it), else the weight.
      const auto m = masters.find(t.fqn);
      const auto p = params.find(t.fqn);
      uint32_t pick = UINT32_MAX;
      if (m != masters.end() && (p == params.end() || ts[p->second].shape == ts[m->second].shape)) {
        pick = m->second;
      } else if (p != params.end()) {
        pick = p->second;
      }
      if (pick == i) {
        if (t.role == Role::kOptimState) ++plan.from_master;
        add("model." + name, {std::string("model"), name}, i);
        continue;
      }
      if (t.role == Role::kParam) continue;  // its master stands for it
      // A master that is not the parameter's (another shape): an optimizer state like the others.
    }
    if (t.role == Role::kOptimState) {
      add("optim.state." + name + "." + t.state, {std::string("optim"), std::string("state"), name, t.state}, i);
      continue;
    }
    // The optimizer's param groups as torch's get_state_dict names them
    // (optim.param_groups.<i>.<hyperparameter>, ".params" the FQNs), from a
    // DCP source that saved them under optimizer / optim / optimizer_0
    // (Lightning's first optimizer); the same bytes.
    if (const std::string_view rest = ParamGroupsRest(t.key); !rest.empty() && t.encoding == Encoding::kBytes) {
      const std::string key = "optim.param_groups." + std::string(rest);
      if (!groups_seen.insert(key).second) continue;  // optimizer. and optim. both: the first
      add(key, {key}, i);
      continue;
    }
    // Other entries keep their source key, flattened as it is: its nesting
    // cannot be told from the dots (a DCP source's "rng_state/shard_0.0_1").
    add(t.key, {t.key}, i);
  }

  // Bytes entries a family reader made for dcp/ (internal exports
  // "@dcp/<key>", literal bytes: DeepSpeed's param groups), where the
  // checkpoint has no entry of that key itself.
  for (auto& [key, bytes] : FamilyEntries(index, &plan.left_out)) {
    auto [it, fresh] = entries.try_emplace(key);
    if (!fresh) continue;  // the checkpoint's own entry
    it->second.key = key;
    it->second.path = {key};
    it->second.tensor = DcpEntry::kLiteral;
    it->second.literal = std::move(bytes);
  }

  // optimizer.state.<fqn>.<state> beside optim.state.<fqn>.<state> (and the
  // same for param_groups), where no entry of the checkpoint has that key
  // already.
  for (auto& [key, e] : entries) {
    constexpr std::string_view kOptim = "optim.";
    if (key.compare(0, kOptim.size(), kOptim) != 0) continue;
    std::string alias = "optimizer." + key.substr(kOptim.size());
    if (entries.count(alias)) continue;
    e.alias_path = e.path;
    if (e.alias_path.size() == 1) {
      e.alias_path[0] = alias;  // a flattened key (param_groups)
    } else {
      e.alias_path[0] = std::string("optimizer");
    }
    e.alias = std::move(alias);
  }
  plan.entries.reserve(entries.size());
  for (auto& [key, e] : entries) plan.entries.push_back(std::move(e));
  return plan;
}

namespace {

// The files of a planned DCP: .metadata, the data files, README.txt
// (`readme_head` and the plan's counts).
Result<DcpTree> FilesOfPlan(const Index& index, const DcpPlan& plan, const std::string& readme_head, bool masters,
                            uint64_t spool_piece) {
  DcpTree tree;
  tree.left_out = plan.left_out;
  tree.chunks = plan.chunks;
  const auto& ts = index.tensors();

  // Items, packed into data files of about kDcpFileBytes: one kArchive
  // segment per chunk (its archive is laid out when read), a bytes entry's
  // own bytes.
  auto file_name = [](uint32_t k) { return "__" + std::to_string(k) + "_0.distcp"; };
  std::vector<FileLayout> layouts(1);
  std::vector<Item> items;
  std::vector<const DcpEntry*> order;
  for (const DcpEntry& e : plan.entries) order.push_back(&e);
  auto place = [&](size_t ei, int chunk, Segment seg) {
    if (layouts.back().size > 0 && layouts.back().size + seg.size > kDcpFileBytes) layouts.emplace_back();
    const uint32_t k = static_cast<uint32_t>(layouts.size() - 1);
    items.push_back(Item{ei, chunk, k, layouts.back().size, seg.size});
    layouts.back().Add(std::move(seg));
  };
  std::map<std::pair<DType, std::vector<int64_t>>, uint64_t> archive_size;
  for (size_t ei = 0; ei < order.size(); ++ei) {
    const DcpEntry& e = *order[ei];
    if (e.tensor == DcpEntry::kLiteral) {
      place(ei, -1, LiteralSegment(e.literal));
      continue;
    }
    const TensorRecord& et = ts[e.tensor];
    Segment seg;
    seg.tensor = TensorId{e.tensor};
    if (et.encoding == Encoding::kBytes) {
      seg.kind = SegmentKind::kTensor;
      seg.out_dtype = DType::kU8;
      seg.size = et.byte_size;
      place(ei, -1, std::move(seg));
      continue;
    }
    seg.kind = SegmentKind::kArchive;
    seg.out_dtype = e.dtype;
    const auto lead = static_cast<std::ptrdiff_t>(e.stacked_axes);
    for (size_t c = 0; c < e.chunks.size(); ++c) {
      // The chunk as a box of its tensor (a stack's: without the stack axes).
      const uint32_t id = lead > 0 ? e.chunk_tensors[c] : e.tensor;
      Box b = e.chunks[c];
      b.offsets.erase(b.offsets.begin(), b.offsets.begin() + lead);
      b.lengths.erase(b.lengths.begin(), b.lengths.begin() + lead);
      const bool whole = b.lengths == ts[id].shape;
      // An archive's size follows from its dtype and shape alone (the pickle
      // and the ZIP headers; not the values): laid out once per kind.
      auto [size, fresh] = archive_size.try_emplace({e.dtype, e.chunks[c].lengths}, 0);
      if (fresh) {
        ASSIGN_OR_RETURN(auto parts,
                         topo_files::TorchSaveTensorParts(index, id, e.dtype, whole ? nullptr : &b, e.stacked_axes));
        size->second = formats::PartsSize(parts);
      }
      Segment item = seg;
      item.tensor = TensorId{id};
      item.size = size->second;
      item.lead_ones = e.stacked_axes;
      if (!whole) item.boxes = {b};
      place(ei, static_cast<int>(c), std::move(item));
    }
  }

  // .metadata: a checkpoint of a million chunks makes hundreds of MB of it,
  // so past kDcpSpoolPiece it goes to an unlinked file in $TMPDIR in pieces
  // as it is made (the daemon holds one piece); a small one stays in memory.
  PickleWriter w;
  Memo m(w);
  auto spooled = std::make_shared<SpooledBytes>();
  Status spool_st;
  auto drain = [&] {
    if (!spool_st.ok() || w.size() < spool_piece) return;
    if (spooled->fd < 0) {
      spooled->fd = OpenUnlinkedTempFile("ckptfs-dcp-metadata");
      if (spooled->fd < 0) {
        spool_st = ErrnoStatus("create", "a temporary file for dcp/.metadata in " + TempDir(), errno);
        return;
      }
    }
    const std::string piece = w.Drain();
    spool_st = PwriteAll(spooled->fd, spooled->size, piece.data(), piece.size(), "dcp/.metadata in " + TempDir());
    spooled->size += piece.size();
  };
  WriteDataclass(m, kMd, "Metadata", [&] {
    m.Str("state_dict_metadata");
    w.BeginDict();
    // Each entry's key and alias are written here first, and found by
    // their memo ids later (storage_data names them once per chunk).
    std::vector<std::array<uint32_t, 2>> key_ids(order.size());
    for (size_t i = 0; i < order.size(); ++i) {
      const DcpEntry* e = order[i];
      drain();
      for (int a = 0; a < 2; ++a) {
        const std::string* k = a == 0 ? &e->key : &e->alias;
        if (k->empty()) continue;
        key_ids[i][a] = m.Unique(*k);
        if (e->tensor == DcpEntry::kLiteral || ts[e->tensor].encoding == Encoding::kBytes) {
          WriteDataclass(m, kMd, "BytesStorageMetadata", [] {});
        } else {
          WriteTensorMetadata(m, *e);
        }
      }
    }
    w.EndDict();
    m.Str("planner_data");
    w.BeginDict();
    for (size_t i = 0; i < order.size(); ++i) {
      const DcpEntry* e = order[i];
      drain();
      for (int a = 0; a < 2; ++a) {
        if ((a == 0 ? e->key : e->alias).empty()) continue;
        const std::vector<PathElem>* path = a == 0 ? &e->path : &e->alias_path;
        m.Get(key_ids[i][a]);
        w.BeginTuple();
        for (const PathElem& p : *path) {
          if (std::holds_alternative<int64_t>(p)) {
            w.Int(std::get<int64_t>(p));
          } else {
            m.Str(std::get<std::string>(p));
          }
        }
        w.EndTuple();
      }
    }
    w.EndDict();
    m.Str("storage_data");
    w.BeginDict();
    std::vector<uint32_t> file_ids(layouts.size(), UINT32_MAX);  // each data file's name
    for (const Item& it : items) {
      drain();
      const DcpEntry& e = *order[it.entry];
      for (int a = 0; a < 2; ++a) {
        if ((a == 0 ? e.key : e.alias).empty()) continue;
        WriteDataclass(m, kMd, "MetadataIndex", [&] {
          m.Str("fqn");
          m.Get(key_ids[it.entry][a]);
          m.Str("offset");
          if (it.chunk < 0) {
            w.None();
          } else {
            WriteSize(m, e.chunks[static_cast<size_t>(it.chunk)].offsets);
          }
          m.Str("index");
          if (it.chunk < 0) {
            w.None();
          } else {
            w.Int(it.chunk);
          }
        });
        WriteDataclass(m, "torch.distributed.checkpoint.filesystem", "_StorageInfo", [&] {
          m.Str("relative_path");
          if (file_ids[it.file] == UINT32_MAX) {
            file_ids[it.file] = m.Str(file_name(it.file));
          } else {
            m.Get(file_ids[it.file]);
          }
          m.Str("offset");
          w.Int(static_cast<int64_t>(it.offset));
          m.Str("length");
          w.Int(static_cast<int64_t>(it.length));
        });
      }
    }
    w.EndDict();
    m.Str("storage_meta");
    w.None();
    m.Str("version");
    m.Str("1.0.0");
  });
  FileLayout md;
  if (spooled->fd < 0) {
    md.Add(LiteralSegment(w.Finish()));
  } else {
    std::string rest = w.Finish();
    if (spool_st.ok()) {
      spool_st = PwriteAll(spooled->fd, spooled->size, rest.data(), rest.size(), "dcp/.metadata in " + TempDir());
    }
    RETURN_IF_ERROR(spool_st);
    spooled->size += rest.size();
    Segment seg;
    seg.kind = SegmentKind::kSpooled;
    seg.size = spooled->size;
    seg.set_spooled(std::move(spooled));
    md.Add(std::move(seg));
  }
  tree.files.emplace_back(".metadata", std::move(md));
  for (uint32_t k = 0; k < layouts.size(); ++k) {
    if (layouts[k].segments.empty()) continue;
    tree.files.emplace_back(file_name(k), std::move(layouts[k]));
  }
  FileLayout readme;
  readme.Add(LiteralSegment(readme_head + ReadmeTail(plan, masters)));
  tree.files.emplace_back("README.txt", std::move(readme));
  return tree;
}

}  // namespace

Result<DcpPlan> PlanProfile(const Index& index, const DcpProfile& profile) {
  DcpPlan plan;
  const auto& ts = index.tensors();
  std::map<std::string, std::vector<const DcpProfileTensor*>> by_key;
  for (const DcpProfileTensor& pt : profile.tensors) {
    if (pt.tensor >= ts.size()) return Internal("profile " + profile.dir + ": no tensor " + std::to_string(pt.tensor));
    by_key[pt.key].push_back(&pt);
  }
  std::map<std::string, DcpEntry> entries;
  for (auto& [key, members] : by_key) {
    const TensorRecord& first = ts[members[0]->tensor];
    std::string why;
    for (const DcpProfileTensor* pt : members) {
      const TensorRecord& t = ts[pt->tensor];
      if (!t.error.empty()) why = "'" + t.key + "': " + t.error;
      if (t.encoding != Encoding::kTensor || StorageClassName(t.dtype).empty()) {
        why = "'" + t.key + "' is not a tensor torch.save can hold";
      }
      if (t.dtype != first.dtype || t.shape != first.shape) why = "its tensors differ in dtype or shape";
      if (pt->stack_size != members[0]->stack_size || pt->stack_index.size() != pt->stack_size.size()) {
        why = "named both as a stack and as a tensor, or in stacks of different sizes";
      }
    }
    const std::vector<int64_t>& axes = members[0]->stack_size;
    const bool stacked = !axes.empty();
    if (why.empty() && stacked) {
      // Every entry of the stack exactly once (a hole would read as
      // whatever the loader's buffer held).
      std::sort(members.begin(), members.end(),
                [](const DcpProfileTensor* a, const DcpProfileTensor* b) { return a->stack_index < b->stack_index; });
      std::vector<int64_t> want(axes.size(), 0);
      auto name = [&](const std::vector<int64_t>& at) {
        std::string n = axes.size() == 1 ? "layer " : "entry (";
        for (size_t d = 0; d < at.size(); ++d) n += (d ? ", " : "") + std::to_string(at[d]);
        return n + (axes.size() == 1 ? "" : ")");
      };
      auto total = [&] {
        std::string n;
        for (size_t d = 0; d < axes.size(); ++d) n += (d ? " x " : "") + std::to_string(axes[d]);
        return n;
      };
      bool done = false;  // every index seen
      for (const DcpProfileTensor* m : members) {
        const std::vector<int64_t>& at = m->stack_index;
        bool inside = true;
        for (size_t d = 0; d < axes.size(); ++d) inside = inside && at[d] >= 0 && at[d] < axes[d];
        if (!inside || done) {
          why = name(at) + " is past " + total();
        } else if (at < want) {
          why = name(at) + " appears twice";
        } else if (at != want) {
          why = name(want) + " of " + total() + " is missing";
        }
        if (!why.empty()) break;
        for (size_t d = axes.size(); d-- > 0;) {  // the next index, the last axis fastest
          if (++want[d] < axes[d]) break;
          want[d] = 0;
          if (d == 0) done = true;
        }
      }
      if (why.empty() && !done) why = name(want) + " of " + total() + " is missing";
    } else if (why.empty() && members.size() > 1) {
      why = "named by both '" + first.key + "' and '" + ts[members[1]->tensor].key + "'";
    }
    if (!why.empty()) {
      plan.left_out.push_back(key + ": " + why);
      continue;
    }
    DcpEntry& e = entries[key];
    e.key = key;
    e.path = {key};
    e.tensor = members[0]->tensor;
    e.dtype = first.dtype;
    e.size = first.shape;
    if (!stacked) {
      e.chunks = ChunksOf(index, TensorId{e.tensor}, first, /*stored=*/true);
    } else {
      e.size.insert(e.size.begin(), axes.begin(), axes.end());
      e.stacked_axes = static_cast<uint8_t>(axes.size());
      for (const DcpProfileTensor* pt : members) {
        for (Box b : ChunksOf(index, TensorId{pt->tensor}, ts[pt->tensor], /*stored=*/true)) {
          b.offsets.insert(b.offsets.begin(), pt->stack_index.begin(), pt->stack_index.end());
          b.lengths.insert(b.lengths.begin(), axes.size(), 1);
          e.chunks.push_back(std::move(b));
          e.chunk_tensors.push_back(pt->tensor);
        }
      }
    }
    plan.chunks += e.chunks.size();
  }
  for (const DcpProfileObject& o : profile.objects) {
    auto [it, fresh] = entries.try_emplace(o.key);
    if (!fresh) {
      plan.left_out.push_back(o.key + ": named by a tensor and an object");
      continue;
    }
    it->second.key = o.key;
    it->second.path = {o.key};
    it->second.tensor = DcpEntry::kLiteral;
    it->second.literal = o.bytes;
  }
  plan.entries.reserve(entries.size());
  for (auto& [key, e] : entries) plan.entries.push_back(std::move(e));
  return plan;
}

Result<DcpTree> DcpFiles(const Index& index, uint64_t spool_piece) {
  ASSIGN_OR_RETURN(DcpPlan plan, PlanDcp(index));
  ASSIGN_OR_RETURN(DcpTree tree, FilesOfPlan(index, plan, ReadmeHead(), true, spool_piece));
  // Lightning Fabric's sharded checkpoint is a DCP with meta.pt beside it
  // (torch.save of the state that is not a module or an optimizer), and
  // its load takes a directory for one only with that file: an empty dict,
  // since no source records a Fabric user's own entries.
  PickleWriter w;
  w.BeginDict();
  w.EndDict();
  FileLayout l;
  l.Add(LiteralSegment(formats::TorchSaveBytes("meta", w.Finish())));
  tree.files.emplace_back("meta.pt", std::move(l));
  return tree;
}

Result<DcpTree> ProfileFiles(const Index& index, const DcpProfile& profile, uint64_t spool_piece) {
  ASSIGN_OR_RETURN(DcpPlan plan, PlanProfile(index, profile));
  return FilesOfPlan(index, plan, profile.readme, false, spool_piece);
}

}  // namespace ckptfs::dcp_view
