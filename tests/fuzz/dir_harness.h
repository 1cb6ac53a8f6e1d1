// libFuzzer harness for whole checkpoint directories: the input is a small
// archive of files, materialized under $TMPDIR (or /dev/shm) and mounted
// through the FUSE-free core (Filesystem: detect, index, views, reads,
// verify), so a mutant reaches every reader and view builder exactly as a
// hostile checkpoint directory would.
//
// Archive format: dir_archive.h.
//
// Seeds: tests/fuzz/corpus/<target>/, packed from real producer checkpoints
// by tests/fuzz/make_corpus.py. Nightly-length run (1 CPU-hour per target):
//   CC=clang CXX=clang++ cmake -S . -B build-fuzz -DCKPTFS_FUZZ=ON -DCKPTFS_BUILD_TESTS=OFF -DCKPTFS_CUDA=OFF
//   cmake --build build-fuzz -j2 --target fuzz_dcp_dir
//   cp -r tests/fuzz/corpus/dcp_dir /tmp/c && nice -n 19 build-fuzz/fuzz_dcp_dir -max_total_time=3600 \
//       -rss_limit_mb=2048 -timeout=20 -max_len=1500000 /tmp/c
#ifndef CKPTFS_TESTS_FUZZ_DIR_HARNESS_H_
#define CKPTFS_TESTS_FUZZ_DIR_HARNESS_H_

#include <cstddef>
#include <cstdint>

namespace ckptfs::fuzz {

enum class Depth {
  kReader,  // detect + read + index + checkpoint.json + one pass over params/
  kViews,   // also every view file (hf/, topo/ layouts, universal/), report.json
};

// Runs one input; never throws; cleans up its directory.
void RunDirectory(const uint8_t* data, size_t size, Depth depth);

}  // namespace ckptfs::fuzz

#endif  // CKPTFS_TESTS_FUZZ_DIR_HARNESS_H_
