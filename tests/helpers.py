"""Small helpers the test modules share (pytest puts tests/ on sys.path)."""
import torch

import gpulab


def on_gpu() -> bool:
    return gpulab.mode() == "compiled"


def few(name: str, labels: tuple) -> dict:
    """A wrong kernel needs only the cases that expose it (keeps the CPU run short)."""
    cases = gpulab.get_spec(name).cases["gpu" if on_gpu() else "cpu"]
    return dict(cases=[c for c in cases if c.label in labels], dtypes=[torch.float32])


def subprocess_env(root) -> dict:
    """The environment for a child Python that must import this checkout's gpulab: the
    repository first, then whatever PYTHONPATH already held (an offline GPU host finds
    nbformat & co. there)."""
    import os
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(root) + (os.pathsep + path if path else "")}
