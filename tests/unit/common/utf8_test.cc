#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "ckptfs/common.h"
#include "common/json_text.h"

namespace ckptfs {
namespace {

TEST(Utf8Test, ValidSequencesPassUnchanged) {
  for (std::string s : {"", "layers.0.weight", "\xC3\xA9", "\xE2\x82\xAC", "\xF0\x9F\x98\x80", "\xF4\x8F\xBF\xBF"}) {
    EXPECT_TRUE(IsUtf8(s)) << s;
    EXPECT_EQ(EscapeNonUtf8(s), s);
  }
}

TEST(Utf8Test, InvalidBytesAreEscapedOneByOne) {
  // A lone surrogate (pickle's surrogatepass), an overlong '/', a stray
  // continuation byte, a truncated sequence, a code point above U+10FFFF.
  EXPECT_EQ(EscapeNonUtf8("w\xED\xB3\xBF.weight"), "w%ED%B3%BF.weight");
  EXPECT_EQ(EscapeNonUtf8("\xC0\xAF"), "%C0%AF");
  EXPECT_EQ(EscapeNonUtf8("a\x80z"), "a%80z");
  EXPECT_EQ(EscapeNonUtf8("\xE2\x82"), "%E2%82");
  EXPECT_EQ(EscapeNonUtf8("\xF4\x90\x80\x80"), "%F4%90%80%80");
  EXPECT_EQ(EscapeNonUtf8("ok\xC3\xA9\xFF"), "ok\xC3\xA9%FF");
  for (int b = 0; b < 256; ++b) {
    std::string s(1, static_cast<char>(b));
    EXPECT_TRUE(IsUtf8(EscapeNonUtf8(s)));
  }
}

TEST(Utf8Test, JsonOfAnyBytesIsValidAndNeverThrows) {
  std::string name = "bad\xFF\xFEname";
  EXPECT_EQ(JsonEscape(name), "\"bad%FF%FEname\"");
  nlohmann::json j = {{"name", name}};
  std::string text;
  ASSERT_NO_THROW(text = JsonText(j));
  EXPECT_FALSE(nlohmann::json::parse(text, nullptr, false).is_discarded());
}

}  // namespace
}  // namespace ckptfs
