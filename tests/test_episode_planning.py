"""The planner counts multi-turn episodes (train(tools=...), issue 28): estimate_vram / plan_for_gpu take
tool_turns and tool_result_tokens, checked as simulate_step checks them, the rollout's terms held against
simulate_step(tool_turns=...)."""

from __future__ import annotations

import re

import pytest

from grpo_nb.memory import GiB, estimate_vram
from grpo_nb.planning import plan_for_gpu


# Two shapes of test_memory_accounting's models, completions short enough that the simulation (a model call per
# token for episodes) takes seconds: one on a simulated T4 (fp16: the result prefill's attention buffers), one bf16.
SHAPES = [("Qwen/Qwen2.5-0.5B-Instruct", dict(max_prompt_length=64, max_completion_length=96, num_generations=4,
                                              per_device_train_batch_size=2, tool_turns=3, tool_result_tokens=32),
           "T4"),
          ("meta-llama/Llama-3.2-1B-Instruct", dict(max_prompt_length=64, max_completion_length=64, num_generations=4,
                                                    load_in_4bit=True, tool_turns=3, tool_result_tokens=16), None),
          # 2 rows at a time: run_episodes' rollout per turn, the conversation so far its prompt
          ("Qwen/Qwen2.5-0.5B-Instruct", dict(max_prompt_length=64, max_completion_length=96, num_generations=4,
                                              per_device_train_batch_size=2, tool_turns=3, tool_result_tokens=32,
                                              rollout_max_rows=2), "T4")]


@pytest.mark.parametrize("model,kw,gpu", SHAPES, ids=["qwen-0.5b-t4", "llama-1b-4bit", "qwen-0.5b-t4-2-rows"])
def test_episode_estimate_within_10_percent_of_the_simulated_step(model, kw, gpu):
    from grpo_nb.simulate import simulate_step

    simulated = simulate_step(model, gpu=gpu, **kw)
    estimate = estimate_vram(model, **kw, **({"dtype": "fp16"} if gpu == "T4" else {}))
    rollout = simulated.phases["rollout"]["peak"]
    print(f"{model}: rollout estimated {estimate.rollout_peak / GiB:.4f} GiB, simulated {rollout / GiB:.4f}; step "
          f"estimated {estimate.total / GiB:.4f}, simulated {simulated.peak / GiB:.4f}")
    assert abs(estimate.rollout_peak - rollout) <= 0.10 * rollout, (estimate.rollout_peak / GiB, rollout / GiB)
    assert abs(estimate.total - simulated.peak) <= 0.10 * simulated.peak, (estimate.total / GiB, simulated.peak / GiB)
    single = estimate_vram(model, **{**kw, "tool_turns": 1, "tool_result_tokens": 0},
                           **({"dtype": "fp16"} if gpu == "T4" else {}))
    assert estimate.settings["tool_turns"] == 3
    if "rollout_max_rows" in kw:  # each turn a rollout of its own, within the same context: the same cache
        assert estimate["kv_cache"] == single["kv_cache"]
    else:  # the growing cache of every row (and its copy of a layer)
        assert estimate["kv_cache"] > single["kv_cache"]


def test_one_turn_is_todays_estimate():
    kw = dict(max_prompt_length=256, max_completion_length=1024, load_in_4bit=True, rollout_max_rows=4)
    today = estimate_vram("Qwen/Qwen2.5-1.5B-Instruct", **kw)
    one = estimate_vram("Qwen/Qwen2.5-1.5B-Instruct", tool_turns=1, tool_result_tokens=0, **kw)
    assert one.categories == today.categories and one.total == today.total
    # below all completions at once, train() runs each turn as a rollout of its own: the single-turn terms
    assert estimate_vram("Qwen/Qwen2.5-1.5B-Instruct", tool_turns=3, tool_result_tokens=64, **kw).categories == \
        today.categories


@pytest.mark.parametrize("bad,fragments", [
    (dict(tool_turns=0), ["tool_turns=0", "an integer >= 1"]),
    (dict(tool_turns=2.0), ["tool_turns=2.0", "an integer >= 1"]),
    (dict(tool_result_tokens=-1, tool_turns=2), ["tool_result_tokens=-1", "an integer >= 0"]),
    (dict(tool_result_tokens=500), ["tool_result_tokens=500", "0 with tool_turns=1", "tool_turns=2"]),
    (dict(tool_turns=13, max_completion_length=12), ["tool_turns=13", "at most max_completion_length=12"]),
    (dict(tool_turns=3, tool_result_tokens=60, max_completion_length=64), ["tool_result_tokens=60", "at most 30",
                                                                           "at least one sampled token a turn"]),
    (dict(tool_turns=2, system="trl"), ["tool_turns=2", "1 with system='trl'"]),
])
def test_bad_episode_arguments_refused_as_simulate_step_refuses_them(bad, fragments):
    from grpo_nb.simulate import simulate_step

    messages = {}
    for func in (estimate_vram, simulate_step):
        with pytest.raises(ValueError) as err:
            func("Qwen/Qwen2.5-0.5B-Instruct", **bad)
        messages[func.__name__] = str(err.value)
        assert all(f in str(err.value) for f in fragments), str(err.value)
    assert messages["estimate_vram"].replace("estimate_vram", "simulate_step") == messages["simulate_step"]
    with pytest.raises(ValueError, match=re.escape(fragments[0])):
        plan_for_gpu("T4", "Qwen/Qwen2.5-0.5B-Instruct", max_completion_length=bad.get("max_completion_length", 256),
                     **{k: v for k, v in bad.items() if k != "max_completion_length"})


def test_plan_for_gpu_counts_the_episodes():
    episodes = dict(tool_turns=3, tool_result_tokens=1024)
    lengths = (8192, 4096, 2048)
    single = plan_for_gpu("T4", "Qwen/Qwen2.5-1.5B-Instruct", max_completion_length=lengths, load_in_4bit=(True,))
    plan = plan_for_gpu("T4", "Qwen/Qwen2.5-1.5B-Instruct", max_completion_length=lengths, load_in_4bit=(True,),
                        **episodes)
    assert plan.fits and plan.settings["tool_turns"] == 3 and plan.settings["tool_result_tokens"] == 1024
    assert "tool_turns=3, tool_result_tokens=1024" in repr(plan)
    s = plan.settings
    again = estimate_vram("Qwen/Qwen2.5-1.5B-Instruct", max_prompt_length=256, num_generations=s["num_generations"],
                          max_completion_length=s["max_completion_length"], load_in_4bit=True, dtype="fp16", **episodes)
    assert plan.estimate.total == again.total
    # the result prefills' attention (fp16 on a T4) makes the rollout the binding phase: fewer tokens or generations
    assert (s["max_completion_length"], s["num_generations"]) < (single.settings["max_completion_length"],
                                                                 single.settings["num_generations"])
    # lengths too short for the turns are left out, said in the notes
    short = plan_for_gpu("T4", "Qwen/Qwen2.5-1.5B-Instruct", max_completion_length=(2048, 1024), tool_turns=3,
                         tool_result_tokens=512)
    assert short.settings["max_completion_length"] == 2048 and any("1024 not tried" in n for n in short.notes)


def test_episode_time_prices_every_turn(monkeypatch):
    """simulate_step(tool_turns=...).time(): every turn's prefill and decode steps, the decode steps on the static
    cache made for the episodes' whole budget (one CUDA graph replays them in every turn); with a rollout narrower
    than the step, a rollout per turn (a static cache each)."""
    import grpo_nb.simulate.step as step_module
    from grpo_nb.memory.estimate import turn_budget
    from grpo_nb.simulate import simulate_step
    from grpo_nb.simulate.pricing import price
    from tiny_models import tiny_config

    kw = dict(max_prompt_length=16, max_completion_length=40, num_generations=4, dtype="fp16",
              gradient_checkpointing=True, gpu="T4")
    single = simulate_step(tiny_config("llama"), **kw)
    episode = simulate_step(tiny_config("llama"), tool_turns=2, tool_result_tokens=8, **kw)
    t, trace = episode.time("T4"), episode._trace
    assert t.generated_tokens == 4 * 2 * turn_budget(40, 2, 8)  # sampled tokens only: the results are not generated
    assert any("tools' own time" in n for n in t.notes)
    assert sorted(kind for kind, _, _ in trace.calls.values()).count("prefill") == 2  # the prompt, then the result
    decode_units = [u for units in trace.decode_units().values() for u in units]
    assert not trace.eager  # the static cache: every turn's steps replay the graph
    eager = price(trace, "T4", episode.settings, graph_decode=False).seconds("decode")
    assert t.seconds("decode") < eager / 2
    # per sampled token the episode's decode steps cost what the single turn's do: the same cache, the same graph
    # (and each turn's end, launched from Python once a turn: ~20% more at these 16-token turns, now that a step's
    # sampling replays a graph too)
    single_decode = single.time("T4").seconds("decode")
    assert not single._trace.eager
    assert t.seconds("decode") / t.generated_tokens == pytest.approx(single_decode / (4 * 40), rel=0.3)
    # at 16 tokens a turn every decode step is recorded; 4 of them a turn, standing for the rest, and each turn's
    # last (what ends the turn is launched after it, once), price the same
    monkeypatch.setattr(step_module, "EPISODE_DECODE_SAMPLES", 4)
    sampled = simulate_step(tiny_config("llama"), tool_turns=2, tool_result_tokens=8, **kw)
    st = sampled.time("T4")
    assert len({op.unit for op in trace.ops if op.stage == "decode"}) == len(decode_units)
    assert len({op.unit for op in sampled._trace.ops if op.stage == "decode"}) == 2 * (4 + 1)
    assert st.seconds("decode") == pytest.approx(t.seconds("decode"), rel=0.03)
    assert st.stages["decode"].kernels == pytest.approx(t.stages["decode"].kernels, rel=0.03)
    monkeypatch.undo()
    # 4 rows, 2 at a time: run_episodes cannot keep them on one cache; each turn is a rollout of its own
    narrow = simulate_step(tiny_config("llama"), tool_turns=3, tool_result_tokens=8, rollout_max_rows=2, **kw)
    nt = narrow.time("T4")
    assert sorted(kind for kind, _, _ in narrow._trace.calls.values()).count("prefill") == 3 * 2
    assert not narrow._trace.eager  # static caches: their steps replay a graph on CUDA
    assert nt.seconds("decode") < price(narrow._trace, "T4", narrow.settings, graph_decode=False).seconds("decode")
    assert nt.generated_tokens == 4 * 3 * turn_budget(40, 3, 8)


def test_plan_for_gpu_prices_and_searches_episodes():
    from tiny_models import tiny_config

    kw = dict(max_prompt_length=16, num_generations=(4,), load_in_4bit=(False,), gradient_checkpointing=True,
              simulate=True, tool_turns=2, tool_result_tokens=4)
    both = plan_for_gpu("T4", tiny_config("llama"), max_completion_length=(32, 8), **kw)
    assert both.settings["max_completion_length"] == 32 and both.settings["tool_turns"] == 2
    assert both.time is not None and "priced" in repr(both)
    # the rollout's width searched (one row at a time first, then all of them), the episodes kept in every try
    assert [a.get("rollout_max_rows") for a, _, _ in both.alternatives] == [None]
    assert both.simulated.settings["tool_turns"] == 2 and both.time.generated_tokens == 4 * 2 * 14
    limit = 0.9 * both.time.total
    capped = plan_for_gpu("T4", tiny_config("llama"), max_completion_length=(32, 8), max_step_seconds=limit, **kw)
    assert capped.fits and capped.settings["max_completion_length"] == 8 and capped.time.total <= limit
    assert any("slower than max_step_seconds" in n and "32 tokens" in n for n in capped.notes)
