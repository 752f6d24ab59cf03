"""Resuming: a checkpoint read, checked for what its weights mean against this run, then put in place.

`read_training_checkpoint` reads and checks everything a checkpoint folder holds (`checkpoint_schema`), and
refuses one whose weights mean something else on this model: trained on another base model (`run_identity`: a
fingerprint of the base weights, kept in every checkpoint), with another LoRA setup, or fully fine-tuned under
another config. `restore_state` puts it in place once it fits the run's optimizer, schedule and data;
`warn_changed_settings` names the settings, reward functions and data that differ from the checkpoint's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import warnings
from pathlib import Path

import torch

from .checkpoint_schema import FLOAT_DTYPES, CheckpointError, check_fits_run, check_trainer_state, check_weights, is_plain, need
from .checkpointing import (_CHECKPOINT, LEGACY_TRAINER_STATE, SETTINGS, TRAINABLE, TRAINER_STATE, TRAINER_TENSORS,
                            _foreign, _json_object, _jsonable, _refusing, checkpoints, finished_result, load_tensors,
                            read_file, read_state, set_rng_state, without_checkpoints)
from . import parking
from .arguments import short_repr
from .optim import warmup_steps
from .rollout import RolloutEngine, rollout_state
from .distributed import like, load_optimizer_state


def read_training_checkpoint(path, model) -> tuple[dict, dict, dict | None]:
    """(the trainer state, the trainable weights, the run's settings: its grpo_config.json, None when it has
    none) saved in `path`, each checked against what grpo-nb writes (checkpoint_schema) and the weights against
    `model`, its LoRA setup and its base model included; nothing is loaded into anything yet."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"Cannot resume: {path} is not a folder. Pass a checkpoint-<step> folder or True.")
    if (path / LEGACY_TRAINER_STATE).exists() and not (path / TRAINER_STATE).exists():
        raise ValueError(
            f"Cannot resume from {path}: it was written by an older grpo-nb, which stored the trainer state as a "
            f"pickle ({LEGACY_TRAINER_STATE}); loading a pickle can run any code it holds, so grpo-nb does not. "
            f"If you wrote it yourself and trust it, convert it once with "
            f"grpo_nb.checkpointing.convert_legacy_checkpoint({str(path)!r}), then resume.")
    missing = [name for name in (TRAINER_STATE, TRAINER_TENSORS, TRAINABLE) if not (path / name).exists()]
    if missing:
        inside, beside = checkpoints(path), [p.name for p in checkpoints(path.parent) if p != path]
        instead = (f"pass one of the checkpoints in it ({', '.join(str(p) for p in inside[-3:])}), or True with "
                   f"output_dir={str(path)!r} to continue from its newest" if inside else
                   f"resume from one of the checkpoints beside it ({', '.join(beside)})" if beside else
                   "pass a checkpoint-<step> folder a train() run wrote into its output_dir")
        finished = f" {without_checkpoints(path)}" if finished_result(path) and not (inside or beside) else ""
        raise ValueError(f"Cannot resume from {path}: it is not a grpo-nb training checkpoint (missing "
                         f"{', '.join(missing)}): {instead}.{finished}")
    name = TRAINABLE
    try:
        tensors = load_tensors(path / TRAINABLE)
        name = f"{TRAINER_STATE} / {TRAINER_TENSORS}"
        state = read_state(path)
        name = SETTINGS
        settings = json.loads(read_file(path / SETTINGS)[0]) if (path / SETTINGS).exists() else None
    except CheckpointError:
        raise
    except Exception as err:  # also RecursionError: JSON nested deeper than Python's stack
        raise _foreign(path, name, f"could not be read, {type(err).__name__}: {err}") from err
    folder = adapter_folder(path, model)
    adapter = _json_object(folder / "adapter_config.json")  # peft's, beside the adapter's weights
    adapter = adapter if is_plain(adapter) else {}
    params = dict(model.named_parameters())
    expected = {name for name, p in params.items() if p.requires_grad}
    # before the tensors' names: it names the setting that differs; target_modules by the layers LoRA sits on
    check_same_adapter(path, adapter, model, same_layers=set(tensors) == expected)
    if set(tensors) != expected:
        unknown, absent = sorted(set(tensors) - expected), sorted(expected - set(tensors))
        raise ValueError(
            f"Cannot resume from {path}: it was written for another model or LoRA setup "
            f"({len(unknown)} tensors this model does not train, e.g. {unknown[:2]}; {len(absent)} trained tensors "
            f"missing, e.g. {absent[:2]}). Load the same model with the same lora_rank and target_modules."
        )
    for name, tensor in tensors.items():
        if params[name].shape != tensor.shape:
            raise ValueError(f"Cannot resume from {path}: {name} has shape {tuple(tensor.shape)} in the "
                             f"checkpoint but {tuple(params[name].shape)} in the model.")
    with _refusing(path, TRAINABLE):
        check_weights(tensors, params)
    with _refusing(path, TRAINER_STATE):
        check_trainer_state(state)
        # checkpoint-<n> holds step n: a copy or a renamed folder would be taken for another step (resume=True
        # picks the highest number, rotation keeps the highest numbers)
        number = _CHECKPOINT.match(path.name)
        need(number is None or int(number.group(1)) == state["step"], "step",
             f"{number and int(number.group(1))}, the step its folder's name says (a checkpoint copied or renamed "
             f"to another step's name)", state["step"])
    with _refusing(path, SETTINGS):
        need(settings is None or (isinstance(settings, dict) and is_plain(settings)), "the settings",
             "a JSON object of GRPOConfig's fields", settings)
    check_same_base(path, state.get("identity", {}).get("base"), adapter, model, folder)
    return state, tensors, settings


def adapter_folder(path: Path, model) -> Path:
    """Where peft saved the model's adapter in `path`: `path` itself, or its subfolder named after the adapter when
    that is not "default" (get_peft_model(..., adapter_name="grpo") saves into <path>/grpo)."""
    name = getattr(model, "active_adapter", None) if getattr(model, "active_peft_config", None) is not None else None
    if isinstance(name, str) and name != "default" and (path / name / "adapter_config.json").exists() \
            and not (path / "adapter_config.json").exists():
        return path / name
    return path


def load_weights(model, weights: dict) -> None:
    """Copy checked trainable weights (read_training_checkpoint's) into `model`."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(like(params[name], tensor))  # a sharded parameter takes its shard


def load_training_checkpoint(path, model) -> dict:
    """Load the trainable weights into `model` once everything in `path` is checked; return the trainer state."""
    state, weights, _ = read_training_checkpoint(path, model)
    load_weights(model, weights)
    return state


def restore_state(path, state, weights, *, model, optimizer, scheduler, scaler, prompts, rollout, batch_type) -> None:
    """Check a checkpoint's state (read_training_checkpoint's) against this run - its dataset, optimizer,
    schedule, rollout, vocabulary and the pending batch's fields (`batch_type`, step.StepBatch) - and only
    then put the weights, optimizer, schedule, random states and data position in place. `rollout`: the run's
    engine when it keeps a random state of its own (a grpo_nb.rollout.ResumableRollout), else None."""
    order = state["sampler"]["order"]
    if order and max(order) >= len(prompts.dataset):
        raise ValueError(f"The checkpoint was trained on a dataset with at least {max(order) + 1} rows and is part "
                         f"way through an epoch of it; this dataset has {len(prompts.dataset)}. Resume with the "
                         f"same dataset (its order is part of the checkpoint), or start a new run in a new "
                         f"output_dir for another dataset.")
    saved = state["rollout"]
    if isinstance(saved, dict) and rollout is not None and set(saved) != set(own := rollout.state_dict()):
        raise ValueError(f"Cannot resume from {path}: it was trained with another rollout, whose random state (keys "
                         f"{sorted(map(str, saved))[:6]}) this run's {type(rollout).__name__} (keys {sorted(own)}) "
                         f"cannot take. Pass the rollout= the run was trained with (the same function or engine), so "
                         f"that the resumed run draws what the unbroken one would.")
    with _refusing(Path(path), TRAINER_STATE):
        check_fits_run(state, optimizer=optimizer, scheduler=scheduler, rollout=rollout, batch_type=batch_type,
                       vocab_size=_vocab_size(model), native_rollout=isinstance(rollout, RolloutEngine),
                       model=model)
    load_weights(model, weights)
    load_optimizer_state(optimizer, state["optimizer"])
    parking.park(optimizer)  # loaded onto the device; a parking run keeps it in host memory until its first update
    scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])
    prompts.load_state_dict(state["sampler"])
    warn_other_world_size(path, state["sampler"].get("world_size"), prompts.world.size, prompts.rows_per_batch)
    if state["rollout"] is not None and rollout is not None:
        rollout.load_state_dict(state["rollout"])
    set_rng_state(state["rng"])


def warn_other_world_size(path, saved: int | None, now: int, prompts_per_rank: int) -> None:
    """Each process draws prompts_per_rank prompts a step, so the global batch is that times the processes: a
    checkpoint trained by another number of them goes on with another batch (and, for the losses that normalise
    per sequence, another gradient scale), as another batch size would (warn_changed_settings). `saved`: the
    checkpoint's number (None in checkpoints written before it was kept)."""
    if saved is None or saved == now:
        return
    per = lambda n: "process" if n == 1 else "processes"  # noqa: E731
    warnings.warn(f"Resuming from {path}, which {saved} {per(saved)} trained, with {now} {per(now)}: each step now "
                  f"draws {prompts_per_rank * now} prompts (was {prompts_per_rank * saved}; {prompts_per_rank} per "
                  f"process), so the global batch changed mid-run and the run will not equal an unbroken one. To "
                  f"keep the batch, resume with {saved} {per(saved)}, or scale per_device_train_batch_size x "
                  f"gradient_accumulation_steps by {saved}/{now}.", stacklevel=5)


def _vocab_size(model) -> int | None:
    """The rows of the model's input embedding: token ids must be below it."""
    try:
        return model.get_input_embeddings().weight.shape[0]
    except (AttributeError, NotImplementedError):
        return None


# Fields a resumed run may change without a word: where it stops, how it logs and saves.
RESUMABLE_CHANGES = {"max_steps", "logging_steps", "save_steps", "save_total_limit", "num_completions_to_print",
                     "sample_history_steps", "report_to", "run_name", "project", "logging_dir",
                     "log_completions", "log_completions_path", "output_dir", "reward_timeout", "max_nonfinite_steps",
                     "max_unscored_steps", "eval_strategy", "eval_steps", "per_device_eval_batch_size",
                     "eval_on_start", "park_optimizer_state"}
# (the eval_* settings measure the run, they do not change it; parking moves the optimizer's state, not its values)


# Settings a resume cannot apply: the checkpoint's state fixes them.
NOT_APPLIED = {"seed": "a resumed run continues the checkpoint's random streams (sampling, data order), so it draws "
                       "what the unbroken run would. Start a new run, without resume_from_checkpoint, for another seed"}


def warn_changed_settings(path: Path, saved: dict | None, config, *, state: dict | None = None,
                          identity: dict | None = None, reward_names: list[str] | None = None,
                          decided: frozenset = frozenset()) -> None:
    """A resume with other training settings (`saved`: the checkpoint's grpo_config.json), reward functions or data
    (`state`: its trainer state, against this run's `identity` and `reward_names`) runs on under the new ones, so
    the result differs from an unbroken run's: say which changed, and which a resume does not apply (the seed).
    `decided`: the settings grpo-nb decided for this run where the user left them to it (cpu_rollout_dtype="auto"):
    a change there is this machine's or this version's decision, not the user's, and the message says so."""
    if saved is not None:  # a checkpoint without its settings: nothing to compare with
        now = json.loads(json.dumps(_jsonable(dataclasses.asdict(config))))  # as saved: lists for tuples
        differ = [k for k in sorted(now) if k in saved and saved[k] != now[k] and k not in RESUMABLE_CHANGES
                  and not (k == "warmup_ratio" and _same_warmup(saved, now))]
        described = {k: f"{k} {_short(saved[k])} -> {now[k]!r}" for k in differ}
        changed = [described[k] for k in differ if k not in NOT_APPLIED.keys() | decided]
        auto = [described[k] for k in differ if k in decided]
        if auto:
            keep = ", ".join(f"{k}={saved[k]!r}" for k in differ if k in decided)
            warnings.warn(f"Resuming from {path}, whose run sampled its rollouts otherwise than this one will: "
                          f"{'; '.join(auto)}. You left these to grpo-nb (cpu_rollout_dtype='auto' and the rollout "
                          f"correction it implies), and it decided otherwise here than for the checkpoint's run (another "
                          f"CPU, another model size, or a grpo-nb from before 'auto'). The run continues with this "
                          f"machine's decision; to continue exactly as the checkpoint's run sampled, pass {keep}.",
                          stacklevel=4)
        if changed:
            warnings.warn(f"Resuming from {path} with settings that differ from the ones it was trained with: "
                          f"{'; '.join(changed)}. The run continues under the new ones (the optimizer's settings "
                          f"too, and the learning rate follows the new schedule from this step), so it will not "
                          f"equal an unbroken run.", stacklevel=4)
        for k in (k for k in differ if k in NOT_APPLIED):
            warnings.warn(f"Resuming from {path} with {k} {_short(saved[k])} -> {now[k]!r}, which a resume does not "
                          f"apply: {NOT_APPLIED[k]}.", stacklevel=4)
    inputs = changed_inputs(state, identity, reward_names) if state is not None else []
    if inputs:
        warnings.warn(f"Resuming from {path} with other inputs than it was trained with: {'; '.join(inputs)}. The "
                      f"run trains on the new ones from step {state['step'] + 1}: its history's rewards before and "
                      f"after measure different things, and it will not equal an unbroken run. Resume with the "
                      f"checkpoint's to continue that run, or start a new run in a new output_dir.", stacklevel=4)


def _same_warmup(saved: dict, now: dict) -> bool:
    """The same count of warmup steps under another warmup_ratio: a trl.GRPOConfig's warmup_steps, read against
    another max_steps (train(config=trl_config, max_steps=...)), is the same warmup, not a changed setting."""
    try:
        return warmup_steps(saved["warmup_ratio"], saved["max_steps"]) == warmup_steps(now["warmup_ratio"],
                                                                                    now["max_steps"])
    except (KeyError, TypeError, ValueError, OverflowError):  # a hand-edited grpo_config.json: compared as values
        return False


def changed_inputs(state: dict, identity: dict | None, reward_names: list[str] | None) -> list[str]:
    """What this run trains on that differs from the checkpoint's (`state`, checked): the reward functions, by the
    names its records hold; the dataset, by its size and a digest of a few rows; the tokens its prompts become."""
    changes = []
    before = state["history"][-1].get("rewards") if state["history"] else None
    if isinstance(before, dict) and reward_names is not None and list(before) != list(reward_names):
        changes.append(f"reward functions {_short(list(before))} -> {list(reward_names)!r}")
    if "identity" in state and identity is not None:  # the tools and environments (none: a run without)
        before, after = dict(state["identity"].get("agent") or {}), dict(identity.get("agent") or {})
        if "schemas" not in before:  # a checkpoint from before the schemas were recorded: names only
            after.pop("schemas", None)
        order = before.get("order")  # absent in older checkpoints (not checked by checkpoint_schema: checked here)
        if not (isinstance(order, list) and len(order) <= 4096
                and all(isinstance(v, str) and len(v) <= 4096 for v in order)):
            before.pop("order", None)
            after.pop("order", None)
        if before != after:
            changes.append(_agent_change(before, after))
    saved, now = state.get("identity", {}).get("dataset"), (identity or {}).get("dataset")
    if saved and now:
        if saved["rows"] != now["rows"]:
            changes.append(f"a dataset of {now['rows']} rows (it was trained on {saved['rows']}; the data order "
                           f"continues the checkpoint's epoch)")
        elif None not in (saved["rows_digest"], now["rows_digest"]) and saved["rows_digest"] != now["rows_digest"]:
            changes.append(f"another dataset of the same size ({now['rows']} rows, other contents, or the same rows "
                           f"in another order: the rest of the checkpoint's epoch then takes other rows, some again, "
                           f"some never; rows are compared by a sample of 9)")
        elif (None not in (saved["prompts_digest"], now["prompts_digest"])
              and saved["prompts_digest"] != now["prompts_digest"]):
            changes.append("prompts that become other tokens (another chat template or tokenizer)")
    return changes


def _agent_change(before: dict | None, after: dict | None) -> str:
    """A resume's other tools / environments, said. The checkpoint's pending batch (num_iterations) is still
    trained on: its tokens, masks and advantages are whole, the tools' parts already masked out."""
    def shown(agent):
        if not agent:
            return "no tools"
        envs = f", environments {agent['environments']}" if agent.get("environments") else ""
        return f"tools {agent.get('tools')}{envs}"

    change = f"{shown(before)} -> {shown(after)}"
    if before and after and shown(before) == shown(after):  # the same names: a tool's arguments or description
        other = sorted(n for n in after.get("schemas", {}) if before.get("schemas", {}).get(n) != after["schemas"][n])
        changes = [f"tools of the same names whose arguments or descriptions changed ({', '.join(other)}): the model "
                   f"learned to call them as they were"] if other else []
        if before.get("order") != after.get("order") and "order" in before:
            changes.append(f"the same tools in another order ({before['order']} -> {after['order']}): the system "
                           f"prompt lists them in the order given, so the prompts the model sees change; pass "
                           f"tools= in the run's order ({before['order']})")
        change = "; ".join(changes) or change
    if before and not after:
        change += (" (train(tools=..., environment_factory=...) not passed again: from here the model's tool calls "
                   "are plain text, never run, and the final save writes the tokenizer without the tools' template; "
                   "pass them as the run did)")
    return change


# ----------------------------------------------------------------------------------------
# What a run trains on: its base model, its adapter and its data, compared when it is resumed

# Positions sampled in each dimension of a weight for its fingerprint: small and fixed, so that an embedding
# resized for added tokens (new rows at the end) keeps them.
_SAMPLED = (0, 1, 7, 31, 127, 511, 2047, 8191)
# LoRA settings that change what the adapter's weights mean: its scale (lora_alpha / r, / sqrt(r) with rsLoRA),
# DoRA's magnitudes, the layers that carry it. lora_dropout only shapes the training from here on: warned.
ADAPTER_MEANING = ("peft_type", "r", "lora_alpha", "use_rslora", "use_dora", "rank_pattern", "alpha_pattern",
                   "target_modules")


def run_identity(model, tokenizer, dataset, agent=None) -> dict:
    """What a checkpoint's weights mean something only together with: the base model under them and the data they
    were trained on, and the tools and environments its episodes called (`agent`, episodes.Agent; absent for a
    run without). Taken when a run starts (before a checkpoint's weights are loaded), kept in its checkpoints,
    and compared when one is resumed (read_training_checkpoint, warn_changed_settings)."""
    identity = {"base": base_identity(model), "dataset": data_identity(dataset, tokenizer)}
    if (vocabulary := tokenizer_identity(tokenizer)) is not None:
        identity["tokenizer"] = vocabulary
    if agent is not None:
        identity["agent"] = agent.identity()
        # the order given: the names above are sorted, but the system prompt lists the tools in this order, so the
        # same tools in another order are other prompts (said on resume)
        identity["agent"]["order"] = [getattr(t, "name", None) for t in getattr(agent, "tools", ())]
    return identity


def tokenizer_identity(tokenizer) -> dict | None:
    """The tokenizer's vocabulary: its size, a digest of its added tokens (id and text) and one of what each id
    means (its token's text). Tokens added to the tokenizer object after a run stopped (a tool of the stopped step,
    a callback: the object keeps them) change what ids mean and would be saved with every later checkpoint; a
    prompt's encoding (data_identity) does not show them. A token only marked special (an existing id, its text
    unchanged) changes the added tokens but not the ids' meaning (check_same_tokenizer tells the two apart). None
    for a tokenizer without a length."""
    try:
        added = sorted((int(i), str(t.content)) for i, t in (getattr(tokenizer, "added_tokens_decoder", None)
                                                             or {}).items())
        identity = {"size": int(len(tokenizer)), "added": _digest(added)}
    except (TypeError, ValueError, AttributeError):
        return None
    try:  # one pass over the vocabulary at the run's start (a 150k-token one: tens of milliseconds)
        identity["ids"] = _digest(sorted((int(i), str(t)) for t, i in tokenizer.get_vocab().items()))
    except (TypeError, ValueError, AttributeError, NotImplementedError):
        pass
    return identity


def check_same_tokenizer(path, saved, now, tokenizer) -> None:
    """Refuse to resume the checkpoint at `path` with a tokenizer whose vocabulary differs from the one its steps
    trained with (`saved`, `now`: tokenizer_identity's; a checkpoint written before runs recorded it is not
    compared): the checkpoints written from here and the final save would hold the tokens added since, which the
    trained weights never saw. Only other tokens marked special or added (every id meaning what it did: the same
    size and `ids`) is warned of, not refused."""
    if not (isinstance(saved, dict) and isinstance(now, dict)) or saved == now:
        return
    size = saved.get("size")
    if size == now.get("size") and saved.get("ids") is not None and saved.get("ids") == now.get("ids"):
        warnings.warn(f"Resuming from {path} with a tokenizer whose added or special tokens differ from the one its "
                      f"steps trained with (e.g. an existing token marked special with add_special_tokens), though "
                      f"it has the same {size} tokens and each id means what it did, so the weights fit it. The "
                      f"text now splits at such tokens, and completions are decoded without the special ones (the "
                      f"rewards do not see them): if that is not meant, load the tokenizer again "
                      f"(AutoTokenizer.from_pretrained('{path}') loads the one the checkpoint saved).", UserWarning,
                      stacklevel=3)
        return
    extra = [t.content for i, t in sorted((getattr(tokenizer, "added_tokens_decoder", None) or {}).items())
             if isinstance(size, int) and not isinstance(size, bool) and i >= size]
    shown = f" (added: {', '.join(map(repr, extra[:8]))}{', ...' if len(extra) > 8 else ''})" if extra else ""
    if size == now.get("size"):
        differs = (f"the tokenizer passed has as many tokens as the one its steps trained with ({size}), but other "
                   f"added tokens{'' if saved.get('ids') is None else ' and ids that mean other tokens'} (a token "
                   f"replaced by another at its id, or, in a checkpoint written before grpo-nb told them apart, "
                   f"only marked special)")
    else:
        differs = f"the tokenizer passed has {now.get('size')} tokens{shown}, the one its steps trained with {size}"
    raise ValueError(f"Cannot resume from {path}: {differs}. "
                     f"Tokens added since (by a tool, a reward function or a callback of the run that stopped - this "
                     f"tokenizer object keeps them - or by hand) change what the ids mean, and every checkpoint "
                     f"written from here and the final save would hold them. Load the tokenizer again "
                     f"(AutoTokenizer.from_pretrained('{path}') loads the one the checkpoint saved) and resume with "
                     f"it; tokens meant to be added go in before a new run (with the embeddings resized).")


def base_identity(model) -> dict:
    """The base model: its architecture, the hub id or folder it was loaded from, and a fingerprint of its weights."""
    config = getattr(model, "config", None)
    return {"model_type": getattr(config, "model_type", None) or None,
            "name_or_path": str(getattr(config, "name_or_path", None) or "") or None,
            "fingerprint": weight_fingerprint(model), "layers": layer_fingerprint(model)}


def weight_fingerprint(model) -> list | None:
    """Values at fixed positions of frozen weights a checkpoint relies on but does not hold: the input embedding and
    the last frozen 1-D weight (the final norm). Both lie outside the decoder layers, so neither quantization (4-bit)
    nor sharding (fsdp) changes them, and a QLoRA and a bf16 run of one base agree. None when there is none to read
    (full fine-tuning, offloaded weights)."""
    try:
        embedding = model.get_input_embeddings().weight
    except (AttributeError, NotImplementedError):
        embedding = None
    picked = [embedding] if embedding is not None and not embedding.requires_grad and _readable(embedding) else []
    picked += [p for p in model.parameters() if not p.requires_grad and p.dim() == 1 and _readable(p)][-1:]
    if not picked:
        return None
    with torch.no_grad():
        return [[v if math.isfinite(v) else None for v in _sample(p).float().flatten().tolist()] for p in picked]


_LAYER = re.compile(r"\.(\d+)\.")
# Positions (row, column) sampled from each matrix of every decoder layer: a few values each, so that a model of
# 100 layers keeps a small fingerprint and a fine-tune that changed any layer (LoRA's layers_to_transform) shows.
_PAIRS = ((0, 0), (1, 7), (7, 31), (31, 1), (127, 511), (511, 127), (2047, 8191), (8191, 2047))


def layer_fingerprint(model) -> dict:
    """Values at a few fixed positions of the frozen weight matrices of every decoder layer (up to 8 a layer), and of
    an output head not tied to the embedding, by name: a fine-tune merged from LoRA differs from its base only there.
    Plain float weights only: a quantized one (4-bit, 8-bit, float8) holds other values for the same model, so a
    QLoRA and a bf16 run compare the layers both hold."""
    layers: dict[int, list] = {}
    for name, p in model.named_parameters():
        if (found := _LAYER.search(name)) and not p.requires_grad and p.dim() == 2 and _readable(p) \
                and p.dtype in FLOAT_DTYPES:
            layers.setdefault(int(found.group(1)), []).append((name, p))
    picked = [pair for i in sorted(layers) for pair in layers[i][:8]][:1024]
    try:
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        head = embedding = None
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.nn.Parameter) and not weight.requires_grad and weight.dim() == 2 and _readable(weight) \
            and weight is not getattr(embedding, "weight", None):
        picked.append(("lm_head.weight", weight))
    with torch.no_grad():  # the same names with or without peft's wrapping
        return {re.sub(r"^base_model\.model\.|\.base_layer", "", name): [
            v if math.isfinite(v) else None for v in _few(p).float().tolist()] for name, p in picked}


def _readable(param) -> bool:
    # a DTensor (fsdp) holds only this rank's shard, a meta tensor (offloaded) no values
    return param.is_floating_point() and param.device.type != "meta" and not hasattr(param, "device_mesh")


def _sample(weight: torch.Tensor) -> torch.Tensor:
    index = [torch.tensor([i for i in _SAMPLED if i < size], device=weight.device) for size in weight.shape[:2]]
    return weight[index[0]] if weight.dim() == 1 else weight[index[0]][:, index[1]]


def _few(weight: torch.Tensor) -> torch.Tensor:
    rows, columns = zip(*[(i, j) for i, j in _PAIRS if i < weight.shape[0] and j < weight.shape[1]])
    return weight[torch.tensor(rows, device=weight.device), torch.tensor(columns, device=weight.device)]


def _same_weights(saved: list, now: list) -> bool:
    """Two fingerprints of one model, loaded in any float dtype (bf16, fp16, fp32): equal to bf16's precision."""
    if len(saved) != len(now) or any(len(a) != len(b) for a, b in zip(saved, now)):
        return False
    return all(a == b if a is None or b is None else abs(a - b) <= 2**-7 * max(abs(a), abs(b)) + 1e-6
               for values, others in zip(saved, now) for a, b in zip(values, others))


def _model_name(name_or_path: str | None) -> str | None:
    """The model a hub id or folder names: 'Qwen/Qwen2.5-1.5B', '/content/Qwen2.5-1.5B/' and a hub cache's
    '.../models--Qwen--Qwen2.5-1.5B/snapshots/<hash>' all name qwen2.5-1.5b."""
    text = str(name_or_path or "").replace("\\", "/").rstrip("/")
    cached = re.search(r"models--([^/]+)/snapshots/", text)
    name = cached.group(1).split("--")[-1] if cached else text.rsplit("/", 1)[-1]
    return name.lower() or None


def data_identity(dataset, tokenizer) -> dict:
    """The dataset's size, a digest of a few of its rows (every column) and of the tokens their prompts become
    through this tokenizer and chat template: a few rows read, whatever the dataset's size."""
    rows = len(dataset)
    picked = [dict(dataset[i]) for i in sorted({i * rows // 8 for i in range(8)} | {rows - 1})] if rows else []
    prompts = None
    if tokenizer is not None and picked:
        from .rollout.batch import prompt_texts

        try:
            prompts = tokenizer(prompt_texts(tokenizer, [row.get("prompt") for row in picked]),
                                add_special_tokens=False)["input_ids"]
        except Exception:  # a prompt the template fails on: the first rollout names it; nothing to compare here
            prompts = None
    return {"rows": rows, "rows_digest": _digest(picked), "prompts_digest": None if prompts is None else
            _digest(prompts)}


def _digest(value) -> str | None:
    try:  # numpy numbers by value; other values JSON cannot hold (an image, an array) count by their kind
        text = json.dumps(value, sort_keys=True, default=lambda v: v.item() if getattr(v, "shape", None) == ()
                          and hasattr(v, "item") else type(v).__name__)
    except (TypeError, ValueError, RecursionError):  # keys of mixed kinds, an int too long to print, deep nesting
        return None
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _short(value) -> str:
    return short_repr(value, 80)  # several settings in one message: each short


def check_same_base(path: Path, saved: dict | None, adapter: dict, model, folder: Path | None = None) -> None:
    """Refuse a checkpoint trained on another base model of the same shape (Qwen2.5-1.5B, -Instruct, -Math; another
    family with the same layer names; a fine-tune merged from LoRA): its adapter means something only on the weights
    it was trained on. A moved or renamed folder of the same model passes: its weights match. `saved`: the
    checkpoint's identity["base"] (None in checkpoints written before grpo-nb recorded it); `adapter`: its
    adapter_config.json, in `folder`. A fully fine-tuned checkpoint holds every weight, but runs under this model's
    config: its architecture and the settings that change the computation (check_same_config)."""
    saved, folder = saved or {}, folder or path
    if not getattr(model, "peft_config", None):  # full fine-tuning, some weights frozen (an embedding) or none
        check_same_config(path, saved, model)
    if all(p.requires_grad for p in model.parameters()):
        return
    now = base_identity(model)
    then_name = adapter.get("base_model_name_or_path") or saved.get("name_or_path")
    then_name = then_name if isinstance(then_name, str) else None
    now_name = now["name_or_path"] or getattr(getattr(model, "active_peft_config", None), "base_model_name_or_path",
                                                 None)
    trained_on = f"trained on {_short(then_name)}" if then_name else "trained on another base model"
    this = f"this model ({_short(now_name)})" if now_name else "this model"
    # an older checkpoint's sample (more values, of the first and last layer only) has other lengths: not compared
    differ = [name for name in set(saved.get("layers") or {}) & set(now["layers"])
              if len(saved["layers"][name]) == len(now["layers"][name])
              and not _same_weights([saved["layers"][name]], [now["layers"][name]])]
    if saved.get("model_type") and now["model_type"] and saved["model_type"] != now["model_type"]:
        problem = (f"it was {trained_on}, a {_short(saved['model_type'])} model, and {this} is a "
                   f"{_short(now['model_type'])} model")
    elif saved.get("fingerprint") and now["fingerprint"] and not _same_weights(saved["fingerprint"],
                                                                                 now["fingerprint"]):
        problem = (f"it was {trained_on}, and {this} has other base weights (the values sampled from its embedding "
                   f"and final norm differ; a moved or renamed folder of the same model would match): another model "
                   f"of the same shape, e.g. an -Instruct and a base model, or another fine-tune")
    elif differ:
        problem = (f"it was {trained_on}, and {this} has other weights in its decoder layers or output head (the "
                   f"values sampled from {sorted(differ)[0]} differ, while its embedding matches): e.g. a fine-tune "
                   f"merged from a LoRA adapter and the model it was merged into")
    elif saved.get("fingerprint") and now["fingerprint"]:
        return  # the same weights, whatever the name: a moved or renamed folder, a local copy of a hub model
    elif _model_name(then_name) and _model_name(now_name) and _model_name(then_name) != _model_name(now_name):
        problem = (f"it was {trained_on}, and {this} is another model. If it is the same model moved or renamed, "
                   f"write {str(now_name)!r} into {folder / 'adapter_config.json'} as base_model_name_or_path")
    else:
        return
    raise ValueError(
        f"Cannot resume from {path}: {problem}. An adapter means something only on the base model it was trained on: "
        f"load that model and resume again, or start a new run in a new output_dir for this one (to train this "
        f"adapter on it on purpose, start from the adapter's weights: PeftModel.from_pretrained(<this base model "
        f"without an adapter>, {str(folder)!r}, is_trainable=True), without resume_from_checkpoint).")


# The config fields that change what a fully fine-tuned model computes with the same weights: positions (rope),
# norms, attention window, activation, tied embeddings. Sizes are checked by the weights' shapes.
_COMPUTES = re.compile(r"^(model_type|rope_\w+|\w*_eps|sliding_window|use_sliding_window|hidden_act|"
                       r"tie_word_embeddings|partial_rotary_factor)$")


def check_same_config(path: Path, saved: dict, model) -> None:
    """Refuse a fully fine-tuned checkpoint resumed onto another architecture (identity's model_type) or a config
    that computes otherwise (its config.json against the model's: rope settings, norm eps, sliding window, ...)."""
    then = _json_object(path / "config.json")
    then = {"model_type": saved.get("model_type"), **then} if saved.get("model_type") else then
    config = getattr(model, "config", None)
    now = json.loads(json.dumps(config.to_dict(), default=str)) if hasattr(config, "to_dict") else {}
    changed = [k for k in sorted(then) if _COMPUTES.match(k) and k in now and then[k] != now[k]]
    if changed:
        raise ValueError(
            f"Cannot resume from {path}: its weights were trained fully under another model config: "
            f"{'; '.join(f'{k} {_short(then[k])} -> {_short(now[k])}' for k in changed)} (its config.json against "
            f"this model's). The trained weights would run under other positions, norms or architecture. Load the "
            f"model the checkpoint was trained from (the same architecture and config) and resume again, or start "
            f"a new run in a new output_dir.")


def check_same_adapter(path: Path, saved: dict, model, same_layers: bool = False) -> None:
    """Refuse a checkpoint whose adapter was trained with another LoRA setup (adapter_config.json against the model's
    peft config): another lora_alpha or use_rslora rescales every trained weight, another r or target_modules does not
    fit. target_modules counts only when LoRA sits on other layers (not `same_layers`, the trained tensors' names):
    "all-linear", a list and a regex can name the same ones. Warn for another lora_dropout."""
    config = getattr(model, "active_peft_config", None)
    if config is None:
        return  # not an adapter: full fine-tuning
    if not saved and same_layers:  # (other tensors: refused by their names next, a clearer message)
        named = sorted(p.name for p in path.iterdir() if p.is_dir() and not p.is_symlink()
                       and "peft_type" in _json_object(p / "adapter_config.json"))
        if not named:  # no adapter under another name either: the file was deleted or spoiled
            raise _foreign(path, "adapter_config.json", "missing, or not the JSON peft writes, so the LoRA setup the "
                           "checkpoint was trained with (lora_alpha, r, ...) cannot be checked against this model's; "
                           "the checkpoint looks damaged or edited: restore the file from a copy")
        raise ValueError(
            f"Cannot resume from {path}: it holds no adapter_config.json for this model's adapter "
            f"({getattr(model, 'active_adapter', None)!r}; peft saves an adapter named other than 'default' in a "
            f"subfolder of that name, and this checkpoint holds one in {named[0]!r}), so its LoRA setup (lora_alpha, r, ...) cannot be checked against this one's. "
            f"Resume a checkpoint a train() run of this adapter wrote, set up with the same adapter_name.")
    if not saved:
        return
    now = config.to_dict()
    meaning = [key for key in ADAPTER_MEANING if not (same_layers and key == "target_modules")]
    changed = [key for key in meaning if key in saved and _setting(saved[key]) != _setting(now.get(key))]
    if changed:
        scale = ""
        if "r" not in changed and {"lora_alpha", "use_rslora"} & set(changed):
            then, after = _lora_scale(saved), _lora_scale(now)
            if then and after:
                scale = f": its weights would act {after / then:.3g}x as strongly (LoRA scales them by lora_alpha / r)"
        raise ValueError(
            f"Cannot resume from {path}: it was written for another model or LoRA setup: its adapter was trained "
            f"with {'; '.join(f'{k} {_show(k, saved[k])}' for k in changed)}, and this model's adapter has "
            f"{'; '.join(f'{k} {_show(k, now.get(k))}' for k in changed)}{scale}. Set the model up with the "
            f"checkpoint's LoRA settings (its adapter_config.json; setup_reasoning_model(..., lora_rank=r, "
            f"lora_alpha=...)) and resume again, or start a new run in a new output_dir.")
    if "lora_dropout" in saved and _setting(saved["lora_dropout"]) != _setting(now.get("lora_dropout")):
        warnings.warn(f"Resuming from {path} with another lora_dropout than it was trained with: "
                      f"{_short(saved['lora_dropout'])} -> {now.get('lora_dropout')!r}. The run continues with the "
                      f"new one, so it will not equal an unbroken run.", stacklevel=5)


def _setting(value):
    """A peft setting as adapter_config.json holds it: sets and tuples as sorted lists, enums by value."""
    if isinstance(value, (set, tuple, list)):
        return sorted(_setting(v) for v in value) if all(isinstance(v, str) for v in value) else [
            _setting(v) for v in value]
    return getattr(value, "value", value)


def _show(key: str, value) -> str:
    if key == "target_modules" and isinstance(value, (set, tuple, list)):  # full names: model.layers.0.mlp.up_proj
        return f"{sorted({str(m).rsplit('.', 1)[-1] for m in value})} ({len(value)} modules)"
    return _short(_setting(value))


def _lora_scale(config: dict) -> float | None:
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in (r, alpha)):
        return None
    return alpha / (math.sqrt(r) if config.get("use_rslora") is True else r)


def warn_other_rollout(path, saved, rollout) -> None:
    """A checkpoint sampled by a rollout that keeps a random state (the native engine, a ResumableRollout),
    resumed with one that keeps none, or the other way round: the resumed run cannot draw what the unbroken one
    would, which resuming promises. Said, not refused: resuming with another engine can be what was meant."""
    own = rollout_state(rollout)
    if (saved is None) == (own is None):
        return  # (another ResumableRollout's keys are refused by restore_state)
    name = getattr(rollout, "__name__", None) or type(rollout).__name__
    was = (f"a rollout that keeps its random state in the checkpoint (keys {sorted(map(str, saved))[:6]}), which "
           f"this run's {name!r} does not take" if saved is not None else
           f"a rollout that keeps no random state (a function of yours, rollout='hf' or vLLM), and this run's "
           f"{name!r} starts from its own seed")
    warnings.warn(f"{path} was sampled with {was}: the resumed run will not draw the completions the unbroken run "
                  f"would. Pass the rollout= the run was trained with to continue it exactly.", UserWarning,
                  stacklevel=4)
