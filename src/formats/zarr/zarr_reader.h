// Zarr v2 directory stores (https://zarr-specs.readthedocs.io/en/latest/v2/v2.0.html),
// the subset Megatron's zarr strategy wrote: one array per immediate
// subdirectory holding a `.zarray`, uncompressed (`compressor: null`, no
// filters), C order, chunk keys joined by `dimension_separator` ("." default).
// Every chunk file holds a full chunk (edge chunks too), so each chunk is one
// fragment read straight from its file. dtype "bfloat16" is Megatron's rewrite
// of numpy's 2-byte void; a bare "<V2" is refused rather than guessed.
//
// A chunk file that is absent is a hole: its fragment points at the missing
// file, so reads of that region fail with EIO naming it, never zeros (even
// where fill_value would let zarr itself return fill bytes). A chunk file of
// the wrong size is left out (also a hole) and reported.
#ifndef CKPTFS_FORMATS_ZARR_ZARR_READER_H_
#define CKPTFS_FORMATS_ZARR_ZARR_READER_H_

#include <string>

#include "ckptfs/common.h"
#include "ckptfs/model.h"

namespace ckptfs::formats {

// A zarr v2 `.zarray` dtype string: numpy's little-endian descrs and
// "bfloat16" (tensorstore's extension, also Megatron's rewrite of a 2-byte
// void); a bare "<V2" is refused rather than guessed.
Result<DType> ZarrV2DType(const std::string& d);

// Arrays `<ckpt_root>/<rel_dir>/<name>/.zarray` (rel_dir may be empty); file
// paths are recorded relative to ckpt_root. Problems (holes, bad chunk files,
// unsupported arrays) are appended to ck.info.problems.
Status ReadZarrArrays(const std::string& ckpt_root, const std::string& rel_dir, Checkpoint& ck);

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_ZARR_ZARR_READER_H_
