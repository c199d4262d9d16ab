"""Measure how long each solution notebook takes to run top to bottom.

    python tools/time_notebooks.py OUT_DIR [--label gpu] [NN ...]

Runs every ``solutions/NN_*.ipynb`` (or the listed NN) in a fresh kernel with nbclient,
in the notebook's folder, and writes ``OUT_DIR/notebook_times_<label>.json``:
``{"label", "date", "machine", "ci", "seconds": {notebook: s}, "failed": {notebook: error}}``.
The environment decides the mode: ``CI=true`` shortens demos (as the test suite runs
them), without it the notebooks run in full, as a learner runs them. Copy the result
into ``gpulab/data/notebook_times.json`` under its label (``cpu_ci``, ``cpu``, ``gpu``)
and run ``gpulab generate``: each notebook's opening cell quotes it.
On the H200: ``python tools/time_notebooks.py /tmp/times --label gpu`` (no CI set).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]


def machine() -> str:
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:
        pass
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--label", default="gpu")
    p.add_argument("only", nargs="*", help="notebook numbers (default: all)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per cell")
    a = p.parse_intermixed_args(argv)
    env_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    os.environ["PYTHONPATH"] = env_path
    result = {"label": a.label, "date": datetime.date.today().isoformat(), "machine": machine(),
              "ci": bool(os.environ.get("CI")), "seconds": {}, "failed": {}}
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        if a.only and path.name[:2] not in a.only:
            continue
        nb = nbformat.read(path, as_version=4)
        client = NotebookClient(nb, timeout=a.timeout, kernel_name="python3",
                                resources={"metadata": {"path": str(path.parent)}})
        start = time.perf_counter()
        try:
            client.execute()
        except Exception as e:  # report and go on: the other notebooks still count
            result["failed"][path.name] = f"{type(e).__name__}: {str(e)[:300]}"
        result["seconds"][path.name] = round(time.perf_counter() - start, 1)
        print(f"{path.name}: {result['seconds'][path.name]} s", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    out = a.out / f"notebook_times_{a.label}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", out)
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
