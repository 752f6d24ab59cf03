"""selective_logprobs never materialises [rows, vocab] logits: peak memory vs the plain path.

Each path runs in a fresh interpreter so neither sees the other's allocator state. The peak is
measured as the process's peak RSS (ru_maxrss) after the forward + backward, minus its current
RSS just before (inputs already allocated and touched). Using the *current* RSS as baseline,
not the earlier peak, can only over-state a path's increase, i.e. make the ratio smaller.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROWS, VOCAB, HIDDEN = 8192, 49152, 256  # full fp32 logits: 8192 * 49152 * 4 B = 1.5 GiB

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(2)
    rows, vocab, hidden, path = {rows}, {vocab}, {hidden}, {path!r}

    def status_kib(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        raise RuntimeError("no " + field)

    def current_rss_kib():
        return status_kib("VmRSS")

    def peak_rss_kib():
        # VmHWM belongs to this process's own address space. ru_maxrss would not do: after
        # fork+exec it starts from the parent's peak (pytest's, gigabytes after model tests).
        return status_kib("VmHWM")

    h = (torch.randn(rows, hidden) * 0.5).requires_grad_()
    w = (torch.randn(vocab, hidden) * 0.05).requires_grad_()
    tokens = torch.randint(0, vocab, (rows,))
    upstream = torch.randn(rows)
    if path == "chunked":
        from grpo_nb.logprobs import selective_logprobs
    # Warm the BLAS/allocator on something tiny, so lazy library set-up is not counted.
    (torch.randn(64, hidden) @ torch.randn(hidden, 64)).sum()

    try:  # reset the high-water mark to the current RSS (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    base_rss = current_rss_kib()
    base_peak = peak_rss_kib()
    if path == "chunked":
        out = selective_logprobs(h, w, tokens)
    else:
        out = torch.log_softmax(h @ w.t(), dim=-1).gather(1, tokens[:, None]).squeeze(1)
    (out * upstream).sum().backward()
    peak = peak_rss_kib()
    assert h.grad is not None and w.grad is not None
    print(json.dumps({{
        "increase_mib": (peak - base_rss) / 1024,
        "maxrss_delta_mib": (peak - base_peak) / 1024,
        "checksum": float(out.detach().double().sum()),
    }}))
    """
)


def _peak_increase(path: str) -> dict:
    code = _SCRIPT.format(rows=ROWS, vocab=VOCAB, hidden=HIDDEN, path=path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_selective_logprobs_peak_memory_is_8x_below_full_logits():
    chunked = _peak_increase("chunked")
    full = _peak_increase("full")
    ratio = full["increase_mib"] / max(chunked["increase_mib"], 1.0)
    print(
        f"\n[memory] rows={ROWS} vocab={VOCAB} hidden={HIDDEN}: "
        f"selective_logprobs +{chunked['increase_mib']:.0f} MiB, full logits +{full['increase_mib']:.0f} MiB, "
        f"ratio {ratio:.1f}x"
    )
    # Same inputs (same seed), so both paths computed the same log-probs.
    assert abs(chunked["checksum"] - full["checksum"]) <= 1e-4 * abs(full["checksum"])
    # The full path at least holds the fp32 logits once.
    assert full["increase_mib"] >= ROWS * VOCAB * 4 / 2**20
    assert ratio >= 8, (chunked, full)


# ----------------------------------------------------------------------------- the planner on hostile configs

PLANNER_CONFIG = dict(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
_CUSTOM_CODE = "import pathlib; pathlib.Path(__file__).with_name('RAN').write_text('ran')\n"


def test_the_planner_reads_the_context_window_as_train_does():
    """YaRN extends max_position_embeddings by its factor (Qwen3: 32768 x 4): the planner plans the lengths train()
    accepts for such a model, and still refuses what lies beyond the extended window."""
    from grpo_nb import estimate_vram
    from grpo_nb.attachments import position_window
    from grpo_nb.memory import context_window
    from grpo_nb.memory.estimate import resolve_config

    yarn = {**PLANNER_CONFIG, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 2048}}
    assert context_window(resolve_config(yarn)) == position_window(resolve_config(yarn)) == 8192
    assert estimate_vram(yarn, max_prompt_length=256, max_completion_length=7936).total > 0
    with pytest.raises(ValueError, match="beyond the model's context window of 8192"):
        estimate_vram(yarn, max_prompt_length=256, max_completion_length=7937)


def test_the_planner_never_runs_or_offers_to_run_a_folders_code(tmp_path, monkeypatch):
    """A folder whose config.json points at its own code (auto_map): refused by name, no [y/N] prompt, no code run."""
    from grpo_nb import estimate_vram, plan_for_gpu
    from grpo_nb.simulate import simulate_step

    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("the planner asked whether to run custom code"))
    folder = tmp_path / "custom"
    folder.mkdir()
    (folder / "custom_config.py").write_text(_CUSTOM_CODE)
    auto_map = {"AutoConfig": "custom_config.CustomConfig", "AutoModelForCausalLM": "custom_config.CustomModel"}
    config = {**PLANNER_CONFIG, "model_type": "customnet", "auto_map": auto_map}
    (folder / "config.json").write_text(json.dumps(config))
    for plan in (lambda: estimate_vram(str(folder)), lambda: plan_for_gpu("T4", str(folder)),
                 lambda: simulate_step(str(folder))):
        with pytest.raises(ValueError, match=r"needs custom code \(its config.json's auto_map, "
                                             r"model_type='customnet'\), and the planner does not run a folder's "
                                             r"code. Pass a config dict of its sizes"):
            plan()
    # A model type transformers knows is read by its own class, the auto_map ignored; the values are checked too.
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    assert estimate_vram(str(folder)).settings["parameters"] == estimate_vram(PLANNER_CONFIG).settings["parameters"]
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "llama",
                                                    "rope_scaling": {"rope_type": "linear", "factor": -4.0}}))
    with pytest.raises(ValueError, match=r"factor=-4.0: expected a number >= 1"):
        estimate_vram(str(folder))
    assert not (folder / "RAN").exists()


@pytest.mark.parametrize("overrides,fragments", [
    (dict(rope_scaling={"rope_type": "nonexistent", "factor": 2.0}),
     ["the config's rope_parameters", "rope_type='nonexistent', which this transformers does not know", "'yarn'"]),
    (dict(rope_scaling={"rope_type": "yarn", "factor": "4"}),
     ["rope_parameters", "factor='4': expected a number >= 1"]),
    (dict(rope_parameters={"rope_type": "linear", "factor": -4.0}), ["factor=-4.0: expected a number >= 1"]),
    (dict(rope_scaling=[1, 2]), ["the config's rope_scaling=[1, 2] is invalid: expected a dict"]),
    (dict(model_type="mistral", sliding_window=0),
     ["the config's sliding_window=0 is invalid: expected an integer >= 1"]),
    (dict(hidden_size=2**40), ["the config's vocab_size=1000 x hidden_size=1099511627776 make a weight of 1.1e+15",
                               "beyond any real model"]),
    (dict(num_hidden_layers=100_000), ["the config's num_hidden_layers=100000 is invalid: expected at most 1,000",
                                       "beyond any real model"]),
    (dict(torch_dtype="banana"), ["the config dict is invalid: transformers refused it (AttributeError", "banana"]),
], ids=["rope-type", "rope-factor-str", "rope-factor-negative", "rope-list", "sliding-window-0", "overflow", "layers",
        "dtype-unknown"])
def test_config_values_transformers_cannot_build_are_refused_by_name(overrides, fragments):
    """Refused before the architecture is built (instantly, naming the key), by the three planner functions alike."""
    from grpo_nb import estimate_vram, plan_for_gpu
    from grpo_nb.simulate import simulate_step

    config = {**PLANNER_CONFIG, **overrides}
    for func, plan in (("estimate_vram", lambda: estimate_vram(config)), ("plan_for_gpu", lambda: plan_for_gpu(
            "T4", config)), ("simulate_step", lambda: simulate_step(config, max_completion_length=16))):
        with pytest.raises(ValueError) as err:
            plan()
        missing = [f for f in [f"{func}: ", *fragments] if f not in str(err.value)]
        assert not missing, f"{func}: message lacks {missing}:\n{err.value}"


def test_config_values_the_plan_does_not_use_are_planned():
    """The checkpoint's storage dtype (float8 in some files) is not what training loads in: planned in `dtype`. A
    window Qwen2-MoE stores as 0 when it does not use one is no window. The caller's dict is left as it was."""
    from grpo_nb import estimate_vram

    config = {**PLANNER_CONFIG, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    plain = estimate_vram(config).total
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}  # transformers adds keys to its copy
    assert estimate_vram({**config, "torch_dtype": "float8_e4m3fn"}).total == plain
    moe = dict(PLANNER_CONFIG, model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=32)
    assert estimate_vram(moe).total > 0
