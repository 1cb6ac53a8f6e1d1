// A restricted pickle virtual machine (protocols 0-5, CPython
// Lib/pickletools.py is the opcode reference). It builds inert values and
// never calls anything: GLOBAL / STACK_GLOBAL resolve only names on an allow
// list (torch, numpy, collections, argparse, DCP dataclasses, ...), and
// REDUCE / NEWOBJ / BUILD record the call
// as an Object node instead of running it. A handful of well-known callables
// are interpreted because their result is plain data: OrderedDict, torch.Size,
// _codecs.encode (bytes under protocol 2), builtins.getattr (Enum members),
// and torch's tensor rebuild functions, which become Tensor nodes that point at
// a storage record. Class names are matched across module renames
// (torch.distributed._shard.checkpoint.X == torch.distributed.checkpoint.X,
// numpy.core == numpy._core, __builtin__ == builtins, copy_reg == copyreg;
// protocol 0/1's copyreg._reconstructor(cls, object, None) is an instance of
// cls like protocol 2's NEWOBJ).
//
// Unknown globals. Checkpoints carry their trainer's own objects in metadata
// ckptfs does not need (Megatron-DeepSpeed's args hold
// megatron.enums.PositionEmbeddingType; client state holds schedulers). With
// `placeholders` on (the default) such a global becomes an inert kGlobal with
// `placeholder` set that keeps its module and name, and calls of it are
// recorded like any other. Globals stay strict (an error naming them) where
// they would decide tensor bytes (storage classes, `_rebuild*` functions and
// dtypes from outside torch) and for modules that are never data (os,
// subprocess, builtins other than the constructors above, ...).
//
// Enums. CPython 3.11.0-3.11.4 pickle an Enum member as
// getattr(Cls, 'name'), every other release as Cls(value). For the enums a
// family reader names in PickleOptions::enums (DeepSpeed's ZeroStageEnum)
// both become the object Cls(value); EnumValue reads it. The VM itself knows
// no family's enum.
//
// Limits: the input size bounds the number of values; the stack and memo are
// bounded; out-of-band buffers (protocol 5 NEXT_BUFFER) and extension codes
// are refused.
//
// Streaming (PickleOptions::consume). A reader of a huge pickle (a DCP
// .metadata with millions of chunks) takes dict entries as they are set and
// the VM frees what it took, so the tree never holds them. What makes freeing
// safe: a first pass over the opcodes finds the memo entries that are ever
// read back (GET); only those are stored, and a stored value is pinned with
// everything it holds or will hold (and so is a DUP'd value). Any other value
// is reachable from one place only (the stack, or one live parent): an entry
// popped by SETITEM(S) and taken by the consumer is then unreachable, and its
// unpinned nodes go back to the arena's free list. The first pass also counts
// each entry's reads: after its last one the memo lets go of it, and a
// mark-and-sweep from the stack and the memo (run whenever the live nodes
// have doubled) returns what nothing reaches any more, pinned or not (the
// arguments a REDUCE consumed, chunk offsets read back by storage_data). Ints,
// None, True and False are one shared, pinned node per value.
#ifndef CKPTFS_FORMATS_PICKLE_H_
#define CKPTFS_FORMATS_PICKLE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ckptfs/common.h"
#include "ckptfs/model.h"

namespace ckptfs::formats {

struct PyValue;
// Values reference each other by plain pointers into the VM's arena (pickle
// memo references can form cycles, so shared ownership between values would
// leak). The caller holds the root as a PyHandle, which owns the whole arena.
using PyRef = PyValue*;
using PyHandle = std::shared_ptr<PyValue>;

enum class PyKind : uint8_t {
  kNone,
  kBool,
  kInt,
  kBigInt,
  kFloat,
  kStr,
  kBytes,
  kTuple,
  kList,
  kDict,
  kSet,
  kGlobal,   // a class or function: module + name
  kObject,   // a recorded call cls(*args) with BUILD state and appended items
  kStorage,  // a persistent id ('storage', class, key, location, numel)
  kTensor,   // a rebuilt tensor view of a storage
};

struct TensorRef {
  std::string storage_key;
  DType dtype = DType::kInvalid;
  uint64_t storage_offset = 0;  // elements
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // elements
};

struct PyValue {
  PyKind kind = PyKind::kNone;
  bool b = false;
  bool newobj = false;       // object: made by NEWOBJ (cls.__new__) rather than REDUCE
  bool placeholder = false;  // global: not on the allow list, kept inert (see the header note)
  bool pinned = false;       // streaming: reachable from the memo or the stack twice, never freed
  bool marked = false;       // streaming: reached in the current Collect (the VM's, always false after)
  uint32_t depth = 0;        // nesting depth, bounded so that recursive consumers cannot overflow the stack
  union {
    int64_t i = 0;
    double f;
  };
  std::string s;                              // str, bytes, big-int bytes (LE two's complement), global module
  std::vector<PyRef> items;                   // tuple, list, set; object's APPEND(S)
  std::vector<std::pair<PyRef, PyRef>> dict;  // dict; object's SETITEM(S)
  PyRef callable = nullptr;                   // object: the class / function
  PyRef state = nullptr;                      // object: BUILD state
  // What only a global (its name), a call with arguments, a storage or a
  // tensor carries, out of line: a DCP .metadata holds millions of values
  // (128 bytes each), nearly all tuples, dicts, strs and argument-less
  // dataclass objects.
  struct TensorParts {
    DType storage_dtype = DType::kInvalid;  // storage
    bool untyped = false;                   // storage: UntypedStorage (numel counts bytes)
    uint64_t storage_numel = 0;             // storage
    TensorRef tensor;                       // tensor
  };
  struct Ext {
    std::string name;                    // global
    std::vector<PyRef> args;             // object: call arguments
    std::unique_ptr<TensorParts> parts;  // storage / tensor
  };
  std::unique_ptr<Ext> ext;

  // A global's name (empty for any other kind).
  const std::string& name() const;
  // An object's call arguments (empty when none, or for any other kind).
  const std::vector<PyRef>& args() const;
  // A tensor's view of its storage (empty for any other kind).
  const TensorRef& tensor() const;
  // The out-of-line fields, made on first use.
  Ext& MutableExt();
  TensorParts& MutableParts();

  // Convenience accessors (nullptr / empty when absent or of another kind).
  const PyValue* Get(std::string_view key) const;  // dict lookup by str key
  bool IsStr() const { return kind == PyKind::kStr; }
  bool IsSeq() const { return kind == PyKind::kTuple || kind == PyKind::kList; }
  // For an object: its class name ("TensorStorageMetadata"); for a global: its name.
  // A view of the global's own name: valid while the value is.
  std::string_view ClassName() const;
  // Attribute lookup on an object whose BUILD state is a dict.
  const PyValue* Attr(std::string_view key) const;
};

// An Enum class whose members a family reader needs as numbers.
struct PickleEnum {
  std::string module, cls;                               // "deepspeed.runtime.zero.config", "ZeroStageEnum"
  std::vector<std::pair<std::string, int64_t>> members;  // name, value
};

struct PickleOptions {
  // Extra allowed module prefixes for a family reader (e.g. "deepspeed").
  std::vector<std::string> extra_modules;
  // Enums read in either pickle form (see the header note); a member or
  // value outside `members` is an error naming the enum. Default: none.
  std::vector<PickleEnum> enums;
  // Unknown globals (outside the strict classes in the header note) become
  // placeholders instead of failing the pickle. Default: on.
  bool placeholders = true;
  // Streaming: called for each key/value set into a dict (SETITEM(S), DICT),
  // before the entry is added. Returning true takes the entry: it is not added
  // and its values are freed after the call (copy what you need). An error
  // stops the unpickling and is returned as is.
  std::function<Result<bool>(const PyValue& dict, const PyValue& key, const PyValue& value)> consume;
  // Streaming, the same for each item appended to a list (APPEND(S)).
  std::function<Result<bool>(const PyValue& list, const PyValue& item)> consume_item;
  // The file form of Unpickle: bytes read per window (at least what one
  // opcode needs). Tests make it tiny so that every argument crosses one.
  uint64_t read_window = uint64_t{1} << 20;
};

// Unpickles `data`; `what` names the source in errors ("x.distcp @ 431 data.pkl").
// `placeholders`, when given, receives the unknown globals kept as
// placeholders ("module.name", first-seen order).
Result<PyHandle> Unpickle(std::string_view data, const std::string& what, const PickleOptions& opts = {},
                          std::vector<std::string>* placeholders = nullptr);

// Reads exactly [offset, offset + len) of a pickle's bytes (a short read is an
// error naming the file).
using PickleRead = std::function<Status(uint64_t offset, char* dst, size_t len)>;
// The same for `size` bytes read through `read` in windows (read_window), so
// a pickle of hundreds of MiB is never held whole (streaming reads it twice).
Result<PyHandle> Unpickle(uint64_t size, const PickleRead& read, const std::string& what,
                          const PickleOptions& opts = {}, std::vector<std::string>* placeholders = nullptr);

// Canonical module name used for matching (see the header note).
std::string CanonicalModule(std::string_view module);

// Integer value of an Int / Bool; error otherwise.
Result<int64_t> AsInt(const PyValue* v, std::string_view what);
// Value of an enum member of PickleOptions::enums (either pickle form: the
// VM made it Cls(value), Cls an allowed global) or a plain int; an error
// naming the class otherwise.
Result<int64_t> EnumValue(const PyValue* v, std::string_view what);
// Tuple/list of ints (torch.Size is a tuple after unpickling).
Result<std::vector<int64_t>> AsIntVector(const PyValue* v, std::string_view what);

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_PICKLE_H_
