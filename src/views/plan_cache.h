// Plans of views (dcp/, a family's DCP profile such as torch_dist/, hf/),
// kept beside the index (internal to the views layer). Planning dcp/ writes
// the whole .metadata and places every item: seconds at a million chunks, on
// every mount's first listing. The first mount that plans a view saves the
// plan as <index>/<name>.plan; later mounts of the same index by the same
// build load it instead.
//
// Design note. A plan file names the program build that wrote it (the ELF
// build id: any change to the code makes a new one), the index it was made
// from (RocksDB's IDENTITY, new with every build of the index) and a key for
// whatever else it was made from (hf/: its options and the files beside the
// checkpoint), and carries an xxh3 of all its bytes: a file of another build,
// index or key, or a damaged one, is ignored (the view is planned again and
// the file replaced), so a cached plan is never older than the code, the
// index or its inputs. Saving is best effort: an index directory that cannot
// be written keeps no plans. The file is written under a temporary name and
// renamed into place, so two daemons on one index never see half a plan.
// Spooled bytes (a large .metadata) follow the records in the file and are
// served from it.
#ifndef CKPTFS_VIEWS_PLAN_CACHE_H_
#define CKPTFS_VIEWS_PLAN_CACHE_H_

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/index.h"
#include "views/topo_files.h"

namespace ckptfs::plan_cache {

struct Plan {
  std::vector<topo_files::NamedLayout> files;
  std::vector<std::string> notes;  // what the view logs when it is made (left-out keys)
};

// <index dir>/<name>.plan.
std::string PathOf(const Index& index, std::string_view name);

// The plan saved as `name` beside `index` by this build for this index under
// `key`, if there is one and it is whole. `key` names whatever else the plan
// was made from (hf/: its options and the files beside the checkpoint it
// reads, hf::InputsKey); "" for a view made from the index alone.
std::optional<Plan> Load(const Index& index, std::string_view name, std::string_view key = "");

// Saves `plan` as `name` under `key` (spooled segments' bytes copied into the
// file). An error says why nothing was saved; the caller logs it and goes on.
Status Save(const Index& index, std::string_view name, const Plan& plan, std::string_view key = "");

// This program's ELF build id in hex ("" when it has none: then nothing is
// cached).
const std::string& BuildId();

}  // namespace ckptfs::plan_cache

#endif  // CKPTFS_VIEWS_PLAN_CACHE_H_
