"""crisp_tools.key_study: out-of-sample R^2 by group, the frequency / damage correlation, the keys' codes, the CLI."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from crisp_tools import key_study as ks  # noqa: E402
from crisp_tools import profiler as prof  # noqa: E402
from profile_helpers import PROFILE_ARGS, make_tiny_mixtral, write_text  # noqa: E402

from crisp_runtime.planning.pairs import CombinationKey, combination_codes  # noqa: E402


def _grouped(n, groups, noise, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, groups, (n,), generator=g)
    means = torch.linspace(0.0, 1.0, groups)
    return codes, means[codes] + noise * torch.randn(n, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("noise, shuffled, low, high", [
    (0.0, False, 1.0, 1.0),  # the key is the whole story
    (0.2, False, 0.5, 0.95),  # the key explains most of it
    (0.2, True, -0.1, 0.05),  # a key unrelated to the damage explains nothing out of sample
])
def test_group_r2(noise, shuffled, low, high):
    fit_codes, fit_y = _grouped(4000, 8, noise, seed=1)
    test_codes, test_y = _grouped(2000, 8, noise, seed=2)
    if shuffled:
        fit_codes = fit_codes[torch.randperm(fit_codes.numel(), generator=torch.Generator().manual_seed(3))]
    assert low - 1e-12 <= ks.group_r2(fit_codes, fit_y, test_codes, test_y) <= high + 1e-12


def test_group_r2_by_hand():
    """Fit means 1 (code 0) and 3 (code 1), overall 2; test code 2 was never fitted and predicts 2."""
    fit = torch.tensor([0, 0, 1, 1]), torch.tensor([0.0, 2.0, 2.0, 4.0])
    test = torch.tensor([0, 1, 2]), torch.tensor([1.0, 4.0, 2.0])
    sse, sst = 0 + 1 + 0, 1 + 4 + 0
    assert ks.group_r2(*fit, *test) == pytest.approx(1 - sse / sst)


@pytest.mark.parametrize("sign", [1, -1])
def test_spearman_frequency_damage(sign):
    # group g has 20 + 10 g tokens and mean damage sign * g
    codes = torch.cat([torch.full((20 + 10 * g,), g) for g in range(6)])
    y = sign * codes.double()
    assert ks.spearman_frequency_damage(codes, y) == pytest.approx(sign)


def test_the_plans_keys_are_the_runtimes_codes():
    e, k = 16, 6
    g = torch.Generator().manual_seed(0)
    index = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(200)])
    weights = torch.rand(200, k, generator=g).softmax(dim=1)
    order = weights.argsort(dim=1, descending=True, stable=True)
    si, sw = index.gather(1, order), weights.gather(1, order)
    edges = {"rank2": torch.tensor([0.1, 0.15, 0.2]), "tail": torch.linspace(0.1, 0.5, 7)}
    codes = ks.key_codes(si, sw, e, 3, edges)
    for key in CombinationKey:
        assert torch.equal(codes[key.value], combination_codes(key, index, weights, e))
    rank2 = codes[f"leading expert x rank-2 routing weight ({ks.RANK2_BUCKETS} buckets)"]
    assert torch.equal(rank2 // ks.RANK2_BUCKETS, si[:, 0])
    assert torch.equal(rank2 % ks.RANK2_BUCKETS, torch.bucketize(sw[:, 2].contiguous(), edges["rank2"]))


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    root = tmp_path_factory.mktemp("key-study")
    text = write_text(root / "calib.txt")
    out = {}
    for top_k in (2, 4):
        model = make_tiny_mixtral(root / f"model{top_k}", experts=8, top_k=top_k)
        pack = root / f"pack{top_k}"
        assert prof.main(["--model", str(model), "--data", str(text), "--out", str(pack), *PROFILE_ARGS]) == 0
        out[top_k] = model, pack, text
    return out


def test_cli_writes_every_key_per_layer(packs, tmp_path, capsys):
    model, pack, text = packs[4]
    path = tmp_path / "study.json"
    assert ks.main(["--model", str(model), "--crisp", str(pack), "--data", str(text), "--fit-samples", "8",
                    "--test-samples", "4", "--seq-len", "32", "--num-dominant", "2", "--quiet",
                    "--json", str(path)]) == 0
    study = json.loads(path.read_text())
    assert study["num_dominant"] == 2 and study["top_k"] == 4 and sorted(study["layers"]) == ["0", "1"]
    for layer in study["layers"].values():
        assert len(layer["keys"]) == 4 and layer["mean_damage_test"] > 0
        assert all(v["oos_r2"] <= 1.0 for v in layer["keys"].values())
    assert "R^2" in capsys.readouterr().out


@pytest.mark.parametrize("top_k, extra, message", [
    (2, [], "wider than top-2"),
    (4, ["--num-dominant", "4"], "--num-dominant must lie in"),
])
def test_cli_refusals(packs, capsys, top_k, extra, message):
    model, pack, text = packs[top_k]
    assert ks.main(["--model", str(model), "--crisp", str(pack), "--data", str(text), "--fit-samples", "4",
                    "--test-samples", "4", "--seq-len", "32", "--quiet", *extra]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("experts, seed, message", [
    (4, 0, "this CRISP pack was made for another model"),  # another architecture: 4 experts, the pack's 8
    (8, 1, "made from other weights than this model (weights fingerprint"),  # the same one, other weights
])
def test_cli_refuses_a_pack_of_another_model_before_the_study(packs, tmp_path, capsys, monkeypatch, experts, seed,
                                                              message):
    monkeypatch.setattr(ks.KeyStudy, "run", lambda self: pytest.fail("studied"))
    _, pack, text = packs[4]
    model = make_tiny_mixtral(tmp_path / "model", seed, experts=experts, top_k=4)
    capsys.readouterr()
    assert ks.main(["--model", str(model), "--crisp", str(pack), "--data", str(text), "--fit-samples", "2",
                    "--test-samples", "2", "--seq-len", "32", "--quiet"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]  # (transformers' loading bar aside)
    assert len(errors) == 1 and errors[0].startswith(f"key_study: error: --crisp {pack}: ") and message in errors[0]
    assert "Traceback" not in err and "=True" not in err  # no API argument offered on a command line
