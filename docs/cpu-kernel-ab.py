"""Same-round A/B of the native CPU kernel's builds (docs/cpu-kernel.md, sessions 6 and 7).

Builds the kernel source of earlier commits and the working tree's source, into a temporary folder, and
times one Mixtral-sized expert (H 4096, I 14336, g 64) per build, 6 experts in rotation so that nothing
stays in the 32 MiB L3, best of --rounds interleaved rounds (every build once per round, each round
starting at the next build), after checking
that the builds agree with each other.

    PYTHONPATH=. python docs/cpu-kernel-ab.py --rev 5177118 --rev a4ee77f --tokens 1,4,8,16

Session 6's table: --rev 5177118 --avx2 --tokens 1,4 --widths 3584,14336 --threads 1,2.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from crisp_kernels import cpu_native


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _build_rev(rev: str, work: Path, flags: tuple[str, ...]) -> cpu_native.NativeKernel:
    """The kernel source of ``rev`` (a git revision, or a path to a .c file)."""
    src = work / f"{len(list(work.glob('*.c')))}.c"
    if rev.endswith(".c"):
        src.write_bytes(Path(rev).read_bytes())
    else:
        src.write_bytes(subprocess.run(["git", "show", f"{rev}:crisp_kernels/cpu_expert_native.c"],
                                       check=True, capture_output=True).stdout)
    return _build_source(src, work / src.stem, flags)


def _build_source(src: Path, folder: Path, flags: tuple[str, ...]) -> cpu_native.NativeKernel:
    """``src`` under the module's own build (same flags, atomic write). ABI 1 sources (before session 6)
    are declared by hand: open_library would refuse them; both ABIs share the entry."""
    current = cpu_native.SOURCE
    try:
        cpu_native.SOURCE = src
        path = cpu_native.build(folder, (*cpu_native.FLAGS, *flags))
    finally:
        cpu_native.SOURCE = current
    lib = ctypes.CDLL(str(path))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.crisp_expert_rows_f32.argtypes = [p, i64, i64, i64, p, p, p, p, i64, i64, p, p, i64]
    lib.crisp_expert_rows_f32.restype = ctypes.c_int
    return cpu_native.NativeKernel(path, lib)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", action="append", default=[], help="git revision (or path to a .c "
                        "file) whose kernel is timed too (repeatable; -march=native)")
    parser.add_argument("--avx2", action="store_true", help="also the working tree's source with -mno-avx512f")
    parser.add_argument("--flag", action="append", default=[], help="compiler flag added to every build "
                        "(repeatable; e.g. --flag=-mno-avx512f to compare the AVX2 paths)")
    parser.add_argument("--tokens", type=_ints, default=[1, 4], help="token counts, comma separated")
    parser.add_argument("--widths", type=_ints, default=[14336], help="neurons read (<= 14336), comma separated")
    parser.add_argument("--threads", type=_ints, default=[2], help="kernel threads, comma separated")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (best kept)")
    args = parser.parse_args()
    hidden, group, rows, experts = 4096, 64, 14336, 6
    if max(args.widths) > rows:
        parser.error(f"--widths: at most {rows}")
    if args.rounds < 1:
        parser.error("--rounds: expected >= 1")
    work = Path(tempfile.mkdtemp(prefix="crisp-kernel-ab-"))
    flags = tuple(args.flag)
    builds = {f"{rev}": _build_rev(rev, work, flags) for rev in args.rev}
    if args.avx2:
        builds["now, -mno-avx512f"] = cpu_native.open_library(
            cpu_native.build(work / "avx2", (*cpu_native.FLAGS, "-mno-avx512f")))
    builds["now"] = cpu_native.open_library(cpu_native.build(work / "now", (*cpu_native.FLAGS, *flags)))
    gen = torch.Generator().manual_seed(0)
    qs = [torch.randint(0, 256, (rows, 3, hidden // 2), dtype=torch.uint8, generator=gen) for _ in range(experts)]
    scales = (torch.rand(rows, 3, hidden // group, generator=gen) * 0.01).half()
    zeros = torch.randint(0, 16, (rows, 3, hidden // group), dtype=torch.uint8, generator=gen)
    print("ms per expert, best of", args.rounds, "rounds:", " | ".join(builds))
    for tokens in args.tokens:
        x, w = torch.randn(tokens, hidden, generator=gen), torch.ones(tokens)
        # the builds agree before anything is timed (another summation order only)
        got = []
        for kernel in builds.values():
            o = torch.zeros(tokens, hidden)
            kernel.rows_f32(x, qs[0], scales, zeros, group, None, 0, rows, w, o, 2)
            got.append(o)
        for name, o in zip(builds, got, strict=True):
            err = ((o - got[-1]).norm() / got[-1].norm()).item()
            if not err < 1e-5:  # nothing is timed for builds that compute something else
                raise SystemExit(f"{name} differs from the working tree's build by {err:.2e} at T {tokens}")
        out = torch.zeros(tokens, hidden)
        for width in args.widths:
            for threads in args.threads:
                best = dict.fromkeys(builds, float("inf"))
                names = list(builds)
                for r in range(args.rounds):  # each round starts at another build: no build always runs first
                    for name in names[r % len(names):] + names[:r % len(names)]:
                        kernel = builds[name]
                        t0 = time.perf_counter()
                        for q in qs:
                            kernel.rows_f32(x, q, scales, zeros, group, None, 0, width, w, out, threads)
                        best[name] = min(best[name], (time.perf_counter() - t0) / experts)
                print(f"T {tokens:2d} width {width:5d} threads {threads}: "
                      + " | ".join(f"{v * 1e3:6.2f}" for v in best.values()))


if __name__ == "__main__":
    main()
