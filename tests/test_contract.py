"""Every backend implements the whole contract, with the same signatures and
the same inner modules; no backend imports the front end."""

import ast
import inspect
import pathlib
import re

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
    modules = {p.stem for p in (BACKEND_DIR / backend).glob("*.py")}
    for module in sorted(modules):
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


def _resolved_methods(classes, name):
    """The methods of class `name` with everything it inherits from the
    backend's own classes, in Python's method resolution order (C3), so
    that a method defined on a base class counts for its subclasses."""
    mro = _linearize(classes, name)
    methods = {}
    for cls in reversed(mro):
        methods.update(_functions(classes[cls]))
    return methods


def _linearize(classes, name):
    """C3 linearization of `name` over the backend's classes (a base named
    as `module.Class` counts as `Class`; bases that are not the backend's,
    such as `object`, add nothing)."""
    bases = [
        base.id if isinstance(base, ast.Name) else base.attr
        for base in classes[name].bases
        if isinstance(base, (ast.Name, ast.Attribute))
    ]
    bases = [base for base in bases if base in classes]
    sequences = [_linearize(classes, base) for base in bases] + [bases]
    order = [name]
    while any(sequences):
        sequences = [s for s in sequences if s]
        for sequence in sequences:
            head = sequence[0]
            if not any(head in s[1:] for s in sequences):
                break
        else:
            raise AssertionError(f"no consistent MRO for {name}")
        order.append(head)
        sequences = [s[1:] if s[0] == head else s for s in sequences]
    return order


def _engine_classes(classes):
    """The backend's public engine classes (`...Engine`)."""
    return sorted(
        name
        for name in classes
        if name.endswith("Engine") and not name.startswith("_")
    )


def test_resolved_methods_follow_the_mro():
    tree = ast.parse(
        "class A:\n    def f(self): pass\n    def g(self): pass\n"
        "class B(A):\n    def f(self, x): pass\n"
        "class C(A):\n    def g(self, y): pass\n"
        "class D(B, C):\n    pass\n"
        "class E(mod.B):\n    pass\n"
    )
    classes = {n.name: n for n in tree.body}
    assert _linearize(classes, "D") == ["D", "B", "C", "A"]
    methods = _resolved_methods(classes, "D")
    assert _params(methods["f"]) == ["self", "x"]  # B's, over A's
    assert _params(methods["g"]) == ["self", "y"]  # C's, before A's
    assert _linearize(classes, "E") == ["E", "B", "A"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_classes_implement_engine(backend):
    _, classes = _definitions(backend)
    expected = _protocol_methods("Engine")
    engines = _engine_classes(classes)
    assert {"OneDeviceEngine", "MirroredEngine"} <= set(engines)
    for engine in engines:
        methods = _resolved_methods(classes, engine)
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


# Private Keras names (attributes, methods, arguments) that only
# `keras_dist/_src/keras_glue/` may touch; everything else calls its
# functions, so that a Keras release that renames one breaks one package.
KERAS_PRIVATE_NAMES = (
    "_make_function",
    "_compute_loss",
    "_compile_loss",
    "_flat_losses",
    "_compile_metrics",
    "_loss_tracker",
    "_symbolic_build",
    "_maybe_symbolic_build",
    "_flatten_layers",
    "_call_has_training_arg",
    "_losses_override",
    "_initial_epoch",
    "_moments",
    "_reduction_axes",
    "_initial_seed",
    "_value",
    "_model",
    "_distribute_strategy",
    "_is_default",
    "_use_cached_eval_dataset",
    "_save_model",
    "_backend_update_step",
    "_backend_increment_gradient_accumulators",
    "_apply_weight_decay",
    "_overwrite_model_variables_with_average_value",
    "_backend_reset_gradient_accumulators",
    "_common_apply",
    "_tf_apply",
    "_direct_assign",
    "_track_variables",
    "_torch_params",
    "_dataset",
    "_get_iterator",
    "_dataloader",
    "_initialize",
)
GLUE_DIR = SRC / "keras_glue"


def _private_keras_uses(text):
    found = ["keras.src"] if "keras.src" in text else []
    for name in KERAS_PRIVATE_NAMES:
        pattern = rf"\.{name}\b|[\"']{name}[\"']"
        if name == "_model":
            # keras_dist's own helper classes keep a model as `self._model`;
            # Keras's `Callback._model` is caught in callbacks below.
            pattern = rf"(?<!\bself)\.{name}\b|[\"']{name}[\"']"
        if re.search(pattern, text):
            found.append(name)
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and any(
            "Callback" in ast.unparse(base) for base in node.bases
        ):
            if any(
                isinstance(n, ast.Attribute) and n.attr == "_model"
                for n in ast.walk(node)
            ):
                found.append(f"{node.name}: Callback._model")
    return found


def test_private_keras_apis_only_in_keras_glue():
    package = SRC.parent
    offenders = {}
    for path in sorted(package.rglob("*.py")):
        if GLUE_DIR in path.parents:
            continue
        found = _private_keras_uses(path.read_text())
        if found:
            offenders[str(path.relative_to(package.parent))] = found
    assert not offenders, (
        "Private Keras APIs outside keras_dist/_src/keras_glue/ (add a "
        f"function there and call it): {offenders}"
    )


def test_private_keras_names_listed_are_used_in_keras_glue():
    # Keeps KERAS_PRIVATE_NAMES honest: each name is one keras_glue touches.
    glue = "\n".join(p.read_text() for p in GLUE_DIR.glob("*.py"))
    unused = [n for n in KERAS_PRIVATE_NAMES if n not in glue]
    assert not unused, f"not used in keras_glue, drop from the list: {unused}"


def test_keras_glue_imports_no_backend():
    # Backend modules import keras_glue, never the other way round; and a
    # backend's own Keras modules (`keras.src.backend.<name>`) are imported
    # inside the function that needs them, not when keras_glue is.
    for path in GLUE_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:
                continue
            for module in modules:
                assert not module.startswith("keras_dist._src.backends"), (
                    f"keras_glue/{path.name} imports a backend ({module})"
                )
                assert not module.startswith(
                    ("keras.src.backend.jax", "keras.src.backend.tensorflow")
                    + ("keras.src.backend.torch", "tensorflow", "torch", "jax")
                ), f"keras_glue/{path.name} imports {module} at import time"


def _keras_imports_in_glue():
    """``(module, name)`` of every ``from keras.src... import name`` in
    keras_glue, at any depth (function-level imports included)."""
    found = set()
    for path in GLUE_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("keras.src")
            ):
                found.update((node.module, a.name) for a in node.names)
    return sorted(found)


def test_private_keras_names_resolve_in_the_installed_keras():
    """What keras_glue reaches exists in the Keras installed here: every
    module and name it imports (another backend's modules aside), the
    moved-between-releases names it finds by feature, and the private
    methods it calls or replaces. A Keras release that moves or renames
    one fails here, not in a user's `fit`."""
    import importlib

    import keras

    from keras_dist._src.keras_glue import internals as glue

    backend = keras.backend.backend()
    others = [b for b in BACKENDS if b != backend]
    missing = []
    for module, name in _keras_imports_in_glue():
        if any(module.startswith(f"keras.src.backend.{b}") for b in others):
            continue
        try:
            if not hasattr(importlib.import_module(module), name):
                missing.append(f"{module}.{name}")
        except ImportError:
            missing.append(module)
    base = glue.base_trainer_class()
    trainer = glue.backend_trainer_class(backend)
    assert issubclass(trainer, base)
    owners = {
        base: (
            "compile",
            "compute_loss",
            "get_metrics_result",
            "reset_metrics",
            "_compute_loss",
            "_symbolic_build",
        ),
        trainer: ("_make_function",) if backend != "torch" else (),
        keras.layers.BatchNormalization: ("_moments", "call"),
        keras.layers.Layer: ("_flatten_layers",),
    }
    if backend == "torch":
        core = glue.torch_core()
        owners[core.Variable] = ("_initialize", "_direct_assign", "__array__")
        assert callable(core.get_device)
        assert callable(glue.torch_ops_module("nn").batch_normalization)
    if backend == "tensorflow":
        owners[trainer] += ("_autoconvert_optionals",)
    for owner, names in owners.items():
        missing += [
            f"{owner.__name__}.{n}" for n in names if not hasattr(owner, n)
        ]
    assert not missing, f"Keras {keras.__version__} lacks {missing}"
