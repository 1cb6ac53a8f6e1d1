#include "formats/npy.h"

namespace ckptfs::formats {

Result<std::string> NpyHeader(DType dtype, const std::vector<int64_t>& shape) {
  std::string_view descr = NumpyDescr(dtype);
  if (descr.empty()) return Unsupported("numpy has no dtype for " + std::string(DTypeName(dtype)));
  std::string dict = "{'descr': '" + std::string(descr) + "', 'fortran_order': False, 'shape': (";
  for (size_t i = 0; i < shape.size(); ++i) {
    dict += std::to_string(shape[i]);
    if (shape.size() == 1 || i + 1 < shape.size()) dict += ",";
    if (i + 1 < shape.size()) dict += " ";
  }
  dict += "), }";
  // magic(6) + version(2) + len(2) + dict + padding + '\n' == multiple of 64.
  size_t total = 10 + dict.size() + 1;
  size_t padded = (total + 63) / 64 * 64;
  dict.append(padded - total, ' ');
  dict.push_back('\n');
  if (dict.size() > 65535) return Unsupported("npy header longer than 65535 bytes");
  std::string out("\x93NUMPY\x01\x00", 8);
  uint16_t len = static_cast<uint16_t>(dict.size());
  out.push_back(static_cast<char>(len & 0xFF));
  out.push_back(static_cast<char>(len >> 8));
  out += dict;
  return out;
}

}  // namespace ckptfs::formats
