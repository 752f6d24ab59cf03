"""The Triton kernels behind selective_logprobs(backend="triton") against the PyTorch reference.

Without a GPU the kernels run on Triton's CPU interpreter (TRITON_INTERPRET=1, set here before
triton is imported) with small blocks so the file stays fast; with a GPU they run for real with
their default blocks, and a full-size (Qwen2.5-1.5B head) check runs as well.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' import (triton.jit reads it)
pytest.importorskip("triton", reason="the kernels are Triton (run interpreted on the CPU; installed with torch on Linux)")

from grpo_nb.kernels import logprobs_triton as K  # noqa: E402
from grpo_nb.logprobs import completion_logprobs, selective_logprobs  # noqa: E402

try:
    from tests.tiny_models import tiny_model
except ImportError:  # tests/ itself on sys.path (plain `pytest`)
    from tiny_models import tiny_model

if not CUDA and not K.interpreted():
    pytest.skip("grpo_nb.kernels was imported before TRITON_INTERPRET=1 was set; run this file on its own",
                allow_module_level=True)

DEVICE = "cuda" if CUDA else "cpu"
# Interpreter: small tiles, so that a few dozen rows already span several row blocks, vocab
# tiles and K steps (and each interpreted op stays cheap). GPU: the kernels' own defaults.
BLOCKS = {} if CUDA else {"block_m": 16, "block_v": 64, "block_k": 32}
ATOL = RTOL = 1e-5


def close(actual, expected, atol=ATOL, rtol=RTOL):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def make_inputs(n, v, h, *, seed=0, std=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g) * std
    weight = torch.randn(v, h, generator=g) * 0.3
    tokens = torch.randint(0, v, (n,), generator=g)
    upstream = torch.randn(n, generator=g)
    return (hidden.to(DEVICE, dtype), weight.to(DEVICE, dtype), tokens.to(DEVICE), upstream.to(DEVICE))


def run(fn, hidden, weight, tokens, upstream, *, h_grad=True, w_grad=True):
    """Forward + backward of `fn(h, w)`; returns (logp, grad_h, grad_w)."""
    h = hidden.clone().requires_grad_(h_grad)
    w = weight.clone().requires_grad_(w_grad)
    out = fn(h, w)
    if h_grad or w_grad:
        (out * upstream).sum().backward()
    return out, h.grad, w.grad


def kernel(tokens, temperature=1.0, scale=1.0, softcap=None, **kw):
    return lambda h, w: K.triton_selective_logprobs(h, w, tokens, temperature, scale, softcap, **{**BLOCKS, **kw})


def reference(tokens, temperature=1.0, scale=1.0, softcap=None):
    return lambda h, w: selective_logprobs(h, w, tokens, temperature=temperature, logit_scale=scale,
                                           logit_softcap=softcap, backend="torch")


def check(n, v, h, *, temperature=1.0, scale=1.0, softcap=None, std=1.0, h_grad=True, w_grad=True,
          upstream_mask=None, seed=0, **kw):
    hidden, weight, tokens, upstream = make_inputs(n, v, h, seed=seed, std=std)
    if upstream_mask is not None:
        upstream = upstream * upstream_mask
    ours = run(kernel(tokens, temperature, scale, softcap, **kw), hidden, weight, tokens, upstream,
               h_grad=h_grad, w_grad=w_grad)
    ref = run(reference(tokens, temperature, scale, softcap), hidden, weight, tokens, upstream,
              h_grad=h_grad, w_grad=w_grad)
    assert ours[0].shape == (n,) and ours[0].dtype == torch.float32
    close(ours[0], ref[0])
    for got, want, needed in ((ours[1], ref[1], h_grad), (ours[2], ref[2], w_grad)):
        if needed:
            close(got, want)
        else:
            assert got is None
    return ours


# --------------------------------------------------------------------------------------
# Kernel against the reference


@pytest.mark.parametrize("h", [32, 64])
@pytest.mark.parametrize("v", [100, 257, 512])
@pytest.mark.parametrize("n", [1, 37, 64])
def test_matches_reference(n, v, h):
    # Vocabularies that are not multiples of the tile, a ragged last row block, one row alone;
    # a vocabulary split into 1, 2 or 3 slices in the forward pass.
    check(n, v, h, num_splits=1 + (n + v) % 3, seed=n + v + h)


def test_ragged_hidden_size_and_smallest_tiles():
    # 40 = 2.5 K steps of 16: the last K step is masked. 16 x 16 x 16 tiles are the smallest
    # tl.dot takes (on the GPU too).
    check(37, 100, 40, block_m=16, block_v=16, block_k=16, num_splits=3, softcap=4.0)


@pytest.mark.parametrize("temperature", [0.7, 1.6])
def test_temperature(temperature):
    check(37, 257, 32, temperature=temperature)


@pytest.mark.parametrize("scale,softcap", [(0.25, None), (1.0, 5.0), (2.0, 3.0), (0.0625, 30.0)])
def test_logit_scale_and_softcap(scale, softcap):
    # Large hidden states so the soft-cap's tanh is well into its non-linear range.
    check(37, 257, 32, temperature=0.6, scale=scale, softcap=softcap, std=3.0, num_splits=2)


def test_upstream_gradient_with_zeros():
    """Masked (padding) positions get a zero upstream gradient and must get zero grad_h rows."""
    mask = (torch.arange(64, device=DEVICE) % 3 != 0).float()
    _, grad_h, _ = check(64, 257, 32, upstream_mask=mask, softcap=4.0, scale=1.5)
    assert (grad_h[mask == 0] == 0).all()
    assert (grad_h[mask == 1].abs().sum(-1) > 0).all()


@pytest.mark.parametrize("h_grad,w_grad", [(True, False), (False, True)], ids=["frozen-head", "head-only"])
def test_only_one_input_requires_grad(h_grad, w_grad):
    check(37, 257, 64, temperature=0.8, scale=1.5, softcap=4.0, std=2.0, h_grad=h_grad, w_grad=w_grad)


def test_no_grad_inputs_give_plain_tensor():
    hidden, weight, tokens, _ = make_inputs(20, 100, 32)
    out = K.triton_selective_logprobs(hidden, weight, tokens, **BLOCKS)
    assert not out.requires_grad
    close(out, selective_logprobs(hidden, weight, tokens, backend="torch"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_against_fp32_reference(dtype):
    """bf16 / fp16 inputs: fp32 accumulation, so the log-probs match the fp32 reference on the
    rounded inputs closely; the gradients go through half-precision dz tiles (as the torch
    path's grad_h does) and come back in the input dtype."""
    hidden, weight, tokens, upstream = make_inputs(64, 257, 64, dtype=dtype, seed=3)
    ours = run(kernel(tokens, 0.9, 1.0, 5.0), hidden, weight, tokens, upstream)
    ref = run(reference(tokens, 0.9, 1.0, 5.0), hidden.float(), weight.float(), tokens, upstream)
    close(ours[0], ref[0], atol=1e-4, rtol=1e-4)
    for got, want in zip(ours[1:], ref[1:]):
        assert got.dtype == dtype
        err = (got.float() - want).norm() / want.norm()
        assert err < 1e-2, float(err)
        close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_extreme_logits_are_finite():
    hidden, weight, tokens, _ = make_inputs(37, 257, 32, std=200.0)  # logits in the thousands
    out = K.triton_selective_logprobs(hidden, weight, tokens, **BLOCKS)
    assert torch.isfinite(out).all()
    close(out, selective_logprobs(hidden, weight, tokens, backend="torch"), atol=1e-3, rtol=1e-5)


def test_noncontiguous_inputs():
    hidden, weight, tokens, upstream = make_inputs(37, 100, 32)
    h_nc = hidden.t().contiguous().t()
    w_nc = weight.t().contiguous().t()
    assert not h_nc.is_contiguous() and not w_nc.is_contiguous()
    ours = run(kernel(tokens), h_nc, w_nc, tokens, upstream)
    ref = run(reference(tokens), hidden, weight, tokens, upstream)
    for got, want in zip(ours, ref):
        close(got, want)


def test_empty_input():
    hidden, weight, tokens, upstream = make_inputs(0, 100, 32)
    out, grad_h, grad_w = run(kernel(tokens), hidden, weight, tokens, upstream)
    assert out.shape == (0,) and out.dtype == torch.float32
    assert grad_h.shape == (0, 32)
    assert grad_w.shape == weight.shape and (grad_w == 0).all()


def test_bad_tokens_and_blocks_raise():
    hidden, weight, tokens, _ = make_inputs(5, 100, 32)
    with pytest.raises(ValueError, match="token ids"):
        K.triton_selective_logprobs(hidden, weight, tokens + 100, **BLOCKS)
    with pytest.raises(ValueError, match="block sizes"):
        K.triton_selective_logprobs(hidden, weight, tokens, block_m=8)
    with pytest.raises(ValueError, match="dtype"):
        K.triton_selective_logprobs(hidden.double(), weight.double(), tokens)


# --------------------------------------------------------------------------------------
# Dispatch in selective_logprobs


def test_backend_triton_matches_torch_backend_3d():
    """[B, T, H] inputs with fp32 activations and a bf16 head: the caller's reshape and cast."""
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(3, 13, 64, generator=g).to(DEVICE)
    weight = (torch.randn(257, 64, generator=g) * 0.3).to(DEVICE, torch.bfloat16)
    tokens = torch.randint(0, 257, (3, 13), generator=g).to(DEVICE)
    ours = selective_logprobs(hidden, weight, tokens, temperature=0.7, backend="triton")
    ref = selective_logprobs(hidden, weight, tokens, temperature=0.7, backend="torch")
    assert ours.shape == tokens.shape
    # The torch path rounds bf16 logits before the softmax; the kernel keeps them in fp32.
    close(ours, ref, atol=3e-2, rtol=1e-2)


def test_bad_backend_is_an_error():
    hidden, weight, tokens, _ = make_inputs(4, 16, 32)
    with pytest.raises(ValueError, match="backend"):
        selective_logprobs(hidden, weight, tokens, backend="cuda")


@pytest.mark.skipif(CUDA, reason="checks dispatch on a machine without CUDA; this one has a GPU")
def test_auto_backend_uses_torch_on_cpu(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the Triton kernel ran on CPU tensors under backend='auto'")

    monkeypatch.setattr(K, "triton_selective_logprobs", boom)
    hidden, weight, tokens, _ = make_inputs(4, 16, 32)
    selective_logprobs(hidden, weight, tokens)  # default backend="auto"


@pytest.mark.skipif(CUDA, reason="checks dispatch on a machine without CUDA; this one has a GPU")
def test_triton_backend_on_cpu_without_interpreter_names_the_fix(monkeypatch):
    monkeypatch.setattr(K, "interpreted", lambda: False)
    hidden, weight, tokens, _ = make_inputs(4, 16, 32)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        selective_logprobs(hidden, weight, tokens, backend="triton")


def test_triton_backend_without_triton_names_the_fix(monkeypatch):
    import grpo_nb.kernels

    # `from .kernels import logprobs_triton` now fails as it would without triton.
    monkeypatch.delattr(grpo_nb.kernels, "logprobs_triton")
    monkeypatch.setitem(sys.modules, "grpo_nb.kernels.logprobs_triton", None)
    hidden, weight, tokens, _ = make_inputs(4, 16, 32)
    with pytest.raises(RuntimeError, match="backend='torch'"):
        selective_logprobs(hidden, weight, tokens, backend="triton")
    out = selective_logprobs(hidden, weight, tokens)  # "auto" falls back to torch
    close(out, selective_logprobs(hidden, weight, tokens, backend="torch"))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_completion_logprobs_triton_equals_torch(tied):
    model = tiny_model("qwen2", tied=tied, seed=2).to(DEVICE)
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(4, 512, (3, 5), generator=g).to(DEVICE)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[1, :2] = 0  # a left-padded prompt
    completion_ids = torch.randint(4, 512, (3, 6), generator=g).to(DEVICE)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[2, 3:] = 0
    upstream = torch.randn(3, 6, generator=g).to(DEVICE) * completion_mask

    params = [model.lm_head.weight, model.model.norm.weight, model.model.layers[1].mlp.down_proj.weight]
    results = {}
    for backend in ("triton", "torch"):
        out = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                  temperature=0.8, backend=backend)
        results[backend] = (out, torch.autograd.grad((out * upstream).sum(), params))
    close(results["triton"][0], results["torch"][0])
    for got, want in zip(results["triton"][1], results["torch"][1]):
        assert want.abs().sum() > 0
        close(got, want, atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------------------
# Full size, GPU only


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_full_shape_bf16_on_gpu():
    """4,096 rows through Qwen2.5-1.5B's head (151,936 x 1,536) in bf16.

    Matches the fp32 reference, and the peak memory above the inputs stays far below the
    N x V x 4 bytes (2.5 GB) that fp32 logits alone would take.
    """
    n, v, d = 4096, 151936, 1536
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, d, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(v, d, device="cuda", generator=g) * 0.02).bfloat16()
    tokens = torch.randint(0, v, (n,), device="cuda", generator=g)
    upstream = torch.randn(n, device="cuda", generator=g)
    full_logits_bytes = n * v * 4

    def peak_extra(w_grad):
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_(w_grad)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = K.triton_selective_logprobs(h, w, tokens, 1.0, 1.0, None)
        (out * upstream).sum().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, out.detach(), h.grad, w.grad

    frozen_peak, _, _, _ = peak_extra(False)
    assert frozen_peak < 0.05 * full_logits_bytes, frozen_peak
    peak, out, grad_h, grad_w = peak_extra(True)
    # grad_W in fp32 (accumulator) and bf16 (result) is all that may scale with the vocabulary.
    assert peak < v * d * (4 + 2) * 1.05 + 0.05 * full_logits_bytes, peak

    ref, ref_h, ref_w = run(reference(tokens), hidden.float(), weight.float(), tokens, upstream)
    close(out, ref, atol=1e-3, rtol=1e-3)
    for got, want in ((grad_h, ref_h), (grad_w, ref_w)):
        err = (got.float() - want).norm() / want.norm()
        assert err < 1e-2, float(err)


def test_auto_self_test_accepts_the_kernels_and_rejects_wrong_ones():
    # "auto" runs this once per (device, dtype, hidden size) before trusting the kernels.
    from grpo_nb import logprobs as L

    w = torch.randn(10, 64, device=DEVICE)
    L._SELF_TESTED.clear()
    assert L._kernels_pass_self_test(K, w)

    class WrongKernels:  # plausible-looking but off by a constant
        @staticmethod
        def triton_selective_logprobs(h, w, t, temperature, scale, softcap):
            return L._SelectiveLogprobs.apply(h, w, t, temperature, 16, scale, softcap) - 0.1

    class BrokenKernels:
        @staticmethod
        def triton_selective_logprobs(*a):
            raise RuntimeError("out of resource: shared memory")

    for kernels, reason in ((WrongKernels, "differ from the PyTorch reference"), (BrokenKernels, "out of resource")):
        L._SELF_TESTED.clear()
        with pytest.warns(RuntimeWarning, match=reason):
            assert not L._kernels_pass_self_test(kernels, w)
    L._SELF_TESTED.clear()
