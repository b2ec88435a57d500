"""Every backend implements the whole contract, with the same signatures and
the same inner modules; no backend imports the front end."""

import ast
import inspect
import pathlib

import pytest

from keras_dist._src.backends import contract

BACKEND_DIR = pathlib.Path(contract.__file__).parent
BACKENDS = ["jax", "tensorflow", "torch"]
SRC = BACKEND_DIR.parent


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


def _module_tree(backend, module):
    return ast.parse((BACKEND_DIR / backend / f"{module}.py").read_text())


def _definitions(backend):
    """Top-level functions and classes of every module of a backend."""
    functions, classes = {}, {}
    for module in contract.INNER_MODULES:
        tree = _module_tree(backend, module)
        functions.update(_functions(tree))
        classes.update(
            {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        )
    return functions, classes


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_inner_modules(backend):
    present = {p.stem for p in (BACKEND_DIR / backend).glob("*.py")}
    missing = set(contract.INNER_MODULES) - present
    assert not missing, f"{backend} lacks modules {missing}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_module_functions(backend):
    functions, _ = _definitions(backend)
    expected = _protocol_methods("BackendModule")
    for name in contract.CONTRACT_FUNCTIONS:
        assert name in functions, f"{backend} lacks {name}()"
        assert _params(functions[name]) == _params(expected[name])[1:], (
            f"{backend}.{name} signature differs from the contract"
        )
    init = (BACKEND_DIR / backend / "__init__.py").read_text()
    for name in contract.CONTRACT_FUNCTIONS + ("NAME",):
        assert f'"{name}"' in init, f"{backend}/__init__ does not export {name}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_classes_implement_engine(backend):
    _, classes = _definitions(backend)
    expected = _protocol_methods("Engine")
    for engine in ("OneDeviceEngine", "MirroredEngine"):
        methods = {}
        node = classes[engine]
        for base in node.bases:  # one level of inheritance
            if isinstance(base, ast.Name) and base.id in classes:
                methods.update(_functions(classes[base.id]))
        methods.update(_functions(node))
        for name in contract.ENGINE_METHODS + ("num_replicas_in_sync",):
            assert name in methods, f"{backend}.{engine} lacks {name}"
            assert _params(methods[name]) == _params(expected[name]), (
                f"{backend}.{engine}.{name} signature differs"
            )


def _imports(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_never_import_the_front_end(backend):
    front_end = (
        "keras_dist._src.strategy",
        "keras_dist._src.strategies",
        "keras_dist._src.api",
    )
    for path in (BACKEND_DIR / backend).glob("*.py"):
        for module in _imports(path):
            assert not module.startswith(front_end), (
                f"{path.name} of {backend} imports the front end ({module})"
            )


def test_runtime_protocol_matches_host_runtime():
    from keras_dist._src import runtime

    for name in ("barrier", "broadcast", "all_reduce", "all_gather"):
        protocol = inspect.signature(getattr(runtime.Runtime, name))
        host = inspect.signature(getattr(runtime.HostRuntime, name))
        assert list(protocol.parameters) == list(host.parameters), name
