"""Save and load packed layers as safetensors (never pickle), validated on load.

One file holds any number of MoE layers of one model:

    layers.{L}.qweight       (E, I, 3, H/2) uint8
    layers.{L}.scales        (E, I, 3, H/g) fp16
    layers.{L}.zeros         (E, I, 3, H/g) uint8     (asymmetric format only)
    layers.{L}.neuron_order  (E, I) int64             original index of stored neuron j

With a 2-bit tail (``crisp_kernels.format``: storage rows from ``tail_start`` hold two neurons each)
the tensors have R < I storage rows, ``neuron_order`` keeps (E, I), and the metadata adds
``tail_start`` and ``num_neurons`` (I) with ``format_version`` 2: a reader that predates tails refuses
the file by its version rather than read 2-bit rows as 4-bit ones. Packs without a tail stay version 1,
byte for byte.
    layers.{L}.bias          (E, I, 2) float32        gate / up bias of stored neuron j (gpt-oss only)
    layers.{L}.down_bias     (E, H) float32           per expert (gpt-oss only)

and string metadata: format name and version, bits, group size, symmetric, H, I, E, the layer
indices and ``tensor_sha256`` (JSON ``{tensor name: sha256 of its bytes}``); for a model with biases
``has_bias`` ("true") and for an activation other than SiLU GLU ``activation`` (JSON of
:meth:`Activation.to_json`). Both are absent otherwise, so a SiLU pack is byte for byte what it
was before they existed, and a file without them loads as SiLU GLU without biases.

Writing: the file is laid out here rather than by ``safetensors.save_file`` so that the same
layers give the same bytes (safetensors keeps metadata in a hash map: its order changed from run
to run). Header keys are sorted, tensors are laid out by (alignment, name) as safetensors does,
and the file is written atomically: a temporary file in the same folder, fsync, then rename, so
an interrupted save leaves the old file or none, never half a file.

Reading: the file is read into process memory (one ``readinto``), never memory-mapped: a mapped
file rewritten in place kills the process with SIGBUS. Every header field is checked (dtype,
shape, offsets covering the data exactly), then shapes against the metadata, then the cheap value
checks of :func:`crisp_kernels.format.check_layer_values` (finite positive scales, zero points
<= 15, permutations). The per-tensor digests cost about as much as reading the file again:
``PackCheck.DIGESTS`` compares them at every read; ``PackCheck.ONCE`` (what ``load_pack``, and so
``apply`` and ``load_model``, do) compares them the first time this machine reads a file and records a
stamp (the file's resolved path, size, modification time, inode and header digest, in
``$CRISP_CACHE_DIR/verified``; also its status-change time, which ``cp -p`` or ``touch -r`` cannot set back);
a later read of the same unchanged file skips the hashing
(``DigestStatus.VERIFIED_BEFORE``), and any change to the file (a rewrite, an edit, a copy) is hashed
again. A file modified less than ``STAMP_MIN_AGE_S`` before it is read is not stamped: file systems
keep modification times in ticks (a few ms on Linux, 1-2 s on some), and an edit within the tick of the
last write would leave the recorded time unchanged (git's "racily clean" files). A stamp that cannot be
written (a read-only cache) means the digests are compared at every read. Files
written before the digests existed (same format version) load; their digest check reports
``DigestStatus.UNAVAILABLE``.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .format import (
    SILU_GLU,
    Activation,
    PackedLayer,
    QuantFormat,
    check_layer_values,
    check_permutations,
    rows_for_neurons,
)

FORMAT_NAME = "crisp-packed-experts"
FORMAT_VERSION = 1
FORMAT_VERSION_TAIL = 2  # a pack with 2-bit tail rows (module docstring)
TAIL_START_KEY, NUM_NEURONS_KEY = "tail_start", "num_neurons"
DIGESTS_KEY = "tensor_sha256"
HAS_BIAS_KEY = "has_bias"
ACTIVATION_KEY = "activation"
# A pack header is a few KB per layer; a length field beyond this is corruption, not a pack.
_MAX_HEADER_BYTES = 100 * 2**20

_DTYPE_NAMES = {
    torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
    torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64", torch.bool: "BOOL",
}
_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


class PackFormatError(ValueError):
    """A packed file that is not ours, of another version, truncated or inconsistent."""


class PackIntegrityError(PackFormatError):
    """A packed file whose contents fail a value check or disagree with its recorded digests."""


class PackCheck(enum.Enum):
    VALUES = "values"  # header, shapes, dtypes and value ranges (always done)
    DIGESTS = "digests"  # also each tensor's sha256 against the digest recorded at save
    ONCE = "once"  # DIGESTS, unless this machine verified this very file before, unchanged since (a stamp)


class DigestStatus(enum.Enum):
    NOT_CHECKED = "not checked"
    VERIFIED = "verified"
    VERIFIED_BEFORE = "verified before on this machine (the file is unchanged since)"
    UNAVAILABLE = "unavailable (file written before digests were recorded)"


@dataclass(frozen=True)
class PackedFile:
    """What :func:`read_packed` returns: the layers and what was learnt reading them."""

    layers: dict[int, PackedLayer]
    metadata: dict[str, str]
    header_sha256: str  # sha256 of the 8-byte length + header: binds metadata, digests and layout
    digests: DigestStatus


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
        shape = (layer.num_experts, layer.intermediate_size, layer.hidden_size, layer.fmt, layer.activation,
                 layer.bias is None, layer.tail_start, layer.num_neurons)
        if shape != (first.num_experts, first.intermediate_size, first.hidden_size, first.fmt, first.activation,
                     first.bias is None, first.tail_start, first.num_neurons):
            raise ValueError(f"layers[{idx}]: all layers of one file must share E, I, H, the format, the activation, "
                             f"whether they have biases and the 2-bit tail's start")
    return first


# ----------------------------------------------------------------------------- raw safetensors


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (little-endian, as safetensors)."""
    flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def tensor_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(_tensor_bytes(t.detach().cpu().contiguous())).hexdigest()


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor],
                      metadata: Mapping[str, str]) -> None:
    """Write a safetensors file whose bytes depend only on ``tensors`` and ``metadata`` (not atomic:
    callers go through :func:`atomic_write`)."""
    cpu = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    for name, t in cpu.items():
        if t.dtype not in _DTYPE_NAMES:
            raise ValueError(f"tensor {name}: dtype {t.dtype} cannot be stored")
    # Largest alignment first, then by name (safetensors' own layout): every tensor starts on a
    # multiple of its item size once the header is padded to 8 bytes.
    order = sorted(cpu, key=lambda n: (-cpu[n].element_size(), n))
    header: dict = {"__metadata__": dict(sorted((str(k), str(v)) for k, v in metadata.items()))}
    offset = 0
    for name in order:
        nbytes = cpu[name].numel() * cpu[name].element_size()
        header[name] = {"dtype": _DTYPE_NAMES[cpu[name].dtype], "shape": list(cpu[name].shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for name in order:
            f.write(_tensor_bytes(cpu[name]))


def _read_header(path: Path, f, size: int) -> tuple[dict, bytes]:
    if size < 8:
        raise PackFormatError(f"{path}: not a readable safetensors file ({size} bytes; the file may be truncated)")
    prefix = f.read(8)
    length = int.from_bytes(prefix, "little")
    if length > min(size - 8, _MAX_HEADER_BYTES):
        raise PackFormatError(f"{path}: not a readable safetensors file (header length {length} for a file of "
                              f"{size} bytes; the file may be truncated)")
    raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise PackFormatError(f"{path}: not a readable safetensors file (header is not JSON: {exc})") from None
    if not isinstance(header, dict):
        raise PackFormatError(f"{path}: not a readable safetensors file (header is {type(header).__name__})")
    return header, prefix + raw


def _check_metadata_field(path: Path, metadata) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise PackFormatError(f"{path}: header field __metadata__ must map strings to strings, got "
                              f"{type(metadata).__name__}")
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise PackFormatError(f"{path}: header field __metadata__.{key}: expected a string, got "
                                  f"{type(value).__name__} {value!r}"[:300])
    return metadata


def _entry_layout(path: Path, name: str, entry) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    where = f"{path}: header field {name!r}"
    if not isinstance(entry, dict):
        raise PackFormatError(f"{where}: expected an object, got {type(entry).__name__}")
    dtype = _DTYPES.get(entry.get("dtype")) if isinstance(entry.get("dtype"), str) else None
    if dtype is None:
        raise PackFormatError(f"{where}.dtype: {entry.get('dtype')!r} is not one of {sorted(_DTYPES)}")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise PackFormatError(f"{where}.shape: expected a list of non-negative integers, got {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise PackFormatError(f"{where}.data_offsets: expected [begin, end] with 0 <= begin <= end, got {offsets!r}")
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    if offsets[1] - offsets[0] != numel * itemsize:
        raise PackFormatError(f"{where}: data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, "
                              f"shape {shape} of {entry['dtype']} needs {numel * itemsize}")
    return dtype, tuple(shape), offsets[0], offsets[1]


def read_safetensors(path: str | os.PathLike) -> tuple[dict[str, str], dict[str, torch.Tensor], str]:
    """(metadata, tensors, sha256 of the header) of a safetensors file, read into memory (no mmap).

    Every header field is validated; any defect is a :class:`PackFormatError` naming the file
    and the field.
    """
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        header, header_bytes = _read_header(path, f, size)
        metadata = _check_metadata_field(path, header.pop("__metadata__", None))
        layout = {name: _entry_layout(path, name, entry) for name, entry in header.items()}
        data_len = size - len(header_bytes)
        end = 0
        for name, (_, _, begin, stop) in sorted(layout.items(), key=lambda item: item[1][2:]):
            if begin != end:
                raise PackFormatError(f"{path}: header field {name!r}.data_offsets: starts at {begin}, expected "
                                      f"{end} (tensors must tile the data without gaps or overlaps)")
            end = stop
        if end != data_len:
            raise PackFormatError(f"{path}: the tensors describe {end} bytes of data, the file holds {data_len} "
                                  f"(the file may be truncated)")
        # One allocation per tensor, filled by readinto in file order: no mapping, no second copy,
        # and each tensor can be freed on its own (e.g. once pinned by the runtime's host store).
        tensors = {}
        for name, (dtype, shape, begin, stop) in sorted(layout.items(), key=lambda item: item[1][2]):
            t = torch.empty(shape, dtype=dtype)
            if stop > begin and f.readinto(_tensor_bytes(t)) != stop - begin:
                raise PackFormatError(f"{path}: cannot read tensor {name}, the file may be truncated (changed "
                                      f"while read)")
            tensors[name] = t
    return metadata, tensors, hashlib.sha256(header_bytes).hexdigest()


# ----------------------------------------------------------------------------- packed layers


def save_packed(
    path: str | os.PathLike,
    layers: Mapping[int, PackedLayer],
    *,
    extra_metadata: Mapping[str, str] | None = None,
) -> str:
    """Write ``{layer_index: PackedLayer}`` to ``path`` atomically; returns the header's sha256
    (what a pack folder records to bind its other files to this one)."""
    first = check_uniform_layers(layers)
    tensors = {}
    for idx, layer in layers.items():
        check_layer_values(layer, f"layers[{idx}]")
        for name, t in layer.tensors().items():
            tensors[f"layers.{int(idx)}.{name}"] = t.detach().cpu().contiguous()
    metadata = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION if first.tail_start is None else FORMAT_VERSION_TAIL),
        "bits": str(first.fmt.bits),
        "group_size": str(first.fmt.group_size),
        "symmetric": json.dumps(first.fmt.symmetric),
        "hidden_size": str(first.hidden_size),
        "intermediate_size": str(first.intermediate_size),
        "num_experts": str(first.num_experts),
        "layers": json.dumps(sorted(int(i) for i in layers)),
        DIGESTS_KEY: json.dumps({name: tensor_sha256(t) for name, t in sorted(tensors.items())}, sort_keys=True),
    }
    if first.tail_start is not None:
        metadata[TAIL_START_KEY] = str(first.tail_start)
        metadata[NUM_NEURONS_KEY] = str(first.num_neurons)
    if first.bias is not None:
        metadata[HAS_BIAS_KEY] = "true"
    if first.activation != SILU_GLU:
        metadata[ACTIVATION_KEY] = json.dumps(first.activation.to_json(), sort_keys=True)
    for key, value in (extra_metadata or {}).items():
        if key in metadata:
            raise ValueError(f"extra_metadata: key {key!r} is reserved")
        metadata[key] = str(value)
    atomic_write(path, lambda tmp: write_safetensors(tmp, tensors, metadata))
    return header_sha256(path)


def header_sha256(path: str | os.PathLike) -> str:
    """sha256 of a safetensors file's length field and header (cheap: a few KB are read)."""
    path = Path(path)
    with open(path, "rb") as f:
        _, header_bytes = _read_header(path, f, os.fstat(f.fileno()).st_size)
    return hashlib.sha256(header_bytes).hexdigest()


def _check_metadata(path: Path, metadata: Mapping[str, str]) -> None:
    if metadata.get("format") != FORMAT_NAME:
        raise PackFormatError(f"{path}: format is {metadata.get('format')!r}, expected {FORMAT_NAME!r}")
    if metadata.get("format_version") not in (str(FORMAT_VERSION), str(FORMAT_VERSION_TAIL)):
        raise PackFormatError(
            f"{path}: format version {metadata.get('format_version')!r} is not supported (metadata field "
            f"format_version; this CRISP reads versions {FORMAT_VERSION} and {FORMAT_VERSION_TAIL})"
        )
    has_tail = TAIL_START_KEY in metadata or NUM_NEURONS_KEY in metadata
    if has_tail != (metadata["format_version"] == str(FORMAT_VERSION_TAIL)):
        raise PackFormatError(f"{path}: metadata is incomplete or invalid (format_version "
                              f"{metadata['format_version']} with{'' if has_tail else 'out'} {TAIL_START_KEY!r}: "
                              f"version {FORMAT_VERSION_TAIL} and the 2-bit tail fields come together)")


def read_packed_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The metadata of a packed file, validated for format name and version, without the tensors."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"packed experts file not found: {path}")
    with open(path, "rb") as f:
        header, _ = _read_header(path, f, os.fstat(f.fileno()).st_size)
    metadata = _check_metadata_field(path, header.get("__metadata__"))
    _check_metadata(path, metadata)
    return metadata


def _strict_int(value: str, field: str, path: Path, minimum: int = 1) -> int:
    if not isinstance(value, str) or not value.isascii() or not value.isdigit() or int(value) < minimum:
        raise PackFormatError(f"{path}: metadata is incomplete or invalid ({field}={value!r}: expected an integer "
                              f">= {minimum})")
    return int(value)


def _parse_metadata(path: Path, metadata: Mapping[str, str]):
    missing = [k for k in ("bits", "group_size", "symmetric", "hidden_size", "intermediate_size", "num_experts",
                           "layers") if k not in metadata]
    if missing:
        raise PackFormatError(f"{path}: metadata is incomplete or invalid (missing {missing})")
    try:
        symmetric = json.loads(metadata["symmetric"])
        layer_ids = json.loads(metadata["layers"])
    except (json.JSONDecodeError, RecursionError) as exc:
        raise PackFormatError(f"{path}: metadata is incomplete or invalid (symmetric / layers: {exc})") from None
    if type(symmetric) is not bool:
        raise PackFormatError(f"{path}: metadata is incomplete or invalid (symmetric={symmetric!r}: expected "
                              f"true or false)")
    if (not isinstance(layer_ids, list) or not layer_ids or not all(type(i) is int and i >= 0 for i in layer_ids)
            or len(set(layer_ids)) != len(layer_ids)):
        raise PackFormatError(f"{path}: metadata is incomplete or invalid (layers={metadata['layers']!r}: expected "
                              f"a non-empty list of distinct non-negative integers)")
    try:
        fmt = QuantFormat(bits=_strict_int(metadata["bits"], "bits", path),
                          group_size=_strict_int(metadata["group_size"], "group_size", path), symmetric=symmetric)
    except ValueError as exc:
        if isinstance(exc, PackFormatError):
            raise
        raise PackFormatError(f"{path}: metadata is incomplete or invalid ({exc})") from None
    hidden = _strict_int(metadata["hidden_size"], "hidden_size", path)
    try:
        fmt.check_hidden_size(hidden, "hidden_size")
    except ValueError as exc:
        raise PackFormatError(f"{path}: metadata is incomplete or invalid ({exc})") from None
    inter = _strict_int(metadata["intermediate_size"], "intermediate_size", path)
    num_experts = _strict_int(metadata["num_experts"], "num_experts", path)
    return fmt, hidden, inter, num_experts, layer_ids


def _parse_tail(path: Path, metadata: Mapping[str, str], rows: int) -> tuple[int | None, int]:
    """(tail_start or None, neurons per expert) from the optional 2-bit tail fields."""
    if TAIL_START_KEY not in metadata and NUM_NEURONS_KEY not in metadata:
        return None, rows
    if TAIL_START_KEY not in metadata or NUM_NEURONS_KEY not in metadata:
        present, absent = ((TAIL_START_KEY, NUM_NEURONS_KEY) if TAIL_START_KEY in metadata
                           else (NUM_NEURONS_KEY, TAIL_START_KEY))
        raise PackFormatError(f"{path}: metadata is incomplete or invalid ({present} without {absent})")
    start = _strict_int(metadata[TAIL_START_KEY], TAIL_START_KEY, path, minimum=0)
    neurons = _strict_int(metadata[NUM_NEURONS_KEY], NUM_NEURONS_KEY, path)
    if start >= rows or rows_for_neurons(neurons, start) != rows:
        raise PackFormatError(f"{path}: metadata is incomplete or invalid ({NUM_NEURONS_KEY}={neurons} neurons "
                              f"with {TAIL_START_KEY}={start} do not fill intermediate_size={rows} storage rows)")
    return start, neurons


def _parse_model_math(path: Path, metadata: Mapping[str, str]) -> tuple[bool, Activation]:
    """(has biases, activation) from the optional metadata fields (absent: no biases, SiLU GLU)."""
    has_bias = metadata.get(HAS_BIAS_KEY)
    if has_bias not in (None, "true"):
        raise PackFormatError(f"{path}: metadata is incomplete or invalid ({HAS_BIAS_KEY}={has_bias!r}: expected "
                              f"'true' or no such field)")
    activation = SILU_GLU
    if ACTIVATION_KEY in metadata:
        try:
            activation = Activation.from_json(json.loads(metadata[ACTIVATION_KEY]))
        except (json.JSONDecodeError, RecursionError, TypeError, ValueError) as exc:
            raise PackFormatError(f"{path}: metadata is incomplete or invalid ({ACTIVATION_KEY}: {exc})") from None
    return has_bias is not None, activation


def _recorded_digests(path: Path, metadata: Mapping[str, str]) -> dict[str, str] | None:
    if DIGESTS_KEY not in metadata:
        return None
    try:
        digests = json.loads(metadata[DIGESTS_KEY])
    except (json.JSONDecodeError, RecursionError):
        digests = None
    if not isinstance(digests, dict) or not all(isinstance(v, str) for v in digests.values()):
        raise PackFormatError(f"{path}: metadata field {DIGESTS_KEY} is not a JSON object of hex digests")
    return digests


def read_packed(path: str | os.PathLike, device: str | torch.device = "cpu", *,
                check: PackCheck = PackCheck.VALUES) -> PackedFile:
    """Read a file written by :func:`save_packed`: the layers, the metadata, the header digest and
    whether the tensor digests were verified (see the module docstring)."""
    path = Path(path)
    if not isinstance(check, PackCheck):
        raise TypeError(f"check: expected a PackCheck ({', '.join(c.name for c in PackCheck)}), got {check!r}")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: {device!r} is not a torch device ({exc})") from None
    if not path.is_file():
        raise FileNotFoundError(f"packed experts file not found: {path}")
    before = os.stat(path)
    metadata, tensors, header_digest = read_safetensors(path)
    all_tensors = dict(tensors)  # the loop below pops from ``tensors``
    _check_metadata(path, metadata)
    fmt, hidden, inter, num_experts, layer_ids = _parse_metadata(path, metadata)
    tail_start, neurons = _parse_tail(path, metadata, inter)
    groups = hidden // fmt.group_size
    expected = {
        "qweight": ((num_experts, inter, 3, hidden // 2), torch.uint8),
        "scales": ((num_experts, inter, 3, groups), torch.float16),
        "neuron_order": ((num_experts, neurons), torch.int64),
    }
    if not fmt.symmetric:
        expected["zeros"] = ((num_experts, inter, 3, groups), torch.uint8)
    has_bias, activation = _parse_model_math(path, metadata)
    if has_bias:
        expected["bias"] = ((num_experts, inter, 2), torch.float32)
        expected["down_bias"] = ((num_experts, hidden), torch.float32)
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
            check_permutations(found["neuron_order"], num_experts, neurons)
        except ValueError as exc:
            raise PackFormatError(f"{path}: layers.{idx}.{exc}") from exc
        try:
            layer = PackedLayer(fmt, found["qweight"], found["scales"], found.get("zeros"), found["neuron_order"],
                                found.get("bias"), found.get("down_bias"), activation, tail_start)
        except ValueError as exc:  # e.g. a tail in a symmetric or biased pack
            raise PackFormatError(f"{path}: layers.{idx}: {exc}") from None
        try:
            check_layer_values(layer, f"layers.{idx}")
        except ValueError as exc:
            raise PackIntegrityError(f"{path}: {exc}") from None
        layers[idx] = layer
    if tensors:
        raise PackFormatError(f"{path}: unexpected tensors not described by the metadata: {sorted(tensors)[:5]} "
                              f"(metadata fields layers={metadata['layers']}, symmetric={metadata['symmetric']})")
    digests = _recorded_digests(path, metadata)
    if digests is not None and set(digests) != set(all_tensors):
        raise PackFormatError(f"{path}: metadata field {DIGESTS_KEY} does not list exactly the file's tensors "
                              f"(differences: {sorted(set(digests) ^ set(all_tensors))[:5]})")
    status = DigestStatus.NOT_CHECKED
    if check is not PackCheck.VALUES:
        # ONCE trusts a stamp only when the file was not changed while read either
        unchanged = _same_file(before, os.stat(path))
        if digests is None:
            status = DigestStatus.UNAVAILABLE
        elif check is PackCheck.ONCE and unchanged and _stamped(path, before, header_digest):
            status = DigestStatus.VERIFIED_BEFORE
        else:
            for name in sorted(digests):
                if tensor_sha256(all_tensors[name]) != digests[name]:
                    raise PackIntegrityError(f"{path}: tensor {name}: sha256 differs from the digest recorded at "
                                             f"save; the file is corrupt")
            status = DigestStatus.VERIFIED
            if unchanged:
                _write_stamp(path, before, header_digest)
    if device.type != "cpu":
        try:
            layers = {idx: replace(lay.to(device), neuron_order=lay.neuron_order.to(device))
                      for idx, lay in layers.items()}
        except (RuntimeError, AssertionError) as exc:  # no such device / torch built without CUDA
            raise ValueError(f"device: cannot place the packed layers on {device} ({exc})") from None
    return PackedFile(layers, dict(metadata), header_digest, status)


# ----------------------------------------------------------------------------- digest stamps

# a file modified this recently is not stamped: an edit within the same modification-time tick (FAT: 2 s) would
# not show in the time a stamp records
STAMP_MIN_AGE_S = 3


def _stamp_path(path: Path) -> Path:
    from .cpu_native import cache_dir  # the package's one cache folder ($CRISP_CACHE_DIR)

    key = hashlib.sha256(os.fsencode(path.resolve())).hexdigest()[:32]
    return cache_dir() / "verified" / f"{key}.json"


# what identifies a file's contents without reading them; ctime is set by the kernel at every change of the file or
# of its times, which no tool can set back (``cp -p`` or ``touch -r`` restore the modification time, not this)
STAT_FIELDS = ("st_size", "st_mtime_ns", "st_ctime_ns", "st_ino", "st_dev")


def _file_identity(path: Path, st: os.stat_result, header_digest: str) -> dict:
    return {"path": str(path.resolve()), **{f: getattr(st, f) for f in STAT_FIELDS}, "header_sha256": header_digest}


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return all(getattr(a, f) == getattr(b, f) for f in STAT_FIELDS)


def _stamped(path: Path, st: os.stat_result, header_digest: str) -> bool:
    """Whether this file, as ``st`` describes it, had its digests verified on this machine before."""
    try:
        recorded = json.loads(_stamp_path(path).read_text())
    except (OSError, ValueError, RecursionError):  # none, unreadable, not JSON or nested beyond the parser: verify
        return False
    return recorded == _file_identity(path, st, header_digest)


def _write_stamp(path: Path, st: os.stat_result, header_digest: str) -> None:
    """Record that this file's digests are verified, unless it was modified within ``STAMP_MIN_AGE_S`` (best
    effort: a cache that cannot be written only means the digests are compared again at the next read)."""
    if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) < STAMP_MIN_AGE_S * 1_000_000_000:
        return
    try:
        stamp = _stamp_path(path)
        stamp.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(_file_identity(path, st, header_digest), sort_keys=True)
        atomic_write(stamp, lambda tmp: Path(tmp).write_text(text))
    except OSError:
        pass


def load_packed(path: str | os.PathLike, device: str | torch.device = "cpu", *,
                check: PackCheck = PackCheck.VALUES) -> dict[int, PackedLayer]:
    """Read a file written by :func:`save_packed`; every shape is checked against the metadata."""
    return read_packed(path, device, check=check).layers
