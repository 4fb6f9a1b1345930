"""atom_sched as vLLM's scheduler: ``scheduler_cls="atom_sched.vllm.AtomScheduler"``.

Needs vLLM (``pip install atom-sched[vllm]``; on a CPU machine ``scripts/vllm_venv.sh`` builds a
venv with vLLM's CPU build). docs/vllm.md describes the mapping and what is not supported yet.
"""

from atom_sched.vllm.scheduler import AtomScheduler, UnsupportedFeature

__all__ = ["AtomScheduler", "UnsupportedFeature"]
