"""Everything `train()` checks before any work: a wrong input fails in seconds, with a message
that names what is wrong and how to fix it, not after loading, rollouts or hours of training."""

from __future__ import annotations

import tempfile
from pathlib import Path

from .attachments import model_context
from .config import GRPOConfig
from .data import check_dataset
from .rewards import check_reward_funcs
from .rollout import eos_token_ids, prompt_texts, uses_vllm


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


def check_inputs(model, tokenizer, dataset, reward_funcs, config: GRPOConfig) -> None:
    """Fail before any work with a message that says what is wrong and how to fix it."""
    columns, conversational = check_dataset(dataset)
    check_reward_funcs(reward_funcs, columns, config.reward_weights)
    if tokenizer.pad_token_id is None:
        raise ValueError("The tokenizer has no pad token, which batching prompts needs. Set one, e.g. "
                         "tokenizer.pad_token = tokenizer.eos_token, or run grpo_nb.prepare_tokenizer(tokenizer) "
                         "(setup_reasoning_model does this for you).")
    eos_token_ids(model, tokenizer)  # raises if completions could never end
    if conversational and not getattr(tokenizer, "chat_template", None):
        raise ValueError("The prompts are chat messages but the tokenizer has no chat template to render them. "
                         "Set tokenizer.chat_template, run grpo_nb.prepare_tokenizer(tokenizer) for grpo-nb's "
                         "default template, or make the prompts plain strings.")
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
    if context and config.max_prompt_length is None:
        _check_prompt_lengths(tokenizer, dataset, context - config.max_completion_length, config)
    _check_writable(Path(config.output_dir))


def _check_prompt_lengths(tokenizer, dataset, room: int, config) -> None:
    """With no max_prompt_length nothing cuts prompts, so one too long for the context is an error; find it now."""
    for start in range(0, len(dataset), 512):
        rows = dataset[start : start + 512]  # a dict of columns from a datasets.Dataset, a list of rows from a list
        prompts = rows["prompt"] if isinstance(rows, dict) else [row["prompt"] for row in rows]
        lengths = [len(ids) for ids in tokenizer(prompt_texts(tokenizer, prompts), add_special_tokens=False)["input_ids"]]
        longest = max(range(len(lengths)), key=lengths.__getitem__)
        if lengths[longest] > room:
            raise ValueError(
                f"Dataset row {start + longest}: its prompt is {lengths[longest]} tokens, and with "
                f"max_completion_length={config.max_completion_length} that exceeds the model's max_seq_length "
                f"{room + config.max_completion_length}. Set max_prompt_length (prompts are then cut from the left), "
                f"filter long prompts out of the dataset, or load the model with a larger max_seq_length.")


def _check_writable(output_dir: Path) -> None:
    """The run ends by saving to output_dir: find out now, not after hours of training, if it can't."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=output_dir):
            pass
    except OSError as err:
        raise OSError(f"output_dir={str(output_dir)!r} is not a writable folder ({err}); checkpoints and the "
                      f"trained adapter are saved there. Pass another output_dir.") from err
