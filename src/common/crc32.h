// CRC-32 as zlib and ZIP compute it (reflected polynomial 0xEDB88320), on the
// CPU: carry-less multiplication (PCLMULQDQ) folding where the CPU has it,
// else zlib's crc32_z. torch.save archives carry one per entry: the views
// compute it for every archive item they serve (dcp/, torch_dist/, universal/)
// and the reader checks it over source ZIP entries, so it runs over every byte
// such a view serves; zlib's byte-table CRC was a third of the daemon's CPU
// in a Megatron resume.
#ifndef CKPTFS_COMMON_CRC32_H_
#define CKPTFS_COMMON_CRC32_H_

#include <cstdint>

namespace ckptfs {

// zlib's crc32_z(crc, p, n): continues from `crc` (0 to start).
uint32_t Crc32Update(uint32_t crc, const char* p, uint64_t n);

// The same, through zlib alone (the reference, and the fallback).
uint32_t Crc32UpdateZlib(uint32_t crc, const char* p, uint64_t n);

}  // namespace ckptfs

#endif  // CKPTFS_COMMON_CRC32_H_
