"""The Python fixed cost of a step, for callgrind (scripts/count_instructions.sh): one running
request decoding, each step the loop `atom-sched bench`'s fixed-cost row times
(scheduler_bench.fixed_cost_steps: schedule(), views() and the six arrays a runner reads,
update()). Prefix caching is off, so no step grows a hash map:
two runs of different lengths differ by their steps alone, and the script divides by that
difference.

    python count_python_step.py STEPS
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import numpy as np

from atom_sched import SamplingParams, Scheduler, SchedulerConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/
from scheduler_bench import fixed_cost_steps  # noqa: E402


def main(steps: int) -> None:
    cfg = SchedulerConfig(num_blocks=1 << 16, block_size=16, max_num_seqs=8,
                          max_num_batched_tokens=8192, max_model_len=1 << 20,
                          enable_prefix_caching=False)
    s = Scheduler(cfg)
    s.add_request(0, list(range(3, 35)), SamplingParams(max_tokens=10**7, ignore_eos=True))
    sampled = np.full(1, 7, np.int32)
    gc.disable()
    fixed_cost_steps(s, sampled, steps)


if __name__ == "__main__":
    main(int(sys.argv[1]))
