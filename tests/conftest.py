"""Without a GPU, Triton kernels run on Triton's CPU interpreter; this must be set before any
test module imports them, whichever module pytest collects first."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
