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
  `done` is an error the model sees), and returns the observation as text: its one text field, or its fields
  (without done / reward / metadata) as JSON, or `observation_text(observation)`;
* `get_reward()` is the episode's reward: the sum of the rewards the steps returned (`reward="last"`: the last
  one; or a function of the list), 0.0 for an episode that never acted;
* the environment itself is the episode's `.env` attribute, for reward functions (`environments=`).

Not covered: OpenEnv's HTTP/WebSocket clients to a server in a container work when their `reset()`/`step()` are
synchronous and return `StepResult`s (`observation`, `reward`, `done`), but have not been run here (no containers);
OpenEnv's "code mode" (`execute_code`) is not offered as a tool.
"""

from __future__ import annotations

import inspect
import json
import typing

JSON_TYPES = {"string": str, "integer": int, "number": float, "boolean": bool, "array": list, "object": dict}
SKIPPED_FIELDS = ("metadata",)  # on every OpenEnv action and observation: not the model's to set or to read
OBSERVATION_BOOKKEEPING = ("done", "reward", "metadata")


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
    probe = _make(env)
    try:
        tools = _mcp_tools(probe) if _is_mcp(probe) else [_action_tool(probe, tool_name or "step")]
    finally:
        _close(probe)
    names = [t.__name__ for t in tools]
    if clash := sorted(set(names) & {"reset", "get_reward", "env"}):
        raise ValueError(f"openenv_environment: the environment offers a tool named {clash[0]!r}, which the episode "
                         f"class needs for itself (reset / get_reward / env): rename the tool in the environment.")
    shown = name or type(probe).__name__

    def __init__(self):
        self.env = _make(env)
        self._rewards: list[float] = []
        self._done = False

    def reset(self, **row):
        self._rewards, self._done = [], False
        return _text(_call_reset(self.env, row), observation_text)

    def get_reward(self) -> float:
        if not self._rewards:
            return 0.0
        if reward == "sum":
            return float(sum(self._rewards))
        if reward == "last":
            return float(self._rewards[-1])
        return float(reward(list(self._rewards)))

    def _step(self, action):
        if self._done:
            raise RuntimeError("the episode is over (the environment said done): answer without calling tools.")
        out = self.env.step(action)
        observation = getattr(out, "observation", out)  # a client's StepResult, or the observation itself
        value, done = getattr(out, "reward", None), getattr(out, "done", False)
        if value is not None:
            self._rewards.append(float(value))
        self._done = bool(done)
        return observation

    attributes = {"__init__": __init__, "reset": reset, "get_reward": get_reward, "_step": _step,
                  "__doc__": f"OpenEnv's {type(probe).__name__}, one episode (grpo_nb.openenv_adapter)."}
    for tool in tools:
        attributes[tool.__name__] = tool
    cls = type(shown, (), attributes)
    cls._observation_text = staticmethod(observation_text) if observation_text else None
    return cls


def _make(env):
    made = env()
    if not (callable(getattr(made, "reset", None)) and callable(getattr(made, "step", None))):
        raise TypeError(f"openenv_environment: {getattr(env, '__name__', env)!s:.80}() returned "
                        f"{type(made).__name__}, which has no reset() and step(): pass an OpenEnv Environment class "
                        f"(or a function returning one).")
    return made


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
    """reset() with the columns it names, or every column but the prompt when it takes **kwargs."""
    params = inspect.signature(environment.reset).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        kwargs = {k: v for k, v in row.items() if k != "prompt"}
    else:
        kwargs = {k: v for k, v in row.items() if k in {p.name for p in params}}
    out = environment.reset(**kwargs)
    return getattr(out, "observation", out)


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
    def method(self, **kwargs):
        return body(self, kwargs)

    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
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
    description = (inspect.getdoc(action_cls) or "").split("\n\n")[0]
    doc = _docstring(f"Act in the environment: {description}" if description else "", described)

    def body(self, kwargs):
        return _text(self._step(action_cls(**kwargs)), self._observation_text)

    return _method(tool_name, params, doc, body)


def _mcp_tools(environment) -> list:
    from openenv.core.env_server.mcp_types import CallToolAction, ListToolsAction

    listed = environment.step(ListToolsAction())
    tools = []
    for tool in listed.tools:
        schema = tool.input_schema or {}
        required = set(schema.get("required", ()))
        params, described = [], {}
        for arg, spec in (schema.get("properties") or {}).items():
            annotation = JSON_TYPES.get(spec.get("type"), str)
            if annotation is list and spec.get("items", {}).get("type") in JSON_TYPES:
                annotation = list[JSON_TYPES[spec["items"]["type"]]]
            if arg not in required:
                annotation = typing.Optional[annotation]
            params.append(inspect.Parameter(arg, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                                            default=inspect.Parameter.empty if arg in required else None))
            described[arg] = spec.get("description") or spec.get("title")
        params.sort(key=lambda p: p.default is not inspect.Parameter.empty)  # required first, as a signature needs

        def body(self, kwargs, _name=tool.name):
            arguments = {k: v for k, v in kwargs.items() if v is not None}
            observation = self._step(CallToolAction(tool_name=_name, arguments=arguments))
            if getattr(observation, "error", None) is not None:
                raise RuntimeError(observation.error.message)
            return _mcp_result_text(getattr(observation, "result", observation))

        tools.append(_method(tool.name, params, _docstring(tool.description, described), body))
    if not tools:
        raise ValueError(f"openenv_environment: the MCP environment {type(environment).__name__} lists no tools: the "
                         f"model would have nothing to call. Register them on its FastMCP server.")
    return tools


def _mcp_result_text(result) -> str:
    """An MCP tool's result as text: its text contents, its structured data as JSON, or its str()."""
    if isinstance(result, str):
        return result
    content = getattr(result, "content", None)
    if content:
        texts = [getattr(c, "text", None) for c in content]
        if all(isinstance(t, str) for t in texts):
            return "\n".join(texts)
    data = getattr(result, "data", None)
    if data is not None:
        return data if isinstance(data, str) else json.dumps(data, default=str, ensure_ascii=False)
    if isinstance(result, (dict, list, int, float, bool)) or result is None:
        return json.dumps(result, default=str, ensure_ascii=False)
    return str(result)
