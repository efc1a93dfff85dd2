"""Nothing a user owns is deleted or overwritten by the command-line tools (reproducers of each way it could).

Each test is one way a user's file could be lost: the work folder of crisp-profile, its --out, output
options aimed at inputs, outputs that cannot be written, Ctrl-C, corrupt inputs. Most are refused
before any model is loaded; a few run crisp-profile for real on the tiny random Mixtral (~1 s each).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from crisp_bench import cli as bench_cli  # noqa: E402
from crisp_bench import simulate_cmd  # noqa: E402
from crisp_bench import traces as tr  # noqa: E402
from crisp_tools import evaluate, evidence, key_study  # noqa: E402
from crisp_tools import profiler as prof  # noqa: E402
from crisp_tools.calibration import CliError  # noqa: E402
from crisp_tools.workdir import MARKER, WorkFolder  # noqa: E402
from profile_helpers import make_tiny_mixtral, write_text  # noqa: E402

from crisp_runtime.storage import outputs  # noqa: E402

# Fewer windows than tests/test_profile.py, no search: a run takes ~1 s on a 2-core CPU.
FAST = ["--samples", "8", "--seq-len", "32", "--batch-size", "4", "--dominance-samples", "8",
        "--dominance-min-tokens", "8", "--search-samples", "4", "--dominance", "routing-weight", "--threads", "1",
        "--quiet"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("safety")
    model = make_tiny_mixtral(root / "model")
    (root / "data").mkdir()
    text = write_text(root / "data" / "calib.txt")
    pack = root / "pack"
    assert prof.main(["--model", str(model), "--data", str(text), "--out", str(pack), *FAST]) == 0
    return root, model, text, pack


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def run(fn, argv, capsys) -> tuple[int, str]:
    try:
        rc = fn(argv)
    except SystemExit as exc:
        rc = exc.code
    return rc, capsys.readouterr().err


def one_line_error(err: str, *needles: str) -> None:
    # transformers' own progress bar ("Loading weights ... it/s]") precedes errors found after a model load
    lines = [line for line in err.splitlines() if line.strip() and not line.rstrip().endswith("it/s]")]
    assert len(lines) == 1 and "error:" in lines[0], err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])


# ----------------------------------------------------------------------------- crisp-profile --work-dir


@pytest.mark.parametrize("where, needle", [
    ("model", "is the input --model"),
    ("data folder", "contains the input --data"),
    ("out parent", "contains the input --out"),
    ("inside model", "lies inside the input --model"),
    ("out", "is the input --out"),
])
def test_work_dir_overlapping_an_input_is_refused(tiny, tmp_path, capsys, where, needle):
    root, model, text, _ = tiny
    out = tmp_path / "out"
    work = {"model": model, "data folder": text.parent, "out parent": tmp_path, "inside model": model / "w",
            "out": out}[where]
    before = snapshot(root)
    rc, err = run(prof.main, ["--model", str(model), "--data", str(text), "--out", str(out), "--work-dir",
                              str(work), *FAST], capsys)
    assert rc == 2
    one_line_error(err, "--work-dir", needle)
    assert snapshot(root) == before and not out.exists()


def test_work_dir_of_user_files_keeps_them(tiny, tmp_path, capsys):
    """A work dir holding the user's files: the run writes its own run-<key> folder, removes only that."""
    _, model, text, pack = tiny
    work = tmp_path / "mine"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    (work / "sub").mkdir()
    (work / "sub" / "data.bin").write_bytes(b"\x00\x01")
    out = tmp_path / "out"
    rc, _ = run(prof.main, ["--model", str(model), "--data", str(text), "--out", str(out), "--work-dir", str(work),
                            *FAST], capsys)
    assert rc == 0
    assert snapshot(work) == {"notes.txt": b"mine", "sub/data.bin": b"\x00\x01"}
    assert sorted(p.name for p in work.iterdir()) == ["notes.txt", "sub"]  # no marker: the folder was not ours
    assert (out / "plan.json").read_text() == (pack / "plan.json").read_text()


def test_two_runs_with_other_settings_keep_each_others_checkpoint(tiny, tmp_path, monkeypatch, capsys):
    """Run A gets SIGINT (Ctrl-C) after a batch; run B (another seed, same --out) completes; A resumes."""
    _, model, text, _ = tiny
    out = tmp_path / "out"
    argv_a = ["--model", str(model), "--data", str(text), "--out", str(out), *FAST]
    real_save = prof.Stats.save

    def save_then_ctrl_c(self, path, run_key):
        real_save(self, path, run_key)
        signal.raise_signal(signal.SIGINT)  # a real SIGINT through Python's default handler, as Ctrl-C sends

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    monkeypatch.setattr(prof.Stats, "save", save_then_ctrl_c)
    try:
        rc, err = run(prof.main, argv_a, capsys)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert rc == 130 and "crisp-profile: interrupted; rerun the same command to resume" in err
    assert "Traceback" not in err
    monkeypatch.setattr(prof.Stats, "save", real_save)
    work = tmp_path / ".out.crisp-work"
    (run_a,) = [p for p in work.iterdir() if p.name.startswith("run-")]
    assert (run_a / prof.STATS_FILE).is_file() and (work / MARKER).is_file() and not out.exists()
    rc, err = run(prof.main, [a for a in argv_a if a != "--quiet"] + ["--seed", "7"], capsys)  # run B, other key
    assert rc == 0 and "left alone: 1 checkpoint folder(s) of runs with other settings" in err and run_a.name in err
    assert (run_a / prof.STATS_FILE).is_file()  # A's checkpoint survived B's clean-up
    rc, err = run(prof.main, [a for a in argv_a if a != "--quiet"], capsys)
    assert rc == 0 and "resuming from" in err
    assert not work.exists()  # created by the runs, empty again: removed
    fresh = tmp_path / "fresh"  # the resumed pack equals an uninterrupted run's, byte for byte
    assert run(prof.main, [a if a != str(out) else str(fresh) for a in argv_a], capsys)[0] == 0
    for name in ("experts.safetensors", "plan.json"):
        assert (out / name).read_bytes() == (fresh / name).read_bytes(), name


def test_corrupt_checkpoint_is_redone_and_said(tiny, tmp_path, capsys):
    _, model, text, pack = tiny
    work, out = tmp_path / "w", tmp_path / "out"
    argv = ["--model", str(model), "--data", str(text), "--out", str(out), "--work-dir", str(work),
            *[a for a in FAST if a != "--quiet"]]
    assert run(prof.main, [*argv, "--keep-work"], capsys)[0] == 0  # leaves the checkpoint behind
    (ckpt,) = work.glob(f"run-*/{prof.STATS_FILE}")
    ckpt.write_bytes(ckpt.read_bytes()[:100])  # truncated
    shutil.rmtree(out)
    rc, err = run(prof.main, argv, capsys)
    assert rc == 0 and "unreadable or of another version; starting over" in err, err
    assert (out / "plan.json").read_bytes() == (pack / "plan.json").read_bytes()
    assert not work.exists()


def test_same_run_twice_at_once_is_refused(tmp_path):
    a = WorkFolder(tmp_path / "w", "k" * 64, "stats.safetensors")
    b = WorkFolder(tmp_path / "w", "k" * 64, "stats.safetensors")
    a.open()
    try:
        with pytest.raises(CliError, match="another crisp-profile run"):
            b.open()
    finally:
        a.remove()
    assert not (tmp_path / "w").exists()


# ----------------------------------------------------------------------------- crisp-profile --out


def test_out_holding_the_model_and_its_pack_is_refused(tiny, tmp_path, capsys):
    """The layout crisp-bench documents: pack files inside the model folder. The checkpoint must survive."""
    _, model, text, pack = tiny
    both = tmp_path / "model-with-pack"
    shutil.copytree(model, both)
    for f in pack.iterdir():
        shutil.copy(f, both / f.name)
    before = snapshot(both)
    for out in (both, both / "pack"):
        rc, err = run(prof.main, ["--model", str(both), "--data", str(text), "--out", str(out), *FAST], capsys)
        assert rc == 2
        one_line_error(err, "--out", "--model")
    assert snapshot(both) == before


def test_out_with_a_user_file_beside_the_pack_is_refused(tiny, tmp_path, capsys):
    _, model, text, pack = tiny
    out = tmp_path / "out"
    shutil.copytree(pack, out)
    (out / "README.md").write_text("my notes")
    before = snapshot(out)
    rc, err = run(prof.main, ["--model", str(model), "--data", str(text), "--out", str(out), *FAST], capsys)
    assert rc == 2
    one_line_error(err, "--out", "README.md")
    assert snapshot(out) == before


def test_out_is_the_data_file_or_the_folder_holding_it(tiny, capsys):
    root, model, text, _ = tiny
    before = snapshot(root)
    for out in (text, text.parent):
        rc, err = run(prof.main, ["--model", str(model), "--data", str(text), "--out", str(out), *FAST], capsys)
        assert rc == 2
        one_line_error(err, "--out", "--data")
    assert snapshot(root) == before


# ----------------------------------------------------------------------------- output options onto inputs


def _eval(model, pack, text, *extra):
    return ["--model", str(model), "--crisp", str(pack), "--data", str(text), "--quiet", *extra]


@pytest.mark.parametrize("tool, option, target", [
    ("eval", "--json", "pack.json"), ("eval", "--json", "DATA"), ("eval", "--json", "MODEL/config.json"),
    ("evidence", "--markdown", "plan.json"), ("evidence", "--json", "DATA"),
    ("evidence", "--json", "experts.safetensors"),
    ("key_study", "--json", "pack.json"), ("key_study", "--json", "DATA"),
    ("key_study", "--json", "MODEL/config.json"),
])
def test_tool_outputs_never_overwrite_inputs(tiny, capsys, tool, option, target):
    root, model, text, pack = tiny
    path = {"DATA": text, "MODEL/config.json": model / "config.json"}.get(target, pack / target)
    before = snapshot(root)
    fn = {"eval": evaluate.main, "evidence": evidence.main, "key_study": key_study.main}[tool]
    rc, err = run(fn, _eval(model, pack, text, option, str(path)), capsys)
    assert rc == 2
    one_line_error(err, option)
    assert snapshot(root) == before


@pytest.mark.parametrize("argv", [
    ["e2e", "--json", "PACK/plan.json"],
    ["e2e", "--record-trace", "PACK/experts.safetensors"],
    ["e2e", "--json", "MODEL/config.json"],
    ["transfer", "--profile-out", "PACK/plan.json"],
    ["simulate", "--record-trace", "PACK/pack.json", "--plan", "auto"],
    ["simulate", "--trace", "TRACE", "--json", "TRACE", "--plan", "auto"],
    ["layer", "--plot", "PACK/plot.png"],
])
def test_bench_outputs_never_overwrite_inputs(tiny, tmp_path, capsys, argv):
    root, model, text, pack = tiny
    tr.synthetic_trace(num_layers=2, num_tokens=24).save(tmp_path / "t.npz")
    subs = {"PACK": str(pack), "MODEL": str(model), "TRACE": str(tmp_path / "t.npz")}
    argv = [next((a.replace(k, v) for k, v in subs.items() if a.startswith(k)), a) for a in argv]
    before = snapshot(root), (tmp_path / "t.npz").read_bytes()
    rc, err = run(bench_cli.main, [*argv, "--model", str(model), "--pack", str(pack)], capsys)
    assert rc == 2
    one_line_error(err, "error:")
    assert (snapshot(root), (tmp_path / "t.npz").read_bytes()) == before


def test_outputs_that_cannot_be_written_are_found_before_the_work(tiny, tmp_path, capsys):
    root, model, text, pack = tiny
    ro = tmp_path / "ro.json"
    ro.write_text("{}")
    ro.chmod(0o444)
    (tmp_path / "d.json").mkdir()
    cases = [(ro, "read-only"), (tmp_path / "d.json", "is a folder"), (tmp_path / "none" / "x.json", "does not exist")]
    for path, needle in cases:
        rc, err = run(evaluate.main, _eval(model, pack, text, "--json", str(path)), capsys)
        assert rc == 2
        one_line_error(err, "--json", needle)
    assert ro.read_text() == "{}"


def _user_files(tmp_path: Path) -> dict[str, bytes]:
    """Files of the user's that sit where an output is asked for: notes, a JSON of another program, a picture."""
    files = {"notes.json": b"my notes, not JSON\n", "package.json": b'{"name": "mine", "format": "npm"}\n',
             "photo.png": b"\x89PNG\r\n\x1a\n" + bytes(range(64)), "empty.md": b""}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    return files


@pytest.mark.parametrize("tool, option", [("eval", "--json"), ("evidence", "--json"), ("evidence", "--markdown"),
                                          ("key_study", "--json")])
def test_tool_outputs_never_replace_a_user_file(tiny, tmp_path, capsys, tool, option):
    root, model, text, pack = tiny
    files = _user_files(tmp_path)
    fn = {"eval": evaluate.main, "evidence": evidence.main, "key_study": key_study.main}[tool]
    for name in files:
        rc, err = run(fn, _eval(model, pack, text, option, str(tmp_path / name)), capsys)
        assert rc == 2
        one_line_error(err, option, "not written by a CRISP tool", "--force")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files


def test_bench_replaces_its_own_output_but_not_a_user_file_unless_forced(tmp_path, capsys):
    files = _user_files(tmp_path)
    tr.synthetic_trace(num_layers=2, num_tokens=24).save(tmp_path / "t.npz")
    sim = ["simulate", "--trace", str(tmp_path / "t.npz"), "--plan", "auto", "--warmup", "4", "--policies", "full"]
    for name, option in (("notes.json", "--json"), ("package.json", "--json"), ("photo.png", "--plot"),
                         ("empty.md", "--json")):
        rc, err = run(bench_cli.main, [*sim, option, str(tmp_path / name)], capsys)
        assert rc == 2
        one_line_error(err, option, "not written by a CRISP tool")
    assert {n: (tmp_path / n).read_bytes() for n in files} == files
    # its own earlier outputs (and a trace it saved) are replaced without --force
    out, plot = tmp_path / "sim.json", tmp_path / "sim.png"
    for _ in range(2):
        assert run(bench_cli.main, [*sim, "--json", str(out), "--plot", str(plot)], capsys)[0] == 0
        assert outputs.written_by_crisp(out) and outputs.written_by_crisp(plot)
    assert run(bench_cli.main, ["simulate", "--trace", str(tmp_path / "t.npz"), "--plan", "auto", "--policies",
                                "full", "--warmup", "4", "--json", str(tmp_path / "t2.json")], capsys)[0] == 0
    # --force replaces a user's file the user named
    assert run(bench_cli.main, [*sim, "--json", str(tmp_path / "notes.json"), "--force"], capsys)[0] == 0
    assert json.loads((tmp_path / "notes.json").read_text())["format"] == "crisp-bench"
    # an input stays refused with --force
    rc, err = run(bench_cli.main, [*sim, "--json", str(tmp_path / "t.npz"), "--force"], capsys)
    assert rc == 2
    one_line_error(err, "--json", "is the input --trace")


def test_corpus_and_training_tools_keep_user_files(tmp_path, capsys):
    from crisp_tools import make_corpus, train_tiny_moe

    data = tmp_path / "data"
    data.mkdir()
    (data / "stdlib-calib.txt").write_text("my own calibration text\n")
    stdlib = tmp_path / "lib"
    stdlib.mkdir()
    (stdlib / "mod.py").write_text("x = 1\n")
    with pytest.raises(SystemExit, match="stdlib-calib.txt exists and was not written by this tool"):
        make_corpus.main(["--out", str(data), "--stdlib", str(stdlib)])
    assert sorted(p.name for p in data.iterdir()) == ["stdlib-calib.txt"]  # nothing written, nothing replaced
    assert make_corpus.main(["--out", str(data), "--stdlib", str(stdlib), "--force"]) == 0
    assert (data / "stdlib-train.txt").read_text().startswith("# ==== mod.py ====")
    assert (data / "stdlib-calib.txt").read_text() == ""  # one file: it went to the training split
    assert make_corpus.main(["--out", str(data), "--stdlib", str(stdlib)]) == 0  # its own files: replaced

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    with pytest.raises(SystemExit):
        train_tiny_moe.parse_args(["--out", str(ckpt)])
    assert "holds files this tool did not write" in capsys.readouterr().err
    assert train_tiny_moe.parse_args(["--out", str(ckpt), "--force"]).force
    (ckpt / "training.json").write_text(json.dumps({"hyperparameters": {}, "tokens_per_step": 1, "train_tokens": 1}))
    assert not train_tiny_moe.parse_args(["--out", str(ckpt)]).force  # a checkpoint it wrote: accepted


# ----------------------------------------------------------------------------- the output module


def test_check_outputs_follows_links_and_refuses_duplicates(tmp_path):
    data = tmp_path / "in.txt"
    data.write_text("input")
    (tmp_path / "link.json").symlink_to(data)
    os.link(data, tmp_path / "hard.json")
    for out in ("link.json", "hard.json"):
        with pytest.raises(outputs.OutputPathError, match="is the input --data"):
            outputs.check_outputs({"--json": tmp_path / out}, {"--data": [data]})
    with pytest.raises(outputs.OutputPathError, match="same file as --json"):
        outputs.check_outputs({"--json": tmp_path / "a.json", "--markdown": tmp_path / "a.json"})
    assert data.read_text() == "input"


@pytest.mark.parametrize("target", ["dangling", "crisp-output"])
def test_an_output_that_is_a_symlink_is_the_users_unless_forced(target, tmp_path, capsys):
    """A link at the output path, dangling or onto a CRISP output, is the user's: writing would replace it."""
    trace = tmp_path / "t.npz"
    tr.synthetic_trace(num_layers=2, num_tokens=24).save(trace)
    run = ["simulate", "--trace", str(trace), "--plan", "auto", "--target", "native", "--policies", "full",
           "--warmup", "4"]
    link = tmp_path / "link.json"
    if target == "crisp-output":
        assert bench_cli.main([*run, "--json", str(tmp_path / "earlier.json")]) == 0
        link.symlink_to("earlier.json")
    else:
        link.symlink_to("newtarget.json")
    capsys.readouterr()
    assert bench_cli.main([*run, "--json", str(link)]) == 2
    err = capsys.readouterr().err
    assert f"--json {link}: exists and is a symbolic link" in err and "--force" in err and err.count("\n") == 1, err
    assert link.is_symlink() and not (tmp_path / "newtarget.json").exists()
    with pytest.raises(outputs.OutputPathError, match="is a symbolic link"):
        outputs.check_outputs({"--json": link})
    assert outputs.check_outputs({"--json": link}, force=True)
    assert bench_cli.main([*run, "--json", str(link), "--force"]) == 0
    assert not link.is_symlink() and json.loads(link.read_text())["format"] == "crisp-bench"


def test_written_by_crisp_judges_by_content(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from crisp_bench import report
    from crisp_bench.report_cmd import MARKER as REPORT_MARKER
    from crisp_tools.evidence import EVIDENCE_MARKER

    ours = {"bench.json": lambda p: report.write_json(p, "simulate", []),
            "eval.json": lambda p: outputs.write_json(p, {"format": "crisp-eval", "version": 1}),
            "trace.npz": lambda p: tr.synthetic_trace(num_layers=2, num_tokens=8).save(p),
            "report.md": lambda p: p.write_text(REPORT_MARKER + "\n| a |\n"),
            "evidence.md": lambda p: p.write_text(EVIDENCE_MARKER + "\n# x\n")}
    fig = plt.figure()
    ours["plot.png"] = lambda p: fig.savefig(p, format="png", metadata=outputs.png_metadata("crisp-bench"))
    theirs = {"plain.png": lambda p: fig.savefig(p, format="png"),
              "other.json": lambda p: p.write_text('{"format": "npm"}'),
              "no-format.json": lambda p: p.write_text('{"records": []}'),
              "format-not-a-string.json": lambda p: p.write_text('{"format": {"crisp": 1}}'),
              "list.json": lambda p: p.write_text('["crisp"]'),
              "truncated.json": lambda p: p.write_text('{"format": "crisp-bench", "rec'),
              "text.md": lambda p: p.write_text("# my notes\n<!-- generated by crisp -->\n"),
              "empty": lambda p: p.write_bytes(b""),
              "garbage.npz": lambda p: p.write_bytes(b"PK\x03\x04" + bytes(100)),
              "binary": lambda p: p.write_bytes(bytes(range(256)))}
    import zipfile

    def other_npz(p):
        with zipfile.ZipFile(p, "w") as z:
            z.writestr("meta.npy", b"not an array")

    theirs["other.npz"] = other_npz
    for name, make in {**ours, **theirs}.items():
        make(tmp_path / name)
    plt.close(fig)
    assert {n for n in (*ours, *theirs) if outputs.written_by_crisp(tmp_path / n)} == set(ours)
    assert not outputs.written_by_crisp(tmp_path / "missing.json")
    assert {n: outputs.output_kind(tmp_path / n) for n in ours} == {
        "bench.json": "crisp-bench", "eval.json": "crisp-eval", "trace.npz": "crisp-routing-trace",
        "report.md": "markdown:crisp-bench report", "evidence.md": "markdown:crisp_tools.evidence",
        "plot.png": "png:crisp-bench"}
    for name in theirs:
        with pytest.raises(outputs.OutputPathError, match="not written by a CRISP tool"):
            outputs.check_outputs({"--json": tmp_path / name})
        outputs.check_outputs({"--json": tmp_path / name}, force=True)


def test_an_option_replaces_only_its_own_kind_of_output_unless_forced(tmp_path):
    from crisp_bench import report

    bench, ev = tmp_path / "bench.json", tmp_path / "eval.json"
    report.write_json(bench, "simulate", [])
    outputs.write_json(ev, {"format": "crisp-eval", "version": 1})
    kinds = {"--json": {"crisp-bench"}}
    assert outputs.check_outputs({"--json": bench}, kinds=kinds)["--json"] == bench.resolve()
    with pytest.raises(outputs.OutputPathError) as err:
        outputs.check_outputs({"--json": ev}, kinds=kinds)
    msg = str(err.value)
    assert msg.startswith(f"--json {ev}: exists and holds another CRISP output (crisp-eval, where this option writes "
                          f"crisp-bench)") and "--force" in msg and "\n" not in msg
    outputs.check_outputs({"--json": ev}, kinds=kinds, force=True)
    outputs.check_outputs({"--json": ev})  # an option whose kinds are not given replaces any CRISP output
    with pytest.raises(outputs.OutputPathError, match="holds another CRISP output"):
        outputs.check_output("--json", ev, kinds={"crisp-stream-rss"})


def test_tools_do_not_replace_each_others_results(tiny, tmp_path, capsys):
    """A benchmark's --json onto an evaluation record or a routing trace, the evaluation's onto a benchmark
    record, the evidence page onto the report's page: refused before any work, the files unchanged; --force
    replaces."""
    from crisp_bench.report_cmd import MARKER as REPORT_MARKER
    from crisp_tools.evidence import EVIDENCE_MARKER

    root, model, text, pack = tiny
    outputs.write_json(tmp_path / "eval.json", {"format": "crisp-eval", "version": 1, "records": []})
    outputs.write_json(tmp_path / "bench.json", {"format": "crisp-bench", "version": 1, "records": []})
    (tmp_path / "evidence.md").write_text(EVIDENCE_MARKER + "\n# evidence\n")
    (tmp_path / "report.md").write_text(REPORT_MARKER + "\n| a |\n")
    tr.synthetic_trace(num_layers=2, num_tokens=8).save(tmp_path / "other.npz")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    tr.synthetic_trace(num_layers=2, num_tokens=24).save(tmp_path / "t.npz")
    sim = ["simulate", "--trace", str(tmp_path / "t.npz"), "--plan", "auto", "--warmup", "4", "--policies", "full"]
    cases = [(bench_cli.main, [*sim, "--json", str(tmp_path / "eval.json")], "--json", "crisp-eval"),
             (bench_cli.main, [*sim, "--json", str(tmp_path / "other.npz")], "--json", "crisp-routing-trace"),
             (evaluate.main, _eval(model, pack, text, "--json", str(tmp_path / "bench.json")), "--json", "crisp-bench"),
             (evidence.main, _eval(model, pack, text, "--markdown", str(tmp_path / "report.md")), "--markdown",
              "markdown:crisp-bench report"),
             (key_study.main, _eval(model, pack, text, "--json", str(tmp_path / "eval.json")), "--json", "crisp-eval")]
    for fn, argv, option, kind in cases:
        rc, err = run(fn, argv, capsys)
        assert rc == 2, (argv, err)
        one_line_error(err, option, f"holds another CRISP output ({kind},", "--force")
    assert {n: (tmp_path / n).read_bytes() for n in before} == before
    assert run(bench_cli.main, [*sim, "--json", str(tmp_path / "eval.json"), "--force"], capsys)[0] == 0
    assert json.loads((tmp_path / "eval.json").read_text())["format"] == "crisp-bench"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, a folder that takes no files")
def test_a_folder_that_takes_no_files_is_refused_before_any_work(tmp_path, capsys):
    """/proc passes the permission and read-only checks for root, but no file can be made in it: each output is
    refused up front (the probe file is made and removed), not after the run's work."""
    with pytest.raises(outputs.OutputPathError, match="folder /proc does not take new files"):
        outputs.check_output("--json", "/proc/crisp-out.json")
    outputs.check_output("--json", tmp_path / "out.json")
    assert list(tmp_path.iterdir()) == []  # the probe left nothing
    tr.synthetic_trace(num_layers=2, num_tokens=24).save(tmp_path / "t.npz")
    rc, err = run(bench_cli.main, ["simulate", "--trace", str(tmp_path / "t.npz"), "--plan", "auto", "--warmup", "4",
                                   "--policies", "full", "--json", "/proc/crisp-out.json"], capsys)
    assert rc == 2
    one_line_error(err, "--json /proc/crisp-out.json", "does not take new files")


def test_atomic_write_keeps_the_old_file_when_the_write_fails(tmp_path):
    path = tmp_path / "out.json"
    outputs.write_json(path, {"a": 1})
    assert (path.stat().st_mode & 0o777) == outputs.NEW_FILE_MODE

    def fail(tmp):
        Path(tmp).write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        outputs.write_atomic(path, fail)
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary file left
    with pytest.raises(ValueError):
        outputs.write_json(path, {"x": float("nan")})  # strict JSON by default
    assert json.loads(path.read_text()) == {"a": 1}


def test_atomic_rewrite_keeps_a_reader_of_the_old_file(tmp_path):
    """A reader holding the old file (as a memory map) keeps its bytes: the new file is a new inode."""
    import mmap

    path = tmp_path / "trace.bin"
    outputs.write_bytes(path, b"old" * 1000)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        outputs.write_bytes(path, b"new")
        assert m[:6] == b"oldold"
    assert path.read_bytes() == b"new"


# ----------------------------------------------------------------------------- Ctrl-C and corrupt inputs


def test_ctrl_c_in_crisp_eval_exits_130_without_traceback(tiny, monkeypatch, capsys):
    _, model, text, pack = tiny

    class Interrupted:
        def __init__(self, *a, **k):
            raise KeyboardInterrupt

    monkeypatch.setattr(evaluate, "Evaluator", Interrupted)
    rc, err = run(evaluate.main, _eval(model, pack, text), capsys)
    assert rc == 130 and "crisp-eval: interrupted; rerun the same command" in err and "Traceback" not in err


def test_ctrl_c_in_crisp_bench_exits_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_cli, "_cmd_simulate", interrupted)
    rc, err = run(bench_cli.main, ["simulate"], capsys)
    assert rc == 130 and "crisp-bench: interrupted" in err and "Traceback" not in err


def test_ctrl_c_stops_the_default_suite(monkeypatch, capsys):
    calls = []

    def interrupted(args):
        calls.append(args.command)
        raise KeyboardInterrupt

    for name in ("_cmd_transfer", "_cmd_kernels"):
        monkeypatch.setattr(bench_cli, name, interrupted)
    rc, err = run(bench_cli.main, [], capsys)
    assert rc == 130 and calls == ["transfer"] and "Traceback" not in err


def test_bench_internal_error_names_file_and_line(monkeypatch, capsys):
    def broken(args):
        return {}["field"]

    monkeypatch.setattr(bench_cli, "_cmd_simulate", broken)
    rc, err = run(bench_cli.main, ["simulate"], capsys)
    assert rc == 1 and "internal error at test_cli_safety.py:" in err and "'field'" in err


def test_simulate_seq_len_beyond_the_models_positions(tiny, capsys):
    _, model, text, _ = tiny  # max_position_embeddings 64
    rc, err = run(bench_cli.main, ["simulate", "--model", str(model), "--text", str(text), "--plan", "auto",
                                   "--seq-len", "100000", "--sequences", "1"], capsys)
    assert rc == 2
    assert "--seq-len 100000" in err and "max_position_embeddings (64)" in err and "Traceback" not in err


def test_e2e_tokens_beyond_the_models_positions(tiny, capsys):
    _, model, text, pack = tiny
    rc, err = run(bench_cli.main, ["e2e", "--model", str(model), "--pack", str(pack), "--text", str(text),
                                   "--tokens", "100000"], capsys)
    assert rc == 2
    one_line_error(err, "--tokens 100000", "max_position_embeddings (64)", "at most 51")


def _corrupt_npz(path: Path) -> None:
    tr.synthetic_trace(num_layers=2, num_tokens=64).save(path)
    data = bytearray(path.read_bytes())
    mid = len(data) // 3
    data[mid:mid + 64] = bytes(64)  # zero a stretch of compressed data
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", ["zlib", "truncated", "not utf-8 json", "deep json", "records not a list",
                                  "record field"])
def test_corrupt_inputs_are_clear_errors(tmp_path, kind):
    if kind in ("zlib", "truncated"):
        path = tmp_path / "t.npz"
        _corrupt_npz(path)
        if kind == "truncated":
            path.write_bytes(path.read_bytes()[:200])
        with pytest.raises(tr.TraceError, match="not a readable trace"):
            tr.Trace.load(path)
        return
    path = tmp_path / "e2e.json"
    content = {"not utf-8 json": b"\xff\xfe{}", "deep json": b"[" * 100_000 + b"]" * 100_000,
               "records not a list": json.dumps({"command": "e2e", "records": {"a": 1}}).encode(),
               "record field": json.dumps({"command": "e2e", "records": [{"policy": "full",
                                                                          "tokens_per_s": "fast"}]}).encode()}[kind]
    path.write_bytes(content)
    needle = {"not utf-8 json": "not UTF-8", "deep json": "nested too deeply", "records not a list": "'records'",
              "record field": "records[0].tokens_per_s"}[kind]
    with pytest.raises((bench_cli.CliError, ValueError), match="--compare") as exc:
        simulate_cmd._compare_e2e(path, [], 0.25)
    assert needle in str(exc.value) and str(path) in str(exc.value)


def test_corrupt_trace_through_simulate_exits_2(tmp_path, capsys):
    _corrupt_npz(tmp_path / "t.npz")
    rc, err = run(bench_cli.main, ["simulate", "--trace", str(tmp_path / "t.npz"), "--plan", "auto"], capsys)
    assert rc == 2
    one_line_error(err, "t.npz", "not a readable trace")


@pytest.mark.parametrize("kind", ["corrupt gzip", "deep jsonl", "not utf-8 jsonl"])
def test_corrupt_text_inputs_exit_2(tiny, tmp_path, capsys, kind):
    _, model, _, _ = tiny
    if kind == "corrupt gzip":
        path = tmp_path / "c4.jsonl.gz"
        raw = bytearray(gzip.compress(b'{"text": "hello world"}\n' * 200))
        raw[30:60] = bytes(30)
        path.write_bytes(bytes(raw))
    elif kind == "deep jsonl":
        path = tmp_path / "d.jsonl"
        path.write_bytes(b"[" * 100_000 + b"]" * 100_000 + b"\n")
    else:
        path = tmp_path / "u.jsonl"
        path.write_bytes(b'{"text": "\xff\xfe"}\n')
    rc, err = run(prof.main, ["--model", str(model), "--data", str(path), "--out", str(tmp_path / "o"), *FAST],
                  capsys)
    assert rc == 2
    one_line_error(err, "--data", str(path))
    assert not (tmp_path / "o").exists()
