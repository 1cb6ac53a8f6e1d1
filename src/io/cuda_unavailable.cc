// Built instead of cuda_transforms.cu when CMake found no nvcc: the GPU
// backend is absent, and says so.
#include "ckptfs/transforms.h"

namespace ckptfs {

bool CudaCompiledIn() { return false; }

Result<std::shared_ptr<char>> AllocDeviceBytes(int, uint64_t) {
  return Unsupported("this ckptfs was built without CUDA: no device memory");
}

Status DownloadDeviceBytes(int, const char*, uint64_t, char*) {
  return Unsupported("this ckptfs was built without CUDA: no device memory");
}

Result<std::unique_ptr<Transforms>> MakeCudaTransforms(const CudaOptions&) {
  return Unsupported("this ckptfs was built without CUDA (no nvcc at configure time, or a sanitizer build)");
}

}  // namespace ckptfs
