// xxHash64 (XXH64) and ATOM's chained KV-block hash.
//
// Our own implementation of the published XXH64 algorithm; digests are bit-identical to the
// reference library (and to Python's `xxhash.xxh64`). Nothing here allocates or throws. All
// functions and the state class are reentrant; a single Xxhash64State must not be shared between
// threads without external synchronisation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

namespace atom_sched {

// One-shot XXH64 digest of `len` bytes at `data` (may be null when len == 0).
[[nodiscard]] uint64_t xxhash64(const void* data, size_t len, uint64_t seed = 0) noexcept;

// Streaming XXH64: feeding the input in any split gives the same digest as xxhash64() over the
// concatenation. Fixed size (no heap), cheap to copy.
class Xxhash64State {
 public:
  explicit Xxhash64State(uint64_t seed = 0) noexcept { reset(seed); }

  // Starts a new digest with `seed`, discarding anything fed so far.
  void reset(uint64_t seed = 0) noexcept;
  // Appends `len` bytes at `data` (may be null when len == 0).
  void update(const void* data, size_t len) noexcept;
  // Digest of everything fed since the last reset(); does not change the state.
  [[nodiscard]] uint64_t digest() const noexcept;

 private:
  uint64_t acc_[4];       // the four stripe accumulators
  uint64_t seed_;
  uint64_t total_len_;    // bytes fed since reset()
  unsigned char buf_[32];  // pending bytes of an incomplete 32-byte stripe
  uint32_t buf_len_;
};

// ATOM's chained block hash: XXH64 with seed 0 over, first, `parent` as 8 little-endian bytes
// (only when a parent is given), then every token as a little-endian int64 (sign-extended).
// Block 0 of a sequence has no parent; block i uses block i-1's hash. Does not allocate.
[[nodiscard]] uint64_t block_hash(std::span<const int32_t> tokens,
                                  std::optional<uint64_t> parent) noexcept;

// block_hash() of `count` blocks of `block_size` tokens, each with a parent, at once:
// out[i] = block_hash({tokens[i], block_size}, parents[i]). Built by GCC for x86-64 and run where
// the CPU has AVX-512DQ, eight at a time in vector lanes (fewer than three left over go one by
// one); elsewhere one by one.
void block_hashes(const int32_t* const* tokens, const uint64_t* parents, size_t count,
                  size_t block_size, uint64_t* out) noexcept;

// The parent of block 0 for a request with extra keys (vLLM's: a LoRA adapter, a cache salt):
// XXH64 over a domain tag and both strings, each preceded by its length, so every block of the
// chain differs from the same tokens' under other keys. None when both are empty (ATOM's chain).
[[nodiscard]] std::optional<uint64_t> hash_namespace(std::string_view lora_name,
                                                     std::string_view cache_salt) noexcept;

}  // namespace atom_sched
