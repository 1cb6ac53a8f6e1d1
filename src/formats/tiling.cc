#include "formats/tiling.h"

#include "ckptfs/geometry.h"

namespace ckptfs::formats {

Status CheckTiling(const TensorRecord& t, const std::vector<Fragment>& frags, const std::vector<SourceFile>& files,
                   std::string* detail) {
  auto files_of = [&](const Fragment& f) { return f.file.v < files.size() ? files[f.file.v].rel_path : "?"; };
  std::vector<Box> boxes;
  for (const auto& f : frags) {
    if (f.offsets.size() != t.shape.size() || f.lengths.size() != t.shape.size()) {
      return Invalid("a chunk's rank differs from the tensor's");
    }
    for (size_t d = 0; d < t.shape.size(); ++d) {
      if (f.offsets[d] < 0 || f.lengths[d] < 0 || f.offsets[d] + f.lengths[d] > t.shape[d]) {
        return Invalid("a chunk lies outside the tensor's shape");
      }
    }
    boxes.push_back(Box{f.offsets, f.lengths});
  }
  const Coverage c = AnalyzeCoverage(t.shape, boxes, 8);
  if (c.clean()) return Status::Ok();
  CoverageText text = DescribeCoverage(
      c, t.shape, [&](size_t i) { return files_of(frags[i]); }, "chunks");
  *detail = std::move(text.detail);
  return Invalid(text.message);
}

}  // namespace ckptfs::formats
