"""The engine decides graph policy from what backends declare (common/ops/graph_capabilities.py),
never from their names: no string in common/engine is a GPU backend's name."""

from __future__ import annotations

import ast
from pathlib import Path

from common.ops.registry import GPU_OPS

ENGINE = Path(__file__).resolve().parents[3] / "common" / "engine"


def backend_names_in(source: str, names: set[str]) -> list[str]:
    """Each string constant of ``source`` (docstrings and comments aside) that is in ``names``,
    or a tuple/set/list display holding one."""
    tree = ast.parse(source)
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)}
    return [n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
            and n.value in names]


def test_the_engine_names_no_backend():
    names = {backend for backends in GPU_OPS.values() for backend in backends}
    assert {"flashinfer", "triton", "capturable"} <= names
    found = {path.name: backend_names_in(path.read_text(), names)
             for path in sorted(ENGINE.glob("*.py"))}
    assert {name: hits for name, hits in found.items() if hits} == {}


def test_the_check_sees_a_name():
    names = {"flashinfer", "triton"}
    source = ('"""Uses flashinfer."""\n'
              'ok = backend == "flashinfer"\n'
              'cap = 64 if moe in ("capturable", "triton") else 0\n')
    assert backend_names_in(source, names) == ["flashinfer", "triton"]
