"""GPULAB_SHARD=k/n (tests/conftest.py) splits the suite into n disjoint parts whose union
is the whole suite: a compiled run spread over several GPU calls runs every test once."""
from types import SimpleNamespace

import pytest

import conftest


def _shard(items, monkeypatch, shard):
    monkeypatch.setenv("GPULAB_SHARD", shard)
    dropped = []
    config = SimpleNamespace(hook=SimpleNamespace(pytest_deselected=lambda items: dropped.extend(items)))
    kept = list(items)
    conftest.pytest_collection_modifyitems(config, kept)
    return kept, dropped


def test_shards_are_disjoint_and_cover_the_suite(monkeypatch):
    items = [SimpleNamespace(nodeid=f"tests/test_{f}.py::test_{i}") for f in "abc" for i in range(40)]
    parts = []
    for k in (1, 2, 3):
        kept, dropped = _shard(items, monkeypatch, f"{k}/3")
        assert len(kept) + len(dropped) == len(items) and kept
        parts.append({it.nodeid for it in kept})
    assert set().union(*parts) == {it.nodeid for it in items} and sum(map(len, parts)) == len(items)


@pytest.mark.parametrize("bad", ["0/2", "3/2", "1", "a/b"])
def test_a_bad_shard_is_a_usage_error(monkeypatch, bad):
    with pytest.raises(pytest.UsageError, match="GPULAB_SHARD must be k/n"):
        _shard([SimpleNamespace(nodeid="x")], monkeypatch, bad)
