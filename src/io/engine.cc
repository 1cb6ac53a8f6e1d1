#include <unistd.h>

#include <cerrno>

#include "ckptfs/io.h"

namespace ckptfs {
namespace {

class PreadEngine final : public ReadEngine {
 public:
  Status ReadBatch(std::span<IoRequest> reqs) override {
    for (IoRequest& r : reqs) {
      uint64_t done = 0;
      while (done < r.length) {
        ssize_t n = ::pread(r.fd, r.dst + done, r.length - done, static_cast<off_t>(r.offset + done));
        if (n < 0) {
          if (errno == EINTR) continue;
          return IoError(std::string("cannot read source: ") + std::strerror(errno));
        }
        if (n == 0) {
          return Invalid("cannot read source: the file ends before byte " + std::to_string(r.offset + done) +
                         ", wanted up to " + std::to_string(r.offset + r.length) + " (truncated?)");
        }
        done += static_cast<uint64_t>(n);
      }
    }
    return Status::Ok();
  }
  const char* name() const override { return "pread"; }
};

}  // namespace

std::unique_ptr<ReadEngine> MakePreadEngine() { return std::make_unique<PreadEngine>(); }

Result<EngineKind> ParseEngineKind(std::string_view s) {
  if (s == "auto") return EngineKind::kAuto;
  if (s == "uring" || s == "io_uring") return EngineKind::kUring;
  if (s == "pread") return EngineKind::kPread;
  return Invalid("unknown engine '" + std::string(s) + "' (auto, uring, pread)");
}

}  // namespace ckptfs
