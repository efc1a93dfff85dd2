"""Byte-level text helpers shared by CRISP's tools, tests and demos.

The tiny demo model (``models/tiny-mixtral``) is trained on raw UTF-8 bytes, so the
"tokenizer" is the identity on bytes: token id ``b`` is byte ``b`` (0..255). Byte 0 is used
as a document separator when documents are concatenated; it never occurs in ordinary text.

Local text only: nothing here downloads anything.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Iterable, Sequence

import torch

VOCAB_SIZE = 256
"""Number of token ids: one per byte value."""

DOC_SEPARATOR = 0
"""Byte placed between documents by :func:`sample_sequences`."""

SPECIAL_TOKEN = "\x00"
"""The separator as text: :func:`byte_tokenizer`'s bos, eos and pad token (id ``DOC_SEPARATOR``)."""

_JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz")


def encode(text: str) -> torch.LongTensor:
    """UTF-8 bytes of ``text`` as token ids.

    Returns a LongTensor of shape ``(len(text.encode("utf-8")),)`` with values in 0..255.
    """
    data = text.encode("utf-8")
    if not data:
        return torch.zeros(0, dtype=torch.long)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long)


def decode(ids: torch.Tensor | Sequence[int]) -> str:
    """Text of the byte ids ``ids`` (shape ``(n,)``); invalid UTF-8 becomes U+FFFD.

    Raises ValueError if an id is outside 0..255.
    """
    values = ids.reshape(-1).tolist() if isinstance(ids, torch.Tensor) else list(ids)
    bad = [v for v in values if not 0 <= int(v) < VOCAB_SIZE]
    if bad:
        raise ValueError(f"decode: ids must be in 0..{VOCAB_SIZE - 1}, got {bad[:5]}")
    return bytes(int(v) for v in values).decode("utf-8", errors="replace")


def _read_jsonl_lines(path: str, lines: Iterable[str]) -> list[str]:
    texts = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
        except RecursionError as e:  # ~100k nested brackets exhaust the parser's stack
            raise ValueError(f"{path}:{lineno}: JSON nested too deeply to read") from e
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f"{path}:{lineno}: expected a JSON object with a string 'text' field")
        texts.append(record["text"])
    return texts


def read_texts(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[str]:
    """Read local documents, in the order given.

    - ``.txt``: the whole file is one document.
    - ``.jsonl``, ``.jsonl.gz``, ``.json.gz``: one JSON object per line with a ``text`` field
      (the layout of C4's shards); each line is one document.

    Raises ValueError naming the path for an unsupported suffix, a missing ``text`` field,
    invalid JSON/UTF-8 or an unreadable file.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    texts: list[str] = []
    for p in paths:
        path = os.fspath(p)
        name = path.lower()
        if not os.path.exists(path):  # before the suffix: a missing file is not "an unsupported type"
            raise ValueError(f"{path}: cannot read text (no such file)")
        try:
            if name.endswith(".txt"):
                with open(path, encoding="utf-8") as f:
                    texts.append(f.read())
            elif name.endswith(_JSONL_SUFFIXES):
                opener = gzip.open if name.endswith(".gz") else open
                with opener(path, "rt", encoding="utf-8") as f:
                    texts.extend(_read_jsonl_lines(path, f))
            else:
                raise ValueError(
                    f"{path}: unsupported file type; expected .txt, .jsonl, .jsonl.gz or .json.gz"
                )
        except (OSError, UnicodeDecodeError, EOFError, zlib.error) as e:  # zlib.error: corrupt .gz data
            raise ValueError(f"{path}: cannot read text ({type(e).__name__}: {e})") from e
    return texts


def sample_sequences(texts: Sequence[str], num_samples: int, seq_len: int, seed: int) -> torch.LongTensor:
    """Deterministic windows of ``seq_len`` byte ids from the concatenated documents.

    Documents are joined with the separator byte 0. Window starts are drawn with a
    ``torch.Generator`` seeded by ``seed`` (same inputs -> same output on every machine);
    windows may overlap when the text is short.

    Returns a LongTensor of shape ``(num_samples, seq_len)``.
    Raises ValueError if ``num_samples`` or ``seq_len`` is not positive, or if the text has
    fewer than ``seq_len`` bytes.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if isinstance(texts, str):
        texts = [texts]
    sep = bytes([DOC_SEPARATOR])
    data = sep.join(t.encode("utf-8") for t in texts)
    if len(data) < seq_len:
        raise ValueError(
            f"texts are too short for seq_len={seq_len}: need at least {seq_len} bytes, "
            f"have {len(data)} (from {len(texts)} document(s))"
        )
    stream = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # (total_bytes,)
    gen = torch.Generator().manual_seed(int(seed))
    starts = torch.randint(0, len(data) - seq_len + 1, (num_samples,), generator=gen)  # (num_samples,)
    offsets = torch.arange(seq_len)  # (seq_len,)
    return stream[starts[:, None] + offsets[None, :]].to(torch.long)  # (num_samples, seq_len)


def byte_tokenizer(model_max_length: int | None = None):
    """This byte-level encoding as a transformers tokenizer (``PreTrainedTokenizerFast``).

    Token id ``b`` is byte ``b``, exactly as :func:`encode` / :func:`decode`, for any text. The
    document separator (byte 0, the NUL character) is the bos, eos and pad token: generation
    stops at a separator, batches pad with it, and ``skip_special_tokens`` drops it. Nothing is
    added around the text (no bos), so ``tokenizer(text).input_ids == encode(text).tolist()``.
    ``tokenizer.save_pretrained(folder)`` writes the standard files (tokenizer.json,
    tokenizer_config.json) that ``AutoTokenizer.from_pretrained(folder)`` reads offline.

    Imports ``tokenizers`` and ``transformers`` (the ``hf`` extra) only when called.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # The byte-level pre-tokenizer shows byte b as the printable character bytes_to_unicode()[b]
    # (GPT-2's table: printable bytes map to themselves, the others to U+0100 upwards); the vocabulary
    # maps that character to id b. Byte 0 is the special token instead: the added-token pass takes
    # every NUL out of the text before the pre-tokenizer, so its table character never reaches the model.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(VOCAB_SIZE):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(VOCAB_SIZE + extra)
            extra += 1
    vocab = {(SPECIAL_TOKEN if b == DOC_SEPARATOR else table[b]): b for b in range(VOCAB_SIZE)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per byte
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(SPECIAL_TOKEN, special=True, normalized=False)])
    kwargs = {} if model_max_length is None else {"model_max_length": int(model_max_length)}
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIAL_TOKEN, eos_token=SPECIAL_TOKEN,
                                   pad_token=SPECIAL_TOKEN, **kwargs)
