"""Every backend implements the whole contract, with the same signatures."""

import ast
import pathlib

import pytest

from keras_dist._src.backend import contract

BACKEND_DIR = pathlib.Path(contract.__file__).parent
BACKENDS = ["jax_backend", "tensorflow_backend", "torch_backend"]


def _functions(tree):
    return {
        node.name: node
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
    }


def _params(node):
    args = node.args
    return [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]


def _protocol_methods(name):
    tree = ast.parse(pathlib.Path(contract.__file__).read_text())
    cls = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name
    )
    return _functions(cls)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_module_functions(backend):
    tree = ast.parse((BACKEND_DIR / f"{backend}.py").read_text())
    functions = _functions(tree)
    expected = _protocol_methods("BackendModule")
    for name in contract.CONTRACT_FUNCTIONS:
        assert name in functions, f"{backend} lacks {name}()"
        assert _params(functions[name]) == _params(expected[name])[1:], (
            f"{backend}.{name} signature differs from the contract"
        )
    names = [
        t.id
        for n in tree.body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    ]
    assert "NAME" in names


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_classes_implement_engine(backend):
    tree = ast.parse((BACKEND_DIR / f"{backend}.py").read_text())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    expected = _protocol_methods("Engine")
    for engine in ("OneDeviceEngine", "MirroredEngine"):
        methods = {}
        node = classes[engine]
        for base in node.bases:  # one level of in-module inheritance
            if isinstance(base, ast.Name) and base.id in classes:
                methods.update(_functions(classes[base.id]))
        methods.update(_functions(node))
        for name in contract.ENGINE_METHODS + ("num_replicas_in_sync",):
            assert name in methods, f"{backend}.{engine} lacks {name}"
            assert _params(methods[name]) == _params(expected[name]), (
                f"{backend}.{engine}.{name} signature differs"
            )
