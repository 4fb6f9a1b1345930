"""Writes a small EAGLE-3 drafter head for the test model (SmolLM2-135M, a Llama), offline.

No EAGLE head for SmolLM2 is on this machine, so the EAGLE test makes one with seeded random
weights: one decoder layer over [token embedding, fused hidden states], the fc layer that fuses
three of the target's hidden states, a final norm, and a draft vocabulary of a few common tokens
with its own lm_head (vLLM maps draft ids back through ``d2t``). The head has no embeddings:
vLLM's proposer shares the target's. Its attention matches the target's (heads, head size), so
its KV layer joins the target's one KV-cache group. Its drafts are poor (few are accepted), but
they are a pure function of what the scheduler gives the runner, so both schedulers must see the
same ones.
"""

from __future__ import annotations

import json
from pathlib import Path

STD = 0.02
INTERMEDIATE = 256
# Common SmolLM2 tokens (",", ".", " the", " of"...): the only ones the head proposes.
DRAFT_VOCAB = [2, 28, 30, 260, 282, 284, 314, 504]


def make_eagle3_head(parent: Path, model_path: str, seed: int) -> str:
    """The head's folder under ``parent`` (made once): ``seed`` decides its weights."""
    import torch
    from safetensors.torch import save_file

    folder = parent / f"eagle3_seed{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / "model.safetensors").exists():
        return str(folder)
    target = json.loads((Path(model_path) / "config.json").read_text())
    hidden, heads = target["hidden_size"], target["num_attention_heads"]
    kv_heads = target["num_key_value_heads"]
    head_dim = target.get("head_dim", hidden // heads)
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * STD

    # vLLM's loader reads midlayer.* as the head's layer 0; its attention and MLP take the
    # token's embedding and the fused hidden state side by side (2 * hidden inputs).
    layer = "midlayer."
    tensors = {
        layer + "self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        layer + "self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        layer + "self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        layer + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        layer + "mlp.gate_proj.weight": rand(INTERMEDIATE, hidden),
        layer + "mlp.up_proj.weight": rand(INTERMEDIATE, hidden),
        layer + "mlp.down_proj.weight": rand(hidden, INTERMEDIATE),
        layer + "input_layernorm.weight": torch.ones(hidden),
        layer + "hidden_norm.weight": torch.ones(hidden),
        layer + "post_attention_layernorm.weight": torch.ones(hidden),
        "fc.weight": rand(hidden, 3 * hidden),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": rand(len(DRAFT_VOCAB), hidden),
        # Draft id i is target id i + d2t[i]; t2d marks the target ids the head can propose.
        "d2t": torch.tensor([t - i for i, t in enumerate(DRAFT_VOCAB)], dtype=torch.int64),
        "t2d": torch.isin(torch.arange(target["vocab_size"]), torch.tensor(DRAFT_VOCAB)),
    }
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    # vLLM's EAGLE config turns LlamaForCausalLM into its Eagle3LlamaForCausalLM.
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": INTERMEDIATE, "num_hidden_layers": 1,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "hidden_act": "silu", "max_position_embeddings": target["max_position_embeddings"],
        "rms_norm_eps": target["rms_norm_eps"],
        "rope_parameters": target.get("rope_parameters", {
            "rope_theta": target.get("rope_theta", 10000.0), "rope_type": "default"}),
        "attention_bias": False, "mlp_bias": False, "vocab_size": target["vocab_size"],
        "tie_word_embeddings": False, "dtype": "float32",
        "draft_vocab_size": len(DRAFT_VOCAB), "target_hidden_size": hidden}))
    return str(folder)
