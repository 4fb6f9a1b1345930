"""The shipped typed stubs (_core.pyi, py.typed) describe the compiled module exactly."""

import ast
import inspect
from pathlib import Path

import atom_sched
from atom_sched import _core

PACKAGE_DIR = Path(atom_sched.__file__).parent
# pybind11 gives every class an __init__ (raising when no constructor is bound): not compared.
PUBLIC_DUNDERS = {"__len__", "__iter__", "__contains__"}


def stub_tree() -> ast.Module:
    return ast.parse((PACKAGE_DIR / "_core.pyi").read_text())


def stub_members(cls: ast.ClassDef) -> set[str]:
    names = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name != "__init__":
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _public(name: str) -> bool:
    return not name.startswith("_") or name in PUBLIC_DUNDERS


def module_members(cls: type) -> set[str]:
    return {name for name in vars(cls) if _public(name)}


def test_stubs_and_marker_are_installed():
    assert (PACKAGE_DIR / "_core.pyi").is_file()
    assert (PACKAGE_DIR / "py.typed").is_file()


def test_every_stub_class_matches_the_module():
    classes = [n for n in stub_tree().body if isinstance(n, ast.ClassDef)]
    assert classes
    for cls in classes:
        real = getattr(_core, cls.name)
        assert inspect.isclass(real), cls.name
        if issubclass(real, BaseException):
            continue
        stubbed = stub_members(cls)
        assert {n for n in stubbed if _public(n)} == module_members(real), cls.name
        # Private helpers stubbed for the package's own modules (compat) exist too.
        assert all(hasattr(real, n) for n in stubbed if not _public(n)), cls.name


def test_every_module_name_has_a_stub():
    tree = stub_tree()
    stubbed = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    stubbed |= {n.target.id for n in tree.body
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    public = {name for name in dir(_core) if not name.startswith("_")}
    assert {n for n in stubbed if not n.startswith("_")} == public
    assert all(hasattr(_core, n) for n in stubbed if n.startswith("_"))


def test_package_exports_what_the_module_has():
    for name in atom_sched.__all__:
        assert hasattr(atom_sched, name), name
