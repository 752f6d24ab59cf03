"""The tokenizer comes back from a step's rollout as train() started with it (grpo_nb.rollout_guard.tokenizer_kept):
what a tool, an environment, a rollout or a reward function changes of it is put back (said once) or, where ids
would change meaning, refused."""

import pytest

from grpo_nb import train
from grpo_nb.models import prepare_tokenizer
from tiny_models import FAST, count_w7, dataset, lora_model, tiny_tokenizer


def _train(tmp_path, tok, reward, **kw):
    return train(lora_model(), tok, dataset(), [count_w7, reward], verbose=False, live=False,
                 output_dir=str(tmp_path / "run"), **{**FAST, "max_steps": 2, **kw})


def test_a_changed_template_padding_side_or_eos_is_put_back_and_said_once(tmp_path):
    tok = prepare_tokenizer(tiny_tokenizer())
    template, side = tok.chat_template, tok.padding_side

    def meddle(completions, **kwargs):
        tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        tok.padding_side = "right"
        return [0.0] * len(completions)

    with pytest.warns(UserWarning, match="chat_template, padding_side") as caught:
        history = _train(tmp_path, tok, meddle)
    assert len(history) == 2
    assert sum("put back as train() started" in str(w.message) for w in caught) == 1  # said once, put back each step
    assert tok.chat_template == template and tok.padding_side == side
    saved = (tmp_path / "run" / "chat_template.jinja")
    assert not saved.exists() or "{{ m['content'] }}{% endfor %}" not in saved.read_text()


def test_tokens_added_mid_run_are_refused(tmp_path):
    tok = prepare_tokenizer(tiny_tokenizer())

    def add_token(completions, **kwargs):
        tok.add_special_tokens({"additional_special_tokens": ["<secret>"]})
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match="tokens added or special tokens set"):
        _train(tmp_path, tok, add_token)


def test_a_step_that_fails_after_the_tokenizer_was_changed_saves_the_tokenizer_it_trained_with(tmp_path):
    """Probe P39 F1: a reward function (or tool) that changed the template and padding side, then a step that fails
    (its reward server down): the tokenizer is put back on the way out too, so checkpoint-1 (written for the last
    completed step) and the user's object hold the template the run trained with, not the changed one."""
    import json

    tok = prepare_tokenizer(tiny_tokenizer())
    template, side, calls = tok.chat_template, tok.padding_side, []

    def meddle_then_fail(completions, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # step 2
            tok.chat_template, tok.padding_side = "HACKED {{ messages }}", "right"
            raise RuntimeError("my reward server is down")
        return [0.0] * len(completions)

    with pytest.warns(UserWarning, match="put back as train\\(\\) started"), \
            pytest.raises(Exception, match="my reward server is down") as caught:
        _train(tmp_path, tok, meddle_then_fail)
    assert "everything up to step 1 is saved" in "\n".join(getattr(caught.value, "__notes__", []))
    assert tok.chat_template == template and tok.padding_side == side
    saved = tmp_path / "run" / "checkpoint-1"
    assert "HACKED" not in "".join(f.read_text() for f in saved.iterdir() if f.suffix in (".jinja", ".json"))
    assert json.loads((saved / "tokenizer_config.json").read_text()).get("padding_side", side) == side


def test_tokens_added_in_a_step_write_no_checkpoint_with_that_tokenizer(tmp_path):
    """Probe P39 F1, refused case: tokens added at step 2 are refused, and the checkpoint-1 written on the way out
    would have saved the tokenizer with the added token: none is written then (the message says where the weights
    are)."""
    tok = prepare_tokenizer(tiny_tokenizer())
    calls = []

    def add_token_at_step_2(completions, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            tok.add_special_tokens({"additional_special_tokens": ["<secret>"]})
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match="tokens added or special tokens set") as caught:
        _train(tmp_path, tok, add_token_at_step_2)
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "no checkpoint-1 is written" in notes and "grpo_nb.save_adapter(model, path, tokenizer)" in notes
    assert not (tmp_path / "run" / "checkpoint-1").exists()


def test_saves_after_a_tools_run_warn_without_the_tokenizer_it_trained_with(tmp_path):
    """A run with tools may give the tokenizer grpo-nb's tool template (the base's cannot render calls): an adapter
    saved without that tokenizer would load with the base's template, offering tools in a format never trained on."""
    import warnings

    from grpo_nb import save_adapter
    from tiny_models import Scripted, byte_tokenizer, chat, multiply

    tok = byte_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"  # no tools
    model = lora_model()
    model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(model, tok, chat(2), lambda completions, **kw: [0.0] * len(completions), tools=[multiply],
              rollout=Scripted(lambda text, k: "done"), verbose=False, live=False, output_dir=str(tmp_path / "run"),
              **{**FAST, "max_steps": 1, "max_completion_length": 16, "max_prompt_length": None})
    assert "<tool_call>" in tok.chat_template  # grpo-nb's template, set by train()
    with pytest.warns(UserWarning, match=r"trained with tools .*save_adapter\(model, path, tokenizer\)"):
        save_adapter(model, tmp_path / "bare")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # with the tokenizer it trained with: nothing to say
        save_adapter(model, tmp_path / "kept", tok)
