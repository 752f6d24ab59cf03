"""Prompts -> scored groups: encode, roll out, decode, call the reward functions.

The one path from dataset rows to rewarded completions, shared by `train()` (sampled groups,
strict rewards), `evaluate()` (greedy, one completion per prompt) and `sample_and_score()`
(sampled groups, a failing reward function shown in its cells instead of raised).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .reward_calls import call_reward_funcs, rewards_tensor
from .reward_contract import RewardCall, RewardLog, reward_columns
from .rollout.batch import WithTemplateKwargs
from .rollout import (RolloutBatch, check_rollout_batch, check_tokenizer, decode_completions, encode_prompts,
                      eos_token_ids, prompt_texts, returns_logprobs)


def embedding_rows(model) -> int | None:
    """The rows of the model's input embedding (token ids must be below it); None when the model does not say."""
    try:
        return model.get_input_embeddings().weight.shape[0]
    except (AttributeError, NotImplementedError):
        return None


def input_device(model) -> torch.device:
    """Where the prompt ids go: the device the input embedding runs on. accelerate's offload (cpu_offload(), a
    device_map with "cpu" or "disk") keeps an offloaded layer's weights on meta and moves them, and the inputs, to
    its hook's execution device for each forward: ids on meta (the first weight's device) cannot be moved there."""
    try:
        embedding = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embedding = None
    hook = getattr(embedding, "_hf_hook", None)
    for h in (hook, *getattr(hook, "hooks", ())):  # a SequentialHook holds several
        if getattr(h, "execution_device", None) is not None:
            return torch.device(h.execution_device)
    weight = getattr(embedding, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.device.type != "meta":
        return weight.device
    return next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))


@dataclass
class ScoredGroups:
    """`num_generations` completions of each prompt, next to each other, and what each reward function said."""
    rows: list[dict]  # per completion: its prompt's row (the prompt and the other columns)
    num_generations: int
    rollout: RolloutBatch  # token ids, masks, truncation, the sampler's log-probs
    texts: list[str]
    completions: list  # as reward functions get them: strings, or chat messages for chat prompts
    completion_ids: list[list[int]]
    calls: list[RewardCall]  # one per reward function
    generation_time: float
    prompts_cut: int  # prompts longer than max_prompt_length, cut from the left
    rewards_per_func: torch.Tensor  # [N, num_funcs] float32; NaN where a function gave no score
    log: RewardLog  # what the reward functions logged through log_extra / log_metric


def score_groups(model, tokenizer, rows: list[dict], rollout, num_generations: int, reward_funcs=(), *,
                 max_prompt_length: int | None = None, strict: bool = True, trainer_state=None,
                 timeout: float | None = None, caller: str = "score_groups", agent=None,
                 max_completion_length: int | None = None, chat_template_kwargs: dict | None = None) -> ScoredGroups:
    """Roll out `num_generations` completions for each row's prompt and score them all.

    `rollout`: any rollout callable (`grpo_nb.rollout`). Each reward function gets the rows'
    columns but the prompt as keywords (repeated per generation), TRL-style. `strict`: a reward
    function that breaks the contract raises RewardFunctionError; otherwise each RewardCall says
    what went wrong where. A completion no function scored stays NaN in every column: what to do
    with it is the caller's (training leaves it out of its group's advantages). `caller`: the
    public function named in the message when the tokenizer cannot encode the prompts. `agent`
    (episodes.Agent): each completion is an episode of tool calls (`episodes.run_episodes`, within
    `max_completion_length` tokens); reward functions get its messages, and `environments` with an
    environment_factory; the tools' call counts go to the log's metrics ("tools/...").
    `chat_template_kwargs`: extra apply_chat_template() arguments for chat prompts (GRPOConfig's, e.g.
    {"enable_thinking": False}), in episodes too (every turn's rendering).
    """
    device = input_device(model)
    prompts = [row["prompt"] for row in rows]
    check_tokenizer(caller, model, tokenizer, not isinstance(prompts[0], str))
    repeated = [row for row in rows for _ in range(num_generations)]
    columns = {key: [row[key] for row in repeated] for key in reward_columns(rows[0])}
    eos_ids = eos_token_ids(model, tokenizer)
    started = time.perf_counter()
    if getattr(rollout, "takes_prompts", False):  # TRL's rollout_func (rollout_func.RolloutFunc): its own loop
        out, extra = rollout.generate(model, tokenizer, rows, num_generations, trainer_state, device, eos_ids,
                                      embedding_rows(model))
        generation_time, cut = time.perf_counter() - started, 0
        texts, completions, completion_ids = decode_completions(tokenizer, out, not isinstance(prompts[0], str))
        reward_prompts, tool_metrics = [row["prompt"] for row in repeated], {}
        columns.update(extra)  # the function's other keys, by name (TRL's)
    elif agent is None:
        texts = prompt_texts(WithTemplateKwargs(tokenizer, chat_template_kwargs), prompts) if (
            chat_template_kwargs and not isinstance(prompts[0], str)) else None
        prompt_ids, prompt_mask, cut = encode_prompts(tokenizer, prompts, max_prompt_length, device, texts)
        out = rollout(model, tokenizer, prompt_ids, prompt_mask, num_generations)
        generation_time = time.perf_counter() - started
        check_rollout_batch(out, prompt_ids, prompt_mask, num_generations, rollout,
                            engine=returns_logprobs(rollout) is not None, vocab_size=embedding_rows(model),
                            eos_ids=eos_ids)
        texts, completions, completion_ids = decode_completions(tokenizer, out, not isinstance(prompts[0], str))
        reward_prompts, tool_metrics = [row["prompt"] for row in repeated], {}
    else:
        from .attachments import model_context
        from .episodes import run_episodes

        episodes = run_episodes(model, tokenizer, rows, rollout, num_generations, agent,
                                max_prompt_length=max_prompt_length, max_completion_length=max_completion_length,
                                context=model_context(model), device=device, eos_ids=eos_ids,
                                vocab_size=embedding_rows(model), engine=returns_logprobs(rollout) is not None,
                                chat_template_kwargs=chat_template_kwargs)
        generation_time, out, cut = time.perf_counter() - started, episodes.batch, episodes.prompts_cut
        texts, completions, reward_prompts = episodes.texts, episodes.completions, episodes.prompts
        completion_ids = [ids[m.bool()].tolist() for ids, m in zip(out.completion_ids, out.completion_mask)]
        if episodes.environments is not None:
            columns["environments"] = episodes.environments
        tool_metrics = episodes.metrics()
    log = RewardLog(len(texts))
    calls = call_reward_funcs(list(reward_funcs), prompts=reward_prompts,
                              completions=completions, completion_ids=completion_ids, columns=columns,
                              trainer_state=trainer_state, timeout=timeout, strict=strict,
                              log=log) if reward_funcs else []
    for name, values in tool_metrics.items():
        log.metrics.setdefault(name, []).extend(values)
    return ScoredGroups(repeated, num_generations, out, texts, completions, completion_ids, calls,
                        generation_time, cut, rewards_tensor(calls, len(texts)), log)
