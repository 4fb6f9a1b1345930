// The paged KV-cache block pool and its prefix cache.
//
// Blocks are reference counted. A block with ref count 0 is on the free list, an intrusive doubly
// linked list over block ids kept in LRU order (allocation takes the head, frees go to the tail),
// so taking, returning and removing a block on a cache hit are O(1) and the list never holds a
// block twice (ATOM's deque with stale duplicates, bug 8.29, is gone).
//
// Prefix cache: the chained hash of a full block (block_hash() in xxhash64.h) maps to the block
// that holds that content. A freed block keeps its hash ("free-cached") and is evicted lazily,
// when it is handed out fresh. Hashes are published only after the forward that computed the
// blocks (publish()), never at allocation. A lookup also compares the stored tokens, so a hash
// collision is never a hit.
//
// The cached set is a forest, as KV-aware routers see it: a block is cached only if its parent
// (the block before it in the sequence) is, and forgetting a block forgets its cached descendants
// first (one BlockRemoved each, leaves first). So a router that applies our events holds exactly
// the blocks a prefix lookup can reach: no orphan whose parent was evicted, and no BlockStored
// after a reset that names a parent the routers have cleared.
//
// Per-request state slots (linear-attention/Mamba state) are a separate pool of slot ids.
//
// Not thread-safe: one thread owns the pool (the scheduler's).
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "atom_sched/flat_hash_map.h"
#include "atom_sched/kv_events.h"

namespace atom_sched {

/// The null block (docs/design.md, "block-table contract"): never allocated, never cached; every
/// block-table entry past a request's blocks holds it, so a kernel that reads or writes through a
/// padded entry touches this scratch block, never a live request's KV. An engine sizes its KV
/// cache for all num_blocks ids; num_blocks - 1 of them hold requests.
inline constexpr int32_t kNullBlock = 0;

class BlockPool {
 public:
  /// num_blocks >= 2 (block 0 is the null block), block_size > 0, num_state_slots >= 0. Throws
  /// InvalidArgument otherwise. `recompute_last_hit`: can_allocate gives back a hit's last block
  /// (SchedulerConfig::recompute_last_hit_block).
  BlockPool(int32_t num_blocks, int32_t block_size, bool enable_prefix_caching, bool enable_events,
            int32_t num_state_slots = 0, bool recompute_last_hit = false);

  /// Block ids 0..num_blocks-1, the null block included.
  [[nodiscard]] int32_t num_blocks() const noexcept { return num_blocks_; }
  /// Blocks that can hold requests: num_blocks - 1 (all but the null block).
  [[nodiscard]] int32_t num_usable_blocks() const noexcept { return num_blocks_ - 1; }
  [[nodiscard]] int32_t block_size() const noexcept { return block_size_; }
  [[nodiscard]] int32_t num_free_blocks() const noexcept { return num_free_; }
  [[nodiscard]] int32_t num_used_blocks() const noexcept {
    return num_usable_blocks() - num_free_;
  }
  /// Fraction of the usable blocks in use, in [0, 1].
  [[nodiscard]] double usage() const noexcept;
  [[nodiscard]] bool prefix_caching() const noexcept { return prefix_caching_; }
  [[nodiscard]] int32_t num_free_state_slots() const noexcept {
    return static_cast<int32_t>(free_state_slots_.size());
  }
  [[nodiscard]] int32_t num_state_slots() const noexcept { return num_state_slots_; }

  /// Number of leading blocks of a token sequence found in the prefix cache. `hashes[i]` is the
  /// chain hash of block i (tokens[i*bs, (i+1)*bs)); only the first `max_blocks` are probed. Pure.
  [[nodiscard]] int32_t count_cached_blocks(std::span<const uint64_t> hashes,
                                            std::span<const int32_t> tokens,
                                            int32_t max_blocks) const;

  /// ATOM's can_allocate for a request of `num_tokens` tokens: the number of leading cached blocks
  /// (>= 0) if the whole request fits now with `reserve` blocks still free after it, else -1. The
  /// last block is never a cache hit (so prefill always computes at least one token), nor, with
  /// `recompute_last_hit`, the last block that would otherwise be one: `hashes`
  /// must hold the chain hashes of at least min(full blocks, ceil(num_tokens/bs) - 1) blocks when
  /// prefix caching is on. Pure.
  [[nodiscard]] int32_t can_allocate(std::span<const uint64_t> hashes,
                                     std::span<const int32_t> tokens, int32_t num_tokens,
                                     bool needs_state_slot, int32_t reserve = 0) const;

  /// Gives a request blocks for `num_tokens` tokens: the first `num_cached_blocks` are the cache
  /// hits can_allocate found (shared, ref count + 1), the rest fresh (lazily evicting their old
  /// hash). Appends the ids to `table`, which must be empty. Call right after can_allocate says
  /// yes.
  void allocate(std::span<const uint64_t> hashes, int32_t num_cached_blocks, int32_t num_tokens,
                std::vector<int32_t>& table);

  /// Appends fresh blocks to `table` until it holds `target_blocks`. Returns false, changing
  /// nothing, if the free list is too short.
  bool grow(std::vector<int32_t>& table, int32_t target_blocks);

  /// Releases a request's blocks, last block first, so its prefix stays cached longest.
  void free(std::span<const int32_t> table);

  /// Registers blocks [first_block, end_block) of a request as computed: `hashes[i]` is the chain
  /// hash of block i, tokens[i*bs, (i+1)*bs) its content. A hash that is already cached (the same
  /// content computed twice) is not registered again and records no event; nor is a block whose
  /// parent hash (block i-1's) is not cached, nor any block after it. Records one BlockStored per
  /// run of newly registered blocks, labelled with the extra keys the hashes were made under.
  void publish(std::span<const int32_t> table, std::span<const uint64_t> hashes,
               std::span<const int32_t> tokens, int32_t first_block, int32_t end_block,
               std::string_view lora_name = {}, std::string_view cache_salt = {});

  /// A hint ahead of publish(): requests the prefix cache's lines where registering `hash`
  /// will probe. Changes nothing (with prefix caching off the map is empty and this is moot).
  void prefetch_publish(uint64_t hash) const noexcept { map_.prefetch(hash); }

  /// Takes a free state slot (the most recently released one), or returns -1 if none is free.
  int32_t take_state_slot();
  void release_state_slot(int32_t slot);

  /// Forgets every cached hash (live blocks included) and records AllBlocksCleared. A live
  /// request's later blocks are not cached afterwards (their parents are gone).
  void reset_prefix_cache();

  /// Moves the recorded events out. Empty when events are disabled.
  [[nodiscard]] std::vector<KvEvent> take_events();
  [[nodiscard]] bool events_enabled() const noexcept { return events_enabled_; }

  /// Throws InvariantViolation if the free list, the ref counts or the hash map disagree.
  /// `expected_refs[b]`, if given, is the number of request tables that hold block b.
  void check_invariants(std::span<const int32_t> expected_refs = {}) const;

  // Introspection (tests, stats).
  [[nodiscard]] int32_t ref_count(int32_t block) const { return ref_count_.at(block); }
  [[nodiscard]] bool is_cached(int32_t block) const { return has_hash_.at(block) != 0; }
  [[nodiscard]] int32_t cached_block(uint64_t hash) const;  // -1 if the hash is not cached
  [[nodiscard]] int32_t num_cached_hashes() const noexcept { return map_.size(); }
  /// Every hash in the prefix cache (unordered). O(capacity).
  [[nodiscard]] std::vector<uint64_t> cached_hashes() const;
  /// Block ids of the free list, head (next to be handed out) first. O(free blocks).
  [[nodiscard]] std::vector<int32_t> free_list() const;

 private:
  /// count_cached_blocks(), also counting in `shared` the hits a live request holds.
  int32_t leading_hits(std::span<const uint64_t> hashes, std::span<const int32_t> tokens,
                       int32_t max_blocks, int32_t& shared) const;
  int32_t pop_free_head();       // takes the LRU block off the free list, evicting its hash
  void unlink_free(int32_t b);   // removes b from the free list
  void push_free_tail(int32_t b);
  void forget_hash(int32_t b);   // drops b's and its descendants' hashes, recording BlockRemoved
  void forget_leaf(int32_t b);   // drops the hash of b, which has no cached child
  [[nodiscard]] bool tokens_match(int32_t block, std::span<const int32_t> tokens) const;
  void check_tree_links(int32_t b) const;  // throws InvariantViolation

  int32_t num_blocks_;
  int32_t block_size_;
  bool prefix_caching_;
  bool events_enabled_;
  bool recompute_last_hit_;
  int32_t num_state_slots_;

  std::vector<int32_t> ref_count_;
  std::vector<int32_t> free_prev_, free_next_;  // intrusive free list; -1 ends it
  int32_t free_head_ = -1, free_tail_ = -1, num_free_ = 0;
  std::vector<uint64_t> hash_;      // valid where has_hash_
  std::vector<uint8_t> has_hash_;   // block is registered in map_
  std::vector<int32_t> block_tokens_;  // num_blocks * block_size: content of registered blocks
  // The cached forest, over block ids (-1: none): each registered block's parent and its
  // registered children as an intrusive doubly linked list.
  std::vector<int32_t> parent_, first_child_, next_sibling_, prev_sibling_;
  FlatHashMap map_;
  std::vector<int32_t> free_state_slots_;
  std::vector<KvEvent> events_;
};

}  // namespace atom_sched
