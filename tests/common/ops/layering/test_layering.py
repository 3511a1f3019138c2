"""``common/ops`` sits below the model and the engine: no module of it imports either.

The check reads the source, so it sees every import a module can run: at the top, inside a
function (a lazy import climbs as surely as a top-level one), relative ones, and the dotted module
names the registry's tables hand to ``importlib``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

OPS = Path(__file__).resolve().parents[4] / "common" / "ops"
ABOVE_OPS = ("common.model", "common.engine", "prefill_service", "decode_service", "router")
# a module name as the registry writes one in a table ("common.ops.gdn.fla"), optionally ":attr"
_MODULE_NAME = re.compile(r"^[a-z_]\w*(\.\w+)+(:\w+)?$")


def _docstrings(tree: ast.Module) -> set[int]:
    """ids of the docstring nodes (prose may name any module)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def imported_names(source: str, module: str, *, is_package: bool = False) -> set[str]:
    """Every module name ``module``'s source may import: import statements anywhere (relative
    ones resolved against ``module``) and string constants shaped like module names."""
    tree = ast.parse(source)
    package = module if is_package else module.rpartition(".")[0]
    skip = _docstrings(tree)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in skip and _MODULE_NAME.match(node.value)):
            names.add(node.value.partition(":")[0])
    return names


def climbs(root: Path, package: str, above: tuple[str, ...] = ABOVE_OPS) -> list[str]:
    """``file: name`` for every import under ``root`` (the package ``package``) of a module in
    ``above`` or below one."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = [package, *rel.parts]
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        names = imported_names(path.read_text(), module, is_package=is_package)
        high = {n for n in names if any(n == a or n.startswith(a + ".") for a in above)}
        # ``from a.b import c`` yields a.b and a.b.c: report the module, not its attribute
        found += [f"{path.relative_to(root)}: {n}" for n in sorted(high)
                  if n.rpartition(".")[0] not in high]
    return found


def test_ops_import_nothing_above_them():
    assert OPS.is_dir()
    assert climbs(OPS, "common.ops") == []


def test_the_check_sees_every_kind_of_climb(tmp_path):
    """A climb at the top, inside a function, relative, and in a registry table is found; an
    import within ops and a docstring naming the model are not."""
    pkg = tmp_path / "ops"  # read as common.ops
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from ... import model\n")  # common.model
    (pkg / "top.py").write_text("from common.model.kernels import Kernels\n")
    (pkg / "lazy.py").write_text(
        '"""See common.model.kernels."""\n'
        "def f():\n"
        "    import common.engine.cuda_graph\n"
        "    from common.ops.registry import default_registry\n")
    (pkg / "table.py").write_text('OPS = {"x": "common.engine.llm_engine:attr"}\n')
    assert climbs(pkg, "common.ops") == [
        "lazy.py: common.engine.cuda_graph",
        "sub/__init__.py: common.model",
        "table.py: common.engine.llm_engine",
        "top.py: common.model.kernels",
    ]
