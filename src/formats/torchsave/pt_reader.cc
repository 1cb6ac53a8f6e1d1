#include "formats/torchsave/pt_reader.h"

#include <re2/re2.h>

#include <algorithm>
#include <map>

#include "formats/byte_reader.h"
#include "formats/state_dict_roles.h"
#include "formats/torch_file.h"
#include "formats/torchsave/meta_consolidated.h"
#include "formats/torchsave/state_walk.h"

namespace ckptfs::formats {
namespace {

const RE2& ArchiveRe() {
  static const RE2 re(R"([^.].*\.(?:pt|pth|bin|ckpt))");
  return re;
}
// Trainer / Accelerate bookkeeping beside the weights: not model state.
const RE2& BookkeepingRe() {
  static const RE2 re(R"((?:rng_state.*|random_states.*|training_args|scheduler.*|scaler.*|lr_scheduler.*|)"
                      R"(extra_state_world_size_.*)\.(?:pt|pth|bin|pkl))");
  return re;
}
const RE2& OptimizerRe() {
  static const RE2 re(R"((?:optimizer|optim)(?:_[0-9]+)?\.(?:pt|pth|bin))");
  return re;
}
const RE2& ConsolidatedRe() {
  static const RE2 re(R"(consolidated\.[0-9]+\.pth)");
  return re;
}

std::vector<std::string> Archives(const std::string& dir) {
  std::vector<std::string> out;
  for (const std::string& n : ListDirectory(dir)) {
    if (RE2::FullMatch(n, ArchiveRe()) && !RE2::FullMatch(n, BookkeepingRe())) out.push_back(n);
  }
  return out;
}

int64_t StepOf(const std::string& dir, const std::vector<const PyValue*>& roots) {
  for (const PyValue* r : roots) {
    if (r == nullptr || r->kind != PyKind::kDict) continue;
    for (const char* k : {"step", "global_step", "iteration", "epoch_step"}) {
      const PyValue* v = r->Get(k);
      if (v != nullptr && v->kind == PyKind::kInt) return v->i;
    }
  }
  return TrainerStateStep(dir);
}

}  // namespace

bool LooksLikeTorchSaveDir(const std::string& dir) { return !Archives(dir).empty(); }

Result<Checkpoint> ReadTorchSaveDir(const std::string& dir) {
  std::vector<std::string> names = Archives(dir);
  // Model archives first, then optimizer ones (listing order of params/).
  std::stable_partition(names.begin(), names.end(),
                        [](const std::string& n) { return !RE2::FullMatch(n, OptimizerRe()); });
  if (names.empty()) return NotFound("cannot read " + dir + ": no torch.save archive (.pt, .pth, .bin)");
  std::vector<std::string> consolidated;
  for (const std::string& n : names) {
    if (RE2::FullMatch(n, ConsolidatedRe())) consolidated.push_back(n);
  }
  if (consolidated.size() > 1) {
    if (consolidated.size() != names.size()) {
      return Invalid("cannot read " + dir + ": Meta model-parallel consolidated.NN.pth shards beside other archives");
    }
    return ReadMetaConsolidated(dir, std::move(consolidated));
  }
  Checkpoint ck;
  ck.info.family = Family::kTorchSave;
  Files files;
  files.dir = dir;
  files.ck = &ck;
  std::vector<std::unique_ptr<Source>> sources;
  std::vector<const PyValue*> roots;
  std::vector<Leaf> leaves;
  std::vector<uint32_t> leaf_source;
  size_t skipped = 0;
  bool too_deep = false;
  for (const std::string& n : names) {
    sources.push_back(files.Open(n));
    Source& s = *sources.back();
    if (!s.error.empty()) {
      ck.info.Flag(Check::kCoverage, Severity::kError, "", n, s.error);
      continue;
    }
    roots.push_back(s.root());
    std::vector<std::string> path;
    if (RE2::FullMatch(n, OptimizerRe())) path.push_back("optimizer");  // optimizer.bin: {"state", "param_groups"}
    const size_t before = leaves.size();
    WalkStateDict(s.root(), path, leaves, &skipped, &too_deep);
    leaf_source.resize(leaves.size(), static_cast<uint32_t>(sources.size() - 1));
    if (leaves.size() == before && path.empty() && s.root()->kind != PyKind::kDict) {
      ck.info.problems.push_back(
          n + " holds no state dict (a pickled " +
          (s.root()->ClassName().empty() ? std::string("value") : std::string(s.root()->ClassName())) + "); not read");
    }
  }
  if (ck.info.findings.size() == names.size()) {
    return Invalid("cannot read " + dir + ": " + ck.info.findings[0].message);
  }

  // One record per tensor path; a path two archives both hold is refused.
  std::map<std::string, size_t> by_key;
  std::vector<std::vector<std::string>> paths;
  std::vector<std::string> record_file;  // the archive each record comes from
  for (size_t i = 0; i < leaves.size(); ++i) {
    const Leaf& leaf = leaves[i];
    const Source& s = *sources[leaf_source[i]];
    TensorRecord t;
    t.key = JoinPath(leaf.path);
    t.encoding = Encoding::kTensor;
    if (auto [it, inserted] = by_key.emplace(t.key, ck.tensors.size()); !inserted) {
      TensorRecord& first = ck.tensors[it->second];
      if (first.error.empty()) {
        first.error =
            "cannot index '" + t.key + "': it is in two archives (" + record_file[it->second] + " and " + s.rel + ")";
        ck.info.Flag(Check::kCoverage, Severity::kError, t.key, s.rel, first.error);
      }
      continue;
    }
    const bool piece = IsDTensor(leaf.v) || IsShardedTensor(leaf.v);
    auto loc = piece ? Result<Loc>(Unsupported("cannot read " + s.rel + ": '" + t.key + "' is a " +
                                               (IsDTensor(leaf.v) ? "DTensor" : "ShardedTensor") +
                                               ", one rank's shard of a tensor; no rank-file layout this archive "
                                               "belongs to is known (verl: model_world_size_W_rank_R.pt, Accelerate: "
                                               "pytorch_model_fsdp_0_rank<R>.bin)"))
                     : Resolve(s, leaf.v, s.rel + " '" + t.key + "'");
    ck.fragments.Resize(ck.tensors.size() + 1);
    if (!loc.ok()) {
      t.error = loc.status().message();
      t.dtype = leaf.v->kind == PyKind::kTensor ? leaf.v->tensor().dtype : DType::kU8;
      t.shape.assign(1, 0);
    } else {
      t.dtype = loc->dtype;
      t.shape = loc->shape;
      t.byte_size = t.Numel() * DTypeSize(t.dtype);
      ck.fragments.Set(ck.tensors.size(), {WholeFragment(*loc, s.file)});
      t.num_fragments = 1;
    }
    paths.push_back(leaf.path);
    record_file.push_back(s.rel);
    ck.tensors.push_back(std::move(t));
  }
  for (size_t i = 0; i < ck.tensors.size(); ++i) {
    if (!ck.tensors[i].error.empty()) {
      ck.fragments.Clear(i);
      ck.tensors[i].num_fragments = 0;
    }
  }
  ClassifyStateDict(ck.tensors, paths);
  if (skipped > 0) {
    ck.info.problems.push_back(std::to_string(skipped) +
                               " non-tensor entries (param_groups, counters, strings) are not shown");
  }
  if (too_deep) ck.info.problems.push_back("entries nested deeper than 32 levels are not shown");
  if (std::string note = files.PlaceholderNote(); !note.empty()) ck.info.problems.push_back(std::move(note));
  std::string list;
  for (size_t i = 0; i < names.size() && i < 4; ++i) list += (i ? ", " : "") + names[i];
  if (names.size() > 4) list += ", ...";
  ck.info.format_note = "torch.save archive" + std::string(names.size() > 1 ? "s" : "") + ": " + list;
  ck.info.step = StepOf(dir, roots);
  return ck;
}

}  // namespace ckptfs::formats
