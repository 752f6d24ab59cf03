"""Episodes: rollouts in which the model calls tools, or acts in an environment, turn after turn.

TRL 1.16's contract: `train(..., tools=[f, ...])` and `train(..., environment_factory=Env)` (or a dict of them,
chosen by each row's `environment` column). An episode: the model's turn is sampled; the tool calls it wrote
are run (tools.call_tool) and their results appended in the chat template's format; the model goes on from
there, until a turn calls nothing, `max_tool_calling_iterations` rounds have run, or the episode's tokens reach
`max_completion_length` (it covers every turn and every result; a result that would not fit is left out and the
episode ends with the turn that asked for it, as TRL does).

The tokens a tool or an environment wrote are part of the completion the model reads, and of none it is trained
on: `RolloutBatch.env_mask` is 0 over them, and the loss, lengths and the rollout correction see sampled tokens
only. Each continuation goes through the same rollout engine as the first turn, with the conversation so far
as its prompt.

Untrusted text stays text: a tool's result is tokenized with its special tokens split (a page holding
"<|im_end|>" cannot end a turn), and lone surrogates (in results, reset() observations, calls the model wrote)
become U+FFFD. A tool still running at `tool_timeout` cannot be stopped; when it is an environment's method the
instance is not reused (later episodes get a new one), and a warning says that episode's reward may count the
late change. Environments are built once per pool slot and each episode of a batch needs its own instance.
A run's tools and environments are recorded in its checkpoints (resume.run_identity): a resume without them, or
with others, warns (a pending generation batch is still trained on: its tools' tokens are already masked).

    Agent            what train() sets up once: the tools, the environments' pools, the call format
    run_episodes()   one generation batch of episodes -> Episodes
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import time
from contextlib import contextmanager
import warnings
from dataclasses import dataclass, field

import jinja2
import torch

from .rewards import accepted_keywords
from .rollout.batch import (RolloutBatch, WithTemplateKwargs, check_rollout_batch, encode_prompts, left_padded,
                            prompt_token_ids)
from .rollout.engine import RolloutEngine
from .tools import (Tool, ToolFormat, absent_sentinel, as_tools, call_tool, changed_span, encodable, encode_suffix,
                    error_content, in_own_loop, one_call_per_turn_error, supports_tools, takes_several_calls,
                    tool_chat_template, tool_format, tool_suffix)


@dataclass
class Agent:
    """The tools and environments of a run, and how its model writes a call."""
    tools: list[Tool]  # the standalone tools, offered in every episode
    format: ToolFormat
    max_iterations: int | None = None  # tool-calling rounds per episode; None: until the token budget ends it
    timeout: float | None = None  # seconds one tool call may take
    factories: dict | None = None  # {environment name (None: the only one): factory}
    env_schemas: dict = field(default_factory=dict)  # {name: [Tool]} each environment's methods, from a probe
    pools: dict = field(default_factory=dict)  # {name: [instances]}: built once, reset for each episode
    rewarded: list = field(default_factory=list)  # environment classes that score episodes (get_reward)
    # grpo-nb's tool template where the tokenizer's cannot render tools (tools.tool_chat_template), else None:
    # episodes render with it; train() sets it on the tokenizer once its inputs are checked (use_template)
    template: str | None = None
    # False where the chat template refuses a turn with several calls (Llama 3.1 / 3.2's raise "only supports
    # single tool-calls at once"): a turn's first call runs, the others get an error saying so (run_episodes)
    several_calls: bool = True
    warned: set = field(default_factory=set)  # what was said once

    def use_template(self, tokenizer) -> None:
        """Give `tokenizer` the template the episodes render with, said once: the adapter is saved with it."""
        current = tokenizer.chat_template
        if self.template is None or current == self.template or (
                isinstance(current, dict) and current.get("tool_use") == self.template):
            return
        named = isinstance(current, dict) and bool(current)  # {} is no template: a plain string replaces it
        if named and "tool_use" in current:
            what = "tokenizer.chat_template['tool_use'] (the template transformers renders with when tools are given)"
        else:
            what = f"The tokenizer's chat template ({type(tokenizer).__name__})"
        if named and self.template == current.get("default"):
            instead = ("so grpo-nb sets 'tool_use' to the 'default' template, which does (the prompts and the "
                       "tools' results are rendered with it)")
        else:
            instead = ("so grpo-nb sets its own training template (grpo_nb.tool_chat_template: tools in the system "
                       "turn, calls as <tool_call>{...}</tool_call>)")
        warnings.warn(f"{what} cannot render tool calls and their results, {instead}. The adapter is saved with "
                      f"this tokenizer, so inference offers tools as training did; this tokenizer object keeps it "
                      f"too (keep a copy of tokenizer.chat_template to put the old one back).", stacklevel=3)
        # named templates keep theirs: the tools' becomes the one transformers picks when tools are given
        tokenizer.chat_template = {**current, "tool_use": self.template} if named else self.template

    def identity(self) -> dict:
        """What a checkpoint records of them (resume.run_identity): the tools' names, the environments' classes."""
        env_tools = sorted(t.name for tools in self.env_schemas.values() for t in tools)
        every = [*self.tools, *(t for tools in self.env_schemas.values() for t in tools)]
        # what the model is shown of each (arguments, descriptions): a digest, so a tool of the same name that now
        # takes other arguments is told apart on resume
        schemas = {t.name: hashlib.sha256(json.dumps(t.schema, sort_keys=True, default=repr).encode()).hexdigest()[:16]
                   for t in every}
        return {"tools": sorted(t.name for t in self.tools) + env_tools, "schemas": dict(sorted(schemas.items())),
                "environments": [type(pool[0]).__name__ if name is None else f"{name}: {type(pool[0]).__name__}"
                                 for name, pool in self.pools.items() if pool]}

    @property
    def multi(self) -> bool:
        return self.factories is not None and list(self.factories) != [None]

    def environments(self, rows: list[dict]) -> list | None:
        """One instance per episode (per completion), from the pools: an instance serves one episode of a batch."""
        if self.factories is None:
            return None
        names = [self.environment_name(row, i) for i, row in enumerate(rows)]
        handed, out = {}, []
        for name in names:
            pool = self.pools.setdefault(name, [])
            k = handed.get(name, 0)
            if k == len(pool):
                made = self.factories[name]()
                if any(made is e for p in self.pools.values() for e in p):
                    where = "environment_factory" + ("" if name is None else f"[{name!r}]")
                    raise ValueError(
                        f"{where} returned the same {type(made).__name__} instance for two episodes (e.g. "
                        f"environment_factory=lambda: env): the episodes of a batch run side by side, so they would "
                        f"all act on one state, and get_reward() and the reward functions would read its end state "
                        f"for every episode. Each episode needs its own: pass the class "
                        f"(environment_factory={type(made).__name__}) or a function that builds a new one "
                        f"(lambda: {type(made).__name__}(...)).")
                pool.append(made)
            handed[name] = k + 1
            out.append(pool[k])
        return out

    def retire(self, environment) -> None:
        """Take `environment` out of its pool (a method of it timed out and may still be changing it): later
        episodes get a new instance."""
        for pool in self.pools.values():
            for k, e in enumerate(pool):
                if e is environment:
                    del pool[k]
                    return

    def environment_name(self, row: dict, index: int):
        """The factory `row` names; `index`: its place in this batch (train() checked every dataset row's first,
        check_environment_column, so a row is refused here only in a call that did not)."""
        if not self.multi:
            return None
        name = row.get("environment")
        if not self.names_factory(name):
            raise ValueError(f"Row {index} of this batch (prompt {str(row.get('prompt'))!r:.80}): environment={name!r} "
                             f"is not one of the environments passed as environment_factory "
                             f"({', '.join(map(repr, self.factories))}): every row needs an 'environment' column "
                             f"naming one.")
        return name

    def names_factory(self, name) -> bool:
        try:
            return name in self.factories
        except TypeError:  # an unhashable value (a list): not a name
            return False

    def tools_of(self, environment, name) -> dict[str, Tool]:
        """The tools an episode offers: the standalone ones and its environment's methods (bound to it)."""
        tools = {t.name: t for t in self.tools}
        for t in self.env_schemas.get(name, []) if environment is not None else []:
            tools[t.name] = Tool(t.name, getattr(environment, t.name), t.schema)
        return tools


def make_agent(tools, environment_factory, tokenizer, config) -> Agent | None:
    """The Agent of `train(tools=..., environment_factory=...)`, checked; None when neither is given. A
    tokenizer whose chat template cannot render a tool exchange gets grpo-nb's (`tools.tool_chat_template`) as
    `agent.template`: the episodes render with it, and train() sets it on the tokenizer once its inputs are
    checked (Agent.use_template, said once: the adapter's saved tokenizer keeps it). The tokenizer is not
    changed here, unless it has no chat template at all (then it gets grpo-nb's now, as train()'s checks of
    chat prompts need one)."""
    if not tools and environment_factory is None:
        return None
    standalone = as_tools(tools or [], "tools")
    factories = None
    if environment_factory is not None:
        factories = dict(environment_factory) if isinstance(environment_factory, dict) else {None: environment_factory}
        if not factories:
            raise ValueError("environment_factory={} names no environment: pass a class (environment_factory=MyEnv), "
                             "or a dict of them chosen by each row's 'environment' column ({'a': EnvA, 'b': EnvB}).")
    agent = Agent(standalone, ToolFormat("hermes"), config.max_tool_calling_iterations, config.tool_timeout, factories)
    for name, factory in (factories or {}).items():
        where = "environment_factory" + ("" if name is None else f"[{name!r}]")
        probe = build_environment(factory, where)
        reset = getattr(type(probe), "reset", None)
        if not callable(reset):
            raise ValueError(f"{where}: the environment {type(probe).__name__} has no reset() method. Each episode "
                             f"starts with env.reset(**row) (returning None, or a string appended to the prompt).")
        agent.env_schemas[name] = environment_tools(probe, where)
        check_no_clash(standalone, agent.env_schemas[name], type(probe).__name__)
        agent.pools[name] = [probe]
        if check_get_reward(probe, where) and type(probe) not in agent.rewarded:
            agent.rewarded.append(type(probe))
    if not (agent.tools or any(agent.env_schemas.values())):
        raise ValueError("tools=[] and the environments have no public methods: the model would have nothing to call. "
                         "Pass tools=[my_function], or give the environment methods (each one a tool).")
    agent.template = tools_template(tokenizer)
    if agent.template is not None and not getattr(tokenizer, "chat_template", None):
        agent.use_template(tokenizer)  # none at all: chat prompts need one to be checked
    found = tool_format(tokenizer, agent.template)
    if found is None:
        raise ValueError("The tokenizer's chat template writes tool calls in a format grpo-nb does not read (it reads "
                         "<tool_call>{...}</tool_call>, as Qwen2.5/Qwen3/Hermes, and a turn that is one JSON call, as "
                         "Llama 3.1-3.3). Set tokenizer.chat_template = grpo_nb.tool_chat_template(tokenizer).")
    agent.format = found
    agent.several_calls = takes_several_calls(tokenizer, agent.template)
    return agent


def check_environment_column(agent: Agent | None, dataset) -> None:
    """A dict environment_factory picks each row's environment by its 'environment' column: every row's value is
    read now, before the first step (a column read), and a value that names no factory is refused naming its
    dataset row - not when the sampler first draws that row, steps and checkpoints later."""
    if agent is None or not agent.multi:
        return
    if hasattr(dataset, "column_names"):  # a datasets.Dataset: the column at once
        column = "environment" in dataset.column_names
        values = list(dataset["environment"]) if column else [None] * len(dataset)
    else:  # a list of dicts
        values = [row.get("environment") if isinstance(row, dict) else None for row in dataset]
        column = any(isinstance(row, dict) and "environment" in row for row in dataset)
    bad = [i for i, value in enumerate(values) if not agent.names_factory(value)]
    if not bad:
        return
    value = values[bad[0]]
    more = f" ({len(bad)} rows in all: {', '.join(map(str, bad[:8]))}{', ...' if len(bad) > 8 else ''})" \
        if len(bad) > 1 and column else ""
    missing = "" if column else " (the dataset has no 'environment' column)"
    if column and not isinstance(value, str) and agent.names_factory(str(value)):
        missing = f" (the {type(value).__name__} {value!r}, where the dict's names are strings: {str(value)!r} is one)"
    raise ValueError(f"Dataset row {bad[0]}: environment={value!r} is not one of the environments passed as "
                     f"environment_factory ({', '.join(map(repr, agent.factories))}){more}{missing}: every row needs "
                     f"an 'environment' column naming one. Fix the rows' values (a typo, another case), or add the "
                     f"missing environment to the dict.")


def tools_template(tokenizer) -> str | None:
    """The chat template episodes with tools render with (prompts and tools' results alike), where it is not the
    tokenizer's own: None when the tokenizer's renders tools (as transformers picks it: a named "tool_use" when
    tools are given, else the template), else the one to use - grpo-nb's (tools.tool_chat_template), or for named
    templates whose "tool_use" cannot render tools, "default" where that one can. The tokenizer is not changed."""
    named = getattr(tokenizer, "chat_template", None)
    if isinstance(named, dict) and named:
        check_named_templates(named)
    if isinstance(named, dict) and "tool_use" in named:
        # named templates (Hermes, Command-R): transformers renders with "tool_use" when tools are given - the
        # prompts, and so the tools' results too (one template for both). One that cannot render tools is replaced
        # (Agent.use_template, said once)
        if supports_tools(tokenizer, named["tool_use"]):
            return named["tool_use"]
        return named["default"] if supports_tools(tokenizer, named["default"]) else tool_chat_template(tokenizer)
    return None if supports_tools(tokenizer) else tool_chat_template(tokenizer)


def check_named_templates(named: dict) -> None:
    """Named chat templates (tokenizer.chat_template a dict, as Hermes / Command-R ship): each a Jinja string, and a
    "default" among them - transformers renders with "default" when no tools are given (train()'s checks of the
    prompts) and refuses a dict without it; a value that is not a string fails deep in Jinja ("Can't compile non
    template nodes") at the first rendering. A key that is not a string is saved as one (1 reloads as '1'), and a
    template that is not valid Jinja is shipped with the adapter, failing whoever renders with it: both refused."""
    for key in named:
        if not isinstance(key, str):
            raise TypeError(f"tokenizer.chat_template has the key {key!r} ({type(key).__name__}): named chat "
                            f"templates are named by strings ('default', 'tool_use', 'rag'), and a saved tokenizer "
                            f"reloads it as {str(key)!r}, so the reloaded tokenizer differs from the one trained "
                            f"with. Name it by a string: tokenizer.chat_template[{str(key)!r}] = "
                            f"tokenizer.chat_template.pop({key!r}).")
    for key, value in named.items():
        if not isinstance(value, str):
            raise TypeError(f"tokenizer.chat_template[{key!r}] is {value!r:.60} ({type(value).__name__}), not a "
                            f"template: each of the named chat templates is a Jinja string. Set it to one "
                            f"(tokenizer.chat_template[{key!r}] = '...'), or remove it "
                            f"(del tokenizer.chat_template[{key!r}]).")
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template as compile_template
    except ImportError:  # another transformers: its first rendering says
        compile_template = None
    for key, value in named.items():
        try:
            if compile_template is not None:
                compile_template(value)
        except jinja2.TemplateSyntaxError as err:
            raise ValueError(f"tokenizer.chat_template[{key!r}] is not valid Jinja (line {err.lineno}: {err}): the "
                             f"tokenizer saved with the adapter would fail whoever renders with it"
                             f"{' (transformers picks it when tools are given)' if key == 'tool_use' else ''}. Fix it, "
                             f"or remove it (del tokenizer.chat_template[{key!r}]).") from None
    if "default" not in named:
        first = next(iter(named))
        raise ValueError(f"tokenizer.chat_template holds named templates ({', '.join(map(repr, named))}) but no "
                         f"'default': transformers renders with 'default' when no tools are given (the prompts' "
                         f"checks, a chat without tools) and refuses a dict without it. Add one: "
                         f"tokenizer.chat_template['default'] = tokenizer.chat_template[{first!r}], or set one "
                         f"template string (tokenizer.chat_template = tokenizer.chat_template[{first!r}]).")


def build_environment(factory, where: str = "environment_factory", passed: str = "environment_factory={}"):
    """`factory()`, refused with the fix when it is not callable or needs arguments (grpo-nb calls it with none).
    `passed`: how the fix passes the bound factory, {} in its place ("openenv_environment({})" for that one)."""
    if not callable(factory):
        raise TypeError(f"{where}={factory!r:.80} is not a class or function that makes an environment: pass the "
                        f"class itself (environment_factory=MyEnv), which grpo-nb calls once per episode.")
    try:
        inspect.signature(factory).bind()
    except TypeError as err:
        shown = getattr(factory, "__name__", None) or type(factory).__name__
        raise TypeError(f"{where}={shown} is called with no arguments to make each episode's environment, but it "
                        f"needs some ({err}). Bind them: {passed.format(f'functools.partial({shown}, size=5)')} or "
                        f"{passed.format(f'lambda: {shown}(size=5)')} (each call must build a new instance); "
                        f"per-row settings go to its reset(**row).") from None
    except ValueError:  # no signature to read (a builtin): let the call say
        pass
    return factory()


def environment_tools(environment, where: str = "environment_factory") -> list[Tool]:
    """The environment's public methods as tools (bound to it): plain, static and class methods, not reset() and
    get_reward()."""
    cls = type(environment)
    names = [n for n in dir(cls) if not n.startswith("_") and n not in ("reset", "get_reward")
             and (inspect.isfunction(raw := inspect.getattr_static(cls, n)) or isinstance(raw, (staticmethod,
                                                                                                 classmethod)))]
    return as_tools([getattr(environment, n) for n in names], f"{where} ({cls.__name__}'s methods)")


def check_no_clash(tools: list[Tool], methods: list[Tool], cls_name: str) -> None:
    """A standalone tool and an environment method with one name: the model calls by name, so one would hide the
    other (the environment's won, silently)."""
    if both := sorted({t.name for t in tools} & {m.name for m in methods}):
        raise ValueError(f"tools=[...] and the environment {cls_name}'s methods both have a tool named {both[0]!r}: "
                         f"the model calls a tool by its name, so one would silently replace the other. Rename one "
                         f"(or drop the standalone tool if the method does its work).")


def check_get_reward(environment, where: str) -> bool:
    """Whether the environment scores its episodes with get_reward(), which is called with no arguments after
    each episode (TRL's); refused with the fix when it cannot be."""
    cls = type(environment)
    raw = inspect.getattr_static(cls, "get_reward", None)
    if raw is None:
        return False
    if isinstance(raw, property) or not callable(getattr(cls, "get_reward", None)):
        raise TypeError(f"{where}: {cls.__name__}.get_reward is not a method (a property or a value): grpo-nb, as "
                        f"TRL, calls env.get_reward() with no arguments after each episode. Make it "
                        f"def get_reward(self) -> float.")
    try:
        inspect.signature(environment.get_reward).bind()
    except TypeError as err:
        raise TypeError(f"{where}: {cls.__name__}.get_reward() is called with no arguments after each episode (as "
                        f"TRL does), but it needs some ({err}). Read what it scores from the environment's own state "
                        f"(self), set by reset() and the methods the model called; a reward function that needs the "
                        f"completion takes `completions` and `environments` instead.") from None
    except ValueError:
        pass
    return True


def env_reward_funcs(agent: Agent | None) -> list:
    """A reward function per environment class with get_reward(), named after the class (TRL's): an episode is
    scored by its own environment's get_reward() when it is of that class, else None (not scored by it)."""
    funcs = []
    for cls in agent.rewarded if agent is not None else []:
        def env_reward(environments=None, _cls=cls, **_):
            return [_awaited_value(e.get_reward()) if type(e) is _cls else None for e in environments]

        env_reward.__name__ = cls.__name__
        funcs.append(env_reward)
    return funcs


def _own_copy(value):
    """A deep copy of a row's value, or the value itself where it cannot be copied (a client, a lock, a file in a
    list dataset's row): that object is shared by the episodes, as it was given."""
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001  (TypeError: cannot pickle '_thread.lock', and whatever __deepcopy__ raises)
        return value


def reset_environment(environment, row: dict, multi: bool, index: int):
    """env.reset(**row) (without the routing `environment` column), or with the keywords its reset names when it
    takes no **kwargs; a returned string is appended to the prompt's last message."""
    reset = environment.reset
    kwargs = accepted_keywords(reset, {k: v for k, v in row.items() if not (multi and k == "environment")})
    # each episode's own copy (as tool arguments are): a reset() that edits the prompt in place would otherwise
    # edit the one row all the group's episodes (and, for a list dataset, later epochs) are prompted from
    kwargs = {k: _own_copy(v) for k, v in kwargs.items()}
    try:
        observation = _awaited_value(reset(**kwargs))
    except Exception as err:
        raise RuntimeError(f"{type(environment).__name__}.reset() failed for dataset row {index}: "
                           f"{type(err).__name__}: {err}. It is called with the row's columns as keywords "
                           f"({', '.join(kwargs) or 'none it names'}).") from err
    if observation is not None and not isinstance(observation, str):
        raise TypeError(f"{type(environment).__name__}.reset() returned {type(observation).__name__} "
                        f"{observation!r:.80}: it must return None, or a string that is appended to the prompt.")
    return None if observation is None else encodable(observation)


def with_observation(messages: list, observation: str | None) -> list:
    """The prompt's messages with what reset() returned appended to the last one (TRL's), the row left as it was."""
    if not observation:
        return messages
    last = messages[-1]
    return [*messages[:-1], {**last, "content": (last.get("content") or "") + observation}]


def assistant_message(content: str, calls: list[dict]) -> dict:
    """A turn as reward functions and chat templates read it: its text, and the calls that could be read."""
    message = {"role": "assistant", "content": content}
    if good := [c for c in calls if "error" not in c]:
        message["tool_calls"] = [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for c in good]
    return message


def run_call(tools: dict, call: dict, timeout, late: list | None = None) -> tuple[str, bool]:
    """One call a turn made, as (the tool message's content, whether it failed): one that could not be read tells
    the model why (ToolFormat.parse's error), any other runs (tools.call_tool)."""
    if "error" in call:
        return error_content(call["error"]), True
    return call_tool(tools, call["name"], call["arguments"], timeout, late)


def _awaited_value(value):
    """An async reset() / get_reward()'s value, awaited as async tools are (in a thread's own event loop: a
    notebook cell runs in one, where asyncio.run() is refused)."""
    return in_own_loop(value) if inspect.isawaitable(value) else value


# --------------------------------------------------------------------------------------
# The episodes of one generation batch


_OBSERVATION = "observation_q7x"  # letters only: no special token's text can be taken for it (changed_span)


def _encode_with_observations(tokenizer, prompts, texts, observations, max_prompt_length, device, render):
    """encode_prompts(), where what reset() returned is text only, as a tool's result is (encode_suffix): an
    observation (a web page, a file) holding "<|im_end|>" stays those characters, not a marker that ends the
    user's turn and forges an assistant turn in the prompt. The template's own markers stay special tokens.
    The observation's rendering is found by rendering the prompt with a sentinel in its place (`render(i,
    observation)`: row i's text with that observation), not by searching for its text: an observation may equal
    the template's own text after it (the end of the turn and the generation prompt), or be escaped or trimmed."""
    markers = [t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.content]
    marked = [i for i, o in enumerate(observations) if o and any(m in o for m in markers)]
    if not marked:
        return encode_prompts(tokenizer, prompts, max_prompt_length, device, texts)
    encode = lambda text, **kw: tokenizer(text, add_special_tokens=False, **kw)["input_ids"]  # noqa: E731
    rows = prompt_token_ids(tokenizer, prompts, texts)
    for i in marked:
        text = texts[i]
        sentinel = absent_sentinel(_OBSERVATION, text, observations[i])  # one the observation cannot hold
        start, end = changed_span(text, render(i, sentinel), sentinel)
        rows[i] = encode(text[:start]) + encode(text[start:end], split_special_tokens=True) + encode(text[end:])
    ids, mask, cut = left_padded(rows, tokenizer, max_prompt_length)
    return ids.to(device), mask.to(device), cut


@dataclass
class Episodes:
    batch: RolloutBatch  # the whole episodes as completions, env_mask 0 over what tools wrote
    prompts: list  # per episode: the chat messages it started from (after reset)
    completions: list[list[dict]]  # per episode: its messages (assistant turns with tool_calls, tool results)
    texts: list[str]  # per episode: its turns as one readable text
    environments: list | None
    calls_per_episode: list = field(default_factory=list)
    turns: list = field(default_factory=list)  # assistant turns per episode
    tool_seconds: list = field(default_factory=list)  # per call: seconds it took
    failed: list = field(default_factory=list)  # per call: 1 if the model was sent an error
    prompts_cut: int = 0

    def metrics(self) -> dict[str, list[float]]:
        """Per-step values, averaged into the record's "metrics" (over ranks too): TRL's tools/call_frequency
        (calls per episode) and tools/failure_frequency (failed calls per call), turns per episode, seconds
        per call."""
        out = {"tools/call_frequency": [float(c) for c in self.calls_per_episode],
               "tools/turns": [float(t) for t in self.turns]}
        if self.failed:
            out["tools/failure_frequency"] = [float(f) for f in self.failed]
            out["tools/seconds"] = list(self.tool_seconds)
        return out


@dataclass
class _Episode:
    prompt: list  # token ids
    tools: dict
    ids: list = field(default_factory=list)
    sampled: list = field(default_factory=list)  # 1: the model's token, 0: a tool's / environment's
    logprobs: list | None = field(default_factory=list)
    messages: list = field(default_factory=list)
    turns: int = 0
    calls: int = 0
    pending: list = field(default_factory=list)  # the calls of its last turn, not yet run
    ended: bool = False  # the last turn ended with an EOS
    truncated: bool = False


@contextmanager
def _with_budget(rollout, tokens: int):
    """The engine's own max_completion_length lowered to what is left of the episodes' budget, where it has
    one (grpo-nb's engines); a user's rollout samples its own length and the turn is cut to the budget."""
    before = getattr(rollout, "max_completion_length", None)
    if isinstance(before, int):
        rollout.max_completion_length = max(1, min(before, tokens))
    try:
        yield
    finally:
        if isinstance(before, int):
            rollout.max_completion_length = before


def run_episodes(model, tokenizer, rows: list[dict], rollout, num_generations: int, agent: Agent, *,
                 max_prompt_length: int | None, max_completion_length: int, context: int | None, device,
                 eos_ids: list[int], vocab_size: int | None, engine: bool,
                 chat_template_kwargs: dict | None = None) -> Episodes:
    """`num_generations` episodes for each row's prompt; every turn rendered with `chat_template_kwargs` (GRPOConfig's,
    e.g. Qwen3's {"enable_thinking": False}: the generation prompt after each tool result as after the first)."""
    renderer = WithTemplateKwargs(tokenizer, chat_template_kwargs) if chat_template_kwargs else tokenizer
    G = num_generations
    repeated = [row for row in rows for _ in range(G)]
    environments = agent.environments(repeated)
    names = [agent.environment_name(row, i // G) for i, row in enumerate(repeated)]
    prompts, observations = [], []
    for i, row in enumerate(repeated):
        prompt = row["prompt"]
        if isinstance(prompt, str):
            raise ValueError("Tools and environments need chat prompts (lists of messages) so that the chat template "
                             "can offer the tools and render their results: make the prompt column "
                             "[{'role': 'user', 'content': ...}].")
        observation = None if environments is None else reset_environment(environments[i], row, agent.multi, i // G)
        prompts.append(with_observation(prompt, observation))
        observations.append(observation)
    episodes = [_Episode([], agent.tools_of(environments[i] if environments else None, names[i]))
                for i in range(len(repeated))]
    template = {} if agent.template is None else {"chat_template": agent.template}

    def render(i: int, observation=None) -> str:  # row i's prompt, with `observation` in place of reset()'s
        prompt = prompts[i] if observation is None else with_observation(repeated[i]["prompt"], observation)
        return renderer.apply_chat_template(prompt, tools=[t.schema for t in episodes[i].tools.values()] or None,
                                            tokenize=False, add_generation_prompt=True, **template)

    texts = [render(i) for i in range(len(prompts))]
    prompt_ids, prompt_mask, cut = _encode_with_observations(tokenizer, prompts, texts, observations,
                                                             max_prompt_length, device, render)
    if cut:
        _warn_tools_cut(renderer, agent, episodes[0].tools, max_prompt_length, template)
    for e, ids, mask in zip(episodes, prompt_ids.tolist(), prompt_mask.tolist()):
        e.prompt = [t for t, m in zip(ids, mask) if m]

    # grpo-nb's engine goes on from each episode's KV cache (only a result's tokens are prefilled); any other
    # rollout gets the conversation so far as a new prompt
    on_cache = isinstance(rollout, RolloutEngine) and (rollout.max_rows is None or len(episodes) <= rollout.max_rows)
    cache, cached_rows = None, []  # the engine's EpisodeCache, and the episode of each of its rows

    def sample(picked: list[int], ids: torch.Tensor, mask: torch.Tensor, per_prompt: int, budget: int):
        nonlocal cache, cached_rows
        with _with_budget(rollout, budget):
            if on_cache:
                out, cache = rollout.start_episodes(model, tokenizer, ids, mask, per_prompt)
                cached_rows = list(picked)
            else:
                out = rollout(model, tokenizer, ids, mask, per_prompt)
        check_rollout_batch(out, ids, mask, per_prompt, rollout, engine=engine, vocab_size=vocab_size,
                            eos_ids=eos_ids)
        for r, i in enumerate(picked):
            take_turn(episodes[i], out, r)

    def go_on(going: list[int], appended: list[list[int]], budget: int):
        nonlocal cached_rows
        if not on_cache:
            ids, mask, _ = left_padded([episodes[i].prompt + episodes[i].ids for i in going], tokenizer)
            return sample(going, ids.to(device), mask.to(device), 1, budget)
        where = {e: k for k, e in enumerate(cached_rows)}
        out = rollout.continue_episodes(model, tokenizer, cache, [where[i] for i in going], appended, budget)
        cached_rows = list(going)
        for r, i in enumerate(going):
            take_turn(episodes[i], out, r)

    def take_turn(e: _Episode, out: RolloutBatch, r: int):
        real = out.completion_mask[r].bool()
        left = max_completion_length - len(e.ids)
        turn = out.completion_ids[r][real].tolist()
        cut_short = len(turn) > left
        turn = turn[:left]
        e.ids += turn
        e.sampled += [1] * len(turn)
        if e.logprobs is not None and out.sampling_logprobs is not None:
            e.logprobs += out.sampling_logprobs[r][real][: len(turn)].float().tolist()
        else:
            e.logprobs = None
        e.turns += 1
        e.ended = bool(turn) and turn[-1] in eos_ids
        e.truncated = not e.ended and (cut_short or bool(out.truncated[r]) or len(e.ids) >= max_completion_length)
        body = turn[:-1] if e.ended else turn
        content, calls = agent.format.parse(tokenizer.decode(body, skip_special_tokens=False), e.tools)
        content = tokenizer.decode(tokenizer(content, add_special_tokens=False)["input_ids"], skip_special_tokens=True) \
            if content else content
        e.messages.append(assistant_message(content, calls))
        e.pending = calls

    try:
        # the first turn: a group shares its prompt (and the engine its prefill) unless resets made them differ
        same = all(episodes[k].prompt == episodes[k - k % G].prompt for k in range(len(episodes)))
        if same:
            sample(list(range(len(episodes))), prompt_ids[::G], prompt_mask[::G], G, max_completion_length)
        else:
            sample(list(range(len(episodes))), prompt_ids, prompt_mask, 1, max_completion_length)

        seconds, failed = [], []  # per call
        timed_out = []  # episodes whose environment's method outlived tool_timeout (it may still change it)
        rounds = 0
        eos_texts = [tokenizer.convert_ids_to_tokens(i) for i in eos_ids]
        while True:
            asking = [i for i, e in enumerate(episodes) if e.pending and e.ended]
            if not asking or (agent.max_iterations is not None and rounds >= agent.max_iterations):
                break
            going, appended = [], []
            for i in asking:
                e = episodes[i]
                calls, e.pending, results = e.pending, [], []
                for k, call in enumerate(calls):
                    e.calls += 1
                    if k and not agent.several_calls:  # the template cannot render the turn: not run, the model told
                        failed.append(1)
                        seconds.append(0.0)
                        results.append({"role": "tool", "name": call.get("name") or "unknown",
                                        "content": one_call_per_turn_error(call)})
                        continue
                    started, late = time.perf_counter(), []
                    content, fails = run_call(e.tools, call, agent.timeout, late)
                    if late and environments is not None and _method_of(e.tools[late[0]], environments[i]):
                        timed_out.append((i, late[0]))
                    seconds.append(time.perf_counter() - started)
                    failed.append(int(fails))
                    # longer than this cannot fit the budget: tokens are rarely longer than 32 characters
                    results.append({"role": "tool", "name": call.get("name") or "unknown",
                                    "content": content[: 32 * max_completion_length]})
                # the turn as the template renders it: its first call alone where it takes one per turn (only the
                # text after the turn is used; the model's own tokens stay as it wrote them)
                suffix, spans = tool_suffix(renderer, calls if agent.several_calls else calls[:1], results, eos_texts,
                                            template=agent.template)
                suffix_ids = encode_suffix(tokenizer, suffix, spans)
                room = max_completion_length - len(e.ids) - len(suffix_ids)
                if room < 1 or (context is not None and len(e.prompt) + len(e.ids) + len(suffix_ids) >= context):
                    continue  # the result does not fit: left out, the episode ends with the turn that asked for it
                e.ids += suffix_ids
                e.sampled += [0] * len(suffix_ids)
                if e.logprobs is not None:
                    e.logprobs += [0.0] * len(suffix_ids)
                e.messages += results
                going.append(i)
                appended.append(suffix_ids)
            rounds += 1
            if not going:
                break
            go_on(going, appended, max(max_completion_length - len(episodes[i].ids) for i in going))
    finally:
        if cache is not None:  # the engine's KV cache (a static one: and its CUDA graph) goes now
            cache.release()
    if timed_out:
        _retire_timed_out(agent, environments, timed_out)
    return _assemble(episodes, prompt_ids, prompt_mask, prompts, environments, tokenizer, seconds, failed, cut)


def _method_of(tool: Tool, environment) -> bool:
    return getattr(tool.function, "__self__", None) is environment or tool.function is getattr(
        type(environment), tool.name, None)


def _retire_timed_out(agent: Agent, environments: list, timed_out: list) -> None:
    """An environment whose method outlived tool_timeout is still being changed by it (Python cannot stop a
    thread): this episode's get_reward() may count a call the model was told failed, and a reused instance would
    carry the late change into another episode. It is not reused (a new one is built), and this is said once."""
    for i, _ in timed_out:
        agent.retire(environments[i])
    if "timeout" not in agent.warned:
        agent.warned.add("timeout")
        i, name = timed_out[0]
        warnings.warn(
            f"{type(environments[i]).__name__}.{name} did not return within tool_timeout={agent.timeout:g} s and "
            f"still runs in its thread (Python cannot stop it): the model was told the call failed, but the method "
            f"may still change the environment, so get_reward() and the reward functions of that episode may count "
            f"it. Such an instance is not reused: later episodes get a new one. {len(timed_out)} episode(s) of this "
            f"batch; said once. Raise tool_timeout, or make the method return in time.", UserWarning, stacklevel=2)


def _warn_tools_cut(tokenizer, agent: Agent, tools: dict, max_prompt_length, template: dict) -> None:
    """Prompts cut from the left lose their beginning, where chat templates put the tools' schemas and how to call
    them: the model can no longer call anything correctly. Said once, with what the tools' part takes."""
    if "tools cut" in agent.warned or not tools:
        return
    agent.warned.add("tools cut")
    probe = [{"role": "user", "content": "x"}]
    try:
        with_tools, without = (len(tokenizer(tokenizer.apply_chat_template(
            probe, tools=offered, tokenize=False, add_generation_prompt=True, **template),
            add_special_tokens=False)["input_ids"]) for offered in ([t.schema for t in tools.values()], None))
    except Exception:  # noqa: BLE001 - the measure is only for the message
        with_tools = without = 0
    warnings.warn(f"Prompts longer than max_prompt_length={max_prompt_length} were cut from the left, and with "
                  f"tools the left is where the chat template puts the tools' schemas and how to call them "
                  f"(about {with_tools - without} tokens here): the cut prompts lose them, so the model cannot call "
                  f"the tools correctly. Raise max_prompt_length (or None: what the context leaves), or shorten the "
                  f"prompts or the tools' docstrings.", UserWarning, stacklevel=2)


def _assemble(episodes, prompt_ids, prompt_mask, prompts, environments, tokenizer, seconds, failed,
              cut) -> Episodes:
    n, width = len(episodes), max(1, max(len(e.ids) for e in episodes))
    device = prompt_ids.device
    completion_ids = torch.full((n, width), tokenizer.pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros((n, width), dtype=torch.long)
    env_mask = torch.zeros((n, width), dtype=torch.long)
    keep_logprobs = all(e.logprobs is not None for e in episodes)
    logprobs = torch.zeros((n, width), dtype=torch.float32) if keep_logprobs else None
    for i, e in enumerate(episodes):
        k = len(e.ids)
        completion_ids[i, :k] = torch.tensor(e.ids, dtype=torch.long)
        completion_mask[i, :k] = 1
        env_mask[i, :k] = torch.tensor(e.sampled, dtype=torch.long)
        if logprobs is not None:
            logprobs[i, :k] = torch.tensor(e.logprobs, dtype=torch.float32)
    batch = RolloutBatch(prompt_ids, prompt_mask, completion_ids.to(device), completion_mask.to(device),
                         torch.tensor([e.truncated for e in episodes], device=device),
                         None if logprobs is None else logprobs.to(device), env_mask.to(device))
    return Episodes(batch, prompts, [e.messages for e in episodes], [episode_text(e.messages) for e in episodes],
                    environments, [e.calls for e in episodes], [e.turns for e in episodes], seconds, failed, cut)


def episode_text(messages: list[dict]) -> str:
    """An episode's turns as one text (the records' and the dashboard's): the assistant's words, each call as
    `[tool call] name({...})` and each result as `[tool name] result`, on their own lines."""
    import json

    lines = []
    for m in messages:
        if m["role"] == "assistant":
            if m.get("content"):
                lines.append(m["content"])
            for c in m.get("tool_calls", []):
                f = c["function"]
                lines.append(f"[tool call] {f['name']}({json.dumps(f['arguments'], ensure_ascii=False)})")
        else:
            lines.append(f"[{m.get('name', 'tool')}] {m['content']}")
    return "\n".join(lines)
