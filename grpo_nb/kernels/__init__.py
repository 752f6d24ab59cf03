"""grpo-nb's own kernels, each beside the PyTorch reference it must match and checked against it before first use.

Triton (GPU): the completion log-probs (`logprobs_triton`), RMSNorm (`rms_norm_triton`), a static decode step's work
between its products (`decode_triton`, chosen by `decode_glue`) and the sampling after it (`sample_triton`), loaded on
first use by `grpo_nb.logprobs` / `grpo_nb.rms_norm` / `decode_glue`, so the package works without triton and
`TRITON_INTERPRET=1` (the CPU interpreter) may be set any time before that first use.

C (a CPU rollout's decode steps, compiled on first use by `native`): attention over the cache (`cpu_attention`),
few-row bf16 products with AMX (`cpu_linear`), the steps between the products (`cpu_decode_ops`). Where one cannot
be built or fails its check, the caller runs torch's ops.
"""

# Where a kernel called on the meta device reports its work (a Triton launch runs nothing there): set by
# grpo_nb.simulate.device - (name, FLOPs, bytes, dtype, *the tensors it writes) to the time simulation's op record
# and the simulated device, which forgets any values it knew for them. None when no simulation is loaded.
meta_launch = None


def report_meta(name: str, flops: int, nbytes: int, dtype, *written) -> None:
    """A Triton kernel's work, called on the meta device, to `meta_launch` where a simulation set it."""
    if meta_launch is not None:
        meta_launch(name, flops, nbytes, dtype, *written)


def on_device(device):
    """The context a Triton launch for tensors on `device` runs in: Triton launches on the current CUDA device, so
    the tensors' own (a model on cuda:1 while cuda:0 is current); nothing to do elsewhere."""
    import contextlib

    import torch

    device = torch.device(device)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def triton_interpreted(kernel) -> bool:
    """Whether a `triton.jit` kernel runs on Triton's CPU interpreter (TRITON_INTERPRET=1 when it was jitted)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - other triton layouts
        return False
    return isinstance(kernel, InterpretedFunction)


def self_tested(verdicts: dict, key: tuple, kernel: str, fallback: str, check) -> bool:
    """Whether a kernel may run for `key` ((device, ...): what its correctness may depend on): `check()` - the
    kernel against its PyTorch reference, True where they agree - run once per key, its verdict kept in `verdicts`.
    A GPU, driver or Triton version the kernel never ran on could fail to compile it, run out of shared memory or
    compute other numbers; then the caller falls back to the PyTorch ops with a warning instead of stopping (or,
    worse, training on wrong numbers). No verdict while a CUDA graph is being captured (the check reads results
    back) or when the check ran out of memory: False then, and asked again at the next call."""
    import torch

    if key in verdicts:
        return verdicts[key]
    if str(key[0]).startswith("cuda") and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    try:  # only True passes: a check answering a tensor, a string or None has not said the results agree
        ok, reason = check() is True, "its results differ from the PyTorch reference"
    except torch.OutOfMemoryError:
        return False
    except Exception as e:  # compile errors, out of resources, driver issues
        ok, reason = False, f"{type(e).__name__}: {str(e)[:200]}"
    if not ok:
        import warnings

        warnings.warn(f"grpo-nb's {kernel} failed its self-test on {key[0]} ({reason}); using {fallback}. Please "
                      "report this.", RuntimeWarning, stacklevel=4)
    verdicts[key] = ok
    return ok
