"""The README as a user runs it: its Python blocks on the committed tiny model (CPU), its commands' --help,
the set-up commands that CI runs verbatim, and a results table that is `crisp-bench report`'s own.

A Python block that needs a GPU or a network says so in a comment on its first line
(``# needs: cuda`` / ``# needs: network``) and is skipped here with that reason.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README.read_text(), flags=re.S | re.M)


PY_BLOCKS = _blocks("python")
BASH_BLOCKS = _blocks("bash")


def test_readme_has_the_blocks_a_user_needs():
    assert len(PY_BLOCKS) >= 2, "the quick start's load_model and apply blocks"
    assert any("load_model(" in b and "gpu_budget=" in b for b in PY_BLOCKS)
    assert any("apply(" in b and "gpu_budget=" in b for b in PY_BLOCKS)
    assert len(README.read_text().splitlines()) <= 300


@pytest.mark.parametrize("index", range(len(PY_BLOCKS)), ids=[f"python-block-{i}" for i in range(len(PY_BLOCKS))])
def test_python_block_runs_as_written(index, tmp_path):
    code = PY_BLOCKS[index]
    first = code.splitlines()[0] if code.strip() else ""
    needs = re.search(r"#\s*needs:\s*(\w+)", first)
    if needs:
        pytest.skip(f"README block {index} needs {needs.group(1)}")
    script = tmp_path / f"block{index}.py"
    script.write_text(code)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"README python block {index} failed:\n{code}\n--- stderr:\n{done.stderr[-4000:]}"
    assert done.stdout.strip(), "every README block prints what it shows"


def _commands() -> list[list[str]]:
    """Each command line of the README's bash blocks (continuations joined), split into words."""
    out = []
    for block in BASH_BLOCKS:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" # ")[0].strip()
            if line:
                out.append(shlex.split(line))
    return out


def _tool(words: list[str]) -> list[str] | None:
    """The program (and subcommand) of one README command, as a command line this environment runs."""
    if words[0] in ("crisp-profile", "crisp-eval", "crisp-bench", "crisp-pack"):
        sub = [words[1]] if words[0] in ("crisp-bench", "crisp-pack") and len(words) > 1 and \
            not words[1].startswith("-") else []
        return [str(Path(sys.executable).parent / words[0]), *sub]
    if words[:2] == ["python", "-m"]:
        return [sys.executable, "-m", words[2]]
    return None


def test_set_up_commands_are_what_ci_runs():
    """CI (.ci/run) runs the README's test command verbatim; the main job is the same install + crisp-bench."""
    setup = [b.strip() for b in BASH_BLOCKS if b.startswith("python3 -m venv")]
    assert len(setup) == 2
    install = setup[1].rsplit(" && ", 1)[0]
    assert setup[0] == install + " && crisp-bench"
    assert setup[1].endswith(" && python -m pytest -q")
    ci = (ROOT / ".ci" / "run").read_text()
    assert setup[1] in ci.splitlines()


def _tools() -> dict[str, list[str]]:
    out = {}
    for words in _commands():
        argv = _tool(words)
        if argv is not None:
            out[" ".join([Path(argv[0]).name, *argv[1:]])] = argv
    return out


README_TOOLS = _tools()


def test_every_readme_command_is_a_known_tool():
    names = {w[0] for w in _commands()} - {"python3"}
    assert names <= {"crisp-profile", "crisp-eval", "crisp-bench", "crisp-pack", "python", "bash"}, names


@pytest.mark.parametrize("tool", sorted(README_TOOLS))
def test_each_readme_command_has_help(tool):
    argv = README_TOOLS[tool]
    done = subprocess.run([*argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout


def test_readme_results_table_is_the_reports():
    """Every row of the README's results table is a row `crisp-bench report` builds from bench/results/."""
    from crisp_bench.report_cmd import RESULTS_DIR, build_report

    report_rows = {line for line in build_report(RESULTS_DIR, ["results"]).splitlines() if line.startswith("| ")}
    text = README.read_text()
    section = text.split("## Results", 1)[1].split("\n## ", 1)[0]
    readme_rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| figure")]
    assert readme_rows, "the README has a results table"
    for row in readme_rows:
        assert row in report_rows, f"README results row not produced by `crisp-bench report`:\n{row}"
