// ChecksumSet: an external sort of checksum ranges by (file, offset).
//
// A run on disk is a sequence of records, each a fixed 32-byte header (offset,
// length, file, crc32, name length, little-endian as the machine writes them:
// the file never leaves this process) and the name bytes. Runs are written in
// sorted order, so ForEach is a k-way merge that reads each run front to back
// through a small buffer; ties go to the earlier run, which holds the earlier
// additions, so "first added wins" holds across runs as within one.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <queue>
#include <tuple>

#include "ckptfs/model.h"
#include "common/temp_file.h"

namespace ckptfs {
namespace {

constexpr size_t kRecBytes = 32;
constexpr size_t kReadBuffer = size_t{256} << 10;

Status WriteAll(int fd, uint64_t at, const std::string& bytes) {
  return PwriteAll(fd, at, bytes.data(), bytes.size(), "the checksum spill file");
}

// One sorted source for the merge: a run in the file, or the ranges still in
// memory (sorted through an index vector).
class Cursor {
 public:
  virtual ~Cursor() = default;
  // The current range; false at the end (or on error, see status()).
  virtual bool Valid() const = 0;
  virtual const ChecksumRange& Get() const = 0;
  virtual void Next() = 0;
  virtual const Status& status() const = 0;
};

class FileCursor : public Cursor {
 public:
  FileCursor(int fd, uint64_t begin, uint64_t bytes, size_t buffer)
      : fd_(fd), at_(begin), end_(begin + bytes), buffer_(buffer) {
    Next();
  }
  bool Valid() const override { return valid_; }
  const ChecksumRange& Get() const override { return cur_; }
  const Status& status() const override { return status_; }
  void Next() override {
    valid_ = false;
    if ((at_ == end_ && pos_ == buf_.size()) || !status_.ok()) return;
    char h[kRecBytes];
    if (!Read(h, kRecBytes)) return;
    uint32_t name_len;
    std::memcpy(&cur_.offset, h, 8);
    std::memcpy(&cur_.length, h + 8, 8);
    std::memcpy(&cur_.file.v, h + 16, 4);
    std::memcpy(&cur_.crc32, h + 20, 4);
    std::memcpy(&name_len, h + 24, 4);
    cur_.name.resize(name_len);
    if (!Read(cur_.name.data(), name_len)) return;
    valid_ = true;
  }

 private:
  bool Read(char* out, size_t n) {
    while (n > 0) {
      if (pos_ == buf_.size()) {
        uint64_t want = std::min<uint64_t>(buffer_, end_ - at_);
        if (want == 0) {
          status_ = Internal("cannot read the checksum spill file: a run ends inside a record");
          return false;
        }
        buf_.resize(want);
        ssize_t got = ::pread(fd_, buf_.data(), want, static_cast<off_t>(at_));
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) {
          status_ = ErrnoStatus("read", "the checksum spill file", got < 0 ? errno : EIO);
          return false;
        }
        buf_.resize(static_cast<size_t>(got));
        at_ += static_cast<uint64_t>(got);
        pos_ = 0;
      }
      size_t take = std::min(n, buf_.size() - pos_);
      std::memcpy(out, buf_.data() + pos_, take);
      pos_ += take;
      out += take;
      n -= take;
    }
    return true;
  }
  int fd_;
  uint64_t at_, end_;
  size_t buffer_;
  std::string buf_;
  size_t pos_ = 0;
  ChecksumRange cur_;
  bool valid_ = false;
  Status status_;
};

// Indices of `recs` in (file, offset) order, stable: of a repeat, the first
// added comes first.
template <typename Recs>
std::vector<uint32_t> SortedOrder(const Recs& recs) {
  std::vector<uint32_t> order(recs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<uint32_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    return std::tie(recs[a].file, recs[a].offset) < std::tie(recs[b].file, recs[b].offset);
  });
  return order;
}

}  // namespace

ChecksumSet::ChecksumSet(size_t memory_budget) : budget_(std::max<size_t>(memory_budget, 1)) {}

ChecksumSet::~ChecksumSet() {
  if (fd_ >= 0) ::close(fd_);
}

ChecksumSet::ChecksumSet(ChecksumSet&& o) noexcept { *this = std::move(o); }

ChecksumSet& ChecksumSet::operator=(ChecksumSet&& o) noexcept {
  if (this == &o) return *this;
  if (fd_ >= 0) ::close(fd_);
  budget_ = o.budget_;
  recs_ = std::move(o.recs_);
  names_ = std::move(o.names_);
  added_ = o.added_;
  fd_ = o.fd_;
  runs_ = std::move(o.runs_);
  file_end_ = o.file_end_;
  spill_error_ = std::move(o.spill_error_);
  o.fd_ = -1;
  o.recs_.clear();
  o.names_.clear();
  o.runs_.clear();
  o.added_ = 0;
  o.file_end_ = 0;
  return *this;
}

void ChecksumSet::Add(const ChecksumRange& r) {
  if (recs_.capacity() == 0) {
    // Sized once for a run (records ~3/4 of the budget, names the rest): a
    // doubling vector would briefly hold one and a half times the budget.
    recs_.reserve(std::max<size_t>(budget_ * 3 / 4 / sizeof(Rec), 1));
    names_.reserve(budget_ / 4);
  }
  const uint32_t name_len = static_cast<uint32_t>(std::min<size_t>(r.name.size(), UINT32_MAX));
  recs_.push_back(Rec{r.offset, r.length, r.file.v, r.crc32, static_cast<uint32_t>(names_.size()), name_len});
  names_.append(r.name, 0, name_len);
  ++added_;
  // names_ offsets are u32: spill before they could wrap, whatever the budget.
  if (recs_.size() * sizeof(Rec) + names_.size() >= budget_ || names_.size() > (UINT32_MAX >> 1)) Spill();
}

void ChecksumSet::Spill() {
  if (!spill_error_.empty() || recs_.empty()) return;
  if (fd_ < 0) {
    fd_ = OpenUnlinkedTempFile("ckptfs-checksums");
    if (fd_ < 0) {
      spill_error_ = ErrnoStatus("create a temporary file in", TempDir(), errno).message() +
                     " (checksum ranges past the memory budget are kept there; set TMPDIR)";
      return;
    }
  }
  const std::vector<uint32_t> order = SortedOrder(recs_);
  const uint64_t begin = file_end_;
  std::string out;
  out.reserve(kReadBuffer + kRecBytes + 4096);
  Status st;
  for (uint32_t i : order) {
    const Rec& r = recs_[i];
    char h[kRecBytes] = {};
    std::memcpy(h, &r.offset, 8);
    std::memcpy(h + 8, &r.length, 8);
    std::memcpy(h + 16, &r.file, 4);
    std::memcpy(h + 20, &r.crc32, 4);
    std::memcpy(h + 24, &r.name_len, 4);
    out.append(h, kRecBytes);
    out.append(names_, r.name_at, r.name_len);
    if (out.size() >= kReadBuffer) {
      st = WriteAll(fd_, file_end_, out);
      if (!st.ok()) break;
      file_end_ += out.size();
      out.clear();
    }
  }
  if (st.ok() && !out.empty()) {
    st = WriteAll(fd_, file_end_, out);
    if (st.ok()) file_end_ += out.size();
  }
  if (!st.ok()) {
    // Keep what is in memory (still correct, just not bounded) and say why.
    spill_error_ = st.message() + " (checksum ranges past the memory budget are kept there; set TMPDIR)";
    file_end_ = begin;
    return;
  }
  runs_.emplace_back(begin, file_end_ - begin);
  recs_.clear();
  names_.clear();
  // The capacity stays for the next run.
}

Status ChecksumSet::ForEach(const std::function<Status(const ChecksumRange&)>& fn) const {
  if (!spill_error_.empty()) return IoError("cannot index checksum ranges: " + spill_error_);
  std::vector<std::unique_ptr<Cursor>> cursors;
  // The merge's read buffers together stay within the budget too.
  const size_t buffer = std::clamp<size_t>(budget_ / (runs_.size() + 1), 4096, kReadBuffer);
  for (const auto& [begin, bytes] : runs_) cursors.push_back(std::make_unique<FileCursor>(fd_, begin, bytes, buffer));

  // The ranges still in memory: the last (latest) run.
  class MemoryCursor : public Cursor {
   public:
    explicit MemoryCursor(const ChecksumSet& s) : s_(s), order_(SortedOrder(s.recs_)) { Load(); }
    bool Valid() const override { return at_ < order_.size(); }
    const ChecksumRange& Get() const override { return cur_; }
    const Status& status() const override { return ok_; }
    void Next() override {
      ++at_;
      Load();
    }

   private:
    void Load() {
      if (at_ >= order_.size()) return;
      const Rec& r = s_.recs_[order_[at_]];
      cur_ = ChecksumRange{FileId{r.file}, r.offset, r.length, r.crc32, s_.names_.substr(r.name_at, r.name_len)};
    }
    const ChecksumSet& s_;
    std::vector<uint32_t> order_;
    size_t at_ = 0;
    ChecksumRange cur_;
    Status ok_;
  };
  cursors.push_back(std::make_unique<MemoryCursor>(*this));

  // Min-heap on (file, offset, run): ties to the earlier run.
  auto later = [&](size_t a, size_t b) {
    const ChecksumRange& x = cursors[a]->Get();
    const ChecksumRange& y = cursors[b]->Get();
    return std::tie(x.file.v, x.offset, a) > std::tie(y.file.v, y.offset, b);
  };
  std::priority_queue<size_t, std::vector<size_t>, decltype(later)> heap(later);
  for (size_t i = 0; i < cursors.size(); ++i) {
    if (cursors[i]->Valid()) heap.push(i);
    RETURN_IF_ERROR(cursors[i]->status());
  }
  bool have_last = false;
  uint32_t last_file = 0;
  uint64_t last_offset = 0;
  while (!heap.empty()) {
    size_t i = heap.top();
    heap.pop();
    const ChecksumRange& r = cursors[i]->Get();
    if (!have_last || r.file.v != last_file || r.offset != last_offset) {
      RETURN_IF_ERROR(fn(r));
      have_last = true;
      last_file = r.file.v;
      last_offset = r.offset;
    }
    cursors[i]->Next();
    RETURN_IF_ERROR(cursors[i]->status());
    if (cursors[i]->Valid()) heap.push(i);
  }
  return Status::Ok();
}

}  // namespace ckptfs
