"""Tests for grpo_nb.data and grpo_nb.dataset_checks: generated arithmetic problems, GSM8K formatting (no Hub
needed), and what a dataset must be."""

import re

import datasets
import pytest

from grpo_nb import data, dataset_checks
from grpo_nb.rewards import correctness_reward, strict_format_reward
from grpo_nb.data import FEW_SHOT_EXAMPLES, SYSTEM_PROMPT, make_prompt, arithmetic_dataset, extract_gsm8k_answer, format_gsm8k, load_gsm8k


def solve(question):
    """Recompute a generated problem's answer from its text alone.

    The first sentence holds the starting number, each following sentence but the last
    (the question) one step. A step's operation is read from its wording, independently
    of the generator, so a template that says something other than what it computes fails.
    Returns (answer, list of (operation, operand)).
    """
    sentences = re.split(r"(?<=[.?])\s+", question)
    assert sentences[-1].startswith("How many") and not re.search(r"\d", sentences[-1])
    (total,) = map(int, re.findall(r"\d+", sentences[0]))
    steps = []
    for sentence in sentences[1:-1]:
        (n,) = map(int, re.findall(r"\d+", sentence))
        if "equal" in sentence:
            assert total % n == 0, f"inexact division in {question!r}"
            op, total = "/", total // n
        elif "times as many" in sentence or "new ones" in sentence:
            op, total = "*", total * n
        elif "more" in sentence:
            op, total = "+", total + n
        else:
            op, total = "-", total - n
        steps.append((op, n))
        assert total >= 0, f"negative running total in {question!r}"
    return total, steps


def test_columns_and_prompt_format():
    ds = arithmetic_dataset(8, seed=1)
    assert len(ds) == 8
    assert set(ds.column_names) == {"prompt", "answer", "question"}
    row = ds[0]
    assert row["prompt"] == make_prompt(row["question"], SYSTEM_PROMPT, few_shot=2)
    assert [m["role"] for m in row["prompt"]] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert row["prompt"][-1] == {"role": "user", "content": row["question"]}
    assert isinstance(row["answer"], str)
    plain = arithmetic_dataset(2, seed=1, few_shot=0)[0]["prompt"]
    assert plain == [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": plain[1]["content"]}]
    with pytest.raises(ValueError, match="few_shot"):
        arithmetic_dataset(2, few_shot=5)
    custom = arithmetic_dataset(2, system_prompt="Be brief.")
    assert custom[0]["prompt"][0] == {"role": "system", "content": "Be brief."}


def test_system_prompt_and_examples_show_the_format():
    assert "<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>" in SYSTEM_PROMPT
    # The worked examples are themselves in the exact format, with correct integer answers.
    for question, answer in FEW_SHOT_EXAMPLES:
        assert strict_format_reward([answer]) == [0.5]
        assert correctness_reward([answer], answer=["5"]) == [2.0]


def test_same_seed_same_dataset_different_seed_different():
    a = arithmetic_dataset(32, seed=3, difficulty="medium")
    b = arithmetic_dataset(32, seed=3, difficulty="medium")
    c = arithmetic_dataset(32, seed=4, difficulty="medium")
    assert a.to_list() == b.to_list()
    assert a["question"] != c["question"]


def test_problems_are_varied():
    ds = arithmetic_dataset(200, seed=0, difficulty="hard")
    assert len(set(ds["question"])) > 190
    names = {q.split()[0] for q in ds["question"]}
    assert len(names) >= 5
    assert len({q.split("How many ")[1].split(" does")[0] for q in ds["question"]}) >= 5  # items


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_answers_are_correct_non_negative_integers(difficulty):
    ds = arithmetic_dataset(300, seed=7, difficulty=difficulty)
    for row in ds:
        answer, _ = solve(row["question"])
        assert row["answer"] == str(answer), row["question"]
        assert int(row["answer"]) >= 0


def test_difficulty_levels():
    def stats(ds):
        all_steps = [solve(q)[1] for q in ds["question"]]
        return (
            {len(steps) for steps in all_steps},
            {op for steps in all_steps for op, _ in steps},
            max(int(re.search(r"\d+", q).group()) for q in ds["question"]),
        )

    num_steps, ops, biggest_start = stats(arithmetic_dataset(300, difficulty="easy"))
    assert num_steps == {1} and ops == {"+", "-"} and biggest_start <= 10
    num_steps, ops, biggest_start = stats(arithmetic_dataset(300, difficulty="medium"))
    assert num_steps == {2} and ops == {"+", "-", "*"} and 10 < biggest_start <= 50
    num_steps, ops, biggest_start = stats(arithmetic_dataset(300, difficulty="hard"))
    assert num_steps == {3} and ops == {"+", "-", "*", "/"} and 50 < biggest_start <= 100


def test_keyword_overrides():
    ds = arithmetic_dataset(100, difficulty="easy", num_steps=4, max_value=30, operations=("*", "/"))
    for q, a in zip(ds["question"], ds["answer"]):
        answer, steps = solve(q)
        assert str(answer) == a
        assert len(steps) == 4
        assert {op for op, _ in steps} <= {"*", "/"}
    # Subtraction alone over several steps still never goes below zero (solve checks).
    for q in arithmetic_dataset(100, num_steps=3, max_value=20, operations="-")["question"]:
        solve(q)
    # Division alone needs totals divisible several times over; they are found.
    for q in arithmetic_dataset(20, num_steps=3, operations=["/"], max_value=100)["question"]:
        assert [op for op, _ in solve(q)[1]] == ["/", "/", "/"]


def test_bad_arguments():
    with pytest.raises(ValueError, match="difficulty"):
        arithmetic_dataset(difficulty="impossible")
    with pytest.raises(ValueError, match="operations"):
        arithmetic_dataset(operations=("^",))
    with pytest.raises(ValueError, match="max_value"):
        arithmetic_dataset(max_value=1)
    with pytest.raises(ValueError, match="num_steps"):
        arithmetic_dataset(num_steps=0)
    with pytest.raises(ValueError, match="could not generate"):
        arithmetic_dataset(4, num_steps=10, max_value=3, operations="/")


# ----------------------------------------------------------------------------------------
# GSM8K

GSM8K_ROWS = {
    "question": [
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "A company pays 1234 dollars a month. How much is that over 1 month?",
    ],
    "answer": [
        "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
        "It pays 1,234 dollars.\n#### 1,234",
    ],
}


def test_extract_gsm8k_answer():
    assert extract_gsm8k_answer("blah\n#### 72") == "72"
    assert extract_gsm8k_answer("x\n#### 1,234 ") == "1234"
    assert extract_gsm8k_answer("#### -5") == "-5"
    assert extract_gsm8k_answer("no final answer") is None
    # GSM8K-like sets (translations, user-made): the number, not every word after '####' glued together
    for tail, number in (("18 eggs", "18"), ("5\n\nThe answer is five", "5"), ("$18", "18"), ("$ 1,000.50.", "1000.50"),
                         ("3/4", "3/4"), ("1.234,5", "1.234,5")):
        assert extract_gsm8k_answer("work\n#### " + tail) == number, tail
    # not one number: given back whole, never cut to its first digits (format_gsm8k refuses the row)
    for tail in ("1 234", "1e3", "3:30", "5-7", "5 - 7"):
        assert extract_gsm8k_answer("work\n#### " + tail) == tail, tail


def test_format_gsm8k():
    ds = format_gsm8k(datasets.Dataset.from_dict(GSM8K_ROWS))
    assert ds["answer"] == ["72", "1234"]
    assert ds["question"] == GSM8K_ROWS["question"]
    assert ds[0]["prompt"] == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": GSM8K_ROWS["question"][0]},
    ]
    custom = format_gsm8k(datasets.Dataset.from_dict(GSM8K_ROWS), system_prompt="Sys")
    assert custom[1]["prompt"][0]["content"] == "Sys"
    # A DatasetDict, as datasets.load_dataset(<local path>) returns, works too.
    splits = format_gsm8k(datasets.DatasetDict(train=datasets.Dataset.from_dict(GSM8K_ROWS)))
    assert splits["train"]["answer"] == ["72", "1234"]


def test_format_gsm8k_rejects_rows_without_final_answer():
    rows = {"question": ["q"], "answer": ["no marker here"]}
    with pytest.raises(ValueError, match="row 0 has no '#### <number>'"):
        format_gsm8k(datasets.Dataset.from_dict(rows))


def test_format_gsm8k_names_a_row_whose_answer_is_no_text_or_no_number():
    for answer in (5, None):
        with pytest.raises(TypeError, match=r"row 0's 'answer' is .* not a GSM8K solution text"):
            format_gsm8k(datasets.Dataset.from_dict({"question": ["q"], "answer": [answer]}))
    with pytest.raises(ValueError, match=r"row 0's 'answer' has no number after its '####' but words"):
        format_gsm8k(datasets.Dataset.from_dict({"question": ["q"], "answer": ["#### eighteen eggs"]}))


def test_format_gsm8k_rejects_a_final_answer_with_nothing_after_it():
    rows = {"question": ["q", "q2"], "answer": ["work\n#### 4", "work\n####  "]}
    with pytest.raises(ValueError, match=r"row 1 has nothing after the '####'.*dataset.filter"):
        format_gsm8k(datasets.Dataset.from_dict(rows))


def test_blank_answers_are_missing_like_none_and_nan():
    # an empty <answer></answer> would match a blank reference: correctness_reward would pay 2.0 for it
    assert correctness_reward(["<answer>\n\n</answer>"], [""]) == [2.0]
    for blank in ("", "   ", "\n"):
        with pytest.raises(ValueError, match=r"row 1: its 'answer' is .*, a missing value.*strip\(\) != ''"):
            dataset_checks.check_dataset([{"prompt": "p", "answer": "4"}, {"prompt": "q", "answer": blank}])
    assert dataset_checks.check_dataset([{"prompt": "p", "answer": 0}, {"prompt": "q", "answer": "0"}])[0] == ["prompt", "answer"]


def test_missing_prompts_are_dropped_not_turned_into_text():
    pd = pytest.importorskip("pandas", reason="pandas comes with datasets")
    frame = pd.DataFrame({"prompt": ["w5", None], "answer": ["1", "2"]})
    for rows in (dataset_checks.as_dataset(frame), [{"prompt": "w5"}, {"prompt": float("nan")}]):
        with pytest.raises(ValueError, match=r"row 1: its 'prompt' is (None|nan), a missing value.*dataset.filter"):
            dataset_checks.check_dataset(rows)


def test_a_dataframe_column_of_mixed_types_is_named_with_the_fix():
    pd = pytest.importorskip("pandas", reason="pandas comes with datasets")
    frame = pd.DataFrame({"prompt": ["a", "b", "c", "d"], "answer": [1, "2", None, "x"]}, index=[7, 8, 9, 10])
    with pytest.raises(ValueError, match=r"column 'answer' mixes int \(row 0\), str \(row 1\).*"
                                         r"df\['answer'\] = df\['answer'\].astype\(str\)"):
        dataset_checks.as_dataset(frame)
    assert list(dataset_checks.as_dataset(frame.astype({"answer": str}))["answer"])[:2] == ["1", "2"]  # the fix works


def test_a_dataset_formatted_for_another_library_is_read_as_the_rows_it_stores():
    stored = datasets.Dataset.from_dict({"prompt": ["w4 w5", "w6"], "answer": [5, 6], "score": [0.1, 0.2]})
    for kind in ("pandas", "arrow", "torch"):  # rows as a DataFrame, an Arrow table, float32 tensors
        plain = dataset_checks.as_dataset(stored.with_format(kind))
        assert [plain[i] for i in range(2)] == stored.to_list() and dataset_checks.check_dataset(plain) == (stored.column_names, False)
    for kept in (stored.with_format("numpy"), stored.with_transform(lambda batch: batch)):  # their rows are dicts
        assert dataset_checks.as_dataset(kept) is kept


def test_load_gsm8k_offline_gives_clear_error(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(data.datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError) as info:
        load_gsm8k("test")
    message = str(info.value)
    assert "Could not load GSM8K" in message
    assert "Couldn't reach" in message  # the original reason
    assert "format_gsm8k(datasets.load_dataset(" in message
    assert "arithmetic_dataset()" in message
    assert isinstance(info.value.__cause__, ConnectionError)


def test_load_gsm8k_formats_what_it_loads(monkeypatch):
    calls = []

    def fake_load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return datasets.Dataset.from_dict(GSM8K_ROWS)

    monkeypatch.setattr(data.datasets, "load_dataset", fake_load_dataset)
    ds = load_gsm8k("test")
    assert calls == [(("openai/gsm8k", "main"), {"split": "test"})]
    assert ds["answer"] == ["72", "1234"]


def test_check_dataset_refuses_values_nested_too_deep_or_holding_themselves():
    tree = leaf = []
    for _ in range(dataset_checks.MAX_NESTING - 1):  # the outer list and 49 inside it
        leaf.append([])
        leaf = leaf[0]
    dataset_checks.check_dataset([{"prompt": "w5", "tree": tree}])  # MAX_NESTING levels is fine: what Arrow holds
    loop = {"id": 1}
    loop["children"] = [loop]
    for value, message in [([tree], "column 'tree' is nested more than 50 levels deep"),
                           (loop, "column 'tree' refers to itself")]:
        with pytest.raises(ValueError, match=f"Dataset row 1: {message}"):
            dataset_checks.check_dataset([{"prompt": "w5", "tree": []}, {"prompt": "w6", "tree": value}])


def test_an_answer_is_one_value():
    dataset_checks.check_dataset([{"prompt": "w5", "answer": a} for a in ("5", 5, 2.5, True)])
    for answer, fix in [(["5", "five"], "row['answer'][0]"), ({"value": "5"}, "row['answer']['value']"),
                        (b"5", "row['answer'].decode()")]:
        with pytest.raises(ValueError, match=re.escape(f"Dataset row 0: its 'answer' is a {type(answer).__name__} "
                                                       f"({answer!r}), but the answer column holds one reference")) as e:
            dataset_checks.check_dataset([{"prompt": "w5", "answer": answer}])
        assert fix in str(e.value) and "rename_column('answer', 'answers')" in str(e.value)
