"""The TRL callback, driven with log dicts shaped like TRL 1.16 GRPOTrainer's (keys from its source:
`_metrics[mode][...]` in grpo_trainer.py plus Trainer.log's loss / grad_norm / learning_rate / epoch)."""

import math
from types import SimpleNamespace

import pytest
import torch

from grpo_nb_widgets import dashboard_html, reward_figure, traces_html, vram_figure
from grpo_nb_widgets import trl_callback
from grpo_nb_widgets.trl_callback import GrpoNbDashboardCallback, record_from_trl_logs


def trl_logs(step):
    return {
        "loss": 0.01 * step, "grad_norm": 0.5, "learning_rate": 1e-5, "epoch": 0.1 * step,
        "num_tokens": 1000.0 * step, "step_time": 2.5,
        "completions/mean_length": 40.0 + step, "completions/min_length": 10.0, "completions/max_length": 64.0,
        "completions/clipped_ratio": 0.25, "completions/mean_terminated_length": 30.0,
        "completions/min_terminated_length": 10.0, "completions/max_terminated_length": 50.0,
        "rewards/xml_count_reward/mean": 0.1 * step, "rewards/xml_count_reward/std": 0.05,
        "rewards/org/reward-model/mean": 1.5, "rewards/org/reward-model/std": 0.2,
        "reward": 0.1 * step + 1.5, "reward_std": 0.3, "frac_reward_zero_std": 0.5,
        "kl": 0.002 * step, "entropy": 1.2,
        "clip_ratio/low_mean": 0.01, "clip_ratio/low_min": 0.0, "clip_ratio/high_mean": 0.02,
        "clip_ratio/high_max": 0.05, "clip_ratio/region_mean": 0.03,
    }


def drive(callback, steps, args, model=None, optimizer=None):
    control = SimpleNamespace()
    for step in range(1, steps + 1):
        state = SimpleNamespace(global_step=step)
        callback.on_step_end(args, state, control, model=model, optimizer=optimizer)
        callback.on_log(args, state, control, logs=trl_logs(step), model=model, optimizer=optimizer)
    callback.on_log(args, state, control, logs={"train_runtime": 9.0, "train_loss": 0.02, "epoch": 0.3})
    callback.on_train_end(args, state, control, model=model)


def test_records_from_trl_logs_and_figures():
    model = torch.nn.Linear(4, 4)
    model.weight.requires_grad_(False)
    optimizer = torch.optim.AdamW([model.bias])
    model.bias.grad = torch.ones(4)
    optimizer.step()
    cb = GrpoNbDashboardCallback(live=False)
    drive(cb, 3, SimpleNamespace(output_dir="unused", log_completions=False), model, optimizer)

    assert [r["step"] for r in cb.history] == [1, 2, 3]  # the train summary log is no step
    r = cb.history[-1]
    assert r["reward"] == pytest.approx(1.8) and r["reward_std"] == 0.3 and r["frac_reward_zero_std"] == 0.5
    assert r["rewards"] == {"xml_count_reward": {"mean": pytest.approx(0.3), "std": 0.05},
                            "org/reward-model": {"mean": 1.5, "std": 0.2}}
    assert r["loss"] == pytest.approx(0.03) and r["kl"] == pytest.approx(0.006) and r["grad_norm"] == 0.5
    assert (r["clip_ratio"], r["clip_ratio_low"], r["clip_ratio_high"]) == (0.03, 0.01, 0.02)
    assert (r["completion_length_mean"], r["completion_length_max"], r["truncated_fraction"]) == (43.0, 64.0, 0.25)
    assert r["step_time"] == 2.5 and r["trl_logs"]["num_tokens"] == 3000.0 and r["samples"] == []
    assert r["memory"]["base_weights"] == 64 and r["memory"]["trainable"] == 16
    assert r["memory"]["optimizer"] >= 32  # AdamW's two moments (+ step)

    fig = reward_figure(cb.history)
    gids = {line.get_gid() for ax in fig.axes for line in ax.get_lines()}
    assert {"reward:total", "reward:xml_count_reward", "reward:org/reward-model", "kl", "loss"} <= gids
    bars = {p.get_gid() for ax in vram_figure(cb.history).axes for p in ax.patches}
    assert {"run:base_weights", "run:lora_optimizer", "run:gradients"} <= bars
    assert "<img" in dashboard_html(cb.history)


def test_eval_logs_are_skipped():
    assert record_from_trl_logs({"eval_loss": 1.0, "eval_reward": 2.0}) is None
    assert record_from_trl_logs({"train_runtime": 3.0, "train_loss": 0.1}) is None
    assert record_from_trl_logs({"reward": 1.0}, step=7)["step"] == 7


def test_logged_completions_are_attached(tmp_path):
    pd = pytest.importorskip("pandas", reason="TRL logs completions as a pandas table (the dev extra installs it)")
    pytest.importorskip("pyarrow", reason="pandas tables from TRL need pyarrow (installed with datasets)")
    args = SimpleNamespace(output_dir=str(tmp_path), log_completions=True, reward_weights=None)
    cb = GrpoNbDashboardCallback(live=False)
    (tmp_path / "completions").mkdir()
    control = SimpleNamespace()
    for step in (1, 2):
        state = SimpleNamespace(global_step=step)
        cb.on_step_end(args, state, control)
        cb.on_log(args, state, control, logs=trl_logs(step))
        # TRL writes the table right after on_log, in the layout of GRPOTrainer.log.
        pd.DataFrame({"step": [step] * 2,
                      "prompt": [[{"role": "user", "content": "2+2?"}]] * 2,
                      "completion": [[{"role": "assistant", "content": "<answer>4</answer>"}],
                                     [{"role": "assistant", "content": "5"}]],
                      "xml_count_reward": [0.25, 0.0], "org/reward-model": [1.0, float("nan")],
                      "advantage": [0.7, -0.7]}).to_parquet(
            tmp_path / "completions" / f"completions_{step:05d}.parquet")
    cb.on_train_end(args, state, control)
    for record in cb.history:
        assert len(record["samples"]) == 2
    s = cb.history[-1]["samples"][0]
    assert s["prompt"] == "2+2?" and s["completion"] == "<answer>4</answer>" and s["advantage"] == 0.7
    assert s["rewards"] == {"xml_count_reward": 0.25, "org/reward-model": 1.0} and s["reward"] == 1.25
    assert cb.history[-1]["samples"][1]["reward"] == 0.0  # NaN (None) skipped as TRL does
    assert "&lt;answer&gt;" in traces_html(cb.history) or "answer" in traces_html(cb.history)


def test_live_display_one_handle_throttled(monkeypatch):
    import IPython.display

    shown = []

    class Handle:
        def update(self, obj, **kwargs):
            shown.append(("update", obj))

    def fake_display(obj, display_id=None, **kwargs):
        shown.append(("display", obj))
        return Handle()

    monkeypatch.setattr(IPython.display, "display", fake_display)
    monkeypatch.setattr(trl_callback, "in_notebook", lambda: True)
    cb = GrpoNbDashboardCallback(live=True, update_every_s=3600)
    drive(cb, 3, SimpleNamespace(output_dir="unused", log_completions=False))
    assert [kind for kind, _ in shown] == ["display", "update"]  # first step, then the forced final draw
    assert "GRPO run (TRL)" in shown[-1][1]["text/html"]


def test_live_outside_a_notebook_prints_text_and_settings_for_no_view_are_named(monkeypatch, capsys):
    import IPython.display

    monkeypatch.setattr(IPython.display, "display", lambda *a, **k: pytest.fail("displayed outside a notebook"))
    monkeypatch.setattr(trl_callback, "in_notebook", lambda: False)
    cb = GrpoNbDashboardCallback(live=True, update_every_s=0)
    drive(cb, 3, SimpleNamespace(output_dir="unused", log_completions=False))
    out = capsys.readouterr().out
    assert out and "<div" not in out and "base64" not in out  # was the whole HTML bundle, images inlined
    with pytest.warns(UserWarning, match=r"live=False, title=...\): these settings are for the live dashboard"):
        GrpoNbDashboardCallback(live=False, title="mine")


def test_a_real_trl_grpo_run_feeds_the_dashboard(tmp_path):
    """Two steps of TRL's own GRPOTrainer on a tiny model: the callback sees TRL's real logs."""
    pytest.importorskip("trl", reason="runs TRL's GRPOTrainer (the dev extra installs trl)")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    try:
        from tests.tiny_models import tiny_model, tiny_tokenizer
    except ImportError:
        from tiny_models import tiny_model, tiny_tokenizer

    def token_count_reward(completions, **kwargs):
        return [float(len(c.split())) for c in completions]

    model_dir = tmp_path / "tiny-llama"
    tiny_model("llama", seed=0, attn_implementation="sdpa").save_pretrained(model_dir)
    dataset = Dataset.from_dict({"prompt": ["w5 w6 w7", "w10 w11 w12", "w15 w16", "w20 w21 w22 w23"]})
    args = GRPOConfig(output_dir=str(tmp_path / "out"), report_to=[], per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=6, use_cpu=True, bf16=False, max_steps=2,
                      logging_steps=1, save_strategy="no", seed=0, gradient_checkpointing=False,
                      log_completions=True)
    callback = GrpoNbDashboardCallback(live=False)
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=token_count_reward, args=args, train_dataset=dataset,
                          processing_class=tiny_tokenizer(), callbacks=[callback])
    trainer.train()
    steps = [r["step"] for r in callback.history]
    assert steps == [1, 2], steps
    last = callback.history[-1]
    assert set(last["rewards"]) == {"token_count_reward"}
    assert last["reward"] == pytest.approx(last["trl_logs"]["reward"]) and last["completion_length_mean"] > 0
    # full fine-tuning here: every weight is trainable, none frozen; Adam holds two states per weight
    assert last["memory"]["base_weights"] == 0 and last["memory"]["trainable"] > 0
    assert last["memory"]["optimizer"] == pytest.approx(2 * last["memory"]["trainable"], rel=1e-3)  # + step counters
    assert "<img" in dashboard_html(callback.history)
    # TRL's logged completions (its parquet files), with their per-function scores
    samples = callback.history[0]["samples"]
    assert samples and all(s["rewards"]["token_count_reward"] == float(len(s["completion"].split())) for s in samples)


def test_a_completion_no_function_scored_has_no_score(tmp_path):
    pd = pytest.importorskip("pandas", reason="TRL logs completions as a pandas table (the dev extra installs it)")
    pytest.importorskip("pyarrow", reason="pandas tables from TRL need pyarrow (installed with datasets)")
    from grpo_nb_widgets.traces import traces_text
    from grpo_nb_widgets.trl_callback import samples_from_completions_table

    path = tmp_path / "completions_00001.parquet"
    pd.DataFrame({"step": [1, 1], "prompt": ["2+2?"] * 2, "completion": ["4", "x"], "judge": [1.0, float("nan")],
                  "advantage": [0.5, 0.0]}).to_parquet(path)
    samples = samples_from_completions_table(path, ["judge"])
    assert samples[0]["reward"] == 1.0 and math.isnan(samples[1]["reward"])  # not a reward of 0.000
    assert "#2 | reward — |" in traces_text({"step": 1, "samples": samples})


def test_trl_samples_keep_what_grpo_nbs_own_records_keep(tmp_path):
    """A chat prompt's question (its last user message) as the prompt, an assistant prefill apart, long text cut or
    named: the same as grpo_nb.records.sample_of_row, which the widgets cannot import."""
    pd = pytest.importorskip("pandas", reason="TRL logs completions as a pandas table (the dev extra installs it)")
    pytest.importorskip("pyarrow", reason="pandas tables from TRL need pyarrow (installed with datasets)")
    from grpo_nb.records import sample_of_row
    from grpo_nb_widgets.trl_callback import samples_from_completions_table

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?" + "x" * 3000},
            {"role": "assistant", "content": "<reasoning>\n"}]
    rows = [{"prompt": chat, "answer": "5"}, {"prompt": "plain " * 500, "answer": "y" * 1500}]
    for i, row in enumerate(rows):  # a table of chat prompts, one of plain ones
        path = tmp_path / f"completions_{i:05d}.parquet"
        pd.DataFrame({"step": [1], "prompt": [row["prompt"]], "completion": ["5"], "answer": [row["answer"]],
                      "judge": [1.0]}).to_parquet(path)
        [theirs], ours = samples_from_completions_table(path, ["judge"]), sample_of_row(row)
        assert {k: theirs.get(k) for k in ours} == ours


def test_values_the_callback_cannot_read_are_dropped_not_raised():
    """TRL does not catch what a callback raises: a value float() cannot hold must not stop training."""
    cb = GrpoNbDashboardCallback(live=False)
    args = SimpleNamespace(output_dir="unused", log_completions=True)
    logs = {"reward": 10**400, "loss": "high", "grad_norm": None, "kl": True, "entropy": torch.tensor([1.0, 2.0]),
            "reward_std": float("nan"), "learning_rate": torch.tensor(1e-5), "rewards/f/mean": 10**400,
            "rewards/f/std": 0.5, "step": "three"}
    cb.on_log(args, SimpleNamespace(global_step="three"), None, logs=logs)
    [record] = cb.history
    assert not {"reward", "loss", "grad_norm", "kl", "entropy"} & set(record)
    assert math.isnan(record["reward_std"]) and record["learning_rate"] == pytest.approx(1e-5)
    assert record["rewards"] == {"f": {"std": 0.5}} and record["step"] is None and record["trl_logs"] == logs
