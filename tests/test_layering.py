"""The package's layering, read from its source: the reference model files import nothing CPU-specific, no module
imports a higher layer, and there is no import cycle (the import graph of `ddtree`, drawn from its imports)."""
import ast
from pathlib import Path

import ddtree

PACKAGE = Path(ddtree.__file__).resolve().parent
# lowest first: a module may import its own layer and the ones below it
LAYERS = [
    "config knobs cache files protocol kv_cache stats traces checker stops method_spec tree kernel_files hub machine_load",
    "attention layers fused target hf_target hf_cache loading markov drafter wrapping",
    "cpu gpu",
    "sampling cost_cache budget engine testing gguf_export",
    "api compare hf_baseline llamacpp_baseline peers runner datasets train",
    "benchmark cli serve __main__ __init__",
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names.split()}
REFERENCE_MODEL = ("layers", "target", "drafter", "attention", "fused", "kv_cache")


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def imports(path: Path) -> list[tuple[str, bool]]:
    """(imported ddtree module, inside a function?) for every package-relative import of one file."""
    tree = ast.parse(path.read_text())
    package = module_name(path).split(".")[:-1]  # the importing module's package (for "." imports)
    inside = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
            parts = base + (node.module.split(".") if node.module else [])
            names = [parts + [a.name] if not node.module else parts for a in node.names]
            out += [(".".join(n), id(node) in inside) for n in names]
    return out


def top(module: str) -> str:
    return module.split(".")[0] if module else "__init__"


def test_reference_model_files_import_nothing_cpu_specific():
    for name in REFERENCE_MODEL:
        found = [m for m, _ in imports(PACKAGE / f"{name}.py") if top(m) == "cpu"]
        assert not found, f"ddtree/{name}.py imports {found}: the CPU runtime wraps the model, not the other way"


def test_no_module_imports_a_higher_layer():
    ups = []
    for path in PACKAGE.rglob("*.py"):
        here = module_name(path)
        for module, in_function in imports(path):
            if top(module) not in LAYER or top(here) not in LAYER:
                continue
            if LAYER[top(module)] > LAYER[top(here)]:
                ups.append(f"{here} -> {module}" + (" (inside a function)" if in_function else ""))
    assert ("layers", False) in imports(PACKAGE / "target.py")  # the reader sees the imports it must
    assert not ups, f"imports up a layer (see LAYERS): {ups}"


def test_every_module_has_a_layer():
    tops = {top(module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert tops <= set(LAYER), f"modules without a layer in tests/test_layering.py: {sorted(tops - set(LAYER))}"
