"""Files written beside and renamed into place: a link planted at any name grpo-nb writes (to a file
elsewhere, to a folder, dangling) is replaced or refused, never written or deleted through; the save
still succeeds, and nothing is left behind."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch

import grpo_nb.checkpointing as ckpt
from grpo_nb import atomic_files, save_adapter, save_gguf, save_merged
from grpo_nb.saving import load_for_inference
from grpo_nb.tracking import CompletionsFile, drop_lines_after
from test_gguf import bpe_tokenizer
from test_saving import base_folder, logits, trained
from tiny_models import lora_model
from tiny_models import tiny_model, tiny_tokenizer

GONE = 2**31 - 1  # a process id no process has


@pytest.fixture
def outside(tmp_path):
    """What planted links point to: a file and a folder outside the folder written, and a dangling target."""
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "precious.txt").write_text("precious")
    (tmp_path / "outside" / "folder").mkdir()
    (tmp_path / "outside" / "folder" / "kept.txt").write_text("kept")

    def untouched():
        return {str(p.relative_to(tmp_path / "outside")): p.read_text() for p in (tmp_path / "outside").rglob("*")
                if p.is_file()} == {"precious.txt": "precious", "folder/kept.txt": "kept"}

    return {"file": tmp_path / "outside" / "precious.txt", "folder": tmp_path / "outside" / "folder",
            "dangling": tmp_path / "outside" / "missing", "untouched": untouched}


def plant(link: Path, target: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, link)
    return link


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ----------------------------------------------------------------------------- the writer itself

@pytest.mark.parametrize("kind", ["file", "folder", "dangling"])
def test_write_file_replaces_a_link_at_its_target(tmp_path, outside, kind):
    target = plant(tmp_path / "out" / "data.txt", outside[kind])
    atomic_files.write_file(target, lambda tmp: tmp.write_text("new"))
    assert not target.is_symlink() and target.read_text() == "new"
    assert outside["untouched"]() and listing(tmp_path / "out") == ["data.txt"]


def test_a_failed_write_keeps_the_old_file_and_leaves_nothing(tmp_path):
    (tmp_path / "data.txt").write_text("old")

    def fail(tmp):
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_files.write_file(tmp_path / "data.txt", fail)
    assert listing(tmp_path) == ["data.txt"] and (tmp_path / "data.txt").read_text() == "old"


@pytest.mark.parametrize("kind", ["file", "folder", "dangling", "real folder"])
def test_write_folder_replaces_what_is_at_its_target_whole(tmp_path, outside, kind):
    target = tmp_path / "out" / "checkpoint-1"
    if kind == "real folder":
        target.mkdir(parents=True)
        (target / "stale.txt").write_text("stale")
    else:
        plant(target, outside[kind])
    atomic_files.write_folder(target, lambda tmp: (tmp / "a.txt").write_text("a"))
    assert not target.is_symlink() and listing(target) == ["a.txt"]
    assert outside["untouched"]() and listing(tmp_path / "out") == ["checkpoint-1"]


def test_a_failed_folder_write_keeps_the_old_folder(tmp_path):
    (tmp_path / "checkpoint-1").mkdir()
    (tmp_path / "checkpoint-1" / "a.txt").write_text("old")
    with pytest.raises(ValueError):
        atomic_files.write_folder(tmp_path / "checkpoint-1", lambda tmp: int("half written"))
    assert listing(tmp_path) == ["checkpoint-1"] and (tmp_path / "checkpoint-1" / "a.txt").read_text() == "old"


def test_write_into_replaces_links_at_file_and_folder_names(tmp_path, outside):
    folder = tmp_path / "out"
    plant(folder / "weights.safetensors", outside["file"])
    plant(folder / "config.json", outside["dangling"])
    plant(folder / "sub", outside["folder"])
    (folder / "theirs.txt").write_text("stays")

    def write(tmp):
        for name in ("weights.safetensors", "config.json"):
            (tmp / name).write_text(name)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "inner.txt").write_text("inner")

    atomic_files.write_into(folder, write)
    assert outside["untouched"]()
    assert listing(folder) == ["config.json", "sub", "theirs.txt", "weights.safetensors"]  # nothing hidden left
    assert not any(p.is_symlink() for p in folder.iterdir())
    assert (folder / "weights.safetensors").read_text() == "weights.safetensors"
    assert listing(folder / "sub") == ["inner.txt"]


def test_write_into_renames_nothing_unless_every_name_takes_what_is_written(tmp_path):
    # A folder planted at a file's name (or a file at a folder's): refused before the first rename, so the
    # folder is left as it was, not half new files and half old ones.
    folder = tmp_path / "out"
    (folder / "model.safetensors").mkdir(parents=True)
    (folder / "config.json").write_text("old")

    def write(tmp):
        (tmp / "config.json").write_text("new")
        (tmp / "model.safetensors").write_text("weights")

    with pytest.raises(IsADirectoryError, match=r"model.safetensors is a folder, where a file .* Nothing was written"):
        atomic_files.write_into(folder, write)
    assert listing(folder) == ["config.json", "model.safetensors"] and (folder / "config.json").read_text() == "old"
    (folder / "sub").write_text("a file")
    with pytest.raises(NotADirectoryError, match="sub is a file, where a folder"):
        atomic_files.write_into(folder, lambda tmp: (tmp / "sub").mkdir())
    with pytest.raises(NotADirectoryError, match="sub is a file, where a folder .* move it away"):
        atomic_files.write_folder(folder / "sub", lambda tmp: (tmp / "a.txt").write_text("a"))
    assert (folder / "sub").read_text() == "a file"


def test_replaced_files_keep_their_permission_bits_and_a_kept_readme_stays(tmp_path):
    (tmp_path / "completions.jsonl").write_text("old")
    (tmp_path / "completions.jsonl").chmod(0o600)  # made private by its owner
    atomic_files.write_file(tmp_path / "completions.jsonl", lambda tmp: tmp.write_text("new"))
    assert (tmp_path / "completions.jsonl").stat().st_mode & 0o777 == 0o600
    (tmp_path / "README.md").write_text("# my notes")
    (tmp_path / "weights.bin").write_text("old")
    (tmp_path / "weights.bin").chmod(0o640)

    def write(tmp):
        (tmp / "README.md").write_text("# a fresh model card")
        (tmp / "weights.bin").write_text("new")

    atomic_files.write_into(tmp_path, write, keep=("README.md",))
    assert (tmp_path / "README.md").read_text() == "# my notes" and (tmp_path / "weights.bin").read_text() == "new"
    assert (tmp_path / "weights.bin").stat().st_mode & 0o777 == 0o640


def test_private_names_are_bounded_whatever_the_targets_name(tmp_path):
    name = "a" * 245 + ".gguf"  # a valid name, 250 bytes; its private folder's name must still fit in 255
    dead = tmp_path / f".{atomic_files._short(name)}.tmp-{GONE}-abc123"  # left by a process killed mid-write
    dead.mkdir()
    atomic_files.write_file(tmp_path / name, lambda tmp: tmp.write_text("x"))
    assert listing(tmp_path) == [name]


def test_names_and_folders_that_cannot_be_written_are_told_apart(tmp_path):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "gone").symlink_to(tmp_path / "missing")
    assert "NUL" in atomic_files.name_problem("out\x00put")
    assert "lone surrogate" in atomic_files.name_problem("out\ud800")
    assert atomic_files.name_problem("out/é") is None
    assert atomic_files.folder_problem(tmp_path / "a_file") == "this is a file"
    assert "not a folder" in atomic_files.folder_problem("/dev/null")
    assert "which does not exist" in atomic_files.folder_problem(tmp_path / "gone")
    assert atomic_files.folder_problem(tmp_path / "new") is None and atomic_files.folder_problem(tmp_path) is None


def test_leftovers_of_dead_processes_go_and_links_are_never_followed(tmp_path, outside):
    dead = tmp_path / f".checkpoint-3.tmp-{GONE}-abc123"
    (dead / "checkpoint-3").mkdir(parents=True)
    running = tmp_path / f".checkpoint-4.tmp-{os.getppid()}-abc123"  # our parent runs
    running.mkdir()
    plant(tmp_path / f".checkpoint-5.tmp-{GONE}-abc123", outside["folder"])
    plant(tmp_path / f".checkpoint-6.old-{GONE}", outside["folder"])  # grpo-nb 0.2's names
    atomic_files.remove_leftovers(tmp_path)
    assert listing(tmp_path) == sorted([running.name, f".checkpoint-5.tmp-{GONE}-abc123",
                                        f".checkpoint-6.old-{GONE}", "outside"])
    assert outside["untouched"]()


def test_remove_folder_refuses_a_link(tmp_path, outside):
    link = plant(tmp_path / "checkpoint-1", outside["folder"])
    with pytest.raises(NotADirectoryError):
        atomic_files.remove_folder(link)
    assert link.is_symlink() and outside["untouched"]()
    (tmp_path / "checkpoint-2" / "sub").mkdir(parents=True)
    atomic_files.remove_folder(tmp_path / "checkpoint-2")
    assert listing(tmp_path) == ["checkpoint-1", "outside"]


def test_append_refuses_a_link(tmp_path, outside):
    link = plant(tmp_path / "log.jsonl", outside["file"])
    with pytest.raises(OSError):
        atomic_files.open_to_append(link)
    assert outside["untouched"]()


def test_tilde_is_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert atomic_files.expand("~/out") == tmp_path / "out"
    atomic_files.write_file("~/out/a.txt", lambda tmp: tmp.write_text("a"))
    assert (tmp_path / "out" / "a.txt").read_text() == "a"


# ----------------------------------------------------------------------------- every save path

def test_save_gguf_never_writes_through_a_link(tmp_path, outside, monkeypatch):
    """The old code wrote `.model.gguf.partial` by following whatever was at that name, then renamed the
    link to model.gguf: the outside file got the model, and model.gguf became a link to it."""
    model, tok = tiny_model("llama"), bpe_tokenizer()
    plant(tmp_path / "out" / ".model.gguf.partial", outside["file"])
    plant(tmp_path / "out" / "model.gguf", outside["dangling"])
    monkeypatch.setenv("HOME", str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the test tokenizer's pre-tokenizer is not one llama.cpp knows
        assert save_gguf(model, "~/out/model.gguf", tok, quantization="f32") == tmp_path / "out" / "model.gguf"
    assert outside["untouched"]()
    assert not (tmp_path / "out" / "model.gguf").is_symlink()
    assert (tmp_path / "out" / "model.gguf").read_bytes()[:4] == b"GGUF"
    assert listing(tmp_path / "out") == [".model.gguf.partial", "model.gguf"]  # the planted link is not ours


def test_save_adapter_and_save_merged_replace_planted_links(tmp_path, outside, monkeypatch):
    model, tok = trained(base_folder(tmp_path))
    adapter, merged = save_adapter(model, tmp_path / "adapter", tok), save_merged(model, tmp_path / "merged", tok)
    # Links planted in folders a save made (a folder of links alone is someone else's: refused, see below)
    for folder, name, target in [(adapter, "adapter_model.safetensors", "file"), (adapter, "README.md", "folder"),
                                 (merged, "model.safetensors", "file"), (merged, "generation_config.json", "dangling")]:
        (folder / name).unlink()
        plant(folder / name, outside[target])
    save_adapter(model, adapter, tok)
    save_merged(model, merged, tok, dtype="float32")
    assert outside["untouched"]()
    for folder in (adapter, merged):
        assert not any(p.is_symlink() or p.name.startswith(".") for p in folder.iterdir()), listing(folder)
    monkeypatch.setenv("HOME", str(tmp_path))
    again, _ = load_for_inference("~/merged", device="cpu", dtype="float32")
    assert (logits(again) - logits(model)).abs().max() < 1e-4
    with pytest.raises(ValueError, match="a link to .*missing, which does not exist"):
        save_adapter(model, plant(tmp_path / "gone", outside["dangling"]), tok)
    plant(tmp_path / "links" / "adapter_config.json", outside["file"])
    with pytest.raises(ValueError, match=r"holds other files \(adapter_config.json\)"):
        save_adapter(model, tmp_path / "links", tok)  # a link proves nothing about the folder


def test_save_merged_again_in_other_shards_leaves_no_stale_weights(tmp_path):
    model, tok = trained(base_folder(tmp_path))
    save_merged(model, tmp_path / "merged", tok, dtype="float32")  # one model.safetensors
    save_merged(model, tmp_path / "merged", tok, dtype="float32", max_shard_bytes=2**16)  # shards and an index
    names = listing(tmp_path / "merged")
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names  # transformers would
    save_merged(model, tmp_path / "merged", tok, dtype="float32")                       # load the old one first
    assert [n for n in listing(tmp_path / "merged") if n.startswith("model")] == ["model.safetensors"]


def test_checkpoints_and_the_final_result_replace_planted_links(tmp_path, outside):
    model, tok = lora_model(), tiny_tokenizer()
    out = tmp_path / "out"
    pid = os.getpid()
    plant(out / "checkpoint-1", outside["folder"])  # the final name, and grpo-nb 0.2's temporary names
    plant(out / f".checkpoint-1.tmp-{pid}", outside["folder"])
    plant(out / f".checkpoint-1.old-{pid}", outside["dangling"])
    for name in ("adapter_model.safetensors", "history.json", f".result.tmp-{pid}"):
        plant(out / name, outside["file"])
    ckpt.save_training_checkpoint(out / "checkpoint-1", model=model, tokenizer=tok, config=None, history=[],
                                  state={"step": 1})
    ckpt.save_checkpoint(model, tok, out, history=[{"step": 1}])
    assert outside["untouched"]()
    assert ckpt.read_state(out / "checkpoint-1") == {"step": 1}
    assert json.loads((out / "history.json").read_text()) == [{"step": 1}]
    assert safetensors.torch.load_file(out / "adapter_model.safetensors")
    planted = sorted([f".checkpoint-1.tmp-{pid}", f".checkpoint-1.old-{pid}", f".result.tmp-{pid}"])
    assert [n for n in listing(out) if n.startswith(".")] == planted  # links we did not make stay; ours are gone


def test_the_history_and_config_writers_hold_any_value(tmp_path):
    # What a reward function's log_extra or a setting may hold: a save never dies on it (numbers stay numbers).
    @dataclasses.dataclass
    class Config:
        generation_kwargs: dict

    history = [{"step": np.int64(1), "extra": [np.float32(0.5), np.bool_(True), object()], "gone": np.float64("nan")}]
    ckpt.save_checkpoint(lora_model(), tiny_tokenizer(), tmp_path, config=Config({"min_new_tokens": np.int64(2)}),
                         history=history)
    saved = json.loads((tmp_path / "history.json").read_text())
    assert saved[0]["step"] == 1 and saved[0]["extra"][:2] == [0.5, True] and saved[0]["gone"] is None
    assert saved[0]["extra"][2].startswith("<object object")
    assert json.loads((tmp_path / "grpo_config.json").read_text()) == {"generation_kwargs": {"min_new_tokens": 2}}


def test_rotation_never_deletes_through_a_link(tmp_path, outside):
    plant(tmp_path / "checkpoint-1", outside["folder"])
    for step in (2, 3, 4):
        (tmp_path / f"checkpoint-{step}" / "sub").mkdir(parents=True)
    ckpt.rotate_checkpoints(tmp_path, keep=1)
    assert listing(tmp_path) == ["checkpoint-1", "checkpoint-4", "outside"]
    assert outside["untouched"]()


def test_completions_file_rewrite_and_append_never_follow_a_link(tmp_path, outside):
    path = tmp_path / "completions.jsonl"
    path.write_text(json.dumps({"step": 1, "run_id": "r"}) + "\n" + json.dumps({"step": 2, "run_id": "r"}) + "\n")
    plant(tmp_path / "completions.jsonl.tmp", outside["file"])  # the name the old code rewrote it through
    drop_lines_after(path, "r", 1)
    assert outside["untouched"]() and [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1]
    assert listing(tmp_path) == ["completions.jsonl", "completions.jsonl.tmp", "outside"]


def test_a_run_that_logged_nothing_leaves_no_completions_file(tmp_path):
    class Config:
        logging_steps, max_steps, log_completions_path = 1, 1, str(tmp_path / "out" / "completions.jsonl")

    logger = CompletionsFile(Config, "20250101-000000-abcdef")
    logger({"step": 1, "samples": []})  # log_completions=False: no rows
    logger.close()
    assert not (tmp_path / "out" / "completions.jsonl").exists()
    assert ckpt.foreign_files(tmp_path / "out") == []  # an empty file there made a rerun refuse output_dir


def test_a_completions_file_does_not_make_output_dir_someone_elses(tmp_path):
    row = {"step": 1, "prompt": "p", "completion": "c", "reward": 1.0, "run_id": "20250101-000000-abcdef"}
    (tmp_path / "completions.jsonl").write_text(json.dumps(row) + "\n")
    assert ckpt.foreign_files(tmp_path) == []  # a run killed before its first checkpoint leaves only this
    (tmp_path / "data.csv").write_text("step,run_id\n1,x\n")
    (tmp_path / "completions.jsonl").unlink()
    assert ckpt.foreign_files(tmp_path) == ["data.csv"]


def test_a_folder_of_tensorboard_event_files_does_not_make_output_dir_someone_elses(tmp_path):
    run = tmp_path / "20250101-000000-abcdef"  # logging_dir=output_dir: TensorBoard's <run id>/ folder
    run.mkdir()
    (run / "events.out.tfevents.1.host.1.0").write_bytes(b"")
    assert ckpt.foreign_files(tmp_path) == []
    (run / "notes.txt").write_text("mine")  # anything else in it is someone's
    assert ckpt.foreign_files(tmp_path) == [run.name]
