// Orbax checkpoints (orbax-checkpoint, the JAX side: MaxText, Levanter, T5X,
// PaxML, EasyDeL): a CheckpointManager root (`<root>/<step>/<item>/`), one
// step directory, or one item directory; arrays in zarr v2 or v3, inside
// tensorstore's OCDBT database or as plain directories (docs/formats/orbax.md).
//
// The root reads its latest finished step (the largest step number whose
// directory is not an unfinished `*.orbax-checkpoint-tmp*` one); the others
// are named in checkpoint.json. Every chunk is one fragment: a zstd frame in
// an OCDBT data file or a chunk file, or inside an OCDBT node (a value the
// writer stored inline; Compression::kZstdNested). A chunk the metadata needs
// that is absent is a hole (reads of it fail; never fill values).
#ifndef CKPTFS_FORMATS_ORBAX_ORBAX_READER_H_
#define CKPTFS_FORMATS_ORBAX_ORBAX_READER_H_

#include <string>

#include "ckptfs/common.h"
#include "ckptfs/model.h"

namespace ckptfs::formats {

bool LooksLikeOrbax(const std::string& dir);
Result<Checkpoint> ReadOrbax(const std::string& dir);

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_ORBAX_ORBAX_READER_H_
