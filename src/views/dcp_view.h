// The dcp/ view (internal to the views layer): any checkpoint as a PyTorch
// Distributed Checkpoint, the directory torch's FileSystemWriter writes, so
// every loader that reads DCP (torch's FileSystemReader and dcp.load at any
// world size and placement, torchtitan, Accelerate, Lightning) resumes from it
// without code.
//
// Design note. Made from the index alone: the .metadata pickle (Metadata with
// TensorStorageMetadata / BytesStorageMetadata per key, MetadataIndex ->
// _StorageInfo per chunk, planner_data) and data files whose items are what
// torch's writer would have written for each chunk: a torch.save archive of
// the chunk (tensors; the bytes rendered from the sources at read time) or
// the entry's own bytes (non-tensor entries). Sizes are exact before any
// tensor byte is read; each item is one kArchive segment, laid out as an
// archive only when it is read, so a data file of a million items holds a
// segment per item, not its ZIP headers.
//
// Keys are those of dcp.save({"model": ..., "optim": ...}) of
// get_state_dict(model, optim): model.<fqn> for each parameter (the fp32
// master where the checkpoint holds one, else the weight), and
// optim.state.<fqn>.<state> for every other optimizer state (exp_avg,
// exp_avg_sq, step, ...), also offered as optimizer.state.<fqn>.<state>
// (Lightning Fabric's and Accelerate's prefix: the same items, so a plan of
// either reads nothing twice). Entries that are neither keep their source key.
// Param groups a family reader recorded with integer ids (DeepSpeed, verl)
// come as internal exports "@dcp/optim.param_groups.<i>.<name>" of literal
// bytes (formats/param_groups.h): bytes entries of their own, not records.
// Chunks follow the source's own row blocks where those tile a tensor along
// dim 0 (an FSDP / row-parallel save), so a rank reads only its blocks; else
// a tensor is one chunk, cut into row blocks of at most kDcpMaxChunkBytes.
// A tensor that cannot be represented (refused by its reader, a dtype
// torch.save lacks, a key two tensors would share) is left out, and named in
// dcp/README.txt: dcp.load then fails with torch's own missing-key error for
// exactly that key.
#ifndef CKPTFS_VIEWS_DCP_VIEW_H_
#define CKPTFS_VIEWS_DCP_VIEW_H_

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "ckptfs/index.h"
#include "ckptfs/views.h"
#include "views/topo_files.h"

namespace ckptfs::dcp_view {

// The largest chunk a tensor without row blocks of its own is cut into.
constexpr uint64_t kDcpMaxChunkBytes = 256ull << 20;
// Items are packed into data files of about this size (__<k>_0.distcp).
constexpr uint64_t kDcpFileBytes = 1ull << 30;
// A .metadata larger than this is written to an unlinked file in $TMPDIR in
// pieces of about this size as it is made, and read back from there.
constexpr uint64_t kDcpSpoolPiece = 8ull << 20;

struct DcpTree {
  std::vector<topo_files::NamedLayout> files;  // .metadata, README.txt, __<k>_0.distcp (dcp/: meta.pt)
  std::vector<std::string> left_out;           // "<key>: <why>" for each tensor not represented
  uint64_t chunks = 0;
};

// dcp/'s files: those of the plan, and meta.pt, which Lightning Fabric's
// load asks for beside a DCP (torch.save of an empty dict).
// `spool_piece`: past this many bytes .metadata is spooled (tests lower it).
Result<DcpTree> DcpFiles(const Index& index, uint64_t spool_piece = kDcpSpoolPiece);

// A family's DCP profile's DCP files (PlanProfile's plan): .metadata, data
// files and README.txt (the profile's text and the counts).
Result<DcpTree> ProfileFiles(const Index& index, const DcpProfile& profile, uint64_t spool_piece = kDcpSpoolPiece);

}  // namespace ckptfs::dcp_view

#endif  // CKPTFS_VIEWS_DCP_VIEW_H_
