"""A simulated step's time on a card: every recorded kernel priced by a roofline, then added up by stage.

    step = simulate_step("Qwen/Qwen2.5-1.5B-Instruct", load_in_4bit=True, max_completion_length=1024, dtype="fp16")
    print(step.time("T4").table())

Each kernel of the step (`ops.py` records them: FLOPs, bytes, dtype, stage) costs on the GPU

    max(flops / the card's matmul rate in its dtype, bytes / the card's memory bandwidth) + KERNEL_S

(non-matmul kernels at the FP32 rate; `grpo_nb.gpus` has the rates and their sources), and on the host either
`EAGER_S` to launch it from PyTorch, or `GRAPH_NODE_S` when it is replayed from a CUDA graph. The host runs ahead
of the GPU until something waits for a result: a unit of work launched eagerly (a prefill, a stage of the update,
an eager decode step) takes max(GPU time, host time). A decode step replayed from a CUDA graph takes the sum:
measured on an H200, a replayed step cost its graph's launch (cudaGraphLaunch's host time, ~1.1 us per kernel in
the graph) plus its kernels' GPU time, one after the other, whether the engine waited for the GPU at every step or
every `CHECK_EVERY` = 8 steps (0-5% apart, bf16 LoRA and QLoRA at 1/8/64 rows): the launch does not overlap the
previous replay's kernels. The sampling after a static decode step replays a graph of its own
(`RolloutEngine._decode_static`; its ops are marked `graphed`): graph nodes too, and one more graph launch.

What the roofline knows of the kernels the card really runs:

* bitsandbytes' 4-bit matmul in the rollout (no gradient) is its fused kernel or a dequantisation to 16 bits
  followed by a matmul, by `bnb_fused_4bit` - the rule of bitsandbytes 0.50's `backends/cuda/ops.py` by compute
  capability, rows and weight shape; training always dequantises (recorded as such).
* Offloaded activations travel over the host link on a side stream, overlapping the update's compute: the
  update takes max(compute, copies).
* A rollout simulated for a few tokens stands for its whole length through the trace's `repeats` (how many decode
  steps each recorded one stands for), which the simulation that recorded it sets: grpo-nb's static KV cache
  has the same shapes at every token, so a piece's first decode step counts for all of them; TRL's growing
  cache is recorded at its first and last length, each standing for half the steps (the cost is linear in the
  length). Every completion runs to its full length, the worst case the memory simulation also prices.

Launch costs, measured on an H200 machine (benchmarks/step_time_gpu.py, results/step_time_gpu_h200*: Qwen2.5-1.5B's
shapes, bf16 LoRA and QLoRA, prefill and decode steps of ~3,000 kernels each, with CUDA profiles): a kernel
launched from grpo-nb's model code costs 20-35 us of host time (Python, peft's and bitsandbytes' layers, PyTorch's
dispatch and the launch; `EAGER_S` = 25 us, bf16's); a kernel takes ~2.3 us of GPU time beyond its roofline
(`KERNEL_S`: launch latency, tail and the gap to the next, from a graph-replayed decode step whose weights take
0.65 ms to read and whose ~3,000 kernels take 12 ms in all); replaying a graph costs ~1.1 us of host time per kernel
in it (`GRAPH_NODE_S`: cudaGraphLaunch averaged 3.5 ms for those ~3,000 kernels). The host was a server CPU: a Colab
or Kaggle VM's is likely slower, so these are lower bounds there. The launch costs were 10 us, 1 us and 10 us per
graph before this measurement (from HolisticTraceAnalysis' docs and cuda.juliagpu.org), which priced the H200's
decode steps 3-5x and its update 2.6x too fast.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..arguments import need_bool, need_number
from ..gpus import Card, card as find_card
from ..memory.estimate import turn_budget
from .ops import OpTrace

EAGER_S = 25e-6    # host time to launch one kernel from grpo-nb's model code in eager PyTorch (measured, H200 host)
KERNEL_S = 2.3e-6  # GPU time a kernel takes beyond its roofline (launch latency, tail, gap; measured, H200)
GRAPH_LAUNCH_S = 10e-6  # host time to replay one CUDA graph, beside its kernels' GRAPH_NODE_S
GRAPH_NODE_S = 1.1e-6   # host time per kernel of a replayed CUDA graph (cudaGraphLaunch; measured, H200 host)
_DTYPES = {"torch.float16": "fp16", "torch.bfloat16": "bf16", "torch.float32": "fp32"}


def bnb_fused_4bit(card: Card, dtype: str, m: int, n: int, k: int) -> bool:
    """Whether bitsandbytes (0.50, `backends/cuda/ops.py`) multiplies `m` rows by a 4-bit [n, k] weight with its
    fused kernel (True) or dequantises the weight to `dtype` and calls a matmul (False)."""
    if m <= 4:
        return True
    if m > 1536:
        return False
    major, minor = card.capability
    if dtype == "fp32" or major < 7 or (major == 7 and (minor < 5 or dtype != "fp16")):
        return m < 8  # no tensor-core kernel: the SIMT one wins for a few rows only
    n_blocks = -(-n // 64)
    if n * k < 4 * 2**20:  # small weights: dequantising costs more than it saves up to ~64-320 rows
        return m <= 64
    if m > 512:
        return False
    if m < 8:
        return True
    sms = card.sms
    if (major, minor) == (7, 5):
        return m <= ((128 if k < n else 64) if n_blocks >= 3 * sms else 64 if n_blocks >= sms // 2 else 32)
    if (major, minor) == (8, 0):
        return m <= (128 if n_blocks >= 3 * sms else (64 if k < n else 32) if n_blocks >= sms else 16)
    if major == 9:
        return m <= (64 if n_blocks >= 3 * sms else 48 if n_blocks >= 2 * sms else 32 if n_blocks >= sms else 16)
    return m <= (128 if n_blocks >= sms else 64 if n_blocks >= sms // 2 else 16)


def kernel_seconds(op, card: Card) -> float:
    """The roofline time of one recorded kernel on `card` (without launch costs)."""
    dtype = _DTYPES.get(str(op.dtype), "fp32")
    bandwidth = card.bandwidth
    if op.kind == "transfer":
        return op.bytes / card.host_link
    if op.kind == "gemm_4bit":
        m, n, k = op.shape
        if bnb_fused_4bit(card, dtype, m, n, k):
            rate = card.matmul_rate(dtype) if m >= 8 else card.matmul_rate("fp32")
            return max(op.flops / rate, op.bytes / bandwidth)
        itemsize = 4 if dtype == "fp32" else 2
        dequantize = (n * k // 2 + n * k // 64 + n * k * itemsize) / bandwidth
        matmul = max(op.flops / card.matmul_rate(dtype), (n * k * itemsize + (m * k + m * n) * itemsize) / bandwidth)
        return dequantize + matmul + KERNEL_S  # two kernels
    if op.kind == "matmul" and op.shape:
        measured = card.measured_matmul(op.shape, dtype)
        if measured is not None:
            return measured
    rate = card.matmul_rate(dtype) if op.kind in ("matmul", "attention", "kernel") else card.matmul_rate("fp32")
    roofline = max(op.flops / rate, op.bytes / bandwidth)
    if op.kind == "matmul" and op.shape:
        return roofline / card.efficiency(op.shape[0])
    return roofline


STAGES = ("prefill", "decode", "reference log-probs", "old log-probs", "forward", "log-probs", "loss", "backward",
          "optimizer")  # what `ops.OpRecorder.stage` names a kernel's stage (host transfers: "offload copies")


def _host_seconds(host_s):
    """`price`'s host_s as a function of the stage, each value checked."""
    if isinstance(host_s, Mapping):
        unknown = [k for k in host_s if k not in (*STAGES, "default")]
        if unknown:
            raise ValueError(f"time(): host_s has the key {unknown[0]!r}, which names no stage: expected some of "
                             f"{list(STAGES)} and 'default' (the seconds for the stages not named)")
        if "default" not in host_s:
            raise ValueError(f"time(): host_s={dict(host_s)!r} gives seconds by stage but no 'default' for the other "
                             f"stages: add 'default': seconds")
        seconds = {k: need_number("time", f"host_s[{k!r}]", v, 0, 1e-3) for k, v in host_s.items()}
        return lambda stage: seconds.get(stage, seconds["default"])
    try:
        seconds = need_number("time", "host_s", host_s, 0, 1e-3)
    except ValueError:
        raise ValueError(f"time(): host_s={host_s!r} is invalid: expected the seconds of host work per kernel, a "
                         f"number from 0 to 1e-3 (10 us is 10e-6), or a dict of them by stage with a 'default'") from None
    return lambda stage: seconds


@dataclass
class Stage:
    seconds: float
    kernels: int
    flops: int
    bytes: int
    gpu_seconds: float      # the kernels' own time
    host_seconds: float     # launching them


@dataclass
class StepTime:
    """A step's time on a card, by stage (seconds), with the rollout's tokens per second."""

    card: str
    stages: dict            # stage -> Stage
    generated_tokens: int
    settings: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    def seconds(self, *stages) -> float:
        return sum(self.stages[s].seconds for s in stages if s in self.stages)

    @property
    def rollout(self) -> float:
        return self.seconds("prefill", "decode")

    @property
    def update(self) -> float:
        compute = self.seconds("reference log-probs", "old log-probs", "forward", "log-probs", "loss", "backward")
        return max(compute, self.seconds("offload copies"))

    @property
    def optimizer(self) -> float:
        return self.seconds("optimizer")

    @property
    def total(self) -> float:
        """Seconds per optimizer step: a rollout serves `num_iterations` of them (the update runs each time)."""
        return self.rollout / self.settings.get("num_iterations", 1) + self.update + self.optimizer

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.rollout if self.rollout else float("inf")

    def table(self) -> str:
        rows = [f"| {self.card} | seconds | kernels | TFLOP | GB moved | bound by |", "|---|---:|---:|---:|---:|---|"]
        for name, s in self.stages.items():
            bound = "host (launches)" if s.host_seconds > s.gpu_seconds else "GPU"
            rows.append(f"| {name} | {s.seconds:.3f} | {s.kernels:,} | {s.flops / 1e12:.2f} | {s.bytes / 1e9:.2f} | {bound} |")
        rows.append(f"| **step** (rollout {self.rollout:.2f} s{self._rate()}; update {self.update:.2f} s; optimizer "
                    f"{self.optimizer:.3f} s) | **{self.total:.2f}** | | | | |")
        return "\n".join(rows)

    def _rate(self) -> str:
        return f", {self.tokens_per_second:,.0f} tokens/s" if self.generated_tokens and self.rollout else ""

    def __repr__(self):
        return (f"StepTime({self.card}: {self.total:.2f} s/step, rollout {self.rollout:.2f} s{self._rate()}, "
                f"update {self.update:.2f} s)")


def price(trace: OpTrace, card, settings: dict, *, graph_decode: bool = True, serial: bool = False,
          host_s: float = EAGER_S) -> StepTime:
    """Price `trace` (a step recorded at `settings`, those of `simulate_step`) on `card`.

    `graph_decode`: the decode step's model call replays a CUDA graph (grpo-nb's engine on CUDA) rather than
    launching each kernel (HF generate, TRL); a step on a growing KV cache (`trace.eager`: HF generate's, an
    episode's) launches each kernel either way. `serial`: host and device are one (a CPU): a kernel's time is its
    roofline plus `host_s`, nothing overlaps. `host_s`: seconds of host work per kernel launched, one number or by
    stage ({"decode": ..., "backward": ..., "default": ...}: a CPU's training stages carry autograd's work, its
    decode steps little beyond the op)."""
    card = find_card(card)
    need_bool("time", "graph_decode", graph_decode)
    need_bool("time", "serial", serial)
    host_of = _host_seconds(host_s)
    completion = settings["max_completion_length"]
    eager = getattr(trace, "eager", set())  # (a trace pickled before grpo-nb marked them has none)
    units: dict = {}   # (stage, unit) -> [gpu seconds, host seconds, kernels, flops, bytes]
    order = []
    sampled = set()  # the units whose sampling replays a graph of its own
    for op in trace.ops:
        if op.stage == "setup":
            continue
        # (a parked optimizer state's copies are the optimizer step's own, on its stream: grpo_nb.parking)
        stage = "offload copies" if op.kind == "transfer" and op.stage != "optimizer" else op.stage
        key = (stage, op.unit if stage in ("prefill", "decode") else 0)
        if key not in units:
            units[key] = [0.0, 0.0, 0, 0, 0]
            order.append(key)
        u = units[key]
        gpu = kernel_seconds(op, card)
        if op.kind == "transfer":
            u[0] += gpu
        else:
            replayed = getattr(op, "graphed", False)  # (a trace pickled before grpo-nb marked them has none)
            graphed = graph_decode and op.stage == "decode" and (op.in_model or replayed) and op.unit not in eager
            host = GRAPH_NODE_S if graphed else host_of(op.stage)
            if graphed and replayed and not op.in_model and key not in sampled:
                sampled.add(key)
                u[1] += GRAPH_LAUNCH_S  # the sampling's own graph (the forward's launch: below)
            u[0] += gpu + (0.0 if serial else KERNEL_S)
            u[1] += host
            u[2] += 1
        u[3] += op.flops
        u[4] += op.bytes
    def replayed(key) -> bool:
        return graph_decode and key[0] == "decode" and key[1] not in eager

    for key in order:
        if replayed(key):
            units[key][1] += GRAPH_LAUNCH_S

    def seconds(u, key):
        if serial or replayed(key):  # measured: a replay's launch, then its kernels
            return u[0] + u[1]
        return max(u[0], u[1])

    repeats = {key: trace.repeats.get(key[1], 1) if key[0] == "decode" else 1 for key in order}
    stages: dict = {}
    for key in order:
        u, r = units[key], repeats[key]
        s = stages.setdefault(key[0], Stage(0.0, 0, 0, 0, 0.0, 0.0))
        s.seconds += r * seconds(u, key)
        s.gpu_seconds += r * u[0]
        s.host_seconds += r * u[1]
        s.kernels += round(r * u[2])
        s.flops += r * u[3]
        s.bytes += r * u[4]
    rows = settings["prompts_per_step"] * settings["num_generations"] if settings.get("rollout", True) else 0
    notes = []
    if settings.get("device") == "cpu" and card.capability != (0, 0):
        notes.append("a simulation of the CPU's step (dynamic KV cache, no CUDA graph, no Triton kernels, no "
                     "offloaded activations) priced on a GPU: simulate with device='cuda' for the GPU's own step")
    if settings.get("num_iterations", 1) > 1 and settings.get("rollout", True):
        notes.append(f"a rollout serves num_iterations={settings['num_iterations']} optimizer steps: the total is "
                     f"per optimizer step, with the rollout's time divided by {settings['num_iterations']}")
    pieces, decoded = {piece for _, _, piece in trace.calls.values()}, trace.decode_units()
    if completion > 1 and any(piece not in decoded for piece in pieces):
        notes.append("a rollout piece recorded no decode step: its decode is not priced")
    turns = settings.get("tool_turns", 1)
    if turns > 1:  # an episode samples its turns' share of the budget; the tool results are not generated
        completion = turns * turn_budget(completion, turns, settings.get("tool_result_tokens", 0))
        notes.append(f"episodes of {turns} turns: the rollout is the model's work alone (each turn's prefill and "
                     f"decode steps); the tools' own time and the host's work between turns (parsing calls, "
                     f"templates) are not priced")
    return StepTime(card.name, stages, rows * completion, dict(settings), notes)

