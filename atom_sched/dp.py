"""Data-parallel prefill coordination: ATOM's PrefillDelayer over a torch.distributed group.

Data-parallel ranks run their forwards in lock step (MoE all-to-all, attention DP). A rank that
prefills while the others decode stalls them all, so ranks agree each step whether to prefill:
every rank reports, in one all-reduce (MAX) of four int64 slots, whether it has a prefill it
could admit, whether it is under the KV low watermark (force), and whether it is ready / not
ready to prefill in alignment. When some ranks could prefill but not all are ready, prefill is
delayed (those ranks decode) for at most ``max_delay_passes`` steps or ``max_delay_ms``.

This is the 4-slot protocol of ATOM commit f097c0766 that ATOM's seed scheduler expects
(shared/spec/atom-scheduler-behaviour.md section 5.3). ``schedule_dp`` is the step entry point:
it asks the scheduler for its readiness, runs the all-reduce on every call (idle ranks too), and
passes a veto to ``Scheduler.schedule(allow_prefill=False)``, which then never turns a partial
prefill into a decode row (ATOM bug 8.3).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

__all__ = ["PrefillDelayer", "schedule_dp"]


class PrefillDelayer:
    """Decides, in agreement with every rank of ``group``, whether this step may prefill.

    ``group`` is a torch.distributed process group whose backend can all-reduce CPU tensors
    (gloo); None means the default group. ``clock`` returns seconds (tests inject a fake one).
    """

    def __init__(
        self,
        group: Any = None,
        *,
        max_delay_passes: int = 30,
        token_usage_low_watermark: float | None = None,
        max_delay_ms: float = 5000.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if max_delay_passes < 0:
            raise ValueError("max_delay_passes must be >= 0")
        if max_delay_ms < 0:
            raise ValueError("max_delay_ms must be >= 0")
        if token_usage_low_watermark is not None and not 0.0 <= token_usage_low_watermark <= 1.0:
            raise ValueError("token_usage_low_watermark must be in [0, 1]")
        self.group = group
        self.max_delay_passes = max_delay_passes
        self.token_usage_low_watermark = token_usage_low_watermark
        self.max_delay_ms = max_delay_ms
        self._clock = clock
        self._skip_first = True
        self._delayed_count = 0
        self._delay_start = 0.0
        self.last_decision = ""
        self.decisions: Counter[str] = Counter()

    def should_allow_prefill(
        self,
        local_prefillable: bool,
        token_usage: float,
        local_alignment_ready: bool | None = None,
    ) -> bool:
        """One all-reduce; returns whether this rank may prefill this step."""
        import torch
        import torch.distributed as dist

        if local_alignment_ready is None:
            local_alignment_ready = local_prefillable
        force = (
            self.token_usage_low_watermark is not None
            and local_prefillable
            and token_usage < self.token_usage_low_watermark
        )
        slots = torch.tensor(
            [int(local_prefillable), int(force), int(local_alignment_ready),
             int(not local_alignment_ready)],
            dtype=torch.int64,
        )
        dist.all_reduce(slots, op=dist.ReduceOp.MAX, group=self.group)
        any_prefillable, force_max, any_ready, any_not_ready = (bool(v) for v in slots.tolist())
        all_ready = any_ready and not any_not_ready

        if force_max:
            return self._allow("watermark")
        if self._skip_first:
            self._skip_first = False
            return self._allow("first")
        if not any_prefillable:
            return self._allow("none")
        if all_ready:
            return self._allow("all")
        # Mixed: some rank could prefill but not every rank is ready.
        if self._delayed_count == 0:
            self._delay_start = self._clock()
        elapsed_ms = (self._clock() - self._delay_start) * 1000.0
        if self._delayed_count >= self.max_delay_passes:
            return self._allow("max_passes")
        if elapsed_ms >= self.max_delay_ms:
            return self._allow("timeout")
        self._delayed_count += 1
        self._record("delayed")
        return False

    def _allow(self, reason: str) -> bool:
        self._delayed_count = 0
        self._record(reason)
        return True

    def _record(self, reason: str) -> None:
        self.last_decision = reason
        self.decisions[reason] += 1


def schedule_dp(scheduler: Any, delayer: PrefillDelayer, *, enable_tbo: bool = False,
                now: float | None = None) -> Any:
    """``scheduler.schedule()`` under the delayer's verdict. Call it every step on every rank,
    idle or not: each call performs exactly one all-reduce. With two-batch overlap (TBO) a rank
    is ready only when two prefills can be admitted."""
    required = 2 if enable_tbo else 1
    count = scheduler.count_admittable_head_prefills(required)
    allow = delayer.should_allow_prefill(count > 0, scheduler.kv_usage, count >= required)
    return scheduler.schedule(allow_prefill=allow, now=now)
