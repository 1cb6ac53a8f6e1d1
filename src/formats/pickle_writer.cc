#include "formats/pickle_writer.h"

#include <bit>
#include <cstring>

namespace ckptfs::formats {
namespace {

constexpr uint8_t kMark = '(', kStop = '.', kNone = 'N', kNewTrue = 0x88, kNewFalse = 0x89, kBinInt = 'J',
                  kBinInt1 = 'K', kBinInt2 = 'M', kLong1 = 0x8a, kBinFloat = 'G', kBinUnicode = 'X',
                  kShortBinBytes = 'C', kBinBytes = 'B', kGlobal = 'c', kEmptyTuple = ')', kTuple = 't',
                  kEmptyList = ']', kAppends = 'e', kEmptyDict = '}', kSetItems = 'u', kReduce = 'R', kNewObj = 0x81,
                  kBuild = 'b', kBinPersId = 'Q', kProto = 0x80;
constexpr int kMaxDepth = 200;

}  // namespace

PickleWriter::PickleWriter() {
  Op(kProto);
  Op(2);
}

void PickleWriter::None() { Op(kNone); }
void PickleWriter::Bool(bool v) { Op(v ? kNewTrue : kNewFalse); }

void PickleWriter::Int(int64_t v) {
  if (v >= 0 && v <= 0xFF) {
    Op(kBinInt1);
    out_.push_back(static_cast<char>(v));
  } else if (v >= 0 && v <= 0xFFFF) {
    Op(kBinInt2);
    Le<uint16_t>(static_cast<uint16_t>(v));
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    Op(kBinInt);
    Le<int32_t>(static_cast<int32_t>(v));
  } else {
    // LONG1: minimal little-endian two's complement.
    std::string b;
    uint64_t u = static_cast<uint64_t>(v);
    for (int i = 0; i < 8; ++i) b.push_back(static_cast<char>((u >> (8 * i)) & 0xFF));
    while (b.size() > 1) {
      char last = b.back(), prev = b[b.size() - 2];
      bool redundant = (last == 0 && (prev & 0x80) == 0) || (last == '\xff' && (prev & 0x80) != 0);
      if (!redundant) break;
      b.pop_back();
    }
    Op(kLong1);
    out_.push_back(static_cast<char>(b.size()));
    out_.append(b);
  }
}

void PickleWriter::Float(double v) {
  Op(kBinFloat);
  uint64_t u = std::bit_cast<uint64_t>(v);
  for (int s = 56; s >= 0; s -= 8) out_.push_back(static_cast<char>((u >> s) & 0xFF));  // big-endian
}

void PickleWriter::Str(std::string_view v) {
  Op(kBinUnicode);
  Le<uint32_t>(static_cast<uint32_t>(v.size()));
  out_.append(v);
}

void PickleWriter::Bytes(std::string_view v) {
  if (v.size() < 256) {
    Op(kShortBinBytes);
    out_.push_back(static_cast<char>(v.size()));
  } else {
    Op(kBinBytes);
    Le<uint32_t>(static_cast<uint32_t>(v.size()));
  }
  out_.append(v);
}

void PickleWriter::Global(std::string_view module, std::string_view name) {
  Op(kGlobal);
  out_.append(module);
  out_.push_back('\n');
  out_.append(name);
  out_.push_back('\n');
}

void PickleWriter::Put(uint32_t id) {
  if (id < 256) {
    Op('q');  // BINPUT
    out_.push_back(static_cast<char>(id));
  } else {
    Op('r');  // LONG_BINPUT
    Le<uint32_t>(id);
  }
}

void PickleWriter::Get(uint32_t id) {
  if (id < 256) {
    Op('h');  // BINGET
    out_.push_back(static_cast<char>(id));
  } else {
    Op('j');  // LONG_BINGET
    Le<uint32_t>(id);
  }
}

void PickleWriter::BeginTuple() { Op(kMark); }
void PickleWriter::EndTuple() { Op(kTuple); }

void PickleWriter::BeginList() {
  Op(kEmptyList);
  Op(kMark);
}
void PickleWriter::EndList() { Op(kAppends); }
void PickleWriter::BeginDict() {
  Op(kEmptyDict);
  Op(kMark);
}
void PickleWriter::EndDict() { Op(kSetItems); }
void PickleWriter::Reduce() { Op(kReduce); }
void PickleWriter::NewObj() { Op(kNewObj); }
void PickleWriter::Build() { Op(kBuild); }

Status PickleWriter::Tensor(const std::string& storage_key, DType dtype, uint64_t storage_numel,
                            uint64_t storage_offset, const std::vector<int64_t>& shape,
                            const std::vector<int64_t>& strides) {
  std::string_view cls = StorageClassName(dtype);
  if (cls.empty()) return Unsupported("cannot write a torch.save tensor of dtype " + std::string(DTypeName(dtype)));
  Global("torch._utils", "_rebuild_tensor_v2");
  BeginTuple();
  BeginTuple();  // persistent id
  Str("storage");
  Global("torch", cls);
  Str(storage_key);
  Str("cpu");
  Int(static_cast<int64_t>(storage_numel));
  EndTuple();
  Op(kBinPersId);
  Int(static_cast<int64_t>(storage_offset));
  BeginTuple();
  for (int64_t s : shape) Int(s);
  EndTuple();
  BeginTuple();
  for (int64_t s : strides) Int(s);
  EndTuple();
  Bool(false);
  Global("collections", "OrderedDict");
  Op(kEmptyTuple);
  Reduce();
  EndTuple();
  Reduce();
  return Status::Ok();
}

Status PickleWriter::Value(const PyValue& v, const TensorFn& tensor_fn) { return ValueAt(v, tensor_fn, 0); }

Status PickleWriter::ValueAt(const PyValue& v, const TensorFn& tensor_fn, int depth) {
  if (depth > kMaxDepth) return Unsupported("cannot re-pickle a value nested deeper than " + std::to_string(kMaxDepth));
  auto sub = [&](const PyValue* x) -> Status {
    if (x == nullptr) {
      None();
      return Status::Ok();
    }
    return ValueAt(*x, tensor_fn, depth + 1);
  };
  switch (v.kind) {
    case PyKind::kNone:
      None();
      return Status::Ok();
    case PyKind::kBool:
      Bool(v.b);
      return Status::Ok();
    case PyKind::kInt:
      Int(v.i);
      return Status::Ok();
    case PyKind::kBigInt:
      Op(kLong1);
      if (v.s.size() > 255)
        return Unsupported("cannot re-pickle an integer of " + std::to_string(v.s.size()) + " bytes");
      out_.push_back(static_cast<char>(v.s.size()));
      out_.append(v.s);
      return Status::Ok();
    case PyKind::kFloat:
      Float(v.f);
      return Status::Ok();
    case PyKind::kStr:
      Str(v.s);
      return Status::Ok();
    case PyKind::kBytes:
      Bytes(v.s);
      return Status::Ok();
    case PyKind::kTuple:
      BeginTuple();
      for (PyRef x : v.items) RETURN_IF_ERROR(sub(x));
      EndTuple();
      return Status::Ok();
    case PyKind::kList:
      BeginList();
      for (PyRef x : v.items) RETURN_IF_ERROR(sub(x));
      EndList();
      return Status::Ok();
    case PyKind::kSet:
      Global("builtins", "set");
      BeginTuple();
      BeginList();
      for (PyRef x : v.items) RETURN_IF_ERROR(sub(x));
      EndList();
      EndTuple();
      Reduce();
      return Status::Ok();
    case PyKind::kDict:
      BeginDict();
      for (const auto& [k, x] : v.dict) {
        RETURN_IF_ERROR(sub(k));
        RETURN_IF_ERROR(sub(x));
      }
      EndDict();
      return Status::Ok();
    case PyKind::kGlobal:
      Global(v.s, v.name());
      return Status::Ok();
    case PyKind::kObject:
      RETURN_IF_ERROR(sub(v.callable));
      BeginTuple();
      for (PyRef x : v.args()) RETURN_IF_ERROR(sub(x));
      EndTuple();
      if (v.newobj) {
        NewObj();
      } else {
        Reduce();
      }
      if (!v.items.empty()) {
        Op(kMark);
        for (PyRef x : v.items) RETURN_IF_ERROR(sub(x));
        Op(kAppends);
      }
      if (!v.dict.empty()) {
        Op(kMark);
        for (const auto& [k, x] : v.dict) {
          RETURN_IF_ERROR(sub(k));
          RETURN_IF_ERROR(sub(x));
        }
        Op(kSetItems);
      }
      if (v.state != nullptr) {
        RETURN_IF_ERROR(sub(v.state));
        Build();
      }
      return Status::Ok();
    case PyKind::kTensor:
      return tensor_fn(*this, v);
    case PyKind::kStorage:
      return Unsupported("cannot re-pickle a bare storage");
  }
  return Unsupported("cannot re-pickle this value");
}

std::string PickleWriter::Finish() {
  Op(kStop);
  return std::move(out_);
}

}  // namespace ckptfs::formats
