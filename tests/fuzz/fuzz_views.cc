// libFuzzer target: every view builder and the files it serializes names
// into (checkpoint.json, info.json, hf/ and topo/ safetensors headers and
// layout.json, universal/ archives, report.json), seeded with checkpoints
// whose names are long, not UTF-8, or contain '/', '..' (tests/fuzz/corpus/views).
#include "dir_harness.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ckptfs::fuzz::RunDirectory(data, size, ckptfs::fuzz::Depth::kViews);
  return 0;
}
