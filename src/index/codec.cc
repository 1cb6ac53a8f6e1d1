#include "index/codec.h"

#include <vector>

#include "ckptfs/formats.h"

namespace ckptfs::index {
namespace {

class Writer {
 public:
  template <typename T>
  void Num(T v) {
    char b[sizeof(T)];
    StoreLE(b, v);
    out_.append(b, sizeof(T));
  }
  void Str(std::string_view s) {
    Num<uint32_t>(static_cast<uint32_t>(s.size()));
    out_.append(s);
  }
  void Ints(const std::vector<int64_t>& v) {
    Num<uint32_t>(static_cast<uint32_t>(v.size()));
    for (int64_t x : v) Num<int64_t>(x);
  }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(std::string_view s) : s_(s) {}
  template <typename T>
  bool Num(T* v) {
    if (s_.size() < sizeof(T)) return false;
    *v = LoadLE<T>(s_.data());
    s_.remove_prefix(sizeof(T));
    return true;
  }
  bool Str(std::string* v) {
    uint32_t n;
    if (!Num(&n) || s_.size() < n) return false;
    v->assign(s_.substr(0, n));
    s_.remove_prefix(n);
    return true;
  }
  bool Ints(std::vector<int64_t>* v) {
    uint32_t n;
    if (!Num(&n) || s_.size() / 8 < n) return false;
    v->resize(n);
    for (auto& x : *v) Num(&x);
    return true;
  }
  bool Done() const { return s_.empty(); }

 private:
  std::string_view s_;
};

template <typename E>
bool Enum(Reader& r, E* e, uint8_t max) {
  uint8_t v;
  if (!r.Num(&v) || v > max) return false;
  *e = static_cast<E>(v);
  return true;
}

Status Corrupt(const std::string& what) { return Invalid("cannot decode index record: corrupt " + what); }

}  // namespace

std::string EncodeFile(const SourceFile& f) {
  Writer w;
  w.Str(f.rel_path);
  w.Num(f.size);
  w.Num(f.mtime_ns);
  w.Num(f.inode);
  w.Num(f.ctime_ns);
  return w.Take();
}

Result<SourceFile> DecodeFile(std::string_view s) {
  Reader r(s);
  SourceFile f;
  if (!r.Str(&f.rel_path) || !r.Num(&f.size) || !r.Num(&f.mtime_ns) || !r.Num(&f.inode) || !r.Num(&f.ctime_ns) ||
      !r.Done()) {
    return Corrupt("file");
  }
  return f;
}

std::string EncodeTensor(const TensorRecord& t) {
  Writer w;
  w.Str(t.key);
  w.Num(static_cast<uint8_t>(t.role));
  w.Str(t.fqn);
  w.Str(t.state);
  w.Num(static_cast<uint8_t>(t.encoding));
  w.Num(static_cast<uint8_t>(t.dtype));
  w.Ints(t.shape);
  w.Num(t.byte_size);
  w.Num(t.num_fragments);
  w.Str(t.error);
  w.Num<uint8_t>(t.alias ? 1 : 0);
  w.Str(t.derived);
  w.Num<uint8_t>(t.raw_bytes ? 1 : 0);
  w.Num(static_cast<uint8_t>(t.split.kind));
  w.Num(t.split.dim);
  w.Num(t.split.groups);
  w.Num<uint8_t>(t.split.pad_rows ? 1 : 0);
  w.Num(t.replicas);
  w.Num(t.fragments_json_bytes);
  w.Num(t.vocab_rows);
  return w.Take();
}

Result<TensorRecord> DecodeTensor(std::string_view s) {
  Reader r(s);
  TensorRecord t;
  if (!r.Str(&t.key) || !Enum(r, &t.role, 3) || !r.Str(&t.fqn) || !r.Str(&t.state) || !Enum(r, &t.encoding, 1) ||
      !Enum(r, &t.dtype, static_cast<uint8_t>(DType::kF8E5M2FNUZ)) || !r.Ints(&t.shape) || !r.Num(&t.byte_size) ||
      !r.Num(&t.num_fragments) || !r.Str(&t.error)) {
    return Corrupt("tensor");
  }
  uint8_t alias = 0;
  uint8_t raw = 0;
  if (!r.Num(&alias) || alias > 1 || !r.Str(&t.derived) || !r.Num(&raw) || raw > 1 ||
      !Enum(r, &t.split.kind, static_cast<uint8_t>(SplitKind::kSub2)) || !r.Num(&t.split.dim) ||
      !r.Num(&t.split.groups)) {
    return Corrupt("tensor");
  }
  uint8_t pad = 0;
  if (!r.Num(&pad) || pad > 1 || !r.Num(&t.replicas) || t.replicas == 0 || !r.Num(&t.fragments_json_bytes) ||
      !r.Num(&t.vocab_rows) || t.vocab_rows < -1 ||
      (t.vocab_rows >= 0 && (t.shape.empty() || t.vocab_rows > t.shape[0])) || !r.Done()) {
    return Corrupt("tensor");
  }
  t.split.pad_rows = pad == 1;
  t.alias = alias == 1;
  t.raw_bytes = raw == 1;
  return t;
}

std::string EncodeFragment(const Fragment& f) {
  Writer w;
  w.Num(f.file.v);
  w.Ints(f.offsets);
  w.Ints(f.lengths);
  w.Ints(f.strides);
  w.Num(static_cast<uint8_t>(f.dtype));
  w.Num(f.data_offset);
  w.Num(f.data_length);
  w.Num(static_cast<uint8_t>(f.compression));
  w.Num(f.item_offset);
  w.Num(f.item_length);
  w.Num(f.inner_offset);
  w.Num(f.inner_length);
  w.Num(f.replica);
  return w.Take();
}

Result<Fragment> DecodeFragment(std::string_view s) {
  Reader r(s);
  Fragment f;
  if (!r.Num(&f.file.v) || !r.Ints(&f.offsets) || !r.Ints(&f.lengths) || !r.Ints(&f.strides) ||
      !Enum(r, &f.dtype, static_cast<uint8_t>(DType::kF8E5M2FNUZ)) || !r.Num(&f.data_offset) ||
      !r.Num(&f.data_length) || !Enum(r, &f.compression, 2) || !r.Num(&f.item_offset) || !r.Num(&f.item_length) ||
      !r.Num(&f.inner_offset) || !r.Num(&f.inner_length) || !r.Num(&f.replica) || !r.Done()) {
    return Corrupt("fragment");
  }
  return f;
}

std::string EncodeInfo(const CheckpointInfo& i) {
  Writer w;
  w.Str(std::string(FamilyName(i.family)));  // by name: ids may be renumbered, names are checkpoint.json's
  w.Str(i.format_note);
  w.Num(i.step);
  w.Num(i.world_size);
  w.Str(i.topology);
  w.Num<uint32_t>(static_cast<uint32_t>(i.problems.size()));
  for (const auto& p : i.problems) w.Str(p);
  w.Num<uint32_t>(static_cast<uint32_t>(i.findings.size()));
  for (const Finding& f : i.findings) {
    w.Num(static_cast<uint8_t>(f.check));
    w.Num(static_cast<uint8_t>(f.severity));
    w.Str(f.tensor);
    w.Str(f.file);
    w.Str(f.message);
    w.Str(f.detail);
  }
  return w.Take();
}

Result<CheckpointInfo> DecodeInfo(std::string_view s) {
  Reader r(s);
  CheckpointInfo i;
  uint32_t n;
  std::string family;
  if (!r.Str(&family) || !r.Str(&i.format_note) || !r.Num(&i.step) || !r.Num(&i.world_size) || !r.Str(&i.topology) ||
      !r.Num(&n)) {
    return Corrupt("checkpoint info");
  }
  if (auto id = FamilyFromName(family); id.has_value()) {
    i.family = *id;
  } else if (family != FamilyName(Family::kUnknown)) {
    return Corrupt("checkpoint info (family '" + family + "')");  // written by another build: rebuilt
  }
  for (uint32_t k = 0; k < n; ++k) {
    std::string p;
    if (!r.Str(&p)) return Corrupt("checkpoint info");
    i.problems.push_back(std::move(p));
  }
  if (!r.Num(&n)) return Corrupt("checkpoint info");
  for (uint32_t k = 0; k < n; ++k) {
    Finding f;
    if (!Enum(r, &f.check, static_cast<uint8_t>(Check::kMaster)) ||
        !Enum(r, &f.severity, static_cast<uint8_t>(Severity::kWarning)) || !r.Str(&f.tensor) || !r.Str(&f.file) ||
        !r.Str(&f.message) || !r.Str(&f.detail)) {
      return Corrupt("checkpoint info");
    }
    i.findings.push_back(std::move(f));
  }
  if (!r.Done()) return Corrupt("checkpoint info");
  return i;
}

std::string EncodeExport(const ExportFile& x) {
  Writer w;
  w.Str(x.path);
  w.Num<uint32_t>(static_cast<uint32_t>(x.parts.size()));
  for (const ExportPart& p : x.parts) {
    w.Num(static_cast<uint8_t>(p.kind));
    w.Str(p.literal);
    w.Num(p.tensor);
    w.Num(static_cast<uint8_t>(p.out_dtype));
    w.Num(p.size);
    w.Num<uint32_t>(static_cast<uint32_t>(p.boxes.size()));
    for (const Box& b : p.boxes) {
      w.Ints(b.offsets);
      w.Ints(b.lengths);
    }
  }
  return w.Take();
}

Result<ExportFile> DecodeExport(std::string_view s) {
  Reader r(s);
  ExportFile x;
  uint32_t n;
  if (!r.Str(&x.path) || !r.Num(&n) || n > s.size()) return Corrupt("export");
  x.parts.resize(n);
  for (ExportPart& p : x.parts) {
    if (!Enum(r, &p.kind, 2) || !r.Str(&p.literal) || !r.Num(&p.tensor) ||
        !Enum(r, &p.out_dtype, static_cast<uint8_t>(DType::kF8E5M2FNUZ)) || !r.Num(&p.size)) {
      return Corrupt("export");
    }
    uint32_t nb = 0;
    if (!r.Num(&nb) || nb > s.size()) return Corrupt("export");
    p.boxes.resize(nb);
    for (Box& b : p.boxes) {
      if (!r.Ints(&b.offsets) || !r.Ints(&b.lengths) || b.offsets.size() != b.lengths.size()) return Corrupt("export");
    }
  }
  if (!r.Done()) return Corrupt("export");
  return x;
}

std::string KeyU32(char tag, uint32_t a) {
  std::string k(1, tag);
  for (int s = 24; s >= 0; s -= 8) k.push_back(static_cast<char>((a >> s) & 0xFF));
  return k;
}

std::string KeyU32U32(char tag, uint32_t a, uint32_t b) {
  std::string k = KeyU32(tag, a);
  for (int s = 24; s >= 0; s -= 8) k.push_back(static_cast<char>((b >> s) & 0xFF));
  return k;
}

std::string KeyU32U64(char tag, uint32_t a, uint64_t b) {
  std::string k = KeyU32(tag, a);
  for (int s = 56; s >= 0; s -= 8) k.push_back(static_cast<char>((b >> s) & 0xFF));
  return k;
}

std::string EncodeChecksum(const ChecksumRange& c) {
  Writer w;
  w.Num(c.file.v);
  w.Num(c.offset);
  w.Num(c.length);
  w.Num(c.crc32);
  w.Str(c.name);
  return w.Take();
}

Result<ChecksumRange> DecodeChecksum(std::string_view s) {
  Reader r(s);
  ChecksumRange c;
  if (!r.Num(&c.file.v) || !r.Num(&c.offset) || !r.Num(&c.length) || !r.Num(&c.crc32) || !r.Str(&c.name) || !r.Done()) {
    return Corrupt("checksum");
  }
  return c;
}

}  // namespace ckptfs::index
