"""What a dataset must be before anything reads it: one split with a length and random access, a `prompt` column
of text or chat messages (not empty, valid Unicode, text and chat not mixed), reference answers that are there and
one per row, row values a run can copy and save. train(), evaluate() and the reward previews check it up front, each
problem a ValueError that names the row and the fix.
"""

from __future__ import annotations

import math
import numbers

import datasets

from .reward_contract import is_pandas_na


def dataset_columns(dataset) -> list[str]:
    """Column names of a `datasets.Dataset` or a list of dicts (empty for an empty list)."""
    if hasattr(dataset, "column_names"):
        return list(dataset.column_names)
    return list(dataset[0].keys()) if len(dataset) else []


CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")


def _prompt_kind(prompt, index) -> str:
    """"text" or "chat"; a ValueError naming the row for anything else."""
    if isinstance(prompt, str):
        return "text"
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        for m in prompt:
            if m.get("role") in CHAT_ROLES and isinstance(m.get("content"), list):
                raise ValueError(
                    f"Dataset row {index}: message {str(m)[:200]} has its content as a list of parts (the "
                    f"multimodal format); grpo-nb trains text models on text. Give the content as a string, e.g. "
                    f"dataset.map(lambda row: {{'prompt': [{{**m, 'content': ' '.join(p['text'] for p in m['content']) "
                    f"if isinstance(m['content'], list) else m['content']}} for m in row['prompt']]}})."
                )
            if m.get("role") not in CHAT_ROLES or not isinstance(m.get("content"), str):
                raise ValueError(
                    f"Dataset row {index}: message {str(m)[:200]} needs a 'role' in {list(CHAT_ROLES)} and a "
                    f"'content' (a string). Fix the row, or map the dataset so every message has both."
                )
        return "chat"
    if is_missing(prompt):  # str() would make it the text "None" or "nan"
        raise ValueError(
            f"Dataset row {index}: its 'prompt' is {prompt!r}, a missing value (an empty cell), so there is nothing "
            f"to ask the model. Drop such rows, e.g. dataset = dataset.filter(lambda row: row['prompt'] is not None "
            f"and row['prompt'] == row['prompt']) (the second test drops NaN, pandas' empty cell, which is not "
            f"equal to itself).")
    raise ValueError(
        f"Dataset row {index}: 'prompt' must be a string or a list of chat messages "
        f"[{{'role': 'user', 'content': ...}}], got {type(prompt).__name__}: {str(prompt)[:100]!r}. "
        f"Convert it, e.g. dataset.map(lambda row: {{'prompt': str(row['prompt'])}})."
    )


def as_dataset(dataset):
    """Containers with one obvious meaning as a dataset: a pandas DataFrame becomes a datasets.Dataset
    (its rows, without the index), and a datasets.Dataset formatted for another library (`with_format("pandas")`,
    "arrow", "torch", ...) is read as the plain rows it stores. Everything else is returned as is, for
    `check_dataset` to judge."""
    if isinstance(dataset, datasets.Dataset) and dataset.format["type"] not in (None, "numpy", "custom"):
        # A format only changes how rows are handed out (one row as a DataFrame or an Arrow table, numbers as float32
        # tensors), never the stored values: with_format(None) gives those back exactly. numpy's rows (dicts of numpy
        # values, which compare as the stored ones) and a transform's (dicts it computes: the rows meant) stay as read.
        return dataset.with_format(None)
    if type(dataset).__name__ == "DataFrame" and hasattr(dataset, "to_dict"):
        try:
            return datasets.Dataset.from_pandas(dataset, preserve_index=False)
        except (TypeError, ValueError) as err:  # pyarrow's ArrowTypeError / ArrowInvalid: one type per column
            mixed = _mixed_column(dataset)
            if mixed is None:
                raise
            raise ValueError(mixed) from err
    return dataset


def _mixed_column(frame) -> str | None:
    """What is wrong with the first DataFrame column whose values are of more than one type (ints and text,
    after read_csv or concat), which a datasets.Dataset cannot hold; None if there is none."""
    for column in frame.columns:
        first = {}  # type name -> the first row holding one
        for i, value in enumerate(frame[column].tolist()):
            if not is_missing(value):
                first.setdefault(type(value).__name__, i)
        if len(first) > 1:
            kinds = ", ".join(f"{kind} (row {i})" for kind, i in first.items())
            return (f"The DataFrame's column {column!r} mixes {kinds}, and a dataset column holds one type. Make it "
                    f"one type, e.g. df[{column!r}] = df[{column!r}].astype(str).")
    return None


def _check_prompt_text(prompt, kind: str, index: int) -> None:
    """A prompt that says nothing (empty or blank text, a chat message with empty content) is an error,
    and so is text that is not valid Unicode (a lone surrogate), which the tokenizer cannot encode. An assistant
    message that calls tools says it in its tool_calls: its content may be empty (a worked example with a call)."""
    texts = [prompt] if kind == "text" else [m["content"] for m in prompt if isinstance(m.get("content"), str)]
    said = [prompt] if kind == "text" else [m["content"] for m in prompt
                                            if isinstance(m.get("content"), str) and not m.get("tool_calls")]
    if not texts or not all(t.strip() for t in said):
        raise ValueError(
            f"Dataset row {index}: the prompt {'is' if kind == 'text' else 'has a message that is'} empty "
            f"({str(prompt)[:100]!r}): the model would be asked nothing. Remove such rows, e.g. dataset = dataset.filter(lambda row: bool(str(row['prompt']).strip())).")
    for i, text in enumerate(texts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            where = "its prompt" if kind == "text" else f"message {i} ({prompt[i]['role']}) of its prompt"
            raise ValueError(
                f"Dataset row {index}: {where} holds a lone surrogate {text[err.start]!r} at character {err.start} "
                f"({text[max(0, err.start - 30):err.start + 30]!r}), half of a character that is not valid Unicode "
                f"(text decoded badly, e.g. JSON with a broken \\u escape): the tokenizer cannot encode it. Fix the "
                f"text, e.g. text.encode('utf-8', 'replace').decode() turns it into '?', or drop the row.") from None


def check_dataset(dataset) -> tuple[list[str], bool]:
    """The columns of a training dataset and whether its prompts are chat messages.

    Every row is checked up front (a bad row 5,000 steps in would cost hours), with a
    ValueError that names the row and the fix: the wrong container, no rows, no `prompt`
    column, prompts that are neither text nor chat messages, text mixed with chat, rows of
    a list with different keys.
    """
    if isinstance(dataset, datasets.DatasetDict):
        raise ValueError(f"The dataset is a DatasetDict with splits {list(dataset)}: pass one split, e.g. "
                         f"dataset['{next(iter(dataset), 'train')}'].")
    if isinstance(dataset, datasets.IterableDataset):
        raise ValueError("The dataset is a streaming IterableDataset, which has no length or random access: "
                         "load it without streaming=True, or materialise the rows you need with "
                         "datasets.Dataset.from_list(list(dataset.take(n))).")
    if isinstance(dataset, dict) and not any(isinstance(v, (list, tuple)) for v in dataset.values()):
        raise ValueError(f"The dataset is a single row, a dict with keys {list(dataset)[:10]}: pass a list of rows, "
                         f"e.g. [row], or datasets.Dataset.from_list([row]).")
    if isinstance(dataset, dict):
        raise ValueError(f"The dataset is a dict of columns {list(dataset)[:10]}: wrap it as "
                         f"datasets.Dataset.from_dict(columns), or pass a list of row dicts.")
    if hasattr(dataset, "__next__") or (hasattr(dataset, "__iter__") and not hasattr(dataset, "__len__")):
        raise ValueError(f"The dataset is a {type(dataset).__name__} (an iterator), which has no length or random "
                         f"access: pass a list, e.g. list(rows), or datasets.Dataset.from_list(list(rows)).")
    if isinstance(dataset, (str, bytes)) or not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise ValueError(f"The dataset must be a datasets.Dataset or a list of dicts with a 'prompt' key, "
                         f"got {type(dataset).__name__}.")
    if len(dataset) == 0:
        raise ValueError("The dataset is empty: train() needs at least one row with a 'prompt'.")
    if not isinstance(dataset, datasets.Dataset):
        for i, row in enumerate(dataset):
            if not isinstance(row, dict):
                hint = (" For (prompt, answer) pairs: [{'prompt': p, 'answer': a} for p, a in rows]."
                        if isinstance(row, (tuple, list)) else
                        " For a list of prompts: [{'prompt': p} for p in prompts]." if isinstance(row, str) else "")
                raise ValueError(f"Dataset row {i} is a {type(row).__name__}, not a dict: every row needs a "
                                 f"'prompt' key, e.g. [{{'prompt': 'What is 2+2?', 'answer': '4'}}].{hint}")
            if row.keys() != dataset[0].keys():
                raise ValueError(
                    f"Dataset row {i} has keys {sorted(row)} but row 0 has {sorted(dataset[0])}: every row needs the "
                    f"same keys, since each becomes a column handed to the reward functions. Fill the missing ones.")
            check_row_values(row, i)
    columns = dataset_columns(dataset)
    if "prompt" not in columns:
        raise ValueError(
            f"The dataset has no 'prompt' column (columns: {columns}). Rename the column holding the prompts, "
            f"e.g. dataset = dataset.rename_column('question', 'prompt'), or map rows to chat messages."
        )
    prompts = dataset["prompt"] if isinstance(dataset, datasets.Dataset) else (row["prompt"] for row in dataset)
    kinds = {}
    for i, prompt in enumerate(prompts):
        kind = _prompt_kind(prompt, i)
        _check_prompt_text(prompt, kind, i)
        kinds.setdefault(kind, i)
        if len(kinds) > 1:
            raise ValueError(
                f"Dataset rows mix plain-text prompts (row {kinds['text']}) with chat-message prompts "
                f"(row {kinds['chat']}): completions are handed to reward functions as text for one and as "
                f"messages for the other. Make them all one kind, e.g. wrap text as [{{'role': 'user', "
                f"'content': text}}].")
    if "answer" in columns:
        check_answers(dataset["answer"] if isinstance(dataset, datasets.Dataset)
                      else [row["answer"] for row in dataset])
    return columns, "chat" in kinds


# How deep lists and dicts may nest in a dataset value. A datasets.Dataset cannot hold more (Arrow stops near 60
# levels); in a list of dicts, each level costs a stack frame wherever a row is printed, compared or saved.
MAX_NESTING = 50


def check_row_values(row: dict, index: int) -> None:
    """A list-of-dicts row's values are data a run can copy and save: none nested too deep or holding itself."""
    for column, value in row.items():
        if column == "prompt" or not isinstance(value, (list, tuple, dict, set, frozenset)):
            continue  # the prompt is checked message by message
        problem = nesting_problem(value)
        if problem == "loop":
            raise ValueError(
                f"Dataset row {index}: column {column!r} refers to itself (it holds itself, directly or further in), "
                f"which no checkpoint can store and no reward function can walk: break the loop, or keep the value "
                f"as text.")
        if problem is not None:
            raise ValueError(
                f"Dataset row {index}: column {column!r} is nested more than {MAX_NESTING} levels deep (a parse "
                f"tree, a nested document). Each row's values are copied for every reward-function call and saved "
                f"in checkpoints, and a datasets.Dataset cannot hold such a value either: keep it as text (the "
                f"document it was parsed from) and parse it in the reward function.")


def nesting_problem(value, limit: int = MAX_NESTING) -> str | None:
    """"loop" when `value` holds itself, "deep" when its lists and dicts nest more than `limit` levels, else None.
    Walked without recursion, so that the check cannot overflow the stack it protects."""
    on_path = set()  # the containers from `value` down to the one being walked
    stack = [(None, iter([value]))]
    while stack:
        for inner in stack[-1][1]:
            if isinstance(inner, (list, tuple, dict, set, frozenset)):
                if id(inner) in on_path:
                    return "loop"
                if len(stack) > limit:
                    return "deep"
                on_path.add(id(inner))
                stack.append((id(inner), iter(inner.values() if isinstance(inner, dict) else inner)))
                break
        else:
            on_path.discard(stack.pop()[0])
    return None


def check_answers(answers, row: str = "Dataset row") -> None:
    """Every reference answer is there: not None, NaN or blank text. A blank one is missing too: an empty
    <answer></answer> would match it, and be rewarded (and counted accurate) as right."""
    missing = next((i for i, a in enumerate(answers) if is_missing(a) or isinstance(a, str) and not a.strip()), None)
    if missing is not None:
        raise ValueError(
            f"{row} {missing}: its 'answer' is {answers[missing]!r}, a missing value, so no completion can be judged "
            f"right. Drop such rows, e.g. dataset = dataset.filter(lambda row: row['answer'] is not None and "
            f"row['answer'] == row['answer'] and str(row['answer']).strip() != '') (the second test drops NaN, "
            f"pandas' empty cell, which is not equal to itself; the third blank text).")
    several = next((i for i, a in enumerate(answers) if not isinstance(a, (str, numbers.Number))), None)
    if several is not None:
        answer = answers[several]
        one = (f"row['answer'][{next(iter(answer))!r}]" if isinstance(answer, dict) and answer else
               "row['answer'][0]" if isinstance(answer, (list, tuple)) and answer else
               "row['answer'].decode()" if isinstance(answer, bytes) else "str(row['answer'])")
        raise ValueError(
            f"{row} {several}: its 'answer' is a {type(answer).__name__} ({_shown(answer)}), but the answer column "
            f"holds one reference answer per row: correctness_reward, proximity_reward, evaluate() and the dashboard "
            f"compare the completion's answer with it, and a {type(answer).__name__} would never be equal to one. Map "
            f"it to one answer, e.g. dataset = dataset.map(lambda row: {{'answer': {one}}}), or keep them all under "
            f"another name (dataset.rename_column('answer', 'answers')) for a reward function that accepts any of "
            f"them.")


def _shown(value, limit: int = 100) -> str:
    """repr(value), cut to `limit` characters; a repr that fails (a value that refers to itself) as its type."""
    try:
        text = repr(value)
    except Exception:  # RecursionError, ValueError for an int beyond 4300 digits, a broken __repr__
        return f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."


def is_missing(value) -> bool:
    """None, or a NaN (Python's, numpy's or pandas' NA): a missing value, as a DataFrame's empty cell arrives."""
    if value is None or is_pandas_na(value):
        return True
    return isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral) and math.isnan(value)
