// Declarations the files of TensorReader's implementation share (the class
// itself is in ckptfs/io.h): tensor_reader.cc orchestrates reads; freshness.cc,
// item_cache.cc, slab_cache.cc, means.cc, read_plan.cc and mapped_reads.cc each
// hold one concern. The caches' lock order is io.h's: every mutex is a leaf.
#ifndef CKPTFS_IO_TENSOR_READER_INTERNAL_H_
#define CKPTFS_IO_TENSOR_READER_INTERNAL_H_

#include "ckptfs/common.h"
#include "ckptfs/geometry.h"
#include "ckptfs/model.h"

namespace ckptfs {

// The box a read renders: `box`, or the whole tensor (built in `whole`),
// checked to lie in the tensor.
Result<const Box*> ViewOf(const TensorRecord& t, const Box* box, Box* whole);

}  // namespace ckptfs

#endif  // CKPTFS_IO_TENSOR_READER_INTERNAL_H_
