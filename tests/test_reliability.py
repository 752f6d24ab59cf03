"""Runs that go wrong: non-finite streaks stop with an explanation, out-of-memory says what to change,
and memory stays flat over many steps."""

import math

import pytest
import torch

import grpo_nb.planning as planning
import grpo_nb.step as step_mod
import grpo_nb.trainer as trainer_mod
from grpo_nb import GRPOConfig, train
from grpo_nb.checkpointing import checkpoints, read_state
from grpo_nb.resume import load_training_checkpoint
from grpo_nb.streaks import NonFiniteTrainingError
from tiny_models import FAST, dataset, lora_model, token_id_reward


def test_nonfinite_streak_stops_the_run_with_weights_untouched(tok, tmp_path, monkeypatch):
    model = lora_model()
    real = step_mod.grpo_loss
    calls = {"n": 0}

    def loss_goes_nan(*args, **kwargs):  # fine for step 1 (2 micro-batches), NaN from step 2 on
        calls["n"] += 1
        loss, metrics = real(*args, **kwargs)
        return (loss if calls["n"] <= 2 else loss * math.nan), metrics

    monkeypatch.setattr(step_mod, "grpo_loss", loss_goes_nan)
    seen = []
    with pytest.raises(NonFiniteTrainingError, match=r"(?s)last 3 steps \(2 to 4\).*unchanged since step 1.*"
                                                     r"learning rate too high \(now 0.001\)") as err:
        train(model, tok, dataset(), token_id_reward, output_dir=str(tmp_path), max_steps=10, verbose=False,
              max_nonfinite_steps=3, callbacks=[seen.append], **{**FAST, "save_steps": 0})
    assert [r["skipped_nonfinite"] for r in seen] == [False, True, True, True]
    assert any("checkpoint-4" in note for note in err.value.__notes__)
    weights_after_step_1 = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    state = read_state(tmp_path / "checkpoint-4")
    assert state["step"] == 4 and len(state["history"]) == 4
    import safetensors.torch

    saved = safetensors.torch.load_file(tmp_path / "checkpoint-4" / "trainable.safetensors")
    assert all(torch.equal(saved[n], weights_after_step_1[n]) for n in saved)
    with pytest.raises(ValueError, match="max_nonfinite_steps"):
        GRPOConfig(max_nonfinite_steps=0)


@pytest.mark.parametrize("phase", ["rollout", "update"])
def test_out_of_memory_names_the_phase_and_what_to_change(tok, tmp_path, monkeypatch, phase):
    target = "sample_batch" if phase == "rollout" else "accumulate_gradients"
    real = getattr(trainer_mod, target)
    calls = {"n": 0}

    def runs_out(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_mod, target, runs_out)
    with pytest.raises(torch.cuda.OutOfMemoryError) as err:
        train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path), max_steps=4, verbose=False,
              **FAST)
    message = str(err.value)
    assert f"Out of memory during the {phase} of step 2." in message
    assert ("lower num_generations" if phase == "rollout" else "lower per_device_train_batch_size") in message
    assert "num_generations=4, max_completion_length=6, per_device_train_batch_size=4" in message
    assert "The last completed step used (GiB): base weights" in message  # the breakdown at that moment
    assert "Tried to allocate 2.00 GiB" in message  # the original error stays visible
    assert [p.name for p in checkpoints(tmp_path)] == ["checkpoint-1"] and "checkpoint-1" in message


def test_oom_message_suggests_settings_that_fit(monkeypatch):
    """On a (pretend) 16 GiB GPU the planner's settings are offered, sized for the real model."""
    from grpo_nb.architectures import random_model

    model = random_model("Qwen/Qwen2.5-1.5B-Instruct", device="meta")
    config = GRPOConfig(num_generations=16, max_completion_length=8192, per_device_train_batch_size=16)

    class Device:
        type = "cuda"

    class Props:
        total_memory = 16 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 15 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: int(15.5 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Tesla T4")
    message = planning.oom_message("rollout", 0, config, model, None, Device())
    assert "15.00 GiB allocated, 15.50 GiB reserved, of 16.0 GiB on Tesla T4" in message
    assert "The planner's estimate of what fits this GPU:" in message
    import re

    plan = re.search(r"fits this GPU: num_generations=(\d+), max_completion_length=(\d+), "
                     r"per_device_train_batch_size=(\d+), load_in_4bit=(\w+) \(estimated peak ([\d.]+) GiB\)", message)
    gens, length, micro, _, peak = plan.groups()
    assert int(gens) <= 16 and int(length) <= 8192 and (int(gens), int(length)) != (16, 8192)
    assert float(peak) < 16 * 0.9


def test_memory_stays_flat_over_1000_steps(tok, tmp_path):
    """Memory left between steps (CPU resident, CUDA allocated) after step 10 and after step 1000 agree within 2%."""
    history = train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path), max_steps=1000,
                    verbose=False, num_generations=2, per_device_train_batch_size=2, max_completion_length=2,
                    max_prompt_length=8, save_steps=0, learning_rate=1e-3, sample_history_steps=50)
    current = [r["memory"]["current"] for r in history]
    assert len(current) == 1000 and min(current) > 0
    drift = (current[999] - current[9]) / current[9]
    assert abs(drift) < 0.02, f"memory went from {current[9]} to {current[999]} bytes ({drift:+.2%})"
    # Old records drop their samples, newer ones keep them.
    assert history[0]["samples"] == [] and history[949]["samples"] == [] and history[950]["samples"]


def test_an_error_inside_the_update_writes_no_checkpoint_and_keeps_the_last_good_one(tok, tmp_path, monkeypatch):
    """The weights move first in a step; if its bookkeeping then fails (here the record), the state is neither step 1
    nor step 2: no checkpoint is written from it, and rotation does not delete the good one for it."""
    real = trainer_mod.make_record

    def fails_at_step_2(step, *args, **kwargs):
        if step == 2:
            raise RuntimeError("a bug while making the record")
        return real(step, *args, **kwargs)

    monkeypatch.setattr(trainer_mod, "make_record", fails_at_step_2)
    with pytest.raises(RuntimeError, match="a bug") as err:
        train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path), max_steps=3, verbose=False,
              **{**FAST, "save_steps": 1, "save_total_limit": 1})
    assert any("inside the update of step 2" in note and "no checkpoint is written from that half-done step" in note
               for note in err.value.__notes__)
    assert [p.name for p in checkpoints(tmp_path)] == ["checkpoint-1"]
    state = load_training_checkpoint(tmp_path / "checkpoint-1", lora_model())  # the good one, still loadable
    assert state["step"] == 1 and state["scheduler"]["last_epoch"] == 1


def test_weights_made_nonfinite_by_an_update_are_never_saved(tok, tmp_path, monkeypatch):
    """A finite gradient can still give NaN weights (a damaged optimizer state, a huge weight_decay): the run stops
    naming the step, keeps the checkpoint before it, and writes no adapter of NaNs."""
    real, steps = trainer_mod.apply_update, []

    def breaks_at_step_2(optimizer, params, *args, **kwargs):
        metrics = real(optimizer, params, *args, **kwargs)
        steps.append(1)
        if len(steps) == 2:
            with torch.no_grad():
                params[0].fill_(math.nan)
        return metrics

    monkeypatch.setattr(trainer_mod, "apply_update", breaks_at_step_2)
    with pytest.raises(NonFiniteTrainingError, match=r"are NaN or inf after the update of step 2 \(1 tensor\(s\), "
                                                     r"e\.g\. .*lora_A.*Nothing is saved"):
        train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path), max_steps=3, verbose=False,
              **{**FAST, "save_steps": 1})
    assert [p.name for p in checkpoints(tmp_path)] == ["checkpoint-1"]
    assert not (tmp_path / "adapter_model.safetensors").exists()


def test_the_nonfinite_streak_advises_bf16_only_where_it_is_native():
    from grpo_nb.streaks import check_nonfinite_streak

    history = [{"step": s, "skipped_nonfinite": True} for s in (1, 2, 3)]
    with pytest.raises(NonFiniteTrainingError, match=r"dtype='bfloat16' on a GPU of compute capability 8\.0\+, else "
                                                     r"dtype='float32'"):
        check_nonfinite_streak(history, GRPOConfig(max_nonfinite_steps=3))
