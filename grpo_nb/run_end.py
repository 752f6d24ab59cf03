"""How a run ends: its checkpoints and final result written, whatever stops it (Ctrl-C, an error, out of memory,
the last step), the trackers and the dashboard closed after, and the trained model remembered for the session.

train() (trainer.py) calls these around its loop; each keeps the last completed step, and none ever masks what
stopped the run.
"""

from __future__ import annotations

import warnings
import weakref
from pathlib import Path

import torch

from . import distributed
from .attachments import base_model
from .checkpointing import checkpoints, rotate_checkpoints, save_checkpoint, save_training_checkpoint
from .display import close_live
from .interrupts import deferred_interrupts
from .planning import oom_message
from .run import Progress, Run
from .tracking import close_trackers


def save_state(run: Run, model, tokenizer, progress: Progress, path) -> Path | None:
    """A resumable checkpoint of the last completed step (its snapshot); None on ranks other than 0."""
    # Sharded weights and moments are gathered whole on every rank (a collective); every rank
    # then holds the same weights and optimizer state, and rank 0 alone writes them.
    trainable = distributed.full_trainable_state(model)
    optimizer_state = distributed.full_optimizer_state(run.optimizer)
    if not run.world.is_main:
        return None
    # history grows only with the step count, in the same deferred-interrupt block as the
    # snapshot, so it always matches the snapshot's step and needs no copy per step.
    state = {**progress.snapshot.as_state(), "history": progress.history, "optimizer": optimizer_state,
             "scheduler": run.scheduler.state_dict(), "scaler": run.scaler.state_dict() if run.scaler else None}
    try:
        path = save_training_checkpoint(path, model=model, tokenizer=tokenizer, config=run.config,
                                        history=progress.history, state=state, trainable=trainable)
    except TypeError as err:  # a dataset column of a kind JSON cannot hold, in the pending batch's rows
        if state["pending"] is None:
            raise
        warnings.warn(f"The checkpoint leaves out the generation batch still being trained on ({err}); resuming "
                      f"from it starts a fresh one, so the resumed run is not bit for bit the same.", stacklevel=3)
        path = save_training_checkpoint(path, model=model, tokenizer=tokenizer, config=run.config,
                                        history=progress.history, state={**state, "pending": None},
                                        trainable=trainable)
    rotate_checkpoints(run.output_dir, run.config.save_total_limit)
    return path


def stopped(err: BaseException, run: Run, model, tokenizer, progress: Progress, phase: str):
    """Whatever stopped the run (Ctrl-C, a bad reward, out of memory), keep the last completed step.

    Returns None for Ctrl-C (the run returns its history), else the error to raise: `err` with a
    note on where the run's progress is kept, or for out of memory a new error that also says what to change.
    """
    config, step, history = run.config, progress.step, progress.history
    # (who, what, whether trained weights): rollout_guard found the model changed when the rollout phase stopped
    changed = getattr(err, "grpo_nb_model_changed", None)
    interrupt = isinstance(err, KeyboardInterrupt)
    run.optimizer.zero_grad(set_to_none=True)  # a backward cut short leaves partial gradients
    model.train()
    message = f"grpo-nb: the run stopped at step {step}/{config.max_steps}"
    if progress.updating:  # the weights are past `step`: a checkpoint of them would not be step `step`'s
        message += (f", inside the update of step {step + 1}, whose weights change before its bookkeeping: no "
                    f"checkpoint is written from that half-done step; the checkpoints in {run.output_dir} are kept "
                    f"as they were")
    elif history and run.sharded:
        # Gathering the shards is a collective, which a rank stopped by an error alone would hang in.
        message += (f"; a sharded (fsdp) run keeps the checkpoints written every save_steps={config.save_steps}: "
                    f"train(..., resume_from_checkpoint=True) continues from the newest in {run.output_dir}")
    elif history and step == progress.start:
        # Resumed, and stopped before a step completed (e.g. on seeing a "settings differ" warning): the checkpoint
        # it resumed from holds exactly this state, with its own settings and generation batch. Never replace it.
        message += (f", before a step completed since it resumed at step {step}: nothing is written, and the "
                    f"checkpoint it resumed from is kept as it was; resuming from it again continues from step {step}")
    elif history and changed and changed[2]:
        message += changed_weights_kept(run, step, changed)
    elif history and getattr(err, "grpo_nb_tokenizer_changed", None):
        message += changed_tokenizer_kept(run, step)
    elif history:
        message += keep_last_step(run, model, tokenizer, progress, interrupt)
        if changed:  # frozen weights only: the checkpoint holds the trained ones, as step `step` left them
            message += (f" {changed[0]} left frozen weights of `model` changed ({changed[1]}), which no checkpoint "
                        f"holds: load the model again before resuming.")
    err.grpo_nb_history = history
    if interrupt:
        print(message.replace("grpo-nb: the run stopped", "Training interrupted", 1), flush=True)
        return None
    if isinstance(err, torch.cuda.OutOfMemoryError):
        if run.device.type == "cuda":
            torch.cuda.empty_cache()  # let the user's next cell (or a smaller run) have the memory back
        guidance = oom_message(phase, step, config, model, history[-1]["memory"] if history else None, run.device)
        error = torch.cuda.OutOfMemoryError(f"{guidance}\n{message.rstrip('.')}.\nThe original error: {err}")
        error.__cause__, error.grpo_nb_history = err, history
        return error
    if hasattr(err, "add_note"):
        err.add_note(message)
    return err


def changed_weights_kept(run: Run, step: int, changed: tuple) -> str:
    """What the run's last message says when the rollout phase stopped with the trained weights changed (rollout_guard
    found it): no checkpoint-<step> is written from them, the newest one on disk is the one to resume from."""
    who, what, _ = changed
    saved = checkpoints(run.output_dir)
    resume = (f"the last checkpoint on disk, {saved[-1]}, is the one to resume from (load the model again, then "
              f"train(..., resume_from_checkpoint=True) continues from it)" if saved else
              f"no checkpoint-<step> was written before it (save_steps={run.config.save_steps}), so the {step} step(s) "
              f"trained are lost with these weights: load the model again and train anew (the history is kept)")
    return (f". {who} left the trained weights changed ({what}) when the step's rollout stopped, so nothing was "
            f"saved: a checkpoint-{step} written now would hold those weights, not step {step}'s; {resume}. `model` "
            f"keeps the changed weights")


def changed_tokenizer_kept(run: Run, step: int) -> str:
    """What the run's last message says when tokens were added to the tokenizer (or special tokens set) during the
    step's rollout or its callbacks (rollout_guard.tokenizer_kept): checkpoint-<step> would save that tokenizer, not
    the one the steps trained with, so none is written; the weights are still in `model`."""
    saved = checkpoints(run.output_dir)
    newest = f"; the newest checkpoint on disk is {saved[-1]}" if saved else ""
    return (f". Tokens were added to the tokenizer (or special tokens set) during the step, so no "
            f"checkpoint-{step} is written: it would save that tokenizer, not the one the {step} step(s) trained "
            f"with{newest}. The weights of step {step} are still in `model`: load the tokenizer again and save "
            f"them with grpo_nb.save_adapter(model, path, tokenizer)")


def keep_last_step(run: Run, model, tokenizer, progress: Progress, interrupt: bool) -> str:
    """Write checkpoint-<step> of the last completed step; returns what became of it, for the run's last message.
    A second Ctrl-C meanwhile (Stop pressed again when the first seems to do nothing) waits for the write."""
    step = progress.step
    history = "is returned" if interrupt else "is on this error as .grpo_nb_history (in a notebook: sys.last_value)"
    path = again = None
    try:
        with deferred_interrupts():
            path = save_state(run, model, tokenizer, progress, run.output_dir / f"checkpoint-{step}")
    except KeyboardInterrupt as second:
        again = second
    except Exception as save_error:  # never mask what stopped the run
        room = " once there is room" if isinstance(save_error, OSError) else ""
        return (f"; saving a checkpoint failed too ({save_error}). The trained weights of step {step} are still in "
                f"`model` (save them with grpo_nb.save_adapter(model, path, tokenizer){room}) and the history "
                f"{history}")
    if path is not None:
        waited = " (the second Stop waited for it to be written)" if again is not None else ""
        return (f"; everything up to step {step} is saved in {path}{waited}. train(..., resume_from_checkpoint=True) "
                f"continues from there.")
    if again is not None:  # raised inside the write, where it could not wait: the folder is not there at all
        return (f"; writing checkpoint-{step} was interrupted, so nothing of it was written. The weights of step "
                f"{step} are still in `model` (grpo_nb.save_adapter(model, path, tokenizer) saves them) and the "
                f"history {history}")
    return ""  # a rank other than 0: rank 0 writes


def finish(run: Run, model, tokenizer, progress: Progress) -> BaseException | None:
    """The final save, which a Ctrl-C meanwhile waits for: the run then ends as finished, its history returned.
    Returns the save's error (raised once the trackers and the dashboard are closed), or None."""
    saved = False
    try:
        with deferred_interrupts():
            save_result(run, model, tokenizer, progress)
            saved = True
    except KeyboardInterrupt as err:
        if not saved:  # raised inside the save, where it could not wait: kept like a Ctrl-C in a step
            return stopped(err, run, model, tokenizer, progress, "final save")
        print(f"Training finished at step {progress.step}/{run.config.max_steps}; the Stop pressed during the final "
              f"save waited for it: the result is saved in {run.output_dir}, and the history is returned.", flush=True)
    except Exception as err:
        return err
    return None


def save_result(run: Run, model, tokenizer, progress: Progress) -> None:
    """The trained adapter in output_dir; a failure says where the weights and history still are."""
    try:
        trainable = distributed.full_trainable_state(model)  # a collective when sharded: every rank gathers
        if run.world.is_main:
            save_checkpoint(model, tokenizer, run.output_dir, config=run.config, history=progress.history,
                            trainable=trainable)
        distributed.barrier(run.world)  # the other ranks return once the result is on disk
    except Exception as err:
        room = " free space or pick another folder and" if isinstance(err, OSError) else ""
        err.grpo_nb_history = progress.history
        err.add_note(f"grpo-nb: training finished ({progress.step} steps) but saving the result failed. The trained "
                     f"weights are still in `model`:{room} call grpo_nb.save_adapter(model, path, tokenizer). The "
                     f"history is on this error as .grpo_nb_history.")
        raise


def close_views(trackers, view, ended: BaseException | None) -> None:
    """Close the trackers and show the dashboard's final state (`ended`: what stopped the run, None when it
    finished). Everything is saved by now, so a Ctrl-C here (a tracker's upload, the final plots) only cuts
    that one short."""
    closes = [("the trackers (report_to): they", lambda: close_trackers(trackers, ended))] if trackers else []
    if view is not None:
        closes.append(("the dashboard: it", lambda: close_live(view, ended)))
    for name, close in closes:
        try:
            close()
        except KeyboardInterrupt:
            print(f"Stop pressed while closing {name} may lack the end of the run; the run itself is unaffected.",
                  flush=True)


# The last run train() made on each model object (weakly keyed, by the model under any peft wrapper): training the
# same object again starts from trained weights, which a notebook's re-run training cell does without anyone meaning it.
_TRAINED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def remember_training(model, run: Run, progress: Progress, ended: BaseException | None) -> None:
    if progress.step == 0:
        return
    how = ("finished" if ended is None else "interrupted" if isinstance(ended, KeyboardInterrupt)
           else f"stopped by {type(ended).__name__}")
    _TRAINED[base_model(model)] = (progress.step, run.config.max_steps, run.output_dir, how)


def warn_trained_before(model) -> None:
    """A fresh run on a model object an earlier train() call of this session trained: say so, and the ways to what
    was probably meant."""
    last = _TRAINED.get(base_model(model))
    if last is None:
        return
    step, max_steps, output_dir, how = last
    saved = checkpoints(output_dir)
    resume = (f"to continue that run with its optimizer, schedule and history, pass output_dir='{output_dir}' and "
              f"resume_from_checkpoint=True (its newest checkpoint is {saved[-1].name})" if saved else
              "that run left no checkpoint-<step> to resume with its optimizer and history (save_steps=0), so "
              "training this object again is how to train it further")
    warnings.warn(f"This model was already trained in this session by train() (output_dir='{output_dir}', "
                  f"{how} at step {step}/{max_steps}): this run starts from those trained weights, as a new run "
                  f"(a fresh optimizer and schedule, its history from step 1), not from the base model. For a fresh "
                  f"start, set the model up again (setup_reasoning_model(...)); {resume}.", stacklevel=3)
