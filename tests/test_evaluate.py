"""crisp-eval end to end: profile -> pack -> plan -> apply -> evaluation, both engines, equal bytes."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from crisp_tools import evaluate as ev  # noqa: E402
from crisp_tools import profile_model as prof  # noqa: E402
from crisp_tools.calibration import contiguous_windows, load_model, score_windows  # noqa: E402
from profile_helpers import PROFILE_ARGS, make_tiny_mixtral, write_text  # noqa: E402

from crisp_runtime import apply, load_pack  # noqa: E402
from crisp_runtime.models import record_routing  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    model = make_tiny_mixtral(root / "model")
    text = write_text(root / "calib.txt")
    held = write_text(root / "heldout.txt", 4000)
    out = root / "pack"
    assert prof.main(["--model", str(model), "--data", str(text), "--out", str(out), *PROFILE_ARGS]) == 0
    return root, model, held, out


def _run(setup, engine, tmp_path):
    _, model, held, out = setup
    path = tmp_path / f"{engine}.json"
    rc = ev.main(["--model", str(model), "--crisp", str(out), "--data", str(held), "--seq-len", "32",
                  "--samples", "24", "--engine", engine, "--json", str(path), "--quiet", "--threads", "1"])
    assert rc == 0
    return json.loads(path.read_text())


def test_eval_engines_agree_and_bytes_match(setup, tmp_path, capsys):
    runtime = _run(setup, "runtime", tmp_path)
    table = capsys.readouterr().out
    reference = _run(setup, "reference", tmp_path)
    by_rt = {r["policy"]: r for r in runtime["records"]}
    by_ref = {r["policy"]: r for r in reference["records"]}
    assert list(by_rt) == ["dense", "full", "crisp", "uniform", "skip_aux", "skip_aux_all"]
    for name in by_rt:
        for key in ("policy", "bytes_per_token", "perplexity", "accuracy"):
            assert key in by_rt[name]
        assert by_rt[name]["bytes_per_token"] == pytest.approx(by_ref[name]["bytes_per_token"], rel=1e-12)
        assert by_rt[name]["perplexity"] == pytest.approx(by_ref[name]["perplexity"], rel=1e-4)
    full_bpt = runtime["full_width_bytes_per_token"]
    assert by_rt["full"]["bytes_per_token"] == full_bpt
    assert by_rt["skip_aux_all"]["bytes_per_token"] == full_bpt / 2
    # baselines at equal bytes: uniform within half a neuron step, skip-aux close
    step = full_bpt / setup_intermediate(setup)
    assert abs(by_rt["uniform"]["bytes_per_token"] - by_rt["crisp"]["bytes_per_token"]) <= step / 2 + 1e-9
    assert abs(by_rt["skip_aux"]["bytes_fraction_of_full"] - by_rt["crisp"]["bytes_fraction_of_full"]) < 0.05
    assert "crisp" in table and "uniform" in table and "relative accuracy loss" in table


def setup_intermediate(setup):
    return load_pack(setup[3]).plan.intermediate_size


def test_profile_pack_plan_apply_evaluation(setup):
    """The pack's plan through crisp_runtime.apply: bytes per token = widths x neuron bytes of the plan."""
    _, model_dir, held, out = setup
    model, refs = load_model(model_dir)
    pack = load_pack(out)
    windows = contiguous_windows([held.read_text()], 8, 32)
    with apply(model, out) as handle, record_routing(model, refs) as trace:
        scores = score_windows(model, windows)
        stats = handle.stats()
    assert torch.isfinite(scores.nll).all()
    layer = next(iter(pack.layers.values()))
    nb = layer.fmt.neuron_nbytes(layer.hidden_size)
    expected = sum(int(pack.plan.token_widths(lid, *trace.layer(lid)).sum()) for lid in pack.layers) * nb
    assert stats["bytes_routed"] == expected
    assert stats["bytes_routed"] / stats["tokens"] <= 0.56 * 2 * 2 * layer.intermediate_size * nb  # k * L * I * nb


def test_eval_bad_input(setup, tmp_path, capsys):
    _, model, held, out = setup
    assert ev.main(["--model", str(model), "--crisp", str(tmp_path / "none"), "--data", str(held)]) == 2
    assert "crisp-eval: error:" in capsys.readouterr().err
    assert ev.main(["--model", str(model), "--crisp", str(out), "--data", str(held), "--seq-len", "32",
                    "--samples", "100000"]) == 2
    assert "too little text" in capsys.readouterr().err


def test_evidence_report_runs(setup, tmp_path, capsys):
    from crisp_tools import evidence

    _, model, held, out = setup
    path = tmp_path / "ev.json"
    rc = evidence.main(["--model", str(model), "--crisp", str(out), "--data", str(held), "--seq-len", "32",
                        "--samples", "12", "--top-pairs", "3", "--json", str(path), "--quiet", "--threads", "1"])
    assert rc == 0
    ev = json.loads(path.read_text())
    for layer in ev["skew"].values():
        assert 0.0 <= layer["bottom29_share"] <= layer["top25_share"] <= 1.0
    assert set(ev["uniform_50"]["all_layers"]) == {"hot", "medium", "cold"}
    assert len(ev["masking"]["combinations"]) <= 3
    assert "## 5. Dropping a whole expert" in capsys.readouterr().out


def test_bf16_checkpoint_profiles_in_its_dtype_and_evaluates_in_float32(tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_mixtral(tmp_path / "fp32")
    bf16_dir = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(model_dir).to(torch.bfloat16).save_pretrained(bf16_dir)
    model, _ = load_model(bf16_dir, "cpu", "auto")
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16  # auto: the checkpoint's dtype
    text = write_text(tmp_path / "calib.txt")
    out = tmp_path / "pack"
    assert prof.main(["--model", str(bf16_dir), "--data", str(text), "--out", str(out), *PROFILE_ARGS]) == 0
    # The pack identifies the weights, not the dtype they were loaded in: bf16 -> float32 is exact.
    rc = ev.main(["--model", str(bf16_dir), "--crisp", str(out), "--data", str(text), "--seq-len", "32",
                  "--samples", "8", "--dtype", "float32", "--quiet", "--threads", "1"])
    assert rc == 0
    with pytest.raises(ev.CliError, match="--dtype"):
        load_model(bf16_dir, "cpu", "float64")
