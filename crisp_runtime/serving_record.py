"""The serving configuration a throughput search stored in a pack (pack.json's optional ``serving`` field).

``crisp-profile --plan-for-throughput`` (``crisp_tools.profiler.throughput``) chooses, at one GPU budget on
one hardware profile, the serving policy, prefetch and eviction with the most simulated tokens/s whose
accuracy loss (runtime in the loop, held-out calibration text) stays within a bound, and stores it as::

    "serving": {"version": 1,
                "policy": {...},            crisp_runtime.serving.ServingPolicy.to_dict()
                "prefetch": {...} | null,   crisp_runtime.prefetch.PrefetchPolicy.to_dict() (null: none)
                "eviction": "next_use",     crisp_runtime.eviction.POLICIES
                "gpu_budget_fraction": 0.25 of the pack's expert bytes at full width, in (0, 1]
                "search": {...}}            how it was chosen (profile, figures, candidates): free-form

The field is optional (packs without it load as before) and parsed strictly when present
(:func:`serving_record`; a :class:`~crisp_kernels.PackFormatError` names the bad field). A user asks for
it explicitly, it is never applied behind their back::

    record = serving_record(pack.info)        # None: the pack stores none
    handle = apply(model, pack, gpu_budget=record.budget_bytes(pack.layers), config=record.runtime_config())
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from crisp_kernels import PackFormatError

from .eviction import POLICIES as EVICTION_POLICIES
from .prefetch import PrefetchPolicy
from .runtime import RuntimeConfig
from .serving import ServingPolicy

SERVING_KEY = "serving"
SERVING_RECORD_VERSION = 1
_KEYS = ("version", "policy", "prefetch", "eviction", "gpu_budget_fraction", "search")


@dataclass(frozen=True)
class ServingRecord:
    """A stored serving choice (see the module docstring)."""

    policy: ServingPolicy
    prefetch: PrefetchPolicy | None
    eviction: str
    gpu_budget_fraction: float
    search: Mapping = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.policy, ServingPolicy):
            raise TypeError(f"ServingRecord: policy must be a ServingPolicy, got {type(self.policy).__name__}")
        if self.prefetch is not None and not isinstance(self.prefetch, PrefetchPolicy):
            raise TypeError(f"ServingRecord: prefetch must be a PrefetchPolicy or None, got "
                            f"{type(self.prefetch).__name__}")
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(f"ServingRecord: eviction must be one of {', '.join(EVICTION_POLICIES)}, "
                             f"got {self.eviction!r}")
        b = self.gpu_budget_fraction
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0.0 < b <= 1.0:
            raise ValueError(f"ServingRecord: gpu_budget_fraction must be a fraction in (0, 1], got {b!r}")

    def to_dict(self) -> dict:
        return {"version": SERVING_RECORD_VERSION, "policy": self.policy.to_dict(),
                "prefetch": None if self.prefetch is None else self.prefetch.to_dict(), "eviction": self.eviction,
                "gpu_budget_fraction": self.gpu_budget_fraction, "search": dict(self.search)}

    def runtime_config(self, **overrides) -> RuntimeConfig:
        """The runtime configuration it stores (serving, prefetch, eviction); ``overrides`` other fields."""
        return RuntimeConfig(serving=self.policy, prefetch=self.prefetch, eviction=self.eviction, **overrides)

    def budget_bytes(self, layers: Mapping) -> int:
        """The stored budget in bytes for these packed layers (a fraction of :func:`budget_base_bytes`)."""
        return int(self.gpu_budget_fraction * budget_base_bytes(layers))


def budget_base_bytes(layers: Mapping) -> int:
    """What a GPU budget fraction is a fraction of: every expert of ``layers`` at full width in 4-bit rows. For a
    pack with a 2-bit tail (``crisp_tools.tail_pack``) that is its 4-bit source's bytes, not its own: a fraction
    means the same GPU memory on both packs (the simulator's and crisp-eval's rule, not a fraction of the tail
    pack's own, smaller, bytes)."""
    return sum(layer.num_experts * layer.num_neurons * layer.fmt.neuron_nbytes(layer.hidden_size)
               for layer in layers.values())


def serving_record(info: Mapping, *, where: str = "pack.json") -> ServingRecord | None:
    """pack.json's ``serving`` field parsed strictly, or None when the pack stores none."""
    data = info.get(SERVING_KEY)
    if data is None:
        return None
    if not isinstance(data, Mapping):
        raise PackFormatError(f"{where}: field serving must be an object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_KEYS))
    missing = [k for k in _KEYS if k not in data]
    if unknown or missing:
        raise PackFormatError(f"{where}: field serving has unknown keys {unknown} / lacks {missing}; expected "
                              f"{', '.join(_KEYS)}")
    if type(data["version"]) is not int or data["version"] != SERVING_RECORD_VERSION:
        raise PackFormatError(f"{where}: field serving.version is {data['version']!r}; this CRISP reads "
                              f"{SERVING_RECORD_VERSION}")
    if not isinstance(data["policy"], Mapping) or not isinstance(data["search"], Mapping):
        raise PackFormatError(f"{where}: fields serving.policy and serving.search must be objects")
    prefetch = data["prefetch"]
    try:
        policy = ServingPolicy.from_dict(data["policy"])
        if prefetch is not None:
            if not isinstance(prefetch, Mapping) or set(prefetch) - {"rule", "extra_experts", "width"}:
                raise ValueError(f"serving.prefetch must be null or a PrefetchPolicy object, got {prefetch!r}")
            prefetch = PrefetchPolicy(extra_experts=prefetch.get("extra_experts", 0),
                                      width=prefetch.get("width", "plan"))
        return ServingRecord(policy, prefetch, data["eviction"], data["gpu_budget_fraction"], data["search"])
    except (TypeError, ValueError) as exc:
        raise PackFormatError(f"{where}: field serving: {exc}") from None
