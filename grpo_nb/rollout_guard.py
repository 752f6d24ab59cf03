"""What a user's rollout function may leave changed on the model, put back or refused before the update.

grpo-nb's own engines restore what they change; `train(rollout=callable)` runs anyone's function, which may
switch adapters, call model.eval(), merge the adapter, rescale it, turn checkpointing off, leave a hook on a
layer, replace a weight's Parameter or write into the weights. `model_kept_for_update` (used by trainer.py around
each step's rollouts) records what the update and the saves depend on before the rollout and compares after it:
what can be put back is, and said once per run; what cannot be put back without a copy of the weights is refused,
naming the rollout.
"""

from __future__ import annotations

import copy
import functools
import math
import warnings
from contextlib import contextmanager

import torch

from . import distributed
from .reward_calls import CALLED


# values read from each weight (a grid over its dims) before and after a user's rollout, to see that it changed them
SAMPLED_VALUES = 64
# a merge and unmerge of the adapter in float32 (weight + delta - delta) moves a weight by about a unit in the last
# place of its largest values: a change within this many such units of a float32 weight is rounding, not a change
ROUNDING_ULPS = 16


def _readable(p) -> torch.Tensor | None:
    """A weight's values as this process holds them (fsdp=True: its shard), or None: on meta (offloaded), empty."""
    t = p.data
    if isinstance(t, distributed.DTensor):
        t = t.to_local()
    return None if t.device.type == "meta" or t.numel() == 0 else t


def weight_samples(params) -> list[torch.Tensor | None]:
    """A few values of each weight, on a grid over its dims (views: nothing the size of a weight is copied), read
    to the CPU in one transfer per dtype, to compare after a user's rollout. Version counters do not see every
    write: each `p.data` is a tensor with a counter of its own, so p.data.copy_(...), p.data.add_(noise) and peft's
    merge_adapter() + unmerge_adapter() (weight.data += delta) leave p._version as it was; the values show them.
    None for a weight with no values here (on meta: offloaded) or one that cannot be sliced."""
    picked: list[torch.Tensor | None] = []
    for p in params:
        try:
            if (t := _readable(p)) is None:
                picked.append(None)
                continue
            per = max(1, round(SAMPLED_VALUES ** (1 / t.dim()))) if t.dim() else 1
            for dim, size in enumerate(t.shape):
                step = max(1, size // per)
                t = t[(slice(None),) * dim + (slice(0, step * per, step),)]
            picked.append(t.reshape(-1))
        except (RuntimeError, NotImplementedError, TypeError):  # a tensor subclass of a quantization library
            picked.append(None)
    groups: dict = {}
    for i, t in enumerate(picked):
        if t is not None:
            groups.setdefault((t.dtype, t.device), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(picked)
    for members in groups.values():
        values = torch.cat([picked[i] for i in members]).cpu()  # a copy, also on the CPU
        for i, part in zip(members, values.split([picked[i].numel() for i in members])):
            out[i] = part
    return out


# each weight's bytes read as integers of the same width (float32 as int32, 16-bit as int16, 8-bit as uint8)
INTEGERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# a weight is read this many values at a time (a bounded copy in a wider dtype, not one the size of the weight)
CHUNK = 1 << 22
# each chunk is laid out as rows of this many values (whatever the weight's shape): the sums of its rows and of its
# columns, each weighted by a pseudo-random number of its place, see a value moved, negated or scaled anywhere
WIDTH = 1024
# how many standard spreads a sum of independent roundings may stray (Hoeffding: beyond 8, about e^-32)
SPREAD = 8
# the weights of the places, by device: computed once (a few thousand values), grown when a weight needs more
_PLACES: dict = {}


def _places(count: int, device) -> torch.Tensor:
    """Pseudo-random integers below 2**22, one per place 0..count-1 (a fixed mix of the place's index, the same on
    every device and call): a sum weighted by them changes when values trade places or flip sign together, which a
    plain or linearly weighted sum need not (+1 -2 -3 +4 = 0)."""
    key = torch.device(device)
    if (have := _PLACES.get(key)) is None or len(have) < count:
        h = torch.arange(max(count, WIDTH, CHUNK // WIDTH), dtype=torch.int64) * 0x2545F4914F6CDD1D + 0x632BE5AB
        h ^= h >> 29
        h = h * 0x1B873593 + 0x5BD1E995
        h ^= h >> 31
        _PLACES[key] = have = (h & ((1 << 22) - 1)).to(key)
    return have[:count]


def _parts(t: torch.Tensor):
    """The values of a tensor as 1-d parts of at most CHUNK values (or one row along its first dim, if longer), in
    order: views of a contiguous tensor, bounded copies of a strided one."""
    if t.dim() == 0:
        yield t.reshape(1)
    elif t.is_contiguous():
        yield from t.reshape(-1).split(CHUNK)
    else:
        for part in t.split(max(1, CHUNK // max(1, t[0].numel()))):  # along the first dim: any strides
            yield part.reshape(-1)


def _marginals(part: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A 1-d part laid out as rows of WIDTH values (the last one padded with zeros), in `dtype`: the sums of its rows
    and of its columns (a copy of the part in `dtype`, bounded by CHUNK)."""
    n = part.numel()
    rows = -(-n // WIDTH)
    wide = torch.empty(rows * WIDTH, dtype=dtype, device=part.device)
    wide[:n].copy_(part)
    wide[n:].zero_()
    wide = wide.view(rows, WIDTH)
    return wide.sum(1, dtype=dtype), wide.sum(0, dtype=dtype)


def byte_sums(params) -> list[tuple[int, int, int] | None]:
    """Each weight's bytes read as integers of its width (float32 as int32, 16-bit as int16, ...), summed in 64 bits
    (wrapping at 2**64 only: exact, whatever the order of the sum), with its number of values: a write into any one
    value changes the sum (a write into a few rows, as a token's embedding set or a token banned by zeroing its
    lm_head row, or into one element escapes the sample of weight_samples). Besides the plain sum, one weighted by
    place: the chunk's rows' and columns' sums (_marginals) times pseudo-random weights of their places (_places), so
    that two rows or values swapped, a row negated (every value's sign bit flipped: +-2**31 each, which cancel in a
    plain sum) or scaled by a power of two show too. Read on the device CHUNK values at a time (a bounded copy, in
    int32 for 8 and 16-bit weights, whose rows of WIDTH values cannot overflow it, else int64), nothing the size of a
    weight allocated; one transfer per device. None for a weight on meta (offloaded) or one that cannot be read so (a
    quantization library's subclass)."""
    out: list = [None] * len(params)
    pending: dict = {}
    for i, p in enumerate(params):
        try:
            if (t := _readable(p)) is None:
                continue
            bits = t.view(INTEGERS[t.element_size()])
            wide = torch.int32 if bits.element_size() <= 2 else torch.int64
            totals, placed = [], []
            for k, part in enumerate(_parts(bits)):
                rows, cols = _marginals(part, wide)
                rows, cols = rows.to(torch.int64), cols.to(torch.int64)
                mix = 1 + 2 * ((k * 0x9E3779B1) % (1 << 20))  # the part's own odd weight: parts swapped show
                totals.append(rows.sum())
                placed.append(((rows * _places(len(rows), rows.device)).sum()
                               + (cols * _places(WIDTH, cols.device)).sum() * 3) * mix)
            pending.setdefault(t.device, []).append(
                (i, torch.stack([torch.stack(totals).sum(), torch.stack(placed).sum()]), t.numel()))
        except (RuntimeError, NotImplementedError, TypeError, KeyError):
            continue
    for members in pending.values():
        for (i, _, count), (total, placed) in zip(members, torch.stack([s for _, s, _ in members]).cpu().tolist()):
            out[i] = (total, placed, count)
    return out


def float_moments(params, which) -> dict[int, list[float]]:
    """For the float32 / float64 weights among `which` (indices into params): the sum of its values, of their squares
    (in float64), its largest magnitude, and a sum weighted by place (as byte_sums', with weights in [-1, 1) per row
    and per column of each chunk, the chunk's in [1, 2)), which tell float32 rounding from a write (beyond_rounding):
    values moved between places or negated keep the first three. Read CHUNK values at a time (a bounded float64
    copy); one transfer per device."""
    pending: dict = {}
    for i in which:
        try:
            if (t := _readable(params[i])) is None or t.dtype not in (torch.float32, torch.float64):
                continue
            sums, squares, tops, placed = [], [], [], []
            for k, part in enumerate(_parts(t)):
                x = part.double()
                low, high = torch.aminmax(x)
                sums.append(x.sum())
                squares.append(torch.dot(x, x))
                tops.append(torch.maximum(-low, high))
                rows, cols = _marginals(x, torch.float64)
                mix = 1.0 + (k * 0.6180339887498949) % 1.0
                placed.append(mix * (rows @ (_places(len(rows), rows.device).double() / (1 << 21) - 1)
                                     + cols @ (_places(WIDTH, cols.device).double() / (1 << 21) - 1)))
            pending.setdefault(t.device, []).append(
                (i, torch.stack([torch.stack(sums).sum(), torch.stack(squares).sum(), torch.stack(tops).max(),
                                 torch.stack(placed).sum()])))
        except (RuntimeError, NotImplementedError, TypeError):
            continue
    return {i: values for members in pending.values()
            for (i, _), values in zip(members, torch.stack([m for _, m in members]).cpu().tolist())}


# the float moments of the weights as the last rollout left them, by (id, byte sum, count): a frozen weight's are read
# once per run, not twice a step (on a CPU, float32 weights' float64 sums cost some 10 ns a value)
_KNOWN_MOMENTS: dict = {}


def known_moments(params, sums) -> dict[int, list[float]]:
    """float_moments of each weight, those of a weight whose bytes are as the last rollout left them remembered."""
    keys = {i: (id(params[i]), *s) for i, s in enumerate(sums) if s is not None}
    known = {i: _KNOWN_MOMENTS[k] for i, k in keys.items() if k in _KNOWN_MOMENTS}
    return {**known, **float_moments(params, [i for i in keys if i not in known])}


def remember_moments(params, sums, moments) -> None:
    """Keep the float moments of the weights as this rollout left them (only these: a bounded store)."""
    _KNOWN_MOMENTS.clear()
    _KNOWN_MOMENTS.update({(id(params[i]), *sums[i]): m for i, m in moments.items() if sums[i] is not None})


def beyond_rounding(before: list[float], after: list[float], count: int) -> bool:
    """Whether a float32 / float64 weight whose bytes changed (byte_sums) changed by more than float32 rounding of its
    values, ROUNDING_ULPS units in the last place of its largest value each at most (float_moments before and after):
    such roundings (peft's merge + unmerge) fall either way independently, so their sum and that of their effect on
    the squares stay within SPREAD spreads of zero; a write into a row or a value moves the sums by what it wrote.
    Values moved between places (two rows or values swapped) or negated keep these sums, not the one weighted by
    place, whose weights (at most 4 in size each) scale the same independent roundings."""
    (sum_was, squares_was, top_was, placed_was), (sum_now, squares_now, top_now, placed_now) = before, after
    scale = max(top_was, top_now)
    each = ROUNDING_ULPS * torch.finfo(torch.float32).eps * scale  # the most one value may move by rounding
    # the float64 sums' own rounding, which differs between two sums of slightly different values
    noise = 4 * math.log2(count + 1) * count * torch.finfo(torch.float64).eps
    spread = SPREAD * math.sqrt(count)
    return not (abs(sum_now - sum_was) <= spread * each + noise * scale
                and abs(squares_now - squares_was) <= spread * 2 * scale * each + count * each * each
                + noise * scale * scale
                and abs(placed_now - placed_was) <= 4 * (spread * each + noise * scale))  # NaN sums: beyond


def rewritten_weights(params, samples: list, sums: list, moments: dict) -> list[int]:
    """Which weights a rollout changed, from what was read before it (weight_samples, byte_sums, known_moments):
    those whose sample moved beyond rounding (changed_values), and those whose bytes changed unless, for a float32 /
    float64 weight, by no more than float32 rounding of its values (a merge and unmerge of the adapter in float32,
    allowed). The moments of the weights as left remembered for the next rollout."""
    grid = set(changed_values(samples, weight_samples(params)))
    if all(s is None for s in sums):  # not read before (grpo-nb's own engine): the sample's comparison alone
        return sorted(grid)
    sums_now = byte_sums(params)
    moved = [i for i, (was, now) in enumerate(zip(sums, sums_now))
             if was is not None and now is not None and was != now]
    moments_now = float_moments(params, moved)
    remember_moments(params, sums_now, {**{i: m for i, m in moments.items() if i not in moved}, **moments_now})
    return sorted(grid | {i for i in moved if i not in moments or i not in moments_now
                          or beyond_rounding(moments[i], moments_now[i], sums[i][-1])})


def changed_values(before: list, after: list) -> list[int]:
    """Which weights' sampled values (weight_samples) differ: beyond float32 rounding for a 32/64-bit weight
    (ROUNDING_ULPS), at all for a 16-bit or integer (quantized) one, whose rounding is a change of its own size."""
    changed = []
    for i, (was, now) in enumerate(zip(before, after)):
        if was is None or now is None or was.shape != now.shape or torch.equal(was, now):
            continue
        if was.is_floating_point():
            same = (was == now) | (was.isnan() & now.isnan())
            if was.dtype in (torch.float32, torch.float64):
                finite = was.double()[torch.isfinite(was)]
                scale = float(finite.abs().max()) if finite.numel() else 0.0
                same |= (now.double() - was.double()).abs() <= ROUNDING_ULPS * torch.finfo(torch.float32).eps * scale
            if bool(same.all()):
                continue
        changed.append(i)
    return changed


# a LoRA layer's modules that its forward runs (the optimizer holds the weights of these very ones)
LORA_MODULES = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_dropout", "lora_magnitude_vector")


def lora_forward_state(layers) -> list[dict]:
    """What each LoRA layer's forward computes with besides its weights' values: the scale per adapter (peft's
    scale_layer() and set_scale() change it), r and lora_alpha, its lora_A / lora_B / dropout modules, a dropout's p.
    Small (a few floats and references per layer): kept to put back after a user's rollout."""
    state = []
    for m in layers:
        held = {key: dict(getattr(m, key).items()) for key in LORA_MODULES
                if isinstance(getattr(m, key, None), (torch.nn.ModuleDict, torch.nn.ParameterDict))}
        numbers = {key: dict(value) for key in ("scaling", "r", "lora_alpha")
                   if isinstance(value := getattr(m, key, None), dict)}
        state.append({"numbers": numbers,
                      # a scale held as a tensor (peft's prepare_model_for_compiled_hotswap) is changed in place by
                      # scale_layer() (`scaling[a] *= s`): its value is kept, not only the tensor
                      "values": {(key, a): v.detach().clone() for key, values in numbers.items()
                                 for a, v in values.items() if isinstance(v, torch.Tensor)},
                      "modules": held,
                      "p": {(key, a): mod.p for key, mods in held.items() for a, mod in mods.items()
                            if isinstance(getattr(mod, "p", None), float)}})
    return state


def put_back_lora_forward(model, layers, state) -> list[str]:
    """Put back what lora_forward_state kept (the adapters the rollout added, if any, are left); what had changed,
    as phrases for the rollout's warning (none when nothing had)."""
    scaled, edited = [], []
    for m, was in zip(layers, state):
        for key, values in was["numbers"].items():
            now = getattr(m, key)
            if (moved := [(a, _number(was["values"].get((key, a), v)), _number(now.get(a))) for a, v in values.items()
                          if not _same_number(now.get(a), v, was["values"].get((key, a)))]):
                (scaled if key == "scaling" else edited).append((m, f"{key}[{moved[0][0]!r}] {moved[0][1]!r} -> "
                                                                   f"{moved[0][2]!r}"))
                now.update(values)
                with torch.no_grad():  # the tensors themselves (a compiled forward holds them) back to their values
                    for (k, a), value in was["values"].items():
                        if k == key:
                            values[a].copy_(value)
        for key, modules in was["modules"].items():
            now = getattr(m, key)
            if any(a not in now or now[a] is not mod for a, mod in modules.items()):
                edited.append((m, f"{key} replaced"))
                for a, mod in modules.items():
                    now[a] = mod
        for (key, a), p in was["p"].items():
            if (mod := was["modules"][key][a]).p != p:
                edited.append((m, f"{key}[{a!r}].p {p!r} -> {mod.p!r}"))
                mod.p = p
    if not scaled and not edited:
        return []
    names = {id(m): name for name, m in model.named_modules()}
    phrases = []
    if scaled:
        m, what = scaled[0]
        phrases.append(f"the LoRA scale changed in {len(scaled)} layer(s) (e.g. {names.get(id(m), '?')}: {what}; peft's "
                       f"scale_layer() or set_scale()): the loss would train the adapter at that scale and the saves "
                       f"write lora_alpha and r for the usual one. Call unscale_layer() on them before returning")
    if edited:
        m, what = edited[0]
        phrases.append(f"the LoRA layers edited in {len(edited)} place(s) (e.g. {names.get(id(m), '?')}: {what}): the "
                       f"optimizer holds the adapter's own modules and the saves write its config. Leave lora_A, "
                       f"lora_B, lora_dropout, r and lora_alpha as get_peft_model() made them")
    return phrases


def _same_number(now, was, value) -> bool:
    """Whether a LoRA layer's number (a float, or a tensor whose value before the rollout is `value`) is as it was."""
    if value is None:
        return not isinstance(now, torch.Tensor) and now == was
    return now is was and now.shape == value.shape and bool(torch.equal(now.detach(), value))


def _number(value):
    """A LoRA layer's number for a message: a one-value tensor as its float."""
    return float(value) if isinstance(value, torch.Tensor) and value.numel() == 1 else value


def peft_configs_state(model) -> dict:
    """Each adapter's config (model.peft_config) and a copy of its fields, which every adapter save writes as
    adapter_config.json: kept to put back after a user's rollout. Fields whose copy compares unequal to the
    original (objects without ==) are left out, so that they are never taken for a change."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict):
        return {}
    kept = {}
    for name, config in configs.items():
        try:
            fields = copy.deepcopy(vars(config))
        except Exception:  # noqa: BLE001 - a config that cannot be copied is not compared
            continue
        kept[name] = (config, {k: v for k, v in fields.items() if _equal(vars(config).get(k), v)})
    return kept


def _equal(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an array's ==, or an object that cannot be compared
        return False


def put_back_peft_configs(model, kept: dict) -> list[str]:
    """Put back the configs peft_configs_state kept; what had changed, as phrases for the rollout's warning."""
    configs = getattr(model, "peft_config", None)
    phrases = []
    for name, (config, fields) in kept.items():
        now = configs.get(name) if isinstance(configs, dict) else None
        edits = [k for k, v in fields.items() if not _equal(getattr(now, k, None), v)]
        if now is not config or edits:
            if edits and now is not None:
                k = edits[0]
                phrases.append(f"model.peft_config[{name!r}] edited ({k} {fields[k]!r} -> {getattr(now, k, None)!r}): "
                               f"the layers keep computing with their own values and every save writes the config, "
                               f"so the saved adapter would load as another model than the one trained. Set LoRA "
                               f"settings in the LoraConfig given to get_peft_model(), not on model.peft_config")
            else:
                phrases.append(f"model.peft_config[{name!r}] replaced: leave the adapter's config as it is")
            for k in edits:
                setattr(config, k, fields[k])
            if isinstance(configs, dict):
                configs[name] = config
    return phrases


# a module's hooks by kind, and the dicts holding their flags under the same id (what a handle's remove() clears)
HOOKS = {"_forward_pre_hooks": ("forward pre-hook", ("_forward_pre_hooks_with_kwargs",)),
         "_forward_hooks": ("forward hook", ("_forward_hooks_with_kwargs", "_forward_hooks_always_called")),
         "_backward_pre_hooks": ("backward pre-hook", ()),
         "_backward_hooks": ("backward hook", ())}
# the libraries that put hooks of their own on a model during a forward and keep them: transformers' output-capturing
# hooks (put on at the first forward asked for hidden states or attentions, marked as installed, never put on again),
# enable_input_require_grads(), peft's, accelerate's, torch's (fsdp): not the rollout's to take off
LIBRARIES = {"torch", "transformers", "peft", "accelerate", "grpo_nb", "trl", "bitsandbytes", "torchao", "deepspeed",
             "vllm"}


def hooks_state(model) -> dict:
    """The ids of each module's forward / backward hooks (ids, not copies: cheap), to take off after a user's rollout
    the ones it registered and left."""
    return {id(m): (m, [set(d) if (d := m.__dict__.get(key)) else () for key in HOOKS]) for m in model.modules()}


def _library_hook(hook) -> bool:
    """Whether a hook is a library's own (its function defined in one of LIBRARIES), not the user's."""
    func = getattr(hook, "func", hook)  # a functools.partial
    func = getattr(func, "__func__", func)  # a bound method
    where = getattr(func, "__module__", None) or type(func).__module__ or ""
    return where.split(".")[0] in LIBRARIES


def remove_new_hooks(model, state) -> list[str]:
    """Take off the forward / backward hooks a user's rollout registered on the model's modules and left (a steering
    hook, a hook keeping activations for a probe): they would act in every forward of the loss too, and pile up one
    more at each rollout. A library's own hooks stay (_library_hook); so do those of modules the rollout added.
    What was taken off, as a phrase for the rollout's warning."""
    taken = []
    for name, m in model.named_modules():
        if (was := state.get(id(m))) is None:
            continue
        for (key, (kind, extras)), kept in zip(HOOKS.items(), was[1]):
            hooks = m.__dict__.get(key)
            for hook_id in [h for h in hooks or () if h not in kept and not _library_hook(hooks[h])]:
                del hooks[hook_id]
                for extra in extras:
                    m.__dict__.get(extra, {}).pop(hook_id, None)
                taken.append((kind, name))
    if not taken:
        return []
    kind, name = taken[0]
    return [f"{len(taken)} hook(s) registered on its modules and not removed (e.g. a {kind} on {name or 'the model'}): "
            f"they would act in the loss's forward and backward too (a steering hook: the adapter trained for the "
            f"steered model and saved for the plain one; a hook keeping outputs: every step's activations kept "
            f"alive) and pile up one more at each rollout. grpo-nb took them off; keep the handle that "
            f"register_forward_hook() returns and call handle.remove() before returning (in a `finally:`, so that a "
            f"failed sampling removes it too)"]


def parameters_state(model) -> list[tuple]:
    """Each module's Parameter objects, by the name it holds them under, and whether each trains: the optimizer holds
    these objects, so a rollout that puts a new Parameter in a module (`lin.weight = nn.Parameter(...)`,
    load_state_dict(..., assign=True)) leaves the optimizer stepping one the forward no longer reads. Left out: weights
    on meta (accelerate's offloading puts a new one in at each forward) and fsdp=True's shards (FSDP swaps the
    gathered weights in and out)."""
    return [(f"{where}.{key}".lstrip("."), m, key, p, p.requires_grad) for where, m in model.named_modules()
            for key, p in m._parameters.items()
            if p is not None and p.device.type != "meta" and not isinstance(p, distributed.DTensor)]


def put_back_parameters(model, state, name: str) -> list[str]:  # name: who did it ("The rollout 'r'")
    """Put back in their modules the Parameter objects a user's rollout replaced (with their values: the new ones are
    dropped); what was, as a phrase for the rollout's warning. A trainable weight whose module the rollout took out of
    the model cannot be put back from here: refused, naming it (a frozen one's, as a deleted adapter's, is left)."""
    here = {id(m) for m in model.modules()}
    if gone := [(weight, m) for weight, m, _, _, trains in state if trains and id(m) not in here]:
        raise ValueError(f"{name} took {len(gone)} of the model's trained weights out of it (e.g. "
                         f"{gone[0][0]}: the {type(gone[0][1]).__name__} holding it replaced by another module), "
                         f"mid-run: the optimizer steps the old weights, which the forward no longer reads, and the "
                         f"saves would write the new ones untrained. Leave the model's modules in place (sample from a "
                         f"copy of the model), and load the model again.")
    replaced = [(weight, m, key, p, trains) for weight, m, key, p, trains in state
                if id(m) in here and m._parameters.get(key) is not p]
    if not replaced:
        return []
    for _, m, key, p, _ in replaced:
        m._parameters[key] = p
    # a trained one named first
    weight, trains = max(((weight, trains) for weight, _, _, _, trains in replaced), key=lambda r: r[1])
    why = ("the optimizer steps the original objects, so a replaced trained weight would never train, and the saves "
           "would write the new ones" if trains else "the run would train against other weights than it was given "
           "(a 4-bit merge and unmerge quantizes them again, rounded)")
    return [f"{len(replaced)} weight(s) replaced by new Parameter objects (e.g. {weight}: `module.weight = "
            f"nn.Parameter(...)`, load_state_dict(..., assign=True), a 4-bit layer's merge and unmerge): {why}. "
            f"grpo-nb put the original objects back, with their values (the new ones dropped): leave the model's "
            f"Parameter objects in place, or sample from a copy"]


# torch's global hooks (torch.nn.modules.module.register_module_forward_hook() and the like): they act on every
# module's forward, the loss's too. The dicts holding their flags under the same id are cleared with them
GLOBAL_HOOKS = {"_global_forward_pre_hooks": (), "_global_forward_hooks": ("_global_forward_hooks_with_kwargs",
                                                                             "_global_forward_hooks_always_called"),
                "_global_backward_pre_hooks": (), "_global_backward_hooks": (),
                "_global_buffer_registration_hooks": (), "_global_module_registration_hooks": (),
                "_global_parameter_registration_hooks": ()}
# a buffer of at most this many values is copied before a user's rollout, to put its values back (rotary inv_freq)
BUFFER_COPY = 1 << 16
# a module attribute of these types is kept (variance_epsilon, scaling, head_dim, is_causal): cheap to compare
NUMBERS = (int, float, bool)


def _numbers(m) -> dict:
    """A module's own numbers that its forward may read (RMSNorm's variance_epsilon, attention's scaling); not its
    mode, checkpointing switch (put_back_checkpointing's) or private state."""
    return {k: v for k, v in m.__dict__.items() if type(v) in NUMBERS and not k.startswith("_")
            and k not in ("training", "gradient_checkpointing")}


def _dynamic(m) -> bool:
    """A rotary embedding that recomputes its frequencies at each forward from the length (dynamic / longrope
    scaling): its buffer and length are its own business."""
    return "dynamic" in str(m.__dict__.get("rope_type", "")) or "longrope" in str(m.__dict__.get("rope_type", ""))


def structure_state(model) -> dict:
    """What the forward computes with besides the weights, kept to put back after a user's rollout: each module's
    class and children (a swapped activation, a wrapped lm_head, a parametrization: new class), its numbers
    (_numbers), the buffers (their objects, byte sums, and a copy of the small ones: rotary inv_freq) and torch's
    global hooks (their ids). References and small copies: cheap."""
    modules = [(name, m, type(m), dict(m._modules), _numbers(m) if not _dynamic(m) else {}, m.__dict__.get("forward"),
                set(m._parameters)) for name, m in model.named_modules()]
    buffers = [(f"{name}.{key}".lstrip("."), m, key, b) for name, m in model.named_modules() if not _dynamic(m)
               for key, b in m._buffers.items() if b is not None and b.device.type != "meta"]
    tensors = [b for *_, b in buffers]
    copies = [b.detach().clone() if b.numel() <= BUFFER_COPY else None for b in tensors]
    hooks = {key: set(getattr(torch.nn.modules.module, key, {}) or ()) for key in GLOBAL_HOOKS}
    return {"modules": modules, "buffers": buffers, "sums": byte_sums(tensors), "copies": copies, "hooks": hooks}


def put_back_structure(model, state, who: str) -> list[str]:
    """Put back what structure_state kept: a child module replaced (unless it holds trained weights: see
    put_back_parameters), a parametrization taken off (the original Parameter back), a class put back, numbers and
    small buffers' values put back, torch global hooks the rollout registered taken off; what had changed, as phrases
    for the rollout's warning. A large buffer changed in place cannot be put back: refused, naming it."""
    modules, classes, numbers, buffers = [], [], [], []
    for name, m, kind, children, was, forward, keys in state["modules"]:
        for hook_id, hook in list(m._forward_pre_hooks.items()):
            # torch.nn.utils.weight_norm() / spectral_norm() (old style): the weight made of new parameters by a
            # library pre-hook; taken off (the original Parameter is put back by put_back_parameters)
            if type(hook).__name__ in ("WeightNorm", "SpectralNorm") and getattr(hook, "name", None) in keys and (
                    f"{hook.name}_v" in m._parameters or f"{hook.name}_orig" in m._parameters):
                m._forward_pre_hooks.pop(hook_id)
                for extra in (f"{hook.name}_g", f"{hook.name}_v", f"{hook.name}_orig", f"{hook.name}_u"):
                    m._parameters.pop(extra, None)
                    m._buffers.pop(extra, None)
                m.__dict__.pop(hook.name, None)
                classes.append(name)
        if (now_forward := m.__dict__.get("forward")) is not forward and not (
                now_forward is not None and _library_hook(now_forward)):
            if forward is None:
                del m.__dict__["forward"]
            else:
                m.__dict__["forward"] = forward
            classes.append(name)
        if type(m) is not kind:
            if torch.nn.utils.parametrize.is_parametrized(m):  # the class it had comes back with the originals
                for key in list(m.parametrizations):
                    torch.nn.utils.parametrize.remove_parametrizations(m, key, leave_parametrized=False)
            if type(m) is not kind:
                m.__class__ = kind
            classes.append(name)
        for key, child in children.items():
            if (now := m._modules.get(key, child)) is not child and not (
                    child is not None and any(p.requires_grad for p in child.parameters())):
                m._modules[key] = child
                modules.append((f"{name}.{key}".lstrip("."), type(now).__name__, type(child).__name__))
        for key, value in was.items():
            if (now := m.__dict__.get(key, value)) != value or type(now) is not type(value):
                m.__dict__[key] = value
                numbers.append(f"{name or 'the model'}.{key} {value!r} -> {now!r}")
    sums_now = byte_sums([b for *_, b in state["buffers"]])
    for (where, m, key, b), was, now, copy_ in zip(state["buffers"], state["sums"], sums_now, state["copies"]):
        if m._buffers.get(key) is not b or was != now:
            if copy_ is None and was != now:
                raise ValueError(f"{who} changed the model's buffer {where} in place ({tuple(b.shape)}, too large "
                                 f"for grpo-nb to keep a copy of): the loss would run with other values than the "
                                 f"model was given. Leave the model's buffers as they are (sample from a copy), and "
                                 f"load the model again: this model object keeps the changed buffer.")
            if copy_ is not None:
                with torch.no_grad():
                    b.copy_(copy_)
            m._buffers[key] = b
            buffers.append(where)
    taken = []
    for key, extras in GLOBAL_HOOKS.items():
        hooks = getattr(torch.nn.modules.module, key, None)
        for hook_id in [h for h in hooks or () if h not in state["hooks"][key] and not _library_hook(hooks[h])]:
            del hooks[hook_id]
            for extra in extras:
                getattr(torch.nn.modules.module, extra, {}).pop(hook_id, None)
            taken.append(key.strip("_").replace("_", " "))
    phrases = []
    if modules:
        where, now, was = modules[0]
        phrases.append(f"{len(modules)} module(s) replaced (e.g. {where}: a {now} where the model has a {was}: an "
                       f"activation swapped, lm_head wrapped): the loss would run another model than the one the run "
                       f"trains and saves. grpo-nb put the original modules back: sample with a wrapper of your own "
                       f"around the model (or a LogitsProcessor), not one put into it")
    if classes:
        phrases.append(f"the class or forward of {len(classes)} module(s) changed (e.g. {classes[0] or 'the model'}: "
                       f"torch.nn.utils.parametrize.register_parametrization(), weight_norm(), module.forward = ... "
                       f"or __class__ set): grpo-nb took the parametrizations off and put the original weights, "
                       f"forward and class back")
    if numbers:
        phrases.append(f"{len(numbers)} module setting(s) changed (e.g. {numbers[0]}): put back; leave them as they "
                       f"are")
    if buffers:
        phrases.append(f"{len(buffers)} buffer(s) changed (e.g. {buffers[0]}: rotary frequencies rescaled for long "
                       f"sampling, or the like): the loss would run with them; grpo-nb put their values back")
    if taken:
        phrases.append(f"{len(taken)} torch global hook(s) registered and not removed (e.g. a {taken[0]}, "
                       f"register_module_forward_hook()): they would act in every forward of the loss and after "
                       f"train(); grpo-nb took them off: call handle.remove() before returning")
    return phrases


def checkpointing_state(model) -> list[tuple]:
    """Each module's gradient checkpointing switch and function (transformers' layers; enable_offloaded_checkpointing
    swaps the function), and whether input embeddings get the require-grads hook (enable_input_require_grads())."""
    def switch(m):  # read without nn.Module.__getattr__, which raises (slowly) for the many modules without one
        return m.__dict__.get("gradient_checkpointing", getattr(type(m), "gradient_checkpointing", None))

    return [(m, bool(switch(m)), m.__dict__.get("_gradient_checkpointing_func"),
             m.__dict__.get("_require_grads_hook") is not None)
            for m in model.modules() if isinstance(switch(m), bool) or m.__dict__.get("_require_grads_hook") is not None]


def put_back_checkpointing(state) -> list[str]:
    """Turn back on the gradient checkpointing (and its function, its input hook) a user's rollout turned off or
    replaced; what had changed, as phrases for the rollout's warning. Turned on where it was off is left: the update
    then only runs slower."""
    def same(a, b) -> bool:  # gradient_checkpointing_enable() makes a new functools.partial of the same call each time
        return a is b or (isinstance(a, functools.partial) and isinstance(b, functools.partial) and a.func == b.func
                          and a.args == b.args and a.keywords == b.keywords)

    changed = 0
    for m, on, func, hooked in state:
        if on and (not getattr(m, "gradient_checkpointing", False)
                   or func is not None and not same(m.__dict__.get("_gradient_checkpointing_func"), func)):
            m.gradient_checkpointing = True
            if func is not None:
                m._gradient_checkpointing_func = func
            changed += 1
        if hooked and m.__dict__.get("_require_grads_hook") is None and callable(
                getattr(m, "enable_input_require_grads", None)):
            m.enable_input_require_grads()
            changed += 1
    if not changed:
        return []
    return [f"gradient checkpointing turned off or replaced in {changed} module(s) (gradient_checkpointing_disable() "
            f"or _enable() with other settings): the update would keep every layer's activations (an out-of-memory "
            f"error where the run was sized with checkpointing). Generation needs no change: checkpointing acts only "
            f"in train mode; leave it as it was before returning"]


@contextmanager
def model_kept_for_update(model, rollout, warned: set, *, tools: bool = False):
    """Around the rollouts of a step: the model comes back as the update needs it, whatever the rollout left.
    grpo-nb's engines restore what they change; a user's function may not: `model.eval()` for generate() (the
    loss would run without gradient checkpointing and dropout), `model.set_adapter("draft")` (the loss would run
    through an adapter the optimizer does not hold, and the saves would write it), the adapter layers disabled
    or grad mode off (the backward would fail without a word on why), the LoRA scale changed (scale_layer()), the
    adapter's config edited, gradient checkpointing turned off, hooks registered and left, a weight's Parameter
    object replaced. Train mode is put back without a word (as transformers' Trainer does every step); anything else
    is put back too, and said once per run, naming the rollout, since the function does the same outside train().
    What cannot be put back without a copy of the weights is refused: weights converted, resized, or with other
    values (a sample of each is compared, and a sum of each one's bytes, which sees a write into any value)."""
    grad, default_dtype = torch.is_grad_enabled(), torch.get_default_dtype()
    adapter = getattr(model, "active_adapter", None) if getattr(model, "peft_config", None) else None
    layers = [m for m in model.modules() if hasattr(m, "adapter_layer_names") and hasattr(m, "enable_adapters")]
    disabled = [bool(getattr(m, "disable_adapters", False)) for m in layers]
    # what each LoRA layer runs: model.active_adapter names only the first of a stack that
    # model.base_model.set_adapter([...]) makes, so the layers' own lists are compared
    stacks = [tuple(getattr(m, "active_adapters", ()) or ()) for m in layers]
    lora = lora_forward_state(layers)
    configs = peft_configs_state(model)
    checkpointing = checkpointing_state(model)
    trainable = [(p, p.requires_grad) for p in model.parameters()]
    trains = {id(p): flag for p, flag in trainable}
    # bitsandbytes repacks its 4-bit weights for the CPU's kernels in eval mode (other shape and bytes, the same
    # weights): their values are its business; a rollout replacing them is seen by parameters_state
    checked = [(p, flag) for p, flag in trainable if not hasattr(p, "quant_state")]
    kinds = [(p.dtype, p.device, tuple(p.shape)) for p, _ in checked]
    # a conversion and back (model.half().float()), a write through p.data (p.data.copy_(...), weight noise, peft's
    # merge + unmerge in 16 bits): the dtype and device stay, the values change; a sample of each weight is compared
    samples = weight_samples([p for p, _ in checked])
    # a write into a few rows or values of a weight (a token's embedding set) escapes the sample: every value's bytes
    # are summed on the device (one read of each weight: about a decode step's), exact; a float32 weight's float sums
    # tell rounding (merge + unmerge) from a write
    # Around grpo-nb's own engine (which leaves every weight as it found it) only the reward functions could write
    # into one: that is left to the sample, and the per-step read of every weight (a second or two a step on a CPU)
    # is spared; a user's rollout function (merging an adapter, sampling from a modified copy) gets the full read.
    # `tools`: the user's tools and environments run inside the rollout (episodes.py): user code, read in full too
    thorough = tools or type(rollout).__module__.split(".")[0] != "grpo_nb" or getattr(rollout, "user_written", False)
    sums = byte_sums([p for p, _ in checked]) if thorough else [None] * len(checked)
    moments = known_moments([p for p, _ in checked], sums)
    hooks = hooks_state(model)  # forward / backward hooks registered and left: taken off
    parameters = parameters_state(model)  # Parameter objects replaced: put back
    structure = structure_state(model)  # modules swapped, buffers, module numbers, torch's global hooks: put back
    # the buffers (rotary inv_freq, ...) a conversion replaces: the originals are small, kept to put back as they were
    buffers = [(m, key, b) for m in model.modules() for key, b in m._buffers.items() if b is not None]
    rewards: list = []  # the reward functions called inside (call_reward_funcs notes them): named when to blame
    CALLED.append(rewards)
    verdict: list = []  # what a refusal found changed in the weights, and whether trained ones (for run_end.stopped)

    def settle(failed: bool) -> None:  # after the rollout and the rewards, whether they returned or raised
        left = []
        if torch.is_grad_enabled() != grad:
            torch.set_grad_enabled(grad)
            left.append("grad mode off (torch.set_grad_enabled(False)): use `with torch.no_grad():` or "
                        "@torch.no_grad() instead")
        if torch.get_default_dtype() != default_dtype:  # new tensors of the loss (and the user's session) in it
            now_dtype = torch.get_default_dtype()
            torch.set_default_dtype(default_dtype)
            left.append(f"the default dtype set to {now_dtype} (torch.set_default_dtype()): set it back before "
                        f"returning")
        who = culprit(rollout, rewards, tools)  # a reward function, where grpo-nb's own engine sampled
        here = {id(m) for m in model.modules()}
        if any(id(m) not in here for m in layers):  # merge_and_unload() / unload(): no adapter left
            verdict[:] = ["the LoRA layers removed (merge_and_unload() or unload())", True]
            raise ValueError(f"{who} removed the model's LoRA layers (model.merge_and_unload() or "
                             f"unload() on the model train() trains): the adapter the run trains and saves is gone "
                             f"from it. Sample from a merged copy instead (grpo_nb.save_merged() to a folder, for "
                             f"vLLM), or, on a float32 model, merge with model.merge_adapter() and call "
                             f"model.unmerge_adapter() before returning (in 16 bits the unmerge rounds the base "
                             f"weights).")
        if moved := [(p, was) for (p, _), was in zip(checked, kinds) if (p.dtype, p.device) != was[:2]]:
            # model.half() / .to(...) converts the weights in place (the optimizer's too): put back, but refused, since
            # the conversion already rounded them (a NaN update or a silent loss of precision otherwise)
            p, (dtype, device, _) = moved[0]
            now = f"{p.dtype} on {p.device}"
            for p, (dtype_was, device_was, _) in moved:
                p.data = p.data.to(device_was, dtype_was)
            for m, key, b in buffers:  # converted with the weights: the kept originals back (they are not rounded)
                if (now_b := m._buffers.get(key)) is not None and (now_b.dtype, now_b.device) != (b.dtype, b.device):
                    m._buffers[key] = b
            verdict[:] = [f"{len(moved)} weight(s) converted to {now} and back (rounded)",
                          any(trains.get(id(q), False) for q, _ in moved)]
            raise ValueError(f"{who} converted {len(moved)} of the model's weights from {dtype} on "
                             f"{device} to {now} (model.half(), model.to(...) or the like on the model train() "
                             f"trains), which the update cannot train (the weights are rounded, the optimizer's "
                             f"state is of the old kind). Sample without converting the model: under "
                             f"torch.autocast(...) for a lower precision, or from a converted copy, and load the "
                             f"model again: the conversion rounded the weights of this model object.")
        names = {}
        if resized := [(p, was[2]) for (p, _), was in zip(checked, kinds) if tuple(p.shape) != was[2]]:
            names = {id(q): n for n, q in model.named_parameters()}
            p, shape = resized[0]
            verdict[:] = [f"{len(resized)} weight(s) resized (e.g. {names.get(id(p), '?')})",
                          any(trains.get(id(q), False) for q, _ in resized)]
            raise ValueError(f"{who} resized {len(resized)} of the model's weights (e.g. "
                             f"{names.get(id(p), '?')} from {list(shape)} to {list(p.shape)}: "
                             f"model.resize_token_embeddings() after tokenizer.add_tokens(), or the like), mid-run: the "
                             f"optimizer, the checkpoints and the saved adapter are of the model as it was. Add the "
                             f"tokens and resize the embeddings before train(), and load the model and the tokenizer "
                             f"again: both keep the change.")
        left += put_back_lora_forward(model, layers, lora)  # before an unmerge: it takes away the delta at this scale
        try:  # after the LoRA layers' own modules (said as theirs), before the Parameters (a parametrization's)
            left += put_back_structure(model, structure, who)
        except ValueError:
            verdict[:] = ["a buffer changed in place", False]
            raise
        left += put_back_peft_configs(model, configs)
        if merged := [m for m in layers if getattr(m, "merged", False)]:
            for m in merged:  # merge_adapter(): the merged layers compute without lora_A/B, so nothing gets a gradient
                m.unmerge()
            left.append(f"the adapter merged into the weights ({len(merged)} layer(s), model.merge_adapter()): call "
                        f"model.unmerge_adapter() before returning")
        # after the unmerge: a 4-bit layer's makes new Parameters, and the originals come back whole (after a
        # failed rollout too: the originals hold the step's values, which a checkpoint can then keep)
        try:
            left += put_back_parameters(model, parameters, who)
        except ValueError:
            verdict[:] = ["trained weights taken out of the model (their module replaced)", True]
            raise
        left += remove_new_hooks(model, hooks)
        if rewritten := rewritten_weights([p for p, _ in checked], samples, sums, moments):
            names = names or {id(q): n for n, q in model.named_parameters()}
            first, dtype = names.get(id(checked[rewritten[0]][0]), "?"), checked[rewritten[0]][0].dtype
            verdict[:] = [f"{len(rewritten)} weight(s) changed in place (e.g. {first})",
                          any(checked[i][1] for i in rewritten)]
            if dtype in (torch.float16, torch.bfloat16) and all(
                    ".base_layer." in names.get(id(checked[i][0]), "") for i in rewritten):
                # the 16-bit weights under the LoRA layers alone: peft's merge + unmerge (TRL's, before a vLLM sync)
                raise ValueError(f"{who} changed the values of {len(rewritten)} of the frozen weights "
                                 f"the LoRA layers sit on (e.g. {first}, {dtype}): model.merge_adapter() and "
                                 f"unmerge_adapter() add the adapter's delta to them and take it away in their own "
                                 f"dtype, which in 16 bits rounds them at every rollout (and a write into them, "
                                 f"p.data.copy_(...), changes them outright), so the run would train against a "
                                 f"drifting base and save the adapter for the original one. Sample from a merged "
                                 f"copy instead (grpo_nb.save_merged() to a folder, for vLLM) or with the adapter "
                                 f"unmerged, and load the model again: this model object keeps the changed weights.")
            # same dtype and device, other values: model.half().float() / model.to(torch.bfloat16).float() rounded
            # every weight (base ones too, which no save keeps), or the rollout wrote into the weights in place
            raise ValueError(f"{who} replaced or changed in place {len(rewritten)} of the model's "
                             f"weights (e.g. {first}) although they keep their dtype and device: a conversion and "
                             f"back (model.half().float(), model.to(torch.bfloat16).float()) rounds every weight, and "
                             f"a write into them, however few values (p.data.copy_(...), p.add_(...) under "
                             f"torch.no_grad(), emb.weight.data[token_id] = ...: weight noise, a token's embedding "
                             f"set, a weight sync by hand) changes them, the frozen base ones too, so the run would "
                             f"train against other weights than the adapter it saves is for. Sample without changing "
                             f"the model (under torch.autocast(...) for a lower precision, or from a converted or "
                             f"noised copy), and load the model again: this model object keeps the changed weights.")
        now = getattr(model, "active_adapter", None) if adapter is not None else None
        if isinstance(adapter, str) and now != adapter:
            model.set_adapter(adapter)
            left.append(f"peft adapter {now!r} active, where this run trains {adapter!r}: switch back with "
                        f"model.set_adapter({adapter!r}) before returning")
        elif isinstance(adapter, str) and any(tuple(getattr(m, "active_adapters", ()) or ()) != was
                                              for m, was in zip(layers, stacks)):
            # other adapters active in the layers (model.base_model.set_adapter([...]) stacks them): the loss would
            # train through all of them and the run save one
            stacked = sorted({a for m in layers for a in (getattr(m, "active_adapters", ()) or ())})
            model.set_adapter(adapter)
            left.append(f"peft adapters {stacked} active at once (stacked, e.g. model.base_model.set_adapter([...])), "
                        f"where this run trains {adapter!r} alone: switch back with model.set_adapter({adapter!r}) "
                        f"before returning")
        if any(bool(getattr(m, "disable_adapters", False)) and not was for m, was in zip(layers, disabled)):
            for m, was in zip(layers, disabled):
                m.enable_adapters(not was)
            left.append("the adapter layers disabled: sample from the base model inside `with "
                        "model.disable_adapter():`, or call model.base_model.enable_adapter_layers() before returning")
        changed = [p for p, flag in trainable if p.requires_grad != flag]
        for p, flag in trainable:
            p.requires_grad_(flag)
        if changed and not left:
            left.append(f"{len(changed)} weight(s) with requires_grad changed: put them back before returning")
        left += put_back_checkpointing(checkpointing)
        model.train()  # the loss's mode: gradient checkpointing and dropout act only in train mode
        if left and not failed and f"rollout left {left}" not in warned:
            warned.add(f"rollout left {left}")
            warnings.warn(f"{who} left the model with {'; and '.join(left)}. grpo-nb put the model "
                          f"back as it trains it after each rollout (its completions were sampled as the rollout "
                          f"left it), so the run trains and saves what it was given; fix the function so that it "
                          f"also leaves the model as it found it outside train().", UserWarning, stacklevel=4)

    try:
        yield
    except BaseException as err:  # the rollout or a reward stopped (Ctrl-C, an error): the run ends here
        try:
            settle(True)  # what can be put back is; a change that cannot is told to run_end.stopped, not raised
        except ValueError:
            pass
        # run_end.stopped() writes no checkpoint of a step from trained weights this left changed (the last one
        # on disk stays the one to resume from); frozen ones changed: the checkpoint (trained weights) is right
        if verdict:
            err.grpo_nb_model_changed = (culprit(rollout, rewards, tools), *verdict)
        raise
    finally:
        CALLED[:] = [r for r in CALLED if r is not rewards]
    try:
        settle(False)
    except ValueError as refusal:
        if verdict:
            refusal.grpo_nb_model_changed = (culprit(rollout, rewards, tools), *verdict)
        raise


def name_of(rollout) -> str:
    """The name a rollout is called by in the guard's messages."""
    return getattr(rollout, "__name__", None) or type(rollout).__name__


def culprit(rollout, rewards, tools: bool = False) -> str:
    """Who changed the model, as a message's subject: the reward functions where the rollout is grpo-nb's own engine
    (which leaves the model as it found it) - or the tools and environments they ran beside - else the user's
    rollout."""
    ours = type(rollout).__module__.split(".")[0] == "grpo_nb" and not getattr(rollout, "user_written", False)
    if tools and ours:
        return ("One of the tools or environments of the episodes, or a reward function"
                + (f" ({', '.join(map(repr, rewards))})" if rewards else "") + ", run beside grpo-nb's rollout engine,")
    if rewards and ours:
        return (f"The reward function {rewards[0]!r} (run after grpo-nb's rollout engine)" if len(rewards) == 1 else
                f"One of the reward functions ({', '.join(map(repr, rewards))}, run after grpo-nb's rollout engine)")
    return f"The rollout {name_of(rollout)!r}"


def tokenizer_state(tokenizer, model) -> dict:
    """What of the tokenizer (and the model's generation ids) the run depends on: what it renders, encodes, pads with,
    stops at, and saves with the adapter."""
    generation = getattr(model, "generation_config", None)
    return {"chat_template": copy.deepcopy(getattr(tokenizer, "chat_template", None)),
            "padding_side": getattr(tokenizer, "padding_side", None),
            "truncation_side": getattr(tokenizer, "truncation_side", None),
            "special tokens": repr(getattr(tokenizer, "special_tokens_map", None)),
            "vocabulary": len(tokenizer) if hasattr(tokenizer, "__len__") else None,
            "generation_config.eos_token_id": copy.deepcopy(getattr(generation, "eos_token_id", None)),
            "generation_config.pad_token_id": copy.deepcopy(getattr(generation, "pad_token_id", None))}


@contextmanager
def tokenizer_kept(tokenizer, model, warned: set, who: str = "the rollout, a reward function, a tool or an environment",
                   during: str = "this step's rollout"):
    """Around the rollouts of a step, as `model_kept_for_update` for the weights: the tokenizer (and the model's
    generation ids) come back as they were. A tool, an environment, a rollout or a reward function that sets
    another chat template, padding side or EOS would have the next steps render, pad or stop otherwise, and the run
    save that tokenizer with the adapter: put back, said once - also when the rollout then fails (a reward function
    raising, Ctrl-C), so the checkpoint of the last step written on the way out holds the tokenizer it trained
    with. Tokens added or special tokens set change what ids mean, which cannot be put back: refused, and the error
    (this refusal, or the rollout's own) marked `grpo_nb_tokenizer_changed`, which run_end.stopped() reads to write
    no checkpoint with that tokenizer. Also around the callbacks (`who`, `during`: how the messages name them),
    which run before the step's checkpoint is written."""
    before = tokenizer_state(tokenizer, model)
    try:
        yield
    except BaseException as err:
        try:
            refusal = _put_back(tokenizer, model, before, warned, who, during)
        except Exception:  # noqa: BLE001 - never mask what stopped the rollout
            refusal = None
        if refusal is not None:
            err.grpo_nb_tokenizer_changed = refusal
        raise
    refusal = _put_back(tokenizer, model, before, warned, who, during)
    if refusal is not None:
        error = ValueError(refusal)
        error.grpo_nb_tokenizer_changed = refusal
        raise error


def _put_back(tokenizer, model, before: dict, warned: set, who: str, during: str) -> str | None:
    """Puts back what of `before` (tokenizer_state) can be, saying so once; returns the refusal's message when
    tokens were added or special tokens set (which cannot be), else None."""
    after = tokenizer_state(tokenizer, model)
    changed = [key for key in before if before[key] != after[key]]
    if not changed:
        return None
    fixed = [key for key in changed if key not in ("vocabulary", "special tokens")]
    generation = getattr(model, "generation_config", None)
    for key in fixed:
        if key.startswith("generation_config."):
            setattr(generation, key.split(".", 1)[1], before[key])
        else:
            setattr(tokenizer, key, before[key])
    if len(fixed) < len(changed):
        return (f"During {during} {who} changed the tokenizer train() trains with "
                f"({', '.join(changed)}): tokens added or special tokens set change what the ids mean, for "
                f"the model, the checkpoints and the tokenizer saved with the adapter. Add tokens before "
                f"train() (and resize the embeddings), and inside those functions work on a copy "
                f"(copy.deepcopy(tokenizer)). Load the tokenizer again: this object keeps the change.")
    if "tokenizer" not in warned:
        warned.add("tokenizer")
        warnings.warn(f"During {during} {who} changed {', '.join(changed)} of the tokenizer or the model's "
                      f"generation settings: put back as train() started (the next steps would render, pad or stop "
                      f"otherwise, and the run saves this tokenizer with the adapter). Work on a copy "
                      f"(copy.deepcopy(tokenizer)) inside the function; this is said once per run.", UserWarning,
                      stacklevel=4)
    return None
