"""Shared test setup.

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, so it is set here, before
anything imports triton or crisp_kernels: on a CPU-only machine the kernels then run in
Triton's interpreter. ``bench/gpu_check.sh`` sets ``TRITON_INTERPRET=0`` and
``CRISP_TEST_DEVICES=cuda`` to run the same tests compiled on a GPU.

Devices: tests that take the ``device`` fixture run once per device in ``CRISP_TEST_DEVICES``
(comma-separated; default ``cpu``, plus ``cuda`` when a GPU is present). The cuda cases carry
the ``gpu`` marker, so ``pytest -m gpu`` selects them; every ``gpu`` test is skipped without CUDA.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def _test_devices() -> list[str]:
    configured = os.environ.get("CRISP_TEST_DEVICES", "")
    if configured.strip():
        return [d.strip() for d in configured.split(",") if d.strip()]
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(
    params=[pytest.param(d, marks=[pytest.mark.gpu] if d.startswith("cuda") else []) for d in _test_devices()]
)
def device(request) -> torch.device:
    return torch.device(request.param)


@pytest.fixture
def kernel_backend(device):
    """The Triton backend for ``device``: compiled on CUDA, the interpreter on the CPU."""
    from crisp_kernels import Backend
    from crisp_kernels._triton import HAS_TRITON, interpreter_enabled

    if not HAS_TRITON:
        pytest.skip("Triton is not installed")
    if device.type == "cuda":
        return Backend.TRITON
    if not interpreter_enabled():
        pytest.skip("TRITON_INTERPRET=0: no Triton backend for CPU tensors")
    return Backend.TRITON_INTERPRET
