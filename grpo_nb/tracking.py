"""Experiment tracking: each step's record to TensorBoard, W&B or Trackio, completions to a JSON-lines file.

`GRPOConfig.report_to` names the services as transformers and TRL do ("tensorboard", "wandb",
"trackio", a list of them, "all" or "none"); `log_completions_path` writes the sampled
completions to a file, for people who want no service at all. Each backend is one small
object that `train()` adds to its callbacks: it is called with every record (the same plain
dicts the widgets see), logs every `logging_steps` steps and the last, and `close()` flushes
it, also when the run stops on an error. A service's library is imported only when it is
named, so a run that reports nowhere never loads one, and none of them needs a login.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import errno
import html
import importlib
import importlib.util
import json
import math
import os
import re
import secrets
import time
import warnings
from pathlib import Path

from . import atomic_files

TRACKERS = ("tensorboard", "wandb", "trackio")
REPORT_TO = (*TRACKERS, "all", "none")
# What `import` needs per backend, and the package that provides it.
MODULES = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb", "trackio": "trackio"}
FIXED_COLUMNS = ("step", "prompt", "completion", "reward", "advantage", "run_id")


# --------------------------------------------------------------------------------------
# Checking and reading the settings (GRPOConfig.validate words the errors)


def report_to_problem(value) -> str | None:
    """Why `value` is not a valid report_to, or None when it is."""
    allowed = "tensorboard, wandb, trackio (one name or a list), 'all' (those installed) or 'none'"
    if value is None:
        return None
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        return f"expected a name or a list of names: {allowed}"
    for name in names:
        if name not in REPORT_TO:
            close = difflib.get_close_matches(name, REPORT_TO, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else (
                " For another service, pass `callbacks=[fn]` to train(): fn gets every step's record to log yourself.")
            return f"{name!r} is not a tracker grpo-nb reports to; allowed: {allowed}.{hint}"
    if len(names) > 1 and {"all", "none"} & set(names):
        return "'all' and 'none' stand alone, not in a list with other names"
    return None


# W&B's rule for a project name (wandb.sdk.wandb_settings.Settings.validate_project): at most 128 characters, none
# of these. Checked with the config, so that a run reporting to W&B does not stop at the tracker's start.
WANDB_PROJECT_LIMIT = 128
WANDB_PROJECT_FORBIDDEN = "/\\#?%:"


def project_problem(project, report_to) -> str | None:
    """Why W&B would refuse `project` as the run's project, when report_to sends the run there; None otherwise
    (Trackio turns any name into a file name of its own)."""
    if not isinstance(project, str) or "wandb" not in tracker_names(report_to):
        return None
    found = [c for c in WANDB_PROJECT_FORBIDDEN if c in project]
    if not found and len(project) <= WANDB_PROJECT_LIMIT:
        return None
    fixed = (re.sub(r"[/\\#?%:]+", "-", project).strip("-. ")[:WANDB_PROJECT_LIMIT] or "grpo-nb")
    why = (f"it contains {', '.join(map(repr, found))}" if found
           else f"it is {len(project)} characters long")
    return (f"report_to sends the run to W&B, whose project names have at most {WANDB_PROJECT_LIMIT} characters and "
            f"none of {' '.join(WANDB_PROJECT_FORBIDDEN)}, and {why}: pick another, e.g. project={fixed!r}")


def path_problem(value, *, file: bool) -> str | None:
    """Why `value` is not a usable file (or folder) path, or None when it is (or is None)."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        return f"expected a path (a str or pathlib.Path), got {type(value).__name__}"
    text = os.fspath(value)
    if not isinstance(text, str) or not text.strip():
        return "expected a path, got an empty one"
    if (problem := atomic_files.name_problem(text)) is not None:
        return problem
    path = Path(text).expanduser()
    if file and (path.is_dir() or text.endswith(("/", os.sep))):
        return "this is a folder; name a file in it, e.g. a path ending in completions.jsonl"
    if not file and (problem := atomic_files.folder_problem(path)) is not None:
        return f"{problem}; name a folder for TensorBoard's event files"
    return completions_file_problem(path) if file else None


def completions_file_problem(path: Path) -> str | None:
    """Why the run cannot append its completions to `path`, or None: a new or empty file, or one that
    grpo-nb wrote (appending there is meant: several runs share it)."""
    if path.is_symlink():
        return (f"it is a link (to {os.readlink(path)}), and grpo-nb appends only to the file named, never "
                f"through a link: pass the path of the file itself")
    if path.exists() and not path.is_file():
        return "this is not a file (a device, a pipe or a socket); name a file, e.g. 'completions.jsonl'"
    if path.is_file() and path.stat().st_size and not written_by_grpo_nb(path):
        return (f"this file holds other data: its first line is not a completion row grpo-nb writes (a JSON "
                f"object with {', '.join(ROW_COLUMNS)}), and appending would mix rows into it. Name a new file, "
                f"e.g. 'completions.jsonl'")
    return None


# The columns every completion row has (CompletionsFile adds the run_id): what tells a file of them.
ROW_COLUMNS = ("step", "prompt", "completion", "reward", "run_id")


def written_by_grpo_nb(path: Path) -> bool:
    """`path` is a completions file a run wrote: its first line is a JSON object with a completion row's
    columns (a run_id among them, as text)."""
    if not atomic_files.regular_file(path):  # a pipe would hang the read; a link is not the file named
        return False
    try:
        with atomic_files.open_to_read(path) as f:
            row = json.loads(f.readline(64 * 2**20))  # a bound: a file of another kind may have no line breaks
    except (OSError, ValueError, RecursionError):  # not readable, not JSON, not text, nested too deep
        return False
    return isinstance(row, dict) and isinstance(row.get("run_id"), str) and all(c in row for c in ROW_COLUMNS)


def tracker_names(report_to) -> list[str]:
    """report_to as a list of backends: 'none' (or None) is none, 'all' those installed (transformers' meaning)."""
    names = [] if report_to is None else [report_to] if isinstance(report_to, str) else list(report_to)
    if names == ["all"]:
        return [n for n in TRACKERS if importlib.util.find_spec(n) is not None]
    return [n for n in dict.fromkeys(names) if n != "none"]


# What new_run_id makes. A resumed run's id comes from its checkpoint, which may be someone else's: it names a
# folder, a W&B run and a Trackio run, so nothing else (a path, "../..") may pass as one.
RUN_ID = re.compile(r"[0-9]{8}-[0-9]{6}-[0-9a-f]{6}")


def new_run_id() -> str:
    """A fresh run's id (time and a random suffix): its TensorBoard folder, W&B id and Trackio name.
    A run resumed in its own output_dir keeps its id, from the checkpoint, so each service appends to the
    same run; one resumed into another output_dir (a fork, e.g. a sweep from one checkpoint) gets a new one."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def run_folder(run_name: str | None, run_id: str) -> str:
    """A folder name for the run: its id, after its name when it has one (made safe for a path)."""
    if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
        raise ValueError(f"run_id={run_id!r} is not a run id new_run_id() makes (e.g. {new_run_id()!r}); it names "
                         f"the run's folder, so nothing else (a path, '..') may pass as one.")
    if not run_name:
        return run_id
    return re.sub(r"[^\w.-]+", "-", run_name).strip("-") + "-" + run_id


# --------------------------------------------------------------------------------------
# What a record becomes


def scalars(record: dict) -> dict[str, float]:
    """Every number in a record, nested names joined by '/': loss, rewards/<function>/mean,
    memory/<category> (bytes), metrics/<name> (reward functions' log_metric), ... The step is the
    x axis; samples go to the completions table."""
    out = {}

    def walk(name, value):
        if isinstance(value, (bool, int, float)):
            out[name] = float(value)
        elif isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{name}/{key}", inner)

    for key, value in record.items():
        if key not in ("step", "samples"):
            walk(key, value)
    return out


def _finite(value):
    """JSON has no NaN: a reward function's "no score" (NaN) is written as null."""
    return value if not isinstance(value, float) or math.isfinite(value) else None


def _cell(value):
    """A value a reward function gave log_extra, as JSON and every tracker's table can hold it."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    return _finite(value) if isinstance(value, float) else str(value)


def completion_rows(record: dict) -> list[dict]:
    """One row per sampled completion: step, prompt, completion, each reward function's score, the
    weighted total (`reward`), the advantage, and the columns reward functions added with log_extra
    (TRL's completions table). Rows follow the record's samples, so their number is
    `num_completions_to_print` and there are none with `log_completions=False`."""
    rows = []
    samples = record.get("samples") or []
    prefilled = any(sample.get("prefill") for sample in samples)  # one set of columns for the step's rows
    for sample in samples:
        row = {"step": record["step"], "prompt": sample["prompt"]}
        if prefilled:  # the start of the answer the prompt wrote, which the completion continues
            row["prefill"] = sample.get("prefill") or ""
        row["completion"] = sample["completion"]
        for name, value in sample.get("rewards", {}).items():
            row[f"{name} (reward)" if name in row or name in FIXED_COLUMNS else name] = _finite(value)
        row["reward"] = _finite(sample.get("reward"))
        if "advantage" in sample:
            row["advantage"] = _finite(sample["advantage"])
        for column, value in (sample.get("extra") or {}).items():
            row[f"{column} (extra)" if column in row or column in FIXED_COLUMNS else column] = _cell(value)
        rows.append(row)
    return rows


def settings(config) -> dict:
    """The config as plain JSON values (a generation_kwargs entry of any type becomes its text)."""
    return json.loads(json.dumps(dataclasses.asdict(config), default=str))


# What TensorBoard's markdown would read as inline markup in a cell, as character references: a model's "2*3*4"
# is not italics, "![](url)" no image that loads, a backslash stays, and "|" does not end the cell. An underscore
# between two letters or digits ("count_w7") can neither open nor close emphasis, and stays as it is.
_MARKDOWN_TEXT = str.maketrans({c: f"&#{ord(c)};" for c in "\\`*[]|"})
_EMPHASIS_UNDERSCORE = re.compile(r"(?<![^\W_])_|_(?![^\W_])")


def markdown_cell(value) -> str:
    """A value as the text of one markdown table cell: shown as written (HTML escaped: <answer> tags stay
    visible), on one row (line breaks, "\\r" from a Windows file included, as <br>)."""
    text = f"{value:.4g}" if isinstance(value, float) else "" if value is None else str(value)
    text = html.escape(text.replace("\r\n", "\n").replace("\r", "\n")).translate(_MARKDOWN_TEXT)
    return _EMPHASIS_UNDERSCORE.sub("&#95;", text).replace("\n", "<br>")


def markdown_table(rows: list[dict]) -> str:
    """Rows as a markdown table for TensorBoard's text tab (its renderer keeps only safe HTML); column names
    and cells show their text as written."""
    columns = list(rows[0])
    lines = ["| " + " | ".join(map(markdown_cell, columns)) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(markdown_cell(row.get(c)) for c in columns) + " |" for row in rows])


# --------------------------------------------------------------------------------------
# The backends


def need(name: str):
    """The module a backend needs, imported now; if missing, an error that says how to install it, and if installed
    but failing to import (a dependency missing or of another version), one that says so: `pip install` would
    answer "already satisfied"."""
    try:
        return importlib.import_module(MODULES[name])
    except ImportError as err:
        try:
            installed = importlib.util.find_spec(name) is not None  # the package (tensorboard's too) is there
        except (ImportError, ValueError):  # a parent that fails to import; a module without a spec
            installed = False
        if installed:
            raise ImportError(f"GRPOConfig.report_to={name!r} needs the {name} package, which is installed but "
                              f"failed to import ({type(err).__name__}: {err}): a dependency of it is missing or of "
                              f"a version it does not work with. Repair the install (e.g. `pip install --upgrade "
                              f"{name}`, or install the module the error names), or leave {name!r} out of "
                              f"report_to.") from err
        raise ImportError(f"GRPOConfig.report_to={name!r} needs the {name} package, which is not installed "
                          f"({err}). Install it with `pip install {name}`, or leave {name!r} out of report_to."
                          ) from err


def start_failure(tracker: str, err: Exception) -> RuntimeError:
    """What a service library's own start (wandb.init, trackio.init, ...) raised - a Space or entity that does not
    exist, no network, a bad setting in the environment - as an error naming the tracker and report_to."""
    return RuntimeError(f"GRPOConfig.report_to={tracker!r}: {tracker} could not start its run ({type(err).__name__}: "
                        f"{err}). Fix the service's settings (its environment variables, project, login), or leave "
                        f"{tracker!r} out of report_to; the error it raised is chained above.")


@contextlib.contextmanager
def starting(tracker: str):
    """Around a service library's own start: its failure as start_failure's error, the library's chained."""
    try:
        yield
    except Exception as err:
        raise start_failure(tracker, err) from err


class Tracker:
    """One backend: called with every record, it logs every `logging_steps` steps and the last one."""
    name = "tracker"

    def __init__(self, config):
        self.logging_steps, self.max_steps = config.logging_steps, config.max_steps
        self.failed = self.logged = False

    def __call__(self, record: dict) -> None:
        step = record["step"]
        if self.failed or not (step % self.logging_steps == 0 or step == self.max_steps):
            return
        try:
            self.log(record)
        except Exception as err:  # a broken tracker must not cost the run: the history keeps every number
            self.failed = True
            warnings.warn(f"{self.name} failed at step {step} ({err!r}) and logs nothing more in this run; "
                          f"training goes on, and the history returned by train() keeps every record.", stacklevel=2)

    def log(self, record: dict) -> None:
        raise NotImplementedError

    def close(self, error=None) -> None:
        """Flush and close (`error`: what stopped the run, or None)."""

    def discard(self) -> None:
        """After close(), when the run never started (another tracker failed to): remove what this one made."""


class TensorBoard(Tracker):
    """Scalars and a completions table (the text tab) in a folder of the run's own, <logging_dir>/<run>, by default
    output_dir/runs/<run>."""
    name = "report_to='tensorboard'"

    def __init__(self, config, run_id: str, resumed_step: int = 0):
        super().__init__(config)
        writer = need("tensorboard").SummaryWriter
        # Each run in a folder of its own, also in a logging_dir several runs share (HF's habit, "./logs"):
        # TensorBoard shows each folder as a run, and the purge start below hides only this run's own steps.
        # A run resumed in place keeps its id, so it appends to its folder. The name cut to a length any disk
        # takes; the run id keeps the folder unique.
        runs = default_runs_folder(config.output_dir) if config.logging_dir is None else Path(
            config.logging_dir).expanduser()
        self.log_dir = runs / run_folder(config.run_name and config.run_name[:48], run_id)
        # purge_step writes a session start. TensorBoard takes every start after a folder's first as a restart
        # and hides what was logged from that step on: a run resumed at step k hides what its first attempt
        # logged after k (it was killed before a checkpoint). So a fresh run writes its start too, at step 0.
        # made by this run (not a resumed run's): the one folder discard() may remove
        self.made = not resumed_step and not self.log_dir.exists()
        try:
            self.writer = writer(log_dir=str(self.log_dir), purge_step=resumed_step + 1 if resumed_step else 0)
        except OSError as err:  # e.g. a file where one of its parent folders would be: before any step
            option = "logging_dir" if config.logging_dir is not None else "output_dir"
            raise OSError(f"GRPOConfig.{option}={getattr(config, option)!r}: TensorBoard cannot make its folder "
                          f"{self.log_dir} ({err.strerror or err}): pass a folder you can write to.") from err
        except Exception as err:
            raise start_failure("tensorboard", err) from err
        if not resumed_step:
            text = json.dumps(settings(config), indent=1)  # indented: a code block in the text tab
            self.writer.add_text("config", "\n".join("    " + line for line in text.splitlines()), 0)

    def log(self, record):
        step = record["step"]
        self.logged = True
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, step)
        rows = completion_rows(record)
        if rows:
            self.writer.add_text("completions", markdown_table(rows), step)
        self.writer.flush()  # a killed process keeps what was logged (the writer would wait up to 2 minutes)

    def close(self, error=None):
        self.writer.close()

    def discard(self):
        """The run's folder removed again, when this run made it and logged no step: a tracker after this one failed
        to start, and an event file holding only the config would show in TensorBoard as a run of its own."""
        if self.made and not self.logged:
            with contextlib.suppress(OSError):
                atomic_files.remove_folder(self.log_dir)


def default_runs_folder(output_dir) -> Path:
    """output_dir/runs, TensorBoard's default folder, made here as a real folder: SummaryWriter creates its
    run folder inside, following any link, so a link (or a file) planted at `runs` is refused by name
    (train() refuses it before the run: output_checks.check_output_dir; this is for one planted meanwhile)."""
    runs = Path(output_dir).expanduser() / "runs"
    with contextlib.suppress(FileExistsError):
        runs.mkdir(parents=True)
    if runs.is_symlink() or not runs.is_dir():
        raise ValueError(f"output_dir={str(output_dir)!r}: runs is {'a link' if runs.is_symlink() else 'not a folder'}"
                         f", where TensorBoard's event files go by default, and grpo-nb never writes through a "
                         f"link: remove it, or set GRPOConfig.logging_dir to another folder.")
    return runs


def wandb_has_credentials(wandb) -> bool:
    """Whether W&B finds an API key without asking for one (environment, ~/.netrc, its settings)."""
    try:
        return bool(wandb.login(prompt=False, verify=False))
    except TypeError:  # a wandb older than login(prompt=...): look where it keeps keys
        import netrc

        try:
            return bool(os.environ.get("WANDB_API_KEY")) or netrc.netrc().authenticators("api.wandb.ai") is not None
        except (OSError, netrc.NetrcParseError):
            return False


class RunTracker(Tracker):
    """W&B and Trackio share a run API: run.log(dict, step=) and a Table type in `self.library`."""

    def log(self, record):
        data = scalars(record)
        rows = completion_rows(record)
        if rows:
            columns = list(rows[0])
            data["completions"] = self.library.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])
        self.run.log(data, step=record["step"])


class Wandb(RunTracker):
    """Scalars and a `completions` table in a W&B run; offline (files under ./wandb, `wandb sync` later)
    when WANDB_MODE=offline or when no API key is set up, so a run never waits for a login."""
    name = "report_to='wandb'"

    def __init__(self, config, run_id: str, resumed_step: int = 0):
        super().__init__(config)
        self.library = wandb = need("wandb")
        self.own = wandb.run is None  # a run the user started with wandb.init() (any mode) is theirs to finish
        if not self.own:
            self.run = wandb.run
            with starting("wandb"):
                self.run.config.update(settings(config), allow_val_change=True)
            return
        # WANDB_MODE and WANDB_DIR are passed on explicitly: wandb reads the environment once per process, and
        # a notebook may set them after an earlier run. "dryrun" and "run" are WANDB_MODE's older names.
        mode = os.environ.get("WANDB_MODE") or None
        mode = {"dryrun": "offline", "run": "online"}.get(mode, mode)
        if mode is None and not wandb_has_credentials(wandb):
            mode = "offline"
            warnings.warn("report_to='wandb': no W&B API key is set up (WANDB_API_KEY or `wandb login`), so this run "
                          "logs offline to ./wandb (WANDB_DIR moves it); `wandb sync <its folder>` uploads it later.",
                          stacklevel=4)
        with starting("wandb"):
            self.run = wandb.init(project=config.project or os.environ.get("WANDB_PROJECT") or "grpo-nb",
                                  name=config.run_name, id=run_id, resume="allow", mode=mode,
                                  dir=os.environ.get("WANDB_DIR"), config=settings(config))

    def close(self, error=None):
        if self.own:
            self.run.finish(exit_code=0 if error is None else 1)


class Trackio(RunTracker):
    """Scalars and a `completions` table in a Trackio run, stored locally (TRACKIO_DIR) unless
    TRACKIO_SPACE_ID names a Space; `trackio show` opens its dashboard."""
    name = "report_to='trackio'"

    def __init__(self, config, run_id: str, resumed_step: int = 0):
        super().__init__(config)
        self.library = trackio = need("trackio")
        # embed=False: in a notebook, train()'s own dashboard is the live view; no second web server is started.
        with starting("trackio"):
            self.run = trackio.init(project=config.project or "grpo-nb", name=config.run_name or run_id,
                                    config=settings(config), resume="allow" if resumed_step else "never",
                                    embed=False)

    def close(self, error=None):
        self.run.finish()


class CompletionsFile(Tracker):
    """`log_completions_path`: one JSON object per line and completion (see `completion_rows`), with
    the run's id; the file is appended to, so several runs can share it. It is created with the first
    row: a run that stops before logging leaves no empty file behind (in output_dir, one would make
    the folder look like someone else's to the next run)."""
    name = "log_completions_path"

    def __init__(self, config, run_id: str, resumed_step: int = 0):
        super().__init__(config)
        self.path, self.run_id = atomic_files.expand(config.log_completions_path), run_id
        if (problem := completions_file_problem(self.path)) is not None:  # checked again: it may have changed
            raise ValueError(f"GRPOConfig.log_completions_path={str(self.path)!r} is invalid: {problem}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resumed_step and self.path.exists():
                drop_lines_after(self.path, run_id, resumed_step)
            if not os.access(self.path if self.path.exists() else self.path.parent, os.W_OK):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self.path))
        except OSError as err:
            blocker = next((p for p in self.path.parents if p.exists()), None)  # the nearest existing parent
            why = f"{blocker} is a file" if blocker is not None and blocker.is_file() else err.strerror or err
            raise OSError(f"GRPOConfig.log_completions_path={str(self.path)!r} cannot be written ({why}): "
                          f"pass a file in a folder you can write to.") from err

    def log(self, record):
        rows = completion_rows(record)
        if not rows:
            return
        # Opened for each step's rows, not kept open: another run sharing the file that resumes rewrites it by a
        # rename (drop_lines_after), and a handle kept open would append to the old file, lost from then on. (The
        # step's rows go in one write.)
        text = "".join(json.dumps({**row, "run_id": self.run_id}, ensure_ascii=False) + "\n" for row in rows)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (half an emoji from a reward or a tool): escaped, as JSON can
            text = "".join(json.dumps({**row, "run_id": self.run_id}) + "\n" for row in rows)
        with atomic_files.open_to_append(self.path) as file:  # a link put there meanwhile is refused
            file.write(text)


def drop_lines_after(path: Path, run_id: str, step: int) -> None:
    """Resuming at `step`: remove this run's lines from later steps (logged before it was killed,
    then trained again), so the file matches the history. Other runs' lines stay as they are."""
    kept = []
    # Rows end at "\n" only: U+2028, U+0085 and the like are written as they are inside a row's text (splitlines()
    # would break there), and reading as bytes keeps a "\r" as it was.
    for line in path.read_bytes().decode("utf-8").split("\n"):
        try:
            row = json.loads(line)
            later = row.get("run_id") == run_id and row.get("step", 0) > step
        except (ValueError, AttributeError, TypeError):
            later = False
        if not later:
            kept.append(line)
    atomic_files.write_file(path, lambda tmp: tmp.write_bytes("\n".join(kept).encode("utf-8")))


BACKENDS = {"tensorboard": TensorBoard, "wandb": Wandb, "trackio": Trackio}


def start_trackers(config, run_id: str, resumed_step: int = 0) -> list[Tracker]:
    """The backends `config` asks for, started (their libraries imported here), as train() callbacks.

    `resumed_step` > 0: the run continues from that step's checkpoint and each backend appends to
    the run `run_id` names. If one fails to start, those already started are closed again."""
    kinds = [BACKENDS[name] for name in tracker_names(config.report_to)]
    if config.log_completions_path is not None:
        kinds.append(CompletionsFile)
    started = []
    try:
        for kind in kinds:
            started.append(kind(config, run_id, resumed_step))
    except BaseException as err:
        close_trackers(started, err)
        for tracker in started:
            tracker.discard()
        raise
    return started


def close_trackers(trackers, error=None) -> None:
    """Flush and close each backend; one failing neither masks the run's outcome nor leaves the others open."""
    for tracker in trackers:
        try:
            tracker.close(error)
        except Exception as close_error:
            warnings.warn(f"{tracker.name} failed to close: {close_error!r}", stacklevel=2)
