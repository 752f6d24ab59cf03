"""A CPU decode step's few-row bf16 products in C with AMX (grpo_nb/kernels/cpu_linear.c) against their PyTorch
reference, what they refuse, how `lora.skinny_linear` offers them, and the lean forward's logits with them."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from grpo_nb import lora
from grpo_nb.kernels import cpu_linear as L

if not L.available():
    # a kernel that builds and computes other numbers is a failure, never a skip
    assert "differ from the PyTorch reference" not in (L.why_not or ""), L.why_not
    pytest.skip(f"grpo-nb's AMX products do not run here ({L.why_not})", allow_module_level=True)


def _near(got: torch.Tensor, want: torch.Tensor):
    """bf16 outputs equal to the reference's rounding or the bf16 value next to it (the sums' last fp32 bits)."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("M", [1, 2, 15, 16, 17, 33, 64])
@pytest.mark.parametrize("N,K", [(16, 32), (48, 64), (96, 576), (80, 1536)])
def test_the_kernel_computes_its_reference(M, N, K):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x = torch.randn(M, K, generator=g).bfloat16()
    weight = torch.randn(N, K, generator=g).bfloat16()
    bias = torch.randn(N, generator=g).bfloat16()
    for b in (None, bias):
        got = L.linear(x, weight, b)
        _near(got, L.reference(x, weight, b))
        _near(got, F.linear(x, weight, b))  # what torch gives, to the same rounding
        # not trivially right: most outputs are exactly the reference's (the rest one bf16 step away)
        assert (got == L.reference(x, weight, b)).float().mean() > 0.9


def test_strided_rows_and_weight_views_and_batched_rows():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(80, 160, generator=g).bfloat16()
    weight = big[8:72, 32:128]  # a view: rows 160 apart, 64 of them, 96 columns
    x = torch.randn(2, 5, 101, generator=g).bfloat16()[..., 3:99]  # [2, 5, 96], rows 101 apart
    bias = torch.randn(64, generator=g).bfloat16()
    got = L.linear(x, weight, bias)
    assert got.shape == (2, 5, 64) and got.is_contiguous()
    _near(got, L.reference(x, weight, bias))
    weight_t = torch.randn(32, 64, generator=g).bfloat16().t()  # columns strided: refused
    assert L.linear(torch.randn(3, 32).bfloat16(), weight_t) is None


def test_what_it_does_not_take():
    x, w, b = torch.randn(4, 64).bfloat16(), torch.randn(32, 64).bfloat16(), torch.randn(32).bfloat16()
    assert L.supports(x, w, b) and L.supports(x, w, None)
    refused = [(x.float(), w.float(), None), (x.half(), w.half(), None),  # not bf16
               (x, w.float(), None), (x.float(), w, None), (x, w, b.float()),  # mixed dtypes
               (x[:, :48], w[:, :48], None),  # K not a multiple of 32
               (x, w[:24], None),  # N not a multiple of 16
               (torch.randn(65, 64).bfloat16(), w, None),  # more rows than a decode step's: torch's GEMM
               (x[:0], w, None),  # no rows
               (x, w, b[:16]), (x, w, torch.randn(64).bfloat16()[::2]),  # a short or strided bias
               (x[:, 0], w, None)]  # x's last size is not the weight's K
    for operands in refused:
        assert not L.supports(*operands)
        assert L.linear(*operands) is None
    with torch.enable_grad():
        assert not L.supports(x.clone().requires_grad_(), w, None)  # autograd needs torch's product
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # says "cpu", holds no memory
        assert L.linear(torch.randn(4, 64).bfloat16(), torch.randn(32, 64).bfloat16()) is None


def test_without_amx_or_a_compiler_it_answers_none_quietly(monkeypatch, tmp_path):
    """No compiler, or a CPU without AMX (the common case): torch's products, without a warning; a kernel that
    computes other numbers than its reference: a warning."""
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    monkeypatch.setenv("GRPO_NB_CACHE", str(tmp_path))
    monkeypatch.setattr(L, "_function", None)
    x, w = torch.randn(4, 64).bfloat16(), torch.randn(32, 64).bfloat16()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert L.linear(x, w) is None and "could not build cpu_linear.c" in L.why_not
    monkeypatch.delenv("CC")
    monkeypatch.setattr(L, "_function", None)
    real = L._load

    def no_amx():
        fn, _ = real()
        return fn, lambda: 1  # what the library answers where -march=native gave it no AMX

    monkeypatch.setattr(L, "_load", no_amx)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert L.linear(x, w) is None and "no AMX" in L.why_not
    monkeypatch.setattr(L, "_load", real)
    monkeypatch.setattr(L, "_function", None)
    monkeypatch.setattr(L, "_self_test", lambda fn: False)  # built, but computing other numbers
    with pytest.warns(RuntimeWarning, match="differ from the PyTorch reference"):
        assert L.linear(x, w) is None


def test_skinny_linear_offers_it_and_keeps_the_fastest():
    """bf16 few-row products time the AMX kernel beside torch's two ways; every call's product is the reference's
    to bf16 rounding, whichever runs (torch's `W @ x.T` rounds before it adds the bias: two roundings)."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    assert "AMX (grpo-nb)" in lora._BF16_PRODUCTS.products
    for rows in (1, 4, 16):
        x = torch.randn(1, rows, 64, generator=g).bfloat16()
        for _ in range(3 * lora._BF16_PRODUCTS.trials + 1):
            out = lora.skinny_linear(x, w, b)
            assert out.shape == (1, rows, 96) and out.is_contiguous()
            want = L.reference(x, w, b).float()
            torch.testing.assert_close(out.float(), want, rtol=2**-7, atol=2**-7 * want.abs().max())
        assert lora._BF16_PRODUCTS.chosen[(rows, w.shape, torch.bfloat16)] in lora._BF16_PRODUCTS.products
    fp32 = torch.randn(4, 64, generator=g)  # fp32 copies: torch's two ways only
    lora.skinny_linear(fp32, w.float())
    assert (4, w.shape, torch.float32) not in lora._BF16_PRODUCTS._times


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q / k / v biases
def test_the_lean_forward_with_it_gives_the_logits_of_torchs_products(arch, monkeypatch):
    """A prefill and decode steps of a tiny model with bf16 rollout copies, every few-row product made to run as
    the kernel, against the same with F.linear: the logits agree to bf16 rounding, and the kernel did run."""
    from grpo_nb.rollout import lean_forward
    from tiny_models import adapted_tiny_model

    g = torch.Generator().manual_seed(1)
    model = adapted_tiny_model(arch, g)
    ids = torch.randint(4, 500, (3, 7), generator=g)
    steps = torch.randint(4, 500, (3, 3, 1), generator=g)  # the same new tokens for both
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    calls = []
    kernel_call = L._call

    def counted(*args):
        calls.append(args[2].shape)
        return kernel_call(*args)

    monkeypatch.setattr(L, "_call", counted)
    logits = {}
    for name, product in (("torch", F.linear), ("kernel", lora._native_linear)):
        monkeypatch.setattr(lora, "_BF16_PRODUCTS", lora.ProductChoice({name: product}))
        call, cache, m, p, out = lean_forward.LeanForward(model), None, mask, pos[:, -1:], []
        with torch.no_grad(), lora.rollout_branch(cpu_dtype=torch.bfloat16), lora.cpu_output_head(model):
            last, cache = call(ids, m, pos, cache)
            for step in steps:
                out.append(last)
                m, p = torch.cat([m, torch.ones_like(m[:, :1])], 1), p + 1
                last, cache = call(step, m, p, cache)
        logits[name] = torch.stack(out)
    assert len(calls) >= 3 * 6  # each decode step's layers' products and the head
    scale = logits["torch"].abs().max()
    assert scale > 1
    torch.testing.assert_close(logits["kernel"], logits["torch"], rtol=0, atol=0.03 * scale)


def test_a_parameter_weight_runs_and_fake_tensors_never_ask(monkeypatch):
    """A bf16 model's own weight (a Parameter) takes the kernel; a product of FakeTensors (torch.compile's tracing)
    goes to torch's products without running the kernel's first-use check, which would fail on them and switch the
    kernel off for the process."""
    g = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(32, 64, generator=g).bfloat16(), requires_grad=False)
    x = torch.randn(4, 64, generator=g).bfloat16()
    _near(L.linear(x, weight), L.reference(x, weight, None))
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(L, "_function", None)  # not yet checked in this process
    with FakeTensorMode():
        out = lora.skinny_linear(torch.randn(4, 64).bfloat16(), torch.randn(32, 64).bfloat16())
        assert out.shape == (4, 32)
    assert L._function is None
    assert L.available()


def test_no_kernel_checks_itself_under_a_fake_tensor_mode(monkeypatch):
    """Asked first while a FakeTensorMode is active, each C kernel answers False without checking (its check would
    hand C fake tensors' null pointers) and is checked once the mode is gone."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from grpo_nb.kernels import cpu_attention, cpu_decode_ops

    for module, name in ((L, "_function"), (cpu_attention, "_function"), (cpu_decode_ops, "_library")):
        monkeypatch.setattr(module, name, None)
        with FakeTensorMode():
            assert module.available() is False
        assert getattr(module, name) is None
        assert module.available()
