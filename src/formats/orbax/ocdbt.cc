#include "formats/orbax/ocdbt.h"

#include <cstring>
#include <set>
#include <utility>

#include "common/crc32c.h"
#include "formats/zstd.h"

namespace ckptfs::formats::orbax {
namespace {

// A bounded cursor over a decoded body; every read checks what is left.
class Cursor {
 public:
  Cursor(std::string_view s, std::string what) : s_(s), what_(std::move(what)) {}
  size_t pos() const { return pos_; }
  size_t left() const { return s_.size() - pos_; }
  const std::string& what() const { return what_; }

  Status Fail(const std::string& why) const {
    return Invalid("corrupt " + what_ + " at byte " + std::to_string(pos_) + ": " + why);
  }
  Status Varint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos_ >= s_.size()) return Fail("a varint runs past the end");
      const auto b = static_cast<unsigned char>(s_[pos_++]);
      if (shift == 63 && b > 1) return Fail("a varint overflows 64 bits");
      *v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if (b < 0x80) return Status::Ok();
    }
    return Fail("a varint longer than 10 bytes");
  }
  // A varint that must be at most `max` (a count or a length).
  Status Count(uint64_t* v, uint64_t max, const char* name) {
    RETURN_IF_ERROR(Varint(v));
    if (*v > max) return Fail(std::string(name) + " " + std::to_string(*v) + " is more than " + std::to_string(max));
    return Status::Ok();
  }
  Status Byte(uint8_t* v) {
    if (pos_ >= s_.size()) return Fail("ends early");
    *v = static_cast<uint8_t>(s_[pos_++]);
    return Status::Ok();
  }
  Status Bytes(uint64_t n, std::string_view* out) {
    if (n > left()) return Fail("needs " + std::to_string(n) + " bytes, " + std::to_string(left()) + " are left");
    *out = s_.substr(pos_, n);
    pos_ += n;
    return Status::Ok();
  }
  Status Le(int bytes, uint64_t* v) {
    std::string_view b;
    RETURN_IF_ERROR(Bytes(bytes, &b));
    *v = 0;
    for (int i = bytes; i-- > 0;) *v = (*v << 8) | static_cast<unsigned char>(b[i]);
    return Status::Ok();
  }
  Status End() const { return left() == 0 ? Status::Ok() : Fail(std::to_string(left()) + " trailing bytes"); }

 private:
  std::string_view s_;
  size_t pos_ = 0;
  std::string what_;
};

// A column of n single bytes, each at most `max` (heights, value kinds).
Status ByteColumn(Cursor& c, uint64_t n, uint8_t max, const char* name, std::vector<uint64_t>* out) {
  if (n > c.left()) return c.Fail(std::string(name) + ": " + std::to_string(n) + " entries do not fit");
  out->resize(n);
  for (uint64_t i = 0; i < n; ++i) {
    uint8_t b = 0;
    RETURN_IF_ERROR(c.Byte(&b));
    if (b > max) return c.Fail(std::string(name) + " " + std::to_string(b));
    (*out)[i] = b;
  }
  return Status::Ok();
}

// A column of n varints, each at most `max`.
Status Column(Cursor& c, uint64_t n, uint64_t max, const char* name, std::vector<uint64_t>* out) {
  out->resize(n);
  for (uint64_t i = 0; i < n; ++i) RETURN_IF_ERROR(c.Count(&(*out)[i], max, name));
  return Status::Ok();
}

// A column-major array of node references (interior entries, manifest
// versions): data file id, offset, length, then the subtree statistics.
struct RefColumns {
  std::vector<uint64_t> ids, offs, lens, nkeys, ntree, nind;
};
Status ReadRefColumns(Cursor& c, uint64_t n, RefColumns* r) {
  RETURN_IF_ERROR(Column(c, n, UINT64_MAX, "data_file_id", &r->ids));
  RETURN_IF_ERROR(Column(c, n, UINT64_MAX, "offset", &r->offs));
  RETURN_IF_ERROR(Column(c, n, UINT64_MAX, "length", &r->lens));
  RETURN_IF_ERROR(Column(c, n, UINT64_MAX, "num_keys", &r->nkeys));
  RETURN_IF_ERROR(Column(c, n, UINT64_MAX, "num_tree_bytes", &r->ntree));
  return Column(c, n, UINT64_MAX, "num_indirect_value_bytes", &r->nind);
}

struct DataFile {
  std::string path;  // base_path + relative_path, relative to the database directory
  std::string base;  // base_path: what the paths of a node read from this file are relative to
};

// The data file table of a manifest or a node: num_files, then the path
// prefix lengths (shared with the previous path) of files 1.., the suffix
// lengths, the base path lengths, then the suffixes concatenated. A node's
// paths are relative to the base path of the file it was read from
// (`transitive`).
Status ReadDataFileTable(Cursor& c, const std::string& transitive, uint64_t max_files, std::vector<DataFile>* out) {
  uint64_t n = 0;
  RETURN_IF_ERROR(c.Count(&n, std::min<uint64_t>(max_files, c.left()), "num_files"));
  std::vector<uint64_t> prefix, suffix, base;
  RETURN_IF_ERROR(Column(c, n == 0 ? 0 : n - 1, 1 << 16, "path_prefix_length", &prefix));
  RETURN_IF_ERROR(Column(c, n, 1 << 16, "path_suffix_length", &suffix));
  RETURN_IF_ERROR(Column(c, n, 1 << 16, "base_path_length", &base));
  out->clear();
  std::string prev;
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t p = i == 0 ? 0 : prefix[i - 1];
    if (p > prev.size()) return c.Fail("a path prefix is longer than the previous path");
    std::string_view sfx;
    RETURN_IF_ERROR(c.Bytes(suffix[i], &sfx));
    std::string full = prev.substr(0, p) + std::string(sfx);
    if (base[i] > full.size()) return c.Fail("a base path is longer than its path");
    const std::string path = transitive + full;
    if (!SafeRelativePath(path)) return c.Fail("data file path '" + path + "' leaves the database directory");
    out->push_back(DataFile{path, transitive + full.substr(0, base[i])});
    prev = std::move(full);
  }
  return Status::Ok();
}

struct Walk {
  const OcdbtFiles& files;
  const OcdbtLimits& limits;
  uint64_t max_decoded = 0;
  uint64_t nodes = 0;
  uint64_t decoded = 0;  // node bytes decoded so far
  OcdbtListing* out = nullptr;
  // A B+tree is a tree: a node referenced twice is a hostile DAG (work
  // exponential in its height), refused.
  std::set<std::pair<std::string, uint64_t>> seen;
};

Result<std::string> ReadRange(const OcdbtFiles& files, const std::string& rel, uint64_t off, uint64_t len,
                              uint64_t max_len, const std::string& what) {
  if (len > max_len) {
    return Invalid("corrupt " + what + ": " + std::to_string(len) + " bytes, more than " + std::to_string(max_len));
  }
  ASSIGN_OR_RETURN(uint64_t size, files.size_of(rel));
  if (off > size || len > size - off) {
    return Invalid("corrupt " + what + ": bytes [" + std::to_string(off) + ", +" + std::to_string(len) + ") of " + rel +
                   " are past its end (" + std::to_string(size) + " bytes)");
  }
  return files.read(rel, off, len);
}

// The node at [offset, +length) of `df`, at `height`, holding keys that start
// with `prefix` (its entries' keys are relative to it).
Status ReadNode(Walk& w, const DataFile& df, uint64_t offset, uint64_t length, uint32_t height,
                const std::string& prefix) {
  if (++w.nodes > w.limits.max_nodes) {
    return Invalid("corrupt OCDBT tree: more than " + std::to_string(w.limits.max_nodes) + " nodes");
  }
  const std::string what = "OCDBT B+tree node " + df.path + " @ " + std::to_string(offset);
  if (!w.seen.emplace(df.path, offset).second) return Invalid("corrupt " + what + ": referenced twice in the tree");
  ASSIGN_OR_RETURN(std::string raw, ReadRange(w.files, df.path, offset, length, w.limits.max_encoded_bytes, what));
  ASSIGN_OR_RETURN(OcdbtEnvelope env, DecodeOcdbtEnvelope(raw, kOcdbtBtreeNodeMagic, w.max_decoded, what));
  w.decoded += env.body.size();
  if (w.decoded > w.limits.max_total_decoded_bytes) {
    return Invalid("corrupt OCDBT tree: its nodes decode to more than " +
                   std::to_string(w.limits.max_total_decoded_bytes) + " bytes");
  }
  Cursor c(env.body, what);
  uint8_t h = 0;
  RETURN_IF_ERROR(c.Byte(&h));
  if (h != height) {
    return c.Fail("height " + std::to_string(h) + " where its parent says " + std::to_string(height));
  }
  std::vector<DataFile> table;
  RETURN_IF_ERROR(ReadDataFileTable(c, df.base, c.left(), &table));
  uint64_t n = 0;
  RETURN_IF_ERROR(c.Count(&n, std::min<uint64_t>(c.left(), w.limits.max_entries), "num_entries"));
  if (n == 0) return c.Fail("a node without entries");
  std::vector<uint64_t> kp, ks;
  RETURN_IF_ERROR(Column(c, n - 1, 1 << 16, "key_prefix_length", &kp));
  RETURN_IF_ERROR(Column(c, n, 1 << 16, "key_suffix_length", &ks));
  std::vector<uint64_t> common;
  if (h > 0) RETURN_IF_ERROR(Column(c, n, 1 << 16, "subtree_common_prefix_length", &common));
  std::vector<std::string> keys(n);
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t p = i == 0 ? 0 : kp[i - 1];
    if (p > keys[i == 0 ? 0 : i - 1].size()) return c.Fail("a key prefix is longer than the previous key");
    std::string_view sfx;
    RETURN_IF_ERROR(c.Bytes(ks[i], &sfx));
    keys[i] = (i == 0 ? std::string() : keys[i - 1].substr(0, p)) + std::string(sfx);
    if (i > 0 && keys[i] <= keys[i - 1]) return c.Fail("keys out of order");
  }
  auto file_of = [&](uint64_t id, const DataFile** out) -> Status {
    if (id >= table.size()) return c.Fail("data file id " + std::to_string(id) + " of " + std::to_string(table.size()));
    *out = &table[id];
    return Status::Ok();
  };
  if (h > 0) {
    RefColumns refs;
    RETURN_IF_ERROR(ReadRefColumns(c, n, &refs));
    RETURN_IF_ERROR(c.End());
    for (uint64_t i = 0; i < n; ++i) {
      if (common[i] > keys[i].size()) return c.Fail("a subtree prefix is longer than its key");
      const DataFile* child = nullptr;
      RETURN_IF_ERROR(file_of(refs.ids[i], &child));
      RETURN_IF_ERROR(ReadNode(w, *child, refs.offs[i], refs.lens[i], h - 1, prefix + keys[i].substr(0, common[i])));
    }
    return Status::Ok();
  }
  std::vector<uint64_t> vlen, kind;
  RETURN_IF_ERROR(Column(c, n, UINT64_MAX, "value_length", &vlen));
  RETURN_IF_ERROR(ByteColumn(c, n, 1, "value_kind", &kind));
  uint64_t indirect = 0;
  for (uint64_t k : kind) indirect += k;
  std::vector<uint64_t> ids, offs;
  RETURN_IF_ERROR(Column(c, indirect, UINT64_MAX, "data_file_id", &ids));
  RETURN_IF_ERROR(Column(c, indirect, UINT64_MAX, "offset", &offs));
  if (w.out->values.size() + n > w.limits.max_entries) {
    return c.Fail("more than " + std::to_string(w.limits.max_entries) + " keys in the tree");
  }
  uint64_t j = 0;
  for (uint64_t i = 0; i < n; ++i) {
    OcdbtValue v;
    v.key = prefix + keys[i];
    v.length = vlen[i];
    if (kind[i] == 1) {
      const DataFile* f = nullptr;
      RETURN_IF_ERROR(file_of(ids[j], &f));
      v.file = f->path;
      v.offset = offs[j++];
      if (v.offset > UINT64_MAX - v.length) return c.Fail("a value range overflows");
    } else {
      v.is_inline = true;
      v.file = df.path;
      v.node_offset = offset;
      v.node_length = length;
      v.node_header = env.header_bytes;
      v.node_zstd = env.zstd;
      v.body_offset = c.pos();
      std::string_view b;
      RETURN_IF_ERROR(c.Bytes(v.length, &b));
      v.bytes.assign(b);
    }
    if (!w.out->values.empty() && v.key <= w.out->values.back().key) {
      return c.Fail("key '" + v.key + "' is out of order across nodes");
    }
    w.out->values.push_back(std::move(v));
  }
  return c.End();
}

}  // namespace

bool SafeRelativePath(std::string_view rel) {
  if (rel.empty() || rel.front() == '/' || rel.find('\0') != std::string_view::npos) return false;
  size_t start = 0;
  while (start <= rel.size()) {
    size_t end = rel.find('/', start);
    if (end == std::string_view::npos) end = rel.size();
    const std::string_view part = rel.substr(start, end - start);
    // A trailing '/' is a base path's (a directory), allowed only at the end.
    if (part.empty() && end != rel.size()) return false;
    if (part == "." || part == "..") return false;
    start = end + 1;
  }
  return true;
}

Result<OcdbtEnvelope> DecodeOcdbtEnvelope(std::string_view data, uint32_t magic, uint64_t max_decoded,
                                          const std::string& what) {
  auto fail = [&](const std::string& why) { return Invalid("corrupt " + what + ": " + why); };
  if (data.size() < 4 + 8 + 2 + 4) return fail("shorter than an OCDBT header");
  uint32_t m = 0;
  for (int i = 0; i < 4; ++i) m = (m << 8) | static_cast<unsigned char>(data[i]);
  if (m != magic) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "magic %08x, expected %08x", m, magic);
    return fail(buf);
  }
  uint64_t len = 0;
  for (int i = 8; i-- > 0;) len = (len << 8) | static_cast<unsigned char>(data[4 + i]);
  if (len != data.size()) {
    return fail("its header says " + std::to_string(len) + " bytes, its reference " + std::to_string(data.size()));
  }
  uint32_t crc = 0;
  for (int i = 4; i-- > 0;) crc = (crc << 8) | static_cast<unsigned char>(data[data.size() - 4 + i]);
  const uint32_t got = Crc32cUpdate(0, data.data(), data.size() - 4);
  if (got != crc) {
    char buf[80];
    std::snprintf(buf, sizeof buf, "CRC-32C %08x, the structure records %08x", got, crc);
    return fail(buf);
  }
  Cursor c(data.substr(12, data.size() - 16), what);
  uint64_t version = 0, compression = 0;
  RETURN_IF_ERROR(c.Varint(&version));
  if (version != 0) return fail("version " + std::to_string(version) + " (ckptfs reads version 0)");
  RETURN_IF_ERROR(c.Varint(&compression));
  OcdbtEnvelope env;
  env.header_bytes = 12 + c.pos();
  std::string_view body;
  RETURN_IF_ERROR(c.Bytes(c.left(), &body));
  if (compression == 0) {
    if (body.size() > max_decoded) return fail("a body of " + std::to_string(body.size()) + " bytes");
    env.body.assign(body);
  } else if (compression == 1) {
    env.zstd = true;
    ASSIGN_OR_RETURN(env.body, ZstdDecompress(body, max_decoded, what));
  } else {
    return fail("compression format " + std::to_string(compression) + " (0 none and 1 zstd are defined)");
  }
  return env;
}

Result<OcdbtListing> ReadOcdbt(const OcdbtFiles& files, const std::string& manifest, const OcdbtLimits& limits) {
  const std::string what = "OCDBT manifest " + manifest;
  ASSIGN_OR_RETURN(uint64_t size, files.size_of(manifest));
  ASSIGN_OR_RETURN(std::string raw, ReadRange(files, manifest, 0, size, limits.max_encoded_bytes, what));
  ASSIGN_OR_RETURN(OcdbtEnvelope env,
                   DecodeOcdbtEnvelope(raw, kOcdbtManifestMagic, limits.max_decoded_node_bytes, what));
  Cursor c(env.body, what);
  OcdbtListing out;
  OcdbtConfig& cfg = out.config;
  std::string_view uuid;
  RETURN_IF_ERROR(c.Bytes(16, &uuid));
  cfg.uuid.assign(uuid);
  uint8_t kind = 0;
  RETURN_IF_ERROR(c.Byte(&kind));
  if (kind > 1) return c.Fail("manifest_kind " + std::to_string(kind));
  cfg.manifest_kind = kind;
  RETURN_IF_ERROR(c.Varint(&cfg.max_inline_value_bytes));
  RETURN_IF_ERROR(c.Varint(&cfg.max_decoded_node_bytes));
  uint8_t arity = 0;
  RETURN_IF_ERROR(c.Byte(&arity));
  cfg.version_tree_arity_log2 = arity;
  if (arity == 0 || arity > 16) return c.Fail("version_tree_arity_log2 " + std::to_string(arity));
  RETURN_IF_ERROR(c.Count(&cfg.compression, 1, "compression_method"));
  if (cfg.compression == 1) {
    uint64_t level = 0;
    RETURN_IF_ERROR(c.Le(4, &level));
    cfg.zstd_level = static_cast<int32_t>(static_cast<uint32_t>(level));
  }
  if (cfg.manifest_kind != 0) {
    return Unsupported("cannot read " + manifest +
                       ": a numbered OCDBT manifest (manifest_kind 1, manifest.<generation> files) is not read by "
                       "ckptfs yet; orbax writes single-file manifests");
  }
  std::vector<DataFile> table;
  RETURN_IF_ERROR(ReadDataFileTable(c, "", c.left(), &table));
  uint64_t n = 0;
  RETURN_IF_ERROR(c.Count(&n, c.left(), "num_versions"));
  std::vector<uint64_t> gen, height;
  RETURN_IF_ERROR(Column(c, n, UINT64_MAX, "generation_number", &gen));
  RETURN_IF_ERROR(ByteColumn(c, n, 255, "root_height", &height));
  RefColumns refs;
  RETURN_IF_ERROR(ReadRefColumns(c, n, &refs));
  const auto& [ids, offs, lens, nkeys, ntree, nind] = refs;
  std::vector<uint64_t> times(n);
  for (uint64_t i = 0; i < n; ++i) RETURN_IF_ERROR(c.Le(8, &times[i]));
  // Version-tree node references follow (older generations): not needed,
  // the latest version is always inline.
  out.versions = n;
  if (n == 0) return out;  // an empty database
  for (uint64_t i = 1; i < n; ++i) {
    if (gen[i] <= gen[i - 1]) return c.Fail("generation numbers out of order");
  }
  const uint64_t last = n - 1;
  out.generation = gen[last];
  out.commit_time_ns = times[last];
  if (offs[last] == UINT64_MAX && lens[last] == UINT64_MAX) {  // an empty tree
    if (nkeys[last] != 0) return c.Fail("an empty root with " + std::to_string(nkeys[last]) + " keys");
    return out;
  }
  if (height[last] > limits.max_height) return c.Fail("root height " + std::to_string(height[last]));
  if (ids[last] >= table.size()) return c.Fail("root data file id " + std::to_string(ids[last]));
  Walk w{
      files, limits, std::min(limits.max_decoded_node_bytes, std::max<uint64_t>(cfg.max_decoded_node_bytes, 1 << 20)),
      0,     0,      &out,
      {}};
  const DataFile& root = table[ids[last]];
  RETURN_IF_ERROR(ReadNode(w, root, offs[last], lens[last], static_cast<uint32_t>(height[last]), ""));
  if (out.values.size() != nkeys[last]) {
    return Invalid("corrupt " + what + ": the latest version records " + std::to_string(nkeys[last]) +
                   " keys, its tree holds " + std::to_string(out.values.size()));
  }
  return out;
}

}  // namespace ckptfs::formats::orbax
