"""Held-out evaluation: greedy answers to a prompt dataset, checked against its `answer` column
and scored by reward functions, so a run can be judged before and after training.

Accuracy is measured two ways, as published GRPO runs report it: strict (the answer inside the
requested `<answer>` tags, exactly what `correctness_reward` pays for) and lenient (the last
number anywhere in the completion). Each rate comes with a 95% confidence interval (Wilson's), and
`paired_test` says whether two evaluations of the same problems differ beyond chance.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import numbers
import re
import time
import warnings

import datasets
import numpy as np
import torch

from .arguments import need_int, refuse
from .checkpointing import rng_state, set_rng_state
from .checks import check_context, check_model_and_tokenizer, check_prompts, prompts_cut_message
from .config import GRPOConfig, config_for
from .dataset_checks import as_dataset, check_dataset
from .distributed import World, gather_objects
from .episodes import env_reward_funcs, make_agent
from .resume import data_identity
from .reward_contract import check_reward_funcs, reward_func_name, reward_func_names
from .rewards import answer_texts, answers_match, correctness_reward, soft_format_reward
from .attachments import text_config
from .lora import available_host_bytes
from .memory.accounting import kv_cache_bytes, sampling_bytes
from .rollout import engine_for
from .rollout.static_cache import free_device_memory
from .scoring import score_groups

# evaluate(batch_size="auto")'s widest batch: past it a step's cost grows with its rows (compute-bound) anyway.
EVAL_MAX_ROWS = 128
_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")
RATES = ("accuracy", "lenient_accuracy", "format_rate", "truncation_rate")
# The settings of evaluate() that change what it measures: how the completions are generated, and how each accuracy
# judges them. compare() pairs two evaluations only where these agree (a longer completion is not training).
GENERATION_SETTINGS = ("max_completion_length", "max_prompt_length")
CHECK_SETTING = {"correct": "answer_check", "correct_lenient": "lenient_check"}
# ... and the episodes': tools offered, environments, rounds of calls (their values when absent: no tools), and the
# chat template's arguments (absent: none)
TOOL_SETTINGS = {"tools": [], "environment": None, "max_tool_calling_iterations": None, "chat_template_kwargs": None}


def default_answer_check(text: str, reference) -> bool:
    """Strict: the completion's last `<answer>...</answer>` equals `reference` (as numbers when both
    are) - `correctness_reward`'s own rule."""
    return correctness_reward([text], [reference])[0] > 0


def lenient_answer_check(text: str, reference) -> bool:
    """Lenient: the last number anywhere in the completion equals `reference` (tags or not)."""
    numbers = _NUMBER.findall(text)
    return bool(numbers) and answers_match(numbers[-1].rstrip(",").lstrip("+"), str(reference))


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% (z=1.96) Wilson score interval of a binomial rate: sound near 0% and 100% too."""
    if n == 0:
        return (math.nan, math.nan)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def paired_test(before: list[bool], after: list[bool]) -> float:
    """Two-sided exact McNemar p-value for two evaluations of the same problems: the chance of a
    split at least this lopsided among the problems that changed, if training changed nothing."""
    if len(before) != len(after):
        raise ValueError(f"paired_test needs the same problems: {len(before)} vs {len(after)} results")
    gained = sum(1 for b, a in zip(before, after) if a and not b)
    lost = sum(1 for b, a in zip(before, after) if b and not a)
    changed = gained + lost
    if changed == 0:
        return 1.0
    tail = sum(math.comb(changed, k) for k in range(min(gained, lost) + 1)) / 2**changed
    return min(1.0, 2 * tail)


@torch.no_grad()
def evaluate(model, tokenizer, dataset, reward_funcs=None, *, answer_check=default_answer_check,
             lenient_check=lenient_answer_check, max_completion_length: int = GRPOConfig.max_completion_length,
             batch_size: int | str = "auto", max_prompt_length: int | None = None, limit: int | None = None, tools=None,
             environment_factory=None, max_tool_calling_iterations: int | None = None,
             tool_timeout: float | None = GRPOConfig.tool_timeout, chat_template_kwargs: dict | None = None) -> dict:
    """Greedy completions for `dataset`'s prompts: accuracy (strict and lenient), format, length,
    truncation and mean rewards.

    Args:
        dataset: rows with a `prompt` (text or chat messages) and, for accuracy, an `answer`.
        reward_funcs: TRL-style reward functions to average over the completions (each gets
            the dataset's columns as keywords, as in training), e.g. STARTER_REWARDS.
        answer_check: `(completion_text, reference_answer) -> bool` for "accuracy"; the default
            is strict (`correctness_reward`'s rule). None skips accuracy. The text is the completion
            behind its prompt's assistant prefill, if the prompt ends with one (e.g. "<reasoning>\n"):
            the answer as the reward functions read it (`rewards.answer_texts`); so is format_rate's.
        lenient_check: the same for "lenient_accuracy"; the default takes the last number in the
            completion. None skips it.
        limit: evaluate only the first `limit` rows.
        batch_size: prompts generated at once; "auto" (default): as many as a quarter of the free GPU memory's
            (an eighth of the host's available memory on the CPU) KV cache holds, at most EVAL_MAX_ROWS - wide
            batches are cheaper per token (100 one-shot arithmetic prompts on 2 CPU cores: 35 s at once, 104 s
            16 at a time).
        tools, environment_factory, max_tool_calling_iterations, tool_timeout: as in train(): each completion is
            an episode; the checks read its last turn, and "tool_call_rate" / "tool_calls" say how many episodes
            called a tool and how many calls they made on average.
        chat_template_kwargs: extra apply_chat_template() arguments for chat prompts, as train()'s (e.g.
            {"enable_thinking": False} for Qwen3): evaluate as the model was trained.

    Returns {"accuracy", "lenient_accuracy", "format_rate", "truncation_rate", "mean_length",
    "intervals": {rate: (low, high)} (95%, Wilson), "rewards": {function name: mean over the
    completions it scored, NaN if it returned None for all}, "n",
    "completions": texts (as generated, without a prefill), "correct" / "correct_lenient": one bool per row,
    "truncated", "problems": a digest of the rows' prompts and answers, "settings": the lengths and the checks'
    names (compare() pairs only evaluations of the same problems under the same settings)}. The
    accuracies and their lists are None without an `answer` column or without their check.
    """
    max_completion_length = need_int("evaluate", "max_completion_length", max_completion_length, 1)
    if batch_size != "auto":
        need_int("evaluate", "batch_size", batch_size, 1)
    need_int("evaluate", "max_prompt_length", max_prompt_length, 1, optional=True)
    need_int("evaluate", "limit", limit, 1, optional=True)
    check_model_and_tokenizer("evaluate", model, tokenizer)
    for name, check in (("answer_check", answer_check), ("lenient_check", lenient_check)):
        if check is not None and not callable(check):
            raise TypeError(f"evaluate({name}={check!r:.80}) is invalid: expected a function "
                            f"(completion_text, reference_answer) -> bool, or None to skip it.")
    # what the numbers depend on besides the model and the problems (max_prompt_length as asked: None is "what the
    # context leaves", whatever max_completion_length then leaves it)
    settings = {"max_completion_length": max_completion_length, "max_prompt_length": max_prompt_length,
                **{name: None if check is None else reward_func_name(check)
                   for name, check in (("answer_check", answer_check), ("lenient_check", lenient_check))},
                "tools": [], "environment": None,  # set once make_agent has checked them
                "max_tool_calling_iterations": max_tool_calling_iterations if tools or environment_factory else None}
    config = config_for("evaluate()", max_tool_calling_iterations=max_tool_calling_iterations,
                        tool_timeout=tool_timeout, chat_template_kwargs=chat_template_kwargs)
    if config.chat_template_kwargs:  # recorded when set: absent reads as none (TOOL_SETTINGS), as in older results
        settings["chat_template_kwargs"] = config.chat_template_kwargs
    agent = make_agent(tools, environment_factory, tokenizer, config)
    reward_funcs = [] if reward_funcs is None else (
        list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs])
    # the rows, the reward functions' columns and the prompts (with tools, as the episodes render them), as train()
    # checks its own: what trains also evaluates, and a mistake gets the same message in both
    dataset, columns, conversational = check_eval_dataset("evaluate", model, tokenizer, dataset, reward_funcs, agent,
                                                          config.chat_template_kwargs, limit=limit)
    # train()'s check of the context: a completion beyond the model's context is found before any generating
    context = check_context("evaluate", model, max_prompt_length, max_completion_length)
    if max_prompt_length is None and context:
        max_prompt_length = context - max_completion_length  # what the context leaves, as in train()
    checks = {"correct": answer_check, "correct_lenient": lenient_check}
    checks = {k: f for k, f in checks.items() if f is not None and "answer" in columns}
    # from the agent: `tools` may be an iterator (a generator, map()), which make_agent has read to its end
    settings["tools"] = sorted(t.name for t in agent.tools) if agent is not None else []
    settings["environment"] = environment_names(environment_factory, agent)  # by the classes it built
    reward_funcs = reward_funcs + env_reward_funcs(agent)  # environments' get_reward(), named by class, as in train()
    if batch_size == "auto":
        batch_size = auto_batch_size(model, len(dataset), (max_prompt_length or 1024) + max_completion_length)
    rows = generate_and_judge(model, tokenizer, dataset, reward_funcs, checks, agent, batch_size=batch_size,
                              max_prompt_length=max_prompt_length, max_completion_length=max_completion_length,
                              chat_template_kwargs=config.chat_template_kwargs, caller="evaluate")
    if rows["prompts_cut"]:
        cut = prompts_cut_message(rows["prompts_cut"], max_prompt_length, max_completion_length, context)
        warnings.warn(f"evaluate(): {cut}", UserWarning, stacklevel=3)  # its caller's line (past the no_grad wrapper)
    return {**judged_numbers(rows, reward_funcs, agent is not None), "settings": settings}


def auto_batch_size(model, rows: int, tokens: int) -> int:
    """evaluate(batch_size="auto"): how many prompts of up to `tokens` tokens (prompt + completion) to generate at
    once - the rows whose KV cache and sampling buffers fit in a quarter of the free GPU memory (an eighth of the
    host's available memory on the CPU), at least 1, at most `rows` and EVAL_MAX_ROWS."""
    cfg = text_config(model)
    weight = next(model.parameters())
    per_row = kv_cache_bytes(cfg, 1, tokens, weight.element_size()) + sampling_bytes(cfg.vocab_size, 1)
    free = free_device_memory(weight.device)
    budget = free // 4 if free is not None else available_host_bytes() // 8
    return max(1, min(rows, EVAL_MAX_ROWS, budget // max(1, per_row)))


def check_eval_dataset(func: str, model, tokenizer, dataset, reward_funcs: list, agent,
                       chat_template_kwargs: dict | None = None, *, limit: int | None = None) -> tuple:
    """The checks of a dataset to evaluate, one for evaluate() (`func` "evaluate") and train(eval_dataset=...)
    (`func` "train"), before any generating: train()'s checks of the rows (check_dataset), of the reward functions'
    columns (`environments` too where the agent has an environment_factory) and of the prompts as the run renders
    them (check_prompts: with the agent's tools and `chat_template_kwargs`), of the first `limit` rows.
    Returns (the dataset, its columns, whether its prompts are chat messages).

    train() has two datasets, so there the checks' errors (ValueError and TypeError) are raised again, of the same
    kind, with a message that starts "train(eval_dataset=...): " (chained to the original); any other exception (a
    tokenizer's or a chat template's own) goes through as it is, with a note saying it came from the eval set."""
    with _said_of_eval_set(func):
        dataset = as_dataset(dataset)
    if isinstance(dataset, (list, datasets.Dataset)) and len(dataset) == 0:  # check_dataset's says train()
        raise ValueError(f"{func}() got an empty {'dataset' if func == 'evaluate' else 'eval_dataset'}: pass at "
                         f"least one row with a 'prompt' (and an 'answer' for accuracy)")
    with _said_of_eval_set(func):
        columns, conversational = check_dataset(dataset)
        if reward_funcs:  # (environment_factory passes environments=, as in train())
            check_reward_funcs(reward_funcs, [*columns, *(["environments"] if agent and agent.factories else [])])
        if limit is not None:
            dataset = dataset.select(range(min(limit, len(dataset)))) if hasattr(dataset, "select") else dataset[:limit]
        # a template that drops the question, a prompt of no tokens
        check_prompts(func, model, tokenizer, dataset, conversational, agent=agent,
                      chat_template_kwargs=chat_template_kwargs)
    return dataset, columns, conversational


@contextlib.contextmanager
def _said_of_eval_set(func: str):
    """train(eval_dataset=...)'s checks (`func` "train"): their errors said of the eval set (check_eval_dataset)."""
    try:
        yield
    except Exception as err:
        if func == "evaluate":
            raise
        if type(err) in (ValueError, TypeError):  # the checks' own: their message, said of the eval set
            raise type(err)(f"train(eval_dataset=...): {err}") from err
        if hasattr(err, "add_note"):  # Python 3.11+
            err.add_note("(raised by train()'s checks of eval_dataset, its held-out rows)")
        raise


@torch.no_grad()
def generate_and_judge(model, tokenizer, dataset, reward_funcs: list, checks: dict, agent, *, batch_size: int,
                       max_prompt_length: int | None, max_completion_length: int, chat_template_kwargs: dict | None,
                       caller: str, timeout: float | None = None, first_row: int = 0) -> dict:
    """evaluate()'s work once its inputs are checked: greedy completions of `dataset`'s prompts, `batch_size` at a
    time, judged by `checks` ({"correct": answer_check, "correct_lenient": lenient_check}, those that apply) and
    scored by `reward_funcs` (the environments' get_reward() included). `caller`: the function a tokenizer's failure
    names; `timeout`: each reward call's limit (train()'s reward_timeout); `first_row`: the dataset row that
    `dataset`'s first is (a rank's share: a failing check names the row of the whole set).

    Returns the judged rows, plain lists one item a row (so that ranks can gather them and judged_numbers read the
    whole set): "completions" (as generated, without a prefill), "answers" (what the checks read), "problems" (each
    row's prompt and answer as JSON), "correct" / "correct_lenient" (those checked), "truncated", "lengths" (the
    model's tokens), "scores" (each reward function's score, NaN for none), "calls" (tool calls per episode: [] without
    an agent); and "prompts_cut", how many prompts were cut to max_prompt_length."""
    # The native engine's greedy tokens equal generate()'s (tests/test_engine.py), faster; generate() for a model
    # without a KV cache
    rollout = engine_for(model, max_completion_length=max_completion_length, greedy=True)
    out = {key: [] for key in ("completions", "answers", "problems", *checks, "truncated", "lengths", "scores",
                               "calls")}
    out["prompts_cut"] = 0
    for start in range(0, len(dataset), batch_size):
        rows = [dict(dataset[i]) for i in range(start, min(start + batch_size, len(dataset)))]
        # which problems, in which order: compare() pairs only evaluations of the same
        out["problems"] += [json.dumps([row.get("prompt"), row.get("answer")], default=repr) for row in rows]
        groups = score_groups(model, tokenizer, rows, rollout, 1, reward_funcs,
                              max_prompt_length=max_prompt_length, caller=caller, agent=agent,
                              max_completion_length=max_completion_length, timeout=timeout,
                              chat_template_kwargs=chat_template_kwargs)
        # the checks read the answer where the reward functions read it: behind an assistant prefill; in an
        # episode, in its last turn
        final = groups.texts if agent is None else [last_turn(c) for c in groups.completions]
        batch_answers = answer_texts(final, [row["prompt"] for row in rows])
        out["calls"] += groups.log.metrics.get("tools/call_frequency", [])
        for key, check in checks.items():
            out[key] += [judged(CHECK_SETTING[key], check, text, row["answer"], first_row + start + i)
                         for i, (text, row) in enumerate(zip(batch_answers, rows))]
        out["scores"] += groups.rewards_per_func.tolist()
        out["completions"] += groups.texts
        out["answers"] += batch_answers
        out["truncated"] += groups.rollout.truncated.tolist()
        sampled = groups.rollout.completion_mask * (1 if groups.rollout.env_mask is None else groups.rollout.env_mask)
        out["lengths"] += sampled.sum(1).tolist()  # the model's tokens (a tool's are not)
        out["prompts_cut"] += groups.prompts_cut
    return out


def judged_numbers(rows: dict, reward_funcs: list, tools: bool) -> dict:
    """evaluate()'s result but its "settings", from generate_and_judge's judged rows (of the whole set): the rates
    with their 95% intervals, the mean length, each reward function's mean, the per-row lists, the problems' digest;
    with `tools`, how many episodes called a tool and how many calls they made."""
    rewards = {}
    if reward_funcs:
        per_func = torch.tensor(rows["scores"], dtype=torch.float32).reshape(-1, len(reward_funcs))
        for j, name in enumerate(reward_func_names(reward_funcs)):
            column = per_func[:, j]
            scored = column[~column.isnan()]  # None means "no score", as in training
            rewards[name] = scored.mean().item() if len(scored) else math.nan
    n = len(rows["completions"])
    hits = {"accuracy": rows.get("correct"), "lenient_accuracy": rows.get("correct_lenient"),
            "format_rate": [score > 0 for score in soft_format_reward(rows["answers"])],
            "truncation_rate": rows["truncated"]}
    out = {name: (sum(found) / n if found is not None else None) for name, found in hits.items()}
    problems = hashlib.sha256()
    for problem in rows["problems"]:
        problems.update(problem.encode())
    out.update(
        intervals={name: wilson_interval(sum(found), n) for name, found in hits.items() if found is not None},
        mean_length=sum(rows["lengths"]) / n, rewards=rewards, n=n, completions=rows["completions"],
        truncated=rows["truncated"], correct=rows.get("correct"), correct_lenient=rows.get("correct_lenient"),
        problems=problems.hexdigest()[:16])
    if tools:
        calls = rows["calls"]
        out.update(tool_call_rate=sum(c > 0 for c in calls) / n, tool_calls=sum(calls) / n)
        out["intervals"]["tool_call_rate"] = wilson_interval(sum(c > 0 for c in calls), n)
    return out


# --------------------------------------------------------------------------------------
# During training: train(..., eval_dataset=...) with eval_steps (GRPOConfig's eval_* settings)

# What a step's record keeps of an evaluation (record["eval"]): the numbers, not the completions or per-row lists, so
# that the history, which every checkpoint writes whole, stays small.
RECORD_NUMBERS = (*RATES, "mean_length", "n", "tool_call_rate", "tool_calls")


def checked_eval_dataset(model, tokenizer, eval_dataset, reward_funcs: list, config: GRPOConfig, agent):
    """train(eval_dataset=...), checked as evaluate() checks its dataset (check_eval_dataset) before the first step: a
    bad eval set fails now, not at its first evaluation an hour into the run. `reward_funcs`: train()'s, which score
    the eval completions too. Returns (the dataset, whether it has an `answer` column)."""
    dataset, columns, _ = check_eval_dataset("train", model, tokenizer, eval_dataset, reward_funcs, agent,
                                             config.chat_template_kwargs)
    return dataset, "answer" in columns


def check_eval_world(world: World, sharded: bool, dataset) -> None:
    """train(eval_dataset=...) across processes: each rank evaluates its share of the rows (whole weights on each),
    so every rank must hold the same eval set (its size and a digest of a few rows, as the training set's are
    compared), and the layers must not be sharded (fsdp=True: a rank's forward waits for the others' weight gathers,
    which ranks generating different rows would not make in step). A collective: every rank calls it, at set-up,
    and every rank raises the same error."""
    if not world.distributed:
        return
    if sharded:
        raise ValueError("train(eval_dataset=...) with fsdp=True across processes is not supported: the ranks would "
                         "have to generate the eval rows in lockstep for their sharded layers. Train without "
                         "eval_dataset and call evaluate() on the saved adapter after training, or drop fsdp=True.")
    identity = data_identity(dataset, None)
    mine = f"{identity['rows']} rows, digest {identity['rows_digest']}"
    everyone = gather_objects(mine, world)
    differ = [rank for rank, theirs in enumerate(everyone) if theirs != everyone[0]]
    if differ:
        raise ValueError(f"The {world.size} processes were given different eval_dataset rows ({everyone[0]} on rank "
                         f"0, {everyone[differ[0]]} on rank {differ[0]}): each rank evaluates its share of the same "
                         f"held-out set. Build eval_dataset the same way on every rank (a .shuffle() needs the same "
                         f"seed=), computing nothing of it from RANK or LOCAL_RANK.")


def evaluate_during_training(model, tokenizer, dataset, has_answers: bool, reward_funcs: list, run) -> dict:
    """One held-out evaluation inside train(): evaluate()'s greedy completions of `dataset` with the run's
    max_completion_length, max_prompt_length, chat_template_kwargs, tools and environments, scored by its reward
    functions (`reward_funcs`, the environments' included) under its reward_timeout, per_device_eval_batch_size
    prompts at a time; the default strict and lenient checks where the rows have an `answer`. `run`: train()'s
    set-up (trainer.Run: its config, agent, world and memory tracker). Returns what the step's record keeps
    (eval_record).

    Across processes each rank generates and judges its share of the rows (consecutive rows, ranks in order) and
    every rank gathers all of them: the numbers and their intervals are the whole set's, the same on every rank.
    It leaves the training as it was: python's, numpy's, torch's (and CUDA's) random states are put back (greedy
    decoding draws nothing, but a reward function or an environment may), so the run samples what it would have
    sampled without it; the model is back in its mode (train) even after Ctrl-C; the run's own rollout engine is not
    used (a greedy engine of its own, whose cache is freed when each batch ends). Its memory peak goes to the
    tracker (MemoryTracker.measure_evaluation), for the step's record."""
    config, world = run.config, run.world
    checks = {"correct": default_answer_check, "correct_lenient": lenient_answer_check} if has_answers else {}
    first, end = len(dataset) * world.rank // world.size, len(dataset) * (world.rank + 1) // world.size
    share = dataset if world.size == 1 else (
        dataset.select(range(first, end)) if hasattr(dataset, "select") else dataset[first:end])
    started, random_state, was_training = time.perf_counter(), rng_state(), model.training
    try:
        with run.memory.measure_evaluation():
            rows = generate_and_judge(model, tokenizer, share, reward_funcs, checks, run.agent,
                                      batch_size=config.per_device_eval_batch_size,
                                      max_prompt_length=config.max_prompt_length,
                                      max_completion_length=config.max_completion_length,
                                      chat_template_kwargs=config.chat_template_kwargs, caller="train",
                                      timeout=config.reward_timeout, first_row=first)
    finally:
        set_rng_state(random_state)
        model.train(was_training)
    parts = gather_objects(rows, world)  # each rank's rows, in rank order: the whole set's
    rows = {key: sum(part[key] for part in parts) if key == "prompts_cut" else [v for part in parts for v in part[key]]
            for key in rows}
    if rows["prompts_cut"] and world.is_main and not run.eval_warned:
        run.eval_warned = True
        cut = prompts_cut_message(rows["prompts_cut"], config.max_prompt_length, config.max_completion_length, None)
        warnings.warn(f"train(eval_dataset=...): {cut}", UserWarning, stacklevel=3)  # train()'s caller's line
    return eval_record(judged_numbers(rows, reward_funcs, run.agent is not None), time.perf_counter() - started)


def eval_record(result: dict, seconds: float) -> dict:
    """What a step's record keeps of an evaluate() result: the rates and the mean length (None for an accuracy
    without answers), the 95% intervals as [low, high], each reward function's mean, the number of rows and the
    seconds it took. Plain numbers, so the trackers get them as eval/accuracy, eval/rewards/<name>, ..."""
    out = {key: result[key] for key in RECORD_NUMBERS if key in result}
    out["intervals"] = {key: [float(low), float(high)] for key, (low, high) in result["intervals"].items()}
    out["rewards"] = {name: float(mean) for name, mean in result["rewards"].items()}
    out["seconds"] = seconds
    return out


def last_turn(messages) -> str:
    """An episode's last assistant turn: where its final answer is."""
    turns = [m for m in messages if isinstance(m, dict) and m.get("role") == "assistant"]
    return (turns[-1].get("content") or "") if turns else ""


def judged(name: str, check, text: str, answer, row: int) -> bool:
    """`check(text, answer)` as a bool; an exception or a verdict that is not one names the row."""
    where = (f"on dataset row {row} (answer {answer!r:.80}), whose completion is {text!r:.300}")
    try:
        verdict = check(text, answer)
    except Exception as err:
        raise ValueError(f"evaluate({name}={reward_func_name(check)}) raised {type(err).__name__}: {err}\n{where}. "
                         f"It is called as {name}(completion_text, reference_answer) and should return True or "
                         f"False.") from err
    if isinstance(verdict, np.generic):
        verdict = verdict.item()
    if not isinstance(verdict, (bool, numbers.Real)):
        # a non-empty string such as "no" would otherwise count as correct
        raise TypeError(f"evaluate({name}={reward_func_name(check)}) returned {verdict!r:.80} "
                        f"({type(verdict).__name__}) {where}: expected True or False.")
    return bool(verdict)


def compare(before: dict, after: dict) -> str:
    """Two evaluate() results side by side, as text lines (rates with their 95% intervals), and the paired test of
    each accuracy where both ran on the same problems under the same settings (other settings are named instead)."""
    for name, result in (("before", before), ("after", after)):
        if not isinstance(result, dict) or not isinstance(result.get("n"), int):
            shown = f"<{type(result).__name__}>" if not isinstance(result, dict) else f"<dict with keys {sorted(result)}>"
            refuse("compare", name, shown, "what evaluate(model, tokenizer, dataset) returned (a dict with 'n' and "
                   "the rates)", TypeError if not isinstance(result, dict) else ValueError)

    def rate(result, key):
        low, high = result.get("intervals", {}).get(key, (math.nan, math.nan))
        return f"{result[key]:.1%}" + (f" [{low:.0%}, {high:.0%}]" if not math.isnan(low) else "")

    lines = [f"{'':<20}{'before':>22}{'after':>22}"]
    for key in RATES:
        if before.get(key) is not None and after.get(key) is not None:
            lines.append(f"{key:<20}{rate(before, key):>22}{rate(after, key):>22}")
    if before.get("mean_length") is not None and after.get("mean_length") is not None:
        lines.append(f"{'mean_length':<20}{before['mean_length']:>22.1f}{after['mean_length']:>22.1f}")
    for name in before.get("rewards", {}):
        if name in after.get("rewards", {}):
            lines.append(f"{name:<20}{before['rewards'][name]:>22.3f}{after['rewards'][name]:>22.3f}")
    lines.append(f"{'n':<20}{before['n']:>22}{after['n']:>22}")
    # Other settings (a longer max_completion_length, another answer_check) change the numbers with the same model
    differ = other_settings(before, after)
    if differ:
        lines.append("other settings: " + ", ".join(f"{name} {before['settings'].get(name, TOOL_SETTINGS.get(name))!r} "
                                                     f"vs {after['settings'].get(name, TOOL_SETTINGS.get(name))!r}"
                                                     for name in differ)
                     + " (the differences above are not the model's alone)")
    # A paired test needs the same problems in the same order: results of evaluate() say which they were
    same = before.get("problems") is not None and before.get("problems") == after.get("problems")
    for key, label in (("correct", "strict"), ("correct_lenient", "lenient")):
        if not (before.get(key) and after.get(key)):
            continue
        changed = [name for name in differ if name in GENERATION_SETTINGS or name in TOOL_SETTINGS
                   or name == CHECK_SETTING[key]]
        if len(before[key]) != len(after[key]):
            lines.append(f"no paired test ({label}): the two evaluations ran on {len(before[key])} and "
                         f"{len(after[key])} problems; a paired test needs the same ones (the same limit=)")
        elif not same:
            lines.append(f"no paired test ({label}): the two evaluations ran on other problems")
        elif changed:
            lines.append(f"no paired test ({label}): the two evaluations used other settings ({', '.join(changed)}); "
                         f"evaluate both with the same ones to test what training changed")
        else:
            lines.append(f"paired test ({label}, same problems): p = {paired_test(before[key], after[key]):.3g}")
    return "\n".join(lines)


def other_settings(before: dict, after: dict) -> list[str]:
    """The evaluate() settings the two results record differently (none for results that record none). The tools
    settings count as absent (no tools) in results made before they were recorded."""
    ours, theirs = before.get("settings"), after.get("settings")
    if not isinstance(ours, dict) or not isinstance(theirs, dict):
        return []
    return [name for name in (*GENERATION_SETTINGS, *CHECK_SETTING.values())
            if name in ours and name in theirs and ours[name] != theirs[name]] + [
        name for name, absent in TOOL_SETTINGS.items() if ours.get(name, absent) != theirs.get(name, absent)]


def environment_names(factory, agent=None):
    """What evaluate()'s settings record of an environment_factory: its class's (or each key's) name, not a repr
    holding a memory address (a lambda made again in a re-run cell is the same setting). A factory that is not
    the class itself (a lambda, a function, functools.partial) is recorded by the class of the instance it built
    (agent.pools, make_agent's probe) and what it binds: a partial's function and arguments, a function's literal
    constants and closure values, so that `lambda: Hard(0)` and `lambda: Hard(100)`, or partials of two classes,
    are not paired by compare() as the same setting."""
    if factory is None:
        return None
    pools = getattr(agent, "pools", None) or {}
    if isinstance(factory, dict):
        return {str(k): _factory_name(v, pools.get(k)) for k, v in factory.items()}
    return _factory_name(factory, pools.get(None))


def _factory_name(factory, built=None) -> str:
    name = getattr(factory, "__name__", None) or type(factory).__name__
    if isinstance(factory, type):
        return name
    cls = type(built[0]).__name__ if built else None
    if isinstance(factory, functools.partial):
        inner = getattr(factory.func, "__name__", None) or type(factory.func).__name__
        bound = [*map(_plain, factory.args), *(f"{k}={_plain(v)}" for k, v in factory.keywords.items())]
        call = f"{inner}({', '.join(bound)})"
        return call if cls in (None, inner) else f"{cls} from {call}"
    code = getattr(factory, "__code__", None)
    values = [] if code is None else [c for c in code.co_consts if _is_plain(c)]
    for cell in getattr(factory, "__closure__", None) or ():
        try:
            values += [cell.cell_contents] if _is_plain(cell.cell_contents) else []
        except ValueError:  # an empty cell
            pass
    shown = name + (f" with {', '.join(map(_plain, values))}" if values else "")
    return shown if cls is None else f"{cls} from {shown}"


def _is_plain(value) -> bool:
    """A value whose repr is the same in every run (no memory address); a function's docstring is one too."""
    return isinstance(value, (bool, int, float, str)) and not (isinstance(value, str) and "\n" in value)


def _plain(value) -> str:
    """A bound argument as the record shows it: a plain value's repr, else its class's name (no address)."""
    if _is_plain(value) or value is None:
        return repr(value)[:40]
    return getattr(value, "__name__", None) or type(value).__name__
