"""Every backend implements the whole contract, with the same signatures and
the same inner modules; no backend imports the front end."""

import ast
import inspect
import pathlib
import re

import pytest

from keras_dist._src.backends import contract

BACKEND_DIR = pathlib.Path(contract.__file__).parent
PACKAGE_DIR = BACKEND_DIR.parent.parent  # keras_dist/
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
    for name in contract.CONTRACT_FUNCTIONS + ("NAME", "CAPABILITIES"):
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


def _base_names(classes, name):
    """Every base class `name` has, through the backend's own classes
    (a base named as `module.Class` counts as `Class`)."""
    names = set()
    for base in classes[name].bases:
        if isinstance(base, (ast.Name, ast.Attribute)):
            base = base.id if isinstance(base, ast.Name) else base.attr
            names.add(base)
            if base in classes:
                names |= _base_names(classes, base)
    return names


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_engine_takes_the_optional_capabilities_defaults(backend):
    """Every engine class derives from `contract.EngineDefaults`, so that
    the front end reads an optional capability (``engine.mesh``,
    ``engine.lay_out``) without asking whether the engine has it."""
    _, classes = _definitions(backend)
    engines = [n for n in classes if n.lstrip("_").endswith("Engine")]
    assert {"OneDeviceEngine", "MirroredEngine"} <= set(engines)
    for engine in engines:
        assert "EngineDefaults" in _base_names(classes, engine), (
            f"{backend}.{engine} does not derive from EngineDefaults"
        )
    declared = vars(contract.EngineDefaults)
    for name in contract.OPTIONAL_ENGINE_CAPABILITIES:
        assert name in declared, name


def test_no_probing_for_engine_capabilities():
    """No ``getattr(engine, "mesh", None)``: an optional capability has
    its default in `contract.EngineDefaults`."""
    names = "|".join(contract.OPTIONAL_ENGINE_CAPABILITIES + ("placement",))
    probe = re.compile(
        rf"(getattr|hasattr)\([^()]*(engine|extended)[^()]*,\s*"
        rf"[\"']({names})[\"']"
    )
    found = [
        f"{path.relative_to(PACKAGE_DIR)}:{i}"
        for path in PACKAGE_DIR.rglob("*.py")
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if probe.search(line)
    ]
    assert not found, found
    assert probe.search('getattr(self._engine, "mesh", None)')


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
    "name_scope_stack",
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


# Private names of the frameworks themselves that only
# `keras_dist/_src/framework_glue/` may touch (as keras_glue for Keras).
FRAMEWORK_GLUE_DIR = SRC / "framework_glue"
FRAMEWORK_PRIVATE_PATTERNS = (
    r"\bjax\._src\b",
    r"\bfrom jax import _src\b",
    r"\btensorflow\.python\b",
    r"\bfrom tensorflow import python\b",
    r"\bcompute_local_shape_and_global_offset\b",
    r"\._local_tensor\b",
    r"\._flatten\(",
    r"\._VariantDataset\b",
    r"(?<!\bself)\._seed\b",
    r"(?<!\bself)\._rng\b",
)
FRAMEWORK_GLUE = {
    "jax": "jax_private",
    "tensorflow": "tensorflow_private",
    "torch": "torch_private",
}


def test_framework_privates_only_in_framework_glue():
    package = SRC.parent
    offenders = {}
    for path in sorted(package.rglob("*.py")):
        if FRAMEWORK_GLUE_DIR in path.parents:
            continue
        text = path.read_text()
        found = [p for p in FRAMEWORK_PRIVATE_PATTERNS if re.search(p, text)]
        if found:
            offenders[str(path.relative_to(package.parent))] = found
    assert not offenders, (
        "Private JAX/TensorFlow/torch names outside "
        "keras_dist/_src/framework_glue/ (add a function there and call "
        f"it): {offenders}"
    )


def test_framework_glue_imports_no_framework():
    # Importing a glue module imports no framework: each function imports
    # what it needs when called.
    for path in FRAMEWORK_GLUE_DIR.glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = (
                    [node.module]
                    if isinstance(node, ast.ImportFrom)
                    else [a.name for a in node.names]
                )
                assert modules == ["__future__"], (
                    f"framework_glue/{path.name} imports {modules} at "
                    "import time"
                )


def _imports_in(path):
    """``(module, name)`` of every ``from module import name`` in `path`,
    at any depth."""
    return sorted(
        (node.module, a.name)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module
        if node.module != "__future__"
        for a in node.names
    )


def test_framework_private_names_resolve_in_the_installed_framework():
    """What the running backend's framework glue reaches exists in the
    framework installed here: every name it imports, the private
    attributes it reads, and the resolvers that are safe to call return
    what their callers expect. A release that moves one fails here."""
    import importlib
    import random

    import keras

    backend = keras.backend.backend()
    module_name = FRAMEWORK_GLUE[backend]
    glue = importlib.import_module(
        f"keras_dist._src.framework_glue.{module_name}"
    )
    missing = []
    for module, name in _imports_in(FRAMEWORK_GLUE_DIR / f"{module_name}.py"):
        try:
            found = importlib.import_module(module)
        except ImportError:
            missing.append(module)
            continue
        if not hasattr(found, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{module}.{name}")
    if backend == "jax":
        from jax._src import xla_bridge
        from jax._src.lib import _jax

        for owner, names in (
            (xla_bridge, ("register_backend_factory", "make_cpu_client")),
            (_jax, ("make_gloo_tcp_collectives",)),
        ):
            missing += [n for n in names if not hasattr(owner, n)]
        assert isinstance(glue.backends_initialized(), bool)
        assert glue.distributed_client() is None  # no job joined here
        assert glue.coordinator_address() is None
        assert glue.running_in_cloud_tpu_vm() is False
    elif backend == "tensorflow":
        import tensorflow as tf

        extended = glue.collective_all_reduce_extended_class()
        if not hasattr(extended, "_initialize_local_devices"):
            missing.append("CollectiveAllReduceExtended._initialize_...")
        context = glue.eager_context()
        names = ("set_config_key_value", "get_config_key_value", "_seed")
        missing += [n for n in names if not hasattr(context, n)]
        # `_rng` exists once a global seed is set (not set here).
        if "self._rng" not in inspect.getsource(type(context)):
            missing.append("Context._rng")
        rng = glue.eager_op_seed_generator()
        assert rng is None or isinstance(rng, random.Random)
        glue.eager_global_seed()  # None or the seed: either resolves
        dataset = tf.data.Dataset.range(8).batch(2, drop_remainder=True)
        assert int(glue.static_batch_size(dataset)) == 2
        assert len(list(glue.auto_shard_dataset(dataset, 2, 0, 2))) == 2
        assert not glue.is_aggregating_variable(tf.Variable(1.0))
        restored = glue.deserialize_dataset_from_graph(
            glue.serialize_dataset_to_graph(dataset), dataset.element_spec
        )
        assert len(list(restored)) == 4
    else:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor

        if "_local_tensor" not in DTensor.__annotations__:
            missing.append("DTensor._local_tensor")
        if not hasattr(DeviceMesh, "_flatten"):
            missing.append("DeviceMesh._flatten")
    assert not missing, f"{backend} lacks {missing}"


BACKEND_NAMES = {"jax", "tensorflow", "torch", "numpy", "openvino"}


def _backend_switches(text):
    """Lines of `text` that ask for the Keras backend's name
    (``keras.backend.backend()``, a backend module's ``NAME``) or compare
    something with a backend's name."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "backend"
            and ast.unparse(node.func.value).endswith("backend")
        ) or (isinstance(node, ast.Attribute) and node.attr == "NAME"):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            literals = set()
            for operand, op in zip(operands[1:], node.ops):
                if isinstance(op, (ast.Eq, ast.NotEq)):
                    literals.update(
                        o.value
                        for o in (operands[0], operand)
                        if isinstance(o, ast.Constant)
                    )
                elif isinstance(op, (ast.In, ast.NotIn)) and isinstance(
                    operand, (ast.Tuple, ast.List, ast.Set)
                ):
                    literals.update(
                        e.value
                        for e in operand.elts
                        if isinstance(e, ast.Constant)
                    )
            if literals & BACKEND_NAMES:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_backend_name_switch_outside_backends():
    # What differs between backends is declared by the backend (its
    # `CAPABILITIES`, `backends.refuse_unsupported`); only `backends/` and
    # `cluster/` (launching processes) may ask for the backend's name (the
    # CLI's doctor reads its checks from the backend's `doctor` module).
    package = SRC.parent
    allowed = (SRC / "backends", SRC / "cluster")
    offenders = {}
    for path in sorted(package.rglob("*.py")):
        if any(a in path.parents for a in allowed):
            continue
        found = _backend_switches(path.read_text())
        if found:
            offenders[str(path.relative_to(package.parent))] = found
    assert not offenders, (
        "Backend-name switches outside backends/ and cluster/ (declare a "
        f"capability in backends/contract.py's Capabilities): {offenders}"
    )


def test_backend_switch_finder_finds_switches():
    text = (
        "import keras\n"
        "a = keras.backend.backend()\n"
        "b = name() == 'torch'\n"
        "c = backend in ('jax', 'tensorflow')\n"
        "d = module.NAME\n"
        "e = 'torch' in sys.modules\n"  # whether torch is imported: fine
        "f = x == 'other'\n"
    )
    assert [f.split(":")[0] for f in _backend_switches(text)] == [
        "2",
        "3",
        "4",
        "5",
    ]


def test_the_backend_declares_its_capabilities():
    from keras_dist._src import backends

    module = backends.get()  # the running backend's: importing another
    capabilities = module.CAPABILITIES  # would start its framework
    assert isinstance(capabilities, contract.Capabilities)
    for plan_type in capabilities.refused_plans:
        assert plan_type in module.ENGINES, plan_type
    # Every submodule is imported by now; none may shadow the function.
    assert backends.capabilities() is capabilities
