// The DCP reader's entry points and its order of steps: find the saves, read
// their metadata, locate and resolve every chunk's item, check the tiling and
// read the step. dcp_internal.h says which file holds each step.
#include "formats/dcp/dcp_reader.h"

#include <re2/re2.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "formats/byte_reader.h"
#include "formats/dcp/dcp_internal.h"
#include "formats/pickle.h"
#include "formats/state_dict_roles.h"
#include "formats/torch_file.h"
#include "formats/torch_save.h"

namespace ckptfs::formats::dcp {
namespace {

// The training step, from the usual keys or the directory name; -1 if unknown.
int64_t FindStep(const std::string& dir, const Checkpoint& ck, const OpenFiles& files) {
  for (const char* key : {"train_state.step", "step", "iteration", "global_step", "train_state.iteration"}) {
    for (size_t i = 0; i < ck.tensors.size(); ++i) {
      const TensorRecord& t = ck.tensors[i];
      if (t.key != key || !t.error.empty() || ck.fragments.Count(i) != 1) continue;
      const Fragment f = ck.fragments.Get(i)[0];
      int fd = files.fds[f.file.v];
      if (fd < 0) continue;
      if (t.encoding == Encoding::kBytes && f.compression == Compression::kNone) {
        FileSliceReader r(fd, f.data_offset, f.data_length, t.key);
        auto a = ReadTorchSave(r);
        if (a.ok() && a->root->kind == PyKind::kInt) return a->root->i;
      } else if (t.encoding == Encoding::kTensor && t.shape.empty() && f.compression == Compression::kNone) {
        char buf[8] = {};
        size_t n = DTypeSize(t.dtype);
        if (n == 0 || n > 8 || ::pread(fd, buf, n, static_cast<off_t>(f.data_offset)) != static_cast<ssize_t>(n))
          continue;
        if (t.dtype == DType::kI64) return LoadLE<int64_t>(buf);
        if (t.dtype == DType::kI32) return LoadLE<int32_t>(buf);
        if (t.dtype == DType::kF32) return static_cast<int64_t>(LoadLE<float>(buf));
        if (t.dtype == DType::kF64) return static_cast<int64_t>(LoadLE<double>(buf));
      }
    }
  }
  std::string base = dir;
  while (!base.empty() && base.back() == '/') base.pop_back();
  base = base.substr(base.rfind('/') + 1);
  static const RE2 kStepRe(R"((?:step|global_step|iter|checkpoint)[-_]?0*([0-9]+)$)");
  int64_t step = -1;
  if (RE2::PartialMatch(base, kStepRe, &step)) return step;
  return -1;
}

// Lightning's sharded checkpoints (Trainer with ModelParallelStrategy or FSDP
// sharded state dicts, Fabric) keep the loop state beside the DCP files in
// meta.pt: {global_step, epoch, loops, callbacks, ...}. Served as
// other/meta.pt; its global_step is the checkpoint's step.
void ReadLightningMeta(DcpReader& r) {
  const std::string prefix = r.saves.size() == 1 ? r.saves[0].prefix : "";
  if (r.saves.size() == 1 && !r.saves[0].others.empty()) {
    std::string names;
    for (size_t i = 0; i < r.saves[0].others.size() && i < 8; ++i) names += (i ? ", " : "") + r.saves[0].others[i];
    if (r.saves[0].others.size() > 8) names += ", ...";
    r.ck.info.problems.push_back(r.dir + " is a folder of " + std::to_string(r.saves[0].others.size() + 1) +
                                 " Lightning checkpoints: this mount reads the latest, " +
                                 prefix.substr(0, prefix.size() - 1) + "; the others (" + names +
                                 ") are read by mounting them");
  }
  struct stat st {};
  if (::lstat((r.dir + "/" + prefix + "meta.pt").c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return;
  Files files;
  files.dir = r.dir;
  files.ck = &r.ck;
  auto src = files.Open(prefix + "meta.pt");
  const PyValue* root = src->error.empty() ? src->root() : nullptr;
  if (root != nullptr && root->kind == PyKind::kDict) {
    if (const PyValue* g = root->Get("global_step"); g != nullptr && g->kind == PyKind::kInt) r.ck.info.step = g->i;
  } else if (!src->error.empty()) {
    r.ck.info.problems.push_back(src->error);
  }
  TensorRecord t;
  t.key = "meta.pt";
  if (src->fd < 0) t.error = src->error;
  r.ck.AddFileBytes(src->file, std::move(t));
}

// What follows from the finished records: each entry's state-dict role, the
// world size (from the data files' names) and the training step.
void Conclude(DcpReader& r) {
  Checkpoint& ck = r.ck;
  ClassifyStateDict(ck.tensors, r.paths);
  r.paths.clear();

  static const RE2 kRankRe(R"(__([0-9]+)_[0-9]+(?:\.distcp)?)");
  for (const auto& f : ck.files) {
    uint32_t rank = 0;
    if (RE2::FullMatch(f.rel_path.substr(f.rel_path.rfind('/') + 1), kRankRe, &rank) && rank < UINT32_MAX) {
      ck.info.world_size = std::max<uint32_t>(ck.info.world_size, rank + 1);
    }
  }
  ck.info.step = FindStep(r.dir, ck, r.files);
  ReadLightningMeta(r);
}

}  // namespace
}  // namespace ckptfs::formats::dcp

namespace ckptfs::formats {

bool LooksLikeDcp(const std::string& dir) { return !dcp::FindSaves(dir).empty(); }

Result<Checkpoint> ReadDcp(const std::string& dir) {
  std::vector<dcp::DcpSave> saves = dcp::FindSaves(dir);
  if (saves.empty()) return NotFound("cannot read " + dir + ": no .metadata and no __<rank>.metadata");
  dcp::DcpReader r(dir, std::move(saves));
  RETURN_IF_ERROR(r.ReadMetadata());
  r.NoteRankLocalSaves();
  if (!r.resolved) r.Resolve();
  dcp::Conclude(r);
  return std::move(r.ck);
}

}  // namespace ckptfs::formats
