#include "atom_sched/block_pool.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "atom_sched/errors.h"

namespace atom_sched {

const char* medium_name(Medium m) noexcept {
  switch (m) {
    case Medium::kGpu: return "GPU";
    case Medium::kCpu: return "CPU";
    case Medium::kDisk: return "DISK";
    case Medium::kRemote: return "REMOTE";
    case Medium::kNone: break;
  }
  return nullptr;
}

namespace {
void require(bool ok, const std::string& what) {
  if (!ok) throw InvalidArgument(what);
}
void check(bool ok, const std::string& what) {
  if (!ok) throw InvariantViolation("BlockPool: " + what);
}

// A block's tokens are compared (a cache hit) and copied (a publish) whole. The usual 16-token
// block takes fixed-size code: for 64 bytes, the library's memcmp and memmove calls cost more
// than the work (an admission of 256 prompts makes thousands of each).
constexpr int32_t kUsualBlockSize = 16;
[[gnu::always_inline]] inline bool same_tokens(const int32_t* a, const int32_t* b, int32_t n) {
  if (n != kUsualBlockSize) return std::equal(a, a + n, b);
  int32_t diff = 0;
  for (int32_t j = 0; j < kUsualBlockSize; ++j) diff |= a[j] ^ b[j];  // vectorised
  return diff == 0;
}
[[gnu::always_inline]] inline void copy_tokens(const int32_t* from, int32_t n, int32_t* to) {
  if (n == kUsualBlockSize)
    std::memcpy(to, from, kUsualBlockSize * sizeof(int32_t));
  else
    std::copy_n(from, n, to);
}
}  // namespace

BlockPool::BlockPool(int32_t num_blocks, int32_t block_size, bool enable_prefix_caching,
                     bool enable_events, int32_t num_state_slots, bool recompute_last_hit)
    : num_blocks_(num_blocks),
      block_size_(block_size),
      prefix_caching_(enable_prefix_caching),
      events_enabled_(enable_events),
      recompute_last_hit_(recompute_last_hit),
      num_state_slots_(num_state_slots),
      map_(std::max(num_blocks, 1)) {
  require(num_blocks >= 2, "num_blocks must be >= 2 (block 0 is the null block), got " +
                               std::to_string(num_blocks));
  require(block_size > 0, "block_size must be > 0, got " + std::to_string(block_size));
  require(num_state_slots >= 0,
          "num_state_slots must be >= 0, got " + std::to_string(num_state_slots));
  ref_count_.assign(num_blocks, 0);
  free_prev_.resize(num_blocks);
  free_next_.resize(num_blocks);
  // The free list holds 1..num_blocks-1 in order; the null block is never on it.
  free_prev_[kNullBlock] = free_next_[kNullBlock] = -1;
  for (int32_t b = 1; b < num_blocks; ++b) {
    free_prev_[b] = b - 1 >= 1 ? b - 1 : -1;
    free_next_[b] = b + 1 < num_blocks ? b + 1 : -1;
  }
  free_head_ = 1;
  free_tail_ = num_blocks - 1;
  num_free_ = num_blocks - 1;
  hash_.assign(num_blocks, 0);
  has_hash_.assign(num_blocks, 0);
  for (auto* links : {&parent_, &first_child_, &next_sibling_, &prev_sibling_})
    links->assign(num_blocks, -1);
  if (prefix_caching_) block_tokens_.assign(static_cast<size_t>(num_blocks) * block_size, 0);
  // ATOM pops state slots from the end of [0..G-1]: the first request gets G-1.
  free_state_slots_.reserve(num_state_slots);
  for (int32_t g = 0; g < num_state_slots; ++g) free_state_slots_.push_back(g);
}

double BlockPool::usage() const noexcept {
  return static_cast<double>(num_used_blocks()) / num_usable_blocks();
}

bool BlockPool::tokens_match(int32_t block, std::span<const int32_t> tokens) const {
  const int32_t* stored = block_tokens_.data() + static_cast<size_t>(block) * block_size_;
  return same_tokens(tokens.data(), stored, static_cast<int32_t>(tokens.size()));
}

int32_t BlockPool::cached_block(uint64_t hash) const {
  return prefix_caching_ ? map_.find(hash) : -1;
}

int32_t BlockPool::count_cached_blocks(std::span<const uint64_t> hashes,
                                       std::span<const int32_t> tokens,
                                       int32_t max_blocks) const {
  int32_t shared = 0;
  return leading_hits(hashes, tokens, max_blocks, shared);
}

int32_t BlockPool::leading_hits(std::span<const uint64_t> hashes, std::span<const int32_t> tokens,
                                int32_t max_blocks, int32_t& shared) const {
  if (!prefix_caching_) return 0;
  int32_t n = std::min<int32_t>(max_blocks, static_cast<int32_t>(hashes.size()));
  int32_t hits = 0;
  for (; hits < n; ++hits) {
    int32_t b = map_.find(hashes[hits]);
    if (b < 0 || !tokens_match(b, tokens.subspan(static_cast<size_t>(hits) * block_size_,
                                                  block_size_)))
      break;
    shared += ref_count_[b] > 0;
  }
  return hits;
}

int32_t BlockPool::can_allocate(std::span<const uint64_t> hashes, std::span<const int32_t> tokens,
                                int32_t num_tokens, bool needs_state_slot,
                                int32_t reserve) const {
  if (needs_state_slot && free_state_slots_.empty()) return -1;
  const int32_t num_needed = (num_tokens + block_size_ - 1) / block_size_;
  // The last block is never a hit, so prefill always computes at least one token. A hit held by
  // a live request needs no new block.
  int32_t shared = 0;
  int32_t hits = leading_hits(hashes, tokens, num_needed - 1, shared);
  if (recompute_last_hit_ && hits > 0) {
    // The hit's last block is computed again, into a fresh block: one block less to share.
    --hits;
    shared -= ref_count_[map_.find(hashes[hits])] > 0;
  }
  return num_free_ - reserve >= num_needed - shared ? hits : -1;
}

[[gnu::always_inline]] inline void BlockPool::unlink_free(int32_t b) {
  int32_t p = free_prev_[b], n = free_next_[b];
  (p >= 0 ? free_next_[p] : free_head_) = n;
  (n >= 0 ? free_prev_[n] : free_tail_) = p;
  free_prev_[b] = free_next_[b] = -1;
  --num_free_;
}

[[gnu::always_inline]] inline void BlockPool::push_free_tail(int32_t b) {
  free_prev_[b] = free_tail_;
  free_next_[b] = -1;
  (free_tail_ >= 0 ? free_next_[free_tail_] : free_head_) = b;
  free_tail_ = b;
  ++num_free_;
}

void BlockPool::forget_hash(int32_t root) {
  if (!has_hash_[root]) return;
  // Post-order walk of root's cached subtree, without recursion (a chain can be thousands of
  // blocks deep): descend to a leaf, forget it, go back to its parent.
  int32_t b = root;
  while (true) {
    while (first_child_[b] >= 0) b = first_child_[b];
    const int32_t parent = parent_[b];
    forget_leaf(b);
    if (b == root) return;
    b = parent;
  }
}

void BlockPool::forget_leaf(int32_t b) {
  const int32_t p = parent_[b], prev = prev_sibling_[b], next = next_sibling_[b];
  if (prev >= 0) next_sibling_[prev] = next;
  else if (p >= 0) first_child_[p] = next;
  if (next >= 0) prev_sibling_[next] = prev;
  parent_[b] = prev_sibling_[b] = next_sibling_[b] = -1;
  map_.erase(hash_[b]);
  has_hash_[b] = 0;
  if (events_enabled_) {
    KvEvent e;
    e.kind = KvEventKind::kBlockRemoved;
    e.block_hashes.push_back(hash_[b]);
    events_.push_back(std::move(e));
  }
}

[[gnu::always_inline]] inline int32_t BlockPool::pop_free_head() {
  int32_t b = free_head_;
  if (b < 0) throw InvariantViolation("BlockPool: no free block (caller skipped the check)");
  unlink_free(b);
  // Lazy eviction: the cached content is overwritten from now on (most blocks have none).
  if (has_hash_[b]) forget_hash(b);
  ref_count_[b] = 1;
  return b;
}

void BlockPool::allocate(std::span<const uint64_t> hashes, int32_t num_cached_blocks,
                         int32_t num_tokens, std::vector<int32_t>& table) {
  if (!table.empty()) throw InvariantViolation("BlockPool::allocate: table not empty");
  const int32_t num_needed = (num_tokens + block_size_ - 1) / block_size_;
  // Written by index (an admission takes dozens of blocks): no capacity check per block.
  table.resize(num_needed);
  int32_t* out = table.data();
  for (int32_t i = 0; i < num_cached_blocks; ++i) {
    int32_t b = map_.find(hashes[i]);
    if (b < 0) throw InvariantViolation("BlockPool::allocate: cache hit vanished");
    if (ref_count_[b] == 0) unlink_free(b);  // free-cached: claimed straight off the free list
    ++ref_count_[b];
    out[i] = b;
  }
  for (int32_t i = num_cached_blocks; i < num_needed; ++i) out[i] = pop_free_head();
}

bool BlockPool::grow(std::vector<int32_t>& table, int32_t target_blocks) {
  const int32_t missing = target_blocks - static_cast<int32_t>(table.size());
  if (missing <= 0) return true;
  if (missing > num_free_) return false;
  for (int32_t i = 0; i < missing; ++i) table.push_back(pop_free_head());
  return true;
}

void BlockPool::free(std::span<const int32_t> table) {
  for (auto it = table.rbegin(); it != table.rend(); ++it) {
    int32_t b = *it;
    if (--ref_count_[b] == 0) push_free_tail(b);
  }
}

void BlockPool::publish(std::span<const int32_t> table, std::span<const uint64_t> hashes,
                        std::span<const int32_t> tokens, int32_t first_block, int32_t end_block,
                        std::string_view lora_name, std::string_view cache_salt) {
  if (!prefix_caching_) return;
  // The map's slots for the new hashes, requested together: the probes below are independent
  // misses that the loop's body (a hundred instructions a block) would otherwise take one at a
  // time. (A prefill publishes dozens of blocks at once.)
  for (int32_t i = first_block; i < end_block; ++i) map_.prefetch(hashes[i]);
  KvEvent* run = nullptr;  // the BlockStored being extended, while blocks register back to back
  for (int32_t i = first_block; i < end_block; ++i) {
    const int32_t b = table[i];
    const uint64_t h = hashes[i];
    if (has_hash_[b]) {  // already cached here
      run = nullptr;
      continue;
    }
    // The parent: usually the request's own previous block (no lookup).
    int32_t parent = -1;
    if (i > 0) {
      const int32_t prev = table[i - 1];
      parent = has_hash_[prev] && hash_[prev] == hashes[i - 1] ? prev : map_.find(hashes[i - 1]);
      // The prefix was reset away: nothing after it is reachable. (A block whose content is
      // cached elsewhere always has its parent cached: the cached set is a forest.)
      if (parent < 0) return;
    }
    if (!map_.insert_if_absent(h, b)) {
      // The same content lives in another block (computed twice): keep the first copy, record
      // nothing (ATOM overwrote the map and re-announced, 8.30).
      run = nullptr;
      continue;
    }
    hash_[b] = h;
    has_hash_[b] = 1;
    parent_[b] = parent;
    if (parent >= 0) {
      next_sibling_[b] = first_child_[parent];
      if (next_sibling_[b] >= 0) prev_sibling_[next_sibling_[b]] = b;
      first_child_[parent] = b;
    }
    auto content = tokens.subspan(static_cast<size_t>(i) * block_size_, block_size_);
    copy_tokens(content.data(), block_size_,
                block_tokens_.data() + static_cast<ptrdiff_t>(b) * block_size_);
    if (!events_enabled_) continue;
    if (run == nullptr) {
      events_.emplace_back();
      run = &events_.back();
      run->kind = KvEventKind::kBlockStored;
      run->block_size = block_size_;
      run->medium = Medium::kGpu;
      run->lora_name = lora_name;
      run->cache_salt = cache_salt;
      if (i > 0) run->parent_block_hash = hashes[i - 1];
    }
    run->block_hashes.push_back(h);
    run->token_ids.insert(run->token_ids.end(), content.begin(), content.end());
  }
}

int32_t BlockPool::take_state_slot() {
  if (free_state_slots_.empty()) return -1;
  int32_t g = free_state_slots_.back();
  free_state_slots_.pop_back();
  return g;
}

void BlockPool::release_state_slot(int32_t slot) {
  if (slot < 0 || slot >= num_state_slots_)
    throw InvariantViolation("BlockPool: releasing state slot " + std::to_string(slot));
  free_state_slots_.push_back(slot);
}

void BlockPool::reset_prefix_cache() {
  map_.clear();
  std::fill(has_hash_.begin(), has_hash_.end(), 0);
  for (auto* links : {&parent_, &first_child_, &next_sibling_, &prev_sibling_})
    std::fill(links->begin(), links->end(), -1);
  if (events_enabled_) {
    KvEvent e;
    e.kind = KvEventKind::kAllBlocksCleared;
    e.medium = Medium::kNone;
    events_.push_back(std::move(e));
  }
}

std::vector<KvEvent> BlockPool::take_events() {
  std::vector<KvEvent> out;
  out.swap(events_);
  return out;
}

void BlockPool::check_tree_links(int32_t b) const {
  const std::string at = "cached forest at block " + std::to_string(b) + ": ";
  if (!has_hash_[b]) {
    check(parent_[b] < 0 && first_child_[b] < 0 && next_sibling_[b] < 0 && prev_sibling_[b] < 0,
          at + "an uncached block keeps links");
    return;
  }
  const int32_t p = parent_[b];
  if (p >= 0) check(has_hash_[p], at + "the parent is not cached (an orphan)");
  const int32_t prev = prev_sibling_[b], next = next_sibling_[b];
  check(prev >= 0 ? next_sibling_[prev] == b && parent_[prev] == p
                  : p < 0 || first_child_[p] == b, at + "broken sibling link");
  check(next < 0 || (prev_sibling_[next] == b && parent_[next] == p), at + "broken sibling link");
  if (first_child_[b] >= 0)
    check(parent_[first_child_[b]] == b && prev_sibling_[first_child_[b]] < 0,
          at + "broken child link");
}

std::vector<uint64_t> BlockPool::cached_hashes() const {
  std::vector<uint64_t> out;
  out.reserve(map_.size());
  map_.for_each([&](uint64_t h, int32_t) { out.push_back(h); });
  return out;
}

std::vector<int32_t> BlockPool::free_list() const {
  std::vector<int32_t> out;
  out.reserve(num_free_);
  for (int32_t b = free_head_; b >= 0; b = free_next_[b]) out.push_back(b);
  return out;
}

void BlockPool::check_invariants(std::span<const int32_t> expected_refs) const {
  // Free list: well linked, exactly the blocks with ref count 0, each once.
  std::vector<uint8_t> on_list(num_blocks_, 0);
  int32_t count = 0, prev = -1;
  for (int32_t b = free_head_; b >= 0; b = free_next_[b]) {
    check(b > kNullBlock && b < num_blocks_, "free list holds the null block or a bad id");
    check(!on_list[b], "block " + std::to_string(b) + " twice on the free list");
    check(free_prev_[b] == prev, "free list back link broken at block " + std::to_string(b));
    on_list[b] = 1;
    prev = b;
    check(++count <= num_blocks_, "free list cycles");
  }
  check(prev == free_tail_, "free list tail is wrong");
  check(count == num_free_, "free count " + std::to_string(num_free_) + " != list length " +
                                std::to_string(count));
  check(ref_count_[kNullBlock] == 0 && !has_hash_[kNullBlock],
        "the null block is held by a request or cached");
  if (!expected_refs.empty())
    check(expected_refs[kNullBlock] == 0, "a request table holds the null block");
  for (int32_t b = 1; b < num_blocks_; ++b) {
    check(ref_count_[b] >= 0, "negative ref count on block " + std::to_string(b));
    check((ref_count_[b] == 0) == (on_list[b] != 0),
          "block " + std::to_string(b) + " ref count " + std::to_string(ref_count_[b]) +
              (on_list[b] ? " but on the free list" : " but not on the free list"));
    if (!expected_refs.empty())
      check(ref_count_[b] == expected_refs[b],
            "block " + std::to_string(b) + " ref count " + std::to_string(ref_count_[b]) +
                " but held by " + std::to_string(expected_refs[b]) + " tables");
    if (has_hash_[b]) check(map_.find(hash_[b]) == b, "hashed block missing from the map");
    check_tree_links(b);
  }
  // Map: every entry names a block that carries that hash.
  int32_t entries = 0;
  map_.for_each([&](uint64_t h, int32_t b) {
    check(b >= 0 && b < num_blocks_, "map names an out-of-range block");
    check(has_hash_[b] && hash_[b] == h, "map entry disagrees with block " + std::to_string(b));
    ++entries;
  });
  check(entries == map_.size(), "map size is wrong");
  check(prefix_caching_ || entries == 0, "hashes cached with prefix caching off");
  // State slots: distinct and in range.
  std::vector<uint8_t> seen(num_state_slots_, 0);
  for (int32_t g : free_state_slots_) {
    check(g >= 0 && g < num_state_slots_ && !seen[g], "state slot free list is corrupt");
    seen[g] = 1;
  }
}

}  // namespace atom_sched
