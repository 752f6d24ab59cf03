"""The GRPO loop on a tiny random model: records, saving, and every bad input of the core issue."""

import math

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, PeftModel, get_peft_model

import grpo_nb.step as step_mod
import grpo_nb.trainer as trainer_mod
from grpo_nb import RewardFunctionError, evaluate, train
from tiny_models import FAST, count_w7, dataset, length_reward, lora_model, tiny_model, token_id_reward

def test_records_and_saved_adapter(tok, tmp_path):
    model = lora_model()
    seen = []
    hist = train(model, tok, dataset(), [count_w7, length_reward], output_dir=str(tmp_path), max_steps=2,
                 callbacks=[seen.append], verbose=False, **FAST)
    assert len(hist) == 2 and seen == hist
    r = hist[-1]
    for key in ("reward", "reward_std", "loss", "kl", "clip_ratio", "completion_length_mean", "completion_length_max",
                "frac_reward_zero_std", "step_time", "peak_memory_bytes", "grad_norm", "learning_rate"):
        assert isinstance(r[key], (int, float)), key
    assert set(r["rewards"]) == {"count_w7", "length_reward"}
    assert 1 <= r["completion_length_mean"] <= 6 and r["peak_memory_bytes"] > 0
    assert len(r["samples"]) == 4 and {"prompt", "completion", "rewards", "reward", "advantage", "answer"} <= set(
        r["samples"][0])
    # The adapter is saved at the end and loads back with peft, giving the same weights.
    reloaded = PeftModel.from_pretrained(tiny_model("llama", seed=0), tmp_path)
    a = dict(model.named_parameters())
    for name, p in reloaded.named_parameters():
        if "lora_B" in name:
            assert torch.equal(p, a[name])
    assert (tmp_path / "history.json").exists() and (tmp_path / "grpo_config.json").exists()


def test_conversational_prompts_and_trl_style_reward_arguments(tok, tmp_path):
    seen = {}

    def spy(prompts, completions, completion_ids, answer, trainer_state, **kwargs):
        seen.update(prompts=prompts, completions=completions, answer=answer, state=trainer_state)
        return [0.0] * len(completions)

    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": "w5 w6"}]] * 2, "answer": ["1", "2"]})
    train(lora_model(), tok, ds, spy, output_dir=str(tmp_path), max_steps=1, verbose=False, **FAST)
    assert len(seen["completions"]) == 8
    assert seen["completions"][0][0]["role"] == "assistant" and isinstance(seen["completions"][0][0]["content"], str)
    assert seen["prompts"][0] == [{"role": "user", "content": "w5 w6"}]
    assert sorted(set(seen["answer"])) == ["1", "2"]  # columns repeated once per generation
    assert seen["state"].global_step == 0 and seen["state"].max_steps == 1  # TRL's trainer_state fields
    # transformers' TrainerState, as TRL passes its own: 2 prompts per step over a dataset of 2 rows
    from transformers import TrainerState
    state = seen["state"]
    assert isinstance(state, TrainerState) and (state.epoch, state.num_train_epochs) == (0.0, 1)
    assert (state.logging_steps, state.save_steps, state.train_batch_size) == (1, 0, 4)
    assert state.is_world_process_zero and state.is_local_process_zero and state.log_history == []


def test_kl_and_multiple_iterations(tok, tmp_path):
    hist = train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path), max_steps=4, beta=0.1,
                 num_iterations=2, verbose=False, **FAST)
    assert len(hist) == 4
    # Steps 1-2 share a generation batch, as do 3-4; the KL to the adapter-free reference is >= 0.
    assert hist[0]["completion_length_mean"] == hist[1]["completion_length_mean"]
    assert all(r["kl"] >= 0 and math.isfinite(r["kl"]) for r in hist)
    assert hist[1]["kl"] > 0  # the policy moved away from the reference after one update


def test_nonfinite_loss_skips_the_step_and_keeps_weights(tok, tmp_path, monkeypatch):
    model = lora_model()
    real = step_mod.grpo_loss

    def nan_loss(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        return loss * float("nan"), metrics

    monkeypatch.setattr(step_mod, "grpo_loss", nan_loss)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    hist = train(model, tok, dataset(), count_w7, output_dir=str(tmp_path), max_steps=2, verbose=False, **FAST)
    assert all(r["skipped_nonfinite"] for r in hist) and all(math.isnan(r["loss"]) for r in hist)
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, before[n]) and p.grad is None


# ------------------------------------------------------------------ bad inputs (the full catalog: test_bad_inputs.py)


def test_raising_reward_names_function_and_completion_and_keeps_progress(tok, tmp_path):
    calls = {"n": 0}

    def flaky(completions, **kwargs):
        calls["n"] += 1
        if calls["n"] > 1:  # fine at step 1, broken at step 2
            raise KeyError("boom")
        return [0.0] * len(completions)

    with pytest.raises(RewardFunctionError) as err:
        train(lora_model(), tok, dataset(), flaky, output_dir=str(tmp_path), max_steps=3, verbose=False, **FAST)
    msg = str(err.value)
    assert "flaky" in msg and "KeyError" in msg and "boom" in msg
    # Step 1's progress was saved, resumable, before the error propagated, and the note says where.
    assert (tmp_path / "checkpoint-1" / "adapter_model.safetensors").exists()
    assert (tmp_path / "checkpoint-1" / "trainer_state.json").exists()
    assert any("checkpoint-1" in n and "resume_from_checkpoint=True" in n for n in getattr(err.value, "__notes__", []))


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_gradient_accumulation_equals_one_big_batch(tok, loss_type):
    """Micro-batches of 2 with accumulation take exactly the step one batch of 8 would."""
    from grpo_nb.config import GRPOConfig

    g = torch.Generator().manual_seed(0)
    batch = {
        "prompt_ids": torch.randint(4, 500, (8, 5), generator=g), "prompt_mask": torch.ones(8, 5, dtype=torch.long),
        "completion_ids": torch.randint(4, 500, (8, 6), generator=g),
        "completion_mask": (torch.arange(6)[None] < torch.tensor([6, 3, 1, 6, 2, 5, 4, 6])[:, None]).long(),
        "advantages": torch.randn(8, generator=g),
    }
    batch["prompt_mask"][1, :2] = 0  # a left-padded prompt
    batch = step_mod.StepBatch(**batch, loss_mask=batch["completion_mask"], num_generations=4)
    results = []
    for micro in (8, 2):
        model = lora_model(seed=0)
        for n, p in model.named_parameters():  # non-zero adapters, so every LoRA weight gets a gradient
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(1))
        params = [p for p in model.parameters() if p.requires_grad]
        config = GRPOConfig(num_generations=4, per_device_train_batch_size=micro, gradient_accumulation_steps=8 // micro,
                            loss_type=loss_type, max_completion_length=6, max_grad_norm=1e9)
        metrics = step_mod.accumulate_gradients(model, params, batch, config)
        metrics = step_mod.apply_update(torch.optim.SGD(params, lr=1.0), params, metrics, config)
        results.append((metrics, [p.detach().clone() for p in params]))
    (m_big, p_big), (m_small, p_small) = results
    assert m_big.loss == pytest.approx(m_small.loss, abs=1e-6)
    assert m_big.grad_norm == pytest.approx(m_small.grad_norm, rel=1e-5) and m_big.grad_norm > 0
    for a, b in zip(p_big, p_small):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_fp16_weights_train_with_loss_scaling(tok, tmp_path):
    """The T4 set-up: fp16 base weights, fp32 LoRA adapters, a GradScaler on the loss."""
    base = tiny_model("llama", seed=0).half()
    base.generation_config.eos_token_id = 2
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    model.train()
    assert trainer_mod.build_grad_scaler(model, torch.device("cpu")) is not None
    assert trainer_mod.build_grad_scaler(lora_model(), torch.device("cpu")) is None
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert all(p.dtype == torch.float32 for p in lora.values())
    hist = train(model, tok, dataset(), token_id_reward, output_dir=str(tmp_path), max_steps=3, verbose=False, **FAST)
    applied = [r for r in hist if not r["skipped_nonfinite"]]
    assert applied and all(math.isfinite(r["grad_norm"]) and math.isfinite(r["loss"]) for r in applied)
    changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, lora[n])]
    assert changed and all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.skipif(__import__("importlib").util.find_spec("triton") is None, reason="needs triton")
def test_train_with_the_triton_backend_matches_torch(tok, tmp_path):
    # On the CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py); same seed, same steps.
    hists = {}
    for backend in ("torch", "triton"):
        hists[backend] = train(lora_model(), tok, dataset(), [token_id_reward], output_dir=str(tmp_path / backend),
                               max_steps=2, verbose=False, logprob_backend=backend, **FAST)
    for a, b in zip(hists["torch"], hists["triton"]):
        assert a["reward"] == b["reward"]  # same completions
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    with pytest.raises(ValueError, match="logprob_backend"):
        train(lora_model(), tok, dataset(), [token_id_reward], logprob_backend="cuda", **FAST)


def test_native_engine_is_the_default_and_generate_stays_available(tok, tmp_path, monkeypatch):
    from grpo_nb.rollout.engine import RolloutEngine
    from grpo_nb.rollout import HFGenerateRollout

    calls = []
    for cls in (RolloutEngine, HFGenerateRollout):
        original = cls.__call__
        monkeypatch.setattr(cls, "__call__", lambda self, *a, _o=original, _c=cls: calls.append(_c) or _o(self, *a))
    train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path), max_steps=2, verbose=False, **FAST)
    assert calls == [RolloutEngine, RolloutEngine]
    calls.clear()
    hist = train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path), max_steps=1, verbose=False,
                 rollout="hf", **FAST)
    assert calls == [HFGenerateRollout] and math.isfinite(hist[0]["loss"])


# ------------------------------------------------------------------ DAPO dynamic sampling


def flat_unless_open(completion_ids, kind, **kwargs):
    """Rows of kind 'flat' always score 1 (a group with nothing to learn); 'open' rows vary."""
    return [1.0 if k == "flat" else float(sum(ids) % 7) for ids, k in zip(completion_ids, kind)]


def half_flat_dataset():
    ds = dataset(8)
    return ds.add_column("kind", ["flat", "open"] * 4)


def test_dynamic_sampling_replaces_zero_variance_groups(tok, tmp_path):
    settings = dict(FAST, max_steps=3, seed=1, verbose=False, output_dir=str(tmp_path))
    plain = train(lora_model(), tok, half_flat_dataset(), flat_unless_open, **settings)
    assert any(r["frac_reward_zero_std"] > 0 for r in plain) and all(r["sampling_rounds"] == 1 for r in plain)
    dynamic = train(lora_model(), tok, half_flat_dataset(), flat_unless_open, dynamic_sampling=True, **settings)
    assert all(r["frac_reward_zero_std"] == 0 for r in dynamic)
    assert any(r["sampling_rounds"] > 1 for r in dynamic)
    assert all(s["kind"] == "open" for r in dynamic for s in r["samples"])


def test_dynamic_sampling_falls_back_to_flat_groups_after_max_rounds(tok, tmp_path):
    ds = half_flat_dataset().map(lambda row: {"kind": "flat"})
    hist = train(lora_model(), tok, ds, flat_unless_open, dynamic_sampling=True, dynamic_sampling_max_rounds=3,
                 **dict(FAST, max_steps=1, verbose=False, output_dir=str(tmp_path)))
    assert hist[0]["sampling_rounds"] == 3 and hist[0]["frac_reward_zero_std"] == 1.0
    assert hist[0]["loss"] == 0.0  # all advantages zero: nothing to push


def test_keep_informative_groups_merges_rollouts_of_different_widths():
    from grpo_nb.config import GRPOConfig

    def part(rewards, tp, tc, seed):
        g = torch.Generator().manual_seed(seed)
        n = len(rewards)
        completion_mask = torch.ones(n, tc, dtype=torch.long)
        return step_mod.StepBatch(
            prompt_ids=torch.randint(4, 50, (n, tp), generator=g), prompt_mask=torch.ones(n, tp, dtype=torch.long),
            completion_ids=torch.randint(4, 50, (n, tc), generator=g), completion_mask=completion_mask,
            loss_mask=completion_mask.clone(), advantages=torch.zeros(n), num_generations=2,
            rewards=torch.tensor(rewards), rewards_per_func=torch.tensor(rewards)[:, None],
            truncated=torch.zeros(n, dtype=torch.bool), rows=[{"prompt": f"p{seed}-{k}"} for k in range(n)],
            texts=[f"t{seed}-{k}" for k in range(n)], sampling_logprobs=-torch.rand(n, tc), generation_time=1.0)

    config = GRPOConfig(num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                        scale_rewards="none")
    parts = [part([1.0, 0.0, 3.0, 3.0], tp=3, tc=5, seed=0),   # group 0 informative, group 1 flat
             part([2.0, 2.0, 0.0, 4.0], tp=6, tc=2, seed=1)]   # group 0 flat, group 1 informative
    batch = step_mod.keep_informative_groups(parts, config)
    assert batch.texts == ["t0-0", "t0-1", "t1-2", "t1-3"] and batch.sampling_rounds == 2
    assert batch.generation_time == 2.0 and batch.rows[2] == {"prompt": "p1-2"}
    assert batch.prompt_ids.shape == (4, 6) and batch.completion_ids.shape == (4, 5)
    # Prompts stay left-padded, completions right-padded, and the values are the chosen rows'.
    assert torch.equal(batch.prompt_ids[:2, 3:], parts[0].prompt_ids[:2])
    assert (batch.prompt_mask[:2, :3] == 0).all() and (batch.completion_mask[2:, 2:] == 0).all()
    assert torch.equal(batch.completion_ids[2:, :2], parts[1].completion_ids[2:])
    assert torch.equal(batch.sampling_logprobs[2:, :2], parts[1].sampling_logprobs[2:])
    assert batch.rewards.tolist() == [1.0, 0.0, 0.0, 4.0]
    assert batch.advantages.tolist() == [0.5, -0.5, -2.0, 2.0]
    # Micro-batches: whole rows, each trimmed of the columns that are padding in all its rows.
    micros = list(batch.micro_batches(2))
    assert [m.completion_ids.shape for m in micros] == [(2, 5), (2, 2)]
    assert [m.prompt_ids.shape for m in micros] == [(2, 3), (2, 6)]
    assert torch.equal(micros[1].per_token(batch.loss_mask), batch.loss_mask[2:, :2])


def test_top_entropy_quantile_and_variants_train(tok, tmp_path):
    """Each variant runs end to end and changes the update (the definitions are tested in test_loss.py)."""
    settings = dict(FAST, max_steps=2, num_iterations=2, seed=4, verbose=False, output_dir=str(tmp_path))
    final = {}
    for name, extra in {"grpo": {}, "entropy": {"top_entropy_quantile": 0.3}, "rloo": {"advantage_estimator": "rloo"},
                        "token": {"loss_type": "grpo"}, "gspo": {"importance_sampling_level": "sequence",
                                                                   "loss_type": "grpo"}}.items():
        model = lora_model()
        hist = train(model, tok, dataset(), token_id_reward, **settings, **extra)
        assert all(math.isfinite(r["loss"]) for r in hist)
        final[name] = torch.cat([p.detach().flatten() for p in model.parameters() if p.requires_grad])
    for name, baseline in (("entropy", "grpo"), ("rloo", "grpo"), ("gspo", "token")):
        assert not torch.equal(final[name], final[baseline]), name


def test_most_completions_cut_warns_once_and_is_recorded(tok, tmp_path):
    """A random tiny model rarely says EOS within 2 tokens: the answers would never arrive."""
    with pytest.warns(UserWarning, match=r"of this step's completions hit max_completion_length=2") as caught:
        hist = train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path), verbose=False,
                     **{**FAST, "max_steps": 3, "max_completion_length": 2})
    cut = [str(w.message) for w in caught if "hit max_completion_length" in str(w.message)]
    assert len(cut) == 1  # once per run
    assert all(r["truncated_fraction"] > 0.5 for r in hist)
    # sampling at temperature 1 (the default): a lower one is named too; below 1 it is not
    assert "sample at a lower temperature (now 1; e.g. 0.7)" in cut[0]
    with pytest.warns(UserWarning, match=r"hit max_completion_length=2") as caught:
        train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path / "cool"), verbose=False,
              **{**FAST, "max_steps": 1, "max_completion_length": 2, "temperature": 0.7})
    assert not any("lower temperature" in str(w.message) for w in caught)


def test_a_pandas_dataframe_is_a_dataset(tok, tmp_path):
    """One obvious meaning: its rows (the index is not a column). evaluate() takes it too."""
    import pandas as pd

    from grpo_nb.evaluation import evaluate

    frame = pd.DataFrame({"prompt": ["w5 w6", "w7 w8 w9"] * 4, "answer": ["1", "2"] * 4}, index=range(10, 18))
    seen = []

    def reward(completions, answer, **kwargs):
        seen.extend(answer)
        return [0.0] * len(completions)

    hist = train(lora_model(), tok, frame, [reward, token_id_reward], output_dir=str(tmp_path), verbose=False,
                 **{**FAST, "max_steps": 1})
    assert len(hist) == 1 and set(seen) <= {"1", "2"} and seen
    assert evaluate(lora_model(), tok, frame, max_completion_length=2, limit=3)["n"] == 3


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_our_calls_into_transformers_and_peft_raise_no_warnings(tok, tmp_path, family):
    """What a newcomer sees: set-up, a step (rollout, update, save) and an evaluation print no deprecation warnings
    from the libraries (torch's included), neither warnings.warn ones nor transformers' once-per-process logger
    ones (their cache is cleared first)."""
    import logging
    import warnings

    import transformers.utils.logging as hf_logging

    from grpo_nb.models import prepare_for_training

    hf_logging.warning_once.cache_clear()
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("transformers").addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = tiny_model(family, seed=0)
            model.generation_config.eos_token_id = 2
            model = prepare_for_training(model, lora_rank=4)
            train(model, tok, dataset(), count_w7, output_dir=str(tmp_path), verbose=False, live=False,
                  **{**FAST, "max_steps": 1, "save_steps": 1})
            evaluate(model, tok, dataset(4), max_completion_length=4)  # the main job's before/after, no rewards
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    library = [f"{w.category.__name__}: {w.message}" for w in caught  # torch's say "deprecated" in UserWarnings
               if issubclass(w.category, (FutureWarning, DeprecationWarning)) or "deprecated" in str(w.message)]
    assert not library, library
    assert not [m for m in logged if "deprecated" in m], logged


def test_a_model_object_trained_before_is_named_and_reused_batches_cost_no_generation_time(tok, tmp_path):
    """A re-run training cell trains the already trained object: say so. With num_iterations=2 the second step
    trains on the first one's rollout: it generated nothing (summing generation_time must not count it twice)."""
    import warnings

    model = lora_model()
    first = train(model, tok, dataset(), token_id_reward, output_dir=str(tmp_path / "a"), max_steps=2,
                  num_iterations=2, verbose=False, **FAST)
    assert first[0]["generation_time"] > 0 and first[1]["generation_time"] == 0.0
    with pytest.warns(UserWarning, match=r"already trained in this session by train\(\) \(output_dir='.*a', finished "
                                         r"at step 2/2\): this run starts from those trained weights") as caught:
        train(model, tok, dataset(), token_id_reward, output_dir=str(tmp_path / "b"), max_steps=1, verbose=False,
              **FAST)
    message = next(str(w.message) for w in caught if "already trained" in str(w.message))
    assert "setup_reasoning_model" in message and "left no checkpoint-<step>" in message
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path / "c"), max_steps=1,
              verbose=False, **FAST)
    assert not [w for w in caught if "already trained" in str(w.message)]
