"""Table-driven fuzz of the files the command-line tools read: bad contents give one line naming the file.

Every (option, content) pair runs the tool's ``main`` in-process; each file is read before any model
is loaded or any simulation runs, so a case costs milliseconds. ``--compare`` is read after a
simulation, so its reader is called directly.
"""

from __future__ import annotations

import gzip

import pytest
from crisp_bench import cli as bench_cli
from crisp_bench import simulate_cmd
from crisp_bench import traces as tr
from crisp_tools import evaluate
from crisp_tools import profiler as prof

CONTENTS: dict[str, bytes | None] = {
    "empty": b"",
    "folder": None,  # a folder where a file is expected
    "not utf-8": b"\xff\xfe\x00\x81",
    "deep nesting": b"[" * 100_000 + b"]" * 100_000,
    "json list": b"[1, 2]",
    "json number": b"3",
    "json null": b"null",
    "json string": b'"x"',
    "truncated json": b'{"format": ',
    "zeros": bytes(100),
    "wrong format": b'{"format": "something-else", "version": 1}',
}

# option -> (tool, suffix of the file, argv around it: FILE is replaced by the path)
READERS = {
    "simulate --profile": ("bench", ".json", ["simulate", "--trace", "TRACE", "--plan", "auto", "--profile", "FILE"]),
    "simulate --profile-file": ("bench", ".json", ["simulate", "--trace", "TRACE", "--plan", "auto", "--profile",
                                                   "measured", "--profile-file", "FILE"]),
    "simulate --plan": ("bench", ".json", ["simulate", "--trace", "TRACE", "--plan", "FILE"]),
    "simulate --trace": ("bench", ".npz", ["simulate", "--trace", "FILE", "--plan", "auto"]),
    "simulate --accuracy": ("bench", ".json", ["simulate", "--trace", "TRACE", "--plan", "auto", "--accuracy", "FILE"]),
    "crisp-profile --data .jsonl": ("profile", ".jsonl", ["--model", "M", "--data", "FILE", "--out", "OUT"]),
    "crisp-profile --data .json.gz": ("profile", ".json.gz", ["--model", "M", "--data", "FILE", "--out", "OUT"]),
    "crisp-eval --data .jsonl.gz": ("eval", ".jsonl.gz", ["--model", "M", "--crisp", "P", "--data", "FILE"]),
}
# a .gz reader sees the content compressed, and also the raw bytes as a corrupt stream
GZ_RAW = True


def _write(path, content: bytes | None, suffix: str) -> None:
    if content is None:
        path.mkdir()
    elif suffix.endswith(".gz"):
        path.write_bytes(gzip.compress(content))
    else:
        path.write_bytes(content)


def _run(fn, argv, capsys):
    try:
        rc = fn(argv)
    except SystemExit as exc:
        rc = exc.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("reader", list(READERS))
def test_bad_file_contents_are_one_line_errors(reader, tmp_path, capsys):
    tool, suffix, template = READERS[reader]
    fn = {"bench": bench_cli.main, "profile": prof.main, "eval": evaluate.main}[tool]
    tr.synthetic_trace(num_layers=2, num_tokens=24).save(tmp_path / "t.npz")
    cases = dict(CONTENTS)
    if suffix.endswith(".gz") and GZ_RAW:
        cases["corrupt gzip stream"] = b"raw"  # written below without compression
    failures = []
    for i, (name, content) in enumerate(cases.items()):
        path = tmp_path / f"case{i}{suffix}"
        if name == "corrupt gzip stream":
            data = bytearray(gzip.compress(b'{"text": "hello"}\n' * 500))
            data[20:60] = bytes(40)
            path.write_bytes(bytes(data))
        else:
            _write(path, content, suffix)
        subs = {"FILE": str(path), "TRACE": str(tmp_path / "t.npz"), "M": str(tmp_path / "model"),
                "P": str(tmp_path / "pack"), "OUT": str(tmp_path / "out")}
        argv = [subs.get(a, a) for a in template]
        rc, err = _run(fn, argv, capsys)
        lines = [line for line in err.splitlines() if line.strip()]
        ok = rc == 2 and len(lines) == 1 and "error:" in lines[0] and path.name in lines[0] and "Traceback" not in err
        # a valid-but-empty text file is refused too, for being empty (it names the text, not the file)
        if not ok and rc == 2 and len(lines) == 1 and "the text is empty" in lines[0]:
            ok = True
        if not ok:
            failures.append((name, rc, err[-400:]))
    assert not failures, failures
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", list(CONTENTS))
def test_bad_compare_file_names_the_file(name, tmp_path):
    path = tmp_path / "e2e.json"
    _write(path, CONTENTS[name], ".json")
    with pytest.raises((bench_cli.CliError, ValueError)) as exc:
        simulate_cmd._compare_e2e(path, [], 0.25)
    assert str(path) in str(exc.value) and "--compare" in str(exc.value)
