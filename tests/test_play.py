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
    with pytest.raises(ValueError, match=r"^play\(environment=\.\.\.\): the environment _NoReset has no reset"):
        play(tiny_model(), tok, prompt="Move.", environment=lambda: _NoReset(), max_completion_length=4)


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
