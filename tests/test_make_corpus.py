"""tools/make_corpus.py --prose: the committed held-out prose is what the command writes."""

import os
import pathlib

import pytest
from crisp_tools import make_corpus

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not all(os.path.isfile(os.path.join(make_corpus.LICENCES, n)) for n in make_corpus.PROSE_SOURCES),
                    reason="the GNU licence texts of Debian's base-files are not installed")
def test_prose_regenerates_byte_identical(tmp_path):
    assert make_corpus.main(["--prose", "--out", str(tmp_path)]) == 0
    assert (tmp_path / make_corpus.PROSE_FILE).read_bytes() == (ROOT / "data" / make_corpus.PROSE_FILE).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == [make_corpus.PROSE_FILE]  # no stdlib split written


@pytest.mark.parametrize("missing", make_corpus.PROSE_SOURCES)
def test_prose_names_a_missing_licence(tmp_path, missing):
    src = tmp_path / "licences"
    src.mkdir()
    for name in make_corpus.PROSE_SOURCES:
        if name != missing:
            (src / name).write_text(f"{name} text\n")
    with pytest.raises(SystemExit, match=f"--licences: cannot read .*{missing}"):
        make_corpus.main(["--prose", "--out", str(tmp_path / "out"), "--licences", str(src)])
    assert not (tmp_path / "out" / make_corpus.PROSE_FILE).exists()


@pytest.mark.parametrize("argv", [["--licences", "."], ["--prose", "--licences", "no-such-folder"]])
def test_licences_option_errors(tmp_path, argv, capsys):
    with pytest.raises(SystemExit) as exc:
        make_corpus.main(["--out", str(tmp_path / "out"), *argv])
    assert exc.value.code == 2 and "argument --licences: " in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
