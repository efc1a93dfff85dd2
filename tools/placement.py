"""Where ``crisp-profile`` puts the model it measures, and where it reads the full-precision experts.

Three placements (:class:`Placement`):

- ``resident`` (default): ``from_pretrained`` onto ``--device``; the whole model in memory.
- ``stream``: the non-expert weights on ``--device`` (``crisp_runtime.hf.checkpoint.load_skeleton``); each
  MoE layer's experts are read from the checkpoint when its forward runs and dropped after it
  (``CheckpointExperts``), so host memory holds one layer of full-precision experts, never the model.
- ``device-map`` (``--device-map auto|JSON``): accelerate's big-model loading through
  ``from_pretrained(device_map=, max_memory=, offload_folder=)``: layers over GPUs, CPU and disk;
  accelerate's hooks load an offloaded module's weights around its forward, so the calibration
  instrument (``MaskedExperts``, installed under the hook) sees real weights there.

Whatever the placement, the statistics are the same computation on the same values: packing, the
neuron scores (down-projection norms) and the weights fingerprint read the experts one expert (or a
4-neuron prefix) at a time, from the checkpoint when the model is not resident (offloaded modules
hold ``meta`` tensors between forwards).

The offload folder (:class:`OffloadFolder`) is output of the run: created for it (an existing path is
refused), never inside an input or the pack, and removed after the run with the files the run
wrote in it (one level; nothing is removed recursively).
"""

from __future__ import annotations

import enum
import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from crisp_runtime.hf.moe_layers import MoeLayerRef, UnsupportedModelError, find_moe_layers, model_top_k
from crisp_runtime.storage.outputs import OutputPathError, check_not_input_folder, check_writable_folder

from .calibration import DTYPES, CliError, load_model

# accelerate's named strategies (``infer_auto_device_map`` with balanced memory or in order)
DEVICE_MAP_NAMES = ("auto", "balanced", "balanced_low_0", "sequential")


class Placement(enum.Enum):
    RESIDENT = "resident"
    STREAM = "stream"
    DEVICE_MAP = "device-map"


PLACEMENT_CHOICES = (Placement.RESIDENT.value, Placement.STREAM.value)  # --placement; device-map via --device-map


@dataclass(frozen=True)
class ModelLoading:
    """The placement and, for ``device-map``, accelerate's settings (as ``from_pretrained`` takes them)."""

    placement: Placement = Placement.RESIDENT
    device_map: str | Mapping[str, int | str] | None = None
    max_memory: Mapping[int | str, int | str] | None = None
    offload_folder: Path | None = None


def _json_object(option: str, text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise CliError(f"{option}: expected a JSON object, got {text!r} ({exc})") from exc
    if not isinstance(value, dict) or not value:
        raise CliError(f"{option}: expected a non-empty JSON object, got {text!r}")
    return value


def _device_name(option: str, key: str, device) -> int | str:
    """A GPU index (int or "N"), "cuda[:N]", "cpu" or "disk"; anything else is a CliError."""
    if isinstance(device, bool):
        raise CliError(f"{option}: {key!r}: expected a GPU index, 'cpu' or 'disk', got {device!r}")
    if isinstance(device, int) and device >= 0:
        return device
    if isinstance(device, str):
        if device.isdigit():
            return int(device)
        if device in ("cpu", "disk", "cuda") or (device.startswith("cuda:") and device[5:].isdigit()):
            return device
    raise CliError(f"{option}: {key!r}: expected a GPU index, 'cuda:N', 'cpu' or 'disk', got {device!r}")


def parse_device_map(text: str) -> str | dict[str, int | str]:
    """``--device-map``: one of accelerate's strategies or a JSON object {module name: device}."""
    if text in DEVICE_MAP_NAMES:
        return text
    if not text.lstrip().startswith("{"):
        raise CliError(f"--device-map: expected one of {', '.join(DEVICE_MAP_NAMES)} or a JSON object "
                       f"{{module name: device}}, got {text!r}")
    value = _json_object("--device-map", text)
    return {str(k): _device_name("--device-map", k, v) for k, v in value.items()}


def parse_max_memory(text: str) -> dict[int | str, int | str]:
    """``--max-memory``: a JSON object {device: size}, device a GPU index, "cpu" or "disk", size in bytes or
    a string accelerate reads ("20GiB", "500MB")."""
    from accelerate.utils import convert_file_size_to_int

    out: dict[int | str, int | str] = {}
    for key, size in _json_object("--max-memory", text).items():
        device = _device_name("--max-memory", key, key)
        if isinstance(device, str) and device.startswith("cuda"):
            raise CliError(f"--max-memory: {key!r}: name GPUs by index (0, 1, ...), as accelerate does")
        try:
            if isinstance(size, bool) or not isinstance(size, (int, str)) or convert_file_size_to_int(size) < 0:
                raise ValueError(size)
        except ValueError as exc:
            raise CliError(f"--max-memory: {key!r}: expected a size (bytes, or like '20GiB', '500MB'), got "
                           f"{size!r}") from exc
        out[device] = size
    return out


def loading_from_options(placement: str = "resident", device_map: str | None = None, max_memory: str | None = None,
                         offload_folder: str | os.PathLike | None = None) -> ModelLoading:
    """The :class:`ModelLoading` of crisp-profile's options (CliError naming the option on bad input)."""
    try:
        kind = Placement(placement)
    except ValueError as exc:
        raise CliError(f"--placement: expected one of {', '.join(PLACEMENT_CHOICES)}, got {placement!r}") from exc
    if device_map is None:
        for option, value in (("--max-memory", max_memory), ("--offload-folder", offload_folder)):
            if value is not None:
                raise CliError(f"{option}: only with --device-map (accelerate's placement)")
        return ModelLoading(kind)
    if kind is not Placement.RESIDENT:
        raise CliError(f"--device-map: accelerate places the model; not with --placement {placement}")
    try:
        import accelerate  # noqa: F401
    except ImportError as exc:
        raise CliError("--device-map: needs accelerate (pip install accelerate, or crisp-moe[dev])") from exc
    return ModelLoading(Placement.DEVICE_MAP, parse_device_map(device_map),
                        None if max_memory is None else parse_max_memory(max_memory),
                        None if offload_folder is None else Path(offload_folder))


# ----------------------------------------------------------------------------- the offload folder


class OffloadFolder:
    """accelerate's offload folder of one run: made for it, emptied and removed after it.

    ``given``: the user's ``--offload-folder`` (must not exist: crisp-profile creates it, so that everything in
    it is the run's own); None: a fresh ``.<out>.crisp-offload-*`` folder beside ``--out``. Neither may be,
    contain or lie inside an input (``--model``, ``--data``) or the output.
    """

    def __init__(self, given: Path | None, beside: Path, protected: Mapping[str, object]) -> None:
        option = "--offload-folder" if given is not None else "the offload folder"
        try:
            if given is None:
                check_writable_folder(f"{option} (beside --out)", beside)
                self.path = Path(tempfile.mkdtemp(prefix=".crisp-offload-", dir=beside))
            else:
                given = given.expanduser().absolute()
                if given.exists() or given.is_symlink():
                    raise CliError(f"--offload-folder {given}: exists; give a new path (crisp-profile creates the "
                                   f"folder and removes it after the run)")
                check_writable_folder("--offload-folder", given.parent)
                check_not_input_folder("--offload-folder", given, protected)
                given.mkdir(mode=0o700)
                self.path = given
        except OutputPathError as exc:
            raise CliError(str(exc)) from exc

    def remove(self) -> list[str]:
        """Delete the files in the folder (all the run's: the folder was new), then the folder; returns the
        names left in it (sub-folders are not entered), empty when the folder is gone."""
        if not self.path.is_dir():
            return []
        left = []
        for entry in self.path.iterdir():
            if entry.is_file() or entry.is_symlink():
                entry.unlink(missing_ok=True)
            else:
                left.append(entry.name)
        if not left:
            self.path.rmdir()
        return left


# ----------------------------------------------------------------------------- the experts, wherever they are


class LazyLayers(Mapping):
    """``{layer_id: fn(layer_id)}`` computed at every access, nothing kept (one layer alive at a time when the
    consumer drops it, as ``MaskedExperts`` does after each layer's forward)."""

    def __init__(self, layer_ids: Sequence[int], fn: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._ids = list(layer_ids)
        self._fn = fn

    def __getitem__(self, layer_id: int):
        if layer_id not in self._ids:
            raise KeyError(layer_id)
        return self._fn(layer_id)

    def __iter__(self):
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)


class ExpertSource:
    """The profiler's access to the full-precision experts: the modules' own when resident, else the checkpoint
    (``crisp_runtime.hf.checkpoint.CheckpointExperts``, in the model's dtype)."""

    def __init__(self, placement: Placement, layers: Sequence[MoeLayerRef], checkpoint=None) -> None:
        self.placement = placement
        self.layers = list(layers)
        self.checkpoint = checkpoint  # CheckpointExperts, or None when resident

    @property
    def forward_weights(self) -> Mapping | None:
        """``MaskedExperts``' weights: the checkpoint's, read per layer (stream), or None: the modules' own
        (resident, or loaded by accelerate's hooks around each forward)."""
        return self.checkpoint if self.placement is Placement.STREAM else None

    def read(self, ref: MoeLayerRef, experts: range) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate_up[experts], down[experts])`` in full precision (``pack_layers``' reader)."""
        if self.checkpoint is None:
            return (ref.module.gate_up_proj.detach()[experts.start:experts.stop],
                    ref.module.down_proj.detach()[experts.start:experts.stop])
        return self.checkpoint.experts(ref.layer_id, experts)

    def down_norms(self) -> torch.Tensor:
        """``||down[e][:, j]||`` per (layer, expert, neuron), float64 (L, E, I); one expert read at a time."""
        out = []
        for ref in self.layers:
            norms = [self.read(ref, range(e, e + 1))[1].float().norm(dim=1).cpu().double()
                     for e in range(ref.num_experts)]
            out.append(torch.cat(norms))
        return torch.stack(out)

    def weights_sha256(self) -> str:
        """``crisp_runtime.storage.pack.weights_sha256`` of the experts (4-neuron prefixes; the same digest whichever
        the placement, as the values are the same)."""
        from crisp_runtime.storage.pack import weights_sha256

        if self.checkpoint is None:
            return weights_sha256(self.layers)
        return self.checkpoint.weights_sha256()

    def packed_weights(self, packed) -> Mapping:
        """The dequantized pack in stored order (``calibration.stored_weights``), as ``MaskedExperts`` takes it:
        all layers at once when the model is resident (as fast as before), else one layer per access (the
        dequantized pack is as large as the float32 model)."""
        from .calibration import stored_weights

        if self.placement is Placement.RESIDENT:
            return {lid: stored_weights(layer) for lid, layer in packed.items()}
        return LazyLayers(list(packed), lambda lid: stored_weights(packed[lid]))


@dataclass
class PlacedModel:
    """A model loaded for profiling: ``input_device`` takes the token ids; ``close()`` removes the offload
    folder (call it when the run ends, also on failure)."""

    model: torch.nn.Module
    layers: list[MoeLayerRef]
    experts: ExpertSource
    input_device: torch.device
    offload: OffloadFolder | None = None

    def close(self) -> list[str]:
        return [] if self.offload is None else self.offload.remove()


def load_placed(path: str | os.PathLike, device: torch.device, dtype: str, loading: ModelLoading,
                protected: Mapping[str, object], beside: Path) -> PlacedModel:
    """The model of ``path`` placed as ``loading`` says (see the module docstring).

    protected: the run's inputs and outputs ({option: path(s)}), which the offload folder must keep clear of;
    beside: where a default offload folder is made (``--out``'s parent).
    """
    from crisp_runtime.hf.checkpoint import CheckpointError, CheckpointExperts, CheckpointMap, checkpoint_files

    if loading.placement is Placement.RESIDENT:
        model, layers = load_model(path, device, dtype)
        return PlacedModel(model, layers, ExpertSource(Placement.RESIDENT, layers), device)
    if dtype not in DTYPES:
        raise CliError(f"--dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CliError(f"--model {path}: no config.json in it (expected a local transformers checkpoint)")
    offload = None
    try:
        if loading.placement is Placement.STREAM:
            from crisp_runtime.hf.checkpoint import load_skeleton

            model, cmap = load_skeleton(path, None if dtype == "auto" else DTYPES[dtype])
            model.to(device)
            input_device = device
        else:
            offload = OffloadFolder(loading.offload_folder, beside, protected)
            model = _from_pretrained_dispatched(path, dtype, loading, offload.path)
            cmap = CheckpointMap(model, checkpoint_files(path))
            input_device = torch.device("cpu")  # accelerate's hooks move inputs to each module's device
        layers = find_moe_layers(model)
        model_top_k(model)
    except (CheckpointError, UnsupportedModelError) as exc:
        if offload is not None:
            offload.remove()
        raise CliError(f"--model {path}: {exc}") from exc
    except BaseException:
        if offload is not None:
            offload.remove()
        raise
    source = ExpertSource(loading.placement, layers, CheckpointExperts(cmap, layers))
    return PlacedModel(model.eval(), layers, source, input_device, offload)


def _from_pretrained_dispatched(path: Path, dtype: str, loading: ModelLoading, offload_folder: Path):
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(
            str(path), dtype=DTYPES[dtype], local_files_only=True, device_map=loading.device_map,
            max_memory=None if loading.max_memory is None else dict(loading.max_memory),
            offload_folder=str(offload_folder))
    except Exception as exc:  # transformers / accelerate raise ValueError / KeyError / OSError on bad maps
        raise CliError(f"--model {path} with --device-map: cannot load it ({type(exc).__name__}: {exc})") from exc
