"""GPU kernels against their CPU references: identical integers on random batches (rows in any
order, mixed prefill and decode rows, resets, K = 0..8, padding, up to 4,096 rows), and the
builder on the GPU driving a real scheduler (parity with the host arrays, one step ahead, CUDA
graphs).

Runs on a GPU (the cuda or hip build) and, without one, on the hip-cpu build, whose kernels are
executed on the host by the HIP CPU Runtime: there the "device" buffers are CPU tensors, launches
take stream 0 and have completed when they return, and there are no graphs (docs/device.md).
Skipped, with the reason, without a back end or a device; with ATOM_SCHED_REQUIRE_DEVICE=1 (make
test-hip-cpu-python) a skip is an error instead."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the GPU suite needs torch")

from support.device import Buffers, SpecModel, random_case, run_builder  # noqa: E402

from atom_sched import SchedulerConfig, _core  # noqa: E402

BACKEND = _core.device_backend()
# The hip-cpu build: the kernels run on the host, so the "device" tensors are CPU tensors.
HIP_CPU = BACKEND == "hip-cpu"
DEVICE = "cpu" if HIP_CPU else "cuda"


def _skip_reason() -> str | None:
    backend = BACKEND
    if backend == "none":
        return ("this atom_sched build has no GPU back end (ATOM_SCHED_GPU=OFF): build one with "
                "`make build-cuda`, run the kernels on the CPU with `make test-hip-cpu-python`, "
                "or run scripts/gpu_check.sh on a GPU machine")
    if HIP_CPU:
        return None if _core.device_count() > 0 else "the hip-cpu runtime reports no device"
    if not torch.cuda.is_available():
        return f"no GPU: the module is built for {backend} but torch.cuda.is_available() is False"
    if _core.device_count() == 0:
        return f"no device visible to the {backend} runtime"
    return None


REASON = _skip_reason()
if REASON is not None and os.environ.get("ATOM_SCHED_REQUIRE_DEVICE") == "1":
    raise RuntimeError(f"ATOM_SCHED_REQUIRE_DEVICE=1 but the device suite would skip: {REASON}")
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

SEEDS = range(6)


def both(case, **kw):
    """The reference's buffers (CPU) and the kernels' (the device's; CPU for hip-cpu)."""
    return Buffers(case, "cpu", **kw), Buffers(case, DEVICE, **kw)


def stream() -> int:
    return 0 if HIP_CPU else int(torch.cuda.current_stream().cuda_stream)


def synchronize() -> None:
    if not HIP_CPU:  # hip-cpu launches have completed when they return
        torch.cuda.synchronize()


def assert_same(cpu: Buffers, gpu: Buffers, what: str) -> None:
    synchronize()
    a, b = cpu.snapshot(), gpu.snapshot()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=f"{what}: {key}")


def prepare_both(cpu: Buffers, gpu: Buffers, fn: str = "device_prepare") -> None:
    c = cpu.case
    getattr(_core, fn)(cpu.plan.data_ptr(), cpu.state, cpu.outputs, c.padded_rows,
                       c.padded_tokens)
    getattr(_core, fn)(gpu.plan.data_ptr(), gpu.state, gpu.outputs, c.padded_rows,
                       c.padded_tokens, stream(), True)


@pytest.mark.parametrize("k", range(9))
@pytest.mark.parametrize("seed", SEEDS)
def test_prepare_kernels_match_reference(k: int, seed: int) -> None:
    case = random_case(np.random.default_rng(1000 * k + seed), k)
    cpu, gpu = both(case)
    prepare_both(cpu, gpu)
    assert_same(cpu, gpu, f"prepare k={k} seed={seed}")
    # Each kernel alone, too.
    cpu, gpu = both(case)
    prepare_both(cpu, gpu, "device_apply_plan")
    assert_same(cpu, gpu, "apply_plan")
    prepare_both(cpu, gpu, "device_build_inputs")
    assert_same(cpu, gpu, "build_inputs")


@pytest.mark.parametrize("rows", [1024, 1025, 4096])
def test_prepare_many_rows_spans_several_tiles(rows: int) -> None:
    case = random_case(np.random.default_rng(rows), 3, num_slots=rows + 7, width=16,
                       block_size=16, max_rows=rows)
    cpu, gpu = both(case)
    prepare_both(cpu, gpu)
    assert_same(cpu, gpu, f"{rows} rows")


@pytest.mark.parametrize("k", range(9))
@pytest.mark.parametrize("prob", [False, True])
@pytest.mark.parametrize("later", [False, True])
def test_accept_kernel_matches_reference(k: int, prob: bool, later: bool) -> None:
    rng = np.random.default_rng(7 * k + prob + 2 * later)
    case = random_case(rng, k)
    cpu, gpu = both(case)
    prepare_both(cpu, gpu)
    rp = case.padded_rows
    st = cpu.snapshot()
    target = rng.integers(6000, 9000, size=(rp, k + 1)).astype(np.int32)
    for i, r in enumerate(case.rows):  # agree with the drafts on a random prefix
        cut = int(rng.integers(0, k + 1))
        target[i, :cut] = st["drafts"][r["slot"]][:cut]
    nxt = rng.integers(10, 5000, size=(rp, k)).astype(np.int32)
    probs = [rng.random((rp, k)).astype(np.float32) for _ in range(3)]
    for bufs, on in ((cpu, False), (gpu, True)):
        dev = DEVICE if on else "cpu"
        t = lambda a, dev=dev: torch.from_numpy(a).to(dev)  # noqa: E731
        tt, tn = t(target), t(nxt)
        tps = [t(p) for p in probs]
        use = prob and k > 0
        args = dict(
            target_tokens=tt.data_ptr(),
            next_drafts=tn.data_ptr() if k and not later else 0,
            target_probs=tps[0].data_ptr() if use else 0,
            draft_probs=tps[1].data_ptr() if use else 0,
            uniform=tps[2].data_ptr() if use else 0,
        )
        s = stream() if on else 0
        _core.device_accept(bufs.plan.data_ptr(), bufs.state, bufs.result.data_ptr(), rp,
                            stream=s, on_device=on, **args)
        if later and k:
            _core.device_store_drafts(bufs.plan.data_ptr(), bufs.state, tn.data_ptr(),
                                      bufs.result.data_ptr(), rp, s, on)
        synchronize()
    assert_same(cpu, gpu, f"accept k={k} prob={prob} later={later}")


def test_bad_plans_set_the_same_error_bits() -> None:
    case = random_case(np.random.default_rng(3), 2)
    plan = case.plan.copy()
    plan[8] = case.num_slots + 5  # the first row's slot is out of range
    case.plan = plan
    cpu, gpu = both(case)
    prepare_both(cpu, gpu)
    assert_same(cpu, gpu, "bad slot")
    assert cpu.snapshot()["errors"][0] & 2


@pytest.mark.parametrize("k", [0, 2, 8])
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("policy", ["atom", "mixed"])
def test_builder_on_gpu_drives_the_scheduler(k: int, mode: str, policy: str) -> None:
    cfg = SchedulerConfig(num_blocks=40, block_size=4, max_num_seqs=8, max_num_batched_tokens=48,
                          max_model_len=96, num_speculative_tokens=k, eos_token_id=1,
                          policy=policy)
    rng = np.random.default_rng(k)
    prompts = {rid: ([int(x) for x in rng.integers(10, 5000, size=int(rng.integers(1, 30)))],
                     None) for rid in range(16)}
    # Under the mixed policy the drafter also proposes fewer than K drafts (variable length).
    variable = policy == "mixed"
    log, builder = run_builder(cfg, prompts, SpecModel(k, seed=k, variable_drafts=variable),
                               mode=mode, device=DEVICE, capture_sizes=(1, 2, 4, 8),
                               cuda_graphs=not HIP_CPU)
    cpu_log, ref = run_builder(cfg, prompts, SpecModel(k, seed=k, variable_drafts=variable),
                               mode=mode, device="cpu", capture_sizes=(1, 2, 4, 8),
                               kernels=False)
    assert builder.runs_kernels and not ref.runs_kernels
    assert log.tokens == cpu_log.tokens and log.finished == cpu_log.finished
    assert (log.mixed_steps > 0) == (policy == "mixed")
    assert builder.host_waits == 0, "a step waited for the device"
    if not HIP_CPU:  # no graphs on hip-cpu
        assert builder._graphs, "decode steps replayed captured graphs"
