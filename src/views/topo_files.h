// File layouts of the topo/ and hf/ views (internal to the views layer): the
// safetensors files of a rank or an hf/ shard, layout.json, the ZeRO-style DP
// partitions, and Megatron-native per-rank torch.save archives. Every layout
// is literal headers plus sub-boxes of global tensors; sizes are exact
// before any tensor byte is read.
#ifndef CKPTFS_VIEWS_TOPO_FILES_H_
#define CKPTFS_VIEWS_TOPO_FILES_H_

#include <string>
#include <utility>
#include <vector>

#include "ckptfs/index.h"
#include "ckptfs/topo.h"
#include "ckptfs/views.h"

namespace ckptfs::topo_files {

using NamedLayout = std::pair<std::string, FileLayout>;  // path relative to the view dir

// One safetensors file of `tensors` (each in its source dtype), with
// `metadata` as __metadata__. Their pieces are moved into the layout (names
// and shapes stay). An error names a dtype safetensors lacks.
Result<FileLayout> Safetensors(const Index& index, std::vector<RankTensor>& tensors,
                               const std::vector<std::pair<std::string, std::string>>& metadata);

// Every file of topo/<name>/: tp<t>-pp<p>.safetensors, layout.json, with -dp<D>
// tp<t>-pp<p>-dp<d>.safetensors, and Megatron-native files for Megatron sources.
Result<std::vector<NamedLayout>> TopoFiles(const Index& index, const TopoPlan& plan);

// hf/: model-0000k-of-0000n.safetensors (shards of at most hf_shard_bytes
// unless one tensor is larger), model.safetensors.index.json, config.json when
// an architecture is known (hf_export.h), and ERRORS.
Result<std::vector<NamedLayout>> HfFiles(const Index& index, const TopoOptions& opts);

// The parts of a torch.save archive holding one tensor: the box `box` of
// tensor `id` (null: the whole tensor) rendered as `out`, as torch.save(t)
// writes it (archive name "archive"), e.g. one item of a DCP data file;
// its shape has `lead_ones` axes of length 1 before the box's (a layer of a
// stack).
Result<std::vector<ExportPart>> TorchSaveTensorParts(const Index& index, uint32_t id, DType out, const Box* box,
                                                     int lead_ones = 0);

// Segments of a synthesized file's parts (ExportFile, torch.save archives).
Result<FileLayout> LayoutOfParts(const Index& index, const std::string& path, const std::vector<ExportPart>& parts);

}  // namespace ckptfs::topo_files

#endif  // CKPTFS_VIEWS_TOPO_FILES_H_
