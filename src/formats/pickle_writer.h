// A pickle emitter for the archives ckptfs synthesizes (torch.save's
// data.pkl). It writes protocol 2 (plus the protocol-3 bytes opcodes, which
// every Python 3 unpickler reads), no memo unless asked (Put / Get), so equal inputs give equal bytes:
// the size of a synthesized file is known without reading any tensor.
#ifndef CKPTFS_FORMATS_PICKLE_WRITER_H_
#define CKPTFS_FORMATS_PICKLE_WRITER_H_

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ckptfs/common.h"
#include "ckptfs/model.h"
#include "formats/pickle.h"

namespace ckptfs::formats {

class PickleWriter {
 public:
  PickleWriter();

  void None();
  void Bool(bool v);
  void Int(int64_t v);
  void Float(double v);
  void Str(std::string_view v);
  void Bytes(std::string_view v);
  void Global(std::string_view module, std::string_view name);
  // Containers: open, write the items (dict: key, value, key, value ...), close.
  void BeginTuple();
  void EndTuple();
  void BeginList();
  void EndList();
  void BeginDict();
  void EndDict();
  void Reduce();  // callable, args tuple -> callable(*args)
  void NewObj();  // class, args tuple -> class.__new__(class, *args)
  void Build();   // object, state -> object with state applied
  // The memo (for writers that repeat values: a DCP .metadata names the same
  // classes and keys millions of times): Put stores the value on top of the
  // stack as `id`, Get pushes it again. Ids are the caller's to assign.
  void Put(uint32_t id);
  void Get(uint32_t id);
  // Splices opcodes that push exactly one value (a Fragment() of another
  // writer: no PROTO, no STOP, no memo).
  void Raw(std::string_view ops) { out_.append(ops); }
  // The opcodes written so far without the PROTO header: one value to Raw()
  // into another pickle.
  std::string Fragment() const { return out_.substr(2); }
  // A tensor view of storage `storage_key` (a record data/<key> of the
  // archive) as torch._utils._rebuild_tensor_v2 writes it.
  Status Tensor(const std::string& storage_key, DType dtype, uint64_t storage_numel, uint64_t storage_offset,
                const std::vector<int64_t>& shape, const std::vector<int64_t>& strides);

  // Re-emits a value read by the pickle VM (pickle.h): plain data, globals,
  // recorded calls (REDUCE or NEWOBJ, then BUILD state). Tensors go to
  // `tensor_fn`, which writes them (usually via Tensor()).
  using TensorFn = std::function<Status(PickleWriter&, const PyValue&)>;
  Status Value(const PyValue& v, const TensorFn& tensor_fn);

  // STOP, and the bytes (those not yet drained).
  std::string Finish();
  // The bytes written so far (the PROTO header first), taken out of the
  // writer: a large pickle goes to its destination in pieces. Memo ids stay
  // valid; Fragment() is meaningless after a Drain.
  std::string Drain() { return std::exchange(out_, std::string()); }
  size_t size() const { return out_.size(); }

 private:
  void Op(uint8_t op) { out_.push_back(static_cast<char>(op)); }
  template <typename T>
  void Le(T v) {
    char b[sizeof(T)];
    StoreLE(b, v);
    out_.append(b, sizeof(T));
  }
  Status ValueAt(const PyValue& v, const TensorFn& tensor_fn, int depth);

  std::string out_;
};

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_PICKLE_WRITER_H_
