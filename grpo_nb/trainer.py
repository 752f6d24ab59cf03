"""The GRPO loop: prompts -> rollout -> rewards -> advantages -> log-probs -> loss -> optimizer step.

`train()` composes the stages of `step.py`; each is a plain function. Every optimizer step
appends one plain record (a dict, `records.make_record`) to the history and hands it to the
callbacks, which is all the widgets ever see. Setting up, resuming and stopping are named
functions around the loop, so the loop itself is one GRPO step on one screen.
"""

from __future__ import annotations

import copy
import os
import time
import warnings

import torch

from . import distributed
from .checkpointing import (check_no_later_checkpoints, check_storable_rollout_state, find_checkpoint,
                            rng_state)
from .run_lock import output_dir_lock
from .resume import (check_same_tokenizer, data_identity, read_training_checkpoint, restore_state, run_identity,
                     warn_changed_settings, warn_other_rollout)
from .attachments import attachments, model_context, text_config
from .checks import check_eval_settings, check_inputs, check_shardable
from .config import GRPOConfig
from .trl_config import from_trl_config
from .data import PromptSampler
from .dataset_checks import as_dataset
from .display import in_notebook, live_dashboard
from .episodes import env_reward_funcs, make_agent
from .models import checkpointing_for
from .evaluation import check_eval_world, checked_eval_dataset, evaluate_during_training
from .rollout_func import RolloutFunc
from .logprobs import output_head, triton_kernels
from .memory import MemoryTracker, logprob_scratch_bytes
from .records import make_record, print_progress
from .rollout import (PRECISION_SETTINGS, ResumableRollout, RolloutEngine, make_rollout, rollout_precision,
                      rollout_state)
from .streaks import check_finite_weights, check_nonfinite_streak, check_unscored_streak, warn_nothing_to_learn
from .reward_contract import reward_func_names
from .run_end import close_views, finish, remember_training, save_state, stopped, warn_trained_before
from .tracking import start_trackers
from .batch import StepBatch, StepMetrics, resumed_batch
from .interrupts import deferred_interrupts
from .optim import build_grad_scaler, build_optimizer, follow_schedule
from .run import Progress, Run, Snapshot
from .rollout_guard import model_kept_for_update, tokenizer_kept
from .step import accumulate_gradients, add_logprobs, apply_update, check_rollout_logprobs, sample_batch


def train(model, tokenizer, dataset, reward_funcs=(), config: GRPOConfig | None = None, *, callbacks=(),
          rollout="auto", tools=None, environment_factory=None, rollout_func=None, eval_dataset=None,
          verbose: bool | None = None, live=None, resume_from_checkpoint=None, **overrides) -> list[dict]:
    """Train `model` with GRPO on the prompts of `dataset`, scored by `reward_funcs`.

    Args:
        model, tokenizer: from `setup_reasoning_model()` (or any causal LM + tokenizer).
        dataset: a `datasets.Dataset` or list of dicts with a `prompt` column (a string or a
            list of chat messages); every other column is passed to the reward functions.
        reward_funcs: one function or a list; TRL's convention: `f(prompts, completions,
            completion_ids, **columns) -> list[float | None]`.
        config: a GRPOConfig, or a TRL user's trl.GRPOConfig (read by `from_trl_config`); keyword
            overrides (e.g. `max_steps=50`) are applied on top (a TRL config's warmup_steps stays a count).
        callbacks: functions called with each step's record, after the dashboard and the trackers have it; they
            get a copy, so what they add or change never reaches the history or the checkpoints. A callback
            stops the run early by raising KeyboardInterrupt: it ends like Ctrl-C (below), the history returned;
            any other exception (StopIteration too) propagates, as an error would.
        rollout: the generation engine: "auto" (vLLM if the model was set up with
            `fast_inference=True`, else grpo-nb's native engine), "native", "hf" (plain HF
            `generate`, the reference), "vllm", or a callable (see `grpo_nb.rollout`).
        tools, environment_factory: TRL's: functions the model may call, and an environment class (or a
            dict of them chosen by an `environment` column) whose methods are its tools, built once and
            reset per episode; its `get_reward()` scores episodes. Each completion is then an episode of
            turns (grpo_nb.episodes): tool results are read by the model but not trained on.
        rollout_func: TRL's: f(prompts, trainer) -> {"prompt_ids", "completion_ids", "logprobs", ...} runs its own
            loop (grpo_nb.rollout_func; `trainer.rollout` samples from the live policy).
        eval_dataset: TRL's: held-out rows (a `prompt`, and an `answer` for accuracy) evaluated during training, as
            `evaluate()` does it (greedy; strict and lenient accuracy with 95% intervals, format rate, truncation,
            mean length, each reward function's mean), after every `eval_steps` steps and the last (config's
            eval_strategy / eval_steps; eval_on_start=True adds one before the first step): record["eval"] of the
            steps that evaluated (record["eval_start"] of the first). The whole set each time: pass a small one.
            Checked before the first step; it never changes what the run samples or trains. Its memory peak:
            record["memory"]["evaluation_peak"]. Data parallel: each process evaluates its share of the rows.
        verbose: print a progress line per logged step; default on outside notebooks.
        live: show the dashboard (`LiveDashboard` of the widgets) while training: in a notebook
            updated in place, elsewhere a final text summary; default on in notebooks. Also takes
            a configured `LiveDashboard(png_dir=...)`. Its final state is shown even after an error.
        resume_from_checkpoint: True (the newest checkpoint-<step> in output_dir) or a checkpoint
            folder: continue that run where it stopped, with the same weights, optimizer, schedule,
            random states and data order, so the result equals an uninterrupted run's.

    Returns:
        The history: one dict per optimizer step (see `records.make_record`), those of a resumed
        run included. Every `save_steps` a resumable checkpoint-<step> is written to `output_dir`
        (the newest `save_total_limit` kept), and the adapter to `output_dir` itself at the end.
        Ctrl-C (a notebook's Stop button) ends the run cleanly: the last completed step is
        saved as a checkpoint and the history returned; pressed during that write or the final
        save, it waits for the write to finish. Any other error also saves the last completed
        step before it propagates. A run resumed and stopped before a step completed writes
        nothing: the checkpoint it resumed from stays as it was.
    """
    reward_funcs = [] if reward_funcs is None else list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) \
        else [reward_funcs]
    dataset = as_dataset(dataset)  # e.g. a pandas DataFrame
    if config is not None and not isinstance(config, GRPOConfig):  # a TRL user's trl.GRPOConfig
        # its counts and fractions of the run (warmup_steps, save_steps < 1) are taken of the max_steps it will run
        config = from_trl_config(config, dataset_size=len(dataset) if hasattr(dataset, "__len__") else None,
                                 max_steps=overrides.get("max_steps"))
    # the paths it writes, absolute as the system reads them: checked and written at the same folders, wherever the
    # working directory goes during the run (a reward's sandbox, a callback's %cd)
    config = (config or GRPOConfig()).replace(**overrides).anchored()
    if rollout_func is not None and (tools or environment_factory is not None):
        raise ValueError("rollout_func runs its own loop, so tools= and environment_factory= would not be used: pass "
                         "either rollout_func, or tools / environment_factory (grpo-nb then runs the turns).")
    agent = make_agent(tools, environment_factory, tokenizer, config)  # may give the tokenizer a tool template
    reward_funcs += env_reward_funcs(agent)  # environments that score episodes (get_reward), named by class
    check_inputs(model, tokenizer, dataset, reward_funcs, config, callbacks=callbacks, verbose=verbose, live=live,
                 resume_from_checkpoint=resume_from_checkpoint, agent=agent, rollout_func=rollout_func)
    check_eval_settings(config, eval_dataset, rollout_func)
    held_out = None if eval_dataset is None else checked_eval_dataset(model, tokenizer, eval_dataset, reward_funcs,
                                                                      config, agent)  # (rows, has answers)
    if agent:  # grpo-nb's tool template where needed, once the inputs are checked; saves keep what it trained under
        agent.use_template(tokenizer)
        attachments(model).tool_template = tokenizer.chat_template
    if resume_from_checkpoint in (None, False):
        warn_trained_before(model)
    config = config.fitted_to(model_context(model))  # max_prompt_length=None: what the context leaves
    asked = config
    config = rollout_precision(config, model, rollout, rollout_func)  # cpu_rollout_dtype="auto" decided for this run
    # one run per output_dir; gradient checkpointing as this run needs it (setup's "auto" off CUDA: models.py)
    with output_dir_lock(config.output_dir, enabled=distributed.launch_rank() == 0), checkpointing_for(model, config):
        run = set_up(model, tokenizer, dataset, config, rollout)
        run.agent = agent
        run.auto_decided = frozenset(k for k in PRECISION_SETTINGS if getattr(asked, k) != getattr(config, k))
        if held_out is not None:  # across processes each rank evaluates its share of the same rows
            check_eval_world(run.world, run.sharded, held_out[0])
        if rollout_func is not None:  # TRL's: the user's loop, given the prompts and the engine to sample with
            run.rollout = RolloutFunc(rollout_func, run.rollout, config, run.world)
        progress = resume(run, model, resume_from_checkpoint, reward_funcs, tokenizer)
        check_storable_rollout_state(run.rollout)  # every checkpoint keeps it: refused now, not at the first save
        progress.start = progress.step
        check_finite_weights(run, model, "before training")  # every save below is of finite weights
        trackers = start_trackers(config, progress.run_id, progress.step) if run.world.is_main else []  # report_to
        view, verbose = displays(run, progress, live, verbose)
        views = [*([view] if view is not None else []), *trackers]  # each step's record goes to these first
        model.train()

        ended = error = None  # what stopped the run (None: it trained max_steps), what train() then raises
        phase = "setup"
        start_eval = None  # eval_on_start's result, kept for the first step's record
        try:
            if held_out is not None and config.eval_on_start and progress.step == 0 < config.max_steps:
                phase = "evaluation"  # a resumed run has its baseline in its history already
                start_eval = evaluate_during_training(model, tokenizer, *held_out, reward_funcs, run)
            while progress.step < config.max_steps:
                started = time.perf_counter()
                if progress.batch is None:
                    phase = "rollout"
                    run.memory.start_rollout()
                    # rollout, rewards, advantages; then the sampler's and the reference policy's log-probs
                    # whatever a user's rollout, tools or rewards left on the model
                    # (the weights' guard exits first: a resize after tokens were added is said as such)
                    with tokenizer_kept(tokenizer, model, progress.warned), \
                            model_kept_for_update(model, run.rollout, progress.warned, tools=run.agent is not None):
                        batch = sample_batch(model, tokenizer, run.prompts, run.rollout, reward_funcs, config,
                                             progress.step, run.world, run.agent)
                    if progress.step == progress.start:  # a state made at the first call (as the engine's generator)
                        check_storable_rollout_state(run.rollout)
                    batch = add_logprobs(model, batch, config)
                    run.memory.end_rollout(batch.size, batch.prompt_ids.shape[1] + batch.completion_ids.shape[1])
                    warn_once(batch, config, progress.warned, model_context(model))  # prompts cut, most completions cut
                    warn_nothing_to_learn(batch, config, progress.step + 1, progress.warned)
                    progress.batch, progress.iterations_left = batch, config.num_iterations
                phase = "update"
                lr = run.scheduler.get_last_lr()[0]
                run.memory.start_update()
                # the policy's log-probs, the loss and its backward, micro-batch by micro-batch
                metrics = accumulate_gradients(model, run.params, progress.batch, config, run.scaler, run.world,
                                               progress.history)  # history: use_adaptive_entropy's state
                run.memory.end_backward()  # the activations' peak is before the optimizer step (grpo_nb.parking)
                with deferred_interrupts():  # the update, the schedule, the count and the history move together
                    progress.updating = True  # until end_step has caught up with the weights, nothing is saved
                    metrics = apply_update(run.optimizer, run.params, metrics, config, run.scaler)  # the optimizer step
                    if not metrics.skipped:
                        check_finite_weights(run, model, f"after the update of step {progress.step + 1}")
                    record = end_step(run, model, progress, metrics, lr, time.perf_counter() - started, reward_funcs)
                    progress.updating = False
                if start_eval is not None:
                    record["eval_start"], start_eval = start_eval, None
                if held_out is not None and config.evaluates_at(progress.step):
                    # after the step is complete (a Ctrl-C in here keeps it, without this evaluation), before the
                    # views, callbacks and the step's checkpoint get its record
                    phase = "evaluation"
                    record["eval"] = evaluate_during_training(model, tokenizer, *held_out, reward_funcs, run)
                run.memory.take_evaluation_peak(record["memory"])  # this step's evaluations' (eval_on_start's too)
                # the callbacks run before the step's checkpoint: one that adds tokens (a logging helper that
                # "registers" a marker) would have it and every later save hold a tokenizer the steps did not train with
                with tokenizer_kept(tokenizer, model, progress.warned, who="a callback (train(callbacks=...))",
                                    during=f"step {progress.step}'s callbacks"):
                    report(record, views, callbacks, config, verbose)
                if config.save_steps and progress.step % config.save_steps == 0:
                    save_state(run, model, tokenizer, progress, run.output_dir / f"checkpoint-{progress.step}")
                check_nonfinite_streak(progress.history, config)
                check_unscored_streak(progress.history, config, progress.warned)
        except BaseException as err:  # Ctrl-C (how a user ends a run early: the history is returned) or an error
            ended, error = err, stopped(err, run, model, tokenizer, progress, phase)
        else:
            ended = error = finish(run, model, tokenizer, progress)  # the final save
        finally:
            close_views(trackers, view, ended)  # after every save, so what they say is how the run ended
            remember_training(model, run, progress, ended)
    if error is not None:
        raise error
    return progress.history


# --------------------------------------------------------------------------------------
# Around the loop


def set_up(model, tokenizer, dataset, config: GRPOConfig, rollout) -> Run:
    """Processes, sharding, the rollout engine, optimizer, schedule, loss scaling, memory tracking, data order."""
    device = next(model.parameters()).device
    world = distributed.setup(device)
    sharded = config.fsdp and world.distributed
    if sharded:
        check_shardable(model, rollout)
    # ranks given other settings or data are refused here (a collective), not left to train apart or wait forever
    distributed.check_same_settings(world, config, data_identity(dataset, None))
    if sharded:
        distributed.shard_model(model, world)  # before the optimizer: sharding replaces the parameters
    elif config.fsdp:
        warnings.warn("fsdp=True shards weights over several processes; this is one process, so it trains "
                      "unsharded. Launch with torchrun or accelerate launch to shard.", stacklevel=3)
    torch.manual_seed(config.seed)
    # Each rank samples with its own seed: ranks that draw the same prompt must not draw the same completions.
    rollout = make_rollout(rollout or "auto", model, tokenizer,
                           config.replace(seed=(config.seed + 1009 * world.rank) % 2**63) if world.distributed else config)
    check_rollout_logprobs(rollout, config)  # the correction needs the engine's log-probs: refuse before a rollout
    if sharded and isinstance(rollout, RolloutEngine) and rollout.decode == "auto":
        rollout.decode = "static"  # a CUDA graph cannot hold the layers' weight gathers
    optimizer, scheduler, params = build_optimizer(model, config)
    return Run(config, world, device, rollout, optimizer, scheduler, params, build_grad_scaler(model, device),
               MemoryTracker(model, optimizer, device), PromptSampler(dataset, config.prompts_per_step, config.seed,
                                                                      world), sharded)


def resume(run: Run, model, resume_from_checkpoint, reward_funcs: list, tokenizer) -> Progress:
    """A fresh start, or the state of the checkpoint `resume_from_checkpoint` names, put back in place once it is
    checked against this run: refused for another base model or LoRA setup, a warning for other settings, reward
    functions or data."""
    names = reward_func_names(reward_funcs)
    progress = Progress()
    # what the weights mean something only with (the base model, the data), taken before a checkpoint's are loaded
    progress.identity = run_identity(model, tokenizer, run.prompts.dataset, run.agent)
    path = find_checkpoint(resume_from_checkpoint, run.output_dir)
    if path is not None:
        state, weights, settings = read_training_checkpoint(path, model)  # all checked; the model not yet touched
        check_same_tokenizer(path, state.get("identity", {}).get("tokenizer"), progress.identity.get("tokenizer"),
                             tokenizer)  # tokens added since (a stopped step's tool, a callback) not saved onward
        if run.world.is_main:
            warn_other_rollout(path, state["rollout"], run.rollout)
        check_no_later_checkpoints(run.output_dir, state["step"], path)  # rotation would keep those over the new
        if run.world.distributed:
            # Rank 0 wrote the checkpoint: its sampling state and its share of a half-used
            # generation batch are its own. The other ranks keep their seeds, and every rank
            # starts a fresh generation batch, so a data-parallel resume is not bit-exact.
            state = {**state, "pending": None, "rollout": state["rollout"] if run.world.is_main else None}
        restore_state(path, state, weights, model=model, optimizer=run.optimizer, scheduler=run.scheduler,
                      scaler=run.scaler, prompts=run.prompts, batch_type=StepBatch,
                      rollout=run.rollout if isinstance(run.rollout, ResumableRollout) else None)
        warn_changed_settings(path, settings, run.config, state=state, identity=progress.identity, reward_names=names,
                              decided=run.auto_decided)
        follow_schedule(run.optimizer, run.scheduler, run.config.learning_rate)
        progress.step, progress.history = state["step"], state["history"]
        if path.resolve().parent == run.output_dir.resolve() and state.get("run_id") and not copied(settings, run):
            # the same run going on: its trackers append to the same run
            progress.run_id, progress.parent_run_id = state["run_id"], state.get("parent_run_id")
        else:  # a fork (e.g. one of a sweep from a shared checkpoint): a run of its own, naming where it started
            progress.parent_run_id = state.get("run_id")
        if state["pending"] is not None:  # a generation batch still being iterated on (num_iterations > 1)
            scored_by = state["history"][-1].get("rewards") if state["history"] else None
            progress.batch, progress.iterations_left = resumed_batch(
                path, state["pending"], run.config, names, run.device,
                scored_by=list(scored_by) if isinstance(scored_by, dict) else None)
        if progress.step >= run.config.max_steps:
            warnings.warn(f"The checkpoint {path} is at step {progress.step}, which is already max_steps="
                          f"{run.config.max_steps}: nothing to train. Raise max_steps to train further.", stacklevel=3)
    progress.snapshot = snapshot(run, progress)
    return progress


def copied(settings: dict | None, run: Run) -> bool:
    """The run folder was copied (or moved) by hand since the checkpoint was written: its settings name another
    output_dir (absolute, as train() records it). Resumed there, it is a run of its own, so that its trackers do
    not append to, or cut back, the original's (a completions file they share, a TensorBoard run)."""
    saved = (settings or {}).get("output_dir")
    return isinstance(saved, str) and os.path.isabs(saved) and \
        os.path.realpath(saved) != os.path.realpath(run.output_dir)


def displays(run: Run, progress: Progress, live, verbose) -> tuple:
    """(the live dashboard or None, whether to print progress lines): rank 0 alone shows anything."""
    verbose = (not in_notebook()) if verbose is None else verbose
    live = in_notebook() if live is None else live
    if not run.world.is_main:
        return None, False
    # a resumed run's curves start where the run began; a dashboard object used before shows this run only
    return live_dashboard(live, run.device, run.config.max_steps, verbose, progress.history), verbose


def snapshot(run: Run, progress: Progress) -> Snapshot:
    """What the next step depends on besides weights and optimizer."""
    pending = None if progress.batch is None else (progress.batch.state_dict(), progress.iterations_left)
    return Snapshot(step=progress.step, pending=pending, rng=rng_state(), sampler=run.prompts.state_dict(),
                    rollout=rollout_state(run.rollout), run_id=progress.run_id, parent_run_id=progress.parent_run_id,
                    identity=progress.identity)


def end_step(run: Run, model, progress: Progress, metrics: StepMetrics, lr: float, seconds: float, reward_funcs) -> dict:
    """The schedule, the count, the record and the snapshot move on together (inside deferred_interrupts): the
    record, which can fail, is made first, so a failure leaves all of them as they were."""
    config, batch, step = run.config, progress.batch, progress.step + 1
    run.memory.end_update(gradients=metrics.gradient_bytes, logprob_scratch=logprob_scratch(model, batch, config))
    record = make_record(step, batch, metrics, config=config, reward_funcs=reward_funcs, lr=lr, step_time=seconds,
                         device=run.device, memory=run.memory.breakdown(), world=run.world)
    with warnings.catch_warnings():  # a skipped step still advances the schedule
        warnings.simplefilter("ignore", UserWarning)
        run.scheduler.step()
    progress.step = step
    progress.iterations_left -= 1
    batch.generation_time = 0.0  # counted once: the steps that train on it again (num_iterations) generate nothing
    if progress.iterations_left == 0:
        progress.batch = None
    progress.history.append(record)
    if config.sample_history_steps is not None and len(progress.history) > config.sample_history_steps:
        # Long runs would otherwise keep every step's completions in RAM: memory must stay flat.
        progress.history[-config.sample_history_steps - 1]["samples"] = []
    progress.snapshot = snapshot(run, progress)
    return record


def report(record: dict, views, callbacks, config: GRPOConfig, verbose: bool) -> None:
    """The step's record to the dashboard and the trackers (`views`), then to the user's callbacks, which may stop
    the run (the views have the step by then) and get a copy: what they add or change stays out of the history, so
    it never makes a checkpoint unwritable or unloadable."""
    if verbose and (record["step"] % config.logging_steps == 0 or record["step"] == config.max_steps):
        print_progress(record, config.max_steps)
    for view in views:
        view(record)
    if callbacks:
        theirs = copy.deepcopy(record)  # one copy for all: a callback may read what an earlier one added
        for callback in callbacks:
            callback(theirs)


def warn_once(batch: StepBatch, config: GRPOConfig, warned: set, context: int | None = None) -> None:
    """Say once per run when prompts lose their beginning, and when most completions hit the length cap
    (a common silent failure: the answer comes last, so rewards for being right never arrive). `context`:
    the model's (model_context), to tell apart the fix of a max_prompt_length that the context caps."""
    from .checks import prompts_cut_message

    if batch.prompts_cut and "prompts cut" not in warned:
        warned.add("prompts cut")
        warnings.warn(prompts_cut_message(batch.prompts_cut, config.max_prompt_length, config.max_completion_length,
                                          context), stacklevel=3)
    share = float(batch.truncated.float().mean()) if batch.truncated is not None and batch.size else 0.0
    if share > 0.5 and "completions cut" not in warned:
        warned.add("completions cut")
        # every one cut: more often completions that cannot end (the template's end of turn is no EOS id)
        never_end = (" Every completion ran to the cap: if they never end at all, check the EOS ids "
                     "(model.generation_config.eos_token_id) hold the token the chat template ends a turn with."
                     if share == 1.0 else "")
        # at temperature 1 a small model's samples often ramble on where its greedy answer ends (the main job's
        # 135M model: at 1.0 a quarter of its samples still run at 160 tokens, a tenth of its greedy answers pass 64)
        hot = (f", or sample at a lower temperature (now {config.temperature:g}; e.g. 0.7): a small model's samples "
               f"ramble at 1.0" if config.temperature >= 1.0 else "")
        warnings.warn(
            f"{share:.0%} of this step's completions hit max_completion_length={config.max_completion_length} "
            f"tokens before they ended: their answers, which come last, are cut off, so rewards for a right answer "
            f"cannot arrive. Raise max_completion_length (or ask for shorter reasoning in the prompt){hot}. The "
            f"share is recorded each step as truncated_fraction.{never_end}", stacklevel=3)


def logprob_scratch(model, batch: StepBatch, config: GRPOConfig) -> int:
    """Bytes the log-prob computation works in for one micro-batch (see memory.logprob_scratch_bytes)."""
    cfg = text_config(model)
    rows = min(config.per_device_train_batch_size, batch.size) * batch.completion_ids.shape[1]
    triton = triton_kernels(config.logprob_backend, output_head(model)["lm_head_weight"]) is not None
    return logprob_scratch_bytes(rows, cfg.vocab_size, cfg.hidden_size, chunk_size=config.logprob_chunk_size,
                                 backend="triton" if triton else "torch")
