// hf/ as a Hugging Face model directory (internal to the views layer): which
// architecture the checkpoint is, its config.json, and every Hugging Face
// tensor as a list of boxes of one source tensor (a fused QKV split per
// query group into q/k/v, SwiGLU's fc1 into gate/up, the padded vocabulary
// rows cut). Nothing is copied: the planned boxes are read through the
// engine like any other view file.
//
// The name mapping is data: each source convention (Megatron's mcore names,
// torchtitan's / Meta's) gives its rule tables per target architecture
// through the family table (ckptfs/hf_names.h HfConvention, registered in
// src/formats/detect.cc). Documented in docs/views.md, "hf/ for
// transformers" section.
#ifndef CKPTFS_VIEWS_HF_EXPORT_H_
#define CKPTFS_VIEWS_HF_EXPORT_H_

#include <deque>
#include <string>
#include <vector>

#include "ckptfs/index.h"
#include "ckptfs/topo.h"

namespace ckptfs::hf {

// A Hugging Face tensor: `pieces` of source tensor `id`, each rendered in C
// order and concatenated, as `out`; `transposed`: the pieces as matrices
// (`how`), their rows concatenated, then transposed (GPT-2's Conv1D stores
// [in, out], the transpose of Megatron's Linear [out, in]; a Flax kernel
// [in..., out...] is the transpose of a Linear weight).
struct HfTensor {
  std::string name;
  TensorId id;
  std::vector<int64_t> shape;
  std::vector<Box> pieces;
  DType out = DType::kInvalid;
  bool transposed = false;
  Transpose how;  // when transposed: the pieces as matrices
  // Every element multiplied by `scale`, then `add` added (MaxText's query
  // kernels, Gemma's embedding and norms).
  double scale = 1.0, add = 0.0;
};

struct HfPlan {
  // The Hugging Face class ("LlamaForCausalLM"); empty when no architecture
  // was recognised: hf/ then holds the parameters under their source names.
  std::string architecture;
  std::string config_json;  // config.json's text ("" without an architecture)
  // A deque: its elements never move, so planning can index their names.
  std::deque<HfTensor> tensors;
  std::vector<std::string> not_included;  // source parameters left out
  std::vector<std::string> errors;        // hf/ERRORS lines (each "hf/: ...")
  // Files served verbatim beside config.json (generation_config.json and the
  // tokenizer's), from the checkpoint directory or --hf-config's directory.
  std::vector<std::pair<std::string, std::string>> side_files;  // name, bytes
};

// The plan for `index` under `opts` (--hf-arch, --hf-config, --hf-dtype).
// An error only for a bad option (an unknown --hf-arch or --hf-dtype, an
// unreadable --hf-config); what the checkpoint lacks goes to `errors`.
Result<HfPlan> PlanHf(const Index& index, const TopoOptions& opts);

// What PlanHf's result depends on besides the index, as a digest (the key of
// hf/'s saved plan, plan_cache.h): the options, and every entry (name, type,
// size, mtime, ctime, inode) of the directories it reads config.json, the
// tokenizer files and a convention's record from. A file edited, added,
// removed or replaced there gives another key.
std::string InputsKey(const Index& index, const TopoOptions& opts);

}  // namespace ckptfs::hf

#endif  // CKPTFS_VIEWS_HF_EXPORT_H_
