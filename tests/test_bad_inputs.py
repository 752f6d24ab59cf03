"""The catalog of bad inputs: each one fails with a message that names what is wrong and the fix.

Every case is one function registered with `@case(id, error, *fragments)`: it makes the
mistake, and the test asserts that `error` is raised (before any training unless the case
says otherwise) and that the message, notes included, holds every fragment. The table in
docs/bad_inputs.md lists the same ids; a test keeps the two in step.
"""

from __future__ import annotations

import errno
import os
import re
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
from datasets import Dataset, DatasetDict, IterableDataset

from grpo_nb.attachments import attachments
import grpo_nb.checkpointing as ckpt
import grpo_nb.run_lock as run_lock
from grpo_nb.run_lock import LOCK
import grpo_nb.trainer as trainer_mod
from grpo_nb import RewardFunctionError, setup_reasoning_model, train
from grpo_nb.models import prepare_tokenizer
from tiny_models import FAST, count_w7, dataset, lora_model, token_id_reward
from tiny_models import tiny_model, tiny_tokenizer

CATALOG: dict[str, tuple] = {}
DOC = Path(__file__).resolve().parents[1] / "docs" / "bad_inputs.md"


def case(case_id, error, *fragments):
    """Register a bad-input case; `error` None means the input is handled and training runs."""
    def register(make_mistake):
        assert case_id not in CATALOG, case_id
        CATALOG[case_id] = (make_mistake, error, fragments)
        return make_mistake
    return register


class Run:
    """train() on a tiny LoRA model with settings that would finish one step in a second."""

    def __init__(self, tmp_path, monkeypatch):
        self.tmp_path, self.monkeypatch = tmp_path, monkeypatch
        self.tok = prepare_tokenizer(tiny_tokenizer())

    def __call__(self, ds=None, rewards=count_w7, model=None, tok=None, **overrides):
        settings = {**FAST, "max_steps": 1, "verbose": False, "live": False, "output_dir": str(self.tmp_path / "run"),
                    **overrides}
        return train(model or lora_model(), tok or self.tok, dataset() if ds is None else ds, rewards, **settings)


# ----------------------------------------------------------------------------- datasets

@case("dataset-dict-of-splits", ValueError, "DatasetDict", "dataset['train']")
def _(run):
    run(DatasetDict({"train": dataset(), "test": dataset()}))


@case("dataset-streaming", ValueError, "IterableDataset", "streaming=True")
def _(run):
    run(IterableDataset.from_generator(lambda: iter([{"prompt": "w5"}])))


@case("dataset-dict-of-columns", ValueError, "dict of columns", "Dataset.from_dict")
def _(run):
    run({"prompt": ["w5", "w6"]})


@case("dataset-empty", ValueError, "dataset is empty")
def _(run):
    run(Dataset.from_dict({"prompt": []}))


@case("dataset-no-prompt-column", ValueError, "no 'prompt' column", "['question', 'answer']", "rename_column")
def _(run):
    run(dataset().rename_column("prompt", "question"))


@case("dataset-rows-differ", ValueError, "row 1 has keys ['prompt']", "['answer', 'prompt']", "same keys")
def _(run):
    run([{"prompt": "w5", "answer": "1"}, {"prompt": "w6"}])


@case("dataset-row-not-dict", ValueError, "row 1 is a str", "'prompt' key")
def _(run):
    run([{"prompt": "w5"}, "w6"])


@case("dataset-rows-are-tuples", ValueError, "row 0 is a tuple", "[{'prompt': p, 'answer': a} for p, a in rows]")
def _(run):
    run([("w5 w6", "1"), ("w7", "2")])


@case("dataset-generator", ValueError, "generator (an iterator)", "list(rows)")
def _(run):
    run({"prompt": p} for p in ("w5", "w6"))


@case("prompt-not-string", ValueError, "row 3", "got int", "dataset.map")
def _(run):
    run([{"prompt": "w5"}, {"prompt": "w6"}, {"prompt": "w7"}, {"prompt": 42}])


@case("prompt-empty", ValueError, "row 1: the prompt is empty", "dataset.filter")
def _(run):
    run([{"prompt": "w5"}, {"prompt": "   "}])


@case("prompt-no-tokens", ValueError, "row 1: its prompt '~~~' becomes no tokens", "dataset.filter")
def _(run):
    from tokenizers import normalizers

    tok = prepare_tokenizer(tiny_tokenizer())
    tok.backend_tokenizer.normalizer = normalizers.Replace("~", "")  # as some tokenizers drop control characters
    run([{"prompt": "w5"}, {"prompt": "~~~"}], tok=tok)


@case("message-empty-content", ValueError, "row 0: the prompt has a message that is empty", "dataset.filter")
def _(run):
    run([{"prompt": [{"role": "user", "content": ""}]}])


@case("message-content-parts", ValueError, "row 0: message", "a list of parts (the multimodal format)",
      "content as a string")
def _(run):
    run([{"prompt": [{"role": "user", "content": [{"type": "text", "text": "w5 w6"}]}]}])


@case("answer-none", ValueError, "row 1: its 'answer' is None", "row['answer'] is not None")
def _(run):
    run([{"prompt": "w5", "answer": "1"}, {"prompt": "w6", "answer": None}])


@case("message-unknown-role", ValueError, "row 1", "'robot'", "needs a 'role' in")
def _(run):
    chat = [{"role": "user", "content": "w5"}]
    run(Dataset.from_list([{"prompt": chat}, {"prompt": [{"role": "robot", "content": "hi"}]}]))


@case("prompts-mixed-text-and-chat", ValueError, "row 0", "row 1", "all one kind")
def _(run):
    run([{"prompt": "w5"}, {"prompt": [{"role": "user", "content": "w6"}]}])


@case("answer-blank", ValueError, "row 1: its 'answer' is '  ', a missing value", "str(row['answer']).strip() != ''")
def _(run):
    run([{"prompt": "w5", "answer": "1"}, {"prompt": "w6", "answer": "  "}])


@case("prompt-missing", ValueError, "row 1: its 'prompt' is None, a missing value", "row['prompt'] is not None")
def _(run):
    import pandas as pd

    run(pd.DataFrame({"prompt": ["w5", None], "answer": ["1", "2"]}))


@case("dataset-dataframe-mixed-types", ValueError, "column 'answer' mixes int (row 0), str (row 1), float (row 2)",
      "df['answer'] = df['answer'].astype(str)")
def _(run):
    import pandas as pd

    run(pd.DataFrame({"prompt": ["w5", "w6", "w7"], "answer": [1, "2", 3.5]}))


@case("gsm8k-empty-final-answer", ValueError, "row 1 has nothing after the '####'", "dataset.filter")
def _(run):
    from grpo_nb import format_gsm8k

    run(format_gsm8k(Dataset.from_dict({"question": ["q", "q2"], "answer": ["work\n#### 4", "work\n#### "]})))


@case("dataset-value-nested-too-deep", ValueError, "row 1: column 'meta' is nested more than 50 levels deep",
      "keep it as text")
def _(run):
    tree = 0
    for _ in range(500):  # a parse tree: each level a stack frame wherever the row is copied or saved
        tree = [tree]
    run([{"prompt": "w5", "meta": [0]}, {"prompt": "w6", "meta": tree}])


@case("dataset-value-refers-to-itself", ValueError, "row 0: column 'meta' refers to itself", "break the loop")
def _(run):
    node = {"name": "root", "children": []}
    node["children"].append({"name": "leaf", "parent": node})
    run([{"prompt": "w5", "meta": node}, {"prompt": "w6", "meta": {}}])


@case("answer-not-one-value", ValueError, "row 0: its 'answer' is a list (['5', 'five']), but the answer column "
      "holds one reference answer per row", "row['answer'][0]", "rename_column('answer', 'answers')")
def _(run):
    run([{"prompt": "w5", "answer": ["5", "five"]}, {"prompt": "w6", "answer": ["6", "six"]}])


# ----------------------------------------------------------------------------- tokenizer and context

@case("tokenizer-no-chat-template", ValueError, "no chat template", "prepare_tokenizer")
def _(run):
    tok = tiny_tokenizer()  # not prepared: no template
    run(Dataset.from_list([{"prompt": [{"role": "user", "content": "w5"}]}]), tok=tok)


@case("tokenizer-no-pad-token", ValueError, "no pad token", "tokenizer.pad_token = tokenizer.eos_token")
def _(run):
    tok = prepare_tokenizer(tiny_tokenizer())
    tok.pad_token = None
    run(tok=tok)


@case("tokenizer-no-eos-token", ValueError, "no EOS token", "tokenizer.eos_token")
def _(run):
    model = lora_model()
    model.generation_config.eos_token_id = None
    tok = prepare_tokenizer(tiny_tokenizer())
    tok.eos_token = None
    run(model=model, tok=tok)


@case("prompt-longer-than-context", UserWarning, "longer than max_prompt_length=250", "cut from the left",
      "last 250 tokens")  # max_prompt_length=None: the context (256) less max_completion_length (6)
def _(run):
    run([{"prompt": "w5"}, {"prompt": "w6"}, {"prompt": " ".join(["w7"] * 300)}], max_prompt_length=None)


@case("prompt-longer-than-max-prompt-length", UserWarning, "longer than max_prompt_length=16", "cut from the left",
      "last 16 tokens", "Raise max_prompt_length")
def _(run):
    run([{"prompt": " ".join(["w9"] * 40)}])


@case("completion-longer-than-context", ValueError, "max_completion_length=300", "max_seq_length 256",
      "Lower max_completion_length")
def _(run):
    run(max_completion_length=300, max_prompt_length=None)


@case("prompt-plus-completion-longer-than-context", ValueError, "16 + 250", "max_seq_length 256", "Lower one")
def _(run):
    run(max_completion_length=250)


# ----------------------------------------------------------------------------- reward functions

@case("reward-none-given", ValueError, "at least one reward function")
def _(run):
    run(rewards=[])


@case("reward-not-callable", ValueError, "'my_reward_model' is not callable", "f(prompts, completions")
def _(run):
    run(rewards=["my_reward_model"])


@case("reward-funcs-in-a-dict", TypeError, "is a dict", "pass a list of functions", "reward_weights=[...]")
def _(run):
    run(rewards={"count": count_w7})


@case("reward-needs-missing-column", ValueError, "'correct'", "['answer']", "solution", "rename_column")
def _(run):
    def correct(completions, answer, **kwargs):
        return [float(c == a) for c, a in zip(completions, answer)]
    run(dataset().rename_column("answer", "solution"), rewards=correct)


@case("reward-without-kwargs", ValueError, "'strict'", "'prompts'", "Add **kwargs")
def _(run):
    def strict(completions, answer):
        return [0.0] * len(completions)
    run(rewards=strict)


@case("reward-column-clash", ValueError, "['completions']", "clash", "rename_column")
def _(run):
    run(Dataset.from_dict({"prompt": ["w5"] * 4, "completions": ["x"] * 4}))


@case("reward-weights-wrong-length", ValueError, "reward_weights has 1 values but there are 2", "one weight per")
def _(run):
    run(rewards=[count_w7, count_w7], reward_weights=[1.0])


@case("reward-raises", RewardFunctionError, "'parse'", "ValueError", "sample 0", "completion is")
def _(run):
    def parse(completions, **kwargs):
        return [float(c) for c in completions]  # completions of a random model are not numbers
    run(rewards=parse)


@case("reward-hangs", RewardFunctionError, "'sandbox'", "reward_timeout=0.2", "stuck", "raise reward_timeout")
def _(run):
    release = threading.Event()

    def sandbox(completions, **kwargs):
        release.wait(30)
        return [0.0] * len(completions)
    try:
        run(rewards=sandbox, reward_timeout=0.2)
    finally:
        release.set()


@case("reward-returns-nan", RewardFunctionError, "'ratio'", "returned nan", "return None")
def _(run):
    def ratio(completions, **kwargs):
        return [0.0] * (len(completions) - 1) + [float("nan")]
    run(rewards=ratio)


@case("reward-returns-inf", RewardFunctionError, "'ratio'", "returned inf", "must be finite")
def _(run):
    def ratio(completions, **kwargs):
        return [float("inf")] * len(completions)
    run(rewards=ratio)


@case("reward-all-none", RewardFunctionError, "No completion got a reward in the last 2 step(s) (1 to 2)",
      "returned None for every completion", "return 0.0", "max_unscored_steps=2")
def _(run):
    with pytest.warns(UserWarning, match="got no score"):  # said at the first such step, which trains on (TRL's way)
        run(rewards=lambda completions, **kw: [None] * len(completions), max_steps=3, max_unscored_steps=2)


@case("mask-truncated-every-completion-cut", UserWarning, "Step 1: every completion hit max_completion_length=6",
      "mask_truncated_completions=True leaves cut completions out of the loss", "this step changes nothing (loss 0)",
      "Step 2: every completion", "set mask_truncated_completions=False")
def _(run):
    history = run(mask_truncated_completions=True, max_steps=2)  # a random tiny model ends nothing in 6 tokens
    assert [r["grad_norm"] for r in history] == [0.0, 0.0]  # said at each such step: each changes nothing


@case("dynamic-sampling-no-group-differs", UserWarning, "dynamic_sampling rolled out 2 times",
      "in no group did the rewards differ", "the step trains nothing, at 2 times a step's generation",
      "preview_rewards")
def _(run):
    def flat(completions, **kwargs):  # e.g. a reward that only checks the format, which every completion has
        return [1.0] * len(completions)
    history = run(rewards=flat, dynamic_sampling=True, dynamic_sampling_max_rounds=2)
    assert history[0]["sampling_rounds"] == 2


@case("reward-wrong-count", RewardFunctionError, "returned 1 values for 8 completions", "one reward per completion")
def _(run):
    run(rewards=lambda completions, **kw: [1.0])


@case("reward-returns-strings", RewardFunctionError, "'high'", "not a number", "Return a list of floats")
def _(run):
    run(rewards=lambda completions, **kw: ["high"] * len(completions))


@case("reward-returns-dict", RewardFunctionError, "returned dict", "Return a list of floats")
def _(run):
    run(rewards=lambda completions, **kw: {"score": 1.0})


@case("reward-returns-tensor-elsewhere", None)
def _(run):
    # Tensors are accepted wherever they live (a reward model on the GPU, grad attached):
    # they are detached and moved to the CPU. tests/test_rewards.py checks a CUDA one on a GPU.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    history = run(rewards=lambda completion_ids, **kw: torch.tensor(
        [float(len(ids)) for ids in completion_ids], dtype=torch.float64, device=device, requires_grad=True) * 2)
    assert len(history) == 1 and history[0]["reward"] > 0


# ----------------------------------------------------------------------------- config

@case("config-one-generation", ValueError, "num_generations=1", "at least 2 generations")
def _(run):
    run(num_generations=1)


@case("config-batch-not-divisible", ValueError, "not divisible by num_generations=4", "per_device_train_batch_size=4")
def _(run):
    run(per_device_train_batch_size=3, gradient_accumulation_steps=1)


@case("config-epsilon-not-positive", ValueError, "GRPOConfig.epsilon=0", "> 0")
def _(run):
    run(epsilon=0)


@case("config-beta-negative", ValueError, "GRPOConfig.beta=-0.1", ">= 0")
def _(run):
    run(beta=-0.1)


@case("config-loss-type-unknown", ValueError, "GRPOConfig.loss_type='ppo'", "allowed: ")
def _(run):
    run(loss_type="ppo")


@case("config-unknown-field", ValueError, "no field 'num_generation'", "num_generations")
def _(run):
    run(num_generation=8)


@case("config-kl-without-adapter", ValueError, "beta=0.04", "no adapter", "set beta=0")
def _(run):
    run(model=tiny_model("llama"), beta=0.04)


@case("config-generation-kwargs-owned", ValueError, "max_new_tokens", "use max_completion_length")
def _(run):
    run(generation_kwargs={"max_new_tokens": 99})


@case("config-generation-kwargs-typo", ValueError, "['temprature'] is not an argument of transformers' generate()",
      "did you mean 'temperature'?")
def _(run):
    run(generation_kwargs={"temprature": 0.5})


@case("config-generation-kwargs-greedy", ValueError, "greedy or beam search makes them all the same",
      "drop do_sample")
def _(run):
    run(generation_kwargs={"do_sample": False})


@case("config-generation-kwargs-eos", ValueError, "['eos_token_id'] are taken from the tokenizer",
      "model.generation_config.eos_token_id")
def _(run):
    run(generation_kwargs={"eos_token_id": 5})


@case("config-bool-as-text", ValueError, "GRPOConfig.mask_truncated_completions='False' is invalid",
      "expected True or False (a bool, not the text)")
def _(run):
    run(mask_truncated_completions="False")  # as read from YAML or a command line: any text is true


@case("config-max-grad-norm-zero", ValueError, "GRPOConfig.max_grad_norm=0 is invalid", "grpo-nb always clips",
      "what 0 or None mean in transformers and TRL", "max_grad_norm=1e9")
def _(run):
    run(max_grad_norm=0)  # transformers' (so a TRL config's) "no clipping"


@case("config-constant-with-warmup", ValueError, "GRPOConfig.lr_scheduler_type='constant_with_warmup' is invalid",
      "grpo-nb's 'constant' applies warmup_ratio, so use lr_scheduler_type='constant'")
def _(run):
    run(lr_scheduler_type="constant_with_warmup", warmup_ratio=0.1)  # transformers' name


@case("callbacks-not-a-list", TypeError, "train(callbacks=<built-in function print>)", "callbacks=[print]")
def _(run):
    run(callbacks=print)


@case("callbacks-trainer-callback", TypeError, "is a transformers TrainerCallback", "live=True")
def _(run):
    from transformers import TrainerCallback

    run(callbacks=[TrainerCallback()])


@case("live-is-the-class", TypeError, "train(live=<class", "an instance, not the class")
def _(run):
    from grpo_nb_widgets import LiveDashboard

    run(live=LiveDashboard)


def as_rank_zero_of_two(run):
    """train() believes it is rank 0 of 2 processes; the fsdp checks run before any collective."""
    run.monkeypatch.setattr(trainer_mod.distributed, "setup", lambda device: trainer_mod.distributed.World(0, 2))


@case("fsdp-4bit-model", ValueError, "fsdp=True cannot shard 4-bit", "without fsdp", "load_in_4bit=False")
def _(run):
    as_rank_zero_of_two(run)
    model = lora_model()
    next(p for p in model.parameters() if not p.requires_grad).quant_state = object()  # how bitsandbytes marks 4-bit
    run(model=model, fsdp=True)


@case("fsdp-with-vllm", ValueError, "fsdp=True does not work with vLLM", "fast_inference=False")
def _(run):
    as_rank_zero_of_two(run)
    model = lora_model()
    attachments(model).rollout = object()  # what setup_reasoning_model(fast_inference=True) attaches
    run(model=model, fsdp=True)


def _launcher_environment(run, **env):
    """The variables torchrun sets, as a shell or a notebook could have them left over (the others unset)."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GRPO_NB_DIST_TIMEOUT"):
        run.monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        run.monkeypatch.setenv(name, value)


@case("env-world-size-rank-out-of-range", ValueError, "WORLD_SIZE=2 in the environment makes grpo-nb train "
      "data-parallel, but RANK is '5'", "0 to 1", "To train in this one process, unset them", "torchrun")
def _(run):
    _launcher_environment(run, WORLD_SIZE="2", RANK="5", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    run()


@case("env-world-size-without-the-other-processes", RuntimeError, "Process 0 of WORLD_SIZE=2 could not join the "
      "process group at 127.0.0.1:", "waiting up to 1 s for the other 1 process", "unset them",
      "GRPO_NB_DIST_TIMEOUT=<seconds>")
def _(run):
    import socket

    with socket.socket() as free:  # a port nobody listens on
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    _launcher_environment(run, WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          GRPO_NB_DIST_TIMEOUT="1")
    run()


# ----------------------------------------------------------------------------- models

@case("model-unknown-offline", RuntimeError, "nobody/no-such-model", "local folder", "model_name=None")
def _(run):
    import huggingface_hub.constants

    run.monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run.monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    setup_reasoning_model("nobody/no-such-model")


@case("model-4bit-without-lora", ValueError, "load_in_4bit=True", "set lora_rank")
def _(run):
    setup_reasoning_model(load_in_4bit=True, lora_rank=None)


@case("model-is-a-pipeline", TypeError, "train(model=<TextGenerationPipeline>)", "pass pipe.model and pipe.tokenizer")
def _(run):
    from transformers import pipeline

    run(model=pipeline("text-generation", model=lora_model(), tokenizer=run.tok))


@case("model-is-a-name", TypeError, "train(model='HuggingFaceTB/SmolLM2-135M-Instruct') is a name",
      "setup_reasoning_model(")
def _(run):
    run(model="HuggingFaceTB/SmolLM2-135M-Instruct")


@case("model-without-lm-head", TypeError, "model=<LlamaModel>) has no language-model head", "AutoModelForCausalLM")
def _(run):
    from transformers import LlamaModel

    run(model=LlamaModel(tiny_model().config))


@case("tokenizer-of-another-model", ValueError, "has 600 tokens but the model's embedding has 512 rows",
      "Load both from the same name", "resize_token_embeddings")
def _(run):
    tok = prepare_tokenizer(tiny_tokenizer())
    tok.add_tokens([f"extra{i}" for i in range(600 - len(tok))])
    run(tok=tok)


@case("tokenizer-of-a-smaller-model", UserWarning, "train(tokenizer=...) has 300 tokens, and the model's embedding "
      "512 rows", "decode to no text", "the model's own name")
def _(run):  # before: trained without a word, the rewards scoring completions with most tokens dropped
    run(tok=prepare_tokenizer(tiny_tokenizer(300)))


@case("model-fp16-full-fine-tuning", ValueError, "trains float16 weights", "lora_rank=16", "dtype='float32'")
def _(run):
    model = tiny_model("llama").half()  # what dtype="auto" picks for full fine-tuning on a T4
    model.generation_config.eos_token_id = 2
    run(model=model)


@case("setup-from-an-adapter-folder", ValueError, "holds a LoRA adapter", "is_trainable=True",
      "load_for_inference(folder)", "save_merged()")
def _(run):
    folder = run.tmp_path / "trained"
    lora_model().save_pretrained(folder)  # what train() leaves in its output_dir
    setup_reasoning_model(folder)


@case("setup-target-module-typo", ValueError, "['vproj'] is not in it", "'v_proj'")
def _(run):
    setup_reasoning_model(target_modules=["q_proj", "vproj"], max_seq_length=64)


@case("prepare-for-training-twice", ValueError, "already carries a LoRA adapter", "a notebook cell run twice",
      "model.unload()")
def _(run):
    from grpo_nb.models import prepare_for_training

    prepared = prepare_for_training(tiny_model("llama"), max_seq_length=64, lora_rank=4)
    prepare_for_training(prepared, max_seq_length=64, lora_rank=4)  # the cell run again: a PeftModel in a PeftModel


@case("setup-cuda-without-a-gpu", ValueError, "setup_reasoning_model(device='cuda')", "no CUDA GPU")
def _(run):
    run.monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    setup_reasoning_model(device="cuda")


@case("evaluate-model-without-lm-head", TypeError, "evaluate(model=<LlamaModel>)", "AutoModelForCausalLM")
def _(run):
    from transformers import LlamaModel

    from grpo_nb import evaluate

    evaluate(LlamaModel(tiny_model().config), run.tok, dataset())


# ----------------------------------------------------------------------------- checkpoints and output_dir

def _trained_checkpoint(run) -> Path:
    run(max_steps=2, save_steps=2, output_dir=str(run.tmp_path / "done"))
    return run.tmp_path / "done" / "checkpoint-2"


@case("resume-nothing-to-resume", FileNotFoundError, "no checkpoint-<step> folder", "resume_from_checkpoint")
def _(run):
    run(resume_from_checkpoint=True)


@case("resume-foreign-folder", ValueError, "not a grpo-nb training checkpoint")
def _(run):
    foreign = run.tmp_path / "foreign"
    lora_model().save_pretrained(foreign)  # a plain adapter folder, no trainer state
    run(resume_from_checkpoint=foreign)


@case("resume-damaged-checkpoint", ValueError, "damaged", "trainer_state.json")
def _(run):
    good = _trained_checkpoint(run)
    (good / "trainer_state.json").write_bytes(b"half a file")
    run(max_steps=3, resume_from_checkpoint=good)


@case("resume-legacy-pickle", ValueError, "older grpo-nb", "can run any code", "convert_legacy_checkpoint")
def _(run):
    old = _trained_checkpoint(run)
    torch.save({"step": 2}, old / "trainer_state.pt")  # what grpo-nb wrote before 0.2
    (old / "trainer_state.json").unlink()
    run(max_steps=3, resume_from_checkpoint=old)


@case("output-dir-in-use", RuntimeError, "in use by another training run", "pass another output_dir")
def _(run):
    with run_lock.output_dir_lock(run.tmp_path / "run"):  # as another notebook's run would hold it
        run()


@case("resume-other-model", ValueError, "another model or LoRA setup")
def _(run):
    from peft import LoraConfig, get_peft_model

    good = _trained_checkpoint(run)
    other = get_peft_model(tiny_model("llama"), LoraConfig(r=8, target_modules=["q_proj"]))
    run(model=other, max_steps=3, resume_from_checkpoint=good)


@case("output-dir-not-writable", OSError, "output_dir=", "not a writable folder", "Pass another output_dir")
def _(run):
    blocker = run.tmp_path / "a_file"
    blocker.write_text("")
    run(output_dir=str(blocker / "run"))  # a folder under a file: unwritable even for root


@case("output-dir-holds-other-files", ValueError, "holds other files (README.md, notes.txt)", "a README.md stays",
      "pass a new folder")
def _(run):
    project = run.tmp_path / "project"
    project.mkdir()
    (project / "README.md").write_text("mine")
    (project / "notes.txt").write_text("mine")
    try:
        run(output_dir=str(project))  # e.g. output_dir="." in a project folder
    finally:
        assert (project / "README.md").read_text() == "mine"


@case("output-dir-holds-an-earlier-run", ValueError, "holds an earlier run's checkpoints (up to checkpoint-2)",
      "resume_from_checkpoint=True", "new output_dir")
def _(run):
    _trained_checkpoint(run)
    run(output_dir=str(run.tmp_path / "done"))  # the training cell run again


@case("output-dir-as-a-path", None)
def _(run):
    history = run(output_dir=run.tmp_path / "as_path")  # a pathlib.Path: saved at the end like a str
    assert len(history) == 1 and (run.tmp_path / "as_path" / "adapter_model.safetensors").exists()


@case("resume-with-another-dataset", ValueError, "at least", "this dataset has 2", "Resume with the same dataset")
def _(run):
    good = _trained_checkpoint(run)
    run(ds=dataset(2), max_steps=3, resume_from_checkpoint=good, output_dir=str(run.tmp_path / "done"))


@case("resume-with-changed-settings", UserWarning, "differ from the ones it was trained with",
      "learning_rate 0.001 -> 0.002", "follows the new schedule")
def _(run):
    good = _trained_checkpoint(run)
    run(max_steps=3, learning_rate=2e-3, resume_from_checkpoint=good, output_dir=str(run.tmp_path / "done"))


@case("disk-full-at-checkpoint", OSError, "No space left", "disk has room", "checkpoint-1")
def _(run):
    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    run.monkeypatch.setattr(ckpt, "write_state", full_disk)
    try:
        run(max_steps=2, save_steps=1)
    finally:
        out = run.tmp_path / "run"
        assert not ckpt.checkpoints(out) and not [p for p in out.iterdir() if p.name.startswith(".")]


@case("disk-full-at-final-save", OSError, "No space left", "training finished (1 steps)", "still in `model`",
      "grpo_nb_history")
def _(run):
    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    run.monkeypatch.setattr(ckpt, "_write_model_files", full_disk)
    run()


# ----------------------------------------------------------------------------- loss variants, rollout correction

@case("config-sapo-temperature-not-positive", ValueError, "GRPOConfig.sapo_temperature_neg=0", "> 0")
def _(run):
    run(loss_type="sapo", sapo_temperature_neg=0)


@case("config-cispo-cap-not-above-one", UserWarning, "epsilon_high=None falls back to epsilon=0.2",
      "set epsilon_high=5.0")
def _(run):
    run(loss_type="cispo")


@case("config-rollout-correction-mode-unknown", ValueError, "GRPOConfig.rollout_importance_sampling_mode='token'",
      "allowed: token_truncate, token_mask, sequence_truncate, sequence_mask")
def _(run):
    run(rollout_importance_sampling_mode="token")


@case("config-rollout-correction-bounds-crossed", ValueError, "rollout_importance_sampling_clip_min=3.0",
      "less than rollout_importance_sampling_clip_max=3.0")
def _(run):
    run(rollout_importance_sampling_clip_min=3.0)


@case("config-rollout-correction-truncate-unbounded", ValueError, "rollout_importance_sampling_clip_max=None",
      "clips the ratios, so set it or rollout_importance_sampling_clip_min")
def _(run):
    run(rollout_importance_sampling_correction=True, rollout_importance_sampling_mode="token_truncate",
        rollout_importance_sampling_clip_max=None)


@case("config-rollout-correction-mask-excludes-one", ValueError, "rollout_importance_sampling_clip_max=0.5 is below 1",
      "ratio 1 (the engine's log-probs agreeing with the trainer's", "every token would be dropped",
      "not a clip epsilon", "clip_max=3.0")
def _(run):
    run(rollout_importance_sampling_correction=True, rollout_importance_sampling_clip_max=0.5)  # read as an epsilon


@case("config-rollout-correction-truncate-excludes-one", UserWarning,
      "rollout_importance_sampling_clip_min=1.5 is above 1", "nearly every weight is clipped to 1.5",
      "scaling the whole update", "not a clip epsilon")
def _(run):
    run(rollout_importance_sampling_correction=True, rollout_importance_sampling_mode="token_truncate",
        rollout_importance_sampling_clip_min=1.5)


@case("config-vespo-sequence-correction", ValueError, "GRPOConfig.rollout_importance_sampling_mode='sequence_mask'",
      "loss_type='vespo'", "'token_truncate' or 'token_mask'")
def _(run):
    run(loss_type="vespo", rollout_importance_sampling_correction=True)


@case("config-luspo-token-level", UserWarning, "loss_type='luspo'", "Set importance_sampling_level='sequence'")
def _(run):
    run(loss_type="luspo")


@case("config-delta-not-positive", ValueError, "GRPOConfig.delta=0 is invalid: expected a finite number > 0, or None",
      "TRL recommends delta > 1 + epsilon_high = 1.2", "delta=4")
def _(run):  # TRL takes it, and its cap at 0 then zeroes every positive-advantage update
    run(delta=0)


@case("config-output-dir-none", ValueError, "GRPOConfig.output_dir=None is invalid", "set save_steps=0")
def _(run):  # before: the run trained for minutes, then failed writing its adapter to None
    run(output_dir=None)


@case("config-park-optimizer-state-text", ValueError, "GRPOConfig.park_optimizer_state='yes' is invalid",
      "True, False or 'auto'")
def _(run):
    run(park_optimizer_state="yes")


@case("config-prefix-sharing-auto", ValueError, "GRPOConfig.prefix_sharing='auto' is invalid", "True or False")
def _(run):  # prefix sharing decides for itself where it pays; the option only turns it off
    run(prefix_sharing="auto")


@case("config-entropy-coef-bounds-crossed", ValueError, "GRPOConfig.entropy_coef_min=0.5",
      "at most entropy_coef_max=0.1")
def _(run):
    run(use_adaptive_entropy=True, entropy_coef_min=0.5, entropy_coef_max=0.1)


@case("config-trl-name-and-ours", ValueError, "vllm_importance_sampling_mode=",
      "pass only rollout_importance_sampling_mode=")
def _(run):
    run(vllm_importance_sampling_mode="token_mask", rollout_importance_sampling_mode="token_mask")


@case("rollout-correction-without-logprobs", ValueError, "rollout_importance_sampling_correction=True",
      "HFGenerateRollout", "rollout='native'", "rollout_importance_sampling_correction=False")
def _(run):
    run(rollout="hf", rollout_importance_sampling_correction=True)


# ----------------------------------------------------------------------------- a user's rollout function (probe P22)

def _wrapping_rollout(name, change):
    """A user's rollout: the native engine's completions, after `change(model, batch)` (its mistake)."""
    from grpo_nb.rollout import RolloutEngine

    engine = RolloutEngine(max_completion_length=6, seed=0)

    def rollout(model, tokenizer, prompt_ids, prompt_mask, num_generations):
        out = engine(model, tokenizer, prompt_ids, prompt_mask, num_generations)
        change(model, out)
        return out

    rollout.__name__ = name
    return rollout


@case("rollout-leaves-other-adapter-active", UserWarning, "The rollout 'draft_rollout' left the model with peft "
      "adapter 'draft' active, where this run trains 'default'", "model.set_adapter('default')",
      "put the model back")
def _(run):
    from peft import LoraConfig

    model = lora_model()
    model.add_adapter("draft", LoraConfig(r=2, target_modules="all-linear"))  # e.g. a draft adapter to sample with
    model.set_adapter("default")
    before = {k: v.detach().clone() for k, v in model.named_parameters() if ".default." in k}
    run(model=model, max_steps=2, rewards=token_id_reward,
        rollout=_wrapping_rollout("draft_rollout", lambda m, out: m.set_adapter("draft")))
    # before: no optimizer weight got a gradient (grad_norm 0) and the final save wrote the untrained 'draft'
    assert any(not torch.equal(v, dict(model.named_parameters())[k]) for k, v in before.items())
    assert model.active_adapter == "default" and (run.tmp_path / "run" / "adapter_model.safetensors").exists()


@case("rollout-leaves-eval-mode", None)
def _(run):
    import grpo_nb.step as step_mod

    seen, logprobs = [], step_mod.completion_logprobs
    run.monkeypatch.setattr(step_mod, "completion_logprobs",
                            lambda model, *a, **k: seen.append(model.training) or logprobs(model, *a, **k))
    model = lora_model()
    run(model=model, rollout=_wrapping_rollout("eval_rollout", lambda m, out: m.eval()))
    # before: the loss ran in eval mode (gradient checkpointing and dropout silently off), and the model stayed so
    assert seen and all(seen) and model.training


@case("rollout-leaves-adapter-layers-disabled", UserWarning, "The rollout 'base_rollout' left the model with the "
      "adapter layers disabled", "with model.disable_adapter():", "enable_adapter_layers()")
def _(run):  # before: a raw "element 0 of tensors does not require grad" from the first backward
    run(rollout=_wrapping_rollout("base_rollout", lambda m, out: m.base_model.disable_adapter_layers()))


@case("rollout-leaves-grad-disabled", UserWarning, "The rollout 'nograd_rollout' left the model with grad mode off",
      "with torch.no_grad():")
def _(run):  # before: a raw "element 0 of tensors does not require grad" from the first backward
    try:
        run(rollout=_wrapping_rollout("nograd_rollout", lambda m, out: torch.set_grad_enabled(False)))
        assert torch.is_grad_enabled()
    finally:
        torch.set_grad_enabled(True)


@case("rollout-merges-the-adapter", UserWarning, "The rollout 'merge_rollout' left the model with the adapter "
      "merged into the weights", "model.unmerge_adapter() before returning")
def _(run):  # before: a raw "element 0 of tensors does not require grad" from the first backward
    model = lora_model()
    run(model=model, max_steps=2, rewards=token_id_reward,
        rollout=_wrapping_rollout("merge_rollout", lambda m, out: m.merge_adapter()))
    assert not any(getattr(m, "merged", False) for m in model.modules())


@case("rollout-merge-and-unload", ValueError, "The rollout 'unload_rollout' removed the model's LoRA layers",
      "merge_and_unload()", "unmerge_adapter() before returning")
def _(run):  # before: a raw "element 0 of tensors does not require grad" from the first backward
    run(rollout=_wrapping_rollout("unload_rollout", lambda m, out: m.merge_and_unload()))


@case("rollout-converts-the-model-dtype", ValueError, "The rollout 'half_rollout' converted", "from torch.float32",
      "to torch.float16", "model.half()", "torch.autocast")
def _(run):  # before: NonFiniteTrainingError after the update, blaming the learning rate; the model left in float16
    model = lora_model()
    inv_freq = {k: v.clone() for k, v in model.named_buffers()}
    try:
        run(model=model, rollout=_wrapping_rollout("half_rollout", lambda m, out: m.half()))
    finally:
        assert all(p.dtype == torch.float32 for p in model.parameters())
        # before (probe P26 F4): the weights were put back, the buffers (rotary inv_freq) left in float16
        assert all(torch.equal(v, dict(model.named_buffers())[k]) for k, v in inv_freq.items())


@case("rollout-converts-the-model-and-back", ValueError, "The rollout 'hf_rollout' replaced or changed in place",
      "keep their dtype and device", "model.half().float()", "torch.autocast", "load the model again")
def _(run):  # before (probe P26 F3): no word; every weight, the frozen base ones too, rounded to float16 for the run
    run(rollout=_wrapping_rollout("hf_rollout", lambda m, out: m.half().float()))


@case("rollout-stacks-adapters", UserWarning, "The rollout 'stack_rollout' left the model with peft adapters "
      "['default', 'draft'] active at once (stacked", "model.set_adapter('default') before returning")
def _(run):  # before (probe P26 F2): the loss trained through both adapters, the run saved one, without a word
    import grpo_nb.step as step_mod
    from peft import LoraConfig

    seen, logprobs = [], step_mod.completion_logprobs
    run.monkeypatch.setattr(step_mod, "completion_logprobs", lambda model, *a, **k: seen.append(sorted(
        {x for m in model.modules() if hasattr(m, "adapter_layer_names") for x in m.active_adapters}))
        or logprobs(model, *a, **k))
    model = lora_model()
    model.add_adapter("draft", LoraConfig(r=2, target_modules="all-linear"))
    model.set_adapter("default")
    run(model=model, max_steps=2,
        rollout=_wrapping_rollout("stack_rollout", lambda m, out: m.base_model.set_adapter(["default", "draft"])))
    assert seen and all(s == ["default"] for s in seen)

def _lora_b_nonzero(model, std=0.5):
    """A trained-looking adapter: peft starts lora_B at zero, where a merge adds nothing."""
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=std, generator=torch.Generator().manual_seed(0))
    return model


@case("rollout-writes-weights-through-data", ValueError, "The rollout 'noise_rollout' replaced or changed in place",
      "p.data.copy_(...)", "weight noise", "load the model again")
def _(run):  # before (probe P28 F1): no word, the run trained against noised weights (p.data has its own version)
    def noise(m, out):
        for p in m.parameters():
            p.data.add_(torch.randn_like(p) * 1e-3)  # weight-noise exploration, written through .data
    run(rollout=_wrapping_rollout("noise_rollout", noise))


@case("rollout-merges-and-unmerges-a-16-bit-base", ValueError, "The rollout 'sync_rollout' changed the values of 14 "
      "of the frozen weights the LoRA layers sit on", "torch.bfloat16", "merge_adapter() and unmerge_adapter()",
      "in 16 bits rounds them", "grpo_nb.save_merged()")
def _(run):  # before (probe P28 F2): no word, the bfloat16 base rounded by every merge + unmerge (TRL's vLLM sync)
    from peft import LoraConfig, get_peft_model

    base = tiny_model("llama").to(torch.bfloat16)
    base.generation_config.eos_token_id = 2
    model = _lora_b_nonzero(get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")))
    run(model=model, rollout=_wrapping_rollout("sync_rollout", lambda m, out: (m.merge_adapter(),
                                                                               m.unmerge_adapter())))


@case("rollout-merges-and-unmerges-float32", None)
def _(run):  # before (probe P28 F2): the safe merge (a new tensor per weight) refused as "a conversion and back"
    def sync(m, out):  # in float32 both round at the last bits only: let through, as a merge left is put back
        m.merge_adapter()
        m.unmerge_adapter()
        m.base_model.merge_adapter(safe_merge=True)
        m.base_model.unmerge_adapter()
    run(model=_lora_b_nonzero(lora_model()), max_steps=2, rollout=_wrapping_rollout("sync_rollout", sync))


@case("rollout-leaves-a-safe-merge", UserWarning, "The rollout 'safe_rollout' left the model with the adapter merged "
      "into the weights", "model.unmerge_adapter() before returning")
def _(run):  # before (probe P28 F2): refused as "a conversion and back ... load the model again"
    model = _lora_b_nonzero(lora_model())
    run(model=model, rollout=_wrapping_rollout("safe_rollout", lambda m, out: m.base_model.merge_adapter(
        safe_merge=True)))
    assert not any(getattr(m, "merged", False) for m in model.modules())


@case("rollout-resizes-the-embeddings", ValueError, "The rollout 'tool_rollout' resized 1 of the model's weights (e.g. "
      "base_model.model.model.embed_tokens.weight from [512, 64] to [513, 64]", "resize_token_embeddings()",
      "before train()")
def _(run):  # before (probe P28 F5): refused as "a conversion and back (model.half().float()) rounds every weight"
    tok = prepare_tokenizer(tiny_tokenizer())

    def grow(m, out):
        if len(tok) == 512:
            tok.add_tokens(["<tool>"])
            m.resize_token_embeddings(len(tok))
    run(tok=tok, rollout=_wrapping_rollout("tool_rollout", grow))


@case("rollout-scales-the-lora-layers", UserWarning, "The rollout 'weak_rollout' left the model with the LoRA scale "
      "changed in 14 layer(s)", "scaling['default'] 2.0 -> 0.0", "unscale_layer()")
def _(run):  # before (probe P28 F4): the loss ran at scale 0, grad_norm 0, the untrained adapter saved, no word
    model = lora_model()

    def weaker(m, out):  # sample with the adapter switched down, unscale_layer() forgotten
        for layer in m.modules():
            if hasattr(layer, "scale_layer") and hasattr(layer, "scaling"):
                layer.scale_layer(0.0)
    history = run(model=model, max_steps=2, rewards=token_id_reward, rollout=_wrapping_rollout("weak_rollout", weaker))
    assert all(r["grad_norm"] > 0 for r in history)
    assert all(m.scaling["default"] == 2.0 for m in model.modules() if hasattr(m, "scale_layer"))


@case("rollout-replaces-lora-dropout", UserWarning, "The rollout 'drop_rollout' left the model with the LoRA layers "
      "edited in 14 place(s)", "lora_dropout replaced", "Leave lora_A, lora_B, lora_dropout")
def _(run):  # before (probe P28 F4): the replaced dropout kept for the loss and after train(), no word
    model = lora_model()
    kept = {id(m): m.lora_dropout["default"] for m in model.modules() if hasattr(m, "lora_dropout")}

    def drop(m, out):
        for layer in m.modules():
            if hasattr(layer, "lora_dropout"):
                layer.lora_dropout["default"] = torch.nn.Dropout(0.9)
    run(model=model, rollout=_wrapping_rollout("drop_rollout", drop))
    assert all(m.lora_dropout["default"] is kept[id(m)] for m in model.modules() if hasattr(m, "lora_dropout"))


@case("rollout-edits-the-peft-config", UserWarning, "The rollout 'alpha_rollout' left the model with "
      "model.peft_config['default'] edited (lora_alpha 8 -> 64)", "the saved adapter would load as another model",
      "LoraConfig given to get_peft_model()")
def _(run):  # before (probe P28 F6): every save wrote lora_alpha 64 for layers that trained at 8/4
    model = lora_model()
    run(model=model, rollout=_wrapping_rollout("alpha_rollout", lambda m, out: setattr(
        m.peft_config["default"], "lora_alpha", 64)))
    assert model.peft_config["default"].lora_alpha == 8
    assert '"lora_alpha": 8' in (run.tmp_path / "run" / "adapter_config.json").read_text()


@case("rollout-turns-off-gradient-checkpointing", UserWarning, "The rollout 'fast_rollout' left the model with "
      "gradient checkpointing turned off", "checkpointing acts only in train mode")
def _(run):  # before (probe P28 F9): every later update ran without checkpointing (OOM on a GPU sized with it)
    model = lora_model()
    model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    run(model=model, rollout=_wrapping_rollout("fast_rollout", lambda m, out: m.get_base_model()
                                               .gradient_checkpointing_disable()))
    assert all(layer.gradient_checkpointing for layer in model.get_base_model().model.layers)


@case("rollout-sets-the-default-dtype", UserWarning, "The rollout 'f64_rollout' left the model with the default dtype "
      "set to torch.float64", "set it back before returning")
def _(run):  # before (probe P28 F4): float64 left as the default for the loss and the user's session
    try:
        run(rollout=_wrapping_rollout("f64_rollout", lambda m, out: torch.set_default_dtype(torch.float64)))
        assert torch.get_default_dtype() == torch.float32
    finally:
        torch.set_default_dtype(torch.float32)


@case("rollout-writes-a-row-of-a-weight", ValueError, "The rollout 'row_rollout' replaced or changed in place 1 of the "
      "model's weights (e.g. base_model.model.model.embed_tokens.weight)", "emb.weight.data[token_id]",
      "a token's embedding set", "load the model again")
def _(run):  # before (probe P30 F1): no word; row 5 of the frozen embedding moved for the run (8 of 512 rows sampled)
    run(max_steps=2, rollout=_wrapping_rollout("row_rollout", lambda m, out: m.get_input_embeddings().weight.data[5]
                                               .add_(1.0)))


@case("rollout-writes-one-value-of-a-16-bit-weight", ValueError, "The rollout 'elem_rollout' changed the values of "
      "1 of the frozen weights the LoRA layers sit on (e.g. base_model.model.model.layers.0.self_attn.q_proj.base_layer"
      ".weight, torch.bfloat16)", "p.data.copy_(...), changes them outright", "load the model again")
def _(run):  # before (probe P30 F1): no word; one value off the sampled grid moved for the run
    from peft import LoraConfig, get_peft_model

    base = tiny_model("llama").to(torch.bfloat16)
    base.generation_config.eos_token_id = 2
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    weight = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    run(model=model, rollout=_wrapping_rollout("elem_rollout", lambda m, out: weight.data[1, 1].add_(0.5)))


@case("rollout-merges-and-unmerges-a-trained-float32-adapter", None)
def _(run):  # the bytes of a few values change by float32 rounding (most of the sampled ones not): no write, allowed
    run(model=_lora_b_nonzero(lora_model(), std=1e-3), max_steps=2,
        rollout=_wrapping_rollout("sync_rollout", lambda m, out: (m.merge_adapter(), m.unmerge_adapter())))


@case("rollout-leaves-a-hook-on-a-layer", UserWarning, "The rollout 'probe_rollout' left the model with 1 hook(s) "
      "registered on its modules and not removed (e.g. a forward hook on base_model.model.model.layers.1)",
      "pile up one more at each rollout", "handle.remove() before returning")
def _(run):  # before (probe P30 F2): the hooks ran in every loss forward (a steering hook: the steered model trained)
    import grpo_nb.step as step_mod

    model = lora_model()
    layer = model.get_base_model().model.layers[1]
    seen, logprobs, kept = [], step_mod.completion_logprobs, []
    run.monkeypatch.setattr(step_mod, "completion_logprobs",
                            lambda model, *a, **k: seen.append(len(layer._forward_hooks)) or logprobs(model, *a, **k))

    def probe(m, out):  # hidden states for a probe's reward: a hook registered at each call, never removed
        m.get_base_model().model.layers[1].register_forward_hook(lambda mod, args, o: kept.append(o))
    run(model=model, max_steps=2, rollout=_wrapping_rollout("probe_rollout", probe))
    # before: one more hook per step, each keeping every later forward's outputs (and the loss's graph) alive
    assert seen and not any(seen) and not layer._forward_hooks and not kept


@case("qlora-on-the-cpu", None)
def _(run):  # bitsandbytes repacks 4-bit weights for the CPU's kernels in eval mode: not the rollout changing them
    from transformers import AutoModelForCausalLM

    from tiny_models import tiny_config

    folder = run.tmp_path / "tiny"
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    model, tok = setup_reasoning_model(folder, lora_rank=4, load_in_4bit=True, device="cpu", max_seq_length=64)
    hist = run(model=model, tok=tok, max_steps=2)
    assert len(hist) == 2


@case("rollout-reads-hidden-states", None)
def _(run):  # transformers puts output-capturing hooks of its own on at the first forward asked for hidden states
    model = lora_model()

    def hidden(m, out):
        with torch.no_grad():
            m(out.prompt_ids, attention_mask=out.prompt_mask, output_hidden_states=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(model=model, rollout=_wrapping_rollout("hidden_rollout", hidden))
    assert not [w for w in caught if "hook" in str(w.message)]
    assert any(m._forward_hooks for m in model.modules())  # kept: transformers would not put them on again


@case("rollout-replaces-a-trained-weight", UserWarning, "The rollout 'swap_rollout' left the model with 14 weight(s) "
      "replaced by new Parameter objects (e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
      "a replaced trained weight would never train", "put the original objects back")
def _(run):  # before (probe P30 F3): no word; the optimizer stepped the old objects, lora_A never trained
    model = lora_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_A" in n}

    def swap(m, out):  # e.g. a snapshot restored with load_state_dict(sd, assign=True)
        for layer in m.modules():
            if hasattr(layer, "lora_A") and "default" in layer.lora_A:
                lin = layer.lora_A["default"]
                lin.weight = torch.nn.Parameter(lin.weight.detach().clone())
    run(model=model, max_steps=2, rewards=token_id_reward, rollout=_wrapping_rollout("swap_rollout", swap))
    assert all(not torch.equal(v, dict(model.named_parameters())[n]) for n, v in before.items())


@case("rollout-replaces-a-trained-module", ValueError, "The rollout 'copy_rollout' took 1 of the model's trained "
      "weights out of it (e.g. base_model.model.lm_head.modules_to_save.default.weight: the Linear holding it replaced",
      "the optimizer steps the old weights", "load the model again")
def _(run):  # before (probe P30 F3): no word; the optimizer stepped the old head, the forward and the saves the new one
    import copy

    from peft import LoraConfig, get_peft_model

    base = tiny_model("llama")
    base.generation_config.eos_token_id = 2
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                            modules_to_save=["lm_head"]))

    def fresh_head(m, out):
        heads = m.base_model.model.lm_head.modules_to_save
        heads["default"] = copy.deepcopy(heads["default"])
    run(model=model, rollout=_wrapping_rollout("copy_rollout", fresh_head))


@case("rollout-scales-tensor-lora-scalings", UserWarning, "The rollout 'weak_rollout' left the model with the LoRA "
      "scale changed in 14 layer(s)", "scaling['default'] 2.0 -> 0.0", "unscale_layer()")
def _(run):  # before (probe P30 F6): scalings as tensors are scaled in place: unseen, grad_norm 0, nothing trained
    from peft.utils.hotswap import prepare_model_for_compiled_hotswap

    model = lora_model()
    prepare_model_for_compiled_hotswap(model, target_rank=4, config=model.peft_config)  # the scales become tensors

    def weaker(m, out):
        for layer in m.modules():
            if hasattr(layer, "scale_layer") and hasattr(layer, "scaling"):
                layer.scale_layer(0.0)
    history = run(model=model, max_steps=2, rewards=token_id_reward, rollout=_wrapping_rollout("weak_rollout", weaker))
    assert all(r["grad_norm"] > 0 for r in history)
    assert all(isinstance(m.scaling["default"], torch.Tensor) and float(m.scaling["default"]) == 2.0
               for m in model.modules() if hasattr(m, "scale_layer") and "default" in getattr(m, "scaling", {}))


@case("rollout-negates-a-row-of-a-weight", ValueError, "The rollout 'neg_rollout' replaced or changed in place 1 of "
      "the model's weights (e.g. base_model.model.model.embed_tokens.weight)", "load the model again")
def _(run):  # before (probe P32 F1): the sign flips cancelled in the byte sum wrapping at 32 bits, no word
    run(rollout=_wrapping_rollout("neg_rollout", lambda m, out: m.get_input_embeddings().weight.data[5].neg_()))


@case("rollout-swaps-two-rows-of-a-weight", ValueError, "The rollout 'swap_rollout' replaced or changed in place 1 of "
      "the model's weights (e.g. base_model.model.model.embed_tokens.weight)")
def _(run):  # before (probe P32 F1): a permutation keeps the float sums, passed as float32 rounding, no word
    def swap(m, out):
        d = m.get_input_embeddings().weight.data
        d[[5, 6]] = d[[6, 5]].clone()
    run(rollout=_wrapping_rollout("swap_rollout", swap))


@case("rollout-changes-trained-weights-then-fails", RuntimeError, "sampling failed",
      "The rollout 'noise_rollout' left the trained weights changed (14 weight(s) changed in place", "nothing was "
      "saved", "checkpoint-2, is the one to resume from")
def _(run):  # before (probe P32 F4): checkpoint-2 written of the noised adapter, announced as step 2's
    calls = []

    def noise(m, out):  # weight noise on, sample, and the sampling fails before the noise comes off
        calls.append(1)
        if len(calls) == 3:
            with torch.no_grad():
                for n, p in m.named_parameters():
                    if "lora_B" in n:
                        p.add_(0.5)
            raise RuntimeError("sampling failed")
    try:
        run(max_steps=3, save_steps=1, rewards=token_id_reward, rollout=_wrapping_rollout("noise_rollout", noise))
    finally:
        assert sorted(p.name for p in ckpt.checkpoints(run.tmp_path / "run")) == ["checkpoint-1", "checkpoint-2"]
        from safetensors.torch import load_file
        saved = load_file(str(run.tmp_path / "run" / "checkpoint-2" / "adapter_model.safetensors"))
        assert max(float(v.abs().max()) for k, v in saved.items() if "lora_B" in k) < 0.1  # step 2's, not noised


@case("rollout-rescales-rotary-frequencies", UserWarning, "The rollout 'rope_rollout' left the model with 1 buffer(s) "
      "changed (e.g. base_model.model.model.rotary_emb.inv_freq", "grpo-nb put their values back")
def _(run):  # before (probe P32 F2): the loss and every later rollout ran with the frequencies halved, no word
    model = lora_model()
    rotary = model.get_base_model().model.rotary_emb
    was = rotary.inv_freq.clone()
    run(model=model, rollout=_wrapping_rollout("rope_rollout", lambda m, out: rotary.inv_freq.mul_(0.5)))
    assert torch.equal(rotary.inv_freq, was)


@case("rollout-wraps-the-lm-head", UserWarning, "The rollout 'ban_rollout' left the model with 1 module(s) replaced "
      "(e.g. base_model.model.lm_head: a _BanToken where the model has a Linear", "put the original modules back")
def _(run):  # before (probe P32 F3): a raw AttributeError ('_BanToken' object has no attribute 'weight')
    model = lora_model()

    def ban(m, out):  # a token banned by a module wrapped around the head, left on the model
        base = m.get_base_model()
        base.lm_head = _BanToken(base.lm_head)
    run(model=model, rollout=_wrapping_rollout("ban_rollout", ban))
    assert isinstance(model.get_base_model().lm_head, torch.nn.Linear)


class _BanToken(torch.nn.Module):
    """A module around an lm_head that bans token 7 (no .weight of its own)."""

    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, x):
        logits = self.head(x)
        logits[..., 7] = float("-inf")
        return logits


@case("rollout-swaps-an-activation-and-settings", UserWarning, "The rollout 'act_rollout' left the model with 1 "
      "module(s) replaced (e.g. base_model.model.model.layers.0.mlp.act_fn: a ReLU", "1 module setting(s) changed "
      "(e.g. base_model.model.model.layers.0.input_layernorm.variance_epsilon 1e-06 -> 10.0)")
def _(run):  # before (probe P32 F2): the loss ran with ReLU and eps 10, the adapter saved for the original, no word
    model = lora_model()
    layer = model.get_base_model().model.layers[0]
    act = layer.mlp.act_fn

    def swap(m, out):
        layer.mlp.act_fn = torch.nn.ReLU()
        layer.input_layernorm.variance_epsilon = 10.0
    run(model=model, rollout=_wrapping_rollout("act_rollout", swap))
    assert layer.mlp.act_fn is act and layer.input_layernorm.variance_epsilon == 1e-6


@case("rollout-leaves-a-global-hook", UserWarning, "The rollout 'glob_rollout' left the model with 1 torch global "
      "hook(s) registered and not removed", "grpo-nb took them off")
def _(run):  # before (probe P32 F2): the steering hook acted in every forward of the loss and after train()
    import torch.nn.modules.module as mm

    before = set(mm._global_forward_hooks)
    run(rollout=_wrapping_rollout("glob_rollout", lambda m, out: mm.register_module_forward_hook(
        lambda mod, args, output: None)))
    assert set(mm._global_forward_hooks) == before


@case("rollout-parametrizes-a-weight", UserWarning, "The rollout 'par_rollout' left the model with the class or "
      "forward of 1 module(s) changed (e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.default",
      "took the parametrizations off")
def _(run):  # before (probe P32 F5): "put back", but the loss trained through the doubled weight, a stray key saved
    from torch.nn.utils import parametrize

    model = lora_model()
    lin = model.get_base_model().model.layers[0].self_attn.q_proj.lora_A["default"]
    weight = lin.weight

    class Double(torch.nn.Module):
        def forward(self, w):
            return w * 2

    def par(m, out):
        if not parametrize.is_parametrized(lin):
            parametrize.register_parametrization(lin, "weight", Double())
    run(model=model, rollout=_wrapping_rollout("par_rollout", par))
    assert not parametrize.is_parametrized(lin) and lin.weight is weight


@case("reward-writes-into-the-model", ValueError, "The reward function 'bad_reward' (run after grpo-nb's rollout "
      "engine) replaced or changed in place 1 of the model's weights")
def _(run):  # before (probe P32 F8): blamed on 'RolloutEngine', grpo-nb's own engine
    model = lora_model()

    def bad_reward(completions, **kwargs):  # (a write into a few values is seen only around a user's rollout)
        with torch.no_grad():
            model.get_input_embeddings().weight.data.mul_(1.5)
        return [float(i) for i in range(len(completions))]
    run(model=model, rewards=bad_reward)


@case("rollout-returns-inference-tensors", ValueError, "The rollout 'inference_rollout' returned inference tensors "
      "(prompt_ids, prompt_mask, completion_ids", "torch.inference_mode()", "torch.no_grad() instead")
def _(run):  # before (probe P28 F7): a raw "Inference tensors cannot be saved for backward" in the loss, after rewards
    from grpo_nb.rollout import RolloutEngine

    engine, scored = RolloutEngine(max_completion_length=6, seed=0), []

    def inference_rollout(model, tokenizer, prompt_ids, prompt_mask, num_generations):
        with torch.inference_mode():
            return engine(model, tokenizer, prompt_ids, prompt_mask, num_generations)
    try:
        run(rollout=inference_rollout, rewards=lambda completions, **kw: scored.append(1) or [0.0] * len(completions))
    finally:
        assert not scored  # refused before the rewards (a paid judge) run


@case("rollout-token-id-outside-vocabulary", ValueError, "The rollout 'oov_rollout' returned completion_ids holding "
      "id 512 in row 0 (token 0)", "its embedding has 512 rows: ids 0 to 511", "another tokenizer")
def _(run):  # before: a raw IndexError in the loss (on CUDA a device-side assert), after the rewards
    run(rollout=_wrapping_rollout("oov_rollout", lambda m, out: out.completion_ids.__setitem__((0, 0), 512)))


@case("rollout-token-id-negative", ValueError, "completion_ids holding id -1 in row 1", "0 in the completion_mask")
def _(run):  # before: a raw OverflowError decoding the completions for the rewards
    run(rollout=_wrapping_rollout("neg_rollout", lambda m, out: out.completion_ids.__setitem__((1, 0), -1)))


class _GeneratorStateRollout:
    """A ResumableRollout with a torch.Generator of its own, whose state_dict() returns the generator itself."""

    def __init__(self):
        from grpo_nb.rollout import RolloutEngine

        self.generator, self.engine = torch.Generator().manual_seed(0), RolloutEngine(max_completion_length=6, seed=0)
        self.calls = 0

    def __call__(self, model, tokenizer, prompt_ids, prompt_mask, num_generations):
        self.calls += 1
        return self.engine(model, tokenizer, prompt_ids, prompt_mask, num_generations)

    def state_dict(self):
        return {"gen": self.generator}  # forgot .get_state()

    def load_state_dict(self, state):
        self.generator.set_state(state["gen"])


@case("rollout-state-not-storable", TypeError, "The rollout '_GeneratorStateRollout' keeps a state that a checkpoint "
      "cannot store: its state_dict()['gen'] is a torch.Generator", "g.get_state()")
def _(run):  # before: found at the first checkpoint save (save_steps of work lost, nothing written)
    rollout = _GeneratorStateRollout()
    try:
        run(rollout=rollout, max_steps=3, save_steps=2)
    finally:
        assert rollout.calls == 0  # refused before the first rollout


class _SelfReferenceRollout(_GeneratorStateRollout):
    """A ResumableRollout whose state_dict() holds a reference to itself."""

    def state_dict(self):
        state = {"n": self.calls}
        state["me"] = state
        return state

    def load_state_dict(self, state):
        self.calls = state["n"]


@case("rollout-state-holds-itself", TypeError, "The rollout '_SelfReferenceRollout' keeps a state that a checkpoint "
      "cannot store: its state_dict()['me'] is the dict it lies in", "without cycles")
def _(run):  # before: a raw RecursionError
    run(rollout=_SelfReferenceRollout(), max_steps=2, save_steps=1)


class _NumpyStateRollout:
    """A ResumableRollout keeping a numpy generator's state under the keys "generator" and "seed"."""

    def __init__(self):
        import numpy as np

        from grpo_nb.rollout import RolloutEngine

        self.rng, self.engine = np.random.default_rng(0), RolloutEngine(max_completion_length=6, seed=0)

    def __call__(self, model, tokenizer, prompt_ids, prompt_mask, num_generations):
        self.rng.random()
        return self.engine(model, tokenizer, prompt_ids, prompt_mask, num_generations)

    def state_dict(self):
        return {"generator": self.rng.bit_generator.state, "seed": 0}

    def load_state_dict(self, state):
        self.rng.bit_generator.state = state["generator"]


@case("rollout-state-keys-like-the-engines", None)
def _(run):  # before: the resume refused as "damaged or foreign" (the native engine's schema applied to its state)
    run(rollout=_NumpyStateRollout(), rewards=token_id_reward, save_steps=1)
    resumed = _NumpyStateRollout()
    history = run(rollout=resumed, rewards=token_id_reward, max_steps=2, resume_from_checkpoint=True)
    assert [r["step"] for r in history] == [1, 2]


@case("rollout-mask-past-eos", UserWarning, "The rollout 'ignore_eos_rollout' returned a completion_mask that runs "
      "past the first EOS", "completion_mask_from_eos")
def _(run):  # e.g. vLLM with ignore_eos / min_tokens and a mask of all ones; before: trained on, without a word
    def past_eos(model, out):
        out.completion_ids[:, 2] = run.tok.eos_token_id
        out.completion_mask[:] = 1

    run(rollout=_wrapping_rollout("ignore_eos_rollout", past_eos))


@case("rollout-logprobs-integer", ValueError, "The rollout 'zeros_rollout' returned sampling_logprobs of dtype "
      "torch.int64", "(floats)")
def _(run):  # before: every token "log p = 0": with the correction each weighed ~4e-10, the step learned nothing
    run(rollout=_wrapping_rollout("zeros_rollout", lambda m, out: setattr(
        out, "sampling_logprobs", torch.zeros_like(out.completion_ids))), rollout_importance_sampling_correction=True)


@case("rollout-protocol-attribute-not-method", TypeError, "The rollout '_AttributeRollout' has returns_logprobs = "
      "True, not a method", "def returns_logprobs(self) -> bool")
def _(run):  # before: "'bool' object is not callable" after the first rollout
    run(rollout=_AttributeRollout())


class _AttributeRollout:
    returns_logprobs = True  # the ReportsLogprobs protocol wants a method

    def __call__(self, model, tokenizer, prompt_ids, prompt_mask, num_generations):
        from grpo_nb.rollout import RolloutEngine

        return RolloutEngine(max_completion_length=6, seed=0)(model, tokenizer, prompt_ids, prompt_mask, num_generations)


@case("rollout-async-def", ValueError, "The rollout 'async_rollout' returned a coroutine", "make it a plain def")
def _(run):
    async def async_rollout(model, tokenizer, prompt_ids, prompt_mask, num_generations):
        raise AssertionError("never awaited")

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # "coroutine ... was never awaited": closed, not left
        run(rollout=async_rollout)


@case("resume-with-another-rollout", UserWarning, "checkpoint-1 was sampled with a rollout that keeps its random "
      "state in the checkpoint", "'plain_rollout'", "Pass the rollout= the run was trained with")
def _(run):  # before: resumed without a word, the native engine's saved random state dropped
    run(rollout="native", save_steps=1)
    run(rollout=_wrapping_rollout("plain_rollout", lambda m, out: None), max_steps=2, resume_from_checkpoint=True)


# ----------------------------------------------------------------------------- tracking: report_to, log_completions_path

@case("report-to-unknown", ValueError, "GRPOConfig.report_to='tensorbord' is invalid", "Did you mean 'tensorboard'?")
def _(run):
    run(report_to="tensorbord")


@case("report-to-not-installed", ImportError, "report_to='wandb' needs the wandb package", "pip install wandb")
def _(run):
    run.monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    run(report_to="wandb")


@case("report-to-installed-but-broken", ImportError, "report_to='trackio' needs the trackio package, which is "
      "installed but failed to import", "No module named 'nonexistent_dependency_xyz'", "Repair the install")
def _(run):  # before: "which is not installed ... pip install trackio", which answers "already satisfied"
    (run.tmp_path / "stub").mkdir()
    (run.tmp_path / "stub" / "trackio.py").write_text("import nonexistent_dependency_xyz\n")  # a broken install
    run.monkeypatch.delitem(sys.modules, "trackio", raising=False)
    run.monkeypatch.syspath_prepend(str(run.tmp_path / "stub"))
    run(report_to="trackio")


@case("report-to-tracker-fails-to-start", RuntimeError, "GRPOConfig.report_to='trackio': trackio could not start its "
      "run (RuntimeError: space not found)", "Fix the service's settings", "leave 'trackio' out of report_to")
def _(run):  # a TRACKIO_SPACE_ID that does not exist, wandb.init without network: before, the raw error alone
    from types import SimpleNamespace

    def init(**kwargs):
        raise RuntimeError("space not found")

    run.monkeypatch.setitem(sys.modules, "trackio", SimpleNamespace(init=init))
    try:
        run(report_to=["tensorboard", "trackio"])
    finally:  # the TensorBoard run started before it is removed again: no stray run holding only the config
        runs = run.tmp_path / "run" / "runs"
        assert not runs.exists() or not list(runs.iterdir()), list(runs.iterdir())


@case("log-completions-path-is-a-folder", ValueError, "GRPOConfig.log_completions_path=", "this is a folder")
def _(run):
    run(log_completions_path=run.tmp_path)


@case("log-completions-path-unwritable", OSError, "GRPOConfig.log_completions_path=", "cannot be written",
      "a folder you can write to")
def _(run):
    (run.tmp_path / "a_file").write_text("")
    run(log_completions_path=run.tmp_path / "a_file" / "completions.jsonl")  # under a file: unwritable even for root



# ----------------------------------------------------------------------------- optimizers and TRL configs

@case("optim-unknown", ValueError, "GRPOConfig.optim='adam_8bit' is invalid", "allowed: adamw_torch")
def _(run):
    run(optim="adam_8bit")


@case("optim-without-bitsandbytes", ImportError, "optim='paged_adamw_8bit' needs bitsandbytes",
      "pip install bitsandbytes", "optim='adamw_torch'")
def _(run):
    run.monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed
    run(optim="paged_adamw_8bit")


@case("trl-config-without-counterpart", ValueError, "no counterpart for shuffle_dataset=False",
      "Leave them at TRL's defaults")
def _(run):
    import trl

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = trl.GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, max_steps=1, shuffle_dataset=False)
    run(config=theirs)


@case("trl-config-resume-from-checkpoint", ValueError, "grpo-nb takes these elsewhere than in its config: "
      "resume_from_checkpoint='/x/checkpoint-5' (pass it to train(..., resume_from_checkpoint=...)")
def _(run):
    import trl

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = trl.GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, max_steps=1,
                                resume_from_checkpoint="/x/checkpoint-5")  # as a TRL script's argument parser fills it
    run(config=theirs)


# ----------------------------------------------------------------------------- hardware, text from ids, dataset values, planner arguments (issue 25)

@case("dtype-bf16-on-pre-ampere-gpu", UserWarning, "dtype='bfloat16' on Tesla T4 (compute capability 7.5)",
      "no native bfloat16", "math kernel", "Use dtype='float16'")
def _(run):
    import transformers
    from test_hardware_and_text import fake_gpu

    class Loading(Exception):
        pass

    fake_gpu(run.monkeypatch, "Tesla T4", (7, 5))
    run.monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: (_ for _ in ()).throw(
        Loading()))  # the warning comes before anything loads; stop there
    with pytest.raises(Loading):
        setup_reasoning_model("Qwen/Qwen2.5-1.5B-Instruct", dtype="bfloat16", device="cuda")


@case("dataset-answer-nan", ValueError, "row 1: its 'answer' is nan, a missing value",
      "row['answer'] == row['answer']")
def _(run):
    import pandas as pd

    frame = pd.DataFrame({"prompt": ["w5", "w6"], "answer": [1.0, None]})  # an empty cell: NaN
    run(frame.to_dict("records"))


@case("prompt-lone-surrogate", ValueError, "row 1: its prompt holds a lone surrogate '\\ud800' at character 3",
      "the tokenizer cannot encode it", "text.encode('utf-8', 'replace').decode()")
def _(run):
    run([{"prompt": "w5 w6"}, {"prompt": "w5 \ud800 w6"}])


@case("message-lone-surrogate", ValueError, "row 0: message 1 (user) of its prompt holds a lone surrogate",
      "text.encode('utf-8', 'replace').decode()")
def _(run):
    run([{"prompt": [{"role": "system", "content": "w4"}, {"role": "user", "content": "w5 \udc80"}]}])


_PLANNER_CONFIG = dict(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)


@case("planner-config-dict-partial", ValueError, "plan_for_gpu: the config dict has no vocab_size, intermediate_size",
      "transformers would fill them with its defaults for 'llama'", "AutoConfig.from_pretrained(name)")
def _(run):
    from grpo_nb import plan_for_gpu

    plan_for_gpu("T4", {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16,
                        "num_attention_heads": 32})


@case("planner-config-dict-bad-size", ValueError, "estimate_vram: the config's hidden_size=0 is invalid",
      "an integer >= 1")
def _(run):
    from grpo_nb import estimate_vram

    estimate_vram({**_PLANNER_CONFIG, "hidden_size": 0})


@case("planner-config-heads-do-not-divide", ValueError, "the config's num_key_value_heads=3 does not divide its "
      "num_attention_heads=4")
def _(run):
    from grpo_nb import estimate_vram

    estimate_vram({**_PLANNER_CONFIG, "num_key_value_heads": 3})


@case("simulate-step-zero-batch", ValueError, "simulate_step(per_device_train_batch_size=0) is invalid",
      "an integer >= 1 or None")
def _(run):
    from grpo_nb.simulate import simulate_step

    simulate_step(_PLANNER_CONFIG, per_device_train_batch_size=0)


@case("simulate-step-batch-not-dividing", ValueError, "simulate_step(per_device_train_batch_size=3) is invalid",
      "a divisor of the 8 completions per step")
def _(run):
    from grpo_nb.simulate import simulate_step

    simulate_step(_PLANNER_CONFIG, num_generations=8, per_device_train_batch_size=3)


@case("simulate-step-trl-rollout-max-rows", ValueError, "simulate_step(rollout_max_rows=2) is invalid",
      "None with system='trl': TRL has no such setting", "system='grpo_nb'")
def _(run):
    from grpo_nb.simulate import simulate_step

    simulate_step(_PLANNER_CONFIG, system="trl", rollout_max_rows=2)  # TRL's full-width rollout, not 2 rows


@case("simulate-step-trl-entropy-coef", ValueError, "simulate_step(entropy_coef=0.01) is invalid",
      "0 with system='trl'", "without the entropy bonus")
def _(run):
    from grpo_nb.simulate import simulate_step

    simulate_step(_PLANNER_CONFIG, system="trl", entropy_coef=0.01)


@case("simulate-step-tool-turns-over-completion-length", ValueError, "simulate_step(tool_turns=13) is invalid",
      "at most max_completion_length=12", "every turn samples at least one token")
def _(run):
    from grpo_nb.simulate import simulate_step

    simulate_step(_PLANNER_CONFIG, tool_turns=13, max_completion_length=12)  # not blamed on tool_result_tokens=0


@case("simulate-step-tool-result-tokens-with-one-turn", ValueError, "simulate_step(tool_result_tokens=500) is invalid",
      "0 with tool_turns=1", "tool_turns=2")
def _(run):
    from grpo_nb.simulate import simulate_step

    simulate_step(_PLANNER_CONFIG, tool_result_tokens=500)  # one turn has no result: it would be ignored


@case("planner-beyond-context", ValueError, "estimate_vram(max_prompt_length=256, max_completion_length=8192) is "
      "invalid", "beyond the model's context window of 2048", "max_completion_length to 1792 or less")
def _(run):
    from grpo_nb import estimate_vram

    estimate_vram({**_PLANNER_CONFIG, "max_position_embeddings": 2048}, max_completion_length=8192)


@case("planner-card-too-small", ValueError, "plan_for_gpu(gpu=0.5) is invalid", "CUDA context")
def _(run):
    from grpo_nb import plan_for_gpu

    plan_for_gpu(0.5, _PLANNER_CONFIG)


@case("planner-fp16-full-fine-tuning", ValueError, "plan_for_gpu(dtype='fp16') is invalid",
      "with lora_rank=None", "float16 weights cannot hold the small updates")
def _(run):
    from grpo_nb import plan_for_gpu

    plan_for_gpu("T4", _PLANNER_CONFIG, lora_rank=None, load_in_4bit=False, dtype="fp16")


@case("setup-fp16-full-fine-tuning", ValueError, "setup_reasoning_model(dtype='float16') is invalid",
      "with lora_rank=None", "dtype='auto' picks it")
def _(run):
    setup_reasoning_model(lora_rank=None, dtype="float16", device="cpu")  # refused before anything loads


@case("generation-kwargs-sampling-knob", ValueError, "set GRPOConfig.temperature=0.3",
      "the log-probs must use the sampling settings")
def _(run):
    run(generation_kwargs={"temperature": 0.3})


@case("generation-kwargs-key-not-text", ValueError, "GRPOConfig.generation_kwargs={1: 2} is invalid",
      "got the key 1 (int)")
def _(run):
    run(generation_kwargs={1: 2})


@case("generation-kwargs-processor-not-callable", ValueError,
      "generation_kwargs['logits_processor'] must be a list of LogitsProcessor objects (callables)")
def _(run):
    run(generation_kwargs={"logits_processor": [object()]})


@case("adam-beta-one", ValueError, "GRPOConfig.adam_beta2=1.0 is invalid", "< 1")
def _(run):
    run(adam_beta2=1.0)


@case("trl-keyword-bf16", ValueError, "GRPOConfig has no field 'bf16': the model's dtype decides")
def _(run):
    run(bf16=True)


@case("settings-as-numpy-numbers", None)
def _(run):
    import json

    import numpy as np

    run(num_generations=np.int64(4), learning_rate=np.float32(1e-3), generation_kwargs={"min_new_tokens": np.int64(2)})
    saved = json.loads((run.tmp_path / "run" / "grpo_config.json").read_text())
    assert saved["num_generations"] == 4 and saved["generation_kwargs"] == {"min_new_tokens": 2}


@case("chat-prompt-assistant-prefill", None)
def _(run):
    from grpo_nb.rollout import prompt_texts

    run.tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    prompt = [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "<reasoning>\n"}]
    assert prompt_texts(run.tok, [prompt]) == ["<|im_start|>user\nw5 w6<|im_end|>\n<|im_start|>assistant\n<reasoning>\n"]
    # grpo-nb's format rewards read the answer behind the prefill: the right continuation is the well-formed one
    from grpo_nb.rewards import STARTER_REWARDS

    right, doubled = "I add.\n</reasoning>\n<answer>\n7\n</answer>\n", "<reasoning>\nI add.\n</reasoning>\n<answer>\n7\n</answer>\n"
    completions = [[{"role": "assistant", "content": c}] for c in (right, doubled)]
    totals = [sum(values) for values in zip(*(f(completions=completions, prompts=[prompt] * 2, answer=["7"] * 2)
                                              for f in STARTER_REWARDS))]
    assert totals[0] == 4.0 and totals[1] < totals[0]


@case("generation-config-sampling-processors", None)
def _(run):
    model, seen = lora_model(), []
    model.generation_config.bad_words_ids = [[i] for i in range(3, 512)]  # all but <pad>, <s>, </s>
    model.generation_config.no_repeat_ngram_size = 1

    def spy(completion_ids, **kwargs):
        seen.extend(i for ids in completion_ids for i in ids)
        return [0.0] * len(completion_ids)

    run(rollout="hf", model=model, rewards=spy)
    assert any(i >= 3 for i in seen), "sampled under the model folder's bad_words_ids"


@case("generation-config-eos-not-a-token-id", ValueError,
      "model.generation_config.eos_token_id='2' is not a token id", "generation_config.json",
      "model.generation_config.eos_token_id = 2")
def _(run):
    model = lora_model()
    model.generation_config.eos_token_id = "2"
    run(model=model)


_CHAT = [{"prompt": [{"role": "user", "content": "w5 w6"}]}] * 2
_CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _chatml_tokenizer():
    """The tiny tokenizer with ChatML's two special tokens, in the model's 512 rows."""
    tok = prepare_tokenizer(tiny_tokenizer(510))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = _CHATML
    return tok


class _SetUp(Exception):
    """Raised where training would start: the checks before it have run."""


def _until_set_up(run):
    run.monkeypatch.setattr(trainer_mod, "set_up", lambda *a, **k: (_ for _ in ()).throw(_SetUp()))


@case("chat-template-drops-content", ValueError, "the chat template drops the messages' content",
      "dataset row 0's message 0 (user: 'w5 w6') is not in what the model would be asked",
      "never reads 'content' (it reads ['from', 'value'])")
def _(run):
    run.tok.chat_template = _CHATML.replace("m['role']", "m['from']").replace("m['content']", "m['value']")
    run(_CHAT)


@case("chat-template-raises", ValueError, "Dataset row 0: the tokenizer's chat template failed on its messages",
      "System role not supported", "merge the system message into the first user message")
def _(run):
    run.tok.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
                             "supported') }}{% endif %}" + _CHATML)
    run([{"prompt": [{"role": "system", "content": "w4"}, {"role": "user", "content": "w5"}]}] * 2)


@case("chat-template-opens-no-assistant-turn", UserWarning, "the chat template opens no assistant turn",
      "add_generation_prompt=True adds nothing", "continues the user's turn")
def _(run):
    run.tok.chat_template = _CHATML.split("{% if add_generation_prompt")[0]
    _until_set_up(run)
    with pytest.raises(_SetUp):
        run(_CHAT)


@case("chat-template-special-token-split", ValueError, "special token '<|im_start|>' (id 510) reaches the model as 3 "
      "tokens", "split_special_tokens=True", "tokenizer.split_special_tokens = False")
def _(run):
    tok = _chatml_tokenizer()
    tok.split_special_tokens = True
    run(_CHAT, tok=tok)


@case("chat-template-end-of-turn-not-eos", UserWarning, "ends the assistant's turn with '<|im_end|>' (id 511), "
      "which is not an EOS id [2]", "model.generation_config.eos_token_id = [2, 511]")
def _(run):
    _until_set_up(run)
    with pytest.raises(_SetUp):
        run(_CHAT, tok=_chatml_tokenizer())


@case("chat-template-loops", UserWarning, "has been rendering dataset row 0 for", "Ctrl-C",
      "fix tokenizer.chat_template")
def _(run):
    import grpo_nb.checks as checks

    run.monkeypatch.setattr(checks, "TEMPLATE_NOTICE_SECONDS", 0.02)
    run.tok.chat_template = ("{% if add_generation_prompt %}{% for i in range(1500) %}{% for j in range(1000) %}"
                             "{% if i < 0 %}x{% endif %}{% endfor %}{% endfor %}{% endif %}" + _CHATML)
    _until_set_up(run)
    with pytest.raises(_SetUp):
        run(_CHAT[:1])


@case("tokenizer-of-another-family", ValueError, "is not this model's tokenizer",
      "the model ends text with id(s) [5]", "(5 is 'w5')", "the tokenizer's EOS '</s>' (id 2)")
def _(run):
    model = lora_model()  # a model of another family, whose end of text is id 5
    model.config.eos_token_id = model.generation_config.eos_token_id = 5
    run(model=model)


def _tiny_folder(run, tokenizer=True):
    folder = run.tmp_path / "model"
    tiny_model("llama").save_pretrained(folder)
    if tokenizer:
        run.tok.save_pretrained(folder)
    return folder


@case("model-folder-without-tokenizer", ValueError, "the folder holds a model but no tokenizer files",
      "tokenizer.save_pretrained(folder)")
def _(run):
    setup_reasoning_model(_tiny_folder(run, tokenizer=False), lora_rank=4, device="cpu")


@case("max-seq-length-beyond-context-window", UserWarning, "setup_reasoning_model(max_seq_length=1024) is beyond "
      "the model's context window of 256 tokens", "max_position_embeddings 256", "the run uses 256")
def _(run):
    model, _ = setup_reasoning_model(_tiny_folder(run), max_seq_length=1024, lora_rank=4, device="cpu")
    assert attachments(model).max_seq_length == 256  # train() then refuses what does not fit


@case("evaluate-beyond-context", ValueError, "evaluate(max_completion_length=300) leaves no room for a prompt",
      "max_seq_length 256")
def _(run):
    from grpo_nb import evaluate

    evaluate(lora_model(), run.tok, dataset(2), max_completion_length=300)


@case("planner-folder-custom-code", ValueError, "needs custom code (its config.json's auto_map, model_type='customnet')",
      "the planner does not run a folder's code", "Pass a config dict of its sizes")
def _(run):
    import json

    from grpo_nb import estimate_vram

    run.monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("the planner asked whether to run custom code"))
    folder = run.tmp_path / "custom"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**_PLANNER_CONFIG, "model_type": "customnet",
                                                    "auto_map": {"AutoConfig": "custom_config.CustomConfig"}}))
    estimate_vram(str(folder))


@case("planner-config-rope", ValueError, "the config's rope_parameters",
      "has rope_type='nonexistent', which this transformers does not know", "'linear'")
def _(run):
    from grpo_nb import estimate_vram

    estimate_vram({**_PLANNER_CONFIG, "rope_scaling": {"rope_type": "nonexistent", "factor": 2.0}})


@case("planner-config-sliding-window-zero", ValueError, "simulate_step: the config's sliding_window=0 is invalid",
      "an integer >= 1", "or None for full attention")
def _(run):
    from grpo_nb.simulate import simulate_step

    simulate_step({**_PLANNER_CONFIG, "model_type": "mistral", "sliding_window": 0}, max_completion_length=16)


@case("planner-config-beyond-any-model", ValueError, "plan_for_gpu: the config's num_hidden_layers=100000 is invalid",
      "expected at most 1,000, beyond any real model")
def _(run):
    from grpo_nb import plan_for_gpu

    plan_for_gpu("T4", {**_PLANNER_CONFIG, "num_hidden_layers": 100_000})


@case("gguf-header-value-out-of-range", ValueError,
      "save_gguf(): the model's config.max_position_embeddings=1099511627776 does not fit a GGUF header",
      "an integer from 1 to 4294967295 (uint32)")
def _(run):
    from grpo_nb import save_gguf
    from test_gguf import bpe_tokenizer

    model = tiny_model("llama")
    model.config.max_position_embeddings = 2**40
    save_gguf(model, run.tmp_path / "model.gguf", bpe_tokenizer())


@case("chat-template-drops-a-later-rows-role", ValueError,
      "the chat template drops the messages' content: dataset row 1's message 0 (system: 'w4 w5')",
      "A template without a system role leaves it out: merge it into the first user message")
def _(run):
    run.tok.chat_template = ("{% for m in messages %}{% if m['role'] != 'system' %}{{ m['role'] }}: {{ m['content'] }}"
                             "{{ eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    run([{"prompt": [{"role": "user", "content": "w6"}]},
         {"prompt": [{"role": "system", "content": "w4 w5"}, {"role": "user", "content": "w7"}]}] * 2)


@case("dtype-float16-gemma", UserWarning, "setup_reasoning_model(dtype='float16'): gemma2 models overflow float16",
      "inf/NaN logits", "Use dtype='auto' (float32 on a GPU without native bfloat16)")
def _(run):
    from transformers import Gemma2Config

    from grpo_nb.models import dtype_for_model

    dtype_for_model("float16", torch.float16, Gemma2Config())  # what setup_reasoning_model asks once the config is read


@case("format-gsm8k-answer-not-a-number", ValueError, "format_gsm8k(): row 1's 'answer' has no number after its "
      "'####' but words ('eighteen eggs')", "Fix the row or drop it")
def _(run):
    # '#### 18 eggs', '#### $18', '#### 1,234' give the number; only a tail with no number is refused
    from grpo_nb.data import format_gsm8k

    format_gsm8k(Dataset.from_dict({"question": ["q", "q2"], "answer": ["#### $18 eggs", "#### eighteen eggs"]}))


@case("format-gsm8k-answer-not-text", TypeError, "format_gsm8k(): row 0's 'answer' is 5 (int)",
      "not a GSM8K solution text ending in '#### <number>'", "dataset.filter(")
def _(run):
    from grpo_nb.data import format_gsm8k

    format_gsm8k(Dataset.from_dict({"question": ["q"], "answer": [5]}))


@case("demo-odd-arguments", ValueError, "demo(max_steps=0) is invalid: expected an integer >= 1")
def _(run):
    # grpo-nb demo --max-steps 0 / --eval-size -5 / --seed -1 / --output-dir '': argparse's usage error, at once
    import grpo_nb.demo as demo

    run.monkeypatch.setattr(demo, "setup_reasoning_model", lambda **kw: pytest.fail("the model was loaded"))
    demo.run_demo(run.tmp_path / "demo", max_steps=0)


@case("compare-not-an-evaluation", ValueError, "compare(before='<dict with keys []>') is invalid",
      "expected what evaluate(model, tokenizer, dataset) returned")
def _(run):
    from grpo_nb.evaluation import compare

    compare({}, {"n": 1, "accuracy": 1.0})


# ----------------------------------------------------------------------------- files written beside and renamed (issue 25)

@case("log-completions-path-foreign-file", ValueError, "GRPOConfig.log_completions_path=", "holds other data",
      "a JSON object with step, prompt, completion, reward, run_id", "Name a new file")
def _(run):
    (run.tmp_path / "scores.csv").write_text("prompt,score\nw5,1\n")
    try:
        run(log_completions_path=run.tmp_path / "scores.csv")
    finally:
        assert (run.tmp_path / "scores.csv").read_text() == "prompt,score\nw5,1\n"  # not appended to


@case("log-completions-path-is-a-link", ValueError, "GRPOConfig.log_completions_path=", "is a link (to",
      "never through a link")
def _(run):
    (run.tmp_path / "elsewhere.jsonl").write_text("")
    (run.tmp_path / "completions.jsonl").symlink_to(run.tmp_path / "elsewhere.jsonl")
    run(log_completions_path=run.tmp_path / "completions.jsonl")


@case("log-completions-path-becomes-a-fifo", UserWarning, "log_completions_path failed at step 2",
      "a pipe (FIFO), not a regular file",
      "training goes on")
def _(run):  # before: the open for step 2's rows blocked forever on the pipe with no reader
    log = run.tmp_path / "completions.jsonl"
    calls = []

    def pipe_planted(completion_ids, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # as a user or a viewer might, to stream the rows
            log.unlink()
            os.mkfifo(log)
        return token_id_reward(completion_ids=completion_ids, **kwargs)

    pipe_planted.__name__ = "pipe_planted"
    run(max_steps=2, rewards=pipe_planted, log_completions_path=str(log))


@case("log-completions-path-rerun", None)
def _(run):
    # The cell run again after its run stopped in the first step: that run logged nothing and leaves no empty
    # file in output_dir (which made the rerun refuse output_dir as someone else's); the rerun appends its rows.
    path = run.tmp_path / "run" / "completions.jsonl"
    with pytest.raises(RewardFunctionError):
        run(rewards=lambda completions, **kw: 1 / 0, log_completions_path=path)
    run(log_completions_path=path)
    run(log_completions_path=path, output_dir=str(run.tmp_path / "again"))  # two runs share the file
    lines = path.read_text().splitlines()
    assert len(lines) == 8 and len({line.split('"run_id": ')[1] for line in lines}) == 2


@case("output-dir-checkpoint-is-a-link", ValueError, "checkpoint-1 is a link (to", "Remove the link",
      "resume_from_checkpoint=")
def _(run):
    (run.tmp_path / "elsewhere").mkdir()
    (run.tmp_path / "run").mkdir()
    (run.tmp_path / "run" / "checkpoint-1").symlink_to(run.tmp_path / "elsewhere")
    run(resume_from_checkpoint=True)


@case("output-dir-file-is-a-link", None)
def _(run):
    # Links at names the run saves (an adapter of an earlier run linked in, say) are replaced, not written through.
    (run.tmp_path / "theirs.json").write_text("theirs")
    (run.tmp_path / "run").mkdir()
    (run.tmp_path / "run" / "adapter_config.json").write_text('{"peft_type": "LORA"}')  # (a link proves nothing)
    (run.tmp_path / "run" / "grpo_config.json").write_text(  # the earlier run's settings: its folder
        '{"output_dir": "run", "num_generations": 4, "max_completion_length": 6, "beta": 0.0}')
    for name in ("adapter_model.safetensors", "history.json", "README.md"):
        (run.tmp_path / "run" / name).symlink_to(run.tmp_path / "theirs.json")
    with pytest.warns(UserWarning, match="holds the adapter an earlier run saved"):
        run()
    assert (run.tmp_path / "theirs.json").read_text() == "theirs"
    assert not any(p.is_symlink() for p in (run.tmp_path / "run").iterdir())


@case("output-dir-holds-a-model-no-run-saved", ValueError, "holds a model that no grpo-nb run saved there",
      "Pass a new output_dir")
def _(run):
    folder = run.tmp_path / "someones-model"
    lora_model().get_base_model().save_pretrained(folder)  # a model saved by hand, e.g. a download
    run(output_dir=str(folder))


@case("output-dir-holds-a-pytorch-bin-download", ValueError, "holds a model that no grpo-nb run saved there",
      "weights and config over a model", "Pass a new output_dir")
def _(run):
    folder = run.tmp_path / "someones-model"
    base = lora_model().get_base_model()
    base.save_pretrained(folder)
    torch.save(base.state_dict(), folder / "pytorch_model.bin")  # an older download's weight file
    (folder / "model.safetensors").unlink()
    run(output_dir=str(folder))


@case("output-dir-holds-another-trainers-checkpoints", ValueError, "holds checkpoint folders no grpo-nb run wrote",
      "up to checkpoint-500", "HF or TRL Trainer's", "Pass a new output_dir")
def _(run):
    outputs = run.tmp_path / "outputs"  # TRL's and Unsloth's notebooks' default output_dir
    lora_model().get_base_model().save_pretrained(outputs / "checkpoint-500")
    (outputs / "checkpoint-500" / "trainer_state.json").write_text('{"global_step": 500, "log_history": []}')
    run(output_dir=str(outputs))


@case("save-gguf-partial-is-a-link", None)
def _(run):
    # The old writer opened `.model.gguf.partial` through a link planted there: the file it pointed to was
    # overwritten with the model, and model.gguf became a link to it.
    from grpo_nb import save_gguf
    from test_gguf import bpe_tokenizer

    (run.tmp_path / "theirs.txt").write_text("theirs")
    (run.tmp_path / "out").mkdir()
    (run.tmp_path / "out" / ".model.gguf.partial").symlink_to(run.tmp_path / "theirs.txt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the test tokenizer's pre-tokenizer is not one llama.cpp knows
        save_gguf(tiny_model("llama"), run.tmp_path / "out" / "model.gguf", bpe_tokenizer(), quantization="f32")
    assert (run.tmp_path / "theirs.txt").read_text() == "theirs"
    assert (run.tmp_path / "out" / "model.gguf").read_bytes()[:4] == b"GGUF"


@case("output-dir-someone-elses-config-json", ValueError, "holds other files (README.md, config.json, notes.txt)",
      "pass a new folder")
def _(run):
    project = run.tmp_path / "run"  # a project of the user's: a config.json that is no model's proves nothing
    project.mkdir()
    (project / "README.md").write_text("# My project")
    (project / "config.json").write_text('{"api_url": "https://example.com", "retries": 3}')
    (project / "notes.txt").write_text("notes")
    run()


@case("save-adapter-keeps-the-users-readme", None)
def _(run):
    from grpo_nb import save_adapter

    model = lora_model()
    path = save_adapter(model, run.tmp_path / "adapter", run.tok)
    (path / "README.md").write_text("# My adapter\nhow I trained it")
    save_adapter(model, path, run.tok)  # saved again after more training: peft writes a fresh card
    assert (path / "README.md").read_text() == "# My adapter\nhow I trained it"


@case("output-dir-checkpoint-is-a-file", ValueError, "checkpoint-2 is a file, where the run writes its checkpoint "
      "folder", "Move it away")
def _(run):
    (run.tmp_path / "run").mkdir()
    (run.tmp_path / "run" / "checkpoint-2").write_text("mine")
    run(max_steps=3, save_steps=1)


@case("output-dir-lock-is-a-folder", ValueError, ".grpo_nb.lock is a folder, where a file of that name is written")
def _(run):
    (run.tmp_path / "run" / ".grpo_nb.lock").mkdir(parents=True)
    run()


@case("output-dir-file-name-is-a-folder", ValueError, "adapter_model.safetensors is a folder, where a file")
def _(run):
    (run.tmp_path / "run" / "adapter_model.safetensors").mkdir(parents=True)
    run()


@case("output-dir-runs-is-a-link", ValueError, "runs is a link (to", "where TensorBoard writes its event files",
      "GRPOConfig.logging_dir")
def _(run):
    (run.tmp_path / "elsewhere").mkdir()
    (run.tmp_path / "run").mkdir()
    (run.tmp_path / "run" / "runs").symlink_to(run.tmp_path / "elsewhere")
    try:
        run(report_to="tensorboard")
    finally:
        assert not list((run.tmp_path / "elsewhere").iterdir())


@case("output-dir-runs-is-a-file", ValueError, "runs is a file, where TensorBoard writes its event files")
def _(run):
    (run.tmp_path / "run").mkdir()
    (run.tmp_path / "run" / "runs").write_text("")
    run(report_to="tensorboard")


@case("log-completions-path-in-a-checkpoint", ValueError, "GRPOConfig.log_completions_path=", "at checkpoint-1 in "
      "output_dir, a checkpoint folder", "the log would be lost", "completions.jsonl")
def _(run):
    log = run.tmp_path / "run" / "checkpoint-1" / "c.jsonl"  # rotated away with checkpoint-1
    run(max_steps=3, save_steps=1, save_total_limit=1, log_completions_path=log)


@case("log-completions-path-is-a-saved-file", ValueError, "at README.md in output_dir, a file the run's final save "
      "replaces")
def _(run):
    run(log_completions_path=run.tmp_path / "run" / "README.md")


@case("logging-dir-in-a-checkpoint", ValueError, "GRPOConfig.logging_dir=", "at checkpoint-1 in output_dir")
def _(run):
    run(report_to="tensorboard", logging_dir=run.tmp_path / "run" / "checkpoint-1")


@case("logging-dir-not-a-folder", ValueError, "GRPOConfig.logging_dir='/dev/null' is invalid", "this is not a folder")
def _(run):
    run(report_to="tensorboard", logging_dir="/dev/null")


@case("output-dir-nul-character", ValueError, "GRPOConfig.output_dir=", "NUL character")
def _(run):
    run(output_dir=str(run.tmp_path / "out\x00put"))


@case("output-dir-dangling-link", ValueError, "GRPOConfig.output_dir=", "is a link to", "which does not exist")
def _(run):
    (run.tmp_path / "run").symlink_to(run.tmp_path / "unmounted")  # a disk not mounted yet
    run()


@case("save-adapter-folder-at-a-file-name", ValueError, "save_adapter(path=", "adapter_model.safetensors is a folder")
def _(run):
    from grpo_nb import save_adapter

    model = lora_model()
    path = save_adapter(model, run.tmp_path / "adapter", run.tok)
    (path / "adapter_model.safetensors").unlink()
    (path / "adapter_model.safetensors").mkdir()
    try:
        save_adapter(model, path, run.tok)
    finally:
        assert not list((path / "adapter_model.safetensors").iterdir())


@case("load-for-inference-damaged-adapter-config", ValueError, "load_for_inference(path=",
      "adapter_config.json there is not an adapter config peft wrote", "a JSON list, not an object")
def _(run):
    from grpo_nb import load_for_inference, save_adapter

    path = save_adapter(lora_model(), run.tmp_path / "adapter", run.tok)
    (path / "adapter_config.json").write_text("[1, 2]")
    load_for_inference(path, device="cpu")


@case("load-for-inference-adapter-and-merged-model", ValueError, "holds both an adapter", "Pass base_model=")
def _(run):
    from grpo_nb import load_for_inference, save_adapter, save_merged

    model = lora_model()
    both = save_merged(model, run.tmp_path / "both", run.tok)
    save_adapter(model, run.tmp_path / "adapter")
    for name in ("adapter_config.json", "adapter_model.safetensors"):  # copied in by hand
        (run.tmp_path / "adapter" / name).rename(both / name)
    load_for_inference(both, device="cpu")


@case("save-gguf-arguments-swapped", TypeError, "the path and the tokenizer are swapped",
      "the order is save_gguf(model, ")
def _(run):
    from grpo_nb import save_gguf

    save_gguf(tiny_model("llama"), run.tok, str(run.tmp_path / "model.gguf"))


@case("demo-output-dir-holds-other-files", ValueError, "demo output_dir=", "holds other files (history.json, "
      "summary.json)", "pass a new folder")
def _(run):
    import grpo_nb.demo as demo

    run.monkeypatch.setattr(demo, "setup_reasoning_model", lambda **kw: pytest.fail("the model was loaded"))
    for name in ("history.json", "summary.json"):
        (run.tmp_path / name).write_text("mine")
    demo.run_demo(run.tmp_path)


@case("plot-reward-curves-to-a-folder", IsADirectoryError, "Cannot write the PNG", "it is a folder",
      "Name a file in it")
def _(run):
    from grpo_nb.display import plot_reward_curves

    plot_reward_curves([{"step": 1, "reward": 0.5}], run.tmp_path)


@case("live-dashboard-png-dir-not-a-path", TypeError, "LiveDashboard(png_dir=123) is invalid", "a folder for the PNGs")
def _(run):
    from grpo_nb_widgets import LiveDashboard

    LiveDashboard(png_dir=123)


@case("save-merged-peft-variants", None)
def _(run):
    # DoRA, modules_to_save and LoRA on a tied embedding: the merged model computes what the trained one did.
    from peft import LoraConfig, get_peft_model

    from grpo_nb import load_for_inference, save_merged

    model = get_peft_model(tiny_model("llama", tied=True), LoraConfig(
        r=4, target_modules=["q_proj", "embed_tokens"], use_dora=True, modules_to_save=["lm_head"]))
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.5)
    ids = torch.tensor([[5, 6, 7, 8]])
    expected = model.eval()(ids).logits
    loaded, _ = load_for_inference(save_merged(model, run.tmp_path / "m", run.tok, dtype="float32"), device="cpu",
                                   dtype="float32")
    torch.testing.assert_close(loaded(ids).logits, expected, atol=1e-4, rtol=1e-4)


@case("save-merged-lora-bias-without-a-layer-bias", ValueError, "save_merged() cannot write this model merged",
      "lora_bias=True and that layer has no bias", "Nothing was written", "save_adapter(model, path)")
def _(run):
    from peft import LoraConfig, get_peft_model

    from grpo_nb import save_merged

    save_merged(get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj"], lora_bias=True)),
                run.tmp_path / "m", run.tok)


@case("save-merged-into-the-base-models-folder", ValueError, "save_merged(path=",
      "the folder this model's base weights were loaded from", "would replace that base model", "-merged'")
def _(run):
    from grpo_nb import save_merged

    tiny_model("llama").save_pretrained(run.tmp_path / "base")
    run.tok.save_pretrained(run.tmp_path / "base")
    model, tok = setup_reasoning_model(str(run.tmp_path / "base"), device="cpu", dtype="float32", lora_rank=4)
    save_merged(model, run.tmp_path / "base", tok)



@case("train-output-dir-is-the-base-models-folder", ValueError, "output_dir=",
      "the folder this model's base weights were loaded from", "would replace that base model",
      "Pass another output_dir", "-grpo'")
def _(run):
    base = run.tmp_path / "base"
    tiny_model("llama").save_pretrained(base)
    run.tok.save_pretrained(base)
    before = sorted(p.name for p in base.iterdir())
    model, tok = setup_reasoning_model(str(base), device="cpu", dtype="float32", lora_rank=4)
    try:
        run(model=model, tok=tok, output_dir=str(base))
    finally:
        assert sorted(p.name for p in base.iterdir()) == before  # refused before any work: nothing written there


@case("save-merged-base-folder-after-a-cd", ValueError, "save_merged(path=",
      "the folder this model's base weights were loaded from")
def _(run):
    from grpo_nb import save_merged

    run.monkeypatch.chdir(run.tmp_path)
    tiny_model("llama").save_pretrained("base")
    run.tok.save_pretrained("base")
    model, tok = setup_reasoning_model("base", device="cpu", dtype="float32", lora_rank=4)  # a relative path
    (run.tmp_path / "sub").mkdir()
    run.monkeypatch.chdir(run.tmp_path / "sub")  # a notebook's %cd
    save_merged(model, "../base", tok)


@case("save-merged-dot-inside-the-base-folder", ValueError, "save_merged(path='.')",
      "the folder this model's base weights were loaded from", "base-merged'")
def _(run):
    from grpo_nb import save_merged

    tiny_model("llama").save_pretrained(run.tmp_path / "base")
    run.tok.save_pretrained(run.tmp_path / "base")
    run.monkeypatch.chdir(run.tmp_path / "base")  # the notebook sits in the model's folder
    model, tok = setup_reasoning_model(".", device="cpu", dtype="float32", lora_rank=4)
    save_merged(model, ".", tok)  # the suggested name is built from the folder's real name, not '.'


@case("save-merged-into-a-training-runs-folder", ValueError, "save_merged(path=",
      "holds a training run (its grpo_config.json)", "pick another folder", "export'")
def _(run):
    from grpo_nb import save_merged

    model = tiny_model("llama")
    run(model=model, output_dir=str(run.tmp_path / "full"))  # a full fine-tune: its model is there
    save_merged(lora_model(seed=3), run.tmp_path / "full", run.tok)  # another model over the run's result


@case("save-adapter-over-an-adapter-warns", None)
def _(run):
    from grpo_nb import save_adapter

    folder = run.tmp_path / "downloaded"
    lora_model(seed=3).save_pretrained(folder)  # someone's adapter
    with pytest.warns(UserWarning, match=r"save_adapter: '.*downloaded' already holds an adapter .*which this save "
                                         r"replaces\. Pick a new folder to keep it"):
        save_adapter(lora_model(), folder, run.tok)


@case("save-adapter-without-tokenizer-over-a-save", UserWarning, "which this save replaces", "tokenizer files from an "
      "earlier save", "stay, since no tokenizer is given here", "load with this save's adapter",
      "save_adapter(model, path, tokenizer), to replace them")
def _(run):
    from grpo_nb import save_adapter

    save_adapter(lora_model(seed=1), run.tmp_path / "adapter", run.tok)  # yesterday's adapter and tokenizer
    save_adapter(lora_model(seed=2), run.tmp_path / "adapter")  # today's, the tokenizer not given


def _named(seed=0):
    """A LoRA model whose adapter is named "grpo": peft saves it in <folder>/grpo/, replacing that subfolder whole."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_model("llama", seed=seed), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
                          adapter_name="grpo")


@case("output-dir-holds-a-named-adapter-no-run-saved", ValueError,
      "holds an adapter in its subfolder 'grpo' that no grpo-nb run saved there", "Pass a new output_dir")
def _(run):
    from grpo_nb import save_adapter

    folder = run.tmp_path / "mine"
    save_adapter(_named(seed=5), folder)  # the user's adapter: folder/README.md, folder/grpo/adapter_*
    before = (folder / "grpo" / "adapter_model.safetensors").read_bytes()
    try:
        run(model=_named(), output_dir=str(folder))  # its final save replaced folder/grpo whole
    finally:
        assert (folder / "grpo" / "adapter_model.safetensors").read_bytes() == before


@case("output-dir-adapter-subfolder-is-another-run", ValueError, "its subfolder 'grpo' holds another training "
      "run's folder (its grpo_config.json, 1 checkpoint(s))", "replacing that subfolder whole",
      "get_peft_model(..., adapter_name=...)")
def _(run):
    out = run.tmp_path / "out"
    run(max_steps=1, save_steps=1, output_dir=str(out / "grpo"))  # an earlier run's folder, nested in out
    try:
        run(model=_named(), output_dir=str(out))  # its final save deleted out/grpo's checkpoints and history
    finally:
        assert ckpt.checkpoints(out / "grpo") and (out / "grpo" / "history.json").exists()


@case("save-adapter-named-over-another-run", ValueError, "save_adapter(path=", "whose subfolder 'grpo' holds only "
      "an adapter or nothing", "another training run's folder", "give the adapter another name")
def _(run):
    from grpo_nb import save_adapter

    out = run.tmp_path / "out"
    run(max_steps=1, save_steps=1, output_dir=str(out / "grpo"))
    try:
        save_adapter(_named(), out, run.tok)
    finally:
        assert ckpt.checkpoints(out / "grpo")


@case("named-adapter-saved-again-in-its-folder", None)
def _(run):
    from grpo_nb import save_adapter

    # the run's own earlier saves in <folder>/grpo are its to replace: a rerun, a resume in place, save_adapter again
    out = str(run.tmp_path / "out")
    run(model=_named(), max_steps=1, save_steps=1, output_dir=out)
    with pytest.warns(UserWarning, match="holds the adapter an earlier run saved"):
        run(model=_named(), max_steps=1, save_steps=0, output_dir=str(run.tmp_path / "again"))
        run(model=_named(), max_steps=1, save_steps=0, output_dir=str(run.tmp_path / "again"))
    run(model=_named(), max_steps=2, save_steps=1, output_dir=out, resume_from_checkpoint=True)
    save_adapter(_named(), run.tmp_path / "export", run.tok)
    with pytest.warns(UserWarning, match="already holds an adapter in its subfolder 'grpo', which this save replaces"):
        save_adapter(_named(), run.tmp_path / "export", run.tok)


def _adapter_named(name):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_model("llama"), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
                          adapter_name=name)


@case("adapter-name-an-absolute-path", ValueError, "train(model=...) has its LoRA adapter named '/",
      "is an absolute path", "outside the folder", "adapter_name='grpo'")
def _(run):
    elsewhere = run.tmp_path / "elsewhere"  # any folder: a user's other adapter, written over
    try:  # before: trained, and the adapter written to that folder, none in output_dir
        run(model=_adapter_named(str(elsewhere)))
    finally:
        assert not elsewhere.exists()


@case("adapter-name-a-checkpoint", ValueError, "has its LoRA adapter named 'checkpoint-1'",
      "the run's own checkpoint folder", "adapter_name='grpo'")
def _(run):  # before: the final save replaced the step-1 checkpoint with the adapter, then blocked the folder
    run(model=_adapter_named("checkpoint-1"), max_steps=2, save_steps=1)


@case("adapter-name-runs", ValueError, "has its LoRA adapter named 'runs'", "TensorBoard", "adapter_name='grpo'")
def _(run):  # before: the final save replaced output_dir/runs, the run's TensorBoard event files, with the adapter
    run(model=_adapter_named("runs"), max_steps=2, report_to="tensorboard")


@case("adapter-name-with-a-separator", ValueError, "has its LoRA adapter named 'a/b'", "not one plain folder name")
def _(run):
    run(model=_adapter_named("a/b"))


def _meta_model(whole):
    """The tiny llama with LoRA whose weights were never loaded: built under accelerate's init_empty_weights() (all
    on meta), or with one MLP moved to meta."""
    from peft import LoraConfig, get_peft_model

    if whole:
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM
        from tiny_models import tiny_config

        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    else:
        model = tiny_model("llama")
        model.model.layers[1].mlp.to("meta")
    model.generation_config.eos_token_id = 2
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))


@case("model-weights-on-meta", ValueError, "train(model=...) has", "weight(s) with no data, on the 'meta' device",
      "init_empty_weights()", "from_pretrained(name)")
def _(run):  # before (probe P26 F7): a raw "Tensor.item() cannot be called on meta tensors", an empty output_dir left
    try:
        run(model=_meta_model(whole=True))
    finally:
        assert not (run.tmp_path / "run").exists()


@case("sample-and-score-weights-on-meta", ValueError, "sample_and_score(model=...) has", "on the 'meta' device (e.g. "
      "base_model.model.model.layers.1.mlp.")
def _(run):  # before (probe P26 F8): scores of completions a layer with no weights generated, without a word
    from grpo_nb import sample_and_score

    sample_and_score(_meta_model(whole=False), run.tok, ["w5 w6"], count_w7, n=2, max_completion_length=4)


@case("save-adapter-weights-on-meta", ValueError, "save_adapter(model=...) has", "on the 'meta' device")
def _(run):  # before (probe P26 F8): a raw "Cannot copy out of meta tensor", an empty folder left
    from grpo_nb import save_adapter

    try:
        save_adapter(_meta_model(whole=False), run.tmp_path / "export")
    finally:
        assert not (run.tmp_path / "export").exists()

@case("evaluate-cpu-offloaded-model", None)
def _(run):  # before (probe P28 F3): a raw "Cannot copy out of meta tensor" (prompt ids put on the first weight's meta)
    from accelerate import cpu_offload

    from grpo_nb import evaluate, sample_and_score

    plain, offloaded = tiny_model("llama"), tiny_model("llama")
    for model in (plain, offloaded):
        model.generation_config.eos_token_id = 2
    cpu_offload(offloaded, execution_device="cpu")  # every weight on meta, loaded by accelerate's hook per forward
    assert all(p.device.type == "meta" for p in offloaded.parameters())
    got = [sample_and_score(m, run.tok, ["w5 w6"], count_w7, n=2, max_completion_length=4).samples
           for m in (plain, offloaded)]
    assert [s["completion"] for s in got[0]] == [s["completion"] for s in got[1]]
    assert evaluate(offloaded, run.tok, dataset(2), max_completion_length=4)["truncation_rate"] == 1.0


@case("adapter-name-too-long", ValueError, "has its LoRA adapter named 'aaaa", "is 300 bytes long",
      "past the 255 bytes", "adapter_name='grpo'")
def _(run):  # before (probe P26 F5): trained, then "File name too long" at the save, blaming the folder's rights
    run(model=_adapter_named("a" * 300))


@case("adapter-name-with-nul", ValueError, "has its LoRA adapter named 'a\\x00b'", "holds a NUL character",
      "adapter_name='grpo'")
def _(run):  # before (probe P26 F5): trained, then a raw "embedded null byte" from os.makedirs at the save
    run(model=_adapter_named("a\x00b"))

@case("peft-config-edited-after-get-peft-model", ValueError, "train(model=...) has "
      "model.peft_config['default'].lora_alpha (or alpha_pattern) = 32, but its LoRA layers were made with "
      "lora_alpha=8", "edited after get_peft_model()", "LoraConfig(..., lora_alpha=...)",
      "model.peft_config['default'].lora_alpha = 8")
def _(run):  # before (probe P28 F6): trained at 8/4 and saved lora_alpha 32: the reloaded adapter acts 4x stronger
    model = lora_model()
    model.peft_config["default"].lora_alpha = 32  # "raising alpha" after the adapter was made
    run(model=model)


@case("save-adapter-peft-config-edited", ValueError, "save_adapter(model=...) has model.peft_config['default'].r "
      "(or rank_pattern) = 8, but its LoRA layers were made with r=4")
def _(run):  # before (probe P28 F6): saved; loading it failed raw with a size mismatch of lora_A
    from grpo_nb import save_adapter

    model = lora_model()
    model.peft_config["default"].r = 8
    try:
        save_adapter(model, run.tmp_path / "export")
    finally:
        assert not (run.tmp_path / "export").exists()


@case("lora-scale-changed-before-train", ValueError, "has LoRA layers that scale the adapter 'default' by 0.5 where "
      "its lora_alpha and r give 2", "scale_layer() or set_scale()", "unscale_layer()")
def _(run):  # before (probe P28 F4/F6): trained at scale 0.5, saved with lora_alpha/r = 2
    model = lora_model()
    for layer in model.modules():
        if hasattr(layer, "scale_layer") and hasattr(layer, "scaling"):
            layer.scale_layer(0.25)
    run(model=model)


@case("lora-patterns-on-target-parameters", None)
def _(run):  # before (probe P30 F4): refused as "the config was edited after get_peft_model()", whatever the key
    from peft import LoraConfig, get_peft_model

    base = tiny_model("llama")
    base.generation_config.eos_token_id = 2
    # peft matches the patterns of LoRA on parameters against "<module>.<parameter>": this layer has r=8, alpha 2
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=[], target_parameters=[
        "mlp.gate_proj.weight", "mlp.up_proj.weight"], rank_pattern={"gate_proj.weight": 8},
        alpha_pattern={"up_proj.weight": 2}))
    layer = model.get_base_model().model.layers[0].mlp
    assert layer.gate_proj.r["default"] == 8 and layer.up_proj.lora_alpha["default"] == 2
    run(model=model)


@case("lora-other-adapter-scaled-and-edited", None)
def _(run):  # before (probe P30 F5): refused over 'ref', which the run neither trains nor saves
    from peft import LoraConfig

    model = lora_model()
    model.add_adapter("ref", LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))  # a frozen reference adapter
    model.set_adapter("default")
    for layer in model.modules():
        if hasattr(layer, "set_scale") and "ref" in getattr(layer, "scaling", {}):
            layer.set_scale("ref", 0.5)  # kept at half strength
    model.peft_config["ref"].lora_alpha = 99
    run(model=model)
    assert '"lora_alpha": 8' in (run.tmp_path / "run" / "adapter_config.json").read_text()  # the one trained


@case("adapter-name-with-lone-surrogate", ValueError, "has its LoRA adapter named 'a\\ud800'",
      "holds a character no file name can hold (a lone surrogate", "adapter_name='grpo'")
def _(run):  # before (probe P28 F8): trained, then a raw UnicodeEncodeError from os.makedirs at the final save
    run(model=_adapter_named("a\ud800"))


@case("save-adapter-name-an-absolute-path", ValueError, "save_adapter(model=...) has its LoRA adapter named '/",
      "is an absolute path", "adapter_name='grpo'")
def _(run):
    from grpo_nb import save_adapter

    elsewhere = run.tmp_path / "elsewhere"
    try:  # before: written to `elsewhere`, outside the folder named (and not atomically)
        save_adapter(_adapter_named(str(elsewhere)), run.tmp_path / "export", run.tok)
    finally:
        assert not elsewhere.exists()


@case("log-completions-path-in-the-adapter-subfolder", ValueError, "GRPOConfig.log_completions_path=",
      "at grpo in output_dir, the subfolder where the run saves its adapter 'grpo'", "replaces whole")
def _(run):  # before: the final save replaced out/grpo whole, the completions log with it
    out = run.tmp_path / "out"
    run(model=_named(), output_dir=str(out), log_completions_path=str(out / "grpo" / "completions.jsonl"))


def _stacked(other_trainable):
    """A LoRA model with a second adapter 'other' active beside 'default' (peft's set_adapter of a list)."""
    from peft import LoraConfig

    model = lora_model()
    model.add_adapter("other", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    model.base_model.set_adapter(["default", "other"])
    for name, p in model.named_parameters():
        if ".other." in name:
            p.requires_grad_(other_trainable)
    return model


@case("two-adapters-active", ValueError, "has 2 LoRA adapters active at once (['default', 'other'])",
      "saves only 'default'", "model.set_adapter('default')", "model.delete_adapter('other')")
def _(run):  # before: trained through both, saved 'default' alone, which is not the policy trained
    run(model=_stacked(other_trainable=False))


@case("two-adapters-active-both-trainable", ValueError, "has 2 LoRA adapters active at once",
      "model.set_adapter('default')")
def _(run):  # before: "trains weight(s) outside its LoRA adapter", whose fix (freeze them) led to the case above
    run(model=_stacked(other_trainable=True))


@case("save-adapter-inside-a-checkpoint", ValueError, "save_adapter(path=", "lies in the checkpoint folder",
      "deletes, with everything in it, when it rotates", "checkpoint-1-export'")
def _(run):
    from grpo_nb import save_adapter

    model = lora_model()
    run(model=model, max_steps=2, save_steps=1, output_dir=str(run.tmp_path / "done"))
    save_adapter(model, run.tmp_path / "done" / "checkpoint-1" / "export", run.tok)


@case("save-gguf-inside-a-checkpoint", ValueError, "save_gguf(path=", "lies in the checkpoint folder",
      "done-checkpoint-1-model.gguf'")
def _(run):
    from grpo_nb import save_gguf
    from test_gguf import bpe_tokenizer

    checkpoint = run.tmp_path / "done" / "checkpoint-1"  # what makes a folder a checkpoint: its state files
    checkpoint.mkdir(parents=True)
    (checkpoint / ckpt.TRAINER_STATE).write_text("{}")
    (checkpoint / ckpt.TRAINABLE).write_bytes(b"")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the test tokenizer's pre-tokenizer is not one llama.cpp knows
        save_gguf(tiny_model("llama"), checkpoint / "model.gguf", bpe_tokenizer(), quantization="f32")


@case("save-gguf-over-a-gguf-warns", UserWarning, "save_gguf: '", "model.gguf' already holds a GGUF file, which this "
      "export replaces. Pick a new name to keep it.")
def _(run):
    from grpo_nb import save_gguf
    from test_gguf import bpe_tokenizer

    path = run.tmp_path / "model.gguf"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the test tokenizer's pre-tokenizer is not one llama.cpp knows
        save_gguf(tiny_model("llama", seed=3), path, bpe_tokenizer(), quantization="f32")  # another model's export
    save_gguf(tiny_model("llama"), path, bpe_tokenizer(), quantization="f32")


@case("rotation-keeps-a-checkpoint-backup-with-leading-zeros", None)
def _(run):
    import shutil

    done = run.tmp_path / "done"
    run(max_steps=2, save_steps=1, output_dir=str(done))
    shutil.copytree(done / "checkpoint-1", done / "checkpoint-001")  # the user's backup: a name no run writes
    run(max_steps=3, save_steps=1, save_total_limit=1, output_dir=str(done), resume_from_checkpoint=True)
    assert [p.name for p in ckpt.checkpoints(done)] == ["checkpoint-3"] and (done / "checkpoint-001").is_dir()


@case("resume-checkpoint-lost-its-adapter-config", ValueError, "damaged or foreign checkpoint (adapter_config.json: "
      "missing", "looks damaged or edited", "(checkpoint-1 in the same folder)")
def _(run):
    done = run.tmp_path / "done"
    run(max_steps=2, save_steps=1, output_dir=str(done))
    (done / "checkpoint-2" / "adapter_config.json").unlink()
    run(max_steps=3, save_steps=1, output_dir=str(done), resume_from_checkpoint=True)


@case("output-dir-relative-and-a-reward-changes-directory", None)
def _(run):
    # A reward's sandbox (or a callback's %cd) that moves the working directory during the run: the run keeps
    # writing where it started, into the folder its checks and its lock are on.
    (run.tmp_path / "a").mkdir()
    (run.tmp_path / "b").mkdir()
    run.monkeypatch.chdir(run.tmp_path / "a")

    def sandboxed(completions, **kwargs):
        os.chdir(run.tmp_path / "b")
        return [float(len(c) % 3) for c in completions]

    run(rewards=sandboxed, output_dir="exp", max_steps=2, save_steps=1)
    assert sorted(p.name for p in (run.tmp_path / "a" / "exp").glob("checkpoint-*")) == ["checkpoint-1",
                                                                                       "checkpoint-2"]
    assert (run.tmp_path / "a" / "exp" / "adapter_model.safetensors").exists()
    assert not (run.tmp_path / "b" / "exp").exists()


@case("format-gsm8k-answer-not-one-number", ValueError, "row 1's 'answer' ends in '1 234'", "not one number",
      "'#### 1234'", "drop the row")
def _(run):
    from grpo_nb import format_gsm8k

    format_gsm8k(Dataset.from_dict({"question": ["q", "q"], "answer": ["so\n#### 72", "so\n#### 1 234"]}))


@case("train-peft-trainable-token-indices", None)
def _(run):
    from peft import LoraConfig, get_peft_model

    run(model=get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj"],
                                                             trainable_token_indices=[5, 9])))


@case("train-after-merge-adapter", ValueError, "train(model=...) has its LoRA adapter merged", "merge_adapter()",
      "model.unmerge_adapter()")
def _(run):
    model = lora_model()
    model.merge_adapter()
    run(model=model)

# ----------------------------------------------------------------------------- checkpoints read back (issue 25)

def _edited_checkpoint(run, edit) -> Path:
    """A real checkpoint whose trainer_state.json `edit` changed, as someone else's could be."""
    import json

    path = _trained_checkpoint(run)
    state = json.loads((path / "trainer_state.json").read_text())
    edit(state)
    (path / "trainer_state.json").write_text(json.dumps(state))
    return path


@case("resume-foreign-run-id", ckpt.CheckpointError, "damaged or foreign checkpoint", "trainer_state.json",
      "run_id is str '../../../home/user'", "Nothing of it was loaded")
def _(run):
    path = _edited_checkpoint(run, lambda state: state.update(run_id="../../../home/user"))  # names tracker folders
    run(max_steps=3, resume_from_checkpoint=path)


@case("resume-nonfinite-weights", ckpt.CheckpointError, "damaged or foreign checkpoint", "trainable.safetensors",
      "finite weights")
def _(run):
    import safetensors.torch

    path = _trained_checkpoint(run)
    weights = safetensors.torch.load_file(path / "trainable.safetensors")
    weights = {name: torch.full_like(w, float("nan")) for name, w in weights.items()}
    safetensors.torch.save_file(weights, path / "trainable.safetensors")
    run(max_steps=3, resume_from_checkpoint=path)


@case("resume-entropy-coef-edited", ckpt.CheckpointError, "damaged or foreign checkpoint",
      "history[1].entropy_coef is str '0.5'", "a finite number >= 0")
def _(run):  # use_adaptive_entropy's state, read back on resume: not a number, NaN or negative never reaches the loss
    path = _edited_checkpoint(run, lambda state: state["history"][-1].update(entropy_coef="0.5", entropy_window=0.1))
    run(max_steps=3, resume_from_checkpoint=path, use_adaptive_entropy=True)


@case("resume-bad-step", ckpt.CheckpointError, "damaged or foreign checkpoint", "step is int -1",
      "an integer >= 0")
def _(run):
    run(max_steps=3, resume_from_checkpoint=_edited_checkpoint(run, lambda state: state.update(step=-1)))


@case("resume-field-wrong-type", ckpt.CheckpointError, "damaged or foreign checkpoint",
      "sampler.order is str '4,5,6'", "distinct integers >= 0")
def _(run):
    path = _edited_checkpoint(run, lambda state: state["sampler"].update(order="4,5,6"))
    run(max_steps=3, resume_from_checkpoint=path)


@case("lock-file-garbage", ckpt.CheckpointError, "damaged or foreign lock file", "pid is str 'me'",
      "delete")
def _(run):
    (run.tmp_path / "run").mkdir()
    (run.tmp_path / "run" / LOCK).write_text('{"pid": "me", "host": "laptop", "started": "today"}')
    run()


_PRISTINE: list[Path] = []  # the output_dir of one 2-step run, trained by the first case that needs it


def _copied_checkpoint(run) -> Path:
    """_trained_checkpoint's checkpoint-2, trained once per session: each case gets (and edits) its own copy."""
    import shutil

    if not _PRISTINE:
        run(max_steps=2, save_steps=2, output_dir=str(run.tmp_path / "pristine"))
        _PRISTINE.append(run.tmp_path / "pristine")  # pytest keeps each test's tmp_path for the session
    shutil.copytree(_PRISTINE[0], run.tmp_path / "done", ignore=shutil.ignore_patterns(LOCK))
    return run.tmp_path / "done" / "checkpoint-2"


def _checkpoint_mid_batch(run) -> Path:
    """A checkpoint after step 1 of num_iterations=2: it holds the generation batch step 2 trains on again."""
    def stop(record):
        raise KeyboardInterrupt  # as the Stop button would
    run(num_iterations=2, max_steps=2, callbacks=[stop], output_dir=str(run.tmp_path / "done"))
    return run.tmp_path / "done" / "checkpoint-1"


@case("resume-checkpoint-renamed", ckpt.CheckpointError, "checkpoint-7: damaged or foreign checkpoint",
      "step is int 2; expected 7, the step its folder's name says")
def _(run):
    path = _copied_checkpoint(run)
    path.rename(path.parent / "checkpoint-7")  # resume_from_checkpoint=True would take it for the newest
    run(max_steps=8, output_dir=str(path.parent), resume_from_checkpoint=True)


@case("resume-behind-later-checkpoints", ValueError, "holds checkpoint-7, numbered after step 2",
      "Move them out of output_dir")
def _(run):
    import shutil

    path = _copied_checkpoint(run)
    shutil.copytree(path, path.parent / "checkpoint-7")  # rotation keeps the highest numbers: this copy, not new ones
    run(max_steps=4, save_steps=1, save_total_limit=1, output_dir=str(path.parent), resume_from_checkpoint=path)


@case("resume-pending-batch-other-settings", UserWarning, "made under other settings",
      "without the reference policy's log-probs (ref_logprobs), which beta > 0 needs", "fresh rollout")
def _(run):
    path = _checkpoint_mid_batch(run)
    history = run(num_iterations=2, max_steps=2, beta=0.04, resume_from_checkpoint=path)
    assert [r["step"] for r in history] == [1, 2]


@case("resume-other-optimizer-settings", UserWarning, "weight_decay 0.0 -> 0.5",
      "continues under the new ones (the optimizer's settings too")
def _(run):
    path = _copied_checkpoint(run)
    run(max_steps=3, save_steps=3, weight_decay=0.5, resume_from_checkpoint=path)
    state = ckpt.read_state(run.tmp_path / "run" / "checkpoint-3")
    assert state["optimizer"]["param_groups"][0]["weight_decay"] == 0.5  # as the warning says, not the checkpoint's


@case("resume-negative-second-moment", ckpt.CheckpointError, "damaged or foreign checkpoint", ".exp_avg_sq is",
      "expected numbers >= 0")
def _(run):
    import json

    import safetensors.torch

    path = _copied_checkpoint(run)
    state = json.loads((path / "trainer_state.json").read_text())
    tensors = safetensors.torch.load_file(path / "trainer_state.safetensors")
    for _, moments in state["optimizer"]["state"]["__items__"]:  # finite, the right shape, and sqrt(-1) = NaN
        tensors[moments["exp_avg_sq"]["__tensor__"]].fill_(-1.0)
    safetensors.torch.save_file(tensors, path / "trainer_state.safetensors")
    run(max_steps=3, resume_from_checkpoint=path)


@case("resume-settings-file-damaged", ckpt.CheckpointError,
      "damaged or foreign checkpoint (grpo_config.json: could not be read, RecursionError", "Nothing of it was loaded")
def _(run):
    path = _copied_checkpoint(run)
    (path / "grpo_config.json").write_text("[" * 100_000 + "]" * 100_000)
    run(max_steps=3, resume_from_checkpoint=path)


@case("resume-file-not-regular", ckpt.CheckpointError, "damaged or foreign checkpoint",
      "trainer_state.json is a device, not a regular file")
def _(run):
    path = _copied_checkpoint(run)
    (path / "trainer_state.json").unlink()
    (path / "trainer_state.json").symlink_to("/dev/null")  # /dev/zero would never end, a FIFO never start
    run(max_steps=3, resume_from_checkpoint=path)


@case("resume-from-checkpoint-text", ValueError, "train(resume_from_checkpoint='True') is the text 'True'",
      "pass the bool True")
def _(run):
    run(resume_from_checkpoint="True")  # e.g. read from a YAML file or the command line


@case("resume-fork-new-run-id", None)
def _(run):
    path = _copied_checkpoint(run)
    parent = ckpt.read_state(path)["run_id"]
    run(max_steps=3, save_steps=3, resume_from_checkpoint=path)  # into run/, another output_dir: a fork
    state = ckpt.read_state(run.tmp_path / "run" / "checkpoint-3")
    assert state["run_id"] != parent and state["parent_run_id"] == parent


@case("resume-weights-float8", ckpt.CheckpointError, "damaged or foreign checkpoint (trainable.safetensors:",
      "torch.float8_e4m3fn Tensor", "expected a torch.float32 tensor like the model's")
def _(run):
    import safetensors.torch

    path = _copied_checkpoint(run)
    weights = safetensors.torch.load_file(path / "trainable.safetensors")
    weights = {name: w.to(torch.float8_e4m3fn) for name, w in weights.items()}
    safetensors.torch.save_file(weights, path / "trainable.safetensors")
    run(max_steps=3, resume_from_checkpoint=path)


@case("resume-true-newest-not-a-checkpoint", ValueError, "checkpoint-99: it is not a grpo-nb training checkpoint",
      "resume from one of the checkpoints beside it (checkpoint-2)")
def _(run):
    path = _copied_checkpoint(run)
    (path.parent / "checkpoint-99").mkdir()  # a copy interrupted before its first file
    run(max_steps=3, output_dir=str(path.parent), resume_from_checkpoint=True)


@case("callback-changes-its-record", None)
def _(run):
    import datetime

    import numpy as np

    def enrich(record):  # what a callback may add: a probe's tensor, a timestamp, scores by label id, raw data
        record.update(probe=torch.tensor(1.0), when=datetime.datetime.now(), by_label={1: 0.5}, raw=b"ab",
                      seen={1, 2}, curve=np.array([1.0, 2.0]))
        del record["skipped_nonfinite"]
    history = run(max_steps=1, save_steps=1, callbacks=[enrich])
    assert "probe" not in history[0] and "skipped_nonfinite" in history[0]  # the callback changed its own copy
    assert [r["step"] for r in run(max_steps=2, resume_from_checkpoint=True)] == [1, 2]


@case("dataset-int-too-long-for-json", None)
def _(run):
    rows = [{"prompt": row["prompt"], "id": 10**5000 + i} for i, row in enumerate(dataset())]  # big-number data
    run(ds=rows, max_steps=1, save_steps=1)
    history = run(ds=rows, max_steps=2, resume_from_checkpoint=True)
    assert "an int of about 5" in history[0]["samples"][0]["id"]  # the record's text of it, as the checkpoint has it


@case("stop-right-after-a-resume", None)
def _(run):
    import contextlib
    import io

    path = _copied_checkpoint(run)
    before = {p.name: p.read_bytes() for p in path.iterdir()}

    def count_w7(completions, **kwargs):
        raise KeyboardInterrupt  # Stop pressed during the first rollout (e.g. on seeing "settings differ")
    with contextlib.redirect_stdout(io.StringIO()) as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(rewards=count_w7, max_steps=3, learning_rate=0.5, output_dir=str(path.parent), resume_from_checkpoint=True)
    assert "nothing is written, and the checkpoint it resumed from is kept as it was" in out.getvalue()
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before


@case("resume-other-base-model", ValueError, "trained on '/models/Qwen2.5-1.5B', and this model "
      "('/models/Qwen2.5-1.5B-Instruct')", "An adapter means something only on the base model it was trained on")
def _(run):
    import json

    path = _copied_checkpoint(run)
    adapter = json.loads((path / "adapter_config.json").read_text())
    adapter["base_model_name_or_path"] = "/models/Qwen2.5-1.5B"  # as setup_reasoning_model(<that folder>) saves it
    (path / "adapter_config.json").write_text(json.dumps(adapter))
    model = lora_model(seed=5)  # the same shapes and LoRA names, other weights
    model.config.name_or_path = "/models/Qwen2.5-1.5B-Instruct"
    run(model=model, max_steps=3, resume_from_checkpoint=path)


@case("resume-other-lora-alpha", ValueError, "trained with lora_alpha 8, and this model's adapter has lora_alpha 64",
      "8x as strongly", "Set the model up with the checkpoint's LoRA settings")
def _(run):
    from peft import LoraConfig, get_peft_model

    path = _copied_checkpoint(run)  # lora_model(): r=4, lora_alpha=8
    model = get_peft_model(tiny_model("llama"), LoraConfig(r=4, lora_alpha=64, target_modules="all-linear"))
    run(model=model, max_steps=3, resume_from_checkpoint=path)


@case("resume-seed-not-applied", UserWarning, "seed 42 -> 7, which a resume does not apply",
      "continues the checkpoint's random streams", "Start a new run, without resume_from_checkpoint")
def _(run):
    run(max_steps=3, seed=7, resume_from_checkpoint=_copied_checkpoint(run))


@case("resume-other-world-size", UserWarning, "which 2 processes trained, with 1 process: each step now draws 2 "
      "prompts (was 4; 2 per process)", "resume with 2 processes", "by 2/1")
def _(run):
    path = _edited_checkpoint(run, lambda state: state["sampler"].update(world_size=2))  # as a 2-process run wrote it
    run(max_steps=3, resume_from_checkpoint=path)


@case("resume-other-rewards-or-data", UserWarning, "reward functions ['count_w7'] -> ['length_reward']",
      "a dataset of 16 rows (it was trained on 8", "rewards before and after measure different things")
def _(run):
    def length_reward(completion_ids, **kwargs):
        return [float(len(ids)) for ids in completion_ids]

    run(dataset(16), length_reward, max_steps=3, resume_from_checkpoint=_copied_checkpoint(run))


@case("resume-a-run-that-saved-no-checkpoint", FileNotFoundError, "has no checkpoint-<step> folder to resume from",
      "It holds the adapter a finished run saved", "is_trainable=True), then train(model, ..., output_dir=<a new",
      "replaces this one when it ends")
def _(run):
    run(max_steps=1, save_steps=0)  # the quickstart's setting: only the final adapter
    run(max_steps=2, resume_from_checkpoint=True)  # "raise max_steps to train further"


@case("train-an-adapter-loaded-for-inference", ValueError, "no trainable parameters. Its adapter was loaded for "
      "inference", "peft.PeftModel.from_pretrained(<its base model>, <the adapter's folder>, is_trainable=True)")
def _(run):
    from peft import PeftModel

    lora_model().save_pretrained(run.tmp_path / "adapter")  # a finished run's output_dir, as load_for_inference loads it
    run(model=PeftModel.from_pretrained(tiny_model("llama", seed=0), run.tmp_path / "adapter"))


@case("tensorboard-logging-dir-shared-by-runs", None)
def _(run):
    logs = run.tmp_path / "logs"  # logging_dir="./logs" for every experiment, HF's habit
    run(report_to="tensorboard", logging_dir=str(logs), output_dir=str(run.tmp_path / "a"))
    run(report_to="tensorboard", logging_dir=str(logs), output_dir=str(run.tmp_path / "b"))
    assert len([p for p in logs.iterdir() if p.is_dir()]) == 2  # a folder per run: the second hides none of the first


@case("resume-fork-into-another-runs-folder", ValueError, "holds another run's checkpoints (up to checkpoint-1)",
      "starts a run of its own (a fork)", "delete them to keep the newest", "Resume into a new output_dir")
def _(run):
    other = run.tmp_path / "other"
    run(max_steps=1, save_steps=1, output_dir=str(other))  # another run's checkpoint, rotation would delete it
    run(max_steps=3, save_total_limit=1, output_dir=str(other), resume_from_checkpoint=_copied_checkpoint(run))


@case("resume-merged-finetune-on-its-base", ValueError, "has other weights in its decoder layers",
      "a fine-tune merged from a LoRA adapter", "An adapter means something only on the base model")
def _(run):
    path = _copied_checkpoint(run)  # trained on lora_model(): resumed on a "merged" fine-tune of the same base
    model = lora_model()
    with torch.no_grad():  # what merge_and_unload does: decoder weights move, embedding and final norm stay
        for name, p in model.named_parameters():
            if "base_layer" in name:
                p.add_(0.05 * torch.randn_like(p))
    run(model=model, max_steps=3, resume_from_checkpoint=path)


@case("resume-named-adapter-other-lora-alpha", ValueError, "trained with lora_alpha 8, and this model's adapter has "
      "lora_alpha 64", "8x as strongly")
def _(run):
    from peft import LoraConfig, get_peft_model

    def named(alpha):  # peft saves an adapter named other than "default" in <folder>/<name>/
        return get_peft_model(tiny_model("llama"), LoraConfig(r=4, lora_alpha=alpha, target_modules="all-linear"),
                              adapter_name="grpo")
    run(model=named(8), max_steps=1, save_steps=1, output_dir=str(run.tmp_path / "named"))
    run(model=named(64), max_steps=2, resume_from_checkpoint=run.tmp_path / "named" / "checkpoint-1")


@case("resume-target-modules-other-spelling", None)
def _(run):
    from peft import LoraConfig, get_peft_model

    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # = "all-linear" here
    model = get_peft_model(tiny_model("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=every))
    run(model=model, max_steps=3, resume_from_checkpoint=_copied_checkpoint(run))


@case("full-finetune-rerun-replaces-its-model", UserWarning, "holds the model an earlier run saved",
      "will replace it when it ends")
def _(run):
    from grpo_nb.models import prepare_for_training

    for _ in range(2):  # the training cell run twice, save_steps=0: the second replaces the first's model
        run(model=prepare_for_training(tiny_model("llama"), lora_rank=None), max_steps=1, save_steps=0, beta=0.0)


@case("resume-full-finetune-other-config", ValueError, "trained fully under another model config",
      "rms_norm_eps 1e-06 -> 0.01", "Load the model the checkpoint was trained from")
def _(run):
    from grpo_nb.models import prepare_for_training

    def full(eps):
        model = tiny_model("llama")
        model.config.rms_norm_eps = eps  # (the layers read it when built: the point is the config, compared)
        return prepare_for_training(model, lora_rank=None)
    run(model=full(1e-6), max_steps=1, save_steps=1, beta=0.0, output_dir=str(run.tmp_path / "full"))
    run(model=full(1e-2), max_steps=2, beta=0.0, resume_from_checkpoint=run.tmp_path / "full" / "checkpoint-1")


@case("tensorboard-logging-dir-inside-output-dir", None)
def _(run):
    import contextlib
    import io

    out = run.tmp_path / "out"

    def stop(completions, **kwargs):
        raise KeyboardInterrupt  # stopped before its first checkpoint: only TensorBoard's folder is left
    with contextlib.redirect_stdout(io.StringIO()):
        run(rewards=stop, report_to="tensorboard", logging_dir=str(out), output_dir=str(out))
    run(report_to="tensorboard", logging_dir=str(out), output_dir=str(out))  # the same cell again



@case("resume-fork-into-the-checkpoint-itself", ValueError, "is the checkpoint folder", "over the files that "
      "checkpoint resumes from", "deletes the folder, with everything in it", "Pass an output_dir outside it")
def _(run):
    path = _copied_checkpoint(run)  # its run's rotation (save_total_limit) would delete the fork with it
    run(max_steps=3, output_dir=str(path), resume_from_checkpoint=path)


@case("resume-run-folder-into-itself", ValueError, "not a grpo-nb training checkpoint",
      "pass one of the checkpoints in it", "or True with output_dir=")
def _(run):
    folder = _copied_checkpoint(run).parent  # the run's folder, not one of its checkpoints: no fork either
    run(max_steps=3, output_dir=str(folder), resume_from_checkpoint=folder)


@case("load-for-inference-gemma-on-t4", UserWarning, "load_for_inference(dtype='auto'): loading in float32, not "
      "float16: gemma2 models overflow float16")
def _(run):
    from transformers import AutoModelForCausalLM, Gemma2Config

    from grpo_nb import load_for_inference

    folder = run.tmp_path / "gemma2"
    AutoModelForCausalLM.from_config(Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, head_dim=8,
                                                  num_hidden_layers=1, num_attention_heads=2,
                                                  num_key_value_heads=1)).save_pretrained(folder)
    run.tok.save_pretrained(folder)
    for name, fake in (("is_available", lambda: True), ("get_device_capability", lambda device=None: (7, 5)),
                       ("get_device_name", lambda device=None: "Tesla T4")):  # a T4: no native bfloat16
        run.monkeypatch.setattr(torch.cuda, name, fake)
    loaded = AutoModelForCausalLM.from_pretrained

    def load(*args, **kwargs):
        model = loaded(*args, **kwargs)
        model.to = lambda *_, **__: model  # no GPU here to move it to
        return model
    run.monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", load)
    model, _ = load_for_inference(folder)
    assert model.dtype == torch.float32  # not float16: inf/NaN logits, empty generations


@case("plan-for-gpu-per-layer-sizes", ValueError, "gives every layer its own intermediate_size ([16384, ... x35])",
      "the planner does not support such models", "Measure one instead")
def _(run):
    from transformers import Gemma3nTextConfig

    from grpo_nb import plan_for_gpu

    plan_for_gpu("T4", Gemma3nTextConfig())  # Gemma 3n's config.json: one intermediate_size a layer

# ----------------------------------------------------------------------------- reward values and TRL's reward contract (issue 25)

@case("reward-overflows-float32", RewardFunctionError, "'huge'", "returned 1e+39 at index 0", "float32",
      "Scale the rewards down")
def _(run):
    def huge(completions, **kwargs):
        return [1e39] * len(completions)  # finite in float64, inf in the float32 rewards tensor
    run(rewards=huge)


@case("reward-int-too-big", RewardFunctionError, "'factorial'", "an int of about 402 digits at index 0",
      "too big for a float")
def _(run):
    def factorial(completions, **kwargs):
        return [10**401] * len(completions)  # float() would raise OverflowError
    run(rewards=factorial)


@case("reward-numpy-0d", None)
def _(run):
    import numpy as np

    history = run(rewards=lambda completions, **kw: [np.array(float(c.count("w"))) for c in completions])
    assert history[0]["reward"] > 0  # 0-d arrays are numbers, like 0-d tensors


@case("reward-async", None)
def _(run):
    import asyncio

    async def judge(completions, **kwargs):  # e.g. a call to an LLM judge
        await asyncio.sleep(0)
        return [float(c.count("w")) for c in completions]
    assert run(rewards=judge)[0]["reward"] > 0  # awaited, on grpo-nb's own event loop (fine in Jupyter too)


@case("reward-async-raises", RewardFunctionError, "'judge'", "ZeroDivisionError", "sample 0", "completion is")
def _(run):
    async def judge(completions, **kwargs):
        return [1 / 0 for c in completions]
    run(rewards=judge)


@case("reward-log-metric", None)
def _(run):
    def parsed(completions, log_extra, log_metric, **kwargs):
        log_extra("words", [len(c.split()) for c in completions])  # a column of the completions table
        log_metric("parsed_fraction", 0.25)  # averaged per step into record["metrics"]
        return [0.0] * len(completions)
    history = run(rewards=parsed, log_completions_path=run.tmp_path / "completions.jsonl")
    assert history[0]["metrics"] == {"parsed_fraction": 0.25}
    assert history[0]["samples"][0]["extra"]["words"] == len(history[0]["samples"][0]["completion"].split())
    assert '"words": ' in (run.tmp_path / "completions.jsonl").read_text()


@case("reward-log-extra-wrong-count", RewardFunctionError, "'tagged'", "log_extra('tag', values)", "got 1 values",
      "one value per completion (8)")
def _(run):
    def tagged(completions, log_extra, **kwargs):
        log_extra("tag", ["one"])
        return [0.0] * len(completions)
    run(rewards=tagged)


@case("reward-column-named-log-metric", ValueError, "['log_metric']", "clash", "rename_column")
def _(run):
    run(Dataset.from_dict({"prompt": ["w5"] * 4, "log_metric": ["x"] * 4}))


@case("reward-some-unscored", UserWarning, "completion(s) of step 1 got no score", "every reward function (answer)",
      "advantage 0", "unscored_completions", "max_unscored_steps=5")
def _(run):
    def answer(completions, **kwargs):  # e.g. a gold answer it cannot parse: None for those completions
        return [None if i % 4 == 0 else float(c.count("w")) for i, c in enumerate(completions)]
    history = run(rewards=answer)
    assert history[0]["unscored_completions"] == 2 and history[0]["samples"][0]["advantage"] == 0.0


@case("weighted-reward-without-kwargs", None)
def _(run):
    from grpo_nb import weighted_reward

    def words(completions):  # no **kwargs: weighted_reward passes it only what it names
        return [float(len(c.split())) for c in completions]
    assert run(rewards=weighted_reward([words, count_w7], [1.0, 2.0]))[0]["reward"] > 0


@case("config-max-unscored-steps-zero", ValueError, "GRPOConfig.max_unscored_steps=0 is invalid", "integer >= 1")
def _(run):
    run(max_unscored_steps=0)


@case("reward-edits-its-inputs", None)
def _(run):
    rows = [{"prompt": [{"role": "user", "content": f"w{5 + i} w{9 + i}"}], "tags": ["t"]} for i in range(4)]
    before, seen = repr(rows), []

    def normalise(prompts, completions, tags, **kwargs):  # edits in place: a message, a completion, a column's list
        for p, c, t in zip(prompts, completions, tags):
            p[-1]["content"] += " w7"
            c[0]["content"] = c[0]["content"].upper()
            t.append("seen")
        return [0.0] * len(completions)

    def second(completions, tags, **kwargs):
        seen.extend((c[0]["content"], t) for c, t in zip(completions, tags))
        return [float(c[0]["content"].count("w")) for c in completions]
    history = run(rows, rewards=[normalise, second])
    assert repr(rows) == before and all(t == ["t"] for _, t in seen)  # the dataset, and what `second` got
    samples = history[0]["samples"]
    assert [text for text, _ in seen[:len(samples)]] == [s["completion"] for s in samples]  # not upper-cased


@case("reward-log-extra-numpy-values", None)
def _(run):
    import numpy as np

    def counts(completions, log_extra, **kwargs):  # list(np.array(...)) gives np.int64; a tensor's items 0-d tensors
        log_extra("words", list(np.array([len(c.split()) for c in completions])))
        log_extra("objects", [object()] * len(completions))
        return [0.0] * len(completions)
    history = run(rewards=counts)  # the final save writes the history: it holds Python numbers and text
    assert type(history[0]["samples"][0]["extra"]["words"]) is int
    assert history[0]["samples"][0]["extra"]["objects"].startswith("<object object")


@case("reward-logs-after-returning", UserWarning, "log_metric('late', ...) in reward function 'leaves'",
      "came after the function returned", "the value is dropped")
def _(run):
    from grpo_nb import preview_rewards

    kept = []

    def leaves(completions, log_metric, **kwargs):
        kept.append(log_metric)  # e.g. for a thread or task it leaves running
        return [float(c.count("w")) for c in completions]
    preview_rewards(leaves, ["w5 w7"])  # train() and evaluate() close the step's log the same way
    kept[0]("late", 1.0)


@case("reward-trainer-state-outside-train", None)
def _(run):
    from grpo_nb import evaluate

    def curriculum(completions, trainer_state, **kwargs):  # TRL passes trainer_state everywhere it scores
        return [float(trainer_state.global_step)] * len(completions)
    assert evaluate(lora_model(), run.tok, dataset(2), [curriculum], max_completion_length=2)["rewards"] == {
        "curriculum": 0.0}  # a TrainerState that has not trained (global_step=0, max_steps=0), as TRL's


@case("reward-weighted-total-overflows-float32", RewardFunctionError, "weighted total reward of completion 0",
      "reward_weights=[2e+38, 1]", "beyond float32's range", "scale the rewards or the reward_weights down")
def _(run):
    def two(completions, **kwargs):
        return [2.0] * len(completions)
    run(rewards=[two, count_w7], reward_weights=[2e38, 1.0])  # each value fits float32; their 4e38 does not


@case("reward-async-blocks-the-loop", RewardFunctionError, "'blocking_judge' did not return within reward_timeout",
      "'blocking_judge' (line", "is blocking it", "asyncio.to_thread", "fresh event loop")
def _(run):
    import asyncio
    import time

    from grpo_nb import reward_calls

    run.monkeypatch.setattr(reward_calls, "_LOOP_PROBE_S", 0.1)

    async def judge(completions, **kwargs):
        await asyncio.sleep(0.2)
        return [1.0] * len(completions)

    async def blocking_judge(completions, **kwargs):
        time.sleep(2)  # a synchronous call inside async def holds the loop every async function shares
        return [1.0] * len(completions)
    run(rewards=[judge, blocking_judge], reward_timeout=0.5)


@case("reward-is-a-loaded-model", TypeError, "<LlamaForCausalLM> is a loaded model", "def rm_reward(prompts, "
      "completions, **kwargs)")
def _(run):
    run(rewards=[tiny_model("llama")])  # TRL takes reward models; grpo-nb takes functions


@case("weighted-reward-part-raises", RewardFunctionError, "'1*count_w7+2*parse'", "ValueError",
      "(raised by 'parse', weight 2, inside weighted_reward)")
def _(run):
    from grpo_nb import weighted_reward

    def parse(completions, **kwargs):
        return [float(c) for c in completions]
    run(rewards=weighted_reward([count_w7, parse], [1.0, 2.0]))


@case("reward-returns-decimal-or-pandas-na", None)
def _(run):
    from decimal import Decimal

    import pandas as pd

    def exact(completions, **kwargs):  # e.g. from a Decimal computation, or a pandas lookup that found nothing
        return [pd.NA if i % 4 == 0 else Decimal(c.count("w")) for i, c in enumerate(completions)]
    with pytest.warns(UserWarning, match="got no score"):
        history = run(rewards=exact)
    assert history[0]["unscored_completions"] == 2 and history[0]["reward"] > 0


@case("reward-numpy-masked-value", None)
def _(run):
    import numpy as np

    def parsed(completions, **kwargs):  # unparsable completions masked out, then read one value at a time
        raw = np.ma.masked_invalid([float(c.count("w")) if i % 4 else np.nan for i, c in enumerate(completions)])
        return [raw[i] for i in range(len(completions))]
    with pytest.warns(UserWarning, match="got no score"):
        history = run(rewards=parsed)
    assert history[0]["unscored_completions"] == 2  # not two rewards of 0.0


@case("reward-value-unreadable", RewardFunctionError, "reward function 'exact' returned Decimal('sNaN') (Decimal) "
      "at index 0, which cannot be read as a number (ValueError: cannot convert signaling NaN to float)",
      "Completion 0:")
def _(run):
    from decimal import Decimal

    def exact(completions, **kwargs):
        return [Decimal("sNaN")] + [Decimal(1)] * (len(completions) - 1)
    run(rewards=exact)


@case("reward-name-not-text", None)
def _(run):
    class Judge:
        __name__ = 42  # a callable object with a stray __name__

        def __call__(self, completions, **kwargs):
            return [float(c.count("w")) for c in completions]
    history = run(rewards=[Judge()], save_steps=1)
    assert list(history[0]["rewards"]) == ["Judge"]
    assert [r["step"] for r in run(rewards=[Judge()], max_steps=2, resume_from_checkpoint=True)] == [1, 2]


@case("dataset-formatted-for-pandas", None)
def _(run):
    seen = []

    def paired(completions, answer, **kwargs):
        seen.extend(answer)
        return [float(c.count("w")) for c in completions]
    run(dataset().with_format("pandas"), rewards=paired)  # before: TypeError: string indices must be integers
    assert seen and all(isinstance(a, str) for a in seen)  # each row's own answer, as stored


@case("config-seed-too-big", ValueError, "GRPOConfig.seed=1180591620717411303424 is invalid",
      "an integer in [0, 2**63)")
def _(run):
    run(seed=2**70)


@case("config-greedy-sampling", ValueError, "GRPOConfig.top_k=1 is invalid", "keeps only the likeliest token",
      "every completion of a group would be the same")
def _(run):
    run(top_k=1)


@case("reward-needs-dataset-completion-column", ValueError, "'graded' needs the argument 'completion'",
      "not passed to reward functions (as in TRL)", "'completions'", "rename_column('completion', 'reference')")
def _(run):
    def graded(completions, completion, **kwargs):
        return [float(c == ref) for c, ref in zip(completions, completion)]
    run(Dataset.from_dict({"prompt": ["w5", "w6"] * 2, "completion": ["w7", "w8"] * 2}), rewards=graded)


@case("reward-column-named-completion-ids", ValueError, "['completion_ids']", "clash", "rename_column")
def _(run):
    run(Dataset.from_dict({"prompt": ["w5", "w6"] * 2, "completion_ids": [[1], [2]] * 2}))


@case("reward-is-a-class", TypeError, "'Judge' is a class", "reward_funcs=[Judge()]")
def _(run):
    class Judge:
        def __call__(self, completions, **kwargs):
            return [0.0] * len(completions)
    run(rewards=[Judge])


@case("report-to-wandb-project-invalid", ValueError, "GRPOConfig.project='../../x' is invalid",
      "W&B", "it contains '/'", "project='x'")
def _(run):
    run(report_to="wandb", project="../../x")


@case("correctness-reward-money-or-percent", None)
def _(run):
    from grpo_nb.rewards import correctness_reward

    got = correctness_reward(["<answer>$18</answer>", "<answer>18</answer>", "<answer>1/2</answer>"],
                             ["18", "18%", "0.5"])
    assert got == [2.0, 2.0, 0.0]


@case("trl-callback-unreadable-log-value", None)
def _(run):
    from types import SimpleNamespace

    from grpo_nb_widgets.trl_callback import GrpoNbDashboardCallback

    callback = GrpoNbDashboardCallback(live=False)
    callback.on_log(SimpleNamespace(), SimpleNamespace(global_step=1), None, logs={"reward": 10**400, "loss": "high"})
    assert "reward" not in callback.history[0] and "loss" not in callback.history[0]


@case("train-merged-model-at-a-lora-rate", UserWarning, "train(model=...) has no LoRA adapter", "(full fine-tuning)",
      "at learning_rate=0.0001", "prepare_for_training(model, lora_rank=16)", "setup_reasoning_model(folder)")
def _(run):
    from grpo_nb import load_for_inference, save_merged

    save_merged(lora_model(), run.tmp_path / "merged", run.tok)  # "continuing" from the merged model: no adapter
    model, tok = load_for_inference(run.tmp_path / "merged")
    run(model=model, tok=tok, learning_rate=1e-4, beta=0.0)



@case("model-without-a-kv-cache", ValueError, "rollout='native' decodes with a KV cache",
      "RecurrentGemmaForCausalLM", "use rollout='auto' or 'hf'")
def _(run):  # before (probe P34 F1): a raw AttributeError 'CausalLMOutput' object has no attribute 'cache'
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, RecurrentGemmaConfig

    cfg = RecurrentGemmaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, lru_width=64, attention_window_size=16,
                               conv1d_width=4, block_types=["recurrent", "attention"], bos_token_id=1, eos_token_id=2,
                               pad_token_id=0, head_dim=16)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_config(cfg), LoraConfig(r=4, lora_alpha=8,
                                                                              target_modules="all-linear"))
    history = run(model=model)  # rollout="auto": HF generate, which keeps the model's own state
    assert len(history) == 1
    run(model=model, rollout="native", output_dir=str(run.tmp_path / "native"))


# ----------------------------------------------------------------------------- tools and environments (issue 28)

def _agent(run, reply, rewards=None, **overrides):
    """train() with tools on the tiny model, a byte-level tokenizer (any text encodes) and scripted turns."""
    import warnings

    from tiny_models import Scripted, byte_tokenizer, chat

    tok = byte_tokenizer()
    model = lora_model()
    model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    model.config.max_position_embeddings = 2048  # room for the tools' schemas (byte tokens) and the turns
    settings = dict(num_generations=2, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                    max_completion_length=300, max_prompt_length=None, rollout=Scripted(reply))
    settings.update(overrides)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The tokenizer's chat template")  # grpo-nb's tool template, said once
        return run(ds=chat(4), rewards=rewards or (lambda completions, **kw: [float(len(c)) for c in completions]),
                   model=model, tok=tok, **settings)


def _calls(call):
    """A reply that writes `call` in its first turn and "done" after a tool's result."""
    return lambda text, k: "done" if "<|im_start|>tool" in text else call


class _Moves:
    """An environment's one tool, for the cases about its other parts."""

    def move(self, x: int) -> int:
        """
        Moves.

        Args:
            x: Where.
        """
        return x


def _hangs(seconds: float) -> int:
    """
    Sleeps.

    Args:
        seconds: How long.
    """
    import time

    time.sleep(seconds)
    return 0


@case("tool-without-type-hints-or-docstring", ValueError, "The tool 'lookup' cannot be offered to the model",
      "Google-style docstring", "Args:")
def _(run):
    def lookup(key):
        return key

    _agent(run, _calls("x"), tools=[lookup])


@case("tools-not-a-list", TypeError, "tools=<function multiply", "must be a list of functions", "tools=[multiply]")
def _(run):
    from tiny_models import multiply

    _agent(run, _calls("x"), tools=multiply)


@case("two-tools-with-one-name", ValueError, "two tools are named 'multiply'", "each needs its own")
def _(run):
    from tiny_models import multiply

    _agent(run, _calls("x"), tools=[multiply, multiply])


@case("tool-raises", None)
def _(run):
    def fails(x: int) -> int:
        """
        Always raises.

        Args:
            x: Anything.
        """
        raise RuntimeError("the sandbox is down")

    seen = []
    history = _agent(run, _calls('<tool_call>{"name": "fails", "arguments": {"x": 1}}</tool_call>'), tools=[fails],
                     rewards=lambda completions, **kw: seen.extend(completions) or [0.0] * len(completions))
    assert history[-1]["metrics"]["tools/failure_frequency"] == 1.0
    assert "RuntimeError: the sandbox is down" in seen[0][1]["content"] and seen[0][-1]["content"] == "done"


@case("tool-hangs", None)
def _(run):
    import time

    started = time.perf_counter()
    history = _agent(run, _calls('<tool_call>{"name": "_hangs", "arguments": {"seconds": 30}}</tool_call>'),
                     tools=[_hangs], tool_timeout=0.2)
    assert history[-1]["metrics"]["tools/failure_frequency"] == 1.0 and time.perf_counter() - started < 25


@case("tool-returns-an-object-or-a-huge-string", None)
def _(run):
    def big(kind: str) -> str:
        """
        Returns something odd.

        Args:
            kind: Which.
        """
        return {"set": {1, 2}, "huge": "x" * 10_000_000}[kind]

    seen = []
    reply = lambda text, k: "done" if "<|im_start|>tool" in text else (  # noqa: E731
        '<tool_call>{"name": "big", "arguments": {"kind": "%s"}}</tool_call>' % ("set" if k == 0 else "huge"))
    _agent(run, reply, tools=[big], rewards=lambda completions, **kw: seen.extend(completions) or [0.0] * 4)
    assert seen[0][1]["content"] == '"{1, 2}"'  # as JSON, its text
    assert [m["role"] for m in seen[1]] == ["assistant"]  # too long for the budget: left out, the episode ends


@case("tool-returns-bytes", None)
def _(run):
    def shell(command: str) -> bytes:
        """
        Runs a command.

        Args:
            command: What to run.
        """
        return b"line1\nline2 \xff\n"  # subprocess.check_output's: bytes, here with one that is not UTF-8

    seen = []
    _agent(run, _calls('<tool_call>{"name": "shell", "arguments": {"command": "ls"}}</tool_call>'), tools=[shell],
           rewards=lambda completions, **kw: seen.extend(completions) or [0.0] * 4)
    assert seen[0][1]["content"] == "line1\nline2 \ufffd\n"  # the text, not the literal "b'line1\\nline2 ...'"


@case("tool-call-to-an-unknown-tool", None)
def _(run):
    from tiny_models import multiply

    seen = []
    _agent(run, _calls('<tool_call>{"name": "divide", "arguments": {}}</tool_call>'), tools=[multiply],
           rewards=lambda completions, **kw: seen.extend(completions) or [0.0] * 4)
    assert "unknown tool 'divide'; the tools are: multiply" in seen[0][1]["content"]


@case("tool-call-malformed-json", None)
def _(run):
    from tiny_models import multiply

    seen = []
    _agent(run, _calls('<tool_call>{"name": "multiply", "arguments": {"a": 3,</tool_call>'), tools=[multiply],
           rewards=lambda completions, **kw: seen.extend(completions) or [0.0] * 4)
    assert "malformed tool call JSON" in seen[0][1]["content"] and seen[0][-1]["content"] == "done"


@case("tool-calls-without-end", None)
def _(run):
    from tiny_models import multiply

    history = _agent(run, lambda text, k: '<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}</tool_call>',
                     tools=[multiply], max_completion_length=400)
    # no max_tool_calling_iterations: the token budget over the whole episode ends it
    assert 1 < history[-1]["metrics"]["tools/turns"] < 10 and history[-1]["completion_length_max"] <= 400


@case("environment-without-reset", ValueError, "the environment Counter has no reset() method",
      "env.reset(**row)")
def _(run):
    class Counter:
        def increment(self, a: int) -> int:
            """
            Adds.

            Args:
                a: How much.
            """
            return a

    _agent(run, _calls("x"), environment_factory=Counter)


@case("environment-reset-raises", RuntimeError, "Broken.reset() failed for dataset row 0", "KeyError",
      "called with the row's columns as keywords (prompt, answer)")
def _(run):
    class Broken:
        def reset(self, **row):
            return row["level"]

        def act(self, x: int) -> int:
            """
            Acts.

            Args:
                x: A move.
            """
            return x

    _agent(run, _calls("x"), environment_factory=Broken)


@case("environment-reset-returns-a-dict", TypeError, "Game.reset() returned dict", "must return None, or a string")
def _(run):
    class Game(_Moves):
        def reset(self, **row):
            return {"board": "..."}

    _agent(run, _calls("x"), environment_factory=Game)


@case("environment-get-reward-nan", RewardFunctionError, "reward function 'Scored' returned nan",
      "Rewards must be finite")
def _(run):
    class Scored(_Moves):
        def reset(self, **row):
            return None

        def get_reward(self) -> float:
            return float("nan")

    _agent(run, _calls("x"), environment_factory=Scored)


@case("environments-without-an-environment-column", ValueError, "environment=None is not one of the environments",
      "'a', 'b'", "needs an 'environment' column")
def _(run):
    class A(_Moves):
        def reset(self, **row):
            return None

    _agent(run, _calls("x"), environment_factory={"a": A, "b": A})


@case("environment-column-names-no-factory", ValueError, "Dataset row 5: environment='A' is not one of the "
      "environments passed as environment_factory ('a')", "Fix the rows' values")
def _(run):
    # before (P43 F5): found when the sampler first drew row 5, after steps and checkpoints, and named "Dataset row
    # 0" (its place in the batch)
    from tiny_models import Scripted, byte_tokenizer, chat

    class A(_Moves):
        def reset(self, **row):
            return None

    rows = [dict(r, environment="a") for r in chat(8)]
    rows[5]["environment"] = "A"  # a typo in one row
    tok = byte_tokenizer()
    model = lora_model()
    model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    model.config.max_position_embeddings = 2048
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The tokenizer's chat template")
            run(ds=rows, rewards=lambda completions, **kw: [0.0] * len(completions), model=model, tok=tok,
                environment_factory={"a": A}, num_generations=2, per_device_train_batch_size=4,
                gradient_accumulation_steps=1, max_completion_length=300, max_prompt_length=None,
                rollout=Scripted(_calls("x")), max_steps=4, save_steps=1)
    finally:
        assert not ckpt.checkpoints(run.tmp_path / "run")


@case("evaluate-environment-column-names-no-factory", ValueError, "Dataset row 5: environment='A' is not one of the "
      "environments passed as environment_factory ('a', 'b')")
def _(run):
    # before (P45 F1): evaluate() found it when row 5's batch came up, the batches before it generated and thrown
    # away, and named the row's place in its batch
    from grpo_nb import evaluate
    from tiny_models import byte_tokenizer, chat

    class A(_Moves):
        def reset(self, **row):
            return None

    rows = [dict(r, environment="a") for r in chat(6)]
    rows[5]["environment"] = "A"
    tok = byte_tokenizer()
    model = tiny_model()
    model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    model.config.max_position_embeddings = 2048
    calls = []
    model.register_forward_pre_hook(lambda *args: calls.append(1))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The tokenizer's chat template")
        try:
            evaluate(model, tok, rows, environment_factory={"a": A, "b": A}, max_completion_length=8, batch_size=2)
        finally:
            assert not calls  # refused before any generating


@case("environment-column-of-ints-for-names", ValueError, "Dataset row 0: environment=0 is not one of the "
      "environments passed as environment_factory ('0', '1')", "(the int 0, where the dict's names are strings: "
      "'0' is one)")
def _(run):
    from tiny_models import Scripted, byte_tokenizer, chat

    class A(_Moves):
        def reset(self, **row):
            return None

    tok = byte_tokenizer()
    model = lora_model()
    model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    model.config.max_position_embeddings = 2048
    run(ds=[dict(r, environment=i % 2) for i, r in enumerate(chat(4))], model=model, tok=tok,
        rewards=lambda completions, **kw: [0.0] * len(completions), environment_factory={"0": A, "1": A},
        num_generations=2, per_device_train_batch_size=4, gradient_accumulation_steps=1, max_completion_length=300,
        max_prompt_length=None, rollout=Scripted(_calls("x")), max_steps=1)


@case("tools-with-a-template-without-tool-support", UserWarning, "cannot render tool calls",
      "grpo-nb sets its own training template", "saved with this tokenizer")
def _(run):
    from tiny_models import Scripted, byte_tokenizer, chat, multiply

    tok = byte_tokenizer()
    model = lora_model()
    model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    model.config.max_position_embeddings = 2048
    run(ds=chat(4), rewards=lambda completions, **kw: [0.0] * len(completions), model=model, tok=tok, num_generations=2, per_device_train_batch_size=4,
        gradient_accumulation_steps=1, max_completion_length=300, max_prompt_length=None,
        rollout=Scripted(_calls("done")), tools=[multiply])


def _named_templates(run, templates):
    """train() with tools, the byte-level tokenizer's chat_template set to `templates(tok)`: named templates."""
    from grpo_nb.tools import tool_chat_template
    from tiny_models import Scripted, byte_tokenizer, chat, multiply

    tok = byte_tokenizer()
    tok.chat_template = templates(tool_chat_template(tok))
    model = lora_model()
    model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    model.config.max_position_embeddings = 2048
    run(ds=chat(4), rewards=lambda completions, **kw: [0.0] * len(completions), model=model, tok=tok,
        num_generations=2, per_device_train_batch_size=4, gradient_accumulation_steps=1, max_completion_length=300,
        max_prompt_length=None, rollout=Scripted(_calls("done")), tools=[multiply])
    return tok


_NO_TOOLS = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


@case("tools-named-template-tool-use-without-tool-support", UserWarning, "tokenizer.chat_template['tool_use'] (the "
      "template transformers renders with when tools are given) cannot render tool calls",
      "sets 'tool_use' to the 'default' template, which does")
def _(run):
    # before (P39 F2): the prompts were rendered by "tool_use" (no tools shown), the tools' results by "default"
    tok = _named_templates(run, lambda tools: {"default": tools, "tool_use": _NO_TOOLS})
    assert tok.chat_template["tool_use"] == tok.chat_template["default"]


@case("chat-template-named-value-not-a-string", TypeError, "tokenizer.chat_template['tool_use'] is None (NoneType), "
      "not a template", "del tokenizer.chat_template['tool_use']")
def _(run):
    _named_templates(run, lambda tools: {"default": tools, "tool_use": None})


@case("chat-template-named-without-default", ValueError, "tokenizer.chat_template holds named templates ('tool_use') "
      "but no 'default'", "tokenizer.chat_template['default'] = tokenizer.chat_template['tool_use']")
def _(run):
    _named_templates(run, lambda tools: {"tool_use": tools})


@case("chat-template-named-value-not-a-string-without-tools", TypeError, "tokenizer.chat_template['default'] is None "
      "(NoneType), not a template")
def _(run):
    from tiny_models import byte_tokenizer, chat

    tok = byte_tokenizer()
    tok.chat_template = {"default": None, "tool_use": _NO_TOOLS}
    model = lora_model()
    model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    run(ds=chat(4), model=model, tok=tok, num_generations=2, per_device_train_batch_size=4, max_prompt_length=None)


@case("chat-template-empty-dict-with-tools", None)
def _(run):
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The tokenizer's chat template")  # grpo-nb's tool template, said once
        tok = _named_templates(run, lambda tools: {})
    assert isinstance(tok.chat_template, str)  # grpo-nb's template, not a dict without "default"


@case("tools-named-template-tool-use-opens-no-assistant-turn", UserWarning, "the chat template 'tool_use' "
      "(tokenizer.chat_template['tool_use'], which this run renders its prompts with, as tools are given) opens no "
      "assistant turn", "{% if add_generation_prompt %}<|im_start|>assistant")
def _(run):
    # before (P42 F6): the prompt checks rendered 'default'; a 'tool_use' without its generation prompt trained
    # silently on prompts that end after the user's turn
    def without_generation_prompt(tools):
        return {"default": tools, "tool_use": tools[:tools.rindex("{% if add_generation_prompt %}")]}

    _named_templates(run, without_generation_prompt)


@case("tools-named-templates-replaced-no-false-warning", None)
def _(run):
    # before (P42 F7): {"default": X, "tool_use": X} with X rendering no tools and opening no assistant turn: grpo-nb
    # renders with its own template, yet train() warned that "the chat template opens no assistant turn" (of X)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _named_templates(run, lambda tools: {"default": _NO_TOOLS, "tool_use": _NO_TOOLS})
    said = [str(w.message) for w in caught]
    assert not [m for m in said if "opens no assistant turn" in m], said
    assert [m for m in said if "grpo-nb sets its own training template" in m], said


@case("callback-adds-tokens", ValueError, "During step 1's callbacks a callback (train(callbacks=...)) changed the "
      "tokenizer", "(vocabulary)", "copy.deepcopy(tokenizer)", "no checkpoint-1 is written")
def _(run):
    # before (P42 F3): the callbacks ran outside the rollout's guard, before the step's checkpoint: checkpoint-1, every
    # later one and the final save held "<cb_tok>", a token the steps never trained with
    tok = prepare_tokenizer(tiny_tokenizer())

    def register(record):  # a logging helper that "registers" a marker
        tok.add_tokens(["<cb_tok>"])
    try:
        run(tok=tok, max_steps=2, save_steps=1, callbacks=[register])
    finally:
        assert not ckpt.checkpoints(run.tmp_path / "run")


@case("resume-with-tokens-added-since", ValueError, "Cannot resume from", "the tokenizer passed has 501 tokens (added: "
      "'<new_tok>'), the one its steps trained with 500", "this tokenizer object keeps them",
      "AutoTokenizer.from_pretrained(")
def _(run):
    # before (P42 F2): after a step refused for a tool's added token, resuming with the same tokenizer object was
    # accepted: checkpoint-2 on and the final save held the token (a prompt's encoding, compared on resume, does not
    # show it)
    tok = prepare_tokenizer(tiny_tokenizer(500))  # room in the model's 512 embedding rows for an added token
    run(tok=tok, max_steps=1, save_steps=1)
    tok.add_tokens(["<new_tok>"])
    try:
        run(tok=tok, max_steps=2, save_steps=1, resume_from_checkpoint=True)
    finally:
        assert [p.name for p in ckpt.checkpoints(run.tmp_path / "run")] == ["checkpoint-1"]


@case("resume-with-a-token-marked-special", UserWarning, "added or special tokens differ",
      "the same 512 tokens and each id means what it did", "AutoTokenizer.from_pretrained(")
def _(run):
    # before (P43 F9): refused, "has 512 tokens, the one its steps trained with 512 (other added tokens). Tokens
    # added since ... change what the ids mean", though no token was added and no id changed
    tok = prepare_tokenizer(tiny_tokenizer())
    run(tok=tok, max_steps=1, save_steps=1)
    tok.add_special_tokens({"additional_special_tokens": [tok.convert_ids_to_tokens(5)]})  # id 5, marked special
    run(tok=tok, max_steps=2, save_steps=1, resume_from_checkpoint=True)
    assert [p.name for p in ckpt.checkpoints(run.tmp_path / "run")] == ["checkpoint-1", "checkpoint-2"]


@case("chat-template-named-key-not-a-string", TypeError, "tokenizer.chat_template has the key 1 (int)",
      "reloads it as '1'", "tokenizer.chat_template['1'] = tokenizer.chat_template.pop(1)")
def _(run):  # before (P42 F8): accepted and saved; reloaded, the dict differed from the one trained with
    _named_templates(run, lambda tools: {"default": tools, 1: tools})


@case("chat-template-named-invalid-jinja", ValueError, "tokenizer.chat_template['rag'] is not valid Jinja (line 1",
      "del tokenizer.chat_template['rag']")
def _(run):  # before (P42 F8): accepted and shipped in additional_chat_templates/, failing whoever renders with it
    _named_templates(run, lambda tools: {"default": tools, "tool_use": tools, "rag": "{% if %}"})


@case("tools-with-plain-text-prompts", ValueError, "Tools and environments need chat prompts",
      "[{'role': 'user', 'content': ...}]")
def _(run):
    from tiny_models import multiply

    run(tools=[multiply])


@case("tools-with-rollout-hf", None)
def _(run):
    from tiny_models import multiply

    history = _agent(run, None, tools=[multiply], rollout="hf", max_completion_length=8)
    assert history[-1]["metrics"]["tools/turns"] >= 1.0


class _Counter:
    """An environment with one method (each case below changes one thing about it)."""

    def reset(self, **row):
        self.total = 0

    def increment(self, a: int) -> int:
        """
        Adds to the counter.

        Args:
            a: How much.
        """
        self.total += a
        return self.total


@case("tool-and-environment-method-with-one-name", ValueError, "tools=[...] and the environment Env's methods",
      "'multiply'", "one would silently replace the other")
def _(run):
    from tiny_models import multiply

    class Env(_Counter):
        def multiply(self, a: int, b: int) -> int:
            """
            Not a product.

            Args:
                a: One.
                b: Two.
            """
            return a + b

    _agent(run, _calls("x"), tools=[multiply], environment_factory=Env)


@case("environment-factory-empty-dict", ValueError, "environment_factory={} names no environment",
      "environment_factory=MyEnv")
def _(run):
    from tiny_models import multiply

    _agent(run, _calls("x"), tools=[multiply], environment_factory={})


@case("environment-class-needs-arguments", TypeError, "environment_factory=Board is called with no arguments",
      "'size'", "functools.partial(Board", "lambda: Board(")
def _(run):
    class Board(_Counter):
        def __init__(self, size):
            self.size = size

    _agent(run, _calls("x"), environment_factory=Board)


@case("environment-factory-returns-one-instance", ValueError, "returned the same _Counter instance for two episodes",
      "environment_factory=_Counter", "lambda: _Counter(")
def _(run):
    env = _Counter()
    _agent(run, _calls("x"), environment_factory=lambda: env)


def _openenv(step=None, reset=None, fields=None):
    """An in-process OpenEnv Environment class whose step()/reset() return what the given functions do."""
    pytest.importorskip("openenv", reason="OpenEnv is optional: pip install openenv (the dev extra has it)")
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State

    OpenAction = type("OpenAction", (Action,), {"__annotations__": fields or {"n": int}, "__doc__": "Moves."})

    class OpenGame(Environment[OpenAction, Observation, State]):
        def reset(self, seed=None, episode_id=None, **kwargs):
            return reset() if reset else Observation()

        def step(self, action, timeout_s=None, **kwargs):
            return step() if step else Observation(reward=1.0)

        @property
        def state(self):
            return State(step_count=0)

    return OpenGame


_OPENENV_CALL = '<tool_call>{"name": "step", "arguments": {"n": 1}}</tool_call>'


@case("openenv-factory-returns-one-environment", ValueError, "returned the same OpenGame instance for two episodes",
      "openenv_environment(OpenGame)")
def _(run):
    from grpo_nb import openenv_environment

    env = _openenv()()
    _agent(run, _calls("x"), environment_factory=openenv_environment(lambda: env))


@case("openenv-reset-returns-no-observation", RuntimeError, "reset() returned int 3", "openenv_environment reads",
      "gym-style (observation, info) tuple")
def _(run):
    from grpo_nb import openenv_environment

    _agent(run, _calls("x"), environment_factory=openenv_environment(_openenv(reset=lambda: 3)))


@case("openenv-tool-name-private", ValueError, "openenv_environment(tool_name='_step')", "starts with '_'",
      "pass another tool_name=")
def _(run):
    from grpo_nb import openenv_environment

    openenv_environment(_openenv(), tool_name="_step")  # it would replace the adapter's own _step


@case("openenv-action-nested-model", ValueError, "the action OpenAction's field 'inner'", "not supported yet",
      "flatten the action")
def _(run):
    from pydantic import BaseModel

    from grpo_nb import openenv_environment

    class Inner(BaseModel):
        x: int

    openenv_environment(_openenv(fields={"inner": Inner}))


@case("openenv-name-not-a-string", TypeError, "openenv_environment(name=3)", "a non-empty string")
def _(run):
    from grpo_nb import openenv_environment

    openenv_environment(_openenv(), name=3)


@case("openenv-reward-function-returns-none", RewardFunctionError, "openenv_environment(reward=<lambda>) returned "
      "NoneType None", "must return one float")
def _(run):
    from grpo_nb import openenv_environment

    _agent(run, _calls(_OPENENV_CALL), environment_factory=openenv_environment(_openenv(), reward=lambda r: None))


@case("openenv-step-reward-not-a-number", RewardFunctionError, "OpenGame.step() returned the reward [1.0] (list)",
      "as a number (int, float, a numpy number) or None", "The step ran")
def _(run):
    # before (P43 F2): the model read "TypeError: float() argument must be ..." as its own call's error, every
    # episode scored 0.0 and the run trained on, silent
    from grpo_nb import openenv_environment

    out = {"observation": "x", "reward": [1.0], "done": True}
    _agent(run, _calls(_OPENENV_CALL), environment_factory=openenv_environment(_openenv(step=lambda: out)))


@case("openenv-step-done-a-string", RewardFunctionError, "OpenGame.step() returned done='false' (str)",
      "bool('false') is True")
def _(run):  # before (P43 F3): bool("false") ended every episode at its first call, silent
    from grpo_nb import openenv_environment

    out = {"observation": "x", "reward": 1.0, "done": "false"}
    _agent(run, _calls(_OPENENV_CALL), environment_factory=openenv_environment(_openenv(step=lambda: out)))


@case("openenv-environment-needs-arguments", TypeError, "openenv_environment: env=Board is called with no arguments",
      "'size'", "openenv_environment(functools.partial(Board", "openenv_environment(lambda: Board(")
def _(run):  # before (P43 F4): a bare "Board.__init__() missing 1 required positional argument: 'size'"
    from grpo_nb import openenv_environment

    class Board(_openenv()):
        def __init__(self, size):
            super().__init__()
            self.size = size

    openenv_environment(Board)


@case("environment-get-reward-takes-arguments", TypeError, "Scored.get_reward() is called with no arguments",
      "'completion'", "the environment's own state (self)")
def _(run):
    class Scored(_Counter):
        def get_reward(self, completion) -> float:
            return float(len(completion))

    _agent(run, _calls("x"), environment_factory=Scored)


@case("tool-is-a-generator", ValueError, "The tool 'count_up' cannot be offered", "generator (it yields)",
      "return list(...)")
def _(run):
    def count_up(n: int):
        """
        Counts.

        Args:
            n: To where.
        """
        yield from range(n)

    _agent(run, _calls("x"), tools=[count_up])


class Spot:  # a tool argument's class of its own (at module level: the hints here are strings, resolved by name)
    pass


@case("tool-takes-a-class-of-its-own", ValueError, "The tool 'goto' cannot be offered",
      "argument 'where' is a Spot, a class of its own", "build the Spot inside the tool")
def _(run):
    def goto(where: Spot) -> str:
        """
        Goes there.

        Args:
            where: Where to.
        """
        return "ok"

    _agent(run, _calls("x"), tools=[goto])


@case("tool-with-args-and-kwargs", ValueError, "The tool 'total' cannot be offered", "*values and **options",
      "Name each parameter")
def _(run):
    def total(*values: int, **options: int) -> int:
        """
        Adds.

        Args:
            values: Numbers.
            options: Settings.
        """
        return sum(values)

    _agent(run, _calls("x"), tools=[total])


@case("reward-needs-environments-without-environment-factory", ValueError, "needs the argument 'environments'",
      "passes only with environment_factory", "environments=None")
def _(run):
    from tiny_models import multiply

    _agent(run, _calls("x"), tools=[multiply], rewards=lambda completions, environments, **kw: [0.0] * 4)


@case("tools-prompts-cut-lose-the-tools", UserWarning, "cut from the left, and with tools",
      "the tools' schemas", "Raise max_prompt_length")
def _(run):
    from tiny_models import multiply

    _agent(run, _calls("done"), tools=[multiply], max_prompt_length=40)


@case("environment-method-outlives-tool-timeout", UserWarning, "Slow.increment did not return within tool_timeout",
      "may still change the environment", "not reused")
def _(run):
    import time

    class Slow(_Counter):
        def increment(self, a: int) -> int:
            """
            Adds, slowly.

            Args:
                a: How much.
            """
            time.sleep(0.5)
            self.total += a
            return self.total

    _agent(run, _calls('<tool_call>{"name": "increment", "arguments": {"a": 1}}</tool_call>'), environment_factory=Slow,
           tool_timeout=0.05)


@case("resume-without-the-tools", UserWarning, "with other inputs than it was trained with",
      "tools ['multiply'] -> no tools", "pass them as the run did")
def _(run):
    import warnings

    from tiny_models import multiply

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _agent(run, _calls("done"), tools=[multiply], save_steps=1)
    _agent(run, _calls("done"), max_steps=2, resume_from_checkpoint=True)


@case("resume-tools-reordered", UserWarning, "with other inputs than it was trained with", "the same tools in another "
      "order (['multiply', 'add'] -> ['add', 'multiply'])", "the system prompt lists them in the order given",
      "pass tools= in the run's order")
def _(run):
    import warnings

    from tiny_models import multiply

    def add(a: int, b: int) -> int:
        """
        Adds two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return a + b

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _agent(run, _calls("done"), tools=[multiply, add], save_steps=1)
    _agent(run, _calls("done"), tools=[add, multiply], max_steps=2, resume_from_checkpoint=True)


def _rollout_func(run, mutate, **overrides):
    """train(rollout_func=f) where f returns TRL's dict (3 tokens per completion), changed by `mutate(out)`."""
    def f(prompts, trainer):
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for p in prompts:
            ids = run.tok(p, add_special_tokens=False)["input_ids"]
            for k in range(trainer.num_generations):
                out["prompt_ids"].append(ids)
                out["completion_ids"].append([5 + k, 7, 2])
                out["logprobs"].append([-1.0] * 3)
        mutate(out)
        return out

    run(rollout_func=f, **overrides)


@case("rollout-func-logprobs-not-numbers", ValueError, "rollout_func 'f' returned logprobs[0] holding 'a'", "not numbers")
def _(run):
    _rollout_func(run, lambda out: out.update(logprobs=[["a"] * 3 for _ in out["logprobs"]]))


@case("rollout-func-env-mask-fractions", ValueError, "env_mask[0] holding 0.6", "1 where the model sampled the token")
def _(run):
    _rollout_func(run, lambda out: out.update(env_mask=[[0.6] * 3 for _ in out["completion_ids"]]))


@case("rollout-func-env-mask-all-zero", UserWarning, "env_mask that is 0 on every token", "trains on nothing",
      "is it inverted?")
def _(run):
    _rollout_func(run, lambda out: out.update(env_mask=[[0] * 3 for _ in out["completion_ids"]]))


@case("rollout-func-positive-logprobs", ValueError, "logprobs[0] holding 5.0, above 0", "log-probabilities are <= 0")
def _(run):
    _rollout_func(run, lambda out: out.update(logprobs=[[5.0] * 3 for _ in out["logprobs"]]))


@case("rollout-func-padded-rows", UserWarning, "completion_ids[0] = [5, 7, 2, 0, 0]", "pad tokens (0) after its EOS",
      "trained on those pads", "completion_mask[i].bool()")
def _(run):
    def padded(out):
        out["completion_ids"] = [c + [0, 0] for c in out["completion_ids"]]
        out["logprobs"] = [lp + [-1.0, -1.0] for lp in out["logprobs"]]

    _rollout_func(run, padded)


def _generation_major(out):
    """The rows reordered p0g0, p1g0, ..., p0g1, p1g1, ... (a loop over the generations outside the prompts')."""
    g = next(k for k, p in enumerate(out["prompt_ids"]) if p != out["prompt_ids"][0])
    order = [p * g + k for k in range(g) for p in range(len(out["prompt_ids"]) // g)]
    for key in list(out):
        out[key] = [out[key][j] for j in order]


@case("rollout-func-generation-major-rows", ValueError, "prompt_ids[1], which differs from prompt_ids[0] of the same "
      "group", "rows must be prompt-major, num_generations consecutive rows per prompt, in the order the prompts were "
      "given", "generation-major")
def _(run):
    _rollout_func(run, _generation_major)


@case("rollout-func-nan-logprob-with-correction", ValueError, "rollout_func 'f' returned logprobs[2][0] = None/NaN",
      "a token the model sampled", "rollout_importance_sampling_correction=False")
def _(run):
    def one_nan(out):
        out["logprobs"][2] = [float("nan"), -1.0, -1.0]

    _rollout_func(run, one_nan, rollout_importance_sampling_correction=True)


@case("rollout-func-nan-logprob", UserWarning, "rollout_func 'f' returned logprobs[1][2] = None/NaN",
      "not used without rollout_importance_sampling_correction")
def _(run):
    def one_none(out):  # vLLM reports a NaN log-prob as None
        out["logprobs"][1] = [-1.0, -1.0, None]

    _rollout_func(run, one_none)


@case("rollout-func-numpy-rows", None)
def _(run):
    import numpy as np

    def arrays(out):
        for key in ("prompt_ids", "completion_ids", "logprobs"):
            out[key] = [np.array(row) for row in out[key]]
        out["env_mask"] = [np.ones(3, dtype=bool) for _ in out["completion_ids"]]

    _rollout_func(run, arrays)


@case("rollout-func-groups-out-of-order", ValueError, "returned prompt_ids[0] (group 0: rows 0 to 3, num_generations=4) "
      "holding the prompt of prompts[1]", "the groups must come in the order the prompts were given",
      "return the groups sorted by it")
def _(run):
    def reversed_groups(out):  # episodes collected as they finish: each group together, the groups in another order
        g = next(k for k, p in enumerate(out["prompt_ids"]) if p != out["prompt_ids"][0])
        order = [j for start in reversed(range(0, len(out["prompt_ids"]), g)) for j in range(start, start + g)]
        for key in list(out):
            out[key] = [out[key][j] for j in order]

    _rollout_func(run, reversed_groups)


@case("rollout-func-trl-only-attribute", AttributeError, "trainer.vllm_client: grpo-nb has no attribute 'vllm_client'",
      "not TRL's GRPOTrainer", "trainer.rollout(")
def _(run):
    def f(prompts, trainer):
        return trainer.vllm_client.generate(prompts)  # TRL's server-mode client, as TRL's OpenEnv examples read it

    run(rollout_func=f)


@case("play-environment-factory-without-reset", ValueError, "play(environment=<lambda>): the environment it made, "
      "_Moves", "has no reset() method", "def reset(self, **row)")
def _(run):
    from grpo_nb import play

    play(prompt="Move.", environment=lambda: _Moves(), script=["done"])


@case("play-environment-a-dict", ValueError, "play(environment=<dict of 2: 'a', 'b'>): play() plays one "
      "environment; pass one of the dict's values, e.g. environment=envs['a']")
def _(run):
    # before (P45 F2): "the environment has no reset() method ... give dict one"
    from grpo_nb import play

    play(prompt="Move.", environment={"a": _Moves, "b": _Moves}, row={"environment": "a"}, script=["done"])


@case("play-greedy-text", ValueError, "play() argument greedy='False' is invalid: expected True or False (a bool, "
      "not the text)")
def _(run):
    from grpo_nb import play
    from tiny_models import byte_tokenizer, multiply

    play(lora_model(), byte_tokenizer(), prompt="3*4?", tools=[multiply], greedy="False")


@case("play-prompt-content-parts", ValueError, "play(prompt=...): message", "a list of parts (the multimodal format)",
      "which train() refuses", "{'role': 'user', 'content': 'Move.'}")
def _(run):
    from grpo_nb import play

    class Board(_Moves):
        def reset(self, **row):
            return "The board is empty."

    play(prompt=[{"role": "user", "content": [{"type": "text", "text": "Move."}]}], environment=Board, script=["done"])


@case("play-tokenizer-without-pad-token", ValueError, "play(tokenizer=", "the tokenizer has no pad token",
      "tokenizer.pad_token = tokenizer.eos_token")
def _(run):  # before (P44 F1): "TypeError: full(): argument 'fill_value' ... must be Number, not NoneType"
    from grpo_nb import play
    from tiny_models import byte_tokenizer, multiply

    tok = byte_tokenizer()
    tok.pad_token = None  # as Llama 3.x and Mistral tokenizers ship
    model = tiny_model("qwen2")
    model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    play(model, tok, prompt="What is 3 times 4?", tools=[multiply], max_completion_length=8)


@case("play-another-models-tokenizer", ValueError, "play(tokenizer=...) has 1024 tokens but the model's embedding "
      "has 512 rows", "the tokenizer comes from another model")
def _(run):  # before (P44 F1): "IndexError: index out of range in self" from the embedding
    from grpo_nb import play
    from tiny_models import multiply

    play(tiny_model("qwen2"), tiny_tokenizer(vocab_size=1024), prompt="w900 w901", tools=[multiply],
         max_completion_length=8)


@case("play-prompt-past-the-context", UserWarning, "play(): 1 prompt(s) were longer than max_prompt_length=248 "
      "tokens and were cut from the left", "max_seq_length 256 leaves beside max_completion_length=8",
      "the tools' schemas")
def _(run):
    # before (P44 F3): played at positions past the model's 256 (RoPE: silently; learned positions: IndexError)
    from grpo_nb import play
    from tiny_models import byte_tokenizer, multiply

    tok = byte_tokenizer()  # the tools' schemas alone are ~600 byte tokens
    model = tiny_model("qwen2")  # max_position_embeddings 256
    model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    play(model, tok, prompt="What is 3 times 4?", tools=[multiply], max_completion_length=8)


def _endoftext_tokenizer():
    """byte_tokenizer as a ChatML *base* model's (SmolLM2 / Qwen2.5 base): <|im_start|> and <|im_end|> in the
    vocabulary, and <|endoftext|> the EOS (id 259)."""
    from tiny_models import byte_tokenizer

    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]})
    tok.eos_token = "<|endoftext|>"
    return tok


@case("tools-turn-end-not-an-eos-id", ValueError, "train(): The chat template ends the assistant's turn that calls "
      "a tool with '<|im_end|>' (id 258), which is not one of the ids generation stops at ('<|endoftext|>')",
      "Make it one: model.generation_config.eos_token_id = [258, 259]")
def _(run):
    # before (P44 F2): trained until the model first wrote a call (here step 1; untrained, maybe hours), then "Use a
    # template that does: tokenizer.chat_template = grpo_nb.tool_chat_template(tokenizer)" - the one in use
    from tiny_models import Scripted, chat, multiply

    tok = _endoftext_tokenizer()
    model = lora_model()
    model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    model.config.max_position_embeddings = 2048
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The tokenizer's chat template")
        run(ds=chat(4), model=model, tok=tok, tools=[multiply], rollout=Scripted(_calls(_TOOL_CALL)),
            num_generations=2, per_device_train_batch_size=4, gradient_accumulation_steps=1,
            max_completion_length=300, max_prompt_length=None)


_TOOL_CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}</tool_call>'


@case("tokenizer-eos-token-not-a-token", ValueError, "tokenizer.eos_token is '</answer>', which is not a single "
      "token of this tokenizer's vocabulary (it encodes as 9 tokens", "tokenizer.add_special_tokens({'eos_token': "
      "'</answer>'})", "model.resize_token_embeddings(len(tokenizer))")
def _(run):  # before (P44 F4): "The tokenizer has no EOS token ...; set tokenizer.eos_token" - which the user did
    from tiny_models import byte_tokenizer

    tok = byte_tokenizer()
    tok.eos_token = "</answer>"  # no such token: its id is None
    model = lora_model()
    model.config.eos_token_id = model.generation_config.eos_token_id = None
    run(model=model, tok=tok)


@case("tool-timeout-past-the-thread-limit", ValueError, "tool_timeout=10000000000.0 is invalid: expected at most",
      "threading.TIMEOUT_MAX", "for no limit pass None")
def _(run):  # before (P44 F7): accepted, then "OverflowError: timestamp out of range" at the first call (mid-run)
    _agent(run, _calls(_TOOL_CALL), tools=[_hangs], tool_timeout=1e10)


@case("timeout-an-int-beyond-a-float", ValueError, "reward_timeout=", "is invalid: expected at most 922337203")
def _(run):  # before (P45 F4): a raw OverflowError from math.isfinite (an int too large for a float)
    from grpo_nb import GRPOConfig

    GRPOConfig(reward_timeout=10**400)


@case("chat-template-named-blank", ValueError, "tokenizer.chat_template['default'] is blank ('   ')",
      "renders every conversation without tools as no text", "Set it to a template")
def _(run):
    # before (P43 F7): a run with tools renders only 'tool_use', so the blank 'default' passed, trained and was
    # saved with the adapter, rendering every chat without tools as "   "
    from grpo_nb import tool_chat_template
    from tiny_models import Scripted, byte_tokenizer, chat, multiply

    tok = byte_tokenizer()
    tok.chat_template = {"default": "   ", "tool_use": tool_chat_template(tok)}
    model = lora_model()
    model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    model.config.max_position_embeddings = 2048
    run(ds=chat(4), model=model, tok=tok, tools=[multiply], rollout=Scripted(_calls("done")), num_generations=2,
        per_device_train_batch_size=4, gradient_accumulation_steps=1, max_completion_length=300,
        max_prompt_length=None)


# ----------------------------------------------------------------------------- TRL 1.16's config, reward libraries

@case("config-chat-template-kwargs-owned", ValueError, "GRPOConfig.chat_template_kwargs=",
      "['add_generation_prompt'] is set by grpo-nb where it renders prompts")
def _(run):
    run(chat_template_kwargs={"enable_thinking": False, "add_generation_prompt": False})


@case("chat-template-kwargs-with-tools", None)
def _(run):  # episodes render every turn with them (tests/test_tools.py checks Qwen3's template turn by turn)
    from tiny_models import Scripted, byte_tokenizer, chat, multiply

    tok = byte_tokenizer()
    model = lora_model()
    model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    model.config.max_position_embeddings = 2048
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tool template grpo-nb sets on this tokenizer
        run(ds=chat(4), rewards=lambda completions, **k: [float(len(completions[0]))] * len(completions), model=model,
            tok=tok, tools=[multiply], rollout=Scripted(_calls("done")), num_generations=2,
            per_device_train_batch_size=4, gradient_accumulation_steps=1, max_completion_length=300,
            max_prompt_length=None, chat_template_kwargs={"enable_thinking": False})


@case("config-normalize-then-sum-with-rloo", ValueError,
      "GRPOConfig.multi_objective_aggregation='normalize_then_sum' is invalid", "use advantage_estimator='grpo'")
def _(run):
    run(multi_objective_aggregation="normalize_then_sum", advantage_estimator="rloo")


@case("config-normalize-then-sum-scale-rewards", UserWarning, "scale_rewards='none' has no effect with it")
def _(run):  # TRL ignores scale_rewards with it too: said, and the run goes on as TRL's would
    run(rewards=[count_w7, token_id_reward], multi_objective_aggregation="normalize_then_sum", scale_rewards="none")


def _trl_config(**settings):
    import trl

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trl.GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, max_steps=1, **settings)


@case("trl-config-model-init-kwargs", UserWarning, "settings that do nothing in grpo-nb, ignored: "
      "model_init_kwargs={'dtype': 'bfloat16'}", "grpo-nb loads the model itself")
def _(run):  # before: refused as a setting without counterpart, though TRL ignores it for a loaded model too
    run(config=_trl_config(model_init_kwargs={"dtype": "bfloat16"}))


@case("trl-config-use-liger-kernel", UserWarning, "use_liger_kernel=True (deprecated in TRL",
      "never build the full [batch, length, vocab] logits")
def _(run):
    run(config=_trl_config(use_liger_kernel=True))


@case("reward-math-verify-under-timeout", ValueError, "Reward function 'accuracy_reward' calls math_verify",
      "signal.alarm, which works only in Python's main thread", "reward_timeout=30", "Set reward_timeout=None")
def _(run):  # open-r1's accuracy_reward; a stand-in math_verify (the real one need not be installed)
    (run.tmp_path / "math_verify.py").write_text("def parse(text, **kw):\n    return [text]\n\n"
                                                 "def verify(gold, answer, **kw):\n    return gold == answer\n")
    (run.tmp_path / "open_r1_rewards.py").write_text(
        "from math_verify import parse, verify\n\n"
        "def accuracy_reward(completions, **kwargs):\n"
        "    return [float(verify(parse(a), parse(c))) for c, a in zip(completions, kwargs['answer'])]\n")
    run.monkeypatch.syspath_prepend(str(run.tmp_path))
    for name in ("math_verify", "open_r1_rewards"):
        run.monkeypatch.delitem(sys.modules, name, raising=False)
    try:
        from open_r1_rewards import accuracy_reward

        run(rewards=[count_w7, accuracy_reward], reward_timeout=30)
    finally:  # the stand-in leaves with the test (monkeypatch puts back a real math_verify)
        for name in ("math_verify", "open_r1_rewards"):
            sys.modules.pop(name, None)


# ----------------------------------------------------------------------------- held-out evaluation during training

_HELD_OUT = [{"prompt": "w5 w6", "answer": "7"}, {"prompt": "w8", "answer": "3"}]


@case("eval-steps-without-eval-dataset", ValueError, "GRPOConfig.eval_steps=2 evaluates the model on a held-out set",
      "train(..., eval_dataset=heldout)")
def _(run):  # as TRL's Trainer refuses an eval_strategy without an eval_dataset
    run(eval_steps=2)


@case("eval-dataset-never-evaluated", ValueError, "train(eval_dataset=...) would never be evaluated",
      "no eval_steps is set", "Set eval_steps=N")
def _(run):  # TRL's default eval_strategy="no" ignores it silently; here it is said
    run(eval_dataset=_HELD_OUT)


@case("config-eval-strategy-epoch", ValueError, "GRPOConfig.eval_strategy='epoch' is invalid",
      "eval_strategy='steps' with eval_steps set to the steps of an epoch")
def _(run):
    run(eval_dataset=_HELD_OUT, eval_strategy="epoch")


@case("config-eval-steps-with-strategy-no", ValueError, "GRPOConfig.eval_steps=5 is invalid",
      "eval_strategy='no' never evaluates during training")
def _(run):
    run(eval_dataset=_HELD_OUT, eval_strategy="no", eval_steps=5)


@case("eval-dataset-no-prompt-column", ValueError, "train(eval_dataset=...): ", "no 'prompt' column",
      "rename_column")
def _(run):  # refused before the first step, not at the first evaluation an hour in
    run(eval_dataset=[{"question": "w5", "answer": "7"}], eval_steps=1)


@case("eval-dataset-lacks-reward-column", ValueError, "train(eval_dataset=...): ", "'correct'", "['answer']")
def _(run):  # train()'s reward functions score the eval completions too: they need its columns
    def correct(completions, answer, **kwargs):
        return [float(c == a) for c, a in zip(completions, answer)]
    run(rewards=correct, eval_dataset=[{"prompt": "w5 w6"}], eval_steps=1)


@case("eval-dataset-with-rollout-func", ValueError, "train(eval_dataset=...) with rollout_func",
      "not your rollout_func")
def _(run):
    _rollout_func(run, lambda out: None, eval_dataset=_HELD_OUT, eval_steps=1)


# ----------------------------------------------------------------------------- the tests

@pytest.mark.parametrize("case_id", list(CATALOG))
def test_bad_input_is_explained(case_id, tmp_path, monkeypatch):
    make_mistake, error, fragments = CATALOG[case_id]
    run = Run(tmp_path, monkeypatch)
    if error is None:
        make_mistake(run)
        return
    if issubclass(error, Warning):
        with pytest.warns(error) as caught:
            make_mistake(run)
        message = "\n".join(str(w.message) for w in caught)
    else:
        with pytest.raises(error) as err:
            make_mistake(run)
        message = "\n".join([str(err.value), *getattr(err.value, "__notes__", [])])
    missing = [f for f in fragments if f not in message]
    assert not missing, f"{case_id}: message lacks {missing}:\n{message}"


def test_errors_before_training_leave_nothing_behind(tmp_path, monkeypatch):
    """Input checks run before the rollout: a bad input costs no generation and writes no checkpoint."""
    calls = []
    monkeypatch.setattr(trainer_mod, "sample_batch", lambda *a, **k: calls.append(1))
    run = Run(tmp_path, monkeypatch)
    for case_id in ("dataset-no-prompt-column", "reward-needs-missing-column",
                    "prompt-plus-completion-longer-than-context",
                    "tokenizer-no-pad-token", "config-kl-without-adapter"):
        with pytest.raises(ValueError):
            CATALOG[case_id][0](run)
    assert not calls and not ckpt.checkpoints(tmp_path / "run")


def test_failed_final_save_keeps_the_history(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt, "_write_model_files", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    with pytest.raises(OSError) as err:
        Run(tmp_path, monkeypatch)(max_steps=2)
    assert [r["step"] for r in err.value.grpo_nb_history] == [1, 2]


def test_the_doc_lists_every_case():
    ids = re.findall(r"^\| `([a-z0-9-]+)` \|", DOC.read_text(), flags=re.M)
    assert ids == list(CATALOG), "docs/bad_inputs.md and the CATALOG must list the same cases in the same order"
    assert len(CATALOG) >= 20
