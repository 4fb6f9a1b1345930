"""DeviceBatchBuilder: a batch's model inputs built on the device, and the speculative-decoding
bookkeeping after sampling (DESIGN.md section 6; the kernels are in ``hip/``).

The builder keeps each request slot's block-table row, computed length, last sampled token and
drafts in device memory. Each step it uploads a small plan (16 bytes per decode row, plus the
prompt tokens of prefill rows and a 12-byte record per new KV block) in one copy, and two
kernels write ``input_ids``, ``positions``, ``slot_mapping``, ``seq_lens``, ``query_start_loc``,
``cu_seqlens_k``, the batch-ordered ``block_table`` and the logits indices, padded for a captured
CUDA/HIP graph. After sampling, ``accept`` verifies the drafts, rolls the computed lengths back
and copies a compact result to pinned host memory for ``Scheduler.update``. No step waits for the
device.

On CPU tensors (``device="cpu"``) the same calls run the kernels' C++ references, so an engine
written against the builder runs unchanged on a laptop; with the ``hip-cpu`` build of the module
(``ATOM_SCHED_GPU=HIP_CPU``, docs/device.md) they launch the real kernels instead, executed on the
host by AMD's HIP CPU Runtime, for which CPU memory is device memory (``runs_kernels``)::

    builder = DeviceBatchBuilder(config, device="cuda")
    batch = sched.schedule()
    inputs = builder.prepare(batch)                     # device tensors
    target = sample(model(inputs.input_ids, inputs.positions, ...)[inputs.spec_logits_indices])
    result = builder.accept(batch, target, next_drafts)  # before the next prepare()
    out = sched.update(batch, **result)                  # waits for the result's copy only

The builder assumes one stream: every call enqueues on the current stream of its device, and
``accept`` for a batch must be called before ``prepare`` of the next one (it reads that batch's
plan on the device). torch is imported when a builder is created, so ``import atom_sched`` works
without it. The compiled module never links libtorch: it receives pointers and the stream as ints.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _core

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["AcceptResult", "DeviceBatchBuilder", "DeviceInputs"]

RESULT_HEADER_WORDS = int(_core.DEVICE_RESULT_HEADER_WORDS)
# Error bits of the device state -> what they mean (hip/atom_sched_kernels.h).
ERROR_NAMES: dict[int, str] = dict(_core.DEVICE_ERROR_BITS)


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "DeviceBatchBuilder needs torch (pip install 'atom-sched[test]' or torch itself)"
        ) from e
    return torch


def _decode_only(batch: Any) -> bool:
    """No prefill row (is_prefill says every row is one; a mixed batch holds both kinds)."""
    return not batch.is_prefill and not np.asarray(batch.row_is_prefill).any()


def describe_errors(bits: int) -> str:
    """Human-readable names of device error bits."""
    names = [name for bit, name in ERROR_NAMES.items() if bits & bit]
    return "; ".join(names) if names else "none"


@dataclass(frozen=True)
class DeviceInputs:
    """One step's model inputs on the builder's device. The tensors are views of buffers the
    builder reuses: valid until the next ``prepare``. Rows past ``num_rows`` and tokens past
    ``num_tokens`` are padding (slot_mapping -1, seq_len 0, query_start_loc repeating its total)."""

    batch_id: int
    is_prefill: bool
    num_rows: int
    num_tokens: int
    num_rows_padded: int
    num_tokens_padded: int
    max_seqlen_q: int  # host values: exact for q; for k exact unless the batch is not row_exact
    max_seqlen_k: int
    input_ids: torch.Tensor  # int32 [num_tokens_padded]
    positions: torch.Tensor  # int64 [num_tokens_padded]
    slot_mapping: torch.Tensor  # int64 [num_tokens_padded]
    seq_lens: torch.Tensor  # int32 [num_rows_padded] (context_lens)
    query_start_loc: torch.Tensor  # int32 [num_rows_padded + 1] (cu_seqlens_q)
    cu_seqlens_k: torch.Tensor  # int32 [num_rows_padded + 1]
    block_table: torch.Tensor  # int32 [num_rows_padded, block_table_width]
    logits_indices: torch.Tensor  # int32 [num_rows_padded]: each row's last token
    spec_logits_indices: torch.Tensor  # int32 [num_rows_padded, K + 1]: tokens to verify
    # int64 [rows that emit]: the rows whose logits are needed (a prefill chunk that does not
    # finish its prompt samples nothing), for a runner that computes logits for those only.
    sample_rows: torch.Tensor

    @property
    def context_lens(self) -> torch.Tensor:
        return self.seq_lens

    @property
    def cu_seqlens_q(self) -> torch.Tensor:
        return self.query_start_loc

    @property
    def bonus_logits_indices(self) -> torch.Tensor:
        """ATOM's ``cu_seqlens_q - 1`` (the last token of each row)."""
        return self.logits_indices

    @property
    def target_logits_indices(self) -> torch.Tensor:
        """[num_rows_padded, K]: the tokens whose logits verify drafts 1..K."""
        return self.spec_logits_indices[:, :-1]


class AcceptResult:
    """The outputs of one step for ``Scheduler.update``, in (pinned) host memory.

    ``sampled_token_ids`` [rows, K+1] (-1 past the accepted tokens), ``num_accepted`` [rows] and
    ``draft_token_ids`` [rows, K] (None when K == 0) are numpy views of a buffer the builder
    reuses two accepts later. On a GPU they are filled by an asynchronous copy:
    ``synchronize()`` (or ``update_kwargs()``) waits for it. ``device_tokens`` and
    ``device_num_accepted`` are the same values on the device, for a drafter."""

    def __init__(
        self,
        batch_id: int,
        num_rows: int,
        k: int,
        host: np.ndarray,
        device: torch.Tensor,
        event: Any,
        drafts_pending: bool,
        buf: int = 0,
    ) -> None:
        self.batch_id = batch_id
        self._buf = buf
        self.num_rows = num_rows
        self.k = k
        n, w = num_rows, k + 1
        h = RESULT_HEADER_WORDS
        self._host = host
        self._event = event
        self.drafts_pending = drafts_pending
        self.sampled_token_ids: np.ndarray = host[h : h + n * w].reshape(n, w)
        self.num_accepted: np.ndarray = host[h + n * w : h + n * (w + 1)]
        self.draft_token_ids: np.ndarray | None = (
            host[h + n * (w + 1) : h + n * (w + 1 + k)].reshape(n, k) if k > 0 else None
        )
        self.device_tokens = device[h : h + n * w].view(n, w)
        self.device_num_accepted = device[h + n * w : h + n * (w + 1)]

    def ready(self) -> bool:
        """True when the host arrays hold the result (never blocks)."""
        return not self.drafts_pending and (self._event is None or self._event.query())

    def synchronize(self) -> None:
        """Waits for the copy of the result to host memory."""
        if self.drafts_pending:
            raise RuntimeError(
                "the drafts of this step are still missing: call DeviceBatchBuilder.store_drafts"
            )
        if self._event is not None:
            self._event.synchronize()

    @property
    def errors(self) -> int:
        """Sticky device error bits as of this step (0 when all is well)."""
        self.synchronize()
        return int(self._host[1])

    # A mapping of update()'s keyword arguments, so ``sched.update(batch, **result)`` works.
    def keys(self) -> tuple[str, ...]:
        return ("sampled_token_ids", "num_accepted", "draft_token_ids")

    def __getitem__(self, key: str) -> Any:
        return self.update_kwargs()[key]

    def update_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``Scheduler.update(batch, **kwargs)``. Waits for the copy; raises
        DeviceError if the device saw a bad plan."""
        self.synchronize()
        bits = int(self._host[1])
        if bits:
            raise _core.DeviceError(f"device state reports errors: {describe_errors(bits)}")
        return {
            "sampled_token_ids": self.sampled_token_ids,
            "num_accepted": self.num_accepted,
            "draft_token_ids": self.draft_token_ids,
        }


def _on_builder_device(method: Any) -> Any:
    """Runs a builder method with the builder's GPU current, so that a builder on cuda:1 never
    launches on (or allocates from) whichever device the caller has current."""

    @functools.wraps(method)
    def guarded(self: DeviceBatchBuilder, *args: Any, **kwargs: Any) -> Any:
        if not self.on_device:
            return method(self, *args, **kwargs)
        with self._torch.cuda.device(self.device):
            return method(self, *args, **kwargs)

    return guarded


def _runs_kernels(on_device: bool, kernels: bool | None) -> bool:
    """Whether a builder launches the kernels (True) or runs their CPU references (False).

    A GPU always launches the kernels. On CPU tensors only the hip-cpu build can: its kernels run
    on the host, CPU memory is its device memory, and every launch has completed on return."""
    if kernels is not None and not isinstance(kernels, bool):
        raise TypeError(f"kernels must be True, False or None, got {type(kernels).__name__}")
    if on_device:
        if kernels is False:
            raise ValueError("kernels=False needs device='cpu' (the references run on the CPU)")
        return True
    hip_cpu = _core.device_backend() == "hip-cpu" and _core.device_count() > 0
    if kernels and not hip_cpu:
        raise _core.DeviceError(
            "kernels=True on device='cpu' needs the hip-cpu build of atom_sched "
            f"(ATOM_SCHED_GPU=HIP_CPU); this one is '{_core.device_backend()}'"
        )
    return hip_cpu if kernels is None else kernels


class DeviceBatchBuilder:
    """Builds each batch's model inputs on ``device`` from persistent per-slot state.

    ``config`` is the Scheduler's config (its ``max_num_seqs`` slots, block size, table width
    and K). ``capture_sizes``: padded row counts for decode batches (the smallest one that fits
    is used, as a graph runner needs); without it nothing is padded unless ``prepare`` is told.
    ``cuda_graphs``: replay the prepare kernels of decode batches from a captured graph per
    padded size (GPU only; captured the second time a size is seen).
    ``kernels``: on CPU tensors, launch the kernels (True: needs the ``hip-cpu`` build) or run
    their C++ references (False); None (default): the kernels when this build can run them on
    ``device`` (a GPU, or the CPU with ``hip-cpu``). ``runs_kernels`` tells which.
    """

    def __init__(
        self,
        config: Any,
        device: Any = "cpu",
        *,
        capture_sizes: list[int] | tuple[int, ...] | None = None,
        cuda_graphs: bool = False,
        kernels: bool | None = None,
    ) -> None:
        torch = _torch()
        self._torch = torch
        self.device = torch.device(device)
        self.on_device = self.device.type != "cpu"
        if self.on_device:
            if self.device.type != "cuda":
                raise ValueError(f"device must be 'cpu' or a CUDA/ROCm device, got {device!r}")
            if _core.device_backend() == "hip-cpu":
                raise _core.DeviceError(
                    "this atom_sched build (hip-cpu) has no GPU back end: its kernels run on the "
                    "CPU, use device='cpu'"
                )
            if _core.device_backend() == "none":
                raise _core.DeviceError(
                    "this atom_sched build has no GPU back end (build with ATOM_SCHED_GPU=CUDA "
                    "or HIP); use device='cpu' for the CPU reference path"
                )
            if not torch.cuda.is_available():
                raise _core.DeviceError("torch sees no GPU; use device='cpu'")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
        self.runs_kernels = _runs_kernels(self.on_device, kernels)
        self.k = int(config.num_speculative_tokens)
        self.block_size = int(config.block_size)
        self.num_slots = int(config.max_num_seqs)
        self.width = int(config.max_blocks_per_request)
        sizes = sorted({int(s) for s in (capture_sizes or ())})
        if sizes and sizes[0] < 1:
            raise ValueError("capture sizes must be >= 1")
        self.capture_sizes = sizes
        self.max_rows = max([self.num_slots, *sizes])
        self.max_tokens = max(int(config.max_num_batched_tokens), self.max_rows * (self.k + 1))
        # Worst case of one step: every row ships its whole table (an admitted row ships its
        # prefix-hit blocks too, and many rows can share them), so no cap by the pool's size.
        max_updates = self.max_rows * self.width
        self.plan_capacity = int(
            _core.device_plan_words(self.max_rows, max_updates, self.max_tokens)
        )
        self.result_capacity = int(_core.device_result_words(self.max_rows, self.k))
        self.cuda_graphs = bool(cuda_graphs) and self.on_device
        self.host_waits = 0  # times the host had to wait for the device (0 in steady state)
        self.last_plan_bytes = 0  # bytes the last prepare uploaded

        dev, i32 = self.device, torch.int32
        zeros = lambda *shape, dtype=i32: torch.zeros(shape, dtype=dtype, device=dev)  # noqa: E731
        # Persistent per-slot state.
        self._block_table = zeros(self.num_slots, self.width)
        self._computed = zeros(self.num_slots)
        self._last_token = zeros(self.num_slots)
        self._drafts = zeros(self.num_slots, max(self.k, 1))
        self._errors = zeros(1)
        self._state = _core.DeviceSlotState(
            block_table=self._block_table.data_ptr(),
            computed=self._computed.data_ptr(),
            last_token=self._last_token.data_ptr(),
            drafts=self._drafts.data_ptr(),
            errors=self._errors.data_ptr(),
            num_slots=self.num_slots,
            width=self.width,
            k=self.k,
            block_size=self.block_size,
            plan_words=self.plan_capacity,
        )
        # Outputs (capacity-sized; each step returns views of their prefixes).
        R, T = self.max_rows, self.max_tokens
        self._out = {
            "input_ids": zeros(T),
            "positions": zeros(T, dtype=torch.int64),
            "slot_mapping": zeros(T, dtype=torch.int64),
            "seq_lens": zeros(R),
            "query_start_loc": zeros(R + 1),
            "cu_seqlens_k": zeros(R + 1),
            "block_table": zeros(R, self.width),
            "logits_indices": zeros(R),
            "spec_logits_indices": zeros(R, self.k + 1),
            "meta": zeros(8),
        }
        self._outputs = _core.DeviceStepInputs(**{k: v.data_ptr() for k, v in self._out.items()})
        # Plan: two host buffers (pinned on a GPU, so the upload is asynchronous) and, on a GPU,
        # one device buffer that every prepare reads (a captured graph needs a fixed address).
        pin = self.on_device
        self._plan_host = torch.zeros((2, self.plan_capacity), dtype=i32, pin_memory=pin)
        self._plan_host_ptr = [int(self._plan_host[i].data_ptr()) for i in range(2)]
        self._plan_dev = zeros(self.plan_capacity) if self.on_device else None
        self._plan_events: list[Any] = [None, None]
        # Results: two device buffers and two host buffers (the same memory on the CPU).
        self._result_dev = zeros(2, self.result_capacity)
        self._result_host = (
            torch.zeros((2, self.result_capacity), dtype=i32, pin_memory=True)
            if self.on_device
            else self._result_dev
        )
        self._result_np = [self._result_host[i].numpy() for i in range(2)]
        self._result_events: list[Any] = [None, None]
        self._views: dict[tuple[int, int], dict[str, Any]] = {}
        self._graphs: dict[tuple[int, int], Any] = {}
        self._graph_seen: set[tuple[int, int]] = set()
        self._step = 0
        self._accepts = 0
        self._last: tuple[int, int, int, int] | None = None  # batch id, plan ptr, rows, padded
        self._accepted_id = -1  # the id of the batch last passed to accept()
        self._pending: AcceptResult | None = None

    # -- helpers ---------------------------------------------------------------------------------
    def _stream(self) -> int:
        if not self.on_device:
            return 0
        return int(self._torch.cuda.current_stream(self.device).cuda_stream)

    def _wait(self, event: Any) -> None:
        if event is not None and not event.query():
            self.host_waits += 1
            event.synchronize()

    def _record(self) -> Any:
        ev = self._torch.cuda.Event()
        ev.record(self._torch.cuda.current_stream(self.device))
        return ev

    def _padded(self, batch: Any, rows: int | None, tokens: int | None,
                decode_only: bool) -> tuple[int, int]:
        n, ntok = int(batch.num_rows), int(batch.num_tokens)
        if rows is None:
            rows = n
            if self.capture_sizes and decode_only:
                rows = next((s for s in self.capture_sizes if s >= n), n)
        if not n <= rows <= self.max_rows:
            raise ValueError(f"num_rows_padded={rows} must be in {n}..{self.max_rows}")
        if tokens is None:
            tokens = ntok + (rows - n) * (1 if batch.is_prefill else self.k + 1)
        if not ntok <= tokens <= self.max_tokens:
            raise ValueError(f"num_tokens_padded={tokens} must be in {ntok}..{self.max_tokens}")
        return max(rows, 1), tokens

    def _view(self, rows: int, tokens: int) -> dict[str, Any]:
        v = self._views.get((rows, tokens))
        if v is None:
            o = self._out
            v = {
                "input_ids": o["input_ids"][:tokens],
                "positions": o["positions"][:tokens],
                "slot_mapping": o["slot_mapping"][:tokens],
                "seq_lens": o["seq_lens"][:rows],
                "query_start_loc": o["query_start_loc"][: rows + 1],
                "cu_seqlens_k": o["cu_seqlens_k"][: rows + 1],
                "block_table": o["block_table"][:rows],
                "logits_indices": o["logits_indices"][:rows],
                "spec_logits_indices": o["spec_logits_indices"][:rows],
            }
            if len(self._views) >= 256:
                self._views.clear()
            self._views[(rows, tokens)] = v
        return v

    def _check_batch(self, batch: Any) -> None:
        """The batch must come from a scheduler with the builder's config."""
        theirs = {"block_table_width": int(batch.block_table_width),
                  "block_size": int(batch.block_size),
                  "num_speculative_tokens": int(batch.num_speculative_tokens)}
        ours = {"block_table_width": self.width, "block_size": self.block_size,
                "num_speculative_tokens": self.k}
        for name, v in theirs.items():
            if v != ours[name]:
                raise ValueError(f"batch.{name}={v}, the builder's is {ours[name]} (build the "
                                 "builder from the scheduler's config)")

    def _rows_tensor(self, t: Any, n: int, cols: int, dtype: Any, what: str) -> Any:
        """`t` as a C-contiguous [>= n, cols] tensor of `dtype` on the builder's device."""
        torch = self._torch
        if not isinstance(t, torch.Tensor):
            t = torch.as_tensor(np.asarray(t), device=self.device)
        if t.device != self.device:
            raise ValueError(f"{what} is on {t.device}, the builder on {self.device}")
        if t.dim() == 1 and cols == 1:
            t = t.view(-1, 1)
        if t.dim() != 2 or t.shape[1] != cols or t.shape[0] < n:
            raise ValueError(f"{what} must have shape ({n}, {cols}), got {tuple(t.shape)}")
        if t.dtype != dtype:
            if dtype == torch.int32 and t.dtype.is_floating_point:
                raise TypeError(f"{what} must be an integer tensor, got {t.dtype}")
            if dtype == torch.int32 and t.numel():
                # A narrowing copy would wrap (2**32 + 5 -> 5): refuse values outside int32.
                lo, hi = int(t[:n].min()), int(t[:n].max())
                for v in (lo, hi):
                    if not -(2**31) <= v < 2**31:
                        raise ValueError(f"{what} holds {v}, outside int32")
            t = t.to(dtype)
        return t.contiguous()

    # -- prepare ---------------------------------------------------------------------------------
    @_on_builder_device
    def prepare(
        self,
        batch: Any,
        *,
        num_rows_padded: int | None = None,
        num_tokens_padded: int | None = None,
    ) -> DeviceInputs:
        """Uploads the plan of ``batch`` and builds its inputs on the device (two launches)."""
        self._check_batch(batch)
        if self._pending is not None:
            raise RuntimeError(
                f"accept() of batch {self._pending.batch_id} still waits for store_drafts(): "
                "the next prepare() would overwrite the plan it reads"
            )
        if self._last is not None and int(batch.id) <= self._last[0]:
            raise ValueError(
                f"batch {int(batch.id)} was already prepared (the last prepared batch is "
                f"{self._last[0]}): preparing it again would advance its slots twice"
            )
        n = int(batch.num_rows)
        if n > self.max_rows:
            raise ValueError(f"batch has {n} rows; the builder holds {self.max_rows}")
        decode_only = _decode_only(batch)
        rows, tokens = self._padded(batch, num_rows_padded, num_tokens_padded, decode_only)
        buf = self._step & 1
        self._step += 1
        self._wait(self._plan_events[buf])  # the upload that last read this host buffer
        words = _core.device_pack_plan(
            self._plan_host_ptr[buf],
            self.plan_capacity,
            batch.request_slots,
            batch.num_scheduled_tokens,
            batch.num_cached_tokens,
            batch.row_is_prefill,
            batch.slot_reset,
            batch.emits_token,
            batch.new_block_starts,
            batch.new_block_offsets,
            batch.new_block_ids,
            batch.scheduled_tokens,
            batch.cu_seqlens_q,
        )
        self.last_plan_bytes = 4 * words
        if self.on_device:
            assert self._plan_dev is not None
            self._plan_dev[:words].copy_(self._plan_host[buf, :words], non_blocking=True)
            self._plan_events[buf] = self._record()
            plan = int(self._plan_dev.data_ptr())
        else:
            plan = self._plan_host_ptr[buf]
        # Graphs for decode-only steps: their sizes repeat (capture sizes), a prefill's do not.
        self._launch_prepare(plan, rows, tokens, graph=self.cuda_graphs and decode_only)
        self._last = (int(batch.id), plan, n, rows)
        v = self._view(rows, tokens)
        return DeviceInputs(
            batch_id=int(batch.id),
            is_prefill=bool(batch.is_prefill),
            num_rows=n,
            num_tokens=int(batch.num_tokens),
            num_rows_padded=rows,
            num_tokens_padded=tokens,
            max_seqlen_q=int(batch.max_seqlen_q),
            max_seqlen_k=int(batch.max_seqlen_k),
            sample_rows=self._torch.from_numpy(np.flatnonzero(np.asarray(batch.emits_token)))
            .to(self.device, non_blocking=True),
            **v,
        )

    def _launch_prepare(self, plan: int, rows: int, tokens: int, graph: bool) -> None:
        if not graph:
            _core.device_prepare(
                plan, self._state, self._outputs, rows, tokens, self._stream(), self.runs_kernels
            )
            return
        torch = self._torch
        key = (rows, tokens)
        g = self._graphs.get(key)
        if g is None:
            if key not in self._graph_seen:  # first sight: run eagerly (warms the runtime up)
                self._graph_seen.add(key)
                _core.device_prepare(plan, self._state, self._outputs, rows, tokens,
                                     self._stream(), True)
                return
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                _core.device_prepare(plan, self._state, self._outputs, rows, tokens,
                                     self._stream(), True)
            self._graphs[key] = g
        g.replay()

    # -- accept ----------------------------------------------------------------------------------
    @_on_builder_device
    def accept(
        self,
        batch: Any,
        target_token_ids: Any,
        next_draft_token_ids: Any = None,
        *,
        target_probs: Any = None,
        draft_probs: Any = None,
        uniform: Any = None,
    ) -> AcceptResult:
        """The bookkeeping after sampling ``batch`` (the batch last prepared).

        ``target_token_ids`` [rows, K+1] (or [rows] when K == 0): the tokens sampled at the
        positions of ``spec_logits_indices``. Greedy verification accepts draft j+1 while it
        equals target[j]; with ``target_probs``, ``draft_probs`` and ``uniform`` ([rows, K]
        each: p_target and p_draft of each draft token, uniform numbers in [0, 1)) it accepts it
        with probability min(1, p_target / p_draft), and target[j] must then hold the token
        resampled at a rejected position (the bonus token at position K). The accepted tokens
        are the verified drafts followed by target[a-1].

        ``next_draft_token_ids`` [rows, K]: the drafts for the next step; when K > 0 and they are
        not known yet (the drafter runs after verification), call ``store_drafts`` later."""
        if self._last is None or self._last[0] != int(batch.id):
            raise ValueError(
                "accept() must follow prepare() of the same batch, before the next prepare()"
            )
        if self._pending is not None:
            raise RuntimeError("the previous accept() still waits for store_drafts()")
        if self._accepted_id == int(batch.id):
            raise ValueError(
                f"batch {int(batch.id)} was already accepted: accepting it again would advance "
                "its slots twice"
            )
        torch = self._torch
        _, plan, n, rows = self._last
        k = self.k
        target = self._rows_tensor(target_token_ids, n, k + 1, torch.int32, "target_token_ids")
        drafts = None
        if next_draft_token_ids is not None:
            if k == 0:
                raise ValueError("next_draft_token_ids given but num_speculative_tokens is 0")
            drafts = self._rows_tensor(next_draft_token_ids, n, k, torch.int32,
                                       "next_draft_token_ids")
        probs = (target_probs, draft_probs, uniform)
        given = sum(p is not None for p in probs)
        if given not in (0, 3):
            raise ValueError("give all of target_probs, draft_probs and uniform, or none")
        if given and k == 0:
            raise ValueError("probabilities given but num_speculative_tokens is 0")
        tp = dp = un = None
        if given:
            tp, dp, un = (
                self._rows_tensor(p, n, k, torch.float32, name)
                for p, name in zip(probs, ("target_probs", "draft_probs", "uniform"), strict=True)
            )
        buf = self._accepts & 1
        self._accepts += 1
        self._wait(self._result_events[buf])
        res = self._result_dev[buf]
        _core.device_accept(
            plan,
            self._state,
            int(res.data_ptr()),
            rows,
            int(target.data_ptr()),
            int(drafts.data_ptr()) if drafts is not None else 0,
            int(tp.data_ptr()) if tp is not None else 0,
            int(dp.data_ptr()) if dp is not None else 0,
            int(un.data_ptr()) if un is not None else 0,
            self._stream(),
            self.runs_kernels,
        )
        self._accepted_id = int(batch.id)
        pending = k > 0 and drafts is None
        result = AcceptResult(int(batch.id), n, k, self._result_np[buf], res, None, pending, buf)
        if pending:
            self._pending = result
        else:
            self._copy_result(result)
        return result

    @_on_builder_device
    def store_drafts(self, result: AcceptResult, next_draft_token_ids: Any) -> AcceptResult:
        """Completes ``result`` (from ``accept`` without drafts) with the drafter's proposals
        [rows, K] and starts its copy to host memory."""
        if result is not self._pending:
            raise ValueError("store_drafts() must receive the result of the last accept()")
        assert self._last is not None
        _, plan, n, rows = self._last
        drafts = self._rows_tensor(
            next_draft_token_ids, n, self.k, self._torch.int32, "next_draft_token_ids"
        )
        res = self._result_dev[result._buf]
        _core.device_store_drafts(
            plan, self._state, int(drafts.data_ptr()), int(res.data_ptr()), rows,
            self._stream(), self.runs_kernels,
        )
        self._pending = None
        result.drafts_pending = False
        self._copy_result(result)
        return result

    def _copy_result(self, result: AcceptResult) -> None:
        if not self.on_device:
            return
        buf = result._buf
        words = RESULT_HEADER_WORDS + result.num_rows * (2 * self.k + 2)
        self._result_host[buf, :words].copy_(self._result_dev[buf, :words], non_blocking=True)
        ev = self._record()
        self._result_events[buf] = ev
        result._event = ev

    # -- state -----------------------------------------------------------------------------------
    @property
    def errors(self) -> int:
        """Sticky device error bits (waits for the device on a GPU)."""
        return int(self._errors.item())

    def clear_errors(self) -> None:
        self._errors.zero_()

    def slot_state(self) -> dict[str, np.ndarray]:
        """A host copy of the per-slot state (waits for the device): for tests and debugging."""
        return {
            "block_table": self._block_table.cpu().numpy().copy(),
            "computed": self._computed.cpu().numpy().copy(),
            "last_token": self._last_token.cpu().numpy().copy(),
            "drafts": self._drafts[:, : self.k].cpu().numpy().copy(),
        }
