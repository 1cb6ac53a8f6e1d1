#include "common/temp_file.h"

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

namespace ckptfs {

std::string TempDir() {
  const char* env = std::getenv("TMPDIR");
  return env != nullptr && *env != '\0' ? env : "/tmp";
}

int OpenUnlinkedTempFile(const std::string& prefix) {
  const std::string dir = TempDir();
#ifdef O_TMPFILE
  int fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd >= 0) return fd;
#endif
  std::string path = dir + "/" + prefix + "-XXXXXX";
  fd = ::mkostemp(path.data(), O_CLOEXEC);
  if (fd >= 0) ::unlink(path.c_str());
  return fd;
}

Status PwriteAll(int fd, uint64_t at, const char* data, uint64_t len, const std::string& what) {
  uint64_t done = 0;
  while (done < len) {
    const ssize_t n = ::pwrite(fd, data + done, len - done, static_cast<off_t>(at + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return ErrnoStatus("write", what, n < 0 ? errno : ENOSPC);
    done += static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

uint64_t FreeBytes(const std::string& dir) {
  struct statvfs s {};
  if (::statvfs(dir.c_str(), &s) != 0) return 0;
  return static_cast<uint64_t>(s.f_bavail) * s.f_frsize;
}

}  // namespace ckptfs
