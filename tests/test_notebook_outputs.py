"""The notebooks in the repository carry the outputs of a real run of their current code (GitHub shows them)."""

import importlib.util
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
spec = importlib.util.spec_from_file_location("save_outputs", NOTEBOOKS / "save_outputs.py")
save_outputs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(save_outputs)


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("[0-9]*.ipynb")), ids=lambda p: p.stem)
def test_stored_outputs_come_from_a_run_of_the_current_code(path):
    nb = nbformat.read(path, as_version=4)
    made = nb.metadata.get("grpo_nb", {}).get("stored_outputs")
    assert made, f"{path.name} has no stored run: python notebooks/save_outputs.py {path.stem}"
    assert made["code_sha256"] == save_outputs.code_hash(nb), (
        f"{path.name} changed since its outputs were stored: python notebooks/save_outputs.py {path.stem}")
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1))  # top to bottom, every cell
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    assert sum(bool(c.outputs) for c in code) >= len(code) // 2
    fast = save_outputs.needs_gpu(nb)
    assert ("fast mode" in made["outputs"]) == fast
    if fast:  # labelled where the user reads the outputs
        assert any("FAST MODE (GRPO_NB_FAST=1)" in o.get("text", "") for c in code for o in c.outputs)


@pytest.mark.parametrize("name", ["01_quickstart", "02_gsm8k_reasoning", "03_long_context"])
def test_training_notebooks_keep_the_final_dashboard(name):
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    html = [o["data"]["text/html"] for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type in ("display_data", "execute_result") and "text/html" in o.get("data", {})]
    assert any("data:image/png;base64," in h for h in html), "the dashboard's final state (plots inlined) is missing"
