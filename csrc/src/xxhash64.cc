// XXH64, written from the algorithm's public description: four 64-bit accumulators consume the
// input in 32-byte stripes, are folded together, the tail is mixed in 8-, 4- and 1-byte steps, and
// a final avalanche spreads every input bit over the digest.
#include "atom_sched/xxhash64.h"

#include <array>
#include <bit>
#include <cstring>

#if defined(__GNUC__) && !defined(__clang__)
// The vector instances of the helpers below return 64-byte vectors, which GCC notes would pass
// differently without AVX-512; they are always inlined into the AVX-512 function, never called.
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace atom_sched {
namespace {

constexpr uint64_t kPrime1 = 0x9E3779B185EBCA87ULL;
constexpr uint64_t kPrime2 = 0xC2B2AE3D27D4EB4FULL;
constexpr uint64_t kPrime3 = 0x165667B19E3779F9ULL;
constexpr uint64_t kPrime4 = 0x85EBCA77C2B2AE63ULL;
constexpr uint64_t kPrime5 = 0x27D4EB2F165667C5ULL;
constexpr size_t kStripe = 32;

// The input is defined as little-endian; swap on big-endian hosts so digests match everywhere.
inline uint64_t read_le64(const unsigned char* p) noexcept {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  if constexpr (std::endian::native == std::endian::big) v = __builtin_bswap64(v);
  return v;
}

inline uint32_t read_le32(const unsigned char* p) noexcept {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  if constexpr (std::endian::native == std::endian::big) v = __builtin_bswap32(v);
  return v;
}

// The lane arithmetic below is written once for a 64-bit value and for a vector of them (GCC's
// vector extensions: the same operators, lane by lane), so that block_hashes() can hash eight
// blocks side by side with the very same steps. Always inlined: a vector instance takes the
// instruction set of the function it is inlined into.
template <class T>
[[gnu::always_inline]] inline T rotl64(T x, int r) noexcept {
  return (x << r) | (x >> (64 - r));
}

template <class T>
[[gnu::always_inline]] inline T mix_lane(T acc, T lane) noexcept {
  acc += lane * kPrime2;
  acc = rotl64(acc, 31);
  return acc * kPrime1;
}

template <class T>
[[gnu::always_inline]] inline T merge_acc(T h, T acc) noexcept {
  h ^= mix_lane(T{}, acc);
  return h * kPrime1 + kPrime4;
}

template <class T>
[[gnu::always_inline]] inline void init_accs(T acc[4], T seed) noexcept {
  acc[0] = seed + kPrime1 + kPrime2;
  acc[1] = seed + kPrime2;
  acc[2] = seed;
  acc[3] = seed - kPrime1;
}

inline void consume_stripe(uint64_t acc[4], const unsigned char* p) noexcept {
  for (int i = 0; i < 4; ++i) acc[i] = mix_lane(acc[i], read_le64(p + 8 * i));
}

// Folds the accumulators into one value; only used when at least one full stripe was consumed.
template <class T>
[[gnu::always_inline]] inline T converge(const T acc[4]) noexcept {
  T h = rotl64(acc[0], 1) + rotl64(acc[1], 7) + rotl64(acc[2], 12) + rotl64(acc[3], 18);
  for (int i = 0; i < 4; ++i) h = merge_acc(h, acc[i]);
  return h;
}

template <class T>
[[gnu::always_inline]] inline T tail_lane(T h, T lane) noexcept {
  h ^= mix_lane(T{}, lane);
  return rotl64(h, 27) * kPrime1 + kPrime4;
}

template <class T>
[[gnu::always_inline]] inline T avalanche(T h) noexcept {
  h ^= h >> 33;
  h *= kPrime2;
  h ^= h >> 29;
  h *= kPrime3;
  h ^= h >> 32;
  return h;
}

// Mixes the last `len` (< 32) bytes into `h` and finishes the digest.
uint64_t finish(uint64_t h, const unsigned char* p, size_t len) noexcept {
  for (; len >= 8; p += 8, len -= 8) h = tail_lane(h, read_le64(p));
  if (len >= 4) {
    h ^= static_cast<uint64_t>(read_le32(p)) * kPrime1;
    h = std::rotl(h, 23) * kPrime2 + kPrime3;
    p += 4;
    len -= 4;
  }
  for (; len > 0; ++p, --len) {
    h ^= static_cast<uint64_t>(*p) * kPrime5;
    h = std::rotl(h, 11) * kPrime1;
  }
  return avalanche(h);
}

// XXH64 (seed 0) of an input made of `n` 8-byte little-endian lanes, lane i having value lane(i).
// Same digest as xxhash64() over those bytes, without materialising them. T is uint64_t, or a
// vector of them for as many inputs at once (lane(i) then holds each input's lane i).
template <class T, class LaneAt>
[[gnu::always_inline]] inline T hash_lanes(size_t n, LaneAt lane) noexcept {
  size_t i = 0;
  T h;
  if (n >= 4) {
    T acc[4];
    init_accs(acc, T{});
    for (; i + 4 <= n; i += 4) {
      for (size_t k = 0; k < 4; ++k) acc[k] = mix_lane(acc[k], lane(i + k));
    }
    h = converge(acc);
  } else {
    h = T{} + kPrime5;
  }
  h += static_cast<uint64_t>(n) * 8;
  for (; i < n; ++i) h = tail_lane(h, lane(i));
  return avalanche(h);
}

inline uint64_t token_lane(int32_t token) noexcept {
  return static_cast<uint64_t>(static_cast<int64_t>(token));  // int64 two's complement
}

}  // namespace

uint64_t xxhash64(const void* data, size_t len, uint64_t seed) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  const size_t total = len;
  uint64_t h;
  if (len >= kStripe) {
    uint64_t acc[4];
    init_accs(acc, seed);
    for (; len >= kStripe; p += kStripe, len -= kStripe) consume_stripe(acc, p);
    h = converge(acc);
  } else {
    h = seed + kPrime5;
  }
  h += static_cast<uint64_t>(total);
  return finish(h, p, len);
}

void Xxhash64State::reset(uint64_t seed) noexcept {
  init_accs(acc_, seed);
  seed_ = seed;
  total_len_ = 0;
  buf_len_ = 0;
}

void Xxhash64State::update(const void* data, size_t len) noexcept {
  if (len == 0) return;  // data may be null
  const auto* p = static_cast<const unsigned char*>(data);
  total_len_ += len;
  if (buf_len_ + len < kStripe) {
    std::memcpy(buf_ + buf_len_, p, len);
    buf_len_ += static_cast<uint32_t>(len);
    return;
  }
  if (buf_len_ > 0) {  // complete the pending stripe first
    const size_t fill = kStripe - buf_len_;
    std::memcpy(buf_ + buf_len_, p, fill);
    consume_stripe(acc_, buf_);
    p += fill;
    len -= fill;
    buf_len_ = 0;
  }
  for (; len >= kStripe; p += kStripe, len -= kStripe) consume_stripe(acc_, p);
  if (len > 0) std::memcpy(buf_, p, len);
  buf_len_ = static_cast<uint32_t>(len);
}

uint64_t Xxhash64State::digest() const noexcept {
  uint64_t h = total_len_ >= kStripe ? converge(acc_) : seed_ + kPrime5;
  h += total_len_;
  return finish(h, buf_, buf_len_);
}

std::optional<uint64_t> hash_namespace(std::string_view lora_name,
                                       std::string_view cache_salt) noexcept {
  if (lora_name.empty() && cache_salt.empty()) return std::nullopt;
  static constexpr char kTag[] = "atom_sched/extra-keys/v1";
  Xxhash64State h(0);
  h.update(kTag, sizeof(kTag) - 1);
  for (std::string_view s : {lora_name, cache_salt}) {
    const uint64_t n = s.size();
    unsigned char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
    h.update(len, sizeof(len));
    h.update(s.data(), s.size());
  }
  return h.digest();
}

namespace {

// block_hash over a compile-time token count: the stripe loop unrolls and the parent lane's
// branch folds away (hashing was about 40% of a prompt's admission).
template <size_t N>
uint64_t block_hash_n(const int32_t* t, std::optional<uint64_t> parent) noexcept {
  std::array<uint64_t, N + 1> lanes;
  const size_t first = parent.has_value() ? 1 : 0;
  lanes[0] = parent.value_or(0);
  for (size_t i = 0; i < N; ++i) lanes[i + 1] = token_lane(t[i]);
  if (first == 1) return hash_lanes<uint64_t>(N + 1, [&lanes](size_t i) { return lanes[i]; });
  return hash_lanes<uint64_t>(N, [&lanes](size_t i) { return lanes[i + 1]; });
}

}  // namespace

uint64_t block_hash(std::span<const int32_t> tokens, std::optional<uint64_t> parent) noexcept {
  const int32_t* t = tokens.data();
  switch (tokens.size()) {  // the usual block sizes
    case 16: return block_hash_n<16>(t, parent);
    case 32: return block_hash_n<32>(t, parent);
    default: break;
  }
  if (parent.has_value()) {
    const uint64_t first = *parent;
    return hash_lanes<uint64_t>(tokens.size() + 1,
                      [t, first](size_t i) { return i == 0 ? first : token_lane(t[i - 1]); });
  }
  return hash_lanes<uint64_t>(tokens.size(), [t](size_t i) { return token_lane(t[i]); });
}

namespace {

// GCC only, as the multiversioned passes (scheduler_internal.h): Clang rejects passing the
// vectors between the helpers, inlined or not, outside an AVX-512 function.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(ATOM_SCHED_NO_MULTIVERSION)
#define ATOM_SCHED_HASH8_AVX512 1
using U64x8 = uint64_t __attribute__((vector_size(64)));

// Eight chained block hashes side by side, lane r of every vector belonging to block r: the
// steps of hash_lanes() on 64-bit vector lanes. XXH64 multiplies 64-bit values, which only
// AVX-512DQ does in vector lanes (AVX2 would take three 32-bit multiplies a lane): hence this
// one function compiled for it, chosen at run time.
[[gnu::target("avx512f,avx512dq")]] void block_hashes8(const int32_t* const* tokens,
                                                       const uint64_t* parents, size_t block_size,
                                                       uint64_t* out) noexcept {
  U64x8 parent;
  std::memcpy(&parent, parents, sizeof parent);
  const auto lane = [&](size_t i) __attribute__((always_inline)) {
    if (i == 0) return parent;
    U64x8 v;
    for (int r = 0; r < 8; ++r) v[r] = token_lane(tokens[r][i - 1]);
    return v;
  };
  const U64x8 h = hash_lanes<U64x8>(block_size + 1, lane);
  std::memcpy(out, &h, sizeof h);
}

bool have_avx512dq() noexcept {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  return yes;
}
#endif

}  // namespace

void block_hashes(const int32_t* const* tokens, const uint64_t* parents, size_t count,
                  size_t block_size, uint64_t* out) noexcept {
  size_t i = 0;
#ifdef ATOM_SCHED_HASH8_AVX512
  if (have_avx512dq()) {
    for (; i + 8 <= count; i += 8) block_hashes8(tokens + i, parents + i, block_size, out + i);
    if (count - i >= 3) {  // the last few, padded with copies of the first of them
      const int32_t* t[8];
      uint64_t p[8], h[8];
      for (size_t r = 0; r < 8; ++r) {
        const size_t from = i + (i + r < count ? r : 0);
        t[r] = tokens[from];
        p[r] = parents[from];
      }
      block_hashes8(t, p, block_size, h);
      std::memcpy(out + i, h, (count - i) * sizeof(uint64_t));
      return;
    }
  }
#endif
  for (; i < count; ++i) out[i] = block_hash(std::span<const int32_t>(tokens[i], block_size),
                                             parents[i]);
}

}  // namespace atom_sched
