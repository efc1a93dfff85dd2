"""Model shapes: the one registry of the benchmarks and the tests.

A :class:`ModelShape` is what the benchmarks need of a model: MoE layers, experts, top-k and the
expert matrices' sizes (the bytes of a neuron follow from CRISP's 4-bit format). The published
shapes below are from each model's config.json; ``tiny`` is read from the committed checkpoint.
``resolve_shape`` turns a ``--shapes`` item into one: a registered name, a short alias, ``tiny``,
or ``HxI`` (one expert of that size, for the kernel sweep).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from crisp_kernels.format import QuantFormat

from .common import DEFAULT_MODEL, CliError


class ShapeError(CliError):
    """An unknown model shape."""


@dataclass(frozen=True)
class ModelShape:
    """What the benchmarks and the simulator need of a model: layers, experts, and the bytes of one neuron."""

    name: str
    num_layers: int  # MoE layers
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    group_size: int = 64
    symmetric: bool = False

    @property
    def neuron_nbytes(self) -> int:
        return QuantFormat(group_size=self.group_size, symmetric=self.symmetric).neuron_nbytes(self.hidden_size)

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one full-width expert in CRISP's packed 4-bit format."""
        return self.intermediate_size * self.neuron_nbytes

    @property
    def total_expert_nbytes(self) -> int:
        return self.num_layers * self.num_experts * self.expert_nbytes


MIXTRAL_8X7B = ModelShape("mixtral-8x7b", num_layers=32, num_experts=8, top_k=2, hidden_size=4096,
                          intermediate_size=14336)
# DeepSeek-MoE-16B: 28 layers of which the first is dense, so 27 MoE layers; 64 routed experts of
# I 1408, top-6. Its 2 shared experts per layer are dense MLPs computed for every token and always
# resident (CRISP's plan never narrows them), so they are outside the expert bytes this shape counts.
DEEPSEEK_MOE_16B = ModelShape("deepseek-moe-16b", num_layers=27, num_experts=64, top_k=6, hidden_size=2048,
                              intermediate_size=1408)
# Qwen3-30B-A3B: 48 layers, all MoE; 128 experts of moe_intermediate_size 768, top-8.
QWEN3_30B_A3B = ModelShape("qwen3-30b-a3b", num_layers=48, num_experts=128, top_k=8, hidden_size=2048,
                           intermediate_size=768)
# gpt-oss-20b: 24 layers, 32 experts of I 2880, top-4; H 2880 = 45 groups of 64 (g128 does not divide it).
GPT_OSS_20B = ModelShape("gpt-oss-20b", num_layers=24, num_experts=32, top_k=4, hidden_size=2880,
                         intermediate_size=2880)

SHAPES = {s.name: s for s in (MIXTRAL_8X7B, DEEPSEEK_MOE_16B, QWEN3_30B_A3B, GPT_OSS_20B)}
ALIASES = {"mixtral": MIXTRAL_8X7B.name, "deepseek": DEEPSEEK_MOE_16B.name, "qwen3": QWEN3_30B_A3B.name,
           "gpt-oss": GPT_OSS_20B.name}
# The shapes `crisp-bench simulate --target` maps traces onto (those with hardware figures in docs/).
TARGETS = {MIXTRAL_8X7B.name: MIXTRAL_8X7B, DEEPSEEK_MOE_16B.name: DEEPSEEK_MOE_16B}


def tiny_shape(model_dir: Path | None = None) -> ModelShape:
    """The shape named 'tiny': that of ``model_dir``'s config.json (default the committed model)."""
    if model_dir is None and not (DEFAULT_MODEL / "config.json").is_file():
        return ModelShape("tiny-mixtral (assumed)", 4, 8, 2, 128, 512)  # an install without the committed model
    folder = Path(model_dir or DEFAULT_MODEL)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ShapeError(f"--model {folder}: not a transformers checkpoint (no config.json); expected a model folder")
    try:
        c = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ShapeError(f"--model {folder}: {cfg_path.name} is not readable JSON ({exc})") from None
    if not isinstance(c, dict):
        raise ShapeError(f"--model {folder}: {cfg_path.name} must be a JSON object, got {type(c).__name__}")
    # DeepSeek / Qwen-MoE style configs: the experts' size and count under their own keys (intermediate_size is
    # the dense MLP's there), and the first first_k_dense_replace layers dense
    keys = {"num_layers": "num_hidden_layers", "hidden_size": "hidden_size",
            "intermediate_size": "moe_intermediate_size" if "moe_intermediate_size" in c else "intermediate_size",
            "num_experts": next((k for k in ("n_routed_experts", "num_local_experts", "num_experts") if k in c), None),
            "top_k": "num_experts_per_tok"}
    defaults = {"num_experts": 8, "top_k": 2}
    values = {}
    for field_name, key in keys.items():
        if key is None or key not in c:
            if field_name not in defaults:
                raise ShapeError(f"--model {folder}: {cfg_path.name} has no {key!r}")
            values[field_name] = defaults[field_name]
            continue
        v = c[key]
        if type(v) is not int or v < 1:
            raise ShapeError(f"--model {folder}: {cfg_path.name} {key!r} must be a positive integer, got {v!r}")
        values[field_name] = v
    dense = c.get("first_k_dense_replace", 0)
    if type(dense) is not int or not 0 <= dense < values["num_layers"]:
        raise ShapeError(f"--model {folder}: {cfg_path.name} 'first_k_dense_replace' must be an integer in "
                         f"[0, {values['num_layers']}), got {dense!r}")
    values["num_layers"] -= dense
    if values["top_k"] > values["num_experts"]:
        raise ShapeError(f"--model {folder}: {cfg_path.name} routes {values['top_k']} of {values['num_experts']} "
                         "experts; expected num_experts_per_tok <= the expert count")
    return ModelShape(folder.name, **values)


def shape_names() -> list[str]:
    """What ``resolve_shape`` accepts by name (aliases first, as the help texts list them)."""
    return ["tiny", *ALIASES, *SHAPES]


def resolve_shape(spec: str, model_dir: Path | None = None, *, allow_hxi: bool = False) -> ModelShape:
    """A registered shape by name or alias, ``tiny`` (from ``model_dir``), or with ``allow_hxi`` ``HxI``
    (e.g. ``4096x14336``: one layer of one expert, for timing one expert). ShapeError otherwise."""
    key = spec.strip().lower()
    if key == "tiny":
        return tiny_shape(model_dir)
    key = ALIASES.get(key, key)
    if key in SHAPES:
        return SHAPES[key]
    parts = key.split("x")
    if allow_hxi and len(parts) == 2 and all(p.isdigit() and int(p) > 0 for p in parts):
        return ModelShape(key, 1, 1, 1, int(parts[0]), int(parts[1]))
    extra = " or HxI, e.g. 4096x14336" if allow_hxi else ""
    raise ShapeError(f"unknown shape {spec!r}: choose from {', '.join(shape_names())}{extra}")


def resolve_shapes(spec: str | list[str], model_dir: Path | None = None, *, allow_hxi: bool = False
                   ) -> list[ModelShape]:
    """``resolve_shape`` of every item of a comma-separated ``--shapes`` value (or a list of items)."""
    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    if not names:
        raise ShapeError(f"--shapes {spec!r}: give at least one of {', '.join(shape_names())}")
    try:
        return [resolve_shape(n, model_dir, allow_hxi=allow_hxi) for n in names]
    except ShapeError as exc:  # a bad --model names its own option
        raise ShapeError(str(exc) if str(exc).startswith("--model") else f"--shapes: {exc}") from None
