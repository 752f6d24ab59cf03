"""RolloutEngine (grpo_nb/rollout/engine.py) against HF generate and HF's logits processors.

Oracles: `model.generate` (greedy parity, repetition penalty, min_new_tokens, EOS), HF's
TopK/TopP/MinP warpers and RepetitionPenaltyLogitsProcessor (filters), and
`completion_logprobs` (returned sampling log-probs).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import grpo_nb.rollout.engine as engine_mod
from grpo_nb.rollout.engine import RolloutEngine, apply_repetition_penalty, filter_logits, sample_from_logits
from grpo_nb.logprobs import completion_logprobs
from grpo_nb.models import prepare_tokenizer
from grpo_nb.rollout import completion_mask_from_eos, encode_prompts, eos_token_ids

try:
    from tests.tiny_models import MODEL_CASES, MODEL_IDS, tiny_model, tiny_tokenizer
except ImportError:  # tests/ itself on sys.path (plain `pytest`)
    from tiny_models import MODEL_CASES, MODEL_IDS, tiny_model, tiny_tokenizer

NEG_INF = float("-inf")
MAX_NEW = 8
# Ragged on purpose: left padding of 0, 4, 2 and 3 positions.
PROMPTS = ["w5 w6 w7 w8 w9", "w10", "w11 w12 w13", "w40 w41"]
# Same length, no padding (for the repetition penalty, see there).
EVEN_PROMPTS = ["w5 w6 w5 w7", "w9 w10 w9 w9", "w20 w21 w22 w20"]


def _hf_ignores_per_row() -> bool:
    """Whether transformers' repetition penalty (the oracle here) takes a prompt_ignore_length per row (newer than
    transformers 5.17, which the GPU machines carry, where it takes one int)."""
    try:
        RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=torch.zeros(2, dtype=torch.long))
    except ValueError:
        return False
    return True


HF_IGNORES_PER_ROW = _hf_ignores_per_row()
needs_per_row_oracle = pytest.mark.skipif(not HF_IGNORES_PER_ROW, reason="this transformers' repetition penalty "
                                          "takes one prompt_ignore_length, not one per row (the oracle)")


@pytest.fixture(scope="module")
def tok():
    return prepare_tokenizer(tiny_tokenizer())


def encode(tok, prompts):
    ids, mask, _ = encode_prompts(tok, prompts, None, "cpu")
    return ids, mask


@torch.no_grad()
def hf_generate(model, tok, ids, mask, G, max_new=MAX_NEW, **kw):
    """HF generate on every prompt x generation; (ids, mask, truncated) as the engine returns them."""
    eos = eos_token_ids(model, tok)
    ids, mask = ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0)
    was_training = model.training
    model.eval()
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, eos_token_id=eos,
                             pad_token_id=tok.pad_token_id, use_cache=True, **kw)
    finally:
        model.train(was_training)
    comp = out[:, ids.shape[1]:]
    cmask, truncated = completion_mask_from_eos(comp, eos)
    return comp, cmask, truncated


def assert_same_completions(out, ref_ids, ref_mask, ref_truncated, pad):
    assert out.completion_mask.shape == ref_mask.shape, (out.completion_mask.shape, ref_mask.shape)
    assert torch.equal(out.completion_mask, ref_mask)
    m = ref_mask.bool()
    assert torch.equal(out.completion_ids[m], ref_ids[m]), (out.completion_ids, ref_ids)
    assert (out.completion_ids[~m] == pad).all()  # right padding
    assert torch.equal(out.truncated, ref_truncated)


def add_early_eos(model, tok, ids, mask, n_extra=2, max_new=MAX_NEW):
    """Make greedy rows end at different steps: add tokens the greedy path emits as extra EOS ids.

    Picks, one by one from HF's greedy output, the token that spreads the rows' end steps the
    most while leaving at least one row truncated. Sets them on model.generation_config (a list).
    """
    comp, _, _ = hf_generate(model, tok, ids, mask, 1, max_new=max_new)

    def ends(tokens):
        hit = torch.isin(comp, torch.tensor(sorted(tokens)))
        return [int(h.nonzero()[0, 0]) if h.any() else None for h in hit]

    chosen = []
    for _ in range(n_extra):
        candidates = sorted(set(comp.flatten().tolist()) - set(chosen) - {tok.eos_token_id})
        scored = [(len(set(e)), t) for t in candidates if None in (e := ends(chosen + [t]))]
        if scored:
            chosen.append(max(scored)[1])
    eos = [tok.eos_token_id, *chosen]
    model.generation_config.eos_token_id = eos
    return eos


def add_sampled_eos(model, tok, ids, mask, n_extra=3, **sample_kw):
    """As add_early_eos for sampling: the tokens a differently seeded sampling run emits most often."""
    model.generation_config.eos_token_id = [tok.eos_token_id]
    comp = _sample(model, tok, ids, mask, seed=999, **sample_kw).completion_ids
    counts = torch.bincount(comp.flatten(), minlength=model.config.vocab_size)
    counts[[tok.eos_token_id, tok.pad_token_id]] = 0
    eos = [tok.eos_token_id, *counts.topk(n_extra).indices.tolist()]
    model.generation_config.eos_token_id = eos
    return eos


class CompactionSpy:
    """Counts select_cache_rows calls, so a test knows compaction really ran (or did not)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = engine_mod.select_cache_rows

        def spy(cache, indices):
            self.calls += 1
            return real(cache, indices)

        monkeypatch.setattr(engine_mod, "select_cache_rows", spy)


def lora_model(arch, tied, seed=3):
    from peft import LoraConfig, get_peft_model

    base = tiny_model(arch, tied=tied, seed=seed)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # lora_B starts at zero (a no-op adapter): make it change the outputs
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    model.eval()
    return model


# --------------------------------------------------------------------------------------
# 1. Greedy parity with HF generate


@pytest.mark.parametrize("G", [1, 3])
@pytest.mark.parametrize("compact", [None, 0.01], ids=["no-compact", "compact"])
@pytest.mark.parametrize("share", [True, False], ids=["shared", "unshared"])
@pytest.mark.parametrize("arch,tied", MODEL_CASES, ids=MODEL_IDS)
def test_greedy_equals_generate(tok, arch, tied, share, compact, G, monkeypatch):
    model = tiny_model(arch, tied=tied, seed=3)
    ids, mask = encode(tok, PROMPTS)
    add_early_eos(model, tok, ids, mask)
    ref = hf_generate(model, tok, ids, mask, G)
    assert ref[2].any() and not ref[2].all()  # some rows end early, some run to the limit
    spy = CompactionSpy(monkeypatch)
    eng = RolloutEngine(max_completion_length=MAX_NEW, greedy=True, share_prompt_prefix=share, _compact_fraction=compact)
    out = eng(model, tok, ids, mask, G)
    assert_same_completions(out, *ref, pad=tok.pad_token_id)
    assert torch.equal(out.prompt_ids, ids.repeat_interleave(G, 0))
    assert torch.equal(out.prompt_mask, mask.repeat_interleave(G, 0))
    assert eng.last_stats["prefill_rows"] == (len(PROMPTS) if share else len(PROMPTS) * G)
    assert (spy.calls > 0) == (compact is not None)


@pytest.mark.parametrize("max_rows", [1, 2, 5])
def test_rows_in_pieces_equal_one_batch(tok, max_rows):
    """max_rows: the KV cache holds that many rows at a time; greedy completions are the same."""
    model = tiny_model("llama", tied=True, seed=3)
    ids, mask = encode(tok, PROMPTS)
    add_early_eos(model, tok, ids, mask)
    whole = RolloutEngine(max_completion_length=MAX_NEW, greedy=True)(model, tok, ids, mask, 3)
    eng = RolloutEngine(max_completion_length=MAX_NEW, greedy=True, max_rows=max_rows)
    pieces = eng(model, tok, ids, mask, 3)
    assert eng.last_stats["rows"] <= max_rows  # the last piece
    width = whole.completion_ids.shape[1]
    assert pieces.completion_ids.shape[1] == width
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated"):
        assert torch.equal(getattr(pieces, name), getattr(whole, name)), name
    torch.testing.assert_close(pieces.sampling_logprobs, whole.sampling_logprobs)
    with pytest.raises(ValueError, match="max_rows=0 is invalid"):
        RolloutEngine(max_completion_length=4, max_rows=0)


@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("share,compact", [(True, 0.01), (False, None)], ids=["shared-compact", "plain"])
@pytest.mark.parametrize("arch,tied", MODEL_CASES, ids=MODEL_IDS)
def test_greedy_with_lora_equals_generate(tok, arch, tied, share, compact, G, monkeypatch):
    model = lora_model(arch, tied)
    ids, mask = encode(tok, PROMPTS)
    add_early_eos(model, tok, ids, mask)
    ref = hf_generate(model, tok, ids, mask, G)
    with model.disable_adapter():
        base_ids, base_mask, _ = hf_generate(model, tok, ids, mask, G)
    # The adapter matters, so matching `ref` below is evidence the engine runs it.
    assert base_ids.shape != ref[0].shape or not torch.equal(base_ids * base_mask, ref[0] * ref[1])
    spy = CompactionSpy(monkeypatch)
    out = RolloutEngine(max_completion_length=MAX_NEW, greedy=True, share_prompt_prefix=share,
                        _compact_fraction=compact)(model, tok, ids, mask, G)
    assert_same_completions(out, *ref, pad=tok.pad_token_id)
    assert ref[2].any() and not ref[2].all()
    assert (spy.calls > 0) == (compact is not None)


# --------------------------------------------------------------------------------------
# The embedded default model (SmolLM2-135M-Instruct)


@pytest.fixture(scope="module")
def default_model():
    from grpo_nb import setup_reasoning_model

    return setup_reasoning_model(max_seq_length=256)


def test_default_model_greedy_equals_generate(default_model, monkeypatch):
    model, tok = default_model
    chats = [[{"role": "user", "content": "What is 2+3?"}],
             [{"role": "user", "content": "Name a color."}],
             [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Say hi in French."}]]
    ids, mask, _ = encode_prompts(tok, chats, None, "cpu")
    assert not mask.all()  # ragged chat prompts: left padding is exercised
    model.train()  # as setup_reasoning_model returns it (gradient checkpointing on)
    ref = hf_generate(model, tok, ids, mask, 2, max_new=16)
    spy = CompactionSpy(monkeypatch)
    out = RolloutEngine(max_completion_length=16, greedy=True, _compact_fraction=0.01)(model, tok, ids, mask, 2)
    assert_same_completions(out, *ref, pad=tok.pad_token_id)
    assert model.training
    assert ref[2].any() and not ref[2].all() and spy.calls > 0  # one answer ends early: compaction ran


# --------------------------------------------------------------------------------------
# 2. Repetition penalty and min_new_tokens


@pytest.mark.parametrize("share,compact", [(True, 0.01), (False, None)], ids=["shared-compact", "plain"])
@pytest.mark.parametrize("arch,tied", MODEL_CASES, ids=MODEL_IDS)
def test_greedy_repetition_penalty_equals_generate(tok, arch, tied, share, compact):
    # Unpadded prompts: HF's processor counts pad tokens in input_ids as seen, the engine counts
    # real prompt tokens only, so they agree exactly only without left padding.
    model = tiny_model(arch, tied=tied, seed=3)
    ids, mask = encode(tok, EVEN_PROMPTS)
    # End each prompt with the tokens the model says next, so penalising prompt tokens matters.
    comp, _, _ = hf_generate(model, tok, ids, mask, 1, max_new=3)
    ids, mask = torch.cat([ids, comp], 1), torch.ones(len(ids), ids.shape[1] + 3, dtype=torch.long)
    add_early_eos(model, tok, ids, mask)
    ref = hf_generate(model, tok, ids, mask, 2, repetition_penalty=1.3)
    plain = hf_generate(model, tok, ids, mask, 2)
    assert plain[0].shape != ref[0].shape or not torch.equal(plain[0] * plain[1], ref[0] * ref[1])
    # ... and the prompt's share of the penalty matters too.
    from transformers import LogitsProcessorList

    gen_only = RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=ids.shape[1])
    ref_gen_only = hf_generate(model, tok, ids, mask, 2, logits_processor=LogitsProcessorList([gen_only]))
    assert ref_gen_only[0].shape != ref[0].shape or not torch.equal(ref_gen_only[0] * ref_gen_only[1], ref[0] * ref[1])
    out = RolloutEngine(max_completion_length=MAX_NEW, greedy=True, repetition_penalty=1.3, share_prompt_prefix=share,
                        _compact_fraction=compact)(model, tok, ids, mask, 2)
    assert_same_completions(out, *ref, pad=tok.pad_token_id)


@needs_per_row_oracle
def test_repetition_penalty_ignores_left_padding(tok):
    # With left padding the engine equals HF's processor told to skip each row's leading pads.
    model = tiny_model("llama", tied=False, seed=3)
    ids, mask = encode(tok, PROMPTS)
    n_pads = (mask == 0).sum(1).repeat_interleave(2)
    proc = RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=n_pads)
    from transformers import LogitsProcessorList

    ref = hf_generate(model, tok, ids, mask, 2, logits_processor=LogitsProcessorList([proc]))
    plain = hf_generate(model, tok, ids, mask, 2)
    assert not torch.equal(plain[0] * plain[1], ref[0] * ref[1])
    out = RolloutEngine(max_completion_length=MAX_NEW, greedy=True, repetition_penalty=1.3)(model, tok, ids, mask, 2)
    assert_same_completions(out, *ref, pad=tok.pad_token_id)


@pytest.mark.parametrize("via", ["generation_kwargs", "argument"])
@pytest.mark.parametrize("compact", [None, 0.01], ids=["no-compact", "compact"])
@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True)], ids=["llama-untied", "qwen2-tied"])
def test_min_new_tokens_equals_generate(tok, arch, tied, compact, via):
    model = tiny_model(arch, tied=tied, seed=3)
    ids, mask = encode(tok, PROMPTS)
    add_early_eos(model, tok, ids, mask)
    k = 5
    plain = hf_generate(model, tok, ids, mask, 2)
    first_eos = plain[1].sum(1)
    assert ((first_eos < k) & ~plain[2]).any()  # some row would stop before k: the option matters
    ref = hf_generate(model, tok, ids, mask, 2, min_new_tokens=k)
    assert (ref[1].sum(1) >= k).all()
    kwargs = {"generation_kwargs": {"min_new_tokens": k}} if via == "generation_kwargs" else {"min_new_tokens": k}
    out = RolloutEngine(max_completion_length=MAX_NEW, greedy=True, _compact_fraction=compact, **kwargs)(
        model, tok, ids, mask, 2)
    assert_same_completions(out, *ref, pad=tok.pad_token_id)


# --------------------------------------------------------------------------------------
# 3. Seeded sampling


def _sample(model, tok, ids, mask, G=4, seed=123, **kw):
    args = dict(max_completion_length=MAX_NEW, temperature=1.0, top_k=50, top_p=0.95, seed=seed)
    return RolloutEngine(**{**args, **kw})(model, tok, ids, mask, G)


@pytest.fixture(scope="module")
def sampling_setup(tok):
    model = tiny_model("qwen2", tied=False, seed=5)
    ids, mask = encode(tok, PROMPTS)
    # Extra EOS ids that sampling emits often: rows end at different steps, so compaction runs.
    eos = add_sampled_eos(model, tok, ids, mask, n_extra=16)
    return model, ids, mask, eos


def _same(a, b):
    return (a.completion_ids.shape == b.completion_ids.shape and torch.equal(a.completion_ids, b.completion_ids)
            and torch.equal(a.completion_mask, b.completion_mask))


def test_same_seed_same_samples_across_fresh_engines(tok, sampling_setup):
    model, ids, mask, _ = sampling_setup
    a, b = _sample(model, tok, ids, mask), _sample(model, tok, ids, mask)
    assert _same(a, b)
    torch.testing.assert_close(a.sampling_logprobs, b.sampling_logprobs, rtol=0, atol=0)
    # Each row gets its own draws: a group is not G copies of one sample.
    rows = a.completion_ids.view(len(PROMPTS), 4, -1)
    assert any(len({tuple(r.tolist()) for r in grp}) > 1 for grp in rows)


def test_different_seed_or_second_call_gives_different_samples(tok, sampling_setup):
    model, ids, mask, _ = sampling_setup
    a = _sample(model, tok, ids, mask, seed=123)
    assert not _same(a, _sample(model, tok, ids, mask, seed=124))
    eng = RolloutEngine(max_completion_length=MAX_NEW, temperature=1.0, top_k=50, top_p=0.95, seed=123)
    first, second = eng(model, tok, ids, mask, 4), eng(model, tok, ids, mask, 4)
    assert _same(first, a)
    assert not _same(first, second)  # the generator advances between calls


def test_samples_do_not_depend_on_prefix_sharing_or_compaction(tok, sampling_setup, monkeypatch):
    model, ids, mask, _ = sampling_setup
    spy = CompactionSpy(monkeypatch)
    ref = _sample(model, tok, ids, mask, share_prompt_prefix=True, _compact_fraction=None)
    assert spy.calls == 0 and ref.truncated.any() and not ref.truncated.all()
    for share, compact in [(False, None), (True, 0.01), (False, 0.01), (True, 0.5)]:
        out = _sample(model, tok, ids, mask, share_prompt_prefix=share, _compact_fraction=compact)
        assert _same(out, ref), (share, compact)
        torch.testing.assert_close(out.sampling_logprobs, ref.sampling_logprobs, rtol=1e-5, atol=1e-5)
    assert spy.calls > 0  # compaction did run in the variants above


SAMPLING_CASES = [
    dict(temperature=0.5, top_k=30, top_p=0.8, min_p=0.05, repetition_penalty=1.2, min_new_tokens=2),
    dict(temperature=1.5, top_p=0.6),
    dict(temperature=0.8, min_p=0.2, top_k=10),
]


@pytest.mark.parametrize("kw", SAMPLING_CASES, ids=["all", "top_p", "min_p"])
def test_samples_follow_hf_processors_with_the_engine_uniforms(tok, sampling_setup, kw):
    # Pins the documented scheme: step t draws torch.rand(N) from a generator seeded with `seed`,
    # row i takes the first token whose CDF exceeds u[i] * total. Rebuild every step's
    # distribution with HF's own processors on teacher-forced logits and replay the draws.
    model, ids, mask, eos = sampling_setup
    G, seed = 3, 7
    out = RolloutEngine(max_completion_length=MAX_NEW, seed=seed, **kw)(model, tok, ids, mask, G)
    pids, pmask, comp, cmask = out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask
    assert not cmask.all()
    n, tp = pids.shape
    full_mask = torch.cat([pmask, cmask], 1)
    with torch.no_grad():
        logits = model(input_ids=torch.cat([pids, comp], 1), attention_mask=full_mask,
                       position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0)).logits.float()
    procs = []
    if kw.get("repetition_penalty"):
        if not HF_IGNORES_PER_ROW:
            pytest.skip("this transformers' repetition penalty takes one prompt_ignore_length (the oracle)")
        procs.append(RepetitionPenaltyLogitsProcessor(kw["repetition_penalty"],
                                                      prompt_ignore_length=(pmask == 0).sum(1)))
    if kw.get("min_new_tokens"):
        procs.append(MinNewTokensLengthLogitsProcessor(tp, kw["min_new_tokens"], eos))
    procs.append(TemperatureLogitsWarper(kw["temperature"]))
    procs += [TopKLogitsWarper(kw["top_k"])] if kw.get("top_k") else []
    procs += [TopPLogitsWarper(kw["top_p"])] if kw.get("top_p") else []
    procs += [MinPLogitsWarper(kw["min_p"])] if kw.get("min_p") else []
    g = torch.Generator().manual_seed(seed)
    for t in range(comp.shape[1]):
        u = torch.rand(n, generator=g)
        scores = logits[:, tp - 1 + t]
        input_ids = torch.cat([pids, comp[:, :t]], 1)
        for proc in procs:
            scores = proc(input_ids, scores)
        cdf = scores.softmax(-1).cumsum(-1)
        expected = (cdf <= (u * cdf[:, -1])[:, None]).sum(-1)  # first index with cdf > u * total
        live = cmask[:, t].bool()
        assert torch.equal(comp[live, t], expected[live]), t
    if kw.get("min_new_tokens"):
        assert (cmask.sum(1) >= kw["min_new_tokens"]).all()


def test_first_token_frequencies_match_hf_processors(tok):
    # Scheme-agnostic: over 4000 rows of one prompt, first-token frequencies equal the
    # probabilities after HF's temperature / top_k / top_p warpers.
    model = tiny_model("llama", tied=False, seed=1, initializer_range=0.3)
    ids, mask = encode(tok, ["w5 w6 w7"])
    kw = dict(temperature=0.7, top_k=20, top_p=0.9)
    n = 4000
    out = RolloutEngine(max_completion_length=1, seed=0, **kw)(model, tok, ids, mask, n)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, -1].float()
    scores = hf_filter(TemperatureLogitsWarper(0.7)(ids, logits), top_k=20, top_p=0.9)
    probs = scores.softmax(-1)[0]
    assert probs.max() < 0.9 and int((probs > 0.02).sum()) >= 3  # a spread to compare with
    freq = torch.bincount(out.completion_ids[:, 0], minlength=probs.numel()).float() / n
    torch.testing.assert_close(freq, probs, rtol=0, atol=0.025)
    assert (freq[probs == 0] == 0).all()


# --------------------------------------------------------------------------------------
# 4. Sampling filters and the sampler on hand-built distributions


def hf_filter(logits, top_k=None, top_p=None, min_p=None):
    # Order of transformers' GenerationMixin._get_logits_processor (5.23, checked in its
    # source and by test_hf_warper_order): temperature, top_k, top_p, min_p.
    if top_k:
        logits = TopKLogitsWarper(top_k=top_k)(None, logits)
    if top_p is not None and top_p < 1.0:
        logits = TopPLogitsWarper(top_p=top_p)(None, logits)
    if min_p:
        logits = MinPLogitsWarper(min_p=min_p)(None, logits)
    return logits


def kept(logits):
    return torch.isfinite(logits)


def test_hf_warper_order():
    from transformers import GenerationConfig

    model = tiny_model("llama", seed=0)
    cfg = GenerationConfig(do_sample=True, temperature=0.7, top_k=5, top_p=0.9, min_p=0.1)
    try:
        procs = model._get_logits_processor(generation_config=cfg, input_ids_seq_length=4, device="cpu")
    except TypeError as e:  # private API; the order is also stated in hf_filter's comment
        pytest.skip(f"_get_logits_processor signature changed: {e}")
    names = [type(p).__name__ for p in procs]
    assert names == ["TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper"]


FILTER_CASES = [
    dict(top_k=1), dict(top_k=5), dict(top_k=63), dict(top_k=64), dict(top_k=1000),
    dict(top_p=1e-6), dict(top_p=0.3), dict(top_p=0.9), dict(top_p=0.999), dict(top_p=1.0),
    dict(min_p=0.05), dict(min_p=0.3), dict(min_p=0.999), dict(min_p=1.0),
    dict(top_k=10, top_p=0.8), dict(top_k=10, min_p=0.1), dict(top_p=0.9, min_p=0.2),
    dict(top_k=20, top_p=0.7, min_p=0.05), dict(top_k=3, top_p=1e-6, min_p=0.9),
]


@pytest.mark.parametrize("kw", FILTER_CASES, ids=[str(c) for c in FILTER_CASES])
@pytest.mark.parametrize("scale", [0.5, 3.0])
def test_filter_logits_keeps_the_same_tokens_as_hf(kw, scale):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 64, generator=g) * scale  # continuous: no ties
    ours, ref = filter_logits(logits.clone(), **kw), hf_filter(logits.clone(), **kw)
    assert torch.equal(kept(ours), kept(ref))
    assert torch.equal(ours[kept(ours)], logits[kept(ours)])  # survivors are untouched
    assert kept(ours).any(1).all() and kept(ours).gather(1, logits.argmax(1, keepdim=True)).all()


@pytest.mark.parametrize("kw", [dict(top_k=3), dict(top_k=1), dict(min_p=0.5), dict(min_p=1.0),
                                dict(top_k=4, min_p=0.3)], ids=str)
def test_filter_logits_ties_like_hf(kw):
    # Integer logits: many exact ties. top_k and min_p keep every token tied with the cut.
    g = torch.Generator().manual_seed(1)
    logits = torch.randint(0, 4, (32, 12), generator=g).float()
    assert torch.equal(kept(filter_logits(logits.clone(), **kw)), kept(hf_filter(logits.clone(), **kw)))
    assert kept(filter_logits(torch.zeros(1, 6), top_k=2)).all()  # all tied with the 2nd: all kept


@pytest.mark.parametrize("top_p", [1e-6, 0.3, 0.5, 0.7, 0.9])
def test_top_p_with_ties_keeps_as_many_tokens_and_the_same_probabilities_as_hf(top_p):
    # Which of several tied tokens survives the top_p cut is a sort-order detail; the number
    # kept and the kept probability values must match HF.
    g = torch.Generator().manual_seed(2)
    logits = torch.randint(0, 3, (64, 10), generator=g).float()
    ours, ref = kept(filter_logits(logits.clone(), top_p=top_p)), kept(hf_filter(logits.clone(), top_p=top_p))
    assert torch.equal(ours.sum(1), ref.sum(1))
    for i in range(len(logits)):
        assert sorted(logits[i][ours[i]].tolist()) == sorted(logits[i][ref[i]].tolist())


@pytest.mark.parametrize("top_p,n_kept", [(0.25, 1), (0.5, 2), (0.75, 3), (0.7, 3), (0.8, 4)])
def test_top_p_exact_mass_boundary(top_p, n_kept):
    # Uniform over 4 tokens: the masses are exact in float, so top_p hits a boundary exactly;
    # the smallest set whose mass reaches top_p is kept (ties: HF keeps as many).
    logits = torch.zeros(1, 4)
    assert int(kept(filter_logits(logits.clone(), top_p=top_p)).sum()) == n_kept
    assert int(kept(hf_filter(logits.clone(), top_p=top_p)).sum()) == n_kept


def test_top_p_with_ties_keeps_the_same_token_ids_as_hf():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]).log_softmax(-1)
    for top_p in (1e-6, 0.3):
        ours, ref = kept(filter_logits(logits.clone(), top_p=top_p)), kept(hf_filter(logits.clone(), top_p=top_p))
        assert torch.equal(ours, ref), (top_p, ours.int().tolist(), ref.int().tolist())


# probs [0.5, 0.25, 0.15, 0.1] placed at token ids [2, 0, 3, 1]: sorting must map back.
HAND_PROBS = torch.tensor([[0.25, 0.1, 0.5, 0.15]])
HAND_CASES = [
    (dict(top_k=1), {2}), (dict(top_k=2), {2, 0}), (dict(top_k=3), {2, 0, 3}), (dict(top_k=4), {0, 1, 2, 3}),
    (dict(top_p=0.4), {2}), (dict(top_p=0.55), {2, 0}), (dict(top_p=0.6), {2, 0}), (dict(top_p=0.8), {2, 0, 3}),
    (dict(top_p=0.95), {0, 1, 2, 3}),
    (dict(min_p=0.1), {0, 1, 2, 3}), (dict(min_p=0.25), {2, 0, 3}), (dict(min_p=0.4), {2, 0}), (dict(min_p=0.6), {2}),
    # top_p renormalises after top_k: [0.5, 0.25, 0.15] / 0.9 -> the 2nd token starts at mass 0.556.
    (dict(top_k=3, top_p=0.55), {2}), (dict(top_k=3, top_p=0.6), {2, 0}),
    # min_p after top_p: [0.5, 0.25] / 0.75 -> 0.25 is half the max.
    (dict(top_p=0.6, min_p=0.45), {2, 0}), (dict(top_p=0.6, min_p=0.55), {2}),
]


@pytest.mark.parametrize("kw,expected", HAND_CASES, ids=[str(c[0]) for c in HAND_CASES])
def test_filter_logits_hand_computed(kw, expected):
    logits = HAND_PROBS.log()
    got = set(kept(filter_logits(logits.clone(), **kw))[0].nonzero().flatten().tolist())
    assert got == expected
    assert set(kept(hf_filter(logits.clone(), **kw))[0].nonzero().flatten().tolist()) == expected


@pytest.mark.parametrize("penalty", [1.3, 0.7, 1.0])
def test_repetition_penalty_equals_hf(penalty):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=g) * 2  # both signs
    input_ids = torch.randint(0, 40, (6, 15), generator=g)  # with repeats
    seen = torch.zeros(6, 40, dtype=torch.bool).scatter_(1, input_ids, True)
    ref = RepetitionPenaltyLogitsProcessor(penalty)(input_ids, logits.clone())
    ours = apply_repetition_penalty(logits.clone(), seen, penalty)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    if penalty != 1.0:
        assert not torch.equal(ours, logits)


def _filtered_logits(rows=8, vocab=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 2
    drop = torch.rand(rows, vocab, generator=g) < 0.5
    drop[:, 0] = True  # first and last ids filtered: the edges of the CDF
    drop[:, -1] = True
    drop[torch.arange(rows), torch.randint(1, vocab - 1, (rows,), generator=g)] = False
    return logits.masked_fill(drop, NEG_INF)


def test_sample_from_logits_never_returns_a_filtered_token():
    logits = _filtered_logits()
    below_one = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)).item()  # torch.rand's largest value
    edge = [0.0, 1e-12, 1e-7, 0.5, 1 - 1e-7, below_one]
    for u in [torch.full((len(logits),), v) for v in edge] + list(torch.rand(300, len(logits)).unbind(0)):
        tokens = sample_from_logits(logits, u)
        assert torch.isfinite(logits.gather(1, tokens[:, None])).all(), u
    first_allowed = kept(logits).float().argmax(1)
    assert torch.equal(sample_from_logits(logits, torch.zeros(len(logits))), first_allowed)
    last_allowed = logits.shape[1] - 1 - kept(logits).flip(1).float().argmax(1)
    assert torch.equal(sample_from_logits(logits, torch.full((len(logits),), below_one)), last_allowed)


def test_sample_from_logits_frequencies_match_softmax():
    logits = torch.tensor([1.0, NEG_INF, 0.0, -1.0, 2.0, NEG_INF, 0.5, -0.5])
    n = 20_000
    u = torch.rand(n, generator=torch.Generator().manual_seed(0))
    tokens = sample_from_logits(logits.expand(n, -1), u)
    freq = torch.bincount(tokens, minlength=len(logits)).float() / n
    torch.testing.assert_close(freq, logits.softmax(-1), rtol=0, atol=0.02)
    assert freq[1] == 0 and freq[5] == 0


# --------------------------------------------------------------------------------------
# 5. EOS handling


@pytest.mark.parametrize("pad_is_eos", [False, True], ids=["own-pad", "pad-is-eos"])
@pytest.mark.parametrize("compact", [None, 0.01], ids=["no-compact", "compact"])
def test_eos_rows_end_at_different_steps(compact, pad_is_eos):
    tok = prepare_tokenizer(tiny_tokenizer())
    if pad_is_eos:  # as prepare_tokenizer does for tokenizers without a pad token
        tok.pad_token = tok.eos_token
    model = tiny_model("llama", tied=True, seed=3)
    ids, mask = encode(tok, PROMPTS)
    # Two extra EOS ids via the generation config (a list): rows stop at either.
    eos = add_early_eos(model, tok, ids, mask)
    assert len(eos) == 3 and eos_token_ids(model, tok) == sorted(eos)
    out = RolloutEngine(max_completion_length=MAX_NEW, greedy=True, _compact_fraction=compact)(model, tok, ids, mask, 2)
    ref = hf_generate(model, tok, ids, mask, 2)
    assert_same_completions(out, *ref, pad=tok.pad_token_id)

    ends = []
    for row, m, trunc in zip(out.completion_ids, out.completion_mask, out.truncated):
        hits = torch.isin(row, torch.tensor(eos)).nonzero().flatten()
        if trunc:
            assert len(hits) == 0 and m.all() and len(row) == MAX_NEW
            ends.append(MAX_NEW)
        else:
            e = hits[0].item()
            assert m[: e + 1].all() and not m[e + 1 :].any()
            assert (row[e + 1 :] == tok.pad_token_id).all()
            ends.append(e + 1)
    assert out.completion_ids.shape[1] == max(ends)
    assert len(set(ends)) >= 2 and out.truncated.any() and not out.truncated.all()
    # Finished rows end on an EOS id, some on the generation config's extra ones.
    enders = {row[m.sum() - 1].item() for row, m, t in zip(out.completion_ids, out.completion_mask, out.truncated)
              if not t}
    assert enders <= set(eos) and enders & set(eos[1:])


def test_eos_on_the_last_allowed_step_is_not_truncation(tok):
    model = tiny_model("qwen2", tied=False, seed=3)
    ids, mask = encode(tok, PROMPTS)
    add_early_eos(model, tok, ids, mask)
    full = RolloutEngine(max_completion_length=MAX_NEW, greedy=True)(model, tok, ids, mask, 1)
    lengths = full.completion_mask.sum(1)
    row = int(torch.where(full.truncated, 0, lengths).argmax())  # the row whose EOS comes last
    limit = int(lengths[row])
    assert not full.truncated[row] and limit > 1
    out = RolloutEngine(max_completion_length=limit, greedy=True)(model, tok, ids, mask, 1)
    assert out.completion_ids.shape[1] == limit and out.completion_mask[row].all()
    assert not out.truncated[row]  # its EOS is the last token it was allowed
    assert torch.equal(out.truncated, ~torch.isin(out.completion_ids, torch.tensor(eos_token_ids(model, tok))).any(1))
    assert out.truncated.any()  # rows still running at the limit are truncated


def test_width_is_the_longest_row_when_all_rows_end_early(tok):
    model = tiny_model("qwen2", tied=False, seed=3)
    ids, mask = encode(tok, PROMPTS)
    comp, _, _ = hf_generate(model, tok, ids, mask, 1)
    # Every row's token at step 1 and 2 ends it: widths 2 or 3, never the 8 allowed.
    model.generation_config.eos_token_id = sorted(set(comp[:, 1].tolist()) | set(comp[:, 2].tolist()))
    out = RolloutEngine(max_completion_length=MAX_NEW, greedy=True)(model, tok, ids, mask, 2)
    ref = hf_generate(model, tok, ids, mask, 2)
    assert_same_completions(out, *ref, pad=tok.pad_token_id)
    assert not out.truncated.any()
    assert out.completion_ids.shape[1] == int(out.completion_mask.sum(1).max()) <= 3


# --------------------------------------------------------------------------------------
# 6. Returned sampling log-probs


@pytest.mark.parametrize("arch,tied", MODEL_CASES, ids=MODEL_IDS)
def test_sampling_logprobs_equal_a_fresh_forward(tok, arch, tied):
    model = lora_model(arch, tied, seed=4)
    ids, mask = encode(tok, PROMPTS)
    sampling = dict(temperature=0.7, top_k=20, top_p=0.9)
    add_sampled_eos(model, tok, ids, mask, n_extra=2, G=3, **sampling)
    model.train()
    out = RolloutEngine(max_completion_length=MAX_NEW, seed=0, _compact_fraction=0.01, **sampling)(
        model, tok, ids, mask, 3)
    assert model.training
    cm = out.completion_mask.bool()
    assert not cm.all() and out.truncated.any()  # ragged rows
    model.eval()
    with torch.no_grad():
        ref = completion_logprobs(model, out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask,
                                  temperature=0.7, backend="torch")
    torch.testing.assert_close(out.sampling_logprobs[cm], ref[cm], rtol=1e-4, atol=1e-4)
    assert (out.sampling_logprobs[~cm] == 0).all()
    assert (out.sampling_logprobs[cm] < 0).all()  # unfiltered: even the top token has prob < 1


@pytest.mark.parametrize("exact", [False, True], ids=["branch-in-model-dtype", "exact_adapters"])
def test_bf16_rollout_lora_branch(tok, exact):
    """A 16-bit model's rollout runs the LoRA branch in the model's dtype: its log-probs then differ from the
    training forward's by that rounding only. With exact_adapters (what train() sets when the engine's log-probs
    become the old policy's, num_iterations > 1) they equal the training forward's."""
    from peft import LoraConfig, get_peft_model

    from grpo_nb import GRPOConfig, lora
    from grpo_nb.rollout import make_rollout

    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    lora.register(config)
    model = get_peft_model(tiny_model("llama", seed=4).to(torch.bfloat16), config)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    ids, mask = encode(tok, PROMPTS)
    out = RolloutEngine(max_completion_length=MAX_NEW, min_new_tokens=MAX_NEW, seed=0, exact_adapters=exact)(
        model, tok, ids, mask, 2)
    with torch.no_grad():
        forward = completion_logprobs(model, out.prompt_ids, out.prompt_mask, out.completion_ids,
                                      out.completion_mask, backend="torch")
    gap = (out.sampling_logprobs - forward).abs()
    if exact:
        assert gap.max() <= 1e-6
    else:
        assert 0 < gap.max() <= 0.1 and gap.mean() <= 0.02
    settings = dict(num_generations=2, per_device_train_batch_size=2, max_completion_length=4)
    assert not make_rollout("native", model, tok, GRPOConfig(**settings)).exact_adapters
    assert make_rollout("native", model, tok, GRPOConfig(num_iterations=2, **settings)).exact_adapters
    assert not make_rollout("native", model, tok, GRPOConfig(
        num_iterations=2, rollout_importance_sampling_correction=True, **settings)).exact_adapters
    assert make_rollout("native", model, tok, GRPOConfig(**settings)).cpu_dtype is None
    assert make_rollout("native", model, tok, GRPOConfig(
        cpu_rollout_dtype="bfloat16", rollout_importance_sampling_correction=True, **settings)).cpu_dtype == torch.bfloat16


# --------------------------------------------------------------------------------------
# 7. Input validation and 8. training mode


def test_unsupported_generation_kwargs_are_named():
    with pytest.raises(ValueError, match=r"num_beams.*no_repeat_ngram_size|no_repeat_ngram_size.*num_beams"):
        RolloutEngine(max_completion_length=4, generation_kwargs={"num_beams": 2, "no_repeat_ngram_size": 3,
                                                                  "min_new_tokens": 1})
    RolloutEngine(max_completion_length=4, generation_kwargs={"min_new_tokens": 1})  # the supported one


@pytest.mark.parametrize("temperature", [0, 0.0, -0.5, None])
def test_non_positive_temperature_raises(temperature):
    with pytest.raises(ValueError, match="temperature"):
        RolloutEngine(max_completion_length=4, temperature=temperature)


@pytest.mark.parametrize("greedy", [True, False])
def test_training_mode_is_restored(tok, greedy):
    model = lora_model("llama", False)
    ids, mask = encode(tok, PROMPTS[:2])
    eng = RolloutEngine(max_completion_length=3, greedy=greedy, seed=0)
    model.train()
    eng(model, tok, ids, mask, 2)
    assert model.training and all(m.training for m in model.modules())
    model.eval()
    eng(model, tok, ids, mask, 2)
    assert not model.training and not any(m.training for m in model.modules())


def test_training_mode_is_restored_after_an_error(tok, monkeypatch):
    model = tiny_model("llama", seed=0)
    ids, mask = encode(tok, PROMPTS[:2])
    eng = RolloutEngine(max_completion_length=3, greedy=True)
    def boom(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(eng, "_generate", boom)
    model.train()
    with pytest.raises(RuntimeError, match="boom"):
        eng(model, tok, ids, mask, 2)
    assert model.training


def test_cuda_graph_decoding_on_the_cpu_is_refused_with_tools_too(tok):
    """Probe P44 F8: decode='cuda_graph' on the CPU was refused at a rollout without tools and ignored in episodes
    (start_episodes then decoded with the dynamic cache whatever `decode` said): the same setting, checked the same
    way in both."""
    model = tiny_model("llama", seed=0)
    ids, mask = encode(tok, PROMPTS[:2])
    eng = RolloutEngine(max_completion_length=3, greedy=True, decode="cuda_graph")
    for rollout in (eng, eng.start_episodes):
        with pytest.raises(ValueError, match="decode='cuda_graph' needs a CUDA device"):
            rollout(model, tok, ids, mask, 2)
    eng = RolloutEngine(max_completion_length=3, greedy=True, decode="static")  # the fix it names: episodes run
    assert eng.start_episodes(model, tok, ids, mask, 2)[0].completion_ids.shape[0] == 4


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("room", ["grows", "hands over"])
def test_episodes_on_the_static_cache_equal_the_dynamic_one(tok, room, greedy, monkeypatch):
    """An episode's later turns on the static cache (CUDA's decode: one graph replays every turn's steps) - rows
    that ended early within a turn, results of different lengths, episodes that ended - sample what the dynamic
    cache samples. The turns outgrow the first turn's columns: the cache grows, or, with no room on the device for
    a larger one, goes on as a dynamic cache."""
    import grpo_nb.rollout.static_cache as static_cache

    model = tiny_model("llama", seed=0)
    ids, mask = encode(tok, PROMPTS[:2])
    if greedy:
        add_early_eos(model, tok, ids, mask, n_extra=3)
    else:  # a quarter of the vocabulary ends a turn: sampled rows end at different steps
        model.generation_config.eos_token_id = [tok.eos_token_id, *range(3, model.config.vocab_size, 4)]
    turns = {}
    for decode in ("dynamic", "static"):
        eng = RolloutEngine(max_completion_length=MAX_NEW, greedy=greedy, seed=5, decode=decode)
        first, state = eng.start_episodes(model, tok, ids, mask, 2)
        got = [first]
        if decode == "static":
            assert state.static is not None and state.static.mask.shape[-1] == ids.shape[1] + MAX_NEW
            assert len(set(first.completion_mask.sum(-1).tolist())) > 1  # rows that ended before others
            if room == "hands over":
                monkeypatch.setattr(static_cache, "free_device_memory", lambda device: 0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got.append(eng.continue_episodes(model, tok, state, [0, 1, 3], [[5, 6, 7], [], [8, 9, 10, 11, 12]],
                                             MAX_NEW))
            got.append(eng.continue_episodes(model, tok, state, [0, 2], [[13], [14, 15]], MAX_NEW))
        handed_over = [w for w in caught if "go on with a dynamic KV cache" in str(w.message)]
        if decode == "static" and room == "hands over":
            assert len(handed_over) == 1 and state.static is None
        elif decode == "static":
            assert not handed_over and eng.last_stats["decode"] == "static"
            assert state.static.mask.shape[-1] > ids.shape[1] + MAX_NEW  # grown
        state.release()
        turns[decode] = got
    for dynamic, static in zip(turns["dynamic"], turns["static"]):
        assert torch.equal(dynamic.completion_ids, static.completion_ids)
        assert torch.equal(dynamic.completion_mask, static.completion_mask)
        torch.testing.assert_close(dynamic.sampling_logprobs, static.sampling_logprobs, atol=1e-5, rtol=0)


def test_an_episode_turn_never_replays_a_graph_an_earlier_call_captured(tok, monkeypatch):
    """Probe Y F1: a CUDA graph captured in one engine call reads that call's 16-bit adapter copies
    (lora.rollout_branch), freed when it returns; the episodes' later turns replayed the first turn's graph over
    freed memory. Each call now captures its own. A stand-in graph (the CPU has none) checks every replay runs
    inside the call that captured it."""
    from grpo_nb import lora
    import grpo_nb.rollout.static_cache as static_cache

    replays = []

    class Graph:
        def __init__(self, decoder):
            self.decoder, self.copies = decoder, lora._rollout_copies

        def replay(self):
            replays.append(lora._rollout_copies is self.copies)
            self.decoder.graph_logits.copy_(self.decoder._forward())

    def capture(decoder):
        decoder.use_graph = False
        decoder.graph, decoder.graph_logits = Graph(decoder), decoder._forward()
        return decoder.graph_logits

    monkeypatch.setattr(static_cache.StaticDecoder, "_capture", capture)
    model = tiny_model("llama", seed=0)
    ids, mask = encode(tok, PROMPTS[:2])
    eng = RolloutEngine(max_completion_length=MAX_NEW, greedy=True, decode="static")
    monkeypatch.setattr(eng, "_resolve_decode", lambda device: "cuda_graph")  # as on CUDA
    _, state = eng.start_episodes(model, tok, ids, mask, 2, room=64)  # room for every turn: the cache never grows
    after_first = len(replays)
    for _ in range(2):
        eng.continue_episodes(model, tok, state, [0, 1, 2, 3], [[5], [6, 7], [], [8]], MAX_NEW)
        assert eng.last_stats["decode"] == "cuda_graph"
    assert state.static.mask.shape[-1] == ids.shape[1] + 64
    state.release()
    assert 0 < after_first < len(replays) and all(replays), replays


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_continue_episodes_refuses_what_it_cannot_go_on_with(tok, decode, monkeypatch):
    """Probe Y F2-F4: rows and appended lists that do not pair up, repeated rows, no rows, a released state, and a
    state an error left mid-turn (its cache holds part of that turn) are refused before anything changes."""
    import grpo_nb.rollout.static_cache as static_cache

    model = tiny_model("llama", seed=0)
    ids, mask = encode(tok, PROMPTS[:2])
    eng = RolloutEngine(max_completion_length=MAX_NEW, greedy=True, decode=decode)
    _, state = eng.start_episodes(model, tok, ids, mask, 2)
    for rows, appended in (([0, 1], [[5]]), ([1, 1], [[5], [6]]), ([], []), ([4], [[5]])):
        with pytest.raises(ValueError, match="expected distinct indices from 0 to 3"):
            eng.continue_episodes(model, tok, state, rows, appended, MAX_NEW)
    calls = {"n": 0}
    original = (engine_mod.RolloutEngine._decode_step if decode == "dynamic"
                else static_cache.StaticDecoder.step_written)

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(engine_mod.RolloutEngine if decode == "dynamic" else static_cache.StaticDecoder,
                      "_decode_step" if decode == "dynamic" else "step_written", interrupted)
        with pytest.raises(KeyboardInterrupt):
            eng.continue_episodes(model, tok, state, [0, 1, 2, 3], [[5], [6], [7], [8]], MAX_NEW)
    with pytest.raises(RuntimeError, match="stopped an earlier turn of these episodes midway"):
        eng.continue_episodes(model, tok, state, [0, 1, 2, 3], [[5], [6], [7], [8]], MAX_NEW)
    state.release()
    with pytest.raises(RuntimeError, match="KV cache was released"):
        eng.continue_episodes(model, tok, state, [0], [[5]], MAX_NEW)


# --------------------------------------------------------------------------------------
# A common prefix (a system prompt, few-shot examples) prefilled once for all prompts

# 20 shared words, then ragged tails: left padding of 0, 3, 1 and 2 positions after the prefix.
SHARED = " ".join(f"w{i}" for i in range(60, 80))
PREFIXED_PROMPTS = [f"{SHARED} w5 w6 w7 w8", f"{SHARED} w9", f"{SHARED} w11 w12 w13", f"{SHARED} w40 w41"]


def test_common_prefix_length():
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [5, 6, 7, 9, 1, 2], [0, 5, 6, 7, 8, 3]])
    mask = (torch.arange(6)[None] >= torch.tensor([[2], [0], [1]])).long()
    assert engine_mod.common_prefix_length(ids, mask) == 3
    assert engine_mod.common_prefix_length(ids[:1], mask[:1]) == 0  # one prompt: nothing to share
    assert engine_mod.common_prefix_length(ids[[0, 0]], mask[[0, 0]]) == 3  # each row keeps its last token
    assert engine_mod.common_prefix_length(ids, mask.flip(1)) == 0  # right padding: not shared
    assert engine_mod.common_prefix_length(ids.to("meta"), mask.to("meta")) == 0  # no values to compare


@pytest.mark.parametrize("decode", ["dynamic", "static"])
@pytest.mark.parametrize("G", [1, 3])
@pytest.mark.parametrize("arch,tied", MODEL_CASES, ids=MODEL_IDS)
def test_common_prefix_prefill_equals_generate(tok, arch, tied, G, decode, monkeypatch):
    model = tiny_model(arch, tied=tied, seed=3)
    ids, mask = encode(tok, PREFIXED_PROMPTS)
    add_early_eos(model, tok, ids, mask)
    ref = hf_generate(model, tok, ids, mask, G)
    spy = CompactionSpy(monkeypatch)
    eng = RolloutEngine(max_completion_length=MAX_NEW, greedy=True, decode=decode, _compact_fraction=0.01)
    out = eng(model, tok, ids, mask, G)
    assert eng.last_stats["shared_prefix"] >= 20
    assert_same_completions(out, *ref, pad=tok.pad_token_id)
    assert torch.equal(out.prompt_ids, ids.repeat_interleave(G, 0))
    assert (spy.calls > 0) == (decode == "dynamic")


def test_common_prefix_keeps_samples_and_logprobs(tok):
    model = lora_model("llama", False)
    ids, mask = encode(tok, PREFIXED_PROMPTS)
    shared = RolloutEngine(max_completion_length=MAX_NEW, seed=7)
    out = shared(model, tok, ids, mask, 2)
    plain = RolloutEngine(max_completion_length=MAX_NEW, seed=7)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_mod, "MIN_SHARED_PREFIX", 10**9)
        ref = plain(model, tok, ids, mask, 2)
    assert shared.last_stats["shared_prefix"] > 0 and plain.last_stats["shared_prefix"] == 0
    assert torch.equal(out.completion_ids, ref.completion_ids)
    m = out.completion_mask.bool()
    torch.testing.assert_close(out.sampling_logprobs[m], ref.sampling_logprobs[m], rtol=1e-5, atol=1e-5)
