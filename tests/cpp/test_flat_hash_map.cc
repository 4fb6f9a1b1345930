// FlatHashMap: the prefix cache's fixed-capacity open-addressing map (linear probing,
// backward-shift deletion). Collisions are forced by brute-forcing keys whose home slot
// ((key * 0x9E3779B97F4A7C15) >> 17) & mask is chosen, so probe chains, chain wrap-around at the
// end of the table and deletions in the middle of chains are all exercised.

#include "atom_sched/flat_hash_map.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <random>
#include <unordered_map>
#include <vector>

namespace atom_sched {
namespace {

// For FlatHashMap(8): capacity 16 (the minimum), so mask 15.
constexpr uint64_t kMask16 = 15;

uint64_t Home(uint64_t key, uint64_t mask) { return ((key * 0x9E3779B97F4A7C15ull) >> 17) & mask; }

// The first `n` keys >= `start` whose home slot is `home` under `mask`.
std::vector<uint64_t> KeysWithHome(uint64_t home, uint64_t mask, int n, uint64_t start = 1) {
  std::vector<uint64_t> keys;
  for (uint64_t k = start; static_cast<int>(keys.size()) < n; ++k) {
    if (Home(k, mask) == home) keys.push_back(k);
  }
  return keys;
}

std::map<uint64_t, int32_t> Contents(const FlatHashMap& m) {
  std::map<uint64_t, int32_t> out;
  m.for_each([&](uint64_t k, int32_t v) {
    EXPECT_TRUE(out.emplace(k, v).second) << "key " << k << " visited twice";
  });
  return out;
}

TEST(FlatHashMapTest, EmptyMapFindsNothing) {
  FlatHashMap m(8);
  EXPECT_EQ(m.size(), 0);
  EXPECT_EQ(m.find(0), -1);
  EXPECT_EQ(m.find(1), -1);
  EXPECT_EQ(m.find(~0ull), -1);
  EXPECT_TRUE(Contents(m).empty());
}

TEST(FlatHashMapTest, InsertFindOverwriteErase) {
  FlatHashMap m(8);
  m.insert(42, 7);
  m.insert(0, 3);  // key 0 is an ordinary key (emptiness is marked by the value)
  m.insert(~0ull, 0);
  EXPECT_EQ(m.size(), 3);
  EXPECT_EQ(m.find(42), 7);
  EXPECT_EQ(m.find(0), 3);
  EXPECT_EQ(m.find(~0ull), 0);
  EXPECT_EQ(m.find(43), -1);

  m.insert(42, 9);  // overwrite: size unchanged
  EXPECT_EQ(m.size(), 3);
  EXPECT_EQ(m.find(42), 9);

  m.erase(42);
  EXPECT_EQ(m.size(), 2);
  EXPECT_EQ(m.find(42), -1);
  EXPECT_EQ(m.find(0), 3);
  EXPECT_EQ(m.find(~0ull), 0);

  m.erase(42);  // absent: no-op
  m.erase(12345);
  EXPECT_EQ(m.size(), 2);

  EXPECT_EQ(Contents(m), (std::map<uint64_t, int32_t>{{0, 3}, {~0ull, 0}}));

  m.clear();
  EXPECT_EQ(m.size(), 0);
  EXPECT_EQ(m.find(0), -1);
  EXPECT_EQ(m.find(~0ull), -1);
  m.insert(5, 1);
  EXPECT_EQ(m.find(5), 1);
  EXPECT_EQ(m.size(), 1);
}

TEST(FlatHashMapTest, FillsToMaxEntries) {
  FlatHashMap m(100);  // capacity 256
  for (uint64_t k = 0; k < 100; ++k) m.insert(k * 1000003ull, static_cast<int32_t>(k));
  EXPECT_EQ(m.size(), 100);
  for (uint64_t k = 0; k < 100; ++k) EXPECT_EQ(m.find(k * 1000003ull), static_cast<int32_t>(k));
  for (uint64_t k = 0; k < 100; k += 2) m.erase(k * 1000003ull);
  EXPECT_EQ(m.size(), 50);
  for (uint64_t k = 0; k < 100; ++k)
    EXPECT_EQ(m.find(k * 1000003ull), k % 2 ? static_cast<int32_t>(k) : -1) << k;
}

TEST(FlatHashMapTest, KeysWithTheSameHomeAllFound) {
  FlatHashMap m(8);
  const std::vector<uint64_t> keys = KeysWithHome(5, kMask16, 5);
  for (size_t i = 0; i < keys.size(); ++i) m.insert(keys[i], static_cast<int32_t>(10 + i));
  EXPECT_EQ(m.size(), 5);
  for (size_t i = 0; i < keys.size(); ++i) EXPECT_EQ(m.find(keys[i]), static_cast<int32_t>(10 + i));
  // A colliding key that was never inserted walks the whole chain and misses.
  const uint64_t absent = KeysWithHome(5, kMask16, 1, keys.back() + 1)[0];
  EXPECT_EQ(m.find(absent), -1);
  // Overwrite in the middle of the chain.
  m.insert(keys[2], 99);
  EXPECT_EQ(m.size(), 5);
  EXPECT_EQ(m.find(keys[2]), 99);
}

// Erasing the head, the middle and the tail of a chain of keys with one home.
TEST(FlatHashMapTest, EraseInSameHomeChain) {
  for (int victim = 0; victim < 4; ++victim) {
    SCOPED_TRACE(victim);
    FlatHashMap m(8);
    const std::vector<uint64_t> keys = KeysWithHome(3, kMask16, 4);
    for (size_t i = 0; i < keys.size(); ++i) m.insert(keys[i], static_cast<int32_t>(i));
    m.erase(keys[victim]);
    EXPECT_EQ(m.size(), 3);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(m.find(keys[i]), i == victim ? -1 : i);
    // Re-insert and erase everything in another order.
    m.insert(keys[victim], 50);
    EXPECT_EQ(m.find(keys[victim]), 50);
    for (int i = 3; i >= 0; --i) {
      m.erase(keys[i]);
      for (int j = 0; j < i; ++j) EXPECT_NE(m.find(keys[j]), -1) << "lost key " << j;
    }
    EXPECT_EQ(m.size(), 0);
  }
}

// A chain mixing homes h and h+1: erasing an entry at home h must pull the later home-h entry
// back past the home-(h+1) entry that must stay put (it may not move before its own home).
TEST(FlatHashMapTest, EraseInMixedHomeChain) {
  FlatHashMap m(8);
  const std::vector<uint64_t> a = KeysWithHome(6, kMask16, 3);
  const std::vector<uint64_t> b = KeysWithHome(7, kMask16, 2);
  // Layout: slot 6 a0, slot 7 b0, slot 8 a1, slot 9 b1, slot 10 a2.
  m.insert(a[0], 0);
  m.insert(b[0], 1);
  m.insert(a[1], 2);
  m.insert(b[1], 3);
  m.insert(a[2], 4);
  ASSERT_EQ(m.size(), 5);

  m.erase(a[0]);
  EXPECT_EQ(m.find(a[0]), -1);
  EXPECT_EQ(m.find(b[0]), 1);
  EXPECT_EQ(m.find(a[1]), 2);
  EXPECT_EQ(m.find(b[1]), 3);
  EXPECT_EQ(m.find(a[2]), 4);

  m.erase(b[0]);
  EXPECT_EQ(m.find(b[0]), -1);
  EXPECT_EQ(m.find(a[1]), 2);
  EXPECT_EQ(m.find(b[1]), 3);
  EXPECT_EQ(m.find(a[2]), 4);

  m.erase(a[1]);
  EXPECT_EQ(m.find(b[1]), 3);
  EXPECT_EQ(m.find(a[2]), 4);
  EXPECT_EQ(m.size(), 2);
  EXPECT_EQ(Contents(m), (std::map<uint64_t, int32_t>{{b[1], 3}, {a[2], 4}}));
}

// Chains that run off the end of the table wrap to slot 0; deletion must shift across the wrap
// and must not move a wrapped entry whose home is slot 0 or 1 in front of its home.
TEST(FlatHashMapTest, EraseAcrossTableWrap) {
  for (int victim = 0; victim < 6; ++victim) {
    SCOPED_TRACE(victim);
    FlatHashMap m(8);
    const std::vector<uint64_t> h15 = KeysWithHome(15, kMask16, 3);  // slots 15, 0, 1
    const std::vector<uint64_t> h0 = KeysWithHome(0, kMask16, 2);    // slots 2, 3
    const std::vector<uint64_t> h14 = KeysWithHome(14, kMask16, 1);  // slot 14
    std::vector<uint64_t> all = {h14[0], h15[0], h15[1], h15[2], h0[0], h0[1]};
    for (size_t i = 0; i < all.size(); ++i) m.insert(all[i], static_cast<int32_t>(i));
    ASSERT_EQ(m.size(), 6);
    m.erase(all[victim]);
    EXPECT_EQ(m.size(), 5);
    for (int i = 0; i < 6; ++i) EXPECT_EQ(m.find(all[i]), i == victim ? -1 : i) << "key " << i;
    // A second erase in the shifted layout.
    const int second = (victim + 3) % 6;
    m.erase(all[second]);
    for (int i = 0; i < 6; ++i)
      EXPECT_EQ(m.find(all[i]), (i == victim || i == second) ? -1 : i) << "key " << i;
  }
}

// Random operations against std::unordered_map, with keys drawn from a pool in which many keys
// share a few homes near the end of the table (long, wrapping chains), plus ordinary keys.
TEST(FlatHashMapTest, RandomisedAgainstUnorderedMap) {
  constexpr int32_t kMaxEntries = 64;  // capacity 128, mask 127
  constexpr uint64_t kMask = 127;
  std::vector<uint64_t> pool;
  for (uint64_t home : {125ull, 126ull, 127ull, 0ull, 1ull}) {
    for (uint64_t k : KeysWithHome(home, kMask, 30)) pool.push_back(k);
  }
  std::mt19937_64 rng(12345);
  for (int i = 0; i < 150; ++i) pool.push_back(rng());
  pool.push_back(0);

  for (uint64_t seed : {1ull, 2ull, 3ull}) {
    SCOPED_TRACE(seed);
    std::mt19937_64 r(seed);
    FlatHashMap m(kMaxEntries);
    std::unordered_map<uint64_t, int32_t> ref;
    for (int op = 0; op < 100000; ++op) {
      const uint64_t key = pool[r() % pool.size()];
      const int kind = static_cast<int>(r() % 10);
      if (kind < 4) {
        if (static_cast<int32_t>(ref.size()) < kMaxEntries || ref.count(key)) {
          const int32_t value = static_cast<int32_t>(r() % 1000000);
          m.insert(key, value);
          ref[key] = value;
        }
      } else if (kind < 5) {  // insert_if_absent: never overwrites
        if (static_cast<int32_t>(ref.size()) < kMaxEntries || ref.count(key)) {
          const int32_t value = static_cast<int32_t>(r() % 1000000);
          ASSERT_EQ(m.insert_if_absent(key, value), ref.emplace(key, value).second) << "op " << op;
        }
      } else if (kind < 8) {
        m.erase(key);
        ref.erase(key);
      } else {
        auto it = ref.find(key);
        ASSERT_EQ(m.find(key), it == ref.end() ? -1 : it->second) << "op " << op;
      }
      ASSERT_EQ(m.size(), static_cast<int32_t>(ref.size())) << "op " << op;
      if (op % 997 == 0) {
        for (uint64_t k : pool) {
          auto it = ref.find(k);
          ASSERT_EQ(m.find(k), it == ref.end() ? -1 : it->second) << "op " << op << " key " << k;
        }
        const auto contents = Contents(m);
        ASSERT_EQ(contents.size(), ref.size());
        for (const auto& [k, v] : contents) ASSERT_EQ(ref.at(k), v);
      }
    }
  }
}

}  // namespace
}  // namespace atom_sched
