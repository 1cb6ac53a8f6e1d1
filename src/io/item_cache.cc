// Compressed (zstd) items: Item decompresses an item whole into a byte-bounded
// MRU cache (kItemCacheBytes); ItemSpan serves a span of an item from it, or,
// for items too large to hold, through a kept streaming cursor, or, once such
// an item is read out of order (a second pass from its start), from a copy
// decoded once into an unlinked file in $TMPDIR. All check the source
// (CheckFd) first. Locking: item_mu_, cursor_mu_ and spill_mu_ are leaves; a
// cursor is taken out of cursors_ while used, so nothing is held while decoding.
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <string>
#include <utility>

#include "ckptfs/io.h"
#include "common/temp_file.h"
#include "formats/byte_reader.h"
#include "formats/zstd.h"

namespace ckptfs {
namespace {

constexpr uint64_t kItemCacheBytes = 64ull << 20;
// A decompressed container of inline items (an OCDBT node: orbax bounds its
// nodes at max_decoded_node_bytes = 100 MB).
constexpr uint64_t kMaxContainerBytes = 128ull << 20;

}  // namespace

// A cached decoded item, or nullptr.
std::shared_ptr<const std::string> TensorReader::CachedItem(const std::string& key) {
  std::lock_guard<std::mutex> lock(item_mu_);
  for (auto it = item_cache_.begin(); it != item_cache_.end(); ++it) {
    if (it->first == key) {
      auto v = it->second;
      item_cache_.erase(it);
      item_cache_.emplace_back(key, v);
      return v;
    }
  }
  return nullptr;
}

void TensorReader::KeepItem(const std::string& key, std::shared_ptr<const std::string> v) {
  std::lock_guard<std::mutex> lock(item_mu_);
  item_cache_bytes_ += v->size();
  item_cache_.emplace_back(key, std::move(v));
  while (item_cache_bytes_ > kItemCacheBytes && item_cache_.size() > 1) {
    item_cache_bytes_ -= item_cache_.front().second->size();
    item_cache_.erase(item_cache_.begin());
  }
}

Result<std::shared_ptr<const std::string>> TensorReader::Item(const Fragment& f) {
  const bool nested = f.compression == Compression::kZstdNested;
  const std::string outer_key = std::to_string(f.file.v) + ":" + std::to_string(f.item_offset);
  const std::string key = nested ? outer_key + ":" + std::to_string(f.inner_offset) : outer_key;
  if (auto v = CachedItem(key)) return v;
  const std::string& rel = index_.files()[f.file.v].rel_path;
  // The index says how many bytes the item holds; more is a bomb, refused
  // before allocating when the frame declares its size.
  uint64_t bound = 0;
  if (AddOverflow(f.data_offset, f.data_length, &bound) || AddOverflow(bound, uint64_t{1} << 20, &bound)) {
    return Invalid("cannot read " + rel + ": bad item bounds");
  }
  std::shared_ptr<const std::string> outer = nested ? CachedItem(outer_key) : nullptr;
  if (outer == nullptr) {
    RETURN_IF_ERROR(CheckFd(f.file));
    std::string raw(f.item_length, '\0');
    IoRequest req{fds_[f.file.v], f.item_offset, f.item_length, raw.data()};
    RETURN_IF_ERROR(ReadSource(std::span<IoRequest>(&req, 1)).Annotate(rel));
    ASSIGN_OR_RETURN(std::string plain, formats::ZstdDecompress(raw, nested ? kMaxContainerBytes : bound,
                                                                rel + " @ " + std::to_string(f.item_offset)));
    outer = std::make_shared<const std::string>(std::move(plain));
    KeepItem(outer_key, outer);
    if (!nested) return outer;
  }
  if (f.inner_offset > outer->size() || f.inner_length > outer->size() - f.inner_offset) {
    return Invalid("cannot read " + rel + " @ " + std::to_string(f.item_offset) + ": the value at " +
                   std::to_string(f.inner_offset) + " (" + std::to_string(f.inner_length) +
                   " bytes) is past the node's " + std::to_string(outer->size()) + " bytes");
  }
  ASSIGN_OR_RETURN(
      std::string plain,
      formats::ZstdDecompress(std::string_view(*outer).substr(f.inner_offset, f.inner_length), bound,
                              rel + " @ " + std::to_string(f.item_offset) + "+" + std::to_string(f.inner_offset)));
  auto v = std::make_shared<const std::string>(std::move(plain));
  KeepItem(key, v);
  return v;
}

Result<std::pair<std::shared_ptr<const std::string>, uint64_t>> TensorReader::ItemSpan(const Fragment& f, uint64_t off,
                                                                                       uint64_t len) {
  const std::string& rel = index_.files()[f.file.v].rel_path;
  const std::string what = rel + " @ " + std::to_string(f.item_offset);
  uint64_t bound = 0, end = 0;
  if (AddOverflow(f.data_offset, f.data_length, &bound) || AddOverflow(off, len, &end) || end > bound) {
    return Invalid("cannot read " + what + ": range past the item");
  }
  if (bound <= stream_items_above_ || f.compression == Compression::kZstdNested) {
    ASSIGN_OR_RETURN(auto item, Item(f));
    if (end > item->size()) {
      return Invalid("cannot read " + what + ": the item holds " + std::to_string(item->size()) +
                     " bytes, the metadata needs " + std::to_string(end));
    }
    return std::make_pair(std::move(item), off);
  }
  RETURN_IF_ERROR(CheckFd(f.file));
  const std::string key = std::to_string(f.file.v) + ":" + std::to_string(f.item_offset);
  // A span of a spilled copy: one pread.
  auto from_spill = [&](const SpilledItem& s) -> Result<std::pair<std::shared_ptr<const std::string>, uint64_t>> {
    auto bytes = std::make_shared<std::string>(len, '\0');
    RETURN_IF_ERROR(
        formats::PreadExact(s.fd, off, bytes->data(), len, "the decoded copy in " + TempDir() + " of " + what));
    return std::make_pair(std::shared_ptr<const std::string>(std::move(bytes)), uint64_t{0});
  };
  if (auto s = FindSpill(key, end)) return from_spill(*s);
  std::unique_ptr<formats::ZstdCursor> cur;
  bool again = false;  // the item was decoded from its start before: out of order
  {
    std::lock_guard<std::mutex> lock(cursor_mu_);
    for (auto it = cursors_.begin(); it != cursors_.end(); ++it) {
      if (it->first == key && it->second->position() <= off) {
        cur = std::move(it->second);
        cursors_.erase(it);
        break;
      }
    }
    if (cur == nullptr) {
      if (cursor_starts_.size() > 4096) cursor_starts_.clear();
      again = ++cursor_starts_[key] > 1;
    }
  }
  if (cur == nullptr && again) {
    ASSIGN_OR_RETURN(auto s, SpillItem(f, key, bound));
    if (s != nullptr) return from_spill(*s);
  }
  if (cur == nullptr) cur = NewCursor(f, bound);
  auto bytes = cur->Read(off, len);
  if (!bytes.ok()) return bytes.status();
  {
    std::lock_guard<std::mutex> lock(cursor_mu_);
    cursors_.emplace_back(key, std::move(cur));
    if (cursors_.size() > 8) cursors_.erase(cursors_.begin());
  }
  return std::make_pair(std::make_shared<const std::string>(std::move(bytes).value()), uint64_t{0});
}

std::unique_ptr<formats::ZstdCursor> TensorReader::NewCursor(const Fragment& f, uint64_t size) {
  const std::string& rel = index_.files()[f.file.v].rel_path;
  const int fd = fds_[f.file.v];
  const uint64_t base = f.item_offset;
  return std::make_unique<formats::ZstdCursor>(
      [this, fd, base, rel](uint64_t o, uint64_t n, char* dst) {
        IoRequest req{fd, base + o, n, dst};
        return ReadSource(std::span<IoRequest>(&req, 1)).Annotate(rel);
      },
      f.item_length, size + (uint64_t{1} << 20), rel + " @ " + std::to_string(f.item_offset));
}

TensorReader::SpilledItem::~SpilledItem() {
  if (fd >= 0) ::close(fd);
}

std::shared_ptr<TensorReader::SpilledItem> TensorReader::FindSpill(const std::string& key, uint64_t end) {
  std::lock_guard<std::mutex> lock(spill_mu_);
  for (size_t i = 0; i < spills_.size(); ++i) {
    if (spills_[i]->key != key || spills_[i]->size < end) continue;
    auto s = spills_[i];
    spills_.erase(spills_.begin() + static_cast<std::ptrdiff_t>(i));
    spills_.push_back(s);
    return s;
  }
  return nullptr;
}

Result<std::shared_ptr<TensorReader::SpilledItem>> TensorReader::SpillItem(const Fragment& f, const std::string& key,
                                                                           uint64_t size) {
  if (size > kSpillBytes || size > FreeBytes(TempDir()) / 2) return std::shared_ptr<SpilledItem>();
  auto s = std::make_shared<SpilledItem>();
  s->key = key;
  s->fd = OpenUnlinkedTempFile("ckptfs-item");
  if (s->fd < 0) return std::shared_ptr<SpilledItem>();  // no temporary file: stream instead
  const std::unique_ptr<formats::ZstdCursor> cur = NewCursor(f, size);
  constexpr uint64_t kStep = 8ull << 20;
  for (uint64_t pos = 0; pos < size; pos += kStep) {
    ASSIGN_OR_RETURN(std::string bytes, cur->Read(pos, std::min(kStep, size - pos)));
    // A full or failing temporary file system: stream instead.
    if (!PwriteAll(s->fd, pos, bytes.data(), bytes.size(), "a decoded copy in " + TempDir()).ok()) {
      return std::shared_ptr<SpilledItem>();
    }
  }
  s->size = size;
  std::lock_guard<std::mutex> lock(spill_mu_);
  spills_.push_back(s);
  spill_bytes_ += size;
  while (spill_bytes_ > kSpillBytes && spills_.size() > 1) {
    spill_bytes_ -= spills_.front()->size;
    spills_.erase(spills_.begin());
  }
  return s;
}

}  // namespace ckptfs
