#include <gtest/gtest.h>

#include "loom/data.h"

namespace loom {
namespace {

TEST(Utf8, AcceptsWellFormedText) {
  EXPECT_FALSE(invalid_utf8_offset(""));
  EXPECT_FALSE(invalid_utf8_offset("plain ASCII\n\twith controls\x01"));
  EXPECT_FALSE(invalid_utf8_offset("caf\xC3\xA9 \xE6\x97\xA5\xE6\x9C\xAC \xF0\x9F\x98\x80 \xF4\x8F\xBF\xBF"));
  EXPECT_FALSE(invalid_utf8_offset(std::string_view("nul\0inside", 10)));
}

TEST(Utf8, ReportsTheOffsetOfTheFirstMalformedSequence) {
  EXPECT_EQ(invalid_utf8_offset("ab\xFF"), 2u);            // never a lead byte
  EXPECT_EQ(invalid_utf8_offset("ab\x80"), 2u);            // lone continuation
  EXPECT_EQ(invalid_utf8_offset("\xC3\xA9x\xC3"), 3u);     // truncated at the end
  EXPECT_EQ(invalid_utf8_offset("a\xC3(b"), 1u);           // bad continuation
  EXPECT_EQ(invalid_utf8_offset("\xC0\xAF"), 0u);          // overlong '/'
  EXPECT_EQ(invalid_utf8_offset("\xE0\x80\xAF"), 0u);      // overlong, 3 bytes
  EXPECT_EQ(invalid_utf8_offset("xy\xED\xA0\x80"), 2u);    // UTF-16 surrogate
  EXPECT_EQ(invalid_utf8_offset("\xF4\x90\x80\x80"), 0u);  // above U+10FFFF
  EXPECT_EQ(invalid_utf8_offset("ok\xF0\x9F\x98"), 2u);    // truncated 4-byte
}

TEST(Utf8, CountsCodePoints) {
  EXPECT_EQ(count_utf8_chars(""), 0);
  EXPECT_EQ(count_utf8_chars("abc\n"), 4);
  EXPECT_EQ(count_utf8_chars("caf\xC3\xA9 \xE6\x97\xA5 \xF0\x9F\x98\x80"), 8);
}

}  // namespace
}  // namespace loom
