"""A checkpoint is data from someone else until checked: each kind of tampering with a real checkpoint
is refused, naming the file and the field, before the model's weights or output_dir change."""

import contextlib
import json
import math
import os
import shutil
import signal
import time
from dataclasses import fields

import pytest
import safetensors.torch
import torch

import grpo_nb.checkpointing as ckpt
import grpo_nb.run_lock as run_lock
from grpo_nb.run_lock import LOCK
import grpo_nb.resume as resume_mod
from grpo_nb import train
from grpo_nb.checkpoint_schema import CheckpointError, is_kind
from grpo_nb.models import prepare_tokenizer
from grpo_nb.batch import StepBatch
from grpo_nb.tracking import new_run_id, run_folder
from tiny_models import FAST, dataset, lora_model, token_id_reward
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


def first_weight(weights, dtype=None):
    name = sorted(weights)[0]
    weights[name] = weights[name].to(dtype) if dtype else torch.full_like(weights[name], math.nan)


def cast(tensors, marker, dtype):
    tensors[marker["__tensor__"]] = tensors[marker["__tensor__"]].to(dtype)


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
    "sampler-world-size-zero": (lambda r, t, w: put(r["sampler"], "world_size", 0), STATE, "sampler.world_size"),
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
    # a negative second moment passes "finite" and makes the update sqrt(-1): NaN weights in the final adapter
    "moment-second-negative": (lambda r, t, w: fill(t, optimizer_state(r)["exp_avg_sq"], -1.0), STATE,
                               "optimizer.state[0].exp_avg_sq is a torch.float32 Tensor of shape (4, 64); "
                               "expected numbers >= 0"),
    "moment-integer": (lambda r, t, w: cast(t, optimizer_state(r)["exp_avg"], torch.int64), STATE,
                       "optimizer.state[0].exp_avg is a torch.int64 Tensor"),
    "state-tensor-float8": (lambda r, t, w: cast(t, r["rng"]["torch"], torch.float8_e4m3fn), STATE,
                            "rng.torch is a torch.float8_e4m3fn Tensor"),  # torch.isfinite does not take float8
    "weights-float8": (lambda r, t, w: first_weight(w, torch.float8_e5m2), WEIGHTS, "torch.float8_e5m2 Tensor"),
    "parent-run-id-a-path": (lambda r, t, w: put(r, "parent_run_id", "../.."), STATE, "parent_run_id"),
    "identity-fingerprint-not-numbers": (lambda r, t, w: put(r, "identity", {"base": {"fingerprint": [["0.1"]]},
                                                                             "dataset": {"rows": 8}}), STATE,
                                         "identity.base.fingerprint"),
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


def test_a_parameter_missing_from_the_optimizer_state_resumes_with_a_warning(written, tokenizer, tmp_path):
    """One trained parameter's AdamW entry cut from the file: the run resumes (a parameter that never had a gradient
    has no entry either), but says whose moments restart from zero and how to keep them."""
    path = tampered(written, tmp_path, lambda r, t, w: r["optimizer"]["state"]["__items__"].pop(1))
    with pytest.warns(UserWarning, match=r"no entry for 1 of the \d+ trained parameters \(\S*lora_B\S* \(64, 4\)\)"):
        history = train(lora_model(), tokenizer, dataset(), token_id_reward, output_dir=str(tmp_path),
                        resume_from_checkpoint=path, **{**SETTINGS, "max_steps": 2})
    assert [r["step"] for r in history] == [1, 2]
    # every entry gone after a trained step: the same (an optimizer state is empty only before a first update)
    empty = tampered(written, tmp_path / "empty", lambda r, t, w: r["optimizer"]["state"]["__items__"].clear())
    with pytest.warns(UserWarning, match=r"no entry for (\d+) of the \1 trained parameters"):
        train(lora_model(), tokenizer, dataset(), token_id_reward, output_dir=str(tmp_path / "empty"),
              resume_from_checkpoint=empty, **{**SETTINGS, "max_steps": 2})


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
    lock = tmp_path / LOCK
    lock.write_bytes(content)
    with pytest.raises(CheckpointError, match=r"damaged or foreign lock file .*delete"):
        with run_lock.output_dir_lock(tmp_path):
            pass
    assert lock.read_bytes() == content  # not taken over: grpo-nb cannot tell whether a run holds it


def test_an_empty_lock_file_left_by_a_killed_writer_is_taken_over(tmp_path):
    lock = tmp_path / LOCK
    lock.write_bytes(b"")
    old = time.time() - 60
    os.utime(lock, (old, old))
    with run_lock.output_dir_lock(tmp_path):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert not lock.exists()


def test_run_folder_takes_run_ids_only():
    assert run_folder("my run", "20250101-120000-a1b2c3") == "my-run-20250101-120000-a1b2c3"
    assert run_folder(None, new_run_id())
    for bad in ("../../etc", "20250101-120000-a1b2c3/..", "", None, "٢٠٢٥٠١٠١-120000-a1b2c3"):
        with pytest.raises(ValueError, match="not a run id"):
            run_folder(None, bad)


@contextlib.contextmanager
def deadline(seconds=20):
    """A read that blocks (a FIFO opened without a writer) fails the test instead of hanging it."""
    def expired(signum, frame):
        raise TimeoutError(f"still reading after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def replace_with(maker):
    def replace(path):
        path.unlink()
        maker(path)
    return replace


# A file of the checkpoint replaced (the file; what the message says about it)
REPLACED = {
    "settings-nested-too-deep": (ckpt.SETTINGS, lambda p: p.write_text("[" * 100_000 + "]" * 100_000),
                                 "RecursionError"),
    "settings-nested-deeper-than-written": (ckpt.SETTINGS, lambda p: p.write_text('{"beta": ' + "[" * 500 + "]" * 500
                                                                                  + "}"), "the settings is dict"),
    "settings-not-an-object": (ckpt.SETTINGS, lambda p: p.write_text("[1, 2]"), "the settings is list [1, 2]"),
    "state-a-fifo": (STATE, replace_with(os.mkfifo), "trainer_state.json is a FIFO, not a regular file"),
    "state-a-device": (STATE, replace_with(lambda p: p.symlink_to("/dev/null")), "is a device"),
    "weights-a-folder": (WEIGHTS, replace_with(os.mkdir), "trainable.safetensors is a folder"),
    "settings-a-fifo": (ckpt.SETTINGS, replace_with(os.mkfifo), "grpo_config.json is a FIFO"),
}


@pytest.mark.parametrize("case", list(REPLACED))
def test_a_replaced_file_is_refused_before_the_weights_change(case, written, tokenizer, tmp_path):
    file, replace, said = REPLACED[case]
    path = tampered(written, tmp_path, lambda r, t, w: None)
    replace(path / file)
    model = lora_model()
    before = trainable(model)
    with deadline(), pytest.raises(CheckpointError) as err:
        train(model, tokenizer, dataset(), token_id_reward, output_dir=str(tmp_path), resume_from_checkpoint=path,
              **SETTINGS)
    message = str(err.value)
    assert "damaged or foreign checkpoint" in message and f"{file}" in message and said in message, message
    assert all(torch.equal(before[n], p) for n, p in trainable(model).items()), "the model's weights changed"


def test_a_lock_file_that_is_not_a_file_is_refused_not_read(tmp_path):
    os.mkfifo(tmp_path / LOCK)  # reading it would wait for a writer forever
    with deadline(), pytest.raises(CheckpointError, match=r"damaged or foreign lock file .*FIFO.*delete"):
        with run_lock.output_dir_lock(tmp_path):
            pass


def test_a_checkpoint_holds_the_step_its_name_says(written, tokenizer, tmp_path):
    """checkpoint-<n> is taken for step n (True picks the highest n, rotation keeps the highest): a copy under
    another step's name is refused, and a resume is refused while output_dir holds checkpoints after its step."""
    shutil.copytree(written, tmp_path / "checkpoint-1")
    shutil.copytree(written, tmp_path / "checkpoint-7")  # "a copy", kept the way a user might
    files = contents(tmp_path)
    with pytest.raises(CheckpointError, match=r"checkpoint-7: damaged .*step is int 1; expected 7, the step its "
                                              r"folder's name says .*checkpoint-1 in the same folder"):
        train(lora_model(), tokenizer, dataset(), token_id_reward, output_dir=str(tmp_path),
              resume_from_checkpoint=True, **SETTINGS)
    with pytest.raises(ValueError, match=r"checkpoint-1 \(step 1\) .*holds checkpoint-7, numbered after step 1.*"
                                         r"Move them out of output_dir"):
        train(lora_model(), tokenizer, dataset(), token_id_reward, output_dir=str(tmp_path),
              resume_from_checkpoint=tmp_path / "checkpoint-1", **SETTINGS)
    assert contents(tmp_path) == files


def test_a_folder_that_is_no_checkpoint_names_the_real_ones(written, tmp_path):
    shutil.copytree(written, tmp_path / "checkpoint-1")
    (tmp_path / "checkpoint-99").mkdir()  # an interrupted copy
    with pytest.raises(ValueError) as err:
        resume_mod.read_training_checkpoint(ckpt.find_checkpoint(True, tmp_path), lora_model())
    message = str(err.value)
    assert "checkpoint-99: it is not a grpo-nb training checkpoint" in message and "(checkpoint-1)" in message
    assert "resume_from_checkpoint=True" not in message  # what just failed


def test_resume_from_checkpoint_text_and_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert ckpt.find_checkpoint("~/checkpoint-3", tmp_path / "out") == tmp_path / "checkpoint-3"
    for text in ("", " ", "True", "false"):
        with pytest.raises(ValueError, match="pass the bool True .* None \\(or False\\) to start fresh"):
            ckpt.find_checkpoint(text, tmp_path)


def test_a_fork_into_another_output_dir_is_a_run_of_its_own(written, tokenizer, tmp_path):
    """Resumed in its own output_dir a run keeps its id (its trackers append to it); resumed into another (a sweep
    from one checkpoint) it gets a new id, and names the run it started from."""
    import grpo_nb.trainer as trainer_mod
    from grpo_nb import GRPOConfig

    shutil.copytree(written, tmp_path / "a" / "checkpoint-1")
    settings = tmp_path / "a" / "checkpoint-1" / "grpo_config.json"  # as if written in a: where it was saved
    settings.write_text(json.dumps({**json.loads(settings.read_text()), "output_dir": str(tmp_path / "a")}))
    parent = ckpt.read_state(written)["run_id"]

    def resumed(output_dir):
        model = lora_model()
        config = GRPOConfig(**{k: v for k, v in SETTINGS.items() if k not in ("verbose", "live")},
                            output_dir=str(output_dir))
        run = trainer_mod.set_up(model, tokenizer, dataset(), config, "auto")
        return trainer_mod.resume(run, model, tmp_path / "a" / "checkpoint-1", [token_id_reward], tokenizer)

    same, fork = resumed(tmp_path / "a"), resumed(tmp_path / "b")
    assert (same.run_id, same.parent_run_id) == (parent, None)
    assert fork.run_id != parent and fork.parent_run_id == parent
    assert fork.snapshot.run_id == fork.run_id and fork.snapshot.parent_run_id == parent  # in its checkpoints


def test_a_pending_batch_made_under_other_settings_is_dropped(written, tokenizer, tmp_path):
    from grpo_nb import GRPOConfig
    from grpo_nb.checkpoint_schema import pending_misfit

    pending = ckpt.read_state(written)["pending"]  # 4 generations, 1 reward function, num_iterations=2, beta 0
    fits = dict(num_generations=4, num_iterations=2)
    assert pending_misfit(pending, GRPOConfig(**fits), 1) is None
    for change, funcs, said in [({"beta": 0.04}, 1, "without the reference policy's log-probs (ref_logprobs), "
                                                    "which beta > 0 needs"),
                                ({}, 2, "the scores of 1 reward function(s); this run has 2"),
                                ({"num_generations": 2}, 1, "groups have 4 completions each; num_generations is now 2"),
                                ({"num_iterations": 1}, 1, "(old_logprobs) for num_iterations > 1, which is no longer"),
                                ({"rollout_importance_sampling_correction": True}, 1, "(sampling_logprobs)")]:
        assert said in pending_misfit(pending, GRPOConfig(**{**fits, **change}), funcs)
    # train(): a warning, then a fresh rollout (not an IndexError in the record, nor a checkpoint it then refuses)
    shutil.copytree(written, tmp_path / "checkpoint-1")
    with pytest.warns(UserWarning, match="made under other settings: it holds the scores of 1 reward function"):
        history = train(lora_model(), tokenizer, dataset(), [token_id_reward, token_id_reward],
                        output_dir=str(tmp_path), resume_from_checkpoint=True, **{**SETTINGS, "max_steps": 2})
    assert [r["step"] for r in history] == [1, 2] and len(history[1]["rewards"]) == 2


# ----------------------------------------------------------------------------------------
# A checkpoint means something only with its base model, its LoRA setup, its rewards and data (issue 25, P3)


def with_identity(written, folder, model, tokenizer, base_name=None):
    """A copy of the checkpoint recording `model` as its base (as train() records the model it starts from), and
    `base_name` as the base its adapter_config.json names."""
    path = tampered(written, folder, lambda r, t, w: put(r, "identity", resume_mod.run_identity(model, tokenizer, dataset())))
    if base_name is not None:
        adapter = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**adapter, "base_model_name_or_path": base_name}))
    return path


def named(model, name):
    model.config.name_or_path = name  # as from_pretrained(name) sets it
    return model


def test_a_checkpoint_resumes_only_on_the_base_model_it_was_trained_on(written, tokenizer, tmp_path):
    from peft import LoraConfig, get_peft_model
    from tiny_models import tiny_model

    path = with_identity(written, tmp_path, lora_model(), tokenizer, base_name="/models/Qwen2.5-1.5B")
    resume_mod.read_training_checkpoint(path, named(lora_model(), "/models/Qwen2.5-1.5B"))
    # a moved or renamed folder, a local copy of a hub model: other names, the same weights
    resume_mod.read_training_checkpoint(path, named(lora_model(), "/home/me/base-copy"))
    with pytest.raises(ValueError, match=r"trained on '/models/Qwen2.5-1.5B', and this model \('/models/Qwen2.5-1.5B-"
                                         r"Instruct'\) has other base weights .*load that model and resume again"):
        resume_mod.read_training_checkpoint(path, named(lora_model(seed=5), "/models/Qwen2.5-1.5B-Instruct"))
    qwen = get_peft_model(tiny_model("qwen2"), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with pytest.raises(ValueError, match="a 'llama' model, and this model is a 'qwen2' model"):  # same LoRA names
        resume_mod.read_training_checkpoint(path, qwen)
    # a checkpoint without the fingerprint (written before grpo-nb recorded it): by name, and a way out
    old = tmp_path / "old"
    shutil.copytree(path, old / "checkpoint-1")
    tampered_state = json.loads((old / "checkpoint-1" / STATE).read_text())
    del tampered_state["identity"]
    (old / "checkpoint-1" / STATE).write_text(json.dumps(tampered_state))
    resume_mod.read_training_checkpoint(old / "checkpoint-1", named(lora_model(), "Qwen/Qwen2.5-1.5B"))  # hub id, same model
    with pytest.raises(ValueError, match="is another model. If it is the same model moved or renamed, write "
                                         "'/home/me/base-copy' into .*adapter_config.json"):
        resume_mod.read_training_checkpoint(old / "checkpoint-1", named(lora_model(), "/home/me/base-copy"))


def test_the_weight_fingerprint_holds_over_dtypes_and_added_tokens():
    model = lora_model()
    fingerprint = resume_mod.weight_fingerprint(model)
    assert resume_mod._same_weights(fingerprint, resume_mod.weight_fingerprint(lora_model().to(torch.bfloat16)))
    assert resume_mod._same_weights(fingerprint, resume_mod.weight_fingerprint(lora_model().to(torch.float16)))
    model.base_model.model.resize_token_embeddings(600)  # a pad token added: new rows at the end
    assert resume_mod._same_weights(fingerprint, resume_mod.weight_fingerprint(model))
    assert not resume_mod._same_weights(fingerprint, resume_mod.weight_fingerprint(lora_model(seed=5)))
    assert resume_mod._model_name("/root/.cache/huggingface/hub/models--Qwen--Qwen2.5-1.5B/snapshots/abc123/") == \
        resume_mod._model_name("Qwen/Qwen2.5-1.5B") == "qwen2.5-1.5b"


def test_a_checkpoint_resumes_only_with_its_lora_setup(written, tokenizer, tmp_path):
    from peft import LoraConfig, get_peft_model
    from tiny_models import tiny_model

    path = tampered(written, tmp_path, lambda r, t, w: None)  # r=4, lora_alpha=8 (lora_model's)

    def lora(**settings):
        model = tiny_model("llama")
        return get_peft_model(model, LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": "all-linear",
                                                   **settings}))

    for settings, said in [({"lora_alpha": 64}, "lora_alpha 8, and this model's adapter has lora_alpha 64: its "
                                                "weights would act 8x as strongly"),
                           ({"use_rslora": True}, "use_rslora False, and this model's adapter has use_rslora True: "
                                                  "its weights would act 2x"),
                           ({"r": 8}, "trained with r 4, and this model's adapter has r 8. Set the model up"),
                           ({"target_modules": ["q_proj", "v_proj"]}, "this model's adapter has target_modules "
                                                                      "['q_proj', 'v_proj'] (2 modules)")]:
        with pytest.raises(ValueError) as err:
            resume_mod.read_training_checkpoint(path, lora(**settings))
        assert said in str(err.value), str(err.value)
    with pytest.warns(UserWarning, match="another lora_dropout than it was trained with: 0.0 -> 0.1"):
        resume_mod.read_training_checkpoint(path, lora(lora_dropout=0.1))


def test_a_resume_warns_of_other_rewards_data_and_a_seed_it_does_not_apply(written, tokenizer):
    import warnings

    from datasets import Dataset
    from grpo_nb import GRPOConfig

    def said(**changes):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resume_mod.warn_changed_settings(written, settings, GRPOConfig(**{**settings, **changes.pop("config", {})}),
                                       state=state, **{"identity": identity, "reward_names": ["token_id_reward"],
                                                       **changes})
        return [str(w.message) for w in caught]

    state = ckpt.read_state(written)
    settings = json.loads((written / ckpt.SETTINGS).read_text())
    identity = resume_mod.run_identity(lora_model(), tokenizer, dataset())
    state["identity"] = identity  # as train() records it
    assert said() == []
    seed = said(config={"seed": 7})
    assert len(seed) == 1 and "seed 42 -> 7, which a resume does not apply" in seed[0] and "Start a new run" in seed[0]
    assert "reward functions ['token_id_reward'] -> ['count_w7']" in said(reward_names=["count_w7"])[0]
    assert "a dataset of 16 rows (it was trained on 8" in said(identity=resume_mod.run_identity(lora_model(), tokenizer,
                                                                                           dataset(16)))[0]
    other = dataset().map(lambda row: {"answer": row["answer"] + "0"})  # same prompts, other answers
    assert "another dataset of the same size (8 rows" in said(identity=resume_mod.run_identity(lora_model(), tokenizer,
                                                                                          other))[0]
    chat = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in dataset()["prompt"]]})
    state["identity"] = resume_mod.run_identity(lora_model(), tokenizer, chat)
    template = prepare_tokenizer(tiny_tokenizer())
    template.chat_template = "{% for m in messages %}Q: {{ m['content'] }}{% endfor %}"
    assert "prompts that become other tokens (another chat template" in said(
        identity=resume_mod.run_identity(lora_model(), template, chat))[0]


def test_a_pending_batch_scored_by_other_reward_functions_is_dropped(written):
    from grpo_nb import GRPOConfig
    from grpo_nb.batch import resumed_batch

    pending, config = ckpt.read_state(written)["pending"], GRPOConfig(num_generations=4, num_iterations=2)
    assert resumed_batch(written, pending, config, ["token_id_reward"], "cpu", ["token_id_reward"])[0] is not None
    with pytest.warns(UserWarning, match=r"scored by \['token_id_reward'\]; this run's reward functions are "
                                         r"\['count_w7'\]. It is dropped"):
        assert resumed_batch(written, pending, config, ["count_w7"], "cpu", ["token_id_reward"]) == (None, 0)


def test_a_checkpoint_records_what_the_run_trained_on(written, tokenizer):
    """train() keeps the identity it took at the start in every checkpoint (trainer.snapshot)."""
    assert ckpt.read_state(written)["identity"] == resume_mod.run_identity(lora_model(), tokenizer, dataset())


def test_a_run_trained_with_another_rollouts_state_names_the_rollout(tmp_path, tokenizer):
    """A checkpoint of a run whose own rollout kept a random state of other keys (a user's stateful rollout) is no
    damaged checkpoint: the resume names the rollout to pass."""
    from grpo_nb import train

    class Sampler:  # a user's rollout with a state of its own, around the native engine
        def __init__(self):
            from grpo_nb.rollout import RolloutEngine

            self.engine = RolloutEngine(max_completion_length=6, seed=0)

        def __call__(self, *args):
            return self.engine(*args)

        def state_dict(self):
            return {"mine": self.engine.state_dict()["seed"]}

        def load_state_dict(self, state):
            pass

    settings = dict(FAST, output_dir=str(tmp_path), save_steps=1, verbose=False, live=False)
    train(lora_model(), tokenizer, dataset(), token_id_reward, max_steps=1, rollout=Sampler(), **settings)
    with pytest.raises(ValueError, match=r"trained with another rollout, whose random state \(keys \['mine'\]\) this "
                                         r"run's RolloutEngine .*Pass the rollout= the run was trained with"):
        train(lora_model(), tokenizer, dataset(), token_id_reward, max_steps=2, resume_from_checkpoint=True, **settings)


def test_a_tokenizer_is_refused_on_resume_only_when_its_ids_mean_other_tokens():
    # a token only marked special (an existing id, its text kept) is warned of, not refused; the messages' numbers
    # say what differs (P43 F9: "512 tokens, the one its steps trained with 512 (other added tokens)")
    import warnings

    tok = prepare_tokenizer(tiny_tokenizer())
    saved = resume_mod.tokenizer_identity(tok)
    tok.add_special_tokens({"additional_special_tokens": [tok.convert_ids_to_tokens(5)]})
    marked = resume_mod.tokenizer_identity(tok)
    assert marked["added"] != saved["added"] and marked["ids"] == saved["ids"] and marked["size"] == saved["size"]
    with pytest.warns(UserWarning, match="added or special tokens differ.*the same 512 tokens and each id means"):
        resume_mod.check_same_tokenizer("ckpt", saved, marked, tok)
    replaced = dict(marked, ids="another digest")  # a token replaced at its id
    with pytest.raises(ValueError, match=r"has as many tokens as the one its steps trained with \(512\), but other "
                                         r"added tokens and ids that mean other tokens"):
        resume_mod.check_same_tokenizer("ckpt", saved, replaced, tok)
    old = {k: v for k, v in saved.items() if k != "ids"}  # a checkpoint written before "ids": refused as before
    with pytest.raises(ValueError, match="as many tokens as the one its steps trained with \\(512\\), but other added "
                                         "tokens \\(a token replaced"):
        resume_mod.check_same_tokenizer("ckpt", old, marked, tok)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resume_mod.check_same_tokenizer("ckpt", saved, dict(saved), tok)  # the same: nothing said
