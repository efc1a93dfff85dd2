"""Packed safetensors files: exact round trips, atomic writes, and clear errors on bad files."""

import json
import os

import pytest
import safetensors.torch
import torch

import crisp_kernels.io
from crisp_kernels import PackFormatError, QuantFormat, load_packed, pack_layer, read_packed_metadata, save_packed
from crisp_kernels.io import FORMAT_NAME, FORMAT_VERSION


def _layer(seed: int, fmt: QuantFormat, num_experts=2, inter=16, hidden=128):
    gen = torch.Generator().manual_seed(seed)
    order = torch.stack([torch.randperm(inter, generator=gen) for _ in range(num_experts)])
    return pack_layer(
        torch.randn(num_experts, 2 * inter, hidden, generator=gen),
        torch.randn(num_experts, hidden, inter, generator=gen),
        fmt,
        neuron_order=order,
    )


def _assert_layers_equal(a, b):
    assert a.keys() == b.keys()
    for idx in a:
        assert a[idx].fmt == b[idx].fmt
        ta, tb = a[idx].tensors(), b[idx].tensors()
        assert ta.keys() == tb.keys()
        for name in ta:
            assert ta[name].dtype == tb[name].dtype
            assert torch.equal(ta[name], tb[name]), name


@pytest.mark.parametrize("fmt", [QuantFormat(group_size=64), QuantFormat(group_size=32, symmetric=True)])
def test_round_trip_exact(tmp_path, fmt):
    layers = {0: _layer(0, fmt), 3: _layer(1, fmt), 7: _layer(2, fmt)}
    path = tmp_path / "experts.safetensors"
    save_packed(path, layers, extra_metadata={"model": "tiny-moe", "plan": "p1"})
    loaded = load_packed(path)
    _assert_layers_equal(layers, loaded)
    meta = read_packed_metadata(path)
    assert meta["format"] == FORMAT_NAME and meta["format_version"] == str(FORMAT_VERSION)
    assert meta["model"] == "tiny-moe" and meta["plan"] == "p1"
    assert json.loads(meta["layers"]) == [0, 3, 7]
    assert meta["group_size"] == str(fmt.group_size) and json.loads(meta["symmetric"]) == fmt.symmetric


def test_save_errors(tmp_path):
    fmt = QuantFormat(group_size=64)
    with pytest.raises(ValueError, match="layers: expected at least one"):
        save_packed(tmp_path / "a.safetensors", {})
    with pytest.raises(ValueError, match="extra_metadata: key 'format' is reserved"):
        save_packed(tmp_path / "a.safetensors", {0: _layer(0, fmt)}, extra_metadata={"format": "x"})
    with pytest.raises(ValueError, match=r"layers\[1\]: all layers of one file must share"):
        save_packed(tmp_path / "a.safetensors", {0: _layer(0, fmt), 1: _layer(0, fmt, inter=8)})
    with pytest.raises(TypeError, match=r"layers\[0\]: expected PackedLayer"):
        save_packed(tmp_path / "a.safetensors", {0: "nope"})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        save_packed(tmp_path / "missing" / "a.safetensors", {0: _layer(0, fmt)})
    assert list(tmp_path.iterdir()) == []


def test_interrupted_save_keeps_old_file(tmp_path, monkeypatch):
    fmt = QuantFormat(group_size=64)
    path = tmp_path / "experts.safetensors"
    old = {0: _layer(0, fmt)}
    save_packed(path, old)
    old_bytes = path.read_bytes()

    def crashing_write(filename, tensors, metadata):
        with open(filename, "wb") as f:
            f.write(b"partial write")
        raise OSError("disk full")

    monkeypatch.setattr(crisp_kernels.io, "write_safetensors", crashing_write)
    with pytest.raises(OSError, match="disk full"):
        save_packed(path, {0: _layer(1, fmt)})
    assert path.read_bytes() == old_bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["experts.safetensors"]  # no temp file left
    _assert_layers_equal(load_packed(path), old)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="packed experts file not found"):
        load_packed(tmp_path / "nope.safetensors")


@pytest.mark.parametrize("keep", [6, "half"])
def test_truncated_file(tmp_path, keep):
    path = tmp_path / "experts.safetensors"
    save_packed(path, {0: _layer(0, QuantFormat(group_size=64))})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if keep == "half" else data[:keep])
    with pytest.raises(PackFormatError, match="not a readable safetensors file|may be truncated"):
        load_packed(path)


def _write_raw(path, tensors, **meta_changes):
    """A file written by save_packed, then rewritten with altered tensors or metadata."""
    metadata = read_packed_metadata(path)
    metadata.update(meta_changes)
    metadata = {k: v for k, v in metadata.items() if v is not None}
    os.remove(path)
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "experts.safetensors"
    save_packed(path, {0: _layer(0, QuantFormat(group_size=64))})
    return path, safetensors.torch.load_file(str(path))


def test_wrong_format_name(saved):
    path, tensors = saved
    _write_raw(path, tensors, format="gguf")
    with pytest.raises(PackFormatError, match="format is 'gguf', expected 'crisp-packed-experts'"):
        load_packed(path)


def test_no_metadata(tmp_path):
    path = tmp_path / "plain.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(2)}, str(path))
    with pytest.raises(PackFormatError, match="format is None"):
        load_packed(path)


def test_wrong_version(saved):
    path, tensors = saved
    _write_raw(path, tensors, format_version="99")
    with pytest.raises(PackFormatError, match="format version '99' is not supported"):
        load_packed(path)


def test_incomplete_metadata(saved):
    path, tensors = saved
    _write_raw(path, tensors, hidden_size=None)
    with pytest.raises(PackFormatError, match="metadata is incomplete or invalid"):
        load_packed(path)


def test_shape_disagrees_with_metadata(saved):
    path, tensors = saved
    _write_raw(path, tensors, intermediate_size="8")
    match = r"tensor layers.0.qweight is torch.uint8 \(2, 16, 3, 64\), metadata says"
    with pytest.raises(PackFormatError, match=match):
        load_packed(path)


def test_wrong_dtype(saved):
    path, tensors = saved
    tensors["layers.0.scales"] = tensors["layers.0.scales"].float()
    _write_raw(path, tensors)
    with pytest.raises(PackFormatError, match="layers.0.scales is torch.float32"):
        load_packed(path)


def test_missing_tensor(saved):
    path, tensors = saved
    del tensors["layers.0.zeros"]
    _write_raw(path, tensors)
    with pytest.raises(PackFormatError, match="tensor layers.0.zeros is missing"):
        load_packed(path)


def test_extra_tensor(saved):
    path, tensors = saved
    tensors["layers.1.qweight"] = tensors["layers.0.qweight"].clone()
    _write_raw(path, tensors)
    match = r"unexpected tensors not described by the metadata: \['layers.1.qweight'\]"
    with pytest.raises(PackFormatError, match=match):
        load_packed(path)


def test_bad_neuron_order_in_file(saved):
    path, tensors = saved
    tensors["layers.0.neuron_order"] = torch.zeros_like(tensors["layers.0.neuron_order"])
    _write_raw(path, tensors)
    with pytest.raises(PackFormatError, match="layers.0.neuron_order: each row must be a permutation"):
        load_packed(path)
