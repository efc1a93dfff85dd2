"""bench/gpu_check.sh on this CPU: it cannot run its steps here (no GPU), so what is checked is its syntax,
its dry-run listing (steps in value order, every command one the package accepts) and its deadline logic
(a budget too small for every step skips them all, cleanly, saying so)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from crisp_bench import cli as bench_cli

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
ORDER = ["h2d-cpu-busy", "hybrid-step", "prefetch-step", "e2e-hybrid", "pytest-gpu", "kernel-tests", "transfer", "e2e",
         "simulate-measured", "layer", "kernels", "cpu-kernel", "planner"]


def run(*args, env=None):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable, **(env or {})})


def test_syntax():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_dry_run_lists_the_steps_in_value_order_and_their_commands_parse(tmp_path):
    res = run("--dry-run", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    assert not (tmp_path / "out").exists()  # a dry run writes nothing
    steps = [shlex.split(line)[1:] for line in res.stdout.splitlines() if line.startswith("STEP ")]
    assert [s[0] for s in steps] == ORDER
    parser = bench_cli.build_parser()
    for name, needs, *cmd in steps:
        assert int(needs) > 0
        assert cmd[0] == sys.executable
        if cmd[1:3] == ["-m", "crisp_bench.cli"]:
            # an unknown option or value exits 2 here; "cuda" is refused at parse time without a GPU
            parser.parse_args(["cpu" if a == "cuda" else a for a in cmd[3:]])
        elif cmd[1:3] == ["-m", "crisp_bench.hybrid_check"]:
            assert cmd[3:] in (["copy"], ["step"], ["prefetch"]), name
        elif cmd[1:3] == ["-m", "pytest"]:
            for arg in cmd[3:]:
                if arg.startswith("tests"):
                    assert (ROOT / arg).exists(), arg


def test_a_spent_budget_skips_every_step_cleanly(tmp_path):
    out = tmp_path / "out"
    res = run(str(out), env={"TOTAL_BUDGET_S": "0"})
    assert res.returncode == 0, res.stdout + res.stderr
    lines = (out / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in lines] == ORDER
    assert all("skipped: 0s left of TOTAL_BUDGET_S=0s, it needs ~" in line for line in lines)
    assert not any((out / f"{name}.txt").exists() for name in ORDER)  # nothing ran


@pytest.mark.parametrize("env", [{"TOTAL_BUDGET_S": "ten"}, {"STEP_TIMEOUT": "-1"}, {"TOTAL_BUDGET_S": "1.5"}])
def test_bad_budget_refused(tmp_path, env):
    res = run(str(tmp_path / "out"), env=env)
    assert res.returncode == 2 and res.stderr.startswith("error: TOTAL_BUDGET_S and STEP_TIMEOUT must be whole")
