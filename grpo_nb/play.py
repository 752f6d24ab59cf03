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
import inspect
import time
from dataclasses import dataclass, field

from .config import GRPOConfig
from .display import traces
from .episodes import episode_text, make_agent, reset_environment, run_episodes
from .tools import ToolFormat, as_tools, call_tool, error_content, tool_format


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
    `max_completion_length` tokens over all turns and tool results, as in training."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    factory = environment if environment is None or isinstance(environment, type) or not hasattr(
        environment, "reset") else (lambda: environment)
    config = GRPOConfig(max_completion_length=max_completion_length, temperature=temperature,
                        max_tool_calling_iterations=max_tool_calling_iterations, tool_timeout=tool_timeout)
    started = time.perf_counter()
    if script is not None:
        return _scripted(messages, tools, factory, dict(row or {}), list(script), tokenizer, config, started)
    if model is None or tokenizer is None:
        raise ValueError("play() needs a model and its tokenizer to write the turns, or script=[...] with the "
                         "assistant's turns as texts to try the tools / environment without a model.")
    agent = make_agent(tools, factory, tokenizer, config)
    if agent is None:
        raise ValueError("play() needs tools=[...] or environment=... : an episode is turns that call them.")
    from .attachments import model_context
    from .rollout import RolloutEngine, eos_token_ids
    from .scoring import embedding_rows, input_device

    engine = RolloutEngine(max_completion_length=max_completion_length, greedy=greedy, temperature=temperature)
    was_training = model.training
    model.eval()
    try:
        episodes = run_episodes(model, tokenizer, [{**(row or {}), "prompt": messages}], engine, 1, agent,
                                max_prompt_length=None, max_completion_length=max_completion_length,
                                context=model_context(model), device=input_device(model),
                                eos_ids=eos_token_ids(model, tokenizer), vocab_size=embedding_rows(model),
                                engine=True)
    finally:
        model.train(was_training)
    notes = ["stopped at max_completion_length"] if bool(episodes.batch.truncated[0]) else []
    return Episode(episodes.prompts[0], episodes.completions[0],
                   episodes.environments[0] if episodes.environments else None, time.perf_counter() - started, notes)


def _scripted(messages, tools, factory, row, script, tokenizer, config, started) -> Episode:
    """The episode of the given assistant turns: each turn's calls run, their results appended, as training
    would; no tokens, no budget."""
    standalone = {t.name: t for t in as_tools(tools or [], "tools")}
    environment = None
    if factory is not None:
        environment = factory()
        observation = reset_environment(environment, {**row, "prompt": messages}, False, 0)
        if observation:
            messages = [*messages[:-1], {**messages[-1], "content": (messages[-1].get("content") or "") + observation}]
        methods = [getattr(environment, n) for n, _ in inspect.getmembers(type(environment), inspect.isfunction)
                   if not n.startswith("_") and n not in ("reset", "get_reward")]
        standalone.update({t.name: t for t in as_tools(methods, f"{type(environment).__name__}'s methods")})
    fmt = (tool_format(tokenizer) if tokenizer is not None else None) or ToolFormat("hermes")
    turns, notes, rounds = [], [], 0
    for k, text in enumerate(script):
        content, calls = fmt.parse(text)
        message = {"role": "assistant", "content": content}
        good = [c for c in calls if "error" not in c]
        if good:
            message["tool_calls"] = [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                                     for c in good]
        turns.append(message)
        if not calls:
            if k < len(script) - 1:
                notes.append(f"turn {k + 1} called no tool, so the episode ended there; {len(script) - k - 1} "
                             f"scripted turn(s) after it were not used")
            break
        if config.max_tool_calling_iterations is not None and rounds >= config.max_tool_calling_iterations:
            notes.append(f"max_tool_calling_iterations={config.max_tool_calling_iterations} reached")
            break
        for call in calls:
            content, _ = (error_content(call["error"]), True) if "error" in call else \
                call_tool(standalone, call["name"], call["arguments"], config.tool_timeout)
            turns.append({"role": "tool", "name": call.get("name") or "unknown", "content": content})
        rounds += 1
    return Episode(messages, turns, environment, time.perf_counter() - started, notes)
