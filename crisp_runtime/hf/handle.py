"""What the two ways into a model share: the handle a user gets back, and the checks of apply's arguments.

A transformers v5 model's experts modules (``crisp_runtime.hf.dropin``) and per-expert MoE blocks
(``crisp_runtime.hf.blocks``) are patched differently, but the user sees one :class:`CrispHandle` (stats,
set_plan, restore, context manager) and one rule for ``gpu_budget``, ``serving`` / ``config`` / ``cpu``, the plan
and the serving choice. Both modules import this one; neither imports the other's internals.
"""

from __future__ import annotations

import abc
import math
import numbers
import os
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

import torch

from crisp_kernels import PackedLayer
from crisp_kernels.cpu_expert import Precision
from crisp_runtime.cpu.dense import DenseSwap, swap_dense
from crisp_runtime.cpu.knob import serves_on_cpu
from crisp_runtime.execution.runtime import CrispRuntime, RuntimeConfig, min_budget_bytes, plan_for_layers
from crisp_runtime.planning.plan import CrispPlan, PlanError
from crisp_runtime.planning.serving import Placement, make_serving
from crisp_runtime.storage.pack import CrispPack, load_pack

# ---------------------------------------------------------------------- budgets

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


# Budgets are byte counts compared and summed as Python ints, but torch's allocator and the CUDA
# APIs count in signed 64-bit: a larger number is an overflow (or a typo), not a budget.
MAX_BUDGET_BYTES = 2**63 - 1
_BUDGET_TEXT = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*")
_BUDGET_HINT = "bytes (an int) or a string like '2GiB', '512 MB', '1.5GB'"


def parse_budget(budget) -> int | None:
    """Bytes from an int or a string such as ``"2GiB"``, ``"512 MB"``, ``"1.5GB"``; None stays None.

    Raises TypeError (bool, float, other types) or ValueError (unreadable text, unknown unit, not a whole
    number of bytes such as ``"1.9"``, a fraction such as ``"0.25"`` (a share is ``"25%"``), not positive, beyond
    ``MAX_BUDGET_BYTES``), each naming ``gpu_budget``.
    """
    if budget is None:
        return None
    if isinstance(budget, bool):
        raise TypeError(f"gpu_budget: expected {_BUDGET_HINT}, got a bool")
    if isinstance(budget, numbers.Integral):  # int, numpy integers
        value = int(budget)
    elif isinstance(budget, str):
        m = _BUDGET_TEXT.fullmatch(budget)
        if not m and budget.strip().endswith("%"):  # a share needs the pack's bytes: read_budget takes it
            raise ValueError(f"gpu_budget: {budget!r} is a share of a pack's expert bytes; parse_budget reads bytes, "
                             f"as {_BUDGET_HINT} (apply() and load_model() take shares too)")
        if not m:
            raise ValueError(f"gpu_budget: cannot read {budget!r}; expected {_BUDGET_HINT}")
        unit = m.group(2).lower()
        if unit not in _UNITS:
            raise ValueError(f"gpu_budget: unknown unit {m.group(2)!r} in {budget!r}; use one of "
                             "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)")
        try:  # Decimal: "1.1GB" is exactly 1_100_000_000 bytes (a float gives 1_100_000_000.0000002)
            exact = Decimal(m.group(1)) * _UNITS[unit]
        except InvalidOperation as exc:  # pragma: no cover - the pattern admits only plain decimals
            raise ValueError(f"gpu_budget: cannot read {budget!r}; expected {_BUDGET_HINT}") from exc
        # "1.9" is no byte count, and "0.25" or "1.0" without a unit a share written as a fraction (a share is "25%")
        fraction = unit in ("", "b") and "." in m.group(1) and 0 < exact <= 1
        if exact != exact.to_integral_value() or fraction:
            what = "reads as a fraction, not bytes" if fraction else "is not a whole number of bytes"
            share = f"'{float(exact) * 100:g}%'" if fraction else "'25%'"
            raise ValueError(f"gpu_budget: {budget!r} {what}; a budget is whole bytes ('6GiB', '512 MB', 107520) or "
                             f"a share of the pack's expert bytes ({share})")
        value = int(exact)
    elif isinstance(budget, numbers.Real):
        hint = (" (for a share of the pack's expert bytes pass a string such as '25%')" if 0 < budget <= 1
                else "")
        raise TypeError(f"gpu_budget: expected {_BUDGET_HINT}, got {type(budget).__name__} {budget!r}{hint}")
    else:
        raise TypeError(f"gpu_budget: expected {_BUDGET_HINT}, got {type(budget).__name__} {budget!r}")
    if value <= 0:
        raise ValueError(f"gpu_budget must be positive, got {budget!r}")
    if value > MAX_BUDGET_BYTES:
        raise ValueError(f"gpu_budget {budget!r} is {value} bytes, beyond any device (at most {MAX_BUDGET_BYTES})")
    return value


_SHARE_TEXT = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*%\s*")


@dataclass(frozen=True)
class BudgetShare:
    """A GPU budget given as a share of the pack's expert bytes (``gpu_budget="25%"``): the unit of
    ``crisp-profile --gpu-budget``, of the choices a pack stores and of ``crisp-bench simulate --budget``. What it
    is a share of: every expert at full width in the pack's 4-bit rows
    (``crisp_runtime.storage.serving_record.budget_base_bytes``)."""

    fraction: float

    def __post_init__(self) -> None:
        if not (isinstance(self.fraction, numbers.Real) and math.isfinite(self.fraction)
                and 0.0 < self.fraction <= 1.0):
            raise ValueError(f"gpu_budget: a share must be in (0%, 100%], got {self.fraction!r}")

    def bytes_for(self, layers) -> int:
        """The share in bytes for these packed layers, rounded up: a stored choice for 25% applies to "25%"."""
        from crisp_runtime.storage.serving_record import budget_base_bytes

        return max(1, math.ceil(self.fraction * budget_base_bytes(layers)))


def read_budget(budget) -> int | BudgetShare | None:
    """``apply``'s and ``load_model``'s ``gpu_budget``: a share such as ``"25%"`` (:class:`BudgetShare`, turned into
    bytes once the pack is read, :func:`budget_bytes`), else bytes as :func:`parse_budget` reads them."""
    if isinstance(budget, str) and (m := _SHARE_TEXT.fullmatch(budget)):
        percent = Decimal(m.group(1))
        if not 0 < percent <= 100:
            raise ValueError(f"gpu_budget: {budget!r} is not a share in (0%, 100%] of the pack's expert bytes")
        return BudgetShare(float(percent / 100))
    if isinstance(budget, str) and budget.strip().endswith("%"):
        raise ValueError(f"gpu_budget: cannot read {budget!r}; expected a share of the pack's expert bytes such as "
                         f"'25%', or {_BUDGET_HINT}")
    return parse_budget(budget)


def budget_bytes(budget: int | BudgetShare | None, layers) -> int | None:
    """A :func:`read_budget` value in bytes for these packed layers (None stays None)."""
    return budget.bytes_for(layers) if isinstance(budget, BudgetShare) else budget


def check_serving_arguments(config, serving, cpu) -> None:
    """apply's ``config`` / ``serving`` / ``cpu`` checked before any work (their errors name them)."""
    from crisp_runtime.cpu.knob import parse_cpu_mode
    from crisp_runtime.planning.defaults import PAPER, check_given

    if config is not None and not isinstance(config, RuntimeConfig):
        raise TypeError(f"config: expected RuntimeConfig, got {type(config).__name__}")
    if serving is not None and not (isinstance(serving, str) and serving == PAPER):
        make_serving(serving)
    check_given(serving, config)
    if cpu is not None:
        parse_cpu_mode(cpu)


def pack_folder(value, what: str) -> Path:
    """A pack folder argument as a Path, with errors naming ``what`` (an empty string is no folder, not ".")."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{what}: expected a CRISP pack folder (str or path), got {type(value).__name__} {value!r}")
    path = os.fspath(value)
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"{what}: expected a CRISP pack folder, got {value!r}")
    return Path(path)


def loaded_source(source):
    """``apply``'s ``source`` with a pack folder loaded (a CrispPack: its pack.json is read once, for the layers
    and for the serving choice it stores)."""
    if isinstance(source, (str, os.PathLike)):
        return load_pack(pack_folder(source, "source"))
    return source


def serving_choice_for(source, plan: CrispPlan, layers, top_k: int, budget: int | None, *, serving, config, cpu):
    """What runs (``crisp_runtime.planning.defaults.choose_serving``) for this source, plan, budget and the call's
    arguments: one rule for the v5 drop-in and the per-expert blocks."""
    from crisp_runtime.planning.defaults import budget_fraction_of, choose_serving, pack_facts
    from crisp_runtime.storage.serving_record import budget_base_bytes

    info = source.info if isinstance(source, CrispPack) else {}
    facts = pack_facts(info, plan, top_k)
    fraction = budget_fraction_of(budget, budget_base_bytes(layers))
    return choose_serving(info, facts, fraction, serving=serving, config=config, cpu=cpu)


def host_store_budget(cpu, device, layers, top_k: int, budget: int | None) -> int | None:
    """The budget to run with: ``budget``, or where ``cpu`` (the choice's mode) serves every expert on the CPU
    kernel (``cpu_knob.serves_on_cpu``: no GPU) and none was given, the smallest one (``min_budget_bytes``): the
    CPU kernel reads the packed host rows, which only a budgeted runtime keeps; its device cache holds nothing a
    step then reads."""
    if budget is None and serves_on_cpu(cpu, device, layers):
        return min_budget_bytes(layers, top_k)
    return budget


def log_choice(choice, cpu_decision) -> None:
    """The one log line of what runs and why (logger ``crisp_runtime``, INFO): the serving choice and the CPU
    decision with the bandwidths it used."""
    from crisp_runtime.planning.defaults import LOG

    bw = "" if cpu_decision.cpu_bytes_per_s is None else f", CPU {cpu_decision.cpu_bytes_per_s / 1e9:.2f} GB/s"
    if cpu_decision.h2d_bytes_per_s is not None:
        bw += f", H2D {cpu_decision.h2d_bytes_per_s / 1e9:.2f} GB/s"
    LOG.info("%s; cpu decision: %s (%s%s)", choice.log_line(), cpu_decision.placement.value, cpu_decision.reason, bw)


def plan_and_budget_checked(plan: CrispPlan | None, layers, first: PackedLayer, top_k: int, budget: int | None,
                            device) -> CrispPlan:
    """The plan to run (the one given, else full width) checked against the packed layers, and the budget
    against the layers and the device: one rule for the v5 drop-in (:func:`apply`) and the per-expert
    blocks (:func:`crisp_runtime.hf.blocks.apply_blocks`)."""
    layer_ids = sorted(layers)
    if plan is None:
        plan = CrispPlan.full(first.num_experts, top_k, first.intermediate_size, layer_ids)
    plan = plan_for_layers(plan, layers)  # a 2-bit tail pack's plan in neurons -> its storage rows
    try:
        plan.check_compatible(num_experts=first.num_experts, top_k=top_k, intermediate_size=first.intermediate_size,
                              layer_ids=layer_ids)
    except PlanError as exc:
        raise PlanError(f"{exc} (the plan was made for another pack or model)") from exc
    if budget is not None:
        check_budget_fits_layers(budget, layers, top_k)
        _check_budget_fits_device(budget, device)
    return plan


def check_budget_fits_layers(budget: int, layers, top_k: int) -> None:
    need = min_budget_bytes(layers, top_k)
    if budget < need:
        raise ValueError(f"gpu_budget of {budget} bytes is too small: one token needs up to {top_k} experts at "
                         f"full width, {need} bytes")


def _check_budget_fits_device(budget: int, device: torch.device) -> None:
    """A budget larger than the device is a typo that would end in an out-of-memory error mid-run."""
    if device.type != "cuda":  # host memory for cpu; nothing to compare against
        return
    total = torch.cuda.get_device_properties(device).total_memory  # GPU-only
    if budget > total:
        raise ValueError(f"gpu_budget of {budget} bytes is more than {device} has ({total} bytes)")


def floating_dtype(model) -> torch.dtype | None:
    """The dtype of ``model``'s first floating-point parameter that holds data (None without one): the dtype
    ``model.to(dtype)`` / ``.half()`` sets."""
    for p in model.parameters():
        if p.is_floating_point() and not p.is_meta:
            return p.dtype
    return None


# The model dtypes CRISP runs: its activations follow the model's dtype, and the experts' kernels take these
MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MODEL_DTYPES_TEXT = "torch.float32, torch.bfloat16 or torch.float16"


def check_model_dtype(model) -> None:
    """Refuse (ValueError) a model with a floating-point parameter in a dtype CRISP does not run (float64), before
    anything is modified."""
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype not in MODEL_DTYPES:
            raise ValueError(f"model: parameter {name} is {p.dtype}; CRISP runs models in {MODEL_DTYPES_TEXT} "
                             "(convert it first, e.g. model.to(torch.float32), or load it with that dtype)")


def to_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor``'s data converted to ``dtype`` as ``Module.to(dtype)`` converts a parameter (floating tensors
    only; None: unchanged)."""
    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
        tensor.data = tensor.data.to(dtype)
    return tensor


def check_device(value, what: str) -> torch.device:
    """A torch.device from ``value`` (str or torch.device), with an error naming ``what``."""
    if not isinstance(value, (str, torch.device)):
        raise TypeError(f"{what}: expected a device name such as 'cpu' or 'cuda:0', got {type(value).__name__}")
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"{what}: {value!r} is not a device (expected e.g. 'cpu', 'cuda', 'cuda:0')") from exc
    if device.type == "meta":
        raise ValueError(f"{what}: 'meta' holds no data; expected e.g. 'cpu' or 'cuda:0'")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{what}: {value!r} but no CUDA device is available here")
        if device.index is not None and device.index >= torch.cuda.device_count():  # GPU-only
            raise ValueError(f"{what}: {value!r} but only {torch.cuda.device_count()} CUDA device(s) exist")
    elif device.type != "cpu":
        raise ValueError(f"{what}: {value!r}; CRISP runs on 'cpu' or 'cuda' devices")
    return device


# ---------------------------------------------------------------------- the handle


class CrispHandle(abc.ABC):
    """CRISP applied to one model instance; ``restore()`` (or leaving the ``with`` block) undoes it.

    ``stats()`` reports what ran, ``set_plan()`` switches the plan on the same pack and cache. The drop-in for
    v5 experts modules and the one for per-expert blocks each subclass it with their own ``restore()``.
    """

    def __init__(self, model, refs: list, runtime: CrispRuntime) -> None:
        self.model = model
        self.refs = refs
        self.runtime = runtime
        self.active = True
        self.dense: DenseSwap | None = None  # the dense layers replaced (RuntimeConfig.dense), if any
        # the model's dtype once applied (floating_dtype): restore converts the originals it holds outside the
        # module tree when model.to(dtype) / .half() changed it meanwhile; None until the model is modified
        self._dtype: torch.dtype | None = None

    def _swap_dense(self) -> None:
        """Replace the model's dense layers as ``RuntimeConfig.dense`` says (the caller restores on failure), the
        last change apply makes to the model; then records the model's dtype."""
        cpu = self.runtime.config.cpu_experts
        self.dense = swap_dense(self.model, self.runtime.config.dense, threads=cpu.threads,
                                keep_original=self.runtime.config.keep_original,
                                exact_reason=self._exact_attention_reason())
        self._dtype = floating_dtype(self.model)

    def _changed_dtype(self) -> torch.dtype | None:
        """The model's dtype when ``model.to(dtype)`` / ``.half()`` changed it while applied, else None. The
        originals CRISP holds outside the module tree (expert weights, attention's layers) missed that
        conversion: restore converts them to it, as ``.to(dtype)`` would have. Read before restore puts them
        back."""
        now = floating_dtype(self.model)
        return now if self._dtype is not None and now is not None and now != self._dtype else None

    def _exact_attention_reason(self) -> str:
        """Why ``dense="auto"`` keeps attention exact here ("" when the experts all run on the CPU's 8-bit kernel,
        whose Q8_0 arithmetic attention then shares)."""
        placement = self.runtime.serving.placement
        if placement is not Placement.CPU:
            return f"placement {placement.value!r} computes experts off the CPU's 8-bit kernel"
        precision = self.runtime.config.cpu_experts.precision
        if precision is not Precision.Q8:
            return f"the CPU experts compute at precision {precision.value!r}"
        return ""

    def _restore_dense(self, dtype: torch.dtype | None = None) -> None:
        if self.dense is not None:
            self.dense.restore(dtype)

    @property
    def plan(self) -> CrispPlan:
        """The plan that runs (the pack's, the one given, or full width)."""
        return self.runtime.plan

    @property
    def layers(self) -> dict[int, PackedLayer]:
        """The packed experts, ``{layer_id: PackedLayer}`` (host memory)."""
        return dict(self.runtime.layers)

    @property
    def gpu_budget(self) -> int | None:
        """The device prefix cache's budget in bytes, as given; None when none was (every expert resident, or on
        the CPU kernel: the host store's smallest budget, ``stats()["cache"]["host_store_bytes"]``, is not one)."""
        return getattr(self.runtime, "requested_budget", getattr(self.runtime.cache, "budget", None))

    def set_plan(self, plan: CrispPlan) -> None:
        """Switch policy (same pack, same cache): for comparing policies on one applied model."""
        if not isinstance(plan, CrispPlan):
            raise TypeError(f"plan: expected CrispPlan, got {type(plan).__name__}")
        if not self.active:
            raise RuntimeError("set_plan: CRISP is not applied (this handle was restored): the plan would change "
                               "nothing; apply the pack again (crisp_runtime.apply) to run it with a plan")
        self.runtime.set_plan(plan)

    def stats(self) -> dict:
        """What CRISP did since ``apply`` (or :meth:`reset_stats`), as a JSON-friendly dict.

        The keys a user reads first: ``tokens`` (real tokens through the MoE layers, padding excluded),
        ``bytes_h2d`` / ``bytes_h2d_per_token`` (expert bytes copied host-to-device into the GPU cache: the cost
        CRISP cuts), ``bytes_read_per_token`` (what an offload without a cache would copy), ``hit_rate`` (expert
        lookups served without a copy), ``hits`` / ``misses`` / ``widenings`` / ``evictions``, and
        ``served_width_mean`` (mean served width per role, dominant and auxiliary). Residency-aware serving adds
        ``fallbacks`` (slots served narrower than the plan), ``served_wider`` and ``serving_skips``; prefetch adds
        ``prefetches``, ``prefetch_bytes``, ``prefetch_hits`` and ``prefetch_cut``; CPU placements add
        ``cpu_runs`` and ``cpu_splits``. ``layers`` holds the same counters per MoE layer; ``cache`` the budget,
        bytes in use and peak; ``cpu`` what ``apply(cpu=...)`` decided and why; ``serving`` the configuration that
        runs (serving policy, prefetch, eviction, placement), where it came from (the pack's stored choice for the
        budget, the default rule, ``"paper"`` or explicit arguments) and why. Every counter is defined in
        :mod:`crisp_runtime.execution.stats`.
        """
        out = self.runtime.stats.as_dict()
        cache = self.runtime.cache
        internal = getattr(cache, "budget", None)
        out["cache"] = {"budget_bytes": self.gpu_budget, "used_bytes": cache.used,
                        "peak_bytes": cache.peak, "policy": self.plan.policy.value}
        if internal != self.gpu_budget:  # no budget given, experts on the CPU kernel: the host store's own minimum
            out["cache"]["host_store_bytes"] = internal
        out["cpu"] = self.runtime.cpu_stats()  # apply(cpu=...)'s decision, and how the CPU's experts run
        out["serving"] = serving_stats(self.runtime)
        out["dense"] = {"weights": self.runtime.config.dense.value,
                        **({} if self.dense is None else self.dense.info())}
        return out

    def reset_stats(self) -> None:
        """Set every counter of ``stats()`` back to zero (the cache keeps what it holds)."""
        self.runtime.stats.reset()

    @abc.abstractmethod
    def restore(self) -> None:
        """Bring back the original expert weights and forward (idempotent)."""

    def __enter__(self) -> CrispHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(layers={list(self.runtime.layer_ids)}, policy={self.plan.policy.value}, "
                f"budget={self.gpu_budget}, active={self.active})")


def serving_stats(runtime: CrispRuntime) -> dict:
    """``stats()["serving"]``: the configuration that runs, where it came from and why
    (``crisp_runtime.planning.defaults.ServingChoice``), with the serving policy, prefetch and eviction after the CPU
    decision."""
    choice = runtime.serving_choice
    out = {} if choice is None else choice.to_dict()
    cfg = runtime.config
    out["running"] = {"serving": cfg.serving.name, "placement": cfg.serving.placement.value,
                      "prefetch": None if cfg.prefetch is None else cfg.prefetch.to_dict(),
                      "eviction": cfg.eviction if isinstance(cfg.eviction, str) else
                      getattr(cfg.eviction, "name", type(cfg.eviction).__name__)}
    return out
