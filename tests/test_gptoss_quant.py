"""gpt-oss's expert weights in the 4-bit format: the quantization error against the weights themselves
(SQNR), on a from_config model and on weights on the MXFP4 grid gpt-oss is released in, and the
MXFP4 encoder of tools/expert_sqnr.py checked against transformers' own decoder.

Bounds (measured on these seeds, 0.5 dB under): Gaussian weights at g64 asymmetric measure 20.8 dB
(as in tests/test_format.py); MXFP4-grid weights 20.6 dB at g64 (tools/expert_sqnr.py --synthetic mxfp4).
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from crisp_kernels import QuantFormat, layer_sqnr_db, pack_layer  # noqa: E402
from crisp_kernels.format import sqnr_db  # noqa: E402
from crisp_runtime.hf.moe_layers import find_moe_layers  # noqa: E402
from tools.expert_sqnr import main, measure_synthetic, mxfp4_encode  # noqa: E402


def test_from_config_model_sqnr():
    from transformers import AutoModelForCausalLM, GptOssConfig

    cfg = GptOssConfig(vocab_size=64, hidden_size=256, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, head_dim=16)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    for ref in find_moe_layers(model):
        w = ref.weights()
        sqnr = layer_sqnr_db(pack_layer(w.gate_up_proj, w.down_proj), w.gate_up_proj, w.down_proj)
        assert all(20.3 <= v < 30 for v in sqnr.values()), sqnr  # < 30: 4 bits cannot do better


def test_mxfp4_encoding_is_what_transformers_decodes():
    from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    # weights already on the MXFP4 grid round-trip exactly through encode + transformers' decode
    codes = torch.randint(0, 16, (2, 6, 64), generator=gen)
    exps = torch.randint(-8, 0, (2, 6, 2, 1), generator=gen).float()
    on_grid = (torch.tensor(FP4_VALUES)[codes].reshape(2, 6, 2, 32) * torch.exp2(exps)).reshape(2, 6, 64)
    on_grid[..., ::32] = 6 * torch.exp2(exps[..., 0])  # every block reaches 6 x its scale, as a real block's max
    decoded = convert_moe_packed_tensors(*mxfp4_encode(on_grid), dtype=torch.float32)  # (E, in, out)
    assert torch.equal(decoded.transpose(1, 2), on_grid)
    # Gaussian weights land near themselves (e2m1 with a shared power-of-two scale: ~ 17-19 dB)
    w = torch.randn(2, 6, 256, generator=gen)
    approx = convert_moe_packed_tensors(*mxfp4_encode(w), dtype=torch.float32).transpose(1, 2)
    assert 15 <= sqnr_db(w, approx) < 25


@pytest.mark.parametrize("kind, bound", [("gaussian", 20.3), ("mxfp4", 20.1)])
def test_synthetic_gpt_oss_layer_sqnr(kind, bound):
    sqnr = measure_synthetic(kind, QuantFormat(), experts=2, hidden=256, inter=128, seed=0)
    assert bound <= sqnr["all"] < 30, sqnr


def test_cli_errors(capsys):
    assert main([]) == 2
    assert "error: give either MODEL_DIR or --synthetic" in capsys.readouterr().err
    assert main(["--synthetic", "mxfp4", "--hidden", "100"]) == 2
    assert "error: --hidden / --intermediate: expected multiples of 32" in capsys.readouterr().err
    assert main(["/nonexistent/folder"]) == 2
    assert "is not a folder" in capsys.readouterr().err
