"""Everything `train()` checks before any work: a wrong input fails in seconds, with a message
that names what is wrong and how to fix it, not after loading, rollouts or hours of training."""

from __future__ import annotations

import math
import os
import re
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

import jinja2
import torch

from .attachments import attachments, position_window
from .config import GRPOConfig
from .dataset_checks import check_dataset
from .output_checks import check_adapter_name, check_log_paths, check_output_dir, check_writable
from .reward_calls import check_reward_threads
from .reward_contract import check_reward_funcs
from .rollout import check_tokenizer, eos_token_ids, prompt_texts, uses_vllm
from .rollout.batch import WithTemplateKwargs
from .tools import TurnEndNotEOS, check_turn_ends
from .tracking import tracker_names


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
    check_weights_loaded(func, model)
    rows = model.get_input_embeddings().weight.shape[0]  # peft's TrainableTokensWrapper has no num_embeddings
    if len(tokenizer) > rows:
        raise ValueError(f"{func}(tokenizer=...) has {len(tokenizer)} tokens but the model's embedding has {rows} "
                         f"rows, so some token ids do not exist in the model: the tokenizer comes from another "
                         f"model. Load both from the same name; if you added tokens on purpose, call "
                         f"model.resize_token_embeddings(len(tokenizer)).")
    check_not_empty(func, tokenizer)
    check_same_model(func, model, tokenizer)


def check_weights_loaded(func: str, model) -> None:
    """Every weight and buffer holds data: one on the "meta" device has a shape and no values (accelerate's
    init_empty_weights(), a device_map that offloads to meta, module.to("meta")). torch runs some layers on meta
    with a CPU input and returns garbage without a word (generation, scores), and fails raw elsewhere."""
    # accelerate's offload (device_map with "cpu"/"disk") keeps its layers on meta and loads them for each forward
    # (a hook with offload=True): generation works with them, a training step and a save do not
    offloaded = {name for name, m in model.named_modules() if getattr(getattr(m, "_hf_hook", None), "offload", False)}
    skip = () if func in ("train", "save_adapter", "save_merged") else tuple(f"{n}." for n in offloaded)
    empty = [name for name, t in [*model.named_parameters(), *model.named_buffers()]
             if t.device.type == "meta" and not (skip and name.startswith(skip))]
    if empty:
        raise ValueError(f"{func}(model=...) has {len(empty)} weight(s) with no data, on the 'meta' device (e.g. "
                         f"{empty[0]}): the model was built without loading its weights (accelerate's "
                         f"init_empty_weights(), .to('meta'), or a device_map that offloads layers to the CPU or disk, "
                         f"which accelerate keeps on meta). Load the weights: AutoModelForCausalLM.from_pretrained(name) "
                         f"(or setup_reasoning_model(name)) without init_empty_weights, on a device that holds the "
                         f"whole model.")


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


def check_lora_config(func: str, model) -> None:
    """The LoRA config that every adapter save writes (model.peft_config) is what the layers compute with: r,
    lora_alpha and use_rslora (and rank_pattern / alpha_pattern) give each layer's rank and scale when the saved
    adapter is loaded. peft reads the config once, in get_peft_model(): editing it afterwards changes no layer, and
    scale_layer() / set_scale() change the layers' scale alone; either way the run would train one model and save
    another (which loads at another scale, or not at all). Only the active adapter is checked: the one trained and
    saved."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return
    try:
        from peft.utils.other import get_pattern_key
    except ImportError:
        return
    root = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    # the adapter the run trains and every save writes (selected_adapters=[active]): another one loaded beside it (a
    # frozen reference adapter at its own scale, its config edited) is neither, and is not ours to refuse
    active = getattr(model, "active_adapter", None)
    for key, layer in root.named_modules():  # the names peft matched rank_pattern / alpha_pattern against
        scaling, ranks, alphas = (getattr(layer, k, None) for k in ("scaling", "r", "lora_alpha"))
        if not hasattr(layer, "adapter_layer_names") or not all(isinstance(x, dict) for x in (scaling, ranks, alphas)):
            continue
        if isinstance(parameter := getattr(layer, "parameter_name", None), str):
            # LoRA on a parameter (target_parameters, peft's ParamWrapper): peft matched the patterns against
            # "<module>.<parameter>", the module's name without the ".base_layer" of wrappers nested for two of them
            key = key.replace(".base_layer", "") + "." + parameter
        for adapter, scale in scaling.items():
            config = configs.get(adapter)
            if getattr(getattr(config, "peft_type", None), "value", None) != "LORA" or adapter not in ranks:
                continue
            if isinstance(active, str) and adapter != active:
                continue
            rank_pattern, alpha_pattern = config.rank_pattern or {}, config.alpha_pattern or {}
            want = {"r": rank_pattern.get(get_pattern_key(rank_pattern.keys(), key), config.r),
                    "lora_alpha": alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), key), config.lora_alpha),
                    "use_rslora": bool(config.use_rslora)}
            held = {"r": ranks[adapter], "lora_alpha": alphas[adapter],
                    "use_rslora": bool(getattr(layer, "use_rslora", {}).get(adapter, want["use_rslora"]))}
            if (field := next((f for f in want if want[f] != held[f]), None)) is not None:
                pattern = {"r": " (or rank_pattern)", "lora_alpha": " (or alpha_pattern)"}.get(field, "")
                raise ValueError(
                    f"{func}(model=...) has model.peft_config[{adapter!r}].{field}{pattern} = {want[field]!r}, but "
                    f"its LoRA layers were made with {field}={held[field]!r} (e.g. {key}): the config was edited "
                    f"after get_peft_model(), which changes no layer, and every adapter save writes the config, so "
                    f"the saved adapter would load as another model than the one trained (another scale, or a "
                    f"shape that does not load). Create the adapter with the LoraConfig you want "
                    f"(get_peft_model(model, LoraConfig(..., {field}=...)), or setup_reasoning_model(lora_rank=..., "
                    f"lora_alpha=...)), or put the config back: model.peft_config[{adapter!r}].{field} = "
                    f"{held[field]!r}.")
            usual = held["lora_alpha"] / (math.sqrt(held["r"]) if held["use_rslora"] else held["r"])
            if not math.isclose(scale, usual, rel_tol=1e-6):
                raise ValueError(
                    f"{func}(model=...) has LoRA layers that scale the adapter {adapter!r} by {scale:g} where its "
                    f"lora_alpha and r give {usual:g} (e.g. {key}: peft's scale_layer() or set_scale() was called), "
                    f"and a save writes lora_alpha and r: the saved adapter would act at another scale than the "
                    f"one trained. Put the scale back with unscale_layer() on the layers, or create the adapter with "
                    f"the lora_alpha you want (get_peft_model(model, LoraConfig(..., lora_alpha=...))).")


def check_trained_is_saved(model) -> None:
    """A peft model's run ends by saving its active adapter: a weight trained outside it (a norm or a head
    unfrozen by hand) would be trained, kept in the checkpoints, and missing from the result."""
    if not getattr(model, "peft_config", None) or not isinstance(getattr(model, "active_adapter", None), str):
        return
    config = getattr(model, "active_peft_config", None)
    if getattr(config, "is_prompt_learning", False):
        kind = getattr(config.peft_type, "value", config.peft_type)
        raise ValueError(f"train(model=...) has a prompt-learning adapter ({kind}: virtual tokens before the "
                         f"prompt), which grpo-nb does not train: its log-probs and generation run on the model's "
                         f"own layers. Use LoRA "
                         f"(setup_reasoning_model(lora_rank=16), or peft's LoraConfig) or another adapter on the "
                         f"layers (DoRA, IA3, LoHa).")
    from peft import get_peft_model_state_dict

    active = model.active_adapter
    # peft can run several adapters at once (set_adapter([...]) on its layers): the loss would train through all of
    # them, and the save write only the one above, which loaded alone is not the policy trained
    stacked = sorted({name for m in model.modules() if hasattr(m, "adapter_layer_names")
                      for name in getattr(m, "active_adapters", ()) or ()})
    if len(stacked) > 1:
        raise ValueError(f"train(model=...) has {len(stacked)} LoRA adapters active at once ({stacked}): every "
                         f"rollout and loss would run through all of them, and the end of the run saves only "
                         f"{active!r}, which loaded alone is not the model trained. Make one adapter active: "
                         f"model.set_adapter({active!r}) (or delete the other: "
                         f"model.delete_adapter({[n for n in stacked if n != active][0]!r})).")
    # what the save holds, by the memory of each tensor (its names differ from the parameters')
    saved = {t.data_ptr() for t in get_peft_model_state_dict(model, adapter_name=active).values()}
    outside = [name for name, p in model.named_parameters() if p.requires_grad and p.data_ptr() not in saved]
    if outside:
        raise ValueError(f"train(model=...) trains {len(outside)} weight(s) outside its LoRA adapter {active!r} (e.g. "
                         f"{outside[0]}), which the adapter train() saves at the end would not hold: the result would "
                         f"load without them. Freeze them (param.requires_grad_(False)), or make them part of the "
                         f"adapter: LoraConfig(modules_to_save=[...]) for whole modules.")


def check_inputs(model, tokenizer, dataset, reward_funcs, config: GRPOConfig, *, callbacks=(), verbose=None,
                 live=None, resume_from_checkpoint=None, agent=None, rollout_func=None) -> None:
    """Fail before any work with a message that says what is wrong and how to fix it."""
    check_run_arguments(callbacks, verbose, live, resume_from_checkpoint)
    check_model_and_tokenizer("train", model, tokenizer)
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) < 0.75 * rows:  # a padded embedding is a few hundred rows past the tokenizer, not a quarter
        warnings.warn(f"train(tokenizer=...) has {len(tokenizer)} tokens, and the model's embedding {rows} rows: a "
                      f"tokenizer this much smaller is likely another model's. The {rows - len(tokenizer)} ids past "
                      f"it, which the model can generate, decode to no text, so the rewards would score completions "
                      f"with tokens dropped. Load the tokenizer from the model's own name or folder.", UserWarning,
                      stacklevel=3)
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
    check_trained_is_saved(model)
    check_lora_config("train", model)
    check_adapter_name("train", model)
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
    # with environments, reward functions also get each episode's instance (TRL's `environments` keyword)
    check_reward_funcs(reward_funcs, [*columns, *(["environments"] if agent and agent.factories else [])],
                       config.reward_weights, more_columns=rollout_func is not None)
    check_reward_threads(reward_funcs, config.reward_timeout)  # math_verify's signal.alarm: main thread only
    if config.beta > 0 and not hasattr(model, "disable_adapter"):
        raise ValueError(
            f"beta={config.beta} needs a reference policy, which grpo-nb takes as the model with its LoRA adapter "
            f"switched off; this model has no adapter. Use setup_reasoning_model(lora_rank=...) or set beta=0."
        )
    check_context("train", model, config.max_prompt_length, config.max_completion_length)
    check_prompts("train", model, tokenizer, dataset, conversational, agent=agent,  # as the run renders them
                  chat_template_kwargs=config.chat_template_kwargs)
    tensorboard_default = config.logging_dir is None and "tensorboard" in tracker_names(config.report_to)
    check_output_dir(Path(config.output_dir), resume_from_checkpoint, runs=tensorboard_default, model=model)
    check_log_paths(config, model)
    check_writable(Path(config.output_dir))


def check_eval_settings(config: GRPOConfig, eval_dataset, rollout_func=None) -> None:
    """train(eval_dataset=...) and the config's eval_* settings go together (TRL refuses an eval_strategy without an
    eval set too): an evaluation asked for without a set, or a set given that nothing would evaluate, is refused
    with the setting that fixes it, not dropped."""
    asked = ("eval_strategy='steps'" if config.eval_strategy == "steps" else
             f"eval_steps={config.eval_steps}" if config.eval_interval is not None else
             "eval_on_start=True" if config.eval_on_start else None)
    if eval_dataset is None:
        if asked:
            raise ValueError(f"GRPOConfig.{asked} evaluates the model on a held-out set during training, and train() "
                             f"got no eval_dataset: pass train(..., eval_dataset=heldout) (a few rows with a 'prompt' "
                             f"and an 'answer', as evaluate() takes), or leave eval_strategy, eval_steps and "
                             f"eval_on_start unset.")
        return
    if not asked:
        why = ("eval_strategy='no'" if config.eval_strategy == "no" else "no eval_steps is set")
        raise ValueError(f"train(eval_dataset=...) would never be evaluated: {why}. Set eval_steps=N to evaluate it "
                         f"every N steps and after the last (eval_on_start=True adds one before the first step), or "
                         f"leave eval_dataset out and call evaluate(model, tokenizer, heldout) after training.")
    if rollout_func is not None:
        raise ValueError("train(eval_dataset=...) with rollout_func: the held-out evaluation generates greedy "
                         "completions with grpo-nb's engine, not your rollout_func, so it would not measure what the "
                         "run samples. Leave eval_dataset out and evaluate after training, or drop rollout_func.")


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


def check_prompts(func: str, model, tokenizer, dataset, conversational: bool, agent=None,
                  chat_template_kwargs: dict | None = None) -> None:
    """What the model will be asked, checked before any work (train(), evaluate(), sample_and_score()):
    the tokenizer can batch and end them, the chat template renders them as meant, no prompt is empty.
    `agent` (a run with tools): checked with the template its episodes render with (run_template); with a dict of
    environments, every row's 'environment' column is read now, not when the row is drawn (batches later).
    `chat_template_kwargs`: the prompts rendered with them, as the run renders them."""
    if agent is not None:
        from .episodes import check_environment_column

        check_environment_column(agent, dataset)
    _check_eos_is_a_token(func, tokenizer)
    check_tokenizer(func, model, tokenizer, conversational)  # a pad token, an EOS, a chat template if needed
    if conversational:
        if isinstance(getattr(tokenizer, "chat_template", None), dict) and tokenizer.chat_template:
            from .episodes import check_named_templates  # named templates: strings, a "default" among them

            check_named_templates(tokenizer.chat_template)
            _check_no_blank_template(tokenizer.chat_template)
    with run_template(tokenizer, agent) as which:
        rendering = WithTemplateKwargs(tokenizer, chat_template_kwargs) if chat_template_kwargs else tokenizer
        if conversational:
            check_chat_prompt(func, model, rendering, dataset[0]["prompt"], which=which)
        _check_prompt_tokens(func, model, rendering, dataset, which=which)
    if agent is not None:
        # the turn that calls a tool ends where generation stops, or its result could never follow: found now,
        # not at the first call the model writes (tools.tool_suffix's refusal, maybe hours into a run)
        eos_texts = [tokenizer.convert_ids_to_tokens(i) for i in eos_token_ids(model, tokenizer)]
        try:
            check_turn_ends(tokenizer, eos_texts, agent.template)
        except TurnEndNotEOS as err:
            raise TurnEndNotEOS(f"{func}(): {err}") from None


def _check_eos_is_a_token(func: str, tokenizer) -> None:
    """tokenizer.eos_token set to a text that is not one token of the vocabulary (eos_token = "</answer>"): it has
    no id (or the unknown token's), so no completion could end at it. Said so, rather than "set
    tokenizer.eos_token", which the user did."""
    eos = getattr(tokenizer, "eos_token", None)
    if not isinstance(eos, str) or not eos:
        return
    unk = getattr(tokenizer, "unk_token", None)
    token_id = tokenizer.convert_tokens_to_ids(eos)
    if token_id is not None and (eos == unk or token_id != getattr(tokenizer, "unk_token_id", None)):
        return
    try:
        pieces = tokenizer.convert_ids_to_tokens(tokenizer(eos, add_special_tokens=False)["input_ids"])
        spelled = f" (it encodes as {len(pieces)} tokens, {pieces[:8]})"
    except Exception:  # noqa: BLE001 - the message does without it
        spelled = ""
    raise ValueError(f"{func}(tokenizer=...): tokenizer.eos_token is {eos!r}, which is not a single token of this "
                     f"tokenizer's vocabulary{spelled}, so it has no id that generation could stop at. Set "
                     f"tokenizer.eos_token to a token the tokenizer has (the model's own EOS), or make {eos!r} one: "
                     f"tokenizer.add_special_tokens({{'eos_token': {eos!r}}}) and "
                     f"model.resize_token_embeddings(len(tokenizer)).")


def _check_no_blank_template(named: dict) -> None:
    """A named chat template that is blank ('' or whitespace) renders nothing of any conversation: in a run with
    tools only 'tool_use' is rendered, so a blank 'default' would pass every other check and be saved with the
    adapter, rendering every chat without tools as that. Refused as a template that is not a string is."""
    for key, value in named.items():
        if isinstance(value, str) and not value.strip():
            raise ValueError(f"tokenizer.chat_template[{key!r}] is blank ({value!r}): it renders every conversation "
                             f"{'with tools ' if key == 'tool_use' else 'without tools ' if key == 'default' else ''}"
                             f"as no text, and the tokenizer saved with the adapter would keep it. Set it to a "
                             f"template, e.g. the model's own (tokenizer.chat_template[{key!r}] = '...')"
                             f"{'' if key == 'default' else f', or remove it (del tokenizer.chat_template[{key!r}])'}.")


@contextmanager
def run_template(tokenizer, agent):
    """The tokenizer's chat template set, while the prompts are checked, to the one the run renders them with,
    and put back after; yields how to name it. A run with tools renders its prompts with tools given: with
    transformers' named 'tool_use' (where it renders tools), or with the template grpo-nb chose (agent.template,
    set on the tokenizer only once the inputs are checked). Checking 'default' instead would miss a 'tool_use'
    that opens no assistant turn, and warn of a 'default' this run does not render with."""
    current = getattr(tokenizer, "chat_template", None)
    named = isinstance(current, dict) and bool(current)
    template, which = None, "the chat template"
    if agent is not None:  # agent.template None: the tokenizer's own, as transformers picks it with tools given
        template = agent.template if agent.template is not None else current.get("tool_use") if named else None
    name = next((k for k in ("tool_use", "default") if current.get(k) == template), None) if named else None
    if template is not None and name is not None:
        why = "as tools are given" if name == "tool_use" else "as its 'tool_use' cannot render tools"
        which = (f"the chat template {name!r} (tokenizer.chat_template[{name!r}], which this run renders its "
                 f"prompts with, {why})")
    elif template is not None and template != current:
        which = "grpo-nb's tool template (grpo_nb.tool_chat_template, which this run renders its prompts with)"
    if template is None or template == current:
        yield which
        return
    tokenizer.chat_template = template
    try:
        yield which
    finally:
        tokenizer.chat_template = current


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


def check_chat_prompt(func: str, model, tokenizer, messages, row: int = 0, which: str = "the chat template") -> None:
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
        raise ValueError(f"{func}(tokenizer=...): {which} drops the messages' content: dataset row "
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
        warnings.warn(f"{func}(): {which} opens no assistant turn: add_generation_prompt=True adds "
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


def _check_prompt_tokens(func: str, model, tokenizer, dataset, which: str = "the chat template") -> None:
    """Every prompt becomes at least one token, and every chat prompt keeps its messages (row 0 is checked in
    full by check_chat_prompt; a template without a role that only later rows have - a system prompt on some
    rows - drops it from those): found now, not mid-run."""
    for start in range(0, len(dataset), 512):
        rows = dataset[start : start + 512]  # a dict of columns from a datasets.Dataset, a list of rows from a list
        prompts = rows["prompt"] if isinstance(rows, dict) else [row["prompt"] for row in rows]
        texts = prompt_texts(tokenizer, prompts, first_row=start)
        for i, (prompt, text) in enumerate(zip(prompts, texts)):
            if not isinstance(prompt, str) and _dropped_messages(prompt, text) is not None:
                check_chat_prompt(func, model, tokenizer, prompt, row=start + i, which=which)  # raises, naming it
        lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
        if 0 in lengths:
            raise ValueError(f"Dataset row {start + lengths.index(0)}: its prompt {prompts[lengths.index(0)]!r} "
                             f"becomes no tokens at all with this tokenizer, so the model would be asked nothing. "
                             f"Filter such rows out: dataset.filter(lambda row: ...), or fix the prompt text.")


