"""LoRA layers whose adapter branch never holds an fp32 copy of its input or of its output.

peft keeps LoRA adapters in fp32 over a bf16/fp16 base and computes the branch as
`lora_B(lora_A(x.to(fp32))) * scaling`: every adapted layer makes an fp32 copy of its input
([tokens, in_features], kept for backward) and an fp32 [tokens, out_features] output. At
8 x 1280 tokens on Qwen2.5-1.5B that is 0.37 GB for one MLP projection's output alone, and
the largest share of the policy update's peak (`grpo_nb.simulate` shows it).

`lora_add` computes exactly peft's arithmetic - the same fp32 products, the same roundings -
tile of tokens by tile of tokens, inside one autograd function: it keeps only `x` (which the
layer holds anyway) and the [tokens, rank] product `x @ A.T`, adds the branch into the base
layer's output in place, and recomputes the fp32 tiles in backward. The adapters stay fp32
masters; only when each fp32 temporary exists changes.

`FastLoraLinear` / `FastLoraLinear4bit` are peft's own LoRA layers (`nn.Linear` and bitsandbytes
`Linear4bit` bases) with that forward; `register(lora_config)` makes peft build them (peft's
custom-module hook), so saving, loading, merging and `disable_adapter()` are peft's. Anything
the fast path does not cover (dropout > 0 in train mode, DoRA and other variants, mixed adapter batches,
merged weights, autocast) takes peft's forward unchanged.

Rollouts (`rollout_branch()`, entered by the rollout engines) need no gradients and no fp32
master: there the branch of a 16-bit model runs in the model's dtype, from 16-bit copies of the
adapters made once per rollout, as two matmuls (`x @ A.T`, then added into the base output in
the same GEMM's epilogue) instead of the ~9 casts, products and copies of the exact path. On an
H200 the exact path's casts and copies were ~1,600 of a decode step's ~3,000 kernels. The
sampled policy differs from the trained one by 16-bit rounding of the branch (the KV-cached
decode already differs from the training forward that much); the training forward, reference
and old-policy log-probs keep the exact path.

On the CPU, where host memory is ample and every kernel launch is paid in Python, a rollout goes further: each
adapted nn.Linear multiplies by a rollout-only merged copy of its weight, `W + scaling * B @ A` (made once per
rollout at the layer's first call, freed when the rollout ends; the training weights are never touched, so resume
stays exact). That is one matmul instead of ~6 ops a layer: a decode step of the embedded default 11-20% faster at
1-4 rows than with the branch, as fast as the base model alone (benchmarks/cpu_decode.py). The merged product
rounds differently from the branch (fp32: ~1e-7 relative); copies are made while they fit in a quarter of the
memory the system reports available, and the memory records and the planner count them with the rollout's KV
cache. A decode step's few rows multiply as F.linear or as `W @ x.T`, whichever this process timed faster
(`skinny_linear`). `rollout_branch(cpu_dtype=torch.bfloat16)` (the engine's `cpu_dtype`, GRPOConfig's
`cpu_rollout_dtype`; "auto", the default, picks it where it pays: `rollout.rollout_precision`) makes the copies, and
the output head's, in bf16: half the bytes, AVX512-BF16 / AMX products; the sampled policy is then the bf16-rounded
one, which the rollout importance-sampling correction accounts for.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time

import torch
from peft.tuners.lora import layer as peft_layer
from torch.autograd.function import once_differentiable

from .kernels import cpu_linear

# fp32 working memory per tile (the tile's input or output copy); smaller tiles mean more, smaller matmuls.
TILE_BYTES = 64 * 2**20


# The rollout's adapter copies: {id(fp32 adapter): (adapter, its version, 16-bit copy)} inside
# `rollout_branch()`, None outside. False: every rollout takes the exact path (the benchmarks compare both).
ROLLOUT_IN_MODEL_DTYPE = True
_rollout_copies: dict | None = None
# The CPU rollout's merged weights: {id(layer): (layer, the versions of W, A and B, merged weight)}, the bytes they may
# still take, and the bytes the last rollout's copies took (the memory records count them with the rollout).
# `MERGE_DEVICES`: where weights are merged ("meta" too while grpo_nb.simulate stands in for the CPU).
MERGE_ON_CPU = True
MERGE_DEVICES = {"cpu"}
# At most this many rows multiply as W @ x.T (`skinny_linear`): a decode step's; a prefill's many stay F.linear.
SKINNY_ROWS = 16
_merged: dict | None = None
_merge_budget = 0
last_merged_bytes = 0
# The dtype of the rollout's merged copies (and the output head's): None, the model's own; torch.bfloat16 (the
# engine's `cpu_dtype`): half the bytes to read a decode step, products in bf16 where the CPU has them (AVX512-BF16 /
# AMX), rows cast to it and back. The sampled policy then differs from the trained one by bf16 rounding of the
# weights: the rollout importance-sampling correction accounts for it.
_merge_dtype: torch.dtype | None = None


@contextlib.contextmanager
def rollout_branch(enabled: bool = True, cpu_dtype: torch.dtype | None = None):
    """Inside (`enabled`): no-grad forwards of a 16-bit model compute the LoRA branch in the model's dtype (see the module's
    docstring). The adapters' 16-bit copies live until the outermost `rollout_branch()` ends, so a CUDA graph
    captured inside reads copies that stay valid for its replays. `cpu_dtype`: the CPU's merged copies in that
    dtype (None: the model's; an inner rollout_branch keeps the outer one's)."""
    global _rollout_copies, _merged, _merge_budget, last_merged_bytes, _merge_dtype
    outer, outer_merged, outer_budget, outer_dtype = _rollout_copies, _merged, _merge_budget, _merge_dtype
    if not (enabled and ROLLOUT_IN_MODEL_DTYPE):
        _rollout_copies = _merged = None  # the exact path, also inside an enabled rollout (an exact engine called from it)
    elif outer is None:
        _rollout_copies = {}
        if MERGE_ON_CPU:
            _merged, _merge_budget, _merge_dtype = {}, available_host_bytes() // 4, cpu_dtype
            last_merged_bytes = 0
    try:
        yield
    finally:
        if outer is None and _merged:
            last_merged_bytes = sum(m.numel() * m.element_size() for _, _, m in _merged.values())
        _rollout_copies, _merged, _merge_budget, _merge_dtype = outer, outer_merged, outer_budget, outer_dtype


@contextlib.contextmanager
def merge_on(device_type: str):
    """Rollouts merge adapters on `device_type` too (grpo_nb.simulate: meta tensors standing for the CPU's)."""
    added = device_type not in MERGE_DEVICES
    MERGE_DEVICES.add(device_type)
    try:
        yield
    finally:
        if added:
            MERGE_DEVICES.discard(device_type)


def available_host_bytes() -> int:
    """Memory the system reports available (Linux's MemAvailable, else free pages), 0 where it says nothing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def _merged_weight(layer, active: list):
    """The rollout's merged copy of an nn.Linear LoRA layer's weight on the CPU (see the module's docstring), or
    None: not on the CPU, not a plain floating-point weight, or no room left for another copy."""
    current = _current_merged(layer, active)
    if current is not None:
        return current
    weight = layer.base_layer.weight
    if (weight.device.type not in MERGE_DEVICES or not weight.is_floating_point()
            or type(weight) is not torch.nn.Parameter):
        return None
    adapters = [(layer.lora_A[n].weight, layer.lora_B[n].weight, layer.scaling[n]) for n in active]
    # What the copy is made of: which adapters at which scaling (set_adapter() or a scaling changed inside a rollout
    # makes it again), and the tensors with their versions (an in-place change too).
    tensors = (weight,) + tuple(t for a, b, _ in adapters for t in (a, b))
    state = (tuple(active), tuple(float(sc) for _, _, sc in adapters), tensors, tuple(t._version for t in tensors))
    dtype = _merge_dtype or weight.dtype

    def merge():
        merged = weight.detach().float()
        for a, b, scaling in adapters:
            merged = torch.addmm(merged, b.detach().float(), a.detach().float(), alpha=float(scaling))
        return merged.to(dtype)

    return _keep_copy(layer, state, merge, weight.numel() * dtype.itemsize)


def _keep_copy(owner, state, make, size: int):
    """`make()`, kept as `owner`'s copy for this rollout with what it was made of (`state`), or None where a first
    copy of `owner` would not fit the copies' budget (a copy made again takes its old one's room)."""
    global _merge_budget
    if id(owner) not in _merged:
        if size > _merge_budget:
            return None
        _merge_budget -= size
    else:
        _unfuse(_merged[id(owner)][2])
    copy = make()
    _merged[id(owner)] = (owner, state, copy)
    return copy


def fused_copies(layers, weights) -> torch.Tensor | None:
    """The rollout's merged copies `weights` of `layers` (adapted layers that read the same input: q / k / v,
    gate / up) as one weight, their rows stacked in order: one few-row product instead of several, each of which
    pays a call's overhead. Each layer's kept copy becomes a view of it, so it takes no memory beyond the moment
    of the copy. None where one of them is not its layer's copy in this rollout (a plain layer multiplies by its
    own weight; no room was left for a copy) or they differ in dtype or width. Copies already fused (an earlier
    call in this rollout) come back as the weight they are views of."""
    if _merged is None:
        return None
    kept = [_merged.get(id(layer)) for layer in layers]
    if any(k is None or k[0] is not layer or k[2] is not w for k, layer, w in zip(kept, layers, weights)):
        return None
    copies = list(weights)
    if any(c.dim() != 2 for c in copies) or len({(c.dtype, c.device, c.shape[1]) for c in copies}) != 1:
        return None
    rows = sum(c.shape[0] for c in copies)
    base = copies[0]._base
    if (base is not None and base.shape == (rows, copies[0].shape[1]) and copies[0].data_ptr() == base.data_ptr()
            and all(c._base is base for c in copies)
            and all(b.data_ptr() == a.data_ptr() + a.numel() * a.element_size() for a, b in zip(copies, copies[1:]))):
        return base
    fused = torch.cat(copies)
    for layer, (owner, state, _), view in zip(layers, kept, fused.split([c.shape[0] for c in copies])):
        _merged[id(layer)] = (owner, state, view)
    return fused


def _unfuse(copy) -> None:
    """Before a fused copy (`fused_copies`) is made again alone: its siblings leave the rollout's copies (their room
    given back; each is made again at its next use), so that nothing keeps the old fused weight alive uncounted."""
    global _merge_budget
    base = copy._base
    if base is None:
        return
    for key, (_, _, other) in list(_merged.items()):
        if other is not copy and other._base is base:
            del _merged[key]
            _merge_budget += other.numel() * other.element_size()


def _current_merged(layer, active):
    """The layer's merged copy from earlier in this rollout if it still stands for the layer - the same adapters at
    the same scaling, none of the tensors it was made of changed in place -, else None. (It reads those tensors, not
    the layer's: a parameter swapped for another object within one rollout is not seen; each rollout makes its
    copies afresh.)"""
    kept = _merged.get(id(layer))
    if kept is None or kept[0] is not layer:
        return None
    names, scalings, tensors, versions = kept[1]
    if (tuple(active) == names and tuple(layer.scaling[n] for n in active) == scalings
            and tuple(t._version for t in tensors) == versions):
        return kept[2]
    return None


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for a CPU rollout, a decode step's few rows multiplied whichever way is faster here.

    A decode step's <= SKINNY_ROWS rows can also multiply as `weight @ x.T`: MKL then splits the GEMM's long side
    (the outputs) over the threads, where x @ W.T leaves them a few rows each. Which wins depends on the CPU and the
    BLAS build: on one of this project's 2-core machines W @ x.T was 1.7x faster at 4 rows over the embedded
    default's layers (4x for its LM head), on another (a 480 MiB L3) F.linear was 1.3x faster. So each
    (rows, weight shape, dtype) times both on its first calls in this process and keeps the faster
    (`ProductChoice`). bf16 rollout copies on a CPU with AMX time a third way, grpo-nb's kernel
    (`kernels.cpu_linear`). The product comes back contiguous, as F.linear's (a strided one would make attention
    copy it). Off the CPU (the simulation's meta tensors) it is W @ x.T, what the simulation prices."""
    if x.dtype != weight.dtype and weight.dtype == _merge_dtype:  # a lower-precision rollout copy: rows cast to it
        out = skinny_linear(x.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype))
        return out.to(x.dtype)
    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    if not 0 < rows <= SKINNY_ROWS or x.dtype != weight.dtype:
        return torch.nn.functional.linear(x, weight, bias)
    if weight.device.type != "cpu":
        return _weight_times_x(x, weight, bias)
    # (a FakeTensor's product never asks: the kernel's first-use check would fail on it and switch it off)
    native = weight.dtype == torch.bfloat16 and type(weight) in cpu_linear._PLAIN and _native_products()
    products = _BF16_PRODUCTS if native else _PRODUCTS
    return products.run((rows, weight.shape, weight.dtype), x, weight, bias)  # a decode step: ~200 calls, kept lean


def _weight_times_x(x, weight, bias):
    rows = x.numel() // x.shape[-1]
    out = torch.mm(weight, x.reshape(rows, x.shape[-1]).t()).t().contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


class ProductChoice:
    """Per key, the faster of several equal products: each is timed on `trials` calls (taking turns, so a warming
    thread pool or a busy neighbour spreads over all of them), then the one with the least best time runs alone.
    The timed calls are real calls: their results are used."""

    def __init__(self, products: dict, trials: int = 3):
        self.products, self.trials = products, trials
        self.chosen: dict = {}  # key -> product name, once decided
        self._product: dict = {}  # key -> that product
        self._times: dict = {}  # key -> {name: [seconds]} while timing

    def run(self, key, *args):
        product = self._product.get(key)
        if product is not None:
            return product(*args)
        times = self._times.setdefault(key, {n: [] for n in self.products})
        name = min(times, key=lambda n: len(times[n]))  # the least-timed product's turn
        started = time.perf_counter()
        out = self.products[name](*args)
        times[name].append(time.perf_counter() - started)
        if all(len(t) >= self.trials for t in times.values()):
            self.chosen[key] = min(times, key=lambda n: min(times[n]))
            self._product[key] = self.products[self.chosen[key]]
            self._times.pop(key, None)  # another thread (a product's call releases the GIL) may have decided it
        return out


def _native_linear(x, weight, bias):
    """grpo-nb's AMX product (`kernels.cpu_linear`), or F.linear's where it does not take these operands."""
    out = cpu_linear.linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias) if out is None else out


def _native_products() -> bool:
    return cpu_linear.ENABLED and cpu_linear.available()


_PRODUCTS = ProductChoice({"linear": torch.nn.functional.linear, "weight @ x.T": _weight_times_x})
# bf16 rollout copies on a CPU with AMX: grpo-nb's own product too (1.1-2x torch's best at 1-16 rows of the embedded
# default's layers, benchmarks/profile_cpu.md), still only where it times faster here
_BF16_PRODUCTS = ProductChoice({**_PRODUCTS.products, "AMX (grpo-nb)": _native_linear})


@contextlib.contextmanager
def cpu_output_head(model):
    """Inside (a CPU rollout): the model's output head, a plain nn.Linear, multiplies through `skinny_linear` - set
    on the head instance, put back after. The rest of a rollout's forward stays the model's own."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not (MERGE_ON_CPU and type(head) is torch.nn.Linear and head.weight.device.type in MERGE_DEVICES
            and "forward" not in head.__dict__ and not head._forward_hooks and not head._forward_pre_hooks):
        yield
        return
    head.forward = lambda h: skinny_linear(h, _head_weight(head), head.bias)
    try:
        yield
    finally:
        del head.forward


def _head_weight(head):
    """The output head's weight for this rollout: its own, or (a lower-precision merge dtype) a copy in that dtype,
    made once per rollout while it fits the copies' budget, and counted with the merged layers."""
    weight = head.weight
    if _merged is None or _merge_dtype in (None, weight.dtype):
        return weight
    kept = _merged.get(id(head))
    if kept is not None and kept[0] is head and kept[1] == (weight._version,):
        return kept[2]
    copy = _keep_copy(head, (weight._version,), lambda: weight.detach().to(_merge_dtype),
                      weight.numel() * _merge_dtype.itemsize)
    return weight if copy is None else copy


def _copy16(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rollout's `dtype` copy of an adapter weight, made again if the weight changed in place since (its version
    counter: `.data` writes bypass it, and are caught after the rollout by the rollout guard's read of the weights)."""
    kept = _rollout_copies.get(id(weight))
    if kept is None or kept[0] is not weight or kept[1] != weight._version or kept[2].dtype != dtype:
        kept = (weight, weight._version, weight.detach().to(dtype))
        _rollout_copies[id(weight)] = kept
    return kept[2]


def stacked_copy16(weights: list, dtype: torch.dtype, diagonal: bool = False) -> torch.Tensor:
    """The rollout's `dtype` copies of adapter weights as one tensor: their rows stacked in order (weights of one
    width: the A of layers that read the same input, or B of one shape), or (`diagonal`) block-diagonal, zeros
    elsewhere (the B of layers of other widths: one product for all of them). Each weight's own copy (`_copy16`)
    becomes a view of its block, so the copies are held once however they are asked for."""
    parts = [w.detach() for w in weights]
    stacked = (torch.block_diag(*parts) if diagonal else torch.cat(parts)).to(dtype)
    row = column = 0
    for w in weights:
        rows, columns = w.shape
        block = stacked[row:row + rows, column:column + columns] if diagonal else stacked[row:row + rows]
        _rollout_copies[id(w)] = (w, w._version, block)
        row, column = row + rows, column + columns * diagonal
    return stacked


def row_tiles(rows: int, width: int, tile_bytes: int) -> list[slice]:
    """Slices of `rows` rows such that a tile's fp32 copy of `width` columns takes at most `tile_bytes`."""
    step = max(1, tile_bytes // (4 * max(1, width)))
    return [slice(s, min(s + step, rows)) for s in range(0, rows, step)]


def _add_tiles(out, result, x, a, b, scaling, add_in_fp32) -> torch.Tensor:
    """out = result + scaling * (x @ A.T) @ B.T with peft's roundings, tile by tile; returns x @ A.T."""
    rows = x.shape[0]
    xa = torch.empty(rows, a.shape[0], dtype=a.dtype, device=x.device)
    for t in row_tiles(rows, max(x.shape[1], result.shape[1]), TILE_BYTES):
        torch.mm(x[t].to(a.dtype), a.t(), out=xa[t])
        delta = torch.mm(xa[t], b.t()).mul_(scaling)
        # The same roundings as peft's expressions, with no temporaries beyond `delta`.
        if not add_in_fp32:  # peft's 4-bit path: result + delta.to(result.dtype)
            torch.add(result[t], delta.to(result.dtype), out=out[t])
        elif torch.promote_types(result.dtype, delta.dtype) == result.dtype:  # nn.Linear's: result + delta, promoted
            torch.add(result[t], delta, out=out[t])
        else:  # ... promoted to the adapters' wider dtype (a widening cast is exact), then back to the result's
            out[t] = delta.add_(result[t])
    return xa


class _LoraAdd(torch.autograd.Function):
    """result += scaling * (x @ A.T) @ B.T, in place, with peft's roundings (see `lora_add`). It takes and returns
    the tensors in their own shapes: flattening `result` outside would make it a view, which autograd then guards
    with a copy of the whole gradient in backward (CopySlices)."""

    @staticmethod
    def forward(ctx, result, x, a, b, scaling, add_in_fp32, inplace):
        out = result if inplace else torch.empty_like(result, memory_format=torch.contiguous_format)
        xa = _add_tiles(out.view(-1, out.shape[-1]), result.reshape(-1, result.shape[-1]),
                        x.reshape(-1, x.shape[-1]), a, b, scaling, add_in_fp32)
        if inplace:
            ctx.mark_dirty(out)
        ctx.save_for_backward(x, a, b, xa)
        ctx.scaling = scaling
        return out

    @staticmethod
    @once_differentiable  # x @ A.T is saved without its graph: a second derivative would be wrong, so it raises
    def backward(ctx, grad):
        x, a, b, xa = ctx.saved_tensors
        s = ctx.scaling
        need_x, need_a, need_b = ctx.needs_input_grad[1:4]
        flat_x, flat_grad = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        grad_x = torch.empty_like(flat_x) if need_x else None
        # The adapters' gradients are summed over tiles in fp32, each tile's product taken in fp32: with 16-bit
        # adapters a product and a sum in their dtype would round at every tile, where peft's one product rounds
        # once (its error grew 3.5x over 128 tiles). fp32 adapters: the products as they were.
        wide = torch.float32
        grad_a = torch.zeros_like(a, dtype=wide) if need_a else None
        grad_b = torch.zeros_like(b, dtype=wide) if need_b else None
        for t in row_tiles(flat_x.shape[0], max(flat_x.shape[1], flat_grad.shape[1]), TILE_BYTES):
            # back through .to() and * scaling; the scaling is applied to the [T, r] products, not to the
            # [T, out] gradient (one full-size pass fewer; gradients equal to float rounding)
            g = flat_grad[t].to(b.dtype)
            if need_b:
                grad_b.addmm_(g.t().to(wide), xa[t].to(wide), alpha=s)
            g_xa = torch.mm(g, b).mul_(s)  # [T, r]
            if need_a:
                grad_a.addmm_(g_xa.t().to(wide), flat_x[t].to(wide))
            if need_x:
                grad_x[t] = (g_xa @ a).to(x.dtype)
        grad_a = None if grad_a is None else grad_a.to(a.dtype)
        grad_b = None if grad_b is None else grad_b.to(b.dtype)
        return grad, None if grad_x is None else grad_x.view(x.shape), grad_a, grad_b, None, None, None


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` may hold the same memory: one storage (a view: autograd's own test, which tells the
    simulation's meta tensors apart - their addresses are all 0), or, off meta, two storages over overlapping
    addresses (a DLPack or NumPy round trip makes a second storage object over the same memory)."""
    if torch._C._is_alias_of(a, b):
        return True
    if a.device.type == "meta" or b.device.type == "meta":
        return False
    sa, sb = a.untyped_storage(), b.untyped_storage()
    return sa.data_ptr() < sb.data_ptr() + sb.nbytes() and sb.data_ptr() < sa.data_ptr() + sa.nbytes()


def lora_add(result: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float,
             *, add_in_fp32: bool) -> torch.Tensor:
    """`result` (the base layer's output, [..., out]) plus the LoRA branch of `x` ([..., in]), in place.

    The reference is peft's `result + lora_B(lora_A(x.to(A.dtype))) * scaling` (`add_in_fp32`: the
    sum in the adapters' dtype, as peft's nn.Linear layer promotes it, then cast back; else the
    branch cast to the result's dtype first, as peft's 4-bit layer does). Same values and
    gradients; the fp32 copies exist one tile of tokens at a time.
    """
    shape = result.shape
    # A base layer that hands back its input, or a view of it (an identity wrapper), must not have the branch
    # written into the caller's tensor: peft's out-of-place add leaves it alone.
    aliased = _shares_memory(result, x)
    if not (torch.is_grad_enabled() and (result.requires_grad or x.requires_grad or lora_a.requires_grad
                                         or lora_b.requires_grad)):
        # written in place: a strided output (an expanded one shares its memory between elements) or one over the
        # caller's memory is copied first
        own = result.clone(memory_format=torch.contiguous_format) if aliased or not result.is_contiguous() else result
        flat = own.view(-1, shape[-1])
        dtype = result.dtype
        if (_rollout_copies is not None and dtype in (torch.float16, torch.bfloat16) and x.dtype == dtype
                and lora_a.dtype != dtype):  # a rollout of a 16-bit model: the branch in its dtype, two kernels
            flat.addmm_(x.reshape(-1, x.shape[-1]) @ _copy16(lora_a, dtype).t(), _copy16(lora_b, dtype).t(),
                        alpha=float(scaling))
            return flat.view(shape)
        # No graph to record (log-probs without gradients, forwards outside a rollout): peft's arithmetic
        # without autograd's bookkeeping.
        _add_tiles(flat, flat, x.reshape(-1, x.shape[-1]), lora_a, lora_b, float(scaling), add_in_fp32)
        return flat.view(shape)
    # In place where autograd allows it. A view made inside another custom Function (bitsandbytes'
    # 4-bit matmul returns one) must not be modified in place: it gets a new output instead.
    inplace = not result._is_view() and result.is_contiguous() and not aliased
    return _LoraAdd.apply(result, x, lora_a, lora_b, float(scaling), add_in_fp32, inplace)


def _dropout_on(dropout) -> bool:
    """Whether peft's LoRA dropout changes anything: a dropout module in train mode (eval mode's is the identity,
    as peft's Identity for lora_dropout=0)."""
    return not isinstance(dropout, torch.nn.Identity) and dropout.training


def _rollout_merged(layer, active):
    """Inside a CPU rollout that merges (`rollout_branch()`, no gradients): an adapted layer's merged weight over its
    `active` adapters - its copy from earlier in this rollout while that still stands for it, else a new one
    (`_merged_weight`) -, or None where the adapters' branch must run (no plain nn.Linear base, no room for a
    copy). The caller has checked the layer (adapters on and not merged, no variant, no autocast) and that its
    branch is one grpo-nb computes (`_branch_unsupported`)."""
    if _merged is None or torch.is_grad_enabled() or type(layer.base_layer) is not torch.nn.Linear:
        return None  # (a subclass of nn.Linear may compute something else in its forward)
    merged = _current_merged(layer, active)
    return merged if merged is not None else _merged_weight(layer, active)


def _branch_unsupported(layer, active) -> bool:
    """Where peft's own forward must compute the branch: dropout on, a bias on lora_B, hooks on the base layer or
    the adapters' modules (peft's forward calls them, grpo-nb's arithmetic would skip them or change what a hook
    on the base kept), or several adapters over a base of another dtype (peft sums them all in the adapters'
    dtype and casts once)."""
    subs = (layer.base_layer, *(layer.lora_A[n] for n in active), *(layer.lora_B[n] for n in active))
    return (any(_dropout_on(layer.lora_dropout[n]) or layer.lora_B[n].bias is not None for n in active)
            or any(m._forward_hooks or m._forward_pre_hooks for m in subs)
            or (len(active) > 1 and getattr(layer.base_layer, "weight", None) is not None
                and layer.base_layer.weight.dtype != layer.lora_A[active[0]].weight.dtype))


def _peft_arithmetic(layer) -> bool:
    """Whether an adapted layer's output is peft's own arithmetic, which grpo-nb's ways do not compute: merged
    weights, a LoRA variant (DoRA, ...), autocast."""
    return bool(layer.merged or layer.lora_variant or torch.is_autocast_enabled() or torch.is_autocast_enabled("cpu"))


def _active(layer) -> list:
    """The layer's active adapters that it holds."""
    return [a for a in layer.active_adapters if a in layer.lora_A]


def _fast_forward(layer, x, args, kwargs, *, add_in_fp32: bool):
    """The adapted layer's output through `lora_add`, or None where peft's own forward must run."""
    if layer.disable_adapters or args or kwargs or _peft_arithmetic(layer):
        return None
    active = _active(layer)
    if _branch_unsupported(layer, active):
        return None
    merged = _rollout_merged(layer, active)
    if merged is not None:
        return skinny_linear(x, merged, layer.base_layer.bias)
    layer._check_forward_args(x)
    result = layer.base_layer(x)
    for name in active:
        result = lora_add(result, x, layer.lora_A[name].weight, layer.lora_B[name].weight, layer.scaling[name],
                          add_in_fp32=add_in_fp32)
    return result


def rollout_branch_parts(layer, dtype: torch.dtype) -> tuple | None:
    """Inside a rollout of a `dtype` (16-bit) model on a GPU: (base layer, lora_A, lora_B, scaling) where `layer`'s
    own forward adds its one adapter's branch as `lora_add`'s rollout path does (`x @ A16.T`, then `addmm_` of
    `B16.T` into the base output) - so that the caller may multiply several layers' A at once -, else None."""
    if (_rollout_copies is None or torch.is_grad_enabled() or dtype not in (torch.float16, torch.bfloat16)
            or type(layer).forward not in (FastLoraLinear.forward, getattr(_fast4bit_class(), "forward", None))
            or layer.disable_adapters or layer._forward_hooks or layer._forward_pre_hooks or _peft_arithmetic(layer)):
        return None
    active = _active(layer)
    if len(active) != 1 or _branch_unsupported(layer, active) or _rollout_merged(layer, active) is not None:
        return None
    a, b = layer.lora_A[active[0]].weight, layer.lora_B[active[0]].weight
    return None if a.dtype == dtype else (layer.base_layer, a, b, float(layer.scaling[active[0]]))


def _fast4bit_class():
    try:
        return _linear4bit_class()[1]
    except ImportError:  # bitsandbytes is optional
        return None


def rollout_weight(layer):
    """Inside a CPU rollout that merges (`rollout_branch()`, no gradients): (weight, bias) that `layer`'s forward
    multiplies by - a plain nn.Linear's own, an adapted nn.Linear's merged copy (`_rollout_merged`: the same copy
    and budget as its own forward's), a LoRA layer's base with its adapters disabled -, or None where the layer's
    own forward must run (grpo_nb.rollout.lean_forward calls it per projection)."""
    if _merged is None or torch.is_grad_enabled() or layer._forward_hooks or layer._forward_pre_hooks:
        return None
    if type(layer) is torch.nn.Linear:
        return layer.weight, layer.bias
    base = getattr(layer, "base_layer", None)
    if not isinstance(layer, peft_layer.LoraLayer) or type(base) is not torch.nn.Linear or _peft_arithmetic(layer):
        return None
    if layer.disable_adapters:
        return base.weight, base.bias
    active = _active(layer)
    merged = None if _branch_unsupported(layer, active) else _rollout_merged(layer, active)
    return None if merged is None else (merged, base.bias)


class FastLoraLinear(peft_layer.Linear):
    """peft's LoRA layer over an nn.Linear, its adapter branch through `lora_add`."""

    def forward(self, x, *args, **kwargs):
        out = _fast_forward(self, x, args, kwargs, add_in_fp32=True)
        return super().forward(x, *args, **kwargs) if out is None else out


@functools.cache
def _linear4bit_class():
    import bitsandbytes as bnb
    from peft.tuners.lora import bnb as peft_bnb

    class FastLoraLinear4bit(peft_bnb.Linear4bit):
        """peft's LoRA layer over a bitsandbytes 4-bit layer, its adapter branch through `lora_add`."""

        def __init__(self, base_layer, adapter_name, **kwargs):
            base = base_layer.get_base_layer() if hasattr(base_layer, "get_base_layer") else base_layer
            # What peft's own 4-bit dispatcher passes on.
            kwargs.update(compute_dtype=base.compute_dtype, compress_statistics=base.weight.compress_statistics,
                          quant_type=base.weight.quant_type)
            super().__init__(base_layer, adapter_name, **kwargs)

        def forward(self, x, *args, **kwargs):
            out = _fast_forward(self, x, args, kwargs, add_in_fp32=False)
            return super().forward(x, *args, **kwargs) if out is None else out

    return bnb.nn.Linear4bit, FastLoraLinear4bit


def register(lora_config) -> None:
    """Make peft build `FastLoraLinear` (and `FastLoraLinear4bit`) for `lora_config`'s targets."""
    mapping = {}
    try:
        base4, fast4 = _linear4bit_class()
        mapping[base4] = fast4  # first: a 4-bit layer is also an nn.Linear
    except ImportError:  # bitsandbytes is optional
        pass
    mapping[torch.nn.Linear] = FastLoraLinear
    lora_config._register_custom_module(mapping)
