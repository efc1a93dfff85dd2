"""Reading a transformers checkpoint one tensor at a time, expert weights left on disk.

CRISP never needs all the full-precision experts at once: ``load_model`` needs only the non-expert
weights (the packed experts come from the pack), and packing needs one MoE layer at a time.

- :func:`load_skeleton`: the model built on the ``meta`` device (``torch.device("meta")``, no
  memory), then every *non-expert* tensor read one at a time (:class:`SafetensorsFile`:
  ``os.pread`` into a fresh tensor, no mapping) and put in place; expert weights stay ``meta``
  placeholders (plain attributes, as ``apply`` leaves them). Checkpoint names are mapped to the
  model's with transformers' own rules (``core_model_loading.rename_source_key`` over the model's
  conversion mapping, what ``from_pretrained`` uses), so v4-layout checkpoints (Mixtral
  ``block_sparse_moe.experts.N.w1``) and v5 fused ones both load. Non-persistent buffers (rotary
  ``inv_freq``) are computed by the model's own ``_init_weights``; ``tie_weights()`` ties.
- :func:`read_expert_layer`: one MoE layer's ``gate_up_proj (E, 2I, H)`` / ``down_proj (E, H, I)``
  from per-expert (``experts.N.w1/w3/w2``, ``gate_proj/up_proj/down_proj``) or fused tensors.
- :func:`pack_checkpoint` / :func:`pack_layers`: every MoE layer packed (``crisp_kernels.pack_layer``),
  one expert of full-precision weights in memory at a time; :func:`checkpoint_weights_sha256`: the
  pack's weights fingerprint, read as 4-neuron prefixes.
- :class:`CheckpointExperts`: ``{layer_id: (gate_up, down)}`` read at every access, what crisp-profile's
  instrument takes when the experts stay on disk (``crisp_tools.placement``).

``load_model`` puts the non-expert weights on one device; crisp-profile can also run on accelerate's
``device_map`` (``crisp_tools.placement``). Peak host memory: ``python -m crisp_tools.stream_rss``
(figures in docs/big-models.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from crisp_kernels import PackedLayer, QuantFormat, pack_layer
from crisp_runtime.hf.moe_layers import MoeLayerRef, UnsupportedModelError, find_moe_layers
from crisp_runtime.storage.pack import weights_sha256

_WEIGHT_NAMES = ("gate_up_proj", "down_proj")
_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be streamed: no safetensors, a tensor missing or of another shape."""


# safetensors dtype names -> torch (the floating types checkpoints hold; others are refused by name)
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header


class SafetensorsFile:
    """Reads tensors of one safetensors file with ``os.pread`` into fresh tensors, never through a mapping.

    ``safe_open`` maps the file: every page a read touches counts in the process's resident set while
    the file is open, and a column slice (the fingerprint's ``down_proj[:, :, :4]``) touches every
    page of the tensor: measured +840 MiB peak for 4 columns of a 2.1 GB checkpoint. Here a tensor
    costs its own bytes once, and a prefix costs only the prefix.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            raw = f.read(8)
            size = int.from_bytes(raw, "little") if len(raw) == 8 else -1
            if not 0 < size <= _MAX_HEADER:
                raise CheckpointError(f"{self.path}: not a safetensors file (header size {size})")
            try:
                header = json.loads(f.read(size))
            except ValueError as exc:
                raise CheckpointError(f"{self.path}: unreadable safetensors header ({exc})") from exc
        header.pop("__metadata__", None)
        self.entries = header
        self.data_start = 8 + size

    def _entry(self, name: str):
        try:
            entry = self.entries[name]
            dtype = _DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except KeyError as exc:
            raise CheckpointError(f"{self.path}: tensor {name!r}: missing or unsupported ({exc})") from exc
        if end - begin != torch.Size(shape).numel() * dtype.itemsize:
            raise CheckpointError(f"{self.path}: tensor {name!r}: {end - begin} bytes for shape {shape} {dtype}")
        return dtype, shape, self.data_start + begin

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[1]

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor."""
        dtype, shape, offset = self._entry(name)
        out = torch.empty(shape, dtype=dtype)
        buffer = out.view(-1).view(torch.uint8).numpy() if out.numel() else None
        if buffer is not None:
            with open(self.path, "rb") as f:
                f.seek(offset)
                if f.readinto(memoryview(buffer)) != buffer.nbytes:
                    raise CheckpointError(f"{self.path}: tensor {name!r} is truncated")
        return out

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """``tensor[start:stop]`` (along the first dimension): one contiguous read of those bytes only."""
        dtype, shape, offset = self._entry(name)
        if not shape or not 0 <= start < stop <= shape[0]:
            raise CheckpointError(f"{self.path}: tensor {name!r} {shape}: cannot take rows {start}:{stop}")
        out = torch.empty((stop - start, *shape[1:]), dtype=dtype)
        row = torch.Size(shape[1:]).numel() * dtype.itemsize
        buffer = out.view(-1).view(torch.uint8).numpy()
        with open(self.path, "rb") as f:
            f.seek(offset + start * row)
            if f.readinto(memoryview(buffer)) != buffer.nbytes:
                raise CheckpointError(f"{self.path}: tensor {name!r} is truncated")
        return out

    def read_prefix(self, name: str, dim: int, n: int) -> torch.Tensor:
        """``tensor.narrow(dim, 0, n)``: one contiguous read per index of the dimensions before ``dim``."""
        dtype, shape, offset = self._entry(name)
        if not 0 < n <= shape[dim]:
            raise CheckpointError(f"{self.path}: tensor {name!r} {shape}: cannot take {n} along dim {dim}")
        outer = torch.Size(shape[:dim]).numel()
        inner = torch.Size(shape[dim + 1:]).numel() * dtype.itemsize
        out = torch.empty((*shape[:dim], n, *shape[dim + 1:]), dtype=dtype)
        rows = out.view(-1).view(torch.uint8).numpy().reshape(outer, n * inner)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for i in range(outer):
                data = os.pread(fd, n * inner, offset + i * shape[dim] * inner)
                if len(data) != n * inner:
                    raise CheckpointError(f"{self.path}: tensor {name!r} is truncated")
                rows[i] = memoryview(data)
        finally:
            os.close(fd)
        return out


def checkpoint_files(path: str | os.PathLike) -> dict[str, Path]:
    """``{tensor name: safetensors file}`` of a checkpoint folder (single file or sharded with an index)."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index (expected a 'weight_map' object)") from exc
        return {name: path / file for name, file in weight_map.items()}
    single = path / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}; CRISP streams safetensors checkpoints only "
                              "(convert a .bin checkpoint with save_pretrained(safe_serialization=True))")
    return dict.fromkeys(SafetensorsFile(single).entries, single)


def _by_file(names: dict[str, Path]) -> dict[Path, list[str]]:
    out: dict[Path, list[str]] = {}
    for name, file in names.items():
        out.setdefault(file, []).append(name)
    return out


@dataclass(frozen=True)
class _ExpertSource:
    """Where one checkpoint tensor goes in a MoE layer's v5 expert weights."""

    layer_name: str  # module path of the experts module
    target: str  # "gate_up_proj" | "down_proj"
    part: int  # per-expert: 0 = gate, 1 = up (gate_up_proj); 0 for down; -1: the fused tensor itself
    expert: int  # -1 for a fused tensor


class CheckpointMap:
    """How a checkpoint's tensor names map onto a (meta) model: expert tensors vs the rest."""

    def __init__(self, model: nn.Module, names: dict[str, Path]) -> None:
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
        except ImportError as exc:  # pragma: no cover - pinned transformers has them
            raise UnsupportedModelError(f"streaming a checkpoint needs transformers' loading rules: {exc}") from exc
        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        meta_state = model.state_dict()
        prefix = getattr(model, "base_model_prefix", None)
        self.refs = find_moe_layers(model)  # the model's MoE layers, found once for every later step
        experts = {f"{r.name}.{w}": (r.name, w) for r in self.refs for w in _WEIGHT_NAMES}
        self.files = names
        self.params: dict[str, str] = {}  # checkpoint name -> model name (non-expert)
        self.experts: dict[str, _ExpertSource] = {}
        for name in names:
            target, pattern = rename_source_key(name, renamings, converters, prefix, meta_state)
            if target in experts:
                layer_name, weight = experts[target]
                if pattern is None:
                    self.experts[name] = _ExpertSource(layer_name, weight, -1, -1)
                    continue
                converter = next(c for c in converters if pattern in c.source_patterns)
                ops = [type(op).__name__ for op in converter.operations]
                match = _EXPERT_INDEX.search(name)
                if ops not in (["MergeModulelist", "Concatenate"], ["MergeModulelist"]) or match is None:
                    raise UnsupportedModelError(f"{name}: its conversion to {weight} ({ops}) is not one CRISP can "
                                                "stream (per-expert tensors stacked, gate then up)")
                self.experts[name] = _ExpertSource(layer_name, weight, converter.source_patterns.index(pattern),
                                                   int(match.group(1)))
            elif pattern is not None:
                raise UnsupportedModelError(f"{name}: transformers converts it ({pattern!r}) into {target!r}; "
                                            "streaming loads renamed tensors only")
            else:
                self.params[name] = target


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf in module._parameters:
        old = module._parameters[leaf]
        module._parameters[leaf] = nn.Parameter(value, requires_grad=old.requires_grad)
    elif leaf in module._buffers:
        module._buffers[leaf] = value
    else:
        raise CheckpointError(f"{name}: the model has no such parameter or buffer")


def _drop_expert_parameters(refs: Sequence[MoeLayerRef]) -> None:
    for ref in refs:
        for w in _WEIGHT_NAMES:
            if w in ref.module._parameters:
                param = ref.module._parameters.pop(w)
                ref.module.__dict__[w] = torch.empty(param.shape, dtype=param.dtype, device="meta")


def _skeleton_dtype(config, dtype):
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else torch.float32


def load_skeleton(path: str | os.PathLike, dtype=None):
    """A causal LM from a local checkpoint folder with every non-expert weight loaded (CPU), one tensor
    at a time, and its expert weights as ``meta`` placeholders: ``(model, CheckpointMap)``.

    dtype: None / "auto" = the checkpoint config's dtype (float32 when it names none), else a torch dtype.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    skeleton_dtype = _skeleton_dtype(config, dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=skeleton_dtype)
    cmap = CheckpointMap(model, checkpoint_files(path))
    shapes = {k: v for k, v in model.state_dict(keep_vars=True).items()}
    for file, names in _by_file({n: cmap.files[n] for n in cmap.params}).items():
        f = SafetensorsFile(file)
        for name in names:
            target = cmap.params[name]
            want = shapes.get(target)
            if want is None:
                continue  # an unexpected key (from_pretrained drops them too, with a warning)
            if f.shape(name) != tuple(want.shape):
                raise CheckpointError(f"{name}: shape {f.shape(name)} in the checkpoint, {tuple(want.shape)} in the "
                                      f"model ({target})")
            _set_tensor(model, target, f.read(name).to(want.dtype))
    _drop_expert_parameters(cmap.refs)
    _init_non_persistent_buffers(model)
    model.tie_weights()
    missing = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"{path}: no tensor in the checkpoint for {missing[:5]}{more}")
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    return model.eval(), cmap


def _init_non_persistent_buffers(model) -> None:
    """Buffers not in any checkpoint (rotary ``inv_freq``): computed by the model's own ``_init_weights``."""
    named = getattr(model, "named_non_persistent_buffers", None)
    for name in [n for n, _ in named()] if named is not None else []:
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        buffer = module._buffers[leaf]
        if buffer is None or not buffer.is_meta:
            continue
        if any(p.is_meta for p in module.parameters(recurse=False)):
            raise CheckpointError(f"{name}: a non-persistent buffer of a module with unloaded parameters")
        for key, value in list(module._buffers.items()):
            if value is not None and value.is_meta and key in module._non_persistent_buffers_set:
                module._buffers[key] = torch.full_like(value, float("nan"), device="cpu")
        with torch.no_grad():
            model._init_weights(module)
        if any(v is not None and v.is_floating_point() and torch.isnan(v).any() for v in module._buffers.values()):
            raise CheckpointError(f"{name}: the model's _init_weights does not compute this buffer; "
                                  "load the model with from_pretrained instead")


def _expert_sources(cmap: CheckpointMap, layer_name: str) -> dict[str, _ExpertSource]:
    return {n: s for n, s in cmap.experts.items() if s.layer_name == layer_name}


def read_expert_layer(cmap: CheckpointMap, ref, prefix: int | None = None,
                      experts: range | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One MoE layer's ``gate_up_proj (E, 2I, H)`` / ``down_proj (E, H, I)`` read from the checkpoint (dtype as stored).

    prefix: only the first ``prefix`` neurons of each expert: ``(E, prefix, H)`` gate rows (no up rows) and
    ``(E, H, prefix)`` down columns, read as such (the weights fingerprint reads 4).
    experts: only these experts (a step-1 range), ``(len(experts), 2I, H)`` / ``(len(experts), H, I)``; only
    their bytes are read (packing holds one expert, not a layer). Not with ``prefix``.
    """
    num_experts, inter, hidden = ref.num_experts, ref.intermediate_size, ref.hidden_size
    if experts is not None and (prefix is not None or experts.step != 1 or not 0 <= experts.start < experts.stop
                                <= num_experts):
        raise ValueError(f"experts={experts!r}: expected a step-1 range within 0..{num_experts}, without prefix")
    wanted = range(num_experts) if experts is None else experts
    sources = {n: s for n, s in _expert_sources(cmap, ref.name).items() if s.expert < 0 or s.expert in wanted}
    if not sources:
        raise CheckpointError(f"{ref.name}: the checkpoint has no expert tensors for this layer")
    gate_up = down = None
    per_expert: dict[tuple[str, int, int], torch.Tensor] = {}
    for file, names in _by_file({n: cmap.files[n] for n in sources}).items():
        f = SafetensorsFile(file)
        for name in names:
            src = sources[name]
            want = {("gate_up_proj", True): (num_experts, 2 * inter, hidden), ("down_proj", True): (num_experts, hidden,
                    inter), ("gate_up_proj", False): (inter, hidden), ("down_proj", False): (hidden, inter)}[
                (src.target, src.expert < 0)]
            if f.shape(name) != want:
                raise CheckpointError(f"{name}: shape {f.shape(name)} in the checkpoint, expected {want} for "
                                      f"{ref.name}.{src.target}")
            down_dim = len(want) - 1  # the neuron axis of a down tensor is its last; of gate/up, the one before H
            if src.expert < 0:  # fused
                if prefix is not None:
                    part = f.read_prefix(name, 1 if src.target == "gate_up_proj" else down_dim, prefix)
                else:
                    part = f.read(name) if experts is None else f.read_rows(name, experts.start, experts.stop)
                if src.target == "gate_up_proj":
                    gate_up = part
                else:
                    down = part
            elif src.target == "gate_up_proj":  # per expert (I, H): gate (part 0) or up (part 1)
                if prefix is None:
                    per_expert[(src.target, src.part, src.expert)] = f.read(name)
                elif src.part == 0:
                    per_expert[(src.target, 0, src.expert)] = f.read_prefix(name, 0, prefix)
            else:  # per expert (H, I)
                per_expert[(src.target, 0, src.expert)] = (f.read(name) if prefix is None
                                                          else f.read_prefix(name, down_dim, prefix))
    try:
        if gate_up is None:
            parts = (0, 1) if prefix is None else (0,)
            gate_up = torch.stack([torch.cat([per_expert.pop(("gate_up_proj", p, e)) for p in parts])
                                   for e in wanted])
        if down is None:
            down = torch.stack([per_expert.pop(("down_proj", 0, e)) for e in wanted])
    except KeyError as exc:
        raise CheckpointError(f"{ref.name}: expert tensor {exc.args[0]} missing from the checkpoint") from exc
    return gate_up, down


def release_freed_memory() -> None:
    """Hand the allocator's freed heap pages back to the OS (glibc ``malloc_trim``; nothing elsewhere).

    Why: packing one expert allocates scratch below glibc's mmap threshold (up to 32 MiB), which lands in
    the heap among the packed results that stay; freed, it is kept by the process. Measured on a 2.25 GB
    float32 Mixtral checkpoint (12 layers, 21 MiB experts): +35 MiB resident per expert packed, 280 MiB
    over a layer, all of it returned by one ``malloc_trim(0)``; with it, a layer's packing costs its
    packed bytes. Only freed memory is released: no tensor, no Python object is touched.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # musl and other C libraries have no malloc_trim
        return None


ExpertReader = Callable[[MoeLayerRef, range], tuple[torch.Tensor, torch.Tensor]]


def pack_layers(refs: Sequence[MoeLayerRef], read_experts: ExpertReader, fmt: QuantFormat | None = None,
                neuron_order: Mapping[int, torch.Tensor] | None = None) -> dict[int, PackedLayer]:
    """Every layer of ``refs`` packed 4-bit, one expert at a time: ``read_experts(ref, range(e, e + 1))``
    gives that expert's full-precision ``(gate_up (1, 2I, H), down (1, H, I))`` (from the checkpoint:
    ``read_expert_layer(..., experts=)``, or a slice of the module's own). ``neuron_order``:
    ``{layer_id: (E, I)}`` as in ``pack_layer`` (None: the present order). The result equals
    ``pack_layer`` of each whole layer, bit for bit: experts are quantized independently.

    Why one expert: pack_layer's scratch is ~4x its float32 input (measured: +64 MiB for a 15 MiB layer), so
    packing a whole Mixtral-8x7B layer (1.4 GB in bf16, 2.8 GB float32) at once would need ~10 GB more; one
    expert (176 MiB in bf16) needs its own bytes and ~0.7 GB of scratch.
    """
    fmt = QuantFormat() if fmt is None else fmt
    out = {}
    for ref in refs:
        order = None if neuron_order is None else neuron_order[ref.layer_id]
        parts = []
        for e in range(ref.num_experts):
            gate_up, down = read_experts(ref, range(e, e + 1))
            parts.append(pack_layer(gate_up.float().cpu(), down.float().cpu(), fmt,
                                    neuron_order=None if order is None else order[e:e + 1]))
            del gate_up, down
            release_freed_memory()
        out[ref.layer_id] = PackedLayer(
            parts[0].fmt, torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]),
            None if parts[0].zeros is None else torch.cat([p.zeros for p in parts]),
            torch.cat([p.neuron_order for p in parts]))
        del parts
        release_freed_memory()
    return out


def pack_checkpoint(model, cmap: CheckpointMap, fmt: QuantFormat | None = None,
                    neuron_order: Mapping[int, torch.Tensor] | None = None) -> dict[int, PackedLayer]:
    """Every MoE layer packed 4-bit (in ``neuron_order``, default the present order), one expert's
    full-precision weights in memory at a time (:func:`pack_layers`)."""
    refs = cmap.refs
    for ref in refs:
        if getattr(ref.module, "has_bias", False) or getattr(ref.module, "is_transposed", False):
            raise UnsupportedModelError(f"{ref.name}: packing biased / transposed experts (gpt-oss) from a streamed "
                                        "checkpoint is not implemented; load the model and use pack_model")
    return pack_layers(refs, lambda ref, experts: read_expert_layer(cmap, ref, experts=experts), fmt, neuron_order)


class CheckpointExperts(Mapping):
    """``{layer_id: (gate_up, down)}`` read from the checkpoint at every access, nothing kept: the
    ``weights`` of ``crisp_tools.calibration.MaskedExperts`` for a model whose experts stay on disk
    (:func:`load_skeleton`, or offloaded by accelerate), so a forward holds one layer of full-precision
    experts at a time. Every forward re-reads every layer: the OS's page cache, not this process, keeps
    the file's pages when there is memory for them.

    Tensors come on the CPU in the dtype of the model's expert weights (meta placeholders or offloaded
    parameters: what ``from_pretrained`` makes of the stored ones), so that a streamed profile computes
    on the values a resident one does.
    """

    def __init__(self, cmap: CheckpointMap, refs: Sequence[MoeLayerRef]) -> None:
        self.cmap = cmap
        self.refs = {ref.layer_id: ref for ref in refs}

    def _as_model(self, ref, tensors: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = ref.module.gate_up_proj.dtype
        return tensors[0].to(dtype), tensors[1].to(dtype)

    def __getitem__(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        ref = self.refs[layer_id]
        return self._as_model(ref, read_expert_layer(self.cmap, ref))

    def experts(self, layer_id: int, experts: range) -> tuple[torch.Tensor, torch.Tensor]:
        """Only ``experts`` of the layer (``read_expert_layer``'s ``experts``)."""
        ref = self.refs[layer_id]
        return self._as_model(ref, read_expert_layer(self.cmap, ref, experts=experts))

    def weights_sha256(self) -> str:
        """``pack.weights_sha256`` of the experts in the model's dtype, read as 4-neuron prefixes."""
        return _prefix_digest(self._as_model(ref, read_expert_layer(self.cmap, ref, prefix=4))
                              for ref in self.refs.values())

    def __iter__(self):
        return iter(self.refs)

    def __len__(self) -> int:
        return len(self.refs)


def _prefix_digest(prefixes) -> str:
    views = [SimpleNamespace(module=SimpleNamespace(gate_up_proj=gu, down_proj=down)) for gu, down in prefixes]
    return weights_sha256(views)


def checkpoint_weights_sha256(model, cmap: CheckpointMap) -> str:
    """``pack.weights_sha256`` of the checkpoint's experts, read as 4-row slices (the loaded model's digest)."""
    return _prefix_digest(read_expert_layer(cmap, ref, prefix=4) for ref in cmap.refs)
