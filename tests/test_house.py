"""The package's shape, checked: imports run one way between its layers, no import cycle, short functions.

Layers, lowest first (DESIGN.md): the model (self-contained: its files are copied into checkpoints),
errors and recipes, I/O, the conversion's stages and layer stream, the conversion, then exports,
evaluation (which never imports conversion), apps, the CLI and the package's public face. A module
may import its own layer and the layers its entry lists; function-level imports count too, so a lazy
import cannot hide an upward edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "mha2mla"
BASE = {"errors", "recipes"}
ALLOWED = {  # layer → the layers it may import besides itself
    "modeling": set(),
    "base": set(),
    "io": {"base", "modeling"},
    "stages": {"base", "modeling", "io"},
    "conversion": {"base", "modeling", "io", "stages"},
    "exports": {"base", "modeling", "io", "stages"},
    "evaluate": {"base", "modeling", "io"},
    "apps": {"base", "modeling", "io", "stages", "conversion", "exports", "evaluate"},
    "cli": {"base", "modeling", "io", "stages", "conversion", "exports", "evaluate", "apps"},
    "package": {"base", "modeling", "io", "stages", "conversion", "exports", "evaluate", "apps", "cli"},
}
MAX_FUNCTION_LINES = 80
LONG_ALLOWED = {("cli.py", "build_parser"), ("modeling/configuration_mla.py", "__init__")}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    parts = module.split(".")[1:]
    if not parts:
        return "package"
    if parts[0] in BASE:
        return "base"
    if parts[0] == "conversion" and len(parts) > 1 and parts[1] in ("stages", "stream"):
        return "stages"
    return parts[0]


def imports_of(path: Path) -> set[str]:
    """Every mha2mla module `path` imports, at any level of the file."""
    module, found = module_name(path), set()
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" for a in node.names]
            found.update(n if (SRC.parent / n.replace(".", "/")).with_suffix(".py").exists()
                         or (SRC.parent / n.replace(".", "/")).is_dir() else target for n in names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.split(".")[0] == "mha2mla" and m != module}


MODULES = {module_name(p): p for p in SRC.rglob("*.py")}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_down_the_layers(module):
    layer = layer_of(module)
    upward = [m for m in imports_of(MODULES[module]) if layer_of(m) != layer and layer_of(m) not in ALLOWED[layer]]
    assert not upward, f"{module} ({layer}) imports {upward} ({[layer_of(m) for m in upward]})"


def test_no_import_cycle():
    graph = {m: {n for n in imports_of(p) if n in MODULES} for m, p in MODULES.items()}
    state = {}

    def visit(m, path):
        if state.get(m) == "open":
            raise AssertionError(f"import cycle: {' → '.join(path + [m])}")
        if state.get(m) != "done":
            state[m] = "open"
            for n in graph[m]:
                if n != m and not m.startswith(n + "."):  # a submodule importing its own package's __init__
                    visit(n, path + [m])
            state[m] = "done"

    for m in graph:
        visit(m, [])


def test_the_model_files_are_self_contained():
    """configuration_mla, modeling_mla and latent_cache are copied into checkpoints: they import each other only."""
    for name in ("configuration_mla", "modeling_mla", "latent_cache"):
        assert {m for m in imports_of(SRC / "modeling" / f"{name}.py")} <= {
            "mha2mla.modeling.configuration_mla", "mha2mla.modeling.modeling_mla", "mha2mla.modeling.latent_cache"}


def test_functions_are_short():
    long = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES and (str(path.relative_to(SRC)), node.name) not in LONG_ALLOWED:
                    long.append(f"{path.relative_to(SRC)}:{node.name} ({lines} lines)")
    assert not long, long
