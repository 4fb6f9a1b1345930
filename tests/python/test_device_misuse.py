"""Issue 8 item 6: the device builder's misuse cases, each a typed error (or made correct), with
the scheduler and the builder's state unchanged."""

import numpy as np
import pytest
import torch

from atom_sched import DeviceBatchBuilder, SamplingParams, Scheduler, SchedulerConfig, _core


def test_plan_buffer_holds_the_worst_admission_step():
    # 200 requests sharing a 1,024-token system prompt admitted in one step: every admitted row
    # ships its whole table, shared blocks included.
    cfg = SchedulerConfig(num_blocks=4096, block_size=16, max_num_seqs=256,
                          max_num_batched_tokens=8192, max_model_len=2048)
    sched = Scheduler(cfg)
    builder = DeviceBatchBuilder(cfg)
    system = list(range(100, 1124))
    first = sched.add_request(0, system + [7, 8], SamplingParams(max_tokens=4))
    del first
    b = sched.schedule()
    builder.prepare(b)
    res = builder.accept(b, np.full(b.num_rows, 9, np.int32))
    sched.update(b, **res)
    for rid in range(1, 201):
        sched.add_request(rid, system + [rid % 50 + 3, 5], SamplingParams(max_tokens=4))
    b = sched.schedule()
    assert b.num_rows > 100
    x = builder.prepare(b)  # raised "plan needs 44408 words, the buffer holds 21512"
    assert builder.errors == 0
    assert x.block_table.shape[0] == b.num_rows
    assert (x.block_table.numpy() == b.block_tables).all()


def _k2():
    cfg = SchedulerConfig(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                          max_model_len=32, num_speculative_tokens=2)
    sched = Scheduler(cfg)
    builder = DeviceBatchBuilder(cfg)
    sched.add_request(0, [5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True))
    return cfg, sched, builder


def test_prepare_while_store_drafts_pending_is_refused():
    cfg, sched, builder = _k2()
    b0 = sched.schedule()
    builder.prepare(b0)
    res = builder.accept(b0, np.array([[11, 0, 0]], np.int32))  # drafts pending
    b1 = sched.schedule()  # one step ahead
    with pytest.raises(RuntimeError, match="store_drafts"):
        builder.prepare(b1)
    builder.store_drafts(res, np.array([[12, 13]], np.int32))
    builder.prepare(b1)  # now fine


def test_repeated_prepare_and_accept_are_refused_and_change_nothing():
    cfg, sched, builder = _k2()
    b0 = sched.schedule()
    builder.prepare(b0)
    state = builder.slot_state()
    with pytest.raises(ValueError, match="already prepared"):
        builder.prepare(b0)
    assert all((state[k] == v).all() for k, v in builder.slot_state().items())
    res = builder.accept(b0, np.array([[11, 0, 0]], np.int32), np.array([[12, 13]], np.int32))
    state = builder.slot_state()
    with pytest.raises(ValueError, match="already accepted"):
        builder.accept(b0, np.array([[11, 0, 0]], np.int32), np.array([[12, 13]], np.int32))
    assert all((state[k] == v).all() for k, v in builder.slot_state().items())
    sched.update(b0, **res)
    b1 = sched.schedule()
    x = builder.prepare(b1)
    assert x.positions[: b1.num_tokens].tolist() == b1.positions.tolist()


def test_a_builder_for_another_config_is_refused():
    cfg = SchedulerConfig(num_blocks=32, block_size=4, max_model_len=32)
    other = SchedulerConfig(num_blocks=32, block_size=8, max_model_len=64)  # same table width
    assert cfg.max_blocks_per_request == other.max_blocks_per_request
    builder = DeviceBatchBuilder(cfg)
    sched = Scheduler(other)
    sched.add_request(0, [1, 2, 3])
    with pytest.raises(ValueError, match="block_size"):
        builder.prepare(sched.schedule())
    spec = SchedulerConfig(num_blocks=32, block_size=4, max_model_len=32,
                           num_speculative_tokens=1)
    sched = Scheduler(spec)
    sched.add_request(0, [1, 2, 3])
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        builder.prepare(sched.schedule())


@pytest.mark.parametrize("bad", [2**32 + 5, -2**31 - 1, 2**31])
def test_accept_refuses_targets_outside_int32_token_range(bad):
    cfg, sched, builder = _k2()
    b0 = sched.schedule()
    builder.prepare(b0)
    with pytest.raises(ValueError, match=str(bad)):
        builder.accept(b0, torch.tensor([[bad, 0, 0]], dtype=torch.int64),
                       np.array([[12, 13]], np.int32))
    res = builder.accept(b0, torch.tensor([[42, 0, 0]], dtype=torch.int64),
                         np.array([[12, 13]], np.int32))
    assert res.update_kwargs()["sampled_token_ids"].tolist() == [[42, -1, -1]]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two GPUs")
def test_builder_on_the_second_gpu_launches_there():
    import atom_sched

    if atom_sched._core.device_backend() not in ("cuda", "hip"):
        pytest.skip("this build has no GPU back end")
    cfg, sched, _ = _k2()
    builder = DeviceBatchBuilder(cfg, device="cuda:1")
    torch.cuda.set_device(0)
    b0 = sched.schedule()
    x = builder.prepare(b0)
    assert x.positions.device == torch.device("cuda", 1)
    torch.cuda.synchronize(1)
    assert x.positions[: b0.num_tokens].tolist() == b0.positions.tolist()
    assert builder.errors == 0 and torch.cuda.current_device() == 0


def test_kernels_choice_is_checked():
    # The ordinary build runs the references on CPU tensors; demanding the kernels there is a
    # DeviceError naming the build to use, and anything but True/False/None a TypeError.
    cfg = SchedulerConfig(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                          max_model_len=32)
    hip_cpu = _core.device_backend() == "hip-cpu"
    assert DeviceBatchBuilder(cfg).runs_kernels == hip_cpu
    assert not DeviceBatchBuilder(cfg, kernels=False).runs_kernels
    if hip_cpu:
        assert DeviceBatchBuilder(cfg, kernels=True).runs_kernels
    else:
        with pytest.raises(_core.DeviceError, match="hip-cpu build"):
            DeviceBatchBuilder(cfg, kernels=True)
    with pytest.raises(TypeError, match="kernels must be"):
        DeviceBatchBuilder(cfg, kernels="yes")
