// A fixed-capacity open-addressing map from 64-bit block hashes to block ids. The prefix cache
// holds at most one entry per block, so its capacity is known up front and it never allocates
// after construction (std::unordered_map allocates a node per insert).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace atom_sched {

class FlatHashMap {
 public:
  /// Room for `max_entries` entries at a load factor of at most 1/2.
  explicit FlatHashMap(int32_t max_entries) {
    std::size_t cap = 16;
    while (cap < 2 * static_cast<std::size_t>(max_entries)) cap *= 2;
    keys_.assign(cap, 0);
    values_.assign(cap, kEmpty);
    mask_ = cap - 1;
  }

  /// The value stored for `key`, or -1.
  [[nodiscard]] int32_t find(uint64_t key) const noexcept {
    for (std::size_t i = home(key);; i = (i + 1) & mask_) {
      if (values_[i] == kEmpty) return -1;
      if (keys_[i] == key) return values_[i];
    }
  }

  /// Inserts or overwrites. The caller keeps size() <= max_entries.
  void insert(uint64_t key, int32_t value) noexcept {
    std::size_t i = home(key);
    while (values_[i] != kEmpty && keys_[i] != key) i = (i + 1) & mask_;
    if (values_[i] == kEmpty) ++size_;
    keys_[i] = key;
    values_[i] = value;
  }

  /// Inserts `key` unless present (one probe sequence for both); whether it inserted.
  bool insert_if_absent(uint64_t key, int32_t value) noexcept {
    std::size_t i = home(key);
    while (values_[i] != kEmpty) {
      if (keys_[i] == key) return false;
      i = (i + 1) & mask_;
    }
    ++size_;
    keys_[i] = key;
    values_[i] = value;
    return true;
  }

  /// Removes `key` if present. Backward-shift deletion keeps probe chains intact without
  /// tombstones, so lookups never slow down as the cache churns.
  void erase(uint64_t key) noexcept {
    std::size_t i = home(key);
    while (true) {
      if (values_[i] == kEmpty) return;
      if (keys_[i] == key) break;
      i = (i + 1) & mask_;
    }
    std::size_t hole = i;
    for (std::size_t j = (hole + 1) & mask_; values_[j] != kEmpty; j = (j + 1) & mask_) {
      std::size_t h = home(keys_[j]);
      // Move entry j into the hole if its home does not lie cyclically in (hole, j].
      bool home_in_range = hole <= j ? (hole < h && h <= j) : (hole < h || h <= j);
      if (!home_in_range) {
        keys_[hole] = keys_[j];
        values_[hole] = values_[j];
        hole = j;
      }
    }
    values_[hole] = kEmpty;
    --size_;
  }

  void clear() noexcept {
    values_.assign(values_.size(), kEmpty);
    size_ = 0;
  }

  [[nodiscard]] int32_t size() const noexcept { return size_; }

  /// Requests the lines where a probe for `key` starts (a hint: changes nothing), so that a
  /// lookup or insertion issued a while later finds them in cache.
  void prefetch(uint64_t key) const noexcept {
    const std::size_t i = home(key);
    __builtin_prefetch(values_.data() + i);
    __builtin_prefetch(keys_.data() + i);
  }

  /// Calls f(key, value) for every entry.
  template <typename F>
  void for_each(F&& f) const {
    for (std::size_t i = 0; i < values_.size(); ++i)
      if (values_[i] != kEmpty) f(keys_[i], values_[i]);
  }

 private:
  static constexpr int32_t kEmpty = -1;
  // Keys are already xxHash64 digests; the multiply spreads any structure in test keys.
  [[nodiscard]] std::size_t home(uint64_t key) const noexcept {
    return static_cast<std::size_t>((key * 0x9E3779B97F4A7C15ull) >> 17) & mask_;
  }

  std::vector<uint64_t> keys_;
  std::vector<int32_t> values_;
  std::size_t mask_ = 0;
  int32_t size_ = 0;
};

}  // namespace atom_sched
