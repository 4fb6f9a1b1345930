// XXH64 against reference digests (computed with the reference xxHash library through Python's
// `xxhash` package) and ATOM's chained block hash against its published vectors.
#include "atom_sched/xxhash64.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <span>
#include <string_view>
#include <vector>

namespace atom_sched {
namespace {

constexpr uint64_t kBigSeed = 0x9E3779B185EBCA8DULL;

// Deterministic test input shared with the Python script that produced the expected digests:
// byte i = ((i * 131 + 7) >> 1) & 0xff.
std::vector<unsigned char> pattern(size_t n) {
  std::vector<unsigned char> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<unsigned char>(((i * 131 + 7) >> 1) & 0xff);
  return v;
}

struct Vector {
  size_t len;
  uint64_t seed0;
  uint64_t big_seed;
};

// Lengths straddle every branch: <4, <8, <32 (tail only), exactly one stripe, stripes + tails.
constexpr std::array<Vector, 15> kPatternVectors = {{
    {1, 0x1f25c8d0bc1f4bb6ULL, 0x4e38da78585833ffULL},
    {3, 0xfae6158de2e681c8ULL, 0xb5f6c7ed437da4a3ULL},
    {4, 0x62917774d28ea099ULL, 0xc5a372133cb178c0ULL},
    {7, 0x2e36725b00842ee2ULL, 0x9b0167a8931e26a0ULL},
    {8, 0xd8a37a7456ca36fdULL, 0x2c121a226db0bedcULL},
    {9, 0x9207e4b23a4c7398ULL, 0x0aa8768eff8a6938ULL},
    {12, 0xb2ecb4dd7808c6d5ULL, 0x4bc59292b0f790eaULL},
    {31, 0xcec8c2be9bd26a69ULL, 0x3bd5b0bb456b6048ULL},
    {32, 0xb69064153d4851a5ULL, 0x2b562e72e205aea6ULL},
    {33, 0x732da22315773994ULL, 0x59eeea457a19b5aeULL},
    {63, 0x4a1b11c93a45e7eeULL, 0xbe65f82c0baae571ULL},
    {64, 0x7f35aafc3388c0b8ULL, 0xfdc34e31925bf1ecULL},
    {65, 0xc5d65a67e0d689faULL, 0x1ed14f584f97ba3cULL},
    {100, 0x1c0c2332e8ff479aULL, 0x47abf3bfc8c5b145ULL},
    {1000, 0xc7227a16ad9064c5ULL, 0x5c91b134e1799233ULL},
}};

uint64_t hash_str(std::string_view s, uint64_t seed = 0) {
  return xxhash64(s.data(), s.size(), seed);
}

// The byte encoding ATOM hashes, built explicitly: parent (u64 LE) then tokens as int64 LE.
std::vector<unsigned char> block_bytes(const std::vector<int32_t>& tokens,
                                       std::optional<uint64_t> parent) {
  std::vector<unsigned char> out;
  auto put = [&out](uint64_t v) {
    for (int b = 0; b < 8; ++b) out.push_back(static_cast<unsigned char>(v >> (8 * b)));
  };
  if (parent) put(*parent);
  for (int32_t t : tokens) put(static_cast<uint64_t>(static_cast<int64_t>(t)));
  return out;
}

TEST(Xxhash64Test, EmptyInput) {
  EXPECT_EQ(xxhash64(nullptr, 0), 0xEF46DB3751D8E999ULL);
  EXPECT_EQ(xxhash64("", 0, 0), 0xEF46DB3751D8E999ULL);
  EXPECT_EQ(xxhash64(nullptr, 0, 1), 0xD5AFBA1336A3BE4BULL);
  EXPECT_EQ(xxhash64(nullptr, 0, kBigSeed), 0x0B303D920EC349DFULL);
}

TEST(Xxhash64Test, ShortStrings) {
  EXPECT_EQ(hash_str("a"), 0xD24EC4F1A98C6E5BULL);
  EXPECT_EQ(hash_str("abc"), 0x44BC2CF5AD770999ULL);
  EXPECT_EQ(hash_str("message digest"), 0x066ED728FCEEB3BEULL);
  EXPECT_EQ(hash_str("abcdefghijklmnopqrstuvwxyz"), 0xCFE1F278FA89835CULL);
  EXPECT_EQ(hash_str("a", 1), 0xDEC2BC81C3CD46C6ULL);
  EXPECT_EQ(hash_str("abc", kBigSeed), 0x7E49C9D7E85A4AB6ULL);
  EXPECT_EQ(hash_str("abcdefghijklmnopqrstuvwxyz", 1), 0x58058C6EC112E95EULL);
}

TEST(Xxhash64Test, AllByteValuesTwice) {
  std::vector<unsigned char> data(512);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(i & 0xff);
  EXPECT_EQ(xxhash64(data.data(), data.size()), 0x7B3BFCAAC0348AC0ULL);
  EXPECT_EQ(xxhash64(data.data(), data.size(), 1), 0x9430A93ACE18B966ULL);
  EXPECT_EQ(xxhash64(data.data(), data.size(), kBigSeed), 0x0E538456738C9DECULL);
}

TEST(Xxhash64Test, PatternVectorsAcrossLengthBranches) {
  for (const Vector& v : kPatternVectors) {
    const auto data = pattern(v.len);
    EXPECT_EQ(xxhash64(data.data(), data.size(), 0), v.seed0) << "len " << v.len;
    EXPECT_EQ(xxhash64(data.data(), data.size(), kBigSeed), v.big_seed) << "len " << v.len;
  }
}

TEST(Xxhash64Test, UnalignedInputGivesSameDigest) {
  const auto data = pattern(100);
  std::vector<unsigned char> shifted(data.size() + 3);
  std::memcpy(shifted.data() + 3, data.data(), data.size());
  EXPECT_EQ(xxhash64(shifted.data() + 3, data.size()), 0x1c0c2332e8ff479aULL);
}

TEST(Xxhash64Test, StreamingMatchesOneShotForEverySplit) {
  const auto data = pattern(200);
  for (size_t len : {0, 1, 5, 31, 32, 33, 64, 97, 200}) {
    const uint64_t want = xxhash64(data.data(), len, kBigSeed);
    for (size_t split = 0; split <= len; ++split) {
      Xxhash64State st(kBigSeed);
      st.update(data.data(), split);
      st.update(data.data() + split, len - split);
      ASSERT_EQ(st.digest(), want) << "len " << len << " split " << split;
    }
  }
}

TEST(Xxhash64Test, StreamingByteAtATimeAndReset) {
  const auto data = pattern(1000);
  Xxhash64State st(123);
  st.update(data.data(), 10);
  st.reset(0);  // must discard the ten bytes and the seed
  for (unsigned char c : data) st.update(&c, 1);
  EXPECT_EQ(st.digest(), 0xc7227a16ad9064c5ULL);
  EXPECT_EQ(st.digest(), 0xc7227a16ad9064c5ULL);  // digest() does not consume the state
  st.update(nullptr, 0);
  EXPECT_EQ(st.digest(), 0xc7227a16ad9064c5ULL);
}

TEST(Xxhash64Test, StreamingRandomChunks) {
  std::mt19937_64 rng(7);
  const auto data = pattern(4096);
  for (int trial = 0; trial < 50; ++trial) {
    const size_t len = rng() % data.size();
    const uint64_t seed = rng();
    Xxhash64State st(seed);
    for (size_t pos = 0; pos < len;) {
      const size_t chunk = std::min<size_t>(len - pos, rng() % 80);
      st.update(data.data() + pos, chunk);
      pos += chunk;
    }
    ASSERT_EQ(st.digest(), xxhash64(data.data(), len, seed)) << "trial " << trial;
  }
}

TEST(Xxhash64Test, BlockHashAtomVectors) {
  const std::vector<int32_t> a = {1, 2, 3, 4};
  const std::vector<int32_t> b = {5, 6, 7, 8};
  const uint64_t h0 = block_hash(a, std::nullopt);
  EXPECT_EQ(h0, 8356527653647720045ULL);
  EXPECT_EQ(h0, 0x73f859a04f669e6dULL);
  EXPECT_EQ(block_hash(b, h0), 610383040053763902ULL);
  EXPECT_EQ(block_hash(a, 42), 3613909605708555987ULL);
}

TEST(Xxhash64Test, BlockHashParentZeroDiffersFromNoParent) {
  const std::vector<int32_t> a = {1, 2, 3, 4};
  EXPECT_NE(block_hash(a, 0), block_hash(a, std::nullopt));
  EXPECT_EQ(block_hash({}, std::nullopt), 0xEF46DB3751D8E999ULL);  // nothing fed at all
}

TEST(Xxhash64Test, BlockHashMatchesExplicitByteEncoding) {
  std::mt19937_64 rng(11);
  for (size_t n = 0; n <= 70; ++n) {
    std::vector<int32_t> tokens(n);
    for (auto& t : tokens) t = static_cast<int32_t>(rng());  // negatives test sign extension
    const uint64_t parent = rng();
    for (std::optional<uint64_t> p : {std::optional<uint64_t>{}, std::optional<uint64_t>{parent}}) {
      const auto bytes = block_bytes(tokens, p);
      ASSERT_EQ(block_hash(tokens, p), xxhash64(bytes.data(), bytes.size()))
          << "n " << n << " parent " << p.has_value();
    }
  }
}

TEST(Xxhash64Test, BlockHashChainOverBlocks) {
  // Block i's hash is seeded by block i-1's: hashing a 3-block sequence block by block.
  std::vector<int32_t> seq(48);
  for (size_t i = 0; i < seq.size(); ++i) seq[i] = static_cast<int32_t>(i * 1000 + 17);
  std::span<const int32_t> all(seq);
  std::optional<uint64_t> parent;
  for (size_t blk = 0; blk < 3; ++blk) {
    const auto tokens = all.subspan(blk * 16, 16);
    const uint64_t h = block_hash(tokens, parent);
    const auto bytes = block_bytes({tokens.begin(), tokens.end()}, parent);
    EXPECT_EQ(h, xxhash64(bytes.data(), bytes.size()));
    parent = h;
  }
}

TEST(Xxhash64Test, BlockHashesMatchOneByOne) {
  // The batch (eight blocks a vector where the CPU has AVX-512DQ, the last group padded) against
  // block_hash() block by block: every count around the group size, block sizes below, at and
  // past one stripe, negative tokens (sign-extended lanes) and parents with the top bit set.
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<int32_t> token(-5, 1 << 30);
  for (size_t bs : {1, 3, 4, 16, 32}) {
    for (size_t count = 0; count <= 19; ++count) {
      std::vector<std::vector<int32_t>> blocks(count, std::vector<int32_t>(bs));
      std::vector<const int32_t*> tokens(count);
      std::vector<uint64_t> parents(count), out(count + 1, 0xABCD);
      for (size_t i = 0; i < count; ++i) {
        for (auto& t : blocks[i]) t = token(rng);
        tokens[i] = blocks[i].data();
        parents[i] = rng();
      }
      block_hashes(tokens.data(), parents.data(), count, bs, out.data());
      for (size_t i = 0; i < count; ++i)
        EXPECT_EQ(out[i], block_hash(blocks[i], parents[i])) << "bs " << bs << " block " << i;
      EXPECT_EQ(out[count], 0xABCDu) << "wrote past the last block (bs " << bs << ")";
    }
  }
}

}  // namespace
}  // namespace atom_sched
