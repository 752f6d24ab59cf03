"""TRL's `rollout_func`: a user's function that takes the step's prompts and returns token ids, for agents that
run their own loop (an OpenEnv client, a game, a sandbox) - `train(..., rollout_func=f)`.

TRL 1.16's contract: `f(prompts, trainer) -> dict` with "prompt_ids", "completion_ids" and "logprobs" (lists per
completion, `num_generations` completions per prompt, the prompts given once each), optionally "env_mask" (1 where
the model sampled the token, 0 where an environment wrote it) and "logprob_token_ids"; every other key is a list
per completion passed to the reward functions by its name. `trainer` here is a `TrainerView`: the attributes TRL's
rollout functions read (processing_class, args, model, num_generations, accelerator.device, state.global_step), and
`rollout`, grpo-nb's engine, to sample from the live policy: `trainer.rollout(model, tokenizer, ids, mask, n)`. It is
one object for the run, as TRL's trainer (what the function keeps on it stays from step to step), and a TRL attribute
it lacks (trainer.vllm_client, trainer.args.vllm_mode) raises an AttributeError that says what to use instead.

As in TRL, the completion is every token returned (no cut at an EOS), a completion is truncated when its last
token is neither an EOS nor the pad token, and its log-probs are not used as the old policy (they are checked, and
feed the rollout correction when that is on).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import numbers
import warnings
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from .rollout.batch import RolloutBatch, left_padded

REQUIRED = ("prompt_ids", "completion_ids", "logprobs")


@dataclass
class TrainerView:
    """What a TRL rollout function reads of `trainer`."""
    processing_class: object
    args: object  # the run's GRPOConfig (TRL's names: max_completion_length, temperature, num_generations, ...)
    model: object
    num_generations: int
    rollout: object  # grpo-nb's engine: rollout(model, tokenizer, prompt_ids, prompt_mask, n) -> RolloutBatch
    accelerator: object
    state: object  # transformers' TrainerState: global_step, max_steps, ...

    @property
    def tokenizer(self):
        return self.processing_class

    def __getattr__(self, name):
        # only for names the view does not have (a TRL-ported function reads trainer.vllm_client, ...): say that this
        # is grpo-nb's view, not TRL's GRPOTrainer, and what it offers instead of Python's bare "no attribute"
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(_missing_on_trainer(f"trainer.{name}", name))


def _missing_on_trainer(what: str, name: str) -> str:
    """The message for a TRL attribute a rollout function reads that grpo-nb's `trainer` view does not have."""
    vllm = ("; grpo-nb runs no vLLM server or client: sample from the live policy with trainer.rollout(trainer.model, "
            "trainer.processing_class, prompt_ids, prompt_mask, n), grpo-nb's engine (it returns a RolloutBatch with "
            "the completions and their log-probs)") if "vllm" in name else ""
    return (f"{what}: grpo-nb has no attribute {name!r}. The rollout_func's `trainer` is grpo-nb's view of the run, "
            f"not TRL's GRPOTrainer: it offers processing_class (tokenizer), args (a copy of the run's GRPOConfig), "
            f"model, num_generations, accelerator (device, process_index, num_processes), state (global_step, "
            f"max_steps) and rollout (grpo-nb's engine: trainer.rollout(model, tokenizer, prompt_ids, prompt_mask, "
            f"n)){vllm}. State you set on trainer (trainer.my_pool = ...) is kept from step to step, as in TRL. "
            f"See the README's rollout_func row.")


def _args_view(config):
    """A copy of the run's GRPOConfig whose missing attributes (TRL's trainer.args.vllm_mode, use_vllm, ...) are
    named in the AttributeError, with what to use instead."""
    args = copy.deepcopy(config)
    cls = type(config)
    view_cls = _ARGS_VIEWS.get(cls)
    if view_cls is None:
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            raise AttributeError(_missing_on_trainer(f"trainer.args.{name} ({cls.__name__}, a copy of the run's "
                                                     f"settings)", name))
        def __reduce_ex__(self, protocol):  # pickled (a process pool) and copied as the run's own config class
            return _plain_config, (cls, dict(self.__dict__))

        def __eq__(self, other):  # equal to its copies (plain configs): a dataclass's == wants the same class
            if not isinstance(other, cls):
                return NotImplemented
            if not dataclasses.is_dataclass(cls):
                return self.__dict__ == other.__dict__
            return all(getattr(self, f.name) == getattr(other, f.name) for f in dataclasses.fields(cls) if f.compare)

        view_cls = _ARGS_VIEWS[cls] = type(cls.__name__, (cls,), {"__getattr__": __getattr__,
                                                                  "__reduce_ex__": __reduce_ex__, "__eq__": __eq__,
                                                                  "__hash__": cls.__hash__,
                                                                  "__module__": cls.__module__})
    args.__class__ = view_cls
    return args


_ARGS_VIEWS: dict = {}


def _plain_config(cls, fields: dict):
    """The run's config class again, with `fields`: what a pickled or copied trainer.args becomes."""
    config = object.__new__(cls)
    config.__dict__.update(fields)
    return config


class RolloutFunc:
    """`train(rollout_func=f)`: f called with the prompts of each rollout and a TrainerView."""
    takes_prompts = True  # scoring.score_groups calls generate() with the dataset rows, not token ids
    user_written = True  # the rollout guard names it (not the reward functions) for a change to the model

    def __init__(self, func, engine, config, world):
        if not callable(func):
            raise TypeError(f"rollout_func={func!r:.80} is not a function: pass f(prompts, trainer) -> dict with "
                            f"'prompt_ids', 'completion_ids' and 'logprobs' (TRL's contract).")
        self.func, self.engine, self.config, self.world = func, engine, config, world
        self.__name__ = getattr(func, "__name__", type(func).__name__)
        self.warned = set()  # the warnings said once per run
        self.view = None  # one TrainerView per run, as TRL's trainer is one object (state kept on it survives)

    def generate(self, model, tokenizer, rows: list[dict], num_generations: int, trainer_state, device, eos_ids,
                 vocab_size) -> tuple[RolloutBatch, dict]:
        """(the rollout's batch, the extra columns for the reward functions)."""
        # a copy of the settings: a function that writes into trainer.args must not change the run's own (the
        # optimizer's learning rate stays, but the saved grpo_config.json would record the written value)
        args = _args_view(self.config)
        accelerator = SimpleNamespace(device=device, is_main_process=self.world.is_main,
                                      process_index=self.world.rank, num_processes=self.world.size)
        if self.view is None:
            self.view = TrainerView(tokenizer, args, model, num_generations, self.engine, accelerator, trainer_state)
        else:  # the same object every step (a pool, client or counter the function keeps on it stays), refreshed
            view = self.view
            view.processing_class, view.args, view.model, view.num_generations = tokenizer, args, model, num_generations
            view.rollout, view.accelerator, view.state = self.engine, accelerator, trainer_state
        # copies, as TRL gives them: a multi-turn loop that appends to its prompt must not edit the dataset's rows
        # (later epochs' prompts) or the prompts the reward functions get
        out = self.func(copy.deepcopy([row["prompt"] for row in rows]), self.view)
        # compared field by field (args is of the view's subclass, so == between the two is always False)
        changed = sorted(k for k in vars(self.config) if getattr(args, k, None) != getattr(self.config, k))
        if changed and "args" not in self.warned:
            self.warned.add("args")
            warnings.warn(f"rollout_func {self.__name__!r} changed trainer.args ({', '.join(changed)}): "
                          f"ignored, the run keeps train()'s settings (trainer.args is a copy; change them in "
                          f"train()'s arguments instead). Said once per run.", UserWarning, stacklevel=2)
        n = len(rows) * num_generations
        batch, extra = to_batch(out, n, self.__name__, tokenizer, device, eos_ids, vocab_size, self.warned,
                                num_generations=num_generations,
                                correction=bool(getattr(self.config, "rollout_importance_sampling_correction", False)),
                                given=[row["prompt"] for row in rows])
        self._warn_once(batch, extra, rows)
        return batch, extra

    def _warn_once(self, batch: RolloutBatch, extra: dict, rows: list[dict]) -> None:
        """What TRL accepts too but a run was likely not sized or meant for: said once per run."""
        limit, longest = getattr(self.config, "max_completion_length", None), batch.completion_ids.shape[1]
        if limit and longest > limit and "length" not in self.warned:
            self.warned.add("length")  # the function samples: the run's length cap is not applied to what it returns
            warnings.warn(f"rollout_func {self.__name__!r} returned completions of up to {longest} tokens, beyond "
                          f"max_completion_length={limit}: they are trained on as returned, and memory and step time "
                          f"grow with them (an out-of-memory error later in a run sized for {limit}). Cap the "
                          f"sampler's length (e.g. SamplingParams(max_tokens=trainer.args.max_completion_length)). "
                          f"Said once per run.", UserWarning, stacklevel=3)
        shadowed = sorted(k for k in extra if rows and k in rows[0])
        if shadowed and "shadowed" not in self.warned:
            self.warned.add("shadowed")  # TRL does the same; a key named like a column is easily an accident
            warnings.warn(f"rollout_func {self.__name__!r} returned {shadowed}, named like the dataset's column(s): "
                          f"the reward functions get the function's values in their place, not the dataset's. "
                          f"Rename the key if that is not meant. Said once per run.", UserWarning, stacklevel=3)


def _as_list(value):
    """A torch tensor's or numpy array's values as a list (what many samplers and environments return); anything
    else as it is."""
    return value.tolist() if isinstance(value, (torch.Tensor, np.ndarray)) else value


def to_batch(out, n: int, name: str, tokenizer, device, eos_ids, vocab_size,
             warned: set | None = None, num_generations: int | None = None,
             correction: bool = False, given: list | None = None) -> tuple[RolloutBatch, dict]:
    """What a rollout function returned, checked and read into a RolloutBatch (+ the extra columns).
    `num_generations`: the rows' group size, to check that they are prompt-major; `correction`: whether the run's
    rollout_importance_sampling_correction needs the log-probs (then a missing or non-finite one is refused);
    `given`: the prompts handed to the function, to check that each group is its own prompt's, in their order."""
    def refuse(problem: str):
        raise ValueError(f"rollout_func {name!r} returned {problem}. It must return a dict with 'prompt_ids', "
                         f"'completion_ids' and 'logprobs' (lists with one entry per completion: {n}, i.e. "
                         f"num_generations per prompt, the prompts given once each), optionally 'env_mask' "
                         f"(1 = sampled by the model, 0 = written by the environment) and other per-completion "
                         f"lists, which reach the reward functions by their keys.")

    if not isinstance(out, dict):
        if inspect.iscoroutine(out):  # an async def: train() calls it and does not await it
            out.close()
            refuse("a coroutine, not a dict: it is an async def, which train() calls without awaiting; make it a "
                   "plain def (run an async loop inside it with asyncio.run(...))")
        refuse(f"a {type(out).__name__}, not a dict")
    if missing := [k for k in REQUIRED if k not in out]:
        refuse(f"a dict without {missing}")
    out = dict(out)
    for key, value in out.items():
        if isinstance(value, (torch.Tensor, np.ndarray)) and key not in (*REQUIRED, "env_mask", "logprob_token_ids"):
            # another per-completion column (a score, a flag) as one 1-D array: its values, as a list (TRL's rewards
            # get lists); the length is checked below as for a list
            out[key] = value = value.tolist()
        if isinstance(value, (torch.Tensor, np.ndarray)) and key in (*REQUIRED, "env_mask"):
            # one padded 2-D array: its pad columns would be read as tokens, so the rows must come without them
            refuse(f"{key!r} as one {type(value).__name__} of shape {tuple(value.shape)}, not a list: give a list with "
                   f"one row per completion, each without padding (e.g. [row[mask.bool()].tolist() for row, mask in "
                   f"zip(ids, attention_mask)], or {key}.tolist() when no row is padded)")
        if not isinstance(value, (list, tuple)) or len(value) != n:
            got = f"{len(value)} entries" if isinstance(value, (list, tuple)) else type(value).__name__
            refuse(f"{key!r} with {got}, where {n} (one per completion) are expected")

    def ids_of(key, i, row):
        row = _as_list(row)
        if not isinstance(row, (list, tuple)) or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                                         for t in row):
            refuse(f"{key}[{i}] = {row!r:.80}, not a list of token ids")
        if bad := [t for t in row if t < 0 or (vocab_size is not None and t >= vocab_size)]:
            refuse(f"{key}[{i}] holding id {bad[0]}, outside the model's vocabulary (0 to {vocab_size - 1})")
        return [int(t) for t in row]

    prompts = [ids_of("prompt_ids", i, r) for i, r in enumerate(out["prompt_ids"])]
    completions = [ids_of("completion_ids", i, r) for i, r in enumerate(out["completion_ids"])]
    if empty := [i for i, p in enumerate(prompts) if not p]:
        refuse(f"an empty prompt_ids[{empty[0]}]")
    if empty := [i for i, c in enumerate(completions) if not c]:
        refuse(f"an empty completion_ids[{empty[0]}] (a completion needs at least one token)")
    warned = set() if warned is None else warned
    _check_prompt_major(prompts, num_generations, name, refuse, warned)
    if given is not None:
        _check_prompt_order(prompts, given, num_generations or 1, tokenizer, refuse)
    prompt_ids, prompt_mask, _ = left_padded(prompts, tokenizer)
    width = max(map(len, completions))
    completion_ids = torch.full((n, width), tokenizer.pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros((n, width), dtype=torch.long)
    for i, c in enumerate(completions):
        completion_ids[i, : len(c)], completion_mask[i, : len(c)] = torch.tensor(c), 1
    ends = set(eos_ids) | {tokenizer.pad_token_id}
    if "padding" not in warned and (row := next((i for i, c in enumerate(completions) if _pads_after_eos(
            c, set(eos_ids), tokenizer.pad_token_id)), None)) is not None:
        # rows copied from a padded batch (trainer.rollout's RolloutBatch) without its completion_mask: as in TRL,
        # every token returned is the completion, so the pads are trained on (with the advantage's sign)
        warned.add("padding")
        warnings.warn(f"rollout_func {name!r} returned completion_ids[{row}] = {completions[row]!r:.80}, which goes on "
                      f"with pad tokens ({tokenizer.pad_token_id}) after its EOS: every token returned is the "
                      f"completion, so the model is trained on those pads and the reward functions get them. Rows "
                      f"copied from a padded batch need their mask: batch.completion_ids[i][batch.completion_mask[i]"
                      f".bool()].tolist() (and the same for prompt_ids with prompt_mask).", stacklevel=3)
    truncated = torch.tensor([c[-1] not in ends for c in completions])

    def per_token(key, values, kind):
        rows = []
        if key == "logprobs" and all(v is None for v in values):
            return None  # no log-probs given: the step computes them
        for i, (v, c) in enumerate(zip(values, completions)):
            v = _as_list(v)
            if v is None and key == "logprobs":
                v = [None] * len(c)  # one row without log-probs among others: its values are missing (below)
            if not isinstance(v, (list, tuple)) or len(v) != len(c):
                refuse(f"{key}[{i}] with {len(v) if isinstance(v, (list, tuple)) else type(v).__name__} values for "
                       f"completion_ids[{i}]'s {len(c)} tokens")
            # the raw values, before any cast: a cast to long would read env_mask 0.6 as 0 (every token masked out)
            # and torch's own error for a string names neither the key nor the row
            if key == "env_mask":
                # np.True_ / np.False_ (a list made from a numpy mask) are no numbers.Real, but are 1 and 0
                if bad := [x for x in v if not (isinstance(x, (numbers.Real, np.bool_)) and x in (0, 1))]:
                    refuse(f"env_mask[{i}] holding {bad[0]!r:.40}: env_mask holds 1 where the model sampled the "
                           f"token and 0 where the environment wrote it, nothing else (no weights or fractions)")
                v = [int(x) for x in v]  # torch cannot make a long tensor of numpy bools
            elif bad := [x for x in v if x is not None and (not isinstance(x, numbers.Real) or isinstance(x, bool))]:
                refuse(f"{key}[{i}] holding {bad[0]!r:.40}, not numbers (the log-probability of each token)")
            elif bad := [x for x in v if x is not None and x > 1e-3]:
                # log p <= 0: a positive value is a probability, a logit or a flipped sign, and would set the
                # rollout correction's ratios (the engine's own check refuses the same)
                refuse(f"{key}[{i}] holding {bad[0]!r:.40}, above 0: log-probabilities are <= 0 (log p of each "
                       f"sampled token, not its probability, its logit or -log p)")
            rows.append(v)
        t = torch.zeros((n, width), dtype=kind)
        for i, v in enumerate(rows):
            # vLLM reports a NaN log-prob as None; TRL reads it as NaN: not a value the correction can use
            t[i, : len(v)] = torch.tensor([math.nan if x is None else x for x in v], dtype=kind)
        return t

    logprobs = per_token("logprobs", out["logprobs"], torch.float32)
    env_mask = None
    if "env_mask" in out:
        env_mask = per_token("env_mask", out["env_mask"], torch.long)
        if not bool(env_mask[completion_mask.bool()].any()):
            warnings.warn(f"rollout_func {name!r} returned an env_mask that is 0 on every token, so this step trains "
                          f"on nothing: env_mask is 1 where the model sampled the token and 0 where the environment "
                          f"wrote it (TRL's convention; is it inverted?).", stacklevel=2)
    if logprobs is None and correction:
        refuse("'logprobs' that are None, while rollout_importance_sampling_correction=True weights each token by "
               "p_trainer / p_rollout and so needs the log-prob of every token the model sampled: return the "
               "sampler's log-probs, or set rollout_importance_sampling_correction=False")
    if logprobs is not None:
        logprobs = _finite_logprobs(logprobs, completion_mask, env_mask, completions, name, correction, warned)
    batch = RolloutBatch(prompt_ids.to(device), prompt_mask.to(device), completion_ids.to(device),
                         completion_mask.to(device), truncated.to(device),
                         None if logprobs is None else logprobs.to(device),
                         None if env_mask is None else env_mask.to(device))
    extra = {k: list(v) for k, v in out.items() if k not in (*REQUIRED, "env_mask", "logprob_token_ids")}
    if clash := sorted(set(extra) & {"prompts", "completions", "completion_ids", "trainer_state", "log_extra",
                                     "log_metric", "environments"}):
        refuse(f"the key {clash[0]!r}, which is a keyword train() itself passes to every reward function: rename it "
               f"(e.g. {clash[0] + '_from_env'!r}) and read it under that name in the reward functions")
    return batch, extra


def _check_prompt_major(prompts: list[list[int]], num_generations: int | None, name: str, refuse, warned: set):
    """The rows are num_generations consecutive rows per prompt, in the prompts' order (TRL's contract): each group
    of consecutive rows is one GRPO group, compared for the advantages and scored against its own prompt's row.
    Rows in generation-major order (p0g0, p1g0, p0g1, p1g1) show as groups whose prompt_ids differ while every
    num_prompts-th row agrees: refused. Other differences within a group may be one prompt with per-episode
    observations (a random board in the prompt): said once."""
    g = num_generations or 0
    if g <= 1 or len(prompts) % g:
        return
    groups = len(prompts) // g
    odd = next(((i, j) for i in range(0, len(prompts), g) for j in range(i + 1, i + g) if prompts[j] != prompts[i]),
               None)
    if odd is None:
        return
    i, j = odd
    strided = groups > 1 and all(prompts[k] == prompts[k % groups] for k in range(len(prompts)))
    problem = (f"prompt_ids[{j}], which differs from prompt_ids[{i}] of the same group (rows {i} to {i + g - 1}, "
               f"num_generations={g}): rows must be prompt-major, num_generations consecutive rows per prompt, in the "
               f"order the prompts were given (for prompt in prompts: for k in range(trainer.num_generations): ...)")
    if strided:
        refuse(problem + f"; these rows are generation-major (the prompt_ids repeat every {groups} rows), so each "
                         f"group would mix prompts and the reward functions would score completions against other "
                         f"prompts' rows")
    if "group" not in warned:
        warned.add("group")
        warnings.warn(f"rollout_func {name!r} returned {problem}. Each group's completions are compared with each "
                      f"other for the advantages and scored against that group's dataset row; if the prompts differ "
                      f"only by a per-episode observation this is as meant.", stacklevel=4)


def _prompt_text(prompt) -> tuple[str, ...] | None:
    """A dataset row's prompt as the texts to look for in the decoded prompt_ids of a group, without whitespace
    (a chat's messages each: a template puts its markers between them); None when it has no text to look for."""
    if isinstance(prompt, str):
        parts = [prompt]
    elif isinstance(prompt, (list, tuple)):
        parts = [m.get("content") for m in prompt if isinstance(m, dict) and isinstance(m.get("content"), str)]
    else:
        return None
    return tuple(text for p in parts if (text := "".join(p.split()))) or None


def _check_prompt_order(prompts: list[list[int]], given: list, g: int, tokenizer, refuse) -> None:
    """Each group's prompt_ids must be the prompt handed out in its place (group k = prompts[k]): the reward
    functions score group k against dataset row k. Groups kept together but returned in another order (episodes
    collected as they finish, sorted by length, read from a dict) pass the prompt-major check, so each row's decoded
    prompt_ids are compared with the prompts given, by their text (whatever template or special tokens the function
    added). Refused only when a row holds another given prompt's text and not its own: a function that rewrites
    the prompt (an environment's observation) matches none and passes, and two dataset rows with the same prompt
    text are interchangeable. And only where the evidence is unambiguous: texts are compared case-folded (a
    lowercasing normalizer), a row whose decoding holds the unknown token is not compared (its text is lost), nor
    one whose own prompt holds the other's text (a long prompt cut from the left, as TRL truncates, keeps the
    tail, which may be a shorter prompt of the batch)."""
    texts = [None if (t := _prompt_text(p)) is None else tuple(part.casefold() for part in t) for p in given]
    if len(prompts) != len(given) * g:
        return
    unknown = getattr(tokenizer, "unk_token", None)
    unknown = unknown.casefold() if isinstance(unknown, str) and unknown else None
    decoded = {}
    for r, ids in enumerate(prompts):
        k = r // g
        own = texts[k]
        if own is None:
            continue
        key = tuple(ids)
        if key not in decoded:
            try:
                decoded[key] = "".join(tokenizer.decode(ids, skip_special_tokens=False).split()).casefold()
            except Exception:  # an id the tokenizer cannot decode (the model's embedding is wider): nothing to compare
                decoded[key] = None
        text = decoded[key]
        if text is None or all(part in text for part in own) or (unknown is not None and unknown in text):
            continue
        whole = " ".join(own)  # parts hold no whitespace: one cannot match across two
        other = next((j for j, t in enumerate(texts) if t is not None and t != own and all(part in text for part in t)
                      and not all(part in whole for part in t)), None)
        if other is None:
            continue
        refuse(f"prompt_ids[{r}] (group {k}: rows {k * g} to {k * g + g - 1}, num_generations={g}) holding the "
               f"prompt of prompts[{other}] ({given[other]!r:.60}), not that of prompts[{k}] ({given[k]!r:.60}), "
               f"which that group was given: the groups must come in the order the prompts were given (group k = "
               f"prompts[k]), since group k's completions are scored against dataset row k (its prompt, answer and "
               f"other columns). Episodes collected as they finish (asyncio.as_completed, a thread pool), sorted, or "
               f"read from a dict or set come in another order: keep each prompt's index with its episodes and "
               f"return the groups sorted by it (asyncio.gather and executor.map keep the order)")


def _finite_logprobs(logprobs, completion_mask, env_mask, completions, name, correction, warned):
    """The log-probs with the environment's tokens' placeholders (NaN, None, inf: never used) made 0; a missing
    or non-finite log-prob of a token the model sampled is refused when the rollout correction needs it (it would
    make every weight NaN), else said once and the log-probs left out (the step computes its own)."""
    sampled = completion_mask.bool() if env_mask is None else completion_mask.bool() & env_mask.bool()
    finite = torch.isfinite(logprobs)
    logprobs = torch.where(finite | sampled, logprobs, torch.zeros_like(logprobs))
    bad = (sampled & ~finite).nonzero()
    if not len(bad):
        return logprobs
    i, k = (int(x) for x in bad[0])
    value = logprobs[i, k].item()
    where = (f"logprobs[{i}][{k}] = {'None/NaN' if math.isnan(value) else value} (for completion_ids[{i}][{k}] = "
             f"{completions[i][k]}, a token the model sampled; {len(bad)} such value(s) in all)")
    if correction:
        raise ValueError(f"rollout_func {name!r} returned {where}: rollout_importance_sampling_correction=True weights "
                         f"each token by p_trainer / p_rollout, so it needs a finite log-prob of every token the model "
                         f"sampled (env_mask=1). Fix the sampler's log-probs in rollout_func {name!r} (vLLM reports a "
                         f"NaN one as None), mark tokens the environment wrote with env_mask=0, or set "
                         f"rollout_importance_sampling_correction=False.")
    if "nonfinite" not in warned:
        warned.add("nonfinite")
        warnings.warn(f"rollout_func {name!r} returned {where}. The log-probs are not used without "
                      f"rollout_importance_sampling_correction, so the step goes on; with it they would be refused. "
                      f"Check the sampler's log-probs.", stacklevel=4)
    return None


def _pads_after_eos(ids: list[int], eos_ids: set, pad_id) -> bool:
    """Whether a completion goes on after its first EOS with pad tokens only (a row copied with its padding)."""
    first = next((k for k, t in enumerate(ids) if t in eos_ids), None)
    rest = [] if first is None else ids[first + 1:]
    return bool(rest) and all(t == pad_id for t in rest)
