"""Record the slice of vLLM's API that the vLLM rollout backend uses, read from a real wheel.

vLLM cannot be installed on the machines this project is developed on (CUDA only), so the
backend (`grpo_nb/rollout/vllm_backend.py`) is tested against an in-process stand-in
(`tests/fake_vllm.py`). This script keeps both honest: it takes vLLM's wheel (downloaded with
`pip download vllm --no-deps`, or a path), PARSES the relevant source files with `ast` (vLLM is
never imported or installed) and writes `benchmarks/results/vllm_api.json`: the version, the
wheel's file name and sha256, and for every class and function the backend touches its
parameters (name, kind as `inspect.Parameter` names it, default as source text) or, for
dataclasses / msgspec structs, its fields; plus the value sets the backend depends on
(`logprobs_mode` choices, dtypes, quantization methods, LoRA ranks, sleep levels, wake-up
tags, finish reasons) and the validation rules of `SamplingParams` / `LoRARequest`.
`tests/test_vllm_api.py` checks the stand-in and the backend's calls against that committed
record, fast and without network; the wheel (~340 MB) is fetched only when the record is
refreshed:

    python benchmarks/vllm_api.py                       # newest vLLM on the index
    python benchmarks/vllm_api.py --version 0.33.0      # a given version
    python benchmarks/vllm_api.py --wheel /tmp/vllm_wheel/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl

then `python -m pytest -q tests/test_vllm_api.py` says what drifted.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "vllm_api.json"

# What the backend and the stand-in use, plus the engine hooks a weight sync would use:
# (record key, module, class, method).
CALLABLES = [
    ("vllm.LLM.__init__", "vllm.entrypoints.llm", "LLM", "__init__"),
    ("vllm.LLM.generate", "vllm.entrypoints.llm", "LLM", "generate"),
    ("vllm.LLM.sleep", "vllm.entrypoints.llm", "LLM", "sleep"),
    ("vllm.LLM.wake_up", "vllm.entrypoints.llm", "LLM", "wake_up"),
    ("vllm.LLM.collective_rpc", "vllm.entrypoints.llm", "LLM", "collective_rpc"),
    ("vllm.LLM.reset_prefix_cache", "vllm.entrypoints.llm", "LLM", "reset_prefix_cache"),
]
STRUCTS = [  # classes whose constructor is their fields (dataclass / msgspec.Struct) or an __init__
    ("vllm.SamplingParams", "vllm.sampling_params", "SamplingParams"),
    ("vllm.lora.request.LoRARequest", "vllm.lora.request", "LoRARequest"),
    ("vllm.RequestOutput", "vllm.outputs", "RequestOutput"),
    ("vllm.CompletionOutput", "vllm.outputs", "CompletionOutput"),
    ("vllm.logprobs.Logprob", "vllm.logprobs", "Logprob"),
    ("vllm.EngineArgs", "vllm.engine.arg_utils", "EngineArgs"),  # where LLM(**kwargs) goes
]
# Module-level Literal aliases / tuples the backend depends on: name -> modules to look in first.
CONSTANTS = {
    "LogprobsMode": ["vllm.config.model"],
    "ModelDType": ["vllm.config.model"],
    "QuantizationMethods": ["vllm.model_executor.layers.quantization"],
    "MaxLoRARanks": ["vllm.config.lora"],
    "PauseMode": ["vllm.v1.engine"],
    "FINISH_REASON_STRINGS": ["vllm.v1.engine"],
    "_SAMPLING_EPS": ["vllm.sampling_params"],  # temperature below it: greedy (n must be 1)
    "_MAX_TEMP": ["vllm.sampling_params"],  # 0 < temperature below it is raised to it
}
VALIDATION = {  # class key -> methods whose raise/assert rules are recorded
    "vllm.SamplingParams": ("vllm.sampling_params", "SamplingParams",
                            ["__post_init__", "_verify_args", "_verify_greedy_sampling"]),
    "vllm.lora.request.LoRARequest": ("vllm.lora.request", "LoRARequest", ["__post_init__"]),
}
EXPORT_MODULES = ["vllm", "vllm.lora.request", "vllm.sampling_params", "vllm.outputs", "vllm.logprobs"]


class Wheel:
    """The .py files of a wheel, parsed on demand (never imported)."""

    def __init__(self, path: Path):
        self.path = path
        self.zip = zipfile.ZipFile(path)
        self.names = set(self.zip.namelist())
        self._trees: dict[str, ast.Module] = {}
        self.read_files: dict[str, str] = {}  # file -> sha256 of what was read

    def file_of(self, module: str) -> str:
        base = module.replace(".", "/")
        for name in (base + ".py", base + "/__init__.py"):
            if name in self.names:
                return name
        raise KeyError(f"{module} not in the wheel")

    def tree(self, module: str) -> tuple[str, ast.Module]:
        name = self.file_of(module)
        if name not in self._trees:
            data = self.zip.read(name)
            self.read_files[name] = hashlib.sha256(data).hexdigest()
            self._trees[name] = ast.parse(data.decode(), filename=name)
        return name, self._trees[name]

    def find_class(self, module: str, cls: str) -> tuple[str, ast.ClassDef]:
        name, tree = self.tree(module)
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == cls:
                return name, node
        raise KeyError(f"class {cls} not in {name}")


def _src(node) -> str | None:
    return None if node is None else ast.unparse(node)


def _params(fn: ast.FunctionDef, drop_self=True) -> list[dict]:
    a = fn.args
    out = []
    positional = [*a.posonlyargs, *a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        kind = "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD"
        out.append({"name": arg.arg, "kind": kind, "default": _src(default), "annotation": _src(arg.annotation)})
    if a.vararg:
        out.append({"name": a.vararg.arg, "kind": "VAR_POSITIONAL", "default": None,
                    "annotation": _src(a.vararg.annotation)})
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        out.append({"name": arg.arg, "kind": "KEYWORD_ONLY", "default": _src(default),
                    "annotation": _src(arg.annotation)})
    if a.kwarg:
        out.append({"name": a.kwarg.arg, "kind": "VAR_KEYWORD", "default": None,
                    "annotation": _src(a.kwarg.annotation)})
    if drop_self and out and out[0]["name"] in ("self", "cls"):
        out = out[1:]
    for p in out:
        p["required"] = p["default"] is None and p["kind"] not in ("VAR_POSITIONAL", "VAR_KEYWORD")
    return out


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    functions = (n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return next((n for n in functions if n.name == name), None)


def _kind_of(cls: ast.ClassDef) -> tuple[str, dict]:
    """('dataclass' | 'msgspec.Struct' | 'class', options)."""
    for d in cls.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if _src(target) in ("dataclass", "dataclasses.dataclass"):
            opts = {k.arg: _src(k.value) for k in d.keywords} if isinstance(d, ast.Call) else {}
            return "dataclass", opts
    if any("Struct" in _src(b) for b in cls.bases):
        return "msgspec.Struct", {k.arg: _src(k.value) for k in cls.keywords}
    return "class", {}


def _field_default(value) -> tuple[str | None, bool]:
    """(default source text, in __init__?) of a dataclass / msgspec field's right-hand side."""
    if value is None:
        return None, True
    if isinstance(value, ast.Call) and _src(value.func) in ("field", "dataclasses.field", "msgspec.field", "Field"):
        kw = {k.arg: k.value for k in value.keywords}
        init = not (kw.get("init") is not None and _src(kw["init"]) == "False")
        if "default" in kw:
            return _src(kw["default"]), init
        if "default_factory" in kw:
            return f"<factory {_src(kw['default_factory'])}>", init
        return None, init
    return _src(value), True


def _fields(cls: ast.ClassDef) -> list[dict]:
    out = []
    for node in cls.body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        if "ClassVar" in _src(node.annotation):
            continue
        default, init = _field_default(node.value)
        out.append({"name": node.target.id, "annotation": _src(node.annotation), "default": default, "init": init})
    return out


def _resolve(wheel: Wheel, default: str | None, depth=0) -> str | None:
    """`ModelConfig.logprobs_mode` -> that field's own default (EngineArgs borrows them), if found."""
    m = re.fullmatch(r"([A-Z]\w*)\.(\w+)", default or "")
    if not m or depth > 3:
        return None
    cls_name, attr = m.groups()
    for name in sorted(n for n in wheel.names if n.startswith("vllm/config/") and n.endswith(".py")):
        module = name[:-3].replace("/", ".").removesuffix(".__init__")
        _, tree = wheel.tree(module)
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == cls_name:
                for f in _fields(node):
                    if f["name"] == attr:
                        return _resolve(wheel, f["default"], depth + 1) or f["default"]
    return None


def struct_record(wheel: Wheel, module: str, cls_name: str) -> dict:
    file, cls = wheel.find_class(module, cls_name)
    kind, options = _kind_of(cls)
    rec = {"source": f"{file}:{cls.lineno}", "kind": kind, "options": options, "bases": [_src(b) for b in cls.bases]}
    init = _method(cls, "__init__")
    if kind == "class" or init is not None:
        rec["params"] = _params(init)
        return rec
    fields = _fields(cls)
    for f in fields:
        resolved = _resolve(wheel, f["default"])
        if resolved is not None:
            f["default_resolved"] = resolved
    rec["non_init_fields"] = [f["name"] for f in fields if not f["init"]]
    kw_only = options.get("kw_only") == "True"
    params = []
    for f in fields:
        if not f["init"]:
            continue
        default = f.get("default_resolved", f["default"])
        params.append({"name": f["name"], "kind": "KEYWORD_ONLY" if kw_only else "POSITIONAL_OR_KEYWORD",
                       "default": f["default"], "annotation": f["annotation"],
                       "required": f["default"] is None and default is None})
        if "default_resolved" in f:
            params[-1]["default_resolved"] = f["default_resolved"]
    rec["params"] = params  # the generated __init__: one per field, in order
    return rec


def callable_record(wheel: Wheel, module: str, cls_name: str, method: str) -> dict:
    file, cls = wheel.find_class(module, cls_name)
    fn = _method(cls, method)
    if fn is None:
        return {"source": file, "missing": True}
    rec = {"source": f"{file}:{fn.lineno}", "params": _params(fn), "returns": _src(fn.returns)}
    doc = ast.get_docstring(fn) or ""
    if method == "__init__" and any(p["kind"] == "VAR_KEYWORD" for p in rec["params"]):
        # Where **kwargs go: LLM passes them on to EngineArgs(**kwargs).
        kwarg = fn.args.kwarg.arg
        calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)
                 and any(k.arg is None and _src(k.value) == kwarg for k in n.keywords)]
        rec["var_keyword_forwarded_to"] = [_src(c.func) for c in calls]
    if method == "sleep":
        rec["levels"] = {m.group(1): " ".join(m.group(2).split())
                         for m in re.finditer(r"Level (\d+): (.*?)(?=- Level|\n\s*mode:|\Z)", doc, re.S)}
    if method == "wake_up":
        m = re.search(r"Values must be in\s*`?\(([^)]*)\)", doc)
        rec["tags"] = re.findall(r'"(\w+)"', m.group(1)) if m else None
    return rec


def constant_record(wheel: Wheel, name: str, modules: list[str]) -> dict:
    candidates = [wheel.file_of(m) for m in modules]
    pattern = re.compile(rf"^{name}\s*[:=]", re.M)
    candidates += sorted(n for n in wheel.names if n.endswith(".py") and n not in candidates
                         and n.startswith("vllm/") and pattern.search(wheel.zip.read(n).decode(errors="replace")))
    for file in candidates:
        module = file[:-3].replace("/", ".").removesuffix(".__init__")
        _, tree = wheel.tree(module)
        for node in tree.body:
            target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
            if not isinstance(target, ast.Name) or target.id != name or node.value is None:
                continue
            value = node.value
            if isinstance(value, ast.Subscript):  # Literal[...]
                value = value.slice
            items = value.elts if isinstance(value, (ast.Tuple, ast.List)) else [value]
            values = [ast.literal_eval(e) for e in items if isinstance(e, ast.Constant)]
            return {"source": f"{file}:{node.lineno}", "values": values}
    raise KeyError(f"{name} not found in the wheel")


def validation_record(wheel: Wheel, module: str, cls_name: str, methods: list[str]) -> list[dict]:
    """Every raise / assert in those methods, with the `if` it sits under: the rules to mirror."""
    _, cls = wheel.find_class(module, cls_name)
    rules = []
    for method in methods:
        fn = _method(cls, method)
        if fn is None:
            continue
        parents = {}
        for node in ast.walk(fn):
            for child in ast.iter_child_nodes(node):
                parents[child] = node
        for node in ast.walk(fn):
            if isinstance(node, ast.Raise) and node.exc is not None:
                cond, up = None, parents.get(node)
                while up is not None and cond is None:
                    cond = _src(up.test) if isinstance(up, ast.If) else None
                    up = parents.get(up)
                msg = node.exc.args[0] if isinstance(node.exc, ast.Call) and node.exc.args else node.exc
                rules.append({"method": method, "line": node.lineno, "if": cond,
                              "raises": _src(getattr(node.exc, "func", node.exc)), "message": _src(msg)})
            elif isinstance(node, ast.Assert):
                rules.append({"method": method, "line": node.lineno, "assert": _src(node.test),
                              "message": _src(node.msg)})
    return sorted(rules, key=lambda r: r["line"])


def exports_record(wheel: Wheel, module: str) -> list[str]:
    _, tree = wheel.tree(module)
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MODULE_ATTRS" for t in targets):
                names.update(ast.literal_eval(node.value))  # vllm's lazy exports
    return sorted(names)


def fetch_wheel(version: str | None, dest: Path) -> Path:
    spec = f"vllm=={version}" if version else "vllm"
    subprocess.run([sys.executable, "-m", "pip", "download", spec, "--no-deps", "--only-binary=:all:",
                    "-d", str(dest)], check=True)
    return next(dest.glob("vllm-*.whl"))


def build_record(wheel_path: Path) -> dict:
    wheel = Wheel(wheel_path)
    sha = hashlib.sha256()
    with open(wheel_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            sha.update(chunk)
    _, version_tree = wheel.tree("vllm._version")
    version = next((ast.literal_eval(n.value) for n in version_tree.body if isinstance(n, ast.Assign)
                    and any(getattr(t, "id", None) == "__version__" for t in n.targets)),
                   wheel_path.name.split("-")[1])
    record = {
        "vllm_version": version,
        "wheel": {"filename": wheel_path.name, "sha256": sha.hexdigest(), "bytes": wheel_path.stat().st_size},
        "how": "python benchmarks/vllm_api.py [--version V | --wheel PATH]: parsed with ast, vLLM not imported",
        "python_used_to_parse": sys.version.split()[0],
        "callables": {key: callable_record(wheel, mod, cls, meth) for key, mod, cls, meth in CALLABLES},
        "classes": {key: struct_record(wheel, mod, cls) for key, mod, cls in STRUCTS},
        "constants": {name: constant_record(wheel, name, mods) for name, mods in CONSTANTS.items()},
        "validation": {key: validation_record(wheel, *spec) for key, spec in VALIDATION.items()},
        "exports": {m: exports_record(wheel, m) for m in EXPORT_MODULES},
    }
    record["source_files_sha256"] = dict(sorted(wheel.read_files.items()))
    return record


def _dump(obj, indent=0) -> str:
    """JSON with one line per flat object (a parameter, a rule): short, and diffs read well."""
    pad = " " * (indent + 1)
    flat = (str, int, float, bool, type(None))
    if isinstance(obj, dict) and obj and not all(isinstance(v, flat) for v in obj.values()):
        items = [f"{pad}{json.dumps(k)}: {_dump(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    if isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        return "[\n" + ",\n".join(pad + _dump(v, indent + 1) for v in obj) + "\n" + " " * indent + "]"
    return json.dumps(obj)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", type=Path, help="a downloaded vllm-*.whl (else it is downloaded)")
    parser.add_argument("--version", help="the vLLM version to download (default: the newest)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="vllm-wheel-") as tmp:
        wheel = args.wheel or fetch_wheel(args.version, Path(tmp))
        record = build_record(wheel)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(_dump(record) + "\n")
    c = record["constants"]
    print(f"vLLM {record['vllm_version']} ({record['wheel']['filename']}, sha256 {record['wheel']['sha256'][:12]}...)"
          f" -> {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    print(f"  logprobs_mode: {c['LogprobsMode']['values']}; bitsandbytes quantization: "
          f"{'bitsandbytes' in c['QuantizationMethods']['values']}; sleep levels: "
          f"{sorted(record['callables']['vllm.LLM.sleep'].get('levels', {}))}")


if __name__ == "__main__":
    main()
