// .npy header writer (numpy format 1.0, numpy/lib/format.py): magic,
// version, u16 header length, a Python dict literal padded with spaces and a
// newline so that the data starts on a 64-byte boundary (numpy >= 1.23 pads
// to 64; readers accept any multiple of 16). Deterministic: the header of a
// tensor is a pure function of its dtype and shape, so view sizes are exact.
#ifndef CKPTFS_FORMATS_NPY_H_
#define CKPTFS_FORMATS_NPY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "ckptfs/common.h"
#include "ckptfs/model.h"

namespace ckptfs::formats {

// Header for a C-order array; error when numpy has no such dtype.
Result<std::string> NpyHeader(DType dtype, const std::vector<int64_t>& shape);

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_NPY_H_
