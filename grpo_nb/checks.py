"""Everything `train()` checks before any work: a wrong input fails in seconds, with a message
that names what is wrong and how to fix it, not after loading, rollouts or hours of training."""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path

import torch

from .attachments import model_context
from .checkpointing import _CHECKPOINT, LOCK, checkpoints, foreign_files
from .config import GRPOConfig
from .data import check_dataset
from .rewards import check_reward_funcs
from .rollout import eos_token_ids, prompt_texts, uses_vllm
from .tracking import tracker_names

# The files a save writes by name, besides a run's checkpoint-<step> folders, its lock file and TensorBoard's
# default runs/ folder: peft's adapter and model card, transformers' model and tokenizer files, and the run's
# settings and history (train() at its end; save_adapter and save_merged, the same names).
SAVED_FILES = ("adapter_config.json", "adapter_model.safetensors", "README.md", "config.json",
               "generation_config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
               "vocab.json", "merges.txt", "grpo_config.json", "history.json")


def check_shardable(model, rollout) -> None:
    """fsdp=True shards plain (16/32-bit) decoder weights, and rollouts that run through the model itself."""
    if any(getattr(p, "quant_state", None) is not None for p in model.parameters()):
        raise ValueError("fsdp=True cannot shard 4-bit (bitsandbytes) weights. A 4-bit model is small enough for "
                         "every GPU to hold whole: train it without fsdp (data parallel), or load it in 16-bit "
                         "(load_in_4bit=False) to shard it.")
    if uses_vllm(rollout or "auto", model):
        raise ValueError("fsdp=True does not work with vLLM rollouts (vLLM keeps its own whole copy of the weights, "
                         "which sharding is meant to avoid). Set the model up with fast_inference=False, or train "
                         "without fsdp.")


def check_loaded(func: str, name: str, obj) -> None:
    """`obj` (the `name` argument: "model" or "tokenizer") is a loaded object, not a pipeline that
    wraps one, nor its name."""
    if any(cls.__name__ == "Pipeline" for cls in type(obj).__mro__):
        raise TypeError(f"{func}({name}=<{type(obj).__name__}>) is a transformers pipeline, which wraps a model and "
                        f"a tokenizer: pass pipe.model and pipe.tokenizer.")
    if isinstance(obj, (str, os.PathLike)):
        raise TypeError(f"{func}({name}={str(obj)!r}) is a name, not a loaded {name}: load both first, "
                        f"e.g. model, tokenizer = setup_reasoning_model({str(obj)!r}).")


def check_model_and_tokenizer(func: str, model, tokenizer) -> None:
    """A causal language model (not a pipeline, a name or a bare encoder) and a tokenizer whose ids all
    exist in the model's embedding: what train(), evaluate() and sample_and_score() generate with."""
    check_loaded(func, "model", model)
    check_loaded(func, "tokenizer", tokenizer)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{func}(model=<{type(model).__name__}>) is not a model: pass a transformers causal LM, "
                        f"e.g. from setup_reasoning_model(...).")
    if not callable(getattr(model, "get_output_embeddings", None)) or model.get_output_embeddings() is None:
        raise TypeError(f"{func}(model=<{type(model).__name__}>) has no language-model head to generate text with "
                        f"(loaded with AutoModel instead of AutoModelForCausalLM?): load it with "
                        f"setup_reasoning_model(...) or AutoModelForCausalLM.from_pretrained(...).")
    if not callable(tokenizer) or not callable(getattr(tokenizer, "decode", None)):
        raise TypeError(f"{func}(tokenizer=<{type(tokenizer).__name__}>) is not a tokenizer: pass the model's own, "
                        f"e.g. AutoTokenizer.from_pretrained(name) (setup_reasoning_model returns both).")
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise ValueError(f"{func}(tokenizer=...) has {len(tokenizer)} tokens but the model's embedding has {rows} "
                         f"rows, so some token ids do not exist in the model: the tokenizer comes from another "
                         f"model. Load both from the same name; if you added tokens on purpose, call "
                         f"model.resize_token_embeddings(len(tokenizer)).")


def check_tokenizer(func: str, model, tokenizer, chat: bool) -> None:
    """What generating from the prompts needs of the tokenizer, as train() checks it before training:
    a pad token to batch prompts, an EOS to end completions, a chat template for chat prompts."""
    if tokenizer.pad_token_id is None:
        raise ValueError(f"{func}(tokenizer=<{type(tokenizer).__name__}>): the tokenizer has no pad token, which "
                         f"batching prompts needs. Set one, e.g. tokenizer.pad_token = tokenizer.eos_token, or run "
                         f"grpo_nb.prepare_tokenizer(tokenizer) (setup_reasoning_model does this for you).")
    eos_token_ids(model, tokenizer)  # raises if completions could never end
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{func}(tokenizer=<{type(tokenizer).__name__}>): the prompts are chat messages but the "
                         f"tokenizer has no chat template to render them. Set tokenizer.chat_template, run "
                         f"grpo_nb.prepare_tokenizer(tokenizer) for grpo-nb's default template, or make the "
                         f"prompts plain strings.")


def check_inputs(model, tokenizer, dataset, reward_funcs, config: GRPOConfig, *, callbacks=(), verbose=None,
                 live=None, resume_from_checkpoint=None) -> None:
    """Fail before any work with a message that says what is wrong and how to fix it."""
    check_run_arguments(callbacks, verbose, live, resume_from_checkpoint)
    check_model_and_tokenizer("train", model, tokenizer)
    if any(p.requires_grad and p.dtype == torch.float16 for p in model.parameters()):
        raise ValueError("train(model=...) trains float16 weights (full fine-tuning of a float16 model): float16 "
                         "cannot hold the small updates, and PyTorch's gradient scaler refuses float16 gradients. "
                         "Train LoRA adapters (setup_reasoning_model(lora_rank=16), the default; they train in "
                         "float32), or load the model in float32 or bfloat16 (dtype='float32').")
    columns, conversational = check_dataset(dataset)
    check_reward_funcs(reward_funcs, columns, config.reward_weights)
    check_tokenizer("train", model, tokenizer, conversational)  # a pad token, an EOS, a chat template if needed
    if config.beta > 0 and not hasattr(model, "disable_adapter"):
        raise ValueError(
            f"beta={config.beta} needs a reference policy, which grpo-nb takes as the model with its LoRA adapter "
            f"switched off; this model has no adapter. Use setup_reasoning_model(lora_rank=...) or set beta=0."
        )
    context = model_context(model)
    if context and config.max_completion_length >= context:
        raise ValueError(
            f"max_completion_length={config.max_completion_length} leaves no room for a prompt in the model's "
            f"max_seq_length {context}. Lower max_completion_length, or load the model with a larger max_seq_length.")
    if context and config.max_prompt_length and config.max_prompt_length + config.max_completion_length > context:
        raise ValueError(
            f"max_prompt_length + max_completion_length = {config.max_prompt_length} + "
            f"{config.max_completion_length} exceeds the model's max_seq_length {context}. Lower one of them, "
            f"or load the model with a larger max_seq_length."
        )
    _check_prompt_tokens(tokenizer, dataset)
    tensorboard_default = config.logging_dir is None and "tensorboard" in tracker_names(config.report_to)
    check_output_dir(Path(config.output_dir), resume_from_checkpoint, runs=tensorboard_default)
    check_log_paths(config)
    _check_writable(Path(config.output_dir))


def check_run_arguments(callbacks, verbose, live, resume_from_checkpoint) -> None:
    """train()'s own keyword arguments (the config's fields check themselves)."""
    if isinstance(callbacks, (str, bytes)) or callable(callbacks) or not isinstance(callbacks, (list, tuple)):
        raise TypeError(f"train(callbacks={callbacks!r}) is invalid: expected a list of functions, each called "
                        f"with every step's record, e.g. callbacks=[print].")
    for callback in callbacks:
        if hasattr(callback, "on_log") or hasattr(callback, "on_step_end"):  # transformers.TrainerCallback
            raise TypeError(f"train(callbacks=[<{type(callback).__name__}>]) is a transformers TrainerCallback, "
                            f"which TRL's GRPOTrainer calls; train() calls plain functions f(record). For the "
                            f"dashboard pass live=True (or live=LiveDashboard(...)).")
        if not callable(callback):
            raise TypeError(f"train(callbacks=[..., {callback!r}]) is invalid: each callback must be a function "
                            f"called with every step's record (a dict).")
    if verbose is not None and not isinstance(verbose, bool):
        raise TypeError(f"train(verbose={verbose!r}) is invalid: expected True, False or None (the default: on "
                        f"outside notebooks).")
    if not (live is None or isinstance(live, bool) or (callable(live) and not isinstance(live, type))):
        raise TypeError(f"train(live={live!r}) is invalid: expected True, False, None (the default: on in "
                        f"notebooks) or a dashboard object such as LiveDashboard(png_dir=...) - an instance, "
                        f"not the class.")
    if resume_from_checkpoint is not None and not isinstance(resume_from_checkpoint, (bool, str, os.PathLike)):
        raise TypeError(f"train(resume_from_checkpoint={resume_from_checkpoint!r}) is invalid: expected True (the "
                        f"newest checkpoint in output_dir), a checkpoint folder's path, or None.")


def check_output_dir(output_dir: Path, resume_from_checkpoint, *, runs: bool = False) -> None:
    """output_dir is this run's: not a folder of other files that saving would overwrite, nor an earlier
    run's checkpoints that this run would mix with its own (rotation keeps the highest step numbers), and
    nothing stands at a name the run writes but what it writes there (`runs`: TensorBoard's default
    folder output_dir/runs is used)."""
    if (problem := misplaced(output_dir, runs=runs)) is not None:
        raise ValueError(f"output_dir={str(output_dir)!r}: {problem}. Move it away (or rename it), or pass a new "
                         f"output_dir.")
    found, fresh = checkpoints(output_dir), resume_from_checkpoint in (None, False)
    if links := [p for p in found if p.is_symlink()]:
        raise ValueError(f"output_dir={str(output_dir)!r}: {links[0].name} is a link (to {os.readlink(links[0])}), "
                         f"not a checkpoint folder a run wrote, and grpo-nb never writes or deletes through a link it "
                         f"did not make. Remove the link (what it points to stays), pass the folder it points to as "
                         f"resume_from_checkpoint=, or pass a new output_dir.")
    if names := foreign_files(output_dir):
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise ValueError(f"output_dir={str(output_dir)!r} holds other files ({shown}), and the run writes its "
                         f"checkpoints, adapter and tokenizer files there (a README.md would be replaced): pass a "
                         f"new folder, e.g. output_dir='grpo_nb_output'.")
    if found and fresh:
        raise ValueError(f"output_dir={str(output_dir)!r} holds an earlier run's checkpoints (up to "
                         f"{found[-1].name}); a new run there would number its steps from 1 and mix its checkpoints "
                         f"with them. Continue that run with resume_from_checkpoint=True (raise max_steps to train "
                         f"further), or pass a new output_dir (or delete the old one).")
    if fresh and not found and (output_dir / "adapter_config.json").exists():
        warnings.warn(f"output_dir={str(output_dir)!r} holds the adapter an earlier run saved; this run will "
                      f"replace it when it ends. Pass a new output_dir to keep both.", stacklevel=4)


def misplaced(folder: Path, *, runs: bool = False) -> str | None:
    """An entry of `folder` at a name a save writes that is not what it writes there, described (a file
    where a checkpoint folder goes, a folder where a file or the lock goes; with `runs`, a link or a file
    at runs/); None when there is none. Writing would fail on it midway, or follow the link."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:  # not there yet
        return None
    for entry in entries:
        link, is_folder = entry.is_symlink(), entry.is_dir(follow_symlinks=False)
        if _CHECKPOINT.match(entry.name) and not link and not is_folder:
            return f"{entry.name} is a file, where the run writes its checkpoint folder of that name"
        if (entry.name == LOCK or entry.name in SAVED_FILES) and is_folder:
            return f"{entry.name} is a folder, where a file of that name is written"
        if runs and entry.name == "runs" and (link or not is_folder):
            return (f"runs is {f'a link (to {os.readlink(entry.path)})' if link else 'a file'}, where TensorBoard "
                    f"writes its event files by default (grpo-nb never writes through a link it did not make), or "
                    f"set GRPOConfig.logging_dir to another folder")
    return None


def check_log_paths(config: GRPOConfig) -> None:
    """log_completions_path and logging_dir are not at or under a name the run replaces or deletes in
    output_dir: the final save would rename its files over the log, rotation delete it with its checkpoint."""
    output_dir = Path(config.output_dir).expanduser().resolve()
    for option, instead in (("log_completions_path", str(output_dir / "completions.jsonl")),
                            ("logging_dir", str(output_dir / "runs"))):
        value = getattr(config, option)
        try:
            first = Path(value).expanduser().resolve().relative_to(output_dir).parts[0]
        except (TypeError, ValueError, IndexError):  # None, outside output_dir, or output_dir itself
            continue
        if _CHECKPOINT.match(first):
            why = "a checkpoint folder the run replaces (and deletes, to keep only the newest)"
        elif first in SAVED_FILES:
            why = "a file the run's final save replaces"
        else:
            continue
        raise ValueError(f"GRPOConfig.{option}={value!r} is invalid: it is at {first} in output_dir, {why}, and "
                         f"the log would be lost with it. Pick another name, e.g. {option}={instead!r}.")


def _check_prompt_tokens(tokenizer, dataset) -> None:
    """Every prompt becomes at least one token: found now, not mid-run."""
    for start in range(0, len(dataset), 512):
        rows = dataset[start : start + 512]  # a dict of columns from a datasets.Dataset, a list of rows from a list
        prompts = rows["prompt"] if isinstance(rows, dict) else [row["prompt"] for row in rows]
        lengths = [len(ids) for ids in tokenizer(prompt_texts(tokenizer, prompts), add_special_tokens=False)["input_ids"]]
        if 0 in lengths:
            raise ValueError(f"Dataset row {start + lengths.index(0)}: its prompt {prompts[lengths.index(0)]!r} "
                             f"becomes no tokens at all with this tokenizer, so the model would be asked nothing. "
                             f"Filter such rows out: dataset.filter(lambda row: ...), or fix the prompt text.")


def _check_writable(output_dir: Path) -> None:
    """The run ends by saving to output_dir: find out now, not after hours of training, if it can't."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=output_dir):
            pass
    except OSError as err:
        raise OSError(f"output_dir={str(output_dir)!r} is not a writable folder ({err}); checkpoints and the "
                      f"trained adapter are saved there. Pass another output_dir.") from err
