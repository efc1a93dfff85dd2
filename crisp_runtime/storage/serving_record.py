"""The serving configurations a throughput search stored in a pack (pack.json's optional ``serving`` field).

``crisp-profile --plan-for-throughput`` / ``--gpu-budget`` (``crisp_tools.profiler.throughput``) chooses, at a GPU
budget on one hardware profile, the serving policy, prefetch and eviction with the most simulated tokens/s whose
accuracy loss (runtime in the loop, held-out calibration text) stays within a bound. A pack stores one such choice
per budget (version 2)::

    "serving": {"version": 2,
                "choices": [                   one per budget, distinct budgets (any order on disk)
                    {"policy": {...},            crisp_runtime.planning.serving.ServingPolicy.to_dict()
                     "prefetch": {...} | null,   crisp_runtime.scheduling.prefetch.PrefetchPolicy.to_dict() (null: none)
                     "eviction": "next_use",     crisp_runtime.residency.eviction.POLICIES
                     "gpu_budget_fraction": 0.25 of the pack's expert bytes at full width, in (0, 1]
                     "search": {...}},           how it was chosen (profile, figures, candidates): free-form
                    ...]}

Version 1, a single choice (``{"version": 1, "policy": ..., "prefetch": ..., "eviction": ...,
"gpu_budget_fraction": ..., "search": ...}``), is still read: as a list of one choice.

The field is optional (packs without it load as before) and parsed strictly when present
(:func:`serving_choices`; a :class:`~crisp_kernels.PackFormatError` names the bad field). ``apply`` and
``load_model`` run the stored choice for their budget when given no serving and no config
(``crisp_runtime.planning.defaults``: the rule for budgets between stored ones); explicitly::

    choices = serving_choices(pack.info)      # None: the pack stores none
    record = choices.for_fraction(0.25)       # the largest stored budget <= 25% (None: below every one)
    handle = apply(model, pack, gpu_budget=record.budget_bytes(pack.layers), config=record.runtime_config())
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from crisp_kernels import PackFormatError
from crisp_runtime.execution.runtime import RuntimeConfig
from crisp_runtime.planning.serving import ServingPolicy, check_policy_name
from crisp_runtime.residency.eviction import POLICIES as EVICTION_POLICIES
from crisp_runtime.scheduling.copy_window import PrefetchWindow
from crisp_runtime.scheduling.prefetch import PREFETCH_RULE, PrefetchPolicy

SERVING_KEY = "serving"
SERVING_RECORD_VERSION = 2
_V1_KEYS = ("version", "policy", "prefetch", "eviction", "gpu_budget_fraction", "search")
_CHOICE_KEYS = _V1_KEYS[1:]
_V2_KEYS = ("version", "choices")
# Two stored budgets closer than this are one budget, and a budget within it of a stored one is that budget (a
# budget fraction is bytes over bytes: float rounding, never a deliberate difference).
BUDGET_TOLERANCE = 1e-9


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
        """This choice alone, as a version 1 ``serving`` field (a pack storing one choice; still read)."""
        return {"version": 1, **self.entry()}

    def entry(self) -> dict:
        """The choice's entry of version 2's ``choices`` list."""
        return {"policy": self.policy.to_dict(),
                "prefetch": None if self.prefetch is None else self.prefetch.to_dict(), "eviction": self.eviction,
                "gpu_budget_fraction": self.gpu_budget_fraction, "search": dict(self.search)}

    def runtime_config(self, **overrides) -> RuntimeConfig:
        """The runtime configuration it stores (serving, prefetch, eviction); ``overrides`` other fields."""
        return RuntimeConfig(serving=self.policy, prefetch=self.prefetch, eviction=self.eviction, **overrides)

    def budget_bytes(self, layers: Mapping) -> int:
        """The stored budget in bytes for these packed layers (a fraction of :func:`budget_base_bytes`)."""
        return int(self.gpu_budget_fraction * budget_base_bytes(layers))


@dataclass(frozen=True)
class ServingChoices:
    """The choices a pack stores, one per budget, sorted by budget (see the module docstring)."""

    choices: tuple[ServingRecord, ...]

    def __post_init__(self) -> None:
        choices = tuple(self.choices)
        if not choices or not all(isinstance(c, ServingRecord) for c in choices):
            raise ValueError("ServingChoices: expected one or more ServingRecord")
        choices = tuple(sorted(choices, key=lambda c: c.gpu_budget_fraction))
        for a, b in zip(choices, choices[1:], strict=False):
            if b.gpu_budget_fraction - a.gpu_budget_fraction <= BUDGET_TOLERANCE:
                raise ValueError(f"ServingChoices: two choices for the budget {a.gpu_budget_fraction:g}")
        object.__setattr__(self, "choices", choices)

    @property
    def fractions(self) -> tuple[float, ...]:
        return tuple(c.gpu_budget_fraction for c in self.choices)

    def for_fraction(self, fraction: float) -> ServingRecord | None:
        """The choice for a budget of ``fraction`` of :func:`budget_base_bytes`: the one stored for the largest
        budget at or below it (a choice made for less GPU memory stays valid with more: its copies fit, and the
        extra memory only raises the hit rate), None below the smallest stored budget (a choice made for more
        memory would copy more than the budget holds; ``planning.defaults`` then applies its default rule)."""
        below = [c for c in self.choices if c.gpu_budget_fraction <= fraction + BUDGET_TOLERANCE]
        return below[-1] if below else None

    def with_choice(self, record: ServingRecord) -> ServingChoices:
        """These choices with ``record`` added (replacing the one stored for its budget)."""
        keep = [c for c in self.choices
                if abs(c.gpu_budget_fraction - record.gpu_budget_fraction) > BUDGET_TOLERANCE]
        return ServingChoices((*keep, record))

    def to_dict(self) -> dict:
        return {"version": SERVING_RECORD_VERSION, "choices": [c.entry() for c in self.choices]}


def budget_base_bytes(layers: Mapping) -> int:
    """What a GPU budget fraction is a fraction of: every expert of ``layers`` at full width in 4-bit rows. For a
    pack with a 2-bit tail (``crisp_tools.tail_pack``) that is its 4-bit source's bytes, not its own: a fraction
    means the same GPU memory on both packs (the simulator's and crisp-eval's rule, not a fraction of the tail
    pack's own, smaller, bytes)."""
    return sum(layer.num_experts * layer.num_neurons * layer.fmt.neuron_nbytes(layer.hidden_size)
               for layer in layers.values())


def serving_choices(info: Mapping, *, where: str = "pack.json") -> ServingChoices | None:
    """pack.json's ``serving`` field parsed strictly (version 2, or version 1 as one choice), or None when the pack
    stores none."""
    data = info.get(SERVING_KEY)
    if data is None:
        return None
    if not isinstance(data, Mapping):
        raise PackFormatError(f"{where}: field serving must be an object, got {type(data).__name__}")
    version = data.get("version")
    if type(version) is not int or version not in (1, SERVING_RECORD_VERSION):
        raise PackFormatError(f"{where}: field serving.version is {version!r}; this CRISP reads 1 and "
                              f"{SERVING_RECORD_VERSION}")
    if version == 1:
        return ServingChoices((_choice(data, _V1_KEYS, where, "serving"),))
    _check_keys(data, _V2_KEYS, where, "serving")
    entries = data["choices"]
    if not isinstance(entries, list) or not entries:
        raise PackFormatError(f"{where}: field serving.choices must be a non-empty list")
    choices = tuple(_choice(e, _CHOICE_KEYS, where, f"serving.choices[{i}]") for i, e in enumerate(entries))
    try:
        return ServingChoices(choices)
    except ValueError as exc:
        raise PackFormatError(f"{where}: field serving.choices: {exc}") from None


def serving_record(info: Mapping, *, where: str = "pack.json", budget_fraction: float | None = None
                   ) -> ServingRecord | None:
    """The stored choice for ``budget_fraction`` (:meth:`ServingChoices.for_fraction`), or, without one, the
    pack's only stored choice; None when the pack stores none (or none for that budget). A pack storing several
    choices and no ``budget_fraction`` given: PackFormatError naming the stored budgets."""
    choices = serving_choices(info, where=where)
    if choices is None:
        return None
    if budget_fraction is not None:
        return choices.for_fraction(budget_fraction)
    if len(choices.choices) > 1:
        raise PackFormatError(f"{where}: stores serving choices for the budgets "
                              f"{', '.join(f'{f:g}' for f in choices.fractions)}: say which budget")
    return choices.choices[0]


def _check_keys(data: Mapping, keys: tuple[str, ...], where: str, field_name: str) -> None:
    unknown = sorted(set(data) - set(keys))
    missing = [k for k in keys if k not in data]
    if unknown or missing:
        raise PackFormatError(f"{where}: field {field_name} has unknown keys {unknown} / lacks {missing}; expected "
                              f"{', '.join(keys)}")


def _window(data, field_name: str) -> PrefetchWindow | None:
    """A stored prefetch's ``window`` (``PrefetchWindow.to_dict``), strictly; None stays None."""
    if data is None:
        return None
    names = {f.name for f in fields(PrefetchWindow)}
    if not isinstance(data, Mapping) or set(data) - names:
        raise ValueError(f"{field_name}.prefetch.window must be null or a PrefetchWindow object (keys "
                         f"{', '.join(sorted(names))}), got {data!r}")
    return PrefetchWindow(**data)


def _choice(data, keys: tuple[str, ...], where: str, field_name: str) -> ServingRecord:
    """One stored choice (a version 1 field, or an entry of version 2's list), strictly."""
    if not isinstance(data, Mapping):
        raise PackFormatError(f"{where}: field {field_name} must be an object, got {type(data).__name__}")
    _check_keys(data, keys, where, field_name)
    if not isinstance(data["policy"], Mapping) or not isinstance(data["search"], Mapping):
        raise PackFormatError(f"{where}: fields {field_name}.policy and {field_name}.search must be objects")
    prefetch = data["prefetch"]
    try:
        policy = check_policy_name(ServingPolicy.from_dict(data["policy"]))
        if prefetch is not None:
            if not isinstance(prefetch, Mapping) or set(prefetch) - {"rule", "extra_experts", "width", "window"}:
                raise ValueError(f"{field_name}.prefetch must be null or a PrefetchPolicy object, got {prefetch!r}")
            if prefetch.get("rule", PREFETCH_RULE) != PREFETCH_RULE:
                raise ValueError(f"{field_name}.prefetch.rule is {prefetch['rule']!r}; this CRISP prefetches by "
                                 f"one rule, {PREFETCH_RULE!r}")
            prefetch = PrefetchPolicy(extra_experts=prefetch.get("extra_experts", 0),
                                      width=prefetch.get("width", "plan"), window=_window(prefetch.get("window"),
                                                                                          field_name))
        return ServingRecord(policy, prefetch, data["eviction"], data["gpu_budget_fraction"], data["search"])
    except (TypeError, ValueError) as exc:
        raise PackFormatError(f"{where}: field {field_name}: {exc}") from None
