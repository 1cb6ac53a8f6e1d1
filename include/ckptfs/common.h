// ckptfs common layer: Status / Result, logging, byte helpers.
//
// Design note. Nothing in ckptfs throws across a layer boundary. Every fallible
// function returns `Status` or `Result<T>`; messages read
// "cannot <verb> <thing>: <reason>" and gain context as they propagate
// (`Annotate`). Errors carry a coarse `Code` so the FUSE layer can map them to
// an errno in exactly one place (src/fuse/errno_map.cc).
#ifndef CKPTFS_COMMON_H_
#define CKPTFS_COMMON_H_

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace ckptfs {

enum class Code : uint8_t {
  kOk = 0,
  kNotFound,     // a name that does not exist (ENOENT)
  kInvalid,      // malformed or inconsistent input (EIO through the mount)
  kIo,           // an OS-level read failure (EIO)
  kStale,        // a source file changed after indexing (ESTALE)
  kUnsupported,  // a format variant we do not handle (EIO)
  kReadOnly,     // any write (EROFS)
  kInternal,     // a bug (EIO plus a loud log line)
};

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status Ok() { return {}; }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }

  // Prefixes context: Annotate("cannot read x.distcp") on "bad header" gives
  // "cannot read x.distcp: bad header".
  Status Annotate(std::string_view context) const {
    if (ok()) return *this;
    return Status(code_, std::string(context) + ": " + message_);
  }

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

// Name matching for parameter names (split rules, layer numbers).
inline bool EndsWith(std::string_view s, std::string_view suf) {
  return s.size() >= suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0;
}
inline bool Contains(std::string_view s, std::string_view part) { return s.find(part) != std::string_view::npos; }

inline Status Invalid(std::string m) { return {Code::kInvalid, std::move(m)}; }
inline Status NotFound(std::string m) { return {Code::kNotFound, std::move(m)}; }
inline Status IoError(std::string m) { return {Code::kIo, std::move(m)}; }
inline Status Unsupported(std::string m) { return {Code::kUnsupported, std::move(m)}; }
inline Status Stale(std::string m) { return {Code::kStale, std::move(m)}; }
inline Status Internal(std::string m) { return {Code::kInternal, std::move(m)}; }

// Errno-formatted I/O failure: "cannot <verb> <path>: <strerror>".
Status ErrnoStatus(std::string_view verb, std::string_view path, int err);

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}         // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {}  // NOLINT(google-explicit-constructor)

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOkStatus;
    return ok() ? kOkStatus : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

// Opens source file `rel` of the checkpoint rooted at `root` for reading
// (trust boundary, docs/design.md): resolution stays beneath `root` (Linux
// openat2 RESOLVE_BENEATH: `..` and symlinks may move around inside the tree
// but never out of it; absolute symlinks are refused), the open never blocks
// (a FIFO or device is refused, not waited on), and the result must be a
// regular file. Errors name the path and the reason. Returns the fd.
Result<int> OpenSourceFile(const std::string& root, const std::string& rel);
// The same check for a path the caller chose itself (the checkpoint's own
// metadata file): non-blocking, regular files only.
Result<int> OpenRegularFile(const std::string& path);

#define CKPTFS_CONCAT_INNER(a, b) a##b
#define CKPTFS_CONCAT(a, b) CKPTFS_CONCAT_INNER(a, b)

#define RETURN_IF_ERROR(expr)      \
  do {                             \
    ::ckptfs::Status _st = (expr); \
    if (!_st.ok()) return _st;     \
  } while (0)

#define ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                          \
  if (!tmp.ok()) return tmp.status();         \
  lhs = std::move(tmp).value()

#define ASSIGN_OR_RETURN(lhs, expr) ASSIGN_OR_RETURN_IMPL(CKPTFS_CONCAT(_res_, __LINE__), lhs, expr)

// ---- logging -------------------------------------------------------------
// One line per event on stderr (or the file set by SetLogFile). The daemon
// logs every EIO it returns with the reason, so a user can find out why.
enum class LogLevel : uint8_t { kDebug, kInfo, kWarn, kError };
void SetLogLevel(LogLevel level);
void SetLogFile(const std::string& path);  // empty: stderr
// Names the mount in every line ("ckptfs[/mnt/ck] info: ..."); empty: none.
void SetLogTag(const std::string& tag);
bool LogsToFile();  // SetLogFile named a file (the mount daemon)
// Silences the progress lines long work draws on a terminal (false); the
// daemon's progress log lines stay. See ckptfs/progress.h.
void SetProgressQuiet(bool quiet);
void Log(LogLevel level, std::string_view message);
inline void LogError(std::string_view m) { Log(LogLevel::kError, m); }
inline void LogWarn(std::string_view m) { Log(LogLevel::kWarn, m); }
inline void LogInfo(std::string_view m) { Log(LogLevel::kInfo, m); }

// ---- byte helpers (little-endian, unaligned-safe) --------------------------
template <typename T>
inline T LoadLE(const void* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;  // every supported host is little-endian (checked in common.cc)
}
template <typename T>
inline void StoreLE(void* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

// Checked arithmetic for sizes taken from untrusted input.
inline bool MulOverflow(uint64_t a, uint64_t b, uint64_t* out) { return __builtin_mul_overflow(a, b, out); }
inline bool AddOverflow(uint64_t a, uint64_t b, uint64_t* out) { return __builtin_add_overflow(a, b, out); }

// xxh3-64 of a byte range, as 16 lowercase hex digits.
std::string Hex64(uint64_t v);
// A JSON string literal of `s`; bytes that are not valid UTF-8 are written
// as %XX (EscapeNonUtf8), so the result is always valid JSON.
std::string JsonEscape(std::string_view s);

// Names from a checkpoint are byte strings: a pickled str may hold lone
// surrogates (Python's surrogateescape), a file name any byte. JSON,
// safetensors headers and pickles need UTF-8, so a name that is not valid
// UTF-8 (RFC 3629: no overlongs, no surrogates, at most U+10FFFF) is shown
// with each byte of every invalid sequence as %XX (uppercase hex); valid
// UTF-8 is returned unchanged.
bool IsUtf8(std::string_view s);
std::string EscapeNonUtf8(std::string_view s);

}  // namespace ckptfs

#endif  // CKPTFS_COMMON_H_
