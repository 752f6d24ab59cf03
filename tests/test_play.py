"""play(): the checks of its prompt and environment, the scripted and the model's episodes alike (probe P37)."""

from __future__ import annotations

import pytest

from grpo_nb import play
from tiny_models import byte_tokenizer, tiny_model


class _NoReset:
    def move(self, x: int) -> int:
        """
        Moves.

        Args:
            x: Where.
        """
        return x


class _Board(_NoReset):
    def reset(self, **row):
        return "The board is empty."


@pytest.mark.parametrize("factory", [lambda: _NoReset(), lambda: None, _NoReset])
def test_a_scripted_episode_checks_what_the_factory_made_has_reset(factory):
    """F6: the scripted path did not go through make_agent's check: a raw AttributeError."""
    with pytest.raises(ValueError, match=r"play\(environment=.*\): the environment it made, .* has no reset\(\)"):
        play(prompt="Move.", environment=factory, script=["done"])


def test_the_model_s_episode_names_play_s_argument():
    """F6 (C): make_agent's message named train()'s environment_factory."""
    tok = byte_tokenizer()
    model = tiny_model()
    model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id  # the tokenizer's model
    with pytest.raises(ValueError, match=r"^play\(environment=\.\.\.\): the environment _NoReset has no reset"):
        play(model, tok, prompt="Move.", environment=lambda: _NoReset(), max_completion_length=4)


@pytest.mark.parametrize("message, fragment", [
    ({"role": "user", "content": [{"type": "text", "text": "Move."}]}, "a list of parts"),
    ({"role": "user"}, "needs a 'role' in"),
    ({"role": "narrator", "content": "Move."}, "needs a 'role' in"),
])
def test_the_prompt_is_checked_as_train_checks_it(message, fragment):
    """F7 / F14: a prompt train() refuses was played (or crashed appending the environment's observation)."""
    with pytest.raises(ValueError, match=r"play\(prompt=\.\.\.\): message .*" + fragment):
        play(prompt=[message], environment=_Board, script=["done"])
    # tool turns in the prompt, as train() accepts them, still play
    prompt = [{"role": "user", "content": "Move."}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "move", "arguments": {"x": 1}}}]},
              {"role": "tool", "name": "move", "content": "1"}]
    assert play(prompt=prompt, environment=_Board, script=["done"]).prompt[-1]["content"] == "1The board is empty."


def test_a_scripted_turn_with_two_calls_under_a_one_call_template_runs_the_first_as_training_does():
    """Probe P39 F6: play(script=...) ran every call of a turn under Llama 3.1's template (one call per turn), where
    train() runs the first and answers the others with an error; the rehearsal now matches training."""
    from test_tools import trl_template_tokenizer
    from tiny_models import multiply

    two = '{"name": "multiply", "parameters": {"a": 2, "b": 3}}; {"name": "multiply", "parameters": {"a": 5, "b": 2}}'
    episode = play(tokenizer=trl_template_tokenizer("llama3_1"), prompt="hi", tools=[multiply], script=[two, "done"])
    results = [m["content"] for m in episode.messages if m["role"] == "tool"]
    assert results[0] == "6" and "takes one tool call per turn" in results[1]
    # a template that takes several (Qwen2.5's) runs both
    two = "".join('<tool_call>{"name": "multiply", "arguments": {"a": %d, "b": 2}}</tool_call>' % a for a in (3, 5))
    episode = play(tokenizer=trl_template_tokenizer("qwen2_5"), prompt="hi", tools=[multiply], script=[two, "done"])
    assert [m["content"] for m in episode.messages if m["role"] == "tool"] == ["6", "10"]


@pytest.mark.parametrize("greedy", ["False", "True", 0, None])
def test_greedy_must_be_a_bool(greedy):
    """Probe P40 F3: play(greedy="False") decoded greedily (any non-empty text is true)."""
    from tiny_models import multiply

    with pytest.raises(ValueError, match=r"play\(\) argument greedy=.* is invalid: expected True or False"):
        play(tiny_model(), byte_tokenizer(), prompt="3*4?", tools=[multiply], greedy=greedy)
