"""Save and load packed layers as safetensors (never pickle), validated on load.

One file holds any number of MoE layers of one model:

    layers.{L}.qweight       (E, I, 3, H/2) uint8
    layers.{L}.scales        (E, I, 3, H/g) fp16
    layers.{L}.zeros         (E, I, 3, H/g) uint8     (asymmetric format only)
    layers.{L}.neuron_order  (E, I) int64             original index of stored neuron j

and string metadata: format name and version, bits, group size, symmetric, H, I, E and the
layer indices. Writes are atomic: a temporary file in the same folder, fsync, then rename, so
an interrupted save leaves the old file or none, never half a file.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

from .format import PackedLayer, QuantFormat, check_permutations

FORMAT_NAME = "crisp-packed-experts"
FORMAT_VERSION = 1


class PackFormatError(ValueError):
    """A packed file that is not ours, of another version, truncated or inconsistent."""


def atomic_write(path: str | os.PathLike, write) -> None:
    """Call ``write(tmp_path)`` then atomically move the result onto ``path``."""
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: folder {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_uniform_layers(layers: Mapping[int, PackedLayer]) -> PackedLayer:
    """Check that ``layers`` is a non-empty mapping of PackedLayers sharing E, I, H and the format;
    returns the first layer."""
    if not layers:
        raise ValueError("layers: expected at least one packed layer")
    first = next(iter(layers.values()))
    for idx, layer in layers.items():
        if not isinstance(layer, PackedLayer):
            raise TypeError(f"layers[{idx}]: expected PackedLayer, got {type(layer).__name__}")
        shape = (layer.num_experts, layer.intermediate_size, layer.hidden_size, layer.fmt)
        if shape != (first.num_experts, first.intermediate_size, first.hidden_size, first.fmt):
            raise ValueError(f"layers[{idx}]: all layers of one file must share E, I, H and the format")
    return first


def save_packed(
    path: str | os.PathLike,
    layers: Mapping[int, PackedLayer],
    *,
    extra_metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``{layer_index: PackedLayer}`` to ``path`` atomically."""
    from safetensors.torch import save_file

    first = check_uniform_layers(layers)
    tensors = {}
    for idx, layer in layers.items():
        for name, t in layer.tensors().items():
            tensors[f"layers.{int(idx)}.{name}"] = t.detach().cpu().contiguous()
    metadata = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "bits": str(first.fmt.bits),
        "group_size": str(first.fmt.group_size),
        "symmetric": json.dumps(first.fmt.symmetric),
        "hidden_size": str(first.hidden_size),
        "intermediate_size": str(first.intermediate_size),
        "num_experts": str(first.num_experts),
        "layers": json.dumps(sorted(int(i) for i in layers)),
    }
    for key, value in (extra_metadata or {}).items():
        if key in metadata:
            raise ValueError(f"extra_metadata: key {key!r} is reserved")
        metadata[key] = str(value)
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def read_packed_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The metadata of a packed file, validated for format name and version, without the tensors."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"packed experts file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    except Exception as exc:  # safetensors raises its own error types for truncated/corrupt headers
        raise PackFormatError(f"{path}: not a readable safetensors file ({exc})") from exc
    if metadata.get("format") != FORMAT_NAME:
        raise PackFormatError(f"{path}: format is {metadata.get('format')!r}, expected {FORMAT_NAME!r}")
    if metadata.get("format_version") != str(FORMAT_VERSION):
        raise PackFormatError(
            f"{path}: format version {metadata.get('format_version')!r} is not supported "
            f"(this CRISP reads version {FORMAT_VERSION})"
        )
    return metadata


def load_packed(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict[int, PackedLayer]:
    """Read a file written by :func:`save_packed`; every shape is checked against the metadata."""
    from safetensors.torch import load_file

    path = Path(path)
    metadata = read_packed_metadata(path)
    try:
        fmt = QuantFormat(
            bits=int(metadata["bits"]),
            group_size=int(metadata["group_size"]),
            symmetric=bool(json.loads(metadata["symmetric"])),
        )
        hidden = int(metadata["hidden_size"])
        inter = int(metadata["intermediate_size"])
        num_experts = int(metadata["num_experts"])
        layer_ids = [int(i) for i in json.loads(metadata["layers"])]
    except (KeyError, ValueError, TypeError) as exc:
        raise PackFormatError(f"{path}: metadata is incomplete or invalid ({exc})") from exc
    try:
        tensors = load_file(str(path), device=str(device))
    except Exception as exc:
        raise PackFormatError(f"{path}: cannot read tensors, the file may be truncated ({exc})") from exc

    groups = hidden // fmt.group_size
    expected = {
        "qweight": ((num_experts, inter, 3, hidden // 2), torch.uint8),
        "scales": ((num_experts, inter, 3, groups), torch.float16),
        "neuron_order": ((num_experts, inter), torch.int64),
    }
    if not fmt.symmetric:
        expected["zeros"] = ((num_experts, inter, 3, groups), torch.uint8)
    layers: dict[int, PackedLayer] = {}
    for idx in layer_ids:
        found = {}
        for name, (shape, dtype) in expected.items():
            key = f"layers.{idx}.{name}"
            t = tensors.pop(key, None)
            if t is None:
                raise PackFormatError(f"{path}: tensor {key} is missing")
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise PackFormatError(
                    f"{path}: tensor {key} is {t.dtype} {tuple(t.shape)}, metadata says {dtype} {shape}"
                )
            found[name] = t
        try:
            check_permutations(found["neuron_order"], num_experts, inter)
        except ValueError as exc:
            raise PackFormatError(f"{path}: layers.{idx}.{exc}") from exc
        layers[idx] = PackedLayer(
            fmt, found["qweight"], found["scales"], found.get("zeros"), found["neuron_order"]
        )
    if tensors:
        raise PackFormatError(f"{path}: unexpected tensors not described by the metadata: {sorted(tensors)[:5]}")
    return layers
