"""Static-cache decoding for `RolloutEngine`: fixed shapes, so a decode step can be a CUDA graph.

After the engine's prefill, `StaticDecoder` copies the prompt keys/values into a KV cache
pre-sized for the whole rollout (N rows x prompt width + max_completion_length columns) and
then runs every decode step on the same tensors:

* the KV cache: per layer one [N, kv_heads, L, head_dim] key and value tensor, written in
  place at column `write_pos` (plain tensors behind a minimal Cache subclass rather than
  transformers' StaticCache, whose update rule changed across 5.x: cache_position kwargs,
  then an internal counter);
* the attention mask: a 4D additive [N, 1, 1, L] mask in the model dtype (0 = attend, dtype
  min = masked). transformers' `create_causal_mask` returns a 4D mask as-is for eager and sdpa
  attention, so no mask is built per step, and keys not yet written are masked out;
* input buffers: token ids [N, 1], position ids [N, 1] and the write column [1].

Rows never leave the batch (no compaction): finished rows keep decoding pad tokens whose
outputs the engine ignores. That wastes some compute on long-tail rollouts but keeps every
shape fixed, which is what a CUDA graph needs.

`graph=True` captures one decode step in a CUDA graph (once per rollout: the rollout's batch
size and prompt width change every call anyway) and replays it for every token, which removes
the per-kernel launch overhead that dominates small-batch decoding. The first replay is
checked against an eager step on the same inputs; if capture raises or the two disagree the
decoder warns and stays eager.

Where `lean_forward` reproduces the model (Llama / Mistral / Qwen2 classes), the step is grpo-nb's own:
`LeanForward.static_step` with Triton kernels between the products (`grpo_nb.kernels.decode_triton`), the model's
modules for the products; else the model's forward. The engine's sampling after each step works on fixed tensors
too and replays a graph of its own (`GraphedStep`, checked once against an eager call). Neither has run on a GPU.

The CUDA-graph path ran on one GPU so far (an H200, tests/test_cuda.py and test_static_cache.py's CUDA
tests: graph decode equal to eager); the eager static path is tested on the CPU against the dynamic
cache and HF `generate`.

Everything (cache, buffers, graph and its memory pool) belongs to one `StaticDecoder`, which
the engine drops at the end of each rollout, so the memory goes back to PyTorch's caching
allocator for the training step (the allocator returns cached blocks to the driver on demand).

Episodes (`RolloutEngine.start_episodes` / `continue_episodes`) keep one `StaticDecoder` across their
turns, made for the episodes' whole token budget: a tool's result is written into the cache by
`prefill` (eager: a block of tokens per row), the next turn decodes on the same buffers, and the
columns a turn wrote for rows that had finished are masked again (`settle`), so a later turn never
attends to them. Each turn captures its graph anew (`drop_graph` at the end of every engine call):
the graph's kernels read the adapters' 16-bit copies, which live as long as the call. Rows whose
episode ended stay in the cache, decoding pad, as finished rows do within a turn. Padding between
turns (rows' results differ in length) can use more columns than the budget: `make_room` then
grows the cache or, where the GPU has no room for a larger copy, hands the turns so far over as a
dynamic cache (`to_dynamic`).
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from transformers import DynamicCache

from ..attachments import windowed_attention

_SUPPORTED_ATTENTION = ("eager", "sdpa", "grpo_nb_sdpa")  # the last: grpo_nb.attention
# One side stream per device, reused by every capture: cuBLAS keeps a workspace per stream it
# has seen, so a fresh stream per rollout would leave a new workspace behind each time.
_CAPTURE_STREAMS: dict = {}


def capture_stream(device) -> torch.cuda.Stream:
    """The side stream every capture on `device` warms up and records on (one per device, see above)."""
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[device]


def kv_tensors(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's (keys, values) of a filled DynamicCache, across transformers versions."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))  # legacy list-of-tensors cache


def static_unsupported_reason(model) -> str | None:
    """Why the static path cannot decode this model (None: it can)."""
    config = getattr(model, "config", None)
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    attn = getattr(text_config, "_attn_implementation", None) or getattr(config, "_attn_implementation", None)
    if attn not in _SUPPORTED_ATTENTION:
        return f"attention implementation {attn!r} (the static cache passes a 4D mask: eager or sdpa only)"
    # A 4D mask is used as-is for every layer, so sliding-window / linear / chunked layers would
    # silently attend to everything.
    windowed = windowed_attention(text_config)
    return windowed and f"{windowed} (the static cache supports full-attention layers only)"


def free_device_memory(device) -> int | None:
    """Bytes a new allocation can still get on `device` (None: not tracked, e.g. the CPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    # Blocks the caching allocator holds but does not use are free for our purposes too.
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


class _StaticKV(DynamicCache):
    """A Cache over pre-allocated per-layer tensors: `update` writes one column in place.

    Only `update` (what attention layers call, in every transformers version) is overridden;
    it ignores cache_kwargs (cache_position etc.) and writes at `write_pos`, a device tensor,
    so the write is capturable in a CUDA graph.
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], write_pos: torch.Tensor,
                 priced_columns: int | None = None):
        super().__init__()
        self.static_keys, self.static_values, self.write_pos = keys, values, write_pos
        # the columns a decode step reads on average (the simulation prices one step for all)
        self.priced_columns = priced_columns

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = self.static_keys[layer_idx], self.static_values[layer_idx]
        keys.index_copy_(2, self.write_pos, key_states)
        values.index_copy_(2, self.write_pos, value_states)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # Only used by models that derive positions themselves; we always pass position_ids.
        return self.static_keys[layer_idx].shape[2]

    def __len__(self):
        return len(self.static_keys)


# How far a replayed graph's logits may be from an eager step's (graph_error). Capture can pick other kernels
# than the eager step (cuBLAS algorithms, split-K, which in 16 bits - or fp32 under TF32 - may also reduce in lower
# precision: PyTorch allows that for 16 bits by default), so the two differ by rounding that grows through the
# layers. On an H100, 64 rows of Qwen2.5-1.5B shapes in bf16 differed by 0.12 at most (~3% relative RMS, if the
# logits were as spread as a random model's), which the bound on the largest difference used before took for a
# broken graph: decode ran 5x slower. On the CPU, the whole error of bf16 against fp32 arithmetic on the same
# weights is ~1.2% relative RMS (SmolLM2-135M, and a random 28-layer Qwen2); a broken graph (stale buffers, other
# rows, another position) is off by the order of the logits' own spread (~100%; a stale position: ~37%).
GRAPH_TOLERANCE = {torch.float32: 1e-3, torch.float16: 0.1, torch.bfloat16: 0.1}


def graph_tolerance(dtype: torch.dtype) -> float:
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":  # TF32 / bf16 passes allowed
        return GRAPH_TOLERANCE[torch.bfloat16]
    return GRAPH_TOLERANCE.get(dtype, GRAPH_TOLERANCE[torch.bfloat16])


def graph_error(graph_logits: torch.Tensor, eager: torch.Tensor) -> float:
    """The worst row's relative RMS difference of a replayed graph's logits from an eager step's, each row centred
    first: sampling ignores a row's common offset, and a check pooled over rows, or scaled by an offset, would let
    one wrong row among many - or logits that sit far from 0 - through. Logits that are not finite (a model that
    masks tokens with -inf) must be so at the same places and with the same value in both; NaN otherwise."""
    finite = torch.isfinite(eager)
    if not torch.equal(finite, torch.isfinite(graph_logits)) or not torch.equal(eager[~finite], graph_logits[~finite]):
        return float("nan")
    g, e = graph_logits.float().where(finite, 0.0), eager.float().where(finite, 0.0)
    count = finite.sum(-1, keepdim=True).clamp_min(1)
    g = (g - g.sum(-1, keepdim=True) / count).where(finite, 0.0)
    e = (e - e.sum(-1, keepdim=True) / count).where(finite, 0.0)
    per_row = (g - e).norm(dim=-1) / e.norm(dim=-1).clamp_min(1e-12)
    return per_row.max().item()


class StaticDecoder:
    """A pre-sized KV cache and one fixed-shape decode step, for one rollout.

    Build it from the prompt pass's DynamicCache (P prefilled rows, each shared by N // P
    generations), call `step(tokens, positions)` once per generated token, and `release()` it
    when the rollout ends.
    """

    def __init__(self, model, prefill_cache, prompt_mask: torch.Tensor, max_new_tokens: int, extra: dict,
                 graph: bool = False, cache_argument: str = "past_key_values", lean: tuple | None = None):
        self.model, self.extra, self.cache_argument = model, extra, cache_argument
        layers = kv_tensors(prefill_cache)
        k0 = layers[0][0]
        P, W = k0.shape[0], k0.shape[2]  # prefilled rows, prompt width
        N = prompt_mask.shape[0]
        assert N % P == 0, f"{N} rows cannot share {P} prefilled prompts"
        L = W + max_new_tokens  # the last token is never fed back: one spare column, no edge case
        device, dtype = k0.device, k0.dtype
        self.length = W  # columns written so far

        # The cache: prefilled rows broadcast to their N // P generations straight into place
        # (a view of the [N, ...] tensor as [P, G, ...]), no repeated temporary. Zeros, not empty:
        # unwritten columns get attention weight 0, and 0 x NaN garbage would still be NaN.
        self.keys, self.values = [], []
        for k, v in layers:
            for src, dst_list in ((k, self.keys), (v, self.values)):
                dst = torch.zeros(N, src.shape[1], L, src.shape[3], dtype=dtype, device=device)
                dst.view(P, N // P, *dst.shape[1:])[:, :, :, :W].copy_(src[:, None])
                dst_list.append(dst)

        # Static inputs, written before each step (and read by the graph when there is one).
        self.tokens = torch.zeros(N, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(N, 1, dtype=torch.long, device=device)
        self.write_pos = torch.zeros(1, dtype=torch.long, device=device)
        self.mask = torch.full((N, 1, 1, L), torch.finfo(dtype).min, dtype=dtype, device=device)
        self.mask[:, 0, 0, :W].masked_fill_(prompt_mask.bool(), 0.0)
        self.prompt_width = W
        self.cache = self._new_cache()

        # (LeanForward, its kernels): the step through grpo-nb's lean forward where it reproduces the model (fewer
        # kernels: `LeanForward.static_step`, `lean_forward.static_lean`), else None - the model's own forward
        self.lean = lean
        self.logits = None  # [N, V] fp32: each step's logits (`logits_buffer`)
        self.use_graph = self._graph_wanted = graph
        self.graph = self.graph_logits = None
        self.fallback_reason: str | None = None  # why the graph was abandoned, if it was

    def _new_cache(self) -> _StaticKV:
        """The cache object over the decoder's keys, values and write column; its steps priced at the columns they
        read on average, each completion to its full length, as the pricing assumes."""
        return _StaticKV(self.keys, self.values, self.write_pos, (self.prompt_width + self.mask.shape[-1]) // 2)

    @property
    def rows(self) -> int:
        return self.mask.shape[0]

    @staticmethod
    def nbytes(prefill_cache, rows: int, max_new_tokens: int) -> int:
        """Bytes the static cache (keys, values and mask) will take."""
        layers = kv_tensors(prefill_cache)
        k0 = layers[0][0]
        per_column = sum(k.shape[1] * k.shape[3] + v.shape[1] * v.shape[3] for k, v in layers) + 1  # + mask
        return rows * (k0.shape[2] + max_new_tokens) * per_column * k0.element_size()

    # ----------------------------------------------------------------------------------

    def _forward(self) -> torch.Tensor:
        """The step itself, on the static buffers only (this is what the graph records): its fp32 logits in
        `self.logits`, the buffer every step writes (a sampling graph reads it: `GraphedStep`)."""
        with replayed():
            self.mask.index_fill_(3, self.write_pos, 0.0)  # the new token attends to itself
            logits = self._lean_step() if self.lean is not None else None
            if logits is None:
                out = self.model(input_ids=self.tokens, attention_mask=self.mask, position_ids=self.positions,
                                 use_cache=True, **{self.cache_argument: self.cache}, **self.extra)
                logits = out.logits[:, -1]
            return self.logits_buffer(logits)

    def _lean_step(self) -> torch.Tensor | None:
        """The step through `LeanForward.static_step`, or None where it failed - a kernel that would not compile
        for this rollout's shapes (its self-test ran others) -: a warning, and the model's forward from then on
        (the step writes the same cache column again)."""
        forward, glue = self.lean
        try:
            return forward.static_step(self.tokens, self.positions, self.mask, self.cache, glue)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise  # (the capture fails and falls back; the eager step after it comes here again)
            self.lean = None
            warnings.warn(f"grpo-nb's decode step failed ({type(exc).__name__}: {str(exc)[:200]}); decoding with the "
                          "model's own forward instead. Please report this.", RuntimeWarning, stacklevel=4)
            return None

    def logits_buffer(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [N, V] copied (as fp32) into the buffer every decode step writes its logits to, made at the
        first call (before any graph is captured: a graph reads and writes it in place)."""
        if self.logits is None or self.logits.shape != logits.shape:
            self.logits = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        return self.logits.copy_(logits)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed one token per row at `positions`; returns fp32 [N, V] logits.

        With a graph the returned tensor is the graph's output buffer: read it before the next step.
        """
        if self.length >= self.mask.shape[-1]:
            raise RuntimeError(f"static KV cache is full ({self.length} columns)")
        self.tokens.copy_(tokens[:, None])
        self.positions.copy_(positions[:, None])
        self.write_pos.fill_(self.length)
        return self.step_written()

    def step_written(self) -> torch.Tensor:
        """`step` on inputs the caller wrote on the device itself (`tokens`, `positions`, and `write_pos` = the
        columns written so far: the engine's sampling graph writes them, `RolloutEngine._decode_static`)."""
        if self.length >= self.mask.shape[-1]:
            raise RuntimeError(f"static KV cache is full ({self.length} columns)")
        self.length += 1
        if self.graph is not None:
            self.graph.replay()
            return self.graph_logits
        if self.use_graph:  # first step: capture (or give up and stay eager)
            return self._capture()
        return self._forward()

    # -- episodes: more turns on the same cache ----------------------------------------------

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Write a block of tokens per row into the next columns, eagerly (an episode's next turn: each row's last
        sampled token and what a tool appended, left-padded to one width): `ids`, `positions` and `real` (1 where a
        token is real) are [N, T]. Each token attends to the real columns before the block, the real tokens of the
        block before it, and itself. Returns the fp32 logits at the block's last column [N, V]; call `make_room`
        first."""
        N, T = ids.shape
        start, L, device = self.length, self.mask.shape[-1], ids.device
        if start + T > L:
            raise RuntimeError(f"static KV cache has {L - start} free columns, the block needs {T} (make_room first)")
        columns = torch.arange(start, start + T, device=device)
        key = torch.arange(L, device=device)
        allowed = (self.mask[:, 0, 0, :] == 0)[:, None, :] & (key < start)  # [N, 1, L]: the columns so far
        in_block = torch.zeros(N, T, L, dtype=torch.bool, device=device)
        in_block[:, :, start:start + T] = (key[None, start:start + T] <= columns[:, None]) & real.bool()[:, None, :]
        allowed = (allowed | in_block) | (key == columns[:, None])
        mask = torch.full((N, 1, T, L), torch.finfo(self.mask.dtype).min, dtype=self.mask.dtype, device=device)
        mask.masked_fill_(allowed[:, None], 0.0)
        self.cache.write_pos = columns
        try:
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                             **{self.cache_argument: self.cache}, **self.extra)
        finally:
            self.cache.write_pos = self.write_pos  # the buffer the decode step (and its graph) writes through
        self.settle(start, real)
        self.length = start + T
        return out.logits[:, -1].float()

    def settle(self, start: int, real: torch.Tensor) -> None:
        """Mark the columns from `start` on as `real` [N, width] says (1: a token later turns attend to; 0: a
        finished row's pad, a padding position, the turn's unfed last token): a decode step marks its column real
        for every row."""
        columns = self.mask[:, 0, 0, start:start + real.shape[1]]
        columns.copy_(torch.where(real.bool(), 0.0, torch.finfo(self.mask.dtype).min).to(columns.dtype))

    def drop_graph(self) -> None:
        """Forget the captured graph (its memory pool goes with it); the next step captures one again, unless
        capturing failed before. An episode's engine call ends with this: the graph's kernels read what that call
        made and frees at its end (the LoRA adapters' 16-bit copies, `lora.rollout_branch`)."""
        self.graph = self.graph_logits = None
        self.use_graph = self._graph_wanted and self.fallback_reason is None
        if self.lean is not None:  # the next call's weights are looked up again (its copies, not this call's)
            self.lean = (type(self.lean[0])(self.model), self.lean[1])

    def make_room(self, columns: int) -> bool:
        """Whether `columns` more columns fit, growing the cache to just that where they do not (a turn's block
        and its budget of decode steps: the columns a dynamic cache would reach at worst; a graph is captured anew
        at the next step, a few eager steps' time). False where the GPU has no room for it: `to_dynamic` then."""
        L = self.mask.shape[-1]
        new_L = self.length + columns
        if new_L <= L:
            return True
        # beside the cache while it grows: the added columns, one layer's new tensor and the new mask
        size = self.keys[0].element_size()
        per_column = sum(k.shape[1] * k.shape[3] for k in self.keys + self.values) * size
        layer = max(k.shape[1] * k.shape[3] for k in self.keys + self.values) * size
        extra = self.rows * ((new_L - L) * per_column + new_L * (layer + self.mask.element_size()))
        free = free_device_memory(self.mask.device)
        if free is not None and extra > free:
            return False
        self.drop_graph()  # its shapes are the old ones
        for tensors in (self.keys, self.values):
            for i, t in enumerate(tensors):
                bigger = t.new_zeros(*t.shape[:2], new_L, t.shape[3])
                bigger[:, :, :L] = t
                tensors[i] = bigger  # the old one goes now: one layer's copy at a time beside the cache
        mask = self.mask.new_full((self.rows, 1, 1, new_L), torch.finfo(self.mask.dtype).min)
        mask[..., :L] = self.mask
        self.mask = mask
        self.cache = self._new_cache()
        return True

    def to_dynamic(self) -> tuple:
        """The columns written so far as a DynamicCache (every row) and which of them are real [N, length] (1:
        attend), the cache's tensors given up layer by layer; the decoder is released."""
        length, cache = self.length, DynamicCache()
        real = (self.mask[:, 0, 0, :length] == 0).long()
        for i in range(len(self.keys)):
            k, v = self.keys[i][:, :, :length].clone(), self.values[i][:, :, :length].clone()
            self.keys[i] = self.values[i] = None
            cache.update(k, v, i)
        self.release()
        return cache, real

    def _capture(self) -> torch.Tensor:
        """Capture `_forward` in a CUDA graph on the current inputs and return this step's logits.

        A step is idempotent (same inputs -> same K/V written to the same column, same mask
        column set), so warming up, capturing and replaying on the real first step's inputs
        leaves exactly the state one eager step would.
        """
        self.use_graph = False
        try:
            # Warm up on a side stream, as PyTorch's CUDA-graph docs require: lazy inits, cuBLAS
            # workspaces and autotuning must happen outside the capture.
            device = self.mask.device
            stream = capture_stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    eager = self._forward().clone()  # (the buffer: the replay below writes it again)
            torch.cuda.synchronize(device)  # `eager` was made on the side stream: finish it before reuse
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                graph_logits = self._forward()
            graph.replay()
            torch.cuda.synchronize()
        except Exception as exc:  # never fail a run over an optimisation
            return self._fall_back(f"capture failed: {type(exc).__name__}: {exc}")
        # Trust the graph only if it reproduces the eager step.
        err, tol = graph_error(graph_logits, eager), graph_tolerance(self.mask.dtype)
        if not err <= tol:  # NaN fails too
            del graph, graph_logits
            return self._fall_back(f"the replayed graph's logits differ from an eager step by {err:.3g} "
                                   f"(worst row's relative RMS; {tol} allowed)", logits=eager)
        self.graph, self.graph_logits = graph, graph_logits
        return graph_logits

    def _fall_back(self, reason: str, logits: torch.Tensor | None = None) -> torch.Tensor:
        self.fallback_reason = reason
        warnings.warn(f"CUDA-graph decoding disabled, decoding with the eager static cache instead: {reason}",
                      RuntimeWarning, stacklevel=3)
        if logits is not None:  # the eager step's, into the buffer the refused replay wrote (the sampling reads it)
            return self.logits_buffer(logits)
        return self._forward()  # the step is idempotent: safe to redo

    def release(self) -> None:
        """Drop the cache, buffers and graph (its private memory pool goes with it)."""
        self.graph = self.graph_logits = self.cache = self.lean = self.logits = None
        self.keys = self.values = []
        self.tokens = self.positions = self.write_pos = self.mask = None


# How deep the code runs in work a CUDA graph replays on a GPU (a static decode step, its sampling) while it runs
# eagerly (the simulation's op recorder reads it: on a GPU those ops are a graph's nodes, launched by one replay)
_graphed_depth = 0


def in_graphed_step() -> bool:
    return _graphed_depth > 0


@contextlib.contextmanager
def replayed():
    """Inside: work a CUDA graph replays on a GPU (`in_graphed_step`)."""
    global _graphed_depth
    _graphed_depth += 1
    try:
        yield
    finally:
        _graphed_depth -= 1


class GraphedStep:
    """`fn()` - work on fixed tensors only, nothing read back to the host - replayed from a CUDA graph of its own.

    Its first call runs it (on the capture stream: what it initialises lazily happens outside a capture), then
    captures it, which runs nothing; the second replays the graph on the state as it is, keeps what it wrote
    (`writes`: every tensor fn changes), puts the state back, runs fn eagerly and compares the two bit for bit -
    a graph that read a stale tensor or a value the host changed is dropped there with a warning, the eager
    results standing. Later calls replay. Off CUDA, with `graph=False`, or after a failure: eager calls.
    A decode step's sampling (`RolloutEngine._decode_static`): ~30 small kernels the host would launch one by one,
    launched by one replay."""

    def __init__(self, fn, writes: list, graph: bool):
        self.fn, self.writes = fn, writes
        self.wanted = graph and bool(writes) and writes[0].is_cuda
        self.graph, self.checked, self.failure = None, False, None

    def __call__(self) -> None:
        if self.graph is not None and self.checked:
            self.graph.replay()
            return
        if self.wanted and self.graph is None:
            return self._capture()
        if self.graph is not None:
            return self._check()
        with replayed():
            self.fn()

    def _capture(self) -> None:
        self.wanted = False
        device = self.writes[0].device
        stream = capture_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            self.fn()  # the call itself, and the capture's warm-up
        torch.cuda.current_stream(device).wait_stream(stream)
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                self.fn()
            self.graph = graph
        except Exception as exc:  # never fail a run over an optimisation
            self._give_up(f"capture failed: {type(exc).__name__}: {exc}")

    def _check(self) -> None:
        before = [t.clone() for t in self.writes]
        self.graph.replay()
        written = [t.clone() for t in self.writes]
        for t, b in zip(self.writes, before):
            t.copy_(b)
        self.fn()
        if all(torch.equal(a, b) for a, b in zip(written, self.writes)):
            self.checked = True
        else:
            self._give_up("its replay wrote other values than an eager call")

    def _give_up(self, reason: str) -> None:
        self.graph, self.failure = None, reason
        warnings.warn(f"CUDA-graph sampling disabled, sampling eagerly instead: {reason}", RuntimeWarning,
                      stacklevel=4)
