"""Try an agent before training it: one episode with tools or an environment, shown turn by turn.

    episode = play(model, tokenizer, prompt="What is 17 * 23?", tools=[multiply])        # the model acts
    episode = play(prompt="...", environment=Wordle, script=['<tool_call>...</tool_call>', "I won."])  # no model

`play` runs the same episode loop as `train(tools=..., environment_factory=...)` (grpo_nb.episodes): the same
call format, tool results, error messages and limits. With `script` the assistant's turns are given, so an
environment or a tool can be tested (and a reward function on its episodes, with `preview_rewards`) before any
model is loaded. The returned `Episode` shows its turns as a notebook cell's value, and holds the messages (what
reward functions get as the completion), the environment instance and the text.
"""

from __future__ import annotations

import html
import time
import warnings
from dataclasses import dataclass, field

from .checks import check_context, check_model_and_tokenizer, check_prompts, prompts_cut_message
from .config import config_for
from .dataset_checks import CHAT_ROLES
from .display import traces
from .episodes import (assistant_message, build_environment, check_no_clash, environment_tools, episode_text,
                       make_agent, reset_environment, run_call, run_episodes, tools_template, with_observation)
from .tools import ToolFormat, as_tools, one_call_per_turn_error, takes_several_calls, tool_format


@dataclass
class Episode:
    prompt: list  # the chat messages it started from (after the environment's reset)
    messages: list  # the model's turns, its tool calls and their results: a completion as reward functions get it
    environment: object = None  # the instance the episode ran in (its state is the episode's outcome)
    seconds: float = 0.0
    notes: list = field(default_factory=list)  # why it ended, when not with a turn that called nothing

    @property
    def text(self) -> str:
        return episode_text(self.messages)

    def _sample(self) -> dict:
        prompt = self.prompt[-1].get("content", "") if self.prompt else ""
        return {"prompt": prompt, "completion": self.text, "turns": self.messages, "reward": float("nan")}

    def _repr_html_(self) -> str:
        notes = "".join(f"<div><i>{html.escape(n)}</i></div>" for n in self.notes)
        return traces([{"step": 0, "samples": [self._sample()]}]) + notes

    def __str__(self) -> str:
        return traces([{"step": 0, "samples": [self._sample()]}], html=False) + "".join(f"\n({n})" for n in self.notes)


def play(model=None, tokenizer=None, *, prompt, tools=None, environment=None, row: dict | None = None,
         script: list[str] | None = None, greedy: bool = True, temperature: float = 1.0,
         max_completion_length: int = 512, max_tool_calling_iterations: int | None = None,
         tool_timeout: float | None = 30.0) -> Episode:
    """One episode of `prompt` (a user message, or chat messages) with `tools` and/or `environment` (a class,
    as train()'s environment_factory, or an instance, whose state you can read afterwards).

    `row`: the dataset row's other columns, given to the environment's reset(). With `script` (the assistant's
    turns as texts) no model is needed: each turn's calls are run as in training and the script ends the
    episode; the call format is the tokenizer's if one is given, else <tool_call>{...}</tool_call>. Otherwise
    `model` writes the turns, greedily unless greedy=False (then sampled at `temperature`), within
    `max_completion_length` tokens over all turns and tool results, as in training. The model, the tokenizer and
    the prompt get evaluate()'s checks first; a prompt (with the tools' schemas) longer than the model's context
    leaves beside `max_completion_length` is cut from the left, with evaluate()'s warning.

    The tokenizer is left as it is: where its chat template cannot render tools, the episode is rendered with
    grpo-nb's (tools.tool_chat_template), which train() would set."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        messages = list(prompt)
    else:
        raise TypeError(f"play(prompt={prompt!r:.80}) must be the user's message (a string) or chat messages "
                        f"([{{'role': 'user', 'content': ...}}]).")
    _check_messages(messages)
    if tools is None and environment is None:
        raise ValueError("play() needs tools=[...] or environment=... : an episode is turns that call them.")
    if script is not None:
        script = _checked_script(script)
    if isinstance(environment, dict):  # train()'s environment_factory={...} copied: play() plays one of them
        names = ", ".join(map(repr, list(environment)[:4]))
        raise ValueError(f"play(environment=<dict of {len(environment)}: {names}>): play() plays one environment; "
                         f"pass one of the dict's values, e.g. environment=envs[{next(iter(environment), 'name')!r}] "
                         f"(train() and evaluate() route a dict by each row's 'environment' column).")
    if environment is not None and not isinstance(environment, type) and not callable(getattr(environment, "reset",
                                                                                               None)) \
            and not callable(environment):
        raise ValueError(f"play(environment=<{type(environment).__name__}>): the environment has no reset() method. "
                         f"Each episode starts with env.reset(**row) (returning None, or a string appended to the "
                         f"prompt): give {type(environment).__name__} one, e.g. def reset(self, **row): return None.")
    factory = environment if environment is None or isinstance(environment, type) or not hasattr(
        environment, "reset") else (lambda: environment)
    if not isinstance(greedy, bool) and type(greedy).__name__ != "bool_":  # numpy's bool is a bool too
        # any non-empty text is true: greedy="False" (read from a YAML file or a command line) decoded greedily
        raise ValueError(f"play() argument greedy={greedy!r:.80} is invalid: expected True or False"
                         + (" (a bool, not the text)" if isinstance(greedy, str) else ""))
    greedy = bool(greedy)
    config = config_for("play()", max_completion_length=max_completion_length, temperature=temperature,
                        max_tool_calling_iterations=max_tool_calling_iterations, tool_timeout=tool_timeout)
    started = time.perf_counter()
    if script is not None:
        return _scripted(messages, tools, factory, dict(row or {}), script, tokenizer, config, started)
    if model is None or tokenizer is None:
        raise ValueError("play() needs a model and its tokenizer to write the turns, or script=[...] with the "
                         "assistant's turns as texts to try the tools / environment without a model.")
    # evaluate()'s and train()'s checks of the model and tokenizer (another model's tokenizer, a missing pad
    # token) and of the context: a mistake gets the same message here as there, not a raw error mid-episode
    check_model_and_tokenizer("play", model, tokenizer)
    context = check_context("play", model, None, max_completion_length)
    try:
        agent = make_agent(tools, factory, tokenizer, config)
    except ValueError as err:  # make_agent's message names train()'s argument; here it is play()'s
        if not str(err).startswith("environment_factory: the environment"):
            raise
        raise ValueError(str(err).replace("environment_factory:", "play(environment=...):", 1)) from None
    if agent is None:
        raise ValueError("play() needs tools=[...] or environment=... : an episode is turns that call them.")
    check_prompts("play", model, tokenizer, [{"prompt": messages}], True, agent=agent)  # as the episode renders it
    # what the context leaves beside the completion, as evaluate() does: a longer prompt (the tools' schemas count)
    # is cut from the left, said below, instead of running past the model's positions
    max_prompt_length = context - max_completion_length if context else None
    from .attachments import model_context
    from .rollout import engine_for, eos_token_ids
    from .scoring import embedding_rows, input_device

    engine = engine_for(model, max_completion_length=max_completion_length, greedy=greedy, temperature=temperature)
    was_training = model.training
    model.eval()
    try:
        episodes = run_episodes(model, tokenizer, [{**(row or {}), "prompt": messages}], engine, 1, agent,
                                max_prompt_length=max_prompt_length, max_completion_length=max_completion_length,
                                context=model_context(model), device=input_device(model),
                                eos_ids=eos_token_ids(model, tokenizer), vocab_size=embedding_rows(model),
                                engine=True)
    finally:
        model.train(was_training)
    if episodes.prompts_cut:
        warnings.warn("play(): " + prompts_cut_message(episodes.prompts_cut, max_prompt_length, max_completion_length,
                                                       context), UserWarning, stacklevel=2)
    notes = ["stopped at max_completion_length"] if bool(episodes.batch.truncated[0]) else []
    return Episode(episodes.prompts[0], episodes.completions[0],
                   episodes.environments[0] if episodes.environments else None, time.perf_counter() - started, notes)


def _checked_script(script) -> list[str]:
    """The assistant's turns as strings, or refused with the fix (a single string would be one turn per
    character; a message dict's text is its 'content')."""
    if isinstance(script, str) or not isinstance(script, (list, tuple)):
        raise TypeError(f"play(script={script!r:.80}) must be a list of the assistant's turns, each a string: "
                        f"script=[turn_1, turn_2, ...] (for one turn, script=[text]).")
    for k, turn in enumerate(script):
        if not isinstance(turn, str):
            hint = " (a message: pass its 'content')" if isinstance(turn, dict) else ""
            raise TypeError(f"play(script=[...]): turn {k + 1} is {type(turn).__name__} {turn!r:.80}{hint}; each turn "
                            f"is the assistant's text, as the model would write it, calls included "
                            f"('<tool_call>{{...}}</tool_call>').")
    return list(script)


def _check_messages(messages: list) -> None:
    """The chat prompt train() would accept (dataset_checks' check of a row's messages): a message with a list of
    parts as its content (the multimodal format) or without a role or text would play here and then fail train()
    (or break an environment's observation, which is appended to the last message's text)."""
    for m in messages:
        content = m.get("content")
        if m.get("role") in CHAT_ROLES and isinstance(content, list):
            text = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
            raise ValueError(f"play(prompt=...): message {str(m)[:200]} has its content as a list of parts (the "
                             f"multimodal format), which train() refuses: grpo-nb trains text models on text. Give "
                             f"the content as a string, e.g. {{'role': {m['role']!r}, 'content': {text[:80]!r}}}.")
        if m.get("role") not in CHAT_ROLES or not isinstance(content, str):
            raise ValueError(f"play(prompt=...): message {str(m)[:200]} needs a 'role' in {list(CHAT_ROLES)} and a "
                             f"'content' (a string), as train() requires of every dataset row's messages.")


def _check_reset(environment, factory) -> None:
    """What the environment factory made has reset() (make_agent's check, for the scripted episode, which does not
    go through make_agent): each episode starts with it."""
    if callable(getattr(type(environment), "reset", None)):
        return
    made = type(environment).__name__
    shown = getattr(factory, "__name__", None) or type(factory).__name__
    raise ValueError(f"play(environment={shown}): the environment it made, {made} {environment!r:.60}, has no reset() "
                     f"method. Each episode starts with env.reset(**row) (returning None, or a string appended to the "
                     f"prompt): pass a class (or a function returning a new instance) whose objects have one, e.g. "
                     f"def reset(self, **row): return None.")


def _scripted(messages, tools, factory, row, script, tokenizer, config, started) -> Episode:
    """The episode of the given assistant turns: each turn's calls run, their results appended, as training
    would (where the chat template takes one call per turn, only the first); no tokens, no budget."""
    standalone_tools = as_tools(tools or [], "tools")
    standalone = {t.name: t for t in standalone_tools}
    environment = None
    if factory is not None:
        environment = build_environment(factory, "environment")
        _check_reset(environment, factory)
        methods = environment_tools(environment, "environment")
        check_no_clash(standalone_tools, methods, type(environment).__name__)
        messages = with_observation(messages, reset_environment(environment, {**row, "prompt": messages}, False, 0))
        standalone.update({t.name: t for t in methods})
    # the template training renders with (make_agent's): its call format, and whether it takes several calls a turn
    template = tools_template(tokenizer) if tokenizer is not None else None
    fmt = (tool_format(tokenizer, template) if tokenizer is not None else None) or ToolFormat("hermes")
    several = tokenizer is None or takes_several_calls(tokenizer, template)
    turns, notes, rounds = [], [], 0
    for k, text in enumerate(script):
        content, calls = fmt.parse(text, standalone)
        turns.append(assistant_message(content, calls))
        if not calls:
            if k < len(script) - 1:
                notes.append(f"turn {k + 1} called no tool, so the episode ended there; {len(script) - k - 1} "
                             f"scripted turn(s) after it were not used")
            break
        if config.max_tool_calling_iterations is not None and rounds >= config.max_tool_calling_iterations:
            notes.append(f"max_tool_calling_iterations={config.max_tool_calling_iterations} reached")
            break
        for i, call in enumerate(calls):
            # as run_episodes: where the template takes one call per turn (Llama 3.1's), the others are not run
            content = one_call_per_turn_error(call) if i and not several else \
                run_call(standalone, call, config.tool_timeout)[0]
            turns.append({"role": "tool", "name": call.get("name") or "unknown", "content": content})
        rounds += 1
    return Episode(messages, turns, environment, time.perf_counter() - started, notes)
