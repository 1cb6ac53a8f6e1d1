// libFuzzer target over a whole checkpoint directory (dir_harness.h), built
// once per seed directory of tests/fuzz/corpus/ (fuzz_<dir>, CMakeLists.txt):
// the seeds are real producer checkpoints, so each target starts inside the
// readers that recognise them. CKPTFS_FUZZ_VIEWS (the `views` corpus, whose
// seeds have long, non-UTF-8 and '/'-carrying names) also builds every view
// file: hf/ and topo/ headers, layout.json, universal/ archives, report.json.
#include "dir_harness.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
#ifdef CKPTFS_FUZZ_VIEWS
  ckptfs::fuzz::RunDirectory(data, size, ckptfs::fuzz::Depth::kViews);
#else
  ckptfs::fuzz::RunDirectory(data, size, ckptfs::fuzz::Depth::kReader);
#endif
  return 0;
}
