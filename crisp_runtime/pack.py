"""A CRISP pack: a folder with the packed experts of one model, its description and optionally a plan.

    directory/experts.safetensors   every MoE layer, neuron-major 4-bit (crisp_kernels.save_packed)
    directory/pack.json             format, version, model_type, num_hidden_layers, hidden_size,
                                    intermediate_size, num_experts, top_k, layer_ids, quantization,
                                    plus whatever the caller adds (calibration data, tool versions...)
    directory/plan.json             optional CrispPlan

Every file is written atomically (temporary file, fsync, rename). ``load_pack`` checks that the
three agree with each other; ``CrispPack.check_model`` that they fit a model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from crisp_kernels import PackedLayer, PackFormatError, QuantFormat, load_packed, pack_layer, save_packed
from crisp_kernels.io import atomic_write, check_uniform_layers

from .models import find_moe_layers, model_top_k
from .plan import CrispPlan, PlanError

PACK_FORMAT = "crisp-pack"
PACK_VERSION = 1
EXPERTS_FILE = "experts.safetensors"
INFO_FILE = "pack.json"
PLAN_FILE = "plan.json"

_RESERVED = ("format", "version", "hidden_size", "intermediate_size", "num_experts", "layer_ids", "quant")


class PackMismatchError(ValueError):
    """A pack (or packed layers) made for another model: shapes, layer ids or expert count differ."""


@dataclass(frozen=True)
class CrispPack:
    layers: Mapping[int, PackedLayer]
    plan: CrispPlan | None
    info: Mapping = field(default_factory=dict)

    def check_model(self, model) -> None:
        """Raise PackMismatchError unless this pack was made for ``model``'s architecture."""
        check_layers_fit_model(self.layers, model, info=self.info)


def model_info(model) -> dict:
    """What pack.json records about the model a pack is made from."""
    refs = find_moe_layers(model)
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    return {
        "model_type": getattr(text, "model_type", None) or getattr(config, "model_type", None),
        "num_hidden_layers": getattr(text, "num_hidden_layers", None),
        "hidden_size": refs[0].hidden_size,
        "intermediate_size": refs[0].intermediate_size,
        "num_experts": refs[0].num_experts,
        "top_k": model_top_k(model),
        "layer_ids": [r.layer_id for r in refs],
    }


def pack_model(model, fmt: QuantFormat | None = None, neuron_orders: Mapping[int, object] | None = None
               ) -> dict[int, PackedLayer]:
    """Quantize the model's current expert weights, ``{layer_id: PackedLayer}`` (CPU tensors).

    neuron_orders: optional ``{layer_id: (E, I) permutation}`` (most important neuron first); the
    present order otherwise.
    """
    fmt = QuantFormat() if fmt is None else fmt
    out = {}
    for ref in find_moe_layers(model):
        gate_up, down = ref.module.gate_up_proj, ref.module.down_proj
        if gate_up.is_meta or down.is_meta:
            raise ValueError(f"{ref.name}: the expert weights are not loaded (meta tensors); nothing to pack")
        order = None if neuron_orders is None else neuron_orders.get(ref.layer_id)
        layer = pack_layer(gate_up.detach(), down.detach(), fmt, order)
        if layer.qweight.device.type != "cpu":
            layer = PackedLayer(layer.fmt, layer.qweight.cpu(), layer.scales.cpu(),
                                None if layer.zeros is None else layer.zeros.cpu(), layer.neuron_order.cpu())
        out[ref.layer_id] = layer
    return out


def _layers_summary(layers: Mapping[int, PackedLayer]) -> dict:
    if not layers:
        raise ValueError("layers: expected at least one packed layer")
    try:
        first = check_uniform_layers(layers)
    except ValueError as exc:
        raise PackMismatchError(str(exc)) from exc
    return {
        "hidden_size": first.hidden_size,
        "intermediate_size": first.intermediate_size,
        "num_experts": first.num_experts,
        "layer_ids": sorted(int(i) for i in layers),
        "quant": {"bits": first.fmt.bits, "group_size": first.fmt.group_size, "symmetric": first.fmt.symmetric},
    }


def save_pack(
    directory: str | os.PathLike,
    layers: Mapping[int, PackedLayer],
    *,
    plan: CrispPlan | None = None,
    info: Mapping | None = None,
) -> Path:
    """Write a pack folder (created if needed); returns its path. See the module docstring."""
    directory = Path(directory)
    summary = _layers_summary(layers)
    info = dict(info or {})
    for key in ("hidden_size", "intermediate_size", "num_experts", "layer_ids"):
        if key in info and info[key] != summary[key]:
            raise PackMismatchError(f"info[{key!r}] = {info[key]!r} disagrees with the layers ({summary[key]!r})")
    for key in ("format", "version", "quant"):
        if key in info:
            raise ValueError(f"info: key {key!r} is reserved")
    if plan is not None:
        if not isinstance(plan, CrispPlan):
            raise TypeError(f"plan: expected CrispPlan, got {type(plan).__name__}")
        if info.get("top_k") is not None and info["top_k"] != plan.top_k:
            raise PlanError(f"plan top_k {plan.top_k} != info top_k {info['top_k']}")
        plan.check_compatible(num_experts=summary["num_experts"], top_k=plan.top_k,
                              intermediate_size=summary["intermediate_size"], layer_ids=summary["layer_ids"])
        info.setdefault("top_k", plan.top_k)
    record = {"format": PACK_FORMAT, "version": PACK_VERSION, "model_type": None, "num_hidden_layers": None,
              "top_k": None, **info, **summary}
    text = json.dumps(record, indent=1, sort_keys=True)
    directory.mkdir(parents=True, exist_ok=True)
    save_packed(directory / EXPERTS_FILE, layers)
    if plan is not None:
        plan.save(directory / PLAN_FILE)
    else:
        # A stale plan from an earlier pack in this folder would no longer describe these layers.
        (directory / PLAN_FILE).unlink(missing_ok=True)
    # pack.json last: a folder without it is not a (complete) pack.
    atomic_write(directory / INFO_FILE, lambda tmp: Path(tmp).write_text(text))
    return directory


def load_pack(directory: str | os.PathLike, *, device: str = "cpu") -> CrispPack:
    """Read and cross-check a pack folder."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"CRISP pack folder not found: {directory}")
    info_path = directory / INFO_FILE
    if not info_path.is_file():
        raise FileNotFoundError(f"{directory} is not a CRISP pack: {INFO_FILE} is missing")
    try:
        info = json.loads(info_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PackFormatError(f"{info_path}: not readable JSON ({exc})") from exc
    if not isinstance(info, dict) or info.get("format") != PACK_FORMAT:
        raise PackFormatError(f"{info_path}: format is {info.get('format') if isinstance(info, dict) else info!r}, "
                              f"expected {PACK_FORMAT!r}")
    if info.get("version") != PACK_VERSION:
        raise PackFormatError(f"{info_path}: version {info.get('version')!r} is not supported (this CRISP reads "
                              f"{PACK_VERSION})")
    experts_path = directory / EXPERTS_FILE
    if not experts_path.is_file():
        raise FileNotFoundError(f"{directory}: {EXPERTS_FILE} is missing")
    layers = load_packed(experts_path, device=device)
    summary = _layers_summary(layers)
    for key in ("hidden_size", "intermediate_size", "num_experts", "layer_ids", "quant"):
        if info.get(key) != summary[key]:
            raise PackFormatError(f"{directory}: {INFO_FILE} says {key}={info.get(key)!r} but {EXPERTS_FILE} holds "
                                  f"{summary[key]!r}")
    plan = None
    plan_path = directory / PLAN_FILE
    if plan_path.is_file():
        plan = CrispPlan.load(plan_path)
        top_k = info.get("top_k") or plan.top_k
        try:
            plan.check_compatible(num_experts=summary["num_experts"], top_k=top_k,
                                  intermediate_size=summary["intermediate_size"], layer_ids=summary["layer_ids"])
        except PlanError as exc:
            raise PlanError(f"{plan_path}: {exc}") from exc
    return CrispPack(layers=layers, plan=plan, info=info)


def check_layers_fit_model(layers: Mapping[int, PackedLayer], model, *, info: Mapping | None = None) -> None:
    """Raise PackMismatchError unless ``layers`` (and ``info``) describe ``model``'s MoE layers."""
    refs = find_moe_layers(model)
    problems = []
    model_ids = sorted(r.layer_id for r in refs)
    pack_ids = sorted(int(i) for i in layers)
    if model_ids != pack_ids:
        problems.append(f"MoE layers {pack_ids} in the pack, {model_ids} in the model")
    for ref in refs:
        layer = layers.get(ref.layer_id)
        if layer is None:
            continue
        want = (ref.num_experts, ref.intermediate_size, ref.hidden_size)
        got = (layer.num_experts, layer.intermediate_size, layer.hidden_size)
        if want != got:
            problems.append(f"layer {ref.layer_id}: (experts, intermediate, hidden) = {got} in the pack, "
                            f"{want} in the model")
    if info:
        mi = model_info(model)
        for key in ("model_type", "num_hidden_layers", "top_k"):
            if info.get(key) is not None and mi.get(key) is not None and info[key] != mi[key]:
                problems.append(f"{key} {info[key]!r} in the pack, {mi[key]!r} in the model")
    if problems:
        raise PackMismatchError("this CRISP pack was made for another model: " + "; ".join(problems[:6]))
