// libFuzzer target: a checkpoint directory seeded with real deepspeed checkpoints
// (tests/fuzz/corpus/deepspeed_dir); see dir_harness.h for the input format.
#include "dir_harness.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ckptfs::fuzz::RunDirectory(data, size, ckptfs::fuzz::Depth::kReader);
  return 0;
}
