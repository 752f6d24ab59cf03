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
    with pytest.raises(ValueError, match=r"no counterpart for disable_dropout=True; shuffle_dataset=False\."):
        from_trl_config(trl_config(max_steps=3, shuffle_dataset=False, disable_dropout=True))
    with pytest.raises(ValueError, match=r"use_vllm=True \(set it False and load the model with setup_reasoning_model"):
        from_trl_config(trl_config(max_steps=3, use_vllm=True))
    with pytest.warns(UserWarning, match=r"decides elsewhere and so ignores: disable_tqdm"):
        from_trl_config(trl_config(max_steps=3, disable_tqdm=True))
    theirs = trl_config(max_steps=3)
    theirs.loss_type = "nope"  # a value grpo-nb lacks (a later TRL's loss): its own check
    with pytest.raises(ValueError, match="loss_type='nope' is invalid"):
        from_trl_config(theirs)
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


def test_warmup_steps_stay_a_count_when_train_overrides_max_steps(tok, tmp_path):
    """Probe P29-1: the count was turned into a ratio of the TRL config's max_steps before train()'s max_steps= applied,
    so 2 warmup steps of a 4-step config became 3 in a 6-step run (and 1 of a 3-step one)."""
    settings = dict(learning_rate=1e-3, num_generations=4, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                    max_completion_length=6, save_strategy="no", warmup_steps=2)
    history = train(lora_model(), tok, dataset(), token_id_reward, config=trl_config(max_steps=4, **settings),
                    max_steps=6, output_dir=str(tmp_path), verbose=False, live=False)
    lrs = [r["learning_rate"] for r in history]
    assert lrs[:3] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3]) and lrs[3] < 1e-3  # peak after 2 warmup steps
    epochs = trl_config(num_train_epochs=1, **settings)  # 8 prompts, 1 a step: 8 steps; overridden to 3
    assert from_trl_config(epochs, max_steps=3).warmup_ratio == pytest.approx(2 / 3)
    assert from_trl_config(epochs, max_steps=3).max_steps == 3  # no dataset size needed with max_steps given
    # TRL's fractions of the run are of the run train() will train
    ours = from_trl_config(trl_config(max_steps=40, save_steps=0.25, logging_steps=0.1), max_steps=100)
    assert (ours.save_steps, ours.logging_steps) == (25, 10)


def test_warmup_count_is_rounded_as_transformers_does():
    """Probe P29-2: int(15/22 * 22) is 14, a warmup step lost to float rounding; transformers takes ceil(ratio x steps),
    so a plain warmup_ratio=0.29 over 100 steps warms up 29 steps there (28 here before)."""
    import torch

    from grpo_nb.optim import build_optimizer

    def warmup_of(config):
        _, scheduler, _ = build_optimizer(torch.nn.Linear(2, 2), config)
        factors = [scheduler.lr_lambdas[0](step) for step in range(config.max_steps)]
        return factors.index(max(factors))  # steps before the peak

    assert warmup_of(from_trl_config(trl_config(max_steps=22, warmup_steps=15))) == 15
    assert warmup_of(GRPOConfig(max_steps=100, warmup_ratio=0.29)) == 29
    assert warmup_of(GRPOConfig(max_steps=100, warmup_ratio=0.07)) == 7  # 7.000000000000001: float noise, not a step


def test_a_chosen_vllm_correction_carries_over_with_use_vllm_false():
    """Probe P29-9: use_vllm=True is refused (a model set up with fast_inference=True rolls out with vLLM), and with
    use_vllm=False the vllm_importance_sampling_* fields were all skipped, the ones the user set too."""
    chosen = from_trl_config(trl_config(max_steps=3, vllm_importance_sampling_mode="token_truncate",
                                        vllm_importance_sampling_clip_max=2.0))
    assert (chosen.rollout_importance_sampling_correction, chosen.rollout_importance_sampling_mode,
            chosen.rollout_importance_sampling_clip_max) == (True, "token_truncate", 2.0)
    off = from_trl_config(trl_config(max_steps=3, vllm_importance_sampling_correction=False,
                                     vllm_importance_sampling_mode="token_mask"))
    assert not off.rollout_importance_sampling_correction  # an explicit False is kept too
    defaults = from_trl_config(trl_config(max_steps=3))  # TRL applies its defaults only with vLLM: not here either
    assert not defaults.rollout_importance_sampling_correction
    with pytest.raises(ValueError, match=r"rollout_importance_sampling_correction=True\) here"):
        from_trl_config(trl_config(max_steps=3, use_vllm=True))


def test_trls_default_project_leaves_wandb_its_environment_project(monkeypatch):
    """Probe P29-3: TRL's project (default "huggingface") names Trackio's project only; it sent W&B runs there."""
    monkeypatch.setenv("WANDB_PROJECT", "my-team")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert from_trl_config(trl_config(max_steps=3, report_to="none")).project is None  # so $WANDB_PROJECT
    assert from_trl_config(trl_config(max_steps=3, project="mine")).project == "mine"
    with pytest.warns(UserWarning, match=r"goes to W&B project 'mine', not \$WANDB_PROJECT='my-team'"):
        from_trl_config(trl_config(max_steps=3, project="mine", report_to="wandb"))


def test_settings_taken_elsewhere_say_where():
    """Probe P29-10: resume_from_checkpoint and trackio_space_id were refused as having "no counterpart"."""
    with pytest.raises(ValueError, match=r"takes these elsewhere.*resume_from_checkpoint='/x/checkpoint-5' \(pass it "
                                         r"to train\(\.\.\., resume_from_checkpoint=\.\.\.\)") as err:
        from_trl_config(trl_config(max_steps=3, resume_from_checkpoint="/x/checkpoint-5"))
    assert "no counterpart" not in str(err.value)
    with pytest.raises(ValueError, match=r"trackio_space_id='me/space' \(set the environment variable TRACKIO_SPACE_ID"):
        from_trl_config(trl_config(max_steps=3, trackio_space_id="me/space"))
    with pytest.raises(ValueError, match=r"no counterpart for shuffle_dataset=False\. And grpo-nb takes these "
                                         r"elsewhere"):
        from_trl_config(trl_config(max_steps=3, shuffle_dataset=False, trackio_space_id="me/space"))


def test_constant_schedule_warms_up_as_in_transformers():
    """Probe P29-11: transformers' "constant" never warms up (grpo-nb's did, from TRL's warmup_steps), and its
    "constant_with_warmup" is grpo-nb's "constant" (which was refused)."""
    with pytest.warns(UserWarning, match=r"constant schedule has no warmup.*lr_scheduler_type='constant_with_warmup'"):
        ours = from_trl_config(trl_config(max_steps=6, warmup_steps=2, lr_scheduler_type="constant"))
    assert (ours.lr_scheduler_type, ours.warmup_ratio) == ("constant", 0.0)
    ours = from_trl_config(trl_config(max_steps=6, warmup_steps=2, lr_scheduler_type="constant_with_warmup"))
    assert (ours.lr_scheduler_type, ours.warmup_ratio) == ("constant", pytest.approx(2 / 6))


def test_trls_top_entropy_quantile_zero_is_taken():
    """Probe P29-8: TRL documents [0.0, 1.0], 0.0 keeping only the highest-entropy token; it was refused."""
    assert from_trl_config(trl_config(max_steps=3, top_entropy_quantile=0.0)).top_entropy_quantile == 0.0


def test_a_trl_run_resumed_longer_keeps_its_warmup_count_unremarked(tok, tmp_path):
    """The count kept (P29-1) is another warmup_ratio of a longer run: not a changed setting to warn about."""
    theirs = trl_config(max_steps=10, warmup_steps=1, save_steps=1, learning_rate=1e-3, num_generations=4,
                        per_device_train_batch_size=4, gradient_accumulation_steps=2, max_completion_length=6)
    settings = dict(output_dir=str(tmp_path), verbose=False, live=False)
    train(lora_model(), tok, dataset(), token_id_reward, config=theirs, max_steps=2, **settings)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = train(lora_model(), tok, dataset(), token_id_reward, config=theirs, max_steps=3,
                        resume_from_checkpoint=True, **settings)
    assert [r["step"] for r in history] == [1, 2, 3]
    assert not [w for w in caught if "differ from the ones it was trained with" in str(w.message)]


@pytest.mark.filterwarnings("ignore:loss_type='luspo'")
@pytest.mark.parametrize("settings", [
    dict(loss_type="luspo", importance_sampling_level="sequence"),
    dict(loss_type="luspo"),  # TRL's default token level: taken, with TRL's warning
    dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.5, vespo_lambda_neg=1.5),
    dict(off_policy_mask_threshold=0.5),
    dict(entropy_coef=0.01),
    dict(entropy_coef=0.01, use_adaptive_entropy=True, entropy_coef_min=0.001, entropy_coef_max=0.5,
         entropy_coef_delta=0.01, entropy_target=2.0),
], ids=["luspo", "luspo-token", "vespo", "off-policy-mask", "entropy-coef", "adaptive-entropy"])
def test_trls_loss_options_carry_over(settings):
    """TRL 1.16's luspo / vespo losses, off-policy sequence mask and entropy bonus (were refused)."""
    ours = from_trl_config(trl_config(max_steps=3, **settings))
    assert {name: getattr(ours, name) for name in settings} == settings


def test_trls_eval_settings_carry_over_with_trls_meaning():
    ours = from_trl_config(trl_config(max_steps=40, eval_strategy="steps", eval_steps=0.25, eval_on_start=True,
                                      per_device_eval_batch_size=16))
    assert (ours.eval_strategy, ours.eval_interval, ours.eval_on_start, ours.per_device_eval_batch_size) == (
        "steps", 10, True, 16)  # eval_steps below 1: a fraction of the run; do_eval (set by TRL) is not refused
    assert from_trl_config(trl_config(max_steps=40, eval_strategy="steps", logging_steps=4)).eval_interval == 4
    assert from_trl_config(trl_config(max_steps=40, eval_steps=5)).eval_interval is None  # "no": TRL ignores it
    with pytest.raises(ValueError, match="eval_strategy='epoch' is invalid"):
        from_trl_config(trl_config(max_steps=40, eval_strategy="epoch"))


def test_delta_carries_over_with_trls_meaning():
    """TRL's two-sided clipping: delta caps the unclipped ratio term (was refused as having no counterpart)."""
    ours = from_trl_config(trl_config(max_steps=3, loss_type="grpo", delta=4.0))
    assert (ours.delta, ours.loss_type) == (4.0, "grpo")
    assert from_trl_config(trl_config(max_steps=3)).delta is None
    with pytest.raises(ValueError, match=r"GRPOConfig\.delta=0\.0 is invalid: expected a finite number > 0.*"
                                         r"TRL recommends delta > 1 \+ epsilon_high = 1\.2"):
        from_trl_config(trl_config(max_steps=3, delta=0.0))  # TRL takes it, and zeroes every positive update


def test_delta_that_does_nothing_or_not_what_it_is_for_is_said():
    """TRL ignores delta for cispo / sapo / vespo (no unclipped term) and accepts any value; here both are said."""
    for loss_type, more in (("cispo", {"epsilon_high": 5.0}), ("sapo", {}), ("vespo", {})):
        with pytest.warns(UserWarning, match=rf"delta=4.0 has no effect with loss_type='{loss_type}'.*"
                                             r"TRL ignores delta there too"):
            GRPOConfig(delta=4.0, loss_type=loss_type, **more)
    with pytest.warns(UserWarning, match=r"delta=1.1 is at or below 1 \+ epsilon_high = 1.28.*at ratio 1.1 instead of "
                                         r"1.28\. delta is a ratio cap"):
        GRPOConfig(delta=1.1, epsilon_high=0.28)
    with pytest.warns(UserWarning, match=r"below 1 it takes the gradient of every positive-advantage token"):
        GRPOConfig(delta=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        GRPOConfig(delta=4, loss_type="grpo")  # above 1 + epsilon_high: nothing to say
    for bad in (-1.0, float("inf"), float("nan"), "4", True, 10**400):
        with pytest.raises(ValueError, match=r"GRPOConfig\.delta=.* is invalid: expected a finite number > 0, or None"):
            GRPOConfig(delta=bad)


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_sync_ref_model_is_refused_with_the_reason_trl_gives(beta):
    """grpo-nb's reference is the base model with the adapter off: TRL 1.16 raises NotImplementedError for
    sync_ref_model with a PEFT model, and ValueError with beta=0 (no reference model at all)."""
    with pytest.raises(ValueError) as err:
        from_trl_config(trl_config(max_steps=3, beta=beta, sync_ref_model=True))
    message = str(err.value)
    assert "no counterpart" not in message and "Set sync_ref_model=False" in message
    if beta:
        assert "the base model with the LoRA adapter switched off" in message
        assert "TRL 1.16 refuses sync_ref_model=True with a PEFT model" in message
    else:
        assert "with beta=0.0 has nothing to sync: without the KL term no reference model is used" in message
