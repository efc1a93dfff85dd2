"""A tiny random Mixtral checkpoint, a few KB of text and one crisp-profile run, shared by the tools' tests."""

from __future__ import annotations

from pathlib import Path

import torch

# A frozen text (the first 8000 characters of one version of the plan module's source): reading the live module
# would make any edit near its top change the profiled plan and break the tools' tests.
TEXT_SOURCE = Path(__file__).resolve().parent / "data" / "profile-text.txt"

# Small enough for CI: H=64 (one quantization group), I=32, 2 MoE layers, 4 experts, top-2.
PROFILE_ARGS = ["--samples", "24", "--seq-len", "32", "--batch-size", "8", "--dominance-samples", "16",
                "--dominance-min-tokens", "8", "--dominance-max-windows", "8", "--search-target-bytes", "0.55",
                "--search-samples", "8", "--threads", "1", "--quiet"]


def make_tiny_mixtral(directory: Path, seed: int = 0, *, experts: int = 4, top_k: int = 2) -> Path:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, num_local_experts=experts, num_experts_per_tok=top_k,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    model = MixtralForCausalLM(config)
    # A random router is nearly uniform; sharpen it so that combinations are skewed like a trained one.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(8.0)
    model.save_pretrained(directory)
    return directory


def write_text(path: Path, nbytes: int = 8000) -> Path:
    path.write_text(TEXT_SOURCE.read_text(encoding="utf-8")[:nbytes], encoding="utf-8")
    return path
