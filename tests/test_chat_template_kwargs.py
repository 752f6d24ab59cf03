"""chat_template_kwargs (TRL's GRPOConfig field, e.g. {"enable_thinking": False} for Qwen3): extra apply_chat_template()
arguments wherever grpo-nb renders chat prompts - train()'s rollouts, evaluate(), sample_and_score() - and read from a
trl.GRPOConfig as TRL reads it (a dict, or its JSON text)."""

from __future__ import annotations

import warnings

import pytest

import grpo_nb.evaluation as evaluation_mod
import grpo_nb.prototyping as prototyping_mod
from grpo_nb import GRPOConfig, evaluate, sample_and_score, train
from grpo_nb.models import prepare_tokenizer
from grpo_nb.scoring import score_groups
from tiny_models import FAST, Scripted, lora_model, tiny_model, tiny_tokenizer

# Qwen3's template reads enable_thinking the same way: unset or true thinks, false closes the thought at once
TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}w8 {% endif %}"
            "{% if enable_thinking is defined and not enable_thinking %}w9 w9 {% endif %}")
OFF = {"enable_thinking": False}


@pytest.fixture
def tok():
    tok = prepare_tokenizer(tiny_tokenizer())
    tok.chat_template = TEMPLATE
    return tok


def chat_rows(n=2):
    return [{"prompt": [{"role": "user", "content": f"w{5 + i} w6"}], "answer": str(i)} for i in range(n)]


def recording():
    """A Scripted rollout that keeps the prompt texts it was given."""
    seen = []

    def reply(text, k):
        seen.append(text)
        return "w7"

    return Scripted(reply), seen


def test_score_groups_renders_chat_prompts_with_the_kwargs(tok):
    model = tiny_model()
    for kwargs, thinks in ((None, True), ({}, True), (OFF, False), ({"enable_thinking": True}, True)):
        rollout, seen = recording()
        score_groups(model, tok, chat_rows(), rollout, 2, chat_template_kwargs=kwargs)
        assert all(("w9 w9" in text) is not thinks for text in seen), (kwargs, seen)
    rollout, seen = recording()  # text prompts are not rendered: the kwargs change nothing there
    score_groups(model, tok, [{"prompt": "w5 w6"}], rollout, 2, chat_template_kwargs=OFF)
    assert "w9" not in seen[0]


def test_evaluate_and_sample_and_score_take_the_kwargs(tok, monkeypatch):
    model = tiny_model()
    rollout, seen = recording()
    monkeypatch.setattr(evaluation_mod, "engine_for", lambda *a, **k: rollout)
    monkeypatch.setattr(prototyping_mod, "engine_for", lambda *a, **k: rollout)
    plain = evaluate(model, tok, chat_rows(), max_completion_length=4)
    assert seen and not any("w9" in t for t in seen) and "chat_template_kwargs" not in plain["settings"]
    seen.clear()
    off = evaluate(model, tok, chat_rows(), max_completion_length=4, chat_template_kwargs=OFF)
    assert seen and all("w9 w9" in t for t in seen) and off["settings"]["chat_template_kwargs"] == OFF
    # compare() says the two were rendered differently
    assert "chat_template_kwargs None vs {'enable_thinking': False}" in evaluation_mod.compare(plain, off)
    seen.clear()
    sample_and_score(model, tok, [rows["prompt"] for rows in chat_rows()], [lambda completions, **k: [0.0] * len(
        completions)], n=2, max_completion_length=4, chat_template_kwargs='{"enable_thinking": false}')
    assert seen and all("w9 w9" in t for t in seen)
    with pytest.raises(ValueError, match=r"evaluate\(\) argument chat_template_kwargs=\['x'\] is invalid"):
        evaluate(model, tok, chat_rows(), max_completion_length=4, chat_template_kwargs=["x"])


def test_train_renders_its_rollouts_with_the_kwargs(tok, tmp_path):
    rollout, seen = recording()
    train(lora_model(), tok, chat_rows(8), lambda completions, **k: [float(len(completions[0][0]["content"]))] * len(
        completions), **{**FAST, "max_prompt_length": None}, max_steps=1, verbose=False, live=False,
        output_dir=str(tmp_path / "run"), rollout=rollout, chat_template_kwargs=OFF)
    assert seen and all("w9 w9" in t for t in seen)


def test_config_reads_the_kwargs_as_trl_does():
    assert GRPOConfig(chat_template_kwargs='{"enable_thinking": false}').chat_template_kwargs == OFF  # TRL's JSON text
    assert GRPOConfig(chat_template_kwargs=OFF).chat_template_kwargs == OFF
    for bad, said in (("{enable_thinking: false}", "or its JSON text"), ({1: True}, "a dict of apply_chat_template"),
                      ({"tokenize": True}, "['tokenize'] is set by grpo-nb"),
                      ({"x": object()}, "grpo_config.json stores them")):
        with pytest.raises(ValueError, match="GRPOConfig.chat_template_kwargs=") as err:
            GRPOConfig(chat_template_kwargs=bad)
        assert said in str(err.value)


def test_from_trl_config_carries_the_kwargs_and_the_aggregation():
    trl = pytest.importorskip("trl", reason="reads a trl.GRPOConfig (the dev extra installs trl)")
    from grpo_nb.trl_config import from_trl_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = trl.GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, max_steps=1,
                                chat_template_kwargs='{"enable_thinking": false}',
                                multi_objective_aggregation="normalize_then_sum")
        ours = from_trl_config(theirs)
        assert ours.chat_template_kwargs == OFF and ours.multi_objective_aggregation == "normalize_then_sum"
        theirs.chat_template_kwargs = '{"enable_thinking": true}'  # set after TRL's own parsing: still text
        assert from_trl_config(theirs).chat_template_kwargs == {"enable_thinking": True}


def test_the_pre_run_checks_render_with_the_kwargs(tok):
    """A template that needs its variable: the checks before any work render the prompts as the run does (with the
    kwargs), so they pass it where it is given and name it where it is not."""
    tok.chat_template = ("{% if mode is not defined %}{{ raise_exception('mode is required') }}{% endif %}"
                         "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w8 "
                         "{% endif %}")
    evaluate(tiny_model(), tok, chat_rows(), max_completion_length=4, chat_template_kwargs={"mode": "w9"})
    sample_and_score(tiny_model(), tok, [r["prompt"] for r in chat_rows()],
                     lambda completions, **k: [0.0] * len(completions), max_completion_length=4, num_generations=2, chat_template_kwargs={"mode": "w9"})
    with pytest.raises(ValueError, match="mode is required"):
        evaluate(tiny_model(), tok, chat_rows(), max_completion_length=4)


def test_numpy_values_are_taken_and_nan_refused():
    import math

    import numpy as np

    assert GRPOConfig(chat_template_kwargs={"enable_thinking": np.False_}).chat_template_kwargs == OFF
    with pytest.raises(ValueError, match="finite numbers"):
        GRPOConfig(chat_template_kwargs={"temperature_hint": math.nan})
