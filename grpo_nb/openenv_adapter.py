"""OpenEnv environments as `environment_factory`: `train(..., environment_factory=openenv_environment(MyEnv))`.

OpenEnv (github.com/huggingface/OpenEnv, `pip install openenv`) defines an environment as a server-side
`Environment` with `reset(seed=None, episode_id=None, **kwargs) -> Observation` and `step(action) ->
Observation`, the action and observation being pydantic models (`done`, `reward` and `metadata` on every
observation); an `MCPEnvironment` offers MCP tools instead, listed by `step(ListToolsAction())` and called by
`step(CallToolAction(tool_name, arguments))`. TRL's `environment_factory` contract is a class built fresh per
episode whose `reset(**row)` returns the observation text and whose other public methods are the model's tools.

`openenv_environment(env)` makes such a class around `env` (an Environment class, or any zero-argument callable
that returns an environment or a client with the same reset/step), run in-process:

* the tools: one per MCP tool of an `MCPEnvironment` (its name, description and JSON schema), else one for the
  environment's action (`step` by default, or `tool_name=`), whose parameters are the action model's fields;
* `reset(**row)` passes the environment the dataset columns its reset() names (all but the prompt when it takes
  **kwargs) and returns the first observation as text, which is appended to the prompt;
* each call builds the action, steps the environment, records the observation's reward and `done` (a call after
  `done` is an error the model sees; a reward that is no number or a `done` that is no bool / 0 / 1 is the
  environment's error, which get_reward() raises), and returns the observation as text: its one text field, or its
  fields (without done / reward / metadata) as JSON, or `observation_text(observation)`; an MCP tool's result: its
  text, non-text content (an image) as a one-line summary without its data, structured content as JSON;
* `get_reward()` is the episode's reward: the sum of the rewards the steps returned (`reward="last"`: the last
  one; or a function of the list), 0.0 for an episode that never acted;
* the environment itself is the episode's `.env` attribute, for reward functions (`environments=`): each episode
  its own (the environment built to read the tools is the first episode's; one that `env()` returns again while
  another episode holds it is refused, as `environment_factory=lambda: env` is);
* step() may return an Observation, a client's StepResult, a dict (the observation's fields with `reward` / `done`
  keys, or `{"observation", "reward", "done"}`) or a gym-style tuple; reset() an Observation, a StepResult, a dict
  or `(observation, info)`; anything else (bar a string or None) is refused with that contract.

Not covered: OpenEnv's HTTP/WebSocket clients to a server in a container work when their `reset()`/`step()` are
synchronous and return `StepResult`s (`observation`, `reward`, `done`), but have not been run here (no containers);
OpenEnv's "code mode" (`execute_code`) is not offered as a tool.
"""

from __future__ import annotations

import inspect
import json
import logging
import numbers
import threading
import typing
import warnings
import weakref
from contextlib import contextmanager

from .episodes import build_environment
from .rewards import accepted_keywords
from .tools import custom_classes

JSON_TYPES = {"string": str, "integer": int, "number": float, "boolean": bool, "array": list, "object": dict}
SKIPPED_FIELDS = ("metadata",)  # on every OpenEnv action and observation: not the model's to set or to read
OBSERVATION_BOOKKEEPING = ("done", "reward", "metadata")
OWN_NAMES = ("reset", "get_reward", "env")  # the episode class's own public names: no tool may take them
STEP_CONTRACT = ("an OpenEnv Observation (a pydantic model; its done and reward are read), a client's StepResult "
                 "(observation, reward, done), a dict (the observation's fields, with 'reward' and 'done' keys, or "
                 "{'observation': ..., 'reward': ..., 'done': ...}), a gym-style tuple (observation, reward, "
                 "terminated, truncated, info) or (observation, reward, done, info), a string or None")
RESET_CONTRACT = ("an OpenEnv Observation (a pydantic model), a client's StepResult, a dict of the observation's "
                  "fields, a gym-style (observation, info) tuple, a string or None")


def openenv_environment(env, *, tool_name: str | None = None, reward="sum", observation_text=None, name=None):
    """An `environment_factory` class that runs the OpenEnv environment `env` for each episode (see the module).

    env: an OpenEnv `Environment` subclass, or a zero-argument callable returning an environment (or a synchronous
        client with reset() / step()).
    tool_name: the name of the action's tool (non-MCP environments; default "step").
    reward: "sum" (default) or "last" of the step rewards, or a function of the list of rewards (floats).
    observation_text: a function observation -> str, where the default rendering does not suit.
    name: the class's name (what reward logs and get_reward's reward function are named after; default the
        environment's class name).
    """
    if not callable(env):
        raise TypeError(f"openenv_environment(env={env!r:.80}): pass the environment class (or a function with no "
                        f"arguments that returns an environment), which is called once per episode.")
    if not (reward in ("sum", "last") or callable(reward)):
        raise ValueError(f"openenv_environment(reward={reward!r}): expected 'sum', 'last' or a function of the "
                         f"list of step rewards that returns a float.")
    if observation_text is not None and not callable(observation_text):
        raise TypeError(f"openenv_environment(observation_text={observation_text!r:.80}): expected a function "
                        f"observation -> str.")
    if name is not None and not (isinstance(name, str) and name.strip()):
        raise TypeError(f"openenv_environment(name={name!r:.80}): expected a non-empty string (the episode class's "
                        f"name, which its reward log is shown under), or None for the environment's class name.")
    if tool_name is not None:
        _check_tool_name(tool_name, f"openenv_environment(tool_name={tool_name!r})", "pass another tool_name=, e.g. "
                         "tool_name='act' (or leave it out for 'step')")
    probe = _make(env)
    try:
        tools = _mcp_tools(probe) if _is_mcp(probe) else [_action_tool(probe, tool_name or "step")]
    except BaseException:
        _close(probe)
        raise
    shown = name or type(probe).__name__
    # The probe is not closed but handed to the first episode: a factory that returns one environment every time
    # (lambda: env) would otherwise give the episodes a closed one, and building a second costs a container or a
    # server for a client. Each later episode builds its own; one the factory returns while another live episode
    # (or the waiting probe) holds it is refused, as episodes.py refuses one instance shared by two episodes.
    spare = [probe]
    live = weakref.WeakSet()

    def __init__(self):
        if spare:
            made = spare.pop()
        else:
            made = _make(env)
            if any(other.env is made for other in list(live)):
                raise ValueError(
                    f"openenv_environment: the factory {getattr(env, '__name__', env)!s:.80} returned the same "
                    f"{type(made).__name__} instance for two episodes (e.g. openenv_environment(lambda: env)): the "
                    f"episodes of a batch run side by side, so they would all act on one state and read its end "
                    f"state's rewards. Each episode needs its own: pass the class "
                    f"(openenv_environment({type(made).__name__})) or a function that builds a new one "
                    f"(lambda: {type(made).__name__}(...)).")
        self.env = made
        self._rewards: list[float] = []
        self._done = False
        self._problem = None  # a step's reward or done that could not be read (_step): get_reward() refuses
        live.add(self)

    def reset(self, **row):
        self._rewards, self._done, self._problem = [], False, None
        return _text(_call_reset(self.env, row), observation_text)

    def get_reward(self) -> float:
        if self._problem is not None:
            raise ValueError(self._problem)
        if not self._rewards:
            return 0.0
        if reward == "sum":
            return float(sum(self._rewards))
        if reward == "last":
            return float(self._rewards[-1])
        value = reward(list(self._rewards))
        try:
            return float(value)
        except (TypeError, ValueError):  # a ValueError: the reward check's "completion_text" hint is not about this
            raise ValueError(f"openenv_environment(reward={getattr(reward, '__name__', reward)!s:.60}) returned "
                             f"{type(value).__name__} {value!r:.60} for the step rewards {self._rewards[:8]!r:.120}: "
                             f"the function gets the list of the episode's step rewards (floats) and must return "
                             f"one float, e.g. reward=max or reward=lambda rewards: rewards[-1].") from None

    def _step(self, action):
        if self._done:
            raise RuntimeError("the episode is over (the environment said done): answer without calling tools.")
        env_name = type(self.env).__name__
        try:
            observation, value, flags = _read_step(self.env.step(action), env_name)
        except TypeError as err:  # the model reads it as the tool's error: say it once where the user looks too
            if not type(self)._warned:
                type(self)._warned = True
                warnings.warn(str(err), stacklevel=2)
            raise
        # a reward or done that cannot be read is the environment's error, not the model's call's: the model is
        # shown the observation, and get_reward() refuses with the problem (STEP_RAN)
        value, bad_reward = _reward_value(value, env_name)
        self._done, bad_done = _done_value(flags, env_name)
        self._problem = self._problem or bad_reward or bad_done
        if value is not None:
            self._rewards.append(value)
        return observation

    attributes = {"__init__": __init__, "reset": reset, "get_reward": get_reward, "_step": _step, "_warned": False,
                  "_said": set(),  # the MCP tools whose non-text results were warned of (_mcp_result_text)
                  "__doc__": f"OpenEnv's {type(probe).__name__}, one episode (grpo_nb.openenv_adapter)."}
    for tool in tools:
        assert tool.__name__ not in attributes, tool.__name__  # _check_tool_name keeps tools off the internals
        attributes[tool.__name__] = tool
    cls = type(shown, (), attributes)
    cls._observation_text = staticmethod(observation_text) if observation_text else None
    return cls


def _make(env):
    # a class whose __init__ needs arguments: the fix environment_factory= gives, not a bare TypeError
    made = build_environment(env, "openenv_environment: env", "openenv_environment({})")
    if not (callable(getattr(made, "reset", None)) and callable(getattr(made, "step", None))):
        raise TypeError(f"openenv_environment: {getattr(env, '__name__', env)!s:.80}() returned "
                        f"{type(made).__name__}, which has no reset() and step(): pass an OpenEnv Environment class "
                        f"(or a function returning one).")
    return made


def _check_tool_name(tool_name, where: str, fix: str) -> None:
    """A tool is a public method of the episode class: a name that is empty, starts with "_" (hidden from the model,
    or replacing the class's own _step / __init__) or is one of its own names cannot be one."""
    if not isinstance(tool_name, str) or not tool_name.strip():
        raise ValueError(f"{where}: a tool needs a name the model can call it by, not {tool_name!r}: {fix}.")
    if tool_name.startswith("_"):
        raise ValueError(f"{where}: the tool name {tool_name!r} starts with '_': the episode class's tools are its "
                         f"public methods, so the model would not be offered it (and it could replace the class's "
                         f"own internals, such as _step or __init__): {fix}.")
    if tool_name in OWN_NAMES:
        raise ValueError(f"{where}: a tool named {tool_name!r}, which the episode class needs for itself "
                         f"(reset / get_reward / env): {fix}.")


def _read_step(out, env_name: str, method: str = "step", contract: str = STEP_CONTRACT):
    """(observation, reward, done flags) of what step() returned, as given (_reward_value and _done_value read the
    two); refused with `contract` when it is none of its kinds. The flags: gym's (terminated, truncated), else one."""
    if out is None or isinstance(out, str):
        return out, None, (False,)
    if isinstance(out, dict):
        if "observation" in out:  # a StepResult as a dict
            return out["observation"], out.get("reward"), (out.get("done", False),)
        return out, out.get("reward"), (out.get("done", False),)  # the observation's fields (_text drops the two)
    if isinstance(out, tuple) and len(out) in (4, 5) and method == "step":  # gym: (obs, reward, done[, trunc], info)
        return out[0], out[1], tuple(out[2:len(out) - 1])
    # by type, not by attribute names: an Observation may well have a field named `observation` (a board's text
    # next to its legal moves), and read as a StepResult it would show the model that field alone
    if _is_observation(out):  # an OpenEnv Observation
        return out, getattr(out, "reward", None), (getattr(out, "done", False),)
    if hasattr(out, "observation"):  # a client's StepResult (a dataclass), or another client's result of its kind
        return out.observation, getattr(out, "reward", None), (getattr(out, "done", False),)
    if hasattr(out, "model_dump"):  # another pydantic model: an observation of its own
        return out, getattr(out, "reward", None), (getattr(out, "done", False),)
    raise TypeError(f"{env_name}.{method}() returned {type(out).__name__} {out!r:.80}: openenv_environment reads "
                    f"{contract}.")


# What happens to a step whose reward or done cannot be read: the step itself ran (the environment acted on the
# model's call, and the model is shown its observation, as the call was fine); the episode's get_reward() then
# refuses, so the run stops at this step's scoring (a reward function's error), before anything is trained on it,
# rather than score the episode 0.0 or end it on a guess.
STEP_RAN = ("The step ran (the environment acted on the model's call, whose observation the model was shown): the "
            "episode is not scored on a guess, so the run stops before training on this batch.")


def _reward_value(value, env_name: str):
    """(the reward as a float or None, the problem or None): a number (int, float, a numpy number, Decimal) or None;
    text is refused, even "0.5" (a reward parsed from JSON or a form is meant to be converted where it is read)."""
    if value is None:
        return None, None
    if not isinstance(value, (str, bytes, bytearray)):
        try:
            return float(value), None
        except (TypeError, ValueError, OverflowError):
            pass
    return None, (f"{env_name}.step() returned the reward {value!r:.80} ({type(value).__name__}): openenv_environment "
                  f"reads a step's reward as a number (int, float, a numpy number) or None (no reward for that "
                  f"step), which get_reward() sums into the episode's reward. Return a number from step(), e.g. "
                  f"reward=float(score). {STEP_RAN}")


def _done_value(flags: tuple, env_name: str):
    """(whether the episode ended, the problem or None): each flag a bool, a numpy bool, 0 or 1, or None (not said:
    not done). Not bool(flag): the string "false" is truthy, and would end the episode at its first call."""
    ended = False
    for flag in flags:
        if getattr(flag, "ndim", None) == 0 and callable(getattr(flag, "item", None)):  # numpy / torch: one value
            flag = flag.item()
        if flag is None:
            continue
        if isinstance(flag, bool):
            ended = ended or flag
        elif isinstance(flag, numbers.Real) and flag in (0, 1):
            ended = ended or bool(flag == 1)
        else:
            return False, (f"{env_name}.step() returned done={flag!r:.80} ({type(flag).__name__}): openenv_environment "
                           f"reads done as True / False (a bool, a numpy bool, or 0 / 1); a string is not read as "
                           f"one (bool('false') is True: the episode would end at its first call). Return a bool "
                           f"from step(), e.g. done=(text == 'true'). {STEP_RAN}")
    return ended, None


def _is_observation(out) -> bool:
    try:
        from openenv.core.env_server.types import Observation
    except ImportError:
        return False
    return isinstance(out, Observation)


def _close(environment) -> None:
    close = getattr(environment, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # noqa: BLE001  (a probe's close: nothing of the run depends on it)
            pass


def _is_mcp(environment) -> bool:
    try:
        from openenv.core.env_server.mcp_environment import MCPEnvironment
    except ImportError:
        return False
    return isinstance(environment, MCPEnvironment)


def _call_reset(environment, row: dict):
    """reset() with the columns it names, or every column but the prompt when it takes **kwargs; its observation
    (refused with the contract when it is none of reset()'s kinds: it would be str()'d into the prompt)."""
    kwargs = accepted_keywords(environment.reset, row)
    if kwargs is row:  # it takes **kwargs (every column): all but the prompt, which it has no use for
        kwargs = {k: v for k, v in row.items() if k != "prompt"}
    out = environment.reset(**kwargs)
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):  # gym's (observation, info)
        return out[0]
    return _read_step(out, type(environment).__name__, "reset", RESET_CONTRACT)[0]  # step()'s kinds but its tuples


def _text(observation, observation_text=None) -> str | None:
    """An observation as the model reads it: its one text field, or its fields as JSON (see the module)."""
    if observation is None:
        return None
    if observation_text is not None:
        return str(observation_text(observation))
    if isinstance(observation, str):
        return observation
    if hasattr(observation, "model_dump"):
        fields = {k: v for k, v in observation.model_dump().items() if k not in OBSERVATION_BOOKKEEPING}
    elif isinstance(observation, dict):
        fields = {k: v for k, v in observation.items() if k not in OBSERVATION_BOOKKEEPING}
    else:
        return str(observation)
    if not fields:  # an observation of bookkeeping only (an MCP environment's reset): nothing to show
        return None
    if len(fields) == 1 and isinstance(next(iter(fields.values())), str):
        return next(iter(fields.values()))
    return json.dumps(fields, default=str, ensure_ascii=False)


def _docstring(description: str, params: dict[str, str]) -> str:
    """A Google-style docstring (what transformers' get_json_schema reads): one line per parameter."""
    def line(text):
        return " ".join(str(text or "").split())

    doc = line(description) or "Act in the environment."
    if params:
        doc += "\n\nArgs:\n" + "".join(f"    {k}: {line(v) or k}\n" for k, v in params.items())
    return doc


def _method(name: str, params: list[inspect.Parameter], doc: str, body):
    """A method `name(self, <params>) -> str` whose call is body(self, kwargs) (its signature and hints are what
    the tool's schema is read from)."""
    def method(receiver, /, **kwargs):  # positional-only: a parameter may be named "self"
        return body(receiver, kwargs)

    names = {p.name for p in params}
    if {"self", "cls"} <= names:  # get_json_schema skips a first parameter named self or cls: one must be free
        raise ValueError(f"openenv_environment: the tool {name!r} takes parameters named both 'self' and 'cls', and "
                         f"its schema needs one of the two names for the method's receiver: rename one of them.")
    self_param = inspect.Parameter("cls" if "self" in names else "self", inspect.Parameter.POSITIONAL_ONLY)
    method.__signature__ = inspect.Signature([self_param, *params], return_annotation=str)
    method.__annotations__ = {**{p.name: p.annotation for p in params}, "return": str}
    method.__name__ = method.__qualname__ = name
    method.__doc__ = doc
    return method


def _action_type(environment):
    """The pydantic action class step() takes: its `action` parameter's hint, else the Environment[...]'s first."""
    try:
        hint = typing.get_type_hints(type(environment).step).get("action")
    except Exception:  # noqa: BLE001  (unresolvable forward references: try the generic base)
        hint = None
    if hint is None or not hasattr(hint, "model_fields"):
        for base in getattr(type(environment), "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and hasattr(args[0], "model_fields"):
                return args[0]
    return hint if hasattr(hint, "model_fields") else None


def _action_tool(environment, tool_name: str):
    action_cls = _action_type(environment)
    if action_cls is None:
        raise TypeError(f"openenv_environment: cannot tell which action {type(environment).__name__}.step() takes: "
                        f"annotate it (def step(self, action: MyAction, ...)) or subclass Environment[MyAction, "
                        f"MyObservation, MyState].")
    params, described = [], {}
    for field_name, field in action_cls.model_fields.items():
        if field_name in SKIPPED_FIELDS:
            continue
        default = inspect.Parameter.empty if field.is_required() else field.get_default(call_default_factory=True)
        params.append(inspect.Parameter(field_name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                        annotation=field.annotation))
        described[field_name] = field.description
    # its own docstring only: inspect.getdoc would inherit OpenEnv's "Base class for all environment actions."
    description = inspect.cleandoc(action_cls.__dict__.get("__doc__") or "").split("\n\n")[0]
    doc = _docstring(f"Act in the environment: {description}" if description else "", described)

    def body(self, kwargs):
        return _text(self._step(action_cls(**kwargs)), self._observation_text)

    for param in params:  # a field the tool's JSON schema cannot describe: said now, naming the action and field
        _check_field_schema(action_cls, param, _method(tool_name, [param], _docstring("x", {param.name: "x"}), body))
    return _method(tool_name, params, doc, body)


def _check_field_schema(action_cls, param: inspect.Parameter, method) -> None:
    from transformers.utils import get_json_schema

    try:
        custom = custom_classes(param.annotation)
        if custom:  # transformers 5.17's schema says only "object" for them (5.24's refuses them)
            raise TypeError(f"{custom[0].__name__} is a class of its own")
        get_json_schema(method)
    except Exception as err:  # noqa: BLE001  (transformers' TypeHintParsingException and kin)
        raise ValueError(
            f"openenv_environment: the action {action_cls.__name__}'s field {param.name!r} is "
            f"{getattr(param.annotation, '__name__', param.annotation)!s:.80}, which the model cannot be told how to "
            f"fill: the action's tool takes the fields as arguments, described by a JSON schema made from basic "
            f"types (int, float, str, bool), Literal, Enum, list, dict and Optional ({err}). Actions with nested "
            f"models (or other classes) are not supported yet: flatten the action into fields of such types "
            f"(e.g. {param.name}_x: int, {param.name}_y: int), or take a dict and build the model in step().") from None


def _mcp_tools(environment) -> list:
    from openenv.core.env_server.mcp_types import CallToolAction, ListToolsAction

    listed = environment.step(ListToolsAction())
    tools = []
    for tool in listed.tools:
        _check_tool_name(tool.name, f"openenv_environment: the MCP environment {type(environment).__name__}",
                         "rename the tool on its FastMCP server (@mcp.tool(name=...))")
        schema = tool.input_schema or {}
        required = set(schema.get("required", ()))
        defs = {**(schema.get("definitions") or {}), **(schema.get("$defs") or {})}
        params, described, nullable = [], {}, set()
        for arg, spec in (schema.get("properties") or {}).items():
            annotation, null = _annotation(spec, defs)
            if null:
                nullable.add(arg)
            default = inspect.Parameter.empty if arg in required else spec.get("default")
            if null or default is None:  # nullable, or left out (the tool's own default: None is not sent)
                annotation = typing.Optional[annotation]
            params.append(inspect.Parameter(arg, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                                            default=default))
            text = spec.get("description") or spec.get("title") or ""
            if default is not inspect.Parameter.empty and default is not None:  # get_json_schema shows no default
                text = f"{text} (default: {json.dumps(default, default=str)})".strip()
            described[arg] = text
        params.sort(key=lambda p: p.default is not inspect.Parameter.empty)  # required first, as a signature needs

        def body(self, kwargs, _name=tool.name, _nullable=frozenset(nullable)):
            arguments = {k: v for k, v in kwargs.items() if v is not None or k in _nullable}
            with _one_line_tool_errors():  # the error reaches the model; the console gets one line, not a box
                observation = self._step(CallToolAction(tool_name=_name, arguments=arguments))
            if getattr(observation, "error", None) is not None:
                raise RuntimeError(observation.error.message)
            return _mcp_result_text(getattr(observation, "result", observation), _name, type(self)._said)

        tools.append(_method(tool.name, params, _docstring(tool.description, described), body))
    if not tools:
        raise ValueError(f"openenv_environment: the MCP environment {type(environment).__name__} lists no tools: the "
                         f"model would have nothing to call. Register them on its FastMCP server.")
    return tools


class _NoToolTraceback(logging.Filter):
    """FastMCP logs a tool that raised as "Error calling tool 'name'" with its traceback, which its rich handler
    draws as a 20-line box: for each bad call of each episode, a flood in a notebook cell. The error is what the
    model reads (and the user sees it in the episodes), so the record keeps its line and loses the traceback."""

    def filter(self, record):
        if str(record.msg).startswith("Error calling tool"):
            record.exc_info = record.exc_text = None
        return True


_QUIET = {"filter": _NoToolTraceback(), "users": 0, "lock": threading.Lock()}


@contextmanager
def _one_line_tool_errors():
    """FastMCP's server logger without tracebacks for failing tool calls while grpo-nb's calls run (episodes call
    tools side by side in threads: the filter stays while any runs); other records, and other times, as they were."""
    logger = logging.getLogger("fastmcp.server.server")  # FastMCP's get_logger(__name__) of fastmcp/server/server.py
    with _QUIET["lock"]:
        if _QUIET["users"] == 0:
            logger.addFilter(_QUIET["filter"])
        _QUIET["users"] += 1
    try:
        yield
    finally:
        with _QUIET["lock"]:
            _QUIET["users"] -= 1
            if _QUIET["users"] == 0:
                logger.removeFilter(_QUIET["filter"])


def _annotation(spec: dict, defs: dict, depth: int = 0):
    """(a type hint, whether null is allowed) for an MCP tool parameter's JSON schema: what get_json_schema turns
    back into the schema the model is shown (enums as Literal, `$ref`s resolved, anyOf/oneOf as unions)."""
    if depth > 8 or not isinstance(spec, dict):
        return str, False
    if isinstance(spec.get("$ref"), str):
        return _annotation(defs.get(spec["$ref"].rsplit("/", 1)[-1], {}), defs, depth + 1)
    values = spec["enum"] if isinstance(spec.get("enum"), list) else [spec["const"]] if "const" in spec else None
    if values and all(v is None or isinstance(v, (str, int, float, bool)) for v in values):
        kept = tuple(v for v in values if v is not None)
        return (typing.Literal[kept] if kept else str), None in values
    options = spec.get("anyOf") or spec.get("oneOf")
    kind = spec.get("type")
    if isinstance(kind, list):
        options = [{**spec, "type": k} for k in kind]
    if isinstance(options, list) and options:
        hints, null = [], False
        for option in options:
            if isinstance(option, dict) and option.get("type") == "null":
                null = True
                continue
            hint, option_null = _annotation(option, defs, depth + 1)
            hints.append(hint)
            null = null or option_null
        if not hints:
            return str, True
        return (hints[0] if len(hints) == 1 else typing.Union[tuple(hints)]), null
    if kind == "array":
        items = spec.get("items")
        return (list[_annotation(items, defs, depth + 1)[0]] if isinstance(items, dict) and items else list), False
    return JSON_TYPES.get(kind, str), False


def _mcp_result_text(result, tool: str = "", said: set | None = None) -> str:
    """An MCP tool's result as text: its contents, text as it is and anything else (an image, audio, a binary
    resource) as a one-line summary without its data - a text model cannot read it, and an image's base64 would be
    megabytes of tokens -, warned once per tool in `said`; without contents, its structured content as JSON (a tool
    that returned None: "null", as a plain tool's None reads); else its str()."""
    if isinstance(result, str):
        return result
    content = getattr(result, "content", None)
    if content:
        texts, hidden = [], []
        for part in content:
            text, summary = _content_text(part)
            texts.append(text if summary is None else summary)
            if summary is not None:
                hidden.append(summary)
        if hidden and said is not None and tool not in said:
            said.add(tool)
            warnings.warn(f"openenv_environment: the MCP tool {tool!r} returned content that is not text "
                          f"({', '.join(hidden[:3])}): a text model cannot read it, so it is shown a summary in its "
                          f"place, without the data. Return text (a description, or what the model should know of "
                          f"it) for the model to act on.", stacklevel=3)
        return "\n".join(texts)
    data = getattr(result, "data", None)
    if data is not None:
        return data if isinstance(data, str) else json.dumps(data, default=str, ensure_ascii=False)
    structured = getattr(result, "structured_content", None)
    if isinstance(structured, dict):  # FastMCP wraps a result that is not an object (None too) as {"result": ...}
        wrapped = ((getattr(result, "meta", None) or {}).get("fastmcp") or {}).get("wrap_result")
        value = structured.get("result") if wrapped and set(structured) == {"result"} else structured
        return json.dumps(value, default=str, ensure_ascii=False)
    if isinstance(result, (dict, list, int, float, bool)) or result is None:
        return json.dumps(result, default=str, ensure_ascii=False)
    if hasattr(result, "content"):  # a CallToolResult with nothing in it: not FastMCP's repr of its fields
        return "null"
    return str(result)


def _content_text(part):
    """(the text of one MCP content part, None) or (None, a summary of a part that is not text)."""
    kind = getattr(part, "type", None)
    if isinstance(getattr(part, "text", None), str):
        return part.text, None
    resource = getattr(part, "resource", None)  # an embedded resource: its text, or a blob
    if isinstance(getattr(resource, "text", None), str):
        return resource.text, None
    encoded = getattr(part, "data", None) if kind in ("image", "audio") else getattr(resource, "blob", None)
    mime = getattr(part, "mimeType", None) or getattr(resource, "mimeType", None) or kind or type(part).__name__
    if isinstance(encoded, str):  # base64: its decoded size, not read
        size = len(encoded.rstrip("=")) * 3 // 4
        return None, f"[{mime}, {size:,} bytes: not shown]"
    uri = getattr(part, "uri", None) or getattr(resource, "uri", None)
    return None, f"[{mime}{f' at {uri}' if uri else ''}: not shown]"
