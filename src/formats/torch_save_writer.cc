#include "formats/torch_save_writer.h"

#include "common/crc32.h"

namespace ckptfs::formats {
namespace {

constexpr uint32_t kLocalSig = 0x04034b50, kCentralSig = 0x02014b50, kEndSig = 0x06054b50, kZip64EndSig = 0x06064b50,
                   kZip64LocatorSig = 0x07064b50, kDescriptorSig = 0x08074b50;
constexpr uint64_t kMax32 = 0xFFFFFFFFull;
constexpr uint16_t kDosDate = (0 << 9) | (1 << 5) | 1;  // 1980-01-01: reproducible bytes

class PartList {
 public:
  template <typename T>
  void Le(T v) {
    char b[sizeof(T)];
    StoreLE(b, v);
    Lit(std::string_view(b, sizeof(T)));
  }
  void Lit(std::string_view s) {
    if (parts_.empty() || parts_.back().kind != PartKind::kLiteral) parts_.push_back(ExportPart{});
    parts_.back().literal.append(s);
    parts_.back().size += s.size();
    size_ += s.size();
  }
  void Tensor(const ArchiveStorage& st) {
    ExportPart p;
    p.kind = PartKind::kTensor;
    p.tensor = st.tensor;
    p.out_dtype = st.out_dtype;
    if (st.boxes.empty()) {
      p.size = st.nbytes;
      parts_.push_back(std::move(p));
    } else {
      for (const Box& b : st.boxes) {
        ExportPart q = p;
        q.boxes = {b};
        q.size = static_cast<uint64_t>(NumelOf(b.lengths)) * DTypeSize(st.out_dtype);
        parts_.push_back(std::move(q));
      }
    }
    size_ += st.nbytes;
  }
  void Crc(const ArchiveStorage& st) {
    ExportPart p;
    p.kind = PartKind::kCrc32;
    p.tensor = st.tensor;
    p.out_dtype = st.out_dtype;
    p.size = 4;
    p.boxes = st.boxes;
    parts_.push_back(std::move(p));
    size_ += 4;
  }
  uint64_t size() const { return size_; }
  std::vector<ExportPart> Take() { return std::move(parts_); }

 private:
  std::vector<ExportPart> parts_;
  uint64_t size_ = 0;
};

struct Entry {
  std::string name;
  uint64_t size = 0;
  uint64_t offset = 0;                      // local header
  std::string data;                         // literal records: the bytes
  uint32_t crc = 0;                         // literal records
  const ArchiveStorage* storage = nullptr;  // tensor records (CRC in the data descriptor)
};

void LocalHeader(PartList& out, Entry& e) {
  e.offset = out.size();
  const bool z64 = e.size >= kMax32 || e.offset >= kMax32;
  out.Le<uint32_t>(kLocalSig);
  out.Le<uint16_t>(z64 ? 45 : 20);
  out.Le<uint16_t>(e.storage ? 0x08 : 0);
  out.Le<uint16_t>(0);  // STORED
  out.Le<uint16_t>(0);  // time
  out.Le<uint16_t>(kDosDate);
  out.Le<uint32_t>(e.storage ? 0 : e.crc);
  out.Le<uint32_t>(z64 ? static_cast<uint32_t>(kMax32) : static_cast<uint32_t>(e.size));
  out.Le<uint32_t>(z64 ? static_cast<uint32_t>(kMax32) : static_cast<uint32_t>(e.size));
  out.Le<uint16_t>(static_cast<uint16_t>(e.name.size()));
  // Extra: optional ZIP64 sizes, then padding so the data starts 64-aligned.
  uint64_t fixed = out.size() + 2 + e.name.size() + (z64 ? 20 : 0);
  uint64_t pad = (64 - (fixed + 4) % 64) % 64;
  out.Le<uint16_t>(static_cast<uint16_t>((z64 ? 20 : 0) + 4 + pad));
  out.Lit(e.name);
  if (z64) {
    out.Le<uint16_t>(0x0001);
    out.Le<uint16_t>(16);
    out.Le<uint64_t>(e.size);
    out.Le<uint64_t>(e.size);
  }
  out.Le<uint16_t>(0x4246);  // "FB": torch.save's alignment padding
  out.Le<uint16_t>(static_cast<uint16_t>(pad));
  out.Lit(std::string(pad, 'Z'));
}

}  // namespace

std::string TorchSaveBytes(const std::string& archive_name, const std::string& pickle) {
  std::string bytes;
  for (const ExportPart& p : TorchSaveParts(archive_name, pickle, {})) bytes += p.literal;
  return bytes;
}

uint64_t PartsSize(const std::vector<ExportPart>& parts) {
  uint64_t n = 0;
  for (const auto& p : parts) n += p.size;
  return n;
}

std::vector<ExportPart> TorchSaveParts(const std::string& archive_name, const std::string& pickle,
                                       const std::vector<ArchiveStorage>& storages) {
  std::vector<Entry> entries;
  auto literal_entry = [&](const std::string& name, std::string data) {
    Entry e;
    e.name = archive_name + "/" + name;
    e.size = data.size();
    e.crc = Crc32Update(0, data.data(), data.size());
    e.data = std::move(data);
    entries.push_back(std::move(e));
  };
  literal_entry("data.pkl", pickle);
  literal_entry("byteorder", "little");
  for (size_t i = 0; i < storages.size(); ++i) {
    Entry e;
    e.name = archive_name + "/data/" + std::to_string(i);
    e.size = storages[i].nbytes;
    e.storage = &storages[i];
    entries.push_back(std::move(e));
  }
  literal_entry("version", "3\n");

  PartList out;
  for (Entry& e : entries) {
    LocalHeader(out, e);
    if (e.storage == nullptr) {
      out.Lit(e.data);
      continue;
    }
    out.Tensor(*e.storage);
    const bool z64 = e.size >= kMax32 || e.offset >= kMax32;
    out.Le<uint32_t>(kDescriptorSig);
    out.Crc(*e.storage);
    if (z64) {
      out.Le<uint64_t>(e.size);
      out.Le<uint64_t>(e.size);
    } else {
      out.Le<uint32_t>(static_cast<uint32_t>(e.size));
      out.Le<uint32_t>(static_cast<uint32_t>(e.size));
    }
  }

  const uint64_t cd_start = out.size();
  for (const Entry& e : entries) {
    const bool big_size = e.size >= kMax32, big_off = e.offset >= kMax32;
    const uint16_t extra =
        (big_size || big_off) ? static_cast<uint16_t>(4 + (big_size ? 16 : 0) + (big_off ? 8 : 0)) : 0;
    out.Le<uint32_t>(kCentralSig);
    out.Le<uint16_t>(extra ? 45 : 20);  // made by
    out.Le<uint16_t>(extra ? 45 : 20);  // needed
    out.Le<uint16_t>(e.storage ? 0x08 : 0);
    out.Le<uint16_t>(0);
    out.Le<uint16_t>(0);
    out.Le<uint16_t>(kDosDate);
    if (e.storage) {
      out.Crc(*e.storage);
    } else {
      out.Le<uint32_t>(e.crc);
    }
    out.Le<uint32_t>(big_size ? static_cast<uint32_t>(kMax32) : static_cast<uint32_t>(e.size));
    out.Le<uint32_t>(big_size ? static_cast<uint32_t>(kMax32) : static_cast<uint32_t>(e.size));
    out.Le<uint16_t>(static_cast<uint16_t>(e.name.size()));
    out.Le<uint16_t>(extra);
    out.Le<uint16_t>(0);  // comment
    out.Le<uint16_t>(0);  // disk
    out.Le<uint16_t>(0);  // internal attributes
    out.Le<uint32_t>(0);  // external attributes
    out.Le<uint32_t>(big_off ? static_cast<uint32_t>(kMax32) : static_cast<uint32_t>(e.offset));
    out.Lit(e.name);
    if (extra) {
      out.Le<uint16_t>(0x0001);
      out.Le<uint16_t>(static_cast<uint16_t>(extra - 4));
      if (big_size) {
        out.Le<uint64_t>(e.size);
        out.Le<uint64_t>(e.size);
      }
      if (big_off) out.Le<uint64_t>(e.offset);
    }
  }
  const uint64_t cd_size = out.size() - cd_start;
  const uint64_t n = entries.size();
  const bool z64_end = cd_start >= kMax32 || cd_size >= kMax32 || n >= 0xFFFF;
  if (z64_end) {
    const uint64_t rec = out.size();
    out.Le<uint32_t>(kZip64EndSig);
    out.Le<uint64_t>(44);
    out.Le<uint16_t>(45);
    out.Le<uint16_t>(45);
    out.Le<uint32_t>(0);
    out.Le<uint32_t>(0);
    out.Le<uint64_t>(n);
    out.Le<uint64_t>(n);
    out.Le<uint64_t>(cd_size);
    out.Le<uint64_t>(cd_start);
    out.Le<uint32_t>(kZip64LocatorSig);
    out.Le<uint32_t>(0);
    out.Le<uint64_t>(rec);
    out.Le<uint32_t>(1);
  }
  out.Le<uint32_t>(kEndSig);
  out.Le<uint16_t>(0);
  out.Le<uint16_t>(0);
  out.Le<uint16_t>(z64_end ? 0xFFFF : static_cast<uint16_t>(n));
  out.Le<uint16_t>(z64_end ? 0xFFFF : static_cast<uint16_t>(n));
  out.Le<uint32_t>(z64_end ? static_cast<uint32_t>(kMax32) : static_cast<uint32_t>(cd_size));
  out.Le<uint32_t>(z64_end ? static_cast<uint32_t>(kMax32) : static_cast<uint32_t>(cd_start));
  out.Le<uint16_t>(0);
  return out.Take();
}

}  // namespace ckptfs::formats
