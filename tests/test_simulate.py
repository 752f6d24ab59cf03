"""The memory simulation (grpo_nb.simulate): its counter, its oracle, and its honesty against real runs.

The honesty check runs the same step - the same function, `simulate.run_step` - twice: once on
a real CPU model, counted by the CPU allocator and by torch's own profiler, and once on the
meta device as `simulate_step(device="cpu")` runs it. The peaks must agree within 2%.
"""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from grpo_nb.memory import estimate_vram
from grpo_nb.config import GRPOConfig
from grpo_nb.models import prepare_for_training
from grpo_nb.rollout import RolloutEngine
from grpo_nb.simulate import AllocationTracker, OracleError, SimulatedDevice, forced_batch, run_step, simulate_step
from grpo_nb.simulate.step import _TokenizerStandIn
from tiny_models import tiny_config


def profiler_peak(prof) -> int:
    """The peak of what torch's CPU allocator handed out while profiling (its [memory] events in order)."""
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    now = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        now += e.nbytes()
        peak = max(peak, now)
    return peak


def test_counts_meta_like_the_cpu():
    def step(device):
        x = torch.randn(256, 512, device=device, requires_grad=True)
        w = torch.randn(1024, 512, device=device, dtype=torch.bfloat16)
        ((x.bfloat16() @ w.t()).float().relu() * 2.0).sum().backward()

    counts = {}
    for device in ("meta", "cpu"):
        tracker = AllocationTracker(device, label_bytes=0)
        with tracker, tracker.outputs_only_meta_kernels():
            step(device)
        counts[device] = tracker.report()
    assert counts["meta"].peak == counts["cpu"].peak > 0
    # Only the outputs of Python meta kernels count: bf16 * 2.0 computes through fp32 copies on meta.
    tracker = AllocationTracker("meta", label_bytes=0)
    with tracker:
        step("meta")
    assert tracker.report().peak > counts["meta"].peak


def test_oracle_keeps_known_values_and_refuses_to_guess():
    oracle = SimulatedDevice("cuda")
    with oracle:
        mask = oracle.know(torch.empty(2, 5, dtype=torch.long, device="meta"),
                           torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]))
        assert not bool(mask.all()) and int(mask.sum()) == 9
        assert int(mask.any(0).int().argmax()) == 0
        idx = mask.nonzero()
        assert idx.device.type == "meta" and idx.shape == (9, 2)
        x = torch.randn(2, 5, 3, device="meta", requires_grad=True)
        picked = x[mask.bool()]  # boolean indexing keeps its shape and its gradient
        assert picked.shape == (9, 3) and picked.requires_grad
        loss = (x * 2).sum()
        assert bool(torch.isfinite(loss)) and not bool(torch.isnan(loss).any())
        assert float(loss) == 1.0  # a finite placeholder, recorded
        with pytest.raises(OracleError, match="test_simulate.py"):
            int(loss.long())
        with pytest.raises(OracleError, match="boolean mask"):
            x[x > 0]
    asked = {q["question"] for q in oracle.questions}
    assert {"__bool__", "__int__", "__float__"} <= asked
    assert any(not q["known"] for q in oracle.questions)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_simulated_step_matches_a_real_cpu_step(attention):
    """Rollout, policy update and optimizer step of a real CPU model vs the same step on meta: within 2%."""
    G, P, C, micro = 4, 16, 24, 2
    cfg = tiny_config("llama")
    cfg._attn_implementation = attention
    sim = simulate_step(cfg, device="cpu", dtype="fp32", max_prompt_length=P, max_completion_length=C,
                        num_generations=G, per_device_train_batch_size=micro, lora_rank=4,
                        gradient_checkpointing=True, rollout=True)

    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = prepare_for_training(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), lora_rank=4,
                                 gradient_checkpointing=True, max_seq_length=P + C)
    config = GRPOConfig(num_generations=G, per_device_train_batch_size=micro, gradient_accumulation_steps=G // micro,
                        max_completion_length=C, max_prompt_length=P, logprob_backend="torch", max_steps=1)
    engine = RolloutEngine(max_completion_length=C, min_new_tokens=C, decode="dynamic")  # forced lengths
    # once before: what a process does at its first rollout only (the C kernels' build and check, timing each
    # few-row product's ways, each with its own temporaries) is not the step's memory
    warm = forced_batch(G, P, C, cfg.vocab_size, num_generations=G)
    engine(model, _TokenizerStandIn(cfg), warm.prompt_ids, warm.prompt_mask, 1)
    tracker = AllocationTracker("cpu", label_bytes=0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, tracker:
        batch = forced_batch(G, P, C, cfg.vocab_size, num_generations=G)
        run_step(model, batch, config, tracker, rollout=engine, tokenizer=_TokenizerStandIn(cfg))
    real = tracker.report()
    assert real.peak == pytest.approx(profiler_peak(prof), rel=1e-3)  # the counter agrees with torch's profile
    assert sim.counted_peak == pytest.approx(real.peak, rel=0.02)
    for phase in ("rollout", "policy update"):
        assert sim.phases[phase]["peak"] - sim.peak + sim.counted_peak == pytest.approx(real.phase_peaks[phase], rel=0.03)
    assert sim.categories["kv_cache"] > 0 and sim.categories["gradients"] > 0 and sim.categories["optimizer"] > 0


@pytest.mark.parametrize("turns,result", [(3, 4), (2, 0)])
def test_simulated_episodes_match_a_real_cpu_episode_rollout(turns, result, monkeypatch):
    """Multi-turn episodes (train(tools=...)): the rollout through the engine's episode turns, real on the CPU vs
    simulate_step(tool_turns=...) on meta, within 2% (phases within 3%); the update has the single-turn shapes.
    (Without the CPU rollout's merged adapter weights, which test_simulated_step_matches_a_real_cpu_step counts:
    here they would hide the episodes' own bytes.)"""
    from grpo_nb import lora
    from grpo_nb.simulate.episodes import EpisodeRollout

    monkeypatch.setattr(lora, "MERGE_ON_CPU", False)

    G, P, C, micro = 4, 16, 24, 2
    cfg = tiny_config("llama")
    settings = dict(device="cpu", dtype="fp32", max_prompt_length=P, max_completion_length=C, num_generations=G,
                    per_device_train_batch_size=micro, lora_rank=4, gradient_checkpointing=True)
    sim = simulate_step(cfg, tool_turns=turns, tool_result_tokens=result, **settings)
    single = simulate_step(cfg, **settings)

    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = prepare_for_training(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), lora_rank=4,
                                 gradient_checkpointing=True, max_seq_length=P + C)
    config = GRPOConfig(num_generations=G, per_device_train_batch_size=micro, gradient_accumulation_steps=G // micro,
                        max_completion_length=C, max_prompt_length=P, logprob_backend="torch", max_steps=1)
    engine = RolloutEngine(max_completion_length=C, min_new_tokens=C, decode="dynamic")  # every turn at its budget
    tracker = AllocationTracker("cpu", label_bytes=0)
    with tracker:
        batch = forced_batch(G, P, C, cfg.vocab_size, num_generations=G)
        run_step(model, batch, config, tracker, rollout=EpisodeRollout(engine, turns, result),
                 tokenizer=_TokenizerStandIn(cfg))
    real = tracker.report()
    assert sim.counted_peak == pytest.approx(real.peak, rel=0.02)
    for phase in ("rollout", "policy update"):
        assert sim.phases[phase]["peak"] - sim.peak + sim.counted_peak == pytest.approx(real.phase_peaks[phase], rel=0.03)
    assert sim.phases["policy update"]["peak"] == single.phases["policy update"]["peak"]

    def rollout_bytes(phases, starts=None):  # what the rollout allocated above what it started with
        return phases["rollout"]["peak"] - phases["rollout"]["start"] if starts is None else phases["rollout"] - starts["rollout"]

    episode = rollout_bytes(sim.phases)
    assert episode == pytest.approx(rollout_bytes(real.phase_peaks, real.phase_start), rel=0.02)
    if result:  # the results' prefills and the cache of every kept row: more than one turn of the same length
        assert episode > 1.1 * rollout_bytes(single.phases)
    with pytest.raises(ValueError, match="at least one sampled token a turn"):
        simulate_step(cfg, tool_turns=5, tool_result_tokens=6, **settings)
    with pytest.raises(ValueError, match="tool_turns"):
        simulate_step(cfg, tool_turns=2, system="trl", **settings)


def test_full_size_shapes_in_seconds():
    """Qwen2.5-1.5B shapes, 4-bit, offloaded checkpointing, on the simulated GPU (short completions for CI)."""
    step = simulate_step("Qwen/Qwen2.5-1.5B-Instruct", max_prompt_length=64, max_completion_length=128,
                         num_generations=4, load_in_4bit=True, gradient_checkpointing="offload")
    c = step.categories
    assert 1.0e9 < c["base_weights"] < 1.3e9  # NF4 decoder + bf16 embeddings
    assert c["trainable"] == 18_464_768 * 4  # LoRA r=16 on every linear layer, fp32 under peft
    assert c["optimizer"] == 2 * c["trainable"] and c["gradients"] == c["trainable"]
    assert step.host_peak > 0  # offloaded layer inputs wait in (pinned) host memory
    # The categories add up to the peak as estimate_vram's do: the static ones plus the larger phase (the optimizer's
    # state, parked in host memory between steps on a GPU by default, a phase of its own: grpo_nb.parking)
    update = c["gradients"] + c["activations"] + c["logprob_scratch"]
    assert step.settings["park_optimizer_state"]
    assert step.peak == c["base_weights"] + c["trainable"] + c["other"] + max(c["kv_cache"], update,
                                                                              c["gradients"] + c["optimizer"])
    assert {"rollout", "policy update", "optimizer step"} <= set(step.phases)
    where = " ".join(w for w, _, _ in step.largest_at_peak)
    assert "weights" in where
    assert all(q["known"] or q["question"] in ("__float__", "item", "isin (end of sequence?)") for q in step.questions)


def test_trl_step_runs_trl_code():
    """TRL's own trainer, built around the meta model, for the same batch."""
    trl = simulate_step("Qwen/Qwen2.5-0.5B-Instruct", system="trl", max_prompt_length=32, max_completion_length=64,
                        num_generations=4, gradient_checkpointing=True, load_in_4bit=True)
    ours = simulate_step("Qwen/Qwen2.5-0.5B-Instruct", max_prompt_length=32, max_completion_length=64,
                         num_generations=4, gradient_checkpointing=True, load_in_4bit=True)
    assert trl.settings["trl_version"]
    assert trl.categories["base_weights"] == ours.categories["base_weights"]
    assert trl.categories["trainable"] * 2 == ours.categories["trainable"]  # TRL casts QLoRA adapters to bf16
    assert any("trl/trainer/grpo_trainer.py" in q["where"] for q in trl.questions)
    assert trl.categories["kv_cache"] > 0 and trl.phases["policy update"]["peak"] > trl.categories["base_weights"]


def test_simulations_in_other_dtypes_in_one_process():
    """fp32 then fp16 in one process (P16-1): a grouped-query model in fp32 takes CUDA's math attention (the
    efficient kernel takes no grouped keys), and a kernel output remembered from one dtype's build is not
    handed to the next (from_config makes the default dtype the model's while it builds)."""
    settings = dict(max_prompt_length=16, max_completion_length=16, num_generations=2)
    fp32 = simulate_step(tiny_config("llama"), dtype="fp32", **settings)
    fp16 = simulate_step(tiny_config("llama"), dtype="fp16", **settings)
    assert fp32.categories["base_weights"] > 1.9 * fp16.categories["base_weights"] > 0  # fp32 buffers in both
    assert fp32.peak > fp16.peak
    assert torch.get_default_dtype() == torch.float32


def test_a_simulated_card_is_forgotten_after_its_simulation():
    """The card a simulation stands for (its compute capability, which meta tensors' kernels ask) ends with it: it
    was left set, so that a CPU simulation after a T4's priced the T4's kernels (the device is entered twice)."""
    from grpo_nb.attention import simulated_capability
    from grpo_nb.kernels import decode_glue

    step = simulate_step(tiny_config("llama"), max_prompt_length=16, max_completion_length=16, num_generations=2,
                         gpu="T4")
    assert simulated_capability.get() is None
    step.record_ops()
    assert simulated_capability.get() is None and decode_glue.sampler("meta") is None


def test_simulating_a_live_model_leaves_its_config_alone():
    """simulate_step and plan_for_gpu(simulate=True) build from a copy of the model's config (P16-4)."""
    from grpo_nb import plan_for_gpu
    from tiny_models import tiny_model

    model = tiny_model()
    before = model.config.to_dict()
    simulate_step(model, load_in_4bit=True, max_prompt_length=16, max_completion_length=16, num_generations=2)
    plan_for_gpu(16, model, max_prompt_length=16, max_completion_length=(16,), simulate=True)
    assert model.config.to_dict() == before
    assert model.config.use_cache and model.config.dtype == torch.float32


def test_entropy_bonus_simulated():
    """entropy_coef > 0 (entropies with their gradient, chunk by chunk under checkpointing) runs in the simulation;
    it adds no more than a chunk's logits to the update, so estimate_vram, which has no term for it, still holds."""
    kw = dict(max_prompt_length=64, max_completion_length=256, num_generations=4, per_device_train_batch_size=2,
              rollout=False, logprob_backend="torch")
    plain = simulate_step("Qwen/Qwen2.5-0.5B-Instruct", **kw)
    bonus = simulate_step("Qwen/Qwen2.5-0.5B-Instruct", entropy_coef=0.01, **kw)
    assert bonus.settings["entropy_coef"] == 0.01
    assert plain.peak <= bonus.peak <= plain.peak * 1.05
    kw.pop("rollout")
    assert estimate_vram("Qwen/Qwen2.5-0.5B-Instruct", **kw).total == pytest.approx(bonus.peak, rel=0.1)
    with pytest.raises(ValueError, match="entropy bonus"):
        simulate_step("Qwen/Qwen2.5-0.5B-Instruct", system="trl", entropy_coef=0.01, **kw)
    with pytest.raises(ValueError, match="entropy_coef"):
        simulate_step("Qwen/Qwen2.5-0.5B-Instruct", entropy_coef=-1, **kw)


def test_a_simulated_cpu_rollout_makes_the_copies_auto_may_pick():
    """num_iterations > 1 keeps the exact adapter arithmetic only without the rollout correction; on the CPU the
    correction left at None may come on with "auto"'s bf16 copies (decided on the real model), so the simulation
    makes the copies - the larger memory - rather than assume the exact path (hostile probe)."""
    from grpo_nb.simulate.step import _exact_adapters

    assert not _exact_adapters(GRPOConfig(num_iterations=2), "cpu")
    assert _exact_adapters(GRPOConfig(num_iterations=2), "cuda")
    assert _exact_adapters(GRPOConfig(num_iterations=2, rollout_importance_sampling_correction=False), "cpu")
    assert not _exact_adapters(GRPOConfig(num_iterations=1), "cpu")
