"""What every rollout engine takes and returns: left-padded prompt ids in, a RolloutBatch out."""

from __future__ import annotations

import inspect
import numbers
import warnings
from dataclasses import dataclass

import jinja2
import torch


@dataclass
class RolloutBatch:
    """One generation batch, `num_generations` rows per prompt next to each other."""

    prompt_ids: torch.Tensor  # [N, Tp] left-padded
    prompt_mask: torch.Tensor  # [N, Tp]
    completion_ids: torch.Tensor  # [N, Tc] right-padded
    completion_mask: torch.Tensor  # [N, Tc] 1 up to and including the first EOS
    truncated: torch.Tensor  # [N] bool: hit max_completion_length without EOS
    sampling_logprobs: torch.Tensor | None = None  # [N, Tc] if the engine returns them
    # [N, Tc] 1 where the model sampled the token, 0 where a tool or environment wrote it (episodes.py); None: all
    # sampled. Such tokens are read by the model but neither trained on nor counted in lengths (TRL's env_mask).
    env_mask: torch.Tensor | None = None

    @staticmethod
    def concat(pieces: list["RolloutBatch"], pad_token_id: int) -> "RolloutBatch":
        """Batches of the same prompts' width, one after the other (completions right-padded to the longest)."""
        width = max(p.completion_ids.shape[1] for p in pieces)

        def right_pad(t, value):
            return torch.cat([t, t.new_full((t.shape[0], width - t.shape[1]), value)], dim=1)

        have_logprobs = all(p.sampling_logprobs is not None for p in pieces)
        return RolloutBatch(
            torch.cat([p.prompt_ids for p in pieces]), torch.cat([p.prompt_mask for p in pieces]),
            torch.cat([right_pad(p.completion_ids, pad_token_id) for p in pieces]),
            torch.cat([right_pad(p.completion_mask, 0) for p in pieces]),
            torch.cat([p.truncated for p in pieces]),
            torch.cat([right_pad(p.sampling_logprobs, 0.0) for p in pieces]) if have_logprobs else None,
            torch.cat([right_pad(p.env_mask, 0) for p in pieces]) if all(p.env_mask is not None for p in pieces)
            else None)


def check_rollout_batch(out, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, num_generations: int,
                        rollout, *, engine: bool = False, vocab_size: int | None = None,
                        eos_ids: list[int] | None = None) -> None:
    """What a rollout returned is what the step reads it as: a RolloutBatch of `num_generations` rows per prompt next
    to each other, each row holding its prompt (the tokens it was given) and only the new tokens after it, with
    the shapes its fields say. Checked for every rollout, before any reward is computed: a user's rollout function
    that tiles the prompts (`.repeat` where `.repeat_interleave` keeps groups together) or returns generate()'s
    whole sequences would otherwise have its completions scored against other prompts' columns, and trained on,
    without a word. `engine`: one of grpo-nb's engines (a completion that repeats its prompt is then the model's).
    `vocab_size`: the rows of the model's embedding, which every real completion token must index. `eos_ids`:
    the ids that end a completion (eos_token_ids): a completion_mask past the first of them is said once.
    A user's function's sampling log-probs are not used as the old policy (step.sample_batch): they are only
    checked for what any log-prob is here."""
    name = getattr(rollout, "__name__", None) or type(rollout).__name__

    def refuse(problem: str) -> None:
        raise ValueError(f"The rollout {name!r} returned {problem}. A rollout gets (model, tokenizer, prompt_ids, "
                         f"prompt_mask, num_generations) and returns a grpo_nb.rollout.RolloutBatch with "
                         f"num_generations rows per prompt next to each other (prompt_ids.repeat_interleave("
                         f"num_generations, dim=0)) and only the generated tokens as completion_ids.")

    if not isinstance(out, RolloutBatch):
        if inspect.iscoroutine(out):
            out.close()  # never awaited: no RuntimeWarning on top of this message
        fix = (" (it is an async def: train() calls the rollout and does not await it, so make it a plain def)"
               if inspect.iscoroutine(out) else " (it yields: return the RolloutBatch instead)"
               if inspect.isgenerator(out) else "")
        refuse(f"a {type(out).__name__}, not a RolloutBatch{fix}")
    # made under torch.inference_mode(): torch refuses to save them for the backward, which fails raw in the loss,
    # after the rewards (maybe a paid judge) have run on the completions
    if made := [field for field in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated",
                                    "sampling_logprobs")
                if isinstance(value := getattr(out, field), torch.Tensor) and value.is_inference()]:
        raise ValueError(f"The rollout {name!r} returned inference tensors ({', '.join(made)}), made under "
                         f"torch.inference_mode(): the loss cannot take gradients through a step that reads them "
                         f"(torch refuses to save them for backward). Sample under torch.no_grad() instead of "
                         f"torch.inference_mode() (or return t.clone() of each, made outside it).")
    n = prompt_ids.shape[0] * num_generations
    for field, value, dims in (("prompt_ids", out.prompt_ids, 2), ("prompt_mask", out.prompt_mask, 2),
                               ("completion_ids", out.completion_ids, 2), ("completion_mask", out.completion_mask, 2),
                               ("truncated", out.truncated, 1)):
        if not isinstance(value, torch.Tensor) or value.dim() != dims or value.shape[0] != n:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            refuse(f"{field} of shape {shape}, where {n} rows ({prompt_ids.shape[0]} prompts x {num_generations}) "
                   f"{'of one value' if dims == 1 else 'of tokens'} are expected")
    if out.prompt_ids.shape != out.prompt_mask.shape or out.completion_ids.shape != out.completion_mask.shape:
        refuse(f"masks of other shapes than their ids (prompt {tuple(out.prompt_ids.shape)} vs "
               f"{tuple(out.prompt_mask.shape)}, completion {tuple(out.completion_ids.shape)} vs "
               f"{tuple(out.completion_mask.shape)})")
    for field in ("prompt_ids", "completion_ids"):
        if getattr(out, field).is_floating_point() or getattr(out, field).dtype == torch.bool:
            refuse(f"{field} of dtype {getattr(out, field).dtype}, where token ids (integers) are expected")
    # The log-probs are read where the layout says: prompts left-padded (ones at the end), completions right-padded
    # (ones from the start). A mask of other values (2, -1 from ~ of an int, 0.5) would weigh or flip tokens in the loss.
    for field, step in (("prompt_mask", 1), ("completion_mask", -1)):
        mask = getattr(out, field)
        if not bool(((mask == 0) | (mask == 1)).all()):
            refuse(f"a {field} holding other values than 0 and 1 ({sorted(set(mask.flatten().tolist()))[:5]})")
        mask = mask.long()
        if mask.shape[1] > 1 and not bool((mask.diff(dim=1) * step >= 0).all()):
            side = "left-padded: its ones at the end of each row" if step == 1 else \
                "right-padded: its ones from the start of each row, up to the first EOS"
            refuse(f"a {field} that is not {side} (the step reads each completion token's log-prob from the "
                   f"position before it, which must be the prompt's last token)")
        setattr(out, field, mask)
    if out.prompt_mask.shape[1] and not bool(out.prompt_mask[:, -1].all()):
        refuse("a prompt_mask whose last column is padding in some row: prompts must be left-padded, each row's "
               "last token real (the completion follows it)")
    given = [ids[mask.bool()] for ids, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]
    rows = [ids[mask.bool()] for ids, mask in zip(out.prompt_ids.cpu(), out.prompt_mask.cpu())]
    for row, ids in enumerate(rows):
        group = row // num_generations
        if not torch.equal(ids, given[group]):
            other = any(torch.equal(ids, g) for g in given)
            refuse(f"row {row} with " + (
                f"the prompt of another group: rows {group * num_generations}..{(group + 1) * num_generations - 1} "
                f"must all hold prompt {group} (tiled with .repeat instead of .repeat_interleave?)" if other else
                f"a prompt it was not given (row {row} belongs to prompt {group}: return the prompt_ids and "
                f"prompt_mask it was called with, repeated, not the prompts encoded again)"))
    # An id past the embedding fails in the loss's forward with a raw IndexError (on CUDA a device-side assert that
    # ends the session, before any checkpoint can be saved); a negative one fails decoding them for the rewards.
    ids = out.completion_ids.long()  # compared as uint8, 512 would wrap to 0
    outside = out.completion_mask.bool() & ((ids < 0) | (ids >= vocab_size if vocab_size is not None else False))
    if bool(outside.any()):
        row, col = (int(i) for i in outside.nonzero()[0])
        rows = f"its embedding has {vocab_size} rows: ids 0 to {vocab_size - 1}" if vocab_size is not None else "ids from 0"
        refuse(f"completion_ids holding id {int(ids[row, col])} in row {row} (token {col}), outside the "
               f"model's vocabulary ({rows}): were they encoded with another tokenizer, or padded with -100 inside the "
               f"completion_mask? Return the ids the model sampled, with 0 in the completion_mask over any padding")
    if eos_ids:  # the mask runs "up to and including the first EOS": past it, the loss trains on what follows the end
        is_eos = torch.isin(ids, torch.as_tensor(eos_ids, device=ids.device)).long()
        after = (is_eos.cumsum(dim=1) - is_eos) > 0  # tokens after a row's first EOS
        rows = (after & out.completion_mask.bool()).any(dim=1)
        if bool(rows.any()):
            # one text for every step's batch, so that it is said once, not each step
            warnings.warn(f"The rollout {name!r} returned a completion_mask that runs past the first EOS in some "
                          f"completions: the loss trains on the tokens after the end, and the text the rewards get "
                          f"drops the EOS. Mask "
                          f"through the first EOS: completion_mask, truncated = grpo_nb.rollout.completion_mask_from_eos"
                          f"(completion_ids, grpo_nb.rollout.eos_token_ids(model, tokenizer)).", UserWarning,
                          stacklevel=4)
    if not engine:  # generate() returns the prompts, with their left padding, in front of the new tokens
        completions = [ids[mask.bool()] for ids, mask in zip(out.completion_ids.cpu(), out.completion_mask.cpu())]
        padded = [ids for ids in out.prompt_ids.cpu()]
        if out.prompt_mask.bool().all() and all(len(c) > len(p) and torch.equal(c[: len(p)], p)
                                                for c, p in zip(completions, padded)) or \
                not out.prompt_mask.bool().all() and all(len(c) > len(p) and torch.equal(c[: len(p)], p)
                                                         for c, p in zip(out.completion_ids.cpu(), padded)):
            refuse("completion_ids that each begin with their own prompt, padding included: generate()'s whole "
                   "sequences. Return only the new tokens, e.g. out[:, prompt_ids.shape[1]:]")
    truncated = out.truncated
    if truncated.dtype != torch.bool:  # ~ of an int 0/1 is -1/-2: a finished completion would train in reverse
        if truncated.is_floating_point() or not bool(((truncated == 0) | (truncated == 1)).all()):
            refuse(f"truncated of dtype {truncated.dtype} holding other values than 0 and 1, where one bool per row "
                   f"(hit max_completion_length without an EOS) is expected")
        out.truncated = truncated.bool()
    logprobs = out.sampling_logprobs
    if logprobs is not None:
        if not isinstance(logprobs, torch.Tensor) or logprobs.shape != out.completion_ids.shape:
            shape = tuple(logprobs.shape) if isinstance(logprobs, torch.Tensor) else type(logprobs).__name__
            refuse(f"sampling_logprobs of shape {shape}, where the completions' {tuple(out.completion_ids.shape)} "
                   f"is expected (or None: the step then computes them)")
        if not logprobs.is_floating_point():  # zeros_like(completion_ids): every token "log p = 0", a weight of ~0
            refuse(f"sampling_logprobs of dtype {logprobs.dtype}, where the sampled tokens' log-probs (floats) are "
                   f"expected (or None: the step then computes them)")
        real = logprobs[out.completion_mask.bool()].float()
        if real.numel() > 1 and bool((real == 0).all()):
            warnings.warn(f"The rollout {name!r} returned sampling_logprobs that are exactly 0 for every real token: a "
                          f"placeholder, not the sampler's log-probs? The rollout correction (rollout_importance_"
                          f"sampling_correction) would weigh every token by p_trainer / 1. Return the sampler's "
                          f"per-token log-probs, or None.", UserWarning, stacklevel=4)
        if real.numel() and not (torch.isfinite(real).all() and (real <= 1e-3).all()):
            refuse("sampling_logprobs that are no sampled tokens' log-probs (those are finite, log p <= 0): pass the "
                   "sampler's per-token log-probs at the run's temperature, or None (the step then computes them)")


def completion_mask_from_eos(completion_ids: torch.Tensor, eos_token_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of real tokens (through the first EOS) and whether each row ended without one.

    Derived from the first EOS rather than from pad ids, because many tokenizers pad with EOS.
    """
    is_eos = torch.isin(completion_ids, torch.as_tensor(list(eos_token_ids), device=completion_ids.device))
    n, t = completion_ids.shape
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full((n,), t, device=completion_ids.device))
    mask = (torch.arange(t, device=completion_ids.device)[None] <= first_eos[:, None]).long()
    return mask, ~is_eos.any(1)


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a turn: the tokenizer's EOS and the generation config's (may be a list)."""
    ids = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None and not _token_ids(gen_eos):
        # from someone's generation_config.json: "311", 311.0, [[311]] or true (id 1, an ordinary token) would
        # fail later without a name, or end every completion at a wrong token
        raise ValueError(f"model.generation_config.eos_token_id={gen_eos!r} is not a token id (expected an int or a "
                         f"list of ints; it comes from the model folder's generation_config.json): fix that file, "
                         f"or set it, e.g. model.generation_config.eos_token_id = {tokenizer.eos_token_id!r} "
                         f"(the tokenizer's EOS).")
    for value in (tokenizer.eos_token_id, gen_eos):
        if isinstance(value, numbers.Integral):
            ids.add(int(value))
        elif value:
            ids.update(int(v) for v in value)
    if not ids:
        raise ValueError("The tokenizer has no EOS token, so completions could never end; set tokenizer.eos_token.")
    return sorted(ids)


def _token_ids(value) -> bool:
    """An int, or a list of ints (bool is not a token id, though Python counts it as an int)."""
    def one(v):
        return isinstance(v, numbers.Integral) and not isinstance(v, bool)
    return one(value) or (isinstance(value, (list, tuple)) and all(one(v) for v in value))


def prompt_texts(tokenizer, prompts: list, first_row: int = 0) -> list[str]:
    """What the model sees of each prompt: the string, or chat messages through the chat template.
    A template that fails on a prompt (its own raise_exception, an undefined variable, a syntax error,
    endless recursion) is named with the prompt's row (`first_row` + its index) and a fix."""
    texts = []
    for i, prompt in enumerate(prompts):
        try:
            texts.append(prompt if isinstance(prompt, str) else chat_text(tokenizer, prompt))
        except (jinja2.TemplateError, RecursionError) as err:
            raise ValueError(template_failure(first_row + i, prompt, err)) from None
    return texts


def template_failure(row: int, messages, err: BaseException) -> str:
    """Why the chat template failed on dataset row `row`, and what usually fixes it."""
    roles = [m.get("role") if isinstance(m, dict) else m for m in messages]
    if isinstance(err, RecursionError):
        what, fix = "recursed without end (a macro that calls itself?)", "Fix tokenizer.chat_template"
    elif isinstance(err, jinja2.TemplateSyntaxError):
        what = f"is not valid Jinja (line {err.lineno}: {err})"
        fix = "Fix tokenizer.chat_template, or load the model's original tokenizer"
    elif isinstance(err, jinja2.UndefinedError):
        what = f"uses a variable the tokenizer does not provide ({err})"
        fix = "Set it (e.g. tokenizer.bos_token = ...), or fix tokenizer.chat_template"
    elif "system" in roles and "system" in str(err).lower():
        what = f"refused them: {err}"
        fix = ("This template has no system role: merge the system message into the first user message "
               "(arithmetic_dataset(system_prompt=None) leaves it out)")
    else:
        named = "" if type(err) is jinja2.TemplateError else f"{type(err).__name__}: "  # raise_exception's
        what = f"refused them: {named}{err}"
        fix = ("Make the messages what the template accepts (for many: roles alternating user/assistant, "
               "starting with the user), or fix tokenizer.chat_template")
    return (f"Dataset row {row}: the tokenizer's chat template failed on its messages (roles {roles!r:.200}): "
            f"it {what}. {fix}.")


def chat_text(tokenizer, messages) -> str:
    """Chat messages through the chat template, opening the assistant's turn. A last message of the
    assistant's own is a prefill the user wrote to start the answer ("<reasoning>\n"): the model continues
    it, as TRL's maybe_apply_chat_template does, instead of seeing it closed and a fresh turn opened."""
    prefill = bool(messages) and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant"
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=not prefill,
                                             continue_final_message=prefill)
    except ValueError as err:
        if prefill:
            err.add_note("grpo-nb continues a prompt whose last message is the assistant's (a prefill), and this "
                         "chat template changes that message's text: end the prompt with the user's message, or "
                         "use a template that keeps the assistant's content as written.")
        raise


def prompt_token_ids(tokenizer, prompts: list, texts: list[str]) -> list[list[int]]:
    """The token ids of each prompt's text, as TRL 1.16's GRPOTrainer makes them: a plain-text prompt with the
    tokenizer's special tokens (the BOS that Llama / Gemma / Mistral tokenizers add, and their models expect
    at position 0), a chat prompt without them (its template writes its own BOS). A text that already starts
    with the BOS keeps one: never two. An EOS that a tokenizer set to append one (add_eos_token=True) puts after
    a plain-text prompt is dropped: the model would be asked to go on after the end of the text."""
    plain = [i for i, p in enumerate(prompts) if isinstance(p, str)]
    chat = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    rows = [None] * len(texts)
    for picked, special in ((plain, True), (chat, False)):
        if picked:
            for i, ids in zip(picked, tokenizer([texts[i] for i in picked], add_special_tokens=special)["input_ids"]):
                rows[i] = ids
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    if plain and eos is not None and eos != bos and _appends_eos(tokenizer):
        for i in plain:
            rows[i] = rows[i][:-1] if len(rows[i]) > 1 and rows[i][-1] == eos else rows[i]
    return [r[1:] if bos is not None and len(r) > 1 and r[0] == r[1] == bos else r for r in rows]


def _appends_eos(tokenizer) -> bool:
    """Whether the tokenizer puts an EOS after every text it encodes with its special tokens (add_eos_token=True,
    a post-processor ending in EOS), as a short probe text shows."""
    eos = tokenizer.eos_token_id
    return (tokenizer("a", add_special_tokens=True)["input_ids"][-1:] == [eos]
            and tokenizer("a", add_special_tokens=False)["input_ids"][-1:] != [eos])


def encode_prompts(tokenizer, prompts: list, max_prompt_length: int | None, device,
                   texts: list[str] | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Tokenize prompts (chat messages through the chat template, or as `texts` says they render) and left-pad them.

    Prompts longer than `max_prompt_length` keep their last `max_prompt_length` tokens (the
    end of the conversation, where the question usually is), behind their BOS when they begin with
    one (models expect it at position 0); the count of cut prompts is returned so the caller can say so.
    """
    rows = prompt_token_ids(tokenizer, prompts, texts if texts is not None else prompt_texts(tokenizer, prompts))
    if not all(rows):
        empty = next(i for i, r in enumerate(rows) if not r)
        raise ValueError(f"Prompt {empty} ({prompts[empty]!r}) becomes no tokens at all with this tokenizer, so the "
                         f"model would be asked nothing: leave it out, or fix its text.")
    ids, mask, n_cut = left_padded(rows, tokenizer, max_prompt_length)
    return ids.to(device), mask.to(device), n_cut


def left_padded(rows: list[list[int]], tokenizer, max_prompt_length: int | None = None):
    """Rows of token ids left-padded into (ids, mask, how many were cut to max_prompt_length)."""
    n_cut = 0
    if max_prompt_length is not None:
        n_cut = sum(len(r) > max_prompt_length for r in rows)
        bos = tokenizer.bos_token_id
        rows = [r if len(r) <= max_prompt_length else
                r[:1] + r[len(r) - max_prompt_length + 1:] if bos is not None and r[0] == bos and max_prompt_length > 1
                else r[-max_prompt_length:] for r in rows]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask, n_cut


def decode_completions(tokenizer, batch: RolloutBatch, conversational: bool) -> tuple[list, list, list]:
    """What reward functions get for each row of `batch`: (texts, completions, completion_ids).

    Texts run through the first EOS with special tokens dropped; a completion is the text, or
    for a chat prompt TRL's `[{"role": "assistant", "content": text}]`; ids are the masked tokens.
    Each text is decoded from its row's own ids, never from the padded batch: a padded position
    zeroed by the mask would be token 0, an ordinary token in many vocabularies ('!' in Qwen2.5's
    and Llama 3's), and reward functions would score text the model never wrote.
    """
    completion_ids = [ids[m.bool()].tolist() for ids, m in zip(batch.completion_ids, batch.completion_mask)]
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    completions = [[{"role": "assistant", "content": t}] if conversational else t for t in texts]
    return texts, completions, completion_ids


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


class WithTemplateKwargs:
    """`tokenizer` whose apply_chat_template() gets the run's chat_template_kwargs (what rollout.prompt_texts and the
    pre-run checks render is what the run renders, and a template's failures are named as without them); everything
    else is the tokenizer's own."""

    def __init__(self, tokenizer, kwargs: dict):
        self._tokenizer, self._kwargs = tokenizer, kwargs

    def apply_chat_template(self, messages, **kwargs):
        return self._tokenizer.apply_chat_template(messages, **{**self._kwargs, **kwargs})

    def __call__(self, *args, **kwargs):
        return self._tokenizer(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)
