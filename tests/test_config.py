import pytest

from grpo_nb import GRPOConfig


def test_defaults_are_valid_and_t4_sized():
    c = GRPOConfig()
    assert c.num_generations == 8 and c.completions_per_step % c.num_generations == 0
    assert c.prompts_per_step == 1
    assert c.loss_type == "dapo" and c.scale_rewards == "group" and c.beta == 0.0


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("fsdp", "full_shard", "True or False"),
        ("dynamic_sampling", 1, "True or False"),
        ("num_generations", 1, "at least 2"),
        ("num_generations", 0, "at least 2"),
        ("epsilon", 0, "> 0"),
        ("epsilon", -0.1, "> 0"),
        ("epsilon_high", 0.0, "> 0"),
        ("beta", -0.01, ">= 0"),
        ("loss_type", "ppo", "grpo, bnpo, dr_grpo, dapo"),
        ("scale_rewards", "std", "group, batch, none"),
        ("temperature", 0.0, "> 0"),
        ("top_p", 1.5, "<= 1"),
        ("max_completion_length", 0, ">= 1"),
        ("max_steps", 2.5, "integer"),
        ("learning_rate", float("nan"), "finite"),
        ("lr_scheduler_type", "warmup", "constant, linear, cosine"),
        ("reward_weights", [1.0, "a"], "finite numbers"),
        ("num_iterations", 0, ">= 1"),
    ],
)
def test_bad_value_names_field_value_and_allowed(field, value, allowed):
    with pytest.raises(ValueError) as err:
        GRPOConfig(**{field: value})
    msg = str(err.value)
    assert field in msg and repr(value) in msg and allowed in msg


def test_batch_must_hold_whole_groups():
    with pytest.raises(ValueError, match="not divisible by num_generations=8"):
        GRPOConfig(per_device_train_batch_size=6)
    c = GRPOConfig(num_generations=4, per_device_train_batch_size=2, gradient_accumulation_steps=4)
    assert c.prompts_per_step == 2


def test_replace_rejects_unknown_fields_with_a_suggestion():
    c = GRPOConfig()
    assert c.replace(max_steps=5).max_steps == 5
    with pytest.raises(ValueError, match="Did you mean num_generations"):
        c.replace(num_generation=4)
    with pytest.raises(ValueError, match="epsilon"):
        c.replace(epsilon=0)


def test_trl_boolean_scale_rewards():
    assert GRPOConfig(scale_rewards=True).scale_rewards == "group"
    assert GRPOConfig(scale_rewards=False).scale_rewards == "none"


def test_max_prompt_length_defaults_to_what_the_context_leaves():
    """setup_reasoning_model(max_seq_length=256) then train(max_completion_length=12) must just work."""
    assert GRPOConfig(max_completion_length=12).fitted_to(256).max_prompt_length == 244
    assert GRPOConfig(max_completion_length=12, max_prompt_length=100).fitted_to(256).max_prompt_length == 100
    assert GRPOConfig(max_completion_length=12).fitted_to(None).max_prompt_length is None  # no known context: no cut
    assert GRPOConfig(max_completion_length=300).fitted_to(256).max_prompt_length is None  # check_inputs refuses it


@pytest.mark.parametrize("knob, value", [("temperature", 0.3), ("top_p", 0.9), ("top_k", 20), ("min_p", 0.1),
                                         ("repetition_penalty", 1.1)])
def test_sampling_knobs_belong_to_the_config_not_to_generation_kwargs(knob, value):
    """generate() would sample with them while the loss computes log-probs with the config's own values."""
    with pytest.raises(ValueError, match=rf"set GRPOConfig\.{knob}={value}.*the log-probs must use the sampling"):
        GRPOConfig(generation_kwargs={knob: value})
    with pytest.raises(ValueError) as err:
        GRPOConfig(generation_kwargs={"do_sample": False})
    assert "GRPOConfig.temperature" in str(err.value)  # the greedy message points at the config too


def test_generation_kwargs_hold_values_the_run_can_store():
    import dataclasses
    import json

    import numpy as np
    from transformers import LogitsProcessorList, MinLengthLogitsProcessor

    c = GRPOConfig(generation_kwargs={"min_new_tokens": np.int64(2), "bad_words_ids": [[np.int64(7)]],
                                      "typical_p": np.float32(0.5)})
    assert c.generation_kwargs == {"min_new_tokens": 2, "bad_words_ids": [[7]], "typical_p": 0.5}
    assert type(c.generation_kwargs["min_new_tokens"]) is int and type(c.generation_kwargs["typical_p"]) is float
    json.dumps(dataclasses.asdict(c))  # what grpo_config.json holds
    processors = LogitsProcessorList([MinLengthLogitsProcessor(3, eos_token_id=2)])
    assert GRPOConfig(generation_kwargs={"logits_processor": processors}).generation_kwargs["logits_processor"] \
        is processors  # objects generate() takes pass as they are
    for kwargs, named in [({1: 2}, "got the key 1 (int)"),
                          ({"logits_processor": [object()]}, "generation_kwargs['logits_processor'] must be a list"),
                          ({"logits_processor": MinLengthLogitsProcessor(3, eos_token_id=2)}, "must be a list"),
                          ({"prefix_allowed_tokens_fn": [1, 2]}, "'prefix_allowed_tokens_fn'] must be a function"),
                          ({"min_new_tokens": object()}, "generation_kwargs['min_new_tokens'] holds <object")]:
        with pytest.raises(ValueError, match=r"GRPOConfig\.generation_kwargs=") as err:
            GRPOConfig(generation_kwargs=kwargs)
        assert named in str(err.value), str(err.value)


@pytest.mark.parametrize("beta", ["adam_beta1", "adam_beta2"])
def test_adam_betas_stay_below_one(beta):
    """torch's AdamW refuses a beta of 1 unnamed; the config names the field first."""
    with pytest.raises(ValueError, match=rf"GRPOConfig\.{beta}=1\.0 is invalid: expected a finite number >= 0 and < 1"):
        GRPOConfig(**{beta: 1.0})
    assert getattr(GRPOConfig(**{beta: 0.0}), beta) == 0.0


def test_numpy_numbers_are_taken_as_the_numbers_they_hold():
    """np.int64 is what np.arange and pandas hand out in a sweep; grpo_config.json stores Python's numbers."""
    import numpy as np

    c = GRPOConfig(num_generations=np.int64(4), per_device_train_batch_size=np.int64(8),
                   learning_rate=np.float32(1e-5), max_steps=np.arange(3, 4)[0], mask_truncated_completions=np.bool_(True))
    assert (c.num_generations, c.per_device_train_batch_size, c.max_steps, c.mask_truncated_completions) == (4, 8, 3, True)
    assert [type(v) for v in (c.num_generations, c.learning_rate, c.mask_truncated_completions)] == [int, float, bool]
    with pytest.raises(ValueError, match=r"GRPOConfig\.learning_rate=nan is invalid"):
        GRPOConfig(learning_rate=np.float32("nan"))


@pytest.mark.parametrize("make", [lambda: GRPOConfig(bf16=True), lambda: GRPOConfig().replace(fp16=True)])
def test_trl_keywords_say_where_grpo_nb_decides_them(make):
    with pytest.raises(ValueError, match=r"GRPOConfig has no field '(bf16|fp16)': the model's dtype decides"):
        make()
    with pytest.raises(ValueError, match=r"no field 'num_generation'\. Did you mean num_generations"):
        GRPOConfig(num_generation=8)


def test_seed_fits_the_random_generators():
    """torch's generators take seeds below 2**64 (a raw 'Overflow when unpacking long long' above), and a run adds
    offsets to its seed (1009 x the rank, vLLM's per call): below 2**63."""
    assert GRPOConfig(seed=2**63 - 1).seed == 2**63 - 1
    for seed in (2**63, 2**70):
        with pytest.raises(ValueError, match=rf"GRPOConfig\.seed={seed} is invalid: expected an integer in \[0, 2\*\*63\)"):
            GRPOConfig(seed=seed)


@pytest.mark.parametrize("field, value, named", [
    ("top_k", 1, "top_k=1 keeps only the likeliest token"),
    ("min_p", 1.0, "min_p=1 keeps only the likeliest token"),
    ("temperature", 1e-9, "expected 0.001 or more: below it sampling is greedy in practice"),
])
def test_greedy_sampling_settings_are_refused_like_do_sample_false(field, value, named):
    with pytest.raises(ValueError, match=rf"GRPOConfig\.{field}={value!r} is invalid") as err:
        GRPOConfig(**{field: value})
    assert named in str(err.value) and "every completion of a group would be the same" in str(err.value)
    GRPOConfig(top_k=2, min_p=0.99, temperature=1e-3)  # sampling, if narrow


def test_a_wandb_project_name_wandb_refuses_is_refused_with_the_config():
    """W&B's own rule (wandb_settings.validate_project): at most 128 characters, none of / \\ # ? % :."""
    for project, named in (("../../x", "it contains '/'"), ("a:b", "it contains ':'"),
                           ("p" * 129, "it is 129 characters long")):
        with pytest.raises(ValueError, match=r"GRPOConfig\.project=.* is invalid: report_to sends the run to W&B") as err:
            GRPOConfig(report_to=["tensorboard", "wandb"], project=project)
        assert named in str(err.value), str(err.value)
    assert "e.g. project='x'" in str(pytest.raises(ValueError, GRPOConfig, report_to="wandb", project="../../x").value)
    GRPOConfig(report_to="trackio", project="../../x")  # Trackio makes any name a file name of its own
    GRPOConfig(report_to="wandb", project="p" * 128)
