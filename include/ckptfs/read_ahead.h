// Cross-file read-ahead: a reader that opens a tree's files one after the
// other in a walk's order (cp -r, diff -r, rsync, tar, a loader iterating
// params/) has the source bytes of the next files asked of the storage
// before it opens them, so the disk's latency for file k+1 overlaps the
// transfer of file k.
//
// Bounded: at most kFilesAhead files and kBytesAhead source bytes ahead of
// the reader (each file ahead gets an equal share; info.json files, whose
// bytes come from the index, are passed over), and only once the reader has
// opened kInOrder files in a row in one walk order (View::NextInWalk: name
// order, or inode order as GNU cp sorts); until its walk has crossed into a
// second directory, no further than its own directory. A walk may pass over
// files (at most kSkip at a time: a loader that takes each directory's
// fp32.npy only); the names it passed over are passed over when reading
// ahead, until it opens one. The first open that breaks the walk stops it.
// A reader of one file, or of files in any other order, causes no
// read-ahead at all. Streams are told apart by the opening process (FUSE's
// request pid): two walks at once each keep their own.
//
// Off unless asked for (FsOptions::read_ahead, --read-ahead on): on the
// storage it was measured on, local and network-like alike, it made walks
// slower (docs/performance.md, "Cross-file read-ahead").
//
// What "asking the storage" means is the caller's (`fetch`: the filesystem
// core advises the kernel to read a file's source spans, posix_fadvise
// WILLNEED); it runs on one worker thread of this object's, never on the
// thread that opened the file.
#ifndef CKPTFS_READ_AHEAD_H_
#define CKPTFS_READ_AHEAD_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ckptfs/views.h"

namespace ckptfs {

class ReadAhead {
 public:
  static constexpr int kInOrder = 3;                 // opens in a row before any read-ahead
  static constexpr int kFilesAhead = 2;              // files ahead of the reader
  static constexpr uint64_t kBytesAhead = 64 << 20;  // source bytes ahead of the reader
  static constexpr int kStreams = 8;                 // readers followed at once (least recent dropped)
  static constexpr int kSkip = 8;                    // files a walk may pass over between two opens

  // `fetch(ino, budget)`: asks the storage for at most `budget` bytes of
  // file `ino`'s sources; returns how many it asked for (0: none, e.g. a
  // file of literals).
  using Fetch = std::function<uint64_t(uint64_t ino, uint64_t budget)>;
  ReadAhead(const View& view, Fetch fetch);
  ~ReadAhead();
  ReadAhead(const ReadAhead&) = delete;
  ReadAhead& operator=(const ReadAhead&) = delete;

  // File `ino` was opened by process `pid`.
  void Opened(uint64_t ino, uint32_t pid);

  struct Counts {
    uint64_t files = 0;  // files whose sources were asked ahead
    uint64_t bytes = 0;  // source bytes asked ahead
    uint64_t hits = 0;   // files asked ahead that their reader then opened
  };
  Counts counts() const;
  // Waits until every file asked ahead so far has been fetched (tests).
  void Drain();

 private:
  struct Stream {
    uint32_t pid = 0;
    uint64_t last = 0;  // the file it opened last
    int in_order = 0;   // opens in a row in `order`'s walk, `last` included
    View::WalkOrder order = View::WalkOrder::kName;
    bool crossed = false;             // the walk has entered a second directory
    uint64_t used = 0;                // clock_ at its last open, for eviction
    std::vector<uint64_t> ahead;      // files asked ahead and not yet opened, in walk order
    std::vector<std::string> passed;  // names the walk passed over (not opened since)
  };
  // The file after `from` in `order`'s walk, past info.json files and files
  // named in `passed`; 0: none.
  uint64_t Next(uint64_t from, View::WalkOrder order, const std::vector<std::string>& passed) const;
  // Whether `ino` is among the kSkip files after `from` in `order`'s walk;
  // those before it are passed over (their names to s->passed, out of s->ahead).
  bool Follows(uint64_t from, uint64_t ino, View::WalkOrder order, Stream* s) const;
  void Worker();

  const View& view_;
  Fetch fetch_;
  std::mutex mu_;  // guards streams_, queue_, busy_, stop_, thread_ start
  std::condition_variable cv_, idle_cv_;
  std::vector<Stream> streams_;
  uint64_t clock_ = 0;
  struct Job {
    uint64_t ino, budget;
  };
  std::deque<Job> queue_;
  bool busy_ = false, stop_ = false;
  std::thread thread_;  // started on the first job
  std::atomic<uint64_t> files_{0}, bytes_{0}, hits_{0};
};

}  // namespace ckptfs

#endif  // CKPTFS_READ_AHEAD_H_
