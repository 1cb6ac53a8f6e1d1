// Cross-file read-ahead (read_ahead.h). Locking: mu_ is taken before the
// view's tree lock (NextInWalk), never after it; the worker calls fetch_
// with no lock held.
#include "ckptfs/read_ahead.h"

#include <algorithm>

namespace ckptfs {

ReadAhead::ReadAhead(const View& view, Fetch fetch) : view_(view), fetch_(std::move(fetch)) {}

ReadAhead::~ReadAhead() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

uint64_t ReadAhead::Next(uint64_t from, View::WalkOrder order, const std::vector<std::string>& passed) const {
  uint64_t at = from;
  for (int steps = 0; steps < 64; ++steps) {
    at = view_.NextInWalk(at, order);
    const Node* n = at == 0 ? nullptr : view_.Get(at);
    if (n == nullptr) return 0;
    // An info.json is made from the index; a name the reader passes over.
    if (n->lazy != Node::Lazy::kInfo && std::find(passed.begin(), passed.end(), n->name) == passed.end()) return at;
  }
  return 0;
}

bool ReadAhead::Follows(uint64_t from, uint64_t ino, View::WalkOrder order, Stream* s) const {
  std::vector<uint64_t> between;
  uint64_t at = from;
  for (int steps = 0; steps <= kSkip; ++steps) {
    at = view_.NextInWalk(at, order);
    if (at == 0) return false;
    if (at == ino) break;
    between.push_back(at);
  }
  if (at != ino) return false;
  for (uint64_t b : between) {
    const Node* n = view_.Get(b);
    if (n == nullptr || n->lazy == Node::Lazy::kInfo) continue;
    if (std::find(s->passed.begin(), s->passed.end(), n->name) == s->passed.end()) s->passed.push_back(n->name);
    std::erase(s->ahead, b);  // asked ahead and passed over
  }
  return true;
}

void ReadAhead::Opened(uint64_t ino, uint32_t pid) {
  const Node* opened = view_.Get(ino);
  if (opened == nullptr || opened->is_dir) return;
  std::unique_lock<std::mutex> lock(mu_);
  auto it = std::find_if(streams_.begin(), streams_.end(), [&](const Stream& s) { return s.pid == pid; });
  if (it == streams_.end()) {
    if (streams_.size() >= static_cast<size_t>(kStreams)) {
      streams_.erase(std::min_element(streams_.begin(), streams_.end(),
                                      [](const Stream& a, const Stream& b) { return a.used < b.used; }));
    }
    streams_.push_back(Stream{});
    it = streams_.end() - 1;
    it->pid = pid;
  }
  Stream& s = *it;
  s.used = ++clock_;
  // A file asked ahead: the walk goes on (past any it skipped).
  auto hit = std::find(s.ahead.begin(), s.ahead.end(), ino);
  const bool was_hit = hit != s.ahead.end();
  bool in_order = was_hit;
  if (was_hit) {
    hits_.fetch_add(1, std::memory_order_relaxed);
    for (auto a = s.ahead.begin(); a != hit; ++a) {  // asked ahead and passed over
      const Node* n = view_.Get(*a);
      if (n != nullptr && std::find(s.passed.begin(), s.passed.end(), n->name) == s.passed.end()) {
        s.passed.push_back(n->name);
      }
    }
    s.ahead.erase(s.ahead.begin(), hit + 1);
  } else if (s.last != 0) {
    // The order the walk has followed first: name and inode order agree
    // over runs of files (a directory's files made in name order).
    const View::WalkOrder other = s.order == View::WalkOrder::kName ? View::WalkOrder::kInode : View::WalkOrder::kName;
    for (View::WalkOrder o : {s.order, other}) {
      if (Follows(s.last, ino, o, &s)) {
        if (o != s.order) {  // a walk in the other order starts here
          s.ahead.clear();
          s.in_order = 1;
        }
        s.order = o;
        in_order = true;
        break;
      }
    }
  }
  if (in_order) {
    const Node* last = view_.Get(s.last);
    if (last != nullptr && last->parent != opened->parent) s.crossed = true;
    std::erase(s.passed, opened->name);  // a name it opens is no longer passed over
    ++s.in_order;
  } else {  // the walk, if any, is broken: start counting again from here
    s.in_order = 1;
    s.crossed = false;
    s.ahead.clear();
    s.passed.clear();
  }
  s.last = ino;
  if (s.in_order < kInOrder) return;
  uint64_t from = s.ahead.empty() ? ino : s.ahead.back();
  while (s.ahead.size() < static_cast<size_t>(kFilesAhead)) {
    const uint64_t next = Next(from, s.order, s.passed);
    const Node* n = next == 0 ? nullptr : view_.Get(next);
    if (n == nullptr || (!s.crossed && n->parent != opened->parent)) break;
    s.ahead.push_back(next);
    queue_.push_back(Job{next, kBytesAhead / kFilesAhead});
    from = next;
  }
  // Stale jobs go first: at most what every stream may have ahead.
  while (queue_.size() > static_cast<size_t>(kStreams * kFilesAhead)) queue_.pop_front();
  if (queue_.empty()) return;
  if (!thread_.joinable()) thread_ = std::thread([this] { Worker(); });
  lock.unlock();
  cv_.notify_one();
}

void ReadAhead::Worker() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    const Job job = queue_.front();
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    const uint64_t bytes = fetch_(job.ino, job.budget);
    if (bytes > 0) {
      files_.fetch_add(1, std::memory_order_relaxed);
      bytes_.fetch_add(bytes, std::memory_order_relaxed);
    }
    lock.lock();
    busy_ = false;
    if (queue_.empty()) idle_cv_.notify_all();
  }
}

void ReadAhead::Drain() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [this] { return stop_ || (queue_.empty() && !busy_); });
}

ReadAhead::Counts ReadAhead::counts() const {
  return Counts{files_.load(std::memory_order_relaxed), bytes_.load(std::memory_order_relaxed),
                hits_.load(std::memory_order_relaxed)};
}

}  // namespace ckptfs
