// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) on the CPU: SSE4.2's
// crc32 instruction where the CPU has it, else slicing-by-8 tables. Used by
// the formats (OCDBT and zarr v3 checksums) and the CPU transforms backend.
#ifndef CKPTFS_COMMON_CRC32C_H_
#define CKPTFS_COMMON_CRC32C_H_

#include <cstdint>

namespace ckptfs {

// Standard CRC-32C (init and final xor ~0) continuing from `crc` (0 to start).
uint32_t Crc32cUpdate(uint32_t crc, const char* p, uint64_t n);

}  // namespace ckptfs

#endif  // CKPTFS_COMMON_CRC32C_H_
