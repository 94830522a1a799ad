""".ci/run runs the README's quick-start commands exactly as written (it reads them from the README's
marked code block), then CI-only extras; it fails on a failing command and on pytest's "no tests
collected" (exit status 5)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CI = os.path.join(ROOT, ".ci", "run")
README = os.path.join(ROOT, "README.md")

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("awk") is None,
                                reason="needs bash and awk")


def readme_quick_start(text: str) -> list[str]:
    """The commands of the ```bash block between the quick-start markers (parsed independently of
    .ci/run's awk)."""
    match = re.search(r"^<!-- quick-start[ :-].*?$\n```bash\n(.*?)^```\n<!-- /quick-start -->$", text,
                      re.S | re.M)
    assert match, "README.md lacks the <!-- quick-start ... --> ```bash ... ``` <!-- /quick-start --> block"
    return [line for line in match.group(1).splitlines() if line.strip()]


def run_ci(root: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", os.path.join(root, ".ci", "run"), *args], capture_output=True,
                          text=True, timeout=60)


def fake_checkout(tmp_path, commands: list[str]) -> str:
    """A directory with this .ci/run and a README whose quick-start block holds ``commands``."""
    os.makedirs(tmp_path / ".ci")
    shutil.copy(CI, tmp_path / ".ci" / "run")
    block = "\n".join(commands)
    (tmp_path / "README.md").write_text(f"# x\n\n<!-- quick-start -->\n```bash\n{block}\n```\n"
                                        f"<!-- /quick-start -->\n\n```bash\nnot this\n```\n")
    return str(tmp_path)


def test_ci_extracts_exactly_the_two_readme_commands() -> None:
    with open(README) as f:
        expected = readme_quick_start(f.read())
    assert len(expected) == 2, expected
    assert expected[0].startswith("python3 -m venv .venv && ") and 'pip install -e ".[dev]"' in expected[0]
    assert "pytest tests" in expected[1]
    out = run_ci(ROOT, "--print-quick-start")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == expected


def test_ci_runs_the_quick_start_first_and_strictly() -> None:
    with open(CI) as f:
        script = f.read()
    assert "set -euo pipefail" in script
    assert 'export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"' in script
    run_at = script.index('bash -euo pipefail -c "$command"')
    # nothing installed before the quick start (torch first would hide a broken fresh install)
    code_before = [line for line in script[:run_at].splitlines() if not line.lstrip().startswith("#")]
    assert not [line for line in code_before if re.search(r"\bpip\b", line)], code_before
    assert "tests/test_megatron.py" in script[run_at:]


@pytest.mark.parametrize("commands", [["echo one"], ["echo one", "echo two", "echo three"], []])
def test_ci_refuses_a_quick_start_without_two_commands(tmp_path, commands: list[str]) -> None:
    out = run_ci(fake_checkout(tmp_path, commands), "--print-quick-start")
    assert out.returncode != 0 and "expected the 2 quick-start commands" in out.stderr


def test_ci_fails_with_the_failing_commands_status(tmp_path) -> None:
    """pytest exits 1 on a failing test and 5 when it collects nothing; CI must stop with it."""
    root = fake_checkout(tmp_path, ["echo first ran", "exit 5"])
    out = run_ci(root)
    assert out.returncode == 5, out.stdout + out.stderr
    assert "first ran" in out.stdout
    assert "build_info" not in out.stdout + out.stderr  # the extras did not run


def test_ci_stops_at_a_failing_first_command(tmp_path) -> None:
    """Even inside an `a && b` list, where `set -e` alone would carry on to the next line."""
    root = fake_checkout(tmp_path, ["false && echo not-run", "echo second-ran"])
    out = run_ci(root)
    assert out.returncode != 0 and "second-ran" not in out.stdout
