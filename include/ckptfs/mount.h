// Mounting the filesystem core with libfuse (low-level API). Only src/fuse
// includes libfuse; the CLI calls this.
#ifndef CKPTFS_MOUNT_H_
#define CKPTFS_MOUNT_H_

#include <cstdint>
#include <functional>
#include <string>

#include "ckptfs/fs.h"

namespace ckptfs {

struct MountOptions {
  bool allow_other = false;   // off unless asked (docs/design.md, FUSE rules)
  bool debug = false;         // libfuse request tracing
  unsigned max_threads = 16;  // worker threads of the multithreaded loop
  std::string fsname;         // the source shown by findmnt / df ("ckptfs" when empty)
  int64_t uid = -1;           // owner shown for every file (-1: the mounting user)
  int64_t gid = -1;           // group shown for every file (-1: the mounting group)
};

// Mounts `fs` at `mountpoint`, calls `ready` once the mount is live (the CLI
// detaches from the terminal there) and serves requests until unmounted or
// signalled. Returns 0 on a clean unmount.
int MountAndServe(Filesystem& fs, const std::string& mountpoint, const MountOptions& opts,
                  const std::function<void(const Status&)>& ready);

}  // namespace ckptfs

#endif  // CKPTFS_MOUNT_H_
