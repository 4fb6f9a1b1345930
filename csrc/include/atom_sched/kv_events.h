// KV-cache events, in the shape of vLLM's/ATOM's KV-event wire format (see docs and
// shared/spec/kv-events-wire.md). The pool appends them; the engine drains them once per step.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace atom_sched {

enum class KvEventKind : uint8_t { kBlockStored, kBlockRemoved, kAllBlocksCleared };

/// Where the KV of the blocks lives. kNone is only used by AllBlocksCleared (nil on the wire).
enum class Medium : uint8_t { kNone, kGpu, kCpu, kDisk, kRemote };

[[nodiscard]] const char* medium_name(Medium m) noexcept;  // "GPU", ...; nullptr for kNone

struct KvEvent {
  KvEventKind kind = KvEventKind::kBlockStored;
  std::vector<uint64_t> block_hashes;          // Stored / Removed
  std::optional<uint64_t> parent_block_hash;   // Stored: hash of the block before the first one
  std::vector<int32_t> token_ids;              // Stored: the tokens of all the blocks, in order
  int32_t block_size = 0;                      // Stored
  Medium medium = Medium::kGpu;
  // Stored: the extra keys the blocks were hashed under (SamplingParams; empty: none). The salt
  // is an extra key of a sequence's first block only: of this event's first block when
  // parent_block_hash is empty.
  std::string lora_name;
  std::string cache_salt;
};

}  // namespace atom_sched
