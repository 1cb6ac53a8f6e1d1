// libFuzzer target: a whole torch.save archive, tensors resolved.
#include <cstdint>
#include <string_view>

#include "formats/torch_save.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ckptfs::formats;
  MemoryReader r(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
  auto a = ReadTorchSave(r);
  if (!a.ok()) return 0;
  const PyValue& root = *a->root;
  if (root.kind == PyKind::kTensor) (void)ResolveTensor(r, *a, root.tensor()).ok();
  for (const auto& [k, v] : root.dict) {
    if (v && v->kind == PyKind::kTensor) (void)ResolveTensor(r, *a, v->tensor()).ok();
  }
  return 0;
}
