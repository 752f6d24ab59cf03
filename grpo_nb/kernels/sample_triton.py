"""A GPU decode step's sampling in two Triton kernels: the tokens drawn from the tempered softmax and their log-probs.

The rollout engine draws each token by inverse CDF (`rollout.engine.sample_from_logits`: the first token whose
cumulative probability exceeds u * the total, for one uniform u per row) and scores it by the tempered log-softmax.
Through PyTorch's ops that is a division, a log-softmax, a softmax, a cumulative sum, a search and a gather: six
passes over the [rows, vocabulary] fp32 logits (~45 MB a step at 8 rows of Qwen2.5's 151,936 tokens: ~0.2 ms of a
T4's ~8 ms step) for two numbers a row. Here (where no processor changes the scores - no top-k / top-p / min-p, no
repetition penalty, no min_new_tokens, not greedy - `RolloutEngine._sample`):

    sample(logits, temperature, uniforms)   one pass over each row in chunks (each chunk's max and sum of
                                            exponentials), then per row: the chunks' totals, the chunk where the
                                            cumulative sum passes u * the total, and the token inside it
                                            -> (tokens [n] long, their log-probs [n] fp32)

`sample_reference` is the engine's arithmetic, which the tests hold the kernels to under TRITON_INTERPRET=1: the
same token for the same uniform (the sums' order differs: a uniform within ~1e-7 of a boundary between two tokens
may pick the other, the same distribution), the log-prob within fp32 rounding. **Never run on a GPU**: written
and tested without one (`kernels.decode_glue.sampler` self-tests it once per device before it is trusted).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import on_device, report_meta, triton_interpreted

CHUNK = 2048  # columns a program of the first kernel reads (151,936: 75 chunks a row)


@triton.jit
def _chunk_totals(X, M, S, stride_x, n_cols, temperature, CHUNKS: tl.constexpr, CHUNK: tl.constexpr):
    """One (row, chunk) program: the chunk's largest tempered logit and its sum of exp(logit - that)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(X + row * stride_x + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32) / temperature
    m = tl.max(x, axis=0)
    safe = tl.where(m == float("-inf"), 0.0, m)  # (a chunk of -inf logits: sum 0)
    tl.store(M + row * CHUNKS + chunk, m)
    tl.store(S + row * CHUNKS + chunk, tl.sum(tl.exp(x - safe), axis=0))


@triton.jit
def _pick(X, M, S, U, TOKEN, LOGP, stride_x, n_cols, n_chunks, temperature, CHUNKS: tl.constexpr,
          CHUNK: tl.constexpr):
    """One row's program: the chunks' totals rescaled to the row's max, the chunk where their cumulative sum first
    exceeds u * the total, the first token inside it where it does; its log-prob x / T - max - log(total)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS)
    m = tl.load(M + row * CHUNKS + c, mask=c < n_chunks, other=float("-inf"))
    s = tl.load(S + row * CHUNKS + c, mask=c < n_chunks, other=0.0)
    big = tl.max(m, axis=0)
    w = tl.where(s == 0, 0.0, s * tl.exp(m - big))  # (a chunk of -inf: 0; a NaN logit: NaN, as the reference)
    total = tl.sum(w, axis=0)
    target = tl.load(U + row).to(tl.float32) * total
    hit = tl.min(tl.where(tl.cumsum(w, axis=0) > target, c, CHUNKS), axis=0)
    # (none where rounding put the target at the very end: the last chunk with any probability)
    chunk = tl.maximum(tl.where(hit < CHUNKS, hit, tl.max(tl.where(w > 0, c, -1), axis=0)), 0)
    before = tl.sum(tl.where(c < chunk, w, 0.0), axis=0)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=inside, other=float("-inf")).to(tl.float32) / temperature
    e = tl.where(inside, tl.exp(x - big), 0.0)
    running = before + tl.cumsum(e, axis=0)
    passed = (running > target) & (e > 0)  # (a token of probability 0 is never drawn)
    token = tl.min(tl.where(passed, cols, n_cols), axis=0)
    # None where the chunks' totals and this running sum round apart and the target falls between them: the last
    # token that adds to the running sum (not one after it too small to change it)
    last = tl.min(tl.where((running >= tl.max(running, axis=0)) & (e > 0), cols, n_cols), axis=0)
    token = tl.where(token < n_cols, token, last)
    token = tl.where(token < n_cols, token, n_cols - 1)  # (a row of -inf logits: the last token, as the reference)
    chosen = tl.sum(tl.where(cols == token, x, 0.0), axis=0)
    tl.store(TOKEN + row, token.to(tl.int64))
    # (no probability at all - a row of -inf -: NaN, as the reference)
    tl.store(LOGP + row, tl.where(total > 0, chosen - big - tl.log(total), float("nan")))


def interpreted() -> bool:
    """Whether the kernels run on Triton's CPU interpreter (TRITON_INTERPRET=1 when they were jitted)."""
    return triton_interpreted(_pick)


def sample(logits: torch.Tensor, temperature: float, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens drawn from softmax(logits / temperature) [n, V] by inverse CDF at `uniforms` [n] (in [0, 1)), and
    their log-probs under it: ([n] long, [n] fp32)."""
    n, vocab = logits.shape
    if uniforms.shape != (n,):
        raise ValueError(f"sample: uniforms of shape {tuple(uniforms.shape)} for {n} rows of logits: one per row")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    uniforms = uniforms.contiguous()  # (read at row i: a strided view is copied)
    chunks = triton.cdiv(vocab, CHUNK)
    width = triton.next_power_of_2(chunks)
    maxes = torch.empty(n, width, dtype=torch.float32, device=logits.device)
    sums = torch.empty(n, width, dtype=torch.float32, device=logits.device)
    tokens = torch.empty(n, dtype=torch.long, device=logits.device)
    logp = torch.empty(n, dtype=torch.float32, device=logits.device)
    if logits.device.type == "meta":  # the simulation standing for a GPU: the kernels' work to the op record
        partial = 2 * maxes.numel() * 4
        report_meta("sample_chunk_totals", 4 * logits.numel(), logits.numel() * logits.element_size() + partial,
                    logits.dtype, maxes, sums)
        report_meta("sample_pick", 4 * n * CHUNK, n * CHUNK * logits.element_size() + partial + n * 16,
                    logits.dtype, tokens, logp)
        return tokens, logp
    if n:
        with on_device(logits.device):
            _chunk_totals[(n, chunks)](logits, maxes, sums, logits.stride(0), vocab, float(temperature),
                                       CHUNKS=width, CHUNK=CHUNK, num_warps=4)
            _pick[(n,)](logits, maxes, sums, uniforms, tokens, logp, logits.stride(0), vocab, chunks,
                        float(temperature), CHUNKS=width, CHUNK=CHUNK, num_warps=4)
    return tokens, logp


def sample_reference(logits: torch.Tensor, temperature: float,
                     uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rollout engine's sampling where no processor changes the scores (`RolloutEngine._sample` with
    `rollout.engine.sample_from_logits`, its ops; the engine's test holds the two together): the tempered
    log-softmax, inverse-CDF sampling, the sampled tokens' log-probs."""
    tempered = logits / temperature
    cdf = tempered.softmax(-1).cumsum(-1)
    target = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=logits.shape[-1] - 1)
    return tokens, torch.log_softmax(tempered, dim=-1).gather(1, tokens[:, None]).squeeze(1)
