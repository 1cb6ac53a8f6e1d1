#include "ckptfs/progress.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "ckptfs/common.h"

namespace ckptfs {
namespace {

std::atomic<bool> g_quiet{false};
std::atomic<Progress*> g_scope{nullptr};

constexpr int64_t kTerminalIntervalNs = 200'000'000;  // at most 5 redraws a second
constexpr int64_t kLogIntervalNs = 10'000'000'000;    // a daemon log line every 10 s

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string Fixed1(double v) {
  char b[32];
  std::snprintf(b, sizeof(b), "%.1f", v);
  return b;
}

std::string Duration(double s) {
  if (s < 60) return Fixed1(s) + " s";
  const uint64_t t = static_cast<uint64_t>(s + 0.5);
  char b[32];
  if (t < 3600) {
    std::snprintf(b, sizeof(b), "%llum%02llus", static_cast<unsigned long long>(t / 60),
                  static_cast<unsigned long long>(t % 60));
  } else {
    std::snprintf(b, sizeof(b), "%lluh%02llum", static_cast<unsigned long long>(t / 3600),
                  static_cast<unsigned long long>(t / 60 % 60));
  }
  return b;
}

// Terminal columns; 0 when unknown.
unsigned Columns() {
  winsize ws{};
  if (::ioctl(STDERR_FILENO, TIOCGWINSZ, &ws) != 0) return 0;
  return ws.ws_col;
}

}  // namespace

void SetProgressQuiet(bool quiet) { g_quiet.store(quiet, std::memory_order_relaxed); }

std::string HumanBytes(uint64_t n) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (n < 1024) return std::to_string(n) + " B";
  double v = static_cast<double>(n);
  size_t u = 0;
  while (v >= 1024 && u + 1 < std::size(kUnits)) {
    v /= 1024;
    ++u;
  }
  return Fixed1(v) + " " + kUnits[u];
}

Progress::Progress(std::string label, uint64_t total, Unit unit, std::string items)
    : label_(std::move(label)), unit_(unit), items_(std::move(items)), total_(total) {
  start_ns_ = NowNs();
  if (::isatty(STDERR_FILENO) == 1) {
    if (g_quiet.load(std::memory_order_relaxed)) return;
    mode_ = Mode::kTerminal;
    interval_ns_ = kTerminalIntervalNs;
  } else if (LogsToFile()) {
    mode_ = Mode::kLog;
    interval_ns_ = kLogIntervalNs;
  } else {
    return;
  }
  if (const char* e = std::getenv("CKPTFS_PROGRESS_INTERVAL_MS"); e != nullptr && *e != '\0') {
    char* end = nullptr;
    const long long ms = std::strtoll(e, &end, 10);
    if (end != e && *end == '\0' && ms >= 0 && ms <= 86'400'000) interval_ns_ = ms * 1'000'000;
  }
  next_draw_ns_.store(start_ns_ + interval_ns_, std::memory_order_relaxed);
}

Progress::~Progress() { Finish(); }

void Progress::Add(uint64_t n) {
  done_.fetch_add(n, std::memory_order_relaxed);
  if (mode_ == Mode::kNone) return;
  const int64_t now = NowNs();
  int64_t next = next_draw_ns_.load(std::memory_order_relaxed);
  if (now < next) return;
  // One caller per interval draws; the others go on.
  if (!next_draw_ns_.compare_exchange_strong(next, now + interval_ns_, std::memory_order_relaxed)) return;
  Draw(false);
}

void Progress::Finish() {
  if (mode_ == Mode::kNone) return;
  Draw(true);
}

std::string Progress::Line(bool final) const {
  const uint64_t done = done_.load(std::memory_order_relaxed);
  const uint64_t total = total_.load(std::memory_order_relaxed);
  const double secs = static_cast<double>(NowNs() - start_ns_) / 1e9;
  const double rate = secs > 0 ? static_cast<double>(done) / secs : 0;
  const bool bytes = unit_ == Unit::kBytes;
  auto amount = [&](uint64_t v) { return bytes ? HumanBytes(v) : std::to_string(v); };
  std::string rate_s = bytes ? HumanBytes(static_cast<uint64_t>(rate)) + "/s" : Fixed1(rate) + " " + items_ + "/s";
  std::string s = label_ + ": ";
  if (final) {
    s += amount(done) + (bytes ? "" : " " + items_) + " in " + Duration(secs) + ", " + rate_s;
    return s;
  }
  s += amount(done);
  if (total > 0) {
    s += " / " + amount(total) + (bytes ? "" : " " + items_);
    s += " (" + std::to_string(done >= total ? 100 : done * 100 / total) + "%)";
  } else {
    s += bytes ? "" : " " + items_;
  }
  s += ", " + rate_s;
  if (total > done && rate > 0) s += ", ETA " + Duration(static_cast<double>(total - done) / rate);
  return s;
}

void Progress::Draw(bool final) {
  // Lock order: draw_mu_, then the log's leaf lock (LogInfo).
  std::lock_guard<std::mutex> lock(draw_mu_);
  if (finished_) return;
  if (final) {
    finished_ = true;
    if (!shown_) return;  // ended before the first redraw: nothing to finish
  }
  shown_ = true;
  std::string line = Line(final);
  if (mode_ == Mode::kLog) {
    LogInfo(line);
    return;
  }
  // One terminal line: a label longer than the width loses its start, so
  // '\r' keeps redrawing the same line.
  if (const unsigned cols = Columns(); cols > 8 && line.size() >= cols) {
    line = "..." + line.substr(line.size() - (cols - 4));
  }
  std::fprintf(stderr, "\r%s\x1b[K%s", line.c_str(), final ? "\n" : "");
  std::fflush(stderr);
}

ProgressScope::ProgressScope(Progress* p) : prev_(g_scope.exchange(p)) {}
ProgressScope::~ProgressScope() { g_scope.store(prev_); }

void ReportProgress(uint64_t n) {
  if (Progress* p = g_scope.load(std::memory_order_acquire)) p->Add(n);
}

}  // namespace ckptfs
