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

import functools
import math
import re
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
    # A matmul of few rows reaches less than its roofline on some machines (a CPU's BLAS at 1-16 rows): (rows,
    # fraction of the roofline reached) measured at a few row counts, interpolated between; empty: the roofline.
    matmul_efficiency: tuple = ()
    # Products timed one by one on the machine itself (a CPU's BLAS is far from one rate across shapes): ((rows,
    # columns, inner, dtype name), seconds) pairs; a recorded matmul of a shape found here costs what was measured.
    matmul_seconds: tuple = ()

    @functools.cached_property
    def _measured(self) -> dict:
        return dict(self.matmul_seconds)

    def measured_matmul(self, shape: tuple, dtype_name: str) -> float | None:
        """The seconds measured for a (rows, columns, inner) product in `dtype_name`, or None."""
        return self._measured.get((*shape, dtype_name)) if self.matmul_seconds else None

    def matmul_rate(self, dtype_name: str) -> float:
        return self.matmul.get(dtype_name, self.matmul["fp32"])

    def efficiency(self, rows: int) -> float:
        """The fraction of its roofline a matmul of `rows` rows reaches (log-linear between measured points)."""
        points = self.matmul_efficiency
        if not points or rows <= 0:
            return 1.0
        if rows <= points[0][0]:
            return points[0][1]
        for (r0, e0), (r1, e1) in zip(points, points[1:]):
            if rows <= r1:
                w = (math.log(rows) - math.log(r0)) / (math.log(r1) - math.log(r0))
                return e0 + w * (e1 - e0)
        return points[-1][1]


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


def card(name) -> Card:
    """A card of `CARDS` by its name or the name `torch.cuda.get_device_name()` reports ("Tesla T4", "NVIDIA
    A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA H100 80GB HBM3"); a `Card` is checked and returned as it is.
    A name matches the cards whose model ("A100") is one of its words, then the one whose variant ("80GB",
    "PCIe") is among them too, else the model's first card (an A100 of unknown size: the 40 GB one)."""
    if isinstance(name, Card):
        check_card(name)
        return name
    words = [w for w in re.split(r"[\s_-]+", str(name).upper()) if w and w not in ("NVIDIA", "TESLA", "GEFORCE")]
    words += [a + b for a, b in zip(words, words[1:])]  # "RTX 4090" -> RTX4090
    found = [c for c in CARDS if c.split("-")[0].upper() in words]
    variant = [c for c in found if "-" in c and c.split("-", 1)[1].upper() in words]
    if variant or found:
        return CARDS[(variant or found)[0]]
    raise ValueError(f"card={name!r} is not a card grpo-nb can price: expected one of {sorted(CARDS)} (or the name "
                     f"torch.cuda.get_device_name() gives for one of them), or a grpo_nb.gpus.Card with your own "
                     f"measured speeds")


def check_card(c: Card) -> None:
    """A hand-made Card's fields, in the units pricing reads them (FLOP/s and bytes/s, not TFLOPS or GB/s)."""
    def bad(field, value, expected):
        raise ValueError(f"Card {c.name!r}: {field}={value!r} is invalid: expected {expected}")

    ok = lambda v, low: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= low  # noqa: E731
    if not isinstance(c.matmul, dict) or "fp32" not in c.matmul:
        bad("matmul", c.matmul, "a dict of FLOP/s by dtype name with at least 'fp32' (and 'fp16', 'bf16'; a missing "
            "one is priced at the fp32 rate)")
    for key, value in c.matmul.items():
        if key not in ("fp16", "bf16", "fp32"):
            bad("matmul", c.matmul, f"keys 'fp16', 'bf16', 'fp32' only, not {key!r}")
        if not ok(value, 1e8):
            bad(f"matmul[{key!r}]", value, "FLOP/s as a finite number >= 1e8 (300 TFLOPS is 300e12)")
    if not ok(c.bandwidth, 1e8):
        bad("bandwidth", c.bandwidth, "bytes/s as a finite number >= 1e8 (2 TB/s is 2e12)")
    if not (ok(c.host_link, 1e6) or c.host_link == math.inf):
        bad("host_link", c.host_link, "bytes/s as a number >= 1e6 (25 GB/s is 25e9), or math.inf where there is none")
    if not isinstance(c.name, str) or not c.name:
        bad("name", c.name, "a non-empty string")
    if isinstance(c.sms, bool) or not isinstance(c.sms, int) or c.sms < 1:
        bad("sms", c.sms, "the number of streaming multiprocessors, an integer >= 1 (a CPU: its cores)")
    cap = c.capability
    if not (isinstance(cap, tuple) and len(cap) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in cap)):
        bad("capability", cap, "the compute capability as a (major, minor) pair of integers, e.g. (8, 0); (0, 0) for "
            "a device that is no NVIDIA GPU")
    if not isinstance(c.matmul_efficiency, tuple):
        bad("matmul_efficiency", c.matmul_efficiency, "a tuple of (rows, fraction) pairs, or () for the roofline")
    for point in c.matmul_efficiency:
        if not (isinstance(point, tuple) and len(point) == 2 and ok(point[0], 1) and ok(point[1], 1e-6) and point[1] <= 1):
            bad("matmul_efficiency", c.matmul_efficiency, "(rows, fraction of the roofline in (0, 1]) pairs, rows "
                "increasing")
    if not isinstance(c.matmul_seconds, tuple):
        bad("matmul_seconds", c.matmul_seconds, "a tuple of ((rows, columns, inner, dtype name), seconds) pairs, or ()")
    for entry in c.matmul_seconds:
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], tuple) and len(entry[0]) == 4
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in entry[0][:3])
                and entry[0][3] in ("fp16", "bf16", "fp32") and ok(entry[1], 0) and entry[1] > 0):
            bad("matmul_seconds", entry, "((rows, columns, inner, 'fp16' | 'bf16' | 'fp32'), seconds > 0) with "
                "positive integer sizes")
    shapes = [entry[0] for entry in c.matmul_seconds]
    if len(set(shapes)) != len(shapes):
        twice = next(shape for shape in shapes if shapes.count(shape) > 1)
        bad("matmul_seconds", twice, "each (rows, columns, inner, dtype) once: this one has two times")
