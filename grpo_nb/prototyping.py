"""Try reward functions before a long run: score a few completions and look at the table.

    from grpo_nb import preview_rewards, sample_and_score
    preview_rewards([xml_count_reward, correctness_reward],
                    ["<reasoning>\\n2+2\\n</reasoning>\\n<answer>\\n4\\n</answer>", "4"], answer=["4", "4"])
    sample_and_score(model, tokenizer, ["What is 2+2?"], [correctness_reward], n=4, answer=["4"])

Both take TRL-style reward functions (called by keyword with prompts, completions,
completion_ids and the columns) and return a `RewardTable` (from the widgets): an HTML table
as a notebook cell's value, aligned text when printed. Unlike training, nothing stops at a
broken function: its exception, a wrong number of values, a non-number or NaN is shown in
its cells, and `.scores` / `.totals` / `.errors` hold the results for asserts.
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING

import datasets
import numpy as np
import torch

from .arguments import need_int, need_number, refuse
from .checks import check_context, check_loaded, check_model_and_tokenizer, check_prompts, prompts_cut_message
from .config import GRPOConfig, config_for
from .dataset_checks import check_answers, check_dataset
from .display import reward_table
from .loss import informative_groups
from .reward_calls import call_reward_funcs
from .reward_contract import check_callable, check_no_clashes, completion_text, reward_func_names
from .rollout import engine_for
from .scoring import score_groups

if TYPE_CHECKING:
    from .display import RewardTable

MAX_SAMPLES = 256  # sample_and_score's n


def _is_sequence(values) -> bool:
    """Per-row values (a list, a datasets Column, an array, a Series, ...) rather than one value for all."""
    if isinstance(values, (str, bytes, dict)) or (isinstance(values, (torch.Tensor, np.ndarray)) and values.ndim == 0):
        return False
    return hasattr(values, "__len__") and hasattr(values, "__iter__")


def _normalize_columns(columns: dict, n: int, per: str = "completion") -> dict:
    """Each column as a list of n values: a list with one value per `per` (completion or prompt), or a
    single value (string, number, ...) repeated for every one."""
    check_no_clashes(columns)
    out = {}
    for key, values in columns.items():
        if _is_sequence(values):
            values = list(values)
            if len(values) != n:
                raise ValueError(f"column {key!r} has {len(values)} values; give one per {per} ({n}) or a single value")
            out[key] = values
        else:
            out[key] = [values] * n
    return out


def _table(calls, samples, reward_weights, title, footer=()) -> RewardTable:
    # call_reward_funcs names two functions of one name (e.g. two lambdas) apart, so both keep a column
    names = [call.name for call in calls]
    cells = {call.name: call.cells() for call in calls}
    errors = {call.name: call.problem or next((e for e in call.errors if e), None) for call in calls}
    return reward_table(names, samples, cells, weights=reward_weights, errors=errors, title=title, footer=footer)


def _check_weights(func: str, reward_weights, funcs) -> None:
    """None, or one finite number per reward function, in the functions' order."""
    if reward_weights is None:
        return
    ok = isinstance(reward_weights, (list, tuple)) and all(
        isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) for w in reward_weights)
    if not ok or len(reward_weights) != len(funcs):
        shown = f"<dict {list(reward_weights)[:5]}>" if isinstance(reward_weights, dict) else f"{reward_weights!r:.80}"
        raise ValueError(f"{func}(reward_weights={shown}) is invalid: expected a list of {len(funcs)} finite "
                         f"number(s), one per reward function in order ({', '.join(reward_func_names(funcs))}), "
                         f"e.g. reward_weights={[1.0] * len(funcs)}.")


def _per_item(func: str, name: str, values, example: str) -> list:
    """`values` as a list of per-item values; a string, a dict or an iterator would be misread."""
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{func}({name}={values!r:.80}) is invalid: expected a list, and a bare string would be read "
                        f"one character at a time. Wrap it in a list: {name}=[{values!r:.60}].")
    if isinstance(values, dict) or not (hasattr(values, "__len__") and hasattr(values, "__iter__")):
        shown = f"<{type(values).__name__}>"
        raise TypeError(f"{func}({name}={shown}) is invalid: expected a list, e.g. {example}"
                        + (" (materialise an iterator with list(...))" if hasattr(values, "__next__") else "") + ".")
    return list(values)


def _as_list(reward_funcs) -> list:
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if not funcs:
        raise ValueError("give at least one reward function")
    for func in funcs:  # a name or a loaded reward model is a wrong argument, not a broken function to show
        check_callable(func)
    return funcs


def _prompt_text(prompt) -> str | None:
    if prompt is None or isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[-1], dict):
        return str(prompt[-1].get("content"))
    return str(prompt)


def preview_rewards(reward_funcs, completions, *, prompts=None, tokenizer=None, reward_weights=None,
                    **columns) -> RewardTable:
    """Score `completions` with every reward function and show a table of the scores.

    Args:
        reward_funcs: one TRL-style reward function or a list.
        completions: strings, or chat messages lists `[{"role": "assistant", "content": ...}]`.
        prompts: one per completion (default None for each).
        tokenizer: if given, `completion_ids` are the completions' token ids; else None per completion.
        reward_weights: one weight per function; adds a weighted total column (with two or more
            functions an unweighted total is shown anyway, as `train()` would add them).
        **columns: dataset columns, one value per completion (or one value for all).

    Returns a RewardTable (HTML in a notebook, text when printed) with `.scores`
    ({name: [float or None]}), `.totals` and `.errors` ({name: problem or None}).
    """
    funcs = _as_list(reward_funcs)
    _check_weights("preview_rewards", reward_weights, funcs)
    if tokenizer is not None:
        check_loaded("preview_rewards", "tokenizer", tokenizer)
        if not callable(tokenizer):
            raise TypeError(f"preview_rewards(tokenizer=<{type(tokenizer).__name__}>) is not a tokenizer: pass the "
                            f"model's own (it turns the completions into completion_ids), or None.")
    bare = isinstance(completions, str) or (isinstance(completions, list) and completions
                                            and isinstance(completions[0], dict))
    completions = [completions] if bare else _per_item(  # one completion given bare
        "preview_rewards", "completions", completions, "['<answer>4</answer>', '5']")
    n = len(completions)
    if n == 0:
        raise ValueError("give at least one completion")
    if isinstance(prompts, str) and n == 1:
        prompts = [prompts]
    prompts = [None] * n if prompts is None else _per_item("preview_rewards", "prompts", prompts,
                                                           "one prompt per completion, or [prompt] * n")
    if len(prompts) != n:
        raise ValueError(f"{len(prompts)} prompts for {n} completions: give one prompt per completion")
    texts = [completion_text(c) for c in completions]
    completion_ids = ([tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts] if tokenizer is not None
                      else [None] * n)
    columns = _normalize_columns(columns, n)
    if "answer" in columns:  # as sample_and_score and train() check them
        check_answers(columns["answer"], row="preview_rewards: completion")
    calls = call_reward_funcs(funcs, prompts=prompts, completions=completions, completion_ids=completion_ids,
                              columns=columns, strict=False)
    samples = [{"completion": t, "prompt": _prompt_text(p)} for t, p in zip(texts, prompts)]
    return _table(calls, samples, reward_weights, "Reward preview")


def sample_and_score(model, tokenizer, prompts, reward_funcs, n: int = 4, *,
                     max_completion_length: int = GRPOConfig.max_completion_length,
                     temperature: float = 1.0, seed: int | None = 0, max_prompt_length: int | None = None,
                     reward_weights=None, chat_template_kwargs: dict | None = None, **columns) -> RewardTable:
    """Generate `n` completions per prompt with the live model and show every reward function's scores.

    Generation uses grpo-nb's RolloutEngine as training does (sampled at `temperature`, seeded,
    LoRA adapters active), through the same path from prompts to scored groups as `train()`, and
    by default as long as training's completions (GRPOConfig's max_completion_length).
    Prompts are strings or chat messages lists (then completions are chat messages too, as in
    training on a conversational dataset). Columns given per prompt (e.g. `answer=["4", "9"]`)
    are repeated for each of its completions, as `train()` does; a single value applies to all.
    The table marks each group's prompt and completions cut at `max_completion_length`, and
    says which groups have no reward spread (no learning signal). `chat_template_kwargs`: extra
    apply_chat_template() arguments for chat prompts, as train()'s (e.g. {"enable_thinking": False}).
    """
    need_int("sample_and_score", "n", n, 1)
    if n > MAX_SAMPLES:  # all generated at once, and every one a row of the table
        refuse("sample_and_score", "n", n, f"at most {MAX_SAMPLES} completions per prompt (a GRPO group is "
               f"typically 4 to 64); for more, call it again with another seed")
    need_int("sample_and_score", "max_completion_length", max_completion_length, 1)
    need_number("sample_and_score", "temperature", temperature, 0, low_open=True)
    need_int("sample_and_score", "seed", seed, 0, optional=True)
    need_int("sample_and_score", "max_prompt_length", max_prompt_length, 1, optional=True)
    check_model_and_tokenizer("sample_and_score", model, tokenizer)
    chat_template_kwargs = config_for("sample_and_score()", chat_template_kwargs=chat_template_kwargs
                                      ).chat_template_kwargs
    funcs = _as_list(reward_funcs)
    _check_weights("sample_and_score", reward_weights, funcs)
    prompts = _prompt_list(prompts)
    if not prompts:
        raise ValueError("give at least one prompt")
    columns = _normalize_columns(columns, len(prompts), per="prompt")
    rows = [{"prompt": p, **{key: values[i] for key, values in columns.items()}} for i, p in enumerate(prompts)]
    _, conversational = check_dataset(rows)  # train()'s checks of each prompt (text or chat messages, not empty)
    # and of the context and what the model is asked, before generating
    context = check_context("sample_and_score", model, max_prompt_length, max_completion_length)
    if max_prompt_length is None and context:
        max_prompt_length = context - max_completion_length  # what the context leaves, as in train()
    check_prompts("sample_and_score", model, tokenizer, rows, conversational, chat_template_kwargs=chat_template_kwargs)
    engine = engine_for(model, max_completion_length=max_completion_length, temperature=temperature, seed=seed)
    groups = score_groups(model, tokenizer, rows, engine, n, funcs, max_prompt_length=max_prompt_length,
                          strict=False, caller="sample_and_score", chat_template_kwargs=chat_template_kwargs)
    if groups.prompts_cut:
        warnings.warn("sample_and_score(): " + prompts_cut_message(groups.prompts_cut, max_prompt_length,
                                                                   max_completion_length, context), stacklevel=2)
    samples = [{"completion": t, "prompt": _prompt_text(groups.rows[i]["prompt"]), "group": i // n,
                "truncated": bool(groups.rollout.truncated[i])} for i, t in enumerate(groups.texts)]
    table = _table(groups.calls, samples, reward_weights,
                   f"{n} samples per prompt (temperature {temperature:g}, at most {max_completion_length} tokens)")
    table.footer.extend(_group_spread(table, n))
    return table


def _prompt_list(prompts) -> list:
    """sample_and_score's prompts as a list: one prompt given bare is wrapped; a dataset or its rows are
    refused (their repr or their dicts would be taken for prompts), with what to pass instead."""
    fix = ("pass a list of prompts and the columns the reward functions need, e.g. "
           "sample_and_score(model, tokenizer, dataset['prompt'][:4], reward_funcs, answer=dataset['answer'][:4])")
    if isinstance(prompts, (datasets.Dataset, datasets.DatasetDict, dict)) or type(prompts).__name__ == "DataFrame":
        what = "a dict of columns" if isinstance(prompts, dict) else f"a {type(prompts).__name__}"
        raise TypeError(f"sample_and_score(prompts=<{type(prompts).__name__}>) is invalid: it is {what}, not a list "
                        f"of prompts: {fix}.")
    if isinstance(prompts, str):
        return [prompts]  # one prompt given bare
    prompts = _per_item("sample_and_score", "prompts", prompts, "['What is 2+2?'] or dataset['prompt'][:4]")
    if prompts and isinstance(prompts[0], dict):
        if all(isinstance(m, dict) and "role" in m for m in prompts):
            return [prompts]  # one chat conversation given bare
        raise TypeError(f"sample_and_score(prompts=[{prompts[0]!r:.80}, ...]) is invalid: these are dataset rows, "
                        f"not prompts: {fix}.")
    return prompts


def _group_spread(table, n) -> list[str]:
    """Which completions no function scored, and which groups would teach nothing (`informative_groups`:
    the scored completions' totals all equal). Groups where a function failed are not judged."""
    totals, unscored = table.totals, table.unscored
    lines = []
    if any(unscored):
        lines.append(f"completion(s) {', '.join(str(i) for i, u in enumerate(unscored) if u)}: no reward function "
                     f"scored them (all None), so training leaves them out of their group's mean and std and gives "
                     f"them zero advantage, as TRL does")
    judged = [g for g in range(len(totals) // n)
              if all(totals[i] is not None or unscored[i] for i in range(g * n, (g + 1) * n))]
    if not judged:
        return lines
    rows = [i for g in judged for i in range(g * n, (g + 1) * n)]
    values = torch.tensor([math.nan if totals[i] is None else totals[i] for i in rows], dtype=torch.float32)
    flat = [g for g, informative in zip(judged, informative_groups(values, n).tolist()) if not informative]
    if flat:
        lines.append(f"group(s) {', '.join(map(str, flat))}: every scored completion got the same total reward, so "
                     f"GRPO would learn nothing from them (zero advantage)")
    return lines
