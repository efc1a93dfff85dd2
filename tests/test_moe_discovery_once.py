"""``apply`` and ``load_model`` find the model's MoE layers once and pass them on.

Finding them walks every module of the model; each step after the first (pack checks, weights fingerprint,
prefetch, the checkpoint's map) takes the layers it is given instead of walking again.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import crisp_runtime  # noqa: E402
from crisp_runtime.hf import moe_layers  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "tiny-mixtral"
PACK = ROOT / "models" / "tiny-mixtral-crisp"


@pytest.fixture
def discoveries(monkeypatch):
    """The callers of ``find_moe_layers``, one entry per call, in every crisp module that imported it."""
    calls: list[str] = []
    original = moe_layers.find_moe_layers

    def counting(model):
        calls.append(traceback.extract_stack(limit=2)[0].name)
        return original(model)

    patched = 0
    for name, module in list(sys.modules.items()):
        if name.startswith(("crisp_runtime", "crisp_kernels")) and getattr(module, "find_moe_layers", None) is original:
            monkeypatch.setattr(module, "find_moe_layers", counting)
            patched += 1
    assert patched >= 4  # moe_layers itself, the drop-in, the pack, the checkpoint reader, prefetch
    return calls


def test_apply_finds_the_moe_layers_once(discoveries):
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL)
    with crisp_runtime.apply(model, PACK, gpu_budget="2MiB", cpu="off",
                             config=crisp_runtime.RuntimeConfig(prefetch=crisp_runtime.PrefetchPolicy())):
        pass
    assert discoveries == ["apply"]


def test_load_model_finds_the_moe_layers_once(discoveries):
    model, handle = crisp_runtime.load_model(MODEL, PACK, gpu_budget="2MiB")
    assert len(discoveries) == 1, discoveries
    with pytest.warns(UserWarning, match="not kept"):  # load_model never had the full-precision experts
        handle.restore()
