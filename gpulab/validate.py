"""Input validation shared by every public launcher: fail before launch, say what to fix."""
from __future__ import annotations

import torch

from . import runtime

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _dt(d) -> str:
    return str(d).replace("torch.", "")


def require_tensor(name: str, t, *, ndim: int | None = None, shape=None, dtype=None,
                 dtypes=None, contiguous: bool = True, any_device: bool = False) -> None:
    """A tensor of the expected rank/shape/dtype, contiguous, on a device that can run
    gpulab's kernels (``any_device=True`` for plain-PyTorch functions)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must be {_dt(dtype)}, got {_dt(t.dtype)}: convert with .to({dtype})")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must be one of {', '.join(map(_dt, dtypes))}, got {_dt(t.dtype)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {t.stride()} for shape "
                         f"{tuple(t.shape)}): pass {name}.contiguous()")
    if not runtime.COMPILE_ONLY and not any_device:
        runtime.check_device(name, t)


def require_rows(name: str, t, **kw) -> None:
    """:func:`require_tensor`, but only the last dimension must be contiguous: the kernels
    take every other stride (a q sliced out of a fused QKV projection, a cache view of one
    layer), so no copy is needed."""
    require_tensor(name, t, contiguous=False, **kw)
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (strides {t.stride()} for shape "
                         f"{tuple(t.shape)}): pass {name}.contiguous()")


def require_float(name: str, t) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {_dt(t.dtype)}")


def require_same_device(**tensors) -> None:
    devices = {k: v.device for k, v in tensors.items() if isinstance(v, torch.Tensor)}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{k} on {d}" for k, d in devices.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")


def require_index_range(name: str, t: torch.Tensor, low: int, high: int, what: str = "") -> None:
    """Every entry of an index tensor in [low, high): checked on the host before launch,
    because an out-of-range index on the GPU reads or writes someone else's memory."""
    if t.numel() == 0:
        return
    lo, hi = int(t.min()), int(t.max())
    if lo < low or hi >= high:
        bad = ((t < low) | (t >= high)).nonzero()[0].tolist()
        raise IndexError(f"{name}{list(bad)} = {int(t[tuple(bad)])} is outside [{low}, {high})"
                         + (f": {what}" if what else ""))
