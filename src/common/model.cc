#include "ckptfs/model.h"

#include <array>
#include <cstring>

#include "ckptfs/common.h"
#include "common/float_bits.h"
#include "common/json_text.h"
#include "common/varint.h"

namespace ckptfs {
namespace {

struct DTypeInfo {
  DType dtype;
  size_t size;
  std::string_view torch_name;
  std::string_view storage_class;  // legacy typed-storage class (torch.save v2)
  std::string_view numpy;
  std::string_view safetensors;  // safetensors header "dtype"; empty: none
};

constexpr std::array<DTypeInfo, 19> kDTypes = {{
    {DType::kBool, 1, "bool", "BoolStorage", "|b1", "BOOL"},
    {DType::kU8, 1, "uint8", "ByteStorage", "|u1", "U8"},
    {DType::kI8, 1, "int8", "CharStorage", "|i1", "I8"},
    {DType::kI16, 2, "int16", "ShortStorage", "<i2", "I16"},
    {DType::kI32, 4, "int32", "IntStorage", "<i4", "I32"},
    {DType::kI64, 8, "int64", "LongStorage", "<i8", "I64"},
    {DType::kU16, 2, "uint16", "", "<u2", "U16"},
    {DType::kU32, 4, "uint32", "", "<u4", "U32"},
    {DType::kU64, 8, "uint64", "", "<u8", "U64"},
    {DType::kF16, 2, "float16", "HalfStorage", "<f2", "F16"},
    {DType::kBF16, 2, "bfloat16", "BFloat16Storage", "", "BF16"},
    {DType::kF32, 4, "float32", "FloatStorage", "<f4", "F32"},
    {DType::kF64, 8, "float64", "DoubleStorage", "<f8", "F64"},
    {DType::kC64, 8, "complex64", "ComplexFloatStorage", "<c8", "C64"},
    {DType::kC128, 16, "complex128", "ComplexDoubleStorage", "<c16", ""},
    {DType::kF8E4M3FN, 1, "float8_e4m3fn", "", "", "F8_E4M3"},
    {DType::kF8E5M2, 1, "float8_e5m2", "", "", "F8_E5M2"},
    {DType::kF8E4M3FNUZ, 1, "float8_e4m3fnuz", "", "", "F8_E4M3FNUZ"},
    {DType::kF8E5M2FNUZ, 1, "float8_e5m2fnuz", "", "", "F8_E5M2FNUZ"},
}};

const DTypeInfo* Find(DType d) {
  for (const auto& i : kDTypes) {
    if (i.dtype == d) return &i;
  }
  return nullptr;
}

}  // namespace

bool WidensToF32(DType d) {
  return d == DType::kBF16 || d == DType::kF16 || d == DType::kF8E4M3FN || d == DType::kF8E5M2 ||
         d == DType::kF8E4M3FNUZ || d == DType::kF8E5M2FNUZ;
}

bool NarrowsFromF32(DType d) { return d == DType::kBF16 || d == DType::kF16; }

bool Renders(DType from, DType to) {
  if (from == to) return DTypeSize(from) > 0;
  if (from == DType::kF32) return NarrowsFromF32(to);
  return to == DType::kF32 && WidensToF32(from);
}

size_t DTypeSize(DType d) {
  const DTypeInfo* i = Find(d);
  return i ? i->size : 0;
}

std::string_view DTypeName(DType d) {
  const DTypeInfo* i = Find(d);
  return i ? i->torch_name : "invalid";
}

std::string_view SafetensorsDType(DType d) {
  const DTypeInfo* i = Find(d);
  return i ? i->safetensors : "";
}

DType DTypeFromSafetensorsName(std::string_view n) {
  for (const auto& i : kDTypes) {
    if (!i.safetensors.empty() && i.safetensors == n) return i.dtype;
  }
  return DType::kInvalid;
}

DType DTypeFromTorchName(std::string_view n) {
  // torch aliases that pickles may spell differently.
  if (n == "float") return DType::kF32;
  if (n == "double") return DType::kF64;
  if (n == "half") return DType::kF16;
  if (n == "long") return DType::kI64;
  if (n == "int") return DType::kI32;
  if (n == "short") return DType::kI16;
  for (const auto& i : kDTypes) {
    if (i.torch_name == n || (!i.storage_class.empty() && i.storage_class == n)) return i.dtype;
  }
  return DType::kInvalid;
}

std::string_view StorageClassName(DType d) {
  const DTypeInfo* i = Find(d);
  return i ? i->storage_class : "";
}

std::string_view NumpyDescr(DType d) {
  const DTypeInfo* i = Find(d);
  return i ? i->numpy : "";
}

DType NpyDType(DType d) {
  switch (d) {
    case DType::kBF16:
    case DType::kF8E4M3FN:
    case DType::kF8E5M2:
    case DType::kF8E4M3FNUZ:
    case DType::kF8E5M2FNUZ:
      return DType::kF32;
    default:
      return d;
  }
}

float HalfToFloat(uint16_t h) {
  const uint32_t bits = HalfBitsToFloatBits(h);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

bool ElementAsDouble(const char* p, DType d, double* out) {
  auto load = [p](auto v) {
    std::memcpy(&v, p, sizeof(v));
    return v;
  };
  switch (d) {
    case DType::kF32:
      *out = load(float{});
      return true;
    case DType::kF64:
      *out = load(double{});
      return true;
    case DType::kF16:
      *out = HalfToFloat(load(uint16_t{}));
      return true;
    case DType::kBF16: {
      uint32_t bits = static_cast<uint32_t>(load(uint16_t{})) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      *out = f;
      return true;
    }
    case DType::kI8:
      *out = load(int8_t{});
      return true;
    case DType::kU8:
      *out = load(uint8_t{});
      return true;
    case DType::kI16:
      *out = load(int16_t{});
      return true;
    case DType::kI32:
      *out = load(int32_t{});
      return true;
    case DType::kI64:
      *out = static_cast<double>(load(int64_t{}));
      return true;
    default:
      return false;
  }
}

std::string_view CheckName(Check c) {
  switch (c) {
    case Check::kCoverage:
      return "coverage";
    case Check::kCollision:
      return "name-collision";
    case Check::kZeroed:
      return "zeroed-optimizer-state";
    case Check::kDrift:
      return "replica-drift";
    case Check::kGeometry:
      return "zero-geometry";
    case Check::kNumerics:
      return "numerics";
    case Check::kUnreadable:
      return "unreadable";
    case Check::kChecksum:
      return "checksum";
    case Check::kMaster:
      return "master-mismatch";
  }
  return "unknown";
}

std::string_view SeverityName(Severity s) { return s == Severity::kError ? "error" : "warning"; }

namespace {

// Shapes and boxes come from untrusted metadata: a tensor whose byte size
// overflows (or passes kMaxTensorBytes), a negative dimension, or a fragment
// outside the tensor makes the tensor unreadable (EIO naming why), never a
// wrapped-around size (a 0-byte .raw, a header-only .npy).
constexpr uint64_t kMaxTensorBytes = uint64_t{1} << 60;

// Empty when the shape is servable.
std::string CheckShape(const TensorRecord& t) {
  uint64_t bytes = std::max<uint64_t>(DTypeSize(t.dtype), 1);
  for (int64_t d : t.shape) {
    if (d < 0) return "shape " + ShapeStr(t.shape) + " has a negative dimension";
    if (MulOverflow(bytes, static_cast<uint64_t>(d), &bytes) || bytes > kMaxTensorBytes) {
      return "shape " + ShapeStr(t.shape) + " of " + std::string(DTypeName(t.dtype)) + " is more than 2^60 bytes";
    }
  }
  return "";
}

}  // namespace

std::string CheckTensorGeometry(const TensorRecord& t, const std::vector<Fragment>& frags) {
  if (DTypeSize(t.dtype) == 0) return "no element type";
  if (std::string why = CheckShape(t); !why.empty()) return why;
  for (const Fragment& f : frags) {
    if (f.offsets.size() != t.shape.size() || f.lengths.size() != t.shape.size()) {
      return "a fragment's rank differs from the tensor's";
    }
    for (size_t d = 0; d < t.shape.size(); ++d) {
      if (f.offsets[d] < 0 || f.lengths[d] < 0 || f.offsets[d] > t.shape[d] ||
          f.lengths[d] > t.shape[d] - f.offsets[d]) {
        return "a fragment box (offsets " + ShapeStr(f.offsets) + ", lengths " + ShapeStr(f.lengths) +
               ") is outside the shape " + ShapeStr(t.shape);
      }
    }
  }
  return "";
}

namespace {

void PutInts(std::string& out, const std::vector<int64_t>& v) {
  PutVarint(out, v.size());
  for (int64_t x : v) PutVarint(out, ZigZag(x));
}
void GetInts(std::string_view s, size_t* pos, std::vector<int64_t>* v) {
  v->resize(GetVarint(s, pos));
  for (int64_t& x : *v) x = UnZigZag(GetVarint(s, pos));
}

// The packed list: count, then per fragment every field as a varint. Only
// this file writes it, so Get trusts it.
std::string Pack(const std::vector<Fragment>& frags) {
  std::string out;
  if (frags.empty()) return out;
  PutVarint(out, frags.size());
  for (const Fragment& f : frags) {
    PutVarint(out, f.file.v);
    PutInts(out, f.offsets);
    PutInts(out, f.lengths);
    PutInts(out, f.strides);
    PutVarint(out, static_cast<uint64_t>(f.dtype));
    PutVarint(out, f.data_offset);
    PutVarint(out, f.data_length);
    PutVarint(out, static_cast<uint64_t>(f.compression));
    PutVarint(out, f.item_offset);
    PutVarint(out, f.item_length);
    PutVarint(out, f.inner_offset);
    PutVarint(out, f.inner_length);
    PutVarint(out, f.replica);
  }
  out.shrink_to_fit();
  return out;
}

}  // namespace

void FragmentTable::Append(const std::vector<Fragment>& frags) { packed_.push_back(Pack(frags)); }

void FragmentTable::Set(size_t tensor, const std::vector<Fragment>& frags) { packed_[tensor] = Pack(frags); }

size_t FragmentTable::Count(size_t tensor) const {
  size_t pos = 0;
  return static_cast<size_t>(GetVarint(packed_[tensor], &pos));
}

std::vector<Fragment> FragmentTable::Get(size_t tensor) const {
  const std::string& s = packed_[tensor];
  size_t pos = 0;
  std::vector<Fragment> out(static_cast<size_t>(GetVarint(s, &pos)));
  for (Fragment& f : out) {
    f.file.v = static_cast<uint32_t>(GetVarint(s, &pos));
    GetInts(s, &pos, &f.offsets);
    GetInts(s, &pos, &f.lengths);
    GetInts(s, &pos, &f.strides);
    f.dtype = static_cast<DType>(GetVarint(s, &pos));
    f.data_offset = GetVarint(s, &pos);
    f.data_length = GetVarint(s, &pos);
    f.compression = static_cast<Compression>(GetVarint(s, &pos));
    f.item_offset = GetVarint(s, &pos);
    f.item_length = GetVarint(s, &pos);
    f.inner_offset = GetVarint(s, &pos);
    f.inner_length = GetVarint(s, &pos);
    f.replica = static_cast<uint32_t>(GetVarint(s, &pos));
  }
  return out;
}

uint32_t Checkpoint::AddTensor(TensorRecord t, std::vector<Fragment> frags) {
  if (!t.error.empty()) frags.clear();
  t.num_fragments = static_cast<uint32_t>(frags.size());
  if (t.encoding == Encoding::kTensor) t.byte_size = t.Numel() * DTypeSize(t.dtype);
  tensors.push_back(std::move(t));
  fragments.Append(frags);
  return static_cast<uint32_t>(tensors.size() - 1);
}

uint32_t Checkpoint::AddFileBytes(FileId file, TensorRecord t) {
  t.encoding = Encoding::kBytes;
  t.dtype = DType::kU8;
  t.byte_size = files[file.v].size;
  Fragment f;
  f.file = file;
  f.dtype = DType::kU8;
  f.data_length = t.byte_size;
  return AddTensor(std::move(t), {std::move(f)});
}

void AppendFragmentsJson(std::string& out, const std::vector<Fragment>& frags, const std::vector<SourceFile>& files,
                         uint32_t replicas) {
  for (size_t k = 0; k < frags.size(); ++k) {
    const Fragment& f = frags[k];
    if (k > 0) out += ',';
    out += "{\"file\":" + JsonEscape(f.file.v < files.size() ? files[f.file.v].rel_path : std::string("?")) +
           ",\"offsets\":";
    AppendJsonInts(out, f.offsets);
    out += ",\"lengths\":";
    AppendJsonInts(out, f.lengths);
    out += ",\"strides\":";
    AppendJsonInts(out, f.strides);
    out += ",\"byte_offset\":" + std::to_string(f.data_offset);
    if (f.compression != Compression::kNone) {
      out += ",\"zstd_item\":[" + std::to_string(f.item_offset) + "," + std::to_string(f.item_length) + "]";
    }
    if (f.compression == Compression::kZstdNested) {
      out += ",\"zstd_inner\":[" + std::to_string(f.inner_offset) + "," + std::to_string(f.inner_length) + "]";
    }
    if (replicas > 1) out += ",\"copy\":" + std::to_string(f.replica);
    out += '}';
  }
}

}  // namespace ckptfs
