// Progress of long work (index builds, verify) for the person waiting on it.
//
// Design note. A Progress has three audiences, picked once when it is made:
//  * stderr is a terminal and progress is not quieted (SetProgressQuiet, the
//    CLI's -q/--quiet): one line, redrawn in place with '\r' at most every
//    200 ms (CKPTFS_PROGRESS_INTERVAL_MS overrides; 0 redraws at every Add),
//    and a final line once done; work that ends before the first redraw
//    prints nothing, so quick commands stay quiet;
//  * stderr is not a terminal and the log goes to a file (the mount daemon:
//    its index build, the verify behind .ckptfs/report.json): a LogInfo line
//    at most every 10 s (CKPTFS_PROGRESS_INTERVAL_MS overrides this too), and
//    a final one, only for work that runs longer than one interval;
//  * otherwise (a pipe, a test): nothing at all.
// Add() is thread-safe and cheap: a relaxed atomic add, and one clock read
// plus a compare-and-swap deciding which caller draws; drawing happens under
// a mutex held only while formatting and writing the line.
#ifndef CKPTFS_PROGRESS_H_
#define CKPTFS_PROGRESS_H_

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

#include "ckptfs/common.h"  // SetProgressQuiet

namespace ckptfs {

// "1.5 GiB", "812 B": binary units, one decimal from KiB up.
std::string HumanBytes(uint64_t n);

class Progress {
 public:
  enum class Unit : uint8_t { kBytes, kItems };
  // `total` 0: unknown (no percentage, no ETA). `items` names the unit of
  // kItems ("files", "tensors").
  Progress(std::string label, uint64_t total, Unit unit = Unit::kBytes, std::string items = "items");
  ~Progress();  // Finish()
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void Add(uint64_t n);
  void SetTotal(uint64_t total) { total_.store(total, std::memory_order_relaxed); }
  // Draws the final line (when anything was shown) and stops drawing;
  // idempotent.
  void Finish();
  uint64_t done() const { return done_.load(std::memory_order_relaxed); }
  // The line as it would be drawn now (without '\r' or escapes).
  std::string Line(bool final) const;

 private:
  enum class Mode : uint8_t { kNone, kTerminal, kLog };
  void Draw(bool final);

  const std::string label_;
  const Unit unit_;
  const std::string items_;
  Mode mode_ = Mode::kNone;
  int64_t start_ns_ = 0;
  int64_t interval_ns_ = 0;
  std::atomic<uint64_t> done_{0}, total_{0};
  std::atomic<int64_t> next_draw_ns_{0};
  // Serializes drawing; guards shown_ and finished_. Lock order: draw_mu_,
  // then the log's own lock (LogInfo); nothing else is taken under it.
  std::mutex draw_mu_;
  bool shown_ = false, finished_ = false;
};

// While a ProgressScope is alive, ReportProgress(n) from any thread adds n to
// its Progress: the index build's parsers report the metadata bytes they read
// without knowing who shows them. Scopes nest (the innermost wins, the outer
// one is restored); with none, ReportProgress is one atomic load.
class ProgressScope {
 public:
  explicit ProgressScope(Progress* p);
  ~ProgressScope();
  ProgressScope(const ProgressScope&) = delete;
  ProgressScope& operator=(const ProgressScope&) = delete;

 private:
  Progress* prev_;
};
void ReportProgress(uint64_t n);

}  // namespace ckptfs

#endif  // CKPTFS_PROGRESS_H_
