"""The time simulation against published GPU figures (issue 27, item 2b).

    python benchmarks/step_time_published.py     # about 10 minutes on 2 cores

No GPU has run grpo-nb, so its prices are checked against what others measured and published, each priced the
way the published system runs (a CUDA graph per decode step or eager launches; the rows decoded at once):

* gpt-fast (pytorch.org/blog/accelerating-generative-ai-2): Llama-2-7B, one row, fp16, A100-80GB (power-capped at
  330 W): 25.5 tokens/s eager, 107.0 tokens/s with torch.compile and CUDA graphs (its kernels fused).
* Unsloth (unsloth.ai/blog/r1-reasoning): Llama-3.2-3B-Instruct in 4 bits with vLLM, "300 tokens/s" on a T4 and
  "4000 tokens/s or so" on an A100 40GB: batched generation throughput (rows assumed here: 64, vLLM's batches
  in GRPO are the step's prompts x generations).
* SGLang's blog (lmsys.org/blog/2024-07-25-sglang-llama3): Llama-3-8B bf16 on an A100-80GB, offline batches of
  thousands of requests, "approximately 4000 tokens per second" (TensorRT-LLM and SGLang; vLLM 0.5.2 lower).
* Liger-Kernel's benchmark data (benchmark/data/all_benchmark_data.csv, fused_linear_grpo_loss, A100-SXM4-80GB,
  B=16, T=1024, H=4096, V=128256, bf16): forward + backward of the GRPO loss from hidden states 356.5 ms with
  the PyTorch reference (whole logits), 327.1 ms fused.

Decode prices come from `simulate_step(...).time(card)`: the native engine's static-cache decode step at the
given rows, the KV cache at its full length. The loss prices from recording the two loss computations on the
meta device (`OpRecorder`). Results: results/step_time_published.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo_nb.simulate import SimulatedDevice, simulate_step  # noqa: E402
from grpo_nb.simulate.ops import OpRecorder, OpTrace  # noqa: E402
from grpo_nb.simulate.pricing import price  # noqa: E402

LLAMA2_7B = dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
                 rms_norm_eps=1e-5, hidden_act="silu")


def decode(model, gpu, *, rows, prompt, completion, dtype, load_in_4bit=False, graph=True) -> dict:
    generations = max(2, rows)  # GRPO's smallest group; decoded `rows` at a time
    step = simulate_step(model, max_prompt_length=prompt, max_completion_length=completion,
                         num_generations=generations, dtype=dtype, load_in_4bit=load_in_4bit, lora_rank=16,
                         rollout_max_rows=rows)
    t = step.time(gpu, graph_decode=graph)
    per_step = t.seconds("decode") / (generations // rows * (completion - 1))
    return {"decode_step_ms": per_step * 1e3, "tokens_per_s": rows / per_step,
            "rollout_tokens_per_s": t.tokens_per_second, "decode_gpu_bound": t.stages["decode"].gpu_seconds >=
            t.stages["decode"].host_seconds}


def grpo_loss(gpu, backend: str | None) -> float:
    """Forward + backward of the token-level GRPO loss from [B*T, H] hidden states through a [V, H] head, bf16."""
    from grpo_nb.logprobs import selective_logprobs

    b, t, h, v = 16, 1024, 4096, 128256
    oracle = SimulatedDevice("cuda")
    recorder = OpRecorder(lambda: "policy update")
    with oracle, recorder:
        hidden = torch.empty(b * t, h, dtype=torch.bfloat16, device="meta", requires_grad=True)
        weight = torch.empty(v, h, dtype=torch.bfloat16, device="meta", requires_grad=True)
        tokens = oracle.know(torch.empty(b * t, dtype=torch.long, device="meta"), torch.zeros(b * t, dtype=torch.long))
        advantages = torch.empty(b * t, device="meta")
        if backend is not None:
            logprobs = selective_logprobs(hidden, weight, tokens, backend=backend)
        else:  # Liger's torch reference: the whole logits, a log-softmax, the sampled token's entry
            logits = (hidden @ weight.t()).float()
            logprobs = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
        ratio = torch.exp(logprobs - logprobs.detach())
        loss = -(ratio * advantages).mean()
        loss.backward()
    trace: OpTrace = recorder.trace
    settings = {"max_completion_length": 1, "prompts_per_step": 1, "num_generations": 1, "rollout": False}
    return price(trace, gpu, settings, graph_decode=False).update


def main():
    results = {}
    llama3b, llama8b = "meta-llama/Llama-3.2-3B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"
    rows = []
    for label, published, kw in [
        ("gpt-fast eager, Llama-2-7B, 1 row, fp16, A100-80GB", 25.5,
         dict(model=LLAMA2_7B, gpu="A100-80GB", rows=1, prompt=64, completion=200, dtype="fp16", graph=False)),
        ("gpt-fast compiled + CUDA graphs, Llama-2-7B, 1 row, fp16, A100-80GB", 107.0,
         dict(model=LLAMA2_7B, gpu="A100-80GB", rows=1, prompt=64, completion=200, dtype="fp16", graph=True)),
        ("Unsloth + vLLM, Llama-3.2-3B 4-bit, T4 (64 rows assumed)", 300.0,
         dict(model=llama3b, gpu="T4", rows=64, prompt=128, completion=512, dtype="fp16", load_in_4bit=True)),
        ("Unsloth + vLLM, Llama-3.2-3B 4-bit, A100-40GB (64 rows assumed)", 4000.0,
         dict(model=llama3b, gpu="A100-40GB", rows=64, prompt=128, completion=512, dtype="bf16", load_in_4bit=True)),
        ("SGLang / TensorRT-LLM, Llama-3-8B bf16, A100-80GB, large batches (128 rows assumed)", 4000.0,
         dict(model=llama8b, gpu="A100-80GB", rows=128, prompt=256, completion=512, dtype="bf16")),
    ]:
        gpu = kw.pop("gpu")
        model = kw.pop("model")
        ours = decode(model, gpu, **kw)
        rows.append({"what": label, "published_tokens_per_s": published, **ours, "card": gpu, "settings": kw})
        print(f"{label}: published {published:,.0f} tokens/s, priced {ours['tokens_per_s']:,.0f} "
              f"({ours['decode_step_ms']:.2f} ms per decode step)")
    results["decode"] = rows
    loss = {"published_ms": {"torch": 356.54, "liger": 327.09}, "card": "A100-80GB",
            "priced_ms": {"whole logits (torch reference)": grpo_loss("A100-80GB", None) * 1e3,
                          "grpo-nb chunked (torch backend)": grpo_loss("A100-80GB", "torch") * 1e3,
                          "grpo-nb fused (Triton backend, the GPU default)": grpo_loss("A100-80GB", "triton") * 1e3}}
    print(f"GRPO loss, B=16 T=1024 H=4096 V=128256 bf16 on an A100-80GB: published torch 356.5 ms, Liger 327.1 ms; "
          f"priced {loss['priced_ms']}")
    results["grpo_loss"] = loss
    out = ROOT / "benchmarks" / "results" / "step_time_published.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
