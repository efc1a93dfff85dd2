"""Same-round A/B of the native CPU kernel's builds (docs/cpu-kernel.md, session 6).

Builds the kernel source of an earlier commit (ABI 1, AVX2 only) and the current source twice (AVX2 with
-mno-avx512f, and -march=native), into a temporary folder, and times one Mixtral-sized expert (H 4096,
I 14336, g 64) per build, 6 experts in rotation so that nothing stays in the 32 MiB L3, best of 5 rounds.

    PYTHONPATH=. python docs/cpu-kernel-ab.py [--old-rev 5177118]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old-rev", default="5177118", help="git revision of the 'old' kernel source")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (best kept)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="crisp-kernel-ab-"))
    old_src = work / "old.c"
    old_src.write_bytes(subprocess.run(["git", "show", f"{args.old_rev}:crisp_kernels/cpu_expert_native.c"],
                                       check=True, capture_output=True).stdout)
    current = cpu_native.SOURCE
    try:  # the old source under the module's own build (same flags, cache naming, atomic write)
        cpu_native.SOURCE = old_src
        old_lib = ctypes.CDLL(str(cpu_native.build(work / "old")))
    finally:
        cpu_native.SOURCE = current
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    old_lib.crisp_expert_rows_f32.argtypes = [p, i64, i64, i64, p, p, p, p, i64, i64, p, p, i64]
    old = cpu_native.NativeKernel(work / "old", old_lib)  # its ABI 1 is not asked: open_library would refuse it
    builds = {f"{args.old_rev} (avx2)": old,
              "now, -mno-avx512f": cpu_native.open_library(cpu_native.build(work / "new",
                                                                              (*cpu_native.FLAGS, "-mno-avx512f"))),
              "now, -march=native": cpu_native.open_library(cpu_native.build(work / "new"))}
    hidden, group, rows, experts = 4096, 64, 14336, 6
    gen = torch.Generator().manual_seed(0)
    qs = [torch.randint(0, 256, (rows, 3, hidden // 2), dtype=torch.uint8, generator=gen) for _ in range(experts)]
    scales = (torch.rand(rows, 3, hidden // group, generator=gen) * 0.01).half()
    zeros = torch.randint(0, 16, (rows, 3, hidden // group), dtype=torch.uint8, generator=gen)
    print("ms per expert, best of", args.rounds, "rounds:", " | ".join(builds))
    for tokens in (1, 4):
        x, w, out = torch.randn(tokens, hidden, generator=gen), torch.ones(tokens), torch.zeros(tokens, hidden)
        for width in (3584, 14336):
            for threads in (1, 2):
                best = dict.fromkeys(builds, float("inf"))
                for _ in range(args.rounds):
                    for name, kernel in builds.items():
                        t0 = time.perf_counter()
                        for q in qs:
                            kernel.rows_f32(x, q, scales, zeros, group, None, 0, width, w, out, threads)
                        best[name] = min(best[name], (time.perf_counter() - t0) / experts)
                print(f"T {tokens} width {width:5d} threads {threads}: "
                      + " | ".join(f"{v * 1e3:6.2f}" for v in best.values()))
        # the builds agree (another summation order only)
        got = []
        for kernel in builds.values():
            o = torch.zeros(tokens, hidden)
            kernel.rows_f32(x, qs[0], scales, zeros, group, None, 0, rows, w, o, 2)
            got.append(o)
        ref = got[0]
        for o in got[1:]:
            assert ((o - ref).norm() / ref.norm()).item() < 1e-5


if __name__ == "__main__":
    main()
