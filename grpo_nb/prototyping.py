"""Try reward functions before a long run: score a few completions and look at the table.

    from grpo_nb import preview_rewards, sample_and_score
    preview_rewards([xml_count_reward, correctness_reward],
                    ["<reasoning>\\n2+2\\n</reasoning>\\n<answer>\\n4\\n</answer>", "4"], answer=["4", "4"])
    sample_and_score(model, tokenizer, ["What is 2+2?"], [correctness_reward], n=4, answer=["4"])

Both take TRL-style reward functions (called by keyword with prompts, completions,
completion_ids and the columns) and return a `grpo_nb_widgets.RewardTable`: an HTML table
as a notebook cell's value, aligned text when printed. Unlike training, nothing stops at a
broken function: its exception, a wrong number of values, a non-number or NaN is shown in
its cells, and `.scores` / `.totals` / `.errors` hold the results for asserts.
"""

from __future__ import annotations

import math
import numbers

from typing import TYPE_CHECKING

import numpy as np
import torch

from .rewards import completion_text, reward_func_name
from .rollout import RolloutEngine, decode_completions, encode_prompts

if TYPE_CHECKING:  # the display layer (matplotlib & co.) is imported only when a table is made
    from grpo_nb_widgets.reward_table import RewardTable

_OWN_ARGS = ("prompts", "completions", "completion_ids")


def _error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _check_value(value) -> dict:
    """One returned value as a table cell."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, np.generic):
        value = value.item()
    if value is None:
        return {"value": None}
    if not isinstance(value, numbers.Real):
        return {"value": value, "note": f"not a number: {type(value).__name__}"}
    value = float(value)
    if not math.isfinite(value):
        return {"value": value, "note": "not finite; return None for 'no score'"}
    return {"value": value}


def _cells_from_output(values, n: int) -> tuple[list[dict], str | None]:
    """Cells for one function's whole output, and a function-level problem (wrong count/type) or None."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu()
        values = values.tolist() if values.dim() == 1 else values
    elif isinstance(values, np.ndarray):
        values = values.tolist() if values.ndim == 1 else values
    if not isinstance(values, (list, tuple)):
        problem = f"returned {type(values).__name__}, not a list of {n} floats"
        return [{"note": problem} for _ in range(n)], problem
    if len(values) != n:
        problem = f"returned {len(values)} values for {n} completions"
        return [{"note": problem} for _ in range(n)], problem
    return [_check_value(v) for v in values], None


def _score_one(func, n, prompts, completions, completion_ids, columns) -> tuple[list[dict], str | None]:
    """Call `func` on the batch; if it raises, per sample, so each cell shows its own result or exception."""
    try:
        values = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
    except Exception as batch_err:
        cells = []
        for i in range(n):
            try:
                out = func(prompts=prompts[i:i + 1], completions=completions[i:i + 1],
                           completion_ids=completion_ids[i:i + 1], **{k: v[i:i + 1] for k, v in columns.items()})
            except Exception as err:
                cells.append({"error": _error_text(err)})
                continue
            one, _ = _cells_from_output(out, 1)
            cells.append(one[0])
        if all(c.get("error") is None for c in cells):
            # Fine one at a time, broken on the batch: every cell says so.
            cells = [{"error": f"{_error_text(batch_err)} (on the whole batch only)"} for _ in range(n)]
        return cells, f"raised {_error_text(batch_err)}"
    return _cells_from_output(values, n)


def _is_sequence(values) -> bool:
    """Per-row values (a list, a datasets Column, an array, a Series, ...) rather than one value for all."""
    if isinstance(values, (str, bytes, dict)) or (isinstance(values, (torch.Tensor, np.ndarray)) and values.ndim == 0):
        return False
    return hasattr(values, "__len__") and hasattr(values, "__iter__")


def _normalize_columns(columns: dict, n: int, per: int = 1) -> dict:
    """Each column as a list of n values: a list with one value per row (repeated `per` times), or a
    single value (string, number, ...) repeated for every row."""
    out = {}
    clashes = set(_OWN_ARGS) & set(columns)
    if clashes:
        raise ValueError(f"columns {sorted(clashes)} clash with the reward functions' own arguments; rename them")
    for key, values in columns.items():
        if _is_sequence(values):
            values = list(values)
            if len(values) * per != n:
                rows = n // per
                raise ValueError(f"column {key!r} has {len(values)} values; give one per "
                                 f"{'prompt' if per > 1 else 'completion'} ({rows}) or a single value")
            out[key] = [v for v in values for _ in range(per)]
        else:
            out[key] = [values] * n
    return out


def _score_table(reward_funcs, samples, prompts, completions, completion_ids, columns, reward_weights,
                 title, footer=()) -> RewardTable:
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if not funcs:
        raise ValueError("give at least one reward function")
    names, cells, errors = [], {}, {}
    for func in funcs:
        name = reward_func_name(func)
        while name in names:  # two functions with one name (e.g. two lambdas) keep both columns
            name += "'"
        names.append(name)
        cells[name], errors[name] = _score_one(func, len(completions), prompts, completions, completion_ids, columns)
    from grpo_nb_widgets.reward_table import RewardTable

    return RewardTable(names, samples, cells, weights=reward_weights, errors=errors, title=title, footer=footer)


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
    if isinstance(completions, str) or (completions and isinstance(completions[0], dict)):
        completions = [completions]  # one completion given bare
    completions = list(completions)
    n = len(completions)
    if n == 0:
        raise ValueError("give at least one completion")
    prompts = [None] * n if prompts is None else list(prompts)
    if len(prompts) != n:
        raise ValueError(f"{len(prompts)} prompts for {n} completions: give one prompt per completion")
    texts = [completion_text(c) for c in completions]
    completion_ids = ([tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts] if tokenizer is not None
                      else [None] * n)
    columns = _normalize_columns(columns, n)
    samples = [{"completion": t, "prompt": _prompt_text(p)} for t, p in zip(texts, prompts)]
    return _score_table(reward_funcs, samples, prompts, completions, completion_ids, columns, reward_weights,
                        "Reward preview")


def sample_and_score(model, tokenizer, prompts, reward_funcs, n: int = 4, *, max_completion_length: int = 128,
                     temperature: float = 1.0, seed: int | None = 0, max_prompt_length: int | None = None,
                     reward_weights=None, **columns) -> RewardTable:
    """Generate `n` completions per prompt with the live model and show every reward function's scores.

    Generation uses grpo-nb's RolloutEngine as training does (sampled at `temperature`, seeded,
    LoRA adapters active). Prompts are strings or chat messages lists (then completions are
    chat messages too, as in training on a conversational dataset). Columns given per prompt
    (e.g. `answer=["4", "9"]`) are repeated for each of its completions, as `train()` does; a
    single value applies to all. The table marks each group's prompt and completions cut at
    `max_completion_length`, and says which groups have no reward spread (no learning signal).
    """
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], dict)):
        prompts = [prompts]  # one prompt given bare
    prompts = list(prompts)
    if not prompts:
        raise ValueError("give at least one prompt")
    device = next(model.parameters()).device
    prompt_ids, prompt_mask, _ = encode_prompts(tokenizer, prompts, max_prompt_length, device)
    engine = RolloutEngine(max_completion_length=max_completion_length, temperature=temperature, seed=seed)
    out = engine(model, tokenizer, prompt_ids, prompt_mask, n)

    texts, completions, completion_ids = decode_completions(tokenizer, out, not isinstance(prompts[0], str))
    repeated = [p for p in prompts for _ in range(n)]
    columns = _normalize_columns(columns, len(repeated), per=n)
    samples = [{"completion": t, "prompt": _prompt_text(repeated[i]), "group": i // n,
                "truncated": bool(out.truncated[i])} for i, t in enumerate(texts)]
    table = _score_table(reward_funcs, samples, repeated, completions, completion_ids, columns, reward_weights,
                         f"{n} samples per prompt (temperature {temperature:g}, at most {max_completion_length} "
                         f"tokens)")
    table.footer.extend(_group_spread(table.totals, n))
    return table


def _group_spread(totals, n) -> list[str]:
    """Which groups would teach nothing: GRPO's advantage is zero when all of a group's rewards are equal."""
    flat = []
    for g in range(len(totals) // n):
        values = totals[g * n:(g + 1) * n]
        if all(v is not None for v in values) and max(values) - min(values) < 1e-6:
            flat.append(g)
    if not flat:
        return []
    return [f"group(s) {', '.join(map(str, flat))}: every completion got the same total reward, so GRPO "
            f"would learn nothing from them (zero advantage)"]
