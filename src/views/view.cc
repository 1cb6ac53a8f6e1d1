#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <thread>

#include "ckptfs/formats.h"
#include "ckptfs/views.h"
#include "common/json_text.h"
#include "common/temp_file.h"
#include "formats/byte_reader.h"
#include "formats/npy.h"
#include "views/dcp_view.h"
#include "views/hf_export.h"
#include "views/plan_cache.h"
#include "views/topo_files.h"

namespace ckptfs {
namespace {

// Planning hf/ or a topo/ layout of a 100k-tensor model makes ~100 MB of
// temporaries that glibc keeps in the daemon's heap once freed: given back
// to the kernel here (the daemon's RSS after `ls -lR` of such a mount went
// from 287 to 245 MB).
void ReleaseFreeMemory() { malloc_trim(0); }

using json = nlohmann::ordered_json;

Segment TensorSeg(TensorId id, const TensorRecord& t, DType out) {
  Segment seg;
  seg.kind = SegmentKind::kTensor;
  seg.tensor = id;
  seg.out_dtype = out;
  seg.size = t.encoding == Encoding::kBytes ? t.byte_size : t.Numel() * DTypeSize(out);
  return seg;
}

// A tensor segment of rows `rows` of `t` (a padded vocabulary's vocabulary
// or padding; the whole tensor otherwise).
Segment RowsSeg(TensorId id, const TensorRecord& t, DType out, const Box& rows) {
  Segment seg = TensorSeg(id, t, out);
  if (t.VocabPadded()) {
    seg.boxes = {rows};
    seg.size = static_cast<uint64_t>(NumelOf(rows.lengths)) * DTypeSize(out);
  }
  return seg;
}

const char* RoleName(Role r) {
  switch (r) {
    case Role::kParam:
      return "param";
    case Role::kOptimState:
      return "optimizer_state";
    default:
      return "other";
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
         "  " +
         ix.src_dir() +
         "\n"
         "(family: " +
         std::string(FamilyName(ix.info().family)) +
         "). Nothing was converted; every byte is read from\n"
         "the original shards when you read it.\n\n"
         "  checkpoint.json            what ckptfs found: family, step, ranks, counts, problems\n"
         "  params/<fqn>/param.npy     the model's tensor, full global shape (numpy.load)\n"
         "  params/<fqn>/<state>.npy   optimizer states (exp_avg, exp_avg_sq, step, ...); a vocabulary\n"
         "                             padded for tensor parallelism has its true rows, the padding\n"
         "                             rows are <state>.vocab_padding.npy\n"
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
         "  dcp/                       the checkpoint as a PyTorch DCP (.metadata + .distcp): torch's\n"
         "                             dcp.load(sd, checkpoint_id=<mount>/dcp) at any world size,\n"
         "                             model.<fqn> and optim.state.<fqn>.<state>; dcp/README.txt\n"
         "  accelerate/                Accelerate's / the HF Trainer's FSDP layout of the same files:\n"
         "                             pytorch_model_fsdp_0/ and optimizer_0/ (Accelerator.load_state)\n"
         "  topo/tp<T>-pp<P>[-dp<D>]/  any parallel layout, made when you first look it up:\n"
         "                             tp<t>-pp<p>.safetensors per rank, layout.json (and Megatron's\n"
         "                             own iter_*/mp_rank_* files for Megatron checkpoints);\n"
         "                             topo/ERRORS says why a layout cannot be made\n" +
         std::string(
             !HasUniversal(ix)
                 ? ""
                 : "  universal/                 DeepSpeed universal checkpoint (ds_to_universal.py's tree),\n"
                   "                             torch.save archives generated on read; point DeepSpeed's\n"
                   "                             load_checkpoint(<mount>) with checkpoint.load_universal at it\n") +
         "\n"
         ".npy files hold numpy dtypes: bfloat16 and float8 are widened to float32 (exactly);\n"
         "the .raw twin keeps the source dtype. A file whose source is damaged or changed\n"
         "returns EIO (or ESTALE) and the daemon log says why; everything else keeps working.\n"
         "Unmount with: ckptfs umount <mountpoint>\n";
}

}  // namespace

SpooledBytes::~SpooledBytes() {
  if (fd >= 0) ::close(fd);
}

Status SpooledBytes::Read(uint64_t offset, uint64_t n, char* dst) const {
  if (offset > size || n > size - offset) return Internal("a read past the end of spooled bytes");
  return formats::PreadExact(fd, base + offset, dst, n, name.empty() ? "a spooled file in " + TempDir() : name);
}

std::string PathComponent(std::string_view key) {
  std::string out;
  for (char c : key) {
    if (c == '/')
      out += "%2F";
    else if (c == '\0')
      out += "%00";
    else
      out.push_back(c);
  }
  if (out.empty() || out == "." || out == "..") out = "_" + out;
  if (out.size() > 250) out = out.substr(0, 233) + "~" + Hex64(std::hash<std::string_view>{}(key));
  return out;
}

uint64_t View::FindChild(const Node& dir, std::string_view name) const {
  if (building_) {
    if (dir.children.size() <= kScanChildren) {
      for (uint64_t c : dir.children) {
        if (nodes_[c - 1]->name == name) return c;
      }
      return 0;
    }
    auto it = building_->find(ChildKey{dir.ino, name});
    return it == building_->end() ? 0 : it->second;
  }
  auto it = std::lower_bound(dir.children.begin(), dir.children.end(), name,
                             [this](uint64_t c, std::string_view n) { return nodes_[c - 1]->name < n; });
  return it != dir.children.end() && nodes_[*it - 1]->name == name ? *it : 0;
}

uint64_t View::AddNode(uint64_t parent, std::string name, bool is_dir) {
  auto n = std::make_unique<Node>();
  n->ino = nodes_.size() + 1;
  n->parent = parent == 0 ? n->ino : parent;
  n->name = std::move(name);
  n->is_dir = is_dir;
  Node* node = n.get();
  nodes_.push_back(std::move(n));
  if (parent != 0) {
    Node& dir = *nodes_[parent - 1];
    if (building_) {
      // Small directories are scanned; a big one's children are all hashed
      // from the moment it outgrows the scan.
      dir.children.push_back(node->ino);
      if (dir.children.size() == kScanChildren + 1) {
        for (uint64_t c : dir.children) building_->emplace(ChildKey{parent, nodes_[c - 1]->name}, c);
      } else if (dir.children.size() > kScanChildren + 1) {
        building_->emplace(ChildKey{parent, node->name}, node->ino);
      }
    } else {
      Link(parent, node->ino);
    }
    if (is_dir) dir.subdirs++;
  }
  return node->ino;
}

void View::Link(uint64_t dir, uint64_t ino) {
  if (dir == 0) return;  // in name order: after Build, children stay sorted
  Node& d = *nodes_[dir - 1];
  const std::string& name = nodes_[ino - 1]->name;
  auto it = std::lower_bound(d.children.begin(), d.children.end(), name,
                             [this](uint64_t c, const std::string& n) { return nodes_[c - 1]->name < n; });
  d.children.insert(it, ino);
}

uint64_t View::AddDir(uint64_t parent, const std::string& name) {
  if (parent != 0) {
    if (uint64_t c = FindChild(*nodes_[parent - 1], name)) return c;
  }
  return AddNode(parent, name, true);
}

uint64_t View::AddFile(uint64_t parent, const std::string& name, FileLayout layout, TensorId tensor, Node::Lazy lazy) {
  std::string unique = name;
  if (FindChild(*nodes_[parent - 1], unique) != 0) {
    unique = name + "~" + std::to_string(tensor.v);
    // Under tree_mu_ (hf/ and topo/ are added while mounted): PathOfLocked.
    problems_.push_back("two entries map to " + PathOfLocked(parent) + "/" + name + "; the second is named " + unique);
  }
  const uint64_t ino = AddNode(parent, std::move(unique), false);
  Node& n = *nodes_[ino - 1];
  n.lazy = lazy;
  n.tensor = tensor;
  if (lazy == Node::Lazy::kNo) n.layout = std::make_unique<FileLayout>(std::move(layout));
  return ino;
}

FileLayout View::TensorFileLayout(const Node& n) const {
  const TensorRecord& t = index_.tensors()[n.tensor.v];
  FileLayout l;
  const Box rows = t.VocabBox(n.vocab_padding);
  const DType out = n.lazy == Node::Lazy::kNpy ? NpyDType(t.dtype) : t.dtype;
  if (n.lazy == Node::Lazy::kNpy) {
    auto header = formats::NpyHeader(out, rows.lengths);  // checked when the node was made
    l.Add(LiteralSegment(header.ok() ? *header : std::string()));
  }
  l.Add(RowsSeg(n.tensor, t, out, rows));
  return l;
}

Result<std::unique_ptr<View>> View::Build(const Index& index, const TopoOptions& topo) {
  std::unique_ptr<View> v(new View(index, topo));
  v->building_ = std::make_unique<std::unordered_map<ChildKey, uint64_t, ChildKeyHash>>();
  v->building_->reserve(index.tensors().size() + 64);
  v->nodes_.reserve(4 * index.tensors().size() + 64);
  uint64_t root = v->AddDir(0, "");
  uint64_t readme = 0, ckjson = 0;
  {
    FileLayout l;
    l.Add(LiteralSegment(ReadmeText(index)));
    readme = v->AddFile(root, "README.txt", std::move(l), TensorId{});
  }
  ckjson = v->AddFile(root, "checkpoint.json", FileLayout{}, TensorId{});
  {
    uint64_t meta = v->AddDir(root, ".ckptfs");
    uint64_t rep = v->AddFile(meta, "report.json", FileLayout{}, TensorId{});
    v->nodes_[rep - 1]->report = true;
    uint64_t stats = v->AddFile(meta, "stats", FileLayout{}, TensorId{});
    v->nodes_[stats - 1]->stats = true;
  }
  uint64_t params = v->AddDir(root, "params");
  uint64_t other = v->AddDir(root, "other");
  (void)readme;

  const auto& tensors = index.tensors();
  uint64_t n_params = 0, n_states = 0, n_other = 0, n_unlisted = 0, total_bytes = 0;
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
      v->AddFile(other, PathComponent(t.key), std::move(l), id);
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
      if (v->FindChild(*v->nodes_[dir - 1], "info.json") == 0) {
        v->AddFile(dir, "info.json", FileLayout{}, id, Node::Lazy::kInfo);
      }
    }
    // A padded vocabulary: <stem>.npy / .raw hold the vocabulary's rows,
    // <stem>.vocab_padding.npy / .raw the padding rows (each byte once).
    for (const bool padding : {false, true}) {
      if (padding && !t.VocabPadded()) break;
      const std::string name = padding ? stem + ".vocab_padding" : stem;
      auto header = formats::NpyHeader(NpyDType(t.dtype), t.VocabBox(padding).lengths);
      uint64_t npy = 0;
      if (header.ok()) {
        npy = v->AddFile(dir, name + ".npy", FileLayout{}, id, Node::Lazy::kNpy);
      } else {
        v->problems_.push_back("no .npy for '" + t.key + "': " + header.status().message());
      }
      const uint64_t raw = v->AddFile(dir, name + ".raw", FileLayout{}, id, Node::Lazy::kRaw);
      for (uint64_t ino : {npy, raw}) {
        if (ino == 0) continue;
        v->nodes_[ino - 1]->vocab_padding = padding;
        // A Megatron layer stack also served per layer under params/: open
        // by name (other/<stack>.npy), never listed, so cp -r / rsync /
        // diff -r of the tree copy each byte once.
        v->nodes_[ino - 1]->unlisted = t.alias;
      }
    }
    if (t.alias) ++n_unlisted;
  }

  for (const ExportFile& x : index.exports()) RETURN_IF_ERROR(v->AddExport(root, x));
  {
    // hf/ is planned at its first lookup or listing (EnsureHf): for a model of
    // 100k tensors that is most of a mount's time and memory.
    v->hf_dir_ = v->AddDir(root, "hf");
    // dcp/ likewise (its .metadata lists every chunk), when there are tensors.
    bool any_tensor = false;
    for (const TensorRecord& t : tensors) any_tensor |= t.role != Role::kHidden && t.encoding == Encoding::kTensor;
    if (any_tensor) {
      v->dcp_dir_ = v->AddDir(root, "dcp");
      // Accelerate's (and so the HF Trainer's) FSDP SHARDED_STATE_DICT
      // layout: load_fsdp_model reads <dir>/pytorch_model_fsdp_0 (keys
      // model.*), load_fsdp_optimizer <dir>/optimizer_0 (optimizer.*), each a
      // DCP; dcp/ has both key sets, so both are dcp/'s files.
      const uint64_t acc = v->AddDir(root, "accelerate");
      v->accelerate_model_dir_ = v->AddDir(acc, "pytorch_model_fsdp_0");
      v->accelerate_optim_dir_ = v->AddDir(acc, "optimizer_0");
      FileLayout readme;
      readme.Add(LiteralSegment(
          "Accelerate's FSDP checkpoint layout (SHARDED_STATE_DICT, use_dcp), as Accelerator.load_state,\n"
          "load_fsdp_model and load_fsdp_optimizer read it, and so the Hugging Face Trainer's resume:\n"
          "  pytorch_model_fsdp_0/  the model (keys model.<fqn>)\n"
          "  optimizer_0/           the optimizer (keys optimizer.state.<fqn>.<state>, optimizer.param_groups.*)\n"
          "Both hold the same files as ../dcp/ (see its README.txt for what each key comes from); a loader\n"
          "reads only the items its plan asks for, at any world size.\n"));
      v->AddFile(acc, "README.txt", std::move(readme), TensorId{});
      // The family's own DCP layout (Megatron's torch_dist/), its small files
      // now, its DCP planned on first use like dcp/.
      const FamilyReader* reader = ReaderFor(index.info().family);
      if (reader != nullptr && reader->dcp_profile != nullptr) {
        auto profile =
            std::make_shared<DcpProfile>(reader->dcp_profile(DcpProfileInput{index.info(), tensors, index.exports()}));
        // Its files are laid out before anything is added: one that cannot
        // be (a hook's bug) makes the profile absent, not the mount fail.
        for (const ExportFile& f : profile->files) {
          if (!profile->absent.empty()) break;
          if (auto l = topo_files::LayoutOfParts(index, f.path, f.parts); !l.ok()) {
            profile->absent = "cannot lay out " + f.path + ": " + l.status().message();
          }
        }
        if (!profile->absent.empty()) {
          v->profile_absent_ = {profile->dir, profile->absent};
        } else {
          v->profile_dir_ = v->AddDir(root, profile->dir);
          v->profile_dcp_dir_ = v->AddDir(v->profile_dir_, profile->dcp_dir);
          for (const ExportFile& f : profile->files) RETURN_IF_ERROR(v->AddExport(v->profile_dir_, f));
          v->profile_ = std::move(profile);
        }
      }
    }
    v->topo_dir_ = v->AddDir(root, "topo");
    uint64_t errors = v->AddFile(v->topo_dir_, "ERRORS", FileLayout{}, TensorId{});
    v->nodes_[errors - 1]->topo_errors = true;
  }
  // Every directory's children in name order, for lookups and listings.
  v->building_.reset();
  for (auto& n : v->nodes_) {
    if (!n->is_dir) continue;
    std::sort(n->children.begin(), n->children.end(),
              [&v](uint64_t a, uint64_t b) { return v->nodes_[a - 1]->name < v->nodes_[b - 1]->name; });
  }

  const CheckpointInfo& info = index.info();
  json j;
  j["family"] = FamilyName(info.family);
  j["format"] = info.format_note;
  j["source"] = index.src_dir();
  j["step"] = info.step >= 0 ? json(info.step) : json(nullptr);
  j["source_topology"] = {{"world_size", info.world_size}};
  j["counts"] = {{"tensors", tensors.size()},
                 {"params", n_params},
                 {"optimizer_states", n_states},
                 {"other", n_other},
                 {"other_unlisted", n_unlisted},
                 {"fragments", index.num_fragments()},
                 {"files", index.files().size()},
                 {"bytes", total_bytes},
                 {"synthesized_files", index.exports().size()}};
  j["index"] = index.dir();
  // Layouts of a family's own this checkpoint cannot be shown in, and why.
  if (!v->profile_absent_.first.empty()) {
    j["profiles"] = {{v->profile_absent_.first, {{"available", false}, {"why", v->profile_absent_.second}}}};
  } else if (v->profile_ != nullptr) {
    j["profiles"] = {{v->profile_->dir, {{"available", true}}}};
  }
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
    findings.push_back({{"check", std::string(CheckName(f.check))},
                        {"severity", std::string(SeverityName(f.severity))},
                        {"tensor", f.tensor},
                        {"file", f.file},
                        {"message", f.message}});
  }
  j["findings"] = findings;
  FileLayout l;
  l.Add(LiteralSegment(JsonText(j, 2) + "\n"));
  *v->nodes_[ckjson - 1]->layout = std::move(l);
  return v;
}

void View::PlanOnce(std::atomic<bool>& made, uint64_t dir, const std::vector<uint64_t>& links, const std::string& what,
                    const std::function<Result<NamedFiles>()>& plan) const {
  if (dir == 0 || made.load(std::memory_order_acquire)) return;
  std::unique_lock lock(tree_mu_);
  if (made.load(std::memory_order_relaxed)) return;  // made by another thread meanwhile
  // The view grows like a cache (nodes are only added), hence the const_cast.
  View* self = const_cast<View*>(this);
  LogInfo("planning " + what);
  auto add = [&](const std::string& name, FileLayout layout) {
    const uint64_t ino = self->AddFile(dir, name, std::move(layout), TensorId{});
    for (uint64_t d : links) self->Link(d, ino);
  };
  auto files = plan();
  if (files.ok()) {
    for (auto& [name, layout] : *files) add(name, std::move(layout));
  } else {
    const std::string why = what + " is not available: " + files.status().message();
    LogError(why);
    FileLayout l;
    l.Add(LiteralSegment(why + "\n"));
    add("ERRORS", std::move(l));
  }
  made.store(true, std::memory_order_release);
  ReleaseFreeMemory();
}

namespace {

// A view's files (dcp/, a profile's or hf/, `what`), what it leaves out
// logged: from the plan a mount of this index saved (plan_cache.h) as
// `saved_as` under `key`, else made by `make` and saved for the next mount.
Result<std::vector<topo_files::NamedLayout>> CachedPlan(const Index& index, const std::string& saved_as,
                                                        const std::string& key, const std::string& what,
                                                        const std::function<Result<plan_cache::Plan>()>& make) {
  std::optional<plan_cache::Plan> plan = plan_cache::Load(index, saved_as, key);
  if (plan) {
    LogInfo(what + " as planned before (" + plan_cache::PathOf(index, saved_as) + ")");
  } else {
    // Planned, saved and freed on a thread of its own, so that planning's
    // many short-lived allocations land in that thread's malloc arena; the
    // plan is then read back here, compactly, and that arena's garbage goes
    // back to the kernel (ReleaseFreeMemory). Planned and kept in place, what
    // planning freed stayed resident between the plan's pieces: after `ls -lR`
    // of a 100k-tensor checkpoint the daemon held 313 MB on a first mount
    // against 253 MB on a remount; 275 MB this way (295 MB when the planned
    // copy was freed here after the read-back).
    Result<plan_cache::Plan> made = Status();
    Status saved;
    const auto t0 = std::chrono::steady_clock::now();
    std::thread planner([&] {
      made = make();
      if (!made.ok()) return;
      saved = plan_cache::Save(index, saved_as, *made, key);
      if (!saved.ok()) {
        plan = std::move(*made);  // served as made
      } else {
        made = plan_cache::Plan{};  // freed on this thread
      }
    });
    planner.join();
    RETURN_IF_ERROR(made.status());
    char secs[32];
    std::snprintf(secs, sizeof secs, "%.2f",
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    LogInfo(what + " planned in " + secs + " s" + (saved.ok() ? ", saved for the next mount of this index" : ""));
    if (!saved.ok()) {
      LogInfo(what + "'s plan is not kept for the next mount: " + saved.message());
    } else if (!(plan = plan_cache::Load(index, saved_as, key))) {
      // Replaced meanwhile by another mount's plan (of another build):
      // planned again here and served as made.
      ASSIGN_OR_RETURN(plan, make());
    }
  }
  for (const std::string& l : plan->notes) LogWarn(what + " leaves out " + l);
  return std::move(plan->files);
}

// dcp_view's tree as a plan.
std::function<Result<plan_cache::Plan>()> DcpPlan(std::function<Result<dcp_view::DcpTree>()> make) {
  return [make = std::move(make)]() -> Result<plan_cache::Plan> {
    ASSIGN_OR_RETURN(dcp_view::DcpTree tree, make());
    return plan_cache::Plan{std::move(tree.files), std::move(tree.left_out)};
  };
}

}  // namespace

void View::EnsureDcp() const {
  // dcp/'s files are listed under accelerate/'s two directories too.
  PlanOnce(dcp_made_, dcp_dir_, {accelerate_model_dir_, accelerate_optim_dir_}, "dcp/",
           [&] { return CachedPlan(index_, "dcp", "", "dcp/", DcpPlan([&] { return dcp_view::DcpFiles(index_); })); });
}

void View::EnsureHf() const {
  PlanOnce(hf_made_, hf_dir_, {}, "hf/", [&] {
    return CachedPlan(index_, "hf", hf::InputsKey(index_, topo_), "hf/", [&]() -> Result<plan_cache::Plan> {
      ASSIGN_OR_RETURN(NamedFiles files, topo_files::HfFiles(index_, topo_));
      return plan_cache::Plan{std::move(files), {}};
    });
  });
}

std::vector<std::string> View::PlanSavedViews() const {
  EnsureDcp();
  EnsureProfile();
  EnsureHf();
  std::vector<std::string> saved;
  for (const std::string& name : {std::string("dcp"), ProfilePlanName(), std::string(hf_dir_ != 0 ? "hf" : "")}) {
    const std::string path = plan_cache::PathOf(index_, name);
    if (!name.empty() && ::access(path.c_str(), R_OK) == 0) saved.push_back(path);
  }
  return saved;
}

std::string View::ProfilePlanName() const {
  if (profile_ == nullptr) return "";
  std::string name = "profile-" + profile_->dir;
  std::replace(name.begin(), name.end(), '/', '-');
  return name;
}

void View::EnsureProfile() const {
  if (profile_ == nullptr) return;
  const std::string where = profile_->dir + "/" + profile_->dcp_dir + "/";
  const std::string saved_as = ProfilePlanName();
  PlanOnce(profile_made_, profile_dcp_dir_, {}, where, [&] {
    return CachedPlan(index_, saved_as, "", where, DcpPlan([&] { return dcp_view::ProfileFiles(index_, *profile_); }));
  });
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
    AddFile(d, path.substr(pos), std::move(layout), first);
  }
  return Status::Ok();
}

Result<FileLayout> View::ArchiveLayout(const Segment& s) const {
  if (s.kind != SegmentKind::kArchive || s.boxes.size() > 1) return Internal("not an archive segment");
  ASSIGN_OR_RETURN(auto parts,
                   topo_files::TorchSaveTensorParts(index_, s.tensor.v, s.out_dtype, s.box_or_null(), s.lead_ones));
  ASSIGN_OR_RETURN(FileLayout l, topo_files::LayoutOfParts(index_, "an archive item", parts));
  if (l.size != s.size) {
    return Internal("an archive of '" + index_.tensors()[s.tensor.v].key + "' is " + std::to_string(l.size) +
                    " bytes, its segment " + std::to_string(s.size));
  }
  return l;
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
  AddFile(dir, PathComponent(x.path.substr(pos)), std::move(l), first);
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
  if (IsDcpDir(parent)) EnsureDcp();
  if (parent == profile_dcp_dir_) EnsureProfile();
  {
    std::shared_lock lock(tree_mu_);
    const Node* p = GetLocked(parent);
    if (p == nullptr || !p->is_dir) return nullptr;
    if (name == ".") return p;
    if (name == "..") return GetLocked(p->parent);
    if (uint64_t c = FindChild(*p, name)) return GetLocked(c);
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
  if (uint64_t c = FindChild(*nodes_[topo_dir_ - 1], name)) return GetLocked(c);  // made by another thread meanwhile
  if (topo_errors_.count(canon)) return nullptr;
  LogInfo("planning topo/" + canon);
  Status st = self->AddTopo(*t);
  ReleaseFreeMemory();
  if (!st.ok()) {
    self->topo_errors_[canon] = st.message();
    LogError(st.message());
    return nullptr;
  }
  // topo/'s mtime moves on, strictly, so a cached listing of it is dropped
  // (none can be cached before its first listing; see ListFrom).
  if (topo_listed_.load()) {
    const auto now = std::chrono::system_clock::now().time_since_epoch();
    const uint64_t ns = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(now).count());
    topo_changed_ns_.store(std::max(ns, topo_changed_ns_.load(std::memory_order_relaxed) + 1),
                           std::memory_order_release);
  }
  return GetLocked(FindChild(*nodes_[topo_dir_ - 1], name));
}

std::vector<std::tuple<std::string, uint64_t, bool>> View::List(uint64_t ino) const {
  std::vector<Child> children = ListFrom(ino, 0, SIZE_MAX);
  if (ino == topo_dir_) {  // paged in creation order; listed whole in name order
    std::sort(children.begin(), children.end(), [](const Child& x, const Child& y) { return x.name < y.name; });
  }
  std::vector<std::tuple<std::string, uint64_t, bool>> out;
  out.reserve(children.size());
  for (Child& c : children) out.emplace_back(std::move(c.name), c.ino, c.is_dir);
  return out;
}

std::vector<View::Child> View::ListFrom(uint64_t ino, uint64_t from, size_t max) const {
  // The source's own layout is listed in topo/ from the first listing on: it
  // is planned then (not at mount time, which `ckptfs cat` pays too).
  if (ino == topo_dir_ && !index_.info().topology.empty()) Lookup(topo_dir_, index_.info().topology);
  if (ino == hf_dir_) EnsureHf();
  if (IsDcpDir(ino)) EnsureDcp();
  if (ino == profile_dcp_dir_) EnsureProfile();
  // Before the children are read: an entry added after this moves the mtime
  // (Lookup), one added before is in this listing.
  if (ino == topo_dir_) topo_listed_.store(true);
  std::shared_lock lock(tree_mu_);
  std::vector<Child> out;
  const Node* n = GetLocked(ino);
  if (n == nullptr) return out;
  const std::vector<uint64_t>* order = &n->children;
  std::vector<uint64_t> made_order;
  if (ino == topo_dir_) {  // inodes are handed out in creation order
    made_order = n->children;
    std::sort(made_order.begin(), made_order.end());
    order = &made_order;
  }
  for (uint64_t i = from; i < order->size() && out.size() < max; ++i) {
    const Node* c = GetLocked((*order)[i]);
    if (c->stats || c->unlisted) continue;  // open by name only (see Node::stats, Node::unlisted)
    out.push_back(Child{c->name, c->ino, c->is_dir, i + 1});
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
  std::shared_lock lock(tree_mu_);
  return PathOfLocked(ino);
}

std::string View::PathOfLocked(uint64_t ino) const {
  std::string out;
  for (const Node* n = GetLocked(ino); n != nullptr && n->ino != kRootIno; n = GetLocked(n->parent)) {
    out = "/" + n->name + out;
  }
  return out.empty() ? "/" : out;
}

uint64_t View::NextChildLocked(const Node& dir, uint64_t after, WalkOrder order) const {
  auto walked = [this](uint64_t c) {
    const Node* n = GetLocked(c);
    return n != nullptr && !n->stats && !n->unlisted && !n->report && !n->topo_errors;
  };
  const std::vector<uint64_t>& kids = dir.children;
  if (order == WalkOrder::kName) {
    size_t i = 0;
    if (after != 0) {
      const std::string& name = nodes_[after - 1]->name;
      i = static_cast<size_t>(
          std::upper_bound(kids.begin(), kids.end(), name,
                           [this](const std::string& n, uint64_t c) { return n < nodes_[c - 1]->name; }) -
          kids.begin());
    }
    for (; i < kids.size(); ++i) {
      if (walked(kids[i])) return kids[i];
    }
    return 0;
  }
  if (kids.size() <= 64) {  // the smallest walked inode past `after`, by a scan
    uint64_t best = 0;
    for (uint64_t c : kids) {
      if (c > after && (best == 0 || c < best) && walked(c)) best = c;
    }
    return best;
  }
  std::shared_ptr<const std::vector<uint64_t>> sorted;
  {
    std::lock_guard<std::mutex> lock(walk_mu_);
    for (auto& [ino, v] : by_inode_) {
      if (ino == dir.ino && v->size() == kids.size()) sorted = v;
    }
    if (sorted == nullptr) {
      auto v = std::make_shared<std::vector<uint64_t>>(kids);
      std::sort(v->begin(), v->end());
      std::erase_if(by_inode_, [&](const auto& e) { return e.first == dir.ino; });
      by_inode_.emplace_back(dir.ino, v);
      if (by_inode_.size() > 4) by_inode_.erase(by_inode_.begin());
      sorted = std::move(v);
    }
  }
  for (auto it = std::upper_bound(sorted->begin(), sorted->end(), after); it != sorted->end(); ++it) {
    if (walked(*it)) return *it;
  }
  return 0;
}

uint64_t View::NextInWalk(uint64_t ino, WalkOrder order) const {
  std::shared_lock lock(tree_mu_);
  const Node* cur = GetLocked(ino);
  if (cur == nullptr || cur->ino == kRootIno) return 0;
  int dirs = 64;  // directories entered or left before giving up
  while (dirs-- > 0) {
    const Node* parent = GetLocked(cur->parent);
    if (parent == nullptr) return 0;
    const uint64_t next = NextChildLocked(*parent, cur->ino, order);
    if (next == 0) {  // the last of its directory: on past the directory
      if (parent->ino == kRootIno) return 0;
      cur = parent;
      continue;
    }
    cur = GetLocked(next);
    while (cur->is_dir && dirs-- > 0) {  // down to the first file, past empty directories
      const uint64_t first = NextChildLocked(*cur, 0, order);
      if (first == 0) break;
      cur = GetLocked(first);
    }
    if (!cur->is_dir) return cur->ino;
  }
  return 0;
}

Status View::InfoJson(const Node& n, FileLayout* out, uint64_t* size_only) const {
  const Node* dir = Get(n.parent);
  std::vector<TensorId> ids;
  for (uint64_t ino : dir->children) {
    const Node* c = Get(ino);
    if (c->name.size() > 4 && c->name.compare(c->name.size() - 4, 4, ".raw") == 0 && !c->vocab_padding) {
      ids.push_back(c->tensor);
    }
  }
  FileLayout l;
  // Sizing only (`size_only` given): the bytes are counted there, and no
  // layout is made.
  // `rows`: the hash is of those rows only (a padded vocabulary's).
  auto emit = [&](std::string& literal, const TensorId* hash, const Box* rows = nullptr) {
    if (size_only != nullptr) {
      *size_only += literal.size() + (hash != nullptr ? 16 : 0);
    } else {
      l.Add(LiteralSegment(literal));
      if (hash != nullptr) {
        Segment h;
        h.kind = SegmentKind::kHash;
        h.size = 16;
        h.tensor = *hash;
        if (rows != nullptr) h.boxes = {*rows};
        l.Add(h);
      }
    }
    literal.clear();
  };
  // The JSON is written by hand: around the hash placeholders, so that each
  // hash lands at a known offset as a kHash segment, and throughout, because
  // `ls -l` sizes every info.json of a fresh mount (this runs once for each).
  // Each tensor's object is the compact JSON nlohmann writes, fields in this
  // order.
  std::string text = "{\n  \"fqn\": " + JsonEscape(index_.tensors()[n.tensor.v].fqn) + ",\n  \"tensors\": {";
  bool first = true;
  for (TensorId id : ids) {
    const TensorRecord& t = index_.tensors()[id.v];
    std::string body = "{\"key\":" + JsonEscape(t.key);
    body += ",\"role\":\"";
    body += RoleName(t.role);
    body += "\",\"dtype\":\"";
    body += DTypeName(t.dtype);
    body += "\",\"npy_dtype\":\"";
    body += DTypeName(NpyDType(t.dtype));
    body += "\",\"shape\":";
    AppendJsonInts(body, t.VocabShape());
    body += ",\"bytes\":" + std::to_string(t.VocabPadded()
                                               ? static_cast<uint64_t>(NumelOf(t.VocabShape())) * DTypeSize(t.dtype)
                                               : t.byte_size);
    if (!t.error.empty()) body += ",\"error\":" + JsonEscape(t.error);
    if (!t.derived.empty()) body += ",\"derived\":" + JsonEscape(t.derived);
    if (t.replicas > 1)
      body += ",\"mean_of_copies\":" + std::to_string(t.replicas);  // sum(copies) / n, as ds_to_universal.py averages
    body += ",\"fragments\":[";
    if (t.error.empty() && size_only != nullptr) {
      *size_only += t.fragments_json_bytes;
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
    const Box vocab = t.VocabBox(false);
    emit(text, &id, t.VocabPadded() ? &vocab : nullptr);
    text = "\"}";
    if (t.VocabPadded()) {
      // The rows the tensor-parallel layout padded the vocabulary with.
      const Box pad = t.VocabBox(true);
      text = "\", \"vocab_padding\": {\"file\": " + JsonEscape(PathComponent(t.state) + ".vocab_padding.npy") +
             ", \"rows\": " + std::to_string(pad.lengths[0]) + ", \"stored_shape\": ";
      AppendJsonInts(text, t.shape);
      text += ", \"xxh3_64_raw\": \"";
      emit(text, &id, &pad);
      text = "\"}}";
    }
  }
  text += "\n  }\n}\n";
  emit(text, nullptr);
  if (out != nullptr) *out = std::move(l);
  return Status::Ok();
}

Result<const FileLayout*> View::Layout(uint64_t ino) const {
  const Node* n = Get(ino);
  if (n == nullptr || n->is_dir) return NotFound("no such file");
  if (n->lazy == Node::Lazy::kNo) return n->layout.get();
  std::lock_guard<std::mutex> lock(lazy_mu_);
  // Nodes never move: the one Get found is written here, under lazy_mu_.
  Node* m = const_cast<Node*>(n);
  if (!m->made) {
    auto l = std::make_unique<FileLayout>();
    if (m->lazy == Node::Lazy::kInfo) {
      RETURN_IF_ERROR(InfoJson(*m, l.get(), nullptr));
    } else {
      *l = TensorFileLayout(*m);
    }
    m->layout = std::move(l);
    m->made = true;
  }
  return m->layout.get();
}

Result<uint64_t> View::Size(uint64_t ino) const {
  const Node* n = Get(ino);
  if (n == nullptr || n->is_dir) return NotFound("no such file");
  if (n->lazy == Node::Lazy::kNo) return n->layout->size;
  if (n->lazy != Node::Lazy::kInfo) {
    // From the record alone, with no lock and nothing kept: `ls -l` of a
    // 300k-file tree sizes every one.
    const TensorRecord& t = index_.tensors()[n->tensor.v];
    const Box rows = t.VocabBox(n->vocab_padding);
    if (n->lazy == Node::Lazy::kRaw) return RowsSeg(n->tensor, t, t.dtype, rows).size;
    const DType npy = NpyDType(t.dtype);
    ASSIGN_OR_RETURN(std::string header, formats::NpyHeader(npy, rows.lengths));
    return header.size() + RowsSeg(n->tensor, t, npy, rows).size;
  }
  std::lock_guard<std::mutex> lock(lazy_mu_);
  Node* m = const_cast<Node*>(n);
  if (m->made) return m->layout->size;
  if (m->lazy_size == UINT64_MAX) {
    uint64_t size = 0;
    RETURN_IF_ERROR(InfoJson(*m, nullptr, &size));
    m->lazy_size = size;
  }
  return m->lazy_size;
}

}  // namespace ckptfs
