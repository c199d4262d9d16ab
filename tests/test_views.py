"""Interactive views: each draws a figure, redraws when a control moves, and carries a
static PNG for frontends without widgets (nbval, plain viewers)."""
import math

import pytest
import torch
from matplotlib.figure import Figure

import gpulab
from gpulab import attention, paged
from gpulab.harness import views


def score_rows(kind):
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 1024, generator=g) * 2.0
    return s + torch.linspace(0, 8, 1024) if kind == "recency" else s


def make_cache(num_pages, page_size):
    return paged.PagedKVCache(num_pages, page_size, 1, 1, device="cpu")


def empty_kv(n):
    return torch.zeros(n, 1, 1), torch.zeros(n, 1, 1)


def test_running_max_view_redraws_when_tau_moves():
    view = views.running_max_view(score_rows, attention.running_max_trace, kinds=("recency", "iid"),
                                  show=False)
    first = view.png
    assert first.startswith(b"\x89PNG")
    view.controls["tau"].value = 0.0
    assert view.redraws == 1 and view.png != first
    bundle = view._repr_mimebundle_()
    assert {"application/vnd.jupyter.widget-view+json", "image/png", "text/plain"} <= set(bundle)


def test_page_pool_simulation_keeps_the_books():
    requests = views.request_trace(n=12, steps=40)
    snaps = views.simulate_pool(make_cache, 8, 256, requests, 40, empty_kv)
    for owners, lens, running, waiting, finished in snaps:
        assert len(owners) == 256 // 8 and len(lens) == running
        for r, n in lens.items():               # a request holds exactly ceil(n / page) pages
            assert owners.count(r) == math.ceil(n / 8)
        assert sum(lens.values()) <= 256
    assert snaps[-1][4] > 0                      # some requests finished


def test_page_pool_view_steps_and_changes_page_size():
    view = views.page_pool_view(make_cache, empty_kv, page_sizes=(4, 16), page_size=16, slots=256,
                                steps=30, requests=views.request_trace(n=10, steps=30), show=False)
    before = view.png
    view.controls["step"].value = 3
    view.controls["page"].value = 4
    assert view.redraws == 2 and view.png != before


def test_roofline_view_places_the_measured_point():
    pts = views.roofline_points("softmax", "4096x4096", "bf16")
    c = pts["saved"]["ceilings"]
    assert pts["bound_s"] == pytest.approx(max(pts["bytes"] / c["bytes_per_s"], pts["flops"] / c["flops_per_s"]))
    assert pts["measured_ms"] > pts["bound_s"] * 1e3          # nothing beats the roofline
    assert "measured_ms" not in views.roofline_points("softmax", "4096x4096", "fp32")   # not saved
    view = views.roofline_view("softmax", show=False)
    before = view.png
    view.controls["case"].value = "8192x8192"
    view.controls["kernel"].value = "ternary_gemv"             # new kernel: its own shapes
    assert view.controls["case"].options[0] == gpulab.get_spec("ternary_gemv").cases["bench"][0].label
    assert view.png != before and "softmax" in views.roofline_kernels()


def test_without_ipywidgets_the_view_is_a_static_figure(monkeypatch):
    monkeypatch.setattr(views, "widgets", None)
    fig = views.running_max_view(score_rows, attention.running_max_trace, show=False)
    assert isinstance(fig, Figure)
