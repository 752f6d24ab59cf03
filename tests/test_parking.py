"""park_optimizer_state: the optimizer's state in host memory between optimizer steps (grpo_nb.parking).

On the CPU the "host" is the CPU itself, so forced on, the same code path runs (every state tensor copied out,
replaced and brought back); the simulation shows what it frees on a GPU."""

import pytest
import torch

import grpo_nb.checkpointing as ckpt
import grpo_nb.trainer as trainer_module
from grpo_nb import GRPOConfig, estimate_vram, parking, train
from grpo_nb.checkpointing import checkpoints
from grpo_nb.memory import step_peak
from grpo_nb.optim import adamw
from grpo_nb.simulate import simulate_step
from tiny_models import FAST, dataset, lora_model, tiny_config, token_id_reward


def stepped(optimizer, params, steps, park, start=0):
    """`steps` AdamW steps on fixed gradients, parked between them as apply_update parks."""
    for i in range(start, start + steps):
        for p in params:
            p.grad = torch.full_like(p, 0.1 * (i + 1)) + p.detach() * 0.01
        if park:
            parking.restore(optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if park:
            parking.park(optimizer)


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused", "adamw_8bit"])
def test_parked_state_leaves_and_comes_back_with_equal_values(optim):
    """Every state tensor is replaced by its host copy (shared ones, bitsandbytes' quantization maps, stay shared)
    and comes back as a fresh device tensor: the steps equal unparked steps bit for bit."""
    if optim == "adamw_8bit":
        pytest.importorskip("bitsandbytes", reason="adamw_8bit is bitsandbytes' (the dev extra installs it)")
    params, plain = ([torch.nn.Parameter(torch.linspace(-1, 1, 8192).reshape(128, 64) * (k + 1)) for k in range(2)]
                     for _ in range(2))
    config = GRPOConfig(optim=optim, learning_rate=1e-2, park_optimizer_state=True)
    # The first AdamW step in a process came out ~1 ulp apart from later ones (in about 1 of 3 fresh processes,
    # parking or not): one throwaway step first, so the parked and the reference optimizer compute alike.
    stepped(adamw(spare := [torch.nn.Parameter(torch.ones(128, 64))], config), spare, 1, park=False)
    optimizer, reference = adamw(params, config), adamw(plain, config)
    parking.attach(optimizer, parking.OptimizerParking(optimizer, "cpu"))  # the CPU as the "host"
    stepped(optimizer, params, 1, park=False)
    before = {(i, k): v for i, s in enumerate(optimizer.state.values()) for k, v in s.items() if torch.is_tensor(v)}
    parking.park(optimizer)
    assert parking.of(optimizer).parked
    after = {(i, k): v for i, s in enumerate(optimizer.state.values()) for k, v in s.items() if torch.is_tensor(v)}
    assert all(after[key] is not before[key] and torch.equal(after[key], before[key]) for key in before)
    if optim == "adamw_8bit":  # one host copy of the map both parameters' states share
        states = list(optimizer.state.values())
        assert states[0]["qmap1"] is states[1]["qmap1"]
    parking.park(optimizer)  # parked twice: nothing moves
    assert all(v is after[(i, k)] for i, s in enumerate(optimizer.state.values()) for k, v in s.items()
               if torch.is_tensor(v))
    stepped(optimizer, params, 3, park=True, start=1)
    stepped(reference, plain, 4, park=False)
    for a, b in zip(params, plain):
        assert torch.equal(a, b)
    for a, b in zip(optimizer.state.values(), reference.state.values()):
        for key in b:
            assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), key
    parking.restore(optimizer)
    assert not parking.of(optimizer).parked
    if optim == "adamw_8bit":  # shared again on the device
        states = list(optimizer.state.values())
        assert states[0]["qmap1"] is states[1]["qmap1"]


def test_auto_parks_on_cuda_only_and_not_paged_optimizers_nor_past_the_budget():
    assert parking.parks("auto", "cuda") and not parking.parks("auto", "cpu")
    assert not parking.parks("auto", "cuda", "paged_adamw_8bit") and parking.parks(True, "cpu", "paged_adamw_8bit")
    assert not parking.parks(False, "cuda")
    params = [torch.nn.Parameter(torch.ones(64, 64))]
    optimizer = adamw(params, GRPOConfig())
    assert parking.of(optimizer) is None  # "auto" on the CPU
    holder = parking.attach(optimizer, parking.OptimizerParking(optimizer, "cpu", budget=1024))  # 16 KiB of state
    with pytest.warns(UserWarning, match=r"keeps the optimizer's state \(0.00 GiB\) on the device"):
        stepped(optimizer, params, 1, park=True)
    assert not holder.parked and not holder.enabled


def rollout_sees(monkeypatch):
    """Whether the optimizer's state was parked at each rollout of the next train() runs."""
    seen, built = [], []

    def build(model, config):
        out = build_optimizer(model, config)
        built.append(out[0])
        return out

    def sample(*args, **kwargs):
        seen.append(parking.of(built[-1]).parked)
        return sample_batch(*args, **kwargs)

    build_optimizer, sample_batch = trainer_module.build_optimizer, trainer_module.sample_batch
    monkeypatch.setattr(trainer_module, "build_optimizer", build)
    monkeypatch.setattr(trainer_module, "sample_batch", sample)
    return seen


def test_train_parked_equals_unparked_and_resumes_exactly(tok, tmp_path, monkeypatch):
    """3 steps of train() with the state parked (CPU -> CPU copies) give the weights and losses of 3 unparked ones;
    a parked run saved at step 2 holds the unparked run's optimizer state, and resumed (parked again before its
    first rollout) ends where the unbroken run ends."""
    settings = dict(FAST, max_steps=3, seed=3, verbose=False, live=False, lr_scheduler_type="constant")
    plain_model = lora_model()
    plain = train(plain_model, tok, dataset(), token_id_reward, output_dir=str(tmp_path / "plain"),
                  **{**settings, "max_steps": 2, "save_steps": 2})
    plain = train(plain_model, tok, dataset(), token_id_reward, output_dir=str(tmp_path / "plain"),
                  resume_from_checkpoint=True, **settings)  # (the whole history)
    assert not plain[0]["memory"]["optimizer_parked"]

    seen = rollout_sees(monkeypatch)
    parked_model = lora_model()
    parked = train(parked_model, tok, dataset(), token_id_reward, output_dir=str(tmp_path / "parked"),
                   park_optimizer_state=True, **settings)
    assert seen == [False, True, True]  # no state before the first step; parked through every later rollout
    assert parked[-1]["memory"]["optimizer_parked"]
    assert [r["loss"] for r in parked] == [r["loss"] for r in plain]
    for (name, a), b in zip(plain_model.named_parameters(), parked_model.parameters()):
        assert torch.equal(a, b), name

    seen.clear()
    broken_model = lora_model()
    train(broken_model, tok, dataset(), token_id_reward, output_dir=str(tmp_path / "broken"),
          park_optimizer_state=True, **{**settings, "max_steps": 2, "save_steps": 2})
    saved = ckpt.read_state(checkpoints(tmp_path / "broken")[-1])["optimizer"]["state"]
    reference = ckpt.read_state(checkpoints(tmp_path / "plain")[-1])["optimizer"]["state"]
    assert saved.keys() == reference.keys()
    for i in reference:
        for key, value in reference[i].items():
            assert torch.equal(torch.as_tensor(saved[i][key]), torch.as_tensor(value)), (i, key)
    resumed_model = lora_model()
    train(resumed_model, tok, dataset(), token_id_reward, output_dir=str(tmp_path / "broken"),
          resume_from_checkpoint=True, park_optimizer_state=True, **settings)
    assert seen == [False, True, True]  # the resumed step's rollout: parked once the checkpoint was loaded
    for (name, a), b in zip(plain_model.named_parameters(), resumed_model.parameters()):
        assert torch.equal(a, b), name


def test_the_simulated_rollout_and_update_run_without_the_parked_state():
    """On the meta device (a simulated GPU): parked, the rollout's and the policy update's peaks are the optimizer's
    bytes lower, the optimizer step's the same; the categories add up to the peak by step_peak, as the estimate's."""
    cfg = tiny_config("llama")
    shape = dict(max_prompt_length=16, max_completion_length=24, num_generations=4, lora_rank=4)
    kept, parked = (simulate_step(cfg, park_optimizer_state=p, **shape) for p in (False, "auto"))
    optimizer = kept.categories["optimizer"]
    assert optimizer > 0 and parked.categories["optimizer"] == optimizer  # the category is still the bytes
    assert parked.settings["park_optimizer_state"] and not kept.settings["park_optimizer_state"]
    for phase in ("rollout", "policy update"):
        assert kept.phases[phase]["peak"] - parked.phases[phase]["peak"] == optimizer, phase
    assert kept.phases["optimizer step"]["peak"] == parked.phases["optimizer step"]["peak"]
    assert parked.host_peak - kept.host_peak == optimizer  # where it waits
    assert kept.peak - parked.peak == optimizer
    for step in (kept, parked):
        assert step_peak(step.categories, parked=step.settings["park_optimizer_state"]) == step.peak
    # the estimate counts it the same way
    plain, estimate = (estimate_vram(cfg, park_optimizer_state=p, **shape) for p in (False, "auto"))
    assert estimate.settings["park_optimizer_state"] and not plain.settings["park_optimizer_state"]
    assert plain.rollout_peak - estimate.rollout_peak == plain["optimizer"]
    assert plain.total - estimate.total == plain["optimizer"]  # the update's activations outweigh the moments
    assert not estimate_vram(cfg, device="cpu", **shape).settings["park_optimizer_state"]
    assert not estimate_vram(cfg, optim="paged_adamw_8bit", **shape).settings["park_optimizer_state"]


def test_a_real_parked_step_frees_the_optimizer_bytes_in_the_rollout_and_the_update():
    """The simulation's step (run_step) on a real CPU model under the allocation counter, parked and not: the
    rollout's and the policy update's peaks are the optimizer's bytes lower parked, its host copies that much, as
    the simulation counts them on meta (above)."""
    from transformers import AutoModelForCausalLM

    from grpo_nb.models import prepare_for_training
    from grpo_nb.rollout import RolloutEngine
    from grpo_nb.simulate import AllocationTracker, forced_batch, run_step
    from grpo_nb.simulate.step import _TokenizerStandIn

    G, P, C, micro = 4, 16, 24, 2
    cfg = tiny_config("llama")
    reports = {}
    # A CPU rollout's few-row products time two ways on their first calls in a process (lora.ProductChoice), each
    # way with its own temporaries: one rollout first, so both measured ones multiply the same way.
    torch.manual_seed(0)
    warm = prepare_for_training(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), lora_rank=4,
                                gradient_checkpointing=True, max_seq_length=P + C)
    batch = forced_batch(G, P, C, cfg.vocab_size)
    RolloutEngine(max_completion_length=C, min_new_tokens=C, decode="dynamic")(
        warm, _TokenizerStandIn(cfg), batch.prompt_ids, batch.prompt_mask, 1)
    for park in (False, True):
        torch.manual_seed(0)
        model = prepare_for_training(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), lora_rank=4,
                                     gradient_checkpointing=True, max_seq_length=P + C)
        config = GRPOConfig(num_generations=G, per_device_train_batch_size=micro, max_completion_length=C,
                            gradient_accumulation_steps=G // micro, max_prompt_length=P, logprob_backend="torch",
                            max_steps=1, park_optimizer_state=park)
        tracker = AllocationTracker("cpu", label_bytes=0)
        with tracker:
            extra = run_step(model, forced_batch(G, P, C, cfg.vocab_size), config, tracker,
                             rollout=RolloutEngine(max_completion_length=C, min_new_tokens=C, decode="dynamic"),
                             tokenizer=_TokenizerStandIn(cfg))
        assert extra["optimizer_parked"] == park
        reports[park] = tracker.report()
    kept, parked = reports[False], reports[True]
    # the moments, and AdamW's step counts (4 bytes each), which on the CPU are on the device too
    optimizer = pytest.approx(extra["optimizer"], rel=0.01)
    for phase in ("rollout", "policy update"):
        assert kept.phase_peaks[phase] - parked.phase_peaks[phase] == optimizer, phase
    assert kept.phase_peaks["optimizer step"] == parked.phase_peaks["optimizer step"]
    assert parked.host_peak - kept.host_peak == optimizer  # in host memory meanwhile


def test_park_optimizer_state_is_checked():
    for bad in ("yes", "True", 1, None):
        with pytest.raises(ValueError, match=r"GRPOConfig.park_optimizer_state=.* is invalid: expected True, False"):
            GRPOConfig(park_optimizer_state=bad)
    with pytest.raises(ValueError, match="a bool, not the text"):
        GRPOConfig(park_optimizer_state="False")
    with pytest.raises(ValueError, match=r"park_optimizer_state.*one of 'auto', True, False"):
        estimate_vram(tiny_config("llama"), park_optimizer_state="on")
    with pytest.raises(ValueError, match=r"park_optimizer_state.*TRL keeps its optimizer's state"):
        simulate_step(tiny_config("llama"), system="trl", park_optimizer_state=True)
