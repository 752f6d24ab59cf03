"""The meta device made to behave like the device it stands for, and an oracle for the values it lacks.

On the `meta` device every op computes shapes and dtypes and nothing else. That is enough to
run a whole training step and count what it allocates (`tracker.py`), except where the code
asks a tensor for a value or where the device decides what to run. `SimulatedDevice`, a
`TorchFunctionMode` (it sees every torch call made from Python, including `torch.ops` and
tensor methods, and unlike a dispatch mode it changes nothing about how autograd runs), fills
those gaps:

* Values. Small tensors whose values the simulation knows (token ids, attention masks,
  advantages: the batch it builds) carry a CPU *shadow*; an op whose meta inputs all have
  shadows gets its result's shadow computed on the CPU, so masks, lengths and indices stay
  exact through the code (`mask.all()`, `cm.any(0).nonzero().max()`, boolean indexing).
  Values that come from the model (log-probs, the loss, gradient norms) are unknown: the
  oracle answers the questions code asks of them with an explicit rule - they are finite
  (`isfinite` is True, `isnan` / `isinf` False), a scalar read as a Python number is a finite
  placeholder, and sampled tokens are never an end-of-sequence token (`isin(tokens, eos)` is
  False: completions run to their forced length) - or, with `end_sampling_after=k`, they all
  are from the k-th such question on, which lets a rollout into a static KV cache (already
  sized for the full length, every decode step the same shapes) stop after k tokens. Every
  question and its call site is recorded (`questions`). A question it has no rule for raises
  `OracleError` naming the call site, rather than guessing.
* Kernels. `scaled_dot_product_attention` is routed to the kernel the target card would
  run (`grpo_nb.attention.cuda_sdpa_kernel` for its compute capability: flash attention from
  8.0 without a mask, memory-efficient attention with one or before 8.0, each with its
  logsumexp buffer, and the math path, materialising [batch, heads, T, T] in fp32, for what
  neither takes - grouped keys without flash, bf16 before 8.0; the meta device alone would
  always take the math path), and their backward kernels' own working buffers are counted
  (`attention_scratch`, through the tracker). bitsandbytes'
  4-bit matmul allocates the dequantised weight that its CUDA fallback allocates for
  training-sized batches (more than 1536 rows).
* Autocast. CUDA autocast does not apply to meta tensors; when the code under simulation
  enables autocast (TRL's trainer does, through accelerate), the mode casts the inputs of
  autocast's lower-precision ops (matmuls, linear, attention) and fp32 ops (softmax, exp,
  log, norms, sums) as CUDA autocast would.
* Backward runs under the mode too (a mode is switched off while it handles a call, so
  `backward` and `autograd.grad` re-enter it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from .. import attention, kernels
from . import ops

Tensor = torch.Tensor


class OracleError(RuntimeError):
    """Code under simulation asked a question about a value the simulation does not know."""


def _is_meta(x) -> bool:
    return isinstance(x, Tensor) and x.device.type == "meta"


def _leaves(value) -> list:
    """The leaves of nested tuples, lists and dicts: what torch functions take and return
    (torch's `tree_flatten` does the same for every pytree kind, and was half a long step's time)."""
    if isinstance(value, (tuple, list)):
        return [leaf for v in value for leaf in _leaves(v)]
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    return [value]


def _call_site() -> str:
    """The innermost frame outside torch and this module: where the code asked."""
    frame = sys._getframe(2)
    while frame is not None:
        parts = Path(frame.f_code.co_filename).parts
        if "torch" not in parts and not frame.f_code.co_filename.endswith(("device.py", "overrides.py")):
            return f"{'/'.join(parts[-3:])}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "?"


# Questions: Python values read off a tensor.
_QUESTIONS = {Tensor.item, Tensor.__bool__, Tensor.__int__, Tensor.__float__, Tensor.__index__, Tensor.tolist,
              Tensor.__complex__}
# Ops whose output shape depends on values.
_DATA_DEPENDENT = {torch.nonzero, Tensor.nonzero, torch.argwhere, Tensor.argwhere, torch.masked_select,
                   Tensor.masked_select, torch.unique, Tensor.unique, torch.bincount, Tensor.bincount,
                   torch.unique_consecutive, Tensor.unique_consecutive}
# Predicates answered for unknown (model-computed) values: they are finite.
_PREDICATES = {torch.isfinite: True, Tensor.isfinite: True, torch.isnan: False, Tensor.isnan: False,
               torch.isinf: False, Tensor.isinf: False, torch.isposinf: False, torch.isneginf: False}
# Factories whose result does not depend on any input's values (so their shadow is known).
_VALUE_FREE = {torch.zeros, torch.ones, torch.full, torch.arange, torch.tensor, torch.eye, torch.linspace,
               torch.zeros_like, torch.ones_like, torch.full_like, Tensor.new_zeros, Tensor.new_ones,
               Tensor.new_full, Tensor.new_tensor, torch.as_tensor, torch.scalar_tensor}
# Factories whose values the simulation does not know: uninitialised memory, random draws.
_UNINITIALIZED = {torch.empty, torch.empty_like, Tensor.new_empty, torch.empty_strided, Tensor.new_empty_strided,
                  torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like, torch.randint_like,
                  torch.normal, torch.randperm, torch.bernoulli, torch.multinomial, Tensor.uniform_, Tensor.normal_}
_INPLACE_SETITEM = Tensor.__setitem__

# CUDA autocast's op lists (torch/csrc/autograd/autocast_mode.cpp), the ones these models reach.
_AUTOCAST_LOWER = {F.linear, torch.matmul, Tensor.matmul, Tensor.__matmul__, Tensor.__rmatmul__, torch.mm,
                   Tensor.mm, torch.bmm, Tensor.bmm, torch.addmm, Tensor.addmm, torch.baddbmm, Tensor.baddbmm,
                   torch.addbmm, torch.mv, torch.einsum, F.scaled_dot_product_attention, torch.conv1d,
                   torch.conv2d}
_AUTOCAST_FP32 = {torch.exp, Tensor.exp, torch.log, Tensor.log, torch.pow, Tensor.pow, torch.softmax,
                  Tensor.softmax, F.softmax, torch.log_softmax, Tensor.log_softmax, F.log_softmax,
                  torch.logsumexp, Tensor.logsumexp, torch.sum, Tensor.sum, torch.cumsum, Tensor.cumsum,
                  F.layer_norm, torch.norm, Tensor.norm, torch.rsqrt, Tensor.rsqrt, F.cross_entropy,
                  F.nll_loss, F.mse_loss}
_LOW = (torch.float16, torch.bfloat16)

# bitsandbytes' CUDA gemm_4bit dequantises the whole weight and calls F.linear above this many rows.
BNB_CUSTOM_MAX_ROWS = 1536


_ACTIVE: list = []  # the SimulatedDevice modes entered, innermost last


def written_by_kernel(*tensors) -> None:
    """A kernel that the simulation does not run (its launch is a no-op on the meta device) got these
    arguments: whatever values the oracle knew for the floating-point ones (what such kernels write:
    logits statistics, gradient accumulators) are gone. Integer arguments (token ids) are only read."""
    for mode in _ACTIVE:
        for t in tensors:
            if _is_meta(t) and t.is_floating_point():
                mode.shadows.pop(t, None)
                if t._base is not None:  # a kernel writing a slice writes into its base
                    mode.shadows.pop(t._base, None)


def _kernel_on_meta(name: str, flops: int, nbytes: int, dtype: torch.dtype, *written) -> None:
    """A kernel of `grpo_nb.kernels` called on the meta device: its work to the op record, its outputs' values
    unknown (`kernels.meta_launch`)."""
    ops.kernel(name, flops, nbytes, dtype)
    written_by_kernel(*written)


kernels.meta_launch = _kernel_on_meta


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def attention_scratch(op, args):
    """The working buffers CUDA's attention backward kernels allocate beside the gradients they return and
    free before returning, as (shape, dtype) pairs; None for other ops. Sizes from the kernels' sources:
    FlashAttention-2's mha_bwd (flash_api.cpp, as vendored by PyTorch) accumulates dq in fp32 over queries
    rounded to 128 and head_dim rounded to 32 (64 above 128), keeps softmax_d (fp32, per query and head), and
    for grouped keys computes dk and dv for every query head before summing them per key head; the
    memory-efficient kernel (kernel_backward.h) accumulates dq in an fp32 workspace (split keys) and keeps
    delta (fp32, per query and head)."""
    aten = torch.ops.aten
    if op is aten._scaled_dot_product_flash_attention_backward.default:
        query, key = args[1], args[2]
        b, h, tq, d = query.shape
        q_rounded, d_rounded = _round_up(tq, 128), _round_up(d, 32 if d <= 128 else 64)
        buffers = [((b, q_rounded, h, d_rounded), torch.float32), ((b, h, q_rounded), torch.float32)]
        if key.shape[1] != h:
            buffers += [((b, key.shape[2], h, d), query.dtype)] * 2
        return buffers
    if op is aten._scaled_dot_product_efficient_attention_backward.default:
        query = args[1]
        b, h, tq, d = query.shape
        return [((b, h, _round_up(tq, 64), d), torch.float32), ((b, h, tq), torch.float32)]
    return None


class SimulatedDevice(TorchFunctionMode):
    """Run code on the meta device as if on `target` ("cuda" or "cpu"), answering value questions.

    `autocast_from`: the device type whose autocast state the code's autocast contexts set
    (the simulation runs TRL's trainer on the CPU, so its autocast context is the CPU's);
    while it is enabled, meta ops are autocast as on CUDA. `shadow_limit`: the most elements a
    shadow may have (larger results become unknown).
    """

    def __init__(self, target: str = "cuda", *, autocast_from: str | None = None, shadow_limit: int = 2**23,
                 placeholder: float = 1.0, end_sampling_after: int | None = None, capability: tuple = (8, 0)):
        super().__init__()
        if target not in ("cuda", "cpu"):
            raise ValueError(f"SimulatedDevice simulates 'cuda' or 'cpu', not {target!r}")
        self.target = target
        self.capability = tuple(capability)  # the card's compute capability: which attention kernels it has
        self._capability_tokens: list = []  # one per entry: the device may be entered again inside itself
        self.autocast_from = autocast_from
        self.shadow_limit = shadow_limit
        self.placeholder = placeholder
        self.end_sampling_after = end_sampling_after
        self.shadows = WeakIdKeyDictionary()
        self.questions: list[dict] = []
        self._eos_questions = 0

    def __enter__(self):
        _ACTIVE.append(self)
        if self.target == "cuda":  # grpo_nb.attention asks which card a meta tensor stands on
            self._capability_tokens.append(attention.simulated_capability.set(self.capability))
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        if self._capability_tokens:  # (a card named after a GPU simulation stood for every simulation after it)
            attention.simulated_capability.reset(self._capability_tokens.pop())
        return super().__exit__(*exc)

    def restart_sampling(self) -> None:
        """Count end-of-sequence questions from zero again (`end_sampling_after` then applies to each rollout
        piece: the op recorder wants every piece's decode step)."""
        self._eos_questions = 0

    # -- values --------------------------------------------------------------------------------
    def know(self, tensor: Tensor, value: Tensor) -> Tensor:
        """Tell the oracle the values of a meta tensor (a CPU tensor of the same shape)."""
        if tuple(value.shape) != tuple(tensor.shape):
            raise ValueError(f"shadow of shape {tuple(value.shape)} for a tensor of shape {tuple(tensor.shape)}")
        self.shadows[tensor] = value.to("cpu")
        return tensor

    def value(self, tensor: Tensor):
        return self.shadows.get(tensor)

    def _shadow(self, x):
        if _is_meta(x):
            return self.shadows[x]
        if isinstance(x, torch.device) and x.type == "meta":
            return torch.device("cpu")
        if isinstance(x, str) and x == "meta":
            return "cpu"
        return x

    def _known(self, flat) -> bool:
        return all(t in self.shadows for t in flat if _is_meta(t))

    def _on_shadows(self, func, args, kwargs):
        return func(*tree_map(self._shadow, args), **tree_map(self._shadow, kwargs))

    # -- the mode --------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (Tensor.backward, torch.autograd.backward):
            return self._backward(*args, **kwargs)
        if func is torch.autograd.grad:
            return self._grad(*args, **kwargs)
        if func in _QUESTIONS:
            return self._answer(func, args, kwargs)
        flat = _leaves((args, kwargs))
        if not any(_is_meta(t) for t in flat) and not _wants_meta(kwargs):
            return func(*args, **kwargs)
        if func in _DATA_DEPENDENT:
            return self._data_dependent(func, args, kwargs, flat)
        if func is Tensor.__getitem__ and _has_mask_index(args[1]):
            return self._masked_getitem(args, kwargs)
        if func is F.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        if _is_bnb_gemm_4bit(func) and self.target == "cuda":
            return self._gemm_4bit(func, *args, **kwargs)
        if self.autocast_from is not None and torch.is_autocast_enabled(self.autocast_from):
            args, kwargs = self._autocast(func, args, kwargs)
        out = func(*args, **kwargs)
        self._propagate(func, args, kwargs, flat, out)
        return out

    def _propagate(self, func, args, kwargs, flat, out):
        outs = [t for t in _leaves(out) if _is_meta(t)]
        written = args[0] if (func is _INPLACE_SETITEM or _is_inplace(func)) and args and _is_meta(args[0]) else None
        if not outs and written is None:
            return
        if func in _PREDICATES and not self._known(flat):
            for t in outs:
                self.shadows[t] = torch.full((), _PREDICATES[func]).expand(t.shape)
            return
        if func is torch.isin and _is_meta(args[0]) and args[0] not in self.shadows:
            self._eos_questions += 1
            ended = self.end_sampling_after is not None and self._eos_questions >= self.end_sampling_after
            self._ask("isin (end of sequence?)", _call_site(), ended, False)
            for t in outs:
                self.shadows[t] = torch.full((), ended).expand(t.shape)
            return
        known = (self._known(flat) or func in _VALUE_FREE) and func not in _UNINITIALIZED
        if not known or sum(t.numel() for t in outs) > self.shadow_limit:
            if written is not None:
                self.shadows.pop(written, None)  # written with unknown values
                if written._base is not None:
                    self.shadows.pop(written._base, None)
            return
        try:
            if func in _VALUE_FREE and not self._known(flat):
                # zeros_like(x) and friends: x's shape matters, not its values.
                stand_in = lambda x: torch.empty(x.shape, dtype=x.dtype) if _is_meta(x) else self._shadow(x)  # noqa: E731
                result = func(*tree_map(stand_in, args), **tree_map(stand_in, kwargs))
            else:
                result = self._on_shadows(func, args, kwargs)
        except Exception:  # an op the CPU cannot mirror: its result is unknown
            if written is not None:
                self.shadows.pop(written, None)
            return
        for t, v in zip(outs, [v for v in tree_flatten(result)[0] if isinstance(v, Tensor)]):
            if tuple(v.shape) == tuple(t.shape):
                self.shadows[t] = v

    # -- backward, with the mode on ------------------------------------------------------------------
    # A mode is off while it handles a call, and `backward` / `autograd.grad` would hand the call
    # straight back to it if it were switched on again around them: so start the engine directly.
    def _backward(self, tensors, gradient=None, retain_graph=None, create_graph=False, grad_variables=None,
                  inputs=None, grad_tensors=None):
        tensors = (tensors,) if isinstance(tensors, Tensor) else tuple(tensors)
        grads = next((g for g in (gradient, grad_tensors, grad_variables) if g is not None), None)
        grads = (grads,) if isinstance(grads, Tensor) or grads is None else tuple(grads)
        grads = tuple(torch.ones_like(t) if g is None else g for t, g in zip(tensors, grads * len(tensors)))
        inputs = () if inputs is None else (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
        with self:
            _run_engine(tensors, grads, create_graph if retain_graph is None else retain_graph, create_graph,
                        inputs, True, True)

    def _grad(self, outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False, only_inputs=True,
              allow_unused=None, is_grads_batched=False, materialize_grads=False):
        outputs = (outputs,) if isinstance(outputs, Tensor) else tuple(outputs)
        inputs = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
        grad_outputs = (grad_outputs,) if isinstance(grad_outputs, Tensor) or grad_outputs is None else tuple(grad_outputs)
        grad_outputs = tuple(torch.ones_like(o) if g is None else g
                             for o, g in zip(outputs, grad_outputs * len(outputs) if len(grad_outputs) == 1
                                             else grad_outputs))
        with self:
            result = _run_engine(outputs, grad_outputs, create_graph if retain_graph is None else retain_graph,
                                 create_graph, inputs, bool(allow_unused or materialize_grads), False)
        if materialize_grads:
            result = tuple(torch.zeros_like(i) if r is None else r for r, i in zip(result, inputs))
        return result

    def _ask(self, kind: str, where: str, answer, known: bool):
        self.questions.append({"question": kind, "where": where, "answer": answer, "known": known})
        return answer

    def _answer(self, func, args, kwargs):
        t = args[0]
        if not _is_meta(t):
            return func(*args, **kwargs)
        where = _call_site()
        if t in self.shadows:
            return self._ask(func.__name__, where, func(self.shadows[t].detach(), *args[1:], **kwargs), True)
        if func in (Tensor.item, Tensor.__float__) and t.numel() == 1 and t.is_floating_point():
            return self._ask(func.__name__, where, float(self.placeholder), False)
        raise OracleError(f"the memory simulation cannot answer {func.__name__}() of a value computed by the model "
                          f"(a {t.dtype} tensor of shape {tuple(t.shape)}), asked at {where}")

    def _meta_like(self, value: Tensor) -> Tensor:
        out = torch.empty(value.shape, dtype=value.dtype, device="meta")
        self.shadows[out] = value
        return out

    def _data_dependent(self, func, args, kwargs, flat):
        if not self._known(flat):
            raise OracleError(f"the memory simulation cannot run {getattr(func, '__name__', func)}() on values "
                              f"computed by the model (its output's shape depends on them), at {_call_site()}")
        result = self._on_shadows(func, args, kwargs)
        return tree_map(lambda v: self._meta_like(v) if isinstance(v, Tensor) else v, result)

    def _masked_getitem(self, args, kwargs):
        """x[mask] as x[indices of the mask's True entries]: same result and autograd, known shape."""
        x, index = args
        items = index if isinstance(index, tuple) else (index,)
        converted = []
        for item in items:
            if _is_meta(item) and item.dtype in (torch.bool, torch.uint8):
                if item not in self.shadows:
                    raise OracleError(f"the memory simulation cannot index with a boolean mask computed by the "
                                      f"model, at {_call_site()}")
                converted.extend(self._meta_like(i) for i in self.shadows[item].bool().nonzero(as_tuple=True))
            else:
                converted.append(item)
        new_index = tuple(converted)
        out = Tensor.__getitem__(x, new_index)
        self._propagate(Tensor.__getitem__, (x, new_index), kwargs, tree_flatten(((x, new_index), kwargs))[0], out)
        return out

    # -- kernels the target device would run -------------------------------------------------------
    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
        """The SDPA kernel CUDA (or the CPU) picks for these inputs, called directly."""
        if self.autocast_from is not None and torch.is_autocast_enabled(self.autocast_from):
            dtype = torch.get_autocast_dtype(self.autocast_from)
            query, key, value = (t.to(dtype) for t in (query, key, value))
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            # SDPA turns a boolean mask into an additive one in the query's dtype (a new tensor).
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
                ~attn_mask, float("-inf"))
        if self.target == "cpu":
            return self._cpu_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        grouped = enable_gqa and key.shape[1] != query.shape[1]
        kernel = attention.cuda_sdpa_kernel(self.capability, query.dtype, query.shape[-1], mask=attn_mask is not None,
                                            grouped=grouped, training=query.requires_grad or key.requires_grad)
        if kernel == attention.FLASH:
            # CUDA's flash kernel takes grouped keys (fewer key heads than query heads) as they are
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        if kernel == attention.MATH:
            # It repeats grouped keys and holds the [batch, heads, T, T] scores in fp32. (Called as the efficient
            # kernel, grouped keys' backward would return key gradients of the query's shape and autograd stop.)
            return torch.ops.aten._scaled_dot_product_attention_math(
                query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=grouped)[0]
        if attn_mask is not None and attn_mask.shape[-1] % 16:
            # The memory-efficient kernel wants the bias's last dimension aligned to 16 (a padded copy).
            pad = 16 - attn_mask.shape[-1] % 16
            attn_mask = F.pad(attn_mask, (0, pad))[..., : attn_mask.shape[-1]]
        if attn_mask is not None:
            attn_mask = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        compute_lse = query.requires_grad or key.requires_grad or value.requires_grad
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, compute_lse, dropout_p, is_causal, scale=scale)[0]

    @staticmethod
    def _cpu_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        """The kernel torch's CPU dispatcher picks, asked with CPU stand-ins of the same shapes (small shapes:
        the CPU target is for checking the simulation against real runs)."""
        from torch.nn.attention import SDPBackend

        stand_in = lambda t: None if t is None else torch.empty(t.shape, dtype=t.dtype)  # noqa: E731
        choice = torch._fused_sdp_choice(stand_in(query), stand_in(key), stand_in(value), stand_in(attn_mask),
                                         dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        if choice == SDPBackend.FLASH_ATTENTION.value:
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]

    def _gemm_4bit(self, func, A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None,
                   absmax_code=None, absmax_offset=None):
        """bitsandbytes' CUDA gemm_4bit: above BNB_CUSTOM_MAX_ROWS rows it dequantises, then F.linear."""
        rows = A.numel() // A.shape[-1]
        if rows <= BNB_CUSTOM_MAX_ROWS and A.shape[-1] % blocksize == 0:
            return func(A, B, shapeB, absmax, blocksize, quant_type, bias=bias, absmax_8bit=absmax_8bit,
                        absmax_code=absmax_code, absmax_offset=absmax_offset)
        if absmax_8bit is not None:
            absmax = torch.empty_like(absmax_8bit, dtype=torch.float32) + absmax_offset
        ops.dequantized_4bit(shapeB, A.dtype)
        weight = torch.empty(tuple(shapeB), dtype=A.dtype, device=A.device)
        return F.linear(A, weight, bias)

    # -- autocast -------------------------------------------------------------------------------
    def _autocast(self, func, args, kwargs):
        if func in _AUTOCAST_LOWER:
            dtype = torch.get_autocast_dtype(self.autocast_from)
            cast = lambda t: t.to(dtype) if _is_meta(t) and t.is_floating_point() and t.dtype != dtype else t  # noqa: E731
        elif func in _AUTOCAST_FP32:
            cast = lambda t: t.float() if _is_meta(t) and t.dtype in _LOW else t  # noqa: E731
        else:
            return args, kwargs
        return tree_map(cast, args), tree_map(cast, kwargs)


def _run_engine(*args):
    """The autograd engine itself (what `torch.autograd.backward` and `grad` end in), no torch-function check."""
    from torch.autograd.variable import Variable

    return Variable._execution_engine.run_backward(*args)


def _wants_meta(kwargs) -> bool:
    device = kwargs.get("device")
    return device == "meta" or (isinstance(device, torch.device) and device.type == "meta")


def _is_inplace(func) -> bool:
    name = getattr(func, "__name__", "")
    return name.endswith("_") and not name.startswith("__") or name in ("__iadd__", "__isub__", "__imul__",
                                                                      "__itruediv__", "__ior__", "__iand__")


def _has_mask_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(_is_meta(i) and i.dtype in (torch.bool, torch.uint8) for i in items)


def _is_bnb_gemm_4bit(func) -> bool:
    return getattr(func, "__name__", None) == "gemm_4bit.default" or str(func) == "bitsandbytes.gemm_4bit.default"
