"""The CPU decode step's attention in C (grpo_nb/kernels/cpu_attention.c) against its PyTorch reference, what it
refuses, its fallback where it cannot be built, and the engine's samples with it and with torch's SDPA."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from grpo_nb.kernels import cpu_attention as C, native
from grpo_nb.rollout import RolloutEngine
from tiny_models import tiny_model

if not C.available():
    # a kernel that builds and computes other numbers is a failure, never a skip
    assert "differ from the PyTorch reference" not in (C.why_not or ""), C.why_not
    pytest.skip(f"no C compiler with OpenMP here to build the C attention ({C.why_not})", allow_module_level=True)


def _operands(n, H, KV, S, D, dtype, seed=0, shared=0, spare=3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, H, 1, D, generator=g).to(dtype)
    k, v = (torch.randn(n, KV, S + spare, D, generator=g).to(dtype)[:, :, :S] for _ in range(2))  # strided views
    k[:, :, :shared], v[:, :, :shared] = k[:1, :, :shared].clone(), v[:1, :, :shared].clone()
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,H,KV,S,D,shared", [(1, 1, 1, 1, 16, 0), (2, 4, 2, 5, 16, 0), (3, 9, 3, 16, 64, 0),
                                              (3, 9, 3, 17, 64, 7), (2, 14, 2, 40, 64, 33), (2, 12, 2, 33, 128, 16),
                                              (4, 8, 8, 50, 32, 50)])
@pytest.mark.parametrize("masked", [False, True])
def test_the_kernel_computes_its_reference(dtype, n, H, KV, S, D, shared, masked):
    q, k, v = _operands(n, H, KV, S, D, dtype, shared=shared)
    mask = None
    if masked:
        g = torch.Generator().manual_seed(1)
        mask = torch.rand(n, 1, 1, S, generator=g) < 0.6
        mask[0, ..., : S // 2] = False  # left padding
        mask[..., -1] = True  # each token sees itself
    got = C.attention(q, k, v, mask, D**-0.5, shared)
    want = C.reference(q, k, v, mask, D**-0.5)
    assert got is not None and got.dtype == dtype and got.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output rounded once
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    sdpa = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=D**-0.5,
                                          enable_gqa=True)
    torch.testing.assert_close(want.float(), sdpa.to(dtype).float(), rtol=tol, atol=tol)  # the reference is attention


def test_shared_columns_are_read_from_the_first_row():
    """Rows whose first columns differ from row 0's: with shared=P every row attends to row 0's first P columns."""
    q, k, v = _operands(3, 6, 2, 24, 64, torch.float32)
    P = 10
    as_shared = k.clone(), v.clone()
    for t in as_shared:
        t[:, :, :P] = t[:1, :, :P]
    got = C.attention(q, k, v, None, 0.125, shared=P)
    torch.testing.assert_close(got, C.reference(q, *as_shared, None, 0.125), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[1:], C.reference(q, k, v, None, 0.125)[1:], atol=1e-3)
    # past the columns there are: all of them, from row 0
    torch.testing.assert_close(C.attention(q, k, v, None, 0.125, shared=99),
                               C.reference(q, k[:1].expand_as(k), v[:1].expand_as(v), None, 0.125), rtol=1e-5,
                               atol=1e-5)


def test_what_it_does_not_take():
    q, k, v = _operands(2, 4, 2, 8, 64, torch.float32)
    mask = torch.ones(2, 1, 1, 8, dtype=torch.bool)
    assert C.supports(q, k, v, mask) and C.supports(q, k, v, None)
    refused = [(q.half(), k.half(), v.half(), mask),  # fp16: no native fp16 arithmetic on most CPUs
               (torch.cat([q, q], 2), k, v, mask),  # two new tokens per row (a prefill): SDPA's
               (q, k.bfloat16(), v, mask),  # mixed dtypes
               (q[..., :40], k[..., :40], v[..., :40], mask),  # a head size not a multiple of 16
               (q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v, mask),  # strided head dimension
               (q, k, v, mask.float()), (q, k, v, mask[:, :, :, :4]),  # an additive or short mask
               (q[:, :3], k, v, mask)]  # 3 query heads over 2 KV heads
    for operands in refused:
        assert not C.supports(*operands)
        assert C.attention(*operands, 0.125) is None
    with torch.enable_grad():
        assert not C.supports(q.requires_grad_(), k, v, mask)  # autograd needs SDPA's backward


def test_without_a_compiler_it_warns_once_and_answers_none(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    monkeypatch.setenv("GRPO_NB_CACHE", str(tmp_path))
    monkeypatch.setattr(C, "_function", None)
    q, k, v = _operands(2, 4, 2, 8, 64, torch.float32)
    with pytest.warns(RuntimeWarning, match="C attention for CPU decode steps is not used .*could not build cpu_at"):
        assert C.attention(q, k, v, None, 0.125) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        assert C.attention(q, k, v, None, 0.125) is None
    monkeypatch.setattr(C, "_function", None)
    monkeypatch.setattr(C, "_self_test", lambda fn: False)  # built, but computing other numbers
    monkeypatch.delenv("CC")
    with pytest.warns(RuntimeWarning, match="differ from the PyTorch reference"):
        assert not C.available()


def test_a_damaged_library_is_built_again_and_numeric_settings_do_not_fail_the_check(monkeypatch, tmp_path):
    """A library file cut short or replaced (its digest no longer the one its build recorded) would crash the process
    that loads it: it is built again. The check's reference ignores a lower fp32 matmul precision or CPU autocast,
    which would make it, not the kernel, wrong."""
    monkeypatch.setenv("GRPO_NB_CACHE", str(tmp_path))
    monkeypatch.setattr(C, "_function", None)
    assert C.available()
    (library,) = (tmp_path / "kernels").glob("cpu_attention-*.so")
    cut = tmp_path / "cut.so"  # a new file in its place (this process maps the old one: not written in place)
    cut.write_bytes(library.read_bytes()[:3000])
    cut.replace(library)
    monkeypatch.setattr(C, "_function", None)
    precision = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
            warnings.simplefilter("error")
            assert C.available()
    finally:
        torch.set_float32_matmul_precision(precision)
    assert library.stat().st_size > 3000 and native.digest(library) == library.with_suffix(".sha256").read_text()


def test_odd_operands_are_refused_not_handed_to_c():
    from torch._subclasses.fake_tensor import FakeTensorMode

    zero = torch.randn(2, 4, 1, 0), torch.randn(2, 2, 20, 0), torch.randn(2, 2, 20, 0)
    assert C.attention(*zero, None, 0.125) is None  # a head of size 0
    assert C.attention(torch.randn(2, 4, 1, 16), torch.randn(2, 0, 5, 16), torch.randn(2, 0, 5, 16), None) is None
    with FakeTensorMode():  # says "cpu", holds no memory
        fake = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
        assert C.attention(*fake, None, 0.125) is None
    q, k, v = _operands(2, 4, 2, 8, 64, torch.float32)
    torch.testing.assert_close(C.attention(q, k, v, None), C.reference(q, k, v, None, 64**-0.5))  # SDPA's scale


def test_the_engine_samples_the_same_with_it_and_with_sdpa(tok, monkeypatch):
    """Prompts that begin alike (their prefix prefilled once and shared by every row: read once by the kernel),
    3 generations each, rows dropped as they finish: the same tokens and log-probs as with torch's SDPA."""
    model = tiny_model("llama", seed=6)
    text = " ".join(f"w{i}" for i in range(5, 30))
    ids, mask = tok([text + " w40 w41", text + " w50", text + " w60 w61 w62"], return_tensors="pt",
                    padding=True).values()
    runs, used = {}, []
    real = C.attention
    monkeypatch.setattr(C, "attention", lambda *a, **kw: used.append(a[-1] if len(a) > 5 else kw.get("shared"))
                        or real(*a, **kw))
    for on in (True, False):
        monkeypatch.setattr(C, "ENABLED", on)
        engine = RolloutEngine(max_completion_length=12, seed=7, _compact_fraction=0.01)
        runs[on] = engine(model, tok, ids, mask, 3), engine.last_stats
    (kernel, stats), (sdpa, _) = runs[True], runs[False]
    assert stats["forward"] == "lean" and stats["shared_prefix"] >= 20, stats
    assert used and set(used) == {stats["shared_prefix"]}  # every decode step told the shared columns
    assert torch.equal(kernel.completion_ids, sdpa.completion_ids)
    torch.testing.assert_close(kernel.sampling_logprobs, sdpa.sampling_logprobs, rtol=1e-4, atol=1e-4)
    # one prompt, its generations: the prompt's whole width is the same in every row
    used.clear()
    engine = RolloutEngine(max_completion_length=6, seed=7)
    engine(model, tok, ids[2:], mask[2:], 3)
    assert set(used) == {ids.shape[1]}, used


def test_a_library_the_loader_refuses_is_built_again(tmp_path):
    """A cached library whose digest matches but which the loader refuses (a cache folder copied from elsewhere, a
    file and its digest both replaced) is deleted and built once more, not refused in every process after."""
    source = tmp_path / "answer.c"
    source.write_text("int answer(void) { return 42; }\n")
    args = (source, tmp_path / "built", native.compiler("CC", ("cc", "gcc", "clang")),
            [["-O1", "-fPIC", "-shared", "-x", "c"]])
    path = native.build(*args)
    junk = tmp_path / "junk"
    junk.write_bytes(b"not a shared library " * 64)
    junk.replace(path)
    path.with_suffix(".sha256").write_text(native.digest(path))  # consistent: the digest check passes it
    assert native.load(*args).answer() == 42
    assert native.digest(path) == path.with_suffix(".sha256").read_text() and path.stat().st_size > 21 * 64
