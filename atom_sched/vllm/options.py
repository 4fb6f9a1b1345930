"""atom_sched's own policies for vLLM users: the ``"atom_sched"`` entry of vLLM's
``additional_config`` (``--additional-config '{"atom_sched": {"scheduling": "sjf"}}'`` or
``LLM(..., additional_config={...})``), checked and turned into SchedulerConfig keywords.

vLLM has no field for these, and ``additional_config`` is its place for options of plugged-in
components. vLLM's own ``--scheduling-policy`` still chooses priority scheduling. Under
``"scheduling": "fair"`` a request's tenant is ``SamplingParams.extra_args["tenant"]`` (the
OpenAI server's ``vllm_xargs``): see request_tenant().
"""

from __future__ import annotations

import math
from typing import Any

KEY = "atom_sched"
SCHEDULINGS = ("fcfs", "priority", "sjf", "fair")
TENANT_ARG = "tenant"  # the key of SamplingParams.extra_args that names a request's tenant
VICTIMS = ("service_order", "least_computed")


def _bad(what: str) -> ValueError:
    return ValueError(f'additional_config["{KEY}"]: {what}')


def policy_options(additional_config: Any, vllm_policy: str) -> dict[str, Any]:
    """The core's scheduling, preemption_victim, sjf_aging_rate, admission_watermark_blocks and
    tenant_weights for vLLM's `additional_config` and scheduling policy ("fcfs" or "priority").
    ValueError,
    naming the key, for an unknown key or a value of the wrong kind; the core checks the ranges
    when the scheduler is built (also a ValueError)."""
    opts = additional_config.get(KEY) if isinstance(additional_config, dict) else None
    if opts is None:
        return {"scheduling": vllm_policy}
    if not isinstance(opts, dict):
        raise _bad(f"must be a dict, got {type(opts).__name__}")
    known = ("scheduling", "preemption_victim", "sjf_aging_rate", "admission_watermark_blocks",
             "tenant_weights")
    unknown = sorted(str(k) for k in opts if k not in known)
    if unknown:
        raise _bad(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")
    out: dict[str, Any] = {}
    scheduling = opts.get("scheduling", vllm_policy)
    if scheduling not in SCHEDULINGS:
        raise _bad(f"scheduling must be one of {', '.join(SCHEDULINGS)}, got {scheduling!r}")
    # Priorities come with vLLM's requests only under its priority policy, and that policy
    # means priority scheduling: the two settings must agree.
    if (scheduling == "priority") != (vllm_policy == "priority"):
        raise _bad(f"scheduling {scheduling!r} with vLLM's scheduling policy {vllm_policy!r}: "
                   "priority scheduling is vLLM's --scheduling-policy priority, and only "
                   "with it")
    out["scheduling"] = scheduling
    victim = opts.get("preemption_victim", "service_order")
    if victim not in VICTIMS:
        raise _bad(f"preemption_victim must be one of {', '.join(VICTIMS)}, got {victim!r}")
    out["preemption_victim"] = victim
    if "sjf_aging_rate" in opts:
        rate = opts["sjf_aging_rate"]
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate):
            raise _bad(f"sjf_aging_rate must be a finite number, got {rate!r}")
        out["sjf_aging_rate"] = float(rate)
    if "admission_watermark_blocks" in opts:
        blocks = opts["admission_watermark_blocks"]
        if isinstance(blocks, bool) or not isinstance(blocks, int):
            raise _bad(f"admission_watermark_blocks must be an int, got {blocks!r}")
        out["admission_watermark_blocks"] = blocks
    if "tenant_weights" in opts:
        weights = opts["tenant_weights"]
        if not isinstance(weights, dict) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                for k, v in weights.items()):
            raise _bad(f"tenant_weights must be a dict of str to a number, got {weights!r}")
        out["tenant_weights"] = {k: float(v) for k, v in weights.items()}
    return out


MAX_TENANT_BYTES = 256  # the core's bound on SamplingParams.tenant


def request_tenant(extra_args: Any) -> str | None:
    """The tenant a vLLM request names in its SamplingParams.extra_args ("" when none), or None
    when what it names is not a str of at most MAX_TENANT_BYTES bytes of UTF-8. The value comes
    from the client (the server's vllm_xargs), so it is checked here: the core would raise on it
    inside vLLM's engine loop."""
    tenant = extra_args.get(TENANT_ARG, "") if isinstance(extra_args, dict) else ""
    if not isinstance(tenant, str):
        return None
    try:
        size = len(tenant.encode("utf-8"))
    except UnicodeEncodeError:
        return None
    return tenant if size <= MAX_TENANT_BYTES else None
