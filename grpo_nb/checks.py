"""Everything `train()` checks before any work: a wrong input fails in seconds, with a message
that names what is wrong and how to fix it, not after loading, rollouts or hours of training."""

from __future__ import annotations

import os
import re
import tempfile
import threading
import warnings
from contextlib import contextmanager, suppress
from pathlib import Path

import jinja2
import torch

from .attachments import attachments, position_window
from .base_folder import base_folder_problem
from . import atomic_files
from .checkpointing import (_CHECKPOINT, LEGACY_TRAINER_STATE, SETTINGS, TRAINABLE, TRAINER_STATE, checkpoints,
                            finished_result, foreign_files, saved_here, saved_weights)
from .config import GRPOConfig
from .run_lock import LOCK
from .dataset_checks import check_dataset
from .reward_contract import check_reward_funcs
from .rollout import check_tokenizer, eos_token_ids, prompt_texts, uses_vllm
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
    rows = model.get_input_embeddings().weight.shape[0]  # peft's TrainableTokensWrapper has no num_embeddings
    if len(tokenizer) > rows:
        raise ValueError(f"{func}(tokenizer=...) has {len(tokenizer)} tokens but the model's embedding has {rows} "
                         f"rows, so some token ids do not exist in the model: the tokenizer comes from another "
                         f"model. Load both from the same name; if you added tokens on purpose, call "
                         f"model.resize_token_embeddings(len(tokenizer)).")
    check_not_empty(func, tokenizer)
    check_same_model(func, model, tokenizer)


def check_not_empty(func: str, tokenizer) -> None:
    """The tokenizer turns text into tokens: transformers builds an empty one of the model type's class from a
    folder without tokenizer files (weights only: save_merged without a tokenizer, someone's upload)."""
    if tokenizer("What is 2 + 3? Hello world.", add_special_tokens=False)["input_ids"]:
        return
    raise ValueError(f"{func}(tokenizer=<{type(tokenizer).__name__}>) is empty: it turns text into no tokens at all "
                     f"(it has {len(tokenizer)} token(s); loaded from a model folder without tokenizer files?), so "
                     f"every prompt would ask the model nothing. Load the model's own tokenizer "
                     f"(AutoTokenizer.from_pretrained(<the original model's name>)) and save it beside the weights: "
                     f"tokenizer.save_pretrained(folder).")


def _ids(value) -> list[int]:
    """Token ids from a config field (an int or a list of them); nothing for anything else."""
    values = value if isinstance(value, (list, tuple)) else [value]
    return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _ends_text(tokenizer, token_id: int) -> bool:
    """Whether `token_id` is, in this tokenizer, a marker token that ends text or a turn (<|endoftext|>,
    </s>, <|eot_id|>, <end_of_turn>, <|im_end|>, ...)."""
    if not 0 <= token_id < len(tokenizer):
        return False
    token = tokenizer.convert_ids_to_tokens(token_id)
    return (isinstance(token, str) and token.startswith("<") and token.endswith(">")
            and re.search(r"end|eos|eot|eom|</s>", token.lower()) is not None)


def check_same_model(func: str, model, tokenizer) -> None:
    """The tokenizer is this model's, not another family's with fewer tokens (which the embedding size cannot
    tell: a Llama-3 tokenizer's 128,256 ids all exist in Qwen2.5's 151,936 rows, as other tokens). The ids
    that end text must agree: the tokenizer's EOS among the model's, or else the model's own end-of-text id a
    marker that ends text in this tokenizer too (a tokenizer whose EOS was changed on purpose)."""
    model_eos = set(_ids(getattr(getattr(model, "config", None), "eos_token_id", None)))
    model_eos |= set(_ids(getattr(getattr(model, "generation_config", None), "eos_token_id", None)))
    own = tokenizer.eos_token_id
    if not model_eos or own is None or own in model_eos or any(_ends_text(tokenizer, i) for i in model_eos):
        return
    meaning = ", ".join(f"{i} is {tokenizer.convert_ids_to_tokens(i)!r}" if 0 <= i < len(tokenizer) else
                        f"{i} is beyond its {len(tokenizer)} tokens" for i in sorted(model_eos))
    raise ValueError(f"{func}(tokenizer=<{type(tokenizer).__name__}>) is not this model's tokenizer: the model ends "
                     f"text with id(s) {sorted(model_eos)} (its config), which this tokenizer does not use to end "
                     f"text ({meaning}), and the tokenizer's EOS {tokenizer.eos_token!r} (id {own}) is not one of "
                     f"them. Every id would mean another token to the model (a tokenizer of another family, e.g. from "
                     f"a later cell that loaded another model). Use the tokenizer loaded with the model "
                     f"(setup_reasoning_model returns both); if you changed the tokenizer's EOS on purpose, add its "
                     f"id: model.generation_config.eos_token_id = {sorted(model_eos | {own})}.")


# From this learning rate on, a model without an adapter is likely trained at a LoRA rate (the README's 1e-4): full
# fine-tuning takes rates 10-100 times lower (GRPOConfig's 5e-6, TRL's 1e-6), every weight moving at once.
LORA_RATE = 5e-5


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
    if merged := [name for name, module in model.named_modules() if getattr(module, "merged_adapters", None)]:
        raise ValueError(f"train(model=...) has its LoRA adapter merged into the weights (model.merge_adapter(): "
                         f"{len(merged)} layer(s), e.g. {merged[0]}): the merged layers compute without the "
                         f"adapter's trainable matrices, so nothing would get a gradient. Call model.unmerge_adapter() "
                         f"before train() (save_merged() writes a merged copy without merging the model).")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if not getattr(model, "peft_config", None) and trainable and config.learning_rate >= LORA_RATE:
        # a save_merged() folder loaded with load_for_inference() has no adapter: "continuing" it trains every weight
        warnings.warn(f"train(model=...) has no LoRA adapter, so it fine-tunes all {trainable:,} trainable weights "
                      f"(full fine-tuning) at learning_rate={config.learning_rate:g}, a LoRA learning rate: full "
                      f"fine-tuning usually takes 1e-6 to 1e-5, and a higher rate can undo what the model knows. For "
                      f"LoRA add an adapter first: model = grpo_nb.models.prepare_for_training(model, lora_rank=16) "
                      f"(or load the folder with setup_reasoning_model(folder)); to fine-tune every weight, pass a "
                      f"lower learning_rate, e.g. 5e-6.", UserWarning, stacklevel=3)
    columns, conversational = check_dataset(dataset)
    check_reward_funcs(reward_funcs, columns, config.reward_weights)
    if config.beta > 0 and not hasattr(model, "disable_adapter"):
        raise ValueError(
            f"beta={config.beta} needs a reference policy, which grpo-nb takes as the model with its LoRA adapter "
            f"switched off; this model has no adapter. Use setup_reasoning_model(lora_rank=...) or set beta=0."
        )
    check_context("train", model, config.max_prompt_length, config.max_completion_length)
    check_prompts("train", model, tokenizer, dataset, conversational)
    tensorboard_default = config.logging_dir is None and "tensorboard" in tracker_names(config.report_to)
    check_output_dir(Path(config.output_dir), resume_from_checkpoint, runs=tensorboard_default, model=model)
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


def check_output_dir(output_dir: Path, resume_from_checkpoint, *, runs: bool = False, model=None) -> None:
    """output_dir is this run's: not the folder `model`'s base weights were loaded from, not a folder of other
    files that saving would overwrite, nor an earlier run's checkpoints that this run would mix with its own
    (rotation keeps the highest step numbers), and nothing stands at a name the run writes but what it writes
    there (`runs`: TensorBoard's default folder output_dir/runs is used)."""
    if model is not None and (problem := base_folder_problem(output_dir, model)) is not None:
        raise ValueError(f"output_dir={str(output_dir)!r}: {problem} (a full fine-tune's weights over it, or an "
                         f"adapter beside it, which transformers then loads with that folder as base + adapter). "
                         f"Pass another output_dir, e.g. "
                         f"output_dir={str(output_dir.expanduser().resolve()) + '-grpo'!r}.")
    if (problem := misplaced(output_dir, runs=runs)) is not None:
        raise ValueError(f"output_dir={str(output_dir)!r}: {problem}. Move it away (or rename it), or pass a new "
                         f"output_dir.")
    if (inside := checkpoint_around(output_dir)) is not None:
        said = "is" if inside == output_dir.expanduser().resolve() else "lies inside"
        raise ValueError(f"output_dir={str(output_dir)!r} {said} the checkpoint folder {str(inside)!r}: the run "
                         f"would write its checkpoints, adapter and settings into it, over the files that checkpoint "
                         f"resumes from, and the run that saved it deletes the folder, with everything in it, when it "
                         f"rotates its checkpoints (save_total_limit). Pass an output_dir outside it, e.g. "
                         f"output_dir={f'{inside.parent}-from-{inside.name}'!r} (resume_from_checkpoint= still "
                         f"takes the checkpoint's path).")
    found, fresh = checkpoints(output_dir), resume_from_checkpoint in (None, False)
    fork = not fresh and resume_from_checkpoint is not True and _fork(output_dir, resume_from_checkpoint)
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
    if found and not any(os.path.lexists(p / TRAINABLE) or os.path.lexists(p / LEGACY_TRAINER_STATE) for p in found):
        raise ValueError(f"output_dir={str(output_dir)!r} holds checkpoint folders no grpo-nb run wrote (up to "
                         f"{found[-1].name}, without grpo-nb's {TRAINABLE}: e.g. an HF or TRL Trainer's), which "
                         f"this run cannot resume and would mix its own with. Pass a new output_dir, e.g. "
                         f"output_dir={str(output_dir.expanduser().resolve()) + '-grpo'!r}.")
    if found and fresh:
        raise ValueError(f"output_dir={str(output_dir)!r} holds an earlier run's checkpoints (up to "
                         f"{found[-1].name}); a new run there would number its steps from 1 and mix its checkpoints "
                         f"with them. Continue that run with resume_from_checkpoint=True (raise max_steps to train "
                         f"further), or pass a new output_dir (or delete the old one).")
    if found and fork:
        raise ValueError(f"output_dir={str(output_dir)!r} holds another run's checkpoints (up to {found[-1].name}), "
                         f"and resuming {str(resume_from_checkpoint)!r} there starts a run of its own (a fork) that "
                         f"would mix its checkpoints with them, and delete them to keep the newest "
                         f"(save_total_limit). Resume into a new output_dir, or continue that run with "
                         f"resume_from_checkpoint=True.")
    if (fresh or fork) and not found and not saved_here(output_dir / SETTINGS) \
            and (kind := saved_weights(output_dir)) is not None:  # someone's model or adapter
        raise ValueError(f"output_dir={str(output_dir)!r} holds {'an adapter' if kind == 'adapter' else 'a model'} "
                         f"that no grpo-nb run saved there (it has no grpo_config.json): this run would replace it "
                         f"when it ends (a full fine-tune's weights and config over a model, or its adapter beside "
                         f"it, which transformers then loads as base + adapter). Pass a new output_dir, e.g. "
                         f"output_dir={str(output_dir.expanduser().resolve()) + '-grpo'!r}.")
    if (fresh or fork) and not found and (result := finished_result(output_dir)) is not None:
        if model is not None and (theirs := _other_result(output_dir, result, model)) is not None:
            raise ValueError(f"output_dir={str(output_dir)!r} holds {theirs}, and this run saves "
                             f"{_result_of(model)} there: its files would not replace the earlier ones but sit beside "
                             f"them, and the folder would load as the earlier result, or as a mix of the two "
                             f"(transformers applies an adapter it finds beside a model). Pass a new output_dir, or "
                             f"delete the earlier result first.")
        warnings.warn(f"output_dir={str(output_dir)!r} holds the {result[0]} an earlier run saved; this run will "
                      f"replace it when it ends. Pass a new output_dir to keep both.", stacklevel=4)


def _result_of(model) -> str:
    """What a run of `model` saves in its output_dir: its adapter (peft keeps one named other than "default" in a
    subfolder of that name), or the whole model."""
    if not getattr(model, "peft_config", None):
        return "a fully fine-tuned model"
    name = getattr(model, "active_adapter", "default")
    return "a LoRA adapter" + ("" if name == "default" else f" in the subfolder {name!r}")


def _other_result(output_dir: Path, result: tuple, model) -> str | None:
    """The earlier run's result in output_dir (finished_result's), named, when this run's is of another kind or
    place (a model vs an adapter, another adapter subfolder); None when this run's final save replaces it."""
    kind, folder = result
    ours = _result_of(model)
    if kind == "model":
        return None if ours == "a fully fine-tuned model" else "a fully fine-tuned model an earlier run saved"
    theirs = "a LoRA adapter" + ("" if folder == output_dir else f" in the subfolder {folder.name!r}")
    return None if ours == theirs else theirs + " an earlier run saved"


def _fork(output_dir: Path, checkpoint) -> bool:
    """A checkpoint outside output_dir resumed into it: a run of its own there, which writes and rotates
    checkpoints as a new run does. output_dir itself is no checkpoint (read_training_checkpoint says which of
    its checkpoints to pass)."""
    try:
        path, here = atomic_files.expand(checkpoint).resolve(), output_dir.expanduser().resolve()
    except (OSError, ValueError, RuntimeError):  # a path no file can have: find_checkpoint names the problem
        return False
    return path.parent != here and path != here


def checkpoint_around(output_dir: Path) -> Path | None:
    """The checkpoint folder that `output_dir` is or lies in, None when none: one holding a checkpoint's files,
    or a folder named checkpoint-<step> in a finished run's folder (the next checkpoint of that name)."""
    try:
        folder = output_dir.expanduser().resolve()
    except (OSError, ValueError, RuntimeError):  # a path no file can have: saving names the problem
        return None
    for path in (folder, *folder.parents):
        with suppress(OSError):
            if (path / TRAINER_STATE).is_file() and (path / TRAINABLE).is_file():
                return path
            if _CHECKPOINT.match(path.name) and saved_here(path.parent / SETTINGS):
                return path
    return None


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
        folder = None if value is None else Path(value) if option == "logging_dir" else Path(value).parent
        if folder is not None and (inside := checkpoint_around(folder)) is not None:  # another run's checkpoint
            raise ValueError(f"GRPOConfig.{option}={value!r} is invalid: it lies in the checkpoint folder "
                             f"{str(inside)!r}, which the run that saved it deletes, with everything in it, when it "
                             f"rotates its checkpoints (save_total_limit). Pick a folder outside it, e.g. "
                             f"{option}={instead!r}.")
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


def context_limit(func: str, model) -> int | None:
    """The most tokens a prompt and its completion may take: the max_seq_length the model was set up with
    (refused beyond the positions the model was trained for), else that window itself; None if unknown."""
    window = position_window(getattr(model, "config", None))
    context = attachments(model).max_seq_length
    if context and window and context > window:
        raise ValueError(f"{func}(model=...) was set up with max_seq_length={context}, beyond the model's context "
                         f"window of {window} tokens (its config's max_position_embeddings, with any rope scaling): "
                         f"positions past it were never trained, and generating or training there degrades "
                         f"silently. Set the model up with max_seq_length={window} or less.")
    return context or window


def check_context(func: str, model, max_prompt_length: int | None, max_completion_length: int) -> int | None:
    """Prompt and completion fit the model's context (context_limit), as train() checks them: a completion
    that leaves no room for a prompt, or a max_prompt_length that does not fit beside it, is refused.
    Returns the limit (None if the model has none)."""
    context = context_limit(func, model)
    if context and max_completion_length >= context:
        raise ValueError(
            f"{func}(max_completion_length={max_completion_length}) leaves no room for a prompt in the model's "
            f"max_seq_length {context}. Lower max_completion_length, or load the model with a larger max_seq_length.")
    if context and max_prompt_length and max_prompt_length + max_completion_length > context:
        raise ValueError(
            f"{func}(): max_prompt_length + max_completion_length = {max_prompt_length} + {max_completion_length} "
            f"exceeds the model's max_seq_length {context}. Lower one of them, or load the model with a larger "
            f"max_seq_length.")
    return context


def prompts_cut_message(count: int, max_prompt_length: int, max_completion_length: int, context: int | None) -> str:
    """What to say when `count` prompts lost their beginning, and the fix that can work: with max_prompt_length
    at what the context leaves beside the completion (what max_prompt_length=None means), raising it would
    be refused, so the fix is a larger context or a shorter completion."""
    text = (f"{count} prompt(s) were longer than max_prompt_length={max_prompt_length} tokens and were cut from the "
            f"left, keeping their last {max_prompt_length} tokens. ")
    if context and max_prompt_length + max_completion_length >= context:
        return text + (f"That is all the model's max_seq_length {context} leaves beside max_completion_length="
                       f"{max_completion_length} (max_prompt_length=None means max_seq_length - "
                       f"max_completion_length = {context} - {max_completion_length}): to keep them whole, load the "
                       f"model with a larger max_seq_length (setup_reasoning_model(..., max_seq_length=...)), or "
                       f"lower max_completion_length.")
    return text + "Raise max_prompt_length to keep them whole."


def check_prompts(func: str, model, tokenizer, dataset, conversational: bool) -> None:
    """What the model will be asked, checked before any work (train(), evaluate(), sample_and_score()):
    the tokenizer can batch and end them, the chat template renders them as meant, no prompt is empty."""
    check_tokenizer(func, model, tokenizer, conversational)  # a pad token, an EOS, a chat template if needed
    if conversational:
        check_chat_prompt(func, model, tokenizer, dataset[0]["prompt"])
    _check_prompt_tokens(func, model, tokenizer, dataset)


# A chat template runs someone else's loops on every prompt; one that has not rendered a prompt after this
# many seconds is named (it cannot be stopped from here, Ctrl-C can).
TEMPLATE_NOTICE_SECONDS = 10.0


@contextmanager
def _named_if_slow(func: str, row: int):
    def notice():
        warnings.warn(f"{func}(): the tokenizer's chat template has been rendering dataset row {row} for "
                      f"{TEMPLATE_NOTICE_SECONDS:g} s. A template that loops (nested range() loops, a recursive "
                      f"macro) never finishes: stop it (Ctrl-C, or the notebook's Stop button) and fix "
                      f"tokenizer.chat_template, or load the model's original tokenizer.", UserWarning)

    timer = threading.Timer(TEMPLATE_NOTICE_SECONDS, notice)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def check_chat_prompt(func: str, model, tokenizer, messages, row: int = 0) -> None:
    """Render one chat prompt (dataset row `row`) before any work and check what the model would see: every
    system and user message's content is in it (a template written for other keys - ShareGPT's from/value -
    renders empty turns), add_generation_prompt opens the assistant's turn, the template's special tokens
    reach the model as one id each (split_special_tokens=True spells them out), and the token that closes
    the assistant's turn ends a completion."""
    with _named_if_slow(func, row):
        text = prompt_texts(tokenizer, [messages], first_row=row)[0]
    template = str(tokenizer.chat_template)
    if (dropped := _dropped_messages(messages, text)) is not None:
        message = messages[dropped]
        keys = sorted(set(re.findall(r"\[\s*['\"]([A-Za-z_]\w*)['\"]\s*\]", template)) - {"role", "content"})
        hint = (f" The template never reads 'content' (it reads {keys}): it was written for messages of "
                f"other keys." if "content" not in template else
                f" A template without a {message['role']} role leaves it out: merge it into the first user "
                f"message." if message["role"] == "system" else "")
        raise ValueError(f"{func}(tokenizer=...): the chat template drops the messages' content: dataset row "
                         f"{row}'s message {dropped} ({message['role']}: {message['content'].strip()!r:.80}) is not "
                         f"in what the model would be asked, {text!r:.300}.{hint} Fix tokenizer.chat_template, or "
                         f"use the model's own tokenizer.")
    _check_special_tokens(func, tokenizer, text)
    prefill = isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant"
    if prefill:
        return  # continued as written; the turn checks below need a prompt that ends with the user
    try:
        closed = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        answered = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": _ANSWER}],
                                                 tokenize=False, add_generation_prompt=False)
    except (jinja2.TemplateError, ValueError, TypeError, RecursionError):
        return  # a template that refuses these two is judged on the prompts themselves
    if closed == text and _ends_a_turn(messages, text, answered):
        example = ("e.g. {% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}" if "<|im_start|>" in template
                   else "as the model's own tokenizer's template does")
        warnings.warn(f"{func}(): the chat template opens no assistant turn: add_generation_prompt=True adds "
                      f"nothing to dataset row {row}'s prompt ({text[-80:]!r}), so the model continues the user's "
                      f"turn instead of answering it. Use a template that writes the assistant's header when "
                      f"add_generation_prompt is set, {example}.", UserWarning, stacklevel=5)
    _check_turn_end(func, model, tokenizer, answered)


def _ends_a_turn(messages, text: str, answered: str) -> bool:
    """Whether the prompt ends where a turn ends: with the user's bare text, or with what the template writes
    after a message (what follows the answer in `answered`: <|im_end|>, <|eot_id|>, <end_of_turn>). Templates
    without an add_generation_prompt branch end the prompt with the assistant's opening instead (Mistral's and
    Llama 2's [/INST], the original Phi-3's <|assistant|>): their turn is open."""
    end = text.rstrip()
    last = messages[-1].get("content") if isinstance(messages[-1], dict) else None
    after = answered[answered.rfind(_ANSWER) + len(_ANSWER):].strip() if _ANSWER in answered else ""
    return bool(after and end.endswith(after)) or (isinstance(last, str) and bool(last.strip())
                                                     and end.endswith(last.strip()))


def _dropped_messages(messages, text: str) -> int | None:
    """The index of the first system or user message whose text is not in `text`, the prompt rendered from them
    (a template written for other keys, or without a role that some rows have); None when all are there."""
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("system", "user"):
            continue
        if isinstance(message.get("content"), str) and message["content"].strip() not in text:
            return i
    return None


_ANSWER = "The answer is 4."  # an assistant message rendered to see what the template writes after it


def _check_special_tokens(func: str, tokenizer, text: str) -> None:
    """Each special token the rendered prompt holds encodes as its one id (not spelled out)."""
    for token_id, token in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if token.special and token.content and token.content in text:
            ids = tokenizer(token.content, add_special_tokens=False)["input_ids"]
            if ids != [token_id]:
                split = getattr(tokenizer, "split_special_tokens", False)
                raise ValueError(f"{func}(tokenizer=...): the chat template's special token {token.content!r} (id "
                                 f"{token_id}) reaches the model as {len(ids)} tokens "
                                 f"{tokenizer.convert_ids_to_tokens(ids)[:12]}, a prompt format it never saw"
                                 f"{' (the tokenizer has split_special_tokens=True)' if split else ''}. Set "
                                 f"tokenizer.split_special_tokens = False (or remove it from tokenizer_config.json), "
                                 f"or use the model's own tokenizer.")


def _check_turn_end(func: str, model, tokenizer, answered: str) -> None:
    """The special token the template writes right after an assistant message (its end of turn) is an EOS
    id; else completions run on past the model's end of turn to max_completion_length."""
    at = answered.rfind(_ANSWER)
    if at < 0:
        return
    after = tokenizer(answered[at + len(_ANSWER):].lstrip(), add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids) | {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
                                                if t.special}
    special.discard(tokenizer.unk_token_id)  # text the tokenizer cannot encode, not a marker the template chose
    eos = eos_token_ids(model, tokenizer)
    if after and after[0] in special and after[0] not in eos:
        token = tokenizer.convert_ids_to_tokens(after[0])
        warnings.warn(f"{func}(): the chat template ends the assistant's turn with {token!r} (id {after[0]}), which "
                      f"is not an EOS id {eos}: completions would not end where the model ends its answer, but run "
                      f"on to max_completion_length, and reward functions would see the text after it. Add it: "
                      f"model.generation_config.eos_token_id = {sorted({*eos, after[0]})}.", UserWarning,
                      stacklevel=6)


def _check_prompt_tokens(func: str, model, tokenizer, dataset) -> None:
    """Every prompt becomes at least one token, and every chat prompt keeps its messages (row 0 is checked in
    full by check_chat_prompt; a template without a role that only later rows have - a system prompt on some
    rows - drops it from those): found now, not mid-run."""
    for start in range(0, len(dataset), 512):
        rows = dataset[start : start + 512]  # a dict of columns from a datasets.Dataset, a list of rows from a list
        prompts = rows["prompt"] if isinstance(rows, dict) else [row["prompt"] for row in rows]
        texts = prompt_texts(tokenizer, prompts, first_row=start)
        for i, (prompt, text) in enumerate(zip(prompts, texts)):
            if not isinstance(prompt, str) and _dropped_messages(prompt, text) is not None:
                check_chat_prompt(func, model, tokenizer, prompt, row=start + i)  # raises, naming the message
        lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
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
