#include "views/plan_cache.h"

#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <unistd.h>
#include <xxhash.h>

#include <cstring>
#include <memory>

#include "common/temp_file.h"
#include "common/varint.h"
#include "formats/byte_reader.h"

namespace ckptfs::plan_cache {
namespace {

// File: kMagic; varint-framed strings: build id, index identity, plan name,
// key;
// the records' length (a varint); the records; the blobs (spooled segments'
// bytes); the xxh3-64 of records and blobs (8 bytes LE).
constexpr std::string_view kMagic = "CKPTFS-PLAN-2\n";
// Records (or a whole plan file) larger than this are not read (a damaged
// length).
constexpr uint64_t kMaxRecordBytes = uint64_t{4} << 30;
constexpr uint64_t kMaxPlanBytes = uint64_t{64} << 30;

void PutStr(std::string& out, std::string_view s) {
  PutVarint(out, s.size());
  out.append(s);
}

// Bounds-checked reading of the records: any overrun sets `bad` and returns
// zeros, so a damaged file fails its checks instead of reading past them.
struct Reader {
  std::string_view s;
  size_t pos = 0;
  bool bad = false;
  uint64_t Num() {
    uint64_t v = 0;
    if (!bad && !TryGetVarint(s, &pos, &v)) bad = true;
    return bad ? 0 : v;
  }
  std::string_view Str() {
    const uint64_t n = Num();
    if (bad || n > s.size() - pos) {
      bad = true;
      return {};
    }
    std::string_view v = s.substr(pos, n);
    pos += n;
    return v;
  }
  // A count of things each at least one byte long.
  uint64_t Count() {
    const uint64_t n = Num();
    if (n > s.size() - pos) bad = true;
    return bad ? 0 : n;
  }
  double Double() {
    const uint64_t bits = Num();
    double d;
    std::memcpy(&d, &bits, sizeof d);
    return d;
  }
};

std::string IndexIdentity(const Index& index) {
  auto id = formats::ReadWholeFile(index.dir() + "/IDENTITY", 4096);
  return id.ok() ? *id : std::string();
}

// The records of `plan`; the spooled segments, in the order their bytes
// follow the records (each recorded at its offset among them).
Status Encode(const Plan& plan, std::string& rec, std::vector<const SpooledBytes*>& blobs) {
  uint64_t blob_bytes = 0;
  PutVarint(rec, plan.notes.size());
  for (const std::string& n : plan.notes) PutStr(rec, n);
  PutVarint(rec, plan.files.size());
  for (const auto& [name, layout] : plan.files) {
    PutStr(rec, name);
    PutVarint(rec, layout.segments.size());
    for (const Segment& s : layout.segments) {
      PutVarint(rec, static_cast<uint64_t>(s.kind));
      PutVarint(rec, static_cast<uint64_t>(s.out_dtype));
      PutVarint(rec, (s.transposed ? 1u : 0u) | (s.Affine() || s.transposed ? 2u : 0u));
      PutVarint(rec, s.lead_ones);
      PutVarint(rec, s.tensor.v);
      PutVarint(rec, s.size);
      PutVarint(rec, s.boxes.size());
      for (const Box& b : s.boxes) {
        PutVarint(rec, b.offsets.size());
        for (size_t d = 0; d < b.offsets.size(); ++d) {
          PutVarint(rec, ZigZag(b.offsets[d]));
          PutVarint(rec, ZigZag(b.lengths[d]));
        }
      }
      if (s.Affine() || s.transposed) {
        const SegmentRender& r = s.render();
        uint64_t scale, add;
        std::memcpy(&scale, &r.scale, sizeof scale);
        std::memcpy(&add, &r.add, sizeof add);
        PutVarint(rec, r.how.col_axes);
        PutVarint(rec, r.how.rope_group);
        PutVarint(rec, scale);
        PutVarint(rec, add);
      }
      if (s.kind == SegmentKind::kLiteral) PutStr(rec, s.literal());
      if (s.kind == SegmentKind::kSpooled) {
        const SpooledBytes* sp = s.spooled();
        if (sp == nullptr || sp->size != s.size) return Internal("a spooled segment without its bytes");
        PutVarint(rec, blob_bytes);
        blob_bytes += sp->size;
        blobs.push_back(sp);
      }
    }
  }
  return Status::Ok();
}

// The plan in `rec`; spooled segments read from `fd` (its blobs at
// `blobs_at`, `blobs_size` bytes). Nothing when the records do not hold.
std::optional<Plan> Decode(const Index& index, std::string_view rec, int fd, uint64_t blobs_at, uint64_t blobs_size,
                           const std::string& path) {
  Reader r{rec};
  Plan plan;
  const uint64_t n_notes = r.Count();
  for (uint64_t i = 0; i < n_notes && !r.bad; ++i) plan.notes.emplace_back(r.Str());
  const uint64_t n_files = r.Count();
  const uint64_t n_tensors = index.tensors().size();
  for (uint64_t f = 0; f < n_files && !r.bad; ++f) {
    std::string name(r.Str());
    FileLayout l;
    const uint64_t n_seg = r.Count();
    l.segments.reserve(n_seg);
    l.starts.reserve(n_seg);
    for (uint64_t k = 0; k < n_seg && !r.bad; ++k) {
      Segment s;
      const uint64_t kind = r.Num(), dtype = r.Num(), flags = r.Num(), lead = r.Num(), tensor = r.Num();
      if (kind > static_cast<uint64_t>(SegmentKind::kSpooled) || dtype > 255 || lead > 255 || flags > 3 ||
          tensor >= std::max<uint64_t>(n_tensors, 1)) {
        return std::nullopt;
      }
      s.kind = static_cast<SegmentKind>(kind);
      s.out_dtype = static_cast<DType>(dtype);
      s.transposed = (flags & 1) != 0;
      s.lead_ones = static_cast<uint8_t>(lead);
      s.tensor = TensorId{static_cast<uint32_t>(tensor)};
      s.size = r.Num();
      const uint64_t n_boxes = r.Count();
      s.boxes.resize(n_boxes);
      for (Box& b : s.boxes) {
        const uint64_t nd = r.Count();
        if (nd > 64) return std::nullopt;
        b.offsets.resize(nd);
        b.lengths.resize(nd);
        for (uint64_t d = 0; d < nd; ++d) {
          b.offsets[d] = UnZigZag(r.Num());
          b.lengths[d] = UnZigZag(r.Num());
        }
      }
      if ((flags & 2) != 0) {
        SegmentRender render;
        const uint64_t col = r.Num(), rope = r.Num();
        if (col > UINT32_MAX || rope > UINT32_MAX) return std::nullopt;
        render.how.col_axes = static_cast<uint32_t>(col);
        render.how.rope_group = static_cast<uint32_t>(rope);
        render.scale = r.Double();
        render.add = r.Double();
        s.set_render(render);
      }
      if (s.kind == SegmentKind::kLiteral) {
        std::string_view lit = r.Str();
        if (lit.size() != s.size) return std::nullopt;
        s.set_literal(std::string(lit));
      }
      if (s.kind == SegmentKind::kSpooled) {
        const uint64_t off = r.Num();
        if (off > blobs_size || s.size > blobs_size - off) return std::nullopt;
        auto sp = std::make_shared<SpooledBytes>();
        sp->fd = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
        if (sp->fd < 0) return std::nullopt;
        sp->base = blobs_at + off;
        sp->size = s.size;
        sp->name = path;
        s.set_spooled(std::move(sp));
      }
      l.Add(std::move(s));
    }
    plan.files.emplace_back(std::move(name), std::move(l));
  }
  if (r.bad || r.pos != rec.size()) return std::nullopt;
  return plan;
}

}  // namespace

const std::string& BuildId() {
  static const std::string id = [] {
    std::string hex;
    // The main program's PT_NOTE segments (the first object dl_iterate_phdr visits).
    dl_iterate_phdr(
        [](dl_phdr_info* info, size_t, void* out) -> int {
          auto* hex = static_cast<std::string*>(out);
          for (int i = 0; i < info->dlpi_phnum; ++i) {
            const ElfW(Phdr)& ph = info->dlpi_phdr[i];
            if (ph.p_type != PT_NOTE) continue;
            const char* p = reinterpret_cast<const char*>(info->dlpi_addr + ph.p_vaddr);
            const char* end = p + ph.p_memsz;
            while (p + sizeof(ElfW(Nhdr)) <= end) {
              ElfW(Nhdr) nh;
              std::memcpy(&nh, p, sizeof nh);
              const char* name = p + sizeof nh;
              const char* desc = name + ((nh.n_namesz + 3) & ~3u);
              const char* next = desc + ((nh.n_descsz + 3) & ~3u);
              if (next > end) break;
              if (nh.n_type == NT_GNU_BUILD_ID && nh.n_namesz == 4 && std::memcmp(name, "GNU", 4) == 0) {
                static const char kHex[] = "0123456789abcdef";
                for (uint32_t k = 0; k < nh.n_descsz; ++k) {
                  const auto b = static_cast<unsigned char>(desc[k]);
                  hex->push_back(kHex[b >> 4]);
                  hex->push_back(kHex[b & 15]);
                }
                return 1;
              }
              p = next;
            }
          }
          return 1;  // only the main program
        },
        &hex);
    return hex;
  }();
  return id;
}

std::string PathOf(const Index& index, std::string_view name) {
  return index.dir() + "/" + std::string(name) + ".plan";
}

std::optional<Plan> Load(const Index& index, std::string_view name, std::string_view key) {
  const std::string identity = IndexIdentity(index);
  if (BuildId().empty() || identity.empty()) return std::nullopt;
  const std::string path = PathOf(index, name);
  // The file, through a SpooledBytes (which closes it): its reads are
  // bounded, and name the file.
  SpooledBytes file;
  uint64_t size = 0;
  auto fd = formats::OpenBoundedFile(path, kMaxPlanBytes, &size);
  if (!fd.ok()) return std::nullopt;
  file.fd = *fd;
  file.size = size;
  file.name = path;
  // The head: magic, four strings and the records' length; read generously and parsed.
  std::string head(static_cast<size_t>(std::min<uint64_t>(size, 4096)), '\0');
  if (!file.Read(0, head.size(), head.data()).ok()) return std::nullopt;
  if (head.compare(0, kMagic.size(), kMagic) != 0) return std::nullopt;
  Reader h{std::string_view(head).substr(kMagic.size())};
  if (h.Str() != BuildId() || h.Str() != identity || h.Str() != name || h.Str() != key) return std::nullopt;
  const uint64_t rec_size = h.Num();
  if (h.bad) return std::nullopt;
  const uint64_t rec_at = kMagic.size() + h.pos;
  if (rec_size > kMaxRecordBytes || rec_at + 8 > size || rec_size > size - 8 - rec_at) return std::nullopt;
  // Everything between the head and the trailer is summed: records and blobs.
  XXH3_state_t* xs = XXH3_createState();
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(xs, &XXH3_freeState);
  XXH3_64bits_reset(xs);
  std::string rec(static_cast<size_t>(rec_size), '\0');
  if (!file.Read(rec_at, rec.size(), rec.data()).ok()) return std::nullopt;
  XXH3_64bits_update(xs, rec.data(), rec.size());
  const uint64_t blobs_at = rec_at + rec_size, blobs_size = size - 8 - blobs_at;
  std::string buf(static_cast<size_t>(std::min<uint64_t>(blobs_size, 8 << 20)), '\0');
  for (uint64_t off = 0; off < blobs_size; off += buf.size()) {
    const uint64_t n = std::min<uint64_t>(buf.size(), blobs_size - off);
    if (!file.Read(blobs_at + off, n, buf.data()).ok()) return std::nullopt;
    XXH3_64bits_update(xs, buf.data(), n);
  }
  char trailer[8];
  if (!file.Read(size - 8, 8, trailer).ok()) return std::nullopt;
  if (XXH3_64bits_digest(xs) != LoadLE<uint64_t>(trailer)) return std::nullopt;
  return Decode(index, rec, file.fd, blobs_at, blobs_size, path);
}

Status Save(const Index& index, std::string_view name, const Plan& plan, std::string_view key) {
  const std::string identity = IndexIdentity(index);
  if (BuildId().empty()) return Unsupported("this build of ckptfs has no build id");
  if (identity.empty()) return Unsupported("the index at " + index.dir() + " has no IDENTITY");
  if (key.size() > 1024) return Invalid("a plan's key is at most 1 KiB (a digest), not " + std::to_string(key.size()));
  std::string rec;
  std::vector<const SpooledBytes*> blobs;
  RETURN_IF_ERROR(Encode(plan, rec, blobs));
  std::string head(kMagic);
  PutStr(head, BuildId());
  PutStr(head, identity);
  PutStr(head, name);
  PutStr(head, key);
  PutVarint(head, rec.size());
  const std::string path = PathOf(index, name);
  std::string tmp = path + ".XXXXXX";
  const int fd = ::mkostemp(tmp.data(), O_CLOEXEC);
  if (fd < 0) return ErrnoStatus("create", tmp, errno);
  XXH3_state_t* xs = XXH3_createState();
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(xs, &XXH3_freeState);
  XXH3_64bits_reset(xs);
  uint64_t at = 0;
  auto put = [&](const char* p, uint64_t n, bool summed) {
    RETURN_IF_ERROR(PwriteAll(fd, at, p, n, tmp));
    if (summed) XXH3_64bits_update(xs, p, n);
    at += n;
    return Status::Ok();
  };
  // The spooled bytes are copied a piece at a time (a .metadata of millions
  // of chunks is hundreds of MB, never held whole).
  auto write_all = [&]() -> Status {
    if (::fchmod(fd, 0644) != 0) return ErrnoStatus("chmod", tmp, errno);  // as the index's own files
    RETURN_IF_ERROR(put(head.data(), head.size(), false));
    RETURN_IF_ERROR(put(rec.data(), rec.size(), true));
    std::string piece;
    for (const SpooledBytes* sp : blobs) {
      for (uint64_t off = 0; off < sp->size; off += piece.size()) {
        piece.resize(static_cast<size_t>(std::min<uint64_t>(sp->size - off, 8 << 20)));
        RETURN_IF_ERROR(sp->Read(off, piece.size(), piece.data()));
        RETURN_IF_ERROR(put(piece.data(), piece.size(), true));
      }
    }
    char trailer[8];
    StoreLE<uint64_t>(trailer, XXH3_64bits_digest(xs));
    return put(trailer, 8, false);
  };
  Status st = write_all();
  if (::close(fd) != 0 && st.ok()) st = ErrnoStatus("write", tmp, errno);
  if (st.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) st = ErrnoStatus("rename", tmp, errno);
  if (!st.ok()) ::unlink(tmp.c_str());
  return st;
}

}  // namespace ckptfs::plan_cache
