"""Tools a model calls during its rollout: their schemas, calling them, and reading calls out of its text.

TRL 1.16's contract (`GRPOTrainer(tools=[...])`): a tool is a plain Python function, sync or async, with type
hints and a Google-style docstring; its schema is transformers' `get_json_schema`, offered to the model through
the chat template's `tools=`. A call the model writes is parsed in its chat template's format; a tool that raises,
a call to an unknown tool, malformed JSON or wrong arguments go back to the model as `{"error": ...}`.

    as_tools()            functions -> Tool (name, schema), refused with the fix when a schema cannot be made
    call_tool()           one call, in a thread with a time limit -> (tool message content, failed)
    ToolFormat            how a chat template writes calls (`tool_format`), and reading them back (`parse`)
    tool_chat_template()  grpo-nb's training template for tokenizers whose template has no tool support
    tool_suffix()         the text a template puts after an assistant's turn for its tool results, and where
                          each result's rendering lies in it (tool_suffix_text(): the text alone)
    encode_suffix()       its token ids, the results' renderings never read as special tokens
    takes_several_calls() whether the template renders a turn with several calls (Llama 3.x's refuse)

`episodes.py` runs the turns with them.
"""

from __future__ import annotations

import asyncio
import copy
import enum
import functools
import hashlib
import inspect
import json
import random
import re
import threading
import typing
from dataclasses import dataclass
from typing import Callable

# --------------------------------------------------------------------------------------
# Tools and their schemas


@dataclass(frozen=True)
class Tool:
    name: str
    function: Callable
    schema: dict  # transformers.utils.get_json_schema's: {"type": "function", "function": {...}}

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(_unwrapped(self.function))


def _unwrapped(function):
    while isinstance(function, functools.partial):
        function = function.func
    return function


def tool_name(function) -> str:
    """The name the model calls a function by: its own (a partial's wrapped function's, a bound method's)."""
    return getattr(_unwrapped(function), "__name__", None) or type(function).__name__


def custom_classes(annotation) -> list:
    """The classes in a type hint beyond what a tool's JSON schema is made of (basic types, Enum, containers)."""
    if isinstance(annotation, type):
        basic = (int, float, str, bool, dict, list, tuple, type(None))
        return [] if annotation in basic or issubclass(annotation, enum.Enum) else [annotation]
    return [c for arg in typing.get_args(annotation) for c in custom_classes(arg)]


def _schema(function, name: str) -> dict:
    """transformers' get_json_schema of `function`; a partial's is its wrapped function's without the parameters
    it binds (the model cannot set those), an object with __call__ its method's, named `name`."""
    from transformers.utils import get_json_schema

    inner = _unwrapped(function)
    if not (inspect.isfunction(inner) or inspect.ismethod(inner) or inspect.isbuiltin(inner)) \
            and callable(getattr(inner, "__call__", None)) and not isinstance(inner, type):
        inner = inner.__call__  # an instance with __call__: get_json_schema reads functions only
    try:
        hints = typing.get_type_hints(inner)
    except Exception:  # noqa: BLE001  (an unresolvable hint: get_json_schema says what it cannot read)
        hints = {}
    for arg, hint in hints.items():
        custom = custom_classes(hint) if arg != "return" else []
        if custom:  # transformers 5.17's schema says only "object" for them (5.24's refuses them)
            raise TypeError(f"its argument {arg!r} is a {custom[0].__name__}, a class of its own, which a JSON schema "
                            f"cannot describe (the model would be told only 'object'): take basic types (int, float, "
                            f"str, bool), Literal, Enum, list, dict or Optional, and build the "
                            f"{custom[0].__name__} inside the tool.")
    schema = get_json_schema(inner)
    if inner is not function:
        schema = copy.deepcopy(schema)
        schema["function"]["name"] = name
        try:
            left = set(inspect.signature(function).parameters)
        except (TypeError, ValueError):
            left = None
        bound = set()
        f = function
        while isinstance(f, functools.partial):
            bound |= set(f.keywords)
            f = f.func
        parameters = schema["function"].get("parameters") or {}
        properties = parameters.get("properties") or {}
        drop = {k for k in properties if k in bound or (left is not None and k not in left)}
        for k in drop:
            properties.pop(k)
        if "required" in parameters:
            parameters["required"] = [k for k in parameters["required"] if k not in drop]
    return schema


def _unofferable(function) -> str | None:
    """Why a callable with a schema still cannot be a tool, or None: a generator (the model reads one result per
    call, and would read `<generator object ...>`), *args / **kwargs (a JSON schema names each argument)."""
    inner = _unwrapped(function)
    if inspect.isgeneratorfunction(inner) or inspect.isasyncgenfunction(inner):
        return ("it is a generator (it yields), and the model reads one result per call: return the values "
                "instead (e.g. return list(...)).")
    try:
        params = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return None
    varying = [("*" if p.kind is p.VAR_POSITIONAL else "**") + p.name for p in params
               if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if varying:
        return (f"it takes {' and '.join(varying)}, which its JSON schema cannot describe: the model would be "
                f"told to pass arguments named {', '.join(repr(v.lstrip('*')) for v in varying)}. Name each "
                f"parameter it takes, with a type hint and a line under Args:.")
    return None


def as_tools(functions, where: str = "tools") -> list[Tool]:
    """`functions` as Tools, each with its JSON schema; refused with the fix when one has no schema to offer the
    model (no type hints, no docstring, a parameter the docstring does not describe) or two share a name."""
    if functions is None:
        return []
    if callable(functions) or isinstance(functions, (str, bytes)):
        raise TypeError(f"{where}={functions!r:.80} must be a list of functions, e.g. {where}=[multiply]")
    tools = []
    for function in functions:
        if isinstance(function, Tool):
            tools.append(function)
            continue
        if not callable(function):
            raise TypeError(f"{where} holds {function!r:.80}, which is not a function: pass plain Python functions "
                            f"(sync or async) with type hints and a Google-style docstring.")
        name = tool_name(function)
        if problem := _unofferable(function):
            raise ValueError(f"The tool {name!r} cannot be offered to the model: {problem}")
        try:
            schema = _schema(function, name)
        except Exception as err:  # transformers' DocstringParsingException / TypeHintParsingException / ValueError
            raise ValueError(
                f"The tool {name!r} cannot be offered to the model: {err} The model learns what a tool does and how "
                f"to call it from its schema, made from the type hints and a Google-style docstring, e.g.\n"
                f"    def {name}(a: int, b: int) -> int:\n"
                f'        """Multiplies two integers.\n\n        Args:\n            a: The first integer.\n'
                f'            b: The second integer.\n        """') from None
        tools.append(Tool(name, function, schema))
    names = [t.name for t in tools]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"{where}: two tools are named {twice[0]!r}: the model calls a tool by its name, so each "
                         f"needs its own (rename one, or wrap it: def other_name(...): return ...).")
    return tools


# --------------------------------------------------------------------------------------
# Calling a tool


def encodable(text: str) -> str:
    """`text` with any lone UTF-16 surrogate (half an emoji from a JSON escape the model wrote, a file name decoded
    with errors="surrogateescape") replaced by U+FFFD: tokenizers and UTF-8 files refuse them; a pair is joined."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def tool_message_content(result) -> str:
    """What the model reads of a tool's result: a string as it is, bytes (subprocess.check_output, a file read in
    "rb") as the UTF-8 text they hold - bytes that are not UTF-8 each read as U+FFFD -, a dict / list / number as
    JSON, else str(); always encodable. Raises when the result has no text at all (nested past the recursion limit,
    an int of more digits than Python converts, a __str__ that raises): call_tool sends the model an error saying
    why."""
    if isinstance(result, str):
        return encodable(result)
    if isinstance(result, (bytes, bytearray, memoryview)):  # not the Python literal "b'line1\\nline2'" (json's str())
        return bytes(result).decode("utf-8", errors="replace")
    try:
        return encodable(json.dumps(result, ensure_ascii=False, default=str))
    except (TypeError, ValueError, RecursionError):
        return encodable(str(result))


def error_content(message: str) -> str:
    return encodable(json.dumps({"error": message}, ensure_ascii=False))


def in_own_loop(awaitable):
    """The value of `awaitable` (an async tool's, an environment's async reset() / get_reward()), awaited in a
    thread's own event loop: asyncio.run() cannot run inside a running loop, which a notebook cell has."""
    outcome = {}

    def run():
        try:
            outcome["value"] = asyncio.run(_awaited(awaitable))
        except BaseException as err:  # noqa: BLE001 - raised again in the caller's thread
            outcome["error"] = err

    thread = threading.Thread(target=run, name="grpo-nb awaiting", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def call_tool(tools: dict[str, Tool], name, arguments, timeout: float | None,
              timed_out: list | None = None) -> tuple[str, bool]:
    """Run one call the model wrote: (the tool message's content, whether it failed).

    An unknown tool, arguments that are not an object or do not fit the tool's parameters, an exception, a result
    that cannot be made text, or no return within `timeout` seconds: `{"error": ...}` for the model to read, as
    TRL does. A tool still running at its time limit is left in its (daemon) thread: Python cannot stop it; its
    name is appended to `timed_out`. The tool gets a copy of the arguments: one that changes them in place
    (appends to a list it was given) leaves the call as the model wrote it, which the records and rewards see."""
    if not isinstance(name, str) or name not in tools:
        known = ", ".join(sorted(tools)) or "none"
        return error_content(f"unknown tool {name!r}; the tools are: {known}"), True
    if not isinstance(arguments, dict):
        return error_content(f"the arguments of {name} must be a JSON object, not {arguments!r:.100}"), True
    tool = tools[name]
    try:
        inspect.signature(tool.function).bind(**arguments)
    except TypeError as err:
        return error_content(f"{name}: {err}"), True
    except ValueError:  # a builtin without a signature: let the call say
        pass
    outcome: dict = {}
    arguments = copy.deepcopy(arguments)

    def run():
        try:
            result = tool.function(**arguments)
            if inspect.isawaitable(result):
                result = asyncio.run(_awaited(result))
        except BaseException as err:  # noqa: BLE001 - the model reads it; the run goes on
            outcome["error"] = err
            return
        try:  # within the time limit too: a huge result takes long to convert
            outcome["content"] = tool_message_content(result)
        except BaseException as err:  # noqa: BLE001
            outcome["unreadable"] = err

    thread = threading.Thread(target=run, name=f"grpo-nb tool {name}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        if timed_out is not None:
            timed_out.append(name)
        return error_content(f"{name} did not return within tool_timeout={timeout:g} s"), True
    if "error" in outcome:
        return error_content(_described(outcome["error"])), True
    if "unreadable" in outcome:
        return error_content(f"{name} returned a result that cannot be turned into text "
                             f"({_described(outcome['unreadable'])})"), True
    return outcome["content"], False


def _described(err: BaseException) -> str:
    try:
        text = str(err)
    except Exception:  # noqa: BLE001 - an exception whose __str__ fails
        text = ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


async def _awaited(awaitable):
    return await awaitable


# --------------------------------------------------------------------------------------
# How a chat template writes tool calls, and reading them back

_NAME, _KEY, _VALUE, _RESULT = "tool_name_q7x", "arg_key_q7x", "arg_value_q7x", "tool_result_q7x"
_SENTINEL_CALL = [{"type": "function", "function": {"name": _NAME, "arguments": {_KEY: _VALUE}}}]
_SENTINEL_CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": _SENTINEL_CALL},
                  {"role": "tool", "name": _NAME, "content": _RESULT}]


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes a tool call: "hermes" (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`:
    Qwen2.5 / Qwen3, Hermes, SmolLM3, grpo-nb's training template) or "json" (the whole turn one JSON object
    `{"name": ..., "parameters": {...}}`, after `<|python_tag|>` or not: Llama 3.1 / 3.2 / 3.3)."""
    kind: str

    def parse(self, text: str, tools=None) -> tuple[str, list[dict]]:
        """(the turn's text without its calls, the calls): each call {"name", "arguments"} or, when it cannot be
        read, {"name": the name if one could be read, "error": why} - the model is told, the episode goes on.
        `tools`: the names offered; in the "json" format a turn is a call only when its object names one of them
        or has a call's shape ("parameters" / "arguments"), so an answer that is JSON with a "name" stays text."""
        return _parse_hermes(text) if self.kind == "hermes" else _parse_json_turn(text, tools)


def supports_tools(tokenizer, template: str | None = None) -> bool:
    """Whether the tokenizer's chat template (or `template`) renders a whole tool exchange (a call's name and
    arguments, and the tool's result): basic templates (SmolLM2's, Llama 3's base) drop one or the other."""
    try:
        text = tokenizer.apply_chat_template(_SENTINEL_CHAT, tokenize=False,
                                             **({} if template is None else {"chat_template": template}))
    except Exception:  # noqa: BLE001 - any refusal of the roles means no
        return False
    return isinstance(text, str) and all(s in text for s in (_NAME, _KEY, _VALUE, _RESULT))


def tool_format(tokenizer, template: str | None = None) -> ToolFormat | None:
    """How the tokenizer's chat template (or `template`) writes calls, read from how it renders one; None for a
    format grpo-nb does not read (or a template without tools)."""
    if not supports_tools(tokenizer, template):
        return None
    text = tokenizer.apply_chat_template(_SENTINEL_CHAT, tokenize=False,
                                         **({} if template is None else {"chat_template": template}))
    if re.search(r"<tool_call>\s*\{.*" + _NAME, text, re.S):
        return ToolFormat("hermes")
    if re.search(r'\{\s*"name"\s*:\s*"' + _NAME + r'"\s*,\s*"(parameters|arguments)"', text):
        return ToolFormat("json")
    return None


def _call_from_json(raw: str, args_keys=("arguments", "parameters")) -> dict:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as err:
        name = re.search(r'"name"\s*:\s*"([^"]*)"', raw)
        return {"name": name.group(1) if name else None, "error": f"malformed tool call JSON ({err.msg} at char "
                f"{err.pos}): {raw.strip()[:200]}"}
    except (ValueError, RecursionError) as err:  # a number of more digits than Python converts, nesting too deep
        return {"name": None, "error": f"unreadable tool call JSON ({type(err).__name__}: {str(err)[:200]})"}
    return _call_from_value(value, raw, args_keys)


def _encodable_value(value):
    """A JSON value the model wrote with its strings (keys too) encodable: json.loads turns an escape of half an
    emoji ("\\ud83d") into a lone surrogate, which the tool's result, the records and the logs would carry."""
    if isinstance(value, str):
        return encodable(value)
    if isinstance(value, dict):
        return {encodable(k) if isinstance(k, str) else k: _encodable_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_encodable_value(v) for v in value]
    return value


def _call_from_value(value, raw: str, args_keys) -> dict:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return {"name": None, "error": f"a tool call must be a JSON object with a \"name\": {raw.strip()[:200]}"}
    arguments = next((value[k] for k in args_keys if k in value), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            pass
    return {"name": encodable(value["name"]), "arguments": _encodable_value(arguments)}


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


def _parse_hermes(text: str) -> tuple[str, list[dict]]:
    calls = [_call_from_json(m.group(1)) for m in _HERMES.finditer(text)]
    return _HERMES.sub("", text).strip(), calls


def _parse_json_turn(text: str, tools=None) -> tuple[str, list[dict]]:
    """Llama 3.x: a turn that calls a tool is the call's JSON alone; some fine-tunes write several, ";" between.
    An object that neither names an offered tool (`tools`) nor has "parameters" / "arguments" is an answer."""
    body = text.replace("<|python_tag|>", "").strip()
    if not body.startswith("{") or '"name"' not in body:
        return text, []
    keys, calls, decoder, at = ("parameters", "arguments"), [], json.JSONDecoder(), 0
    try:
        first, _ = decoder.raw_decode(body)
    except (ValueError, RecursionError):
        first = None  # read below as a malformed call
    if isinstance(first, dict) and not any(k in first for k in keys) and not (
            tools is not None and isinstance(first.get("name"), str) and first["name"] in tools):
        return text, []  # e.g. {"name": "Alice", "age": 3}, the answer to "extract the person as JSON"
    while at < len(body):
        try:
            value, end = decoder.raw_decode(body, at)
        except (ValueError, RecursionError):
            calls.append(_call_from_json(body[at:], keys))
            break
        calls.append(_call_from_value(value, body[at:end], keys))
        at = end
        while at < len(body) and body[at] in " \n\t;":
            at += 1
    return "", calls


# --------------------------------------------------------------------------------------
# grpo-nb's training template, and the text after a turn that called tools

_TOOL_SYSTEM = (
    "You can call these tools. To call one, write <tool_call>{\"name\": <tool name>, \"arguments\": <its "
    "arguments as a JSON object>}</tool_call> and end your turn; the result comes back in the next message.\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}")


def tool_chat_template(tokenizer) -> str:
    """A chat template that offers tools and reads their calls in the "hermes" format, for a tokenizer whose own
    template has no tool support (SmolLM2's, a base model's): ChatML turns where the tokenizer has ChatML's
    markers, else grpo-nb's plain "User: / Assistant:" turns ending in the EOS token; it starts with the BOS
    token where the tokenizer's own template does (writes_bos). `train(tools=...)` sets it on such a tokenizer
    (said once); the tokenizer saved with the adapter keeps it, so inference offers tools as training did."""
    bos = "{{ bos_token }}" if writes_bos(tokenizer) else ""
    vocab = tokenizer.get_vocab()
    chatml = "<|im_start|>" in vocab and "<|im_end|>" in vocab
    if chatml:
        open_, close = "<|im_start|>{0}\n", "<|im_end|>\n"
        head = {r: open_.format(r) for r in ("system", "user", "assistant", "tool")}
        role_head = "<|im_start|>{{ message.role }}\n"
        end_turn = end_assistant = close
    else:
        head = {"system": "", "user": "User: ", "assistant": "Assistant: ", "tool": "Tool: "}
        role_head = "{{ message.role | capitalize }}: "
        end_turn, end_assistant = "\n", "{{ eos_token }}\n"
    calls = ("{% for call in message.tool_calls or [] %}<tool_call>{\"name\": {{ call.function.name | tojson }}, "
             "\"arguments\": {% if call.function.arguments is string %}{{ call.function.arguments }}{% else %}"
             "{{ call.function.arguments | tojson }}{% endif %}}</tool_call>{% endfor %}")
    return (
        bos + "{% set system = messages[0].content if messages and messages[0].role == 'system' else none %}"
        "{% if tools %}" + head["system"] + "{% if system %}{{ system }}\n\n{% endif %}" + _TOOL_SYSTEM + end_turn
        + "{% elif system %}" + head["system"] + "{{ system }}" + end_turn + "{% endif %}"
        "{% for message in messages %}"
        "{% if message.role == 'system' and loop.first %}"
        "{% elif message.role == 'assistant' %}" + head["assistant"] + "{{ message.content or '' }}" + calls
        + end_assistant
        + "{% elif message.role == 'tool' %}" + head["tool"] + "{{ message.content }}" + end_turn
        + "{% else %}" + role_head + "{{ message.content }}" + end_turn + "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}" + head["assistant"].rstrip(" ") + ("" if chatml else " ") + "{% endif %}")


def writes_bos(tokenizer) -> bool:
    """Whether the tokenizer's own chat template starts a conversation with the BOS token (Gemma's, Mistral's,
    Llama 3's): those models expect it at position 0, and chat prompts are encoded without adding special tokens
    (the template writes its own), so a replacement template that left it out would drop it from every prompt.
    Read from a rendering, as the template is; a tokenizer without a template: whether it adds the BOS to a
    text itself. grpo-nb's own template (tool_chat_template) keeps the answer it was made with."""
    bos = getattr(tokenizer, "bos_token", None)
    if not isinstance(bos, str) or not bos:
        return False
    try:
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                                 add_generation_prompt=True)
            return isinstance(text, str) and text.lstrip().startswith(bos)
        ids = tokenizer("x")["input_ids"]
    except Exception:  # noqa: BLE001 - a template that refuses a bare user turn, a tokenizer that cannot encode
        return False
    return bool(ids) and ids[0] == tokenizer.bos_token_id


def absent_sentinel(base: str, *texts: str) -> str:
    """A placeholder of `base`'s length that none of `texts` holds: `base` itself, else `base` with its last six
    characters drawn at random from its own letters. A value's rendering is found by rendering a sentinel in its
    place (changed_span), which fails when the value (a web page, an environment's observation: untrusted text)
    holds the sentinel itself - the two renderings then agree past the sentinel's place, and the span lands on
    the template's own markers after it, leaving the value's forged "<|im_end|>" special tokens. Its length and
    letters stay those of `base`, which the template was checked to render as written (supports_tools): a
    template that cuts results (`| truncate(60)`) or maps characters renders every variant as it rendered
    `base`, whatever a result holds (a placeholder grown to the result's length would be cut, and one result
    could stop the run). Drawn from the texts' hash (no global random state is touched): a value cannot hold
    the half a million and more variants within a result's budget."""
    if not any(base in t for t in texts):
        return base
    letters = sorted({c for c in base if c.isalpha()})
    rng = random.Random(hashlib.sha256("\0".join(texts).encode("utf-8", "surrogatepass")).digest())
    while True:
        sentinel = base[:-6] + "".join(rng.choice(letters) for _ in range(6))
        if not any(sentinel in t for t in texts):
            return sentinel


def changed_span(text: str, marked: str, sentinel: str | None = None) -> tuple[int, int]:
    """(start, end) of what `text` holds where `marked` (the same rendering with `sentinel` in one value's place)
    holds the sentinel: what the chat template made of the value, escaped (Llama 3.x `| tojson`'s a tool result),
    trimmed or verbatim, found by where the two renderings differ, never by searching for the value's text (which
    may also be the template's own, or not appear verbatim). The sentinel is letters only, so no special token's
    text in the value can be taken for the template's around it; the span is widened to cover all of the
    sentinel's place (a value ending in "x" as the sentinel does keeps its "x"). `sentinel` must not occur in
    `text` (absent_sentinel): a value holding it would make the renderings agree past its place."""
    n = min(len(text), len(marked))
    start = 0
    while start < n and text[start] == marked[start]:
        start += 1
    tail = 0
    while tail < n - start and text[-1 - tail] == marked[-1 - tail]:
        tail += 1
    at = -1 if sentinel is None else marked.find(sentinel, max(0, start - len(sentinel) + 1))
    if at >= 0 and at <= start:
        start, tail = at, min(tail, len(marked) - at - len(sentinel))
    return start, len(text) - tail


def _calling_turn(calls: list[dict]) -> list[dict]:
    return [{"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {
                    "name": c.get("name") if isinstance(c.get("name"), str) else "unknown",
                    "arguments": c.get("arguments") if isinstance(c.get("arguments"), dict) else {}}}
                for c in calls] or [{"type": "function", "function": {"name": "unknown", "arguments": {}}}]}]


def takes_several_calls(tokenizer, template: str | None = None, chat_template_kwargs: dict | None = None) -> bool:
    """Whether the chat template renders an assistant turn with two calls: Llama 3.1 / 3.2's refuse ("This model
    only supports single tool-calls at once!"), though the "json" parser reads several (";" between)."""
    kwargs = dict(chat_template_kwargs or {}, **({} if template is None else {"chat_template": template}))
    calls = [{"name": _NAME, "arguments": {_KEY: _VALUE}}] * 2
    results = [{"role": "tool", "name": _NAME, "content": _RESULT}] * 2
    try:
        tokenizer.apply_chat_template(_calling_turn(calls) + results, tokenize=False, add_generation_prompt=True,
                                      **kwargs)
    except Exception:  # noqa: BLE001 - jinja2's TemplateError from raise_exception, or any other refusal
        return False
    return True


def one_call_per_turn_error(call: dict) -> str:
    """The result a call beyond a turn's first gets where the chat template takes one call per turn."""
    return error_content(f"not run: this model's chat template takes one tool call per turn, so only the turn's "
                         f"first call was run. Call {call.get('name') or 'the tool'} again in a later turn.")


def tool_suffix(tokenizer, calls: list[dict], tool_messages: list[dict], eos_texts: list[str],
                chat_template_kwargs: dict | None = None, template: str | None = None
                ) -> tuple[str, list[tuple[int, int]]]:
    """The text the chat template puts after an assistant turn that made `calls` (ended by its EOS token): the
    tool results and the opening of the assistant's next turn, as TRL reads it from a rendering of a short
    conversation; and where in it each result's rendering lies, (start, end) per tool message, found by
    rendering a sentinel in its place (changed_span): encode_suffix keeps those spans text. The cut is the
    turn's last EOS before the first result, found with a sentinel in place of the results (a template may
    render the calling turn differently once results follow, as Qwen3's drops its empty <think> block; only
    what follows the EOS is taken)."""
    kwargs = dict(chat_template_kwargs or {}, **({} if template is None else {"chat_template": template}))
    turn = _calling_turn(calls)
    render = lambda messages: tokenizer.apply_chat_template(  # noqa: E731
        turn + messages, tokenize=False, add_generation_prompt=True, **kwargs)
    text = render(tool_messages)
    sentinel = absent_sentinel(_RESULT, text, *(str(m.get("content", "")) for m in tool_messages))
    marked = [{**m, "content": sentinel} for m in tool_messages]
    template = render(marked)
    first = template.find(sentinel)
    if first < 0:  # found for _RESULT when the template was chosen (supports_tools): it renders results unlike that
        raise ValueError(
            f"The chat template changes a tool's result as it renders it: a result {sentinel!r} (a placeholder "
            f"grpo-nb renders in a result's place to find where the result lies) is not in the rendering "
            f"{template[-200:]!r}, so grpo-nb cannot tell the result's text from the template's markers. Use a "
            f"template that writes a tool's result as it is (a cut or a filter on message.content, e.g. "
            f"| truncate or | upper, changes it): tokenizer.chat_template = grpo_nb.tool_chat_template(tokenizer) "
            f"is grpo-nb's.")
    ends = [template.rfind(e, 0, first) + len(e) for e in eos_texts if e and template.rfind(e, 0, first) >= 0]
    if not ends:
        raise TurnEndNotEOS(_turn_end_message(tokenizer, turn, eos_texts, kwargs))
    cut = max(ends)
    spans = [changed_span(text, template, sentinel)] if len(tool_messages) == 1 else \
        _spans(render, marked, tool_messages, text, template, sentinel)
    if text[:cut] != template[:cut] or any(start < cut or end > len(text) for start, end in spans):
        # the results changed what comes before them: not a template's usual way
        raise ValueError("The chat template renders the turns before a tool's result differently depending on "
                         "that result, so it cannot be appended to what the model wrote. Use "
                         "tokenizer.chat_template = grpo_nb.tool_chat_template(tokenizer) (grpo-nb's).")
    return text[cut:], [(start - cut, end - cut) for start, end in spans]


class TurnEndNotEOS(ValueError):
    """The chat template ends the assistant's turn that calls tools with no EOS id before the tools' results: the
    model's turn never stops where the results go (tool_suffix; check_turn_ends checks it up front)."""


def check_turn_ends(tokenizer, eos_texts: list[str], template: str | None = None) -> None:
    """Refuse, before any episode, a chat template whose turn that calls a tool does not end with an EOS id
    (`eos_texts`, the tokens of the ids generation stops at) before the tool's result: found by tool_suffix on a
    placeholder call, which would otherwise raise only at the first call the model writes - with an untrained
    model, maybe hours into a run. Only that refusal is made here: what tool_suffix says of other results, it
    says with them."""
    call = [{"name": _NAME, "arguments": {_KEY: _VALUE}}]
    result = [{"role": "tool", "name": _NAME, "content": _RESULT}]
    try:
        tool_suffix(tokenizer, call, result, eos_texts, template=template)
    except TurnEndNotEOS:
        raise
    except Exception:  # noqa: BLE001 - any other refusal is tool_suffix's to make with a real call
        pass


def _turn_end_message(tokenizer, turn: list[dict], eos_texts: list[str], kwargs: dict) -> str:
    """Why tool_suffix cannot cut after the model's turn, and the fix that works: where the template ends the
    turn with a special token of its own (ChatML's <|im_end|> where the model's EOS is <|endoftext|>, as
    SmolLM2 and Qwen2.5 base models have it), that token made an EOS id - another template, grpo-nb's included,
    would end it the same way where the tokenizer has ChatML's markers."""
    eos = ", ".join(map(repr, eos_texts))
    try:
        closed = tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=False, **kwargs).rstrip()
    except Exception:  # noqa: BLE001 - the message does without it
        closed = ""
    added = [t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.content]
    markers = [m for m in {*added, *(["<|im_end|>"] if "<|im_end|>" in tokenizer.get_vocab() else [])}
               if closed.endswith(m)]
    if markers:
        marker = max(markers, key=len)
        marker_id = tokenizer.convert_tokens_to_ids(marker)
        ids = sorted({*(tokenizer.convert_tokens_to_ids(e) for e in eos_texts), marker_id} - {None})
        return (f"The chat template ends the assistant's turn that calls a tool with {marker!r} (id {marker_id}), "
                f"which is not one of the ids generation stops at ({eos}): the model's turn would not stop there, "
                f"so a tool's result could never follow it. Make it one: model.generation_config.eos_token_id = {ids}.")
    text = (f"The chat template does not end an assistant turn with the EOS token before a tool's result ({eos}), "
            f"so grpo-nb cannot tell where the model's turn ends and the result begins. ")
    current = kwargs.get("chat_template", getattr(tokenizer, "chat_template", None))
    if isinstance(current, dict):
        current = current.get("tool_use", current.get("default"))
    if current == tool_chat_template(tokenizer):  # grpo-nb's already: advising it again would change nothing
        return text + ("Make the token that ends the assistant's turn in it an EOS id: "
                       "model.generation_config.eos_token_id = [<the model's EOS ids>, <that token's id>].")
    return text + "Use a template that does: tokenizer.chat_template = grpo_nb.tool_chat_template(tokenizer) is grpo-nb's."


def _spans(render, marked: list[dict], tool_messages: list[dict], text: str, template: str,
           sentinel: str) -> list[tuple[int, int]]:
    """Where each of several results' renderings lies in `text`: each found in a rendering with that result alone
    real (changed_span against `template`, all sentinels), then placed by rebuilding `text` from `template` with
    each sentinel's rendering replaced by its result's. A template whose rendering of one result depends on
    another's (not seen) does not rebuild: then the span from the first result's start to the last's end is
    kept text whole (the template's markers between results too) rather than risk reading any result's as
    markers."""
    pieces, at = [], 0  # (template text before a result, that result's rendering)
    for i, message in enumerate(tool_messages):
        one = render(marked[:i] + [message] + marked[i + 1:])
        start, end = changed_span(one, template, sentinel)
        sentinel_end = len(template) - (len(one) - end)
        if start < at or sentinel_end < start:
            return [changed_span(text, template, sentinel)]
        pieces.append((template[at:start], one[start:end]))
        at = sentinel_end
    spans, rebuilt = [], ""
    for before, result in pieces:
        rebuilt += before
        spans.append((len(rebuilt), len(rebuilt) + len(result)))
        rebuilt += result
    if rebuilt + template[at:] != text:
        return [changed_span(text, template, sentinel)]
    return spans


def tool_suffix_text(tokenizer, calls: list[dict], tool_messages: list[dict], eos_texts: list[str],
                     chat_template_kwargs: dict | None = None, template: str | None = None) -> str:
    """tool_suffix()'s text alone."""
    return tool_suffix(tokenizer, calls, tool_messages, eos_texts, chat_template_kwargs, template)[0]


def encode_suffix(tokenizer, suffix: str, spans: list[tuple[int, int]]) -> list[int]:
    """The token ids of `suffix` (tool_suffix's), where the tools' results (their renderings: `spans`, in order)
    are text only: a web page or file holding "<|im_end|>" stays those characters, not the marker that ends a
    turn (it could forge a turn of its choosing), however the template escaped it. The template's own markers
    around the results stay special tokens."""
    encode = lambda text, **kw: tokenizer(text, add_special_tokens=False, **kw)["input_ids"]  # noqa: E731
    markers = [t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.content]
    if not any(m in suffix[a:b] for a, b in spans for m in markers):
        return encode(suffix)  # nothing to keep apart: as the whole text tokenizes
    ids, at = [], 0
    for start, end in spans:
        ids += encode(suffix[at:start]) + encode(suffix[start:end], split_special_tokens=True)
        at = end
    return ids + encode(suffix[at:])
