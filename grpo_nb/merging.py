"""The merged model: a LoRA adapter added into its base weights, tensor by tensor, without touching the training
model (its adapter stays separate, so training can go on). DoRA and lora_bias go through peft's own merge on a copy of
the layer, a modules_to_save module gives its trained copy, a 4-bit base is dequantized layer by layer (the weights the
4-bit model computed with), a tied embedding is given once. What no merged model can hold is refused before any work.
save_merged writes the tensors as a transformers folder (`write_merged`), save_gguf as one GGUF file.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch


def is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


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


def _both_embeddings(base, names: set) -> bool:
    """Whether the input and the output embeddings were both written: a tied model whose LoRA or modules_to_save
    changed one of them computes with two matrices now, and the merged model must not tie them again."""
    where = {id(module): name for name, module in base.named_modules()}
    embeddings = (base.get_input_embeddings(), getattr(base, "get_output_embeddings", lambda: None)())
    return all(module is not None and f"{where.get(id(module))}.weight" in names for module in embeddings)


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


def write_merged(folder: Path, base, tokenizer, dtype: torch.dtype, max_shard_bytes: int) -> None:
    """The merged model into `folder` as transformers saves one: safetensors shards of at most `max_shard_bytes`
    (an index when there are several), its plain config, generation config and the tokenizer."""
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
