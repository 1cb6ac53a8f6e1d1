#include "ckptfs/common.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <mutex>

namespace ckptfs {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "ckptfs reads little-endian checkpoints in place; big-endian hosts are unsupported");

Status ErrnoStatus(std::string_view verb, std::string_view path, int err) {
  Code code = Code::kIo;
  if (err == ENOENT) code = Code::kNotFound;
  if (err == ESTALE) code = Code::kStale;
  return Status(code, "cannot " + std::string(verb) + " " + std::string(path) + ": " + std::strerror(err));
}

namespace {

// An fd of a regular file, or an error naming `path` (the fd is closed).
Result<int> RequireRegular(int fd, const std::string& path) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    return ErrnoStatus("stat", path, e);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    const char* what = S_ISFIFO(st.st_mode)                           ? "a FIFO"
                       : S_ISDIR(st.st_mode)                          ? "a directory"
                       : S_ISSOCK(st.st_mode)                         ? "a socket"
                       : (S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode)) ? "a device"
                                                                      : "not a regular file";
    return Invalid("cannot open " + path + ": it is " + std::string(what) + ", not a regular file");
  }
  return fd;
}

}  // namespace

Result<int> OpenRegularFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) return ErrnoStatus("open", path, errno);
  return RequireRegular(fd, path);
}

Result<int> OpenSourceFile(const std::string& root, const std::string& rel) {
  const std::string path = root + "/" + rel;
  const int dir = ::open(root.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (dir < 0) return ErrnoStatus("open", root, errno);
  open_how how{};
  how.flags = O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY;
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS;
  int fd = static_cast<int>(::syscall(SYS_openat2, dir, rel.c_str(), &how, sizeof(how)));
  int err = fd < 0 ? errno : 0;
  if (fd < 0 && (err == ENOSYS || err == EPERM)) {
    // No openat2 (Linux < 5.6, or a seccomp filter): open, then check that
    // the real path is inside the real root.
    fd = ::openat(dir, rel.c_str(), static_cast<int>(how.flags));
    err = fd < 0 ? errno : 0;
    if (fd >= 0) {
      char self[64], real[PATH_MAX], base[PATH_MAX];
      std::snprintf(self, sizeof(self), "/proc/self/fd/%d", fd);
      const ssize_t n = ::readlink(self, real, sizeof(real) - 1);
      const bool inside = n > 0 && ::realpath(root.c_str(), base) != nullptr &&
                          std::string(real, static_cast<size_t>(n)).rfind(std::string(base) + "/", 0) == 0;
      if (!inside) {
        ::close(fd);
        fd = -1;
        err = EXDEV;
      }
    }
  }
  ::close(dir);
  if (fd < 0) {
    if (err == EXDEV || err == ELOOP) {
      return Invalid("cannot open " + path +
                     ": it leads outside the checkpoint directory (a symlink or '..' that "
                     "escapes " +
                     root + "); ckptfs reads only files inside it");
    }
    return ErrnoStatus("open", path, err);
  }
  return RequireRegular(fd, path);
}

namespace {
// Lock order: g_log_mu is a leaf lock; nothing is called while holding it.
std::mutex g_log_mu;
LogLevel g_level = LogLevel::kInfo;
FILE* g_log = nullptr;  // nullptr: stderr
std::string g_tag;      // "[/mnt/ck]" once SetLogTag() named the mount
}  // namespace

void SetLogTag(const std::string& tag) {
  std::lock_guard<std::mutex> lock(g_log_mu);
  g_tag = tag.empty() ? "" : "[" + tag + "]";
}

void SetLogLevel(LogLevel level) {
  std::lock_guard<std::mutex> lock(g_log_mu);
  g_level = level;
}

void SetLogFile(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_log_mu);
  if (g_log != nullptr) std::fclose(g_log);
  g_log = path.empty() ? nullptr : std::fopen(path.c_str(), "ae");
}

bool LogsToFile() {
  std::lock_guard<std::mutex> lock(g_log_mu);
  return g_log != nullptr;
}

void Log(LogLevel level, std::string_view message) {
  static constexpr const char* kNames[] = {"debug", "info", "warn", "error"};
  std::lock_guard<std::mutex> lock(g_log_mu);
  if (level < g_level) return;
  auto now = std::chrono::system_clock::now();
  std::time_t t = std::chrono::system_clock::to_time_t(now);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char ts[32];
  std::strftime(ts, sizeof(ts), "%Y-%m-%dT%H:%M:%SZ", &tm);
  FILE* out = g_log != nullptr ? g_log : stderr;
  std::fprintf(out, "%s ckptfs%s %s: %.*s\n", ts, g_tag.c_str(), kNames[static_cast<int>(level)],
               static_cast<int>(message.size()), message.data());
  std::fflush(out);
}

std::string Hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

namespace {
// Length of the valid UTF-8 sequence at s[i], or 0 when it is not one
// (RFC 3629 section 4: the exact ranges of each lead byte's second byte).
size_t Utf8SeqLen(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  if (c < 0x80) return 1;
  size_t n;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF)
    n = 2;
  else if (c == 0xE0)
    n = 3, lo = 0xA0;
  else if (c == 0xED)
    n = 3, hi = 0x9F;  // no surrogates
  else if (c >= 0xE1 && c <= 0xEF)
    n = 3;
  else if (c == 0xF0)
    n = 4, lo = 0x90;
  else if (c >= 0xF1 && c <= 0xF3)
    n = 4;
  else if (c == 0xF4)
    n = 4, hi = 0x8F;
  else
    return 0;
  if (i + n > s.size()) return 0;
  if (b(i + 1) < lo || b(i + 1) > hi) return 0;
  for (size_t k = 2; k < n; ++k) {
    if (b(i + k) < 0x80 || b(i + k) > 0xBF) return 0;
  }
  return n;
}
}  // namespace

bool IsUtf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const size_t n = Utf8SeqLen(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string EscapeNonUtf8(std::string_view s) {
  if (IsUtf8(s)) return std::string(s);
  std::string out;
  out.reserve(s.size() + 16);
  for (size_t i = 0; i < s.size();) {
    const size_t n = Utf8SeqLen(s, i);
    if (n == 0) {
      char buf[4];
      std::snprintf(buf, sizeof(buf), "%%%02X", static_cast<unsigned char>(s[i]));
      out += buf;
      ++i;
    } else {
      out.append(s.substr(i, n));
      i += n;
    }
  }
  return out;
}

std::string JsonEscape(std::string_view raw) {
  // Most names are printable ASCII with nothing to escape: one pass, one copy.
  if (std::all_of(raw.begin(), raw.end(), [](char c) { return c >= 0x20 && c < 0x7f && c != '"' && c != '\\'; })) {
    std::string out;
    out.reserve(raw.size() + 2);
    out.push_back('"');
    out.append(raw);
    out.push_back('"');
    return out;
  }
  const std::string s = EscapeNonUtf8(raw);
  std::string out;
  out.reserve(s.size() + 2);
  out.push_back('"');
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;  // as nlohmann's dump writes them
      case '\f':
        out += "\\f";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out.push_back(static_cast<char>(c));
        }
    }
  }
  out.push_back('"');
  return out;
}

}  // namespace ckptfs
