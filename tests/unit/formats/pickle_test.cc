#include "formats/pickle.h"

#include <gtest/gtest.h>

#include <functional>

namespace ckptfs::formats {
namespace {

template <size_t N>
std::string L(const char (&lit)[N]) {
  return std::string(lit, N - 1);  // keeps embedded NULs
}

std::string B(std::initializer_list<int> v) {
  std::string s;
  for (int c : v) s.push_back(static_cast<char>(c));
  return s;
}

// `data` as a file the VM reads in windows of `window` bytes; records every read.
struct WindowedFile {
  WindowedFile(std::string d, uint64_t w) : data(std::move(d)), window(w) {}
  std::string data;
  uint64_t window;
  uint64_t fail_at = UINT64_MAX;  // reads that reach past this fail (a file that shrank)
  uint64_t bytes_read = 0, largest_read = 0, reads = 0;
  Result<PyHandle> Unpickle(PickleOptions o = {}) {
    o.read_window = window;
    read_ = [this](uint64_t off, char* dst, size_t len) -> Status {
      if (off + len > fail_at) return Invalid("cannot read f: file is truncated");
      data.copy(dst, len, off);
      bytes_read += len;
      largest_read = std::max<uint64_t>(largest_read, len);
      ++reads;
      return Status::Ok();
    };
    return formats::Unpickle(data.size(), read_, "f", o);
  }

 private:
  PickleRead read_;
};

TEST(PickleTest, Protocol2IntAndStop) {
  auto r = Unpickle(B({0x80, 0x02, 'K', 0x2A, '.'}), "t");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ((*r)->kind, PyKind::kInt);
  EXPECT_EQ((*r)->i, 42);
}

TEST(PickleTest, DictListTupleMemo) {
  // {'a': [1, 2], 'b': ('x', 'x')} with the second 'x' via BINGET.
  std::string p = B({0x80, 0x02, '}', 'q', 0, '(', 'X', 1,   0, 0, 0, 'a', ']', 'q', 1, '(', 'K', 1,    'K', 2,
                     'e',  'X',  1,   0,   0, 0,   'b', 'X', 1, 0, 0, 0,   'x', 'q', 2, 'h', 2,   0x86, 'u', '.'});
  auto r = Unpickle(p, "t");
  ASSERT_TRUE(r.ok()) << r.status().message();
  const PyValue* a = (*r)->Get("a");
  ASSERT_NE(a, nullptr);
  ASSERT_EQ(a->items.size(), 2u);
  EXPECT_EQ(a->items[1]->i, 2);
  const PyValue* b = (*r)->Get("b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->kind, PyKind::kTuple);
  EXPECT_EQ(b->items[1]->s, "x");
}

TEST(PickleTest, MemoScalesWithTheInput) {
  // [0, 1, ..., n-1] with every element memoized (MEMOIZE, protocol 4): more
  // memo entries than the old fixed cap of 2^20 (DCP .metadata of ~100k
  // tensors memoizes millions of objects), and the last one fetched back.
  constexpr int n = (1 << 20) + 1000;
  std::string p = B({0x80, 0x04, ']', 0x94});
  for (int i = 0; i < n; ++i) {
    if (i % 1000 == 0) p += i == 0 ? "(" : "e(";  // APPENDS in batches of 1000, as pickle.py writes
    p += B({'M', i & 0xff, (i >> 8) & 0xff});     // BININT2: i mod 65536
    p.push_back(static_cast<char>(0x94));
  }
  p += B({'e', 0x94});        // the last APPENDS; memoize the list once more
  p += B({'j', 1, 0, 0, 0});  // LONG_BINGET 1: the first element
  p += B({0x86, '.'});        // (list, first)
  auto r = Unpickle(p, "t");
  ASSERT_TRUE(r.ok()) << r.status().message();
  ASSERT_EQ((*r)->items.size(), 2u);
  EXPECT_EQ((*r)->items[0]->items.size(), static_cast<size_t>(n));
  EXPECT_EQ((*r)->items[1]->i, 0);
}

TEST(PickleTest, NegativeLong1AndBinFloat) {
  // LONG1 of -3 (one byte 0xfd), BINFLOAT 1.5 big-endian, in a tuple.
  std::string p = B({0x80, 0x02, 0x8a, 1, 0xfd, 'G', 0x3f, 0xf8, 0, 0, 0, 0, 0, 0, 0x86, '.'});
  auto r = Unpickle(p, "t");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ((*r)->items[0]->i, -3);
  EXPECT_DOUBLE_EQ((*r)->items[1]->f, 1.5);
}

TEST(PickleTest, CodecsEncodeGivesBytes) {
  // _codecs.encode(u'\u00ff\x00', 'latin1') as protocol 2 writes bytes.
  std::string p =
      L("\x80\x02"
        "c_codecs\nencode\n"
        "X\x03\x00\x00\x00\xc3\xbf\x00"
        "X\x06\x00\x00\x00latin1"
        "\x86R.");
  auto r = Unpickle(p, "t");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ((*r)->kind, PyKind::kBytes);
  EXPECT_EQ((*r)->s, std::string("\xff\x00", 2));
}

TEST(PickleTest, UnknownGlobalIsRefusedByName) {
  std::string p =
      L("\x80\x02"
        "cos\nsystem\n"
        "X\x02\x00\x00\x00ls\x85R.");
  auto r = Unpickle(p, "evil.pkl");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("unknown pickle global os.system"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("evil.pkl"), std::string::npos);
}

TEST(PickleTest, EnumMemberByNameAndByValueReadTheSame) {
  // CPython 3.11.2: getattr(ZeroStageEnum, 'gradients'); 3.11.7: ZeroStageEnum(2).
  // The enum is the reader's (PickleOptions::enums), not the VM's.
  PickleOptions with_enum;
  with_enum.extra_modules = {"deepspeed"};
  with_enum.enums = {{"deepspeed.runtime.zero.config", "ZeroStageEnum", {{"optimizer_states", 1}, {"gradients", 2}}}};
  std::string by_name =
      L("\x80\x02"
        "cbuiltins\ngetattr\n"
        "cdeepspeed.runtime.zero.config\nZeroStageEnum\n"
        "X\x09\x00\x00\x00gradients"
        "\x86R.");
  std::string by_value =
      L("\x80\x02"
        "cdeepspeed.runtime.zero.config\nZeroStageEnum\n"
        "K\x02\x85R.");
  for (const std::string& p : {by_name, by_value}) {
    auto r = Unpickle(p, "t", with_enum);
    ASSERT_TRUE(r.ok()) << r.status().message();
    EXPECT_EQ((*r)->ClassName(), "ZeroStageEnum");
    auto v = EnumValue(r->get(), "zero_stage");
    ASSERT_TRUE(v.ok()) << v.status().message();
    EXPECT_EQ(*v, 2);
  }
  // An unknown member or value is an error naming the enum.
  auto bad = Unpickle(L("\x80\x02"
                        "cbuiltins\ngetattr\n"
                        "cdeepspeed.runtime.zero.config\nZeroStageEnum\n"
                        "X\x04\x00\x00\x00huge"
                        "\x86R."),
                      "t", with_enum);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("unknown member 'huge'"), std::string::npos) << bad.status().message();
  auto bad_value = Unpickle(L("\x80\x02"
                              "cdeepspeed.runtime.zero.config\nZeroStageEnum\n"
                              "K\x09\x85R."),
                            "t", with_enum);
  ASSERT_FALSE(bad_value.ok());
  // Without the reader's enum the class is an allowed global like any other
  // (deepspeed's modules are allowed): no member names are resolved.
  PickleOptions no_enums;
  no_enums.extra_modules = {"deepspeed"};
  auto no_enum = Unpickle(by_value, "t", no_enums);
  ASSERT_TRUE(no_enum.ok()) << no_enum.status().message();
  EXPECT_EQ(*EnumValue(no_enum->get(), "zero_stage"), 2);  // Cls(2): the value is the argument
  auto by_name_unknown = Unpickle(by_name, "t", no_enums);
  EXPECT_FALSE(by_name_unknown.ok() && EnumValue(by_name_unknown->get(), "zero_stage").ok());
}

TEST(PickleTest, UnknownGlobalInMetadataIsAnInertPlaceholder) {
  // {'args': getattr(megatron.enums.PositionEmbeddingType, 'alibi')}: BLOOM's args.
  std::string p =
      L("\x80\x02"
        "}X\x04\x00\x00\x00"
        "args"
        "cbuiltins\ngetattr\n"
        "cmegatron.enums\nPositionEmbeddingType\n"
        "X\x05\x00\x00\x00"
        "alibi"
        "\x86R"
        "s.");
  std::vector<std::string> placeholders;
  auto r = Unpickle(p, "t", {}, &placeholders);
  ASSERT_TRUE(r.ok()) << r.status().message();
  const PyValue* a = (*r)->Get("args");
  ASSERT_NE(a, nullptr);
  ASSERT_EQ(a->kind, PyKind::kObject);  // the recorded call getattr(cls, 'alibi')
  ASSERT_EQ(a->args().size(), 2u);
  EXPECT_TRUE(a->args()[0]->placeholder);
  EXPECT_EQ(a->args()[0]->name(), "PositionEmbeddingType");
  EXPECT_EQ(a->args()[1]->s, "alibi");
  EXPECT_EQ(placeholders, std::vector<std::string>{"megatron.enums.PositionEmbeddingType"});
  auto v = EnumValue(a, "position_embedding_type");
  EXPECT_FALSE(v.ok());
  // Strict readers can still refuse them.
  PickleOptions strict;
  strict.placeholders = false;
  auto s = Unpickle(p, "t", strict);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("unknown pickle global megatron.enums.PositionEmbeddingType"), std::string::npos);
}

TEST(PickleTest, GlobalsThatDecideTensorBytesStayStrict) {
  // A rebuild function or a storage class from outside torch is refused by name.
  auto r = Unpickle(L("\x80\x02"
                      "cevil._utils\n_rebuild_tensor_v2\n"
                      "."),
                    "t");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("unknown pickle global evil._utils._rebuild_tensor_v2"), std::string::npos);
  auto st = Unpickle(L("\x80\x02"
                       "cevil\nFloatStorage\n"
                       "."),
                     "t");
  ASSERT_FALSE(st.ok());
  // Modules that are never data are refused even where placeholders are on.
  for (const char* m : {"subprocess\ncall\n", "builtins\neval\n", "sys\nexit\n"}) {
    auto x = Unpickle(L("\x80\x02"
                        "c") +
                          m + ".",
                      "t");
    EXPECT_FALSE(x.ok()) << m;
  }
}

TEST(PickleTest, ModuleRenamesAreCanonical) {
  EXPECT_EQ(CanonicalModule("torch.distributed._shard.checkpoint.metadata"), "torch.distributed.checkpoint.metadata");
  EXPECT_EQ(CanonicalModule("torch.distributed._shard.sharded_tensor.metadata"),
            "torch.distributed.checkpoint.metadata");
  EXPECT_EQ(CanonicalModule("__builtin__"), "builtins");
  EXPECT_EQ(CanonicalModule("numpy.core.multiarray"), "numpy._core.multiarray");
  EXPECT_EQ(CanonicalModule("pathlib._local"), "pathlib");
}

TEST(PickleTest, StackGlobalNewobjBuild) {
  // Protocol 4: torch.Size NEWOBJ-less dataclass: Metadata() with BUILD {'x': 1}.
  std::string p =
      "\x80\x04"
      "\x8c\x25torch.distributed.checkpoint.metadata"
      "\x8c\x08Metadata"
      "\x93)\x81"
      "}\x8c\x01xK\x01s"
      "b.";
  auto r = Unpickle(p, "t");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ((*r)->ClassName(), "Metadata");
  ASSERT_NE((*r)->Attr("x"), nullptr);
  EXPECT_EQ((*r)->Attr("x")->i, 1);
}

TEST(PickleTest, TruncatedAndGarbageAreErrors) {
  EXPECT_FALSE(Unpickle(B({0x80, 0x02, 'K'}), "t").ok());
  EXPECT_FALSE(Unpickle(B({0x80, 0x02}), "t").ok());
  EXPECT_FALSE(Unpickle("", "t").ok());
  EXPECT_FALSE(Unpickle(B({0x80, 0x02, 'X', 0xff, 0xff, 0xff, 0x7f, '.'}), "t").ok());
  EXPECT_FALSE(Unpickle(B({0x80, 0x02, 'h', 7, '.'}), "t").ok());  // memo miss
  EXPECT_FALSE(Unpickle(B({0x80, 0x02, 'a', '.'}), "t").ok());     // underflow
  EXPECT_FALSE(Unpickle(B({0x80, 0x02, 0xff, '.'}), "t").ok());    // bad opcode
}

// Memo indices far past the entries there are (LONG_BINPUT 4000000000, as a
// hostile or odd pickler may write) are kept apart from the dense ones: read
// back correctly, streaming or not, next to small indices and a PUT that
// reuses an index.
TEST(PickleTest, FarMemoIndicesAreReadBack) {
  // [s, s, t, u] with s = 'a' at memo 4000000000 (LONG_BINPUT, LONG_BINGET),
  // t = 'b' PUT at 1, then 'c' PUT at 1 too, popped, and memo 1 read back:
  // u is 'c' (the later PUT wins).
  const std::string p =
      B({0x80, 0x02, ']', '(', 'X', 1,   0, 0,   0, 'a', 'r', 0x00, 0x28, 0x6b, 0xee, 'j', 0x00, 0x28, 0x6b, 0xee, 'X',
         1,    0,    0,   0,   'b', 'q', 1, 'X', 1, 0,   0,   0,    'c',  'q',  1,    '0', 'h',  1,    'e',  '.'});
  for (bool streaming : {false, true}) {
    PickleOptions opts;
    if (streaming) opts.consume_item = [](const PyValue&, const PyValue&) -> Result<bool> { return false; };
    auto r = Unpickle(p, "t", opts);
    ASSERT_TRUE(r.ok()) << r.status().message();
    const PyValue& l = **r;
    ASSERT_EQ(l.kind, PyKind::kList);
    ASSERT_EQ(l.items.size(), 4u) << streaming;
    EXPECT_EQ(l.items[0]->s, "a");
    EXPECT_EQ(l.items[1]->s, "a");
    EXPECT_EQ(l.items[2]->s, "b");
    EXPECT_EQ(l.items[3]->s, "c");
  }
}

TEST(PickleTest, SelfReferenceDoesNotLeak) {
  // l = []; l.append(l) -- a memo cycle; found by fuzz_pickle as a leak when
  // values owned each other. The ASan build of this test checks for leaks.
  auto r = Unpickle(B({0x80, 0x02, ']', 'q', 0, 'h', 0, 'a', '.'}), "t");
  ASSERT_TRUE(r.ok()) << r.status().message();
  ASSERT_EQ((*r)->items.size(), 1u);
  EXPECT_EQ((*r)->items[0], r->get());
}

TEST(PickleTest, DeepNestingIsBounded) {
  std::string p = "\x80\x02";
  for (int i = 0; i < 2000; ++i) p += "]";
  for (int i = 0; i < 1999; ++i) p += "a";
  p += ".";
  auto r = Unpickle(p, "t");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("nested deeper"), std::string::npos);
}

// Streaming: a consumer that takes entries whose key starts with 'k'.
struct Taker {
  std::vector<std::string> taken;
  PickleOptions Options() {
    PickleOptions o;
    o.consume = [this](const PyValue&, const PyValue& k, const PyValue& v) -> Result<bool> {
      if (!k.IsStr() || k.s.empty() || k.s[0] != 'k') return false;
      std::string what = k.s + "=";
      if (v.kind == PyKind::kList) {
        for (const auto& it : v.items) what += std::to_string(it->i) + ",";
      }
      taken.push_back(what);
      return true;
    };
    return o;
  }
};

TEST(PickleTest, StreamingTakesEntriesAndKeepsWhatTheMemoShares) {
  // Protocol 4: {'k1': L, 'good': L, 'k2': [3]} where L = [1, 2] is memoized
  // and read back by BINGET: taking 'k1' must not free what 'good' holds.
  std::string p =
      B({0x80, 0x04, '}', 0x94, '(',  0x8c, 2, 'k',  '1', 0x94, ']', 0x94, '(', 'K',  1,   'K', 2,   'e', 0x8c, 4,
         'g',  'o',  'o', 'd',  0x94, 'h',  2, 0x8c, 2,   'k',  '2', 0x94, ']', 0x94, 'K', 3,   'a', 'u', '.'});
  Taker t;
  auto r = Unpickle(p, "t", t.Options());
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(t.taken, (std::vector<std::string>{"k1=1,2,", "k2=3,"}));
  ASSERT_EQ((*r)->dict.size(), 1u);
  const PyValue* keep = (*r)->Get("good");
  ASSERT_NE(keep, nullptr);
  ASSERT_EQ(keep->items.size(), 2u);
  EXPECT_EQ(keep->items[0]->i, 1);
  EXPECT_EQ(keep->items[1]->i, 2);
}

TEST(PickleTest, StreamingKeepsADuplicatedValue) {
  // {'k': L, L: 'b'} with L DUP'd inside the SETITEMS batch (a crafted file:
  // a list as a key). The ASan build checks that nothing freed is read.
  std::string p = B({0x80, 0x04, '}', '(', 0x8c, 1, 'k', ']', 'K', 7, 'a', '2', 0x8c, 1, 'b', 'u', '.'});
  Taker t;
  auto r = Unpickle(p, "t", t.Options());
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(t.taken, (std::vector<std::string>{"k=7,"}));
  ASSERT_EQ((*r)->dict.size(), 1u);
  const PyValue* key = (*r)->dict[0].first;
  ASSERT_EQ(key->kind, PyKind::kList);
  ASSERT_EQ(key->items.size(), 1u);
  EXPECT_EQ(key->items[0]->i, 7);
}

// Checks the streamed 'k'/'g'/'h' pickle below, read by `unpickle`.
void CheckCollects(const std::function<Result<PyHandle>(const std::string&, const PickleOptions&)>& unpickle) {
  // Protocol 4, as CPython writes a large dict, in SETITEMS batches of 1000:
  // {'k<i>': [i, i+1]} for 80,000 entries, every list memoized and read back
  // later, by a kept entry 'g<i>' (the list stays in the tree) or by a taken
  // entry 'kz<i>' (its last read: the memo lets go, and only the VM's
  // mark-and-sweep can take the list back); then 150,000 kept entries
  // 'h<i>': 'v<i>' grow the live nodes past the next sweep, which reuses the
  // released lists' nodes. ASan checks nothing freed is read, and the values
  // say nothing was reused under a live reference.
  constexpr int kN = 80000, kH = 150000;
  auto str = [](const std::string& v) {
    return std::string(1, static_cast<char>(0x8c)) + static_cast<char>(v.size()) + v;
  };
  auto u32 = [](uint32_t v) {
    std::string o;
    for (int i = 0; i < 4; ++i) o.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
    return o;
  };
  auto binint = [&](uint32_t v) { return "J" + u32(v); };
  auto get = [&](uint32_t idx) { return "j" + u32(idx); };
  const std::string memo(1, static_cast<char>(0x94));
  std::string p = "\x80\x04}" + memo;  // memo 0: the dict
  auto batch = [&](int n, const std::function<void(int)>& entry) {
    for (int i = 0; i < n; ++i) {
      if (i % 1000 == 0) p += "(";
      entry(i);
      if (i % 1000 == 999 || i == n - 1) p += "u";
    }
  };
  batch(kN, [&](int i) {  // the list of entry i is memo 2i+2
    p += str("k" + std::to_string(i)) + memo + "]" + memo + "(" + binint(i) + binint(i + 1) + "e";
  });
  batch(kN, [&](int i) { p += str((i % 997 == 0 ? "g" : "kz") + std::to_string(i)) + get(2 * i + 2); });
  batch(kH, [&](int i) { p += str("h" + std::to_string(i)) + str("v" + std::to_string(i)); });
  p += ".";
  Taker t;
  auto r = unpickle(p, t.Options());
  ASSERT_TRUE(r.ok()) << r.status().message();
  const auto& d = (*r)->dict;  // in insertion order: the g entries, then the h
  size_t kept = 0;
  for (int i = 0; i < kN; i += 997, ++kept) {
    ASSERT_LT(kept, d.size());
    ASSERT_EQ(d[kept].first->s, "g" + std::to_string(i));
    const PyValue* v = d[kept].second;
    ASSERT_EQ(v->kind, PyKind::kList) << i;
    ASSERT_EQ(v->items.size(), 2u) << i;
    EXPECT_EQ(v->items[0]->i, i);
    EXPECT_EQ(v->items[1]->i, i + 1);
  }
  ASSERT_EQ(d.size(), kept + kH);
  for (int i = 0; i < kH; ++i) {
    ASSERT_EQ(d[kept + i].first->s, "h" + std::to_string(i));
    ASSERT_EQ(d[kept + i].second->s, "v" + std::to_string(i));
  }
  ASSERT_EQ(t.taken.size(), 2 * static_cast<size_t>(kN) - kept);
  for (size_t j = kN, i = 1; i < kN; ++i) {
    if (i % 997 == 0) continue;
    ASSERT_EQ(t.taken[j++], "kz" + std::to_string(i) + "=" + std::to_string(i) + "," + std::to_string(i + 1) + ",");
  }
}

TEST(PickleTest, StreamingCollectsWhatNothingReachesAndKeepsWhatTheTreeHolds) {
  CheckCollects([](const std::string& p, const PickleOptions& o) { return Unpickle(p, "t", o); });
}

TEST(PickleTest, AFileReadInWindowsStreamsTheSameAndIsNeverHeldWhole) {
  // The same 4 MiB pickle as a file read in 4 KiB windows: the same entries
  // are taken and kept; each pass reads a byte at most once, in window-sized reads.
  uint64_t size = 0, read = 0, largest = 0;
  CheckCollects([&](const std::string& p, const PickleOptions& o) {
    WindowedFile f{p, 4096};
    auto r = f.Unpickle(o);
    size = p.size();
    read = f.bytes_read;
    largest = f.largest_read;
    return r;
  });
  EXPECT_GT(size, 4u << 20);
  EXPECT_GT(read, size);      // the memo scan (which skips what it need not see),
  EXPECT_LE(read, 2 * size);  // then the VM
  EXPECT_EQ(largest, 4096u);
}

TEST(PickleTest, ArgumentsAndLinesAcrossWindowsReadTheSame) {
  // Protocol 0 text lines (GLOBAL's two lines, INT, UNICODE), a 10 kB string
  // and a memo read back, at every window size from 1 byte.
  const std::string big(10000, 'z');
  std::string p = "(ccollections\nOrderedDict\np0\n(tRp1\nI12345\nVh\\u00e9llo\np2\n";
  p += "S'" + big + "'\np3\ng2\ntp4\n.";
  auto whole = Unpickle(p, "t");
  ASSERT_TRUE(whole.ok()) << whole.status().message();
  ASSERT_EQ((*whole)->items.size(), 5u);
  for (uint64_t w : {1, 2, 3, 7, 64, 4096, 1 << 20}) {
    WindowedFile f{p, w};
    auto r = f.Unpickle();
    ASSERT_TRUE(r.ok()) << w << ": " << r.status().message();
    ASSERT_EQ((*r)->items.size(), 5u) << w;
    EXPECT_EQ((*r)->items[0]->kind, PyKind::kDict) << w;
    EXPECT_EQ((*r)->items[1]->i, 12345) << w;
    EXPECT_EQ((*r)->items[2]->s, "h\xc3\xa9llo") << w;
    EXPECT_EQ((*r)->items[3]->s, big) << w;
    EXPECT_EQ((*r)->items[4]->s, (*r)->items[2]->s) << w;
  }
}

TEST(PickleTest, AFileThatIsShortOrShrinksIsAnErrorNamingIt) {
  const std::string p = B({0x80, 0x02, 'X', 20, 0, 0, 0}) + std::string(20, 'a') + ".";
  WindowedFile shrank{p, 4};
  shrank.fail_at = 12;
  auto r = shrank.Unpickle();
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("cannot unpickle f: cannot read f: file is truncated (at byte 2)"),
            std::string::npos)
      << r.status().message();
  WindowedFile cut{p.substr(0, 10), 4};
  r = cut.Unpickle();
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("truncated: wanted 20 more bytes"), std::string::npos) << r.status().message();
  WindowedFile no_newline{"I123", 2};
  r = no_newline.Unpickle();
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("truncated text argument"), std::string::npos) << r.status().message();
}

TEST(PickleTest, StreamingTakesListItems) {
  // Protocol 4: [[1], [2], [3], 'x'] built by APPENDS; the consumer takes the
  // lists holding an odd int. The second list is memoized and read back
  // into the dict after it: taking it must not free it.
  std::string p = B({0x80, 0x04, '}', 0x8c, 1,    'l', ']', '(', ']', 'K',  1, 'a', ']', 0x94, 'K', 2,  'a',
                     ']',  'K',  3,   'a',  0x8c, 1,   'x', 'e', 's', 0x8c, 1, 'r', 'h', 0,    's', '.'});
  std::vector<int64_t> taken;
  PickleOptions o;
  o.consume_item = [&](const PyValue&, const PyValue& v) -> Result<bool> {
    if (v.kind != PyKind::kList || v.items.size() != 1 || v.items[0]->i == 2) return false;
    taken.push_back(v.items[0]->i);
    return true;
  };
  auto r = Unpickle(p, "t", o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(taken, (std::vector<int64_t>{1, 3}));
  const PyValue* l = (*r)->Get("l");
  ASSERT_NE(l, nullptr);
  ASSERT_EQ(l->items.size(), 2u);
  EXPECT_EQ(l->items[0]->items[0]->i, 2);
  EXPECT_EQ(l->items[1]->s, "x");
  const PyValue* again = (*r)->Get("r");
  ASSERT_NE(again, nullptr);
  EXPECT_EQ(again, l->items[0]);
}

TEST(PickleTest, StreamingReleasesOnlyArgumentTuplesNothingElseHolds) {
  // Protocol 4: [Namespace(*t), 'x', 'y', Namespace(*t), t, Namespace(*(3,)), 'z']
  // with t = (1, 2) memoized and read back twice: t must survive both NEWOBJs
  // (the strings after each reuse what was released), while (3,) is released.
  std::string p = B({0x80, 0x04, ']', '(', 'c'}) + "argparse\nNamespace\n" +
                  B({0x94, 'K', 1,    'K', 2, 0x86, 0x94, 0x81, 0x8c, 1,    'x',  0x8c, 1, 'y', 'h', 0,
                     'h',  1,   0x81, 'h', 1, 'h',  0,    'K',  3,    0x85, 0x81, 0x8c, 1, 'z', 'e', '.'});
  PickleOptions o;
  o.consume_item = [](const PyValue&, const PyValue&) -> Result<bool> { return false; };
  auto r = Unpickle(p, "t", o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  const auto& l = (*r)->items;
  ASSERT_EQ(l.size(), 7u);
  for (size_t k : {0, 3}) {
    ASSERT_EQ(l[k]->ClassName(), "Namespace") << k;
    ASSERT_EQ(l[k]->args().size(), 2u) << k;
    EXPECT_EQ(l[k]->args()[0]->i, 1);
    EXPECT_EQ(l[k]->args()[1]->i, 2);
  }
  EXPECT_EQ(l[1]->s, "x");
  EXPECT_EQ(l[2]->s, "y");
  ASSERT_EQ(l[4]->kind, PyKind::kTuple);
  ASSERT_EQ(l[4]->items.size(), 2u);
  EXPECT_EQ(l[4]->items[1]->i, 2);
  ASSERT_EQ(l[5]->args().size(), 1u);
  EXPECT_EQ(l[5]->args()[0]->i, 3);
  EXPECT_EQ(l[6]->s, "z");
}

TEST(PickleTest, StreamingConsumerErrorStopsTheUnpickling) {
  PickleOptions o;
  o.consume = [](const PyValue&, const PyValue&, const PyValue&) -> Result<bool> {
    return Invalid("cannot parse x: refused");
  };
  auto r = Unpickle(B({0x80, 0x04, '}', 0x8c, 1, 'k', 'K', 1, 's', '.'}), "t", o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "cannot parse x: refused");
}

}  // namespace
}  // namespace ckptfs::formats
