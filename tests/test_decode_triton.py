"""The GPU decode step's kernels (grpo_nb/kernels/decode_triton.py) against their PyTorch references, and the static
decode step through them (`LeanForward.static_step`) against the model's own forward.

Without a GPU the kernels run on Triton's CPU interpreter (TRITON_INTERPRET=1), where numpy has no bf16: fp32 and
fp16 here, bf16 by the CUDA self-test and by the references' static step (bitwise the model's).
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' import (triton.jit reads it)
pytest.importorskip("triton", reason="the kernels are Triton (run interpreted on the CPU; installed with torch on Linux)")

from grpo_nb.kernels import decode_glue  # noqa: E402
from grpo_nb.kernels import decode_triton as K  # noqa: E402
from grpo_nb.kernels import sample_triton  # noqa: E402
from grpo_nb.rollout import encode_prompts, lean_forward, static_cache  # noqa: E402
from grpo_nb.rollout.engine import RolloutEngine  # noqa: E402

if not CUDA and not K.interpreted():
    pytest.skip("grpo_nb.kernels was imported before TRITON_INTERPRET=1 was set; run this file on its own",
                allow_module_level=True)

DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
ULP = {torch.float32: 2e-6, torch.float16: 2**-10, torch.bfloat16: 2**-7}


def _rand(*shape, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols,wider", [(1, 8, 0), (5, 100, 0), (3, 576, 16)])
@pytest.mark.parametrize("weight_fp32", [False, True], ids=["weight-like-h", "fp32-weight"])
def test_residual_norm_adds_in_place_and_normalises_as_the_module(dtype, rows, cols, wider, weight_fp32):
    h = _rand(rows, cols + wider, dtype=dtype, scale=3)[:, :cols]  # wider: rows with a stride of their own
    delta = _rand(rows, cols, dtype=dtype, seed=1)
    w = (1 + _rand(cols, dtype=torch.float32, seed=2) / 4).to(torch.float32 if weight_fp32 else dtype)
    ref_h = h.clone()
    for d in (delta, None):
        out, ref = K.residual_norm(h, d, w, 1e-6), K.residual_norm_reference(ref_h, d, w, 1e-6)
        assert out.dtype == ref.dtype and out.shape == ref.shape
        assert torch.equal(h, ref_h)  # the residual sum: one rounding, as torch's add
        tol = ULP[dtype] * 2  # the sum of squares in another order: rstd's last bits
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def _branches(n, widths, dtype, scalings):
    """Adapters' branches as `lean_forward._b_products` hands them: views of one product's wider rows."""
    wide = _rand(n, sum(widths) + 3, dtype=dtype, seed=9).split([*widths, 3], dim=1)
    return list(zip(wide, scalings))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,heads,kv_heads,d", [(1, 4, 2, 8), (3, 3, 1, 6), (2, 2, 2, 128)])
@pytest.mark.parametrize("branches", [False, True], ids=["", "adds"])
def test_rope_write_rotates_and_writes_the_cache_column_as_transformers(dtype, n, heads, kv_heads, d, branches):
    q, k, v = (_rand(n, h * d, dtype=dtype, seed=s, scale=2) for s, h in ((0, heads), (1, kv_heads), (2, kv_heads)))
    angles = _rand(n, d // 2, dtype=torch.float32, seed=3, scale=3)
    cos, sin = (torch.cat([t, t], -1).to(dtype) for t in (angles.cos(), angles.sin()))
    L, column = 7, torch.tensor([4], device=DEVICE)
    caches = [_rand(n, kv_heads, L, d, dtype=dtype, seed=s) for s in (4, 5)]
    copies = [c.clone() for c in caches]
    adds = _branches(n, (heads * d, kv_heads * d, kv_heads * d), dtype, (0.5, 2.0, 1.5)) if branches else None
    out = K.rope_write(q, k, v, cos, sin, *caches, column, adds)
    ref = K.rope_write_reference(q, k, v, cos, sin, *copies, column, adds)
    assert out.shape == (n, heads, 1, d) and out.is_contiguous()
    # every product and sum rounded where torch's ops round: the same values
    assert torch.equal(out, ref)
    assert torch.equal(caches[0], copies[0]) and torch.equal(caches[1], copies[1])
    untouched = [c for c in range(L) if c != 4]
    assert torch.equal(caches[1][:, :, untouched], _rand(n, kv_heads, L, d, dtype=dtype, seed=5)[:, :, untouched])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 37), (4, 1500)])  # 1500: more than one block of a row
@pytest.mark.parametrize("branches", [False, True], ids=["", "adds"])
def test_silu_mul_is_the_mlps_two_ops(dtype, rows, cols, branches):
    gate, up = _rand(rows, cols, dtype=dtype, scale=4), _rand(rows, cols, dtype=dtype, seed=1)
    adds = _branches(rows, (cols, cols), dtype, (2.0, 0.75)) if branches else None
    out, ref = K.silu_mul(gate, up, adds), K.silu_mul_reference(gate, up, adds)
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 * ULP[dtype], atol=2 * ULP[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,heads,kv_heads,d,L,column", [(2, 4, 2, 8, 40, 30), (3, 12, 2, 128, 300, 299),
                                                         (1, 3, 3, 6, 5, 0), (4, 6, 1, 64, 100, 57),
                                                         (20, 4, 4, 16, 700, 650)])  # 3 blocks a split
def test_decode_attention_reads_the_written_columns_only_and_matches_sdpa(dtype, n, heads, kv_heads, d, L, column):
    q = _rand(n, heads, 1, d, dtype=dtype)
    keys, values = _rand(n, kv_heads, L, d, dtype=dtype, seed=1), _rand(n, kv_heads, L, d, dtype=dtype, seed=2)
    mask = torch.zeros(n, 1, 1, L, dtype=dtype, device=DEVICE)
    low = torch.finfo(dtype).min
    mask[..., column + 1:] = low
    mask[0, ..., :2] = low  # a row's left padding
    mask[..., column] = 0  # the new token sees itself
    expected = K.decode_attention_reference(*(t.float() for t in (q, keys, values, mask)), None, d ** -0.5)
    keys[:, :, column + 1:] = values[:, :, column + 1:] = float("nan")  # never read: no NaN comes out
    splits = K.attention_splits(n, kv_heads, L)
    assert splits >= (2 if L >= 64 else 1)
    if L == 700:  # the softmax carried across blocks within a split, not only across splits
        assert -(-L // splits) > 2 * K.ATTENTION_BLOCK
    out = K.decode_attention(q, keys, values, mask, torch.tensor([column], device=DEVICE), d ** -0.5)
    assert out.shape == (n, 1, heads, d) and out.dtype == dtype
    tol = decode_glue.ATTENTION_TOLERANCE[dtype] / 4
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)


def test_decode_attention_takes_a_mask_of_minus_infinity():
    """A mask may hide with -inf (transformers' own masks use the dtype's minimum; both hide): a split whose first
    block is all hidden must not turn the row into NaN."""
    n, heads, kv_heads, d, L = 2, 4, 2, 16, 200
    q = _rand(n, heads, 1, d, dtype=torch.float32)
    keys, values = _rand(n, kv_heads, L, d, dtype=torch.float32, seed=1), _rand(n, kv_heads, L, d, dtype=torch.float32,
                                                                                seed=2)
    mask = torch.zeros(n, 1, 1, L, device=DEVICE)
    mask[0, ..., :150] = float("-inf")
    out = K.decode_attention(q, keys, values, mask, torch.tensor([L - 1], device=DEVICE), d ** -0.5)
    torch.testing.assert_close(out, K.decode_attention_reference(q, keys, values, mask, None, d ** -0.5),
                               rtol=1e-5, atol=1e-5)


def test_the_self_test_trusts_the_kernels_and_refuses_a_wrong_one(monkeypatch):
    from tiny_models import tiny_model

    model = tiny_model("llama").to(DEVICE)
    decode_glue._VERDICTS.clear()
    assert decode_glue._passes_self_test(K, model, torch.device(DEVICE))

    class Wrong:  # the keys' column one to the left
        def __getattr__(self, name):
            return getattr(K, name)

        @staticmethod
        def rope_write(q, k, v, cos, sin, keys, values, column):
            return K.rope_write(q, k, v, cos, sin, keys, values, column - 1)

    class LateColumn:  # attention that misses the column written this step
        def __getattr__(self, name):
            return getattr(K, name)

        @staticmethod
        def decode_attention(q, keys, values, mask, column, scaling, priced_columns=None):
            return K.decode_attention(q, keys, values, mask, column - 1, scaling)

    class OneBlock:  # attention that forgets to rescale what earlier blocks of a split summed
        def __getattr__(self, name):
            return getattr(K, name)

        @staticmethod
        def decode_attention(q, keys, values, mask, column, scaling, priced_columns=None):
            out = K.decode_attention(q, keys, values, mask, column, scaling)
            if keys.shape[2] > 1000:  # (where a split reads more than one block: a wrong result there only)
                out = out * 1.01
            return out

    for wrong in (Wrong(), LateColumn(), OneBlock()):
        decode_glue._VERDICTS.clear()
        with pytest.warns(RuntimeWarning, match="decode-step kernels failed its self-test"):
            assert not decode_glue._passes_self_test(wrong, model, torch.device(DEVICE))
    decode_glue._VERDICTS.clear()


PROMPTS = ["w5 w6 w7 w9 w10 w11", "w8", "w12 w13 w14"]


def _compared_steps(monkeypatch, model, glue, steps=6):
    """Each static decode step twice on the same state - the model's forward, then `static_step` with `glue` -:
    the largest difference of the logits and of each layer's cache written, relative to their scale."""
    from grpo_nb.models import prepare_tokenizer
    from tiny_models import tiny_tokenizer

    monkeypatch.setattr(lean_forward, "LEAN_STATIC_ON_CPU", True)
    monkeypatch.setattr(decode_glue, "glue", lambda model, device: glue)
    forward, seen = static_cache.StaticDecoder._forward, []

    def both(self):
        assert self.lean is not None, "the static step did not take the lean forward"
        state = [t.clone() for t in self.keys + self.values + [self.mask]]
        lean = forward(self).clone()  # (every step's logits land in one buffer)
        written = [t.clone() for t in self.keys + self.values]
        for t, s in zip(self.keys + self.values + [self.mask], state):
            t.copy_(s)
        self.lean, kept = None, self.lean
        own = forward(self)
        self.lean = kept
        seen.append(((lean - own).abs().max() / own.abs().max()).item())
        seen.append(max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(written, self.keys + self.values)))
        return own

    monkeypatch.setattr(static_cache.StaticDecoder, "_forward", both)
    tok = prepare_tokenizer(tiny_tokenizer())
    ids, mask, _ = encode_prompts(tok, PROMPTS, None, "cpu")
    RolloutEngine(decode="static", max_completion_length=steps, seed=1)(model, tok, ids.to(DEVICE),
                                                                        mask.to(DEVICE), 2)
    assert len(seen) == 2 * (steps - 1)
    return max(seen)


@pytest.mark.skipif(CUDA, reason="the references' step on the CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("arch,attn", [("llama", "eager"), ("qwen2", "sdpa"), ("llama", "sdpa")])
def test_the_static_step_with_the_references_is_the_models_forward_bit_for_bit(monkeypatch, arch, attn, dtype):
    from tiny_models import tiny_model

    model = tiny_model(arch, seed=3, attn_implementation=attn).to(dtype)
    assert _compared_steps(monkeypatch, model, decode_glue._references()) == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_static_step_with_the_kernels_is_the_models_forward(monkeypatch, arch, dtype):
    """Adapted layers (grpo-nb's LoRA over each projection) included: on the CPU they multiply by their merged
    copies, as the modules do; a 16-bit GPU's branches: the next test."""
    from tiny_models import adapted_tiny_model

    model = adapted_tiny_model(arch, torch.Generator().manual_seed(0)).to(DEVICE, dtype)
    # fp32 ~1e-6; 16-bit: a unit in the last place of a norm's output, carried through two layers
    assert _compared_steps(monkeypatch, model, K) < {torch.float32: 1e-5}.get(dtype, 8e-3)


@pytest.mark.parametrize("dtype,kernels", [(torch.float16, "references"), (torch.bfloat16, "references"),
                                           (torch.float16, "kernels")])
def test_stacked_adapters_add_the_branches_as_the_modules_do(monkeypatch, dtype, kernels):
    """A 16-bit model's adapters without merged copies (a GPU's rollout): each group's x @ A.T and its B as one
    product each (`lean_forward._branches`), each branch added into its base output by the next kernel."""
    from grpo_nb import lora
    from tiny_models import adapted_tiny_model

    monkeypatch.setattr(lora, "MERGE_ON_CPU", False)
    stacked = []
    original = lean_forward._branches
    monkeypatch.setattr(lean_forward, "_branches", lambda *a: stacked.append(original(*a)) or stacked[-1])
    model = adapted_tiny_model("qwen2", torch.Generator().manual_seed(0)).to(dtype)
    for name, param in model.named_parameters():
        if "lora_" in name:  # fp32 masters, as grpo-nb trains them over a 16-bit base
            param.data = param.data.float()
    # the same products but in wider GEMMs (another order of sums), and each branch rounded to the dtype before
    # its add, as peft's 4-bit layers round it (lora_add's addmm_ rounds once): bf16's 8 bits show it, through two
    # layers; a branch added twice or not at all is off by ~2
    glue = decode_glue._references() if kernels == "references" else K
    assert _compared_steps(monkeypatch, model, glue) < {torch.float16: 8e-3}.get(dtype, 5e-2)
    assert stacked and all(s is not None and s[1].dtype == dtype for s in stacked)
    assert [s[1].shape[0] for s in stacked[:2]] == [3 * 4, 2 * 4]  # rank 4: q / k / v, then gate / up
    # B: q / k / v of two widths (grouped heads) block-diagonal, gate / up of one shape stacked for a batched product
    assert [(tuple(s[2][0].shape), s[2][1]) for s in stacked[:2]] == [((64 + 2 * 32, 12), True), ((2 * 128, 4), False)]


def test_a_failing_static_step_hands_the_rollout_to_the_models_forward(monkeypatch):
    """A kernel that fails at run time (a shape its self-test did not compile) warns once, and the rollout goes on
    through the model's forward with the same tokens."""
    from grpo_nb.models import prepare_tokenizer
    from tiny_models import tiny_model, tiny_tokenizer

    class Failing:
        def __getattr__(self, name):
            return getattr(K, name)

        @staticmethod
        def rope_write(*args):
            raise RuntimeError("out of resources: shared memory")

    tok = prepare_tokenizer(tiny_tokenizer())
    ids, mask, _ = encode_prompts(tok, PROMPTS, None, "cpu")
    model = tiny_model("llama", seed=3)
    engine = RolloutEngine(decode="static", max_completion_length=6, greedy=True)
    expected = engine(model, tok, ids, mask, 2)
    monkeypatch.setattr(lean_forward, "LEAN_STATIC_ON_CPU", True)
    monkeypatch.setattr(decode_glue, "glue", lambda model, device: Failing())
    with pytest.warns(RuntimeWarning, match="decode step failed .*out of resources.*model's own forward"):
        got = engine(model, tok, ids, mask, 2)
    assert torch.equal(got.completion_ids, expected.completion_ids)


def test_bf16_on_the_cpu_takes_the_references(monkeypatch):
    """numpy (Triton's interpreter) has no bf16: a bf16 model's static step on the CPU runs the references."""
    from tiny_models import tiny_model

    assert decode_glue.glue(tiny_model("llama").to(torch.bfloat16), "cpu").rope_write is K.rope_write_reference
    if not CUDA:  # (this file runs the kernels interpreted there)
        assert decode_glue.glue(tiny_model("llama").to(torch.float16), "cpu") is K


def test_the_static_step_is_left_to_the_model_where_it_does_not_reproduce_it(monkeypatch):
    from tiny_models import tiny_model

    model = tiny_model("llama")
    assert lean_forward.static_lean(model, "cpu") is None  # the CPU: only where asked
    monkeypatch.setattr(lean_forward, "LEAN_STATIC_ON_CPU", True)
    assert lean_forward.static_lean(model, "cpu") is not None
    model.model.layers[0].mlp.forward = lambda x: x  # a forward set on an instance by someone else
    assert lean_forward.static_lean(model, "cpu") is None
    monkeypatch.setattr(lean_forward, "LEAN_STATIC", False)
    assert lean_forward.static_lean(tiny_model("llama"), "cpu") is None


def test_a_simulated_gpu_decode_step_runs_the_glue_kernels():
    """What the simulation prices for a GPU's decode step: per layer two residual norms, one rotation with the
    cache's write and one SiLU product, none of the modules' small ops; the same products as the modules' step."""
    from tiny_models import tiny_config

    from grpo_nb.simulate import simulate_step

    def decode_ops(lean):
        lean_forward.LEAN_STATIC = lean
        try:
            step = simulate_step(tiny_config("qwen2"), max_prompt_length=16, max_completion_length=8,
                                 num_generations=4, dtype="fp16", gpu="T4", gradient_checkpointing=True,
                                 load_in_4bit=True)
            trace = step.record_ops()
        finally:
            lean_forward.LEAN_STATIC = True
        unit = trace.decode_units()[1][0]
        return [op for op in trace.ops if op.stage == "decode" and op.unit == unit]

    step, modules = decode_ops(True), [op.name for op in decode_ops(False) if op.in_model]
    ours = [op.name for op in step if op.in_model]
    # around the model call: the sampling and the step's own writes are a graph's (priced so), the host launching
    # only the step's inputs and the uniforms
    graphed = {op.name for op in step if op.graphed and not op.in_model}
    assert {"sample_chunk_totals", "sample_pick", "index_copy_"} <= graphed  # (`sample_triton`: the draw)
    assert not {"_softmax", "_log_softmax", "cumsum", "searchsorted", "div"} & graphed
    assert {op.name for op in step if not (op.graphed or op.in_model)} <= {"copy_", "fill_", "add", "rand", "sum"}
    layers = tiny_config("qwen2").num_hidden_layers
    count = {name: ours.count(name) for name in set(ours)}
    assert (count["residual_norm"], count["rope_write"], count["silu_mul"], count["decode_attention"],
            count["decode_attention_combine"]) == (2 * layers + 1, layers, layers, layers, layers)
    assert not {"index_copy_", "neg", "silu", "rms_norm", "add"} & set(ours)
    assert not any("scaled_dot_product" in name for name in ours)
    assert ours.count("cat") == 1  # the rotary embedding's cos / sin, once a step
    assert ours.count("gemm_4bit") == modules.count("gemm_4bit") > 0
    # the adapters: x @ A.T one product for q / k / v and one for gate / up, and so their B (`lean_forward._branches`:
    # q / k / v block-diagonal, an mm; gate / up a bmm), added by rope_write / silu_mul; o and down as the modules
    assert (modules.count("mm"), modules.count("addmm_")) == (7 * layers + 1, 7 * layers)  # (+ the head)
    assert (ours.count("mm"), ours.count("addmm_")) == (5 * layers + 1, 2 * layers)
    assert ours.count("bmm") == modules.count("bmm") + layers  # (transformers 5.17's rotary embedding has one)
    assert len(modules) - len(ours) >= 15 * layers  # ~43 kernels a layer -> ~26 (QLoRA: 21 are products)


def test_strided_operands_are_read_as_their_values_and_a_strided_cache_is_refused():
    n, heads, kv_heads, d, L = 2, 4, 2, 8, 6
    q = _rand(heads * d, n, dtype=torch.float32).t()  # a transposed view: stride 1 along the rows
    k, v = (_rand(kv_heads * d, n, dtype=torch.float32, seed=s).t() for s in (1, 2))
    cos, sin = torch.ones(n, d, device=DEVICE), torch.zeros(n, d, device=DEVICE)
    caches = [torch.zeros(n, kv_heads, L, d, device=DEVICE) for _ in range(2)]
    column = torch.tensor([3], device=DEVICE)
    out = K.rope_write(q, k, v, cos, sin, *caches, column)  # cos 1, sin 0: the values as they are
    assert torch.equal(out, q.reshape(n, heads, 1, d)) and torch.equal(caches[1][:, :, 3].reshape(n, -1), v)
    gate = _rand(37, 3, dtype=torch.float32).t()
    assert torch.allclose(K.silu_mul(gate, gate), K.silu_mul_reference(gate, gate), rtol=1e-5, atol=1e-6)
    strided = torch.zeros(n, kv_heads, d, L, device=DEVICE).transpose(2, 3)
    with pytest.raises(ValueError, match="head_dim must be contiguous"):
        K.rope_write(q, k, v, cos, sin, strided, caches[1], column)
    with pytest.raises(ValueError, match="rows must be contiguous"):
        K.residual_norm(gate, None, torch.ones(37, device=DEVICE), 1e-6)


# -- the sampling after each step (grpo_nb/kernels/sample_triton.py) ---------------------------------------------

def _logits(rows, vocab, dtype, seed=0):
    """Logits with -inf among them and rows whose probability sits in one token of a late chunk."""
    x = _rand(rows, vocab, dtype=torch.float32, seed=seed, scale=3)
    x[0, : vocab // 3] = float("-inf")
    if rows > 2:
        x[2, vocab - 2] = 25.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("vocab", [37, 2048, 3 * sample_triton.CHUNK + 5])
@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_the_sampling_kernels_draw_the_engines_tokens_with_their_log_probs(dtype, vocab, temperature):
    logits = _logits(5, vocab, dtype)
    for seed in range(3):
        uniforms = torch.rand(5, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
        if seed == 0:
            uniforms[:2] = torch.tensor([0.0, 1 - 2**-24])  # the ends of [0, 1)
        tokens, logp = sample_triton.sample(logits, temperature, uniforms)
        ref_tokens, ref_logp = sample_triton.sample_reference(logits.float(), temperature, uniforms)
        assert tokens.dtype == torch.long and torch.equal(tokens, ref_tokens)
        torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(logp).all() and (logits[0, tokens[0]] > float("-inf"))  # never a token of probability 0


def test_the_sampling_kernels_at_the_edges():
    """A uniform in the gap where the chunks' totals and the running sum inside a chunk round apart (it drew the
    chunk's last token, of probability ~1e-40: found by a probe), a NaN logit and a row of -inf (a NaN log-prob,
    as the engine's ops give - the trainer skips such a step), strided uniforms, one uniform too few."""
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        x = torch.randn(4096, generator=g) * 2
    x[2046:2048] = -80.0
    u = torch.tensor([0.49752676486968994])  # just past the first chunk's share
    token, logp = sample_triton.sample(x[None].to(DEVICE), 1.0, u.to(DEVICE))
    assert token.item() == sample_triton.sample_reference(x[None], 1.0, u)[0].item() == 2045 and logp.item() > -9
    y = _rand(2, 5000, dtype=torch.float32)
    y[0, 10], y[1] = float("nan"), float("-inf")
    token, logp = sample_triton.sample(y, 1.0, torch.tensor([0.3, 0.5], device=DEVICE))
    assert torch.isnan(logp).all() and token[1].item() == 4999
    z = _rand(3, 3000, dtype=torch.float32, seed=1)
    strided = torch.tensor([0.1, 0.9, 0.2, 0.9, 0.3, 0.9], device=DEVICE)[::2]
    assert torch.equal(sample_triton.sample(z, 1.0, strided)[0], sample_triton.sample_reference(z, 1.0, strided)[0])
    with pytest.raises(ValueError, match="one per row"):
        sample_triton.sample(z, 1.0, strided[:2])


def test_the_sampling_kernels_draw_from_the_softmax():
    """Over many uniforms, each token is drawn in proportion to its probability (a chunked sum that dropped or
    doubled a chunk, or a search off by one token, moves whole tokens' shares)."""
    vocab = 2 * sample_triton.CHUNK + 3
    logits = torch.full((1, vocab), float("-inf"), device=DEVICE)
    picks = torch.tensor([5, sample_triton.CHUNK - 1, sample_triton.CHUNK, vocab - 1])
    logits[0, picks] = torch.tensor([0.0, 1.0, -0.5, 0.5], device=DEVICE)
    grid = (torch.arange(400, device=DEVICE, dtype=torch.float32) + 0.5) / 400
    drawn = torch.stack([sample_triton.sample(logits, 1.0, u.reshape(1))[0][0] for u in grid])
    shares = torch.tensor([(drawn == p).float().mean().item() for p in picks])
    torch.testing.assert_close(shares, logits[0, picks].softmax(-1).cpu(), atol=1 / 400 + 1e-6, rtol=0)


def test_the_sampling_self_test_refuses_a_wrong_kernel(monkeypatch):
    assert decode_glue._sampler_passes_self_test(sample_triton, torch.device(DEVICE))
    if not CUDA:  # the CPU runs them only under the interpreter, and only where a test asks
        assert decode_glue.sampler("cpu") is None
        monkeypatch.setattr(decode_glue, "SAMPLER_ON_CPU", True)
        assert decode_glue.sampler("cpu") is sample_triton.sample
        monkeypatch.setattr(sample_triton, "interpreted", lambda: False)
        assert decode_glue.sampler("cpu") is None

    class OffByOne:
        CHUNK = sample_triton.CHUNK
        sample_reference = staticmethod(sample_triton.sample_reference)

        @staticmethod
        def sample(logits, temperature, uniforms):
            tokens, logp = sample_triton.sample(logits, temperature, uniforms)
            return tokens.clamp(max=logits.shape[1] - 2) + (uniforms > 0.6), logp

    class Untempered(OffByOne):
        @staticmethod
        def sample(logits, temperature, uniforms):
            return sample_triton.sample(logits, 1.0, uniforms)

    for wrong in (OffByOne, Untempered):
        decode_glue._VERDICTS.clear()
        with pytest.warns(RuntimeWarning, match="sampling kernels failed its self-test"):
            assert not decode_glue._sampler_passes_self_test(wrong, torch.device(DEVICE))
    decode_glue._VERDICTS.clear()


@pytest.mark.parametrize("decode", ["static", "dynamic"])
def test_the_engine_samples_through_the_kernels_where_nothing_changes_the_scores(monkeypatch, decode):
    """The same completions and log-probs as the engine's own ops, seeded; with a processor (top-p, a repetition
    penalty, min_new_tokens) or greedy, the engine's ops."""
    from grpo_nb.models import prepare_tokenizer
    from tiny_models import tiny_model, tiny_tokenizer

    tok = prepare_tokenizer(tiny_tokenizer())
    ids, mask, _ = encode_prompts(tok, PROMPTS, None, "cpu")
    model = tiny_model("qwen2", seed=3)
    calls = []

    def counted(*args):
        calls.append(1)
        return sample_triton.sample(*args)

    def run(fused, **settings):
        monkeypatch.setattr(decode_glue, "sampler", lambda device: counted if fused else None)
        calls.clear()
        out = RolloutEngine(decode=decode, max_completion_length=7, seed=4, **settings)(model, tok, ids, mask, 2)
        return out, len(calls)

    (ours, n), (theirs, _) = run(True, temperature=0.8), run(False, temperature=0.8)
    assert n > 0 and torch.equal(ours.completion_ids, theirs.completion_ids)
    torch.testing.assert_close(ours.sampling_logprobs, theirs.sampling_logprobs, rtol=1e-5, atol=1e-5)
    for settings in (dict(top_p=0.9), dict(repetition_penalty=1.3), dict(min_new_tokens=7), dict(greedy=True)):
        (ours, n), (theirs, _) = run(True, **settings), run(False, **settings)
        assert n == 0 and torch.equal(ours.completion_ids, theirs.completion_ids), settings
