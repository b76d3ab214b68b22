"""What the decode step's Triton kernels (decode_attention, decode_qkv, decode_matmul,
decode_sampler) share:
whether a device can run them, its multiprocessor count, and how a failed kernel is named
in the warning of an "auto" fallback (`give_up`). Triton is imported only to check that it imports."""
from __future__ import annotations

import functools
import warnings

import torch


@functools.cache
def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def runs_on(tensor: torch.Tensor) -> bool:
    """Where "auto" uses the kernels: a CUDA GPU of compute capability 8.0 or newer (bf16
    tensor cores, where they were built and measured) with Triton importable."""
    return tensor.is_cuda and capability(tensor.device) >= (8, 0) and available()


@functools.cache
def processors(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (1 elsewhere: Triton's CPU interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def give_up(kernel: str, exc: BaseException, fallback: str) -> str:
    """Under "auto" a kernel's failure must not cost a rollout: warn once that `fallback`
    takes over and return the failure's one line (Triton's compile and launch errors share
    no base class), which the caller keeps so that "auto" stops choosing the kernel for the
    rest of the process."""
    message = str(exc).splitlines()[0][:300] if str(exc) else ""
    reason = f"{type(exc).__name__}: {message}"
    warnings.warn(f"{kernel}: the Triton kernel failed ({reason}); using {fallback}", RuntimeWarning, stacklevel=3)
    return reason
