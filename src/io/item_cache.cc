// Compressed (zstd) items: Item decompresses an item whole into a byte-bounded
// MRU cache (kItemCacheBytes); ItemSpan serves a span of an item from it, or,
// for items too large to hold, through a kept streaming cursor. Both check
// the source (CheckFd) first. Locking: item_mu_ and cursor_mu_ are leaves; a
// cursor is taken out of cursors_ while used, so nothing is held while decoding.
#include <memory>
#include <string>
#include <utility>

#include "ckptfs/io.h"
#include "formats/zstd.h"

namespace ckptfs {
namespace {

constexpr uint64_t kItemCacheBytes = 64ull << 20;

}  // namespace

Result<std::shared_ptr<const std::string>> TensorReader::Item(const Fragment& f) {
  std::string key = std::to_string(f.file.v) + ":" + std::to_string(f.item_offset);
  {
    std::lock_guard<std::mutex> lock(item_mu_);
    for (auto it = item_cache_.begin(); it != item_cache_.end(); ++it) {
      if (it->first == key) {
        auto v = it->second;
        item_cache_.erase(it);
        item_cache_.emplace_back(key, v);
        return v;
      }
    }
  }
  const std::string& rel = index_.files()[f.file.v].rel_path;
  RETURN_IF_ERROR(CheckFd(f.file));
  std::string raw(f.item_length, '\0');
  IoRequest req{fds_[f.file.v], f.item_offset, f.item_length, raw.data()};
  RETURN_IF_ERROR(ReadSource(std::span<IoRequest>(&req, 1)).Annotate(rel));
  // The index says how many bytes the item holds; more is a bomb, refused
  // before allocating when the frame declares its size.
  uint64_t bound = 0;
  if (AddOverflow(f.data_offset, f.data_length, &bound) || AddOverflow(bound, uint64_t{1} << 20, &bound)) {
    return Invalid("cannot read " + rel + ": bad item bounds");
  }
  ASSIGN_OR_RETURN(std::string plain, formats::ZstdDecompress(raw, bound, rel + " @ " + std::to_string(f.item_offset)));
  auto v = std::make_shared<const std::string>(std::move(plain));
  std::lock_guard<std::mutex> lock(item_mu_);
  item_cache_.emplace_back(key, v);
  item_cache_bytes_ += v->size();
  while (item_cache_bytes_ > kItemCacheBytes && item_cache_.size() > 1) {
    item_cache_bytes_ -= item_cache_.front().second->size();
    item_cache_.erase(item_cache_.begin());
  }
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
  if (bound <= stream_items_above_) {
    ASSIGN_OR_RETURN(auto item, Item(f));
    if (end > item->size()) {
      return Invalid("cannot read " + what + ": the item holds " + std::to_string(item->size()) +
                     " bytes, the metadata needs " + std::to_string(end));
    }
    return std::make_pair(std::move(item), off);
  }
  RETURN_IF_ERROR(CheckFd(f.file));
  const std::string key = std::to_string(f.file.v) + ":" + std::to_string(f.item_offset);
  std::unique_ptr<formats::ZstdCursor> cur;
  {
    std::lock_guard<std::mutex> lock(cursor_mu_);
    for (auto it = cursors_.begin(); it != cursors_.end(); ++it) {
      if (it->first == key && it->second->position() <= off) {
        cur = std::move(it->second);
        cursors_.erase(it);
        break;
      }
    }
  }
  if (cur == nullptr) {
    const int fd = fds_[f.file.v];
    const uint64_t base = f.item_offset;
    cur = std::make_unique<formats::ZstdCursor>(
        [this, fd, base, rel](uint64_t o, uint64_t n, char* dst) {
          IoRequest req{fd, base + o, n, dst};
          return ReadSource(std::span<IoRequest>(&req, 1)).Annotate(rel);
        },
        f.item_length, bound + (uint64_t{1} << 20), what);
  }
  auto bytes = cur->Read(off, len);
  if (!bytes.ok()) return bytes.status();
  {
    std::lock_guard<std::mutex> lock(cursor_mu_);
    cursors_.emplace_back(key, std::move(cur));
    if (cursors_.size() > 8) cursors_.erase(cursors_.begin());
  }
  return std::make_pair(std::make_shared<const std::string>(std::move(bytes).value()), uint64_t{0});
}

}  // namespace ckptfs
