"""crisp-profile's placements (crisp_tools.placement): streamed from the checkpoint, and accelerate's device_map
with layers offloaded to disk, measure what the resident model measures, bit for bit.

Bit for bit, not within a tolerance: every placement computes the same float32 operations, in the same order,
on the same values (the checkpoint's tensors, as from_pretrained makes them); only where the weights wait
between forwards differs (module, page cache, accelerate's offload). A difference would be a bug (a missed
hook, a layer read in another dtype), not rounding.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from crisp_tools import profiler as prof  # noqa: E402
from crisp_tools.calibration import MaskedExperts, load_model  # noqa: E402
from crisp_tools.placement import (  # noqa: E402
    ModelLoading,
    Placement,
    load_placed,
)
from profile_helpers import PROFILE_ARGS, make_tiny_mixtral, write_text  # noqa: E402

from crisp_runtime.hf.moe_layers import find_moe_layers  # noqa: E402

# Tiny Mixtral (profile_helpers): ~150 KB of float32 weights, ~40 KB of experts per layer. 60 KB of CPU
# memory holds the embedding and part of the first layer; the rest goes to "disk" (accelerate's offload).
DISK_OFFLOAD = ["--device-map", "auto", "--max-memory", '{"cpu": 60000}']
PACK_TENSORS = ("experts.safetensors", "plan.json")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return root, make_tiny_mixtral(root / "model"), write_text(root / "calib.txt")


def _profile(tiny, name, *extra):
    root, model, text = tiny
    out = root / name
    rc = prof.main(["--model", str(model), "--data", str(text), "--out", str(out), "--work-dir",
                    str(root / f"work-{name}"), "--keep-work", *PROFILE_ARGS, *extra])
    assert rc == 0
    stats = next((root / f"work-{name}").glob("run-*/stats.safetensors"))
    from safetensors.torch import load_file

    record = json.loads((out / "pack.json").read_text())
    for key in ("elapsed_s", "files"):
        record.pop(key, None)
    return {n: (out / n).read_bytes() for n in PACK_TENSORS}, load_file(stats), record


@pytest.fixture(scope="module")
def resident(tiny):
    return _profile(tiny, "resident")


@pytest.mark.parametrize("placement", [["--placement", "stream"], DISK_OFFLOAD], ids=["stream", "disk-offload"])
def test_placements_profile_exactly_as_resident(tiny, resident, placement):
    files, stats, record = _profile(tiny, "pack-" + placement[1], *placement)
    want_files, want_stats, want_record = resident
    assert sorted(stats) == sorted(want_stats)
    for name in stats:  # importance sums, pair counts / weights, dominance damage: the same numbers
        assert torch.equal(stats[name], want_stats[name]) or (
            stats[name].is_floating_point() and torch.equal(stats[name].isnan(), want_stats[name].isnan())
            and torch.equal(stats[name].nan_to_num(), want_stats[name].nan_to_num())), name
    assert files == want_files  # the 4-bit experts in importance order, and the plan
    assert record == want_record  # fingerprint, search losses, dominance choice
    assert not list(tiny[0].glob(".crisp-offload-*"))  # the default offload folder went with the run


def test_disk_offload_happens_and_hooks_see_real_weights(tiny, tmp_path):
    """The profiling instrument sits under accelerate's hooks: offloaded experts are meta between forwards and
    real inside them; the observed activations equal the resident model's; leaving restores the hook."""
    _, model_dir, _ = tiny
    from accelerate.utils import convert_file_size_to_int  # noqa: F401 - accelerate present

    loading = ModelLoading(Placement.DEVICE_MAP, "auto", {"cpu": 60000}, tmp_path / "offload")
    placed = load_placed(model_dir, torch.device("cpu"), "auto", loading, protected={"--model": str(model_dir)},
                         beside=tmp_path)
    resident, layers = load_model(model_dir)
    try:
        assert "disk" in placed.model.hf_device_map.values(), placed.model.hf_device_map
        offloaded = [r for r in placed.layers if r.module.gate_up_proj.is_meta]
        assert offloaded and all(hasattr(r.module, "_hf_hook") for r in offloaded)
        tokens = torch.arange(40).view(2, 20)

        def observe(model, refs):
            seen = {}

            def observer(layer_id, expert, h, routing):
                seen[(layer_id, expert)] = h.clone()

            with MaskedExperts(model, refs, observer=observer), torch.no_grad():
                logits = model(input_ids=tokens).logits
            return seen, logits

        got, got_logits = observe(placed.model, placed.layers)
        want, want_logits = observe(resident, layers)
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
        assert torch.equal(got_logits, want_logits)
        for ref in offloaded:  # the hook's own forward again, weights offloaded again
            assert ref.module._old_forward.__func__ is type(ref.module).forward
            assert ref.module.gate_up_proj.is_meta
        with torch.no_grad():
            assert torch.equal(placed.model(input_ids=tokens).logits, resident(input_ids=tokens).logits)
    finally:
        assert placed.close() == []
    assert not (tmp_path / "offload").exists()


def _cases(tiny, tmp_path):
    root, model, _ = tiny
    exists = tmp_path / "exists"
    exists.mkdir()
    return {
        "offload folder exists": (["--device-map", "auto", "--offload-folder", str(exists)], "exists"),
        "offload folder inside the model": (["--device-map", "auto", "--offload-folder", str(model / "off")],
                                            "lies inside the input --model"),
        "max-memory without device-map": (["--max-memory", '{"cpu": "1GiB"}'], "only with --device-map"),
        "offload folder without device-map": (["--offload-folder", str(tmp_path / "o")], "only with --device-map"),
        "device-map with stream": (["--device-map", "auto", "--placement", "stream"], "not with --placement"),
        "device-map not JSON": (["--device-map", "everywhere"], "expected one of auto"),
        "device-map bad device": (["--device-map", '{"model": "gpu7"}'], "expected a GPU index"),
        "max-memory bad size": (["--device-map", "auto", "--max-memory", '{"cpu": "lots"}'], "expected a size"),
        "max-memory not an object": (["--device-map", "auto", "--max-memory", "[1]"], "JSON object"),
    }


@pytest.mark.parametrize("case", ["offload folder exists", "offload folder inside the model",
                                  "max-memory without device-map", "offload folder without device-map",
                                  "device-map with stream", "device-map not JSON", "device-map bad device",
                                  "max-memory bad size", "max-memory not an object"])
def test_bad_placement_options_exit_2_and_write_nothing(tiny, tmp_path, capsys, case):
    argv, message = _cases(tiny, tmp_path)[case]
    root, model, text = tiny
    before = sorted(p.name for p in tmp_path.iterdir())
    model_files = sorted(p.name for p in model.iterdir())
    rc = prof.main(["--model", str(model), "--data", str(text), "--out", str(tmp_path / "out"), "--samples", "4",
                    "--seq-len", "32", "--quiet", *argv])
    assert rc == 2
    err = capsys.readouterr().err
    assert "crisp-profile: error:" in err and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert sorted(p.name for p in model.iterdir()) == model_files


def test_offload_folder_removed_after_a_refused_or_interrupted_run(tiny, tmp_path):
    root, model, text = tiny
    # refused after the model is loaded (--seq-len beyond the model): the folder made for the run goes
    rc = prof.main(["--model", str(model), "--data", str(text), "--out", str(tmp_path / "out"), "--seq-len", "65",
                    "--samples", "4", "--quiet", *DISK_OFFLOAD, "--offload-folder", str(tmp_path / "off")])
    assert rc == 2 and not (tmp_path / "off").exists()
    with pytest.raises(prof.ProfileInterrupted):
        prof.main(["--model", str(model), "--data", str(text), "--out", str(tmp_path / "out"), *PROFILE_ARGS,
                   *DISK_OFFLOAD, "--offload-folder", str(tmp_path / "off")], interrupt_after=1)
    assert not (tmp_path / "off").exists() and not (tmp_path / "out").exists()


def test_streamed_model_keeps_experts_on_disk(tiny):
    _, model_dir, _ = tiny
    placed = load_placed(model_dir, torch.device("cpu"), "auto", ModelLoading(Placement.STREAM), protected={},
                         beside=model_dir.parent)
    assert all(r.module.gate_up_proj.is_meta for r in find_moe_layers(placed.model))
    full = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    for ref, full_ref in zip(placed.layers, find_moe_layers(full), strict=True):
        gate_up, down = placed.experts.checkpoint[ref.layer_id]
        assert torch.equal(gate_up, full_ref.module.gate_up_proj) and torch.equal(down, full_ref.module.down_proj)


@pytest.mark.parametrize("symmetric", [False, True])
def test_stored_weights_expert_by_expert_equal_the_whole_layer(symmetric):
    """calibration.stored_weights dequantizes one expert at a time (memory); the result is the whole layer's."""
    from crisp_tools.calibration import stored_weights

    from crisp_kernels.format import PackedLayer, QuantFormat, dequantize_layer, pack_layer

    gen = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(4, 2 * 96, 128, generator=gen), torch.randn(4, 128, 96, generator=gen)
    order = torch.stack([torch.randperm(96, generator=gen) for _ in range(4)])
    layer = pack_layer(gate_up, down, QuantFormat(symmetric=symmetric), neuron_order=order)
    want = dequantize_layer(PackedLayer(layer.fmt, layer.qweight, layer.scales, layer.zeros,
                                        torch.arange(96).expand(4, -1).contiguous()))
    got = stored_weights(layer)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
