// Chunked formats (DCP, safetensors shards) promise that a tensor's chunks
// tile it exactly: every element in one chunk. This checks a reader's
// fragments against that promise.
#ifndef CKPTFS_FORMATS_TILING_H_
#define CKPTFS_FORMATS_TILING_H_

#include <string>
#include <vector>

#include "ckptfs/common.h"
#include "ckptfs/model.h"

namespace ckptfs::formats {

// A hole or an overlap is an error naming its coordinates and the files of
// the chunks involved; `detail` gets them as JSON for the verify report.
Status CheckTiling(const TensorRecord& t, const std::vector<Fragment>& frags, const std::vector<SourceFile>& files,
                   std::string* detail);

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_TILING_H_
