// LEB128 varints and zigzag for signed values: the compact in-memory keys and
// records of the index build (DCP chunk keys, packed fragment lists) and the
// views' saved plans (views/plan_cache.cc).
#ifndef CKPTFS_COMMON_VARINT_H_
#define CKPTFS_COMMON_VARINT_H_

#include <cstdint>
#include <string>
#include <string_view>

namespace ckptfs {

inline uint64_t ZigZag(int64_t v) { return (static_cast<uint64_t>(v) << 1) ^ static_cast<uint64_t>(v >> 63); }
inline int64_t UnZigZag(uint64_t z) { return static_cast<int64_t>(z >> 1) ^ -static_cast<int64_t>(z & 1); }

inline void PutVarint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

// Reads a varint at *pos and advances it; stops at the end of `s` (callers
// decode only what they encoded).
inline uint64_t GetVarint(std::string_view s, size_t* pos) {
  uint64_t v = 0;
  for (int shift = 0; *pos < s.size() && shift < 64; shift += 7) {
    const auto b = static_cast<unsigned char>(s[(*pos)++]);
    v |= static_cast<uint64_t>(b & 0x7F) << shift;
    if (b < 0x80) break;
  }
  return v;
}

// As GetVarint, for bytes that may be damaged: false (and `*v` untouched)
// when the varint runs past the end of `s` or past 64 bits.
inline bool TryGetVarint(std::string_view s, size_t* pos, uint64_t* v) {
  uint64_t out = 0;
  for (size_t at = *pos, shift = 0; at < s.size() && shift < 64; shift += 7) {
    const auto b = static_cast<unsigned char>(s[at++]);
    out |= static_cast<uint64_t>(b & 0x7F) << shift;
    if (b < 0x80) {
      *pos = at;
      *v = out;
      return true;
    }
  }
  return false;
}

}  // namespace ckptfs

#endif  // CKPTFS_COMMON_VARINT_H_
