"""Every numeric and path argument of every public function, walked with edge values (table-driven).

Each value is either refused before any work, with a message that names the argument, or accepted
with its plain meaning. The parameters come from the signatures, so a new numeric argument without
a check fails here (a string, NaN or a negative count gets through).
"""

from __future__ import annotations

import dataclasses
import inspect
import os

import pytest
import torch

import grpo_nb
from grpo_nb import GRPOConfig, setup_reasoning_model
from grpo_nb.memory import estimate_vram
from grpo_nb.planning import plan_for_gpu
from grpo_nb.models import prepare_tokenizer
from grpo_nb.saving import load_for_inference, save_adapter, save_merged
from grpo_nb_widgets import GrpoNbDashboardCallback, LiveDashboard
from tiny_models import tiny_model, tiny_tokenizer

NAN, INF = float("nan"), float("inf")
# Refused everywhere (None only where the parameter is not optional). -1 is in: no count, length, rate or
# size of this API means anything negative.
NEVER = {int: ["3", NAN, INF, 2.5, 1e-12, True, None, -1], float: ["3", NAN, INF, True, None, -1]}
MAY_PASS = [0, 10**12] + [1e-12]  # accepted or refused, as the argument's meaning says
TINY_CONFIG = dict(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)


class Reached(Exception):
    """Raised where a function starts its real work: every argument check has passed."""


def numeric_parameters(func, skip=()) -> list[tuple[str, type, bool]]:
    """(name, int or float, optional) for every parameter that takes a number, read off the signature."""
    out = []
    for p in inspect.signature(func).parameters.values():
        note = str(p.annotation)
        kind = type(p.default) if type(p.default) in (int, float) else int if "int" in note and "bool" not in note \
            else float if "float" in note else None
        if kind is not None and p.name not in skip:
            out.append((p.name, kind, p.default is None or "None" in note))
    return out


def walk(label: str, call, params) -> int:
    """call(name, value) for every parameter and value; returns how many values were tried."""
    tried = 0
    for name, kind, optional in params:
        for value in NEVER[kind] + MAY_PASS:
            if value is None and optional:
                continue
            tried += 1
            try:
                call(name, value)
            except Reached:
                passed = True
            except (ValueError, TypeError) as err:
                assert f"{name}=" in str(err), f"{label}({name}={value!r}): the message does not name it: {err}"
                passed = False
            else:
                passed = True
            assert not passed or value in MAY_PASS, f"{label}({name}={value!r}) got through unchecked"
    return tried


def reach(*args, **kwargs):
    raise Reached


def test_setup_reasoning_model(monkeypatch):
    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", reach)
    params = numeric_parameters(setup_reasoning_model)
    assert {"max_seq_length", "lora_rank", "lora_alpha", "seed"} <= {name for name, *_ in params}
    walk("setup_reasoning_model", lambda name, value: setup_reasoning_model(**{name: value}), params)


@pytest.mark.parametrize("func_name", ["evaluate", "sample_and_score"])
def test_evaluate_and_sample_and_score(monkeypatch, func_name):
    func = getattr(grpo_nb, func_name)
    module = inspect.getmodule(func)
    monkeypatch.setattr(module, "score_groups", reach)
    monkeypatch.setattr(module, "check_model_and_tokenizer", lambda *a: None)  # stand-in model and tokenizer
    if hasattr(module, "check_prompts"):  # what the stand-ins would render their prompts with
        monkeypatch.setattr(module, "check_prompts", lambda *a, **k: None)
    if hasattr(module, "auto_batch_size"):  # batch_size="auto" reads the stand-in model's memory
        monkeypatch.setattr(module, "auto_batch_size", lambda *a: 1)
    params = numeric_parameters(func)
    assert len(params) >= 4, params
    args = (None, None, [{"prompt": "w5 w6"}]) if func_name == "evaluate" else (None, None, ["w5"], [len])
    walk(func_name, lambda name, value: func(*args, **{name: value}), params)


def test_every_grpo_config_field():
    """train(**overrides) goes through GRPOConfig: its numeric fields are train()'s numeric arguments."""
    params = [(f.name, float if "float" in str(f.type) else int, "None" in str(f.type))
              for f in dataclasses.fields(GRPOConfig)
              if not isinstance(f.default, bool) and ("int" in str(f.type) or "float" in str(f.type))]
    assert len(params) >= 25, params
    walk("GRPOConfig", lambda name, value: GRPOConfig(**{name: value}), params)


def test_estimate_vram_and_plan_for_gpu():
    params = numeric_parameters(estimate_vram)
    assert len(params) == 10, params
    walk("estimate_vram", lambda name, value: estimate_vram(TINY_CONFIG, **{name: value}), params)
    # plan_for_gpu: its own numbers, and each candidate of the lists it tries
    walk("plan_for_gpu", lambda name, value: plan_for_gpu(**{name: value, "model_or_config": TINY_CONFIG}),
         numeric_parameters(plan_for_gpu) + [("gpu", float, False), ("num_generations", int, False),
                                             ("max_completion_length", int, False)])
    walk("plan_for_gpu", lambda name, value: plan_for_gpu("T4", TINY_CONFIG, **{name: [512, value]}),
         [("num_generations", int, False), ("max_completion_length", int, False)])
    with pytest.raises(ValueError, match=r"plan_for_gpu\(num_generations=\[\]\)"):
        plan_for_gpu("T4", TINY_CONFIG, num_generations=[])


def test_simulate_step(monkeypatch):
    """The same checks as estimate_vram's (memory.check_planner_arguments), before the simulation starts."""
    import grpo_nb.simulate.step as simulate_module
    from grpo_nb.simulate import simulate_step

    monkeypatch.setattr(simulate_module, "AllocationTracker", reach)  # where the simulation's work starts
    params = numeric_parameters(simulate_step)
    assert {"beta", "num_iterations", "tool_turns", "tool_result_tokens", "entropy_coef"} <= {name for name, *_ in params} \
        and len(params) == 13, params
    walk("simulate_step", lambda name, value: simulate_step(TINY_CONFIG, **{name: value}), params)


def test_widget_constructors(tmp_path):
    walk("LiveDashboard", lambda name, value: LiveDashboard(notebook=False, **{name: value}),
         numeric_parameters(LiveDashboard))
    walk("GrpoNbDashboardCallback", lambda name, value: GrpoNbDashboardCallback(live=True, **{name: value}),
         numeric_parameters(GrpoNbDashboardCallback))
    (tmp_path / "file.png").write_bytes(b"x")
    with pytest.raises(ValueError, match="png_dir=.*a file"):
        LiveDashboard(png_dir=tmp_path / "file.png")


# ------------------------------------------------------------------------------------ paths

@pytest.fixture(scope="module")
def tiny_lora():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    return get_peft_model(tiny_model(), LoraConfig(r=4, target_modules=["q_proj"])), prepare_tokenizer(tiny_tokenizer())


def test_save_merged_numbers(tiny_lora, tmp_path):
    model, tok = tiny_lora
    folders = iter(range(10**6))
    walk("save_merged", lambda name, value: save_merged(model, tmp_path / f"m{next(folders)}", **{name: value}),
         numeric_parameters(save_merged))
    with pytest.raises(ValueError, match=r"save_merged\(dtype='int8'\)"):
        save_merged(model, tmp_path / "m", dtype="int8")


@pytest.mark.parametrize("save", [save_adapter, save_merged], ids=["save_adapter", "save_merged"])
def test_save_paths(save, tiny_lora, tmp_path):
    model, tok = tiny_lora
    name = save.__name__
    (tmp_path / "a_file").write_bytes(b"x")
    (tmp_path / "someone_elses").mkdir()
    (tmp_path / "someone_elses" / "thesis.tex").write_text("years of work")
    for path, error, fragment in [
        (None, TypeError, "path=None"),
        (42, TypeError, "path=42"),
        ("", ValueError, "path=''"),
        (tmp_path / "a_file", ValueError, "this is a file"),
        (tmp_path / "a_file" / "below", PermissionError, "cannot write there"),  # (root may write anywhere else)
        (tmp_path / "someone_elses", ValueError, "holds other files (thesis.tex)"),
    ]:
        with pytest.raises(error, match=None) as err:
            save(model, path, tok)
        assert f"{name}(" in str(err.value) and fragment in str(err.value), err.value
    assert (tmp_path / "someone_elses" / "thesis.tex").read_text() == "years of work"
    with pytest.raises(TypeError, match=rf"{name}\(model=<TextGenerationPipeline>\) is a transformers pipeline.*pipe.model"):
        from transformers import pipeline

        save(pipeline("text-generation", model=model.get_base_model(), tokenizer=tok), tmp_path / "p")
    with pytest.raises(TypeError, match=rf"{name}\(tokenizer='str'\)"):
        save(model, tmp_path / "t", "HuggingFaceTB/SmolLM2-135M-Instruct")
    # a new folder, and the same one again (a save repeated, e.g. after more training), are accepted
    assert (save(model, tmp_path / "new" / "deep", tok) / "config.json").exists() or name == "save_adapter"
    save(model, tmp_path / "new" / "deep", tok)
    if os.geteuid() != 0:  # root writes to read-only folders anyway
        (tmp_path / "locked").mkdir(mode=0o500)
        with pytest.raises(PermissionError, match="cannot write there"):
            save(model, tmp_path / "locked" / "out", tok)


def test_load_for_inference_arguments(tiny_lora, tmp_path):
    model, tok = tiny_lora
    saved = save_merged(model, tmp_path / "merged", tok, dtype=torch.float32)
    (tmp_path / "a_file").write_bytes(b"x")
    for kwargs, error, fragment in [
        (dict(path=None), TypeError, "path=None"),
        (dict(path=tmp_path / "missing"), FileNotFoundError, "no such folder"),
        (dict(path=tmp_path / "a_file"), ValueError, "this is a file"),
        (dict(path=tmp_path), FileNotFoundError, "holds neither an adapter"),
        (dict(path=saved, device="gpu0"), ValueError, "device='gpu0'"),
        (dict(path=saved, dtype="int8"), ValueError, "dtype='int8'"),
        (dict(path=saved, base_model=3), TypeError, "base_model=3"),
    ]:
        with pytest.raises(error) as err:
            load_for_inference(**kwargs)
        assert "load_for_inference(" in str(err.value) and fragment in str(err.value), err.value
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            load_for_inference(saved, device="cuda")
    loaded, _ = load_for_inference(saved, device="cpu", dtype="float32")
    assert isinstance(loaded, torch.nn.Module)


def test_numpy_numbers_are_taken_as_the_numbers_they_hold():
    """np.int64 (np.arange, a DataFrame column) and np.float32 where a count or a number is expected: accepted,
    and handed back as Python's own numbers, which JSON files and random.Random take."""
    import numpy as np

    from grpo_nb.arguments import need_int, need_number

    n, x = need_int("f", "n", np.int64(3), 1), need_number("f", "x", np.float32(0.5), 0, 1)
    assert (n, x) == (3, 0.5) and type(n) is int and type(x) is float
    assert need_int("f", "n", None, 1, optional=True) is None
    for bad in (np.int64(0), np.float64(2.0), np.bool_(True)):
        with pytest.raises(ValueError, match=r"f\(n=.*\) is invalid: expected an integer >= 1"):
            need_int("f", "n", bad, 1)
    with pytest.raises(ValueError, match=r"f\(x=nan\) is invalid: expected a finite number"):
        need_number("f", "x", np.float32("nan"))
    assert estimate_vram(TINY_CONFIG, max_completion_length=np.int64(64)).settings["max_completion_length"] == 64
    assert plan_for_gpu(np.float32(15), TINY_CONFIG).gpu == plan_for_gpu(15, TINY_CONFIG).gpu == "15 GiB GPU"
    from grpo_nb.rollout import RolloutEngine  # sample_and_score's seed reaches torch's Generator through it

    assert type(RolloutEngine(max_completion_length=2, seed=np.int64(3)).seed) is int
