"""Writes a small PEFT LoRA adapter for the test model (SmolLM2-135M, a Llama), offline.

No adapter for it is on this machine, so the LoRA tests make their own: rank 8 on every layer's
q_proj and v_proj, with seeded random A and B (B not zero, so the adapter changes the answers).
vLLM loads it like any PEFT adapter (adapter_config.json and adapter_model.safetensors).
"""

from __future__ import annotations

import json
from pathlib import Path

RANK = 8
SCALE = 0.05  # the weights' standard deviation: enough to change some answers of SmolLM2


def make_adapter(parent: Path, model_path: str, seed: int) -> str:
    """The adapter's folder under ``parent`` (made once): ``seed`` decides its weights."""
    import torch
    from safetensors.torch import save_file

    folder = parent / f"lora_r{RANK}_s{SCALE}_seed{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / "adapter_model.safetensors").exists():
        return str(folder)
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    hidden = cfg["hidden_size"]
    kv_out = cfg["num_key_value_heads"] * cfg.get("head_dim",
                                                  hidden // cfg["num_attention_heads"])
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj, out in (("q_proj", hidden), ("v_proj", kv_out)):
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, hidden, generator=gen) * SCALE
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, RANK, generator=gen) * SCALE
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0, "bias": "none", "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": model_path, "fan_in_fan_out": False,
        "modules_to_save": None}))
    return str(folder)
