"""DeviceBatchBuilder on CPU tensors (the kernels' C++ references) driving a real Scheduler.

Every step, the builder's tensors must equal the core's host batch arrays (input_ids, positions,
slot_mapping, seq_lens, query_start_loc, cu_seqlens_k, block_table, logits indices) and, after
``update``, each running request's device slot must hold its computed length, last token, drafts
and block table: through chunked prefill, prefix hits, preemption, finishes and slot reuse, K = 0
and K > 0, greedy and probabilistic verification, the one-step-ahead protocol, and mixed batches.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="DeviceBatchBuilder needs torch")

from support.device import SpecModel, run_builder  # noqa: E402

import atom_sched  # noqa: E402
from atom_sched import DeviceBatchBuilder, SamplingParams, Scheduler, SchedulerConfig  # noqa: E402


def prompts(n: int, seed: int, *, shared: int = 0, max_len: int = 40, max_tokens: int = 24):
    """n prompts; with `shared` > 0 half of them start with the same `shared` tokens."""
    rng = np.random.default_rng(seed)
    prefix = [int(x) for x in rng.integers(10, 5000, size=shared)]
    out = {}
    for rid in range(n):
        body = [int(x) for x in rng.integers(10, 5000, size=int(rng.integers(1, max_len)))]
        p = (prefix + body) if shared and rid % 2 == 0 else body
        mt = int(rng.integers(1, max_tokens + 1))
        out[rid] = (p, SamplingParams(max_tokens=mt))
    return out


CONFIGS = {
    # name: (SchedulerConfig kwargs, number of prompts, shared prefix)
    "chunked_prefix": (dict(num_blocks=96, block_size=4, max_num_seqs=6,
                            max_num_batched_tokens=24, max_model_len=128), 14, 12),
    "preempt_small_pool": (dict(num_blocks=22, block_size=4, max_num_seqs=6,
                                max_num_batched_tokens=32, max_model_len=64), 12, 8),
    "unchunked": (dict(num_blocks=128, block_size=8, max_num_seqs=4,
                       max_num_batched_tokens=64, max_model_len=128,
                       enable_chunked_prefill=False), 9, 16),
    "block_size_1": (dict(num_blocks=300, block_size=1, max_num_seqs=5,
                          max_num_batched_tokens=20, max_model_len=96), 8, 5),
    # Mixed batches: decode rows verify drafts while prefill rows run in the same step.
    "mixed_chunked_prefix": (dict(num_blocks=96, block_size=4, max_num_seqs=6,
                                  max_num_batched_tokens=24, max_model_len=128,
                                  policy="mixed"), 14, 12),
    "mixed_preempt_small_pool": (dict(num_blocks=22, block_size=4, max_num_seqs=6,
                                      max_num_batched_tokens=32, max_model_len=64,
                                      policy="mixed"), 12, 8),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("k", [0, 1, 3, 8])
def test_builder_matches_host_arrays_step_after_step(name: str, k: int) -> None:
    kw, n, shared = CONFIGS[name]
    cfg = SchedulerConfig(num_speculative_tokens=k, eos_token_id=1, **kw)
    log, builder = run_builder(cfg, prompts(n, seed=k * 31 + len(name), shared=shared),
                               SpecModel(k, seed=k))
    assert set(log.finished) == set(range(n)), "every request finished"
    assert log.prefill_steps > 0 and log.decode_steps > 0
    assert log.slot_reuses > 0, "slots were reused after finishes"
    if shared:
        assert log.prefix_hits > 0
    if name.endswith("preempt_small_pool"):
        assert log.preemptions > 0
    if name.startswith("mixed"):
        assert log.mixed_steps > 0, "some steps held prefill and decode rows"
    assert builder.host_waits == 0


@pytest.mark.parametrize("name", ["preempt_small_pool", "mixed_preempt_small_pool"])
@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_without_host_block_tables_the_builder_builds_the_same_inputs(name: str, k: int,
                                                                      mode: str) -> None:
    # The builder keeps its tables per device slot from the batch's plan: a scheduler that
    # writes no host tables (finishes and preemptions shift rows here) builds the same inputs,
    # its device tables checked against the requests' tables every step.
    kw, n, shared = CONFIGS[name]
    logs = []
    for host_tables in (True, False):
        cfg = SchedulerConfig(num_speculative_tokens=k, eos_token_id=1,
                              host_block_tables=host_tables, **kw)
        log, _ = run_builder(cfg, prompts(n, seed=7, shared=shared), SpecModel(k, seed=k),
                             mode=mode)
        logs.append(log)
    assert logs[0].preemptions > 0 and logs[0].slot_reuses > 0
    assert logs[1] == logs[0]


@pytest.mark.parametrize("k", [1, 4])
def test_probabilistic_verification_drives_the_scheduler(k: int) -> None:
    kw, n, shared = CONFIGS["preempt_small_pool"]
    cfg = SchedulerConfig(num_speculative_tokens=k, eos_token_id=1, **kw)
    ps = prompts(n, seed=5, shared=shared)
    greedy, _ = run_builder(cfg, ps, SpecModel(k, seed=2))
    prob, _ = run_builder(cfg, ps, SpecModel(k, seed=2, probabilistic=True))
    # The model makes the same accept decisions either way, so the streams are identical.
    assert prob.tokens == greedy.tokens
    assert prob.finished == greedy.finished


@pytest.mark.parametrize("name", ["chunked_prefix", "mixed_chunked_prefix"])
@pytest.mark.parametrize("k, variable_drafts",
                         [(0, False), (2, False), (5, False), (2, True), (5, True)])
def test_one_step_ahead_builds_the_same_inputs_as_synchronous(k: int, name: str,
                                                               variable_drafts: bool) -> None:
    """One step ahead, the host knows neither the in-flight tokens nor (K > 0) the lengths; the
    device does. Every input the device builds, per request and position, and every streamed
    token must be those of the synchronous run: with variable-length drafts too (synchronous rows
    are as wide as the drafts proposed, one step ahead K+1 with the missing drafts padded)."""
    kw, n, shared = CONFIGS[name]
    cfg = SchedulerConfig(num_speculative_tokens=k, eos_token_id=1, **kw)
    ps = prompts(n, seed=11 + k, shared=shared)
    sync, _ = run_builder(cfg, ps, SpecModel(k, seed=9, variable_drafts=variable_drafts))
    ahead, _ = run_builder(cfg, ps, SpecModel(k, seed=9, variable_drafts=variable_drafts),
                           mode="async")
    assert ahead.tokens == sync.tokens
    assert ahead.finished == sync.finished
    # The last input the device built at each position of a request's final sequence is that
    # sequence's token (rejected drafts are overwritten; a step run after the finish, one step
    # ahead, only builds positions past the end).
    for log in (sync, ahead):
        for rid, (prompt, _) in ps.items():
            seq = prompt + log.tokens[rid]
            built = log.inputs[rid]
            final = [p for p in built if p < len(seq) - 1]  # prefix-cache hits are not built
            assert len(final) >= len(seq) - 1 - len(prompt) and final, rid
            assert all(built[p] == seq[p] for p in final), rid


def test_preemption_in_flight_one_step_ahead() -> None:
    kw, n, shared = CONFIGS["preempt_small_pool"]
    cfg = SchedulerConfig(num_speculative_tokens=2, eos_token_id=1, **kw)
    ps = prompts(n, seed=3, shared=shared)
    sync, _ = run_builder(cfg, ps, SpecModel(2, seed=4))
    ahead, _ = run_builder(cfg, ps, SpecModel(2, seed=4), mode="async")
    assert ahead.preemptions > 0
    assert ahead.tokens == sync.tokens


def test_drafts_stored_after_the_drafter_runs() -> None:
    kw, n, shared = CONFIGS["chunked_prefix"]
    cfg = SchedulerConfig(num_speculative_tokens=3, eos_token_id=1, **kw)
    ps = prompts(n, seed=1, shared=shared)
    one, _ = run_builder(cfg, ps, SpecModel(3, seed=1))
    two, _ = run_builder(cfg, ps, SpecModel(3, seed=1), split_drafts=True)
    assert two.tokens == one.tokens


@pytest.mark.parametrize("k", [0, 3])
def test_decode_batches_padded_to_capture_sizes(k: int) -> None:
    kw, n, shared = CONFIGS["chunked_prefix"]
    cfg = SchedulerConfig(num_speculative_tokens=k, eos_token_id=1, **kw)
    log, builder = run_builder(cfg, prompts(n, seed=2, shared=shared), SpecModel(k, seed=3),
                               capture_sizes=(1, 2, 4, 8))
    assert log.padded_steps > 0  # check_inputs_against_host checks the padding values
    assert builder.max_rows == 8


def test_explicit_padding_and_limits() -> None:
    cfg = SchedulerConfig(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                          max_model_len=32, num_speculative_tokens=1)
    sched = Scheduler(cfg)
    builder = DeviceBatchBuilder(cfg)
    sched.add_request(0, [5, 6, 7])
    b = sched.schedule()
    with pytest.raises(ValueError, match="num_rows_padded"):
        builder.prepare(b, num_rows_padded=5)
    with pytest.raises(ValueError, match="num_tokens_padded"):
        builder.prepare(b, num_tokens_padded=2)
    x = builder.prepare(b, num_rows_padded=3, num_tokens_padded=9)
    assert x.input_ids.shape == (9,) and x.block_table.shape == (3, builder.width)
    assert x.slot_mapping[3:].tolist() == [-1] * 6
    assert x.query_start_loc.tolist() == [0, 3, 3, 3]
    assert x.seq_lens.tolist() == [3, 0, 0]
    assert x.target_logits_indices.shape == (3, 1)
    assert x.bonus_logits_indices.tolist() == [2, 2, 2]


def test_accept_contract_errors() -> None:
    cfg = SchedulerConfig(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                          max_model_len=32, num_speculative_tokens=2)
    sched = Scheduler(cfg)
    builder = DeviceBatchBuilder(cfg)
    sched.add_request(0, [5, 6, 7])
    b = sched.schedule()
    with pytest.raises(ValueError, match="must follow prepare"):
        builder.accept(b, np.zeros((1, 3), np.int32))
    builder.prepare(b)
    with pytest.raises(ValueError, match="shape"):
        builder.accept(b, np.zeros((1, 2), np.int32))
    with pytest.raises(TypeError, match="integer"):
        builder.accept(b, np.zeros((1, 3), np.float32))
    with pytest.raises(ValueError, match="all of"):
        builder.accept(b, np.zeros((1, 3), np.int32), target_probs=np.zeros((1, 2), np.float32))
    res = builder.accept(b, torch.tensor([[42, 0, 0]], dtype=torch.int64))  # int64 is converted
    with pytest.raises(RuntimeError, match="store_drafts"):
        res.update_kwargs()
    with pytest.raises(RuntimeError, match="store_drafts"):
        builder.accept(b, np.zeros((1, 3), np.int32))
    builder.store_drafts(res, np.array([[8, 9]], np.int32))
    kw = res.update_kwargs()
    assert kw["sampled_token_ids"].tolist() == [[42, -1, -1]]
    assert kw["num_accepted"].tolist() == [1]
    assert kw["draft_token_ids"].tolist() == [[8, 9]]
    assert res.ready() and res.errors == 0
    assert sorted(res.keys()) == sorted(kw)
    out = sched.update(b, **res)  # the result is a mapping of update()'s keyword arguments
    assert [o.output_tokens for o in out] == [[42]]
    other = SchedulerConfig(num_blocks=32, block_size=4, max_model_len=64)
    sched2 = Scheduler(other)
    sched2.add_request(0, [1, 2])
    with pytest.raises(ValueError, match="block_table_width"):
        builder.prepare(sched2.schedule())


def test_device_errors_reach_the_host_without_a_sync() -> None:
    cfg = SchedulerConfig(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                          max_model_len=32)
    sched = Scheduler(cfg)
    builder = DeviceBatchBuilder(cfg)
    sched.add_request(0, [5, 6, 7])
    b = sched.schedule()
    builder.prepare(b)
    builder._errors.fill_(2)  # as if a kernel had seen a bad slot
    res = builder.accept(b, np.array([3], np.int32))
    assert res.errors == 2
    with pytest.raises(atom_sched.DeviceError, match="slot"):
        res.update_kwargs()
    assert issubclass(atom_sched.DeviceError, RuntimeError)
    builder.clear_errors()
    assert builder.errors == 0


def test_gpu_device_on_a_cpu_build_says_why() -> None:
    cfg = SchedulerConfig(num_blocks=8)
    if atom_sched._core.device_backend() == "none":
        with pytest.raises(atom_sched.DeviceError, match="no GPU back end"):
            DeviceBatchBuilder(cfg, device="cuda")
    elif not torch.cuda.is_available():
        with pytest.raises(atom_sched.DeviceError, match="no GPU"):
            DeviceBatchBuilder(cfg, device="cuda")
    with pytest.raises(ValueError, match="device"):
        DeviceBatchBuilder(cfg, device="meta")


def test_import_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import atom_sched\n"
        "assert 'DeviceBatchBuilder' in atom_sched.__all__\n"
        "try:\n"
        "    atom_sched.DeviceBatchBuilder(atom_sched.SchedulerConfig(num_blocks=8))\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
        "else:\n"
        "    raise SystemExit('no ImportError')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert r.returncode == 0, r.stderr
    assert "needs torch" in r.stdout


def test_first_decode_after_a_remote_prefill_runs_on_a_fresh_slot():
    """A remotely prefilled request's first decode row has a reset slot that never saw its
    prompt: the plan carries the row's start and inputs (T0 and the producer's drafts), and the
    slot's last token and drafts are set from them, so the row is verified like any other."""
    from atom_sched import KVConnector, RemoteMatch, SamplingParams, Scheduler, SchedulerConfig
    from atom_sched.device import DeviceBatchBuilder

    class Remote(KVConnector):
        def is_producer(self):
            return False

        def get_num_new_matched_tokens(self, request):
            return RemoteMatch(num_tokens=request.num_prompt_tokens, load_async=True,
                               first_token=42, draft_tokens=[43, 44])

        def update_state_after_alloc(self, request):
            pass

        def request_finished(self, request):
            return False

    k = 2
    cfg = SchedulerConfig(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                          max_model_len=128, num_speculative_tokens=k)
    sched = Scheduler(cfg)
    sched.set_kv_connector(Remote())
    builder = DeviceBatchBuilder(cfg)
    sched.add_request(0, list(range(10, 23)), SamplingParams(max_tokens=8))  # 13 prompt tokens
    assert sched.schedule() is None
    sched.update_from_kv_xfer_finished(finished_recving=[0])
    batch = sched.schedule()
    assert not batch.is_prefill and batch.slot_reset.tolist() == [True]
    inp = builder.prepare(batch)
    assert inp.input_ids[:3].tolist() == [42, 43, 44] == batch.scheduled_tokens.tolist()
    assert inp.positions[:3].tolist() == [13, 14, 15] == batch.positions.tolist()
    assert inp.slot_mapping[:3].tolist() == batch.slot_mapping.tolist()
    assert inp.seq_lens[:1].tolist() == batch.context_lens.tolist()
    # The target model agrees with the first draft only: 2 tokens accepted, 43 and then 50.
    result = builder.accept(batch, torch.tensor([[43, 50, 51]], dtype=torch.int32),
                            next_draft_token_ids=torch.tensor([[60, 61]], dtype=torch.int32))
    out = sched.update(batch, **result.update_kwargs()).outputs()
    assert out[0].output_tokens == [42, 43, 50]  # T0 streamed with the first output
    state = builder.slot_state()
    slot = batch.request_slots[0]
    assert state["computed"][slot] == sched.request_state(0)["num_computed_tokens"] == 15
    assert state["last_token"][slot] == 50 and state["drafts"][slot].tolist() == [60, 61]


class _RowCappedModel(SpecModel):
    """SpecModel whose accepted count of a decode row is capped at the row's width (fewer than
    K+1 tokens near the position limit: a draft that was not scheduled cannot be accepted)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self._cap: dict[tuple[int, int], int] = {}

    def outputs(self, batch, device):
        rows = zip(batch.req_ids, batch.num_scheduled_tokens, strict=True)
        rows = [] if batch.is_prefill else rows
        self._cap = {(int(r), self.gen[int(r)]): int(w) for r, w in rows}
        return super().outputs(batch, device)

    def accepted(self, rid: int, g: int) -> int:
        a = super().accepted(rid, g)
        return min(a, self._cap.get((rid, g), a))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_decode_rows_shorter_than_k_plus_1_at_max_model_len(mode: str, monkeypatch) -> None:
    """Issue 12 item 3 through the real scheduler: with K = 3, rows near max_model_len carry
    fewer than K+1 tokens (no position reaches the limit); the builder's inputs still equal the
    host's (run_builder checks every batch) and every request streams its whole sequence up to
    max_model_len, in both protocols."""
    k, limit = 3, 24
    widths: list[int] = []

    class Recording(Scheduler):
        def schedule(self, *a, **kw):
            b = super().schedule(*a, **kw)
            if b is not None and not b.is_prefill:
                widths.extend(int(x) for x in b.num_scheduled_tokens)
            return b

    monkeypatch.setattr(atom_sched, "Scheduler", Recording)
    cfg = SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                          max_model_len=limit, num_speculative_tokens=k, eos_token_id=1)
    ps = {rid: (list(range(100 + rid, 110 + 2 * rid)), SamplingParams(max_tokens=100))
          for rid in range(6)}
    model = _RowCappedModel(k, seed=3, eos_rate=0)
    log, builder = run_builder(cfg, ps, model, mode=mode)
    assert any(w < k + 1 for w in widths), widths
    assert all(1 <= w <= k + 1 for w in widths)
    for rid, (p, _) in ps.items():
        assert log.finished[rid] == "max_model_len"
        assert log.tokens[rid] == model.sequence(rid, limit - len(p)), rid
        assert max(log.inputs[rid]) < limit, "a position at or past max_model_len was built"
    assert builder.host_waits == 0
