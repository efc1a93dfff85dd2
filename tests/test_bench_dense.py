"""``crisp-bench dense``: both variants measured on one handle, the check that catches a wrong dense kernel before
anything is timed, and the command's argument errors."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from crisp_bench import dense  # noqa: E402
from crisp_bench.cli import main  # noqa: E402

from crisp_kernels import cpu_native  # noqa: E402

needs_native = pytest.mark.skipif(not cpu_native.available(), reason="the native CPU kernel does not build here")

# a Qwen-MoE of test size: attention, a shared expert, a vocabulary larger than the hidden size
SMALL = dense.FamilyShape("small-qwen", "test", "qwen2_moe", 3,
                          dict(vocab_size=512, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                               shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                               num_attention_heads=4, num_key_value_heads=2))


@needs_native
def test_both_variants_are_measured_with_each_roles_bytes():
    records = dense.measure(SMALL, layers=2, tokens=3, prompt=4, rounds=2)
    by = {r["variant"]: r for r in records}
    assert set(by) == {"default", "keep"}
    assert by["keep"]["speedup_vs_keep"] == 1.0 and by["default"]["speedup_vs_keep"] > 0
    assert by["keep"]["dense_bytes"] == by["default"]["dense_original_bytes"]
    hidden, vocab = 64, 512
    assert by["keep"]["dense_bytes"]["head"] == vocab * hidden * 4  # fp32 as loaded
    assert set(by["default"]["dense_bytes"]) == {"attention", "mlp", "head"}
    # 8-bit blocks of 32 with an fp16 scale: 8.5 bits a weight (a bias stays fp32)
    assert by["default"]["dense_bytes"]["head"] == vocab * hidden * 8.5 / 8
    for role, nbytes in by["default"]["dense_bytes"].items():
        assert nbytes < 0.3 * by["keep"]["dense_bytes"][role]
    assert 0 < by["default"]["layer_rel_err_max"] <= dense.CHECK_TOL and by["default"]["logits_rel_err"] > 0
    assert all(len(r["rounds_ms"]) == 2 and r["expert_bytes_per_token"] > 0 for r in records)


@needs_native
def test_a_wrong_dense_kernel_is_caught_before_anything_is_timed(monkeypatch):
    from crisp_runtime.cpu import dense as cpu_dense

    def zeros(x, packed, threads=None):
        return torch.zeros(*x.shape[:-1], packed.out_features)

    monkeypatch.setattr(cpu_dense, "dense_int8", zeros)
    monkeypatch.setattr(dense, "_decode_s", lambda *a, **k: pytest.fail("timed a wrong kernel"))
    with pytest.raises(dense.DenseBenchError, match=r"dense layer model\.layers\.0\.self_attn\.q_proj differs from the "
                       "layer as loaded by 100.000%"):
        dense.measure(SMALL, layers=1, tokens=2, prompt=4, rounds=1)


@pytest.mark.parametrize(("argv", "needle"), [
    (["dense", "--shapes", "mixtral"], "mixtral"),
    (["dense", "--layers", "0"], "--layers"),
    (["dense", "--shapes", "olmoe", "--layers", "17"], "olmoe has 16 layers"),
    (["dense", "--shapes", "deepseek-v2-lite,olmoe", "--layers", "20"], "olmoe has 16 layers"),  # before any shape
])
def test_bad_arguments_exit_2_without_a_traceback(argv, needle, capsys, monkeypatch):
    monkeypatch.setattr(dense, "measure", lambda *a, **k: pytest.fail("measured before every argument was checked"))
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own refusals
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "Traceback" not in err


def test_help_names_the_shapes_and_what_is_compared(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["dense", "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "as loaded" in out
    assert all(name in out for name in ("OLMoE-1B-7B", "Qwen1.5-MoE-A2.7B", "DeepSeek-V2-Lite"))


def test_a_layer_giving_nan_fails_the_check_whatever_the_layers_after_it_give():
    from types import SimpleNamespace

    from torch import nn

    class Two(nn.Module):  # two "rounded" layers at the root, a then b; the originals beside them
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, input_ids):  # b on the same input: its error is finite
            x = input_ids.float()
            return SimpleNamespace(logits=self.a(x) + self.b(x))

    model = Two()
    original_a, original_b = nn.Linear(4, 4), nn.Linear(4, 4)
    original_a.load_state_dict(model.a.state_dict())
    original_b.load_state_dict(model.b.state_dict())
    with torch.no_grad():
        model.b.weight.add_(1e-3)  # b a little off its original
        nan_a = model.a.weight.clone()
        nan_a[0, 0] = float("nan")
        model.a.weight.copy_(nan_a)  # a gives nan
    worst, where, _ = dense._layer_errors(model, [(model, "a", original_a), (model, "b", original_b)],
                                          torch.ones(1, 4, dtype=torch.long))
    assert torch.isnan(torch.tensor(worst)) and where == "a"
