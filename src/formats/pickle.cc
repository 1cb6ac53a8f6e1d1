#include "formats/pickle.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <unordered_map>
#include <unordered_set>

namespace ckptfs::formats {
namespace {

constexpr uint32_t kMaxDepth = 512;
constexpr size_t kMaxStack = 1u << 20;

using Arena = std::deque<PyValue>;  // stable addresses; destroyed iteratively

bool StartsWith(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }

bool IsAllowedGlobal(const std::string& module, const std::string& name, const PickleOptions& opts) {
  static const char* kModules[] = {"torch",   "numpy",   "collections", "argparse", "_codecs",
                                   "copyreg", "pathlib", "uuid",        "datetime", "enum"};
  auto under = [&](std::string_view prefix) {
    return module == prefix || StartsWith(module, std::string(prefix) + ".");
  };
  for (const char* m : kModules) {
    if (under(m)) return true;
  }
  for (const auto& m : opts.extra_modules) {
    if (under(m)) return true;
  }
  if (module == "builtins") {
    static const char* kNames[] = {"getattr", "set",  "frozenset", "bytearray", "bytes", "complex", "slice", "range",
                                   "object",  "dict", "list",      "tuple",     "int",   "float",   "str",   "bool"};
    for (const char* n : kNames) {
      if (name == n) return true;
    }
  }
  return false;
}

// Globals that are never data: modules whose callables act on the system or
// on the interpreter, and builtins other than the allowed constructors. The
// VM would not call them either; refusing them names a crafted file plainly.
bool IsDeniedGlobal(const std::string& module) {
  static const char* kModules[] = {"os",         "posix",     "nt",       "subprocess", "sys",     "shutil",
                                   "socket",     "importlib", "runpy",    "pickle",     "_pickle", "marshal",
                                   "code",       "codeop",    "ctypes",   "pty",        "signal",  "multiprocessing",
                                   "webbrowser", "tempfile",  "builtins", "pdb",        "timeit",  "platform"};
  for (const char* m : kModules) {
    if (module == m || StartsWith(module, std::string(m) + ".")) return true;
  }
  return false;
}

// Globals that decide tensor bytes: a storage class or a tensor rebuild
// function from outside torch is never a placeholder (it would silently turn
// a tensor into an inert object).
bool DecidesTensorBytes(const std::string& name) {
  return StartsWith(name, "_rebuild") || (name.size() >= 7 && name.compare(name.size() - 7, 7, "Storage") == 0);
}

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Protocol 0's UNICODE argument (raw-unicode-escape: \uXXXX and \UXXXXXXXX
// escapes, every other byte a Latin-1 code point) as UTF-8. pickle.py writes
// a backslash or newline of the string as \u005c / \u000a.
Result<std::string> DecodeRawUnicodeEscape(std::string_view in) {
  std::string out;
  out.reserve(in.size());
  for (size_t i = 0; i < in.size();) {
    const unsigned char c = static_cast<unsigned char>(in[i]);
    const size_t digits = c == '\\' && i + 1 < in.size() ? (in[i + 1] == 'u' ? 4 : in[i + 1] == 'U' ? 8 : 0) : 0;
    if (digits == 0) {
      AppendUtf8(c, &out);
      ++i;
      continue;
    }
    if (in.size() - i - 2 < digits) return Invalid("truncated \\u escape in a UNICODE argument");
    uint32_t cp = 0;
    for (size_t k = 0; k < digits; ++k) {
      const char h = in[i + 2 + k];
      const int v = h >= '0' && h <= '9'   ? h - '0'
                    : h >= 'a' && h <= 'f' ? h - 'a' + 10
                    : h >= 'A' && h <= 'F' ? h - 'A' + 10
                                           : -1;
      if (v < 0) return Invalid("bad \\u escape in a UNICODE argument");
      cp = cp << 4 | static_cast<uint32_t>(v);
    }
    if (cp > 0x10FFFF) return Invalid("\\U escape past U+10FFFF in a UNICODE argument");
    AppendUtf8(cp, &out);
    i += 2 + digits;
  }
  return out;
}

// The pickle bytes the VM reads: the whole input in memory, or a file read in
// windows (a DCP .metadata of hundreds of MiB is never held whole). A view
// returned by Take or Line stays valid until the next call.
class Cursor {
 public:
  explicit Cursor(std::string_view whole) : d_(whole), size_(whole.size()) {}
  Cursor(uint64_t size, const PickleRead* read, uint64_t window)
      : size_(size), read_(read), window_size_(std::max<uint64_t>(window, 1)) {}

  uint64_t pos() const { return p_; }
  uint64_t size() const { return size_; }
  uint64_t left() const { return size_ - p_; }
  Result<std::string_view> Take(uint64_t n) {
    RETURN_IF_ERROR(Ensure(n));
    std::string_view s = d_.substr(p_ - base_, n);
    p_ += n;
    return s;
  }
  Status Skip(uint64_t n) {
    if (n > left()) return Truncated(n);
    p_ += n;
    return Status::Ok();
  }
  Result<uint64_t> Le(size_t n) {
    ASSIGN_OR_RETURN(std::string_view b, Take(n));
    uint64_t v = 0;
    for (size_t i = 0; i < n; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(b[i])) << (8 * i);
    return v;
  }
  // The bytes up to the next newline (not included); the newline is consumed.
  Result<std::string_view> Line() {
    for (uint64_t want = window_size_;; want *= 2) {
      std::string_view here = d_.substr(std::min<uint64_t>(p_ - base_, d_.size()));
      size_t e = here.find('\n');
      if (e != std::string_view::npos) {
        p_ += e + 1;
        return here.substr(0, e);
      }
      if (read_ == nullptr || base_ + d_.size() >= size_) return Invalid("truncated text argument");
      RETURN_IF_ERROR(Fill(std::min(want, left())));
    }
  }

 private:
  Status Truncated(uint64_t n) const { return Invalid("truncated: wanted " + std::to_string(n) + " more bytes"); }
  Status Ensure(uint64_t n) {
    if (p_ - base_ <= d_.size() && n <= d_.size() - (p_ - base_)) return Status::Ok();  // Skip may pass the window
    if (n > left()) return Truncated(n);
    return Fill(std::min(left(), std::max(n, window_size_)));
  }
  // Reads [p_, p_ + n) into the window.
  Status Fill(uint64_t n) {
    window_.resize(n);
    RETURN_IF_ERROR((*read_)(p_, window_.data(), n));
    d_ = window_;
    base_ = p_;
    return Status::Ok();
  }

  std::string_view d_;  // bytes [base_, base_ + d_.size()) of the input
  uint64_t base_ = 0;
  uint64_t p_ = 0;
  uint64_t size_;
  const PickleRead* read_ = nullptr;
  uint64_t window_size_ = 0;
  std::string window_;
};

// Memo indices are small and dense (MEMOIZE numbers entries 0, 1, 2, ...;
// picklers PUT the same numbers), so they index a vector; an index far past
// the entries there are (a PUT of 4294967295, or the few entries a DCP
// .metadata reads back) goes to a hash map instead, so memory follows the
// entries, not the indices. T{} means absent. As hash maps alone, the two
// memo maps were an eighth of a 250k-fragment Megatron index build.
template <typename T>
class IndexMap {
 public:
  T* Find(uint64_t i) {
    if (i < dense_.size() && dense_[i] != T{}) return &dense_[i];
    if (sparse_.empty()) return nullptr;
    auto it = sparse_.find(i);
    return it == sparse_.end() ? nullptr : &it->second;
  }
  bool Contains(uint64_t i) { return Find(i) != nullptr; }
  // The entry at i, made (as T{}) if absent; the caller sets it to non-T{}.
  T& At(uint64_t i) {
    if (T* v = Find(i)) return *v;
    ++count_;
    // The vector grows while at least one index in kDensity below it is
    // used: then it costs no more than a hash map's nodes would. A DCP
    // .metadata reads back a few of its millions of memo entries (sparse);
    // Megatron's reads back most of them (dense).
    if (i >= dense_.size() && i < kDensity * count_ + kSlack) {
      dense_.resize(std::max<uint64_t>(i + 1, dense_.size() + dense_.size() / 2));
    }
    if (i < dense_.size()) return dense_[i];
    return sparse_[i];
  }
  void Erase(uint64_t i) {
    if (i < dense_.size() && dense_[i] != T{}) {
      dense_[i] = T{};
      --count_;
    } else if (!sparse_.empty() && sparse_.erase(i) > 0) {
      --count_;
    }
  }
  size_t size() const { return count_; }
  template <typename F>
  void ForEach(F&& f) const {
    for (const T& v : dense_) {
      if (v != T{}) f(v);
    }
    for (const auto& [k, v] : sparse_) f(v);
  }

 private:
  static constexpr uint64_t kDensity = 8;
  static constexpr uint64_t kSlack = uint64_t{1} << 16;
  std::vector<T> dense_;
  std::unordered_map<uint64_t, T> sparse_;
  size_t count_ = 0;
};

class Vm {
 public:
  // `in` is unread: ScanMemoReads reads a copy of it from the start.
  Vm(const Cursor& in, const std::string& what, const PickleOptions& opts)
      : in_(in), rescan_(in), what_(what), opts_(opts), arena_(std::make_shared<Arena>()) {}

  Result<PyRef> Run();
  const std::shared_ptr<Arena>& arena() const { return arena_; }
  const std::vector<std::string>& placeholders() const { return placeholders_; }

 private:
  PyRef Make(PyKind k) {
    if (!free_.empty()) {
      PyRef v = free_.back();
      free_.pop_back();
      v->kind = k;
      return v;
    }
    PyValue& v = arena_->emplace_back();
    v.kind = k;
    return &v;
  }
  // Streaming: pins `v` and everything it holds (see the header note).
  void Pin(PyRef v) {
    if (!streaming_ || v == nullptr || v->pinned) return;
    std::vector<PyRef> todo{v};
    while (!todo.empty()) {
      PyRef n = todo.back();
      todo.pop_back();
      if (n == nullptr || n->pinned) continue;
      n->pinned = true;
      ForEachChild(*n, [&](PyRef c) { todo.push_back(c); });
    }
  }
  template <typename F>
  static void ForEachChild(const PyValue& n, F&& f) {
    for (PyRef c : n.items) f(c);
    for (const auto& [k, v] : n.dict) {
      f(k);
      f(v);
    }
    for (PyRef c : n.args()) f(c);
    f(n.callable);
    f(n.state);
  }
  // Streaming: returns the unpinned nodes of a taken entry to the free list.
  void Free(PyRef root) {
    std::vector<PyRef> todo{root};
    while (!todo.empty()) {
      PyRef n = todo.back();
      todo.pop_back();
      if (n == nullptr || n->pinned || n->kind == kFreed) continue;
      ForEachChild(*n, [&](PyRef c) { todo.push_back(c); });
      *n = PyValue{};
      n->kind = kFreed;
      free_.push_back(n);
    }
  }
  // Streaming: an argument tuple popped for REDUCE / NEWOBJ / INST that nothing
  // else holds (unpinned: not memoized for a later read, not DUP'd) goes back
  // to the free list at once; its items live on in what was made from them.
  // Without this, one such tuple per DCP chunk waits for the next Collect.
  void Release(PyRef args) {
    if (!streaming_ || args->pinned || args->kind == kFreed) return;
    *args = PyValue{};
    args->kind = kFreed;
    free_.push_back(args);
  }
  PyRef MakeInt(int64_t i) {
    // Streaming: ints are shared and pinned (no opcode changes a value once
    // made), so the millions of chunk offsets a DCP .metadata memoizes for
    // its storage_data cost a pointer each, not a node.
    if (streaming_) {
      if (auto it = ints_.find(i); it != ints_.end()) return it->second;
    }
    PyRef v = Make(PyKind::kInt);
    v->i = i;
    if (streaming_ && ints_.size() < kMaxSharedInts) {
      v->pinned = true;
      ints_.emplace(i, v);
    }
    return v;
  }
  // None, True and False. Streaming: shared and pinned like ints (a DCP
  // chunk's TensorProperties hold two bools each).
  PyRef MakeConst(PyKind k, bool b) {
    PyRef& shared = k == PyKind::kNone ? none_ : bools_[b ? 1 : 0];
    if (streaming_ && shared != nullptr) return shared;
    PyRef v = Make(k);
    v->b = b;
    if (streaming_) {
      v->pinned = true;
      shared = v;
    }
    return v;
  }
  PyRef MakeStr(PyKind k, std::string s) {
    PyRef v = Make(k);
    v->s = std::move(s);
    return v;
  }
  Status Err(const std::string& why) const {
    return Invalid("cannot unpickle " + what_ + ": " + why + " (at byte " + std::to_string(op_pos_) + ")");
  }
  // Input errors carry the opcode's position.
  template <typename T>
  Result<T> At(Result<T> r) const {
    if (!r.ok()) return Err(r.status().message());
    return r;
  }
  Result<std::string_view> Take(uint64_t n) { return At(in_.Take(n)); }
  Result<std::string_view> Line() { return At(in_.Line()); }
  template <typename T>
  Result<T> Num() {
    ASSIGN_OR_RETURN(std::string_view s, Take(sizeof(T)));
    return LoadLE<T>(s.data());
  }
  Status Push(PyRef v) {
    if (stack_.size() >= kMaxStack) return Err("stack too deep");
    stack_.push_back(std::move(v));
    return Status::Ok();
  }
  Result<PyRef> Pop() {
    if (stack_.size() <= Base()) return Err("stack underflow");
    PyRef v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  Result<PyRef> Top() {
    if (stack_.size() <= Base()) return Err("stack underflow");
    return stack_.back();
  }
  size_t Base() const { return marks_.empty() ? 0 : marks_.back(); }
  Result<std::vector<PyRef>> PopMark() {
    if (marks_.empty()) return Err("MARK missing");
    size_t m = marks_.back();
    marks_.pop_back();
    std::vector<PyRef> out(std::make_move_iterator(stack_.begin() + static_cast<ptrdiff_t>(m)),
                           std::make_move_iterator(stack_.end()));
    stack_.resize(m);
    return out;
  }
  Status Adopt(PyValue* parent, const PyRef& child) {
    if (parent->pinned) Pin(child);
    if (child && child->depth + 1 > parent->depth) parent->depth = child->depth + 1;
    if (parent->depth > kMaxDepth) return Err("values nested deeper than " + std::to_string(kMaxDepth));
    return Status::Ok();
  }
  Result<PyRef> Seq(PyKind k, std::vector<PyRef> items) {
    auto v = Make(k);
    for (const auto& it : items) RETURN_IF_ERROR(Adopt(v, it));
    v->items = std::move(items);
    return v;
  }
  Result<PyRef> Global(std::string module, std::string name) {
    module = CanonicalModule(module);
    const bool allowed = IsAllowedGlobal(module, name, opts_);
    if (!allowed && (!opts_.placeholders || IsDeniedGlobal(module) || DecidesTensorBytes(name))) {
      return Err("unknown pickle global " + module + "." + name + " (not on the allow list)");
    }
    auto v = Make(PyKind::kGlobal);
    v->s = std::move(module);
    v->MutableExt().name = std::move(name);
    if (!allowed) {
      v->placeholder = true;
      std::string full = v->s + "." + v->name();
      if (std::find(placeholders_.begin(), placeholders_.end(), full) == placeholders_.end()) {
        placeholders_.push_back(std::move(full));
      }
    }
    return v;
  }
  Status SetItems(const PyRef& target, std::vector<PyRef>& kv) {
    if (kv.size() % 2 != 0) return Err("odd number of items for SETITEMS");
    if (target->kind != PyKind::kDict && target->kind != PyKind::kObject) return Err("SETITEM on a non-dict");
    if (streaming_ && target->kind == PyKind::kDict && opts_.consume) {
      // Every entry is offered before any is freed: a value DUP'd within the
      // batch is pinned, so nothing the consumer reads is freed under it.
      std::vector<bool> taken(kv.size() / 2, false);
      for (size_t i = 0; i < kv.size(); i += 2) {
        ASSIGN_OR_RETURN(taken[i / 2], opts_.consume(*target, *kv[i], *kv[i + 1]));
      }
      for (size_t i = 0; i < kv.size(); i += 2) {
        if (taken[i / 2]) continue;
        RETURN_IF_ERROR(Adopt(target, kv[i]));
        RETURN_IF_ERROR(Adopt(target, kv[i + 1]));
        target->dict.emplace_back(kv[i], kv[i + 1]);
      }
      for (size_t i = 0; i < kv.size(); i += 2) {
        if (!taken[i / 2]) continue;
        Free(kv[i]);
        Free(kv[i + 1]);
      }
      return Status::Ok();
    }
    for (size_t i = 0; i < kv.size(); i += 2) {
      RETURN_IF_ERROR(Adopt(target, kv[i + 1]));
      target->dict.emplace_back(std::move(kv[i]), std::move(kv[i + 1]));
    }
    return Status::Ok();
  }
  Status Append(const PyRef& target, std::vector<PyRef>& items) {
    if (target->kind != PyKind::kList && target->kind != PyKind::kObject && target->kind != PyKind::kSet) {
      return Err("APPEND on a non-list");
    }
    if (streaming_ && target->kind == PyKind::kList && opts_.consume_item) {
      // As SetItems: every item is offered before any is freed.
      std::vector<bool> taken(items.size(), false);
      for (size_t i = 0; i < items.size(); ++i) {
        ASSIGN_OR_RETURN(taken[i], opts_.consume_item(*target, *items[i]));
      }
      for (size_t i = 0; i < items.size(); ++i) {
        if (taken[i]) continue;
        RETURN_IF_ERROR(Adopt(target, items[i]));
        target->items.push_back(items[i]);
      }
      for (size_t i = 0; i < items.size(); ++i) {
        if (taken[i]) Free(items[i]);
      }
      return Status::Ok();
    }
    for (auto& it : items) {
      RETURN_IF_ERROR(Adopt(target, it));
      target->items.push_back(std::move(it));
    }
    return Status::Ok();
  }
  Result<PyRef> Call(const PyRef& callable, const PyRef& args);
  // The options' enum whose class `cls` is, or null.
  const PickleEnum* FindEnum(const PyValue& cls) const {
    if (cls.kind != PyKind::kGlobal) return nullptr;
    for (const PickleEnum& e : opts_.enums) {
      if (cls.s == e.module && cls.name() == e.cls) return &e;
    }
    return nullptr;
  }

  // The canonical form of a known enum member: an Object Cls(value).
  PyRef EnumMember(const PyRef& cls, int64_t value) {
    auto o = Make(PyKind::kObject);
    o->callable = cls;
    o->MutableExt().args = {MakeInt(value)};
    o->depth = 1;
    return o;
  }
  Result<PyRef> RebuildTensor(const std::string& fn, const std::vector<PyRef>& a);
  Result<PyRef> PersistentLoad(const PyRef& pid);
  Status Memoize(uint64_t idx, const PyRef& v) {
    // Every memo entry costs at least one opcode byte (MEMOIZE), so the input
    // bounds the memo; a fixed cap broke DCP .metadata of ~100k tensors.
    if (memo_.size() > std::max<uint64_t>(kMaxStack, in_.size())) return Err("memo too large");
    if (streaming_) {
      if (!memo_reads_.Contains(idx)) return Status::Ok();  // never read back: not kept
      Pin(v);
    }
    memo_.At(idx) = v;
    return Status::Ok();
  }
  // Streaming: the first pass. Finds the memo indices some GET reads. MEMOIZE
  // then numbers entries by count (CPython numbers them len(memo): the same
  // unless a pickle also PUTs an index twice, which no pickler writes; such a
  // GET then misses and the unpickling fails plainly).
  void ScanMemoReads();
  static constexpr PyKind kFreed = static_cast<PyKind>(0xff);
  Result<PyRef> MemoGet(uint64_t idx) {
    PyRef* found = memo_.Find(idx);
    if (found == nullptr) return Err("memo key " + std::to_string(idx) + " missing");
    PyRef v = *found;
    if (streaming_) {
      // After its last read the memo lets go of it (Collect may take it back).
      if (uint64_t* r = memo_reads_.Find(idx); r != nullptr && --*r == 0) {
        memo_reads_.Erase(idx);
        memo_.Erase(idx);
      }
    }
    return v;
  }
  // Streaming: every node the stack, the memo and the shared ints no longer
  // reach goes back to the free list (values a REDUCE or NEWOBJ consumed, the
  // memo's values after their last read). Run between opcodes only, when the
  // live nodes have doubled since the last time: linear in all.
  void Collect() {
    std::vector<PyRef> todo;
    auto mark = [&](PyRef n) {
      if (n != nullptr && !n->marked) {
        n->marked = true;
        todo.push_back(n);
      }
    };
    for (PyRef r : stack_) mark(r);
    memo_.ForEach(mark);
    for (const auto& [k, v] : ints_) mark(v);
    mark(none_);
    for (PyRef b : bools_) mark(b);
    while (!todo.empty()) {
      PyRef n = todo.back();
      todo.pop_back();
      ForEachChild(*n, mark);
    }
    free_.clear();
    size_t live = 0;
    for (PyValue& n : *arena_) {
      if (n.marked) {
        n.marked = false;
        ++live;
        continue;
      }
      if (n.kind != kFreed) {
        n = PyValue{};
        n.kind = kFreed;
      }
      free_.push_back(&n);
    }
    next_collect_ = live + std::max(live / 2, kMinCollect);  // garbage stays under half the live nodes
  }
  static constexpr size_t kMinCollect = size_t{1} << 16;

  Cursor in_;
  Cursor rescan_;  // the same input from its start, for ScanMemoReads
  const std::string& what_;
  const PickleOptions& opts_;
  uint64_t op_pos_ = 0;
  std::vector<PyRef> stack_;
  std::vector<size_t> marks_;
  IndexMap<PyRef> memo_;
  std::shared_ptr<Arena> arena_;
  bool streaming_ = false;
  IndexMap<uint64_t> memo_reads_;      // streaming: GETs still to come, by memo index
  size_t next_collect_ = kMinCollect;  // streaming: live nodes that trigger Collect
  uint64_t memoized_ = 0;              // MEMOIZE ops so far (the next index)
  std::vector<PyRef> free_;            // streaming: freed nodes to reuse
  static constexpr size_t kMaxSharedInts = size_t{1} << 20;
  std::unordered_map<int64_t, PyRef> ints_;  // streaming: one pinned node per int value
  PyRef none_ = nullptr;                     // streaming: the shared None
  PyRef bools_[2] = {nullptr, nullptr};      // streaming: the shared False, True
  std::vector<std::string> placeholders_;    // unknown globals kept inert, in first-seen order
};

Result<PyRef> Vm::PersistentLoad(const PyRef& pid) {
  // torch.save: ('storage', storage_type, key, location, numel).
  if (pid->kind != PyKind::kTuple || pid->items.size() < 5 || !pid->items[0]->IsStr() ||
      pid->items[0]->s != "storage") {
    return Err("unsupported persistent id (expected a torch storage tuple)");
  }
  const PyValue& cls = *pid->items[1];
  auto v = Make(PyKind::kStorage);
  if (cls.kind == PyKind::kGlobal) {
    if (cls.placeholder || (cls.s != "torch" && !StartsWith(cls.s, "torch."))) {
      return Err("storage class " + cls.s + "." + cls.name() + " is not torch's");
    }
    if (cls.name() == "UntypedStorage") {
      v->MutableParts().untyped = true;
      v->MutableParts().storage_dtype = DType::kU8;
    } else {
      v->MutableParts().storage_dtype = DTypeFromTorchName(cls.name());
      if (v->MutableParts().storage_dtype == DType::kInvalid) return Err("unknown storage class torch." + cls.name());
    }
  } else if (cls.kind == PyKind::kObject) {
    return Err("quantized or custom storage types are not supported");
  } else {
    return Err("storage type is not a class");
  }
  const PyValue& key = *pid->items[2];
  if (key.kind == PyKind::kStr) {
    v->s = key.s;
  } else if (key.kind == PyKind::kInt) {
    v->s = std::to_string(key.i);
  } else {
    return Err("storage key is not a string");
  }
  ASSIGN_OR_RETURN(int64_t numel, AsInt(pid->items[4], "storage numel"));
  if (numel < 0) return Err("negative storage size");
  v->MutableParts().storage_numel = static_cast<uint64_t>(numel);
  return v;
}

Result<PyRef> Vm::RebuildTensor(const std::string& fn, const std::vector<PyRef>& a) {
  // _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata])
  // _rebuild_tensor_v3(storage, offset, size, stride, requires_grad, hooks, dtype[, metadata])
  // _rebuild_tensor(storage, offset, size, stride)
  size_t need = fn == "_rebuild_tensor_v3" ? 7 : 4;
  if (a.size() < need) return Err(fn + " with " + std::to_string(a.size()) + " arguments");
  if (a[0]->kind != PyKind::kStorage) return Err(fn + ": first argument is not a storage");
  auto v = Make(PyKind::kTensor);
  TensorRef& t = v->MutableParts().tensor;
  t.storage_key = a[0]->s;
  t.dtype = a[0]->MutableParts().storage_dtype;
  if (fn == "_rebuild_tensor_v3") {
    if (a[6]->kind != PyKind::kGlobal || a[6]->s != "torch")
      return Err("_rebuild_tensor_v3: dtype is not a torch dtype");
    t.dtype = DTypeFromTorchName(a[6]->name());
    if (t.dtype == DType::kInvalid) return Err("unsupported dtype torch." + a[6]->name());
  } else if (a[0]->MutableParts().untyped) {
    return Err(fn + " on an UntypedStorage without a dtype");
  }
  ASSIGN_OR_RETURN(int64_t off, AsInt(a[1], "storage_offset"));
  if (off < 0) return Err("negative storage offset");
  t.storage_offset = static_cast<uint64_t>(off);
  ASSIGN_OR_RETURN(t.shape, AsIntVector(a[2], "size"));
  ASSIGN_OR_RETURN(t.strides, AsIntVector(a[3], "stride"));
  if (t.shape.size() != t.strides.size()) return Err("size and stride ranks differ");
  for (size_t i = 0; i < t.shape.size(); ++i) {
    if (t.shape[i] < 0 || t.strides[i] < 0) return Err("negative size or stride");
  }
  return v;
}

Result<PyRef> Vm::Call(const PyRef& callable, const PyRef& args) {
  if (args->kind != PyKind::kTuple) return Err("REDUCE arguments are not a tuple");
  const auto& a = args->items;
  if (callable->kind == PyKind::kGlobal) {
    const std::string& m = callable->s;
    const std::string& n = callable->name();
    if (m == "torch._utils" && (n == "_rebuild_tensor_v2" || n == "_rebuild_tensor_v3" || n == "_rebuild_tensor")) {
      return RebuildTensor(n, a);
    }
    if (m == "torch._utils" && (n == "_rebuild_parameter" || n == "_rebuild_parameter_with_state")) {
      if (a.empty() || a[0]->kind != PyKind::kTensor) return Err(n + ": first argument is not a tensor");
      return a[0];
    }
    if (m == "torch._tensor" && n == "_rebuild_from_type_v2") {
      // (func, type, args, state): the tensor comes from func(*args).
      if (a.size() < 3) return Err("_rebuild_from_type_v2 with too few arguments");
      if (a[0]->kind == PyKind::kGlobal && a[0]->s == "torch._utils" && a[0]->name() == "_rebuild_wrapper_subclass") {
        // A tensor subclass with no storage of its own (DTensor): kept as an
        // object of that class with its metadata (args: dtype, size, stride,
        // ...) and its state (DTensor: _local_tensor, _spec), for the reader
        // that knows the class. Not a tensor: nothing reads it as one.
        if (a[1]->kind != PyKind::kGlobal || !a[2]->IsSeq()) return Err("_rebuild_wrapper_subclass without a class");
        auto o = Make(PyKind::kObject);
        o->callable = a[1];
        RETURN_IF_ERROR(Adopt(o, a[1]));
        for (const auto& x : a[2]->items) RETURN_IF_ERROR(Adopt(o, x));
        o->MutableExt().args = a[2]->items;
        if (a.size() > 3) {
          RETURN_IF_ERROR(Adopt(o, a[3]));
          o->state = a[3];
        }
        return o;
      }
      return Call(a[0], a[2]);
    }
    if (m == "builtins" && n == "getattr" && a.size() == 2 && a[1]->IsStr()) {
      // getattr(EnumCls, 'member'): a known enum becomes EnumCls(value).
      if (const PickleEnum* e = FindEnum(*a[0])) {
        for (const auto& [member, value] : e->members) {
          if (a[1]->s == member) return EnumMember(a[0], value);
        }
        return Err("unknown member '" + a[1]->s + "' of enum " + a[0]->s + "." + a[0]->name());
      }
    }
    if (const PickleEnum* e = FindEnum(*callable)) {
      if (a.size() != 1 || a[0]->kind != PyKind::kInt) return Err(e->cls + "() argument is not an int");
      for (const auto& [member, value] : e->members) {
        if (a[0]->i == value) return EnumMember(callable, value);
      }
      return Err(std::to_string(a[0]->i) + " is not a value of enum " + e->module + "." + e->cls);
    }
    if (m == "copyreg" && n == "_reconstructor") {
      // Protocols 0/1 for a plain object: _reconstructor(cls, object, None),
      // then BUILD: an instance of cls, as NEWOBJ makes at protocol 2.
      if (a.empty() || a[0]->kind != PyKind::kGlobal) return Err("_reconstructor without a class");
      auto o = Make(PyKind::kObject);
      o->callable = a[0];
      o->newobj = true;
      RETURN_IF_ERROR(Adopt(o, a[0]));
      return o;
    }
    if (m == "collections" && n == "OrderedDict") {
      auto d = Make(PyKind::kDict);
      if (!a.empty() && a[0]->IsSeq()) {
        for (const auto& pair : a[0]->items) {
          if (!pair->IsSeq() || pair->items.size() != 2) return Err("OrderedDict item is not a pair");
          RETURN_IF_ERROR(Adopt(d, pair->items[1]));
          d->dict.emplace_back(pair->items[0], pair->items[1]);
        }
      }
      return d;
    }
    if (m == "torch" && n == "Size") {
      if (a.size() != 1 || !a[0]->IsSeq()) return Err("torch.Size argument is not a sequence");
      if (a[0]->kind == PyKind::kTuple) return a[0];  // immutable: the Size is its tuple (no copy per chunk)
      return Seq(PyKind::kTuple, a[0]->items);
    }
    if (m == "_codecs" && n == "encode") {
      // Protocol 2 writes bytes as encode(str, 'latin1'): code points 0-255.
      if (a.empty() || !a[0]->IsStr()) return Err("_codecs.encode argument is not a str");
      std::string out;
      const std::string& s = a[0]->s;
      for (size_t i = 0; i < s.size();) {
        unsigned char c = static_cast<unsigned char>(s[i]);
        if (c < 0x80) {
          out.push_back(static_cast<char>(c));
          i += 1;
        } else if ((c & 0xE0) == 0xC0 && i + 1 < s.size()) {
          out.push_back(static_cast<char>(((c & 0x1F) << 6) | (static_cast<unsigned char>(s[i + 1]) & 0x3F)));
          i += 2;
        } else {
          return Err("_codecs.encode: code point above 255");
        }
      }
      return MakeStr(PyKind::kBytes, std::move(out));
    }
    if (m == "builtins" && (n == "set" || n == "frozenset")) {
      return Seq(PyKind::kSet, a.empty() || !a[0]->IsSeq() ? std::vector<PyRef>{} : a[0]->items);
    }
    if (m == "builtins" && (n == "bytes" || n == "bytearray") && !a.empty() && a[0]->kind == PyKind::kBytes) {
      return a[0];
    }
  }
  auto o = Make(PyKind::kObject);
  o->callable = callable;
  for (const auto& x : a) RETURN_IF_ERROR(Adopt(o, x));
  if (!a.empty()) o->MutableExt().args = a;
  return o;
}

void Vm::ScanMemoReads() {
  Cursor c = std::move(rescan_);  // its window goes with the scan
  auto skip_sized = [&](size_t len_bytes) {
    auto n = c.Le(len_bytes);
    return n.ok() && c.Skip(*n).ok();
  };
  auto count = [&](Result<uint64_t> idx) {
    if (!idx.ok()) return false;
    ++memo_reads_.At(*idx);
    return true;
  };
  // A malformed stream stops the scan; the VM reports the error where it is.
  while (c.left() > 0) {
    auto opr = c.Le(1);
    if (!opr.ok()) return;
    bool ok = true;
    switch (static_cast<unsigned char>(*opr)) {
      case '.':
        return;
      case 0x80:
      case 'K':
      case 'q':
        ok = c.Skip(1).ok();
        break;
      case 'M':
        ok = c.Skip(2).ok();
        break;
      case 'J':
      case 'r':
        ok = c.Skip(4).ok();
        break;
      case 0x95:
      case 'G':
        ok = c.Skip(8).ok();
        break;
      case 0x8a:
      case 0x8c:
      case 'C':
      case 'U':
        ok = skip_sized(1);
        break;
      case 0x8b:
      case 'X':
      case 'B':
      case 'T':
        ok = skip_sized(4);
        break;
      case 0x8d:
      case 0x8e:
      case 0x96:
        ok = skip_sized(8);
        break;
      case 'I':
      case 'L':
      case 'F':
      case 'S':
      case 'V':
      case 'P':
      case 'p':
        ok = c.Line().ok();
        break;
      case 'c':
      case 'i':
        ok = c.Line().ok() && c.Line().ok();
        break;
      case 'h':
        ok = count(c.Le(1));
        break;
      case 'j':
        ok = count(c.Le(4));
        break;
      case 'g': {
        auto text = c.Line();
        ok = text.ok() && count(std::strtoull(std::string(*text).c_str(), nullptr, 10));
        break;
      }
      default:
        break;  // no argument (or unknown: the VM refuses it)
    }
    if (!ok) return;
  }
}

Result<PyRef> Vm::Run() {
  if (opts_.consume || opts_.consume_item) {
    streaming_ = true;
    ScanMemoReads();
  }
  while (true) {
    op_pos_ = in_.pos();
    if (streaming_ && arena_->size() - free_.size() >= next_collect_) Collect();
    if (in_.left() == 0) return Err("truncated: no STOP opcode");
    ASSIGN_OR_RETURN(std::string_view opb, Take(1));
    unsigned char op = static_cast<unsigned char>(opb[0]);
    switch (op) {
      case 0x80: {  // PROTO
        ASSIGN_OR_RETURN(uint8_t proto, Num<uint8_t>());
        if (proto > 5) return Err("unsupported pickle protocol " + std::to_string(proto));
        break;
      }
      case 0x95: {  // FRAME: a length hint only
        ASSIGN_OR_RETURN(uint64_t n, Num<uint64_t>());
        (void)n;
        break;
      }
      case '.': {  // STOP
        ASSIGN_OR_RETURN(PyRef v, Pop());
        return v;
      }
      case '(':
        marks_.push_back(stack_.size());
        break;
      case '0':
        RETURN_IF_ERROR(Pop().status());
        break;
      case '1': {
        ASSIGN_OR_RETURN(auto v, PopMark());
        break;
      }
      case '2': {
        ASSIGN_OR_RETURN(PyRef v, Top());
        Pin(v);
        RETURN_IF_ERROR(Push(v));
        break;
      }
      case 'N':
        RETURN_IF_ERROR(Push(MakeConst(PyKind::kNone, false)));
        break;
      case 0x88:
      case 0x89:
        RETURN_IF_ERROR(Push(MakeConst(PyKind::kBool, op == 0x88)));
        break;
      case 'J': {
        ASSIGN_OR_RETURN(int32_t v, Num<int32_t>());
        RETURN_IF_ERROR(Push(MakeInt(v)));
        break;
      }
      case 'K': {
        ASSIGN_OR_RETURN(uint8_t v, Num<uint8_t>());
        RETURN_IF_ERROR(Push(MakeInt(v)));
        break;
      }
      case 'M': {
        ASSIGN_OR_RETURN(uint16_t v, Num<uint16_t>());
        RETURN_IF_ERROR(Push(MakeInt(v)));
        break;
      }
      case 0x8a:    // LONG1
      case 0x8b: {  // LONG4
        uint64_t n;
        if (op == 0x8a) {
          ASSIGN_OR_RETURN(uint8_t n1, Num<uint8_t>());
          n = n1;
        } else {
          ASSIGN_OR_RETURN(int32_t n4, Num<int32_t>());
          if (n4 < 0) return Err("negative LONG4 length");
          n = static_cast<uint64_t>(n4);
        }
        ASSIGN_OR_RETURN(std::string_view b, Take(n));
        if (n <= 8) {
          uint64_t u = 0;
          for (size_t i = 0; i < n; ++i) u |= static_cast<uint64_t>(static_cast<unsigned char>(b[i])) << (8 * i);
          if (n > 0 && n < 8 && (static_cast<unsigned char>(b[n - 1]) & 0x80)) u |= ~0ull << (8 * n);
          RETURN_IF_ERROR(Push(MakeInt(static_cast<int64_t>(u))));
        } else {
          RETURN_IF_ERROR(Push(MakeStr(PyKind::kBigInt, std::string(b))));
        }
        break;
      }
      case 'I':
      case 'L': {  // INT / LONG (text)
        ASSIGN_OR_RETURN(std::string_view line, Line());
        std::string t(line);
        if (!t.empty() && t.back() == 'L') t.pop_back();
        if (op == 'I' && (t == "00" || t == "01")) {
          RETURN_IF_ERROR(Push(MakeConst(PyKind::kBool, t == "01")));
          break;
        }
        char* end = nullptr;
        errno = 0;
        long long v = std::strtoll(t.c_str(), &end, 10);
        if (end == t.c_str() || *end != '\0' || errno == ERANGE) return Err("bad integer literal");
        RETURN_IF_ERROR(Push(MakeInt(v)));
        break;
      }
      case 'G': {  // BINFLOAT: big-endian double
        ASSIGN_OR_RETURN(std::string_view b, Take(8));
        uint64_t u = 0;
        for (int i = 0; i < 8; ++i) u = (u << 8) | static_cast<unsigned char>(b[i]);
        auto v = Make(PyKind::kFloat);
        std::memcpy(&v->f, &u, 8);
        RETURN_IF_ERROR(Push(v));
        break;
      }
      case 'F': {
        ASSIGN_OR_RETURN(std::string_view line, Line());
        auto v = Make(PyKind::kFloat);
        v->f = std::strtod(std::string(line).c_str(), nullptr);
        RETURN_IF_ERROR(Push(v));
        break;
      }
      case 'X':    // BINUNICODE
      case 0x8c:   // SHORT_BINUNICODE
      case 0x8d:   // BINUNICODE8
      case 'B':    // BINBYTES
      case 'C':    // SHORT_BINBYTES
      case 0x8e:   // BINBYTES8
      case 0x96:   // BYTEARRAY8
      case 'T':    // BINSTRING
      case 'U': {  // SHORT_BINSTRING
        uint64_t n;
        if (op == 0x8c || op == 'C' || op == 'U') {
          ASSIGN_OR_RETURN(uint8_t n1, Num<uint8_t>());
          n = n1;
        } else if (op == 0x8d || op == 0x8e || op == 0x96) {
          ASSIGN_OR_RETURN(n, Num<uint64_t>());
        } else {
          ASSIGN_OR_RETURN(uint32_t n4, Num<uint32_t>());
          n = n4;
        }
        ASSIGN_OR_RETURN(std::string_view b, Take(n));
        bool is_str = op == 'X' || op == 0x8c || op == 0x8d || op == 'T' || op == 'U';
        // A str pickled with surrogatepass (Python's surrogateescape of a
        // file name) is not UTF-8: names are escaped here, once, so every
        // view, JSON and safetensors header downstream gets valid UTF-8.
        RETURN_IF_ERROR(
            Push(MakeStr(is_str ? PyKind::kStr : PyKind::kBytes, is_str ? EscapeNonUtf8(b) : std::string(b))));
        break;
      }
      case 'S': {  // STRING: a quoted repr
        ASSIGN_OR_RETURN(std::string_view line, Line());
        if (line.size() < 2 || (line.front() != '\'' && line.front() != '"') || line.back() != line.front()) {
          return Err("bad STRING literal");
        }
        RETURN_IF_ERROR(Push(MakeStr(PyKind::kStr, std::string(line.substr(1, line.size() - 2)))));
        break;
      }
      case 'V': {  // UNICODE (raw-unicode-escape)
        ASSIGN_OR_RETURN(std::string_view line, Line());
        ASSIGN_OR_RETURN(std::string text, At(DecodeRawUnicodeEscape(line)));
        RETURN_IF_ERROR(Push(MakeStr(PyKind::kStr, std::move(text))));
        break;
      }
      case ')':
        RETURN_IF_ERROR(Push(Make(PyKind::kTuple)));
        break;
      case 't': {
        ASSIGN_OR_RETURN(auto items, PopMark());
        ASSIGN_OR_RETURN(PyRef v, Seq(PyKind::kTuple, std::move(items)));
        RETURN_IF_ERROR(Push(v));
        break;
      }
      case 0x85:
      case 0x86:
      case 0x87: {
        size_t n = op - 0x84;
        if (stack_.size() < Base() + n) return Err("stack underflow in TUPLE" + std::to_string(n));
        std::vector<PyRef> items(stack_.end() - static_cast<ptrdiff_t>(n), stack_.end());
        stack_.resize(stack_.size() - n);
        ASSIGN_OR_RETURN(PyRef v, Seq(PyKind::kTuple, std::move(items)));
        RETURN_IF_ERROR(Push(v));
        break;
      }
      case ']':
        RETURN_IF_ERROR(Push(Make(PyKind::kList)));
        break;
      case 'l': {
        ASSIGN_OR_RETURN(auto items, PopMark());
        ASSIGN_OR_RETURN(PyRef v, Seq(PyKind::kList, std::move(items)));
        RETURN_IF_ERROR(Push(v));
        break;
      }
      case 0x8f:
        RETURN_IF_ERROR(Push(Make(PyKind::kSet)));
        break;
      case 0x91: {
        ASSIGN_OR_RETURN(auto items, PopMark());
        ASSIGN_OR_RETURN(PyRef v, Seq(PyKind::kSet, std::move(items)));
        RETURN_IF_ERROR(Push(v));
        break;
      }
      case 'a': {
        ASSIGN_OR_RETURN(PyRef item, Pop());
        ASSIGN_OR_RETURN(PyRef list, Top());
        std::vector<PyRef> one{item};
        RETURN_IF_ERROR(Append(list, one));
        break;
      }
      case 'e':
      case 0x90: {  // APPENDS / ADDITEMS
        ASSIGN_OR_RETURN(auto items, PopMark());
        ASSIGN_OR_RETURN(PyRef list, Top());
        RETURN_IF_ERROR(Append(list, items));
        break;
      }
      case '}':
        RETURN_IF_ERROR(Push(Make(PyKind::kDict)));
        break;
      case 'd': {
        ASSIGN_OR_RETURN(auto kv, PopMark());
        auto dict = Make(PyKind::kDict);
        RETURN_IF_ERROR(SetItems(dict, kv));
        RETURN_IF_ERROR(Push(dict));
        break;
      }
      case 's': {
        ASSIGN_OR_RETURN(PyRef v, Pop());
        ASSIGN_OR_RETURN(PyRef k, Pop());
        ASSIGN_OR_RETURN(PyRef dict, Top());
        std::vector<PyRef> kv{k, v};
        RETURN_IF_ERROR(SetItems(dict, kv));
        break;
      }
      case 'u': {
        ASSIGN_OR_RETURN(auto kv, PopMark());
        ASSIGN_OR_RETURN(PyRef dict, Top());
        RETURN_IF_ERROR(SetItems(dict, kv));
        break;
      }
      case 'c':
      case 'i': {  // GLOBAL / INST
        ASSIGN_OR_RETURN(std::string_view mod_line, Line());
        std::string mod(mod_line);  // the next Line may move the window
        ASSIGN_OR_RETURN(std::string_view name, Line());
        ASSIGN_OR_RETURN(PyRef g, Global(std::move(mod), std::string(name)));
        if (op == 'c') {
          RETURN_IF_ERROR(Push(g));
        } else {
          ASSIGN_OR_RETURN(auto args, PopMark());
          ASSIGN_OR_RETURN(PyRef t, Seq(PyKind::kTuple, std::move(args)));
          ASSIGN_OR_RETURN(PyRef o, Call(g, t));
          Release(t);
          RETURN_IF_ERROR(Push(o));
        }
        break;
      }
      case 0x93: {  // STACK_GLOBAL
        ASSIGN_OR_RETURN(PyRef name, Pop());
        ASSIGN_OR_RETURN(PyRef mod, Pop());
        if (!name->IsStr() || !mod->IsStr()) return Err("STACK_GLOBAL operands are not strings");
        ASSIGN_OR_RETURN(PyRef g, Global(mod->s, name->s));
        RETURN_IF_ERROR(Push(g));
        break;
      }
      case 'o': {  // OBJ: MARK cls args...
        ASSIGN_OR_RETURN(auto items, PopMark());
        if (items.empty()) return Err("OBJ without a class");
        PyRef cls = items.front();
        ASSIGN_OR_RETURN(PyRef t, Seq(PyKind::kTuple, std::vector<PyRef>(items.begin() + 1, items.end())));
        ASSIGN_OR_RETURN(PyRef o, Call(cls, t));
        RETURN_IF_ERROR(Push(o));
        break;
      }
      case 'R': {  // REDUCE
        ASSIGN_OR_RETURN(PyRef args, Pop());
        ASSIGN_OR_RETURN(PyRef fn, Pop());
        ASSIGN_OR_RETURN(PyRef o, Call(fn, args));
        Release(args);
        RETURN_IF_ERROR(Push(o));
        break;
      }
      case 0x81:                                          // NEWOBJ
      case 0x92: {                                        // NEWOBJ_EX
        if (op == 0x92) RETURN_IF_ERROR(Pop().status());  // kwargs: not recorded
        ASSIGN_OR_RETURN(PyRef args, Pop());
        ASSIGN_OR_RETURN(PyRef cls, Pop());
        if (args->kind != PyKind::kTuple) return Err("NEWOBJ arguments are not a tuple");
        PyRef o;
        if (cls->kind == PyKind::kGlobal && cls->s == "collections" && cls->name() == "OrderedDict") {
          o = Make(PyKind::kDict);
        } else {
          o = Make(PyKind::kObject);
          o->callable = cls;
          o->newobj = true;
          for (const auto& x : args->items) RETURN_IF_ERROR(Adopt(o, x));
          if (!args->items.empty()) o->MutableExt().args = args->items;
        }
        Release(args);
        RETURN_IF_ERROR(Push(o));
        break;
      }
      case 'b': {  // BUILD
        ASSIGN_OR_RETURN(PyRef state, Pop());
        ASSIGN_OR_RETURN(PyRef obj, Top());
        if (obj->kind == PyKind::kObject) {
          RETURN_IF_ERROR(Adopt(obj, state));
          obj->state = state;
        }
        // BUILD on a dict (a module state_dict's _metadata attribute) or a
        // tensor (Python attributes) carries nothing we serve: dropped.
        break;
      }
      case 'Q': {  // BINPERSID
        ASSIGN_OR_RETURN(PyRef pid, Pop());
        ASSIGN_OR_RETURN(PyRef v, PersistentLoad(pid));
        RETURN_IF_ERROR(Push(v));
        break;
      }
      case 'P': {
        ASSIGN_OR_RETURN(std::string_view line, Line());
        ASSIGN_OR_RETURN(PyRef v, PersistentLoad(MakeStr(PyKind::kStr, std::string(line))));
        RETURN_IF_ERROR(Push(v));
        break;
      }
      case 'q':
      case 'r':
      case 'p':
      case 0x94: {  // BINPUT, LONG_BINPUT, PUT, MEMOIZE
        uint64_t idx;
        if (op == 'q') {
          ASSIGN_OR_RETURN(uint8_t i1, Num<uint8_t>());
          idx = i1;
        } else if (op == 'r') {
          ASSIGN_OR_RETURN(uint32_t i4, Num<uint32_t>());
          idx = i4;
        } else if (op == 'p') {
          ASSIGN_OR_RETURN(std::string_view line, Line());
          idx = std::strtoull(std::string(line).c_str(), nullptr, 10);
        } else {
          idx = streaming_ ? memoized_++ : memo_.size();
        }
        ASSIGN_OR_RETURN(PyRef v, Top());
        RETURN_IF_ERROR(Memoize(idx, v));
        break;
      }
      case 'h':
      case 'j':
      case 'g': {
        uint64_t idx;
        if (op == 'h') {
          ASSIGN_OR_RETURN(uint8_t i1, Num<uint8_t>());
          idx = i1;
        } else if (op == 'j') {
          ASSIGN_OR_RETURN(uint32_t i4, Num<uint32_t>());
          idx = i4;
        } else {
          ASSIGN_OR_RETURN(std::string_view line, Line());
          idx = std::strtoull(std::string(line).c_str(), nullptr, 10);
        }
        ASSIGN_OR_RETURN(PyRef v, MemoGet(idx));
        RETURN_IF_ERROR(Push(v));
        break;
      }
      default: {
        char buf[8];
        std::snprintf(buf, sizeof(buf), "0x%02x", op);
        return Err(std::string("unsupported pickle opcode ") + buf);
      }
    }
  }
}

}  // namespace

std::string CanonicalModule(std::string_view module) {
  std::string m(module);
  if (m == "__builtin__") return "builtins";
  if (m == "copy_reg") return "copyreg";  // protocols 0 and 1 keep Python 2's module names
  if (m == "pathlib._local") return "pathlib";
  auto replace_prefix = [&](std::string_view from, std::string_view to) {
    if (StartsWith(m, from)) m = std::string(to) + m.substr(from.size());
  };
  replace_prefix("numpy.core", "numpy._core");
  replace_prefix("torch.distributed._shard.checkpoint", "torch.distributed.checkpoint");
  replace_prefix("torch.distributed._shard.sharded_tensor.metadata", "torch.distributed.checkpoint.metadata");
  return m;
}

const PyValue* PyValue::Get(std::string_view key) const {
  for (const auto& [k, v] : dict) {
    if (k && k->kind == PyKind::kStr && k->s == key) return v;
  }
  return nullptr;
}

const std::string& PyValue::name() const {
  static const std::string kNone;
  return ext ? ext->name : kNone;
}

const std::vector<PyRef>& PyValue::args() const {
  static const std::vector<PyRef> kNone;
  return ext ? ext->args : kNone;
}

const TensorRef& PyValue::tensor() const {
  static const TensorRef kNone;
  return ext && ext->parts ? ext->parts->tensor : kNone;
}

PyValue::Ext& PyValue::MutableExt() {
  if (!ext) ext = std::make_unique<Ext>();
  return *ext;
}

PyValue::TensorParts& PyValue::MutableParts() {
  if (!MutableExt().parts) ext->parts = std::make_unique<TensorParts>();
  return *ext->parts;
}

std::string_view PyValue::ClassName() const {
  if (kind == PyKind::kGlobal) return name();
  if (kind == PyKind::kObject && callable) {
    if (callable->kind == PyKind::kGlobal) return callable->name();
    return callable->ClassName();
  }
  return {};
}

const PyValue* PyValue::Attr(std::string_view key) const {
  if (kind != PyKind::kObject || !state) return nullptr;
  if (state->kind == PyKind::kDict) return state->Get(key);
  // (dict, slots) state pairs from __getstate__ of slotted classes.
  if (state->kind == PyKind::kTuple) {
    for (const auto& part : state->items) {
      if (part && part->kind == PyKind::kDict) {
        if (const PyValue* v = part->Get(key)) return v;
      }
    }
  }
  return nullptr;
}

Result<int64_t> AsInt(const PyValue* v, std::string_view what) {
  if (v == nullptr) return Invalid(std::string(what) + " is missing");
  if (v->kind == PyKind::kInt) return v->i;
  if (v->kind == PyKind::kBool) return v->b ? 1 : 0;
  return Invalid(std::string(what) + " is not an integer");
}

Result<int64_t> EnumValue(const PyValue* v, std::string_view what) {
  if (v == nullptr) return Invalid(std::string(what) + " is missing");
  // The VM's canonical enum member (the options' enums only): Cls(value),
  // Cls an allowed global (a placeholder never is).
  if (v->kind == PyKind::kObject && v->callable != nullptr && v->callable->kind == PyKind::kGlobal &&
      !v->callable->placeholder && v->args().size() == 1 && v->args()[0]->kind == PyKind::kInt) {
    return v->args()[0]->i;
  }
  if (v->kind == PyKind::kInt) return v->i;
  if (v->kind == PyKind::kObject && v->callable != nullptr && v->callable->kind == PyKind::kGlobal) {
    return Invalid(std::string(what) + " is " + v->callable->s + "." + v->callable->name() +
                   (v->callable->placeholder ? ", an enum ckptfs does not know" : ", not an enum member"));
  }
  return Invalid(std::string(what) + " is not an integer or enum member");
}

Result<std::vector<int64_t>> AsIntVector(const PyValue* v, std::string_view what) {
  if (v == nullptr) return Invalid(std::string(what) + " is missing");
  const PyValue* seq = v;
  // torch.Size that was not interpreted (e.g. via NEWOBJ) carries the tuple as arg 0.
  if (v->kind == PyKind::kObject && v->ClassName() == "Size" && !v->args().empty()) seq = v->args()[0];
  if (!seq->IsSeq()) return Invalid(std::string(what) + " is not a tuple");
  std::vector<int64_t> out;
  out.reserve(seq->items.size());
  for (const auto& it : seq->items) {
    ASSIGN_OR_RETURN(int64_t x, AsInt(it, what));
    out.push_back(x);
  }
  return out;
}

Result<PyHandle> Unpickle(std::string_view data, const std::string& what, const PickleOptions& opts,
                          std::vector<std::string>* placeholders) {
  Vm vm(Cursor{data}, what, opts);
  ASSIGN_OR_RETURN(PyRef root, vm.Run());
  if (placeholders != nullptr) *placeholders = vm.placeholders();
  return PyHandle(vm.arena(), root);  // aliasing: the handle owns the arena
}

Result<PyHandle> Unpickle(uint64_t size, const PickleRead& read, const std::string& what, const PickleOptions& opts,
                          std::vector<std::string>* placeholders) {
  Vm vm(Cursor{size, &read, opts.read_window}, what, opts);
  ASSIGN_OR_RETURN(PyRef root, vm.Run());
  if (placeholders != nullptr) *placeholders = vm.placeholders();
  return PyHandle(vm.arena(), root);
}

}  // namespace ckptfs::formats
