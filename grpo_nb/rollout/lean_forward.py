"""A CPU rollout's forward for Llama-family models without the module machinery: the same arithmetic, fewer ops.

A decode step of the embedded default (SmolLM2-135M, 30 layers) through transformers' and peft's modules runs
~2,000 ATen ops and ~500 module calls for ~200 products; at a few rows each op's Python and dispatch cost is
comparable to its work, and measured here a 4-row step took ~88 ms where its products alone take ~40
(benchmarks/profile_cpu.md). `lean_forward` computes the same decoder - RMSNorm, rotary attention with grouped
KV heads, the gated SiLU MLP - as straight tensor calls, with each projection's weight taken once per call: a
plain nn.Linear's own, or a LoRA layer's rollout copy merged as `grpo_nb.lora` merges it (the same copies, the
same memory budget). A projection without such a weight (adapters it cannot merge, a copy over the budget) runs
its module, so nothing is ever computed differently from the module's forward except float rounding order (in fp32
~1e-6; a 16-bit model's logits differ by 16-bit rounding - measured ~1.4% of their scale in bf16, as much as the
merged copies already differ from peft's branch -, since SDPA on the CPU accumulates differently from eager
attention). A plain peft model (not set up by grpo-nb) merges here too, as grpo-nb's own LoRA layers do.

What stays the model's own: the embedding, the rotary embedding's cos / sin (every rope scaling; applied by
`_rotate`, transformers' formula in three ops), the output head (with `cpu_output_head`'s few-row product), the KV
cache object (transformers' DynamicCache: its layers' keys and values become views of buffers with spare columns,
`LeanForward._append`, so the engine's row compaction and prefix sharing work on it unchanged). Attention is
`scaled_dot_product_attention` with a boolean mask built from the engine's attention mask; a decode step's (one
token per row) is grpo-nb's C kernel where it builds and passes its check (`grpo_nb.kernels.cpu_attention`: the
same attention in fp32 arithmetic, the prompt prefix every row shares read once; 16 rows of the embedded default
~2x faster than SDPA). With bf16 rollout copies
(`cpu_rollout_dtype`) the cache and attention are in bf16 too (`LeanForward._kv_dtype`): the values come out of
the bf16 products already rounded, and at 16 rows a decode step reads about as many bytes of cache as of weights
(measured: a 16-row step 57 -> 52 ms, 4 rows 37 -> 35 ms). With bf16 copies, too, the projections that read the
same input - q / k / v, gate / up - multiply as one product each, their copies fused into one weight
(`LeanForward._fuse`), and a product's output enters the next fp32 op without a cast of its own. A decode step
with fused bf16 copies then runs the steps between its products in C (`LeanForward._decode_layers`,
`grpo_nb.kernels.cpu_decode_ops`: a dozen calls a layer instead of ~40 torch ops, the same arithmetic; 16 rows
~77 -> ~59 ms a step on a slow hour), and its few-row products may be grpo-nb's AMX kernel
(`grpo_nb.kernels.cpu_linear`, where `lora.skinny_linear` times it faster than torch's).

It takes only models it reproduces: transformers' Llama / Mistral / Qwen2 classes exactly (Qwen3's per-head
norms, Gemma's scaled embeddings and norms, Phi-3's fused projections are other arithmetic), full attention
(eager or sdpa, no sliding window), SiLU, weights on the CPU, no hooks (except hooks marked `observing`, which it
calls itself: the simulation's op recorder); `lean_unsupported_reason` says why not, and the engine then calls the
model. Off the CPU the modules' kernels are what a step costs, not their
calls (a CUDA graph removes those): there the engine's prefills and dynamic steps call the model.

A GPU's static decode step (`StaticDecoder`, replayed from a CUDA graph) is `LeanForward.static_step`: the same
decoder over the static cache, each projection the model's own module (bitsandbytes' 4-bit layers, grpo-nb's LoRA
layers) or weight, with the steps between the products in Triton kernels (`grpo_nb.kernels.decode_triton`: the
residual add with the norm, the rotation with the cache's column write, SiLU with the gate's product, attention over
the columns written so far - ~20 kernels a layer fewer, transformers' arithmetic, self-tested per shape by
`kernels.decode_glue`) and the adapters' A of q / k / v (and of gate / up) multiplied as one (`_branches`).
Priced on a T4 (Qwen2.5-1.5B QLoRA, 8 rows): ~1,190 -> ~720 kernels a step, 11.2 -> 8.5 ms (with the
sampling replayed from a graph of its own: `RolloutEngine._decode_static`). Never run on a GPU:
on the CPU it is held to the model's forward under Triton's interpreter and, with the kernels' PyTorch
references, bit for bit (tests/test_decode_triton.py).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from .. import lora
from ..attachments import base_model
from ..kernels import cpu_attention, cpu_decode_ops
from ..rms_norm import rms_norm
from .static_cache import static_unsupported_reason

# Benchmarks switch it off to measure the modules' forward (benchmarks/cpu_decode.py).
LEAN_ON_CPU = True
# Benchmarks switch it off to measure one product per projection (`LeanForward._fuse`).
FUSE = True
LAYER_CLASSES = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer")
NORM_CLASSES = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")
PROJECTIONS = (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj")))
# projections that read the same input, multiplied as one where their rollout copies can be fused (`LeanForward._fuse`)
FUSED = (("qkv", "self_attn", ("q_proj", "k_proj", "v_proj")), ("gate_up", "mlp", ("gate_proj", "up_proj")))
MODEL_TYPES = ("llama", "mistral", "qwen2")  # the configs of those classes (the memory estimate's view)


# A GPU's static decode steps through `LeanForward.static_step` (benchmarks switch it off to price the modules'
# step); on the CPU only where a test asks, to hold it to the model's forward.
LEAN_STATIC = True
LEAN_STATIC_ON_CPU = False


def static_lean(model, device) -> tuple | None:
    """(LeanForward, glue) for a `StaticDecoder`'s decode steps of `model` on `device`: a GPU's (or the meta device
    standing for one), a model the lean forward reproduces, the glue kernels passing their check
    (`kernels.decode_glue`); None otherwise - the model's own forward."""
    from ..attention import simulated_capability
    from ..kernels import decode_glue

    device = torch.device(device)
    gpu = device.type == "cuda" or (device.type == "meta" and simulated_capability.get() is not None)
    if not (LEAN_STATIC and (gpu or (device.type == "cpu" and LEAN_STATIC_ON_CPU))):
        return None
    if lean_unsupported_reason(model, on_gpu=True) is not None:
        return None
    glue = decode_glue.glue(base_model(model), device)
    return None if glue is None else (LeanForward(model), glue)


def spare_columns(length: int) -> int:
    """The columns a layer's keys/values buffer gets beyond `length` when it is (re)made (`LeanForward._append`):
    a quarter more, at least 32 - a new buffer every ~32 decode steps at first, then more rarely."""
    return max(32, length // 4)


def config_supported(config) -> bool:
    """Whether a model of this config would take the lean forward by its architecture (what the memory estimate can
    know; `lean_unsupported_reason` decides on the model itself)."""
    return (getattr(config, "model_type", None) in MODEL_TYPES and getattr(config, "hidden_act", None) == "silu"
            and not getattr(config, "use_sliding_window", False)
            and (config.model_type != "mistral" or getattr(config, "sliding_window", None) is None))


def lean_unsupported_reason(model, on_gpu: bool = False) -> str | None:
    """Why `lean_forward` cannot stand in for this model's forward (None: it can). `on_gpu`: for a GPU's static
    decode step (`LeanForward.static_step`), whose weights are not the CPU's."""
    base = base_model(model)
    inner = getattr(base, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not all(hasattr(inner, n) for n in ("embed_tokens", "norm", "rotary_emb")):
        return f"{type(base).__name__} is not a decoder with .model.layers / embed_tokens / norm / rotary_emb"
    config = base.config
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {getattr(config, 'hidden_act', None)!r} (SiLU only)"
    reason = static_unsupported_reason(base)
    if reason is not None:
        return reason
    peft_config = getattr(model, "active_peft_config", None) if model is not base else None
    if getattr(peft_config, "is_prompt_learning", False):
        return "a prompt-learning adapter (its virtual tokens are added by peft's forward)"
    for layer in layers:
        if type(layer).__name__ not in LAYER_CLASSES:
            return f"decoder layer {type(layer).__name__} (supported: {', '.join(LAYER_CLASSES)})"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if type(norm).__name__ not in NORM_CLASSES:
                return f"norm {type(norm).__name__}"
        for parent, names in PROJECTIONS:
            if not all(hasattr(getattr(layer, parent), n) for n in names):
                return f"{type(layer).__name__}.{parent} lacks one of {names}"
        changed = _changed_forward(layer, layer.self_attn, layer.mlp, layer.input_layernorm,
                                   layer.post_attention_layernorm)
        if changed:
            return changed
        if type(getattr(layer.mlp, "act_fn", None)).__name__ not in ("SiLUActivation", "SiLU"):
            return f"activation {type(getattr(layer.mlp, 'act_fn', None)).__name__} (SiLU only)"
    if type(inner.norm).__name__ not in NORM_CLASSES:
        return f"norm {type(inner.norm).__name__}"
    if base.get_output_embeddings() is None:
        return "no output head"
    # where rollouts merge: the CPU, and meta while grpo_nb.simulate stands in for it (lora.merge_on)
    if not on_gpu and any(p.device.type not in lora.MERGE_DEVICES for p in base.parameters()):
        return "weights off the CPU (the lean forward is for CPU rollouts)"
    if (torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks
            or any(_acting_hooks(m, watching_allowed=m is base or m is inner) or hasattr(m, "_hf_hook")
                   for m in model.modules())):
        return "forward hooks on the model (they would not run)"
    return None


def observing(hook):
    """`hook` (a forward hook or pre-hook registered with_kwargs=True on the causal LM or its decoder) marked as one
    that only watches: a model with such hooks still takes the lean forward, which calls them itself around each of
    its forwards (grpo_nb.simulate's op recorder: where each rollout call starts and ends)."""
    def observe(*args):
        return hook(*args)

    observe.observes_only = True
    return observe


def _acting_hooks(module, watching_allowed: bool) -> bool:
    """Whether `module` has hooks the lean forward would not run: any, or (the causal LM and its decoder, whose
    `observing` hooks it calls) any but those."""
    return any(not (watching_allowed and getattr(h, "observes_only", False))
               for h in (*module._forward_hooks.values(), *module._forward_pre_hooks.values()))


def _changed_forward(*modules) -> str | None:
    """Which module computes something other than transformers' own class would: a class from elsewhere (a copy of
    modeling_llama in remote code, a subclass), a forward patched on the class or set on the instance - except
    grpo-nb's own instance forwards (tiled MLP, lean norms), which compute the same values."""
    for module in modules:
        cls = type(module)
        if not cls.__module__.startswith("transformers.models.") or not cls.forward.__module__.startswith(
                "transformers."):
            return f"{cls.__module__}.{cls.__name__} is not transformers' own (or its forward is patched)"
        own = module.__dict__.get("forward")
        if own is not None and not getattr(own, "__module__", "").startswith("grpo_nb."):
            return f"{cls.__name__} has a forward set on the instance"
    return None


def usable(model, exact_adapters: bool) -> bool:
    """Whether a rollout of this model forwards through `lean_forward`: on the CPU, with rollout copies merged
    (not the exact-adapter path), the switch on, and a model it reproduces."""
    return LEAN_ON_CPU and lora.MERGE_ON_CPU and not exact_adapters and lean_unsupported_reason(model) is None


def _rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    """transformers' LlamaRMSNorm (and Mistral's, Qwen2's): `grpo_nb.rms_norm`, its formula. In fp32 (the formula's
    casts do nothing) torch's own `F.rms_norm`, the same formula in one op (~4x faster at a decode step's rows,
    bitwise equal on the shapes tried with torch 2.13)."""
    if x.dtype == norm.weight.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], norm.weight, norm.variance_epsilon)
    return rms_norm(x, norm.weight, norm.variance_epsilon)


def _project(projection, x: torch.Tensor, cast: dict, dtype: torch.dtype) -> torch.Tensor:
    """x through a projection as `LeanForward` resolved it - (weight, bias), or the module itself (which takes x in
    `dtype`, the model's) -, the product in its weight's dtype. A lower-precision rollout copy
    (`cpu_rollout_dtype`) takes the rows cast to its dtype, as `lora.skinny_linear` casts them, but once per norm
    output for the projections that share it (`cast`: dtype -> x in it); the model's own weights take them in the
    model's dtype. The caller widens the product where the model's dtype is wider (`_widened`)."""
    if type(projection) is not tuple:
        return projection(x.to(dtype))
    weight, bias = projection
    if weight.dtype != lora._merge_dtype:
        rows = x.to(weight.dtype)
    else:
        rows = x if x.dtype == weight.dtype else cast.get(weight.dtype)
        if rows is None:
            rows = cast[weight.dtype] = x.to(weight.dtype)
    return lora.skinny_linear(rows, weight, bias)


def _widened(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as an operand of arithmetic in `dtype` (the model's): x itself where it is narrower (a bf16 rollout copy's
    product), since the op widens it exactly on the way - the same values as a cast first, one op fewer -, else
    cast to `dtype`."""
    return x if torch.promote_types(x.dtype, dtype) == dtype else x.to(dtype)


def _rotary(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder's rotary cos / sin [n, T, d] made ready for `_rotate`, once per forward: [n, 1, T, d] each,
    sin with its first half negated."""
    half = sin.shape[-1] // 2
    return cos.unsqueeze(1), torch.cat([-sin[..., :half], sin[..., half:]], dim=-1).unsqueeze(1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' `apply_rotary_pos_emb` (Llama / Mistral / Qwen2) for one of q, k [n, heads, T, d]:
    x * cos + rotate_half(x) * sin, where rotate_half(x) * sin = [-x2, x1] * [s1, s2] = roll(x, d/2) * [-s1, s2] -
    the same products and sum, three ops instead of ~eight (a decode step runs 60 of these)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)


def _static_project(projection, x: torch.Tensor) -> torch.Tensor:
    """x through a projection as `LeanForward` resolved it for `static_step`: the module itself, or (weight, bias)
    multiplied as nn.Linear's forward does (a CPU rollout's lower-precision copy takes the rows in its dtype)."""
    if type(projection) is not tuple:
        return projection(x)
    weight, bias = projection
    if weight.dtype != x.dtype:
        return F.linear(x.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype)).to(x.dtype)
    return F.linear(x, weight, bias)


def _branches(parent, names, dtype: torch.dtype) -> tuple | None:
    """For the adapted projections `names` of `parent` (one input): (their base layers, their adapters' A stacked
    in `dtype` [sum of ranks, in], their B for one product (`_b_products`), per projection (B in `dtype`, scaling,
    its columns of x @ A.T)) where each adds its branch as `lora_add`'s rollout path does
    (`lora.rollout_branch_parts`), else None. One product x @ A.T and one of B for the group instead of one each,
    the branches added by the kernel that reads the outputs next (a decode step: 6 kernels fewer a layer). The
    rollout's own 16-bit copies (`lora.stacked_copy16`, `lora._copy16`: held once, as long as the engine call - and
    the graph that replays them)."""
    parts = [lora.rollout_branch_parts(getattr(parent, name), dtype) for name in names]
    if any(part is None for part in parts):
        return None
    stacked = lora.stacked_copy16([a for _, a, _, _ in parts], dtype)  # (the prefill's copies of each: views now)
    # B of one shape (gate / up; q / k / v without grouped heads) stacked for a batched product, else block-diagonal
    # (q / k / v of other widths: the zeros cost a little reading, ~0.1 MB a layer of Qwen2.5-1.5B)
    diagonal = len({tuple(b.shape) for _, _, b, _ in parts}) > 1
    b_stacked = lora.stacked_copy16([b for _, _, b, _ in parts], dtype, diagonal=diagonal)
    start, branches = 0, []
    for _, a, b, scaling in parts:
        branches.append((lora._copy16(b, dtype), scaling, slice(start, start + a.shape[0])))
        start += a.shape[0]
    return [base for base, _, _, _ in parts], stacked, (b_stacked, diagonal), branches


def _b_products(b_group: tuple, branches: list, xa: torch.Tensor) -> list:
    """Each projection's (x @ A.T) @ B.T, unscaled, from the group's x @ A.T [n, sum of ranks] in one product:
    batched over B of one shape ([n, out] each), or through the block-diagonal B (views of its [n, sum of outs])."""
    stacked, diagonal = b_group
    if diagonal:
        return list((xa @ stacked.t()).split([b.shape[0] for b, _, _ in branches], dim=1))
    groups, (out, rank) = len(branches), branches[0][0].shape
    return list(torch.bmm(xa.view(-1, groups, rank).transpose(0, 1), stacked.view(groups, out, rank).transpose(1, 2))
                .unbind(0))


def _static_products(p: dict, group: str, names, x: torch.Tensor) -> tuple:
    """The products of the projections `names` on x [n, in] for `static_step`: (their outputs, None), or with
    their adapters stacked (`_branches`) (each base layer's output, [(its branch, scaling)]) for the next kernel to
    add (`decode_triton`'s `adds`: y + scaling * branch, one rounding, as `lora_add`'s rollout path adds
    `addmm_(..., alpha=scaling)` but for the branch's own rounding to the dtype)."""
    branches = p.get(group + "_branches")
    if branches is None or x.dtype != branches[1].dtype:
        return tuple(_static_project(p[name], x) for name in names), None
    bases, stacked, b_group, parts = branches
    xa = x @ stacked.t()
    ys = [base(x) for base in bases]
    # (a base output of another dtype, strided or aliasing x: what lora_add would copy or compute otherwise)
    plain = [y.dtype == x.dtype and y.is_contiguous() and not lora._shares_memory(y, x) for y in ys]
    if all(plain):
        return tuple(ys), [(d, scaling) for d, (_, scaling, _) in zip(_b_products(b_group, parts, xa), parts)]
    out = []  # what lora_add does, one projection at a time: the module where its base output is not plain
    for name, y, ok, (b, scaling, columns) in zip(names, ys, plain, parts):
        out.append(y.addmm_(xa[:, columns], b.t(), alpha=scaling) if ok else _static_project(p[name], x))
    return tuple(out), None


def _attention(attn, q, keys, values, mask) -> torch.Tensor:
    """The attention module's own attention function (its config's implementation, as its forward resolves it)
    on q [n, heads, 1, d] and the static cache: [n, 1, heads, d]."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    implementation = attn.config._attn_implementation
    if implementation == "eager":
        function = sys.modules[type(attn).__module__].eager_attention_forward
    else:
        function = ALL_ATTENTION_FUNCTIONS[implementation]
    extra = {"sliding_window": attn.sliding_window} if hasattr(attn, "sliding_window") else {}
    out, _ = function(attn, q, keys, values, mask, dropout=0.0 if not attn.training else attn.attention_dropout,
                      scaling=attn.scaling, **extra)
    return out


def _grown(layer, dtype: torch.dtype | None = None) -> bool:
    """Whether a cache layer holds keys and values `_append` can grow in place (of `dtype`, if given)."""
    return (layer is not None and getattr(layer, "is_initialized", False) and layer.keys is not None
            and layer.keys.dim() == 4 and (dtype is None or layer.keys.dtype == dtype == layer.values.dtype))


def _attention_mask(attention_mask: torch.Tensor | None, T: int, S: int, device) -> torch.Tensor | None:
    """[n, 1, T, S] booleans (True: attend) for T new tokens after S - T cached columns: the engine's mask of
    real columns, causal among the new tokens; each token always sees itself, so a padding row's attention stays
    finite (its output is never used). None where every column is real and nothing is hidden."""
    if T == 1 and (attention_mask is None or bool(attention_mask.all())):
        return None
    query = torch.arange(S - T, S, device=device)[:, None]
    key = torch.arange(S, device=device)[None]
    allowed = (key <= query)[None]
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()[:, None, :]
    return (allowed | (key == query))[:, None]


class LeanForward:
    """One rollout call's lean forward of `model`. Each projection's weight (`lora.rollout_weight`) is looked up at
    the first forward and kept for the call: between one engine call's forwards nothing but the engine runs, and a
    decode step then spends no time asking ~200 layers again (~12 ms of a 4-row step of the embedded default)."""

    def __init__(self, model):
        self.base = base_model(model)
        # how many first cache columns hold the same keys and values in every row (a prompt prefix the engine
        # prefilled once and repeated): a decode step's attention reads them from one row (`cpu_attention`)
        self.shared_columns = 0
        self._projections = None  # per layer: {name: (weight, bias) or the module}
        self._glue = None  # the dtype of the copies, where decode steps may run `_decode_layers`
        self._room: dict = {}  # per cache layer index: (the layer, keys buffer, values buffer) with spare columns
        # the watching hooks (`observing`) of the model and its decoder, in the order a model call runs them
        outer = (self.base, self.base.model)
        self._before = [(m, h) for m in outer for h in m._forward_pre_hooks.values() if getattr(h, "observes_only", 0)]
        self._after = [(m, h) for m in outer[::-1] for h in m._forward_hooks.values() if getattr(h, "observes_only", 0)]

    def _append(self, cache, i: int, k: torch.Tensor, v: torch.Tensor):
        """cache.update(k, v, i) without copying what the layer holds: its keys and values become views of
        buffers with spare columns, written in place (DynamicCache's cat copies the whole cache every step: at
        16 rows of the embedded default's ~260 columns, ~0.4 GB of traffic a step)."""
        layer = cache.layers[i] if hasattr(cache, "layers") and i < len(cache.layers) else None
        if not _grown(layer):
            return cache.update(k, v, i)  # a new layer: transformers' own first update (a copy, never v's view)
        T = k.shape[2]
        kbuf, vbuf, length = self._room_for(i, layer, T)
        kbuf[:, :, length:length + T] = k
        vbuf[:, :, length:length + T] = v
        layer.keys, layer.values = kbuf[:, :, :length + T], vbuf[:, :, :length + T]
        return layer.keys, layer.values

    def _room_for(self, i: int, layer, T: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(keys buffer, values buffer, the column T new tokens go to) for cache layer i: where the layer's tensors
        are no longer views of its buffers (the engine dropped finished rows, repeated a prefix, a new cache), or
        the buffers are full, they are copied once into new buffers with spare columns."""
        keys, values = layer.keys, layer.values
        n, heads, length, dim = keys.shape
        kept = self._room.get(i)
        if (kept is None or kept[0] is not layer or keys.data_ptr() != kept[1].data_ptr()
                or keys.stride() != kept[1].stride() or keys.shape[:2] != kept[1].shape[:2]
                or length + T > kept[1].shape[2]):
            capacity = length + T + spare_columns(length)
            kbuf = keys.new_empty(n, heads, capacity, dim)
            vbuf = values.new_empty(n, heads, capacity, dim)
            kbuf[:, :, :length] = keys
            vbuf[:, :, :length] = values
            kept = self._room[i] = (layer, kbuf, vbuf)
        return kept[1], kept[2], length

    @staticmethod
    def _kv_dtype(cache, i: int, v_proj, hidden: torch.dtype) -> torch.dtype:
        """The dtype layer i's keys and values are cached in: what the cache already holds, else a lower-precision
        rollout's (`cpu_rollout_dtype`: its values come out of the bf16 product in bf16 anyway, and a decode step
        at 16 rows reads as many bytes of cache as of weights), else the model's."""
        layer = cache.layers[i] if hasattr(cache, "layers") and i < len(cache.layers) else None
        if layer is not None and getattr(layer, "is_initialized", False) and layer.keys is not None:
            return layer.keys.dtype
        if type(v_proj) is tuple and v_proj[0].dtype == lora._merge_dtype:
            return v_proj[0].dtype
        return hidden

    def _resolve(self) -> list[dict]:
        resolved = []
        for layer in self.base.model.layers:
            found = {}
            for parent, names in PROJECTIONS:
                for name in names:
                    module = getattr(getattr(layer, parent), name)
                    weight, bias = lora.rollout_weight(module) or (None, None)
                    if weight is not None and bias is not None and weight.dtype == lora._merge_dtype != bias.dtype:
                        bias = bias.to(weight.dtype)  # once per call, as skinny_linear casts it per product
                    found[name] = module if weight is None else (weight, bias)
            for fused, parent, names in FUSED:
                found[fused] = self._fuse(found, getattr(layer, parent), names) if FUSE else None
            resolved.append(found)
        return resolved

    @staticmethod
    def _fuse(found: dict, parent, names) -> tuple | None:
        """The projections `names` of `parent` (which read the same input) as one product - ((weight, bias), the
        rows of each) - where each multiplies by this rollout's merged bf16 copy (`lora.fused_copies`); `found`'s
        entries for them then hold views of the fused weight. None otherwise: each multiplies on its own. Measured
        on the embedded default (benchmarks/profile_cpu.md): bf16 copies 1 / 4 / 16 rows ~2.5 / 2 / 1.5 ms a decode
        step faster fused; fp32 ones no faster (4 rows ~2 ms slower: MKL's few-row fp32 GEMM on the taller weight)."""
        parts = [found[name] for name in names]
        if (any(type(p) is not tuple or p[0].dtype != torch.bfloat16 for p in parts)
                or len({p[1] is None for p in parts}) != 1):
            return None
        if parts[0][1] is not None and len({p[1].dtype for p in parts}) != 1:
            return None
        weight = lora.fused_copies([getattr(parent, name) for name in names], [p[0] for p in parts])
        if weight is None:
            return None
        sizes = [p[0].shape[0] for p in parts]
        bias = None if parts[0][1] is None else torch.cat([p[1] for p in parts])
        for name, (_, own_bias), view in zip(names, parts, weight.split(sizes)):
            found[name] = (view, own_bias)  # the separate copies are no longer held
        return (weight, bias), sizes

    def _glue_fits(self) -> torch.dtype | None:
        """The dtype of the rollout copies every projection multiplies by (bf16 or fp32, the same for all), where
        `_decode_layers` takes the layers - fp32 norms, an even head size -; else None."""
        dtypes = set()
        for layer, p in zip(self.base.model.layers, self._projections):
            if any(type(p[name]) is not tuple or not p[name][0].is_cpu for _, names in PROJECTIONS for name in names):
                return None
            dtypes |= {p[name][0].dtype for _, names in PROJECTIONS for name in names}
            if any(norm.weight.dtype != torch.float32 for norm in (layer.input_layernorm,
                                                                    layer.post_attention_layernorm)):
                return None
            attn = layer.self_attn
            if attn.head_dim % 2 or p["q_proj"][0].shape[0] % attn.head_dim:
                return None
            if p["k_proj"][0].shape != p["v_proj"][0].shape or p["gate_proj"][0].shape != p["up_proj"][0].shape:
                return None
        return dtypes.pop() if len(dtypes) == 1 and dtypes <= {torch.bfloat16, torch.float32} else None

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
                 cache) -> tuple[torch.Tensor, object]:
        """The model's forward over `input_ids` [n, T] after what `cache` holds (None: nothing; a DynamicCache is
        made): (fp32 logits at the last position [n, V], the cache with these tokens appended). `attention_mask`
        [n, S]: which of the cache's columns and the new ones hold real tokens (None: all). Call it without
        gradients inside `lora.rollout_branch()` and `lora.cpu_output_head()`, as the engine does."""
        if self._projections is None:
            self._projections = self._resolve()
            self._glue = self._glue_fits()
        return self._watched(self._forward, input_ids, attention_mask, position_ids, cache)

    def _watched(self, forward, input_ids, attention_mask, position_ids, cache):
        """forward(input_ids, attention_mask, position_ids, cache), inside the model's watching hooks (`observing`)
        as a model call runs them."""
        if not (self._before or self._after):
            return forward(input_ids, attention_mask, position_ids, cache)
        watched = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       past_key_values=cache)
        for module, hook in self._before:
            hook(module, (), watched)
        out = forward(input_ids, attention_mask, position_ids, cache)
        for module, hook in self._after:
            hook(module, (), watched, out)
        return out

    def static_step(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache, glue
                    ) -> torch.Tensor:
        """One decode step on a `StaticDecoder`'s buffers (a GPU's, replayed from a CUDA graph): tokens and
        positions [n, 1], the additive mask [n, 1, 1, L], the static cache (`static_cache._StaticKV`: per layer
        keys / values [n, kv_heads, L, d], written at its `write_pos`) -> the head's logits [n, V] (its dtype).
        The model's arithmetic, op for op where transformers' modules compute it (`decode_triton`'s references),
        with the steps between the products and the attention in `glue`'s kernels (`kernels.decode_glue`: 6 a
        layer instead of ~20) and every projection and the head the model's own module or weight."""
        if self._projections is None:
            self._projections = self._static_resolve()
        return self._watched(lambda *args: self._static_layers(*args, glue), tokens, mask, positions, cache)

    def _static_resolve(self) -> list[dict]:
        """`_resolve`'s projections, and per group of adapted projections that read the same input (q / k / v,
        gate / up) their adapters' A stacked in the model's 16-bit dtype (`_branches`)."""
        resolved, inner = self._resolve(), self.base.model
        dtype = torch.result_type(inner.layers[0].input_layernorm.weight, inner.embed_tokens.weight)
        for layer, found in zip(inner.layers, resolved):
            for fused, parent, names in FUSED:
                found[fused + "_branches"] = _branches(getattr(layer, parent), names, dtype)
        return resolved

    def _static_layers(self, tokens, mask, positions, cache, glue) -> torch.Tensor:
        inner = self.base.model
        n = tokens.shape[0]
        h = inner.embed_tokens(tokens)
        cos, sin = (t.reshape(n, -1) for t in inner.rotary_emb(h, positions))  # [n, head_dim] each
        h = h.reshape(n, -1)  # the embedding's own output [n, D], updated in place from here
        delta = None  # the previous layer's MLP output, added to h by the next norm
        for i, (layer, p) in enumerate(zip(inner.layers, self._projections)):
            attn, norm = layer.self_attn, layer.input_layernorm
            x = glue.residual_norm(h, delta, norm.weight, norm.variance_epsilon)
            (q, k, v), adds = _static_products(p, "qkv", ("q_proj", "k_proj", "v_proj"), x)
            keys, values = cache.static_keys[i], cache.static_values[i]
            q = glue.rope_write(q, k, v, cos, sin, keys, values, cache.write_pos, adds)
            if glue.decode_attention is None:
                o = _attention(attn, q, keys, values, mask).reshape(n, -1)
            else:  # the columns written so far only, grouped heads reading their keys once
                o = glue.decode_attention(q, keys, values, mask, cache.write_pos, attn.scaling,
                                          cache.priced_columns).reshape(n, -1)
            norm = layer.post_attention_layernorm
            x = glue.residual_norm(h, _static_project(p["o_proj"], o), norm.weight, norm.variance_epsilon)
            (gate, up), adds = _static_products(p, "gate_up", ("gate_proj", "up_proj"), x)
            delta = _static_project(p["down_proj"], glue.silu_mul(gate, up, adds))
        x = glue.residual_norm(h, delta, inner.norm.weight, inner.norm.variance_epsilon)
        return self.base.get_output_embeddings()(x)

    @staticmethod
    def _products(p: dict, fused: str, names, x, cast, dtype) -> tuple:
        """The products of the projections `names` on x: one fused product split (`_fuse`), or one each."""
        if p[fused] is not None:
            (weight, bias), sizes = p[fused]
            return _project((weight, bias), x, cast, dtype).split(sizes, dim=-1)
        return tuple(_project(p[name], x, cast, dtype) for name in names)

    def _forward(self, input_ids, attention_mask, position_ids, cache):
        from transformers import DynamicCache

        inner = self.base.model
        if cache is None:
            cache = DynamicCache(config=self.base.config)
        n, T = input_ids.shape
        h = inner.embed_tokens(input_ids)
        cos, sin = _rotary(*inner.rotary_emb(h, position_ids))
        S = cache.get_seq_length() + T
        mask = _attention_mask(attention_mask, T, S, h.device)
        # (on the CPU only: the simulation forwards meta tensors here, which hold no memory for C to read)
        if (T == 1 and self._glue and h.dtype == torch.float32 and type(h) is torch.Tensor and h.is_cpu
                and cpu_decode_ops.ENABLED
                and len(getattr(cache, "layers", ())) == len(inner.layers)
                and all(_grown(layer, self._glue) for layer in cache.layers) and cpu_decode_ops.available()):
            return self._head(self._decode_layers(h, cos, sin, mask, cache)), cache
        for i, (layer, p) in enumerate(zip(inner.layers, self._projections)):
            attn, kv = layer.self_attn, self._kv_dtype(cache, i, p["v_proj"], h.dtype)
            x, cast = _rms_norm(h, layer.input_layernorm), {}
            q, k, v = self._products(p, "qkv", ("q_proj", "k_proj", "v_proj"), x, cast, h.dtype)
            q = _widened(q, h.dtype).view(n, T, -1, attn.head_dim).transpose(1, 2)
            k = _widened(k, h.dtype).view(n, T, -1, attn.head_dim).transpose(1, 2)
            v = v.to(kv).view(n, T, -1, attn.head_dim).transpose(1, 2)
            k, v = self._append(cache, i, _rotate(k, cos, sin).to(kv), v)
            q = _rotate(q, cos, sin).to(kv)
            o = cpu_attention.attention(q, k, v, mask, attn.scaling, self.shared_columns) if T == 1 else None
            if o is None:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling,
                                                   enable_gqa=k.shape[1] != q.shape[1])
            h = h + _widened(_project(p["o_proj"], o.transpose(1, 2).reshape(n, T, -1), {}, h.dtype), h.dtype)
            x, cast = _rms_norm(h, layer.post_attention_layernorm), {}
            gate, up = self._products(p, "gate_up", ("gate_proj", "up_proj"), x, cast, h.dtype)
            h = h + _widened(_project(p["down_proj"], F.silu(gate.to(h.dtype)) * _widened(up, h.dtype), {}, h.dtype),
                             h.dtype)
        return self._head(h), cache

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """The last position's fp32 logits [n, V] from the decoder's output h [n, T, D]."""
        h = _rms_norm(h[:, -1:], self.base.model.norm)
        return self.base.get_output_embeddings()(h)[:, -1].float()

    def _decode_layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask, cache) -> torch.Tensor:
        """`_forward`'s layers for one new token per row where every projection multiplies by a rollout copy of one
        dtype (`_glue_fits`), with the steps between the products in C (`cpu_decode_ops`: the residual add and
        norm, the rotation and the cache's new column, SiLU(gate) * up - the same arithmetic as the loop's torch
        ops, a dozen calls a layer instead of ~40)."""
        n, dtype = h.shape[0], self._glue
        h = h.reshape(n, -1).clone()  # [n, D] fp32, updated in place from here
        # [n, head_dim] (positions given once for every row: one row, read n times - a row stride of 0)
        cos, sin = (t.reshape(t.shape[0], -1).expand(n, -1) for t in (cos, sin))
        delta = None  # the previous layer's MLP output, added to h by the next norm
        for i, (layer, p) in enumerate(zip(self.base.model.layers, self._projections)):
            attn, norm = layer.self_attn, layer.input_layernorm
            x = cpu_decode_ops.residual_norm(h, delta, norm.weight, norm.variance_epsilon, dtype)
            q, k, v = self._products(p, "qkv", ("q_proj", "k_proj", "v_proj"), x, {}, torch.float32)
            kept = cache.layers[i]
            kbuf, vbuf, length = self._room_for(i, kept, 1)
            q = cpu_decode_ops.rope_qkv(q, k, v, cos, sin, kbuf[:, :, length], vbuf[:, :, length])
            k, v = kept.keys, kept.values = kbuf[:, :, :length + 1], vbuf[:, :, :length + 1]
            o = cpu_attention.attention(q, k, v, mask, attn.scaling, self.shared_columns)
            if o is None:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling,
                                                   enable_gqa=k.shape[1] != q.shape[1])
            o = lora.skinny_linear(o.reshape(n, -1), *p["o_proj"])
            norm = layer.post_attention_layernorm
            x = cpu_decode_ops.residual_norm(h, o, norm.weight, norm.variance_epsilon, dtype)
            gate, up = self._products(p, "gate_up", ("gate_proj", "up_proj"), x, {}, torch.float32)
            delta = lora.skinny_linear(cpu_decode_ops.silu_mul(gate, up), *p["down_proj"])
        return (h + delta).view(n, 1, -1)
