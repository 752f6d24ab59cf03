"""Calling reward functions, the one way train(), evaluate() and the prototyping tools call them: each call gets
its own copies of the keywords, async functions are awaited together on one event loop, a timeout stops the wait,
and a failing function is re-run one completion at a time to name the one that breaks it; then a batch's rewards
as one tensor, and their weighted total."""

from __future__ import annotations

import asyncio
import copy
import dis
import functools
import inspect
import math
import sys
import threading
import time
import types

import torch
from transformers import TrainerState

from .reward_contract import (LoggingError, RewardCall, RewardFunctionError, RewardLog, check_no_clashes,
                              checked_output, describe_completion, error_text, reward_func_name, reward_func_names)


# ----------------------------------------------------------------------------------------
# Async reward functions: awaited on one event loop in a background thread, as TRL does. Not the
# caller's loop: in Jupyter the main thread already runs one, and a blocking call cannot wait on it.


def is_async_reward(func) -> bool:
    """Whether calling `func` gives a coroutine: an `async def`, a partial of one, or an object whose
    `__call__` is `async def` (TRL's is_async_callable)."""
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None))


_loop: asyncio.AbstractEventLoop | None = None
_loop_thread: threading.Thread | None = None
_loop_lock = threading.Lock()
_LOOP_THREAD = "grpo-nb async rewards"  # the name of the loop's thread (and of any loop given up as blocked)
_LOOP_PROBE_S = 1.0  # how long a loop gets to run a no-op before it counts as blocked


def _event_loop() -> asyncio.AbstractEventLoop:
    """The process's loop for async reward functions, started on first use in a daemon thread (and again
    after `blocked_loop` gave one up)."""
    global _loop, _loop_thread
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            _loop_thread = threading.Thread(target=_loop.run_forever, daemon=True, name=_LOOP_THREAD)
            _loop_thread.start()
    return _loop


def blocked_loop() -> str | None:
    """None while the async reward functions' loop runs a no-op within _LOOP_PROBE_S seconds. Else the code
    holding it (an `async def` that runs blocking code without await: time.sleep, requests, a busy loop), and
    the loop is given up: later calls start a fresh one, while this one runs on in its thread until that code
    returns. Without this, every later async reward function in the kernel would wait on it."""
    global _loop
    with _loop_lock:
        loop, thread = _loop, _loop_thread
    if loop is None:
        return None
    answered = threading.Event()
    loop.call_soon_threadsafe(answered.set)
    if answered.wait(_LOOP_PROBE_S):
        return None
    with _loop_lock:
        if _loop is loop:
            _loop = None
    return _code_running_on(thread) or "code that does not await"


def _code_running_on(thread: threading.Thread) -> str | None:
    """The outermost frame on `thread`'s stack that is not asyncio's or threading's own: on a loop's thread,
    the coroutine running on it. None for an idle loop."""
    frame, stack = sys._current_frames().get(thread.ident), []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    for frame in reversed(stack):
        module = frame.f_globals.get("__name__", "")
        if module.split(".")[0] in ("asyncio", "threading", "selectors") or frame.f_code is _awaited.__code__:
            continue
        return f"{frame.f_code.co_name!r} (line {frame.f_lineno} of {frame.f_code.co_filename})"
    return None


def _note_blocked_loop(err: BaseException) -> None:
    """Waiting on the loop was given up (Ctrl-C, the Stop button): if the loop is blocked, say by what, and
    that later calls get a fresh one."""
    where = blocked_loop()
    if where is not None:
        add_note(err, f"The async reward functions' event loop was blocked by {where}, which runs without "
                       f"awaiting; later calls use a fresh loop (restart the kernel to end the blocked one).")


def add_note(err: BaseException, note: str) -> None:
    if hasattr(err, "add_note"):  # Python 3.11+
        err.add_note(note)


async def _awaited(awaitable):
    return await awaitable


def resolved(value):
    """`value`, or for an awaitable (what an async reward function's call returns) what awaiting it gives."""
    if not inspect.isawaitable(value):
        return value
    if threading.current_thread().name == _LOOP_THREAD:  # waiting here would block the loop that has to run it
        if inspect.iscoroutine(value):
            value.close()  # never awaited: no "was never awaited" warning on top of this error
        raise RuntimeError("an async reward function was called from inside another async reward function's "
                           "coroutine without `await`: await it there (weighted_reward's combined function is "
                           "synchronous, so call it outside async code).")
    future = asyncio.run_coroutine_threadsafe(_awaited(value), _event_loop())
    try:
        return future.result()
    except BaseException as err:
        if not future.done():  # interrupted while waiting
            _note_blocked_loop(err)
        raise


# ----------------------------------------------------------------------------------------
# One reward function's call


_COPIED = (list, tuple, dict, set)


def _fresh(value):
    """`value` with each list, tuple, dict and set in it copied; strings, numbers and other objects shared.

    Without recursion, and each container copied once: a value nested thousands deep (a parse tree) is copied
    like any other, and one that holds itself stays so in the copy (through a tuple, that tuple is shared)."""
    copies, building = {}, set()  # id of each container met -> its copy; ids of tuples still being built

    def start(v):
        """v's copy (a tuple's: a list to build it from) and its items still to copy, None when there are none."""
        kind = type(v)
        if kind not in _COPIED or id(v) in building:
            return v, None
        if id(v) in copies:
            return copies[id(v)], None
        if kind is set:  # its items are hashable: numbers, text, tuples
            copies[id(v)] = set(v)
            return copies[id(v)], None
        if kind is tuple:
            building.add(id(v))
            return [], iter(v)
        copies[id(v)] = {} if kind is dict else []
        return copies[id(v)], iter(v.items() if kind is dict else v)

    root, items = start(value)
    stack = [(value, root, items, None, None)] if items is not None else []  # + where the copy goes: parent, key
    while stack:
        original, new, items, parent, key = stack[-1]
        for item in items:
            k, v = item if type(original) is dict else (len(new), item)
            copied, more = start(v)
            if type(new) is dict:
                new[k] = copied
            else:
                new.append(copied)
            if more is not None:
                stack.append((v, copied, more, new, k))
                break
        else:
            stack.pop()
            if type(original) is tuple:
                building.discard(id(original))
                copies[id(original)] = built = tuple(new)
                if parent is None:
                    root = built
                else:
                    parent[key] = built
    return root


def own_copies(keywords: dict) -> dict:
    """The keywords of one reward function call, as its own copies: a function that edits a chat message, a
    column's list or the lists themselves in place (a strip(), an append, a pop, a sort) must change neither
    the dataset nor what the next function scores. Token ids are ints, so copying each list is enough (and
    50x faster than walking it): about 0.4 ms per function for 64 chat completions of 1,024 tokens."""
    return {key: [copy.copy(ids) for ids in value] if key == "completion_ids" and type(value) is list
            else _fresh(value) for key, value in keywords.items()}


# The per-sample re-run's log_extra / log_metric: what it logs is dropped (the batch's own call has failed,
# and its logs with it), and the batch's counts are not the sample's.
_DISCARD_LOGS = {"log_extra": lambda *args, **kwargs: None, "log_metric": lambda *args, **kwargs: None}


def _call_per_sample(func, prompts, completions, completion_ids, columns, extra):
    """Each completion's own call: [(index, output or the exception it raised)]."""
    for i in range(len(completions)):
        keywords = {"prompts": prompts[i : i + 1], "completions": completions[i : i + 1],
                    "completion_ids": completion_ids[i : i + 1],
                    **{key: values[i : i + 1] for key, values in columns.items()}, **extra, **_DISCARD_LOGS}
        try:
            yield i, resolved(func(**own_copies(keywords)))
        except Exception as err:
            yield i, err


def _chat_hint(err: Exception, completions) -> str:
    """A function written for text completions breaks on chat ones ('list' has no attribute 'count',
    ...): say what it was handed and how to read the text."""
    chat = bool(completions) and isinstance(completions[0], (list, tuple)) and all(
        isinstance(m, dict) for m in completions[0])
    if not chat or not isinstance(err, (AttributeError, TypeError)):
        return ""
    return ("\nThe prompts are chat messages, so each completion is a list of messages, "
            "[{'role': 'assistant', 'content': '...'}], not a string: read its text with "
            "grpo_nb.completion_text(c), e.g. texts = [completion_text(c) for c in completions].")


def _untrained_state_hint(func, extra: dict) -> str:
    """A function reading trainer_state fails outside train(), where the state has not trained: say so."""
    try:
        reads_state = "trainer_state" in inspect.signature(func).parameters
    except (TypeError, ValueError):
        reads_state = False
    if not reads_state or getattr(extra.get("trainer_state"), "max_steps", None) != 0:
        return ""
    return ("\nOutside train() (evaluate, sample_and_score, preview_rewards) trainer_state is a TrainerState that "
            "has not trained: global_step=0, max_steps=0, epoch=None, as TRL's trainer has before training. Guard "
            "for it, e.g. progress = state.global_step / state.max_steps if state.max_steps else 0.0.")


def _accepts(func, keywords) -> bool:
    """Whether `func` can be called with these keyword arguments (True when it cannot be told)."""
    try:
        inspect.signature(func).bind(**{key: None for key in keywords})
    except TypeError:
        return False
    except ValueError:  # some builtins have no signature to inspect
        return True
    return True


def _call(func, prompts, completions, completion_ids, columns, extra, strict: bool) -> RewardCall:
    """Call `func` on the batch (awaited when async). Strict: raise RewardFunctionError, naming the function
    and the first failing sample. Collecting: keep every completion's own result or exception."""
    name, n = reward_func_name(func), len(completions)
    try:
        values = resolved(func(**own_copies({"prompts": prompts, "completions": completions,
                                             "completion_ids": completion_ids, **columns, **extra})))
    except LoggingError as err:  # about the call, not a sample: nothing to find one at a time
        if strict:
            raise
        return RewardCall(name, [math.nan] * n, [None] * n, [None] * n, [error_text(err)] * n,
                          problem=f"raised {error_text(err)}")
    except Exception as batch_err:
        # Re-running one sample at a time points at the completion that breaks it, which
        # is usually all it takes to see the bug (e.g. a missing tag, an unparsable number).
        keywords = ["prompts", "completions", "completion_ids", *columns, *extra]
        chat_hint = _chat_hint(batch_err, completions)
        hint = chat_hint + _untrained_state_hint(func, extra) + ("" if _accepts(func, keywords) else (
            f"\nIts signature does not fit the call: reward functions are called by keyword with "
            f"{', '.join(keywords)}. Name the ones you need and accept the rest with **kwargs."))
        call = RewardCall(name, [math.nan] * n, [None] * n, [None] * n, [None] * n,
                          problem=f"raised {error_text(batch_err)}{chat_hint}")
        for i, out in _call_per_sample(func, prompts, completions, completion_ids, columns, extra):
            if isinstance(out, Exception):
                if strict:
                    raise RewardFunctionError(
                        f"reward function {name!r} raised {error_text(out)}\n"
                        f"It first fails on sample {i} of {n}, whose completion is:\n"
                        f"{describe_completion(completions[i])}{hint}") from out
                call.errors[i] = error_text(out)
                continue
            one = checked_output(name, out, completions[i : i + 1])
            call.rewards[i], call.values[i], call.notes[i] = one.rewards[0], one.values[0], one.notes[0]
        if all(error is None for error in call.errors):  # fine one at a time, broken on the batch
            if strict:
                raise RewardFunctionError(
                    f"reward function {name!r} raised {error_text(batch_err)}\n"
                    f"on the batch of {n} completions, but not on any one of them alone: "
                    f"it fails only on the whole batch.{hint}") from batch_err
            call.errors = [f"{error_text(batch_err)} (on the whole batch only)"] * n
            call.rewards = [math.nan] * n
        return call
    call = checked_output(name, values, completions)
    if strict and call.message is not None:
        raise RewardFunctionError(call.message)
    return call


class _InThread:
    """`_call` running in a helper thread, so that the caller can stop waiting for it after `timeout` seconds
    (counted from the start) and several async functions can be awaited at once."""

    def __init__(self, timeout, name, func, *args):
        self.name, self.func, self.n, self.timeout = name, func, len(args[1]), timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.outcome = {}
        self.thread = threading.Thread(target=self._run, args=args, daemon=True, name=f"grpo-nb reward {name}")
        self.thread.start()

    def _run(self, *args):
        try:
            self.outcome["value"] = _call(self.func, *args)
        except BaseException as err:  # handed to the waiting thread by result()
            self.outcome["error"] = err

    def result(self, others=()) -> RewardCall:
        """The call's result, or its exception; RewardFunctionError at the deadline. `others`: the batch's other
        helpers, named in that message when they are still running too."""
        try:
            self.thread.join(None if self.deadline is None else max(0.0, self.deadline - time.monotonic()))
        except BaseException as err:  # Ctrl-C or the Stop button while waiting
            _note_blocked_loop(err)
            raise
        if self.thread.is_alive():
            raise RewardFunctionError(self._timed_out(others))
        if "error" in self.outcome:
            raise self.outcome["error"]
        return self.outcome["value"]

    def _timed_out(self, others) -> str:
        running = [h.name for h in dict.fromkeys([self, *others]) if h.thread.is_alive()]
        where = blocked_loop()
        if where is not None:  # the async functions share one loop, and one that never awaits stalls them all
            return (f"reward function(s) {', '.join(map(repr, running))} did not return within reward_timeout="
                    f"{self.timeout:g} s: async reward functions share one event loop, and {where} is blocking "
                    f"it: an `async def` running blocking code (time.sleep, requests, a synchronous client, a long "
                    f"computation) without await holds the loop, so no other async function can run. Await "
                    f"instead (asyncio.sleep, an async client), or move the blocking call off the loop with "
                    f"`await asyncio.to_thread(f, ...)`. Later calls get a fresh event loop; the blocked one is "
                    f"left in its background thread until the function returns (restart the kernel to end one "
                    f"that never does).")
        also = [name for name in running if name != self.name]
        return (f"reward function {self.name!r} did not return within reward_timeout={self.timeout:g} s for "
                f"{self.n} completions; it may be stuck (an endless loop, a network call, a sandbox that never "
                f"answers). It is left running in a background thread. Make it faster or give it its own timeout, "
                f"or raise reward_timeout (None: no limit)."
                + (f" Still running too: {', '.join(map(repr, also))}." if also else ""))


# ----------------------------------------------------------------------------------------
# A batch's calls


# The names of the reward functions called, one list per open rollout guard (rollout_guard.model_kept_for_update
# pushes one around a step's rollout and rewards, innermost last), so that a change to the model found after them
# can be told as possibly theirs.
CALLED: list[list[str]] = []


def call_reward_funcs(reward_funcs, *, prompts, completions, completion_ids, columns, trainer_state=None,
                      timeout: float | None = None, strict: bool = True, log: RewardLog | None = None
                      ) -> list[RewardCall]:
    """Every reward function called the one way reward functions are called, its output checked.

    `columns` maps each dataset column except `prompt` to its N values (already repeated per
    generation); each function gets them as keywords, TRL-style, with `trainer_state` (outside
    train(), a TrainerState that has not trained, as TRL's trainer has before training) and
    `log_extra` / `log_metric`, which write into `log` (a RewardLog; dropped when None). Each call
    gets its own copies of the lists and what is in them (`own_copies`).
    Strict (training, evaluation): RewardFunctionError, naming the function and the sample, when a
    function fails or returns anything but one finite float32 number (or None) per completion.
    Collecting (prototyping): nothing raises; each RewardCall says what went wrong where.

    Async functions are awaited together (as TRL gathers them), while the others run one after
    another in this thread. With `timeout` (seconds), a function that has not returned by then
    raises RewardFunctionError; a synchronous one then runs in a helper thread (so functions that
    need the main thread, e.g. signal-based timeouts of their own, cannot be used).
    """
    n = len(completions)
    for key, values in {"prompts": prompts, "completion_ids": completion_ids, **columns}.items():
        if len(values) != n:
            raise ValueError(f"{key!r} has {len(values)} entries but there are {n} completions")
    check_no_clashes(columns)
    log = RewardLog(n) if log is None else log
    names = reward_func_names(reward_funcs)  # two functions of one name keep their own scores: 'f', 'f#2'
    if CALLED:  # inside train()'s rollout guard (rollout_guard.model_kept_for_update): a change to the model may be theirs
        CALLED[-1].extend(n for n in names if n not in CALLED[-1])
    state = TrainerState() if trainer_state is None else trainer_state

    def args(func, name):
        return func, prompts, completions, completion_ids, columns, {"trainer_state": state, **log.hooks(name)}, strict

    try:
        awaiting = {j: _InThread(timeout, name, *args(func, name))
                    for j, (func, name) in enumerate(zip(reward_funcs, names)) if is_async_reward(func)}
        calls = []
        for j, (func, name) in enumerate(zip(reward_funcs, names)):
            if j in awaiting:
                call = awaiting[j].result(awaiting.values())
            elif timeout is None:
                call = _call(*args(func, name))
            else:
                call = _InThread(timeout, name, *args(func, name)).result(awaiting.values())
            call.name = name
            calls.append(call)
    finally:
        log.closed = True  # what a function left running logs from now on comes too late for this batch
    return calls


def rewards_tensor(calls: list[RewardCall], n: int) -> torch.Tensor:
    """[n, len(calls)] float32: each call's rewards as a column (NaN: no score)."""
    # reshape first: with no calls the list makes a 1-D tensor, whose .T torch deprecates
    return torch.tensor([c.rewards for c in calls], dtype=torch.float32).reshape(len(calls), n).t().contiguous()


def combine_rewards(rewards_per_func: torch.Tensor, reward_weights=None) -> torch.Tensor:
    """The total reward of each completion: the weighted sum over functions, skipping NaN.

    `rewards_per_func` is [N, num_funcs] from `rewards_tensor`; `reward_weights` has one
    weight per function (default 1.0 each). A completion no function scored is "unscorable" and
    gets NaN, as in TRL: `loss.group_advantages` leaves it out of its group's baseline and gives
    it advantage 0.
    """
    num_funcs = rewards_per_func.shape[1]
    if reward_weights is None:
        reward_weights = [1.0] * num_funcs
    weights = torch.as_tensor(reward_weights, dtype=torch.float64, device=rewards_per_func.device)
    if weights.dim() != 1 or len(weights) != num_funcs:
        raise ValueError(
            f"reward_weights has {weights.numel()} entries but there are {num_funcs} reward functions; "
            "give one weight per reward function"
        )
    # Summed in float64: each reward fits float32 (checked), but a weighted total may not, and in float32 it
    # would be inf - a NaN advantage for its whole group, and a step that learns nothing, without a word.
    totals = (rewards_per_func.double() * weights).nansum(dim=1)
    overflow = (totals.isfinite() & totals.float().isinf()).nonzero()
    if len(overflow):
        i = int(overflow[0])
        shown = lambda values: "[" + ", ".join(f"{v:g}" for v in values.tolist()) + "]"  # noqa: E731
        raise RewardFunctionError(
            f"The weighted total reward of completion {i} is {float(totals[i]):g}, beyond float32's range "
            f"(+-3.4e38), where it would be inf: its rewards {shown(rewards_per_func[i])} (one per reward "
            f"function, in order) weighted by reward_weights={shown(weights)}. Rewards are stored as float32 (as "
            f"in TRL): scale the rewards or the reward_weights down.")
    return totals.to(rewards_per_func.dtype).masked_fill(rewards_per_func.isnan().all(dim=1), math.nan)


# TRL 1.16's multi_objective_aggregation: how several reward functions' rewards become advantages
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def aggregated_advantages(rewards_per_func: torch.Tensor, num_generations: int, *, reward_weights=None,
                          aggregation: str = "sum_then_normalize", scale_rewards: str = "group",
                          estimator: str = "grpo") -> torch.Tensor:
    """[N] advantages of the completions whose rewards are `rewards_per_func` ([N, num_funcs], NaN: no score),
    as TRL 1.16's GRPOTrainer makes them for `aggregation` (its multi_objective_aggregation):

    "sum_then_normalize": the weighted total (`combine_rewards`) against its group (`loss.group_advantages`, with
    `scale_rewards` and `estimator`).
    "normalize_then_sum" (GDPO): each function's rewards normalized within each group first, (r - mean) / (std +
    1e-4) over the completions it scored, so that a function with a wide range cannot drown the others; those
    summed with the weights, then the sums normalized over the whole batch, as TRL does (its scale_rewards has no
    say there). A completion no function scored gets advantage 0, as in both of TRL's.
    """
    from .loss import group_advantages  # here: loss imports nothing of this module, and keeps it so

    if aggregation not in MULTI_OBJECTIVE_AGGREGATIONS:
        raise ValueError(f"multi_objective_aggregation={aggregation!r} is not one of {MULTI_OBJECTIVE_AGGREGATIONS}")
    if aggregation == "sum_then_normalize":
        return group_advantages(combine_rewards(rewards_per_func, reward_weights), num_generations,
                                scale_rewards=scale_rewards, estimator=estimator)
    num_funcs = rewards_per_func.shape[1]
    combine_rewards(rewards_per_func, reward_weights)  # its checks: one weight per function, a total float32 holds
    weights = torch.as_tensor([1.0] * num_funcs if reward_weights is None else reward_weights,
                              dtype=rewards_per_func.dtype, device=rewards_per_func.device)
    unscored = rewards_per_func.isnan().all(dim=1)
    grouped = rewards_per_func.view(-1, num_generations, num_funcs)
    mean = grouped.nanmean(dim=1, keepdim=True)
    std = _nanstd(grouped, dim=1) if num_generations > 1 else torch.zeros_like(mean)
    normalized = ((grouped - mean) / (std + 1e-4)).view(-1, num_funcs)
    totals = (normalized * weights).nansum(dim=1).masked_fill(unscored, math.nan)
    spread = _nanstd(totals) if totals.numel() > 1 else totals.new_zeros(())
    return ((totals - totals.nanmean()) / (spread + 1e-4)).nan_to_num(nan=0.0)


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """TRL's nanstd: the unbiased std of the non-NaN values (NaN with fewer than two); keeps `dim`."""
    scored = (~x.isnan()).sum(dim=dim, keepdim=dim is not None)
    mean = x.nanmean(dim=dim, keepdim=dim is not None)
    std = ((x - mean).square().nansum(dim=dim, keepdim=dim is not None) / (scored - 1)).sqrt()
    return std.masked_fill(scored < 2, math.nan)


# ----------------------------------------------------------------------------------------
# Reward functions that need the main thread, refused up front with reward_timeout (which runs them in a helper thread)


def check_reward_threads(reward_funcs, timeout: float | None) -> None:
    """With `timeout` (reward_timeout) each synchronous reward function runs in a helper thread (`_InThread`). One
    that calls math_verify (open-r1's accuracy_reward, a partial or wrapper of it) cannot: its parse() and verify()
    time out with signal.alarm, which Python allows in the main thread only, so they raise there, or score nothing.
    Refused before any rollout, naming the function; one that checks for the main thread itself (TRL's
    accuracy_reward turns math_verify's timeouts off outside it) is left alone. math_verify is never imported."""
    if timeout is None:
        return
    for func, name in zip(reward_funcs, reward_func_names(reward_funcs)):
        if is_async_reward(func):  # awaited on the loop's thread with or without a timeout
            continue
        found = _uses_math_verify(func)
        if found:
            raise ValueError(
                f"Reward function {name!r} calls math_verify ({found}), whose parse() and verify() time out with "
                f"signal.alarm, which works only in Python's main thread; with reward_timeout={timeout:g} grpo-nb "
                f"runs each reward function in a helper thread (to stop waiting for it), where math_verify fails. Set "
                f"reward_timeout=None (math_verify has timeouts of its own), or do as TRL's accuracy_reward does: "
                f"test threading.current_thread() is threading.main_thread() in the function and outside it call "
                f"parse(..., parsing_timeout=None) and verify(..., timeout_seconds=None) (a function that tests it "
                f"is taken).")


def _from_math_verify(value) -> bool:
    name = value.__name__ if inspect.ismodule(value) else getattr(value, "__module__", None)
    return isinstance(name, str) and (name == "math_verify" or name.startswith("math_verify."))


def _uses_math_verify(func, depth: int = 3, seen=None) -> str | None:
    """What of math_verify `func`'s code uses ("math_verify.verify"), also through a partial, a wrapper
    (__wrapped__, a closure), a method, a callable object, and the functions it calls (`depth` levels); None when
    none, or when the code asks whether it runs in the main thread (it then handles math_verify's timeouts)."""
    seen = set() if seen is None else seen
    while True:  # what is called in the end
        if isinstance(func, functools.partial):
            func = func.func
        elif inspect.ismethod(func):
            func = func.__func__
        elif getattr(func, "__wrapped__", None) is not None and not inspect.ismodule(func):
            if _from_math_verify(func):
                break
            func = func.__wrapped__
        else:
            break
    if _from_math_verify(func):
        return f"{getattr(func, '__module__', '')}.{getattr(func, '__qualname__', type(func).__name__)}"
    if id(func) in seen or depth < 0:
        return None
    seen.add(id(func))
    if not inspect.isfunction(func):
        call = getattr(type(func), "__call__", None)
        return _uses_math_verify(call, depth, seen) if inspect.isfunction(call) else None
    codes, names, loaded, imported = [func.__code__], set(), set(), None
    while codes:  # the function's code and that of the functions defined in it
        code = codes.pop()
        names.update(code.co_names)
        # the global names it loads (not attribute names: `ast.parse` is no use of a global `parse`)
        for i in dis.get_instructions(code):
            if i.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                loaded.add(i.argval)
            elif i.opname == "IMPORT_NAME" and (i.argval == "math_verify" or str(i.argval).startswith("math_verify.")):
                imported = i.argval  # imported inside the function
        codes.extend(c for c in code.co_consts if inspect.iscode(c))
    if "main_thread" in names:
        return None
    if imported:
        return imported
    used = [func.__globals__[n] for n in sorted(loaded) if n in func.__globals__]
    used += [cell.cell_contents for cell in func.__closure__ or () if _filled(cell)]
    # module.attribute: what the attributes the code names are in the modules it uses (helpers.score(...))
    used += [getattr(module, n) for module in used if inspect.ismodule(module) and not _from_math_verify(module)
             for n in sorted(names) if isinstance(getattr(module, n, None), (types.FunctionType, functools.partial))
             or _from_math_verify(getattr(module, n, None))]
    for value in used:
        if _from_math_verify(value) and (inspect.ismodule(value) or callable(value)):
            return (value.__name__ if inspect.ismodule(value)
                    else f"{value.__module__}.{getattr(value, '__qualname__', type(value).__name__)}")
    for value in used:
        if callable(value) and not inspect.isclass(value) and not inspect.isbuiltin(value):
            if found := _uses_math_verify(value, depth - 1, seen):
                return found
    return None


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a closure variable not bound yet
        return False
    return True
