"""EleutherAI's lm-evaluation-harness over a CRISP-patched model (docs/clients.md, run as written).

The doc's setup block (tokenizer, ``load_model`` with a 128 KiB budget: experts streamed and
evicted) and its lm-eval block (``HFLM(pretrained=model, ...)``, the local task in
docs/examples/lm_eval, nothing downloaded) run as one session. Every loglikelihood the harness
reports must equal a direct computation with a second copy of the model with every expert
resident (no budget), and its accuracy the accuracy of those direct loglikelihoods.

lm-eval is not in the ``dev`` extra (it adds ~625 MB and ~3 min to an install here, datasets,
pandas, pyarrow, scipy and scikit-learn with it): install the ``clients`` extra to run this;
without it the module is skipped (CI does not run it).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "clients.md"
TASK_DIR = ROOT / "docs" / "examples" / "lm_eval"
DATA = TASK_DIR / "crisp_tiny_python.jsonl"
MARK = "# run by tests/test_lm_eval_client.py"


def doc_blocks() -> list[str]:
    """The doc's first block (the session's setup) and the lm-eval blocks."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    return [blocks[0]] + [b for b in blocks if b.startswith(MARK)]


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.chdir(ROOT)
    mp.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("datasets")))  # nothing of ours in ~/.cache
    mp.setenv("HF_HUB_OFFLINE", "1")
    namespace: dict = {"__name__": "clients_doc"}
    try:
        with torch.no_grad():
            for block in doc_blocks():
                exec(compile(block, str(DOC), "exec"), namespace)  # noqa: S102 - our own documentation
        yield namespace
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def direct():
    """log p(continuation | context) of every request, computed with the model itself (every expert resident)."""
    from transformers import AutoTokenizer

    from crisp_runtime import load_model

    tok = AutoTokenizer.from_pretrained(ROOT / "models" / "tiny-mixtral")
    model, _ = load_model(ROOT / "models" / "tiny-mixtral", ROOT / "models" / "tiny-mixtral-crisp")

    def loglikelihood(context: str, continuation: str) -> tuple[float, bool]:
        ctx, cont = tok(context).input_ids, tok(continuation).input_ids
        with torch.no_grad():
            logits = model(torch.tensor([ctx + cont])).logits[0, len(ctx) - 1:-1].float()
        logp = logits.log_softmax(-1)
        target = torch.tensor(cont)
        return float(logp.gather(1, target[:, None]).sum()), bool(torch.equal(logp.argmax(-1), target))

    return loglikelihood


def test_the_doc_has_the_lm_eval_block():
    blocks = doc_blocks()
    assert len(blocks) == 2 and 'gpu_budget="128KiB"' in blocks[0]
    assert "HFLM(pretrained=model" in blocks[1] and "include_path=" in blocks[1]


def test_harness_ran_the_local_task_through_the_budget(session):
    docs = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]
    samples = session["results"]["samples"]["crisp_tiny_python"]
    assert [s["doc"] for s in sorted(samples, key=lambda s: s["doc_id"])] == docs
    st = session["handle"].stats()
    assert st["bytes_h2d"] > 0 and st["evictions"] > 0  # the experts were streamed, not all resident


def test_loglikelihoods_and_accuracy_are_the_models(session, direct):
    samples = sorted(session["results"]["samples"]["crisp_tiny_python"], key=lambda s: s["doc_id"])
    correct = []
    for s in samples:
        got = s["filtered_resps"]
        want = [direct(context, continuation) for context, continuation in s["arguments"]]
        # The harness batches 4 requests, right-padded, the direct computation one at a time, without padding and
        # without a budget: float32 matmuls over other shapes, a few 1e-7 relative per logit; a loglikelihood sums
        # at most 8 log-probs of magnitude <= ~25, so 1e-4 is ~1000 ulps at that magnitude, far from a wrong one.
        for (g_ll, g_greedy), (w_ll, w_greedy) in zip(got, want, strict=True):
            assert g_ll == pytest.approx(w_ll, abs=1e-4)
            assert g_greedy == w_greedy
        scores = [ll for ll, _ in want]
        correct.append(float(scores.index(max(scores)) == s["doc"]["label"]))
    acc = session["results"]["results"]["crisp_tiny_python"]["acc,none"]
    assert acc == pytest.approx(sum(correct) / len(correct))
    assert session["acc"] == acc
