"""`crisp-bench report`: the result tables rebuilt from the committed records under bench/results/, the safety of
its --markdown output, and that each record's regenerating command names a real tool and real options."""

from __future__ import annotations

import functools
import hashlib
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from crisp_bench import cli
from crisp_bench.report_cmd import MARKER, RESULTS_DIR, build_report, check_index, install_records, load_index

ROOT = Path(__file__).resolve().parent.parent
INDEX = load_index(RESULTS_DIR)


def run_cli(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_report_prints_every_table_from_the_committed_records(capsys):
    code, out, err = run_cli(["report"], capsys)
    assert code == 0, err
    for table in INDEX["tables"]:
        assert f"### {table['title']}" in out
    assert out.startswith(MARKER)
    # a figure read from a record, not typed into the index: CRISP's relative loss of the committed evaluation
    rec = json.loads((RESULTS_DIR / "eval-tiny-mixtral.json").read_text())
    crisp = next(r for r in rec["records"] if r["policy"] == "crisp")
    assert f"CRISP {crisp['relative_accuracy_loss_vs_full']:.2%}" in out


def test_check_passes_on_the_committed_records(capsys):
    code, out, err = run_cli(["report", "--check"], capsys)
    assert (code, out, err) == (0, "", "")


def test_every_record_under_results_is_described():
    described = set(INDEX["records"])
    present = {p.name for p in RESULTS_DIR.iterdir() if p.name != "index.json" and not p.name.endswith(".md")}
    assert present <= described, f"records without an index entry: {sorted(present - described)}"
    for name, meta in INDEX["records"].items():
        assert set(meta) >= {"what", "kind", "hardware", "date", "command"}, name
        assert meta["kind"] in ("measured", "simulated", "input"), name
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", meta["date"]), name


def _copy_results(tmp_path) -> Path:
    dst = tmp_path / "results"
    shutil.copytree(RESULTS_DIR, dst)
    return dst


@pytest.mark.parametrize("damage, message", [
    ("missing-record", "missing"),
    ("no-match", "entries match"),
    ("not-a-number", "not a number"),
])
def test_a_broken_record_is_a_clear_error(tmp_path, capsys, damage, message):
    results = _copy_results(tmp_path)
    path = results / "eval-tiny-mixtral.json"
    if damage == "missing-record":
        path.unlink()
    else:
        rec = json.loads(path.read_text())
        crisp = next(r for r in rec["records"] if r["policy"] == "crisp")
        if damage == "no-match":
            crisp["policy"] = "renamed"
        else:
            crisp["relative_accuracy_loss_vs_full"] = None
        path.write_text(json.dumps(rec))
        install_records(results, [path])  # as a regenerated record would be: the content checks, not the digest
    code, out, err = run_cli(["report", "--results", str(results)], capsys)
    assert code == 2
    assert message in err and err.count("\n") == 1


def test_a_dotted_field_reads_inside_an_entry(tmp_path):
    from crisp_bench.report_cmd import _Records, _value
    (tmp_path / "r.json").write_text(json.dumps({"records": [{"k": 1, "paired": {"median": 0.75}}]}))
    digest = hashlib.sha256((tmp_path / "r.json").read_bytes()).hexdigest()
    records = _Records(tmp_path, {"records": {"r.json": {"sha256": digest}}})
    assert _value({"record": "r.json", "field": "paired.median", "select": {"k": 1}}, {}, records) == 0.75
    with pytest.raises(Exception, match="not a number"):
        _value({"record": "r.json", "field": "paired.nope", "select": {"k": 1}}, {}, records)
    with pytest.raises(Exception, match="not a number"):
        _value({"record": "r.json", "field": "k.median", "select": {"k": 1}}, {}, records)


def test_unknown_table_is_refused(capsys):
    code, _, err = run_cli(["report", "--table", "nope"], capsys)
    assert code == 2 and "--table nope" in err


def test_markdown_written_atomically_and_never_over_a_users_file(tmp_path, capsys):
    out = tmp_path / "results.md"
    assert run_cli(["report", "--markdown", str(out)], capsys)[0] == 0
    first = out.read_text()
    assert first == build_report(RESULTS_DIR)
    # its own earlier output is replaced
    assert run_cli(["report", "--markdown", str(out), "--table", "results"], capsys)[0] == 0
    assert out.read_text() == build_report(RESULTS_DIR, ["results"])
    # a file it did not write is refused, and left as it was
    notes = tmp_path / "notes.md"
    notes.write_text("my notes\n")
    code, _, err = run_cli(["report", "--markdown", str(notes)], capsys)
    assert code == 2 and "--force" in err
    assert notes.read_text() == "my notes\n"
    assert run_cli(["report", "--markdown", str(notes), "--force"], capsys)[0] == 0
    assert notes.read_text().startswith(MARKER)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.md", "results.md"]  # no temporary left


def test_force_without_markdown_is_refused(capsys):
    rc, _, err = run_cli(["report", "--force"], capsys)
    assert rc == 2 and "--force: only with --markdown" in err


def test_docs_results_page_is_the_reports_output():
    """docs/results.md is `crisp-bench report --markdown docs/results.md`, current with the records."""
    assert (ROOT / "docs" / "results.md").read_text() == build_report(RESULTS_DIR)


def _tool_argv(words: list[str]) -> list[str]:
    if words[0] in ("crisp-bench", "crisp-eval", "crisp-profile", "crisp-pack"):
        argv = [str(Path(sys.executable).parent / words[0])]
        if words[0] == "crisp-bench" and len(words) > 1 and not words[1].startswith("-"):
            argv.append(words[1])
        return argv
    assert words[:2] == ["python", "-m"], words
    return [sys.executable, "-m", words[2]]


COMMANDS = sorted({m["command"] for m in INDEX["records"].values() if m["command"] != "-"})


@functools.cache
def _help_of(argv: tuple[str, ...]) -> subprocess.CompletedProcess:
    """A tool's --help, run once per tool: the 30-odd commands name about ten tools (~3.5 s a start here)."""
    return subprocess.run([*argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("command", COMMANDS)
def test_each_regenerating_command_names_a_tool_and_its_options(command):
    words = shlex.split(command)
    done = _help_of(tuple(_tool_argv(words)))
    assert done.returncode == 0, done.stderr[-2000:]
    for opt in (w.split("=")[0] for w in words if w.startswith("--")):
        assert re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", done.stdout), f"{command}: no option {opt}"


def test_check_finds_an_index_entry_without_its_file(tmp_path):
    results = _copy_results(tmp_path)
    (results / "stream-rss-2gb.json").unlink()
    from crisp_bench.common import CliError

    with pytest.raises(CliError, match="stream-rss-2gb.json"):
        check_index(results)


def _damage(results: Path, damage: str) -> str:
    """Break one thing of a copied results folder; returns the file the error must name."""
    index_path, rec_path = results / "index.json", results / "eval-tiny-mixtral.json"
    index = json.loads(index_path.read_text())
    row = index["tables"][0]["rows"][0]  # reads eval-tiny-mixtral.json
    if damage == "truncated-record":
        rec_path.write_text(rec_path.read_text()[:100])
        return rec_path.name
    if damage in ("record-a-list", "records-a-string", "records-of-strings"):
        rec = {"record-a-list": [1, 2, 3], "records-a-string": {"records": "x"},
               "records-of-strings": {"records": ["x", "y"]}}[damage]
        rec_path.write_text(json.dumps(rec))
        if isinstance(rec, dict):  # installed (its digest recorded): the content checks must catch it
            install_records(results, [rec_path])
        return rec_path.name
    if damage == "tables-a-string":
        index["tables"] = "results"
    elif damage == "row-without-values":
        del row["values"]
    elif damage == "template-names-an-unknown-value":
        row["template"] += " {nope}"
    elif damage == "description-without-command":
        del index["records"]["eval-tiny-mixtral.json"]["command"]
    elif damage == "zero-denominator":
        rec = json.loads(rec_path.read_text())
        next(r for r in rec["records"] if r["policy"] == "crisp")["bytes_fraction_of_full"] = 0
        rec_path.write_text(json.dumps(rec))
        install_records(results, [rec_path])
        index = json.loads(index_path.read_text())
        row = index["tables"][0]["rows"][0]
        row["values"]["crisp"] = {"ratio": [row["values"]["crisp"], row["values"]["bytes"]]}
    elif damage == "record-outside-results":
        (results.parent / "outside.json").write_text(rec_path.read_text())
        index["records"]["../outside.json"] = index["records"]["eval-tiny-mixtral.json"]
        row["record"] = "../outside.json"
    index_path.write_text(json.dumps(index))
    return "index.json"


@pytest.mark.parametrize("damage", [
    "truncated-record", "record-a-list", "records-a-string", "records-of-strings", "tables-a-string",
    "row-without-values", "template-names-an-unknown-value", "description-without-command", "zero-denominator",
    "record-outside-results",
])
@pytest.mark.parametrize("check", [False, True])
def test_a_corrupted_record_or_index_is_a_one_line_error_naming_the_file(tmp_path, capsys, damage, check):
    results = _copy_results(tmp_path)
    name = _damage(results, damage)
    code, out, err = run_cli(["report", "--results", str(results), *(["--check"] if check else [])], capsys)
    assert code == 2 and err.count("\n") == 1 and "internal error" not in err, err
    assert name in err or (damage == "zero-denominator" and "denominator" in err), err
    if damage == "record-outside-results":
        assert "outside the results folder" in err


@pytest.mark.parametrize("target", ["index.json", "eval-tiny-mixtral.json", "new.md"])
def test_markdown_never_writes_onto_the_reports_inputs_even_with_force(tmp_path, capsys, target):
    results = _copy_results(tmp_path)
    before = {p.name: p.read_bytes() for p in results.iterdir()}
    code, _, err = run_cli(["report", "--results", str(results), "--markdown", str(results / target), "--force"],
                           capsys)
    assert code == 2 and f"--markdown {results / target}: " in err and "--results" in err, err
    assert err.count("\n") == 1
    assert {p.name: p.read_bytes() for p in results.iterdir()} == before


def test_check_refuses_an_unknown_table(capsys):
    code, out, err = run_cli(["report", "--check", "--table", "nope"], capsys)
    assert code == 2 and "--table nope" in err and out == ""


# ---------------------------------------------------------------------------- record digests, --install


def _edit_a_figure(path: Path) -> None:
    """Change one number of a record by hand (a figure no command wrote)."""
    rec = json.loads(path.read_text())
    next(r for r in rec["records"] if r["policy"] == "crisp")["relative_accuracy_loss_vs_full"] = 0.001
    path.write_text(json.dumps(rec, indent=1))


@pytest.mark.parametrize("check", [False, True])
def test_a_record_edited_by_hand_is_refused_by_name(tmp_path, capsys, check):
    results = _copy_results(tmp_path)
    _edit_a_figure(results / "eval-tiny-mixtral.json")
    code, out, err = run_cli(["report", "--results", str(results), *(["--check"] if check else [])], capsys)
    assert code == 2 and err.count("\n") == 1 and out == ""
    assert "eval-tiny-mixtral.json: its sha256" in err and "--install" in err


def test_a_record_unused_by_any_table_is_checked_too(tmp_path, capsys):
    results = _copy_results(tmp_path)
    index = load_index(results)
    used = {v.get("record", r.get("record")) for t in index["tables"] for r in t["rows"] if isinstance(r, dict)
            for v in r.get("values", {}).values() if isinstance(v, dict)}
    unused = sorted(set(index["records"]) - used)
    assert unused, "every record feeds a table: nothing to check here"
    path = results / unused[0]
    path.write_bytes(path.read_bytes() + b" ")
    code, _, err = run_cli(["report", "--results", str(results), "--check"], capsys)
    assert code == 2 and unused[0] in err


def test_install_copies_a_regenerated_record_and_records_its_digest(tmp_path, capsys):
    results = _copy_results(tmp_path)
    before = {p.name: p.read_bytes() for p in results.iterdir()}
    regenerated = tmp_path / "eval-tiny-mixtral.json"
    shutil.copy(results / "eval-tiny-mixtral.json", regenerated)
    _edit_a_figure(regenerated)
    code, out, _ = run_cli(["report", "--results", str(results), "--install", str(regenerated)], capsys)
    assert code == 0 and "installed" in out
    assert (results / "eval-tiny-mixtral.json").read_bytes() == regenerated.read_bytes()
    index = load_index(results)
    assert index["records"]["eval-tiny-mixtral.json"]["sha256"] == hashlib.sha256(regenerated.read_bytes()).hexdigest()
    changed = {p.name for p in results.iterdir() if before.get(p.name) != p.read_bytes()}
    assert changed == {"eval-tiny-mixtral.json", "index.json"}
    code, out, _ = run_cli(["report", "--results", str(results), "--check"], capsys)
    assert code == 0
    # a record regenerated in place: only its digest is recorded
    in_place = results / "eval-tiny-deepseek.json"
    in_place.write_bytes(in_place.read_bytes() + b"\n")
    assert run_cli(["report", "--results", str(results), "--install", str(in_place)], capsys)[0] == 0
    assert run_cli(["report", "--results", str(results), "--check"], capsys)[0] == 0


@pytest.mark.parametrize(("name", "content", "needle"), [
    ("not-described.json", b"{}", "describes no record 'not-described.json'"),
    ("eval-tiny-mixtral.json", b"[1, 2]", "not a JSON record"),
    ("eval-tiny-mixtral.json", b"{not json", "not a JSON record"),
    ("eval-tiny-mixtral.json", b"[" * 100_000, "nested deeper than the parser goes"),
    ("eval-tiny-mixtral.json", None, "no such file"),
])
def test_install_refuses_what_is_not_a_described_record_and_writes_nothing(tmp_path, capsys, name, content, needle):
    results = _copy_results(tmp_path)
    before = {p.name: p.read_bytes() for p in results.iterdir()}
    good = tmp_path / "eval-tiny-deepseek.json"
    shutil.copy(results / "eval-tiny-deepseek.json", good)
    bad = tmp_path / "in" / name
    bad.parent.mkdir()
    if content is not None:
        bad.write_bytes(content)
    code, _, err = run_cli(["report", "--results", str(results), "--install", str(good), str(bad)], capsys)
    assert code == 2 and needle in err
    assert {p.name: p.read_bytes() for p in results.iterdir()} == before  # the good one is not installed either


def test_install_is_used_alone(capsys):
    code, _, err = run_cli(["report", "--install", "x.json", "--check"], capsys)
    assert code == 2 and "--install: alone" in err


def test_install_refuses_another_records_content_under_a_records_name(tmp_path, capsys):
    results = _copy_results(tmp_path)
    before = {p.name: p.read_bytes() for p in results.iterdir()}
    swapped = tmp_path / "in" / "eval-tiny-mixtral.json"
    swapped.parent.mkdir()
    shutil.copy(results / "eval-tiny-deepseek.json", swapped)  # the DeepSeek figures under the Mixtral record's name
    code, _, err = run_cli(["report", "--results", str(results), "--install", str(swapped)], capsys)
    assert code == 2 and "not a regeneration of eval-tiny-mixtral.json" in err and "tiny-deepseek" in err
    assert {p.name: p.read_bytes() for p in results.iterdir()} == before


@pytest.mark.parametrize("case", ["the-same-name-twice", "destination-is-a-folder"])
def test_install_checks_every_destination_before_writing_any(tmp_path, capsys, case):
    results = _copy_results(tmp_path)
    first = tmp_path / "in" / "eval-tiny-deepseek.json"
    first.parent.mkdir()
    shutil.copy(results / "eval-tiny-deepseek.json", first)
    first.write_bytes(first.read_bytes() + b"\n")  # a regeneration: other bytes, the same record
    if case == "the-same-name-twice":
        second, needle = results / "eval-tiny-deepseek.json", "given more than once"
    else:
        second, needle = tmp_path / "in" / "eval-tiny-mixtral.json", "not a regular file"
        shutil.copy(results / "eval-tiny-mixtral.json", second)
        (results / "eval-tiny-mixtral.json").unlink()
        (results / "eval-tiny-mixtral.json").mkdir()
    before = {p.name: (p.read_bytes() if p.is_file() else None) for p in results.iterdir()}
    code, _, err = run_cli(["report", "--results", str(results), "--install", str(first), str(second)], capsys)
    assert code == 2 and needle in err and "internal error" not in err
    assert {p.name: (p.read_bytes() if p.is_file() else None) for p in results.iterdir()} == before


@pytest.mark.parametrize("damage", [b"\xff", b"[" * 100_000])
def test_an_index_that_is_no_utf8_or_too_deep_is_a_one_line_error(tmp_path, capsys, damage):
    results = _copy_results(tmp_path)
    (results / "index.json").write_bytes(damage)
    for argv in (["--check"], ["--install", str(results / "eval-tiny-mixtral.json")]):
        code, _, err = run_cli(["report", "--results", str(results), *argv], capsys)
        assert code == 2 and "index.json: not JSON" in err and "internal error" not in err
