"""Streaming checkpoints (crisp_runtime.hf.checkpoint): one tensor at a time, experts never whole in host memory."""

from __future__ import annotations

import concurrent.futures
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from crisp_tools import stream_rss  # noqa: E402
from test_hf_dropin import FAMILIES, TOKENS, logits, make_model  # noqa: E402

from crisp_runtime import PackMismatchError, apply, load_model, pack_model, save_pack  # noqa: E402
from crisp_runtime.hf.checkpoint import (  # noqa: E402
    CheckpointError,
    checkpoint_weights_sha256,
    load_skeleton,
    pack_checkpoint,
)
from crisp_runtime.hf.moe_layers import find_moe_layers  # noqa: E402
from crisp_runtime.storage.pack import (  # noqa: E402
    model_info,
    weights_sha256,
)


def _same_layers(a, b):
    assert sorted(a) == sorted(b)
    for i in a:
        for name in ("qweight", "scales", "zeros", "neuron_order"):
            x, y = getattr(a[i], name), getattr(b[i], name)
            assert (x is None and y is None) or torch.equal(x, y), (i, name)


@pytest.mark.parametrize("family", FAMILIES)
def test_skeleton_and_streamed_pack_equal_from_pretrained(family, tmp_path):
    """save_pretrained writes the per-expert (v4) layout for these families: renaming + stacking are exercised."""
    make_model(family).save_pretrained(tmp_path / "ckpt")
    full = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", local_files_only=True).eval()
    skeleton, cmap = load_skeleton(tmp_path / "ckpt")
    assert cmap.experts  # expert tensors recognised, left on disk
    for ref in find_moe_layers(skeleton):
        assert ref.module.gate_up_proj.is_meta and "gate_up_proj" not in ref.module._parameters
    want = {k: v for k, v in full.state_dict().items() if not k.endswith(("gate_up_proj", "down_proj"))}
    got = skeleton.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(torch.equal(b, dict(skeleton.named_buffers())[n]) for n, b in full.named_buffers())  # rotary too
    _same_layers(pack_checkpoint(skeleton, cmap), pack_model(full))
    assert checkpoint_weights_sha256(skeleton, cmap) == weights_sha256(find_moe_layers(full))


def streamed_and_applied(model, folder, logits):
    """``model`` saved (``save_pretrained``) to ``folder / "ckpt"`` with its full-width pack in ``folder / "pack"``:
    the logits of the checkpoint loaded by ``load_model``, those of ``apply`` on ``model``, and load_model's handle."""
    model.save_pretrained(folder / "ckpt")
    info = {**model_info(model), "model": {"weights_sha256": weights_sha256(find_moe_layers(model))}}
    save_pack(folder / "pack", pack_model(model), info=info)
    with apply(model, folder / "pack"):
        expected = logits(model)
    loaded, handle = load_model(folder / "ckpt", folder / "pack")
    return logits(loaded), expected, handle


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_load_model_streams_and_matches_apply(family, tmp_path):
    got, expected, handle = streamed_and_applied(make_model(family), tmp_path, logits)
    assert torch.equal(got, expected)
    assert handle.stats()["tokens"] == TOKENS.numel()
    # same architecture, other weights: refused from the 4-row slices, accepted when the caller says so
    make_model(family, seed=1).save_pretrained(tmp_path / "other")
    with pytest.raises(PackMismatchError, match="other weights"):
        load_model(tmp_path / "other", tmp_path / "pack")
    load_model(tmp_path / "other", tmp_path / "pack", allow_weights_mismatch=True)


def test_fused_sharded_checkpoint_loads(tmp_path):
    """The v5 fused expert names, one shard per layer with an index (what tools.stream_rss writes)."""
    config = stream_rss.mixtral_config(2 * 2**20, layers=2, hidden=64)
    stream_rss.write_checkpoint(tmp_path / "ckpt", config)
    full = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", local_files_only=True).eval()
    skeleton, cmap = load_skeleton(tmp_path / "ckpt")
    assert {s.expert for s in cmap.experts.values()} == {-1}
    _same_layers(pack_checkpoint(skeleton, cmap), pack_model(full))
    assert checkpoint_weights_sha256(skeleton, cmap) == weights_sha256(find_moe_layers(full))


def test_broken_checkpoints_are_refused_by_name(tmp_path):
    make_model("mixtral").save_pretrained(tmp_path / "ckpt")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "ckpt" / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_skeleton(tmp_path / "bin")
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "ckpt" / "model.safetensors")
    norm = next(k for k in tensors if k.endswith("post_attention_layernorm.weight"))
    save_file({k: v for k, v in tensors.items() if k != norm}, tmp_path / "ckpt" / "model.safetensors")
    with pytest.raises(CheckpointError, match="no tensor in the checkpoint for .*post_attention_layernorm"):
        load_skeleton(tmp_path / "ckpt")
    expert = next(k for k in tensors if ".experts.1.w2" in k)
    save_file({k: v for k, v in tensors.items() if k != expert}, tmp_path / "ckpt" / "model.safetensors")
    skeleton, cmap = load_skeleton(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="missing from the checkpoint"):
        pack_checkpoint(skeleton, cmap)


# Peak host memory, measured in fresh subprocesses (tools/stream_rss.py) for two float32 Mixtral checkpoints
# that differ only in expert size (34.5 and 130.5 MiB; experts are 88% / 97% of them). What the steps add
# above the floor includes fixed costs (~30 MiB: the forward's scratch, lazy imports), so the test compares
# the two sizes: growth per extra checkpoint byte. Measured here (2-core VM), for +96 MiB of checkpoint
# (one float32 layer of experts grows 24 MiB, the 4-bit pack 13-14 MiB): load_model +33 MiB (load_pack
# holds the pack about twice while reading), streamed packing +45 MiB reading a layer at a time, +30 MiB
# since it reads one expert at a time (2026-12-01), crisp-profile --placement stream +59 MiB (2026-12-01,
# one sample), from_pretrained + forward +86 MiB.
# Bounds: load and packing within the allowance (the packed store, held up to 3x while it is read
# and pinned, plus one layer of float32 experts). crisp-profile --placement stream holds what load holds
# and, in turn, a layer read from the checkpoint for a forward and a layer dequantized from the pack for
# the held-out choice of the dominance rule: freed layers of a few MiB stay in the heap (glibc raises its
# mmap threshold to the largest block freed, up to 32 MiB), so its allowance is two layers plus 3x the
# pack; its +59 MiB was 92% of the one-layer allowance, too close for a one-sample peak. from_pretrained
# above half the checkpoint growth (the measurement does see a whole-model load).
@pytest.mark.slow
def test_peak_host_memory_grows_far_slower_than_the_checkpoint(tmp_path):
    stream_rss.write_text(tmp_path / "calib.txt")
    sizes = (32, 128)
    steps = ("pack", "profile", "load", "from_pretrained")  # in this order: load reads the pack step's pack
    configs = {mib: stream_rss.mixtral_config(mib * 2**20, layers=4, hidden=256) for mib in sizes}

    def measure(mib, step):
        return stream_rss.measure(step, tmp_path / f"ckpt{mib}", tmp_path / f"pack{mib}")

    def measure_size(mib):
        size = stream_rss.write_checkpoint(tmp_path / f"ckpt{mib}", configs[mib])
        return size, {step: measure(mib, step) for step in steps}

    # The two sizes' subprocess chains run side by side (their files are apart; each process's peak is its
    # own): 8 runs of 7-8 s each, 4 of them importing torch and transformers.
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        runs = dict(zip(sizes, pool.map(measure_size, sizes), strict=True))
    (size0, small), (size1, large) = runs[32], runs[128]
    assert large["load"]["tokens"] == small["load"]["tokens"] == 32
    json.dumps(runs)
    grown = (size1 - size0) / 2**20
    layer = sum(3 * c.num_local_experts * c.hidden_size * c.intermediate_size * 4 * sign
                for c, sign in ((configs[128], 1), (configs[32], -1))) / 2**20
    pack = (large["pack"]["pack_bytes"] - small["pack"]["pack_bytes"]) / 2**20

    def growth(step):
        return large[step]["peak_above_imports_mib"] - small[step]["peak_above_imports_mib"]

    # A fresh-clone CI run measured +41 MiB for load (3.1x the pack's growth, 43% of the checkpoint's;
    # +33 MiB here): the transient copies of the pack, not the checkpoint, set load's peak.
    upper = {"load": layer + 3 * pack, "pack": layer + 3 * pack, "profile": 2 * layer + 3 * pack}
    # Peak RSS only ever gains from the allocator's and the OS's noise (arenas, page cache, threads): in
    # full-suite runs one sample of these ~30 MiB growths was seen over its bound once in four runs. A step
    # over its bound is measured once more at both sizes and each size's lower peak kept (the two chains'
    # files stay as the first runs left them, so a second load reads the same pack).
    for step in [s for s in upper if growth(s) >= upper[s]]:
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            again = dict(zip(sizes, pool.map(lambda mib, s=step: measure(mib, s), sizes), strict=True))
        for mib, record in again.items():
            first = runs[mib][1][step]
            runs[mib][1][step] = min(first, record, key=lambda r: r["peak_above_imports_mib"])
    for step, bound in upper.items():
        assert growth(step) < bound, (step, runs, grown, layer, pack)
    assert growth("from_pretrained") > grown / 2, (runs, grown)
