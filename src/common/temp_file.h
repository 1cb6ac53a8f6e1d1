// Unlinked temporary files in $TMPDIR (else /tmp): what the daemon keeps on
// local disk instead of in memory (checksum runs past their memory budget,
// large decompressed items). Never in a checkpoint directory.
#ifndef CKPTFS_COMMON_TEMP_FILE_H_
#define CKPTFS_COMMON_TEMP_FILE_H_

#include <cstdint>
#include <string>

#include "ckptfs/common.h"

namespace ckptfs {

// The directory temporary files go to: $TMPDIR, else /tmp.
std::string TempDir();
// An unlinked read-write file there (O_TMPFILE, else mkostemp + unlink),
// `prefix` naming it while it has a name; -1 with errno set on failure.
int OpenUnlinkedTempFile(const std::string& prefix);
// All of `len` bytes at `at` (pwrite, EINTR retried); `what` names the file.
Status PwriteAll(int fd, uint64_t at, const char* data, uint64_t len, const std::string& what);
// The bytes free to an unprivileged writer in the file system of `dir`, or 0.
uint64_t FreeBytes(const std::string& dir);

}  // namespace ckptfs

#endif  // CKPTFS_COMMON_TEMP_FILE_H_
