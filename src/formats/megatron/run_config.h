// The run configuration that wrappers of Megatron-Core keep beside a torch_dist
// checkpoint instead of Megatron-LM's pickled args: Megatron-Bridge's
// iter_N/run_config.yaml (ConfigContainer: model.*, ddp.*) and NeMo 2's
// <checkpoint>/context/model.yaml (the model's config.*). Read with libyaml
// (a non-recursive event parser; aliases are not expanded), into the
// ModelFacts the split rules and the distributed-optimizer replay need.
#ifndef CKPTFS_FORMATS_MEGATRON_RUN_CONFIG_H_
#define CKPTFS_FORMATS_MEGATRON_RUN_CONFIG_H_

#include <map>
#include <string>

#include "ckptfs/common.h"
#include "formats/megatron/megatron_common.h"

namespace ckptfs::formats::megatron {

// The scalars of a YAML document's mappings, keyed by their path
// ("model.num_layers" -> "4"; null -> "null"). Sequences and what is under
// them, aliases and anchors are skipped; nesting deeper than 64 is an error.
// `text` is the whole document (the caller bounds its size); `what` names it
// in errors.
Result<std::map<std::string, std::string>> YamlScalars(const std::string& text, const std::string& what);

// NeMo 2's context/io.json (fiddle's serialization of the TrainerContext):
// the MegatronStrategy arguments the run set, as "strategy.<name>" (and
// "strategy.ddp.<name>") -> value; the parallel sizes live there, not in the
// model's config (GPTConfig keeps what it was constructed with).
Result<std::map<std::string, std::string>> Nemo2StrategyArgs(const std::string& text, const std::string& what);

// ModelFacts from TransformerConfig / DistributedDataParallelConfig fields
// under `model` and `ddp` ("model." / "ddp." for Bridge, "config." / "" for
// NeMo 2). Fields that are absent or null keep ModelFacts' unknowns; the data
// parallel size is not in them (dp stays -1).
ModelFacts FactsOfConfig(const std::map<std::string, std::string>& kv, const std::string& model,
                         const std::string& ddp);

}  // namespace ckptfs::formats::megatron

#endif  // CKPTFS_FORMATS_MEGATRON_RUN_CONFIG_H_
