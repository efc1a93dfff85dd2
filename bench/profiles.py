"""Hardware profiles for the decoding simulator (the model shapes it maps traces onto: ``shapes``).

A profile says how long the machine takes to move and to compute expert bytes, in a form
that carries over between model shapes (bytes, not "one expert"):

    load(bytes)    = copy_latency_s + bytes / h2d_bytes_per_s          (0 when nothing is copied)
    compute(bytes) = compute_latency_s + bytes / compute_bytes_per_s   (bytes of the prefix read)

plus fixed per-MoE-layer times for the router and for the rest of the layer (attention,
norms, glue), which run on the compute engine before the experts are known.

Built-in ``rtx4090-pcie4`` (the CRISP paper: RTX 4090, PCIe 4.0, Mixtral-8x7B at 4 bits)
---------------------------------------------------------------------------------------
The paper gives two kinds of figures that do not add up to each other:

* per expert (isolated): full width loads in 7.5 ms and computes in 0.8 ms; at 50% width
  3.8 ms and 0.4 ms;
* per MoE layer (in a run): 14.4 ms = 11.2 ms loading "the two routed experts" + 2.6 ms
  computing + 0.4 ms router (the three parts add up exactly: the measured layer is serial).

Two full-width loads would take 15.0 ms and two computes 1.6 ms. So the layer figure cannot
be "two uncached experts" under the per-expert figures: 11.2 ms of loading is 1.49 full
loads (about a quarter of the routed experts were cache hits), and 2.6 ms of compute holds
1.0 ms beyond the two experts' 1.6 ms (attention, norms, dequantisation glue or launch
overheads: the paper does not say).

This profile takes the per-expert figures as the ground truth and explains the layer figure
with cache hits and a fixed overhead:

* load: an affine fit through (100%, 7.5 ms) and (50%, 3.8 ms): 0.1 ms fixed per copy plus
  7.4 ms per full expert, i.e. 13.0 GB/s for our format's 96.3 MB Mixtral expert (about half
  of what pinned PCIe 4.0 x16 copies reach; the paper's loader is what it is);
* compute: linear through (100%, 0.8 ms) and (50%, 0.4 ms): 0.8 ms per full expert, no
  fixed part (120 GB/s of prefix bytes);
* router 0.4 ms, and ``other_s`` = 2.6 - 2 x 0.8 = 1.0 ms of non-expert work per MoE layer
  that does not shrink with width (a conservative reading: CRISP cannot shorten it).

With these numbers a serial full-width layer at a ~25% hit rate takes 1.0 + 0.4 + 1.5 x 7.5 +
1.6 = 14.25 ms, the paper's 14.4 ms. ``crisp-bench simulate`` prints the breakdown it
reproduces beside the paper's.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from crisp_runtime.scheduling.copy_window import ExpertTiming

from .common import CliError
from .shapes import MIXTRAL_8X7B

PROFILE_FORMAT = "crisp-bench-profile"
PROFILE_VERSION = 1
MEASURED_PROFILE_FILE = "crisp-bench-profile.json"


class ProfileError(CliError):
    """A profile that is unknown or malformed."""


def _finite_number(v) -> bool:
    """A JSON number that is finite (true / false are not numbers here, though Python's bool is an int)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class HardwareProfile(ExpertTiming):
    """Timing model of one machine (see the module docstring)."""

    name: str
    h2d_bytes_per_s: float
    copy_latency_s: float
    compute_bytes_per_s: float
    compute_latency_s: float
    router_s: float
    other_s: float
    description: str = ""
    source: str = ""
    # The host CPU (hybrid placement; None = a profile without a CPU, GPU-only configurations):
    # prefix bytes per second its expert kernel streams at batch 1, a fixed time per expert, the H2D
    # rate while it streams host memory, and the join of its (T, H) partial output into the GPU's.
    cpu_bytes_per_s: float | None = None
    cpu_latency_s: float = 0.0
    h2d_bytes_per_s_cpu_busy: float | None = None
    join_s: float = 0.0

    def __post_init__(self) -> None:
        nullable = ("cpu_bytes_per_s", "h2d_bytes_per_s_cpu_busy")  # no CPU measured: null
        for f in (*nullable, "h2d_bytes_per_s", "compute_bytes_per_s"):
            v = getattr(self, f)
            if (v is not None or f not in nullable) and not (_finite_number(v) and v > 0):
                raise ProfileError(f"profile {self.name!r}: {f} must be a positive number"
                                   f"{' or null' if f in nullable else ''}, got {v!r}")
        for f in ("cpu_latency_s", "join_s", "copy_latency_s", "compute_latency_s", "router_s", "other_s"):
            v = getattr(self, f)
            if not (_finite_number(v) and v >= 0):
                raise ProfileError(f"profile {self.name!r}: {f} must be a non-negative number, got {v!r}")

    def cost_model(self):
        """The runtime scheduler's cost model with this profile's bandwidths (its split decisions)."""
        from crisp_runtime.scheduling.scheduler import CostModel

        return CostModel(h2d_bytes_per_s=self.h2d_bytes_per_s, device_bytes_per_s=self.compute_bytes_per_s,
                         cpu_bytes_per_s=self.cpu_bytes_per_s, cpu_latency_s=self.cpu_latency_s,
                         h2d_bytes_per_s_cpu_busy=self.h2d_bytes_per_s_cpu_busy, join_s=self.join_s)

    def prefetch_window(self, row_nbytes: int, name: str = ""):
        """This machine's timing as ``scheduling.copy_window.PrefetchWindow`` for neuron rows of ``row_nbytes``
        bytes (lead = other + router; the CPU's timing for steps under a CPU placement): the modeled clock that
        cuts prefetches in the simulator and, through ``PrefetchPolicy.window``, in the runtime
        (``bench.simulate.target_window`` maps a model onto a target)."""
        from crisp_runtime.scheduling.copy_window import PrefetchWindow

        return PrefetchWindow(row_nbytes=int(row_nbytes), h2d_bytes_per_s=self.h2d_bytes_per_s,
                              copy_latency_s=self.copy_latency_s, compute_bytes_per_s=self.compute_bytes_per_s,
                              compute_latency_s=self.compute_latency_s, lead_s=self.other_s + self.router_s,
                              name=name or self.name, cpu_bytes_per_s=self.cpu_bytes_per_s,
                              cpu_latency_s=self.cpu_latency_s, h2d_bytes_per_s_cpu_busy=self.h2d_bytes_per_s_cpu_busy,
                              join_s=self.join_s)

    def with_cpu(self, cpu_bytes_per_s: float) -> HardwareProfile:
        """The same machine with a CPU of another bandwidth (for sweeps)."""
        from dataclasses import replace

        return replace(self, name=f"{self.name}@cpu{cpu_bytes_per_s / 1e9:g}GBps", cpu_bytes_per_s=cpu_bytes_per_s)

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict:
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, data) -> HardwareProfile:
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            got = data.get("format") if isinstance(data, dict) else None
            raise ProfileError(f"not a crisp-bench profile (format {got!r})")
        if data.get("version") != PROFILE_VERSION:
            raise ProfileError(
                f"profile version {data.get('version')!r} is not supported (this reads {PROFILE_VERSION})"
            )
        names = {f.name for f in fields(cls)}
        optional = ("description", "source", "cpu_bytes_per_s", "cpu_latency_s", "h2d_bytes_per_s_cpu_busy", "join_s")
        missing = {f.name for f in fields(cls) if f.name not in optional} - set(data)
        if missing:
            raise ProfileError(f"profile is missing {sorted(missing)}")
        return cls(**{k: v for k, v in data.items() if k in names})

    def save(self, path: str | os.PathLike) -> None:
        """Write the profile as JSON, atomically."""
        from crisp_runtime.storage.outputs import write_json

        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> HardwareProfile:
        from crisp_runtime.cli_args import JsonInputError, read_json

        if not Path(path).exists():
            raise ProfileError(f"{path}: no such profile file (make one with `crisp-bench transfer --profile-out`)")
        try:
            data = read_json(path, "profile")
        except JsonInputError as exc:
            raise ProfileError(str(exc)) from exc
        try:
            return cls.from_dict(data)
        except ProfileError as exc:
            raise ProfileError(f"{path}: {exc}") from exc


def _rtx4090() -> HardwareProfile:
    expert = MIXTRAL_8X7B.expert_nbytes
    # Affine fit through the paper's (full, 7.5 ms) and (half, 3.8 ms) loads.
    full_load, half_load = 7.5e-3, 3.8e-3
    per_expert = 2 * (full_load - half_load)  # 7.4 ms
    latency = full_load - per_expert  # 0.1 ms
    return HardwareProfile(
        name="rtx4090-pcie4",
        h2d_bytes_per_s=expert / per_expert,
        copy_latency_s=latency,
        compute_bytes_per_s=expert / 0.8e-3,
        compute_latency_s=0.0,
        router_s=0.4e-3,
        other_s=2.6e-3 - 2 * 0.8e-3,
        description="CRISP paper, RTX 4090 + PCIe 4.0, Mixtral-8x7B 4-bit: expert 7.5/0.8 ms load/compute at "
        "full width, 3.8/0.4 ms at 50%; router 0.4 ms; 1.0 ms other compute per layer",
        source="paper",
    )


# The desktop host of the hybrid profiles. Figures and where they come from (/work/shared/ANCHORS.md):
# - H2D 25 GB/s: pinned copies measured by others on an RTX 4090 over PCIe 4.0 x16 (the paper's loader
#   reached 13 GB/s, profile rtx4090-pcie4); ~15 GB/s while the CPU streams host memory at the same time
#   (reported for a 4090 desktop);
# - CPU 50 GB/s of 4-bit prefix bytes at batch 1: the middle of the 30-72 GB/s CPU GEMV range FreeToken
#   reports for desktop DDR5 hosts (dual-channel DDR5-6000 peaks at 96 GB/s); the simulator sweeps 30-72;
# - assumed (no measurement on a desktop): 20 us per copy and 50 us per CPU expert call (thread-pool wake-up
#   and dispatch), 20 us to join the (T, H) partial output (a 16 KB copy and an add). Measured on a 2-core Zen 4
#   VM (docs/hybrid.md, 2026-12-02): 42-45 us per call through the runtime's path, and 20-260 us per step for the
#   worker's handoff, which these figures leave out (with them the 25% headline simulates 2.95x LRU, not 3.02x);
# - GPU compute, router and other per-layer work: the paper's RTX 4090 figures (profile rtx4090-pcie4).
DESKTOP_CPU_BYTES_PER_S = 50e9


def _desktop(name: str, h2d: float, h2d_busy: float, description: str) -> HardwareProfile:
    base = _rtx4090()
    return HardwareProfile(
        name=name, h2d_bytes_per_s=h2d, copy_latency_s=20e-6, compute_bytes_per_s=base.compute_bytes_per_s,
        compute_latency_s=base.compute_latency_s, router_s=base.router_s, other_s=base.other_s,
        description=description, source="ANCHORS (bandwidths) + paper (GPU compute, router, other)",
        cpu_bytes_per_s=DESKTOP_CPU_BYTES_PER_S, cpu_latency_s=50e-6, h2d_bytes_per_s_cpu_busy=h2d_busy,
        join_s=20e-6)


def _rtx4090_ddr5() -> HardwareProfile:
    return _desktop("rtx4090-pcie4-ddr5", 25e9, 15e9,
                    "RTX 4090 + PCIe 4.0 (25 GB/s, 15 GB/s while the CPU streams) + desktop DDR5 host (CPU 50 GB/s "
                    "of 4-bit prefix bytes); GPU compute, router, other from the CRISP paper")


def _rtx4090_pcie5_ddr5() -> HardwareProfile:
    # Hypothetical: the same GPU on a PCIe 5.0 link, whose 50 GB/s equals the CPU's; the busy rate keeps the
    # PCIe 4.0 host's ratio (15/25).
    return _desktop("rtx4090-pcie5-ddr5", 50e9, 30e9,
                    "the rtx4090-pcie4-ddr5 host with a PCIe 5.0 link: H2D 50 GB/s (30 while the CPU streams), equal "
                    "to the CPU's 50 GB/s (hypothetical: where hybrid placement should gain least)")


BUILTIN_PROFILES = {"rtx4090-pcie4": _rtx4090, "rtx4090-pcie4-ddr5": _rtx4090_ddr5,
                    "rtx4090-pcie5-ddr5": _rtx4090_pcie5_ddr5}
# Paper's measured MoE layer, for comparison in reports.
PAPER_LAYER_MS = {"total": 14.4, "load": 11.2, "compute": 2.6, "router": 0.4}


def profiles_with_cpu() -> list[str]:
    """The built-in profiles that have a CPU (``cpu_bytes_per_s``: what the CPU placements are simulated with)."""
    return [name for name, make in BUILTIN_PROFILES.items() if make().has_cpu]


def get_profile(name: str, profile_file: str | os.PathLike | None = None) -> HardwareProfile:
    """A built-in profile by name, ``measured`` (from ``profile_file``), or a path to a profile JSON."""
    if name in BUILTIN_PROFILES:
        return BUILTIN_PROFILES[name]()
    if name == "measured":
        return HardwareProfile.load(profile_file or MEASURED_PROFILE_FILE)
    if name.endswith(".json"):
        return HardwareProfile.load(name)
    known = ", ".join([*BUILTIN_PROFILES, "measured", "PATH.json"])
    raise ProfileError(f"--profile: unknown profile {name!r}; choose one of: {known}")


def fit_affine(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of y = a + b x minimising the *relative* squared error sum ((a + b x - y) / y)^2.

    Relative, so that points spanning orders of magnitude (a 50 kB and a 96 MB expert) all count:
    the small ones fix the fixed latency, the large ones the bandwidth. Intercept clamped at >= 0.
    """
    pts = [(float(x), float(y)) for x, y in points if y > 0]
    if not pts:
        raise ValueError("fit_affine: no positive measurements")
    if len(pts) < 2 or len({x for x, _ in pts}) < 2:
        return 0.0, sum(y for _, y in pts) / sum(x for x, _ in pts)
    # Weighted least squares with weights 1 / y^2.
    w = [1.0 / (y * y) for _, y in pts]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, pts, strict=True))
    sy = sum(wi * y for wi, (_, y) in zip(w, pts, strict=True))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, pts, strict=True))
    sxy = sum(wi * x * y for wi, (x, y) in zip(w, pts, strict=True))
    det = sw * sxx - sx * sx
    slope = (sw * sxy - sx * sy) / det
    intercept = (sy - slope * sx) / sw
    if intercept < 0 or slope <= 0:
        # Proportional fit through the origin, still in relative error: b = sum(w x y) / sum(w x^2).
        return 0.0, sxy / sxx
    return intercept, slope
