"""KV connectors for prefill/decode disaggregation (docs/distributed.md).

* :class:`LoopbackProducer` / :class:`LoopbackConsumer`: the prefill and decode sides of a
  connector pair that moves KV blocks between two :class:`atom_sched.engine.LLMEngine` s on one
  machine over ZMQ on 127.0.0.1 (the decode side pulls, as ATOM's MoRIIO and vLLM's NIXL do).
* :class:`NixlProducer` / :class:`NixlConsumer`: the same pair with the KV moved by NVIDIA NIXL
  one-sided READs (``pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1``).
* :class:`DisaggPair`: both engines in two processes and the proxy between them.

Needs the ``engine`` extra (torch). The names are imported lazily.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DisaggPair", "LoopbackConsumer", "LoopbackProducer", "NixlConsumer", "NixlProducer",
           "engine_worker", "nixl_available"]

_WHERE = {"LoopbackConsumer": "loopback", "LoopbackProducer": "loopback",
          "NixlConsumer": "nixl", "NixlProducer": "nixl", "nixl_available": "nixl",
          "DisaggPair": "disagg", "engine_worker": "disagg"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        from importlib import import_module

        return getattr(import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
