// libFuzzer target: the ZIP directory reader and data-offset resolution.
#include <cstdint>
#include <string_view>

#include "formats/zip.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ckptfs::formats;
  MemoryReader r(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
  auto dir = ReadZipDirectory(r);
  if (dir.ok()) {
    for (const auto& e : dir->entries) (void)ZipDataOffset(r, e).ok();
  }
  return 0;
}
