"""The native CPU expert kernel's build and call (crisp_kernels.cpu_native); its arithmetic against the
float64 reference is in tests/test_cpu_expert.py (every shape, width, row range and poison test runs
it, held to the fp32 tolerance 1e-5).

Here: the build is cached by name and never overwrites a file it did not make, a failed or impossible
build says why and leaves nothing behind, the portable C and AVX2 paths (built without AVX2 or
AVX-512) equal the reference, the native build uses the widest vectors the CPU has, results do not
depend on timing (bitwise equal for a thread count, within fp32 rounding across thread counts), and the
token limit is enforced."""

from __future__ import annotations

import os

import pytest
import torch
from test_cpu_expert import FP32_TOL, SHAPES, expert, inputs

from crisp_kernels import cpu_native
from crisp_kernels.cpu_expert import CpuExpertConfig, CpuImpl, expert_mlp_cpu_accumulate_, reference_check
from crisp_kernels.expert_mlp import expert_mlp_ref

NATIVE = CpuExpertConfig(impl=CpuImpl.NATIVE_FP32)


def _cpu_flags() -> set[str]:
    """The flags /proc/cpuinfo lists (empty where it has none), as the build names its library by."""
    return set(cpu_native._cpu_flags().partition(":")[2].split())


def test_the_native_build_uses_the_widest_vectors_this_cpu_has():
    flags = _cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags to compare with")
    expected = 512 if "avx512f" in flags and "fma" in flags else 256 if {"avx2", "fma"} <= flags else 0
    assert cpu_native.load().vector_bits == expected


def call(kernel, packed, x, widths, start, stop, weights, threads):
    out = torch.zeros(x.shape)
    kt = None if widths is None else widths.clamp(0, stop).to(torch.int64)
    kernel.rows_f32(x, packed.qweight, packed.scales, packed.zeros, packed.fmt.group_size, kt, start, stop, weights,
                    out, threads)
    return out


def test_build_is_cached_by_name_and_leaves_other_files_alone(tmp_path):
    mine = tmp_path / "notes.txt"
    mine.write_text("the user's")
    first = cpu_native.build(tmp_path)
    assert first.parent == tmp_path and first.name.startswith("crisp_cpu_expert-") and first.suffix == ".so"
    stamp = first.stat().st_mtime_ns
    assert cpu_native.build(tmp_path) == first and first.stat().st_mtime_ns == stamp  # not rebuilt
    other = cpu_native.build(tmp_path, flags=(*cpu_native.FLAGS, "-DCRISP_TEST_FLAG"))
    assert other != first  # other flags, another name: nothing overwritten
    assert mine.read_text() == "the user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["notes.txt", first.name, other.name])


def test_a_failed_build_says_why_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "false")  # a compiler that runs and fails
    with pytest.raises(cpu_native.NativeUnavailable, match="building the native CPU kernel failed"):
        cpu_native.build(tmp_path)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(cpu_native.NativeUnavailable, match="does not run"):
        cpu_native.build(tmp_path)


def test_an_unwritable_cache_folder_is_refused(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("the user's")
    with pytest.raises(cpu_native.NativeUnavailable, match="CRISP_CACHE_DIR"):
        cpu_native.build(blocker / "cache")  # a folder under a file cannot be made, even by root
    assert blocker.read_text() == "the user's"


def test_a_corrupt_library_is_refused_not_loaded_blindly(tmp_path):
    """A damaged file where a build should be (we write atomically, so only someone else makes one) is
    refused with its path: the callers fall back to torch's kernels and say why."""
    bad = tmp_path / "crisp_cpu_expert-0123.so"
    bad.write_bytes(b"\x7fELF not really")
    with pytest.raises(cpu_native.NativeUnavailable, match="crisp_cpu_expert-0123.so"):
        cpu_native.open_library(bad)
    assert bad.read_bytes() == b"\x7fELF not really"  # left as it was


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("CRISP_CACHE_DIR", str(tmp_path / "c"))
    assert cpu_native.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("CRISP_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cpu_native.cache_dir() == tmp_path / "x" / "crisp"


# The paths a host's -march=native does not take, built on purpose: the element-by-element C (a CPU without
# AVX2/FMA) and the 256-bit one (AVX2 without AVX-512; on an AVX2 host this is the native build again).
NARROWER_BUILDS = {"portable": ("-mno-avx512f", "-mno-avx2", "-mno-fma"), "avx2": ("-mno-avx512f",)}
NARROWER_BITS = {"portable": 0, "avx2": 256}


# each narrower build once per session, into the first asking test's tmp_path (kept for the session): 20 tests ask,
# and a build takes 1.3-3.5 s on the 2-core VM
_NARROWER_KERNELS: dict = {}


def narrower_kernel(tmp_path, build: str):
    """The kernel built for ``build`` (a NARROWER_BUILDS key), into tmp_path the first time in a session; skips
    where this host cannot run it."""
    if os.uname().machine not in ("x86_64", "AMD64"):
        pytest.skip("-mno-avx2 / -mno-avx512f are x86 flags")
    if build == "avx2" and not {"avx2", "fma"} <= _cpu_flags():
        pytest.skip("this CPU has no AVX2 / FMA")
    if build not in _NARROWER_KERNELS:
        flags = (*cpu_native.FLAGS, *NARROWER_BUILDS[build])
        _NARROWER_KERNELS[build] = cpu_native.open_library(cpu_native.build(tmp_path, flags=flags))
    kernel = _NARROWER_KERNELS[build]
    assert kernel.vector_bits == NARROWER_BITS[build]  # the path it was built for, not the native one
    return kernel


@pytest.mark.parametrize("build", sorted(NARROWER_BUILDS))
@pytest.mark.parametrize("shape", SHAPES)
def test_narrower_builds_equal_the_reference(tmp_path, shape, build):
    """What a CPU with fewer vector instructions runs, against the float64 reference."""
    kernel = narrower_kernel(tmp_path, build)
    packed = expert(*shape)
    for tokens in (1, 5, 6, 11):
        x, weights, widths = inputs(tokens, shape[0], torch.float32, shape[1], per_token=True)
        for start, stop in ((0, shape[1]), (0, 33), (7, shape[1] - 1)):
            got = call(kernel, packed, x, widths, start, stop, weights, 2)
            k = widths.clamp(0, stop)
            ref = expert_mlp_ref(x, packed, stop, token_widths=k, compute_dtype=torch.float64)
            if start:
                ref -= expert_mlp_ref(x, packed, start, token_widths=k, compute_dtype=torch.float64)
            ref *= weights.double().unsqueeze(1)
            assert ((got.double() - ref).norm() / ref.norm()).item() <= FP32_TOL


def test_threads_split_neurons_deterministically():
    kernel = cpu_native.load()
    shape = (256, 1100, 64, False)
    packed = expert(*shape)
    x, weights, widths = inputs(3, shape[0], torch.float32, shape[1], per_token=True)
    one = call(kernel, packed, x, widths, 0, shape[1], weights, 1)
    for threads in (2, 3, 7, 5000):  # more threads than neurons: one neuron each at most
        got = call(kernel, packed, x, widths, 0, shape[1], weights, threads)
        assert torch.equal(got, call(kernel, packed, x, widths, 0, shape[1], weights, threads))  # same split
        assert ((got - one).norm() / one.norm()).item() <= FP32_TOL  # another summation order only


def test_token_limit_and_auto_fallback():
    shape = SHAPES[0]
    packed = expert(*shape)
    x, weights, _ = inputs(cpu_native.MAX_TOKENS + 1, shape[0], torch.float32, shape[1], per_token=False)
    out = torch.zeros(x.shape)
    with pytest.raises(ValueError, match="at most"):
        expert_mlp_cpu_accumulate_(x, packed, None, shape[1], weights, out, config=NATIVE)
    assert torch.count_nonzero(out) == 0
    # the default takes the torch path past the limit, still equal to the reference
    assert reference_check(x, packed, None, shape[1], weights) <= FP32_TOL


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads the process's mapped libraries (Linux)")
def test_the_kernel_runs_on_torchs_openmp_runtime():
    """One libgomp in the process, torch's: the kernel's threads are torch's intra-op threads (a second
    OpenMP runtime, or threads of its own, would compete with torch's spinning ones for the cores)."""
    cpu_native.load()
    with open("/proc/self/maps") as maps:
        gomp = {line.split()[-1] for line in maps if "libgomp" in line}
    if not gomp:
        pytest.skip("this torch build does not use libgomp")
    assert len(gomp) == 1 and os.path.dirname(torch.__file__) in next(iter(gomp))


@pytest.mark.parametrize("bad", ["x fp64", "x strided", "out shape", "weights int", "qweight rows < stop",
                                 "scales fp32", "group 48", "token_widths int32", "start > stop"])
def test_a_bad_direct_call_raises_before_the_c_code_runs(bad):
    shape = SHAPES[0]
    packed = expert(*shape)
    x, weights, widths = inputs(2, shape[0], torch.float32, shape[1], per_token=True)
    args = dict(x=x, qweight=packed.qweight, scales=packed.scales, zeros=packed.zeros, group=packed.fmt.group_size,
                token_widths=widths.to(torch.int64), row_start=0, row_stop=shape[1], weights=weights,
                out=torch.zeros(x.shape), threads=2)
    edits = {"x fp64": dict(x=x.double()), "x strided": dict(x=torch.randn(shape[0], 2).t()),
             "out shape": dict(out=torch.zeros(3, shape[0])),
             "weights int": dict(weights=torch.ones(2, dtype=torch.int32)),
             "qweight rows < stop": dict(row_stop=shape[1] + 1), "scales fp32": dict(scales=packed.scales.float()),
             "group 48": dict(group=48), "token_widths int32": dict(token_widths=widths.to(torch.int32)),
             "start > stop": dict(row_start=5, row_stop=4)}
    before = args["out"].clone()
    with pytest.raises(ValueError):
        cpu_native.load().rows_f32(**{**args, **edits[bad]})
    assert torch.equal(args["out"], before)



@pytest.mark.parametrize("tokens", [*range(1, 18), 63, 64])
def test_every_token_tile_remainder_equals_the_reference(tokens):
    """T = 1..17, 63 and 64 (the limit): one token (gate_up_1), and gate/up tiles of 8 tokens (AVX-512) or
    4 (AVX2) through the multi-token pass (gate_up_nt) with every remainder, each followed by down passes of
    4 / 2 tokens with their remainders, per-token widths included (the AVX2 and portable builds:
    test_narrower_builds_...)."""
    shape = (256, 200, 64, False)
    packed = expert(*shape)
    x, weights, widths = inputs(tokens, shape[0], torch.float32, shape[1], per_token=True)
    assert reference_check(x, packed, widths, shape[1], weights, NATIVE) <= FP32_TOL
    assert reference_check(x, packed, None, 131, weights, NATIVE) <= FP32_TOL
