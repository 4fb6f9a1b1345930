"""``Batch.views()``'s result: the arrays a model runner and sampler read, named (and typed and
shaped) as the ``Batch`` attributes of the same names (docs/api.md, "Batch")."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt


class BatchViews(NamedTuple):
    req_ids: npt.NDArray[np.int64]
    request_slots: npt.NDArray[np.int32]
    num_scheduled_tokens: npt.NDArray[np.int32]
    num_cached_tokens: npt.NDArray[np.int32]
    context_lens: npt.NDArray[np.int32]
    cu_seqlens_q: npt.NDArray[np.int32]
    cu_seqlens_k: npt.NDArray[np.int32]
    scheduled_tokens: npt.NDArray[np.int32]
    positions: npt.NDArray[np.int64]
    slot_mapping: npt.NDArray[np.int64]
    # None when the scheduler writes no host block tables (host_block_tables=False).
    block_tables: npt.NDArray[np.int32] | None
    spec_draft_tokens: npt.NDArray[np.int32]
    temperatures: npt.NDArray[np.float32]
    top_ks: npt.NDArray[np.int32]
    top_ps: npt.NDArray[np.float32]
    seeds: npt.NDArray[np.int64]
    row_is_prefill: npt.NDArray[np.bool_]
    emits_token: npt.NDArray[np.bool_]
