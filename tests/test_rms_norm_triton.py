"""The Triton RMSNorm forward (grpo_nb/kernels/rms_norm_triton.py) against its PyTorch reference.

Without a GPU the kernel runs on Triton's CPU interpreter (TRITON_INTERPRET=1), where numpy has no bf16: fp32 and
fp16 rows here, bf16 in the CUDA self-test only. On a GPU the same tests run on CUDA tensors.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernel's import (triton.jit reads it)
pytest.importorskip("triton", reason="the kernel is Triton (run interpreted on the CPU; installed with torch on Linux)")

from grpo_nb import rms_norm as norms  # noqa: E402
from grpo_nb.kernels import rms_norm_triton as K  # noqa: E402

if not CUDA and not K.interpreted():
    pytest.skip("grpo_nb.kernels was imported before TRITON_INTERPRET=1 was set; run this file on its own",
                allow_module_level=True)

DEVICE = "cuda" if CUDA else "cpu"
ULP = {torch.float32: 1e-6, torch.float16: 2**-10, torch.bfloat16: 2**-7}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])


def _rows(rows, cols, dtype, seed=0, wider=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols + wider, generator=g) * 3
    return x.to(DEVICE, dtype)[:, :cols]  # wider > 0: rows of a wider tensor (a stride of their own)


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("same_weight_dtype", [True, False], ids=["weight-like-x", "fp32-weight"])
@pytest.mark.parametrize("rows,cols,wider", [(1, 8, 0), (5, 100, 0), (37, 576, 0), (3, 96, 32)])
def test_the_kernel_matches_the_modules_formula(x_dtype, same_weight_dtype, rows, cols, wider):
    x = _rows(rows, cols, x_dtype, seed=rows, wider=wider)
    weight = (1 + torch.randn(cols, generator=torch.Generator().manual_seed(1)) / 4).to(
        DEVICE, x_dtype if same_weight_dtype else torch.float32)
    out, rstd = K.rms_norm_forward(x, weight, 1e-5)
    ref, ref_rstd = K.rms_norm_reference(x, weight, 1e-5)
    assert out.dtype == ref.dtype and out.shape == ref.shape and rstd.shape == (rows, 1)
    # rstd as torch's up to the order of the sum; after it the module's roundings, bit for bit
    torch.testing.assert_close(rstd, ref_rstd, rtol=1e-6, atol=0)
    assert torch.equal(out, K.rms_norm_reference(x, weight, 1e-5, rstd)[0])
    # against the reference's own rstd: a unit or two in the last place of x's dtype
    ulp = max(ULP[x_dtype], ULP[out.dtype])
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 * ulp, atol=ulp * 1e-3)


def test_no_rows_and_refused_shapes():
    out, rstd = K.rms_norm_forward(torch.empty(0, 16, device=DEVICE), torch.ones(16, device=DEVICE), 1e-6)
    assert out.shape == (0, 16) and rstd.shape == (0, 1)
    x, w = torch.randn(4, 16, device=DEVICE), torch.ones(16, device=DEVICE)
    assert K.supported(x, w)
    assert not K.supported(x.t().contiguous().t(), w)  # columns not contiguous
    assert not K.supported(x, torch.ones(8, device=DEVICE)) and not K.supported(x.double(), w.double())
    assert not K.supported(torch.randn(2, K.MAX_COLUMNS + 1, device=DEVICE), torch.ones(K.MAX_COLUMNS + 1,
                                                                                       device=DEVICE))


def test_the_self_test_trusts_the_kernel_and_refuses_a_wrong_one(monkeypatch):
    """What `rms_norm` runs before it uses the kernel on a GPU: here on the interpreter's rows, the same code."""
    x, w = _rows(4, 64, torch.float16), torch.ones(64, device=DEVICE, dtype=torch.float16)
    monkeypatch.setattr(norms, "_SELF_TESTED", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert norms._passes_self_test(K, x, w)
    right = K.rms_norm_forward
    wrong = lambda rows, weight, eps: (lambda out, rstd: (out * 1.01, rstd))(*right(rows, weight, eps))
    monkeypatch.setattr(norms, "_SELF_TESTED", {})
    monkeypatch.setattr(K, "rms_norm_forward", wrong)
    with pytest.warns(RuntimeWarning, match="Triton RMSNorm kernel failed its self-test"):
        assert not norms._passes_self_test(K, x, w)
    assert not norms._passes_self_test(K, x, w)  # decided once per device, dtypes and width


def test_a_simulated_gpu_step_launches_one_kernel_per_norm(monkeypatch):
    """The simulation prices what a GPU runs: each RMSNorm of a decode step one kernel, not ~8 (the modules' step;
    grpo-nb's own static step adds the residual in the same kernel: tests/test_decode_triton.py)."""
    from tiny_models import tiny_config

    from grpo_nb.rollout import lean_forward
    from grpo_nb.simulate import simulate_step

    monkeypatch.setattr(lean_forward, "LEAN_STATIC", False)

    step = simulate_step(tiny_config("llama"), max_prompt_length=16, max_completion_length=8, num_generations=4,
                         dtype="fp16", gpu="T4", gradient_checkpointing=True)
    trace = step.record_ops()
    decode = [op for op in trace.ops if op.stage == "decode" and op.unit == trace.decode_units()[1][0]]
    layers = tiny_config("llama").num_hidden_layers
    assert sum(op.name == "rms_norm" for op in decode) == 2 * layers + 1
    assert not any(op.name in ("pow", "rsqrt") for op in decode)
    forward = [op.name for op in trace.ops if op.stage == "forward"]
    assert "rms_norm" in forward  # the update's forward too (its backward stays PyTorch's)
