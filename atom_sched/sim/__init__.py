"""The serving simulator (``atom-sched simulate``): the real Scheduler on a simulated clock, with
Poisson arrivals, a GPU step-time model, ShareGPT V3 conversations or synthetic mixes, and the
latency and throughput figures a serving benchmark reports (docs/perf.md, "Serving simulator").

* ``workloads``: conversations of turns (ShareGPT, synthetic).
* ``simulator``: :func:`simulate`, :class:`StepTimeModel`, :class:`SimResult`.
* ``report``: the table, JSON and latency plot.
* ``cli``: the command line.
"""

from .simulator import SimResult, StepTimeModel, simulate
from .workloads import Conversation, Turn

__all__ = ["Conversation", "SimResult", "StepTimeModel", "Turn", "simulate"]
