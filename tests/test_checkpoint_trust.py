"""A checkpoint is data from someone else until checked: each kind of tampering with a real checkpoint
is refused, naming the file and the field, before the model's weights or output_dir change."""

import json
import math
import os
import shutil
import time
from dataclasses import fields

import pytest
import safetensors.torch
import torch

import grpo_nb.checkpointing as ckpt
from grpo_nb import train
from grpo_nb.checkpoint_schema import CheckpointError, is_kind
from grpo_nb.models import prepare_tokenizer
from grpo_nb.step import StepBatch
from grpo_nb.tracking import new_run_id, run_folder
from test_trainer import FAST, dataset, lora_model, token_id_reward
from tiny_models import tiny_tokenizer

# Two iterations per generation batch, stopped after step 1: the checkpoint holds every field train() writes,
# the generation batch still being trained on included.
SETTINGS = dict(FAST, max_steps=3, num_iterations=2, verbose=False, live=False)
STATE, TENSORS, WEIGHTS = ckpt.TRAINER_STATE, ckpt.TRAINER_TENSORS, ckpt.TRAINABLE


@pytest.fixture(scope="module")
def tokenizer():
    return prepare_tokenizer(tiny_tokenizer())


@pytest.fixture(scope="module")
def written(tmp_path_factory, tokenizer):
    """One real checkpoint, written once for the module."""
    out = tmp_path_factory.mktemp("written")

    def stop(record):
        raise KeyboardInterrupt

    train(lora_model(), tokenizer, dataset(), token_id_reward, output_dir=str(out), callbacks=[stop], **SETTINGS)
    return out / "checkpoint-1"


def optimizer_state(raw):  # the first parameter's AdamW state, as trainer_state.json encodes it
    return raw["optimizer"]["state"]["__items__"][0][1]


def batch(raw):  # the pending generation batch's fields
    return raw["pending"]["__tuple__"][0]


def numpy_rng(raw):  # ('MT19937', keys, position, has_gauss, cached_gaussian)
    return raw["rng"]["numpy"]["__tuple__"]


def put(container, key, value):
    container[key] = value


def put_tensor(tensors, marker, value):
    tensors[marker["__tensor__"]] = value


def fill(tensors, marker, value):
    tensors[marker["__tensor__"]] = torch.full_like(tensors[marker["__tensor__"]], value)


def first_weight(weights):
    name = sorted(weights)[0]
    weights[name] = torch.full_like(weights[name], math.nan)


# (edit of the decoded JSON, the state's tensors and the trainable weights; the file; the field named)
TAMPERING = {
    "run-id-a-path": (lambda r, t, w: put(r, "run_id", "../../../home/user/.ssh"), STATE, "run_id"),
    "run-id-not-a-string": (lambda r, t, w: put(r, "run_id", 7), STATE, "run_id"),
    "array-dtype-any-numpy-type": (lambda r, t, w: put(numpy_rng(r)[1], "dtype", "<U999999999"), STATE,
                                   "rng.numpy[1].dtype"),
    "tensor-not-in-the-file": (lambda r, t, w: put(r["rng"], "torch", {"__tensor__": "t999"}), STATE, "rng.torch"),
    "marker-with-extra-keys": (lambda r, t, w: put(r["rng"], "torch", {**r["rng"]["torch"], "x": 1}), STATE,
                               "rng.torch"),
    "step-negative": (lambda r, t, w: put(r, "step", -1), STATE, "step is int -1"),
    "step-fractional": (lambda r, t, w: put(r, "step", 1.5), STATE, "step is float 1.5"),
    "step-ahead-of-the-schedule": (lambda r, t, w: put(r, "step", 2), STATE, "scheduler.last_epoch"),
    "learning-rate-negative": (lambda r, t, w: put(r["scheduler"], "base_lrs", [-0.1]), STATE, "scheduler.base_lrs"),
    "scheduler-key-sets-an-attribute": (lambda r, t, w: put(r["scheduler"], "optimizer", None), STATE,
                                        "scheduler.optimizer"),
    "scheduler-state-of-a-lambda": (lambda r, t, w: put(r["scheduler"], "lr_lambdas", [{"x": 1}]), STATE,
                                    "scheduler.lr_lambdas"),
    "history-after-the-step": (lambda r, t, w: put(r["history"][0], "step", 7), STATE, "history[0].step"),
    "history-not-a-list": (lambda r, t, w: put(r, "history", {"step": 1}), STATE, "history"),
    "weights-not-finite": (lambda r, t, w: first_weight(w), WEIGHTS, "finite weights"),
    "moment-of-another-shape": (lambda r, t, w: put_tensor(t, optimizer_state(r)["exp_avg"], torch.zeros(1)), STATE,
                                "optimizer.state[0].exp_avg"),
    "moment-not-finite": (lambda r, t, w: fill(t, optimizer_state(r)["exp_avg_sq"], math.inf), STATE,
                          "optimizer.state[0].exp_avg_sq"),
    "optimizer-maximizes": (lambda r, t, w: put(r["optimizer"]["param_groups"][0], "maximize", True), STATE,
                            "optimizer.param_groups[0].maximize"),
    "optimizer-of-other-parameters": (lambda r, t, w: r["optimizer"]["param_groups"][0]["params"].append(99), STATE,
                                      "optimizer.param_groups[0].params"),
    "numpy-rng-position": (lambda r, t, w: put(numpy_rng(r), 2, 10**6), STATE, "rng.numpy"),  # numpy: a segfault
    "python-rng-state": (lambda r, t, w: put(r["rng"]["python"]["__tuple__"][1], "__tuple__", [1, 2]), STATE,
                         "rng.python"),
    "torch-rng-size": (lambda r, t, w: put_tensor(t, r["rng"]["torch"], torch.zeros(10, dtype=torch.uint8)), STATE,
                       "rng.torch"),
    "sampler-order-negative": (lambda r, t, w: put(r["sampler"], "order", [-1]), STATE, "sampler.order"),
    "rollout-device": (lambda r, t, w: put(r["rollout"], "device", "bogus:0"), STATE, "rollout.device"),
    "pending-unknown-field": (lambda r, t, w: put(batch(r), "injected", 1), STATE, "pending[0].injected"),
    "pending-token-out-of-vocabulary": (lambda r, t, w: fill(t, batch(r)["completion_ids"], 10**6), STATE,
                                        "pending[0].completion_ids"),
    "pending-advantages-not-finite": (lambda r, t, w: fill(t, batch(r)["advantages"], math.nan), STATE,
                                      "pending[0].advantages"),
    "pending-no-steps-left": (lambda r, t, w: put(r["pending"]["__tuple__"], 1, 0), STATE, "pending[1]"),
    "pending-field-wrong-type": (lambda r, t, w: put(batch(r), "num_generations", "4"), STATE,
                                 "pending[0].num_generations"),
    "pending-texts-short": (lambda r, t, w: put(batch(r), "texts", ["one"]), STATE, "pending[0].texts"),
    "pending-mask-not-0-1": (lambda r, t, w: fill(t, batch(r)["loss_mask"], 2), STATE, "pending[0].loss_mask"),
    "key-missing": (lambda r, t, w: r.pop("scaler"), STATE, "scaler is missing"),
    "field-wrong-type": (lambda r, t, w: put(r, "rng", []), STATE, "rng is list []"),
    "scaler-state-garbage": (lambda r, t, w: put(r, "scaler", {"scale": -1}), STATE, "scaler.scale"),
}


def tampered(written, folder, edit):
    """A copy of the checkpoint in `folder`/checkpoint-1, edited as `edit` says."""
    path = folder / "checkpoint-1"
    shutil.copytree(written, path)
    raw = json.loads((path / STATE).read_text())
    tensors = safetensors.torch.load_file(path / TENSORS)
    weights = safetensors.torch.load_file(path / WEIGHTS)
    edit(raw, tensors, weights)
    (path / STATE).write_text(json.dumps(raw))
    safetensors.torch.save_file(tensors, path / TENSORS)
    safetensors.torch.save_file(weights, path / WEIGHTS)
    return path


def contents(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def trainable(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("case", list(TAMPERING))
def test_tampering_is_refused_by_name_and_changes_nothing(case, written, tokenizer, tmp_path):
    edit, file, field = TAMPERING[case]
    path = tampered(written, tmp_path, edit)
    model = lora_model()
    with torch.no_grad():  # unlike the checkpoint's weights: a premature copy would show
        for p in model.parameters():
            if p.requires_grad:
                p.add_(1.0)
    before, files = trainable(model), contents(tmp_path)
    with pytest.raises(CheckpointError) as err:
        train(model, tokenizer, dataset(), token_id_reward, output_dir=str(tmp_path), resume_from_checkpoint=path,
              **SETTINGS)
    message = str(err.value)
    assert "damaged or foreign checkpoint" in message and f"({file}: " in message and field in message, message
    after = trainable(model)
    assert all(torch.equal(before[n], after[n]) for n in before), "the model's weights changed"
    assert contents(tmp_path) == files, "output_dir changed"


def test_the_checkpoint_untouched_resumes(written, tokenizer, tmp_path):
    """The tampering table's checkpoint itself passes every check (so each refusal above is its edit's)."""
    path = tampered(written, tmp_path, lambda r, t, w: None)
    model = lora_model()
    with pytest.warns(UserWarning, match="nothing to train"):  # resumed and restored, then max_steps=1 is reached
        history = train(model, tokenizer, dataset(), token_id_reward, output_dir=str(tmp_path),
                        resume_from_checkpoint=path, **{**SETTINGS, "max_steps": 1})
    assert [r["step"] for r in history] == [1]
    saved = safetensors.torch.load_file(path / WEIGHTS)
    assert all(torch.equal(saved[n], p) for n, p in trainable(model).items())


def test_every_field_of_the_pending_batch_has_a_kind_the_check_knows():
    """check_batch reads each StepBatch field's kind from its annotation: a new field of another kind must
    teach checkpoint_schema.is_kind about it (else every pending batch would be refused)."""
    samples = {"torch.Tensor": torch.zeros(1), "int": 1, "float": 1.0, "list": [], "dict": {}, "None": None}
    for f in fields(StepBatch):
        for kind in str(f.type).split("|"):
            assert kind.strip() in samples and is_kind(samples[kind.strip()], kind.strip()), (f.name, f.type)


@pytest.mark.parametrize("content", [b'["pid", 1]', b'{"pid": "123", "host": "h", "started": "t"}',
                                     b'{"pid": -1, "host": "h", "started": "t"}', b'{"pid": 0, "host": "h"}',
                                     b'{"pid": 1e400, "host": "h", "started": "t"}', b"\xff\xfe garbage"])
def test_a_lock_file_of_garbage_is_refused_and_kept(tmp_path, content):
    lock = tmp_path / ckpt.LOCK
    lock.write_bytes(content)
    with pytest.raises(CheckpointError, match=r"damaged or foreign lock file .*delete"):
        with ckpt.output_dir_lock(tmp_path):
            pass
    assert lock.read_bytes() == content  # not taken over: grpo-nb cannot tell whether a run holds it


def test_an_empty_lock_file_left_by_a_killed_writer_is_taken_over(tmp_path):
    lock = tmp_path / ckpt.LOCK
    lock.write_bytes(b"")
    old = time.time() - 60
    os.utime(lock, (old, old))
    with ckpt.output_dir_lock(tmp_path):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert not lock.exists()


def test_run_folder_takes_run_ids_only():
    assert run_folder("my run", "20250101-120000-a1b2c3") == "my-run-20250101-120000-a1b2c3"
    assert run_folder(None, new_run_id())
    for bad in ("../../etc", "20250101-120000-a1b2c3/..", "", None, "٢٠٢٥٠١٠١-120000-a1b2c3"):
        with pytest.raises(ValueError, match="not a run id"):
            run_folder(None, bad)
