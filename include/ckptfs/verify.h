// verify layer: catches the silent checkpoint failures users have hit.
//
// Design note. Verification has two sources of findings. Readers flag, at
// index time, what only they can see because they hold every copy (Megatron
// TP/PP replicas compared by hash and then by value, DeepSpeed group_paddings
// against the recomputed ZeRO geometry, zarr chunks that are missing); those
// live in the index (CheckpointInfo::findings). Verify adds what needs the
// fragments or the data:
//  * coverage: every tensor's fragments must tile its global extent; holes
//    (missing rank files, chunks that do not tile) and overlaps are reported
//    with numpy-slice coordinates;
//  * layer numbering: per layer stack (`...layers.<i>.`) indices must run
//    from 0 without gaps and reach the configured layer count (--num-layers,
//    or config.json / params.json next to the checkpoint): pipeline stages
//    that reuse names leave exactly this signature (torchtitan #474);
//  * zeroed optimizer states: at step > 0, an exp_avg / exp_avg_sq / fp32
//    master chunk (one fragment: a zarr chunk, a DCP chunk, a ZeRO partition
//    slice) whose bytes are all zero (Megatron zarr #1053);
//  * --deep: NaN / Inf counts, L2 norm and max |x| per tensor.
// The data pass reads each tensor once in C order through the read engine
// (the same path as the mount), hashing it with xxh3-64 (the value info.json
// shows) and CRC-32C (on the GPU where --gpu says so), feeding the zero and numeric checks from the same buffer, so
// every source byte is read once; alias records (a layer stack also shown
// per layer, verbatim file copies behind universal/) are skipped. Tensors run
// in parallel on a small pool.
//
// Verdict: exit 0 clean, 1 problems found, 2 something could not be read.
#ifndef CKPTFS_VERIFY_H_
#define CKPTFS_VERIFY_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ckptfs/common.h"
#include "ckptfs/index.h"
#include "ckptfs/io.h"
#include "ckptfs/model.h"

namespace ckptfs {

struct VerifyOptions {
  bool deep = false;             // NaN/Inf counts and norms (false)
  int64_t expected_layers = -1;  // configured layer count; -1: from config.json / params.json (-1)
  unsigned threads = 0;          // data-pass workers; 0: hardware concurrency, at most 8 (0)
};

struct TensorCheck {
  uint32_t tensor = 0;
  bool read = false;    // the data pass read it
  uint64_t xxh3 = 0;    // of the raw bytes in C order (info.json's value)
  uint32_t crc32c = 0;  // of the same bytes (the checksum GCS and S3 keep), on the transforms backend
  uint32_t zero_fragments = 0;
  bool numeric = false;  // --deep ran on it (float dtypes)
  uint64_t nan = 0, inf = 0;
  double l2 = 0, max_abs = 0;
};

struct Report {
  std::string source, family, format;
  int64_t step = -1;
  bool deep = false;
  int64_t configured_layers = -1;
  std::string configured_layers_from;  // "--num-layers", "config.json", ...
  std::vector<Finding> findings;
  std::vector<std::string> notes;  // what ckptfs could not check or serve (not defects)
  std::vector<TensorCheck> tensors;
  uint64_t bytes_read = 0;
  uint64_t tensors_read = 0;
  double seconds = 0;

  // 0 clean, 1 something could not be read, 3 problems found (the CLI exit codes).
  int ExitCode() const;
};

Result<Report> Verify(const Index& index, TensorReader& reader, const VerifyOptions& opts);

// `ckptfs verify --json` and .ckptfs/report.json. `timing`: include seconds
// and throughput (the mount's copy leaves them out so it is reproducible).
std::string ReportJson(const Report& r, const Index& index, bool timing = true);
// The human table `ckptfs verify` prints.
std::string ReportTable(const Report& r, const Index& index);

}  // namespace ckptfs

#endif  // CKPTFS_VERIFY_H_
