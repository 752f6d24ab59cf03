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
