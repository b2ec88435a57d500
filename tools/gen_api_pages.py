"""Writes the API reference's pages: one a public name, `docs/api/*.md`.

The public names are read from the `__all__` lists of `keras_dist` and of
its public submodules (`callbacks`, `checkpoint`, `layers`) without
importing them (no Keras or backend needed). Each page holds a
mkdocstrings directive (`::: keras_dist.MirroredStrategy`) that renders
the docstring when the site is built.

    python tools/gen_api_pages.py           # write docs/api/
    python tools/gen_api_pages.py --check   # exit 1 if docs/api/ is stale
"""

import argparse
import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "keras_dist"
SUBMODULES = {
    "callbacks": PACKAGE / "callbacks" / "__init__.py",
    "checkpoint": PACKAGE / "checkpoint.py",
    "layers": PACKAGE / "layers" / "__init__.py",
}
SECTIONS = {
    "Strategies": (
        "Strategy",
        "OneDeviceStrategy",
        "MirroredStrategy",
        "MultiWorkerMirroredStrategy",
        "ModelParallel",
        "ShardedDataParallel",
        "CentralStorageStrategy",
        "ParameterServerStrategy",
        "TPUStrategy",
        "get_strategy",
        "has_strategy",
        "available_strategies",
        "strategy_from_name",
    ),
    "Meshes and layouts": ("DeviceMesh", "LayoutMap"),
    "Devices and clusters": (
        "list_devices",
        "simulate_cpu_devices",
        "ClusterEnvironment",
        "serve",
    ),
    "Values and input": (
        "PerReplica",
        "ReduceOp",
        "InputOptions",
        "ShardPolicy",
    ),
}
OTHER = "Errors and the rest"


def _all_of(path: pathlib.Path) -> list[str]:
    """The last list literal assigned to `__all__` in `path`."""
    names = None
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = (
                node.targets if isinstance(node, ast.Assign) else [node.target]
            )
            if any(getattr(t, "id", None) == "__all__" for t in targets):
                if isinstance(node.value, ast.List) and node.value.elts:
                    names = [ast.literal_eval(e) for e in node.value.elts]
    if names is None:
        raise SystemExit(f"no __all__ list in {path}")
    return names


def public_names() -> list[str]:
    """Dotted names of every public object, sorted within each module."""
    top = _all_of(PACKAGE / "__init__.py")
    names = [f"keras_dist.{n}" for n in sorted(top) if n not in SUBMODULES]
    for module, path in SUBMODULES.items():
        names += [f"keras_dist.{module}.{n}" for n in sorted(_all_of(path))]
    return names


def _section(dotted: str) -> str:
    parts = dotted.split(".")
    if len(parts) == 3:
        return f"keras_dist.{parts[1]}"
    for title, members in SECTIONS.items():
        if parts[1] in members:
            return title
    return OTHER


def support_table() -> str:
    """The README's "Strategies and backends" section, its links made
    relative to docs/api/."""
    readme = (ROOT / "README.md").read_text()
    title = "## Strategies and backends\n"
    section = readme.split(title, 1)[1].split("\n## ", 1)[0]
    section = section.replace("](guides/", "](../guides/")
    return title + section.rstrip()


def pages() -> dict[str, str]:
    """File name under docs/api/ -> its text."""
    out = {}
    index = ["# API reference", ""]
    index.append(
        "One page per public name of `keras_dist`, generated from the "
        "docstrings."
    )
    index += ["", support_table()]
    by_section: dict[str, list[str]] = {}
    for dotted in public_names():
        filename = dotted.removeprefix("keras_dist.") + ".md"
        out[filename] = f"# `{dotted}`\n\n::: {dotted}\n"
        by_section.setdefault(_section(dotted), []).append(dotted)
    order = list(SECTIONS) + [OTHER]
    order += sorted(s for s in by_section if s not in order)
    for section in order:
        if section not in by_section:
            continue
        index += ["", f"## {section}", ""]
        members = SECTIONS.get(section, ())
        ranked = sorted(
            by_section[section],
            key=lambda d: (
                members.index(d.split(".")[-1])
                if d.split(".")[-1] in members
                else len(members),
                d,
            ),
        )
        for dotted in ranked:
            filename = dotted.removeprefix("keras_dist.") + ".md"
            index.append(f"* [`{dotted}`]({filename})")
    out["index.md"] = "\n".join(index) + "\n"
    return out


def main() -> int:
    """Writes (or with --check compares) docs/api/."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "docs" / "api"))
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    wanted = pages()
    if args.check:
        present = {p.name: p.read_text() for p in out.glob("*.md")}
        if present != wanted:
            stale = sorted(set(present) ^ set(wanted)) or sorted(
                n for n in wanted if present.get(n) != wanted[n]
            )
            print(
                "docs/api/ is stale (run python tools/gen_api_pages.py): "
                + ", ".join(stale)
            )
            return 1
        print(f"docs/api/: {len(wanted)} pages up to date")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    for stale in set(p.name for p in out.glob("*.md")) - set(wanted):
        (out / stale).unlink()
    for name, text in wanted.items():
        (out / name).write_text(text)
    print(f"wrote {len(wanted)} pages to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
