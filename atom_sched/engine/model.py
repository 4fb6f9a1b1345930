"""A Llama-family decoder in plain torch with a paged KV cache.

RMSNorm, rotary position embeddings, grouped-query attention and a SwiGLU MLP, written to match
``transformers``' ``LlamaForCausalLM`` operation for operation (float32, the same rotary table and
normalisation order), so that greedy tokens agree with its ``generate``.

The KV cache is paged: per layer one key and one value tensor of shape
``[num_blocks, block_size, kv_heads, head_dim]``. A step's new keys and values are written at
``slot_mapping`` (flat slot = block * block_size + offset; -1 = padding, skipped) and attention
reads every row's context through its ``block_table``. No per-request dense cache exists.

The forward consumes exactly the tensors the device batch builder produces (:class:`ModelInputs`):
``input_ids``, ``positions``, ``seq_lens``, ``query_start_loc``, ``slot_mapping``,
``block_table`` and ``logits_indices``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaDims:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> LlamaDims:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"rope type {rope_type!r} is not supported by this engine")
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )


@dataclass
class ModelInputs:
    """One step's model inputs, as tensors on the model's device (names follow the device batch
    builder). ``T`` = tokens in the step, ``R`` = rows (requests), ``W`` = block-table width."""

    input_ids: torch.Tensor  # [T] int, the token at each position
    positions: torch.Tensor  # [T] int64, absolute position of each token
    seq_lens: torch.Tensor  # [R] int32, context length of each row after this step
    query_start_loc: torch.Tensor  # [R+1] int32, row r's tokens are [qsl[r], qsl[r+1])
    slot_mapping: torch.Tensor  # [T] int64, KV slot of each token (-1: padding, not written)
    block_table: torch.Tensor  # [R, W] int32, row -> KV block ids (batch order)
    logits_indices: torch.Tensor  # [N] int64, token indices whose logits are wanted
    max_seqlen_q: int  # max tokens of a row in this step
    max_seqlen_k: int  # max seq_len of a row in this step


class PagedKVCache:
    """Per layer: keys and values, each ``[num_blocks, block_size, kv_heads, head_dim]``."""

    def __init__(self, dims: LlamaDims, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        shape = (num_blocks, block_size, dims.num_kv_heads, dims.head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(dims.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(dims.num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """``(block_size, kv_heads, head_dim)``: one block of one layer's keys (or values)."""
        return tuple(self.k[0].shape[1:])

    def read_blocks(self, block_ids: list[int] | torch.Tensor) -> torch.Tensor:
        """The keys and values of ``block_ids`` in every layer, as one new contiguous tensor
        ``[num_layers, 2 (k, v), len(block_ids), block_size, kv_heads, head_dim]`` (for a KV
        transfer: prefill/decode disaggregation)."""
        ids = torch.as_tensor(block_ids, dtype=torch.long, device=self.k[0].device)
        out = torch.empty((len(self.k), 2, ids.numel(), *self.block_shape),
                          dtype=self.k[0].dtype, device=self.k[0].device)
        for li, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            torch.index_select(k, 0, ids, out=out[li, 0])
            torch.index_select(v, 0, ids, out=out[li, 1])
        return out

    def write_blocks(self, block_ids: list[int] | torch.Tensor, data: torch.Tensor) -> None:
        """Write ``data`` (laid out as :meth:`read_blocks` returns it) into ``block_ids``."""
        ids = torch.as_tensor(block_ids, dtype=torch.long, device=self.k[0].device)
        want = (len(self.k), 2, ids.numel(), *self.block_shape)
        if tuple(data.shape) != want:
            raise ValueError(f"KV data of shape {tuple(data.shape)}, expected {want}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise ValueError(f"block ids out of range [0, {self.num_blocks})")
        data = data.to(device=self.k[0].device, dtype=self.k[0].dtype)
        for li, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            k.index_copy_(0, ids, data[li, 0])
            v.index_copy_(0, ids, data[li, 1])


class _AttnMeta:
    """Index tensors shared by every layer of one step (built once per forward)."""

    def __init__(self, inp: ModelInputs, block_size: int, device: torch.device) -> None:
        qsl = inp.query_start_loc.to(torch.long)
        rows = qsl.numel() - 1
        num_tokens = int(inp.input_ids.numel())
        qlens = qsl[1:] - qsl[:-1]
        max_q = max(int(inp.max_seqlen_q), 1)
        max_k = max(int(inp.max_seqlen_k), 1)
        nblk = (max_k + block_size - 1) // block_size
        # Keys: row r's logical token j lives in slot block_table[r, j // bs] * bs + j % bs.
        bt = inp.block_table[:, :nblk].to(torch.long)
        offs = torch.arange(block_size, device=device)
        self.key_slots = (bt[:, :, None] * block_size + offs).reshape(rows, nblk * block_size)
        # Queries: a [R, max_q] grid of token indices; padding points at an extra zero row.
        ar = torch.arange(max_q, device=device)
        valid_q = ar[None, :] < qlens[:, None]
        q_index = torch.where(valid_q, qsl[:-1, None] + ar[None, :],
                              torch.full_like(valid_q, num_tokens, dtype=torch.long))
        self.q_index = q_index  # [R, max_q]
        self.valid_q_flat = valid_q.reshape(-1).nonzero().squeeze(1)
        q_pos = torch.zeros(rows, max_q, dtype=torch.long, device=device)
        q_pos[valid_q] = inp.positions.to(torch.long)
        # Causal mask over the paged context: key j is visible to a query at position p iff
        # j <= p (every key past a row's seq_len lies past all its query positions).
        keys = torch.arange(nblk * block_size, device=device)
        self.mask = (keys[None, None, :] <= q_pos[:, :, None])[:, None]  # [R, 1, max_q, K]
        sm = inp.slot_mapping.to(torch.long)
        keep = sm >= 0
        if bool(keep.all()):
            self.write_slots, self.write_rows = sm, None
        else:
            self.write_rows = keep.nonzero().squeeze(1)
            self.write_slots = sm[self.write_rows]
        self.rows, self.max_q, self.num_tokens = rows, max_q, num_tokens


class LlamaForCausalLM:
    """The forward pass (inference only, no autograd)."""

    def __init__(self, dims: LlamaDims, state: dict[str, torch.Tensor],
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self.dims = dims
        self.device = torch.device(device)
        self.dtype = dtype

        def w(name: str) -> torch.Tensor:
            return state[name].to(device=self.device, dtype=dtype).contiguous()

        self.embed = w("model.embed_tokens.weight")
        if dims.tie_word_embeddings or "lm_head.weight" not in state:
            self.lm_head = self.embed
        else:
            self.lm_head = w("lm_head.weight")
        self.norm = w("model.norm.weight")
        self.layers = []
        for i in range(dims.num_layers):
            p = f"model.layers.{i}."
            self.layers.append({
                "ln1": w(p + "input_layernorm.weight"),
                "ln2": w(p + "post_attention_layernorm.weight"),
                # q, k and v in one matmul; gate and up in one matmul.
                "qkv": torch.cat([w(p + "self_attn.q_proj.weight"),
                                  w(p + "self_attn.k_proj.weight"),
                                  w(p + "self_attn.v_proj.weight")]).contiguous(),
                "o": w(p + "self_attn.o_proj.weight"),
                "gate_up": torch.cat([w(p + "mlp.gate_proj.weight"),
                                      w(p + "mlp.up_proj.weight")]).contiguous(),
                "down": w(p + "mlp.down_proj.weight"),
            })
        # The rotary table, computed as transformers does (float32 outer product, then cos/sin).
        d = dims.head_dim
        inv_freq = 1.0 / (dims.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64)
                                              .to(torch.float) / d))
        t = torch.arange(dims.max_position_embeddings, dtype=torch.float)
        freqs = t[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=self.device, dtype=dtype)
        self.sin = emb.sin().to(device=self.device, dtype=dtype)
        self.scale = 1.0 / math.sqrt(d)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32)
        var = xf.pow(2).mean(-1, keepdim=True)
        return weight * (xf * torch.rsqrt(var + self.dims.rms_norm_eps)).to(x.dtype)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    @torch.inference_mode()
    def forward(self, inp: ModelInputs, cache: PagedKVCache) -> torch.Tensor:
        """Logits ``[len(logits_indices), vocab]`` (float32) for one step; writes the step's keys
        and values into ``cache``."""
        dims = self.dims
        H, KV, D = dims.num_heads, dims.num_kv_heads, dims.head_dim
        meta = _AttnMeta(inp, cache.block_size, self.device)
        ids = inp.input_ids.to(torch.long)
        pos = inp.positions.to(torch.long)
        cos = self.cos[pos][:, None, :]
        sin = self.sin[pos][:, None, :]
        x = self.embed[ids]
        T = x.shape[0]
        for li, layer in enumerate(self.layers):
            h = self._rms(x, layer["ln1"])
            qkv = h @ layer["qkv"].T
            q = qkv[:, : H * D].view(T, H, D)
            k = qkv[:, H * D: (H + KV) * D].view(T, KV, D)
            v = qkv[:, (H + KV) * D:].view(T, KV, D)
            q = q * cos + self._rotate_half(q) * sin
            k = k * cos + self._rotate_half(k) * sin
            attn = self._paged_attention(q, k, v, cache.k[li], cache.v[li], meta)
            x = x + attn @ layer["o"].T
            h = self._rms(x, layer["ln2"])
            gu = h @ layer["gate_up"].T
            g, u = gu.split(dims.intermediate_size, dim=-1)
            x = x + (F.silu(g) * u) @ layer["down"].T
        idx = inp.logits_indices.to(torch.long)
        x = self._rms(x[idx], self.norm)
        return (x @ self.lm_head.T).float()

    __call__ = forward

    def _paged_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: _AttnMeta) -> torch.Tensor:
        H, KV, D = self.dims.num_heads, self.dims.num_kv_heads, self.dims.head_dim
        kflat = k_cache.view(-1, KV, D)
        vflat = v_cache.view(-1, KV, D)
        # Write this step's keys and values through slot_mapping (padding slots skipped) ...
        if meta.write_rows is None:
            kflat.index_copy_(0, meta.write_slots, k)
            vflat.index_copy_(0, meta.write_slots, v)
        else:
            kflat.index_copy_(0, meta.write_slots, k[meta.write_rows])
            vflat.index_copy_(0, meta.write_slots, v[meta.write_rows])
        # ... then read every row's context through its block table.
        keys = kflat[meta.key_slots].permute(0, 2, 1, 3)  # [R, KV, K, D]
        vals = vflat[meta.key_slots].permute(0, 2, 1, 3)
        qpad = torch.cat([q, q.new_zeros(1, H, D)])[meta.q_index]  # [R, max_q, H, D]
        out = F.scaled_dot_product_attention(qpad.permute(0, 2, 1, 3), keys, vals,
                                             attn_mask=meta.mask, scale=self.scale,
                                             enable_gqa=KV != H)  # [R, H, max_q, D]
        out = out.permute(0, 2, 1, 3).reshape(meta.rows * meta.max_q, H * D)
        if out.shape[0] == meta.num_tokens:  # no query padding (e.g. every row 1 token)
            return out
        return out[meta.valid_q_flat]
