// Small helpers shared by the scheduler's source files (scheduler*.cc). Not a public header.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <string>

#include "atom_sched/errors.h"

// Function multiversioning: the marked function is compiled twice, with AVX2 where the CPU has it
// and for the baseline x86-64; the loader picks the clone once. (CMake's
// ATOM_SCHED_MULTIVERSION=OFF, the sanitized test build, compiles the baseline alone, so that the
// suites run it too.)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(ATOM_SCHED_NO_MULTIVERSION)
#define ATOM_SCHED_AVX2_CLONES [[gnu::target_clones("avx2", "default")]]
#else
#define ATOM_SCHED_AVX2_CLONES
#endif

namespace atom_sched::detail {

inline int32_t ceil_div(int32_t a, int32_t b) { return (a + b - 1) / b; }

inline void check(bool ok, const std::string& what) {
  if (!ok) throw InvariantViolation("Scheduler: " + what);
}

inline std::string id_str(int64_t id) { return std::to_string(id); }

// Calls fn(i) for each i < n with marks[i] != 0, in order, reading the marks eight at a time:
// the passes that flag rows vectorise, and a step flags few (marks holds n rounded up to 8).
template <class Fn>
[[gnu::always_inline]] inline void for_each_marked(const uint8_t* marks, int32_t n, Fn&& fn) {
  static_assert(std::endian::native == std::endian::little, "byte i of a word is mark i0 + i");
  const auto word_at = [&](int32_t i0) {
    uint64_t word;
    std::memcpy(&word, marks + i0, sizeof word);
    return word;
  };
  int32_t i0 = 0;
  for (; i0 + 8 <= n; i0 += 8)
    for (uint64_t word = word_at(i0); word != 0; word &= word - 1)
      fn(i0 + __builtin_ctzll(word) / 8);
  if (i0 == n) return;
  for (uint64_t word = word_at(i0) & (~uint64_t{0} >> (8 * (i0 + 8 - n))); word != 0;
       word &= word - 1)  // the last bytes before n
    fn(i0 + __builtin_ctzll(word) / 8);
}

// out[i] = in[0] + ... + in[i] for i < n (cu_seqlens), eight lanes a step: a running sum has a
// dependency chain per element, the lanes one per three shifts. Inline, so it takes the
// instruction set of the (cloned) function it is inlined into. (__builtin_shufflevector: GCC 12
// and Clang both have it; the fuzz targets build with Clang.)
[[gnu::always_inline]] inline void inclusive_sums(const int32_t* __restrict in,
                                                  int32_t* __restrict out, int32_t n) {
  using I32x8 = int32_t __attribute__((vector_size(32)));
  const I32x8 zero{};
  I32x8 carry{};  // every lane: the sum before this step's eight
  int32_t i = 0;
  for (; i + 8 <= n; i += 8) {
    I32x8 v;
    std::memcpy(&v, in + i, sizeof v);
    v += __builtin_shufflevector(zero, v, 0, 8, 9, 10, 11, 12, 13, 14);  // lanes up by one
    v += __builtin_shufflevector(zero, v, 0, 1, 8, 9, 10, 11, 12, 13);   // by two
    v += __builtin_shufflevector(zero, v, 0, 1, 2, 3, 8, 9, 10, 11);     // by four
    v += carry;
    std::memcpy(out + i, &v, sizeof v);
    carry = __builtin_shufflevector(v, v, 7, 7, 7, 7, 7, 7, 7, 7);
  }
  for (int32_t sum = i > 0 ? out[i - 1] : 0; i < n; ++i) out[i] = sum += in[i];
}

}  // namespace atom_sched::detail
