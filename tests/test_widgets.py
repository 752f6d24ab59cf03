"""The display layer (grpo_nb_widgets) rendered headlessly from recorded histories.

Synthetic records copy the shape of grpo_nb.trainer.make_record (a real one-step run on a tiny
model checks that they do); the widgets must draw what the records say, and say so instead of
raising when a record lacks memory or samples.
"""

import base64
import math
import re
import subprocess
import sys

import pytest

from grpo_nb_widgets import (HTML, dashboard_html, plot_reward_curves, png_bytes, reward_figure, save_png,
                             split_completion, traces_html, traces_text, vram_figure)

GiB, MiB = 2**30, 2**20
FUNCS = ("xml_count_reward", "soft_format_reward", "correctness_reward")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def memory(step=1, *, scale=1.0):
    cats = {"base_weights": int(1.1 * GiB), "trainable": 70 * MiB, "optimizer": 140 * MiB, "gradients": 70 * MiB,
            "activations": int(0.6 * GiB * scale), "logprob_scratch": 0, "kv_cache": int(1.5 * GiB * scale),
            "other": 300 * MiB}
    static = cats["base_weights"] + cats["trainable"] + cats["optimizer"] + cats["other"]
    update = cats["gradients"] + cats["activations"] + cats["logprob_scratch"]
    peak = static + max(cats["kv_cache"], update)
    return {**cats, "peak": peak, "rollout_peak": static + cats["kv_cache"], "update_peak": static + update,
            "reserved_peak": peak + 200 * MiB, "current": static, "optimizer_parked": False}


def sample(completion, answer="12", reward=1.0):
    return {"prompt": "What is 5 + 7?", "completion": completion,
            "rewards": {"xml_count_reward": 0.5, "soft_format_reward": 0.5, "correctness_reward": reward - 1.0},
            "reward": reward, "advantage": reward - 1.0, "answer": answer, "extra": {}}


def record(step, *, funcs=FUNCS, scale=1.0):
    """One step with make_record's keys."""
    mem = memory(step, scale=scale)
    return {
        "step": step, "reward": 0.1 * step, "reward_std": 0.3, "unscored_completions": 0, "metrics": {},
        "rewards": {name: {"mean": 0.05 * step * (j + 1), "std": 0.1} for j, name in enumerate(funcs)},
        "loss": 0.01 / step, "kl": 0.001 * step, "clip_ratio": 0.02, "clip_ratio_low": 0.01, "clip_ratio_high": 0.01,
        "grad_norm": 1.0, "skipped_nonfinite": False, "learning_rate": 5e-4, "completion_length_mean": 40.0 + step,
        "completion_length_max": 64, "truncated_fraction": 0.1, "frac_reward_zero_std": 0.25, "sampling_rounds": 1, "prompts_truncated": 0,
        "generation_time": 2.0, "step_time": 3.0, "peak_memory_bytes": mem["peak"], "memory": mem, "device": "cuda:0",
        "samples": [
            sample(f"<reasoning>5 plus 7 is 12 (step {step})</reasoning>\n<answer>12</answer>", reward=3.0),
            sample("<reasoning>I think <script>alert('x')</script> it is</reasoning><answer>13</answer>", reward=1.0),
            sample("no tags at all & a < b", reward=0.0),
        ],
    }


def history(n=8, **kw):
    return [record(step, **kw) for step in range(1, n + 1)]


def patches_by_gid(fig):
    return {p.get_gid(): p for ax in fig.axes for p in ax.patches if p.get_gid()}


def lines_by_gid(ax):
    return {line.get_gid(): line for line in ax.lines if line.get_gid()}


def assert_png(data):
    assert data.startswith(PNG_MAGIC) and len(data) > 3000


# --------------------------------------------------------------------------------------
# A real record: the synthetic ones must keep its shape


@pytest.fixture(scope="module")
def real_history(tmp_path_factory):
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model

    from grpo_nb import train
    from grpo_nb.models import prepare_tokenizer
    from tiny_models import tiny_model, tiny_tokenizer

    model = tiny_model("llama")
    model.generation_config.eos_token_id = 2
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    model.train()

    def length_reward(completions, **kwargs):
        return [float(len(c)) for c in completions]

    data = Dataset.from_dict({"prompt": ["w5 w6 w7", "w8 w9"], "answer": ["3", "4"]})
    return train(model, prepare_tokenizer(tiny_tokenizer()), data, [length_reward], num_generations=4,
                 per_device_train_batch_size=4, max_completion_length=6, max_prompt_length=16, save_steps=0,
                 max_steps=1, verbose=False, output_dir=str(tmp_path_factory.mktemp("run")))


def test_synthetic_records_have_the_real_shape(real_history):
    real = real_history[-1]
    fake = record(1)
    assert set(fake) == set(real)
    # reserved_peak: CUDA only; peaks_upper_bound: where the OS keeps the process's CPU peak (CI's sandbox)
    assert set(real["memory"]) - {"reserved_peak", "peaks_upper_bound"} <= set(fake["memory"])
    assert set(fake["samples"][0]) == set(real["samples"][0])


def test_every_widget_renders_a_real_run(real_history, tmp_path):
    assert_png(png_bytes(vram_figure(real_history[-1])))
    assert_png(png_bytes(reward_figure(real_history)))
    assert {p.split(":")[1] for p in patches_by_gid(vram_figure(real_history)) if p.startswith("run:")} >= {
        "base_weights", "lora_optimizer", "other"}
    page = dashboard_html(real_history)
    assert page.count("data:image/png;base64,") == 2 and "w" in traces_html(real_history)
    assert "WRONG (answer" in traces_text(real_history)  # a random model gives no <answer> tag


# --------------------------------------------------------------------------------------
# VRAM breakdown


def test_vram_bar_has_one_segment_per_nonzero_category_and_the_peak(tmp_path):
    rec = record(3)
    fig = vram_figure(rec, device_total_bytes=16 * GiB)
    segments = patches_by_gid(fig)
    # logprob_scratch is zero in this record: no segment for it; trainable + optimizer are one segment.
    assert set(segments) == {f"run:{k}" for k in ("base_weights", "lora_optimizer", "gradients", "activations",
                                                    "kv_cache", "other")}
    mem = rec["memory"]
    assert segments["run:lora_optimizer"].get_width() == pytest.approx((mem["trainable"] + mem["optimizer"]) / GiB)
    assert segments["run:kv_cache"].get_width() == pytest.approx(mem["kv_cache"] / GiB)
    # Rollout and update lanes both start where the static part ends, and the longer one ends at the peak.
    static_end = sum(segments[f"run:{k}"].get_width() for k in ("base_weights", "lora_optimizer", "other"))
    assert segments["run:kv_cache"].get_x() == pytest.approx(static_end)
    assert segments["run:gradients"].get_x() == pytest.approx(static_end)
    assert segments["run:kv_cache"].get_x() + segments["run:kv_cache"].get_width() == pytest.approx(mem["peak"] / GiB)
    (ax,) = fig.axes
    peak = lines_by_gid(ax)["peak"]
    assert list(peak.get_xdata()) == pytest.approx([mem["peak"] / GiB] * 2)
    assert lines_by_gid(ax)["device_total"].get_xdata()[0] == pytest.approx(16)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert len(legend) == 6 and legend[0].startswith("base weights") and "GiB" in legend[0]
    assert_png(save_png(fig, tmp_path / "vram.png").read_bytes())
    assert_png(fig._repr_png_())  # a figure left as a cell's value shows as an image in any notebook


def test_save_png_replaces_a_planted_link_instead_of_writing_through_it(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("someone else's file")
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "reward.png").symlink_to(outside)
    path = save_png(reward_figure([record(1)]), tmp_path / "plots" / "reward.png")
    assert outside.read_text() == "someone else's file" and not path.is_symlink()
    assert_png(path.read_bytes())
    assert sorted(p.name for p in path.parent.iterdir()) == ["reward.png"]  # no temporary file left


def test_png_paths_that_cannot_be_written_are_named_and_one_does_not_stop_the_other(tmp_path):
    from grpo_nb_widgets import LiveDashboard

    with pytest.raises(IsADirectoryError, match=rf"Cannot write the PNG {re.escape(str(tmp_path))}: it is a folder"):
        plot_reward_curves(history(3), tmp_path)
    with pytest.raises(TypeError, match=r"LiveDashboard\(png_dir=123\) is invalid: expected a folder"):
        LiveDashboard(png_dir=123)
    name = "r" * 250 + ".png"  # a name as long as a disk allows: the private one beside it must still fit
    assert_png(save_png(reward_figure(history(3)), tmp_path / name).read_bytes())
    (tmp_path / "plots" / "reward.png").mkdir(parents=True)
    dashboard = LiveDashboard(notebook=False, print_steps=False, png_dir=tmp_path / "plots")
    dashboard(record(1))
    with pytest.raises(OSError, match=r"Cannot write the PNG .*plots/reward.png: it is a folder"):
        dashboard.save_pngs(tmp_path / "plots")
    assert_png((tmp_path / "plots" / "vram.png").read_bytes())


def test_vram_legend_of_a_full_fine_tune_says_weights_not_lora():
    full = {**record(3)["memory"], "base_weights": 0}  # a full fine-tune: every weight trainable, no frozen base
    legend = [t.get_text() for t in vram_figure({"memory": full}).axes[0].get_legend().get_texts()]
    assert any(t.startswith("weights + optimizer") for t in legend) and not any("LoRA" in t for t in legend)
    legend = [t.get_text() for t in vram_figure(record(3)).axes[0].get_legend().get_texts()]
    assert any(t.startswith("LoRA + optimizer") for t in legend)


def test_vram_of_an_optimizer_parked_between_steps():
    """A state in host memory between steps (grpo_nb.parking) is on the device at the optimizer step only: a lane of
    its own beside the gradients, not the static part."""
    mem = {**record(3)["memory"], "optimizer_parked": True, "optimizer": 3 * GiB}
    fig = vram_figure({"memory": mem})
    segments = patches_by_gid(fig)
    assert segments["run:lora_optimizer"].get_width() == pytest.approx(mem["trainable"] / GiB)
    parked = segments["run:parked_optimizer"]
    static_end = sum(segments[f"run:{k}"].get_width() for k in ("base_weights", "lora_optimizer", "other"))
    # the optimizer step's lane: gradients, then the state, after the static part; here it is the peak's lane
    assert parked.get_x() == pytest.approx(static_end + mem["gradients"] / GiB)
    assert parked.get_width() == pytest.approx(3)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any(t.startswith("LoRA  ") for t in legend) and any(t.startswith("optimizer (in host") for t in legend)
    unparked = patches_by_gid(vram_figure({"memory": {**mem, "optimizer_parked": False}}))
    assert "run:parked_optimizer" not in unparked
    assert unparked["run:lora_optimizer"].get_width() == pytest.approx((mem["trainable"] + 3 * GiB) / GiB)


def test_vram_marks_the_runs_peak_over_the_history():
    steps = [record(1, scale=2.0), record(2)]  # the first step peaked higher than the latest
    (ax,) = vram_figure(steps).axes
    assert lines_by_gid(ax)["peak"].get_xdata()[0] == pytest.approx(steps[0]["peak_memory_bytes"] / GiB)
    assert "step 2" in ax.get_yticklabels()[0].get_text()


def test_vram_second_bar_for_a_trl_estimate():
    from grpo_nb.memory import estimate_vram
    from tiny_models import tiny_config

    trl = {"base_weights": 3 * GiB, "trainable": 70 * MiB, "optimizer": 140 * MiB, "gradients": 70 * MiB,
           "activations": 2 * GiB, "logprob_scratch": GiB, "kv_cache": 2 * GiB, "other": 0}
    fig = vram_figure(record(1), trl_estimate=trl)
    segments = patches_by_gid(fig)
    assert {g for g in segments if g.startswith("estimate:")} == {
        f"estimate:{k}" for k in ("base_weights", "lora_optimizer", "gradients", "activations", "logprob_scratch",
                                  "kv_cache")}
    assert segments["estimate:logprob_scratch"].get_width() == pytest.approx(1.0)
    assert len(fig.axes[0].get_yticklabels()) == 2
    # grpo_nb's MemoryEstimate works as is (it has .categories) and as dict(estimate.categories).
    estimate = estimate_vram(tiny_config(), system="trl", max_prompt_length=16, max_completion_length=6,
                             num_generations=4)
    for given in (estimate, dict(estimate.categories)):
        widths = {g: p.get_width() for g, p in patches_by_gid(vram_figure(record(1), trl_estimate=given)).items()}
        assert widths["estimate:base_weights"] == pytest.approx(estimate.categories["base_weights"] / GiB)
    # An estimate alone (before any run) draws just that bar.
    assert all(g.startswith("estimate:") for g in patches_by_gid(vram_figure(None, trl_estimate=estimate)))


def test_vram_bar_for_a_step_planned_before_the_run():
    """A simulated step (grpo_nb.simulate) or an estimate drawn beside the run's own bar, labelled as what it is."""
    from types import SimpleNamespace

    categories = {"base_weights": GiB, "trainable": 70 * MiB, "optimizer": 140 * MiB, "gradients": 70 * MiB,
                  "activations": GiB // 2, "logprob_scratch": 0, "kv_cache": GiB // 4, "other": 0}
    simulated = SimpleNamespace(system="grpo_nb", categories=categories, phases={"policy update": {}})
    fig = vram_figure(record(1), planned=simulated, trl_estimate=categories)
    segments = patches_by_gid(fig)
    assert {g.split(":")[0] for g in segments} == {"run", "planned", "estimate"}
    assert segments["planned:activations"].get_width() == pytest.approx(0.5)
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert len(labels) == 3 and "grpo_nb\n(simulated)" in labels
    only = vram_figure(planned=SimpleNamespace(system="trl", categories=categories))  # no run yet
    assert all(g.startswith("planned:") for g in patches_by_gid(only))
    assert [t.get_text() for t in only.axes[0].get_yticklabels()] == ["trl\n(estimate)"]
    # a plan (plan_for_gpu) draws its simulated step, labelled with its card and its priced seconds per step
    from grpo_nb.planning import Plan

    plan = Plan("T4", 13 * GiB, True, {}, None, [], simulated)
    label = lambda: [t.get_text() for t in vram_figure(planned=plan).axes[0].get_yticklabels()]  # noqa: E731
    assert label() == ["plan, T4\n(simulated)"]
    plan._time = SimpleNamespace(total=12.34)
    assert label() == ["plan, T4\n(simulated)\n~12.3 s/step"]


# --------------------------------------------------------------------------------------
# Reward curves


def test_reward_curves_keep_twelve_functions_apart():
    """Colours repeated after 10 functions (C{i % 10}); the 10th also took the total's colour."""
    from matplotlib.colors import to_rgba

    names = [f"f{i}" for i in range(12)]
    hist = [{"step": s, "reward": 1.0, "rewards": {n: {"mean": float(i), "std": 0.0} for i, n in enumerate(names)}}
            for s in range(1, 4)]
    ax_total, ax_funcs, *_ = reward_figure(hist, window=2).axes
    curves = [line for gid, line in lines_by_gid(ax_funcs).items() if not gid.endswith(":raw")]
    styles = {(to_rgba(line.get_color()), line.get_linestyle()) for line in curves}
    assert len(curves) == 12 and len(styles) == 12
    assert to_rgba(lines_by_gid(ax_total)["reward:total"].get_color()) not in {s[0] for s in styles}


def test_reward_figure_has_one_curve_per_reward_function():
    hist = history(8)
    fig = reward_figure(hist, window=3)
    ax_total, ax_funcs, *small = fig.axes
    curves = {gid: line for gid, line in lines_by_gid(ax_funcs).items() if not gid.endswith(":raw")}
    assert set(curves) == {f"reward:{name}" for name in FUNCS}
    assert [t.get_text() for t in ax_funcs.get_legend().get_texts()] == list(FUNCS)
    # The rolling mean is what it says: the last point averages the last 3 steps.
    last3 = [r["rewards"]["correctness_reward"]["mean"] for r in hist[-3:]]
    assert curves["reward:correctness_reward"].get_ydata()[-1] == pytest.approx(sum(last3) / 3)
    assert list(lines_by_gid(ax_total)["reward:total:raw"].get_ydata()) == pytest.approx([r["reward"] for r in hist])
    drawn = {gid for ax in small for gid in lines_by_gid(ax) if not gid.endswith(":raw")}
    assert {"loss", "kl", "completion_length_mean", "clip_ratio", "truncated_fraction"} <= drawn
    assert len(small) == 5  # four panels, and the length panel's right-hand axis for the truncated share
    share = next(lines_by_gid(ax)["truncated_fraction"] for ax in small if "truncated_fraction" in lines_by_gid(ax))
    assert list(share.get_ydata()) == pytest.approx([100 * r["truncated_fraction"] for r in hist])


def test_reward_functions_that_appear_later_get_their_curve(tmp_path):
    hist = history(3, funcs=FUNCS[:1]) + [record(4, funcs=FUNCS)]
    fig = plot_reward_curves(hist, tmp_path / "curve.png", window=2)  # the demo's entry point
    assert_png((tmp_path / "curve.png").read_bytes())
    funcs = [g for g in lines_by_gid(fig.axes[1]) if not g.endswith(":raw")]
    assert len(funcs) == 3
    early = lines_by_gid(fig.axes[1])["reward:correctness_reward:raw"].get_ydata()
    assert all(math.isnan(v) for v in early[:3])  # a gap, not a fake zero


# --------------------------------------------------------------------------------------
# Sample reasoning traces


def test_traces_html_escapes_and_sets_parts_apart():
    page = traces_html(history(2))
    assert isinstance(page, HTML) and page._repr_html_() == page
    assert "<script>" not in page and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page
    assert "a &lt; b" in page and "&amp;" in page
    assert page.count('data-part="reasoning"') == 2 and page.count('data-part="answer"') == 2
    assert page.count('data-part="text"') == 1
    assert page.count("✓ right") == 1 and page.count("✗ wrong") == 2 and "1/3 right" in page
    assert "correctness_reward: <b>2.000</b>" in page and "advantage +2.000" in page
    assert "(step 2)" in page  # the latest step by default


def test_traces_of_an_earlier_step_and_in_text():
    hist = history(4)
    assert "(step 2)" in traces_html(hist, step=2) and "(step 4)" not in traces_html(hist, step=2)
    assert "(step 3)" in traces_html(hist, step=-2)
    assert "No step 9" in traces_html(hist, step=9) and "1–4" in traces_html(hist, step=9)
    text = traces_text(hist, step=1)
    assert "RIGHT (answer 12)" in text and text.count("WRONG") == 2
    assert "[reasoning] 5 plus 7 is 12 (step 1)" in text and "[answer] 12" in text and "<b>" not in text


def test_split_completion_handles_unclosed_and_missing_tags():
    assert split_completion("pre <reasoning>a</reasoning> mid <answer>4</answer> post") == [
        ("text", "pre"), ("reasoning", "a"), ("text", "mid"), ("answer", "4"), ("text", "post")]
    # A completion cut mid-reasoning (max_completion_length) still shows its reasoning.
    assert split_completion("<reasoning>still thinking") == [("reasoning", "still thinking")]
    assert split_completion("<reasoning>x<answer>5</answer>") == [("reasoning", "x"), ("answer", "5")]
    assert split_completion("") == []


def test_samples_without_an_answer_column_have_no_verdict():
    rec = record(1)
    for s in rec["samples"]:
        del s["answer"]
    page = traces_html([rec])
    assert "✓" not in page and "✗" not in page and " right" not in page and 'data-part="answer"' in page
    assert "RIGHT" not in traces_text([rec]) and "WRONG" not in traces_text([rec])


# --------------------------------------------------------------------------------------
# The dashboard, and records that lack parts


def test_dashboard_composes_the_three():
    page = dashboard_html(history(5), trl_estimate=memory(), device_total_bytes=16 * GiB, title="<run>")
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == 2
    for data in images:
        assert_png(base64.b64decode(data))
    assert "&lt;run&gt;" in page and "step 5 | reward 0.500" in page and 'data-part="reasoning"' in page


@pytest.mark.parametrize("missing", ["memory", "samples", "rewards", "everything"])
def test_records_missing_parts_degrade_to_a_message(missing):
    hist = history(3)
    for r in hist:
        if missing == "everything":
            r.clear()
        else:
            r.pop(missing)
            r.pop("peak_memory_bytes") if missing == "memory" else None
    vram = vram_figure(hist)
    if missing in ("memory", "everything"):
        assert not vram.axes and "no memory breakdown" in vram.texts[0].get_text()
    page, text = traces_html(hist), traces_text(hist)
    if missing in ("samples", "everything"):
        assert "No samples" in page and "no samples" in text
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', dashboard_html(hist))  # renders both figures
    assert len(images) == 2 and all(base64.b64decode(data).startswith(PNG_MAGIC) for data in images)


@pytest.mark.parametrize("edit", [
    {"rewards": [1, 2]},  # a list, not {name: {"mean", "std"}}
    {"peak_memory_bytes": "1GB", "device_total_bytes": "16GB"},
    {"reward": 1.7e308, "loss": -1.7e308, "kl": 1.7e308, "completion_length_mean": 1.7e308},  # past an axis's range
    {"rewards": {name: {"mean": 1.7e308, "std": 0.0} for name in FUNCS}},
    {"peak_memory_bytes": 1.7e308, "memory": {**memory(), "kv_cache": 1.7e308, "peak": 1.7e308}},
])
def test_hand_edited_records_draw_what_they_can(edit):
    """A history.json edited by hand (or by another tool): the dashboard draws the rest, never a raw exception."""
    hist = history(3)
    hist[1].update(edit)
    assert_png(png_bytes(reward_figure(hist)))
    assert_png(png_bytes(vram_figure(hist)))
    assert "step 3" in dashboard_html(hist)


def test_the_widgets_import_nothing_from_grpo_nb():
    code = ("import sys, grpo_nb_widgets as w; w.dashboard_html([]); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('grpo_nb', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_an_empty_history_renders_messages():
    assert "no training steps" in reward_figure([]).texts[0].get_text()
    assert "No step -1" in traces_html([]) and "No step -1" in traces_text([])
    assert "no training steps recorded yet" in dashboard_html([])
    assert_png(png_bytes(vram_figure([])))


# --------------------------------------------------------------------------------------
# Text from models and datasets, shown as written (probe round 2)


def test_text_views_show_terminal_escapes_and_bidi_overrides_as_escapes():
    from grpo_nb_widgets.reward_table import RewardTable

    completion = "<answer>5</answer>\x1b[2J\x1b]52;c;cHduZWQ=\x07\x1b[8mhidden"
    rec = {"step": 1, "samples": [{**sample(completion, answer="5\x1b[31m"), "extra": {"tag": "\u202eok"}}]}
    text = traces_text([rec])
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text
    assert "\\x1b[2J\\x1b]52;c;cHduZWQ=\\x07\\x1b[8mhidden" in text and "answer 5\\x1b[31m" in text
    table = RewardTable(["f\x1b[0m"], [{"completion": "<answer>7</answer> \u202eABC", "prompt": "p\x9b"}],
                        {"f\x1b[0m": [{"value": 2.0}]}).text()
    assert "\u202e" not in table and "\x1b" not in table and "\x9b" not in table
    assert "<answer>7</answer> \\u202eABC  2" in table and "f\\x1b[0m: mean 2" in table


def test_reward_table_cuts_text_before_escaping_and_marks_the_cut():
    from grpo_nb_widgets.reward_table import MAX_COMPLETION_HTML, RewardTable

    prompt = "x" * (MAX_COMPLETION_HTML - 2) + "<b>tail"
    page = RewardTable(["f"], [{"completion": "c", "prompt": prompt}], {"f": [{"value": 1.0}]}).html()
    assert "x&lt;b … [5 more characters]</div>" in page  # not a dangling "&l"


def test_legend_labels_show_reward_function_names_as_written():
    names = ["_format_reward", "cost_$5_vs_$10", r"$\undefinedcmd$"]
    hist = [{"step": s, "reward": 1.0, "rewards": {n: {"mean": float(i), "std": 0.0} for i, n in enumerate(names)}}
            for s in (1, 2)]
    fig = reward_figure(hist)
    png_bytes(fig)  # drawn: no mathtext error
    assert [t.get_text() for t in fig.axes[1].get_legend().get_texts()] == [
        " _format_reward", r"cost_\$5_vs_\$10", r"\$\undefinedcmd\$"]  # every function has its entry


def test_a_prefill_is_shown_before_the_completion_and_lists_of_answers_get_no_verdict():
    rec = {"step": 1, "samples": [{**sample("2+3=5\n</reasoning>\n<answer>5</answer>", answer="5"),
                                   "prefill": "<reasoning>\nLet me add.", "prompt": "What is 2+3?"},
                                  sample("<answer>5</answer>", answer=["5", "five"])]}
    page = traces_html([rec])
    assert page.count('data-part="prefill"') == 1 and "Let me add.</pre>" in page
    assert ">2+3=5</pre>" in page and page.count('data-part="text"') == 0  # the prefill opened the reasoning
    assert "1/1 right" in page  # the list answer is not judged "wrong"
    text = traces_text([rec])
    assert "[prefill (written in the prompt, not generated)] <reasoning>" in text and "[reasoning] 2+3=5" in text


def test_the_total_reward_panel_draws_what_dynamic_sampling_rolled_out():
    hist = [dict(record(s), rolled_out_reward=0.25 * s) for s in (1, 2, 3)]
    ax_total = reward_figure(hist, window=1).axes[0]
    assert list(lines_by_gid(ax_total)["reward:rolled_out"].get_ydata()) == [0.25, 0.5, 0.75]
    labels = [t.get_text() for t in ax_total.get_legend().get_texts()]
    assert any(label.startswith("groups kept (trained on)") for label in labels)
    assert "reward:rolled_out" not in lines_by_gid(reward_figure(history(3)).axes[0])


def test_the_dashboards_right_or_wrong_mark_reads_answers_as_correctness_reward_does():
    """The widgets keep their own copy of the answer-matching rule (they import nothing from grpo_nb)."""
    from grpo_nb.rewards import answers_match
    from grpo_nb_widgets.traces import answers_match as shown

    texts = ["18", "$18", "18%", "-$5", "$-5", "-5", "1,234", "1234", " 5.0 ", "5", "1/2", "0.5", "1 000", "1000",
             "18 dollars", "€3", "£3", "3", "abc", "", "$", "%", "+5", "5e0"]
    for a in texts:
        for b in texts:
            assert shown(a, b) == answers_match(a, b), (a, b)


def test_the_right_or_wrong_mark_reads_the_answer_behind_a_prefill():
    from grpo_nb_widgets.traces import verdict

    sample = {"prompt": "What is 3+4?", "prefill": "<answer>\n", "completion": "7\n</answer>", "answer": "7"}
    assert verdict(sample) is True and verdict({**sample, "completion": "8\n</answer>"}) is False


def test_hand_edited_samples_steps_and_huge_numbers_draw_what_they_can():
    """Probe P34 F2: samples that are no list, rewards that are no dict, an int past float's range, a step that is a
    list: the views show what they can; a device_total_bytes that is no number is named."""
    from grpo_nb_widgets import dashboard_html, reward_figure, traces_html, traces_text, vram_figure

    record = {"step": 1, "reward": 0.5, "loss": 0.1, "rewards": {"f": {"mean": 0.5, "std": 0.1}},
              "memory": {"weights": 100, "peak": 200}, "peak_memory_bytes": 200,
              "samples": [{"prompt": "p", "completion": "c", "rewards": {"f": 1.0}, "reward": 1.0}]}
    odd = [dict(record, samples=0.5), dict(record, step=2, samples=[dict(record["samples"][0], rewards=0.5)]),
           dict(record, step=3, reward=10**400, loss=-(10**400), samples=[dict(record["samples"][0], reward=10**400)]),
           dict(record, step=[4, 5])]
    for history in ([r] for r in odd):
        traces_html(history), traces_text(history), reward_figure(history), vram_figure(history), dashboard_html(history)
    assert "+inf" in traces_text([odd[2]]) or "inf" in traces_text([odd[2]])
    for bad in ("1GB", -1e308, 10**400):
        with pytest.raises((TypeError, ValueError), match="vram_figure\\(device_total_bytes="):
            vram_figure(record, device_total_bytes=bad)
