"""The package's layering, read from its source: the reference model files import nothing CPU-specific, no module
imports a higher layer, and there is no import cycle (the import graph of `ddtree`, drawn from its imports)."""
import ast
from pathlib import Path

import pytest

import ddtree

PACKAGE = Path(ddtree.__file__).resolve().parent
# The layers, lowest first: a folder per layer (api.py, the facade the benchmark and training build on, and the
# entry points are the only modules outside one); a module may import its own layer and the ones below it.
LAYERS = [
    "base",  # settings, knobs, files, caches, where the kernels are, the machine, hub ids
    "models",  # the pure-torch reference models and loading them
    "runtime",  # fast paths around the models, chosen at load (cpu/, gpu/)
    "engine",  # the decoding loop and its pure parts
    "api",  # load / Pair / generate
    "bench",  # the benchmark, compare and its runner, the peers, seeded pairs
    "train",  # drafter training
    "cli serve __main__ __init__",  # entry points
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names.split()}
ENTRY_POINTS = {"api", "cli", "serve", "__main__", "__init__"}
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


def test_reference_model_files_import_no_runtime():
    for name in REFERENCE_MODEL:
        found = [m for m, _ in imports(PACKAGE / "models" / f"{name}.py") if top(m) == "runtime"]
        assert not found, f"ddtree/models/{name}.py imports {found}: a runtime wraps the model, not the other way"


def test_the_folders_are_the_layers():
    """Every module lives in its layer's folder; only the entry points sit at the top."""
    flat = {p.stem for p in PACKAGE.glob("*.py")}
    assert flat == ENTRY_POINTS, f"modules outside a layer's folder: {sorted(flat - ENTRY_POINTS)}"
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(LAYER) - ENTRY_POINTS, sorted(folders ^ (set(LAYER) - ENTRY_POINTS))


def test_no_module_imports_a_higher_layer():
    ups = []
    for path in PACKAGE.rglob("*.py"):
        here = module_name(path)
        for module, in_function in imports(path):
            if top(module) not in LAYER or top(here) not in LAYER:
                continue
            if LAYER[top(module)] > LAYER[top(here)]:
                ups.append(f"{here} -> {module}" + (" (inside a function)" if in_function else ""))
    assert ("models.layers", False) in imports(PACKAGE / "models" / "target.py")  # the reader sees the imports
    assert not ups, f"imports up a layer (see LAYERS): {ups}"


def test_every_module_has_a_layer():
    tops = {top(module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert tops <= set(LAYER), f"modules without a layer in tests/test_layering.py: {sorted(tops - set(LAYER))}"


def test_no_test_only_code_in_the_package():
    """Issue 50 item 5: helpers only the tests used live with the tests (tests/conftest.py: reference_arithmetic;
    the tests call tree.best_first_nodes, the engine's own), and nothing in the package defines them."""
    from ddtree.base.config import SamplingParams
    from ddtree.engine import tree
    from ddtree.runtime.cpu import runtime

    assert not hasattr(runtime, "reference_arithmetic") and not hasattr(runtime, "_RuntimeLinear")
    assert not hasattr(tree, "best_first_tree") and not hasattr(SamplingParams, "as_dict")
    gone = ("def reference_arithmetic", "def best_first_tree", "def as_dict(self) -> dict:\n        return asdict")
    assert not [(path.name, name) for path in PACKAGE.rglob("*.py") for name in gone if name in path.read_text()]


def test_runtimes_say_what_they_are_and_the_engine_asks_no_model_for_its_kernel():
    """A runtime implements its protocol itself (no attribute forwarding to the model it holds), and the engine takes
    the step's operations from the object the runtime chose at load (Target.step_ops), never a model's kernel."""
    forwarding = [(p.relative_to(PACKAGE).as_posix(), node.name) for p in (PACKAGE / "runtime").rglob("*.py")
                  for node in ast.walk(ast.parse(p.read_text()))
                  if isinstance(node, ast.FunctionDef) and node.name in ("__getattr__", "__setattr__")]
    assert not forwarding, f"attribute forwarding in a runtime: {forwarding}"
    asks = [(p.name, n.lineno) for p in (PACKAGE / "engine").rglob("*.py") for n in ast.walk(ast.parse(p.read_text()))
            if (isinstance(n, ast.Attribute) and n.attr == "kernel" and getattr(n.value, "id", None) != "qlinear")
            or (isinstance(n, ast.Call) and getattr(n.func, "id", None) == "getattr"
                and any(isinstance(a, ast.Constant) and a.value == "kernel" for a in n.args))]
    assert not asks, f"the engine asks a model for its kernel: {asks}"


def test_a_runtimes_own_attributes_stay_its_own():
    """Setting an attribute on a runtime sets it there: the reference model it holds (`.model`) is not touched."""
    from ddtree.bench.testing import random_pair

    target, drafter = random_pair("llama", seed=1)
    for runtime in (target, drafter):
        runtime.note = 1
        assert not hasattr(runtime.model, "note")
        with pytest.raises(AttributeError):
            runtime.fc  # what the runtime does not define is not the model's either
