"""The clients of a patched model (docs/clients.md, run as written) and the tiny model's tokenizer.

The Python blocks of docs/clients.md are executed in order as one session, once with the doc's small gpu_budget
(experts streamed and evicted) and once with every expert resident, both through the device path that a GPU
runs (``cpu="off"``: on this CPU-only machine the default serves every expert on the CPU kernel), and once as
written; generate
(greedy with padding and a KV cache, without the cache, sampling) and pipeline must give the same
tokens both times. The committed tokenizer must be the byte encoding of crisp_tools.text.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from crisp_tools import text  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "clients.md"
MODEL = ROOT / "models" / "tiny-mixtral"
BUDGET_IN_DOC = 'gpu_budget="128KiB"'
NEW_TOKENS = 4  # max_new_tokens in the doc's examples


def doc_blocks() -> list[str]:
    """The doc's Python blocks but those another test runs (first line ``# run by tests/...``: lm-eval, compile)."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    return [b for b in blocks if not b.startswith("# run by tests/")]


def run_doc(monkeypatch, *, budget: str | None, cpu: str | None = "off") -> dict:
    """Run every Python block of the doc in one namespace (from the repository root); return it. ``cpu``: passed to
    the doc's ``load_model`` ("off": the device path that a GPU runs, streaming and evicting under the budget;
    None: as written, which on a machine without a GPU serves every expert on the CPU kernel)."""
    monkeypatch.chdir(ROOT)
    namespace: dict = {"__name__": "clients_doc"}
    for block in doc_blocks():
        assert block.count(BUDGET_IN_DOC) <= 1
        call = "gpu_budget=None" if budget is None else BUDGET_IN_DOC
        block = block.replace(BUDGET_IN_DOC, call if cpu is None else f"{call}, cpu={cpu!r}")
        exec(compile(block, str(DOC), "exec"), namespace)  # noqa: S102 - our own documentation
    return namespace


@pytest.fixture(scope="module")
def sessions():
    mp = pytest.MonkeyPatch()
    try:
        with torch.no_grad():
            yield {"budget": run_doc(mp, budget=BUDGET_IN_DOC), "resident": run_doc(mp, budget=None),
                   "as_written": run_doc(mp, budget=BUDGET_IN_DOC, cpu=None)}
    finally:
        mp.undo()


def test_doc_blocks_are_there():
    blocks = doc_blocks()
    assert len(blocks) >= 4 and sum(BUDGET_IN_DOC in b for b in blocks) == 1
    joined = "\n".join(blocks)
    for client in ("model.generate(", "do_sample=True", "use_cache=False", 'pipeline("text-generation"'):
        assert client in joined


@pytest.mark.parametrize("name", ["greedy", "no_cache", "sampled", "greedy_text", "sampled_text", "piped"])
def test_outputs_do_not_depend_on_the_budget(sessions, name):
    with_budget, resident = sessions["budget"][name], sessions["resident"][name]
    if isinstance(with_budget, torch.Tensor):
        assert torch.equal(with_budget, resident)
        assert with_budget.shape[1] == sessions["budget"]["enc"].input_ids.shape[1] + NEW_TOKENS
    else:
        assert with_budget == resident


def test_the_budget_was_small_and_respected(sessions):
    handle = sessions["budget"]["handle"]
    st = handle.stats()
    assert st["cache"]["budget_bytes"] == 128 * 1024
    assert 0 < st["cache"]["peak_bytes"] <= 128 * 1024
    assert st["bytes_h2d"] > 0 and st["evictions"] > 0
    assert sessions["resident"]["handle"].stats()["bytes_h2d"] == 0


def test_the_doc_as_written_runs_the_default_placement(sessions):
    ns = sessions["as_written"]
    st = ns["handle"].stats()
    # load_model's default device is the CPU: every expert on the CPU kernel, nothing copied; the same clients
    assert st["cpu"]["placement"] == "cpu_only" and st["bytes_h2d"] == 0 and st["cpu_runs"] > 0
    for name in ("greedy", "no_cache", "sampled"):
        assert ns[name].shape == sessions["budget"][name].shape
    assert len(ns["piped"]) == len(sessions["budget"]["piped"])


def test_stats_of_the_doc_session_count_real_tokens(sessions):
    ns = sessions["budget"]
    mask = ns["enc"].attention_mask
    rows, width = mask.shape
    real = int(mask.sum())
    assert real < rows * width  # the doc's prompts do need padding
    steps = NEW_TOKENS - 1  # forwards after the prefill
    # greedy with the KV cache: the prompt once, then one new position per row per step; without the
    # cache every step recomputes the whole sequence so far (the prompt's padding included each time)
    tokens = real + steps * rows + sum(real + s * rows for s in range(NEW_TOKENS))
    positions = rows * width + steps * rows + sum(rows * (width + s) for s in range(NEW_TOKENS))
    assert (ns["stats"]["tokens"], ns["stats"]["positions"]) == (tokens, positions)


# ---------------------------------------------------------------------- the tokenizer


TEXTS = ["", "hello world", "naïve café — 日本語 🙂", "tabs\tand\nnew lines\r\n", "  leading and trailing  ",
         "NUL \x00 in the middle", "\x00", "Ā is U+0100, the table's stand-in for byte 0", "<|endoftext|> <s> </s>",
         "".join(chr(c) for c in range(1, 128))]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL, local_files_only=True)


@pytest.mark.parametrize("s", TEXTS)
def test_tokenizer_is_the_byte_encoding(tok, s):
    ids = tok(s).input_ids
    assert ids == text.encode(s).tolist()
    assert tok.decode(ids) == s == text.decode(ids)


@pytest.mark.parametrize("ids", [[0xFF, 0x41], [0xE6, 0x97], [0xC3], list(range(256))])
def test_tokenizer_decodes_any_ids_like_text_decode(tok, ids):
    assert tok.decode(ids) == text.decode(ids)  # invalid UTF-8 -> U+FFFD in both


def test_tokenizer_special_ids_and_padding(tok):
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (text.DOC_SEPARATOR,) * 3
    assert len(tok) == text.VOCAB_SIZE == transformers.AutoConfig.from_pretrained(MODEL).vocab_size
    assert tok.model_max_length == transformers.AutoConfig.from_pretrained(MODEL).max_position_embeddings
    enc = tok(["ab", "abcd"], padding=True, padding_side="left", return_tensors="pt")
    assert enc.input_ids.tolist() == [[0, 0, 97, 98], [97, 98, 99, 100]]
    assert enc.attention_mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    assert tok.decode([0, 104, 105, 0], skip_special_tokens=True) == "hi"


def test_committed_tokenizer_is_what_byte_tokenizer_builds(tok):
    built = text.byte_tokenizer(512)
    assert built.get_vocab() == tok.get_vocab()
    assert [built.bos_token, built.eos_token, built.pad_token] == [tok.bos_token, tok.eos_token, tok.pad_token]
    for s in TEXTS:
        assert built(s).input_ids == tok(s).input_ids
