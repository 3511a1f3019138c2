"""fla hidden from transformers' imports only: inside the block it cannot be imported, after it
everything is as it was."""

from __future__ import annotations

import importlib
import sys
import types

import pytest

from common.training.transformers_import import MODELING_MODULES, fla_hidden


def test_fla_is_unimportable_inside_and_restored_after(monkeypatch):
    fake, fake_ops = types.ModuleType("fla"), types.ModuleType("fla.ops")
    fake.__path__ = []  # a package, so `fla.ops` is a submodule of it
    monkeypatch.setitem(sys.modules, "fla", fake)
    monkeypatch.setitem(sys.modules, "fla.ops", fake_ops)
    with fla_hidden():
        with pytest.raises(ImportError):
            importlib.import_module("fla")
        with pytest.raises(ImportError):
            importlib.import_module("fla.ops")
    assert sys.modules["fla"] is fake and sys.modules["fla.ops"] is fake_ops


def test_nothing_is_left_behind_when_fla_was_never_imported(monkeypatch):
    for name in [n for n in sys.modules if n == "fla" or n.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    with fla_hidden():
        pass
    assert "fla" not in sys.modules


def test_the_oracle_modules_are_imported_by_the_test_setup():
    # tests/conftest.py imports them with fla hidden before any test module does
    assert all(name in sys.modules for name in MODELING_MODULES)
