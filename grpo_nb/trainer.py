"""The GRPO loop: prompts -> rollout -> rewards -> advantages -> log-probs -> loss -> optimizer step.

`train()` composes the stages; each stage is a plain function in its own module. Every
optimizer step appends one plain record (a dict) to the history and hands it to the
callbacks, which is all the widgets ever see.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

from .checkpointing import (find_checkpoint, load_training_checkpoint, rng_state, rotate_checkpoints, save_checkpoint,
                            save_training_checkpoint, set_rng_state)
from .config import GRPOConfig
from . import distributed
from .data import check_dataset
from .distributed import World
from .logprobs import _triton_kernels, completion_logprobs, output_head
from .loss import group_advantages, grpo_loss, high_entropy_mask
from .memory import MemoryTracker, gradient_bytes, logprob_scratch_bytes, oom_message, text_config
from .rewards import check_reward_funcs, combine_rewards, reward_columns, reward_func_name, score_completions
from .rollout import (RolloutEngine, decode_completions, encode_prompts, eos_token_ids, make_rollout, prompt_texts,
                      uses_vllm)


# --------------------------------------------------------------------------------------
# Inputs


class PromptSampler:
    """Endless seeded shuffles of the dataset, a fixed number of rows at a time."""

    def __init__(self, dataset, rows_per_batch: int, seed: int, world: World = World()):
        self.dataset, self.rows_per_batch, self.world = dataset, rows_per_batch, world
        self.generator = torch.Generator().manual_seed(seed)
        self.order: list[int] = []

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "order": list(self.order)}

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


def model_context(model) -> int | None:
    """The most tokens (prompt + completion) the run may use: setup's max_seq_length, else the model's."""
    context = getattr(model, "grpo_nb_max_seq_length", None)
    return context or getattr(getattr(model, "config", None), "max_position_embeddings", None)


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


# --------------------------------------------------------------------------------------
# Stages of one step


@torch.no_grad()
def policy_logprobs(model, batch, config, micro_batch):
    """[N, Tc] log-probs of the sampled tokens, micro-batch by micro-batch, without grad."""
    out = torch.zeros(batch["completion_ids"].shape, dtype=torch.float32, device=batch["completion_ids"].device)
    for s in range(0, out.shape[0], micro_batch):
        lp = completion_logprobs(model, *_micro(batch, s, micro_batch), temperature=config.temperature,
                                 chunk_size=config.logprob_chunk_size, backend=config.logprob_backend)
        out[s : s + micro_batch, : lp.shape[1]] = lp
    return out


def _micro(batch, start, size):
    """One micro-batch's prompt/completion tensors, trimmed of columns that are padding in every row."""
    pm, cm = batch["prompt_mask"][start : start + size], batch["completion_mask"][start : start + size]
    p0 = int(pm.any(0).int().argmax())  # first prompt column with a real token (left padding)
    tc = int(cm.any(0).nonzero().max()) + 1 if cm.any() else 1
    return (batch["prompt_ids"][start : start + size, p0:], pm[:, p0:],
            batch["completion_ids"][start : start + size, :tc], cm[:, :tc])


def generate_and_score(model, tokenizer, prompts, rollout, reward_funcs, config, device, step=0, world=World()):
    """Rollout, rewards and advantages for the next batch of `prompts` (a PromptSampler).

    With `dynamic_sampling` (DAPO), groups whose rewards are all equal (zero advantage: no
    learning signal) are dropped and more prompts are rolled out, up to
    `dynamic_sampling_max_rounds` rollouts, to fill the batch with groups that teach something;
    if the rounds run out, zero-variance groups fill the rest. Then the old/ref log-probs the
    loss needs are computed for the kept rows only.
    """
    batch, info = rollout_and_score(model, tokenizer, next(prompts), rollout, reward_funcs, config, device, step)
    if config.dynamic_sampling:
        parts = [(batch, info)]

        def informative() -> int:  # over all ranks, so that every rank runs the same number of rounds
            found = sum(int(_informative_groups(i["rewards"], config.num_generations).sum()) for _, i in parts)
            return int(distributed.all_reduce(torch.tensor(found), world))

        while informative() < config.prompts_per_step * world.size and len(parts) < config.dynamic_sampling_max_rounds:
            parts.append(rollout_and_score(model, tokenizer, next(prompts), rollout, reward_funcs, config, device,
                                           step))
        batch, info = _keep_informative_groups(parts, config)
    micro = config.per_device_train_batch_size
    sampling_logprobs = batch.pop("sampling_logprobs")
    if config.num_iterations > 1:
        # Later passes over this batch need the sampling policy's log-probs for the ratio.
        batch["old_logprobs"] = sampling_logprobs if sampling_logprobs is not None else \
            policy_logprobs(model, batch, config, micro)
    if config.beta > 0:
        with model.disable_adapter():
            batch["ref_logprobs"] = policy_logprobs(model, batch, config, micro)
    return batch, info


def rollout_and_score(model, tokenizer, rows, rollout, reward_funcs, config, device, step=0):
    """One rollout of `rows` (num_generations completions each), scored, with advantages."""
    prompts = [r["prompt"] for r in rows]
    prompt_ids, prompt_mask, n_cut = encode_prompts(tokenizer, prompts, config.max_prompt_length, device)
    t0 = time.perf_counter()
    out = rollout(model, tokenizer, prompt_ids, prompt_mask, config.num_generations)
    generation_time = time.perf_counter() - t0

    g = config.num_generations
    texts, completions, completion_ids = decode_completions(tokenizer, out, not isinstance(prompts[0], str))
    repeated = [r for r in rows for _ in range(g)]
    columns = {k: [r[k] for r in repeated] for k in reward_columns(rows[0])}
    rewards_per_func = score_completions(
        reward_funcs, prompts=[r["prompt"] for r in repeated], completions=completions,
        completion_ids=completion_ids, columns=columns,
        trainer_state=SimpleNamespace(global_step=step, max_steps=config.max_steps), timeout=config.reward_timeout,
    )
    rewards = combine_rewards(rewards_per_func, config.reward_weights)
    advantages = group_advantages(rewards, g, scale_rewards=config.scale_rewards, estimator=config.advantage_estimator)

    loss_mask = out.completion_mask
    if config.mask_truncated_completions:
        loss_mask = loss_mask * (~out.truncated).long()[:, None]
    batch = {
        "prompt_ids": out.prompt_ids, "prompt_mask": out.prompt_mask,
        "completion_ids": out.completion_ids, "completion_mask": out.completion_mask,
        "loss_mask": loss_mask, "advantages": advantages.to(device), "sampling_logprobs": out.sampling_logprobs,
        "old_logprobs": None, "ref_logprobs": None,
    }
    info = {
        "rows": repeated, "texts": texts, "rewards_per_func": rewards_per_func, "rewards": rewards,
        "truncated": out.truncated, "generation_time": generation_time, "prompts_cut": n_cut, "sampling_rounds": 1,
        "completion_lengths": out.completion_mask.sum(1),
    }
    return batch, info


def _global_view(info: dict, world: World) -> dict:
    """The step's scores over every rank's completions (rank 0's first), for the record.

    Samples (rows, texts) stay local: rank 0's come first in the global order anyway.
    """
    if not world.distributed:
        return info
    return {**info, **{key: distributed.gather_rows(info[key], world)
                       for key in ("rewards", "rewards_per_func", "truncated", "completion_lengths")}}


def _informative_groups(rewards: torch.Tensor, g: int) -> torch.Tensor:
    """[groups] bool: the group's rewards are not all equal, so its advantages are not all zero."""
    grouped = rewards.view(-1, g)
    return grouped.amax(1) > grouped.amin(1)


def _keep_informative_groups(parts, config):
    """One batch of prompts_per_step groups from several rollouts, informative groups first."""
    g, need = config.num_generations, config.prompts_per_step
    flags = [_informative_groups(info["rewards"], g).tolist() for _, info in parts]
    order = [(p, k) for want in (True, False) for p, fl in enumerate(flags) for k, f in enumerate(fl) if f == want]
    chosen = sorted(order[:need])  # generation order, so a batch that needed no refill is unchanged
    rows = {p: [k * g + j for q, k in chosen if q == p for j in range(g)] for p in range(len(parts))}

    def gather(source, pad_left=False):
        pieces = [src[rows[p]] for p, src in enumerate(source) if rows[p]]
        width = max(t.shape[1] for t in pieces) if pieces[0].dim() > 1 else None
        if width is not None:
            pieces = [torch.cat([t.new_zeros(t.shape[0], width - t.shape[1]), t] if pad_left else
                                [t, t.new_zeros(t.shape[0], width - t.shape[1])], dim=1) for t in pieces]
        return torch.cat(pieces)

    batches, infos = [b for b, _ in parts], [i for _, i in parts]
    batch = {"old_logprobs": None, "ref_logprobs": None}
    for key in ("prompt_ids", "prompt_mask"):
        batch[key] = gather([b[key] for b in batches], pad_left=True)
    for key in ("completion_ids", "completion_mask", "loss_mask"):
        batch[key] = gather([b[key] for b in batches])
    have_sampling = all(b["sampling_logprobs"] is not None for b in batches)
    batch["sampling_logprobs"] = gather([b["sampling_logprobs"] for b in batches]) if have_sampling else None
    info = {
        "rows": [infos[p]["rows"][i] for p in rows for i in rows[p]],
        "texts": [infos[p]["texts"][i] for p in rows for i in rows[p]],
        "rewards_per_func": gather([i["rewards_per_func"] for i in infos]),
        "rewards": gather([i["rewards"] for i in infos]),
        "truncated": gather([i["truncated"] for i in infos]),
        "generation_time": sum(i["generation_time"] for i in infos),
        "prompts_cut": sum(i["prompts_cut"] for i in infos),
        "sampling_rounds": len(parts),
        "completion_lengths": batch["completion_mask"].sum(1),
    }
    # Advantages again over the kept batch: per-group ones are unchanged, "batch" scaling needs the kept std.
    batch["advantages"] = group_advantages(info["rewards"], g, scale_rewards=config.scale_rewards,
                                           estimator=config.advantage_estimator).to(batch["prompt_ids"].device)
    return batch, info


def optimize(model, optimizer, params, batch, config, scaler=None) -> dict:
    """One optimizer step over the whole generation batch: accumulate_gradients + apply_update."""
    metrics = accumulate_gradients(model, params, batch, config, scaler)
    apply_update(optimizer, params, metrics, config, scaler)
    return metrics


def accumulate_gradients(model, params, batch, config, scaler=None, world=World()) -> dict:
    """The loss's gradients over the whole generation batch, in micro-batches with accumulation.

    Each micro-batch's loss is normalised by the whole batch's sequence/token counts, so the
    accumulated gradient equals that of one big batch; with several ranks the totals are the
    global batch's and the gradients are summed over ranks at the end, so every rank holds the
    whole batch's gradient. A non-finite loss stops early and marks the step to be skipped. With fp16 weights, `scaler` scales the loss so small gradients
    survive the half-precision backward.
    """
    n = batch["completion_ids"].shape[0]
    micro = config.per_device_train_batch_size
    local_tokens = batch["loss_mask"].sum()
    num_tokens = distributed.all_reduce(local_tokens, world)  # dapo: the tokens of the whole global batch
    # bnpo averages over each process's own tokens (as TRL's does), then over processes.
    loss_tokens = local_tokens * world.size if config.loss_type == "bnpo" else num_tokens
    totals = {"loss": 0.0, "kl": 0.0, "clip_ratio": 0.0, "clip_ratio_low": 0.0, "clip_ratio_high": 0.0}
    finite = True
    # Sharded layers reduce their gradients in every backward, a collective: all ranks must run
    # every micro-batch's backward, even after a non-finite loss (the step is skipped anyway).
    lockstep = world.distributed and distributed.is_sharded(model)
    for s in range(0, n, micro):
        p_ids, p_mask, c_ids, c_mask = _micro(batch, s, micro)
        tc = c_ids.shape[1]
        entropy_mask = None
        if config.top_entropy_quantile < 1.0:
            logprobs, entropies = completion_logprobs(
                model, p_ids, p_mask, c_ids, c_mask, temperature=config.temperature,
                chunk_size=config.logprob_chunk_size, backend=config.logprob_backend, return_entropy=True)
            entropy_mask = high_entropy_mask(entropies, batch["loss_mask"][s : s + micro, :tc],
                                             config.top_entropy_quantile)
        else:
            logprobs = completion_logprobs(model, p_ids, p_mask, c_ids, c_mask, temperature=config.temperature,
                                           chunk_size=config.logprob_chunk_size, backend=config.logprob_backend)
        sl = slice(s, s + micro)
        old = batch["old_logprobs"][sl, :tc] if batch["old_logprobs"] is not None else None
        ref = batch["ref_logprobs"][sl, :tc] if batch["ref_logprobs"] is not None else None
        mask = batch["loss_mask"][sl, :tc]
        loss, m = grpo_loss(
            logprobs, old, ref, batch["advantages"][sl], mask, beta=config.beta, epsilon=config.epsilon,
            epsilon_high=config.epsilon_high, loss_type=config.loss_type,
            max_completion_length=config.max_completion_length, num_sequences=n * world.size, num_tokens=loss_tokens,
            use_bias_correction_kl=config.use_bias_correction_kl,
            importance_sampling_level=config.importance_sampling_level, entropy_mask=entropy_mask,
        )
        if not torch.isfinite(loss):
            finite = False
            if not lockstep:
                break
        (scaler.scale(loss) if scaler is not None else loss).backward()
        weight = float(m["num_tokens"]) / max(float(num_tokens), 1.0)
        # Clip shares are over completions when GSPO gives each completion one ratio.
        clip_weight = c_ids.shape[0] / (n * world.size) if config.importance_sampling_level == "sequence" else weight
        totals["loss"] += float(loss.detach())
        totals["kl"] += float(m["kl"]) * weight
        for k in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
            totals[k] += float(m[k]) * clip_weight
    if world.distributed:
        # One rank's non-finite loss skips the step on every rank; the metrics become global sums.
        finite = bool(distributed.all_reduce(torch.tensor(int(finite)), world, torch.distributed.ReduceOp.MIN))
        summed = distributed.all_reduce(torch.tensor(list(totals.values()), dtype=torch.float64), world)
        totals = dict(zip(totals, summed.tolist()))
        if finite:
            distributed.all_reduce_gradients(params, world)
    return {**totals, "finite": finite, "gradient_bytes": gradient_bytes(params)}


def apply_update(optimizer, params, metrics, config, scaler=None) -> None:
    """Clip and apply the accumulated gradients, or skip the step if anything is non-finite.

    Fills in metrics["grad_norm"] and metrics["skipped"]; the weights are untouched when skipped.
    """
    finite = metrics.pop("finite")
    if finite and scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = float(distributed.clip_grad_norm_(params, config.max_grad_norm)) if finite else math.nan
    skipped = not (finite and math.isfinite(grad_norm))
    if not skipped:
        optimizer.step()
    if finite and scaler is not None:
        scaler.update()  # overflowing gradients (skipped above) halve the scale, as in torch.amp
    optimizer.zero_grad(set_to_none=True)
    if skipped:
        metrics["loss"] = math.nan
    metrics.update(grad_norm=grad_norm, skipped=skipped)


@contextlib.contextmanager
def deferred_interrupts():
    """Hold Ctrl-C (a notebook's Stop button) until the block is done, then raise it.

    The weight update, the schedule and the step count change together inside this block, so
    an interrupt never leaves the model one step ahead of its optimizer or its history.
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield  # handlers can only be set from the main thread; an ignored Ctrl-C (a background job) stays ignored
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            raise KeyboardInterrupt


def _logprob_scratch(model, batch, config) -> int:
    """Bytes the log-prob computation works in for one micro-batch (see memory.logprob_scratch_bytes)."""
    cfg = text_config(model)
    rows = min(config.per_device_train_batch_size, batch["completion_ids"].shape[0]) * batch["completion_ids"].shape[1]
    triton = _triton_kernels(config.logprob_backend, output_head(model)["lm_head_weight"]) is not None
    return logprob_scratch_bytes(rows, cfg.vocab_size, cfg.hidden_size, chunk_size=config.logprob_chunk_size,
                                 backend="triton" if triton else "torch")


def build_optimizer(model, config: GRPOConfig):
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("The model has no trainable parameters: load it with setup_reasoning_model(lora_rank=...).")
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2),
                                  weight_decay=config.weight_decay)
    warmup = int(config.warmup_ratio * config.max_steps)

    def lr_factor(step):
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, config.max_steps - warmup)
        if config.lr_scheduler_type == "linear":
            return 1.0 - progress
        if config.lr_scheduler_type == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor), params


def build_grad_scaler(model, device):
    """Loss scaling for fp16 weights (T4-class GPUs); bf16 and fp32 need none."""
    if any(p.dtype == torch.float16 for p in model.parameters()):
        return torch.amp.GradScaler(device.type, init_scale=2.0**12)
    return None


# --------------------------------------------------------------------------------------
# Records


def _nan_stats(x: torch.Tensor) -> tuple[float, float]:
    x = x[~torch.isnan(x)]
    if x.numel() == 0:
        return math.nan, math.nan
    return float(x.mean()), float(x.std()) if x.numel() > 1 else 0.0


def make_record(step, config, reward_funcs, batch, info, opt_metrics, lr, step_time, device, memory) -> dict:
    """One plain dict per optimizer step: everything the widgets and the summary show."""
    g = config.num_generations
    lengths = info["completion_lengths"].float()
    rewards = info["rewards"]
    record = {
        "step": step,
        "reward": float(rewards.mean()),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "rewards": {},
        "loss": opt_metrics["loss"],
        "kl": opt_metrics["kl"],
        "clip_ratio": opt_metrics["clip_ratio"],
        "clip_ratio_low": opt_metrics["clip_ratio_low"],
        "clip_ratio_high": opt_metrics["clip_ratio_high"],
        "grad_norm": opt_metrics["grad_norm"],
        "skipped_nonfinite": opt_metrics["skipped"],
        "learning_rate": lr,
        "completion_length_mean": float(lengths.mean()),
        "completion_length_max": int(lengths.max()),
        "truncated_fraction": float(info["truncated"].float().mean()),
        "frac_reward_zero_std": float((~_informative_groups(rewards, g)).float().mean()),
        "sampling_rounds": info["sampling_rounds"],
        "prompts_truncated": info["prompts_cut"],
        "generation_time": info["generation_time"],
        "step_time": step_time,
        "peak_memory_bytes": memory["peak"],
        "memory": memory,
        "device": str(device),
        "samples": [],
    }
    names = [reward_func_name(f) for f in reward_funcs]
    for j, name in enumerate(names):
        mean, std = _nan_stats(info["rewards_per_func"][:, j])
        record["rewards"][name] = {"mean": mean, "std": std}
    if config.log_completions:
        for i in range(min(config.num_completions_to_print, len(info["texts"]))):
            row = info["rows"][i]
            prompt = row["prompt"] if isinstance(row["prompt"], str) else row["prompt"][-1]["content"]
            record["samples"].append({
                "prompt": prompt,
                "completion": info["texts"][i],
                "rewards": {n: float(info["rewards_per_func"][i, j]) for j, n in enumerate(names)},
                "reward": float(rewards[i]),
                "advantage": float(batch["advantages"][i]),
                **{k: v for k, v in row.items() if k != "prompt" and isinstance(v, (str, int, float))},
            })
    return record


def _in_notebook() -> bool:
    shell = sys.modules.get("IPython")
    ip = shell.get_ipython() if shell and hasattr(shell, "get_ipython") else None
    return ip is not None and "IPKernelApp" in getattr(ip, "config", {})


def print_progress(record: dict, max_steps: int) -> None:
    """A plain one-line progress report for terminals."""
    skipped = "  SKIPPED (non-finite loss)" if record["skipped_nonfinite"] else ""
    print(
        f"step {record['step']:>4}/{max_steps} | reward {record['reward']:.3f} ± {record['reward_std']:.3f} | "
        f"loss {record['loss']:+.4f} | kl {record['kl']:.4f} | len {record['completion_length_mean']:.0f} | "
        f"{record['step_time']:.1f}s{skipped}",
        flush=True,
    )


def live_dashboard(live, device, max_steps: int, verbose: bool):
    """The live display for `train(live=...)`: None when off; imported only when on."""
    if live is None or live is False:
        return None
    if live is not True:
        return live  # a ready-made grpo_nb_widgets.LiveDashboard (or any callable with close())
    from grpo_nb_widgets import LiveDashboard

    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    return LiveDashboard(device_total_bytes=total, max_steps=max_steps, print_steps=not verbose)


def _close_live(view, error) -> None:
    try:
        view.close(error)
    except Exception as close_error:  # the display never masks the run's own outcome
        warnings.warn(f"The live dashboard failed to show the final state: {close_error!r}", stacklevel=3)


# --------------------------------------------------------------------------------------
# The loop


def train(model, tokenizer, dataset, reward_funcs, config: GRPOConfig | None = None, *, callbacks=(),
          rollout="auto", verbose: bool | None = None, live=None, resume_from_checkpoint=None,
          **overrides) -> list[dict]:
    """Train `model` with GRPO on the prompts of `dataset`, scored by `reward_funcs`.

    Args:
        model, tokenizer: from `setup_reasoning_model()` (or any causal LM + tokenizer).
        dataset: a `datasets.Dataset` or list of dicts with a `prompt` column (a string or a
            list of chat messages); every other column is passed to the reward functions.
        reward_funcs: one function or a list; TRL's convention: `f(prompts, completions,
            completion_ids, **columns) -> list[float | None]`.
        config: a GRPOConfig; keyword overrides (e.g. `max_steps=50`) are applied on top.
        callbacks: functions called with each step's record (widgets plug in here).
        rollout: the generation engine: "auto" (vLLM if the model was set up with
            `fast_inference=True`, else grpo-nb's native engine), "native", "hf" (plain HF
            `generate`, the reference), "vllm", or a callable (see `grpo_nb.rollout`).
        verbose: print a progress line per logged step; default on outside notebooks.
        live: show the dashboard (`grpo_nb_widgets.LiveDashboard`) while training: in a notebook
            updated in place, elsewhere a final text summary; default on in notebooks. Also takes
            a configured `LiveDashboard(png_dir=...)`. Its final state is shown even after an error.
        resume_from_checkpoint: True (the newest checkpoint-<step> in output_dir) or a checkpoint
            folder: continue that run where it stopped, with the same weights, optimizer, schedule,
            random states and data order, so the result equals an uninterrupted run's.

    Returns:
        The history: one dict per optimizer step (see `make_record`), those of a resumed run
        included. Every `save_steps` a resumable checkpoint-<step> is written to `output_dir`
        (the newest `save_total_limit` kept), and the adapter to `output_dir` itself at the end.
        Ctrl-C (a notebook's Stop button) ends the run cleanly: the last completed step is
        saved as a checkpoint and the history returned. Any other error also saves the last
        completed step before it propagates.
    """
    config = (config or GRPOConfig()).replace(**overrides)
    reward_funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    check_inputs(model, tokenizer, dataset, reward_funcs, config)
    verbose = (not _in_notebook()) if verbose is None else verbose
    live = _in_notebook() if live is None else live
    device = next(model.parameters()).device
    world = distributed.setup(device)
    if not world.is_main:  # rank 0 alone prints and shows the dashboard (`live` may be a dashboard object)
        verbose, live = False, False
    sharded = config.fsdp and world.distributed
    if sharded:
        check_shardable(model, rollout)
        distributed.shard_model(model, world)  # before the optimizer: sharding replaces the parameters
    elif config.fsdp:
        warnings.warn("fsdp=True shards weights over several processes; this is one process, so it trains "
                      "unsharded. Launch with torchrun or accelerate launch to shard.", stacklevel=2)
    torch.manual_seed(config.seed)
    # Each rank samples with its own seed: ranks that draw the same prompt must not draw the same completions.
    rollout = make_rollout(rollout or "auto", model, tokenizer,
                           config.replace(seed=config.seed + 1009 * world.rank) if world.distributed else config)
    if sharded and isinstance(rollout, RolloutEngine) and rollout.decode == "auto":
        rollout.decode = "static"  # a CUDA graph cannot hold the layers' weight gathers
    optimizer, scheduler, params = build_optimizer(model, config)
    scaler = build_grad_scaler(model, device)
    memory = MemoryTracker(model, optimizer, device)
    prompts = PromptSampler(dataset, config.prompts_per_step, config.seed, world)
    output_dir = Path(config.output_dir)
    history: list[dict] = []
    step = 0
    pending = None  # [batch, info, optimizer steps left] of the generation batch being trained on

    resume_path = find_checkpoint(resume_from_checkpoint, output_dir)
    if resume_path is not None:
        state = load_training_checkpoint(resume_path, model)
        if world.distributed:
            # Rank 0 wrote the checkpoint: its sampling state and its share of a half-used
            # generation batch are its own. The other ranks keep their seeds, and every rank
            # starts a fresh generation batch, so a data-parallel resume is not bit-exact.
            state = {**state, "pending": None, "rollout": state["rollout"] if world.is_main else None}
        step, pending, history = state["step"], state["pending"], state["history"]
        restore_state(state, optimizer=optimizer, scheduler=scheduler, scaler=scaler, prompts=prompts,
                      rollout=rollout, device=device)
        if step >= config.max_steps:
            warnings.warn(f"The checkpoint {resume_path} is at step {step}, which is already max_steps="
                          f"{config.max_steps}: nothing to train. Raise max_steps to train further.", stacklevel=2)

    def snapshot() -> dict:
        """What the next step depends on besides weights and optimizer: taken at each step's end."""
        return {"step": step, "pending": pending, "rng": rng_state(),
                "sampler": prompts.state_dict(),
                "rollout": rollout.state_dict() if hasattr(rollout, "state_dict") else None}

    def save_state(path) -> Path | None:
        # Sharded weights and moments are gathered whole on every rank (a collective); every rank
        # then holds the same weights and optimizer state, and rank 0 alone writes them.
        trainable = distributed.full_trainable_state(model)
        optimizer_state = distributed.full_optimizer_state(optimizer)
        if not world.is_main:
            return None
        # history grows only with the step count, in the same deferred-interrupt block as
        # last_step, so it always matches last_step and needs no copy per step.
        full = {**last_step, "history": history, "optimizer": optimizer_state,
                "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict() if scaler is not None else None}
        path = save_training_checkpoint(path, model=model, tokenizer=tokenizer, config=config,
                                        history=history, state=full, trainable=trainable)
        rotate_checkpoints(output_dir, config.save_total_limit)
        return path

    last_step = snapshot()
    warned_cut = False
    view = live_dashboard(live, device, config.max_steps, verbose)
    if view is not None and history and hasattr(view, "history"):
        view.history.extend(history)  # a resumed run's curves start where the run began
    callbacks = [*callbacks, view] if view is not None else list(callbacks)
    model.train()

    error, phase = None, "setup"
    try:
        while step < config.max_steps:
            t0 = time.perf_counter()
            if pending is None:
                phase = "rollout"
                memory.start_rollout()
                batch, info = generate_and_score(model, tokenizer, prompts, rollout, reward_funcs, config,
                                                 device, step, world)
                info = _global_view(info, world)
                memory.end_rollout(*batch["completion_ids"].shape[:1],
                                   batch["prompt_ids"].shape[1] + batch["completion_ids"].shape[1])
                if info["prompts_cut"] and not warned_cut:
                    warnings.warn(
                        f"{info['prompts_cut']} prompt(s) were longer than max_prompt_length="
                        f"{config.max_prompt_length} tokens and were cut from the left, keeping their last "
                        f"{config.max_prompt_length} tokens. Raise max_prompt_length to keep them whole.", stacklevel=2)
                    warned_cut = True
                pending = [batch, info, config.num_iterations]
            batch, info = pending[0], pending[1]
            phase = "update"
            lr = scheduler.get_last_lr()[0]
            memory.start_update()
            opt_metrics = accumulate_gradients(model, params, batch, config, scaler, world)
            with deferred_interrupts():  # the update, the schedule, the count and the history move together
                apply_update(optimizer, params, opt_metrics, config, scaler)
                with warnings.catch_warnings():  # a skipped step still advances the schedule
                    warnings.simplefilter("ignore", UserWarning)
                    scheduler.step()
                step += 1
                pending[2] -= 1
                if pending[2] == 0:
                    pending = None
                memory.end_update(gradients=opt_metrics["gradient_bytes"],
                                  logprob_scratch=_logprob_scratch(model, batch, config))
                record = make_record(step, config, reward_funcs, batch, info, opt_metrics, lr,
                                     time.perf_counter() - t0, device, memory.breakdown())
                history.append(record)
                if config.sample_history_steps is not None and len(history) > config.sample_history_steps:
                    # Long runs would otherwise keep every step's completions in RAM: memory must stay flat.
                    history[-config.sample_history_steps - 1]["samples"] = []
                last_step = snapshot()
            if verbose and (step % config.logging_steps == 0 or step == config.max_steps):
                print_progress(record, config.max_steps)
            for callback in callbacks:
                callback(record)
            if config.save_steps and step % config.save_steps == 0:
                save_state(output_dir / f"checkpoint-{step}")
            check_nonfinite_streak(history, config)
    except BaseException as err:
        # Whatever stopped the run (Ctrl-C, a bad reward, out of memory), keep the last completed step.
        error = err
        optimizer.zero_grad(set_to_none=True)  # a backward cut short leaves partial gradients
        model.train()
        message = f"grpo-nb: the run stopped at step {step}/{config.max_steps}"
        if history and sharded:
            # Gathering the shards is a collective, which a rank stopped by an error alone would hang in.
            message += (f"; a sharded (fsdp) run keeps the checkpoints written every save_steps={config.save_steps}: "
                        f"train(..., resume_from_checkpoint=True) continues from the newest in {output_dir}")
        elif history:
            try:
                path = save_state(output_dir / f"checkpoint-{step}")
                if path is not None:  # None on ranks other than 0, which write nothing
                    message += (f"; everything up to step {step} is saved in {path}. "
                                f"train(..., resume_from_checkpoint=True) continues from there.")
            except Exception as save_error:  # never mask the original error
                message += (f"; saving a checkpoint failed too ({save_error}). The trained weights are still in "
                            f"`model` (save them with grpo_nb.save_adapter once there is room) and the history "
                            f"is on this error as .grpo_nb_history (in a notebook: sys.last_value.grpo_nb_history)")
        err.grpo_nb_history = history
        if isinstance(err, KeyboardInterrupt):
            print(message.replace("grpo-nb: the run stopped", "Training interrupted", 1), flush=True)
            error = None  # an interrupt is how a user ends a run early: return what was learned
            return history
        if isinstance(err, torch.cuda.OutOfMemoryError):
            if device.type == "cuda":
                torch.cuda.empty_cache()  # let the user's next cell (or a smaller run) have the memory back
            guidance = oom_message(phase, step, config, model, history[-1]["memory"] if history else None, device)
            error = torch.cuda.OutOfMemoryError(f"{guidance}\n{message}.\nThe original error: {err}")
            raise error from err
        if hasattr(err, "add_note"):
            err.add_note(message)
        raise
    finally:
        if view is not None:
            _close_live(view, error)
    try:
        trainable = distributed.full_trainable_state(model)  # a collective when sharded: every rank gathers
        if world.is_main:
            save_checkpoint(model, tokenizer, output_dir, config=config, history=history, trainable=trainable)
        distributed.barrier(world)  # the other ranks return once the result is on disk
    except OSError as err:
        err.grpo_nb_history = history
        err.add_note(f"grpo-nb: training finished ({step} steps) but saving the result failed. The trained weights "
                     f"are still in `model`: free space or pick another folder and call grpo_nb.save_adapter(model, "
                     f"path, tokenizer). The history is on this error as .grpo_nb_history.")
        raise
    return history


class NonFiniteTrainingError(RuntimeError):
    """Too many steps in a row had a NaN/inf loss or gradient; the weights were left untouched."""


def check_nonfinite_streak(history, config) -> None:
    """Stop the run once the last `max_nonfinite_steps` steps were all skipped as non-finite."""
    streak = 0
    for record in reversed(history):
        if not record["skipped_nonfinite"]:
            break
        streak += 1
    if streak >= config.max_nonfinite_steps:
        first = history[-streak]["step"]
        raise NonFiniteTrainingError(
            f"The last {streak} steps ({first} to {history[-1]['step']}) all had a non-finite (NaN or inf) loss or "
            f"gradient, so each was skipped: the weights are unchanged since step {first - 1}. Usual causes: a "
            f"learning rate too high (now {config.learning_rate:g}); fp16 overflow (load with dtype='bfloat16' or "
            f"'float32' if the hardware has it); rewards of a huge scale; a model already broken before training "
            f"(check its outputs). max_nonfinite_steps={config.max_nonfinite_steps} sets how many in a row are allowed."
        )


def restore_state(state, *, optimizer, scheduler, scaler, prompts, rollout, device) -> None:
    """Put a checkpoint's optimizer, schedule, random states and data position back in place."""
    distributed.load_optimizer_state(optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])
    prompts.load_state_dict(state["sampler"])
    if state["rollout"] is not None and hasattr(rollout, "load_state_dict"):
        rollout.load_state_dict(state["rollout"])
    set_rng_state(state["rng"])
    if state["pending"] is not None:  # a generation batch still being iterated on (num_iterations > 1)
        batch = state["pending"][0]
        state["pending"][0] = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
