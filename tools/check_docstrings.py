"""Fails when a public name of keras_dist has no docstring.

Public names: every name in `keras_dist.__all__` and in the `__all__` of
its public submodules (`callbacks`, `checkpoint`, `layers`), and the public
methods and properties that keras_dist's own classes define. Inherited
members of Keras or TensorFlow classes are theirs, not checked.

    KERAS_BACKEND=jax python tools/check_docstrings.py

Exits 1 and lists what is missing; prints the count checked otherwise.
"""

import inspect
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")


def _own(obj) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return module.split(".")[0] == "keras_dist"


def _members(cls):
    """Public methods and properties `cls` itself defines (keras_dist
    classes only; enum members and plain values are not callables)."""
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property):
            yield name, value
        elif inspect.isfunction(value) and _own(value):
            yield name, value


def missing_docstrings():
    """Returns (checked count, list of dotted names without a docstring)."""
    import keras_dist

    spaces = [("keras_dist", keras_dist)]
    for name in keras_dist.__all__:
        value = getattr(keras_dist, name)
        if inspect.ismodule(value):
            spaces.append((f"keras_dist.{name}", value))
    missing, checked, seen = [], 0, set()
    for prefix, module in spaces:
        for name in getattr(module, "__all__", []):
            value = getattr(module, name)
            if inspect.ismodule(value) or id(value) in seen:
                continue
            if not (inspect.isclass(value) or callable(value)):
                continue  # constants such as PREEMPTION_EXIT_CODE
            seen.add(id(value))
            dotted = f"{prefix}.{name}"
            checked += 1
            if not (value.__doc__ or "").strip():
                missing.append(dotted)
            if inspect.isclass(value) and _own(value):
                for member, attr in _members(value):
                    checked += 1
                    if not (attr.__doc__ or "").strip():
                        missing.append(f"{dotted}.{member}")
    return checked, missing


def main() -> int:
    """Prints the result; 1 when a docstring is missing."""
    checked, missing = missing_docstrings()
    if missing:
        print(f"{len(missing)} public names without a docstring:")
        for name in missing:
            print(f"  {name}")
        return 1
    print(f"docstrings: all {checked} public names documented")
    return 0


if __name__ == "__main__":
    sys.exit(main())
