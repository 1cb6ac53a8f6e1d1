// Meta's model-parallel Llama checkpoints: consolidated.00.pth ..
// consolidated.<N-1>.pth, each one model-parallel rank's model.state_dict()
// from Meta's reference model (llama-models' llama3 Transformer, and the
// original llama repo), beside params.json. fairscale's layers split each
// weight along a fixed dimension, which only the model code knows; the rule
// table (the linear layers' part is formats/tp_merge.h's LlamaLinearSplitDim,
// shared with topo/'s name conventions):
//   ColumnParallelLinear, dim 0:  attention.wq / wk / wv, feed_forward.w1 / w3, output
//   RowParallelLinear, dim 1:     attention.wo, feed_forward.w2
//   tok_embeddings:               VocabParallelEmbedding (Llama 3, dim 0) or
//                                 ParallelEmbedding (Llama 2, dim 1): told apart by
//                                 params.json's vocab_size / dim, else by output's shape
//   1-D weights (norms), rope.freqs: replicated, rank 0's copy
// A 2-D+ weight the table does not name is refused with the reason; every shard
// must hold the same keys, dtypes and unsplit extents.
#ifndef CKPTFS_FORMATS_TORCHSAVE_META_CONSOLIDATED_H_
#define CKPTFS_FORMATS_TORCHSAVE_META_CONSOLIDATED_H_

#include <string>
#include <vector>

#include "ckptfs/common.h"
#include "ckptfs/model.h"

namespace ckptfs::formats {

// `shards`: the directory's consolidated.NN.pth names (two or more).
Result<Checkpoint> ReadMetaConsolidated(const std::string& dir, std::vector<std::string> shards);

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_TORCHSAVE_META_CONSOLIDATED_H_
