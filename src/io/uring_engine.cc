// io_uring engine: one ring per worker thread (owned by the caller through a
// thread_local, see tensor_reader.cc), requests submitted as one batch up to
// the queue depth, short reads resubmitted for the remainder.
#include <liburing.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "ckptfs/io.h"

namespace ckptfs {
namespace {

class UringEngine final : public ReadEngine {
 public:
  explicit UringEngine(unsigned depth) : depth_(depth) {}
  ~UringEngine() override {
    if (ok_) io_uring_queue_exit(&ring_);
  }
  bool Init() {
    ok_ = io_uring_queue_init(depth_, &ring_, 0) == 0;
    return ok_;
  }

  Status ReadBatch(std::span<IoRequest> reqs) override {
    // Remaining work per request: (offset done so far).
    std::vector<uint64_t> done(reqs.size(), 0);
    size_t next = 0, inflight = 0, finished = 0;
    for (size_t i = 0; i < reqs.size(); ++i) {
      if (reqs[i].length == 0) ++finished;
    }
    Status err;                   // first failure; then drain what is in flight
    std::vector<size_t> pending;  // requests to (re)submit
    for (size_t i = 0; i < reqs.size(); ++i) {
      if (reqs[i].length > 0) pending.push_back(i);
    }
    while (finished < reqs.size()) {
      while (next < pending.size() && inflight < depth_) {
        io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
        if (sqe == nullptr) break;
        size_t i = pending[next++];
        IoRequest& r = reqs[i];
        uint64_t chunk = std::min<uint64_t>(r.length - done[i], 1u << 30);
        io_uring_prep_read(sqe, r.fd, r.dst + done[i], static_cast<unsigned>(chunk),
                           static_cast<__u64>(r.offset + done[i]));
        io_uring_sqe_set_data64(sqe, i);
        ++inflight;
      }
      int rc = io_uring_submit_and_wait(&ring_, 1);
      if (rc < 0 && rc != -EINTR) return IoError(std::string("cannot submit io_uring reads: ") + std::strerror(-rc));
      io_uring_cqe* cqe;
      unsigned head, seen = 0;
      io_uring_for_each_cqe(&ring_, head, cqe) {
        ++seen;
        --inflight;
        size_t i = static_cast<size_t>(io_uring_cqe_get_data64(cqe));
        int res = cqe->res;
        if (res < 0) {
          if ((res == -EAGAIN || res == -EINTR) && err.ok()) {
            pending.push_back(i);
            continue;
          }
          if (err.ok()) err = IoError(std::string("cannot read source: ") + std::strerror(-res));
          ++finished;
          continue;
        }
        if (res == 0) {
          if (err.ok()) {
            err = Invalid("cannot read source: the file ends before byte " + std::to_string(reqs[i].offset + done[i]) +
                          ", wanted up to " + std::to_string(reqs[i].offset + reqs[i].length) + " (truncated?)");
          }
          ++finished;
          continue;
        }
        done[i] += static_cast<uint64_t>(res);
        if (done[i] < reqs[i].length && err.ok()) {
          pending.push_back(i);  // short read: resubmit the rest
        } else {
          ++finished;
        }
      }
      io_uring_cq_advance(&ring_, seen);
      if (!err.ok()) {
        next = pending.size();  // submit nothing more
        if (inflight == 0) return err;
      }
    }
    return err;
  }
  const char* name() const override { return "io_uring"; }

 private:
  unsigned depth_;
  io_uring ring_{};
  bool ok_ = false;
};

}  // namespace

std::unique_ptr<ReadEngine> MakeUringEngine(unsigned queue_depth) {
  auto e = std::make_unique<UringEngine>(queue_depth);
  if (!e->Init()) return nullptr;
  return e;
}

}  // namespace ckptfs
