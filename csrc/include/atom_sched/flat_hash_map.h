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
    slots_.assign(cap, Slot{});
    mask_ = cap - 1;
  }

  /// The value stored for `key`, or -1.
  [[nodiscard]] int32_t find(uint64_t key) const noexcept {
    for (std::size_t i = home(key);; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.value == kEmpty) return -1;
      if (s.key == key) return s.value;
    }
  }

  /// Inserts or overwrites. The caller keeps size() <= max_entries.
  void insert(uint64_t key, int32_t value) noexcept {
    std::size_t i = home(key);
    while (slots_[i].value != kEmpty && slots_[i].key != key) i = (i + 1) & mask_;
    if (slots_[i].value == kEmpty) ++size_;
    slots_[i] = {key, value};
  }

  /// Inserts `key` unless present (one probe sequence for both); whether it inserted.
  bool insert_if_absent(uint64_t key, int32_t value) noexcept {
    std::size_t i = home(key);
    while (slots_[i].value != kEmpty) {
      if (slots_[i].key == key) return false;
      i = (i + 1) & mask_;
    }
    ++size_;
    slots_[i] = {key, value};
    return true;
  }

  /// Removes `key` if present. Backward-shift deletion keeps probe chains intact without
  /// tombstones, so lookups never slow down as the cache churns.
  void erase(uint64_t key) noexcept {
    std::size_t i = home(key);
    while (true) {
      if (slots_[i].value == kEmpty) return;
      if (slots_[i].key == key) break;
      i = (i + 1) & mask_;
    }
    std::size_t hole = i;
    for (std::size_t j = (hole + 1) & mask_; slots_[j].value != kEmpty; j = (j + 1) & mask_) {
      std::size_t h = home(slots_[j].key);
      // Move entry j into the hole if its home does not lie cyclically in (hole, j].
      bool home_in_range = hole <= j ? (hole < h && h <= j) : (hole < h || h <= j);
      if (!home_in_range) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole].value = kEmpty;
    --size_;
  }

  void clear() noexcept {
    slots_.assign(slots_.size(), Slot{});
    size_ = 0;
  }

  [[nodiscard]] int32_t size() const noexcept { return size_; }

  /// Requests the line where a probe for `key` starts (a hint: changes nothing), so that a
  /// lookup or insertion issued a while later finds it in cache.
  void prefetch(uint64_t key) const noexcept { __builtin_prefetch(slots_.data() + home(key)); }

  /// Calls f(key, value) for every entry.
  template <typename F>
  void for_each(F&& f) const {
    for (const Slot& s : slots_)
      if (s.value != kEmpty) f(s.key, s.value);
  }

 private:
  static constexpr int32_t kEmpty = -1;
  // Keys are already xxHash64 digests; the multiply spreads any structure in test keys.
  [[nodiscard]] std::size_t home(uint64_t key) const noexcept {
    return static_cast<std::size_t>((key * 0x9E3779B97F4A7C15ull) >> 17) & mask_;
  }

  // A key beside its value: a probe reads one line (and one page) where two arrays cost two,
  // each a miss in a map larger than the caches. 16 bytes a slot, four a line, so linear probing
  // mostly stays in the line it started in.
  struct Slot {
    uint64_t key = 0;
    int32_t value = kEmpty;
  };
  std::vector<Slot> slots_;
  std::size_t mask_ = 0;
  int32_t size_ = 0;
};

}  // namespace atom_sched
