"""The generic registry: lazy ``"module:attr"`` entries are imported on first ``get`` only, unknown
names and clashing registrations fail with the kind and the known names."""

from __future__ import annotations

import sys

import pytest

from darts_bench.registry import Registry


def test_lazy_entries_are_imported_on_first_get(tmp_path, monkeypatch):
    (tmp_path / "reg_probe_mod.py").write_text("class Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry("widget", {"t": "reg_probe_mod:Thing"})
    assert reg.names() == ["t"] and "t" in reg and len(reg) == 1
    assert "reg_probe_mod" not in sys.modules  # listing imports nothing
    cls = reg.get("t")
    assert cls.__name__ == "Thing" and reg.get("t") is cls
    reg.register("t", "reg_probe_mod:Thing")  # the same target again: no-op


def test_register_decorator_unknown_names_and_clashes():
    reg = Registry("widget")

    @reg.register("a")
    class A:
        pass

    assert reg.get("a") is A
    with pytest.raises(KeyError, match=r"unknown widget 'b'; known widgets: \['a'\]"):
        reg.get("b")
    with pytest.raises(ValueError, match="widget 'a' registered twice"):
        reg.register("a", object())
    with pytest.raises(ValueError, match="not 'module:attribute'"):
        reg.register("c", "no_colon_here")
    reg.register("d", "darts_bench_no_such_module:X")
    with pytest.raises(ImportError, match="widget 'd': cannot load 'darts_bench_no_such_module:X'"):
        reg.get("d")
