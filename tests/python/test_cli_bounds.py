"""Issue 28 item 6: every flag of `atom-sched generate` and `atom-sched simulate` is bounded. A
value out of range, NaN or an infinity, a seed the code cannot take, an output folder that cannot
be written, or a combination that would only fail later (a KV pool or block tables too large for
memory, a step time of zero) is refused with one line naming the flag and exit status 2, quickly
and before any work: no allocation until the OOM killer, no segfault, no endless loop, no
traceback. Each case runs the real command in a new process, with its address space capped so a
regression fails the test instead of the machine, and a timeout so a hang fails it too."""

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "atom_sched.cli"]
MEMORY_CAP = 8 << 30  # bytes of address space for the command (torch alone needs about 2 GiB)
QUICK_S = 30.0  # a refusal takes about a second (Python and atom_sched start) on a shared machine


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


def run_cli(*args: str, cwd: Path, timeout: float = 90) -> tuple[subprocess.CompletedProcess,
                                                                 float]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("ATOM_SCHED_BENCHMARKS", None)
    t0 = time.perf_counter()
    r = subprocess.run([*CLI, *args], capture_output=True, timeout=timeout, env=env, cwd=cwd,
                       preexec_fn=_cap_memory)
    return r, time.perf_counter() - t0


def assert_refused(r: subprocess.CompletedProcess, elapsed: float, *flags: str) -> str:
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 2, (r.returncode, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1, err[-3000:]
    assert all(f in lines[0] for f in flags), lines[0]
    assert "loaded" not in err and r.stdout == b"", (err, r.stdout[-2000:])  # before any work
    assert elapsed < QUICK_S, elapsed
    return lines[0]


BAD_GENERATE = [
    # The cases
    (["--max-num-seqs", "2147483647"], ["--max-num-seqs"]),
    (["--threads", "100000"], ["--threads"]),
    # Every other flag, each past its bound (and NaN, infinities, non-numbers)
    (["--max-num-seqs", "65537"], ["--max-num-seqs"]),
    (["--max-num-seqs", "many"], ["--max-num-seqs"]),
    (["--threads", "-1"], ["--threads"]),
    (["--threads", "x"], ["--threads"]),
    (["--max-tokens", "8193"], ["--max-tokens"]),
    (["--max-tokens", "0"], ["--max-tokens"]),
    (["--min-tokens", "8193"], ["--min-tokens"]),
    (["--min-tokens", "-1"], ["--min-tokens"]),
    (["--temperature", "inf"], ["--temperature"]),
    (["--temperature", "nan"], ["--temperature"]),
    (["--temperature", "1e-45"], ["--temperature"]),
    (["--temperature", "1000"], ["--temperature"]),
    (["--top-k", "0"], ["--top-k"]),
    (["--top-k", "-2"], ["--top-k"]),
    (["--top-k", "2147483648"], ["--top-k"]),
    (["--top-p", "nan"], ["--top-p"]),
    (["--top-p", "1.5"], ["--top-p"]),
    (["--seed", "2147483648"], ["--seed"]),
    (["--stop", ""], ["--stop"]),
    (["--stop", "x" * 1025], ["--stop"]),
    (["--kv-blocks", "1"], ["--kv-blocks"]),
    (["--kv-blocks", "262145"], ["--kv-blocks"]),
    (["--block-size", "1025"], ["--block-size"]),
    (["--chunk-size", "8193"], ["--chunk-size"]),
    (["--chunk-size", "0"], ["--chunk-size"]),
    (["--max-model-len", "8193"], ["--max-model-len"]),
    (["--spec", "-1"], ["--spec"]),
    (["--ngram", "33"], ["--ngram"]),
    (["--ngram", "0"], ["--ngram"]),
    (["--sjf-aging-rate", "0"], ["--sjf-aging-rate"]),
    (["--sjf-aging-rate", "nan"], ["--sjf-aging-rate"]),
    (["--scheduling", "lifo"], ["--scheduling"]),
    (["--preemption-victim", "random"], ["--preemption-victim"]),
    (["--admission-watermark", "-1"], ["--admission-watermark"]),
    (["--tenants", "a," + "x" * 257], ["--tenants must be at most 256 bytes"]),
    (["--admission-watermark", "511"], ["--admission-watermark must be in 0..--kv-blocks - 2"]),
    # Combinations that failed only later: a KV pool of 2.6 M tokens (about 120 GB of float32
    # KV), and block tables of 65,536 rows x 8,194 blocks (8 GiB)
    (["--kv-blocks", "2600", "--block-size", "1024"], ["--kv-blocks", "--block-size"]),
    (["--max-num-seqs", "65536", "--block-size", "1"], ["--max-num-seqs", "--block-size"]),
]


@pytest.mark.parametrize("args, flags", BAD_GENERATE,
                         ids=[" ".join(a)[:40] for a, _ in BAD_GENERATE])
def test_generate_refuses_out_of_bounds_flags(args, flags, tmp_path):
    r, elapsed = run_cli("generate", *args, "Hi", cwd=tmp_path)
    assert_refused(r, elapsed, *flags)


SIM = ["simulate", "--workload", "chat", "--conversations", "5", "--no-progress"]

BAD_SIMULATE = [
    # The cases
    (["--step-a", "nan"], ["--step-a"]),
    (["--think-time", "nan"], ["--think-time"]),
    (["--step-b", "inf"], ["--step-b"]),
    (["--seed", "-1"], ["--seed"]),
    (["--kv-blocks", "2147483647"], ["--kv-blocks"]),
    (["--conversations", "100000000"], ["--conversations"]),
    (["--max-num-seqs", "2147483647"], ["--max-num-seqs"]),
    (["--budget", "2147483647"], ["--budget"]),
    (["--max-model-len", "2147483647"], ["--max-model-len"]),
    (["--max-tokens", "2147483647"], ["--max-tokens"]),
    (["--out", "/proc/atom-sched/no/such/dir"], ["--out"]),
    # Every other flag
    (["--seed", str(2**63)], ["--seed"]),
    (["--seed", "1.5"], ["--seed"]),
    (["--step-a", "inf"], ["--step-a"]),
    (["--step-a", "61"], ["--step-a"]),
    (["--step-c", "nan"], ["--step-c"]),
    (["--step-c", "-inf"], ["--step-c"]),
    (["--step-b", "2"], ["--step-b"]),
    (["--think-time", "inf"], ["--think-time"]),
    (["--think-time", "1e300"], ["--think-time"]),
    (["--rate", "inf"], ["--rate"]),
    (["--rate", "1e-320"], ["--rate"]),
    (["--load", "nan"], ["--load"]),
    (["--priority-classes", "1000000"], ["--priority-classes"]),
    (["--max-num-seqs", "65537"], ["--max-num-seqs"]),
    (["--kv-blocks", "4194305"], ["--kv-blocks"]),
    (["--conversations", "x"], ["--conversations"]),
    (["--sjf-aging-rate", "1e10"], ["--sjf-aging-rate"]),
    (["--length-hint-error", "4"], ["--length-hint-error"]),
    (["--scheduling", "sjf,lifo"], ["--scheduling"]),
    (["--victim", ""], ["--victim"]),
    (["--watermark", "0,-1"], ["--watermark"]),
    (["--kv-blocks", "100", "--watermark", "0,99"], ["admission_watermark_blocks"]),
    # Combinations: a zero step time (the saturation run's duration 0, a division by zero) and
    # block tables of 65,536 rows x 65,538 blocks
    (["--step-a", "0", "--step-b", "0", "--step-c", "0"], ["--step-a", "--step-b"]),
    (["--max-num-seqs", "65536", "--max-model-len", "1048576"], ["--max-num-seqs"]),
]


@pytest.mark.parametrize("args, flags", BAD_SIMULATE,
                         ids=[" ".join(a)[:40] for a, _ in BAD_SIMULATE])
def test_simulate_refuses_out_of_bounds_flags(args, flags, tmp_path):
    r, elapsed = run_cli(*SIM, *args, cwd=tmp_path)
    assert_refused(r, elapsed, *flags)
    assert not (tmp_path / "sim_out").exists()  # nothing written


def test_simulate_out_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    r, elapsed = run_cli(*SIM, "--out", str(tmp_path / "f"), cwd=tmp_path)
    assert_refused(r, elapsed, "--out")
    r, elapsed = run_cli(*SIM, "--out", str(tmp_path / "f" / "sub"), cwd=tmp_path)
    assert_refused(r, elapsed, "--out")


def test_simulate_still_runs_at_the_bounds(tmp_path):
    """The limits refuse nothing sensible: a short run with values at their bounds works."""
    r, _ = run_cli(*SIM, "--seed", str(2**63 - 1), "--think-time", "3600", "--step-a", "0",
                   "--step-b", "1e-9", "--step-c", "0", "--priority-classes", "100",
                   "--policy", "atom", "--out", str(tmp_path / "o"), cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    assert (tmp_path / "o" / "sim.json").is_file()


def test_in_process_main_returns_2_for_a_bad_value(capsys):
    """main() returns the exit status (tests and scripts call it): a refused value is 2, not a
    SystemExit, and its message is the one line."""
    from atom_sched.cli import main

    assert main(["simulate", "--seed", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--seed must be >= 0, got -1" in err[0], err


def test_every_value_flag_has_a_bounded_type():
    """No flag of generate or simulate parses with a bare int, float or str: each one's type
    bounds it, so a new flag cannot come back unbounded."""
    from atom_sched.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("generate", "simulate"):
        for a in sub.choices[name]._actions:
            if not a.option_strings or a.nargs == 0 or a.choices is not None:
                continue  # positionals (prompts: checked for UTF-8), switches, choices
            assert a.type not in (None, int, float, str, Path), (name, a.option_strings)
