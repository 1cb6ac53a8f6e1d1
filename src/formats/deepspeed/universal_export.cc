// The universal/ tree ds_to_universal.py would write, laid out as export
// files over the source bytes: zero/<param>/<state>.pt archives (written with
// the torch.save writer), zero/optimizer_state.pt without the sharded entries,
// and verbatim copies of the model-states files. Contract: nothing is copied
// at index time; every archive's tensor data is an existing record.
#include <map>
#include <set>
#include <string>
#include <vector>

#include "ckptfs/geometry.h"
#include "formats/deepspeed/ds_internal.h"
#include "formats/pickle_writer.h"
#include "formats/torch_file.h"
#include "formats/torch_save.h"
#include "formats/torch_save_writer.h"

namespace ckptfs::formats::deepspeed {

// One torch.save archive `zero/<name>/<state>.pt` with a dict (or, for
// ZeRO-3, a bare flat tensor), the way ds_to_universal.py saves it. The
// dict's extra keys follow the merge rule; a replicated rule adds none, which
// is also the form of the fp32.pt written from module entries.
Status Reader::ExportState(const std::string& name, const std::string& state, uint32_t tensor, const Rule& rule,
                           bool dict) {
  const TensorRecord& t = ck.tensors[tensor];
  PickleWriter w;
  // A padded vocabulary is cut to original_vocab_size, as ds_to_universal.py does.
  std::vector<int64_t> shape = t.VocabShape();
  const uint64_t numel = static_cast<uint64_t>(NumelOf(shape));
  if (!dict) shape = {static_cast<int64_t>(numel)};
  if (dict) {
    w.BeginDict();
    if (rule.kind == Merge::kCat || rule.kind == Merge::kSub2) {
      w.Str("cat_dim");
      w.Int(rule.kind == Merge::kSub2 ? 0 : rule.cat_dim);
    }
    if (rule.kind == Merge::kSub2) {
      w.Str("param_n_sub_params");
      w.Int(2);
    }
    if (rule.kind == Merge::kSubParams) {
      w.Str("sub_param_shape");
      RETURN_IF_ERROR(patterns->WriteSubparamShape(w, name, rule));
    }
    if (rule.vocab) {
      w.Str("vocab_tensor");
      w.Bool(true);
    }
    w.Str("param");
  }
  RETURN_IF_ERROR(w.Tensor("0", DType::kF32, numel, 0, shape, ContiguousStrides(shape)));
  if (dict) w.EndDict();
  std::vector<Box> boxes;
  if (t.VocabPadded()) boxes.push_back(t.VocabBox(false));
  AddArchive("universal/zero/" + name + "/" + state + ".pt", state, w.Finish(),
             {ArchiveStorage{tensor, DType::kF32, numel * 4, std::move(boxes)}});
  return Status::Ok();
}

void Reader::AddArchive(const std::string& path, const std::string& stem, const std::string& pickle,
                        const std::vector<ArchiveStorage>& storages) {
  ExportFile x;
  x.path = path;
  x.parts = TorchSaveParts(stem, pickle, storages);
  ck.exports.push_back(std::move(x));
}

// universal/zero/optimizer_state.pt: rank (dp 0, tp 0)'s optimizer_state_dict
// without the sharded entries, plus param_groups (ZeRO-3: all of it).
Status Reader::ExportOptimizerState() {
  if (optim.empty() || optim[0].empty()) return Invalid("no optimizer state files");
  const OptimRank& o = optim[0][0];
  if (!o.error.empty()) return Invalid(o.error);
  const PyValue* osd = o.osd;
  PickleWriter w;
  std::vector<ArchiveStorage> storages;
  std::map<std::string, size_t> storage_slot;
  Status tensor_status;
  auto tensor_fn = [&](PickleWriter& pw, const PyValue& v) -> Status {
    // The whole source storage becomes one record of the new archive.
    const TensorRef& ref = v.tensor();
    auto [it, inserted] = storage_slot.emplace(ref.storage_key, storages.size());
    const ZipEntry* e = o.src->archive.zip.Find(o.src->archive.prefix + "/data/" + ref.storage_key);
    if (e == nullptr) return Invalid(o.src->rel + ": no record for storage " + ref.storage_key);
    const uint64_t storage_numel = e->size / DTypeSize(ref.dtype);
    if (inserted) {
      TensorRef whole = ref;
      whole.storage_offset = 0;
      whole.shape = {static_cast<int64_t>(storage_numel)};
      whole.strides = {1};
      ASSIGN_OR_RETURN(ResolvedTensor rt, ResolveTensor(*o.src->reader, o.src->archive, whole));
      TensorRecord rec;
      rec.key = o.src->rel + " storage " + ref.storage_key;
      rec.role = Role::kHidden;
      rec.encoding = Encoding::kBytes;
      rec.dtype = DType::kU8;
      rec.byte_size = storage_numel * DTypeSize(ref.dtype);
      Fragment f;
      f.file = o.src->file;
      f.dtype = DType::kU8;
      f.data_offset = rt.data_offset;
      f.data_length = rec.byte_size;
      storages.push_back(ArchiveStorage{
          ck.AddTensor(std::move(rec), {std::move(f)}), DType::kU8, storage_numel * DTypeSize(ref.dtype), {}});
    }
    return pw.Tensor(std::to_string(it->second), ref.dtype, storage_numel, ref.storage_offset, ref.shape, ref.strides);
  };
  w.BeginDict();
  static const std::set<std::string> kSharded = {"base_optimizer_state", "param_slice_mappings",
                                                 "single_partition_of_fp32_groups"};
  for (const auto& [k, v] : osd->dict) {
    if (stage != 3 && k->IsStr() && kSharded.count(k->s)) continue;
    if (k->IsStr() && k->s == "param_groups") continue;
    RETURN_IF_ERROR(w.Value(*k, tensor_fn));
    RETURN_IF_ERROR(w.Value(*v, tensor_fn));
  }
  const PyValue* groups =
      stage == 3 ? (osd->Get("optimizer_state_dict") ? osd->Get("optimizer_state_dict")->Get("param_groups") : nullptr)
                 : (osd->Get("base_optimizer_state") ? osd->Get("base_optimizer_state")->Get("param_groups") : nullptr);
  if (groups == nullptr) return Invalid(o.src->rel + ": no param_groups");
  w.Str("param_groups");
  RETURN_IF_ERROR(w.Value(*groups, tensor_fn));
  w.EndDict();
  AddArchive("universal/zero/optimizer_state.pt", "optimizer_state", w.Finish(), storages);
  return Status::Ok();
}

// Verbatim copies of the mp_rank_* model-states files (ds_to_universal copies
// them; DeepSpeed's universal loader reads client state from them).
void Reader::ExportCopies() {
  std::vector<const Source*> sources;
  for (const ModelStates& m : models) sources.push_back(m.src.get());
  for (const auto& z : z3_copies) sources.push_back(z.get());
  for (const Source* sp : sources) {
    const Source& s = *sp;
    if (!s.error.empty()) continue;
    const std::string base = s.rel.substr(s.rel.rfind('/') + 1);
    TensorRecord rec;
    rec.key = s.rel;
    rec.role = Role::kHidden;
    const uint64_t size = ck.files[s.file.v].size;
    uint32_t id = ck.AddFileBytes(s.file, std::move(rec));
    ExportFile x;
    x.path = "universal/" + base;
    x.parts.push_back(ExportPart{PartKind::kTensor, "", id, DType::kU8, size, {}});
    ck.exports.push_back(std::move(x));
  }
}

}  // namespace ckptfs::formats::deepspeed
