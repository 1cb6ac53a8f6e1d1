#include "ckptfs/views.h"

#include <nlohmann/json.hpp>

#include "formats/npy.h"
#include "views/topo_files.h"
#include "common/json_text.h"

namespace ckptfs {
namespace {

using json = nlohmann::ordered_json;

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

bool HasUniversal(const Index& ix) {
  for (const ExportFile& x : ix.exports()) {
    if (x.path == "latest_universal") return true;
  }
  return false;
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
         "                             read runs the checks, which read every byte once; a stat\n"
         "                             never does (its size shows 0 until then, like /proc)\n"
         "  .ckptfs/stats              live counters (JSON): reads, bytes, errors, read latency\n"
         "                             percentiles, source bytes read; fresh at each read, never\n"
         "                             listed (diff -r and cp -r of two mounts do not see it):\n"
         "                             cat <mountpoint>/.ckptfs/stats\n"
         "  hf/                        consolidated model-0000k-of-0000n.safetensors + index.json;\n"
         "                             hf/ERRORS names every parameter left out, and why\n"
         "  topo/tp<T>-pp<P>[-dp<D>]/  any parallel layout, made when you first look it up:\n"
         "                             tp<t>-pp<p>.safetensors per rank, layout.json (and Megatron's\n"
         "                             own iter_*/mp_rank_* files for Megatron checkpoints);\n"
         "                             topo/ERRORS says why a layout cannot be made\n" +
         std::string(!HasUniversal(ix) ? "" :
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

Result<std::unique_ptr<View>> View::Build(const Index& index, const TopoOptions& topo) {
  std::unique_ptr<View> v(new View(index, topo));
  uint64_t root = v->AddDir(0, "");
  uint64_t readme = 0, ckjson = 0;
  {
    FileLayout l;
    l.Add(LiteralSegment(ReadmeText(index)));
    readme = v->AddFile(root, "README.txt", std::move(l), TensorId{}, false);
  }
  ckjson = v->AddFile(root, "checkpoint.json", FileLayout{}, TensorId{}, false);
  {
    uint64_t meta = v->AddDir(root, ".ckptfs");
    uint64_t rep = v->AddFile(meta, "report.json", FileLayout{}, TensorId{}, false);
    v->nodes_[rep - 1]->report = true;
    uint64_t stats = v->AddFile(meta, "stats", FileLayout{}, TensorId{}, false);
    v->nodes_[stats - 1]->stats = true;
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
      l.Add(LiteralSegment(*header));
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
  {
    // hf/ is planned at its first lookup or listing (EnsureHf): for a model of
    // 100k tensors that is most of a mount's time and memory.
    v->hf_dir_ = v->AddDir(root, "hf");
    v->topo_dir_ = v->AddDir(root, "topo");
    uint64_t errors = v->AddFile(v->topo_dir_, "ERRORS", FileLayout{}, TensorId{}, false);
    v->nodes_[errors - 1]->topo_errors = true;
  }

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
  l.Add(LiteralSegment(JsonText(j, 2) + "\n"));
  v->nodes_[ckjson - 1]->layout = std::move(l);
  return v;
}

void View::EnsureHf() const {
  if (hf_made_.load(std::memory_order_acquire)) return;
  std::unique_lock lock(tree_mu_);
  if (hf_made_.load(std::memory_order_relaxed)) return;  // made by another thread meanwhile
  // The view grows like a cache (nodes are only added), hence the const_cast.
  View* self = const_cast<View*>(this);
  LogInfo("planning hf/");
  auto files = topo_files::HfFiles(index_, topo_);
  if (files.ok()) {
    for (auto& [name, layout] : *files) self->AddFile(hf_dir_, name, std::move(layout), TensorId{}, false);
  } else {
    const std::string why = "hf/ is not available: " + files.status().message();
    LogError(why);
    FileLayout l;
    l.Add(LiteralSegment(why + "\n"));
    self->AddFile(hf_dir_, "ERRORS", std::move(l), TensorId{}, false);
  }
  hf_made_.store(true, std::memory_order_release);
}

Status View::AddTopo(const Topology& t) {
  ASSIGN_OR_RETURN(TopoPlan plan, PlanTopology(index_, t, topo_));
  auto files = topo_files::TopoFiles(index_, plan);
  if (!files.ok()) return files.status();
  const uint64_t dir = AddDir(topo_dir_, t.Name());
  for (auto& [path, layout] : *files) {
    uint64_t d = dir;
    size_t pos = 0;
    while (true) {
      const size_t slash = path.find('/', pos);
      if (slash == std::string::npos) break;
      d = AddDir(d, path.substr(pos, slash - pos));
      pos = slash + 1;
    }
    TensorId first{};
    for (const Segment& s : layout.segments) {
      if (s.kind != SegmentKind::kLiteral) {
        first = s.tensor;
        break;
      }
    }
    AddFile(d, path.substr(pos), std::move(layout), first, false);
  }
  return Status::Ok();
}

Status View::AddExport(uint64_t root, const ExportFile& x) {
  if (!x.path.empty() && x.path[0] == '@') return Status::Ok();  // internal: for other views, not in the tree
  // Export paths embed names from the checkpoint (universal/zero/<name>/):
  // every component goes through PathComponent, so '', '.', '..' and
  // over-long names stay single, visible entries inside the tree.
  uint64_t dir = root;
  size_t pos = 0;
  while (true) {
    size_t slash = x.path.find('/', pos);
    if (slash == std::string::npos) break;
    dir = AddDir(dir, PathComponent(x.path.substr(pos, slash - pos)));
    pos = slash + 1;
  }
  ASSIGN_OR_RETURN(FileLayout l, topo_files::LayoutOfParts(index_, x.path, x.parts));
  TensorId first{};
  for (const ExportPart& p : x.parts) {
    if (p.kind != PartKind::kLiteral) {
      first = TensorId{p.tensor};
      break;
    }
  }
  AddFile(dir, PathComponent(x.path.substr(pos)), std::move(l), first, false);
  return Status::Ok();
}

const Node* View::GetLocked(uint64_t ino) const {
  if (ino == 0 || ino > nodes_.size()) return nullptr;
  return nodes_[ino - 1].get();
}

const Node* View::Get(uint64_t ino) const {
  std::shared_lock lock(tree_mu_);
  return GetLocked(ino);
}

const Node* View::Lookup(uint64_t parent, std::string_view name) const {
  if (parent == hf_dir_) EnsureHf();
  {
    std::shared_lock lock(tree_mu_);
    const Node* p = GetLocked(parent);
    if (p == nullptr || !p->is_dir) return nullptr;
    if (name == ".") return p;
    if (name == "..") return GetLocked(p->parent);
    auto it = p->children.find(name);
    if (it != p->children.end()) return GetLocked(it->second);
    if (parent != topo_dir_) return nullptr;
  }
  // topo/<name>: plan it now. The view grows like a cache (nodes are only
  // added), hence the const_cast.
  auto t = Topology::Parse(name);
  if (!t) return nullptr;
  std::unique_lock lock(tree_mu_);
  View* self = const_cast<View*>(this);
  const std::string canon = t->Name();
  if (canon != name) return nullptr;  // one spelling per view (tp02 is not tp2)
  if (auto it = nodes_[topo_dir_ - 1]->children.find(name); it != nodes_[topo_dir_ - 1]->children.end()) {
    return GetLocked(it->second);  // made by another thread meanwhile
  }
  if (topo_errors_.count(canon)) return nullptr;
  LogInfo("planning topo/" + canon);
  Status st = self->AddTopo(*t);
  if (!st.ok()) {
    self->topo_errors_[canon] = st.message();
    LogError(st.message());
    return nullptr;
  }
  auto it = nodes_[topo_dir_ - 1]->children.find(name);
  return it == nodes_[topo_dir_ - 1]->children.end() ? nullptr : GetLocked(it->second);
}

std::vector<std::tuple<std::string, uint64_t, bool>> View::List(uint64_t ino) const {
  // The source's own layout is listed in topo/ from the first listing on: it
  // is planned then (not at mount time, which `ckptfs cat` pays too).
  if (ino == topo_dir_ && !index_.info().topology.empty()) Lookup(topo_dir_, index_.info().topology);
  if (ino == hf_dir_) EnsureHf();
  std::shared_lock lock(tree_mu_);
  std::vector<std::tuple<std::string, uint64_t, bool>> out;
  const Node* n = GetLocked(ino);
  if (n == nullptr) return out;
  out.reserve(n->children.size());
  for (const auto& [name, child] : n->children) {
    const Node* c = GetLocked(child);
    if (c->stats) continue;  // open by name only (see Node::stats)
    out.emplace_back(name, child, c->is_dir);
  }
  return out;
}

uint32_t View::NLink(uint64_t ino) const {
  std::shared_lock lock(tree_mu_);
  const Node* n = GetLocked(ino);
  if (n == nullptr) return 1;
  return n->is_dir ? 2 + n->subdirs : 1;
}

bool View::Dynamic(uint64_t ino) const {
  if (ino == topo_dir_) return true;
  const Node* n = Get(ino);
  return n != nullptr && (n->topo_errors || n->report || n->stats);
}

std::string View::TopoErrors() const {
  std::shared_lock lock(tree_mu_);
  std::string out;
  for (const auto& [name, why] : topo_errors_) out += why + "\n";  // each names topo/<name>
  return out;
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

Status View::InfoJson(const Node& n, FileLayout* out, uint64_t* unrendered) const {
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
    if (t.replicas > 1) e["mean_of_copies"] = t.replicas;  // sum(copies) / n, as ds_to_universal.py averages
    // Fragments are written by hand (a tensor may have thousands, and `ls -l`
    // sizes every info.json): the same compact JSON nlohmann would write.
    std::string body = JsonText(e);
    body.pop_back();
    body += ",\"fragments\":[";
    if (t.error.empty() && unrendered != nullptr) {
      *unrendered += t.fragments_json_bytes;
    } else if (t.error.empty()) {
      ASSIGN_OR_RETURN(std::vector<Fragment> fs, index_.Fragments(id));
      const size_t before = body.size();
      AppendFragmentsJson(body, fs, index_.files(), t.replicas);
      if (body.size() - before != t.fragments_json_bytes) {
        return Invalid("index " + index_.dir() + " is inconsistent: the fragments of '" + t.key + "' render to " +
                       std::to_string(body.size() - before) + " bytes, its record says " +
                       std::to_string(t.fragments_json_bytes) + " (rebuild it with ckptfs index --force)");
      }
    }
    body += "]}";
    body.pop_back();  // reopen the object to append the hash field
    text += std::string(first ? "" : ",") + "\n    " + JsonEscape(t.state) + ": " + body + ", \"xxh3_64_raw\": ";
    first = false;
    if (!t.error.empty()) {
      text += "null}";
      continue;
    }
    text += "\"";
    l.Add(LiteralSegment(text));
    text.clear();
    Segment h;
    h.kind = SegmentKind::kHash;
    h.size = 16;
    h.tensor = id;
    l.Add(h);
    text = "\"}";
  }
  text += "\n  }\n}\n";
  l.Add(LiteralSegment(text));
  *out = std::move(l);
  return Status::Ok();
}

Result<const FileLayout*> View::Layout(uint64_t ino) const {
  const Node* n = Get(ino);
  if (n == nullptr || n->is_dir) return NotFound("no such file");
  if (!n->lazy) return &n->layout;
  std::lock_guard<std::mutex> lock(lazy_mu_);
  Node* m = nodes_[ino - 1].get();
  if (!m->made) {
    RETURN_IF_ERROR(InfoJson(*m, &m->layout, nullptr));
    m->made = true;
  }
  return &m->layout;
}

Result<uint64_t> View::Size(uint64_t ino) const {
  const Node* n = Get(ino);
  if (n == nullptr || n->is_dir) return NotFound("no such file");
  if (!n->lazy) return n->layout.size;
  std::lock_guard<std::mutex> lock(lazy_mu_);
  Node* m = nodes_[ino - 1].get();
  if (m->made) return m->layout.size;
  if (m->lazy_size == UINT64_MAX) {
    FileLayout l;
    uint64_t unrendered = 0;
    RETURN_IF_ERROR(InfoJson(*m, &l, &unrendered));
    m->lazy_size = l.size + unrendered;
  }
  return m->lazy_size;
}

}  // namespace ckptfs
