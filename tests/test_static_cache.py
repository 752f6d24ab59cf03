"""RolloutEngine's static-cache decode path (grpo_nb/rollout/static_cache.py) against the dynamic cache and HF generate.

On the CPU `decode="static"` runs the same fixed-shape step a CUDA graph would capture, eagerly;
the CUDA-graph test at the end runs only where a GPU is present.
"""

import gc
import warnings
import weakref

import pytest
import torch

from grpo_nb.rollout import static_cache
from grpo_nb.rollout.engine import RolloutEngine, cache_argument
from grpo_nb.models import prepare_tokenizer
from grpo_nb.rollout import HFGenerateRollout, encode_prompts
from tiny_models import tiny_model, tiny_tokenizer

PROMPTS = ["w5 w6 w7 w9 w10 w11", "w8", "w12 w13 w14"]  # ragged, so left-padded
FIELDS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated")


def _prompts(tok, device="cpu"):
    ids, mask, _ = encode_prompts(tok, PROMPTS, None, device)
    assert (mask == 0).any()  # really ragged
    return ids, mask


def _rollout(model, tok, decode, G, device="cpu", **kw):
    engine = RolloutEngine(decode=decode, **kw)
    out = engine(model, tok, *_prompts(tok, device), G)
    assert engine.last_stats["decode"] == decode
    return out


def _assert_same(a, b):
    """Token for token, mask for mask."""
    for field in FIELDS:
        x, y = getattr(a, field), getattr(b, field)
        assert torch.equal(x.cpu(), y.cpu()), f"{field} differs:\n{x}\n{y}"


def _end_rows_early(model, tok, G, T):
    """Make two of the greedy tokens EOS, so rows finish at different steps."""
    first = _rollout(model, tok, "dynamic", G, max_completion_length=T, greedy=True).completion_ids
    model.generation_config.eos_token_id = [tok.eos_token_id, int(first[0, 2]), int(first[-1, 5])]


def _lengths(out):
    return out.completion_mask.sum(1).tolist()


@pytest.mark.parametrize("G", [1, 3])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_static_greedy_equals_dynamic_and_generate(arch, attn, G):
    tok = prepare_tokenizer(tiny_tokenizer())
    model = tiny_model(arch, seed=3, attn_implementation=attn)
    T = 10
    _end_rows_early(model, tok, G, T)
    kw = dict(max_completion_length=T, greedy=True)
    static = _rollout(model, tok, "static", G, **kw)
    dynamic = _rollout(model, tok, "dynamic", G, **kw)
    reference = HFGenerateRollout(**kw)(model, tok, *_prompts(tok), G)
    _assert_same(static, dynamic)
    _assert_same(static, reference)
    lengths = _lengths(static)
    assert len(set(lengths)) > 1 and min(lengths) < T  # rows finished at different steps
    torch.testing.assert_close(static.sampling_logprobs, dynamic.sampling_logprobs, atol=1e-4, rtol=0)


def test_static_with_a_lora_adapter():
    from peft import LoraConfig, get_peft_model

    tok = prepare_tokenizer(tiny_tokenizer())
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"],
                        init_lora_weights=False)  # random B: the adapter really changes the outputs
    model = get_peft_model(tiny_model("llama", seed=5, attn_implementation="sdpa"), config)
    model.eval()
    ids, mask = _prompts(tok)
    with torch.no_grad():
        with model.disable_adapter():
            base = model(input_ids=ids, attention_mask=mask).logits
        assert not torch.allclose(base, model(input_ids=ids, attention_mask=mask).logits, atol=1e-3)
    T = 10
    _end_rows_early(model, tok, 3, T)
    kw = dict(max_completion_length=T, greedy=True)
    static = _rollout(model, tok, "static", 3, **kw)
    _assert_same(static, _rollout(model, tok, "dynamic", 3, **kw))
    _assert_same(static, HFGenerateRollout(**kw)(model, tok, ids, mask, 3))


@pytest.mark.parametrize("share_prompt_prefix", [True, False])
@pytest.mark.parametrize("arch,attn", [("llama", "eager"), ("qwen2", "sdpa")])
def test_seeded_sampling_is_identical_in_static_and_dynamic_mode(arch, attn, share_prompt_prefix):
    tok = prepare_tokenizer(tiny_tokenizer())
    model = tiny_model(arch, seed=7, attn_implementation=attn)
    model.generation_config.eos_token_id = list(range(2, 40))  # ~7% per step: rows end at different steps
    kw = dict(max_completion_length=24, temperature=0.9, top_k=100, top_p=0.95, min_p=0.01, repetition_penalty=1.2,
              min_new_tokens=2, seed=1234, share_prompt_prefix=share_prompt_prefix)
    # The dynamic run compacts finished rows (the default), the static one never does.
    static = _rollout(model, tok, "static", 4, **kw)
    dynamic = _rollout(model, tok, "dynamic", 4, **kw)
    _assert_same(static, dynamic)
    lengths = _lengths(static)
    assert len(set(lengths)) > 2 and min(lengths) >= 2
    assert len({tuple(r.tolist()) for r in static.completion_ids}) > 1  # really sampled
    torch.testing.assert_close(static.sampling_logprobs, dynamic.sampling_logprobs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("check_every", [3, 64])
def test_checking_for_finished_rows_every_few_steps_changes_nothing(check_every):
    """On CUDA the static cache asks whether every row finished only every CHECK_EVERY steps (each ask waits for the
    GPU): the steps decoded after the last row ended write nothing - same tokens, log-probs and lengths."""
    tok = prepare_tokenizer(tiny_tokenizer())
    model = tiny_model("qwen2", seed=7, attn_implementation="sdpa")
    model.generation_config.eos_token_id = list(range(2, 40))  # rows end at different steps, all before T
    kw = dict(max_completion_length=40, temperature=0.9, top_k=100, min_new_tokens=2, seed=99, decode="static")
    every = RolloutEngine(**kw)
    reference = every(model, tok, *_prompts(tok), 4)
    steps = every.last_stats["decode_steps"]
    lazy = RolloutEngine(**kw)
    lazy._check_every = check_every
    out = lazy(model, tok, *_prompts(tok), 4)
    _assert_same(out, reference)
    torch.testing.assert_close(out.sampling_logprobs, reference.sampling_logprobs, atol=0, rtol=0)
    assert max(_lengths(reference)) < 40  # every row ended before the budget
    # the first check after the last row ended (each check at the end of a step t with t + 1 a multiple), or T
    assert lazy.last_stats["decode_steps"] == min(40 - 1, -(-(steps + 1) // check_every) * check_every - 1) > steps
    # the steps decoded after the last row ended drew uniforms the seeded generator gives back: the next rollout
    # samples what it would after the dynamic loop's (and after checking every step)
    dynamic = RolloutEngine(**{**kw, "decode": "dynamic"})
    dynamic(model, tok, *_prompts(tok), 4)
    again = dynamic(model, tok, *_prompts(tok), 4)
    _assert_same(lazy(model, tok, *_prompts(tok), 4), again)
    _assert_same(every(model, tok, *_prompts(tok), 4), again)


def test_static_step_gets_a_4d_mask_and_logits_to_keep():
    tok = prepare_tokenizer(tiny_tokenizer())
    model = tiny_model("llama", seed=3, attn_implementation="sdpa")
    calls = []
    model.register_forward_pre_hook(lambda mod, args, kwargs: calls.append(kwargs), with_kwargs=True)
    _rollout(model, tok, "static", 2, max_completion_length=4, greedy=True)
    assert len(calls) == 4  # prefill + 3 decode steps
    assert all(c.get("logits_to_keep") == 1 for c in calls)
    prefill, *steps = calls
    assert prefill["attention_mask"].dim() == 2
    for c in steps:
        assert c["attention_mask"].shape == (6, 1, 1, prefill["input_ids"].shape[1] + 4)
        assert c["input_ids"].shape == (6, 1) and c["position_ids"].shape == (6, 1)
        assert isinstance(c[cache_argument(model)], static_cache._StaticKV)  # by the name this transformers uses


def test_the_static_cache_is_released_when_the_rollout_ends(monkeypatch):
    tok = prepare_tokenizer(tiny_tokenizer())
    model = tiny_model("qwen2", seed=3)
    made = []

    class Recorded(static_cache.StaticDecoder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))

    monkeypatch.setattr(static_cache, "StaticDecoder", Recorded)
    engine = RolloutEngine(decode="static", max_completion_length=5, greedy=True)
    engine(model, tok, *_prompts(tok), 2)
    gc.collect()
    assert len(made) == 1 and made[0]() is None and engine._static is None

    # On an error mid-rollout the traceback pins the frame, but the cache is dropped anyway.
    n_calls = []

    def fail_third_call(mod, args, kwargs):
        n_calls.append(1)
        if len(n_calls) == 3:
            raise RuntimeError("boom")

    hook = model.register_forward_pre_hook(fail_third_call, with_kwargs=True)
    with pytest.raises(RuntimeError, match="boom"):
        engine(model, tok, *_prompts(tok), 2)
    hook.remove()
    decoder = made[1]()
    assert engine._static is None
    assert decoder is None or (decoder.keys == [] and decoder.mask is None and decoder.cache is None)


def test_falls_back_to_dynamic_when_the_static_cache_does_not_fit(monkeypatch):
    tok = prepare_tokenizer(tiny_tokenizer())
    model = tiny_model("llama", seed=3)
    monkeypatch.setattr(static_cache, "free_device_memory", lambda device: 0)
    engine = RolloutEngine(decode="static", max_completion_length=6, greedy=True)
    with pytest.warns(RuntimeWarning, match="falls back to the dynamic KV cache.*GiB"):
        out = engine(model, tok, *_prompts(tok), 2)
    assert engine.last_stats["decode"] == "dynamic"
    _assert_same(out, _rollout(model, tok, "dynamic", 2, max_completion_length=6, greedy=True))


def test_unsupported_models_are_detected():
    from transformers import Qwen2Config

    class Model:
        def __init__(self, config):
            self.config = config

    sliding = Qwen2Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    sliding._attn_implementation = "sdpa"
    assert "sliding_attention" in static_cache.static_unsupported_reason(Model(sliding))
    flash = Qwen2Config(num_hidden_layers=2)
    flash._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in static_cache.static_unsupported_reason(Model(flash))
    assert static_cache.static_unsupported_reason(tiny_model("qwen2", attn_implementation="sdpa")) is None
    # Mistral v0.1's window is on every layer, without layer_types: a 4D mask would drop it past 4096 tokens
    from transformers import MistralConfig

    from grpo_nb.prefix_sharing import shareable_config

    mistral = MistralConfig(num_hidden_layers=2, sliding_window=4096)
    mistral._attn_implementation = "sdpa"
    assert "sliding window of 4096 tokens" in static_cache.static_unsupported_reason(Model(mistral))
    assert not shareable_config(mistral)
    mistral.sliding_window = None  # v0.2 on: full attention
    assert static_cache.static_unsupported_reason(Model(mistral)) is None and shareable_config(mistral)


def test_decode_modes():
    tok = prepare_tokenizer(tiny_tokenizer())
    model = tiny_model("llama", seed=3)
    with pytest.raises(ValueError, match="decode='eager' is invalid"):
        RolloutEngine(max_completion_length=4, decode="eager")
    assert RolloutEngine(max_completion_length=4).decode == "auto"
    _rollout(model, tok, "dynamic", 2, max_completion_length=4, greedy=True)
    engine = RolloutEngine(max_completion_length=4, greedy=True)  # "auto"
    engine(model, tok, *_prompts(tok), 2)
    assert engine.last_stats["decode"] == "dynamic"  # on the CPU
    with pytest.raises(ValueError, match="'cuda_graph' needs a CUDA device"):
        RolloutEngine(max_completion_length=4, decode="cuda_graph")(model, tok, *_prompts(tok), 2)


# --------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_decoding_matches_eager(dtype):
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("no bf16 on this GPU")
    tok = prepare_tokenizer(tiny_tokenizer())
    model = tiny_model("llama", seed=3, attn_implementation="sdpa").to("cuda", dtype)
    model.generation_config.eos_token_id = [tok.eos_token_id, 7, 11]
    kw = dict(max_completion_length=48, greedy=True, device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = _rollout(model, tok, "cuda_graph", 4, **kw)  # asserts last_stats["decode"] == "cuda_graph"
        again = _rollout(model, tok, "cuda_graph", 4, **kw)  # a second rollout captures again
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
    static = _rollout(model, tok, "static", 4, **kw)  # the same step, eager: same kernels, same tokens
    _assert_same(graph, static)
    _assert_same(graph, again)
    if dtype == torch.float32:  # in bf16 the longer masked key range may round differently from dynamic
        _assert_same(graph, _rollout(model, tok, "dynamic", 4, **kw))

    # The static cache and the graph's pool are gone once the rollout returns.
    before = torch.cuda.memory_allocated()
    out = _rollout(model, tok, "cuda_graph", 4, **kw)
    del out
    gc.collect()
    assert torch.cuda.memory_allocated() - before < 64 * 1024


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_episodes_replay_one_cuda_graph_across_turns():
    """Episodes on CUDA: the first turn's graph replays the later turns' steps (recaptured where the cache grew);
    the same tokens as the dynamic cache; the cache and the graph's pool gone at release()."""
    tok = prepare_tokenizer(tiny_tokenizer())
    model = tiny_model("llama", seed=3, attn_implementation="sdpa").to("cuda")
    model.generation_config.eos_token_id = [tok.eos_token_id, *range(3, 512, 4)]
    ids, mask = _prompts(tok, "cuda")
    turns, before = {}, torch.cuda.memory_allocated()
    for decode in ("dynamic", "cuda_graph"):
        engine = RolloutEngine(decode=decode, max_completion_length=24, seed=1)
        first, state = engine.start_episodes(model, tok, ids, mask, 2)
        rows = list(range(first.completion_ids.shape[0]))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            second = engine.continue_episodes(model, tok, state, rows, [[5, 6]] * len(rows), 24)
            third = engine.continue_episodes(model, tok, state, rows[::2], [[7]] * len(rows[::2]), 24)
        assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
        assert engine.last_stats["decode"] == ("dynamic" if decode == "dynamic" else "cuda_graph")
        state.release()
        turns[decode] = (first, second, third)
    for a, b in zip(*turns.values()):
        _assert_same(a, b)
    del turns, first, second, third
    gc.collect()
    assert torch.cuda.memory_allocated() - before < 64 * 1024


def test_graph_check_passes_16_bit_rounding_and_refuses_a_broken_graph():
    """A captured CUDA graph may run other kernels than the eager step (cuBLAS algorithms, split-K), so in 16 bits
    its logits differ by rounding: on an H100 at 64 rows, 0.12 at most, which the old bound on the largest
    difference took for a broken graph (decoding then fell back and ran 5x slower). The check must pass anything
    within the model's own 16-bit error and refuse a step computed on the wrong inputs."""
    import copy

    from grpo_nb.rollout.static_cache import GRAPH_TOLERANCE, graph_error, graph_tolerance

    model, ids = tiny_model(), torch.randint(4, 500, (8, 12))
    positions = torch.arange(12).expand(8, 12)
    for dtype in (torch.bfloat16, torch.float16):
        low = copy.deepcopy(model).to(dtype)
        exact = copy.deepcopy(low).float()  # the same (rounded) weights, fp32 arithmetic
        with torch.no_grad():
            eager = exact(ids, position_ids=positions).logits[:, -1]
            rounded = low(ids, position_ids=positions).logits[:, -1].float()
            stale = positions.clone()
            stale[:, -1] -= 6  # a graph replaying an old step's position for the new token
            moved = low(ids, position_ids=stale).logits[:, -1].float()
        whole_error = graph_error(rounded, eager)
        assert 0 < whole_error <= GRAPH_TOLERANCE[dtype] / 4, whole_error  # all of 16-bit's error, with margin
        assert graph_error(rounded.roll(1, dims=0), eager) > GRAPH_TOLERANCE[dtype]  # another row's logits
        assert graph_error(moved, eager) > GRAPH_TOLERANCE[dtype], graph_error(moved, eager)
        assert graph_error(torch.full_like(eager, float("nan")), eager) != graph_error(eager, eager)  # NaN: refused
    # Sampling ignores a row's offset and the check must too; it must not pool one wrong row away among many.
    torch.manual_seed(0)
    eager = torch.randn(256, 4096) * 2 + 25
    assert graph_error(eager.roll(1, dims=0), eager) > 1  # other rows' logits, however far from 0 they sit
    one_wrong = eager.clone()
    one_wrong[7] = torch.randn(4096) * 2 + 25
    assert graph_error(one_wrong, eager) > 1
    # Tokens a model masks with -inf: the same places and values in both is a right graph, anything else is not.
    masked = eager.clone()
    masked[:, -10:] = float("-inf")
    assert graph_error(masked + 1e-3 * torch.randn_like(masked), masked) < 1e-3
    elsewhere = masked.clone()
    elsewhere[0, :10] = float("-inf")
    assert not graph_error(elsewhere, masked) <= GRAPH_TOLERANCE[torch.float32]
    # fp32 under TF32 rounds like 16 bits
    precision = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert graph_tolerance(torch.float32) == GRAPH_TOLERANCE[torch.bfloat16]
    finally:
        torch.set_float32_matmul_precision(precision)
    assert graph_tolerance(torch.float32) == GRAPH_TOLERANCE[torch.float32]
    # The H100's case: logits as spread as a random Qwen2.5-1.5B's (std ~0.8), 64 rows, off by <= 0.12
    torch.manual_seed(0)
    eager = torch.randn(64, 20_000) * 0.8
    noisy = eager + (torch.randn_like(eager) * 0.024).clamp(-0.12, 0.12)
    assert (noisy - eager).abs().max() > 0.02 * (1 + eager.abs().max())  # what the old check refused
    assert graph_error(noisy, eager) <= GRAPH_TOLERANCE[torch.bfloat16]


def test_a_graphed_step_trusts_a_replay_only_after_it_matched_an_eager_call():
    """`GraphedStep` (the sampling's own graph on CUDA): its second call replays the graph, keeps what it wrote,
    puts the state back and runs the step eagerly - a replay that wrote anything else is dropped with a warning,
    the eager result standing -; after a match it replays. A stand-in graph here (capture needs a GPU)."""
    state = torch.zeros(3)

    def fn():
        state.add_(1)

    class Replay:  # what a captured graph of fn (or of a wrong fn) would do
        def __init__(self, delta):
            self.delta, self.replays = delta, 0

        def replay(self):
            self.replays += 1
            state.add_(self.delta)

    step = static_cache.GraphedStep(fn, [state], graph=True)
    assert not step.wanted  # CPU tensors: nothing to capture, every call eager
    step()
    assert torch.equal(state, torch.ones(3)) and step.graph is None
    step.graph = good = Replay(1.0)
    step()  # the check: the replay wrote what fn writes
    assert step.checked and good.replays == 1 and torch.equal(state, torch.full((3,), 2.0))
    step()
    assert good.replays == 2 and torch.equal(state, torch.full((3,), 3.0))

    step = static_cache.GraphedStep(fn, [state], graph=False)
    step.graph = Replay(2.0)  # a graph reading a stale value
    with pytest.warns(RuntimeWarning, match="CUDA-graph sampling disabled.*other values than an eager call"):
        step()
    assert torch.equal(state, torch.full((3,), 4.0)) and step.graph is None and step.failure
    step()  # eager from then on
    assert torch.equal(state, torch.full((3,), 5.0))


def test_a_refused_graph_leaves_the_eager_steps_logits_where_the_sampling_reads_them():
    """A replay that differed from the eager step wrote its logits into the buffer the sampling reads: the eager
    step's go back there."""
    decoder = object.__new__(static_cache.StaticDecoder)
    decoder.logits, decoder.fallback_reason = torch.full((2, 5), 7.0), None  # what the refused replay wrote
    eager = torch.randn(2, 5)
    with pytest.warns(RuntimeWarning, match="CUDA-graph decoding disabled"):
        out = decoder._fall_back("the replayed graph's logits differ", logits=eager)
    assert out is decoder.logits and torch.equal(decoder.logits, eager)
