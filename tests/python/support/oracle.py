"""The oracle: a request's complete output and finish reason under the fixed stop semantics of
docs/api.md (earliest stop wins, stop sequences over generated tokens only, then the length rules
max_tokens, max_model_len, kv_capacity), ATOM's static rejections, and the length limits."""

from __future__ import annotations

from dataclasses import dataclass

from atom_sched import SamplingParams, SchedulerConfig

from .fake_model import FakeModel


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class ReqInfo:
    prompt: list[int]
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    stop_ids: list[int]
    stop_seqs: list[list[int]]
    logprobs: bool
    temperature: float
    top_k: int
    top_p: float


def req_info(prompt: list[int], sp: SamplingParams | None) -> ReqInfo:
    sp = sp if sp is not None else SamplingParams()
    return ReqInfo(
        prompt=list(prompt),
        max_tokens=int(sp.max_tokens),
        min_tokens=int(sp.min_tokens),
        ignore_eos=bool(sp.ignore_eos),
        stop_ids=[int(x) for x in sp.stop_token_ids],
        stop_seqs=[[int(x) for x in s] for s in sp.stop_token_sequences],
        logprobs=bool(sp.logprobs),
        temperature=float(sp.temperature),
        top_k=int(sp.top_k),
        top_p=float(sp.top_p),
    )


def expected_output(
    model: FakeModel, rid: int, info: ReqInfo, cfg: SchedulerConfig
) -> tuple[list[int], str]:
    """The full output and finish reason of request `rid` under docs/api.md's stop semantics."""
    stop_ids = set(int(x) for x in cfg.stop_token_ids) | set(info.stop_ids)
    eos = int(cfg.eos_token_id)
    max_len = int(cfg.max_model_len)
    pool_positions = usable_blocks(cfg) * int(cfg.block_size)
    out: list[int] = []
    g = 0
    while True:
        t = model.token(rid, g)
        out.append(t)
        g += 1
        if len(out) >= info.min_tokens:  # before min_tokens only the length rules stop
            if any(len(out) >= len(s) and out[-len(s) :] == s for s in info.stop_seqs):
                return out, "stop_sequence"
            if eos >= 0 and t == eos and not info.ignore_eos:
                return out, "eos"
            if t in stop_ids:
                return out, f"stop_{t}"
        if len(out) >= info.max_tokens:
            return out, "max_tokens"
        if len(info.prompt) + len(out) >= max_len:
            return out, "max_model_len"
        if len(info.prompt) + len(out) > pool_positions:
            return out, "kv_capacity"


def usable_blocks(cfg: SchedulerConfig) -> int:
    """Blocks requests can hold: all ids but the null block (docs/design.md, block-table
    contract)."""
    return int(cfg.num_blocks) - 1


def final_length(info: ReqInfo, cfg: SchedulerConfig) -> int:
    """The token count at which a length rule (max_tokens, max_model_len, kv_capacity) ends a
    request, whatever its tokens."""
    return min(
        len(info.prompt) + info.max_tokens,
        int(cfg.max_model_len),
        usable_blocks(cfg) * int(cfg.block_size) + 1,
    )


def position_limit(cfg: SchedulerConfig) -> int:
    """Every scheduled position is below this: min(max_model_len, the pool's positions)."""
    return min(int(cfg.max_model_len), usable_blocks(cfg) * int(cfg.block_size))


def rejection_reason(n: int, cfg: SchedulerConfig) -> str | None:
    """ATOM's static rejection of a prompt of `n` tokens (docs/api.md policy item 5)."""
    if n > cfg.max_model_len:
        return (
            f"unschedulable: input tokens={n} > max_model_len={cfg.max_model_len}. "
            "Increase max_model_len or shorten the prompt."
        )
    if not cfg.enable_chunked_prefill and n > cfg.max_num_batched_tokens:
        return (
            f"unschedulable: input tokens={n} > max_num_batched_tokens="
            f"{cfg.max_num_batched_tokens}. Increase max_num_batched_tokens, enable chunked "
            "prefill, or shorten the prompt."
        )
    nb = cdiv(n, cfg.block_size)
    if nb > usable_blocks(cfg):
        return (
            f"unschedulable: needs {nb} KV blocks for {n} input tokens > the pool's "
            f"{usable_blocks(cfg)} (num_blocks={cfg.num_blocks} less the null block). Shorten the "
            "prompt or increase num_blocks."
        )
    return None
