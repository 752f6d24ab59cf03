"""The time simulation: its pricing arithmetic on hand-made kernels, and a recorded step on a tiny model.

The CPU check of the prices against real timings is a benchmark (benchmarks/step_time.py), not a test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from grpo_nb.gpus import CARDS, Card, card
from grpo_nb.simulate import simulate_step
from grpo_nb.simulate.ops import Op, OpTrace
from grpo_nb.simulate.pricing import (EAGER_S, GRAPH_LAUNCH_S, GRAPH_NODE_S, KERNEL_S, bnb_fused_4bit, kernel_seconds,
                                     price)
from tiny_models import tiny_config

# 1 TFLOP/s for matmuls, 0.1 for the rest, 100 GB/s, 10 GB/s to the host
TOY = Card("toy", (8, 0), 10, {"fp16": 1e12, "bf16": 1e12, "fp32": 1e11}, 100e9, 10e9)
F16 = torch.float16


def test_a_kernel_costs_its_roofline():
    compute_bound = Op("mm", "forward", 0, flops=2e9, bytes=1e6, dtype=F16, kind="matmul")
    memory_bound = Op("mm", "forward", 0, flops=2e6, bytes=1e9, dtype=F16, kind="matmul")
    elementwise = Op("mul", "forward", 0, flops=1e9, bytes=1e6, dtype=F16)  # not a matmul: the fp32 rate
    assert kernel_seconds(compute_bound, TOY) == pytest.approx(2e-3)
    assert kernel_seconds(memory_bound, TOY) == pytest.approx(1e-2)
    assert kernel_seconds(elementwise, TOY) == pytest.approx(1e-2)
    assert kernel_seconds(Op("copy to host", "forward", 0, 0, 5e8, torch.uint8, "transfer"), TOY) == pytest.approx(5e-2)


def test_bitsandbytes_kernel_choice():
    t4, h100 = card("Tesla T4"), card("NVIDIA H100 80GB HBM3")
    assert bnb_fused_4bit(t4, "fp16", 1, 8960, 1536)             # one row: its gemv-like kernel
    assert not bnb_fused_4bit(t4, "fp16", 4096, 8960, 1536)      # a prefill: dequantise, then a matmul
    assert not bnb_fused_4bit(t4, "bf16", 16, 8960, 1536)        # no bf16 tensor-core kernel on sm75
    assert bnb_fused_4bit(h100, "bf16", 16, 14336, 4096)
    assert not bnb_fused_4bit(h100, "bf16", 256, 14336, 4096)
    fused = Op("gemm_4bit", "decode", 1, 2 * 8 * 4096 * 4096, 4096 * 4096 // 2, F16, "gemm_4bit", (8, 4096, 4096))
    wide = Op("gemm_4bit", "decode", 1, 2 * 2048 * 4096 * 4096, 4096 * 4096 // 2, F16, "gemm_4bit", (2048, 4096, 4096))
    # the dequantised path writes and reads the 16-bit weight: more than the packed weight alone
    assert kernel_seconds(fused, TOY) == pytest.approx(max(2 * 8 * 4096 * 4096 / 1e12, 4096 * 4096 // 2 / 100e9))
    assert kernel_seconds(wide, TOY) > 4096 * 4096 * 2 * 2 / 100e9


def _trace():
    """A prefill and two recorded decode steps of one piece, standing for 10 decode steps; an update."""
    mm = dict(flops=0, bytes=int(1e8), dtype=F16, kind="matmul")  # 1 ms each on TOY
    ops = [Op("mm", "prefill", 1, in_model=True, **mm), Op("mm", "decode", 2, in_model=True, **mm),
           Op("argmax", "decode", 2, 0, 1000, F16), Op("mm", "decode", 3, in_model=True, **mm),
           Op("mm", "forward", 3, **mm), Op("mm", "backward", 3, **mm), Op("mm", "backward", 3, **mm),
           Op("copy to host", "forward", 3, 0, int(4e7), torch.uint8, "transfer"),  # 4 ms: hidden by the compute
           Op("add", "optimizer", 3, 0, 1000, F16)]
    trace = OpTrace(ops, {1: ("prefill", 1, 1), 2: ("decode", 1, 1), 3: ("decode", 1, 1)})
    trace.repeat_first_decode_step(10)
    return trace


def test_price_adds_up_by_stage():
    settings = {"max_completion_length": 11, "prompts_per_step": 1, "num_generations": 1}
    eager = price(_trace(), TOY, settings, graph_decode=False)
    assert _trace().repeats == {2: 9}
    ms = 1e-3 + KERNEL_S
    assert eager.seconds("prefill") == pytest.approx(ms)
    decode_step = ms + (1000 / 100e9 + KERNEL_S)      # the GPU outruns 2 launches of 10 us
    assert eager.seconds("decode") == pytest.approx(9 * decode_step + ms)
    assert eager.seconds("backward") == pytest.approx(2 * ms)
    assert eager.update == pytest.approx(4e-3)          # the copies (4 ms) overlap the update's 3 ms of compute
    assert eager.optimizer == pytest.approx(EAGER_S)    # one tiny kernel: its launch
    assert eager.total == pytest.approx(eager.rollout + eager.update + eager.optimizer)
    assert eager.generated_tokens == 11 and eager.tokens_per_second == pytest.approx(11 / eager.rollout)
    graph = price(_trace(), TOY, settings, graph_decode=True)
    # a graph-replayed step: its launches (one replay, one eager sampling op), then its kernels
    host = GRAPH_LAUNCH_S + GRAPH_NODE_S + EAGER_S
    assert graph.seconds("decode") == pytest.approx(9 * (decode_step + host) + ms + GRAPH_LAUNCH_S + GRAPH_NODE_S)
    serial = price(_trace(), TOY, settings, serial=True, host_s=1e-3)  # a CPU: every op adds its dispatch
    assert serial.seconds("prefill") == pytest.approx(1e-3 + 1e-3)


def test_measured_products_and_host_work_by_stage():
    """A CPU's card: a product of a shape timed on the machine costs what was measured, other shapes their
    roofline; the host's work per kernel may differ by stage (a decode step's little, autograd's more)."""
    timed = Op("mm", "decode", 2, flops=2 * 4 * 64 * 32, bytes=100, dtype=torch.float32, kind="matmul",
               shape=(4, 64, 32), in_model=True)
    other = Op("mm", "decode", 2, flops=2 * 8 * 64 * 32, bytes=100, dtype=torch.float32, kind="matmul",
               shape=(8, 64, 32), in_model=True)
    cpu = Card("cpu", (0, 0), 2, {"fp32": 1e11}, 10e9, float("inf"), matmul_seconds=(((4, 64, 32, "fp32"), 7e-6),))
    assert kernel_seconds(timed, cpu) == 7e-6
    assert kernel_seconds(other, cpu) == pytest.approx(2 * 8 * 64 * 32 / 1e11)
    # the same shape in another dtype was not measured: its roofline
    assert kernel_seconds(Op("mm", "decode", 2, 2 * 4 * 64 * 32, 100, F16, "matmul", (4, 64, 32)), cpu) == \
        pytest.approx(max(2 * 4 * 64 * 32 / 1e11, 100 / 10e9))
    trace = OpTrace([timed, other, Op("mm", "backward", 3, 0, 100, torch.float32, "matmul", (1, 1, 1))],
                    {1: ("prefill", 1, 1), 2: ("decode", 1, 1)})
    settings = {"max_completion_length": 2, "prompts_per_step": 1, "num_generations": 1}
    priced = price(trace, cpu, settings, graph_decode=False, serial=True, host_s={"decode": 1e-6, "default": 5e-6})
    assert priced.seconds("decode") == pytest.approx(7e-6 + 2 * 8 * 64 * 32 / 1e11 + 2 * 1e-6)
    assert priced.seconds("backward") == pytest.approx(100 / 10e9 + 5e-6)
    assert isinstance(price(trace, cpu, settings, serial=True, host_s=np.float32(1e-6)).seconds("decode"), float)
    for host_s, fragment in [({"decode": 1e-6}, "no 'default'"), ({"decode": -1, "default": 1e-6}, "host_s\\['decode'\\]"),
                             ({"decod": 1e-6, "default": 1e-6}, "'decod', which names no stage"),
                             ("fast", "or a dict of them by stage")]:
        with pytest.raises(ValueError, match=fragment):
            price(trace, cpu, settings, serial=True, host_s=host_s)


def test_host_bound_decode_is_priced_by_its_launches():
    tiny = dict(flops=0, bytes=100, dtype=F16, kind="matmul")
    ops = [Op("mm", "decode", 2, in_model=True, **tiny) for _ in range(100)]
    trace = OpTrace(ops, {1: ("prefill", 1, 1), 2: ("decode", 1, 1)})
    settings = {"max_completion_length": 2, "prompts_per_step": 1, "num_generations": 1}
    assert price(trace, TOY, settings, graph_decode=False).seconds("decode") == pytest.approx(100 * EAGER_S)
    graphed = price(trace, TOY, settings, graph_decode=True).seconds("decode")
    gpu, host = 100 * (100 / 100e9 + KERNEL_S), GRAPH_LAUNCH_S + 100 * GRAPH_NODE_S
    assert graphed == pytest.approx(gpu + host)


def test_a_static_decode_steps_sampling_is_priced_as_a_graph_of_its_own():
    """The sampling after a static decode step (`RolloutEngine._decode_static`) replays a CUDA graph of its own:
    its kernels cost graph nodes' host time, plus one more graph launch; unmarked ones are launched eagerly."""
    tiny = dict(flops=0, bytes=100, dtype=F16, kind="other")
    model = [Op("mm", "decode", 2, in_model=True, **tiny) for _ in range(10)]
    sampling = [Op("softmax", "decode", 2, graphed=True, **tiny) for _ in range(5)]
    eager = [Op("rand", "decode", 2, **tiny)]
    trace = OpTrace(model + sampling + eager, {1: ("prefill", 1, 1), 2: ("decode", 1, 1)})
    settings = {"max_completion_length": 2, "prompts_per_step": 1, "num_generations": 1}
    gpu = 16 * (100 / 100e9 + KERNEL_S)
    host = 2 * GRAPH_LAUNCH_S + 15 * GRAPH_NODE_S + EAGER_S
    assert price(trace, TOY, settings).seconds("decode") == pytest.approx(gpu + host)
    assert price(trace, TOY, settings, graph_decode=False).seconds("decode") == pytest.approx(max(gpu, 16 * EAGER_S))


def test_a_simulated_step_is_priced_at_its_full_length():
    """A tiny model's step recorded on the meta device: every stage priced, decode steps counted to the full length."""
    settings = dict(max_prompt_length=16, num_generations=4, dtype="fp16", gradient_checkpointing=True, gpu="T4")
    short = simulate_step(tiny_config("llama"), max_completion_length=16, **settings).time("T4")
    long = simulate_step(tiny_config("llama"), max_completion_length=64, **settings).time("T4")
    for t in (short, long):
        assert {"prefill", "decode", "forward", "backward", "optimizer"} <= set(t.stages)
        assert t.total > 0 and not t.notes
    # a static KV cache: every decode step costs the same, the longer rollout has 63 of them, the shorter 15
    assert long.seconds("decode") / long.stages["decode"].kernels == pytest.approx(
        short.seconds("decode") / short.stages["decode"].kernels, rel=0.5)
    assert long.stages["decode"].kernels > 3.5 * short.stages["decode"].kernels
    assert long.generated_tokens == 4 * 64
    with pytest.raises(ValueError, match="not a card grpo-nb can price"):
        simulate_step(tiny_config("llama"), max_completion_length=16, **settings).time("GTX 480")
    # a T4's step is simulated in what it trains in: fp16 (bf16 would take the math kernel there)
    assert simulate_step(tiny_config("llama"), max_prompt_length=16, max_completion_length=16, num_generations=2,
                         gpu="T4").settings["dtype"] == "fp16"
    # simulated for one card (default: compute capability 8.0, FlashAttention), priced on another: said so
    other = simulate_step(tiny_config("llama"), max_completion_length=16, **{**settings, "gpu": None}).time("T4")
    assert any("simulate_step(..., gpu='T4')" in n for n in other.notes)
    # bf16 (the default for a card of 8.0) priced on a T4, which only emulates it: said so, with the fix
    for kw in (dict(), dict(gpu="T4", dtype="bf16")):
        notes = simulate_step(tiny_config("llama"), max_prompt_length=16, max_completion_length=16, num_generations=2,
                              **kw).time("T4").notes
        assert any("priced in bf16" in n and "trains in fp16" in n for n in notes), notes
    assert not any("bf16" in n for n in simulate_step(tiny_config("llama"), max_prompt_length=16, max_completion_length=16,
                                                      num_generations=2, gpu="T4").time("T4").notes)
    for bad in ((7,), (7.5, 0), "GTX 480", (0, 0), (99, 9)):
        with pytest.raises(ValueError, match="gpu="):
            simulate_step(tiny_config("llama"), max_completion_length=16, **{**settings, "gpu": bad})


def test_every_card_has_its_rates():
    for c in CARDS.values():
        assert c.matmul["fp16"] <= c.peak["fp16"] and c.bandwidth < c.peak["memory"]
        assert c.host_link > 0 and c.sms > 0
    assert card("T4").matmul["bf16"] < card("T4").matmul["fp16"] / 10  # emulated on sm75


def test_card_names_as_torch_reports_them():
    names = {"Tesla T4": "T4", "t4": "T4", "NVIDIA A100-SXM4-40GB": "A100-40GB", "NVIDIA A100 80GB PCIe": "A100-80GB",
             "NVIDIA A100-PCIE-40GB": "A100-40GB", "A100": "A100-40GB", "NVIDIA H100 80GB HBM3": "H100",
             "H100 SXM5": "H100", "NVIDIA H100 PCIe": "H100-PCIe", "A100_80GB": "A100-80GB",
             "Tesla P100-PCIE-16GB": "P100", "NVIDIA L4": "L4"}
    assert {name: card(name).name for name in names} == names
    for unknown in ("RTX 4090", "NVIDIA L40S", 15, None):
        with pytest.raises(ValueError, match="not a card grpo-nb can price"):
            card(unknown)


@pytest.mark.parametrize("fields, fragment", [
    (dict(matmul={"fp16": 0.0, "fp32": 1e12}), r"matmul\['fp16'\]=0.0 is invalid: expected FLOP/s"),
    (dict(matmul={"fp16": 300.0, "fp32": 19.5}), "300 TFLOPS is 300e12"),           # typed in TFLOPS
    (dict(matmul={"fp16": 1e14}), "at least 'fp32'"),
    (dict(matmul={"torch.float16": 1e14, "fp32": 1e13}), "keys 'fp16', 'bf16', 'fp32' only"),
    (dict(bandwidth=float("nan")), "bandwidth=nan is invalid"),
    (dict(capability="8.0"), "a \\(major, minor\\) pair of integers"),
    (dict(matmul_seconds=(((4, 64, 32), 1e-6),)), "matmul_seconds"),                # no dtype
    (dict(matmul_seconds=(((4, 64, 32, "fp32"), 0.0),)), "seconds > 0"),
    (dict(matmul_seconds=(((4, 64, 32, "fp32"), 1e-6), ((4, 64, 32, "fp32"), 2e-6))), "each .* once"),
])
def test_a_hand_made_card_is_checked(fields, fragment):
    made = dict(name="mine", capability=(8, 0), sms=10, matmul={"fp16": 1e14, "fp32": 1e13}, bandwidth=1e12,
                host_link=1e10)
    step = simulate_step(tiny_config("llama"), max_prompt_length=16, max_completion_length=16, num_generations=2)
    with pytest.raises(ValueError, match=fragment):
        step.time(Card(**{**made, **fields}))


def test_time_options_are_checked_and_a_step_pickles():
    import pickle

    step = simulate_step(tiny_config("llama"), max_prompt_length=16, max_completion_length=16, num_generations=2)
    again = pickle.loads(pickle.dumps(step))  # a partial, not a closure, records the kernels
    assert again.time("T4").total == pytest.approx(step.time("T4").total)
    for options, fragment in [(dict(host_s=10), "host_s=10"), (dict(graph_decode="no"), "True or False"),
                              (dict(serial=None), "True or False"), (dict(host_s="10us"), "host_s='10us'")]:
        with pytest.raises(ValueError, match=fragment):
            step.time("T4", **options)


def test_a_step_counted_and_recorded_in_one_pass_is_the_two_passes(monkeypatch):
    """simulate_step(record_kernels=True) - what plan_for_gpu(simulate=True) runs - counts and records in one pass:
    the same memory, categories and trace as counting, then recording when time() asks; time() simulates nothing
    more. The op recorder's frames name no allocation's place (they once moved the log-probs' scratch into the
    activations)."""
    from grpo_nb.simulate import step as simulate_module

    for settings in (dict(gpu="T4", load_in_4bit=True), dict(device="cpu", dtype="fp32"),
                     dict(gpu="A100", rollout_max_rows=1), dict(system="trl", gpu="A100")):
        kw = dict(max_prompt_length=16, max_completion_length=16, num_generations=2, **settings)
        two = simulate_step(tiny_config("llama"), **kw)
        one = simulate_step(tiny_config("llama"), record_kernels=True, **kw)
        assert one._trace is not None and two._trace is None
        assert (one.peak, one.host_peak) == (two.peak, two.host_peak), settings
        # a recorded rollout decodes a step more: a few KB of sampling may be live at the rollout's peak (kv_cache)
        assert {k: v for k, v in one.categories.items() if k != "kv_cache"} == \
            {k: v for k, v in two.categories.items() if k != "kv_cache"}, settings
        assert abs(one.categories["kv_cache"] - two.categories["kv_cache"]) <= 2**16, (settings, one.categories,
                                                                                      two.categories)
        if settings.get("device") == "cpu":  # (on CUDA allocations under 1 MiB go unlabelled: a tiny model's all)
            assert one.categories["logprob_scratch"] > 0, settings
        for phase, marks in two.phases.items():
            assert abs(one.phases[phase]["peak"] - marks["peak"]) <= 2**16, (settings, phase)
        one.record_ops = None  # time() must not need it
        assert one.time("A100").total == two.time("A100").total, settings
        key = lambda trace: [(o.name, o.stage, o.unit, o.flops, o.bytes) for o in trace.ops]
        assert key(one._trace) == key(two._trace) and one._trace.repeats == two._trace.repeats, settings
    with pytest.raises(ValueError, match="record_kernels"):
        simulate_step(tiny_config("llama"), max_prompt_length=16, max_completion_length=16, num_generations=2,
                      record_kernels="yes")
    # the planner records while it counts wherever it prices
    passes = []
    real = simulate_module._simulate
    monkeypatch.setattr(simulate_module, "_simulate", lambda *a: passes.append(a[-1]) or real(*a))
    from grpo_nb import plan_for_gpu

    plan = plan_for_gpu("A100", tiny_config("llama"), max_prompt_length=16, max_completion_length=(32,),
                        num_generations=(4,), load_in_4bit=(False,), gradient_checkpointing=True, simulate=True)
    assert plan.time is not None and passes and set(passes) == {"both"}, passes  # no second pass


def test_notes_for_a_cpu_step_on_a_gpu_and_for_iterations():
    cpu = simulate_step(tiny_config("llama"), max_prompt_length=16, max_completion_length=16, num_generations=2,
                        device="cpu", dtype="fp32", num_iterations=2).time("T4")
    assert any("the CPU's step" in n for n in cpu.notes) and any("num_iterations=2" in n for n in cpu.notes)
    assert cpu.total == pytest.approx(cpu.rollout / 2 + cpu.update + cpu.optimizer)


def test_plan_for_gpu_prices_its_choice_on_the_named_card():
    from grpo_nb import plan_for_gpu

    plan = plan_for_gpu("NVIDIA A100 80GB PCIe", tiny_config("llama"), max_prompt_length=16,
                        max_completion_length=(32,), num_generations=(4,), load_in_4bit=(False,), simulate=True)
    assert plan.time is not None and plan.time.card == "A100-80GB" and "priced" in repr(plan)
    sized = plan_for_gpu(15, tiny_config("llama"), max_prompt_length=16, max_completion_length=(32,),
                         num_generations=(4,), load_in_4bit=(False,), simulate=True)
    assert sized.time is None  # a size names no card
    with pytest.raises(ValueError, match="device='cpu' plans the CPU's step"):
        plan_for_gpu("H100", tiny_config("llama"), device="cpu", max_prompt_length=16, max_completion_length=(32,))
    for bf16 in ("bf16", "bfloat16"):  # either name of the dtype
        emulated = plan_for_gpu("T4", tiny_config("llama"), dtype=bf16, max_prompt_length=16,
                                max_completion_length=(32,), num_generations=(4,), load_in_4bit=(False,))
        assert any("bf16 is emulated" in n for n in emulated.notes), bf16


def test_what_the_second_probe_of_the_pricing_found():
    made = dict(name="mine", capability=(8, 0), sms=10, matmul={"fp16": 1e14, "fp32": 1e13}, bandwidth=1e12,
                host_link=1e10)
    step = simulate_step(tiny_config("llama"), max_prompt_length=16, max_completion_length=16, num_generations=2)
    for fields, fragment in [(dict(sms=None), "sms=None"), (dict(sms="40"), "sms='40'"), (dict(name=None), "name"),
                             (dict(matmul_efficiency=None), "matmul_efficiency=None")]:
        with pytest.raises(ValueError, match=fragment):
            step.time(Card(**{**made, **fields}))
    with pytest.raises(ValueError, match="beta"):
        simulate_step(tiny_config("llama"), max_prompt_length=16, max_completion_length=16, num_generations=2,
                      lora_rank=None, beta=0.04)
    from grpo_nb import plan_for_gpu

    plan = plan_for_gpu("V100", tiny_config("llama"), max_prompt_length=16, max_completion_length=(32,),
                        num_generations=(4,), load_in_4bit=(False,), simulate=True)
    assert plan.time is None and any("no time priced" in n for n in plan.notes)


def test_plan_for_gpu_keeps_the_fastest_setting_that_fits(monkeypatch):
    import grpo_nb.planning as planning
    from grpo_nb import plan_for_gpu

    kw = dict(max_prompt_length=16, max_completion_length=(32,), num_generations=(4,), simulate=True)
    monkeypatch.setattr(planning, "QUALITY_MARGIN", 0.0)  # the fastest, whatever its weights
    plan = plan_for_gpu("T4", tiny_config("llama"), load_in_4bit=(False, True), **kw)
    tried = plan.alternatives
    assert [(a["load_in_4bit"], a["gradient_checkpointing"]) for a, _, _ in tried] == [
        (False, "offload"), (False, True), (True, "offload"), (True, True)]
    fastest = min((t for _, _, t in tried if t is not None), key=lambda t: t.total)
    assert plan.time is fastest and plan.priced_time is fastest
    monkeypatch.setattr(planning, "QUALITY_MARGIN", 100.0)  # 16-bit weights unless 4-bit is 100x faster
    sixteen = plan_for_gpu("T4", tiny_config("llama"), load_in_4bit=(False, True), **kw)
    assert sixteen.settings["load_in_4bit"] is False and not any("chose 4-bit" in n for n in sixteen.notes)
    assert sixteen.time is min((t for a, _, t in sixteen.alternatives if not a["load_in_4bit"]), key=lambda t: t.total)
    trl = plan_for_gpu("T4", tiny_config("llama"), load_in_4bit=(False,), system="trl", **kw)
    assert not trl.alternatives and trl.time is not None  # TRL's step is priced, not searched
    chosen = next(a for a, _, t in tried if t is fastest)
    assert all(plan.settings[k] == v for k, v in chosen.items())
    assert plan.simulated.peak <= plan.budget_bytes and "fastest that fits chosen" in repr(plan)
    assert plan.categories == plan.simulated.categories  # what the widgets' planned bar draws
    # a setting you chose is kept; False: the first that fits, as before
    kept = plan_for_gpu("T4", tiny_config("llama"), load_in_4bit=(False,), gradient_checkpointing=True, **kw)
    assert [a for a, _, _ in kept.alternatives] == [{"load_in_4bit": False}]
    first = plan_for_gpu("T4", tiny_config("llama"), load_in_4bit=(False, True), fastest=False, **kw)
    assert not first.alternatives and first.settings["load_in_4bit"] is False


def test_plan_for_gpu_passes_over_what_runs_slower_than_max_step_seconds():
    from grpo_nb import plan_for_gpu

    kw = dict(max_prompt_length=16, num_generations=(4,), load_in_4bit=(False,), gradient_checkpointing=True,
              simulate=True)
    both = plan_for_gpu("T4", tiny_config("llama"), max_completion_length=(64, 16), **kw)
    short = plan_for_gpu("T4", tiny_config("llama"), max_completion_length=(16,), **kw)
    assert both.settings["max_completion_length"] == 64
    limit = (both.time.total + short.time.total) / 2  # between the two steps' prices
    capped = plan_for_gpu("T4", tiny_config("llama"), max_completion_length=(64, 16), max_step_seconds=limit, **kw)
    assert capped.fits and capped.settings["max_completion_length"] == 16 and capped.time.total <= limit
    assert any("slower than max_step_seconds" in n and "64 tokens" in n for n in capped.notes)
    nothing = plan_for_gpu("T4", tiny_config("llama"), max_completion_length=(64,), max_step_seconds=limit, **kw)
    assert not nothing.fits and any("64 tokens" in n for n in nothing.notes)
    # said as what it is (it fits, it is slow), with the seconds it was priced at (sub-second steps too)
    assert "is slower than max_step_seconds" in repr(nothing) and "nothing tried fits" not in repr(nothing)
    assert f"({both.time.total:.3g} s)" in repr(nothing)
    from grpo_nb_widgets import vram_figure

    message = vram_figure(planned=nothing).texts[0].get_text()
    assert "fits nothing" in message and "record['memory']" not in message
    from grpo_nb.gpus import CARDS

    for gpu in (CARDS["H100"], (7, 5)):  # a plan needs the card's memory
        with pytest.raises(ValueError, match=r"plan_for_gpu\(gpu=.*its memory in GiB") as err:
            plan_for_gpu(gpu, tiny_config("llama"), max_completion_length=(16,), **kw)
        assert len(str(err.value)) < 400
    for bad, fragment in [(dict(max_step_seconds=0), "max_step_seconds"),
                          (dict(max_step_seconds=10, simulate=False), "simulate=True")]:
        with pytest.raises(ValueError, match=fragment):
            plan_for_gpu("T4", tiny_config("llama"), max_completion_length=(16,), **{**kw, **bad})
    with pytest.raises(ValueError, match="no step can be priced"):
        plan_for_gpu("V100", tiny_config("llama"), max_completion_length=(16,), max_step_seconds=10, **kw)


def test_choosing_by_time_a_length_fits_if_it_fits_one_row_at_a_time(monkeypatch):
    """With `fastest`, the rollout width is a setting too: a length whose 8-row rollout does not fit but whose
    narrower one does is planned, with the widest rollout that fits."""
    from transformers import LlamaConfig

    import grpo_nb.planning as planning
    from grpo_nb import plan_for_gpu

    # a KV cache larger than the update's micro-batch of 1: the rollout's width sets the peak
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=128, max_position_embeddings=1024)
    kw = dict(max_prompt_length=16, max_completion_length=(496,), num_generations=(8,), load_in_4bit=(False,),
              gradient_checkpointing=True, per_device_train_batch_size=1, simulate=True)
    peaks = {rows: simulate_step(config, max_prompt_length=16, max_completion_length=496, num_generations=8, dtype="fp16",
                                 gradient_checkpointing=True, gpu="T4", per_device_train_batch_size=1,
                                 rollout_max_rows=rows).peak for rows in (None, 4)}
    assert peaks[4] < peaks[None]
    import numpy as np  # numpy's integers count as integers, as in every other planner argument

    assert simulate_step(config, max_prompt_length=16, max_completion_length=496, num_generations=8, dtype="fp16",
                         gradient_checkpointing=True, gpu="T4", per_device_train_batch_size=1,
                         rollout_max_rows=np.int64(4)).peak == peaks[4]
    budget = (peaks[4] + peaks[None]) // 2  # all 8 rows at once no longer fit, 4 do
    monkeypatch.setattr(planning, "usable_gpu_bytes", lambda gib, headroom=0.1: budget)
    plan = plan_for_gpu("T4", config, **kw)
    assert plan.fits and plan.settings["rollout_max_rows"] == 4 and plan.simulated.peak <= budget
    assert [(a.get("rollout_max_rows"), t is None) for a, _, t in plan.alternatives] == [(None, True), (4, False)]
    assert not plan_for_gpu("T4", config, fastest=False, **kw).fits  # as before: all rows at once
