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


def reorder_changes_nothing(model_dir: Path, pack, ids: torch.Tensor) -> float:
    """The checkpoint's logits on ``ids`` in float64 before and after its experts' neurons are put in the pack's
    order (gate/up rows and down columns together): their largest absolute difference, which only the order of the
    sums moves. Each layer's order is checked to be a real permutation."""
    from crisp_tools.calibration import load_model, reorder_expert_weights

    model, layers = load_model(model_dir)
    model.double()
    model.set_experts_implementation("eager")  # grouped_mm has no float64
    with torch.no_grad():
        before = model(input_ids=ids).logits
        for ref in layers:
            order = pack.layers[ref.layer_id].neuron_order
            assert not torch.equal(order, torch.arange(order.shape[1]).expand_as(order))  # a real permutation
            gate_up, down = reorder_expert_weights(ref.module.gate_up_proj.data, ref.module.down_proj.data, order)
            ref.module.gate_up_proj.data.copy_(gate_up)
            ref.module.down_proj.data.copy_(down)
        after = model(input_ids=ids).logits
    return (after - before).abs().max().item()
