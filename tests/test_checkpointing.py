"""Checkpoints and exact resume: an interrupted run resumed equals an unbroken one, bit for bit (CPU)."""

import os
import signal
import warnings

import pytest
import torch

import grpo_nb.checkpointing as ckpt
import grpo_nb.run_lock as run_lock
import grpo_nb.resume as resume_mod
import grpo_nb.trainer as trainer_mod
from grpo_nb import train
from grpo_nb.checkpointing import checkpoints
from tiny_models import FAST, dataset, lora_model, token_id_reward

# Fields that measure time or memory differ between any two runs; everything else must be equal.
VOLATILE = {"generation_time", "step_time", "peak_memory_bytes", "memory"}
SETTINGS = dict(FAST, max_steps=6, save_steps=2, seed=3, verbose=False)


def comparable(history):
    return [{k: v for k, v in record.items() if k not in VOLATILE} for record in history]


def weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_same_run(history, model, reference_history, reference_model):
    assert comparable(history) == comparable(reference_history)
    ref = weights(reference_model)
    got = weights(model)
    assert got.keys() == ref.keys() and all(torch.equal(got[n], ref[n]) for n in ref)


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory):
    from tiny_models import tiny_tokenizer
    from grpo_nb.models import prepare_tokenizer

    model = lora_model()
    history = train(model, prepare_tokenizer(tiny_tokenizer()), dataset(), token_id_reward,
                    output_dir=str(tmp_path_factory.mktemp("unbroken")), **SETTINGS)
    return history, model


class Interrupt:
    """Raises KeyboardInterrupt the `at`-th time it is called."""

    def __init__(self, at):
        self.at, self.calls = at, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt


@pytest.mark.parametrize("where", ["rollout", "reward", "backward", "after_step"])
def test_interrupt_anywhere_then_resume_equals_unbroken_run(tok, tmp_path, monkeypatch, unbroken, where):
    model = lora_model()
    interrupt = Interrupt(at=4)  # during step 4 (after step 3 for "after_step")
    rewards, callbacks = [token_id_reward], []
    if where == "rollout":
        original = trainer_mod.sample_batch

        def sample_batch(*args, **kwargs):
            interrupt()
            return original(*args, **kwargs)

        monkeypatch.setattr(trainer_mod, "sample_batch", sample_batch)
    elif where == "reward":
        def reward(completion_ids, **kwargs):
            interrupt()
            return token_id_reward(completion_ids)

        reward.__name__ = "token_id_reward"
        rewards = [reward]
    elif where == "backward":
        param = next(p for p in model.parameters() if p.requires_grad)
        param.register_hook(lambda grad: interrupt() or grad)  # once per micro-batch backward
        interrupt.at = 2 * 3 + 1  # FAST has 2 micro-batches per step: the first backward of step 4
    else:
        callbacks = [lambda record: interrupt() if record["step"] == 3 else None]
        interrupt.at = 1

    history = train(model, tok, dataset(), rewards, output_dir=str(tmp_path), callbacks=callbacks, **SETTINGS)
    assert [r["step"] for r in history] == [1, 2, 3]  # returned, not raised
    assert [p.name for p in checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-3"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no half-written folders
    assert all(p.grad is None for p in model.parameters())  # no partial gradients left behind
    monkeypatch.undo()

    # Resume in a fresh process's shoes: a newly built model, the same call plus resume_from_checkpoint.
    resumed_model = lora_model()  # the same base model, loaded again
    with torch.no_grad():  # adapter weights unlike the run's: the checkpoint must overwrite them
        for p in resumed_model.parameters():
            if p.requires_grad:
                p.add_(1.0)
    resumed = train(resumed_model, tok, dataset(), [token_id_reward], output_dir=str(tmp_path),
                    resume_from_checkpoint=True, **SETTINGS)
    assert_same_run(resumed, resumed_model, *unbroken)


def test_resume_mid_batch_with_num_iterations(tok, tmp_path):
    settings = dict(SETTINGS, num_iterations=2, max_steps=4, save_steps=0)
    reference_model = lora_model()
    reference = train(reference_model, tok, dataset(), token_id_reward, output_dir=str(tmp_path / "a"), **settings)
    model = lora_model()
    stop = lambda record: (_ for _ in ()).throw(KeyboardInterrupt) if record["step"] == 1 else None  # noqa: E731
    assert len(train(model, tok, dataset(), token_id_reward, output_dir=str(tmp_path / "b"), callbacks=[stop],
                     **settings)) == 1
    # Step 1 used the first half of a generation batch; the checkpoint carries the batch for step 2.
    resumed = train(model, tok, dataset(), token_id_reward, output_dir=str(tmp_path / "b"),
                    resume_from_checkpoint=tmp_path / "b" / "checkpoint-1", **settings)
    assert_same_run(resumed, model, reference, reference_model)


def test_a_resume_with_more_steps_follows_the_new_schedule(tok, tmp_path):
    """A finished run resumed with a higher max_steps (what the "nothing to train" warning advises)
    trains every new step at the new linear schedule's rate, not at the old schedule's final 0."""
    settings = dict(SETTINGS, max_steps=2, save_steps=2, lr_scheduler_type="linear", learning_rate=1e-3)
    model = lora_model()
    first = train(model, tok, dataset(), token_id_reward, output_dir=str(tmp_path), **settings)
    assert [r["learning_rate"] for r in first] == [1e-3, 5e-4]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        more = train(model, tok, dataset(), token_id_reward, output_dir=str(tmp_path), resume_from_checkpoint=True,
                     **{**settings, "max_steps": 4, "save_steps": 0})
    assert not [w for w in caught if "differ" in str(w.message)]  # a higher max_steps alone is no change to warn of
    assert [r["learning_rate"] for r in more[2:]] == pytest.approx([1e-3 * (1 - 2 / 4), 1e-3 * (1 - 3 / 4)])


def test_error_saves_resumable_checkpoint(tok, tmp_path, unbroken):
    calls = {"n": 0}

    def flaky(completion_ids, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise ValueError("bug in my reward")
        return token_id_reward(completion_ids)

    flaky.__name__ = "token_id_reward"
    model = lora_model()
    with pytest.raises(Exception, match="bug in my reward") as err:
        train(model, tok, dataset(), flaky, output_dir=str(tmp_path), **SETTINGS)
    assert any("resume_from_checkpoint=True" in note for note in err.value.__notes__)
    resumed = train(model, tok, dataset(), token_id_reward, output_dir=str(tmp_path), resume_from_checkpoint=True,
                    **SETTINGS)
    assert_same_run(resumed, model, *unbroken)


def test_rotation_keeps_the_newest(tok, tmp_path):
    train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path),
          **dict(SETTINGS, max_steps=5, save_steps=1, save_total_limit=2))
    assert [p.name for p in checkpoints(tmp_path)] == ["checkpoint-4", "checkpoint-5"]
    assert (tmp_path / "adapter_model.safetensors").exists()  # the final adapter, as before


def test_an_existing_checkpoint_is_replaced_whole(tok, tmp_path):
    model = lora_model()
    ckpt.save_training_checkpoint(tmp_path / "checkpoint-1", model=model, tokenizer=tok, config=None, history=[],
                                  state={"step": 1})
    ckpt.save_training_checkpoint(tmp_path / "checkpoint-1", model=model, tokenizer=tok, config=None, history=[],
                                  state={"step": 2})
    assert ckpt.read_state(tmp_path / "checkpoint-1") == {"step": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-1"]


def test_resume_at_max_steps_warns_and_returns_history(tok, tmp_path):
    history = train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path),
                    **dict(SETTINGS, max_steps=2))
    with pytest.warns(UserWarning, match="nothing to train"):
        again = train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path),
                      resume_from_checkpoint=True, **dict(SETTINGS, max_steps=2))
    assert comparable(again) == comparable(history)


def test_deferred_interrupts():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal or a notebook kernel
    try:
        with pytest.raises(KeyboardInterrupt):
            with trainer_mod.deferred_interrupts():
                os.kill(os.getpid(), signal.SIGINT)
                finished = True  # the block runs to its end first
        assert finished
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        # Where Ctrl-C is ignored (a background job), it stays ignored.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with trainer_mod.deferred_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


class _RunsCodeWhenUnpickled:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))  # unpickling this creates the marker file


def test_checkpoints_load_without_running_code(tok, tmp_path):
    """trainer_state is JSON + safetensors; an old pickled one is refused, unless converted on purpose."""
    model = lora_model()
    state = {"step": 3, "rng": ckpt.rng_state(), "pending": None, "sampler": {"order": [1, 2]},
             "optimizer": {"state": {0: {"exp_avg": torch.ones(2)}}, "param_groups": [{"betas": (0.9, 0.99)}]}}
    path = ckpt.save_training_checkpoint(tmp_path / "checkpoint-3", model=model, tokenizer=tok, config=None,
                                         history=[{"loss": float("nan")}], state=state)
    assert not list(path.glob("*.pt")) and {"trainer_state.json", "trainer_state.safetensors"} <= {
        p.name for p in path.iterdir()}
    back = ckpt.read_state(path)
    assert back["optimizer"]["state"][0]["exp_avg"].tolist() == [1.0, 1.0]
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"]) and back["rng"]["python"] == state["rng"]["python"]
    assert (back["rng"]["numpy"][1] == state["rng"]["numpy"][1]).all() and back["rng"]["numpy"][1].dtype.name == "uint32"
    ckpt.set_rng_state(back["rng"])  # usable as is

    # An old checkpoint: its pickle would run code. Resuming refuses it before reading a byte of it.
    marker = tmp_path / "code-ran"
    legacy = tmp_path / "old" / "checkpoint-1"
    ckpt.save_training_checkpoint(legacy, model=model, tokenizer=tok, config=None, history=[], state={"step": 1})
    for name in ("trainer_state.json", "trainer_state.safetensors"):
        (legacy / name).unlink()
    torch.save({"step": 1, "payload": _RunsCodeWhenUnpickled(marker)}, legacy / "trainer_state.pt")
    with pytest.raises(ValueError, match=r"(?s)older grpo-nb.*can run any code.*convert_legacy_checkpoint"):
        resume_mod.load_training_checkpoint(legacy, model)
    assert not marker.exists()
    torch.save({"step": 1, "rng": ckpt.rng_state()}, legacy / "trainer_state.pt")  # one the user trusts
    ckpt.convert_legacy_checkpoint(legacy)  # their explicit choice
    assert ckpt.read_state(legacy)["step"] == 1 and not (legacy / "trainer_state.pt").exists()


def test_one_run_per_output_dir(tok, tmp_path):
    """A second run on a folder another live process trains in is refused, naming it; a dead one's lock is taken."""
    import subprocess
    import sys

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from grpo_nb.run_lock import output_dir_lock\n"
                               "with output_dir_lock(sys.argv[1]):\n    print('held', flush=True); time.sleep(600)",
         str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RuntimeError, match=rf"in use by another training run: process {holder.pid} on .*another "
                                               r"output_dir"):
            train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path), verbose=False,
                  **{**FAST, "max_steps": 1})
        assert not checkpoints(tmp_path) and not (tmp_path / "adapter_model.safetensors").exists()
    finally:
        holder.kill()  # SIGKILL: no chance to clean up, its lock file stays behind
        holder.wait()
    assert (tmp_path / run_lock.LOCK).exists()
    train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path), verbose=False,
          **{**FAST, "max_steps": 1})  # the dead process's lock is taken over
    assert (tmp_path / "adapter_model.safetensors").exists() and not (tmp_path / run_lock.LOCK).exists()
    with run_lock.output_dir_lock(tmp_path), pytest.raises(RuntimeError, match=f"process {os.getpid()}"):
        with run_lock.output_dir_lock(tmp_path):  # a second run in this process (another thread, say)
            pass


def _train_until_killed(output_dir, max_steps):
    """A forkserver child: train (resuming if there is anything to resume) until the test kills it."""
    import warnings

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    from transformers import PreTrainedTokenizerFast  # noqa: F401  (imports before the clock matters)

    from grpo_nb.models import prepare_tokenizer
    from tiny_models import tiny_tokenizer

    tokenizer = prepare_tokenizer(tiny_tokenizer())
    resume = bool(checkpoints(output_dir))
    train(lora_model(), tokenizer, dataset(), token_id_reward, output_dir=str(output_dir), verbose=False,
          resume_from_checkpoint=resume or None, **{**FAST, "max_steps": max_steps, "save_steps": 1,
                                                    "save_total_limit": 2})


def test_sigkill_at_random_moments_leaves_loadable_resumable_checkpoints(tok, tmp_path):
    """SIGKILL during steps, checkpoint writes and the final save (seeded moments): whatever is on disk loads."""
    import multiprocessing
    import random
    import time

    import grpo_nb.step  # noqa: F401

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "transformers", "peft", "grpo_nb", "grpo_nb.trainer", "test_checkpointing"])

    def run(output_dir, max_steps, kill_after=None):
        child = ctx.Process(target=_train_until_killed, args=(output_dir, max_steps))
        child.start()
        started = time.monotonic()
        child.join(kill_after)
        child.kill()  # SIGKILL; a child that ended a moment ago is no error (multiprocessing checks)
        child.join()
        return child.exitcode, time.monotonic() - started

    # The kill moments are fractions of how long an unbroken round takes on this machine (a fixed number
    # of seconds kills nothing on a fast machine and only start-ups on a slow one).
    calibration = tmp_path / "calibration"
    run(calibration, 1)  # the first start waits for the fork server to import torch & co.
    took = {steps: run(calibration, int(checkpoints(calibration)[-1].name.split("-")[1]) + steps)[1] for steps in (6, 1)}
    tmp_path = tmp_path / "run"
    rng = random.Random(0)
    moments = []
    for round_ in range(20):
        done = int(checkpoints(tmp_path)[-1].name.split("-")[1]) if checkpoints(tmp_path) else 0
        # Three rounds in four train toward a horizon they never reach, so they end only by the kill (during a
        # step or a checkpoint write, however fast this machine is today); every fourth round has one step to
        # go and is killed near its end (start-up is most of a round), so that the kill often falls in the
        # final save.
        final_save_round = round_ % 4 == 3
        wait = rng.uniform(0.75, 1.05) * took[1] if final_save_round else rng.uniform(0.2, 0.95) * took[6]
        code, elapsed = run(tmp_path, done + (1 if final_save_round else 1000), kill_after=wait)
        moments.append((round(wait, 2), code, round(elapsed, 2), final_save_round))
        assert code in (0, -signal.SIGKILL), moments
        for path in checkpoints(tmp_path):  # every complete checkpoint on disk loads and could be resumed
            state = resume_mod.load_training_checkpoint(path, lora_model())
            assert state["step"] == int(path.name.split("-")[1]) and len(state["history"]) == state["step"]
        if (tmp_path / "adapter_model.safetensors").exists():  # the final result, whole or absent
            import safetensors.torch

            assert safetensors.torch.load_file(tmp_path / "adapter_model.safetensors")
    assert all(code == -signal.SIGKILL for _, code, _, final in moments if not final), moments
    done = int(checkpoints(tmp_path)[-1].name.split("-")[1])
    assert done >= 5, moments  # the kills fell during training, not only before it
    assert run(tmp_path, done + 2)[0] == 0  # and the run goes on from there
    assert ckpt.read_state(checkpoints(tmp_path)[-1])["step"] == done + 2
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".") and p.name != run_lock.LOCK]


def test_a_resumed_optimizer_keeps_this_runs_settings_and_the_checkpoints_moments():
    """load_state_dict would put the checkpoint's betas / weight_decay / eps back, while the resume's warning says
    the new settings apply (and a foreign checkpoint could set weight_decay=1e12): only the moments are loaded."""
    from grpo_nb import GRPOConfig
    from grpo_nb.distributed import load_optimizer_state
    from grpo_nb.optim import build_optimizer

    model = lora_model()
    old, _, params = build_optimizer(model, GRPOConfig(weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.99))
    for p in params:
        p.grad = torch.ones_like(p)
    old.step()
    saved = old.state_dict()
    saved["param_groups"][0].update(eps=1e-300, weight_decay=1e12)  # as a foreign checkpoint may hold them
    new, _, _ = build_optimizer(model, GRPOConfig(weight_decay=0.5, adam_beta1=0.5, adam_beta2=0.9))
    load_optimizer_state(new, saved)
    group = new.param_groups[0]
    assert (group["betas"], group["weight_decay"], group["eps"]) == ((0.5, 0.9), 0.5, 1e-8)
    moments = new.state[params[0]]
    assert torch.equal(moments["exp_avg_sq"], old.state[params[0]]["exp_avg_sq"]) and float(moments["step"]) == 1


# --------------------------------------------------------------------------------------
# Stop pressed at the end of a run, or twice


@pytest.fixture
def real_ctrl_c():
    """Ctrl-C as a terminal or a notebook kernel delivers it; returns a function that presses it now."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield lambda: os.kill(os.getpid(), signal.SIGINT)
    signal.signal(signal.SIGINT, previous)


def test_stop_during_the_final_save_waits_for_it_and_the_run_ends_as_finished(tok, tmp_path, monkeypatch,
                                                                                real_ctrl_c, capsys):
    """The slowest moment after the last step shown: the final save, then the dashboard's last plots. Stop there
    loses neither the result nor the history."""
    from grpo_nb_widgets import LiveDashboard

    real = ckpt._write_model_files

    def pressed_while_writing(*args, **kwargs):
        real_ctrl_c()
        real(*args, **kwargs)

    class ClosedWithStop(LiveDashboard):
        def close(self, error=None):
            raise KeyboardInterrupt  # Stop pressed again while the final plots render

    monkeypatch.setattr(ckpt, "_write_model_files", pressed_while_writing)
    history = train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path),
                    live=ClosedWithStop(notebook=False, print_steps=False), **dict(SETTINGS, max_steps=2, save_steps=0))
    assert [r["step"] for r in history] == [1, 2]
    out = capsys.readouterr().out
    assert f"Training finished at step 2/2; the Stop pressed during the final save waited for it: the result is " \
           f"saved in {tmp_path}" in out
    assert "Stop pressed while closing the dashboard" in out
    assert len(__import__("json").loads((tmp_path / "history.json").read_text())) == 2
    from peft import PeftModel
    from tiny_models import tiny_model

    PeftModel.from_pretrained(tiny_model("llama", seed=0), tmp_path)  # the adapter is whole


def test_a_second_stop_while_the_checkpoint_is_written_waits_for_it(tok, tmp_path, monkeypatch, real_ctrl_c,
                                                                     capsys):
    real = ckpt._write_model_files

    def pressed_again_while_writing(*args, **kwargs):
        real_ctrl_c()
        real(*args, **kwargs)

    monkeypatch.setattr(ckpt, "_write_model_files", pressed_again_while_writing)
    stop = Interrupt(at=2)
    history = train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path), callbacks=[stop],
                    **dict(SETTINGS, max_steps=3, save_steps=0))
    assert [r["step"] for r in history] == [1, 2]
    assert f"Training interrupted at step 2/3; everything up to step 2 is saved in {tmp_path / 'checkpoint-2'} (the " \
           f"second Stop waited for it to be written)" in capsys.readouterr().out
    assert resume_mod.load_training_checkpoint(tmp_path / "checkpoint-2", lora_model())["step"] == 2


def test_the_run_dies_with_a_history_even_if_the_checkpoint_cannot_wait(tok, tmp_path, monkeypatch, capsys):
    """A KeyboardInterrupt raised inside the write itself (no signal to hold): no half folder, the history returned."""
    monkeypatch.setattr(ckpt, "_write_model_files", Interrupt(at=1))
    history = train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path), callbacks=[Interrupt(1)],
                    **dict(SETTINGS, max_steps=2, save_steps=0))
    assert [r["step"] for r in history] == [1]
    assert "writing checkpoint-1 was interrupted, so nothing of it was written. The weights of step 1 are still in " \
           "`model`" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir() if p.name != run_lock.LOCK] == []


def test_what_json_cannot_hold_is_stored_as_its_text_and_read_back():
    """Whatever reaches a record (a dataset's value, a reward's log) is written as plain JSON data a resume
    accepts: the history in trainer_state.json keeps NaN (no score), history.json writes it as null."""
    import datetime
    import json

    import numpy as np

    from grpo_nb.checkpoint_schema import is_plain

    deep = []
    for _ in range(200):
        deep = [deep]
    record = {"step": 1, "reward": float("nan"), "t": torch.tensor(1.0), "a": np.array([1.0]), "b": b"ab",
              "when": datetime.date(2025, 1, 2), "keys": {1: 0.5}, "huge": 10**5000, "n": np.float32(0.5),
              "deep": deep}
    stored = ckpt._jsonable([record], null_nonfinite=False)[0]
    assert is_plain(stored) and json.loads(json.dumps(stored)) is not None
    assert (stored["t"], stored["b"], stored["when"], stored["keys"], stored["n"]) == ("tensor(1.)", "b'ab'",
                                                                                          "2025-01-02", {"1": 0.5}, 0.5)
    assert stored["huge"] == "<an int of about 5,001 digits>" and stored["reward"] != stored["reward"]  # NaN kept
    assert ckpt._jsonable(record)["reward"] is None
    with pytest.raises(TypeError, match="an int of about 5,001 digits"):  # in a pending batch's rows: left out
        ckpt.encode_state({"answer": 10**5000}, {})


def test_a_finished_run_without_checkpoints_is_trained_further_the_way_its_messages_name(tmp_path):
    """save_steps=0 (the quickstart's) leaves only the adapter: resume_from_checkpoint=True cannot continue it, and
    the model load_for_inference gives cannot train. Both messages name the way that works, and it works."""
    from peft import PeftModel

    from grpo_nb import GRPOConfig
    from grpo_nb.optim import build_optimizer
    from tiny_models import tiny_model

    lora_model().save_pretrained(tmp_path / "out")  # what the final save leaves
    with pytest.raises(FileNotFoundError) as err:
        ckpt.find_checkpoint(True, tmp_path / "out")
    said = str(err.value)
    assert "no checkpoint of its optimizer and history (saved every save_steps; 0 saves none)" in said
    assert "PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(" in said and "is_trainable=True" in said
    assert "without resume_from_checkpoint in" in said and "replaces this one when it ends" in said
    with pytest.raises(FileNotFoundError, match=r"folder to resume from. Start without resume_from_checkpoint"):
        ckpt.find_checkpoint(True, tmp_path)  # nothing there to train on
    for_inference = PeftModel.from_pretrained(tiny_model("llama", seed=0), tmp_path / "out")
    with pytest.raises(ValueError, match=r"no trainable parameters. Its adapter was loaded for inference .*"
                                         r"from_pretrained\(<its base model>, <the adapter's folder>, is_trainable"):
        build_optimizer(for_inference, GRPOConfig())
    trainable = PeftModel.from_pretrained(tiny_model("llama", seed=0), tmp_path / "out", is_trainable=True)
    assert build_optimizer(trainable, GRPOConfig())[2]  # the adapter's weights are what it trains


def test_the_base_fingerprint_samples_decoder_layers_in_any_float_dtype():
    """A merged fine-tune differs from its base only in its decoder layers; bf16 and fp32 loads of one model agree."""
    model = lora_model()
    saved = resume_mod.base_identity(model)
    assert saved["layers"] and all("base_layer" not in name for name in saved["layers"])
    same = resume_mod.base_identity(lora_model().to(torch.bfloat16))
    assert all(resume_mod._same_weights([saved["layers"][n]], [same["layers"][n]]) for n in saved["layers"])
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "layers.0" in n and "base_layer" in n).add_(0.05)
    moved = resume_mod.base_identity(model)
    assert moved["fingerprint"] == saved["fingerprint"] and moved["layers"] != saved["layers"]


def test_a_full_finetune_checkpoint_is_refused_under_other_rope_parameters(tmp_path):
    from grpo_nb.models import prepare_for_training
    from tiny_models import tiny_model

    model = prepare_for_training(tiny_model("llama"), lora_rank=None)
    model.save_pretrained(tmp_path)  # a full fine-tuning checkpoint's config.json
    resume_mod.check_same_config(tmp_path, {"model_type": "llama"}, model)  # the same config passes
    model.config.rope_parameters = {**model.config.rope_parameters, "rope_theta": 1e6}
    with pytest.raises(ValueError, match=r"rope_parameters .*10000.0.* -> .*1000000.0"):
        resume_mod.check_same_config(tmp_path, {"model_type": "llama"}, model)


def test_a_full_finetune_with_a_frozen_embedding_is_still_compared_by_config(tmp_path):
    from grpo_nb.models import prepare_for_training
    from tiny_models import tiny_model

    model = prepare_for_training(tiny_model("llama"), lora_rank=None)
    model.get_input_embeddings().weight.requires_grad_(False)  # a common memory saving: not an adapter
    model.save_pretrained(tmp_path)
    resume_mod.check_same_base(tmp_path, resume_mod.base_identity(model), {}, model)  # the same model passes
    model.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match=r"hidden_act 'silu' -> 'gelu'"):
        resume_mod.check_same_base(tmp_path, resume_mod.base_identity(model), {}, model)


def test_the_layer_fingerprint_covers_every_decoder_layer_and_an_untied_head():
    """A fine-tune of middle layers only (LoRA's layers_to_transform) or of the output head only shows."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from tiny_models import tiny_config

    def three_layers():
        config = tiny_config("llama")
        config.num_hidden_layers = 3  # a middle layer, neither the first nor the last
        torch.manual_seed(0)
        return get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=4, target_modules="all-linear"))
    saved = resume_mod.base_identity(three_layers())
    layers = {int(m.group(1)) for name in saved["layers"] if (m := resume_mod._LAYER.search(name))}
    assert layers == {0, 1, 2} and "lm_head.weight" in saved["layers"]
    for changed in ("layers.1.mlp.down_proj.base_layer", "lm_head"):
        model = three_layers()
        with torch.no_grad():
            model.get_submodule(f"base_model.model.{changed.replace('layers', 'model.layers')}").weight.add_(0.05)
        now = resume_mod.base_identity(model)
        assert now["fingerprint"] == saved["fingerprint"]  # embedding and final norm: the same
        assert [n for n in saved["layers"] if now["layers"][n] != saved["layers"][n]] == [
            changed.replace(".base_layer", "").replace("layers", "model.layers") + ".weight"]


def test_output_dir_is_never_a_checkpoint_folder_or_inside_one(tmp_path):
    from grpo_nb.output_checks import check_output_dir

    done = tmp_path / "run" / "checkpoint-2"
    done.mkdir(parents=True)
    for name in (ckpt.TRAINER_STATE, ckpt.TRAINABLE):
        (done / name).write_text("{}")
    for output_dir, said in ((done, "is the checkpoint folder"), (done / "fork" / "a", "lies inside the checkpoint")):
        with pytest.raises(ValueError, match=rf"{said} .*checkpoint-2.*output_dir='.*run-from-checkpoint-2'"):
            check_output_dir(output_dir, done)
    check_output_dir(tmp_path / "fork", done)  # beside it: a fork of its own
    check_output_dir(tmp_path / "mine" / "checkpoint-3", None)  # a folder of that name in no run's folder


def test_an_output_dir_through_a_link_and_dotdot_is_written_where_it_was_checked(tmp_path, monkeypatch, tok):
    """'lnk/../x' is, for the system, x beside the link's target: the run is checked and written there, never at
    the x beside the link that a textual normalisation names (where someone's model sits here)."""
    from tiny_models import tiny_model

    (tmp_path / "elsewhere" / "sub").mkdir(parents=True)
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "lnk").symlink_to(tmp_path / "elsewhere" / "sub")
    tiny_model("llama", seed=3).save_pretrained(tmp_path / "w" / "mymodel")  # someone's model
    before = {p.name: p.read_bytes() for p in (tmp_path / "w" / "mymodel").iterdir()}
    monkeypatch.chdir(tmp_path / "w")
    train(lora_model(), tok, dataset(), token_id_reward, output_dir="lnk/../mymodel", max_steps=1, verbose=False,
          live=False, **FAST)
    assert (tmp_path / "elsewhere" / "mymodel" / "adapter_model.safetensors").is_file()
    assert {p.name: p.read_bytes() for p in (tmp_path / "w" / "mymodel").iterdir()} == before


def test_an_earlier_result_of_another_kind_is_never_left_beside_this_runs(tmp_path, tok):
    """A full fine-tune's model beside an earlier run's adapter (or a named adapter beside the default one) would
    load as the earlier result or a mix of the two: refused before any work."""
    from tiny_models import tiny_model

    settings = dict(FAST, max_steps=1, verbose=False, live=False, output_dir=str(tmp_path))
    train(lora_model(), tok, dataset(), token_id_reward, **settings)  # a LoRA run's adapter
    with pytest.raises(ValueError, match=r"holds a LoRA adapter an earlier run saved, and this run saves a fully "
                                         r"fine-tuned model there: .*sit beside them"):
        train(tiny_model("llama"), tok, dataset(), token_id_reward, **settings)
    with pytest.warns(UserWarning, match="holds the adapter an earlier run saved; this run will replace it"):
        train(lora_model(seed=3), tok, dataset(), token_id_reward, **settings)  # the same kind: replaced


def test_a_log_inside_another_runs_checkpoint_is_refused(tmp_path, tok):
    """That run's rotation would delete it with the checkpoint folder."""
    settings = dict(FAST, max_steps=1, verbose=False, live=False, save_steps=1)
    train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path / "a"), **settings)
    with pytest.raises(ValueError, match=r"log_completions_path=.* lies in the checkpoint folder .*checkpoint-1"):
        train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path / "b"), log_completions=True,
              log_completions_path=str(tmp_path / "a" / "checkpoint-1" / "log.jsonl"), **settings)


def test_a_copied_run_folder_resumed_in_place_is_a_run_of_its_own(tmp_path, tok):
    """It keeps the original's run id no longer: a completions file they share keeps the original's rows."""
    import json
    import shutil

    log = tmp_path / "completions.jsonl"
    settings = dict(FAST, verbose=False, live=False, save_steps=1, log_completions=True, log_completions_path=str(log))
    train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path / "a"), max_steps=2, **settings)
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    original = [json.loads(line) for line in log.read_text().splitlines()]
    shutil.rmtree(tmp_path / "copy" / "checkpoint-2")  # continue the copy from step 1 another way
    train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path / "copy"), max_steps=3,
          resume_from_checkpoint=True, **settings)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert rows[: len(original)] == original  # the original run's rows, steps 1 and 2, all kept
    assert {r["run_id"] for r in rows[len(original):]} != {original[0]["run_id"]}


def test_a_rerun_into_its_own_folder_leaves_nothing_of_the_earlier_result(tmp_path, tok):
    """The final save removes what an earlier result there had and this one does not write (an earlier single
    model.safetensors before new shards, a chat template the new tokenizer has not), and saves only the adapter
    that was trained: the folder loads as this run's result."""
    from peft import LoraConfig

    settings = dict(FAST, max_steps=1, verbose=False, live=False, output_dir=str(tmp_path))
    train(lora_model(), tok, dataset(), token_id_reward, **settings)
    (tmp_path / "chat_template.jinja").write_text("an earlier tokenizer's template")  # as an earlier save left them
    (tmp_path / "adapter_model-00001-of-00002.safetensors").write_bytes(b"an earlier run's shard")
    with pytest.warns(UserWarning, match="holds the adapter an earlier run saved"):
        train(lora_model(seed=2), tok, dataset(), token_id_reward, **settings)
    model = lora_model(seed=3)
    model.add_adapter("grpo", LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model.set_adapter("grpo")
    train(model, tok, dataset(), token_id_reward, **{**settings, "output_dir": str(tmp_path / "two")})
    names = {p.name for p in tmp_path.iterdir()}
    assert "adapter_model-00001-of-00002.safetensors" not in names
    assert "chat_template.jinja" not in names or "earlier" not in (tmp_path / "chat_template.jinja").read_text()
    two = {p.name for p in (tmp_path / "two").iterdir()}
    assert "grpo" in two and "adapter_model.safetensors" not in two  # the untrained "default" is not saved


def test_a_weight_trained_outside_the_adapter_is_refused(tmp_path, tok):
    """The run's result is its adapter: a norm unfrozen by hand would be trained and then missing from it."""
    from peft import LoraConfig, get_peft_model

    from tiny_models import tiny_model

    embedding = get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"]))
    for model in (lora_model(), embedding):  # LoRA on the embedding saves the whole (frozen) embedding too
        model.base_model.model.model.norm.weight.requires_grad_(True)
        with pytest.raises(ValueError, match=r"trains 1 weight\(s\) outside its LoRA adapter 'default' \(e\.g\. "
                                             r".*norm\.weight\).*modules_to_save"):
            train(model, tok, dataset(), token_id_reward, output_dir=str(tmp_path), max_steps=1, verbose=False,
                  live=False, **FAST)


def test_a_prompt_tuning_adapter_is_refused_before_any_rollout(tmp_path, tok):
    from peft import PromptTuningConfig, get_peft_model

    from tiny_models import tiny_model

    model = get_peft_model(tiny_model("llama"), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(ValueError, match=r"has a prompt-learning adapter \(PROMPT_TUNING.*Use LoRA"):
        train(model, tok, dataset(), token_id_reward, output_dir=str(tmp_path), max_steps=1, verbose=False,
              live=False, **FAST)
