#include "views/topo_files.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "ckptfs/formats.h"
#include "common/json_text.h"
#include "formats/pickle_writer.h"
#include "formats/torch_save_writer.h"
#include "views/hf_export.h"

namespace ckptfs::topo_files {
namespace {

using json = nlohmann::ordered_json;

// Box `b` of tensor `id` as `out`; whole-tensor boxes read without one.
Segment BoxSeg(const TensorRecord& t, TensorId id, Box b, DType out) {
  Segment seg;
  seg.kind = SegmentKind::kTensor;
  seg.tensor = id;
  seg.out_dtype = out;
  seg.size = static_cast<uint64_t>(NumelOf(b.lengths)) * DTypeSize(out);
  if (b.lengths != t.shape) seg.boxes.push_back(std::move(b));
  return seg;
}

json IntsJson(const std::vector<int64_t>& v) {
  json a = json::array();
  for (int64_t x : v) a.push_back(x);
  return a;
}

// A safetensors file's first segment: u64 LE header length, then the JSON
// header padded with spaces to a multiple of 8 (the official writer's
// alignment).
Segment SafetensorsHeader(std::string h) {
  while (h.size() % 8 != 0) h.push_back(' ');
  std::string bytes(8, '\0');
  StoreLE<uint64_t>(bytes.data(), h.size());
  bytes += h;
  return LiteralSegment(std::move(bytes));
}

// A safetensors file of header `h` and data `body`.
FileLayout SafetensorsFile(std::string h, std::vector<Segment> body) {
  body.insert(body.begin(), SafetensorsHeader(std::move(h)));
  return FileLayout::Of(std::move(body));
}

std::string RankFile(const TopoPlan& p, const RankPlan& r) {
  return "tp" + std::to_string(r.tp) + "-pp" + std::to_string(r.pp) +
         (p.topo.ep > 0 ? "-ep" + std::to_string(r.ep) : "");
}

// The flat range [a, b) of a rank tensor's local C order (its pieces
// concatenated, then its zero tail) as global boxes; returns how many zero
// elements follow them.
uint64_t FlatRangeBoxes(const RankTensor& rt, uint64_t a, uint64_t b, std::vector<Box>& out) {
  uint64_t c = 0;
  for (const Box& p : rt.pieces) {
    const uint64_t n = static_cast<uint64_t>(NumelOf(p.lengths));
    const uint64_t lo = std::max(a, c), hi = std::min(b, c + n);
    if (lo < hi) {
      for (Box x : DecomposeRange(p.lengths, lo - c, hi - c)) {
        for (size_t d = 0; d < x.offsets.size(); ++d) x.offsets[d] += p.offsets[d];
        out.push_back(std::move(x));
      }
    }
    c += n;
  }
  return b > std::max(a, c) ? b - std::max(a, c) : 0;
}

// ZeRO-style DP partitions of rank (tp, pp): per optimizer state, the flat
// concatenation of that state over the rank's parameters, padded with zeros
// to a multiple of 2*D elements (DeepSpeed's ZeRO-1/2 alignment) and cut into
// D equal parts.
Status AddDpFiles(const Index& index, const TopoPlan& plan, const RankPlan& r, json& dp_json,
                  std::vector<NamedLayout>& out) {
  const int D = plan.topo.dp;
  std::map<std::string, std::vector<const RankTensor*>> by_state;
  std::vector<std::string> order;
  for (const RankTensor& rt : r.tensors) {
    const std::string& st = index.tensors()[rt.id.v].state;
    if (!by_state.count(st)) order.push_back(st);
    by_state[st].push_back(&rt);
  }
  struct State {
    std::string name;
    DType dtype;
    std::vector<const RankTensor*> ts;
    uint64_t numel = 0, padded = 0;
  };
  std::vector<State> states;
  for (const std::string& st : order) {
    State s{st, DType::kInvalid, by_state[st], 0, 0};
    bool mixed = false;
    for (const RankTensor* rt : s.ts) {
      const DType d = index.tensors()[rt->id.v].dtype;
      if (s.dtype == DType::kInvalid) s.dtype = d;
      mixed |= d != s.dtype;
      s.numel += static_cast<uint64_t>(NumelOf(rt->shape));
    }
    if (mixed) {
      bool widen = true;
      for (const RankTensor* rt : s.ts) {
        const DType d = index.tensors()[rt->id.v].dtype;
        widen &= d == DType::kF32 || WidensToF32(d);
      }
      if (!widen) {
        return Invalid("topo/" + plan.topo.Name() + ": state '" + st + "' mixes dtypes that do not widen to float32");
      }
      s.dtype = DType::kF32;
    }
    const uint64_t align = 2 * static_cast<uint64_t>(D);
    s.padded = (s.numel + align - 1) / align * align;
    states.push_back(std::move(s));
  }
  for (int d = 0; d < D; ++d) {
    std::vector<Segment> body;
    json header = json::object();
    header["__metadata__"] = {{"format", "pt"},
                              {"ckptfs_topology", plan.topo.Name()},
                              {"tp_rank", std::to_string(r.tp)},
                              {"pp_rank", std::to_string(r.pp)},
                              {"dp_rank", std::to_string(d)}};
    json parts = json::object();
    uint64_t off = 0;
    for (const State& s : states) {
      const uint64_t part = s.padded / static_cast<uint64_t>(D), p0 = part * d, p1 = p0 + part;
      const uint64_t esz = DTypeSize(s.dtype);
      header[s.name] = {{"dtype", std::string(SafetensorsDType(s.dtype))},
                        {"shape", {part}},
                        {"data_offsets", {off, off + part * esz}}};
      off += part * esz;
      json frags = json::array();
      uint64_t c = 0;
      for (const RankTensor* rt : s.ts) {
        const uint64_t n = static_cast<uint64_t>(NumelOf(rt->shape));
        const uint64_t lo = std::max(p0, c), hi = std::min(p1, c + n);
        if (lo < hi) {
          std::vector<Box> boxes;
          const uint64_t zeros = FlatRangeBoxes(*rt, lo - c, hi - c, boxes);
          const TensorRecord& t = index.tensors()[rt->id.v];
          for (const Box& b : boxes) body.push_back(BoxSeg(t, rt->id, b, s.dtype));
          if (zeros > 0) body.push_back(LiteralSegment(std::string(zeros * esz, '\0')));
          frags.push_back(
              {{"name", rt->name}, {"local_flat_start", lo - c}, {"numel", hi - lo}, {"partition_offset", lo - p0}});
        }
        c += n;
      }
      if (p1 > std::max(p0, s.numel))
        body.push_back(LiteralSegment(std::string((p1 - std::max(p0, s.numel)) * esz, '\0')));
      parts[s.name] = {{"dtype", std::string(DTypeName(s.dtype))},
                       {"numel", part},
                       {"group_numel", s.numel},
                       {"group_padded", s.padded},
                       {"fragments", frags}};
    }
    FileLayout l = SafetensorsFile(JsonText(header), std::move(body));
    const std::string file = RankFile(plan, r) + "-dp" + std::to_string(d) + ".safetensors";
    dp_json.push_back({{"file", file}, {"tp", r.tp}, {"pp", r.pp}, {"dp", d}, {"partitions", parts}});
    out.emplace_back(file, std::move(l));
  }
  return Status::Ok();
}

}  // namespace

Result<std::vector<ExportPart>> TorchSaveTensorParts(const Index& index, uint32_t id, DType out, const Box* box,
                                                     int lead_ones) {
  if (id >= index.tensors().size()) return Internal("no tensor " + std::to_string(id));
  const TensorRecord& t = index.tensors()[id];
  std::vector<int64_t> shape(static_cast<size_t>(std::max(lead_ones, 0)), 1);
  const std::vector<int64_t>& own = box != nullptr ? box->lengths : t.shape;
  shape.insert(shape.end(), own.begin(), own.end());
  const uint64_t numel = static_cast<uint64_t>(NumelOf(shape));
  formats::PickleWriter w;
  RETURN_IF_ERROR(w.Tensor("0", out, numel, 0, shape, ContiguousStrides(shape)));
  const bool whole = box == nullptr || box->lengths == t.shape;
  return formats::TorchSaveParts(
      "archive", w.Finish(),
      {formats::ArchiveStorage{id, out, numel * DTypeSize(out), whole ? std::vector<Box>{} : std::vector<Box>{*box}}});
}

Result<FileLayout> LayoutOfParts(const Index& index, const std::string& path, const std::vector<ExportPart>& parts) {
  FileLayout l;
  for (const ExportPart& p : parts) {
    Segment seg;
    switch (p.kind) {
      case PartKind::kLiteral:
        seg = LiteralSegment(p.literal);
        break;
      case PartKind::kTensor: {
        const TensorRecord& t = index.tensors()[p.tensor];
        seg.kind = SegmentKind::kTensor;
        seg.tensor = TensorId{p.tensor};
        seg.out_dtype = p.out_dtype;
        seg.size = t.encoding == Encoding::kBytes ? t.byte_size : t.Numel() * DTypeSize(p.out_dtype);
        if (p.boxes.size() > 1)
          return Invalid("cannot build the view: " + path + " has a tensor part of several boxes");
        if (!p.boxes.empty()) {
          seg.boxes = p.boxes;
          seg.size = static_cast<uint64_t>(NumelOf(p.boxes[0].lengths)) * DTypeSize(p.out_dtype);
        }
        break;
      }
      case PartKind::kCrc32:
        seg.kind = SegmentKind::kCrc32;
        seg.tensor = TensorId{p.tensor};
        seg.out_dtype = p.out_dtype;
        seg.boxes = p.boxes;
        seg.size = 4;
        break;
    }
    if (seg.size != p.size) {
      return Invalid("cannot build the view: " + path + " has a part of " + std::to_string(p.size) +
                     " bytes whose content is " + std::to_string(seg.size));
    }
    l.Add(std::move(seg));
  }
  return l;
}

Result<FileLayout> Safetensors(const Index& index, std::vector<RankTensor>& tensors,
                               const std::vector<std::pair<std::string, std::string>>& metadata) {
  // The header is written as text, entry by entry, in the bytes nlohmann's
  // compact dump gives: an ordered_json tree of a 100k-tensor model's entries
  // took 1.7 s and ~100 MB to build at mount. The segments are made once,
  // in place (slot 0 waits for the header), and take the pieces' boxes
  // rather than copies: hf/ of that model keeps 190k of them.
  json meta = json::object();
  for (const auto& [k, v] : metadata) meta[k] = v;
  std::string h = "{\"__metadata__\":" + JsonText(meta);
  std::unordered_set<std::string_view> names = {"__metadata__"};
  names.reserve(tensors.size() + 1);
  size_t pieces = 1;
  for (const RankTensor& rt : tensors) pieces += rt.transposed ? 1 : rt.pieces.size() + (rt.zero_tail > 0 ? 1 : 0);
  std::vector<Segment> body;
  body.reserve(pieces);
  body.emplace_back();
  h.reserve(h.size() + tensors.size() * 96);
  uint64_t off = 0;
  for (RankTensor& rt : tensors) {
    const TensorRecord& t = index.tensors()[rt.id.v];
    const DType out = rt.out != DType::kInvalid ? rt.out : t.dtype;
    const std::string_view dt = SafetensorsDType(out);
    if (dt.empty())
      return Unsupported("'" + t.key + "' is " + std::string(DTypeName(out)) + ", which safetensors has no dtype for");
    const uint64_t n = static_cast<uint64_t>(NumelOf(rt.shape)) * DTypeSize(out);
    if (!names.insert(rt.name).second) return Invalid("two tensors are both named '" + rt.name + "'");
    h += ',';
    h += JsonEscape(rt.name);
    h += ":{\"dtype\":\"";
    h += dt;
    h += "\",\"shape\":";
    AppendJsonInts(h, rt.shape);
    h += ",\"data_offsets\":[" + std::to_string(off) + "," + std::to_string(off + n) + "]}";
    off += n;
    const bool affine = rt.scale != 1.0 || rt.add != 0.0;
    if (rt.transposed) {
      Segment seg;
      seg.kind = SegmentKind::kTensor;
      seg.tensor = rt.id;
      seg.out_dtype = out;
      seg.size = n;
      seg.transposed = true;
      seg.boxes = std::move(rt.pieces);
      seg.set_render({rt.how, rt.scale, rt.add});
      body.push_back(std::move(seg));
      continue;
    }
    for (Box& b : rt.pieces) {
      body.push_back(BoxSeg(t, rt.id, std::move(b), out));
      if (affine) body.back().set_render({Transpose{}, rt.scale, rt.add});
    }
    if (rt.zero_tail > 0) body.push_back(LiteralSegment(std::string(rt.zero_tail * DTypeSize(out), '\0')));
  }
  h += '}';
  body[0] = SafetensorsHeader(std::move(h));
  return FileLayout::Of(std::move(body));
}

Result<std::vector<NamedLayout>> TopoFiles(const Index& index, const TopoPlan& plan) {
  std::vector<NamedLayout> out;
  const std::string name = plan.topo.Name();
  json lj;
  lj["topology"] = name;
  lj["source"] = index.src_dir();
  lj["source_topology"] = index.info().topology.empty() ? json(nullptr) : json(index.info().topology);
  lj["tp"] = plan.topo.tp;
  lj["pp"] = plan.topo.pp;
  if (plan.topo.dp > 0) lj["dp"] = plan.topo.dp;
  if (plan.topo.ep > 0) {
    lj["ep"] = plan.topo.ep;
    lj["num_experts"] = plan.num_experts;
  }
  lj["num_layers"] = plan.num_layers;
  json stages = json::array();
  for (size_t p = 0; p < plan.stage_layers.size(); ++p) {
    stages.push_back({{"pp", p}, {"layers", {plan.stage_layers[p].first, plan.stage_layers[p].second}}});
  }
  lj["stages"] = stages;
  json ranks = json::array();
  json dp_json = json::array();
  for (const RankPlan& r : plan.ranks) {
    const std::string file = RankFile(plan, r) + ".safetensors";
    std::vector<std::pair<std::string, std::string>> meta = {{"format", "pt"},
                                                             {"ckptfs_topology", name},
                                                             {"tp_rank", std::to_string(r.tp)},
                                                             {"pp_rank", std::to_string(r.pp)},
                                                             {"tp_size", std::to_string(plan.topo.tp)},
                                                             {"pp_size", std::to_string(plan.topo.pp)}};
    if (plan.topo.ep > 0) {
      meta.emplace_back("ep_rank", std::to_string(r.ep));
      meta.emplace_back("ep_size", std::to_string(plan.topo.ep));
    }
    std::vector<RankTensor> tensors = r.tensors;  // the plan's own are listed below
    auto l = Safetensors(index, tensors, meta);
    if (!l.ok()) return l.status().Annotate("topo/" + name + "/" + file);
    out.emplace_back(file, std::move(*l));
    json ts = json::array();
    for (const RankTensor& rt : r.tensors) {
      const TensorRecord& t = index.tensors()[rt.id.v];
      json slices = json::array();
      for (const Box& b : rt.pieces)
        slices.push_back({{"offsets", IntsJson(b.offsets)}, {"lengths", IntsJson(b.lengths)}});
      ts.push_back({{"name", rt.name},
                    {"fqn", t.fqn},
                    {"state", t.state},
                    {"dtype", std::string(DTypeName(t.dtype))},
                    {"shape", IntsJson(rt.shape)},
                    {"global_shape", IntsJson(PlacedShape(t))},
                    {"rule", rt.rule},
                    {"slices", slices},
                    {"zero_padding_elements", rt.zero_tail}});
    }
    json rj = {{"file", file}, {"tp", r.tp}, {"pp", r.pp}};
    if (plan.topo.ep > 0) rj["ep"] = r.ep;
    rj["tensors"] = ts;
    ranks.push_back(std::move(rj));
    if (plan.topo.dp > 0) RETURN_IF_ERROR(AddDpFiles(index, plan, r, dp_json, out));
  }
  lj["ranks"] = ranks;
  if (plan.topo.dp > 0) lj["dp_partitions"] = dp_json;

  // The family's native files at these degrees (formats.h FamilyReader::native_files).
  if (const FamilyReader* reader = ReaderFor(index.info().family);
      reader != nullptr && reader->native_files != nullptr) {
    ASSIGN_OR_RETURN(NativeFiles native,
                     reader->native_files(NativeFilesInput{index.info(), index.tensors(), index.exports(), plan}));
    json listed = json::array();
    for (const ExportFile& f : native.rank_files) listed.push_back(f.path);
    if (!reader->native_files_key.empty()) lj[std::string(reader->native_files_key)] = listed;
    for (std::vector<ExportFile>* files : {&native.rank_files, &native.others}) {
      for (ExportFile& f : *files) {
        ASSIGN_OR_RETURN(FileLayout l, LayoutOfParts(index, f.path, f.parts));
        out.emplace_back(std::move(f.path), std::move(l));
      }
    }
  }
  FileLayout l;
  l.Add(LiteralSegment(JsonText(lj) + "\n"));  // compact: one entry per rank and tensor
  out.emplace_back("layout.json", std::move(l));
  return out;
}

Result<std::vector<NamedLayout>> HfFiles(const Index& index, const TopoOptions& opts) {
  ASSIGN_OR_RETURN(hf::HfPlan plan, hf::PlanHf(index, opts));
  // Where each shard starts in plan.tensors (at most hf_shard_bytes each,
  // unless one tensor is larger), then the shards, each made at its size.
  std::vector<size_t> first;
  uint64_t cur = 0, total = 0;
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const hf::HfTensor& h = plan.tensors[i];
    const uint64_t bytes = static_cast<uint64_t>(NumelOf(h.shape)) * DTypeSize(h.out);
    if (first.empty() || (cur > 0 && cur + bytes > opts.hf_shard_bytes)) {
      first.push_back(i);
      cur = 0;
    }
    cur += bytes;
    total += bytes;
  }
  first.push_back(plan.tensors.size());
  std::vector<std::vector<RankTensor>> shards(first.size() - 1);
  for (size_t k = 0; k + 1 < first.size(); ++k) shards[k].reserve(first[k + 1] - first[k]);
  for (size_t i = 0, k = 0; i < plan.tensors.size(); ++i) {
    hf::HfTensor& h = plan.tensors[i];
    if (i == first[k + 1]) ++k;
    RankTensor rt;
    rt.id = h.id;
    rt.name = std::move(h.name);
    rt.shape = std::move(h.shape);
    rt.pieces = std::move(h.pieces);
    rt.out = h.out;
    rt.transposed = h.transposed;
    rt.how = h.how;
    rt.scale = h.scale;
    rt.add = h.add;
    shards[k].push_back(std::move(rt));
  }
  plan.tensors.clear();
  std::vector<NamedLayout> out;
  std::vector<std::string> shard_names;
  // The weight map, in first-seen order (a name seen again maps to its last
  // shard), is written as text below: an ordered_json of 100k names took a
  // tenth of a 100k-tensor mount.
  std::vector<std::pair<std::string_view, size_t>> weights;
  std::unordered_map<std::string_view, size_t> weight_pos;
  weight_pos.reserve(plan.tensors.size());
  const size_t n = shards.size();
  for (size_t k = 0; k < n; ++k) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", k + 1, n);
    ASSIGN_OR_RETURN(FileLayout l, Safetensors(index, shards[k], {{"format", "pt"}}));
    for (const RankTensor& rt : shards[k]) {
      auto [it, added] = weight_pos.emplace(rt.name, weights.size());
      if (added) {
        weights.emplace_back(rt.name, k);
      } else {
        weights[it->second].second = k;
      }
    }
    shard_names.push_back(name);
    out.emplace_back(name, std::move(l));
  }
  json ij;
  ij["metadata"] = {{"total_size", total}};
  if (!plan.not_included.empty()) ij["metadata"]["ckptfs_not_included"] = plan.not_included;
  // nlohmann's indent-2 text of {"metadata": ..., "weight_map": {...}}.
  std::string text = JsonText(ij, 2);
  text.resize(text.size() - 2);  // "\n}"
  text += ",\n  \"weight_map\": {";
  for (size_t i = 0; i < weights.size(); ++i) {
    text += i == 0 ? "\n    " : ",\n    ";
    text += JsonEscape(weights[i].first);
    text += ": \"" + shard_names[weights[i].second] + "\"";
  }
  text += weights.empty() ? "}\n}\n" : "\n  }\n}\n";
  FileLayout l;
  l.Add(LiteralSegment(std::move(text)));
  out.emplace_back("model.safetensors.index.json", std::move(l));
  if (!plan.config_json.empty()) {
    FileLayout cl;
    cl.Add(LiteralSegment(plan.config_json));
    out.emplace_back("config.json", std::move(cl));
  }
  for (auto& [name, bytes] : plan.side_files) {
    FileLayout sl;
    sl.Add(LiteralSegment(std::move(bytes)));
    out.emplace_back(name, std::move(sl));
  }
  std::string errors;
  for (const std::string& e : plan.errors) errors += e + "\n";
  FileLayout el;
  if (!errors.empty()) el.Add(LiteralSegment(errors));
  out.emplace_back("ERRORS", std::move(el));
  return out;
}

}  // namespace ckptfs::topo_files
