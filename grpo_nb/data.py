"""Prompt datasets for GRPO: generated arithmetic word problems and GSM8K.

Every dataset here has the same three columns, which is what the trainer and the reward
functions in `grpo_nb.rewards` expect:

- `prompt`: a conversation, `[{"role": "system", ...}, {"role": "user", ...}]`
- `answer`: the reference answer, an integer written as a string
- `question`: the plain question text, handy for printing and debugging

`arithmetic_dataset` needs no network, so it is the way to try things out offline.
What any dataset must be (its container, columns, prompts and answers) is checked in
`grpo_nb.dataset_checks`.
"""

from __future__ import annotations

import random
import re

import datasets
import torch

from .arguments import need_int, refuse
from .distributed import World

SYSTEM_PROMPT = """\
Respond in exactly this format:
<reasoning>
...
</reasoning>
<answer>
...
</answer>
The answer is a single number."""

# Worked examples given as earlier chat turns. A 135M model ignores a format described in
# the system prompt (all-zero format rewards: nothing to learn from), but imitates one it
# has "already answered" in; two such turns give the first groups reward variance.
FEW_SHOT_EXAMPLES = [
    (
        "Ann has 2 pens and buys 3 more. How many pens does Ann have now?",
        "<reasoning>\nAnn has 2 pens. She buys 3 more, so 2 + 3 = 5.\n</reasoning>\n<answer>\n5\n</answer>",
    ),
    (
        "Ben has 9 cards. He gives away 4 cards. How many cards does Ben have now?",
        "<reasoning>\nBen has 9 cards. He gives away 4, so 9 - 4 = 5.\n</reasoning>\n<answer>\n5\n</answer>",
    ),
]


class PromptSampler:
    """Endless seeded shuffles of the dataset, a fixed number of rows at a time."""

    def __init__(self, dataset, rows_per_batch: int, seed: int, world: World = World()):
        self.dataset, self.rows_per_batch, self.world = dataset, rows_per_batch, world
        self.generator = torch.Generator().manual_seed(seed)
        self.order: list[int] = []

    def state_dict(self) -> dict:
        # world_size: the processes that drew each step's rows (the global batch is rows_per_batch of each), for
        # a resume on another number of processes to say that the batch changed (resume.restore_state)
        return {"generator": self.generator.get_state(), "order": list(self.order), "world_size": self.world.size}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.order = list(state["order"])

    def __next__(self) -> list[dict]:
        # Every rank draws the whole global batch from the same random order and keeps its
        # slice, so the ranks together see what one process would, and stay in step.
        picked = []
        while len(picked) < self.rows_per_batch * self.world.size:
            if not self.order:
                self.order = torch.randperm(len(self.dataset), generator=self.generator).tolist()
            picked.append(self.order.pop())
        mine = picked[self.world.rank * self.rows_per_batch : (self.world.rank + 1) * self.rows_per_batch]
        return [dict(self.dataset[i]) for i in mine]


def make_prompt(question: str, system_prompt: str | None = SYSTEM_PROMPT, few_shot: int = 0) -> list[dict[str, str]]:
    """The conversational prompt for one question: the system prompt (none when None or ""), `few_shot`
    worked examples from `FEW_SHOT_EXAMPLES` as earlier user/assistant turns, then the question."""
    if not 0 <= few_shot <= len(FEW_SHOT_EXAMPLES):
        raise ValueError(f"few_shot={few_shot} must be between 0 and {len(FEW_SHOT_EXAMPLES)}")
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for q, a in FEW_SHOT_EXAMPLES[:few_shot]:
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return messages + [{"role": "user", "content": question}]


# ----------------------------------------------------------------------------------------
# Arithmetic word problems

# Each named level sets (num_steps, max_value, operations); keywords to
# `arithmetic_dataset` override single settings.
DIFFICULTIES = {
    "easy": dict(num_steps=1, max_value=10, operations=("+", "-")),
    "medium": dict(num_steps=2, max_value=50, operations=("+", "-", "*")),
    "hard": dict(num_steps=3, max_value=100, operations=("+", "-", "*", "/")),
}
OPERATIONS = ("+", "-", "*", "/")

MAX_VALUE = 10_000

# Multipliers and divisors stay small whatever max_value is: "37 times as many" reads
# badly and makes the running total explode.
_MAX_FACTOR = 10

_NAMES = [
    ("Tom", "he"), ("Mia", "she"), ("Sam", "he"), ("Lena", "she"), ("Ravi", "he"),
    ("Aiko", "she"), ("Omar", "he"), ("Zoe", "she"), ("Diego", "he"), ("Nora", "she"),
]
_ITEMS = [
    "apples", "marbles", "stickers", "books", "cookies", "pencils",
    "coins", "cards", "shells", "balloons", "stamps", "toy cars",
]
_PRONOUNS = {"he": ("he", "him", "his"), "she": ("she", "her", "her")}

# Every operand is >= 2, so the plural item names always read correctly.
_START_TEMPLATES = [
    "{name} has {n} {items}.",
    "{name} starts with {n} {items}.",
    "There are {n} {items} in {name}'s bag.",
]
_STEP_TEMPLATES = {
    "+": [
        "{He} buys {n} more.",
        "{He} finds {n} more {items}.",
        "A friend gives {him} {n} more {items}.",
        "Then {he} gets {n} more {items} as a gift.",
    ],
    "-": [
        "{He} gives away {n} {items}.",
        "{He} loses {n} of them.",
        "{He} gives {n} {items} to a friend.",
        "Then {he} sells {n} of them.",
    ],
    "*": [
        "Then {he} has {n} times as many {items} as before.",
        "{He} trades each of {his} {items} for {n} new ones.",
    ],
    "/": [
        "{He} splits them into {n} equal groups and keeps one group.",
        "{He} packs them equally into {n} boxes and keeps one box.",
    ],
}
_QUESTION_TEMPLATES = [
    "How many {items} does {name} have now?",
    "How many {items} does {name} have in the end?",
    "How many {items} does {name} end up with?",
]


def _pick_step(rng: random.Random, total: int, max_value: int, operations: tuple[str, ...]):
    """One random (operation, operand) that keeps `total` a non-negative integer, or None."""
    max_factor = min(max_value, _MAX_FACTOR)
    choices = []
    if "+" in operations:
        choices.append(("+", list(range(2, max_value + 1))))
    if "-" in operations and total >= 2:
        choices.append(("-", list(range(2, min(total, max_value) + 1))))
    if "*" in operations and total >= 1:
        choices.append(("*", list(range(2, max_factor + 1))))
    if "/" in operations:
        divisors = [d for d in range(2, max_factor + 1) if total >= d and total % d == 0]
        if divisors:
            choices.append(("/", divisors))
    if not choices:
        return None
    op, operands = rng.choice(choices)
    return op, rng.choice(operands)


def _apply(op: str, total: int, n: int) -> int:
    if op == "+":
        return total + n
    if op == "-":
        return total - n
    if op == "*":
        return total * n
    return total // n  # _pick_step only picks divisors, so this is exact


def _make_problem(rng: random.Random, num_steps: int, max_value: int, operations: tuple[str, ...]):
    """One (question, answer) pair, or None when this draw got stuck (e.g. nothing divides)."""
    name, gender = rng.choice(_NAMES)
    he, him, his = _PRONOUNS[gender]
    words = dict(name=name, items=rng.choice(_ITEMS), he=he, He=he.capitalize(), him=him, his=his)

    total = rng.randint(2, max_value)
    sentences = [rng.choice(_START_TEMPLATES).format(n=total, **words)]
    for _ in range(num_steps):
        step = _pick_step(rng, total, max_value, operations)
        if step is None:
            return None
        op, n = step
        sentences.append(rng.choice(_STEP_TEMPLATES[op]).format(n=n, **words))
        total = _apply(op, total, n)
    sentences.append(rng.choice(_QUESTION_TEMPLATES).format(**words))
    return " ".join(sentences), total


def arithmetic_dataset(
    n: int = 256,
    *,
    seed: int = 0,
    difficulty: str = "easy",
    num_steps: int | None = None,
    max_value: int | None = None,
    operations=None,
    system_prompt: str | None = SYSTEM_PROMPT,
    few_shot: int = 2,
) -> datasets.Dataset:
    """`n` generated arithmetic word problems with non-negative integer answers.

    `difficulty` picks a level from `DIFFICULTIES`:
    "easy" (one step, numbers up to 10, + and -), "medium" (two steps, numbers up to 50,
    + - *) or "hard" (three steps, numbers up to 100, + - * and exact division).
    `num_steps`, `max_value` (largest starting number or addend; multipliers and
    divisors stay between 2 and 10) and `operations` (any of "+", "-", "*", "/",
    e.g. `("+", "*")` or `"+*"`) override the level's setting.

    Problems come from a `random.Random(seed)`: the same arguments give the same dataset.
    Subtractions never go below zero and divisions are always exact. `few_shot` worked
    examples precede each question as chat turns (see `FEW_SHOT_EXAMPLES`); small models need them.
    `system_prompt=None` (or "") leaves the system message out.
    """
    n = need_int("arithmetic_dataset", "n", n, 1)
    seed = need_int("arithmetic_dataset", "seed", seed, 0)
    num_steps = need_int("arithmetic_dataset", "num_steps", num_steps, 1, optional=True)
    max_value = need_int("arithmetic_dataset", "max_value", max_value, 2, optional=True)
    few_shot = need_int("arithmetic_dataset", "few_shot", few_shot, 0)
    if max_value is not None and max_value > MAX_VALUE:
        # each step draws its operand from a list of every allowed number: a huge range is a huge list
        refuse("arithmetic_dataset", "max_value", max_value, f"an integer from 2 to {MAX_VALUE:,} (the largest "
               f"starting number or addend; word problems with larger numbers teach a small model nothing more)")
    if system_prompt is not None and not isinstance(system_prompt, str):
        refuse("arithmetic_dataset", "system_prompt", system_prompt, "a string, or None for no system message",
               TypeError)
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty={difficulty!r} is not one of {list(DIFFICULTIES)}")
    level = DIFFICULTIES[difficulty]
    num_steps = level["num_steps"] if num_steps is None else num_steps
    max_value = level["max_value"] if max_value is None else max_value
    operations = tuple(level["operations"] if operations is None else operations)
    if num_steps < 1:
        raise ValueError(f"num_steps must be at least 1, got {num_steps}")
    if max_value < 2:
        raise ValueError(f"max_value must be at least 2, got {max_value}")
    if not operations or any(op not in OPERATIONS for op in operations):
        raise ValueError(f"operations must be a non-empty selection of {OPERATIONS}, got {operations!r}")

    rng = random.Random(seed)
    questions, answers = [], []
    while len(questions) < n:
        # A draw can get stuck, e.g. operations=("/",) with a prime total; it is simply
        # redrawn, but a setting where nearly every draw sticks is an error, not a hang.
        for _ in range(1000):
            problem = _make_problem(rng, num_steps, max_value, operations)
            if problem is not None:
                break
        else:
            raise ValueError(
                f"could not generate a problem with num_steps={num_steps}, max_value={max_value}, "
                f"operations={operations}: too few numbers allow these steps. "
                "Raise max_value, lower num_steps or allow more operations."
            )
        questions.append(problem[0])
        answers.append(str(problem[1]))

    return datasets.Dataset.from_dict(
        {
            "prompt": [make_prompt(q, system_prompt, few_shot) for q in questions],
            "answer": answers,
            "question": questions,
        }
    )


def heldout_split(train: datasets.Dataset, heldout: datasets.Dataset, n: int | None = None,
                  key: str = "question") -> datasets.Dataset:
    """The rows of `heldout` whose `key` (the question) does not occur in `train`: a held-out set
    disjoint from training (generated sets can repeat a question). `n`: keep the first n, and
    fail if fewer are left."""
    seen = set(train[key])
    keep = [i for i, value in enumerate(heldout[key]) if value not in seen]
    if n is not None:
        if len(keep) < n:
            raise ValueError(f"only {len(keep)} of {len(heldout)} held-out rows are not in the training set; "
                             f"{n} were asked for. Generate more held-out rows.")
        keep = keep[:n]
    return heldout.select(keep)


# ----------------------------------------------------------------------------------------
# GSM8K


# GSM8K's final number, at the start of what follows "####": a sign, a '$', digits (thousands commas allowed), a
# decimal part; not followed by more of a number ("1.234,5" is none: refused rather than misread).
_GSM8K_NUMBER = re.compile(r"\s*([-+]?)\s*\$?\s*(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?![\d.,/]*\d)")
# Digits that go on after a space, an exponent, a colon or a dash ("1 234", "1e3", "3:30", "5-7"): not one number,
# and its first digits are not the answer.
_GSM8K_NOT_ONE_NUMBER = re.compile(r"\s*[-+]?\s*\$?\s*\d[\d.,]*[ \t]*(?:[-:eE][-+]?|[ \t])[ \t]*\d")


def extract_gsm8k_answer(text: str) -> str | None:
    """The final answer of a GSM8K solution: the number after its last "####" ("#### 1,234" -> "1234",
    "#### $18" -> "18", "#### 18 eggs" -> "18"); what follows "####", stripped, when no number starts it;
    None without "####". What is not one number ("1 234", "1e3", "3:30", "5-7") comes back whole, never cut to its
    first digits (format_gsm8k refuses it)."""
    if "####" not in text:
        return None
    tail = text.split("####")[-1]
    if _GSM8K_NOT_ONE_NUMBER.match(tail) is None and (number := _GSM8K_NUMBER.match(tail)) is not None:
        sign, digits, decimals = number.groups()
        return sign.replace("+", "") + digits.replace(",", "") + (decimals or "")
    return tail.strip()


def format_gsm8k(dataset, *, system_prompt: str = SYSTEM_PROMPT):
    """Turn a dataset with GSM8K's columns (`question`, `answer`) into our format.

    `prompt` becomes the conversation, `answer` the bare final number (the worked solution
    is dropped: only the number is needed to score a completion). Works on a `Dataset`
    or a `DatasetDict` of splits.
    """
    if not isinstance(dataset, (datasets.Dataset, datasets.DatasetDict)):
        shown = f"<{type(dataset).__name__} of {len(dataset)}>" if hasattr(dataset, "__len__") else repr(dataset)
        raise TypeError(f"format_gsm8k(dataset={shown}) is invalid: expected a datasets.Dataset (or DatasetDict) with "
                        f"GSM8K's 'question' and 'answer' columns; for a list of row dicts, "
                        f"format_gsm8k(datasets.Dataset.from_list(rows)).")
    names = dataset.column_names
    for columns in names.values() if isinstance(names, dict) else [names]:
        if not {"question", "answer"} <= set(columns):
            raise ValueError(f"format_gsm8k(dataset=...) needs GSM8K's 'question' and 'answer' columns; the dataset "
                             f"has {columns}. Rename the columns, e.g. dataset.rename_column('problem', 'question').")

    def convert(row, index):
        if not isinstance(row["answer"], str):
            raise TypeError(f"format_gsm8k(): row {index}'s 'answer' is {row['answer']!r} ({type(row['answer']).__name__}),"
                            f" not a GSM8K solution text ending in '#### <number>': fix or drop the row, e.g. "
                            f"dataset.filter(lambda row: isinstance(row['answer'], str)) before format_gsm8k.")
        answer = extract_gsm8k_answer(row["answer"])
        if answer is None:
            raise ValueError(
                f"row {index} has no '#### <number>' final answer in its 'answer' column: "
                f"{row['answer'][-200:]!r}. Is this really GSM8K?"
            )
        if not answer:
            raise ValueError(
                f"row {index} has nothing after the '####' of its 'answer' column ({row['answer'][-200:]!r}): no "
                f"final answer to train on. Fix the row or drop it, e.g. dataset = dataset.filter(lambda row: "
                f"row['answer'].split('####')[-1].strip() != '') before format_gsm8k.")
        if _GSM8K_NOT_ONE_NUMBER.match(row["answer"].split("####")[-1]):
            raise ValueError(
                f"format_gsm8k(): row {index}'s 'answer' ends in {answer[:200]!r} after its '####', which is not one "
                f"number (digits after a space, an exponent, a colon or a dash), and no completion's answer would "
                f"match it as the target. Write the row's final answer as one number (e.g. '#### 1234'), or drop the "
                f"row before format_gsm8k.")
        if len(answer.split()) > 1:  # glued into one word it would be a target no completion's answer matches
            raise ValueError(
                f"format_gsm8k(): row {index}'s 'answer' has no number after its '####' but words ({answer[:200]!r}): "
                f"GSM8K ends a solution with '#### <number>'. Fix the row or drop it before format_gsm8k.")
        return {"prompt": make_prompt(row["question"], system_prompt), "answer": answer}

    return dataset.map(convert, with_indices=True)


def load_gsm8k(split: str = "train", *, system_prompt: str = SYSTEM_PROMPT) -> datasets.Dataset:
    """GSM8K (openai/gsm8k, "main") from the Hugging Face Hub, formatted by `format_gsm8k`."""
    try:
        dataset = datasets.load_dataset("openai/gsm8k", "main", split=split)
    except Exception as err:
        raise RuntimeError(
            f"Could not load GSM8K (openai/gsm8k, split={split!r}) from the Hugging Face Hub: "
            f"{type(err).__name__}: {err}\n"
            "To fix this, either:\n"
            "  - connect to the Hub (and unset HF_HUB_OFFLINE / HF_DATASETS_OFFLINE), or\n"
            "  - load a local copy yourself: "
            "format_gsm8k(datasets.load_dataset(<local path>, split='train')), or\n"
            "  - train offline on generated problems: arithmetic_dataset()."
        ) from err
    return format_gsm8k(dataset, system_prompt=system_prompt)
