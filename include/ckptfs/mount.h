// Mounting the filesystem core with libfuse (low-level API). Only src/fuse
// includes libfuse; the CLI calls this.
#ifndef CKPTFS_MOUNT_H_
#define CKPTFS_MOUNT_H_

#include <functional>
#include <string>

#include "ckptfs/fs.h"

namespace ckptfs {

struct MountOptions {
  bool allow_other = false;  // off unless asked (DESIGN.md FUSE rules)
  bool debug = false;        // libfuse request tracing
  unsigned max_threads = 16; // worker threads of the multithreaded loop
};

// Mounts `fs` at `mountpoint`, calls `ready` once the mount is live (the CLI
// detaches from the terminal there) and serves requests until unmounted or
// signalled. Returns 0 on a clean unmount.
int MountAndServe(Filesystem& fs, const std::string& mountpoint, const MountOptions& opts,
                  const std::function<void(const Status&)>& ready);

}  // namespace ckptfs

#endif  // CKPTFS_MOUNT_H_
