// libFuzzer target: the restricted pickle VM (both torch.save and DCP dialects).
#include <cstdint>
#include <string_view>

#include "formats/pickle.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto r = ckptfs::formats::Unpickle(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
  if (r.ok()) (void)(*r)->ClassName();
  return 0;
}
