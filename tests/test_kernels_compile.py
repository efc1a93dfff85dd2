"""The expert kernels compiled for real GPUs, without one: Triton's own compiler and the ptxas
that ships with it lower every path to a cubin for sm_90 (H100/H200), sm_89 (RTX 4090) and
sm_80 (A100). This catches what the interpreter cannot (tl.dot operand types and shapes, the
constexpr branches, atomics, layouts); it does not run or time anything.

It runs in a subprocess because conftest.py sets ``TRITON_INTERPRET=1`` before Triton is
imported, and interpreted kernels cannot be compiled.
"""

import json
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import crisp_kernels.expert_mlp_triton as K

    GATE_UP = dict(x_ptr=None, rows_ptr="*i64", tw_ptr="*i32", q_ptr="*u8", s_ptr="*fp16", z_ptr="*u8",
                   b_ptr="*fp32", h_ptr="*fp32", T="i32", k="i32", stride_xt="i32")
    DOWN = dict(h_ptr="*fp32", q_ptr="*u8", s_ptr="*fp16", z_ptr="*u8", out_ptr=None, rows_ptr="*i64",
                w_ptr="*fp32", tw_ptr="*i32", db_ptr="*fp32", T="i32", k="i32", chunk="i32", stride_ot="i32")
    ACT = {"silu": dict(ACT=0, ALPHA=0.0, LIMIT=0.0), "gpt_oss": dict(ACT=1, ALPHA=1.702, LIMIT=7.0)}
    DOT = {"fp16": tl.float16, "bf16": tl.bfloat16, "fp32": tl.float32}
    results = []
    for arch, xdt, hidden, group, sym, token_blocks, act in json.loads(sys.argv[1]):
        biased = act != "silu"  # gpt-oss: gate/up biases per neuron, a down bias per expert
        for cfg in [*K.DECODE_CONFIGS.values(), *K.PREFILL_CONFIGS.values()]:
            if token_blocks and cfg.block_t not in token_blocks:
                continue
            for accumulate in (False, True):  # expert_mlp (stored, x dtype) / expert_mlp_accumulate_ (atomics)
                flags = dict(HB=hidden // 2, GROUP=group, SYMMETRIC=sym, HAS_ROWS=accumulate)
                gu = dict(flags, HAS_TW=accumulate, BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                          HAS_BIAS=biased, **ACT[act])
                dn = dict(flags, HAS_WEIGHTS=accumulate, ATOMIC=accumulate, BLOCK_T=cfg.block_t,
                          BLOCK_J=cfg.block_j, BLOCK_H=cfg.block_h, HAS_TW=accumulate, HAS_DOWN_BIAS=biased)
                if cfg.path == "decode":
                    kernels = (K._gate_up_decode_kernel, K._down_decode_kernel)
                else:
                    kernels = (K._gate_up_prefill_kernel, K._down_prefill_kernel)
                    gu["DOT_DTYPE"] = dn["DOT_DTYPE"] = DOT[xdt]
                for fn, sig, consts in ((kernels[0], GATE_UP, gu), (kernels[1], DOWN, dn)):
                    sig = dict(sig, x_ptr=f"*{xdt}", out_ptr="*fp32" if accumulate else f"*{xdt}")
                    sig = {name: sig[name] for name in sig if name in fn.arg_names}
                    sig.update({name: "constexpr" for name in consts})
                    src = ASTSource(fn=fn, signature=sig, constexprs=consts)
                    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
                    name = f"sm{arch} {xdt} g{group}{' sym' if sym else ''} {act} {fn.__name__} T{cfg.block_t}"
                    try:
                        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
                        ok = bool(compiled.asm.get("cubin"))
                        results.append([name, ok, "" if ok else "no cubin"])
                    except Exception as exc:
                        results.append([name, False, f"{type(exc).__name__}: {exc}"[:2000]])
    print(json.dumps(results))
    """
)

CASES = [  # (arch, activations, H, group, symmetric, the configs' block_t to compile: [] = all, activation)
    (90, "fp16", 4096, 64, False, [], "silu"),  # Mixtral on an H100/H200
    (89, "bf16", 2048, 128, True, [1, 32], "silu"),  # an RTX 4090
    (80, "fp32", 384, 32, False, [64], "silu"),  # the tests' shape, IEEE fp32 dots
    (90, "bf16", 2880, 64, False, [1, 16, 64], "gpt_oss"),  # gpt-oss-20b (H 2880): biases, clamped SwiGLU
]


@pytest.mark.slow
def test_kernels_compile_for_gpus():
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(CASES)], capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0 and "ptxas" in proc.stderr.lower():
        pytest.skip(f"no usable ptxas: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == sum(len(blocks) or 7 for *_, blocks, _ in CASES) * 2 * 2
    failed = [f"{name}: {why}" for name, ok, why in results if not ok]
    assert not failed, "\n".join(failed)
