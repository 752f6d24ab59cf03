"""train(..., config=trl.GRPOConfig(...)): shared fields carry over, the rest is refused or named, never dropped."""

import dataclasses
import warnings

import pytest

from grpo_nb import GRPOConfig, from_trl_config, train
from tiny_models import dataset, lora_model, token_id_reward

trl = pytest.importorskip("trl", reason="reads trl.GRPOConfig objects (the dev extra installs trl)")


def trl_config(**settings):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's own notes on its defaults
        # TRL's default bf16=True (its dtype default, which grpo-nb leaves to the model) needs use_cpu here
        return trl.GRPOConfig(output_dir="unused", use_cpu=True, **settings)


def test_every_shared_field_carries_over_with_trls_value():
    theirs = trl_config(max_steps=7, learning_rate=3e-5, num_generations=4, per_device_train_batch_size=8,
                        gradient_accumulation_steps=2, max_completion_length=48, temperature=0.7, top_p=0.9,
                        beta=0.04, epsilon=0.3, epsilon_high=0.28, loss_type="grpo", scale_rewards="batch",
                        lr_scheduler_type="cosine", optim="adamw_torch", weight_decay=0.1, seed=5, logging_steps=3,
                        save_steps=4, save_total_limit=2, mask_truncated_completions=True, log_completions=True,
                        num_completions_to_print=2, reward_weights=[1.0, 0.5], warmup_steps=0.1,
                        importance_sampling_level="sequence", top_entropy_quantile=0.5)
    ours = from_trl_config(theirs)
    shared = {f.name for f in dataclasses.fields(GRPOConfig)} & {f.name for f in dataclasses.fields(theirs)}
    assert len(shared) > 35
    for name in shared - {"report_to", "fsdp", "lr_scheduler_type", "optim", "project"}:
        assert getattr(ours, name) == getattr(theirs, name), name
    assert (ours.lr_scheduler_type, ours.optim, ours.warmup_ratio, ours.report_to) == ("cosine", "adamw_torch", 0.1,
                                                                                      "none")


def test_trl_defaults_mean_what_they_mean_in_trl():
    ours = from_trl_config(trl_config(max_steps=3))
    assert (ours.learning_rate, ours.optim, ours.use_bias_correction_kl, ours.max_completion_length) == (
        1e-6, "adamw_torch_fused", True, 512)
    # the vLLM correction (on by default in TRL) applies only with use_vllm=True there, so not here either
    assert not ours.rollout_importance_sampling_correction


def test_epochs_become_steps_from_the_dataset_size():
    theirs = trl_config(num_train_epochs=2, num_generations=4, per_device_train_batch_size=8)  # 2 prompts a step
    assert from_trl_config(theirs, dataset_size=10).max_steps == 10
    with pytest.raises(ValueError, match="epochs, which needs the dataset's size"):
        from_trl_config(theirs)
    with pytest.raises(ValueError, match=r"GRPOConfig\.num_iterations=0"):  # named itself, not as max_steps=0
        from_trl_config(trl_config(num_train_epochs=1, num_iterations=0, num_generations=4,
                                   per_device_train_batch_size=8), dataset_size=10)


def test_save_strategy_no_and_fractional_steps_take_trls_meaning():
    assert from_trl_config(trl_config(max_steps=40, save_strategy="no")).save_steps == 0
    ours = from_trl_config(trl_config(max_steps=40, save_steps=0.25, logging_steps=0.1))
    assert (ours.save_steps, ours.logging_steps) == (10, 4)  # TRL: a fraction of the run below 1
    with pytest.raises(ValueError, match=r"no counterpart for save_strategy=.epoch."):
        from_trl_config(trl_config(max_steps=3, save_strategy="epoch"))


def test_unsupported_settings_are_refused_by_name_and_others_named_in_a_warning():
    with pytest.raises(ValueError, match=r"no counterpart for delta=2.0; entropy_coef=0.01\."):
        from_trl_config(trl_config(max_steps=3, entropy_coef=0.01, delta=2.0))
    with pytest.raises(ValueError, match=r"use_vllm=True \(load the model with setup_reasoning_model"):
        from_trl_config(trl_config(max_steps=3, use_vllm=True))
    with pytest.warns(UserWarning, match=r"decides elsewhere and so ignores: disable_tqdm"):
        from_trl_config(trl_config(max_steps=3, disable_tqdm=True))
    with pytest.raises(ValueError, match="loss_type='luspo' is invalid"):  # a value grpo-nb lacks: its own check
        from_trl_config(trl_config(max_steps=3, loss_type="luspo"))
    with pytest.raises(TypeError, match="neither a grpo_nb.GRPOConfig nor a trl.GRPOConfig"):
        from_trl_config({"max_steps": 3})


def test_train_takes_a_trl_config(tok, tmp_path):
    theirs = trl_config(max_steps=2, learning_rate=1e-3, num_generations=4, per_device_train_batch_size=4,
                        gradient_accumulation_steps=2, max_completion_length=6, save_steps=500, log_completions=True)
    history = train(lora_model(), tok, dataset(), token_id_reward, config=theirs, output_dir=str(tmp_path),
                    verbose=False, live=False)
    assert [r["step"] for r in history] == [1, 2] and history[0]["learning_rate"] == 1e-3


def test_a_chosen_mixed_precision_is_named_in_the_warning():
    """bf16/fp16 seed the reference config, so they are read against TRL's defaults (bf16=True unless fp16);
    an explicit bf16=True is that default and says nothing."""
    for settings, named in [({"fp16": True}, r"ignores: fp16 \(the model's dtype decides"),
                            ({"bf16": False}, r"ignores: bf16 \(the model's dtype decides")]:
        with pytest.warns(UserWarning, match=named):
            from_trl_config(trl_config(max_steps=3, **settings))
    for settings in ({}, {"bf16": True}):
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # grpo-nb's warnings (transformers' own are FutureWarnings)
            from_trl_config(trl_config(max_steps=3, **settings))
