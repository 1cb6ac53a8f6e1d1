#include "formats/pickle.h"

#include <gtest/gtest.h>

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

TEST(PickleTest, Protocol2IntAndStop) {
  auto r = Unpickle(B({0x80, 0x02, 'K', 0x2A, '.'}), "t");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ((*r)->kind, PyKind::kInt);
  EXPECT_EQ((*r)->i, 42);
}

TEST(PickleTest, DictListTupleMemo) {
  // {'a': [1, 2], 'b': ('x', 'x')} with the second 'x' via BINGET.
  std::string p = B({0x80, 0x02, '}', 'q', 0, '(', 'X', 1, 0, 0, 0, 'a', ']', 'q', 1, '(', 'K', 1, 'K', 2, 'e',
                     'X', 1, 0, 0, 0, 'b', 'X', 1, 0, 0, 0, 'x', 'q', 2, 'h', 2, 0x86, 'u', '.'});
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
  std::string p = L("\x80\x02" "c_codecs\nencode\n" "X\x03\x00\x00\x00\xc3\xbf\x00" "X\x06\x00\x00\x00latin1" "\x86R.");
  auto r = Unpickle(p, "t");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ((*r)->kind, PyKind::kBytes);
  EXPECT_EQ((*r)->s, std::string("\xff\x00", 2));
}

TEST(PickleTest, UnknownGlobalIsRefusedByName) {
  std::string p = L("\x80\x02" "cos\nsystem\n" "X\x02\x00\x00\x00ls\x85R.");
  auto r = Unpickle(p, "evil.pkl");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("unknown pickle global os.system"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("evil.pkl"), std::string::npos);
}

TEST(PickleTest, ModuleRenamesAreCanonical) {
  EXPECT_EQ(CanonicalModule("torch.distributed._shard.checkpoint.metadata"), "torch.distributed.checkpoint.metadata");
  EXPECT_EQ(CanonicalModule("torch.distributed._shard.sharded_tensor.metadata"), "torch.distributed.checkpoint.metadata");
  EXPECT_EQ(CanonicalModule("__builtin__"), "builtins");
  EXPECT_EQ(CanonicalModule("numpy.core.multiarray"), "numpy._core.multiarray");
  EXPECT_EQ(CanonicalModule("pathlib._local"), "pathlib");
}

TEST(PickleTest, StackGlobalNewobjBuild) {
  // Protocol 4: torch.Size NEWOBJ-less dataclass: Metadata() with BUILD {'x': 1}.
  std::string p = "\x80\x04" "\x8c\x25torch.distributed.checkpoint.metadata" "\x8c\x08Metadata" "\x93)\x81"
                  "}\x8c\x01xK\x01s" "b.";
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

}  // namespace
}  // namespace ckptfs::formats
