"""Guarded Triton import: a CPU-only install (or a platform without Triton) still imports.

``TRITON_INTERPRET=1`` must be set before Triton is first imported: Triton reads it when a
``@triton.jit`` function is decorated, i.e. when our kernel modules are imported.
"""

from __future__ import annotations

import os

try:  # pragma: no cover - exercised by whichever environment runs
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    triton = None
    tl = None
    HAS_TRITON = False


def interpreter_enabled() -> bool:
    """True when Triton kernels run on the CPU through Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
