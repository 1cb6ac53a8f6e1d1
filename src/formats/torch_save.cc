#include "formats/torch_save.h"

namespace ckptfs::formats {

Result<TorchSaveArchive> ReadTorchSave(const ByteReader& r, const PickleOptions& opts) {
  TorchSaveArchive a;
  ASSIGN_OR_RETURN(a.zip, ReadZipDirectory(r));
  if (a.zip.entries.empty()) return Invalid("cannot read torch.save archive " + r.Describe() + ": empty zip");
  const std::string& first = a.zip.entries.front().name;
  size_t slash = first.find('/');
  if (slash == std::string::npos) {
    return Invalid("cannot read torch.save archive " + r.Describe() + ": entries have no top folder");
  }
  a.prefix = first.substr(0, slash);
  const ZipEntry* pkl = a.zip.Find(a.prefix + "/data.pkl");
  if (pkl == nullptr) return Invalid("cannot read torch.save archive " + r.Describe() + ": no data.pkl");
  if (pkl->size > (256u << 20))
    return Invalid("cannot read torch.save archive " + r.Describe() + ": data.pkl too large");
  ASSIGN_OR_RETURN(uint64_t off, ZipDataOffset(r, *pkl));
  ASSIGN_OR_RETURN(std::string bytes, r.ReadAt(off, pkl->size));
  ASSIGN_OR_RETURN(a.root, Unpickle(bytes, r.Describe() + " data.pkl", opts, &a.placeholders));
  return a;
}

Result<ResolvedTensor> ResolveTensor(const ByteReader& r, const TorchSaveArchive& a, const TensorRef& t) {
  auto bad = [&](const std::string& why) {
    return Invalid("cannot resolve tensor in " + r.Describe() + " (storage " + t.storage_key + "): " + why);
  };
  const ZipEntry* rec = a.zip.Find(a.prefix + "/data/" + t.storage_key);
  if (rec == nullptr) return bad("no record data/" + t.storage_key);
  ASSIGN_OR_RETURN(uint64_t off, ZipDataOffset(r, *rec));
  const uint64_t esize = DTypeSize(t.dtype);
  if (esize == 0) return bad("unsupported dtype");
  // Highest element index the view reaches (strides are non-negative).
  uint64_t numel = 1, last = 0;
  for (size_t d = 0; d < t.shape.size(); ++d) {
    uint64_t n = static_cast<uint64_t>(t.shape[d]), term;
    if (MulOverflow(numel, n, &numel)) return bad("size overflows");
    if (n > 0 && (MulOverflow(n - 1, static_cast<uint64_t>(t.strides[d]), &term) || AddOverflow(last, term, &last))) {
      return bad("strides overflow");
    }
  }
  uint64_t skip, need;
  if (MulOverflow(t.storage_offset, esize, &skip)) return bad("offset overflows");
  if (numel > 0) {
    uint64_t span;
    if (MulOverflow(last + 1, esize, &span) || AddOverflow(skip, span, &need)) return bad("extent overflows");
    if (need > rec->size) {
      return bad("view needs " + std::to_string(need) + " bytes but the record holds " + std::to_string(rec->size));
    }
  } else if (skip > rec->size) {
    return bad("storage offset past the record");
  }
  return ResolvedTensor{off + skip, rec->size - skip};
}

void AppendZipChecksums(const ByteReader& r, const TorchSaveArchive& a, FileId file, uint64_t base,
                        std::vector<ChecksumRange>* out) {
  for (const ZipEntry& e : a.zip.entries) {
    if (e.method != 0) continue;
    auto off = ZipDataOffset(r, e);
    if (!off.ok()) continue;  // refused again, with its reason, when a tensor needs it
    out->push_back(ChecksumRange{file, base + *off, e.size, e.crc32, e.name});
  }
}

}  // namespace ckptfs::formats
