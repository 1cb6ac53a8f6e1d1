#include "ckptfs/common.h"

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <mutex>

namespace ckptfs {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "ckptfs reads little-endian checkpoints in place; big-endian hosts are unsupported");

Status ErrnoStatus(std::string_view verb, std::string_view path, int err) {
  Code code = Code::kIo;
  if (err == ENOENT) code = Code::kNotFound;
  if (err == ESTALE) code = Code::kStale;
  return Status(code, "cannot " + std::string(verb) + " " + std::string(path) + ": " +
                          std::strerror(err));
}

namespace {
// Lock order: g_log_mu is a leaf lock; nothing is called while holding it.
std::mutex g_log_mu;
LogLevel g_level = LogLevel::kInfo;
FILE* g_log = nullptr;  // nullptr: stderr
}  // namespace

void SetLogLevel(LogLevel level) {
  std::lock_guard<std::mutex> lock(g_log_mu);
  g_level = level;
}

void SetLogFile(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_log_mu);
  if (g_log != nullptr) std::fclose(g_log);
  g_log = path.empty() ? nullptr : std::fopen(path.c_str(), "ae");
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
  std::fprintf(out, "%s ckptfs %s: %.*s\n", ts, kNames[static_cast<int>(level)],
               static_cast<int>(message.size()), message.data());
  std::fflush(out);
}

std::string Hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string JsonEscape(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 2);
  out.push_back('"');
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
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
