"""Small helpers the test modules share (pytest puts tests/ on sys.path)."""
import torch

import gpulab
from gpulab.engine.model import NEAR_TIE, TINY, TernaryTransformer, encode_prompt, first_flip

# the engine's test prompts: a one-byte one, a long one, two sharing a system prompt
SYSTEM = "You are a poet of the old school. Answer in verse: "
PROMPTS = ["a", "Tyger Tyger, burning bright", "Shall I compare thee to a summer's day? Thou art more",
           SYSTEM + "the sea", SYSTEM + "the moon at night", "0123456789abcde"]


def on_gpu() -> bool:
    return gpulab.mode() == "compiled"


def tiny_transformer() -> TernaryTransformer:
    """The engine tests' model: the tiny configuration, seeded, packed, float32."""
    torch.manual_seed(1234)
    return TernaryTransformer(TINY).pack().to(gpulab.device())


def force_eos(monkeypatch, request_id: str, index: int) -> None:
    """Make token number ``index`` (from 0) of request ``request_id`` EOS wherever the
    engine samples a step's tokens on the device."""
    import gpulab.engine.engine as engine_module
    import gpulab.engine.sampling as sampling_module
    from gpulab.engine.model import EOS
    real = sampling_module.sample_on_device

    def sample(logits, seqs):
        tokens = real(logits, seqs)
        for i, s in enumerate(seqs):
            if s.request_id == request_id and s.num_output_tokens == index:
                tokens = tokens.clone()
                tokens[i] = EOS
        return tokens

    monkeypatch.setattr(sampling_module, "sample_on_device", sample)
    monkeypatch.setattr(engine_module, "sample_on_device", sample)


def assert_same_text_stopping_at_eos(model, configs, max_tokens: int, stop_len: int) -> None:
    """Serve PROMPTS[:3] under each EngineConfig of ``configs``, request "1" made to stop at
    EOS as its token ``stop_len`` (:func:`force_eos` with the engine's own sampling, or a
    patch of its own): it stops there with reason "eos", every page is free afterwards,
    and every config gives the same tokens."""
    from gpulab.engine.engine import LLM
    from gpulab.engine.model import EOS
    from gpulab.engine.sequence import SamplingParams
    runs = []
    for cfg in configs:
        llm = LLM(model, cfg)
        outs = llm.generate(PROMPTS[:3], [SamplingParams(max_tokens=max_tokens) for _ in range(3)])
        runs.append([o.token_ids for o in outs])
        assert outs[1].token_ids[-1] == EOS and len(outs[1].token_ids) == stop_len, cfg
        assert outs[1].completions[0].finish_reason == "eos" and llm.idle(), cfg
    assert all(r == runs[0] for r in runs[1:])


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


def load_tool(name: str):
    """A script of tools/ as a module (tools/ is not a package): ``load_tool("compiled_ledger")``."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name.replace("-", "_"), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mutant_module(module, name: str, *edits):
    """``module``'s source (a gpulab kernel file) with (old, new) edits, imported as a module
    of its own: a real wrong kernel for the checks to reject. Each ``old`` must occur."""
    import importlib.util
    import re
    import sys
    import tempfile
    from pathlib import Path
    src = re.sub(r"^from \.(\w*) import", lambda m: f"from gpulab{'.' if m[1] else ''}{m[1]} import",
                 Path(module.__file__).read_text(), flags=re.M)
    for old, new in edits:
        assert src.count(old) >= 1, old
        src = src.replace(old, new)
    stem = f"{module.__name__.rsplit('.', 1)[-1]}_{name}"
    path = Path(tempfile.mkdtemp(prefix="gpulab_mutants_")) / f"{stem}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def assert_tokens_match(model, prompts, got, want, near_tie=NEAR_TIE[torch.float32]):
    """Equal greedy tokens; on a GPU (Triton kernels vs PyTorch reference: other rounding),
    a difference is accepted only where the reference's two candidates are a near tie
    (:func:`gpulab.engine.model.first_flip`, which tools/speculative_bench.py shares)."""
    for p, g, w in zip(prompts, got, want):
        flip = first_flip(model, encode_prompt(p), g, w, near_tie)
        if flip is None:
            continue
        assert on_gpu(), f"{p!r}: {g} != reference {w}"
        assert flip.near_tie, f"{p!r}: {flip.describe()}"
