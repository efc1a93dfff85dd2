"""The native CPU expert kernel: ``cpu_expert_native.c``, built on first use with the host's C compiler.

Why a hand-written kernel (docs/cpu-kernel.md has the figures): torch's int4pack CPU op, the
well-kept candidate, reaches 88% of memcpy with AVX-512 but is compute-bound at ~3 GB/s per core
with AVX2 only (22-43% of memcpy on an AMD EPYC VM at T = 1), its down projection runs
one op call per 32 or 64 rows of H (single-threaded each), and it needs a second copy of the
experts in its own layout (x 2.05 host memory). This kernel reads the format's neuron-major rows
themselves (no second copy), in fp32 (the exact path's precision, 1e-5), one pass per row.
It has AVX-512, AVX2 + FMA and portable C paths, chosen by ``-march=native``
(:attr:`NativeKernel.vector_bits` says which); at T = 1 it reaches 64-89% of memcpy on a Zen 4 VM.

Building: ``cc -O3 -march=native -shared -fPIC -fopenmp`` (``$CC`` if set) into a cache folder
(``$CRISP_CACHE_DIR``, else ``$XDG_CACHE_HOME/crisp`` or ``~/.cache/crisp``), named by a hash of the
source, the flags, the compiler's version and this CPU's flags, so a changed source or another
machine builds anew and nothing else is ever overwritten. The library is written to a temporary
file in that folder and renamed into place (atomic: two processes building at once both end with a
whole file). :func:`load` builds at most once per process; :class:`NativeUnavailable` says why it
could not (no compiler, a failed build), and callers fall back to the torch paths.

The call releases the GIL (ctypes), so the runtime's CPU worker runs it beside the GPU's thread.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_expert_native.c")
# -fopenmp links libgomp.so.1, resolved to the copy torch has loaded (its intra-op threads: see the source)
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-fopenmp", "-std=c11")
ABI = 6  # crisp_native_abi() of the source this module calls
# The C kernel's token limit (MAX_TOKENS): a decode step sends 1-16 tokens to an expert; more are
# refused (ValueError), the caller takes another path.
MAX_TOKENS = 64
_COMPILE_TIMEOUT_S = 120


class NativeUnavailable(RuntimeError):
    """The native kernel cannot be built or loaded on this machine (the message says why)."""


@dataclass(frozen=True)
class NativeKernel:
    """The loaded library and where it came from."""

    path: Path
    lib: ctypes.CDLL

    @property
    def vector_bits(self) -> int:
        """What the build computes with: 512 (AVX-512), 256 (AVX2 + FMA) or 0 (portable C)."""
        return int(self.lib.crisp_native_vector_bits())

    def rows_f32(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 group: int, token_widths: torch.Tensor | None, row_start: int, row_stop: int,
                 weights: torch.Tensor, out: torch.Tensor, threads: int) -> None:
        """``out += weights[:, None] * sum over neurons row_start <= j < min(row_stop, k_t)`` of the expert.

        x: (T, H) fp32 contiguous; qweight / scales / zeros: the expert's (W, 3, ...) rows, contiguous
        (row j at offset j); token_widths: (T,) int64 contiguous or None; weights: (T,) fp32; out: (T, H)
        fp32 contiguous. ``crisp_kernels.cpu_expert`` checks the format; what the C code's pointer
        arithmetic relies on is checked here again (~10 us; a Mixtral expert takes >= 3 ms), so a bad
        call raises instead of reading or writing past a tensor."""
        self._rows(self.lib.crisp_expert_rows_f32, x, qweight, scales, zeros, group, token_widths, row_start,
                   row_stop, weights, out, threads)

    def rows_q8(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                group: int, token_widths: torch.Tensor | None, row_start: int, row_stop: int,
                weights: torch.Tensor, out: torch.Tensor, threads: int) -> None:
        """:meth:`rows_f32` with 8-bit activations and integer dot products (llama.cpp's Q8_0 arithmetic):
        what is quantized is ``crisp_kernels.cpu_expert_q8``'s docstring; its ``expert_mlp_q8_ref`` is
        the reference."""
        self._rows(self.lib.crisp_expert_rows_q8, x, qweight, scales, zeros, group, token_widths, row_start,
                   row_stop, weights, out, threads)

    def dense_q8(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 group: int, out: torch.Tensor, threads: int, *, weights_checked: bool = False) -> None:
        """``out = x W^T`` for a dense matrix in the format's rows (``crisp_kernels.dense_q8``), with 8-bit
        activations: x (T, H) fp32 contiguous, T <= MAX_TOKENS; qweight (O, H/2) uint8, scales (O, G) fp16,
        zeros (O, G) uint8 or None; out (T, O) fp32 contiguous, overwritten. Checked here (a bad call raises
        before the C code runs); ``weights_checked``: qweight / scales / zeros / group are a ``DenseQ4``'s,
        validated when it was made, and only x and out are checked."""
        tokens, hidden = x.shape
        if tokens > MAX_TOKENS:
            raise ValueError(f"x: the native CPU kernel takes at most {MAX_TOKENS} tokens, got {tokens}")
        rows = qweight.shape[0] if qweight.dim() == 2 else -1
        tensors = {"x": (x, torch.float32, (tokens, qweight.shape[-1] * 2)),
                   "out": (out, torch.float32, (tokens, rows))}
        if not weights_checked:
            groups = hidden // group if group > 0 else 0
            tensors |= {"qweight": (qweight, torch.uint8, (rows, hidden // 2)),
                        "scales": (scales, torch.float16, (rows, groups))}
            if zeros is not None:
                tensors["zeros"] = (zeros, torch.uint8, (rows, groups))
            if group not in (32, 64, 128) or hidden % group:
                raise ValueError(f"group: expected 32, 64 or 128 dividing H = {hidden}, got {group}")
        _check_tensors(tensors)
        rc = self.lib.crisp_dense_q8(x.data_ptr(), tokens, hidden, group, qweight.data_ptr(), scales.data_ptr(),
                                     None if zeros is None else zeros.data_ptr(), rows, out.data_ptr(), threads)
        if rc != 0:
            raise RuntimeError(f"the native CPU kernel failed (code {rc}: -1 out of memory, -2 bad sizes)")

    def dense_bf16(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, threads: int) -> None:
        """``out = x W^T`` for W (O, H) in bf16, x (T, H) fp32 contiguous (T <= MAX_TOKENS), out (T, O) fp32
        contiguous, overwritten: W's values widened exactly to fp32, the dots in fp32. Checked here (a bad call
        raises before the C code runs)."""
        tokens, hidden = x.shape
        if tokens > MAX_TOKENS:
            raise ValueError(f"x: the native CPU kernel takes at most {MAX_TOKENS} tokens, got {tokens}")
        rows = weight.shape[0] if weight.dim() == 2 else -1
        _check_tensors({"x": (x, torch.float32, (tokens, hidden)), "weight": (weight, torch.bfloat16, (rows, hidden)),
                        "out": (out, torch.float32, (tokens, rows))})
        rc = self.lib.crisp_dense_bf16(x.data_ptr(), tokens, hidden, weight.data_ptr(), rows, out.data_ptr(), threads)
        if rc != 0:
            raise RuntimeError(f"the native CPU kernel failed (code {rc}: -2 bad sizes)")

    def dense_int8(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
                   threads: int) -> None:
        """``out = x W^T`` for W (O, H) as int8 codes ``qweight`` (O, H) with fp16 ``scales`` (O, H / 32), one per
        block of 32 (``crisp_kernels.dense_int8``), with 8-bit activations: x (T, H) fp32 contiguous, T <= MAX_TOKENS,
        H a multiple of 32; out (T, O) fp32 contiguous, overwritten. Checked here (a bad call raises before the C
        code runs)."""
        tokens, hidden = x.shape
        if tokens > MAX_TOKENS:
            raise ValueError(f"x: the native CPU kernel takes at most {MAX_TOKENS} tokens, got {tokens}")
        if hidden <= 0 or hidden % 32:
            raise ValueError(f"x: expected H a positive multiple of 32 (the weight's blocks), got {hidden}")
        rows = qweight.shape[0] if qweight.dim() == 2 else -1
        _check_tensors({"x": (x, torch.float32, (tokens, hidden)), "qweight": (qweight, torch.int8, (rows, hidden)),
                        "scales": (scales, torch.float16, (rows, hidden // 32)),
                        "out": (out, torch.float32, (tokens, rows))})
        rc = self.lib.crisp_dense_int8(x.data_ptr(), tokens, hidden, qweight.data_ptr(), scales.data_ptr(), rows,
                                       out.data_ptr(), threads)
        if rc != 0:
            raise RuntimeError(f"the native CPU kernel failed (code {rc}: -1 out of memory, -2 bad sizes)")

    def bind(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group: int,
             q8: bool) -> BoundRows:
        """An expert's host rows (as :meth:`rows_q8` / :meth:`rows_f32` take them), checked now, for
        :meth:`BoundRows.one_token_` (8-bit activations where ``q8``, else fp32)."""
        hidden = qweight.shape[-1] * 2 if qweight.dim() == 3 else -1
        dummy = torch.zeros((1, max(hidden, 0)), dtype=torch.float32)
        _check_call(dummy, qweight, scales, zeros, group, None, 0, 0, torch.zeros(1), dummy)
        return BoundRows(self.lib.crisp_expert_rows_q8 if q8 else self.lib.crisp_expert_rows_f32, qweight, scales,
                         zeros, group)

    @staticmethod
    def _rows(fn, x, qweight, scales, zeros, group, token_widths, row_start, row_stop, weights, out, threads) -> None:
        tokens, hidden = x.shape
        if tokens > MAX_TOKENS:
            raise ValueError(f"x: the native CPU kernel takes at most {MAX_TOKENS} tokens, got {tokens}")
        _check_call(x, qweight, scales, zeros, group, token_widths, row_start, row_stop, weights, out)
        # row row_start's address (contiguous rows, checked): pointer arithmetic, not three slices (~4 us a call)
        row_q = qweight.data_ptr() + row_start * qweight.stride(0)
        row_s = scales.data_ptr() + row_start * scales.stride(0) * scales.element_size()
        row_z = None if zeros is None else zeros.data_ptr() + row_start * zeros.stride(0)
        rc = fn(x.data_ptr(), tokens, hidden, group, row_q, row_s, row_z,
                None if token_widths is None else token_widths.data_ptr(), row_start, row_stop,
                weights.data_ptr(), out.data_ptr(), threads)
        if rc != 0:
            raise RuntimeError(f"the native CPU kernel failed (code {rc}: -1 out of memory, -2 bad sizes); "
                               "out is unchanged")


def dense_chunks(x: torch.Tensor, in_features: int, out_features: int, bias: torch.Tensor | None,
                 threads: int | None, call) -> torch.Tensor:
    """A dense layer's launcher around a native call: ``x`` (..., in_features) on the CPU (any float dtype) as fp32
    rows, in chunks of :data:`MAX_TOKENS` rows, ``call(x_rows, out_rows, threads)`` filling each (rows, out) fp32
    chunk, then ``bias`` added; the result (..., out_features) in x's dtype. threads: None = torch's intra-op
    threads."""
    if x.device.type != "cpu" or x.shape[-1] != in_features:
        raise ValueError(f"x: expected (..., {in_features}) on the CPU, got {tuple(x.shape)} on {x.device}")
    flat = x.reshape(-1, in_features)
    if flat.dtype != torch.float32 or not flat.is_contiguous():
        flat = flat.float().contiguous()
    tokens = flat.shape[0]
    out = torch.empty(tokens, out_features, dtype=torch.float32)
    n = torch.get_num_threads() if threads is None else threads
    for t0 in range(0, tokens, MAX_TOKENS):  # decode: one call on the whole tensors, no slices (~2 us each)
        xs, os_ = (flat, out) if tokens <= MAX_TOKENS else (flat[t0:t0 + MAX_TOKENS], out[t0:t0 + MAX_TOKENS])
        call(xs, os_, n)
    if bias is not None:
        out += bias
    out = out.view(*x.shape[:-1], out_features)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


@dataclass(frozen=True)
class BoundRows:
    """One expert's host rows checked once against the native kernel's contract (:meth:`NativeKernel.bind`),
    for one-token calls that then check only the token's tensors and the row range.

    Why: the per-call path (``expert_mlp_cpu_accumulate_`` -> :meth:`NativeKernel.rows_q8`) re-checks the
    expert's format and its three tensors on every call, ~40 us of Python per expert and call on the 2-core
    VM, against ~2 ms of kernel for a Mixtral-shaped expert; a decode step of a CPU-only model makes one such
    call per routed expert and layer. The tensors are held, so the addresses stay valid.
    """

    fn: object  # the ctypes function: crisp_expert_rows_q8 or crisp_expert_rows_f32
    qweight: torch.Tensor  # (W, 3, H/2) uint8, contiguous
    scales: torch.Tensor  # (W, 3, G) fp16, contiguous
    zeros: torch.Tensor | None  # (W, 3, G) uint8, contiguous, or None (symmetric)
    group: int

    @property
    def hidden(self) -> int:
        return self.qweight.shape[2] * 2

    @property
    def rows(self) -> int:
        return self.qweight.shape[0]

    def one_token_(self, x: torch.Tensor, weights: torch.Tensor, slot: int, out: torch.Tensor, row_start: int,
                   row_stop: int, threads: int) -> None:
        """``out += weights[slot] * sum over neurons row_start <= j < row_stop`` of the expert at x.

        x, out: (1, H) fp32 contiguous CPU tensors; weights: (k,) fp32 contiguous CPU, its element ``slot`` the
        routing weight. Checked here (a bad call raises before the C code runs)."""
        hidden = self.hidden
        for name, t, shape in (("x", x, (1, hidden)), ("out", out, (1, hidden))):
            if t.dtype != torch.float32 or t.shape != shape or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"{name}: expected a contiguous float32 {shape} CPU tensor, got {t.dtype} "
                                 f"{tuple(t.shape)} on {t.device}")
        if (weights.dtype != torch.float32 or weights.dim() != 1 or not weights.is_contiguous()
                or weights.device.type != "cpu" or not 0 <= slot < weights.shape[0]):
            raise ValueError(f"weights: expected a contiguous float32 (k,) CPU tensor with element {slot}, got "
                             f"{weights.dtype} {tuple(weights.shape)} on {weights.device}")
        if not 0 <= row_start <= row_stop <= self.rows:
            raise ValueError(f"rows: expected 0 <= row_start <= row_stop <= {self.rows}, got [{row_start}, "
                             f"{row_stop})")
        if row_start == row_stop:
            return
        q, s, z = self.qweight, self.scales, self.zeros  # row row_start's addresses: contiguous rows (checked)
        row_z = None if z is None else z.data_ptr() + row_start * z.stride(0)
        rc = self.fn(x.data_ptr(), 1, hidden, self.group, q.data_ptr() + row_start * q.stride(0),
                     s.data_ptr() + row_start * s.stride(0) * 2, row_z, None, row_start, row_stop,
                     weights.data_ptr() + 4 * slot, out.data_ptr(), threads)
        if rc != 0:
            raise RuntimeError(f"the native CPU kernel failed (code {rc}: -1 out of memory, -2 bad sizes); "
                               "out is unchanged")


def _check_call(x, qweight, scales, zeros, group, token_widths, row_start, row_stop, weights, out) -> None:
    tokens, hidden = x.shape
    groups = hidden // group if group > 0 else 0
    tensors = {"x": (x, torch.float32, (tokens, hidden)), "out": (out, torch.float32, (tokens, hidden)),
               "weights": (weights, torch.float32, (tokens,)),
               "qweight": (qweight, torch.uint8, (qweight.shape[0], 3, hidden // 2)),
               "scales": (scales, torch.float16, (qweight.shape[0], 3, groups))}
    if zeros is not None:
        tensors["zeros"] = (zeros, torch.uint8, (qweight.shape[0], 3, groups))
    if token_widths is not None:
        tensors["token_widths"] = (token_widths, torch.int64, (tokens,))
    _check_tensors(tensors)
    if group not in (32, 64, 128) or hidden % group:
        raise ValueError(f"group: expected 32, 64 or 128 dividing H = {hidden}, got {group}")
    if not 0 <= row_start <= row_stop <= qweight.shape[0]:
        raise ValueError(f"rows: expected 0 <= row_start <= row_stop <= {qweight.shape[0]}, got [{row_start}, "
                         f"{row_stop})")


def _check_tensors(tensors: dict) -> None:
    for name, (t, dtype, shape) in tensors.items():
        if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name}: the native CPU kernel needs a contiguous {dtype} {shape} CPU tensor, got "
                             f"{t.dtype} {tuple(t.shape)}{'' if t.is_contiguous() else ' (strided)'} on {t.device}")


def cache_dir() -> Path:
    """Where built libraries are kept (created on first build)."""
    if os.environ.get("CRISP_CACHE_DIR"):
        return Path(os.environ["CRISP_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "crisp"


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise NativeUnavailable("no C compiler found (cc, gcc, or $CC): the CPU experts use torch's int4pack op")
    return cc


def _cpu_flags() -> str:
    """This CPU's feature flags (what -march=native compiles for), for the library's name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build_key(cc: str, source: bytes, flags: tuple[str, ...]) -> str:
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise NativeUnavailable(f"the C compiler {cc!r} does not run: {err}") from err
    digest = hashlib.sha256()
    parts = (source, " ".join(flags).encode(), version.encode(), _cpu_flags().encode(), platform.machine().encode())
    for part in parts:
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:20]


def build(folder: Path | None = None, flags: tuple[str, ...] = FLAGS) -> Path:
    """The library for this source, compiler, flags and CPU: built into ``folder`` (default
    :func:`cache_dir`) unless a library of that name is there already. Never overwrites another file.
    ``flags``: the compiler's (tests build the portable C path with ``-mno-avx2``)."""
    cc = _compiler()
    try:
        source = SOURCE.read_bytes()
    except OSError as err:
        raise NativeUnavailable(f"the kernel's source {SOURCE} is missing: {err}") from err
    folder = cache_dir() if folder is None else Path(folder)
    target = folder / f"crisp_cpu_expert-{_build_key(cc, source, flags)}.so"
    if target.is_file():
        return target
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".crisp_cpu_expert-", suffix=".so.tmp", dir=folder)
    except OSError as err:
        raise NativeUnavailable(f"cannot write the native kernel into {folder}: {err} (set CRISP_CACHE_DIR)") from err
    os.close(fd)
    try:
        try:
            done = subprocess.run([cc, *flags, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True,
                                  timeout=_COMPILE_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as err:
            raise NativeUnavailable(f"building the native CPU kernel failed: {err}") from err
        if done.returncode != 0:
            raise NativeUnavailable(f"building the native CPU kernel failed ({cc} exit {done.returncode}): "
                                    f"{done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)  # our own temporary file: never a user's
    return target


def _declare(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.crisp_expert_rows_f32.argtypes = [p, i64, i64, i64, p, p, p, p, i64, i64, p, p, i64]
    lib.crisp_expert_rows_f32.restype = ctypes.c_int
    lib.crisp_expert_rows_q8.argtypes = lib.crisp_expert_rows_f32.argtypes
    lib.crisp_expert_rows_q8.restype = ctypes.c_int
    lib.crisp_dense_q8.argtypes = [p, i64, i64, i64, p, p, p, i64, p, i64]
    lib.crisp_dense_q8.restype = ctypes.c_int
    lib.crisp_dense_bf16.argtypes = [p, i64, i64, p, i64, p, i64]
    lib.crisp_dense_bf16.restype = ctypes.c_int
    lib.crisp_dense_int8.argtypes = [p, i64, i64, p, p, i64, p, i64]
    lib.crisp_dense_int8.restype = ctypes.c_int
    lib.crisp_native_abi.argtypes = []
    lib.crisp_native_abi.restype = ctypes.c_int
    lib.crisp_native_vector_bits.argtypes = []
    lib.crisp_native_vector_bits.restype = ctypes.c_int


def open_library(path: Path) -> NativeKernel:
    """A built library (:func:`build`) as a :class:`NativeKernel`."""
    try:
        lib = ctypes.CDLL(str(path))
        _declare(lib)
    except (OSError, AttributeError) as err:
        raise NativeUnavailable(f"loading the native CPU kernel {path} failed: {err}") from err
    if lib.crisp_native_abi() != ABI:
        raise NativeUnavailable(f"{path}: ABI {lib.crisp_native_abi()}, expected {ABI}")
    return NativeKernel(Path(path), lib)


@functools.cache
def _load_once() -> NativeKernel | NativeUnavailable:
    try:
        return open_library(build())
    except NativeUnavailable as err:
        return err


def load() -> NativeKernel:
    """The native kernel, built if needed; once per process (a failure is remembered and raised again)."""
    got = _load_once()
    if isinstance(got, NativeUnavailable):
        raise got
    return got


def available() -> bool:
    try:
        load()
    except NativeUnavailable:
        return False
    return True
