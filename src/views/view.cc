#include "ckptfs/views.h"

#include <nlohmann/json.hpp>

#include "formats/npy.h"

namespace ckptfs {
namespace {

using json = nlohmann::ordered_json;

Segment Literal(std::string s) {
  Segment seg;
  seg.kind = SegmentKind::kLiteral;
  seg.size = s.size();
  seg.literal = std::move(s);
  return seg;
}

Segment TensorSeg(TensorId id, const TensorRecord& t, DType out) {
  Segment seg;
  seg.kind = SegmentKind::kTensor;
  seg.tensor = id;
  seg.out_dtype = out;
  seg.size = t.encoding == Encoding::kBytes ? t.byte_size : t.Numel() * DTypeSize(out);
  return seg;
}

json ShapeJson(const std::vector<int64_t>& s) {
  json a = json::array();
  for (int64_t x : s) a.push_back(x);
  return a;
}

const char* RoleName(Role r) {
  switch (r) {
    case Role::kParam: return "param";
    case Role::kOptimState: return "optimizer_state";
    default: return "other";
  }
}

std::string ReadmeText(const Index& ix) {
  return "This is a ckptfs mount: a read-only, lazily computed view of the checkpoint\n"
         "  " + ix.src_dir() + "\n"
         "(family: " + ix.info().family + "). Nothing was converted; every byte is read from\n"
         "the original shards when you read it.\n\n"
         "  checkpoint.json            what ckptfs found: family, step, ranks, counts, problems\n"
         "  params/<fqn>/param.npy     the model's tensor, full global shape (numpy.load)\n"
         "  params/<fqn>/<state>.npy   optimizer states (exp_avg, exp_avg_sq, step, ...)\n"
         "  params/<fqn>/*.raw         the same tensors as exact source bytes, C order, no header\n"
         "  params/<fqn>/info.json     dtype, shape, source fragments, xxh3-64 of the raw bytes\n"
         "  other/<key>                every other entry: torch.save blobs as stored\n"
         "                             (torch.load them), other tensors as .npy/.raw\n"
         "  .ckptfs/report.json        integrity report (= ckptfs verify --json); the first\n"
         "                             stat or read runs the checks, which read every byte once\n" +
         std::string(ix.exports().empty() ? "" :
         "  universal/                 DeepSpeed universal checkpoint (ds_to_universal.py's tree),\n"
         "                             torch.save archives generated on read; point DeepSpeed's\n"
         "                             load_checkpoint(<mount>) with checkpoint.load_universal at it\n") +
         "\n"
         ".npy files hold numpy dtypes: bfloat16 and float8 are widened to float32 (exactly);\n"
         "the .raw twin keeps the source dtype. A file whose source is damaged or changed\n"
         "returns EIO (or ESTALE) and the daemon log says why; everything else keeps working.\n"
         "Unmount with: ckptfs umount <mountpoint>\n";
}

}  // namespace

std::string PathComponent(std::string_view key) {
  std::string out;
  for (char c : key) {
    if (c == '/') out += "%2F";
    else if (c == '\0') out += "%00";
    else out.push_back(c);
  }
  if (out.empty() || out == "." || out == "..") out = "_" + out;
  if (out.size() > 250) out = out.substr(0, 233) + "~" + Hex64(std::hash<std::string_view>{}(key));
  return out;
}

uint64_t View::AddDir(uint64_t parent, const std::string& name) {
  if (parent != 0) {
    auto it = nodes_[parent - 1]->children.find(name);
    if (it != nodes_[parent - 1]->children.end()) return it->second;
  }
  auto n = std::make_unique<Node>();
  n->ino = nodes_.size() + 1;
  n->parent = parent == 0 ? n->ino : parent;
  n->name = name;
  n->is_dir = true;
  uint64_t ino = n->ino;
  nodes_.push_back(std::move(n));
  if (parent != 0) {
    nodes_[parent - 1]->children.emplace(name, ino);
    nodes_[parent - 1]->subdirs++;
  }
  return ino;
}

uint64_t View::AddFile(uint64_t parent, const std::string& name, FileLayout layout, TensorId tensor, bool lazy) {
  std::string unique = name;
  auto& siblings = nodes_[parent - 1]->children;
  if (siblings.count(unique)) {
    unique = name + "~" + std::to_string(tensor.v);
    problems_.push_back("two entries map to " + PathOf(parent) + "/" + name + "; the second is named " + unique);
  }
  auto n = std::make_unique<Node>();
  n->ino = nodes_.size() + 1;
  n->parent = parent;
  n->name = unique;
  n->layout = std::move(layout);
  n->lazy = lazy;
  n->tensor = tensor;
  uint64_t ino = n->ino;
  nodes_.push_back(std::move(n));
  siblings.emplace(unique, ino);
  return ino;
}

Result<std::unique_ptr<View>> View::Build(const Index& index) {
  std::unique_ptr<View> v(new View(index));
  uint64_t root = v->AddDir(0, "");
  uint64_t readme = 0, ckjson = 0;
  {
    FileLayout l;
    l.Add(Literal(ReadmeText(index)));
    readme = v->AddFile(root, "README.txt", std::move(l), TensorId{}, false);
  }
  ckjson = v->AddFile(root, "checkpoint.json", FileLayout{}, TensorId{}, false);
  {
    uint64_t meta = v->AddDir(root, ".ckptfs");
    uint64_t rep = v->AddFile(meta, "report.json", FileLayout{}, TensorId{}, false);
    v->nodes_[rep - 1]->report = true;
  }
  uint64_t params = v->AddDir(root, "params");
  uint64_t other = v->AddDir(root, "other");
  (void)readme;

  const auto& tensors = index.tensors();
  uint64_t n_params = 0, n_states = 0, n_other = 0, total_bytes = 0;
  json broken = json::array();
  for (uint32_t i = 0; i < tensors.size(); ++i) {
    const TensorRecord& t = tensors[i];
    TensorId id{i};
    total_bytes += t.byte_size;
    if (!t.error.empty()) broken.push_back({{"key", t.key}, {"error", t.error}});
    if (t.role == Role::kHidden) continue;
    if (t.encoding == Encoding::kBytes) {
      FileLayout l;
      l.Add(TensorSeg(id, t, DType::kU8));
      v->AddFile(other, PathComponent(t.key), std::move(l), id, false);
      ++n_other;
      continue;
    }
    uint64_t dir;
    std::string stem;
    if (t.role == Role::kOther) {
      dir = other;
      stem = PathComponent(t.key);
      ++n_other;
    } else {
      dir = v->AddDir(params, PathComponent(t.fqn));
      stem = PathComponent(t.state);
      (t.role == Role::kParam ? n_params : n_states)++;
      if (!v->nodes_[dir - 1]->children.count("info.json")) {
        v->AddFile(dir, "info.json", FileLayout{}, id, true);
      }
    }
    DType npy = NpyDType(t.dtype);
    auto header = formats::NpyHeader(npy, t.shape);
    if (header.ok()) {
      FileLayout l;
      l.Add(Literal(*header));
      l.Add(TensorSeg(id, t, npy));
      v->AddFile(dir, stem + ".npy", std::move(l), id, false);
    } else {
      v->problems_.push_back("no .npy for '" + t.key + "': " + header.status().message());
    }
    FileLayout raw;
    raw.Add(TensorSeg(id, t, t.dtype));
    v->AddFile(dir, stem + ".raw", std::move(raw), id, false);
  }

  for (const ExportFile& x : index.exports()) RETURN_IF_ERROR(v->AddExport(root, x));

  const CheckpointInfo& info = index.info();
  json j;
  j["family"] = info.family;
  j["format"] = info.format_note;
  j["source"] = index.src_dir();
  j["step"] = info.step >= 0 ? json(info.step) : json(nullptr);
  j["source_topology"] = {{"world_size", info.world_size}};
  j["counts"] = {{"tensors", tensors.size()},        {"params", n_params},
                 {"optimizer_states", n_states},     {"other", n_other},
                 {"fragments", index.num_fragments()}, {"files", index.files().size()},
                 {"bytes", total_bytes}, {"synthesized_files", index.exports().size()}};
  j["index"] = index.dir();
  j["broken"] = broken;
  json problems = json::array();
  for (const auto& f : info.findings) problems.push_back(f.message);
  for (const auto& p : info.problems) problems.push_back(p);
  for (const auto& p : v->problems_) problems.push_back(p);
  j["problems"] = problems;
  // Index-time findings only; .ckptfs/report.json (ckptfs verify) adds the
  // ones that need the data.
  json findings = json::array();
  for (const auto& f : info.findings) {
    findings.push_back({{"check", std::string(CheckName(f.check))}, {"severity", std::string(SeverityName(f.severity))},
                        {"tensor", f.tensor}, {"file", f.file}, {"message", f.message}});
  }
  j["findings"] = findings;
  FileLayout l;
  l.Add(Literal(j.dump(2) + "\n"));
  v->nodes_[ckjson - 1]->layout = std::move(l);
  return v;
}

Status View::AddExport(uint64_t root, const ExportFile& x) {
  uint64_t dir = root;
  size_t pos = 0;
  while (true) {
    size_t slash = x.path.find('/', pos);
    if (slash == std::string::npos) break;
    dir = AddDir(dir, x.path.substr(pos, slash - pos));
    pos = slash + 1;
  }
  FileLayout l;
  TensorId first{};
  bool have = false;
  for (const ExportPart& p : x.parts) {
    Segment seg;
    switch (p.kind) {
      case PartKind::kLiteral:
        seg = Literal(p.literal);
        break;
      case PartKind::kTensor:
        seg = TensorSeg(TensorId{p.tensor}, index_.tensors()[p.tensor], p.out_dtype);
        if (!p.box.lengths.empty() || !p.box.offsets.empty()) {
          seg.box = p.box;
          seg.size = static_cast<uint64_t>(NumelOf(p.box.lengths)) * DTypeSize(p.out_dtype);
        }
        break;
      case PartKind::kCrc32:
        seg.kind = SegmentKind::kCrc32;
        seg.tensor = TensorId{p.tensor};
        seg.out_dtype = p.out_dtype;
        seg.box = p.box;
        seg.size = 4;
        break;
    }
    if (seg.size != p.size) {
      return Invalid("cannot build the view: " + x.path + " has a part of " + std::to_string(p.size) +
                     " bytes whose content is " + std::to_string(seg.size));
    }
    if (p.kind != PartKind::kLiteral && !have) {
      first = TensorId{p.tensor};
      have = true;
    }
    l.Add(std::move(seg));
  }
  AddFile(dir, x.path.substr(pos), std::move(l), first, false);
  return Status::Ok();
}

const Node* View::Get(uint64_t ino) const {
  if (ino == 0 || ino > nodes_.size()) return nullptr;
  return nodes_[ino - 1].get();
}

const Node* View::Lookup(uint64_t parent, std::string_view name) const {
  const Node* p = Get(parent);
  if (p == nullptr || !p->is_dir) return nullptr;
  if (name == ".") return p;
  if (name == "..") return Get(p->parent);
  auto it = p->children.find(name);
  return it == p->children.end() ? nullptr : Get(it->second);
}

Result<uint64_t> View::Resolve(std::string_view path) const {
  uint64_t ino = kRootIno;
  size_t pos = 0;
  while (pos < path.size()) {
    size_t slash = path.find('/', pos);
    std::string_view comp = path.substr(pos, slash == std::string_view::npos ? std::string_view::npos : slash - pos);
    pos = slash == std::string_view::npos ? path.size() : slash + 1;
    if (comp.empty()) continue;
    const Node* n = Lookup(ino, comp);
    if (n == nullptr) return NotFound("no such file in the view: " + std::string(path));
    ino = n->ino;
  }
  return ino;
}

std::string View::PathOf(uint64_t ino) const {
  std::string out;
  for (const Node* n = Get(ino); n != nullptr && n->ino != kRootIno; n = Get(n->parent)) {
    out = "/" + n->name + out;
  }
  return out.empty() ? "/" : out;
}

Status View::MakeInfoJson(Node& n) const {
  const Node* dir = Get(n.parent);
  json j;
  j["fqn"] = index_.tensors()[n.tensor.v].fqn;
  json entries = json::object();
  std::vector<TensorId> ids;
  for (const auto& [name, ino] : dir->children) {
    const Node* c = Get(ino);
    if (c->name.size() > 4 && c->name.compare(c->name.size() - 4, 4, ".raw") == 0) ids.push_back(c->tensor);
  }
  FileLayout l;
  std::string text;
  // The JSON is emitted by hand around the hash placeholders so that each
  // hash lands at a known offset as a kHash segment.
  text = "{\n  \"fqn\": " + JsonEscape(j["fqn"].get<std::string>()) + ",\n  \"tensors\": {";
  bool first = true;
  for (TensorId id : ids) {
    const TensorRecord& t = index_.tensors()[id.v];
    json e;
    e["key"] = t.key;
    e["role"] = RoleName(t.role);
    e["dtype"] = std::string(DTypeName(t.dtype));
    e["npy_dtype"] = std::string(DTypeName(NpyDType(t.dtype)));
    e["shape"] = ShapeJson(t.shape);
    e["bytes"] = t.byte_size;
    if (!t.error.empty()) e["error"] = t.error;
    json frags = json::array();
    if (t.error.empty()) {
      ASSIGN_OR_RETURN(std::vector<Fragment> fs, index_.Fragments(id));
      for (const auto& f : fs) {
        json fj;
        fj["file"] = index_.files()[f.file.v].rel_path;
        fj["offsets"] = ShapeJson(f.offsets);
        fj["lengths"] = ShapeJson(f.lengths);
        fj["strides"] = ShapeJson(f.strides);
        fj["byte_offset"] = f.data_offset;
        if (f.compression == Compression::kZstd) {
          fj["zstd_item"] = {f.item_offset, f.item_length};
        }
        frags.push_back(fj);
      }
    }
    e["fragments"] = frags;
    std::string body = e.dump();
    body.pop_back();  // reopen the object to append the hash field
    text += std::string(first ? "" : ",") + "\n    " + JsonEscape(t.state) + ": " + body + ", \"xxh3_64_raw\": ";
    first = false;
    if (!t.error.empty()) {
      text += "null}";
      continue;
    }
    text += "\"";
    l.Add(Literal(text));
    text.clear();
    Segment h;
    h.kind = SegmentKind::kHash;
    h.size = 16;
    h.tensor = id;
    l.Add(h);
    text = "\"}";
  }
  text += "\n  }\n}\n";
  l.Add(Literal(text));
  n.layout = std::move(l);
  return Status::Ok();
}

Result<const FileLayout*> View::Layout(uint64_t ino) const {
  const Node* n = Get(ino);
  if (n == nullptr || n->is_dir) return NotFound("no such file");
  if (!n->lazy) return &n->layout;
  std::lock_guard<std::mutex> lock(lazy_mu_);
  Node* m = nodes_[ino - 1].get();
  if (!m->made) {
    RETURN_IF_ERROR(MakeInfoJson(*m));
    m->made = true;
  }
  return &m->layout;
}

}  // namespace ckptfs
