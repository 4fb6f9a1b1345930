"""The test library of the atom_sched pytest suites (imported as ``from support import ...``).

* ``fake_model``: ``FakeModel``, a deterministic stand-in for the model, and ``mix``, the one
  deterministic mixer every suite uses.
* ``oracle``: ``expected_output`` (a request's full output and finish reason under docs/api.md's
  stop semantics), ATOM's static ``rejection_reason``, and the length limits.
* ``checks``: ``BatchRecord`` (a copy of one batch) and the per-batch checks against docs/api.md.
* ``driver``: ``Driver``, which runs a Scheduler with a FakeModel (sync or one step ahead) with
  ``check_invariants()`` after every call and every batch checked, and its shortcuts.
* ``device``: the device-builder suites' model, driver and random cases.
* ``dp_scenarios``: per-rank programs for the data-parallel suite (spawned processes).
"""

from .checks import BatchRecord, event_kind, state_snapshot
from .driver import Driver, admission_order, drive, make_config, make_driver, prompt, sp
from .fake_model import EOS, FakeModel, mix
from .oracle import cdiv, expected_output, final_length, position_limit, rejection_reason

__all__ = [
    "EOS",
    "BatchRecord",
    "Driver",
    "admission_order",
    "FakeModel",
    "cdiv",
    "drive",
    "event_kind",
    "expected_output",
    "final_length",
    "make_config",
    "make_driver",
    "mix",
    "position_limit",
    "prompt",
    "rejection_reason",
    "sp",
    "state_snapshot",
]
