#!/usr/bin/env python3
"""Quantization error of a model's experts in CRISP's 4-bit format: SQNR (dB) against the weights
themselves, per MoE layer and projection (gate, up, down) and over all, as JSON on stdout.

    python tools/expert_sqnr.py MODEL_DIR [--group-size 64] [--symmetric]
    python tools/expert_sqnr.py --synthetic mxfp4 [--experts 4] [--hidden 2880] [--intermediate 2880]

MODEL_DIR: a local transformers checkpoint of a supported family (gpt-oss included: its experts are
de-interleaved by ``crisp_runtime.hf.moe_layers``, exactly as the drop-in packs them), loaded on the CPU in
its stored dtype; nothing is downloaded. ``--synthetic`` measures one gpt-oss-shaped layer
(gpt-oss-20b's H = I = 2880 by default) without a checkpoint: ``gaussian`` weights (std 0.02, what
``from_config`` initialises), or ``mxfp4`` weights, Gaussian weights first rounded to the MXFP4
grid gpt-oss is released in (blocks of 32 along the input dimension, e2m1 elements, power-of-two
scales), encoded as its checkpoint stores them and decoded by transformers' own
``convert_moe_packed_tensors``: the checkpoint's weights are MXFP4 values, so that is what the
4-bit format has to reproduce.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from crisp_kernels import QuantFormat, gpt_oss_to_v5, layer_sqnr_db, pack_layer

MXFP4_BLOCK = 32  # elements per shared scale (OCP MX)
_E2M1_EMAX = 2  # the largest e2m1 magnitude is 6 = 1.5 * 2**2


def mxfp4_encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., N) weights -> gpt-oss checkpoint tensors (blocks (..., N/32, 16) uint8, scales (..., N/32) uint8):
    shared exponent floor(log2(absmax)) - 2 per block, elements rounded to the nearest e2m1 value
    (saturating at 6), low nibble = even element, scale stored as exponent + 127."""
    from transformers.integrations.mxfp4 import FP4_VALUES

    *lead, n = w.shape
    groups = w.float().reshape(*lead, n // MXFP4_BLOCK, MXFP4_BLOCK)
    absmax = groups.abs().amax(dim=-1).clamp_min(2.0**-126)
    exp = torch.floor(torch.log2(absmax)) - _E2M1_EMAX
    scaled = groups / torch.exp2(exp).unsqueeze(-1)
    values = torch.tensor(FP4_VALUES[:8])  # the non-negative codes 0..7; code + 8 is the negative
    code = (scaled.abs().unsqueeze(-1) - values).abs().argmin(dim=-1) + 8 * (scaled < 0)
    code = code.to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8)


def synthetic_gpt_oss_layer(kind: str, experts: int, hidden: int, inter: int, seed: int):
    """gpt-oss's experts tensors (gate_up_proj (E, H, 2I) interleaved, down_proj (E, I, H)) and zero
    biases: Gaussian (std 0.02), or those Gaussians on the MXFP4 grid (module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.02  # as stored: (E, out, in)
    down = torch.randn(experts, hidden, inter, generator=gen) * 0.02
    if kind == "mxfp4":
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        gate_up = convert_moe_packed_tensors(*mxfp4_encode(gate_up), dtype=torch.float32)  # -> (E, H, 2I)
        down = convert_moe_packed_tensors(*mxfp4_encode(down), dtype=torch.float32)  # -> (E, I, H)
    else:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    return gate_up, torch.zeros(experts, 2 * inter), down, torch.zeros(experts, hidden)


def measure_synthetic(kind: str, fmt: QuantFormat, experts: int, hidden: int, inter: int, seed: int) -> dict:
    gate_up, _, down, _ = gpt_oss_to_v5(*synthetic_gpt_oss_layer(kind, experts, hidden, inter, seed))
    return layer_sqnr_db(pack_layer(gate_up, down, fmt), gate_up, down)


def measure_model(model_dir: Path, fmt: QuantFormat) -> dict[int, dict]:
    """SQNR per MoE layer of a local checkpoint (one layer's float32 copy at a time)."""
    from transformers import AutoModelForCausalLM

    from crisp_runtime.hf.moe_layers import find_moe_layers

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto", local_files_only=True)
    out = {}
    for ref in find_moe_layers(model):
        w = ref.weights()
        gate_up, down = w.gate_up_proj.float(), w.down_proj.float()
        out[ref.layer_id] = layer_sqnr_db(pack_layer(gate_up, down, fmt), gate_up, down)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", nargs="?", type=Path, help="local transformers checkpoint folder")
    parser.add_argument("--synthetic", choices=("gaussian", "mxfp4"), help="a synthetic gpt-oss layer instead")
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2880)
    parser.add_argument("--intermediate", type=int, default=2880)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--symmetric", action="store_true")
    args = parser.parse_args(argv)
    try:
        if (args.model_dir is None) == (args.synthetic is None):
            raise ValueError("give either MODEL_DIR or --synthetic {gaussian,mxfp4}")
        fmt = QuantFormat(group_size=args.group_size, symmetric=args.symmetric)
        if args.synthetic:
            for name in ("experts", "hidden", "intermediate"):
                if getattr(args, name) <= 0:
                    raise ValueError(f"--{name}: expected a positive integer, got {getattr(args, name)}")
            if args.hidden % MXFP4_BLOCK or args.intermediate % MXFP4_BLOCK:
                raise ValueError(f"--hidden / --intermediate: expected multiples of {MXFP4_BLOCK} (MXFP4 blocks)")
            fmt.check_hidden_size(args.hidden, "--hidden")
            result = {"synthetic": args.synthetic, "shape": [args.experts, args.hidden, args.intermediate],
                      "sqnr_db": measure_synthetic(args.synthetic, fmt, args.experts, args.hidden, args.intermediate,
                                                   args.seed)}
        else:
            if not args.model_dir.is_dir():
                raise ValueError(f"MODEL_DIR: {args.model_dir} is not a folder")
            result = {"model": str(args.model_dir), "sqnr_db": measure_model(args.model_dir, fmt)}
    except (ValueError, TypeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result["format"] = {"group_size": fmt.group_size, "symmetric": fmt.symmetric}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
