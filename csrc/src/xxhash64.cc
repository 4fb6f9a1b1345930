// XXH64, written from the algorithm's public description: four 64-bit accumulators consume the
// input in 32-byte stripes, are folded together, the tail is mixed in 8-, 4- and 1-byte steps, and
// a final avalanche spreads every input bit over the digest.
#include "atom_sched/xxhash64.h"

#include <array>
#include <bit>
#include <cstring>

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

inline uint64_t mix_lane(uint64_t acc, uint64_t lane) noexcept {
  acc += lane * kPrime2;
  acc = std::rotl(acc, 31);
  return acc * kPrime1;
}

inline uint64_t merge_acc(uint64_t h, uint64_t acc) noexcept {
  h ^= mix_lane(0, acc);
  return h * kPrime1 + kPrime4;
}

inline void init_accs(uint64_t acc[4], uint64_t seed) noexcept {
  acc[0] = seed + kPrime1 + kPrime2;
  acc[1] = seed + kPrime2;
  acc[2] = seed;
  acc[3] = seed - kPrime1;
}

inline void consume_stripe(uint64_t acc[4], const unsigned char* p) noexcept {
  for (int i = 0; i < 4; ++i) acc[i] = mix_lane(acc[i], read_le64(p + 8 * i));
}

// Folds the accumulators into one value; only used when at least one full stripe was consumed.
inline uint64_t converge(const uint64_t acc[4]) noexcept {
  uint64_t h = std::rotl(acc[0], 1) + std::rotl(acc[1], 7) + std::rotl(acc[2], 12) +
               std::rotl(acc[3], 18);
  for (int i = 0; i < 4; ++i) h = merge_acc(h, acc[i]);
  return h;
}

inline uint64_t tail_lane(uint64_t h, uint64_t lane) noexcept {
  h ^= mix_lane(0, lane);
  return std::rotl(h, 27) * kPrime1 + kPrime4;
}

inline uint64_t avalanche(uint64_t h) noexcept {
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
// Same digest as xxhash64() over those bytes, without materialising them.
template <class LaneAt>
uint64_t hash_lanes(size_t n, LaneAt lane) noexcept {
  size_t i = 0;
  uint64_t h;
  if (n >= 4) {
    uint64_t acc[4];
    init_accs(acc, 0);
    for (; i + 4 <= n; i += 4) {
      for (size_t k = 0; k < 4; ++k) acc[k] = mix_lane(acc[k], lane(i + k));
    }
    h = converge(acc);
  } else {
    h = kPrime5;
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
  if (first == 1) return hash_lanes(N + 1, [&lanes](size_t i) { return lanes[i]; });
  return hash_lanes(N, [&lanes](size_t i) { return lanes[i + 1]; });
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
    return hash_lanes(tokens.size() + 1,
                      [t, first](size_t i) { return i == 0 ? first : token_lane(t[i - 1]); });
  }
  return hash_lanes(tokens.size(), [t](size_t i) { return token_lane(t[i]); });
}

}  // namespace atom_sched
