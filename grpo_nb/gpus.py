"""How fast the GPUs people train on are: the numbers the time simulation prices a step with.

Each card carries its published peaks (dense tensor-core FLOP/s per dtype, FP32 on CUDA cores, memory
bandwidth) and what a program reaches of them, each with its source:

* `matmul`: torch.matmul's measured throughput on large square matrices per dtype (the community table
  github.com/zzc0721/torch-performance-test-data database.md, 2*N^3 FLOPs over 30 timed iterations), which is
  what cuBLAS reaches in practice (64% of the datasheet's fp16 peak on a T4, ~80% on an A100 or H100). A
  dtype the card has no hardware for (bf16 on a T4 or P100) is emulated there at the measured rate.
* `bandwidth`: 80% of the datasheet's memory bandwidth ("even just copying memory struggles to break 85%" on
  an A100, pytorch.org/blog/accelerating-generative-ai-2; STREAM-style copies reach 80-90% on HBM and GDDR6).
* `host_link`: pinned host<->device copies measured per direction (bandwidthTest / nvbandwidth reports: PCIe
  gen3 ~12 GB/s, github.com/mpicbg-scicomp/gearshifft/pull/82; gen4 ~25 GB/s, github.com/NVIDIA/nvbandwidth
  issues 42 and 53; gen5 ~35 GB/s host to device, nvbandwidth issue 24).

Datasheet figures (dense, i.e. half of NVIDIA's "with sparsity" numbers from Ampere on): T4 65 TFLOPS fp16,
8.1 fp32, 320 GB/s (NVIDIA T4 datasheet); L4 121 fp16/bf16, 30.3 fp32, 300 GB/s (NVIDIA L4 datasheet); P100
PCIe 18.7 fp16 on CUDA cores (no tensor cores), 9.3 fp32, 732 GB/s (NVIDIA P100 datasheet); A10G 70 fp16/bf16,
31.2 fp32, 600 GB/s (AWS A10G datasheet, via baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference);
A100 SXM 312 fp16/bf16, 19.5 fp32, 1555 GB/s (40 GB) or 2039 GB/s (80 GB) (NVIDIA A100 datasheet); H100 SXM
989 fp16/bf16, 67 fp32, 3350 GB/s; H100 PCIe 756, 51, 2000 GB/s (NVIDIA H100 datasheet); H200 as H100 SXM
with 4800 GB/s (NVIDIA H200 datasheet). SM counts and compute capabilities from deviceQuery /
`torch.cuda.get_device_properties`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TERA, GIGA = 1e12, 1e9


@dataclass(frozen=True)
class Card:
    """A GPU's speeds, in FLOP/s and bytes/s as programs reach them (see the module docstring)."""

    name: str
    capability: tuple
    sms: int
    matmul: dict            # dtype name -> FLOP/s torch.matmul reaches (fp16, bf16, fp32)
    bandwidth: float        # bytes/s a kernel streaming memory reaches
    host_link: float        # bytes/s of pinned host<->device copies, per direction
    peak: dict = field(default_factory=dict)  # the datasheet: dtype -> FLOP/s, "memory" -> bytes/s
    notes: str = ""

    def matmul_rate(self, dtype_name: str) -> float:
        return self.matmul.get(dtype_name, self.matmul["fp32"])


def _card(name, capability, sms, fp16, bf16, fp32, peak_fp16, peak_fp32, memory_gbs, link_gbs, notes=""):
    return Card(name, capability, sms, {"fp16": fp16 * TERA, "bf16": bf16 * TERA, "fp32": fp32 * TERA},
                0.8 * memory_gbs * GIGA, link_gbs * GIGA,
                {"fp16": peak_fp16 * TERA, "fp32": peak_fp32 * TERA, "memory": memory_gbs * GIGA}, notes)


# name, (major, minor), SMs, measured matmul TFLOPS fp16 / bf16 / fp32, datasheet fp16 / fp32 TFLOPS, GB/s, link
CARDS = {card.name: card for card in (
    _card("T4", (7, 5), 40, 41.9, 2.46, 4.17, 65, 8.1, 320, 12, "no bf16 hardware: bf16 is emulated (2.5 TFLOPS)"),
    _card("P100", (6, 0), 56, 8.39, 6.11, 8.63, 18.7, 9.3, 732, 12, "no tensor cores, no bf16 hardware"),
    _card("L4", (8, 9), 58, 68.8, 70.9, 15.4, 121, 30.3, 300, 25),
    _card("A10G", (8, 6), 80, 69.5, 69.5, 23.4, 70, 31.2, 600, 25),
    _card("A100-40GB", (8, 0), 108, 247.6, 246.3, 18.1, 312, 19.5, 1555, 25),
    _card("A100-80GB", (8, 0), 108, 258.7, 264.5, 19.2, 312, 19.5, 2039, 25),
    _card("H100", (9, 0), 132, 760.0, 797.5, 51.9, 989, 67, 3350, 35),
    _card("H100-PCIe", (9, 0), 114, 458.0, 495.9, 37.0, 756, 51, 2000, 35),
    _card("H200", (9, 0), 132, 759.4, 790.3, 51.3, 989, 67, 4800, 35),
)}
_ALIASES = {"A100": "A100-40GB", "H100-SXM": "H100", "H200-SXM": "H200", "TESLAT4": "T4", "TESLAP100": "P100",
            "P100-PCIE": "P100", "P100-PCIE-16GB": "P100", "A100-SXM4-40GB": "A100-40GB", "A100-SXM4-80GB": "A100-80GB",
            "H10080GBHBM3": "H100", "H100-80GB-HBM3": "H100", "H100PCIE": "H100-PCIe"}


def card(name) -> Card:
    """A card of `CARDS` by its name or the name `torch.cuda.get_device_name()` reports ("Tesla T4",
    "NVIDIA A100-SXM4-80GB"); a `Card` is returned as it is."""
    if isinstance(name, Card):
        return name
    key = str(name).upper().replace("NVIDIA", "").strip().replace(" ", "-").strip("-")
    known = {k.upper(): k for k in CARDS}
    for candidate in (key, key.replace("-", ""), key.removeprefix("TESLA-")):
        if candidate in known:
            return CARDS[known[candidate]]
        if candidate in _ALIASES:
            return CARDS[_ALIASES[candidate]]
    raise ValueError(f"card={name!r} is not a card grpo-nb can price: expected one of {sorted(CARDS)} (or the name "
                     f"torch.cuda.get_device_name() gives for one of them), or a grpo_nb.gpus.Card with your own "
                     f"measured speeds")
