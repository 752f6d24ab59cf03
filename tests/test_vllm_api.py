"""The vLLM backend and its stand-in against vLLM's real API, as recorded from its wheel.

vLLM cannot be installed here, so `benchmarks/vllm_api.py` parses a vLLM wheel's source with
`ast` and commits what the backend relies on to `benchmarks/results/vllm_api.json`. These tests
read that record (fast, no network) and fail when either side drifts from it:

* the backend (`grpo_nb/rollout/vllm_backend.py`, parsed with `ast`): every keyword it passes to
  `LLM(...)`, `SamplingParams(...)`, `LoRARequest(...)`, `llm.generate/sleep/wake_up(...)` exists
  in the real signature, every name it imports exists, every output attribute it reads is a real
  field, every value it passes from a closed set (logprobs modes, dtypes, LoRA ranks, sleep
  levels, finish reasons) is in that set;
* the stand-in (`tests/fake_vllm.py`, via `inspect.signature`): its parameters bind like the
  real ones (positional ones a prefix of the real positional ones, names real, keyword-only
  where real is, defaults equal), its value sets equal the recorded ones, and its
  `SamplingParams` / `LoRARequest` checks are vLLM's recorded checks.

Refresh the record with `python benchmarks/vllm_api.py` (see benchmarks/README.md).
"""

import ast
import inspect
import json
import re
from pathlib import Path

import pytest
import torch

import fake_vllm

ROOT = Path(__file__).resolve().parents[1]
RECORD = json.loads((ROOT / "benchmarks" / "results" / "vllm_api.json").read_text())
BACKEND_PATH = ROOT / "grpo_nb" / "rollout" / "vllm_backend.py"
POSITIONAL = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")
BY_KEYWORD = ("POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY")


def _values(name):
    return RECORD["constants"][name]["values"]


def _real_params(key):
    entry = RECORD["callables"].get(key) or RECORD["classes"].get(key)
    assert entry is not None and not entry.get("missing"), \
        f"{key} is not in the record: add it to benchmarks/vllm_api.py and refresh the record"
    return entry["params"]


def _engine_args():
    """LLM(**kwargs) forwards its extra keywords to EngineArgs: those count as LLM keywords."""
    assert RECORD["callables"]["vllm.LLM.__init__"]["var_keyword_forwarded_to"] == ["EngineArgs"]
    return {p["name"]: p for p in RECORD["classes"]["vllm.EngineArgs"]["params"]}


def _default_value(p):
    """The recorded default as a Python value, or ... when it is not a literal (an enum, a factory)."""
    text = p.get("default_resolved", p["default"])
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return ...


# -- the backend's calls ---------------------------------------------------------------------------
def _backend_tree():
    return ast.parse(BACKEND_PATH.read_text())


def _vllm_imports(tree):
    """{local name: qualified name} for the backend's `from vllm... import X`; plus ("module", name) pairs."""
    names, pairs = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
                pairs.append((node.module, a.name))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "vllm":
            pairs.append(("vllm", node.attr))  # `import vllm; vllm.LLM`
    return names, pairs


def _target(func, imported):
    """The record key a call goes to, or None when it is not a vLLM call."""
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "vllm":
        return "vllm.LLM.__init__" if func.attr == "LLM" else f"vllm.{func.attr}"
    if isinstance(func, ast.Name) and func.id in imported:
        qualified = imported[func.id]
        qualified = {"vllm.sampling_params.SamplingParams": "vllm.SamplingParams"}.get(qualified, qualified)
        return "vllm.LLM.__init__" if qualified == "vllm.LLM" else qualified
    if isinstance(func, ast.Attribute):  # self.llm.generate(...) / llm.sleep(...)
        owner = func.value
        if getattr(owner, "attr", None) == "llm" or getattr(owner, "id", None) == "llm":
            return f"vllm.LLM.{func.attr}"
    return None


def _dict_keys(fn, name):
    """Keys a function puts in the dict `name` (name = dict(a=..), name = {..}, name["k"] = ..)."""
    keys = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name) and t.id == name:
                    v = node.value
                    if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "dict":
                        keys |= {k.arg for k in v.keywords if k.arg}
                    elif isinstance(v, ast.Dict):
                        keys |= {k.value for k in v.keys if isinstance(k, ast.Constant)}
                if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == name \
                        and isinstance(t.slice, ast.Constant):
                    keys.add(t.slice.value)
    return keys


def backend_calls():
    """[(record key, call node, keyword names incl. **dict keys, line)] for every vLLM call in the backend."""
    tree = _backend_tree()
    imported, _ = _vllm_imports(tree)
    out, seen = [], set()
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        for node in ast.walk(fn):
            if not isinstance(node, ast.Call) or id(node) in seen:
                continue
            key = _target(node.func, imported)
            if key is None:
                continue
            seen.add(id(node))
            kws = {k.arg for k in node.keywords if k.arg}
            for k in node.keywords:
                if k.arg is None and isinstance(k.value, ast.Name):
                    kws |= _dict_keys(fn, k.value.id)
            out.append((key, node, kws, node.lineno))
    return out


def test_backend_calls_every_vllm_entry_point_we_expect():
    found = {key for key, *_ in backend_calls()}
    assert found >= {"vllm.LLM.__init__", "vllm.LLM.generate", "vllm.LLM.sleep", "vllm.LLM.wake_up",
                     "vllm.SamplingParams", "vllm.lora.request.LoRARequest"}, found


def test_backend_keywords_exist_in_the_real_signatures():
    engine = _engine_args()
    problems = []
    for key, node, kws, line in backend_calls():
        params = _real_params(key)
        accepted = {p["name"] for p in params if p["kind"] in BY_KEYWORD}
        if key == "vllm.LLM.__init__":
            accepted |= set(engine)
        positional = [p for p in params if p["kind"] in POSITIONAL]
        if len(node.args) > len(positional) and not any(p["kind"] == "VAR_POSITIONAL" for p in params):
            problems.append(f"line {line}: {key} takes {len(positional)} positional arguments, "
                            f"we pass {len(node.args)}")
        for kw in sorted(kws - accepted):
            problems.append(f"line {line}: {key} has no parameter {kw!r} in vLLM {RECORD['vllm_version']}")
        given = kws | {p["name"] for p in positional[: len(node.args)]}
        for p in params:
            if p["required"] and p["name"] not in given:
                problems.append(f"line {line}: {key} needs {p['name']!r}, which we do not pass")
    assert not problems, "\n".join(problems)


def test_backend_imports_exist_in_vllm():
    _, pairs = _vllm_imports(_backend_tree())
    assert pairs
    exports = RECORD["exports"]
    missing = [f"{m}.{n}" for m, n in pairs if n not in exports.get(m, ())]
    assert not missing, f"not in vLLM {RECORD['vllm_version']}: {missing}"


# What the backend reads off vLLM's objects: the variable names it uses for them in __call__.
READ_VARIABLES = {"request": "vllm.RequestOutput", "c": "vllm.CompletionOutput", "params": "vllm.SamplingParams"}


def _reads():
    call = next(n for n in ast.walk(_backend_tree()) if isinstance(n, ast.FunctionDef) and n.name == "__call__")
    reads = {key: set() for key in [*READ_VARIABLES.values(), "vllm.logprobs.Logprob"]}
    for node in ast.walk(call):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            if isinstance(node.value, ast.Name) and node.value.id in READ_VARIABLES:
                reads[READ_VARIABLES[node.value.id]].add(node.attr)
            elif isinstance(node.value, ast.Subscript) and getattr(node.value.value, "id", None) == "step":
                reads["vllm.logprobs.Logprob"].add(node.attr)  # step[token_id].logprob
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and \
                getattr(node.args[0], "id", None) in READ_VARIABLES and isinstance(node.args[1], ast.Constant):
            reads[READ_VARIABLES[node.args[0].id]].add(node.args[1].value)
    return reads


def test_output_attributes_the_backend_reads_are_real_fields():
    for key, attrs in _reads().items():
        assert attrs, f"found no reads of {key} in VLLMRollout.__call__ (renamed a variable? update READ_VARIABLES)"
        fields = {p["name"] for p in _real_params(key)}
        assert attrs <= fields, f"{key} in vLLM {RECORD['vllm_version']} has no {sorted(attrs - fields)}"


def test_backend_values_are_in_vllms_value_sets():
    from grpo_nb.rollout import vllm_backend

    tree = _backend_tree()
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    modes = {s for s in strings if re.fullmatch(r"(raw|processed)_\w+", s)}  # typos included
    assert modes and modes <= set(_values("LogprobsMode")), modes
    dtypes = {v.value for d in ast.walk(tree) if isinstance(d, ast.Dict) and d.keys
              and all(isinstance(k, ast.Attribute) and getattr(k.value, "id", None) == "torch" for k in d.keys)
              for v in d.values}
    assert dtypes and dtypes | {"auto"} <= set(_values("ModelDType")), dtypes
    assert tuple(vllm_backend._VLLM_LORA_RANKS) == tuple(_values("MaxLoRARanks"))
    levels = RECORD["callables"]["vllm.LLM.sleep"]["levels"]
    used = {k.value.value for key, node, *_ in backend_calls() if key == "vllm.LLM.sleep" for k in node.keywords
            if k.arg == "level"}
    assert used == {1} and "Offload model weights to CPU, discard KV cache" in levels["1"]  # what the module doc says
    finish = {c.value for n in ast.walk(tree) if isinstance(n, ast.Compare) and getattr(n.left, "attr", None)
              == "finish_reason" for c in n.comparators if isinstance(c, ast.Constant)}
    assert finish and finish <= set(_values("FINISH_REASON_STRINGS")), finish
    # 4-bit bases: the backend passes quantization="bitsandbytes" only to a vLLM that still has it.
    has_bnb = "bitsandbytes" in _values("QuantizationMethods")
    version_module = type("vllm", (), {"__version__": RECORD["vllm_version"]})
    assert vllm_backend._has_bitsandbytes(version_module) == has_bnb


# -- the stand-in ----------------------------------------------------------------------------------
FAKES = {
    "vllm.LLM.__init__": fake_vllm.LLM.__init__,
    "vllm.LLM.generate": fake_vllm.LLM.generate,
    "vllm.LLM.sleep": fake_vllm.LLM.sleep,
    "vllm.LLM.wake_up": fake_vllm.LLM.wake_up,
    "vllm.SamplingParams": fake_vllm.SamplingParams,
    "vllm.lora.request.LoRARequest": fake_vllm.LoRARequest,
    "vllm.RequestOutput": fake_vllm.RequestOutput,
    "vllm.CompletionOutput": fake_vllm.CompletionOutput,
    "vllm.logprobs.Logprob": fake_vllm.Logprob,
}


def signature_drift(key, fake) -> list[str]:
    """Ways a call that binds on the stand-in would bind differently (or not at all) on real vLLM."""
    params = list(inspect.signature(fake).parameters.values())
    if inspect.isfunction(fake):
        params = params[1:]  # self
    real = {p["name"]: p for p in _real_params(key)}
    if key == "vllm.LLM.__init__":
        real.update({n: {**p, "kind": "KEYWORD_ONLY"} for n, p in _engine_args().items() if n not in real})
    real_positional = [n for n, p in real.items() if p["kind"] in POSITIONAL]
    problems = []
    fake_positional = [p.name for p in params if p.kind.name in POSITIONAL]
    if fake_positional != real_positional[: len(fake_positional)]:
        problems.append(f"positional parameters {fake_positional}, "
                        f"vLLM's start {real_positional[:len(fake_positional) + 1]}")
    for p in params:
        if p.kind.name in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            if not any(r["kind"] == p.kind.name for r in real.values()):
                problems.append(f"*{p.name}: vLLM takes no {p.kind.name}")
            continue
        r = real.get(p.name)
        if r is None:
            problems.append(f"{p.name!r} is not a vLLM parameter")
            continue
        if p.kind.name == "KEYWORD_ONLY" and r["kind"] not in BY_KEYWORD:
            problems.append(f"{p.name!r} is {r['kind']} in vLLM")
        if p.default is not inspect.Parameter.empty and not r["required"]:
            value = _default_value(r)
            if value is not ... and p.default != value:
                real_default = r.get("default_resolved", r["default"])
                problems.append(f"{p.name!r} defaults to {p.default!r}, vLLM's to {real_default}")
        elif p.default is not inspect.Parameter.empty and r["required"]:
            problems.append(f"{p.name!r} is required in vLLM, optional here")
    named = {p.name for p in params}
    has_var_kw = any(p.kind.name == "VAR_KEYWORD" for p in params)
    for n, r in real.items():
        if r["required"] and n not in named and not has_var_kw:
            problems.append(f"{n!r} is required in vLLM, missing here")
    return problems


@pytest.mark.parametrize("key", sorted(FAKES))
def test_stand_in_signature_matches_vllm(key):
    problems = signature_drift(key, FAKES[key])
    assert not problems, f"tests/fake_vllm.py {key} vs vLLM {RECORD['vllm_version']}:\n" + "\n".join(problems)


def test_stand_in_value_sets_match_vllm():
    assert fake_vllm.VERSION == RECORD["vllm_version"]
    assert fake_vllm.LOGPROBS_MODES == tuple(_values("LogprobsMode"))
    assert fake_vllm.MODEL_DTYPES == tuple(_values("ModelDType"))
    assert fake_vllm.QUANTIZATION_METHODS == tuple(_values("QuantizationMethods"))
    assert fake_vllm.MAX_LORA_RANKS == tuple(_values("MaxLoRARanks"))
    assert fake_vllm.PAUSE_MODES == tuple(_values("PauseMode"))
    assert fake_vllm.FINISH_REASONS == tuple(_values("FINISH_REASON_STRINGS"))
    assert fake_vllm._SAMPLING_EPS == _values("_SAMPLING_EPS")[0] and fake_vllm._MAX_TEMP == _values("_MAX_TEMP")[0]
    assert fake_vllm.SLEEP_LEVELS == tuple(sorted(int(k) for k in RECORD["callables"]["vllm.LLM.sleep"]["levels"]))
    assert fake_vllm.WAKE_UP_TAGS == tuple(RECORD["callables"]["vllm.LLM.wake_up"]["tags"])
    for module, names in fake_vllm.EXPORTS.items():
        missing = set(names) - set(RECORD["exports"].get(module, ())) - {"__version__"}
        assert not missing, f"{module} in vLLM has no {sorted(missing)}"


def _recorded_messages(key):
    return [r["message"] or r.get("assert", "") for r in RECORD["validation"][key]]


# (SamplingParams kwargs, the start of vLLM's message): each rule must be in the record and in the stand-in.
REJECTED = [
    (dict(top_k=-2), "top_k must be 0 (disable), or at least 1"),
    (dict(top_k=1.5), "top_k must be an integer"),
    (dict(temperature=2.5), "temperature must be in [0, 2]"),
    (dict(temperature=-0.5), "temperature must be non-negative"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(top_p=0.0), "top_p must be in (0, 1]"),
    (dict(min_p=1.5), "min_p must be in [0, 1]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be greater than zero"),
    (dict(max_tokens=0), "max_tokens must be at least 1"),
    (dict(min_tokens=-1), "min_tokens must be greater than or equal to 0"),
    (dict(min_tokens=5, max_tokens=3), "min_tokens must be less than or equal to max_tokens"),
    (dict(logprobs=-2), "logprobs must be non-negative or -1"),
    (dict(stop_token_ids=[1.5]), "stop_token_ids must contain only integers"),
    (dict(temperature=0.0, n=2), "n must be 1 when using greedy sampling"),
]


@pytest.mark.parametrize("kwargs,message", REJECTED, ids=[f"{m.split(' must')[0]}-{i}" for i, (_, m) in
                                                          enumerate(REJECTED)])
def test_stand_in_sampling_params_rejects_what_vllm_rejects(kwargs, message):
    assert any(message in m for m in _recorded_messages("vllm.SamplingParams")), \
        f"vLLM {RECORD['vllm_version']} no longer checks {message!r}: update tests/fake_vllm.py and this list"
    with pytest.raises(fake_vllm.VLLMValidationError, match=re.escape(message)):
        fake_vllm.SamplingParams(**kwargs)


def test_stand_in_sampling_params_accepts_and_normalizes_like_vllm():
    for top_k in (0, -1, 5):  # 0 and -1 both disable top-k
        assert fake_vllm.SamplingParams(top_k=top_k).top_k == top_k
    assert fake_vllm.SamplingParams(logprobs=0).logprobs == 0 and fake_vllm.SamplingParams(logprobs=-1).logprobs == -1
    greedy = fake_vllm.SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)
    assert fake_vllm.SamplingParams(temperature=0.001).temperature == _values("_MAX_TEMP")[0]
    assert fake_vllm.SamplingParams(seed=-1).seed is None
    assert fake_vllm.SamplingParams(stop_token_ids=[3, 2, 3]).stop_token_ids == [3, 2]
    assert fake_vllm.SamplingParams().stop_token_ids == []


def test_stand_in_lora_request_checks_like_vllm():
    messages = _recorded_messages("vllm.lora.request.LoRARequest")
    assert any("id must be > 0" in m for m in messages) and any("lora_path cannot be empty" in m for m in messages)
    with pytest.raises(ValueError, match="id must be > 0"):
        fake_vllm.LoRARequest(lora_name="a", lora_int_id=0, lora_path="/x")
    with pytest.raises(AssertionError, match="lora_path cannot be empty"):
        fake_vllm.LoRARequest(lora_name="a", lora_int_id=1)


# -- behaviour on the stand-in: sleep levels, and a 4-bit base on a vLLM without bitsandbytes ------------


def test_stand_in_sleep_levels_and_wake_up_tags(monkeypatch, saved_base):
    vllm = fake_vllm.install(monkeypatch)
    llm = vllm.LLM(model=str(saved_base), enable_sleep_mode=True)
    sp = vllm.SamplingParams(max_tokens=2, seed=0)
    prompts = [{"prompt_token_ids": [5, 6]}]
    llm.sleep(level=0)  # paused scheduling only
    assert llm.asleep and llm.wake_up(["scheduling"]) and not llm.asleep
    llm.sleep(level=1)
    assert llm.wake_up(["weights"]) is False and llm.asleep  # KV cache still asleep: not fully awake
    with pytest.raises(RuntimeError, match="sleeping"):
        llm.generate(prompts, sp, use_tqdm=False)
    assert llm.wake_up(["kv_cache"]) is True
    assert len(llm.generate(prompts, sp, use_tqdm=False)[0].outputs) == 1
    llm.sleep(level=2)  # weights dropped: generating again needs them reloaded
    assert llm.wake_up() is True
    with pytest.raises(RuntimeError, match="level=2"):
        llm.generate(prompts, sp, use_tqdm=False)
    with pytest.raises(TypeError):
        llm.generate(prompts, sp, False)  # use_tqdm is keyword-only in vLLM


def test_4bit_base_on_a_vllm_without_bitsandbytes_is_refused_clearly(monkeypatch, saved_base):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from grpo_nb.rollout.vllm_backend import build_llm

    vllm = fake_vllm.install(monkeypatch)
    base = AutoModelForCausalLM.from_pretrained(saved_base, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear"))
    base.is_loaded_in_4bit = True  # as bitsandbytes marks an NF4 model
    assert "bitsandbytes" not in fake_vllm.QUANTIZATION_METHODS
    with pytest.raises(NotImplementedError, match=r"no bitsandbytes quantization \(removed in vLLM 0.28\)"):
        build_llm(model)
    assert fake_vllm.LLM.instances == []
    monkeypatch.setattr(vllm, "__version__", "0.27.1")  # an older vLLM: bitsandbytes is passed on
    with pytest.raises(ValueError, match="Unknown quantization method: bitsandbytes"):
        build_llm(model)  # (the stand-in knows only the recorded vLLM's methods)
    assert fake_vllm.LLM.instances == []


def test_setup_refuses_a_4bit_base_for_such_a_vllm_before_loading(monkeypatch):
    from grpo_nb import setup_reasoning_model

    fake_vllm.install(monkeypatch)
    with pytest.raises(NotImplementedError, match=r"no bitsandbytes quantization .* Use load_in_4bit=False"):
        setup_reasoning_model(load_in_4bit=True, lora_rank=4, fast_inference=True)
