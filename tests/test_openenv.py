"""OpenEnv environments through `openenv_environment` (issue 28, item 7): an in-process OpenEnv `Environment` and an
`MCPEnvironment` (FastMCP tools) become `environment_factory` classes whose tools, observations and rewards are the
environment's. Built on the `openenv` package from PyPI (the dev extra installs it), no containers."""

from __future__ import annotations

import re
import warnings
from typing import Literal, Optional  # module-level: FastMCP resolves the tools' (string) hints here

import pytest
from tiny_models import Scripted, byte_tokenizer, chat, lora_model

pytest.importorskip("openenv", reason="OpenEnv is optional: pip install openenv (the dev extra has it)")
from openenv.core.env_server.interfaces import Environment  # noqa: E402
from openenv.core.env_server.types import Action, Observation, State  # noqa: E402
from pydantic import Field  # noqa: E402

from grpo_nb import openenv_environment, train  # noqa: E402
from grpo_nb.episodes import environment_tools  # noqa: E402


class CountAction(Action):
    """Add to the running total."""

    amount: int = Field(description="How much to add (1 to 3)")


class CountObservation(Observation):
    total: int = 0
    message: str = ""


class CountEnvironment(Environment[CountAction, CountObservation, State]):
    """Reach the target: each step adds to a total; reward 1 when the total lands on the target, which ends it."""

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)
        self.total, self.target = 0, 5

    def reset(self, seed=None, episode_id=None, target: int = 5, **kwargs) -> CountObservation:
        self.total, self.target = 0, int(target)
        self._state = State(episode_id=episode_id, step_count=0)
        return CountObservation(total=0, message=f"Reach {self.target}.")

    def step(self, action: CountAction, timeout_s=None, **kwargs) -> CountObservation:
        if not 1 <= action.amount <= 3:
            raise ValueError("amount must be 1, 2 or 3")
        self.total += action.amount
        self._state.step_count += 1
        done = self.total >= self.target
        return CountObservation(total=self.total, message="done" if done else "go on", done=done,
                                reward=1.0 if self.total == self.target else 0.0)

    @property
    def state(self) -> State:
        return self._state


def mcp_environment(name: str, *tools):
    """An MCPEnvironment class whose FastMCP server offers `tools` (plain functions) and nothing else."""
    from fastmcp import FastMCP
    from openenv.core.env_server.mcp_environment import MCPEnvironment

    class Env(MCPEnvironment):
        def __init__(self):
            mcp = FastMCP(name)
            for tool in tools:
                mcp.tool(tool)
            super().__init__(mcp)

        def reset(self, seed=None, episode_id=None, **kwargs):
            return Observation()

        def _step_impl(self, action, timeout_s=None, **kwargs):
            return Observation(metadata={"error": f"unknown action {type(action).__name__}"})

        @property
        def state(self):
            return State(step_count=0)

    Env.__name__ = name
    return Env


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def shout(text: str, times: int = 1) -> str:
    """Repeat text in capitals."""
    return (text.upper() + " ") * times


def calculator_environment():
    """An MCPEnvironment with two FastMCP tools."""
    return mcp_environment("CalculatorEnvironment", add, shout)


def test_an_environments_action_is_one_tool_and_its_rewards_the_episodes():
    Episode = openenv_environment(CountEnvironment, tool_name="add")
    assert Episode.__name__ == "CountEnvironment"
    e = Episode()
    assert e.reset(target=4, prompt="not passed on", answer="x") == '{"total": 0, "message": "Reach 4."}'
    assert e.env.target == 4  # the column reset() names reached it
    (tool,) = environment_tools(e)
    assert tool.schema["function"]["name"] == "add"
    assert tool.schema["function"]["parameters"] == {
        "type": "object", "properties": {"amount": {"type": "integer", "description": "How much to add (1 to 3)"}},
        "required": ["amount"]}
    assert e.add(amount=3) == '{"total": 3, "message": "go on"}' and e.get_reward() == 0.0
    e.add(amount=1)
    assert e.get_reward() == 1.0  # landed on 4: done
    with pytest.raises(RuntimeError, match="episode is over"):
        e.add(amount=1)
    with pytest.raises(ValueError, match="amount must be"):  # the environment's own refusal reaches the model
        Episode().add(amount=7)
    last = openenv_environment(CountEnvironment, reward="last")()
    last.reset()
    last.step(amount=3), last.step(amount=2)
    assert last.get_reward() == 1.0 and openenv_environment(CountEnvironment)().get_reward() == 0.0


def test_an_mcp_environments_tools_are_the_models():
    Episode = openenv_environment(calculator_environment())
    e = Episode()
    assert e.reset(prompt="x") is None  # nothing but bookkeeping to show
    schemas = {t.name: t.schema["function"] for t in environment_tools(e)}
    assert set(schemas) == {"add", "shout"}
    assert schemas["add"]["parameters"]["required"] == ["a", "b"] and schemas["add"]["description"] == "Add two integers."
    assert schemas["shout"]["parameters"]["required"] == ["text"]
    assert e.add(a=3, b=4) == "7" and e.shout(text="hi", times=2) == "HI HI " and e.shout(text="x") == "X "
    with pytest.raises(RuntimeError, match="valid integer"):
        e.add(a="q", b=4)


def test_train_runs_an_openenv_environment(tmp_path):
    seen = []

    def total(completions, environments, **kwargs):
        seen.append([e.env.total for e in environments])
        return [0.0] * len(completions)

    def reply(text, k):  # one call per episode: 2 or 3 of a target of 3
        return f'<tool_call>{{"name": "add", "arguments": {{"amount": {k + 2}}}}}</tool_call>' \
            if "<|im_start|>tool" not in text else "ok"

    model = lora_model()
    model.config.eos_token_id = model.generation_config.eos_token_id = byte_tokenizer().eos_token_id
    model.config.max_position_embeddings = 2048
    rows = [dict(r, target=3) for r in chat(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = train(model, byte_tokenizer(), rows, total, rollout=Scripted(reply), output_dir=str(tmp_path / "r"),
                        environment_factory=openenv_environment(CountEnvironment, tool_name="add"),
                        num_generations=2, per_device_train_batch_size=4, max_completion_length=200,
                        max_prompt_length=None, save_steps=0, max_steps=1, verbose=False, live=False)
    assert seen == [[2, 3, 2, 3]]
    assert history[-1]["rewards"]["CountEnvironment"]["mean"] == 0.5  # 3 lands on the target: 1.0 in 2 of 4


def test_what_openenv_environment_refuses():
    with pytest.raises(TypeError, match="pass the environment class"):
        openenv_environment(CountEnvironment())
    with pytest.raises(ValueError, match="'sum', 'last' or a function"):
        openenv_environment(CountEnvironment, reward="max")

    class Unannotated(CountEnvironment):
        def step(self, action, timeout_s=None, **kwargs):
            return super().step(action)

    Unannotated.__orig_bases__ = (Environment,)
    with pytest.raises(TypeError, match="annotate it"):
        openenv_environment(Unannotated)
    with pytest.raises(TypeError, match="has no reset\\(\\) and step\\(\\)"):
        openenv_environment(lambda: object())


class _Closing(CountEnvironment):
    closed = False

    def close(self):
        self.closed = True


def test_one_environment_for_every_episode_is_refused_and_the_probe_is_not_closed():
    shared = _Closing()
    Episode = openenv_environment(lambda: shared, tool_name="add")
    first = Episode()
    assert first.env is shared and not shared.closed  # the probe is the first episode's, not closed under it
    with pytest.raises(ValueError, match="returned the same _Closing instance for two episodes"):
        Episode()
    Fresh = openenv_environment(_Closing)
    a, b = Fresh(), Fresh()
    assert a.env is not b.env and not a.env.closed


def _env(step=None, reset=None, action=CountAction):
    class E(Environment[action, CountObservation, State]):
        def reset(self, seed=None, episode_id=None, **kwargs):
            return reset() if reset else CountObservation()

        def step(self, action, timeout_s=None, **kwargs):
            return step()

        @property
        def state(self):
            return State(step_count=0)

    return E


@pytest.mark.parametrize("out", [{"message": "hi", "reward": 5.0, "done": True},
                                 {"observation": {"message": "hi"}, "reward": 5.0, "done": True},
                                 (Observation(metadata={"x": 1}), 5.0, True, {}),
                                 ("hi", 5.0, False, True, {})])
def test_step_results_are_read_by_their_kind(out):
    e = openenv_environment(_env(step=lambda: out))()
    e.reset()
    assert e.step(amount=1) in ("hi", None) and e.get_reward() == 5.0 and e._done  # (None: bookkeeping only)


def test_step_and_reset_results_of_no_known_kind_are_refused():
    e = openenv_environment(_env(step=lambda: 3))()
    e.reset()
    with pytest.warns(UserWarning, match="step\\(\\) returned int 3"), pytest.raises(TypeError, match="gym-style"):
        e.step(amount=1)
    assert openenv_environment(_env(reset=lambda: ("hello", {"seed": 1})))().reset() == "hello"  # gym's (obs, info)
    with pytest.raises(TypeError, match="reset\\(\\) returned int 3: openenv_environment reads"):
        openenv_environment(_env(reset=lambda: 3))().reset()


def test_mcp_schemas_keep_enums_defaults_and_nullable_types():
    def paint(maybe: Optional[int] = None, lit: Literal["a", "b"] = "a") -> str:
        """Paint."""
        return f"{maybe} {lit}"

    M = mcp_environment("M", paint)
    e = openenv_environment(M)()
    (tool,) = environment_tools(e)
    properties = tool.schema["function"]["parameters"]["properties"]
    assert properties["maybe"]["type"] == "integer" and properties["maybe"]["nullable"]
    assert properties["lit"]["enum"] == ["a", "b"] and '(default: "a")' in properties["lit"]["description"]
    assert e.paint(lit="b") == "None b"


def test_action_fields_self_and_nested_models_and_the_actions_own_docstring():
    from pydantic import BaseModel

    class SelfAction(Action):
        self: int = 0

    class Inner(BaseModel):
        x: int

    class Nested(Action):
        inner: Inner

    e = openenv_environment(_env(step=lambda: "ok", action=SelfAction))()
    e.reset()
    (tool,) = environment_tools(e)
    assert list(tool.schema["function"]["parameters"]["properties"]) == ["self"] and e.step(self=3) == "ok"
    assert "Base class" not in tool.schema["function"]["description"]  # OpenEnv's Action docstring is not its own
    with pytest.raises(ValueError, match="the action Nested's field 'inner' is Inner.*flatten the action"):
        openenv_environment(_env(action=Nested))


def test_an_mcp_tool_named_like_an_internal_is_refused_not_dropped():
    def _peek(x: int) -> str:
        """Peek."""
        return "p"

    Peeking = mcp_environment("Peeking", _peek)
    with pytest.raises(ValueError, match="the tool name '_peek' starts with '_'.*@mcp.tool\\(name=...\\)"):
        openenv_environment(Peeking)


class BoardObservation(Observation):
    observation: str = ""  # a natural name for a board's text, next to the other fields
    legal_moves: list = []


def test_an_observation_with_a_field_named_observation_is_read_whole():
    # an Observation is told from a client's StepResult by its type, not by having an `observation` attribute: read
    # as a StepResult, the model was shown `observation` alone and legal_moves was dropped (P43 F1)
    from openenv.core.client_types import StepResult

    board = BoardObservation(observation="start", legal_moves=["a", "b"], reward=2.0)
    e = openenv_environment(_env(reset=lambda: board, step=lambda: board))()
    whole = '{"observation": "start", "legal_moves": ["a", "b"]}'
    assert e.reset() == whole and e.step(amount=1) == whole and e.get_reward() == 2.0
    result = StepResult(observation=CountObservation(total=3), reward=1.0, done=True)  # a client's: still unwrapped
    e = openenv_environment(_env(step=lambda: result))()
    e.reset()
    assert e.step(amount=1) == '{"total": 3, "message": ""}' and e.get_reward() == 1.0 and e._done


@pytest.mark.parametrize("out, said", [({"observation": "x", "reward": [1.0], "done": False},
                                        "the reward [1.0] (list)"),
                                       ({"observation": "x", "reward": "high"}, "the reward 'high' (str)"),
                                       ({"observation": "x", "reward": "0.5"}, "the reward '0.5' (str)"),
                                       ({"observation": "x", "reward": 1.0, "done": "false"}, "done='false' (str)"),
                                       (("x", 1.0, False, 2, {}), "done=2 (int)")])
def test_a_step_reward_or_done_that_cannot_be_read_is_the_environments_error(out, said):
    # the step ran and the model reads its observation (its call was fine); the episode's get_reward() refuses, so
    # the run stops at the step's scoring, not silently scoring 0.0 or ending the episode on bool("false") (P43 F2/F3)
    e = openenv_environment(_env(step=lambda: out))()
    e.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing said to the model's tool message or as the step contract's warning
        assert e.step(amount=1) == "x"
    assert not e._done
    with pytest.raises(ValueError, match=f"E.step\\(\\) returned {re.escape(said)}.*The step ran"):
        e.get_reward()
    e.reset()
    assert e.get_reward() == 0.0  # a new episode starts clean


def test_done_is_read_from_bools_numpy_bools_and_0_or_1():
    import numpy as np
    import torch

    for done, ended in [(np.bool_(True), True), (np.bool_(False), False), (1, True), (0, False), (None, False),
                        (np.int64(1), True), (torch.tensor(True), True), (torch.tensor(False), False),
                        (np.array(True), True)]:
        e = openenv_environment(_env(step=lambda: {"observation": "x", "reward": np.float32(0.5), "done": done}))()
        e.reset()
        e.step(amount=1)
        assert e._done is ended and e.get_reward() == 0.5, done


def test_mcp_results_that_are_none_images_or_structured_read_as_text():
    # not FastMCP's repr of its CallToolResult, nor an image's base64 (P43 F6)
    from fastmcp.utilities.types import Image

    def nothing() -> Optional[str]:
        """Nothing."""
        return None

    def picture() -> Image:
        """A picture."""
        return Image(data=b"\x89PNG\r\n\x1a\n" + b"x" * 3000, format="png")

    def table() -> dict:
        """A table."""
        return {"a": 1, "b": [1, 2]}

    picture.__annotations__["return"] = Image  # (a string under `from __future__ import annotations`: FastMCP
    # resolves it in this module, which has no Image)

    e = openenv_environment(mcp_environment("Pictures", nothing, picture, table))()
    e.reset()
    assert e.nothing() == "null" and e.table() == '{"a":1,"b":[1,2]}'
    with pytest.warns(UserWarning, match="the MCP tool 'picture' returned content that is not text"):
        shown = e.picture()
    assert shown == "[image/png, 3,008 bytes: not shown]"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per tool
        assert e.picture() == shown


def test_a_failing_mcp_tool_logs_one_line_not_a_traceback():
    # FastMCP's rich handler drew a 20-line traceback box per failing call (P43 F8): the model still reads the error,
    # the log keeps its line, without the traceback, and only while grpo-nb's call runs
    import logging

    def boom() -> str:
        """Raises."""
        raise ValueError("bad input from tool")

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("fastmcp.server.server")
    logger.addHandler(handler)
    try:
        e = openenv_environment(mcp_environment("Booms", boom))()
        e.reset()
        with pytest.raises(RuntimeError, match="bad input from tool"):
            e.boom()
    finally:
        logger.removeHandler(handler)
    (record,) = [r for r in records if "Error calling tool" in r.getMessage()]
    assert record.exc_info is None and not logger.filters
