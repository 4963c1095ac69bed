"""The docs stay true: the paths they name exist, the CLI's defaults are the README's, the layout table and the docs
index are complete, and the model cards have the Hugging Face shape.

Which backticked text counts as a repository path (`repo_paths`), kept simple on purpose:
- only inline `code` spans outside fenced code blocks;
- skipped: anything with a space (a command or prose), a URL, a glob or placeholder (`* ? [ ] { } < >`), an
  assignment or call (`= ( )`), a method or flag (`:`, a leading `-`), an absolute, home (`~`) or variable (`$`)
  path, and paths under `results/` (the benchmark's output);
- kept: text with a `/` whose first part is a top-level entry of the repository (`ddtree/`, `docs/`, `data/`,
  `kernels/`, ...), and a bare file name (no `/`) ending in a source or doc extension (.py .md .sh .cpp .h .json).
  So another project's path (`vllm/...`), a run folder (`runs/A/drafter`), `K/V` or a cache folder such as
  `verify-costs/` is not taken for a repository path, while a made-up `ddtree/...` or `docs/...` path is;
- a kept path exists if it does from the repository root or from the doc's own folder; a bare file name (no `/`,
  as in the README's layout table or RECIPE.md's `model.py`) exists if a file of that name is anywhere in the
  repository; OUTPUT_NAMES are bare names of files the tools write, not repository files.
The journals (docs/journal/) are dated records whose paths are as they were on the day: they are not checked.
"""
from __future__ import annotations

import argparse
import inspect
import os
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
JOURNAL = ROOT / "docs" / "journal"
EXTENSIONS = (".py", ".md", ".sh", ".cpp", ".h", ".json")
SKIP_CHARS = set(" \t*?[]{}<>=():$")
OUTPUT_NAMES = {"summary.md", "summary.json"}  # written by the benchmark under results/
IGNORED_DIRS = {".git", "__pycache__", ".pytest_cache", "build", "results", "runs", ".whl", ".gguf"}


def checked_docs() -> list[Path]:
    """README.md, the training guide and every page under docs/ except the journals."""
    pages = sorted(p for p in (ROOT / "docs").rglob("*.md") if JOURNAL not in p.parents)
    return [ROOT / "README.md", ROOT / "ddtree" / "train" / "RECIPE.md", *pages]


def code_spans(text: str) -> list[str]:
    """The inline `code` spans of a Markdown text, fenced blocks left out."""
    prose = re.sub(r"(?ms)^```.*?^```[^\n]*$", "", text)
    return re.findall(r"(?<!`)`([^`\n]+)`(?!`)", prose)


def _top_level() -> set[str]:
    return {p.name for p in ROOT.iterdir() if p.name not in IGNORED_DIRS and not p.name.endswith(".egg-info")}


def repo_paths(text: str) -> list[str]:
    """The backticked texts of `text` that the module docstring's rules take for repository paths."""
    top, found = _top_level(), []
    for span in code_spans(text):
        span = span.strip()
        if (not span or SKIP_CHARS & set(span) or "://" in span or span[0] in "-~/." or span.startswith("results/")
                or span in OUTPUT_NAMES):
            continue
        if span.split("/")[0] in top if "/" in span else span.endswith(EXTENSIONS):
            found.append(span)
    return found


def _repo_file_names() -> set[str]:
    names = set()
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in IGNORED_DIRS and not d.endswith(".egg-info")]
        names.update(files)
    return names


def missing_paths(doc: Path, text: str | None = None, names: set[str] | None = None) -> list[str]:
    """The repository paths `doc` names (or `text`, read as if it were `doc`) that do not exist."""
    text = doc.read_text() if text is None else text
    names = _repo_file_names() if names is None else names
    missing = []
    for path in repo_paths(text):
        rel = path.rstrip("/")
        if (ROOT / rel).exists() or (doc.parent / rel).exists() or ("/" not in rel and rel in names):
            continue
        missing.append(path)
    return missing


def test_the_path_heuristic_catches_a_made_up_path_and_skips_what_is_not_a_path():
    doc = ROOT / "README.md"
    text = ("`ddtree/made_up_module.py` `docs/no-such-page.md` `no_such_file.py` "
            "`ddtree/engine/decoder.py` `docs/` `data/smollm2-v2` `cpu-speed.md` `model.py` `vllm/models/x.py`\n"
            "`python -m ddtree generate` `https://x.org/a.md` `results/summary.md` `~/.cache/ddtree` `<name>/x.py` "
            "`kernels/ddtree_qlinear*-<key>/` `verify-costs/` `runs/A/drafter` `K/V` `ddtree:16` `--dtype` "
            "`load(quant=\"gguf\")` `DDTREE_CACHE=/tmp/x.py` `summary.md`\n"
            "```\ncat ddtree/fenced_is_not_checked.py\n```\n")
    assert missing_paths(doc, text) == ["ddtree/made_up_module.py", "docs/no-such-page.md", "no_such_file.py"]


@pytest.mark.parametrize("doc", checked_docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_backticked_repository_path_exists(doc):
    assert missing_paths(doc) == [], f"{doc.relative_to(ROOT)} names paths that do not exist"


# --- the command line against the README ------------------------------------------------------------------------

class _Parsed(Exception):
    def __init__(self, parser):
        super().__init__()
        self.parser = parser


def cli_parser() -> argparse.ArgumentParser:
    """`python -m ddtree`'s parser, as cli.main builds it (caught at parse_args: nothing runs)."""
    from ddtree import cli

    for name in ("build_parser", "make_parser", "parser"):
        if callable(getattr(cli, name, None)):
            return getattr(cli, name)()

    def catch(self, *args, **kwargs):
        raise _Parsed(self)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = catch
    try:
        cli.main(["generate", "a prompt"])
    except _Parsed as parsed:
        return parsed.parser
    finally:
        argparse.ArgumentParser.parse_args = original
    raise AssertionError("ddtree.cli.main did not build an argparse parser")


def subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise AssertionError("the parser has no subcommands")


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: a for a in parser._actions for flag in a.option_strings}


def readme_section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(rf"(?ms)^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text)
    assert match, f"the README has no section '## {title}'"
    return match.group(1)


def test_the_readme_generate_signature_is_the_cli_and_api_defaults():
    """README: `pair.generate(prompt, method="ddtree", ..., temperature=0.0, ..., max_new_tokens=256, ...)`."""
    from ddtree.api import Pair

    text = (ROOT / "README.md").read_text()
    match = re.search(r"`pair\.generate\(prompt, (.*?)\)`", text, re.S)
    assert match, "the README no longer states pair.generate's signature"
    stated = dict(re.findall(r"(\w+)=([^,\s)]+)", match.group(1)))
    api = inspect.signature(Pair.generate).parameters
    for name, value in stated.items():  # the README's signature is the API's
        assert repr(api[name].default).replace("'", '"') == value, f"README says {name}={value}"
    gen = options(subcommand(cli_parser(), "generate"))
    for flag in ("--method", "--temperature", "--top-p", "--top-k", "--max-new-tokens", "--budget"):
        name = flag[2:].replace("-", "_")
        cli_default = gen[flag].default
        assert repr(cli_default).replace("'", '"') == stated[name], f"--{flag[2:]} defaults to {cli_default!r}"


def test_the_readme_options_exist_with_the_choices_it_states():
    section = readme_section("Command line")
    parser = cli_parser()
    known = {}
    for action in parser._actions:  # every subcommand's options (generate, compare, chat, ...)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                known.update(options(sub))
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", section))
    assert named and not named - set(known), f"the README names options the CLI lacks: {sorted(named - set(known))}"
    choices = re.findall(r"`(--[a-z-]+) \{([^}]*)\}`", section)
    assert {flag for flag, _ in choices} >= {"--backend", "--quant", "--attention"}
    for flag, listed in choices:
        assert set(listed.split(",")) == set(known[flag].choices), f"{flag}: README {{{listed}}}"


def test_the_dtype_and_budget_defaults_are_the_readmes():
    """README: `dtype=None` picks bfloat16 on CUDA and float32 on every CPU; a bare ddtree with budget=None:
    ddtree:auto+lookup on a CPU, ddtree:64 on a GPU."""
    from ddtree.models.loading import default_dtype
    from ddtree.engine.method_spec import MethodSpec

    text = " ".join((ROOT / "README.md").read_text().split())
    assert "float32 on every CPU" in text and "bfloat16 on CUDA" in text
    assert default_dtype(torch.device("cpu")) == torch.float32
    assert default_dtype(torch.device("cuda")) == torch.bfloat16
    help_text = options(subcommand(cli_parser(), "generate"))["--dtype"].help
    assert "float32 on every CPU" in help_text and "bfloat16 on CUDA" in help_text, help_text
    cpu, gpu = (MethodSpec.parse("ddtree", device=torch.device(d)).label for d in ("cpu", "cuda"))
    assert f"`{cpu}` on a CPU and `{gpu}` on a GPU" in text and (cpu, gpu) == ("ddtree:auto+lookup", "ddtree:64")


# --- the layout table and the docs index ------------------------------------------------------------------------

def test_the_layout_table_names_every_module_and_folder():
    spans = set(code_spans(readme_section("Layout")))
    names = {s.rstrip("/").split("/")[-1] for s in spans} | {s.rstrip("/") for s in spans}
    package = ROOT / "ddtree"
    missing = [str(p.relative_to(ROOT)) for p in sorted(package.rglob("*.py"))
               if "__pycache__" not in p.parts and p.name != "__init__.py"
               and str(p.relative_to(ROOT)) not in names and p.name not in names]
    missing += [f"ddtree/{d.name}/" for d in sorted(package.iterdir())  # a folder, or a path inside it
                if d.is_dir() and d.name != "__pycache__" and not any(s.startswith(f"ddtree/{d.name}/") for s in spans)]
    missing += [f"{d}/" for d in ("kernels", "scripts", "data", "docs", "tests") if d not in names]
    assert missing == [], "the README's layout table misses these"


def test_the_docs_index_lists_every_page_and_readme_section():
    index = (ROOT / "docs" / "index.md").read_text()
    listed = set(code_spans(index))
    pages = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").rglob("*.md")) if p.name != "index.md"]
    assert [p for p in pages if p not in listed] == [], "docs/index.md does not list these pages"
    readme = (ROOT / "README.md").read_text()
    headings = re.findall(r"(?m)^## (.+)$", readme)
    table = index.split("## README.md", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"(?m)^\| (?!section |---)([^|]+?) \|", table)
    assert sorted(rows) == sorted(headings), "docs/index.md's README rows are not the README's sections"


# --- model cards --------------------------------------------------------------------------------------------------

def front_matter(card: str) -> dict[str, str]:
    """The top-level keys of a card's YAML front matter (list items folded into their key)."""
    assert card.startswith("---\n"), "a model card starts with Hugging Face metadata (YAML front matter)"
    block = card[4:card.index("\n---\n", 4)]
    keys, last = {}, None
    for line in block.splitlines():
        if line.startswith("- ") and last:
            keys[last] = (keys[last] + " " + line[2:]).strip()
        else:
            last, _, value = line.partition(":")
            keys[last] = value.strip()
    return keys


def sections(card: str) -> list[str]:
    return re.findall(r"(?m)^## (.+)$", card)


def test_the_shipped_model_card_has_metadata_and_use_first():
    card = (ROOT / "ddtree" / "assets" / "smollm2-135m-dflash" / "README.md").read_text()
    meta = front_matter(card)
    assert meta["license"] == "apache-2.0" and meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert meta["library_name"] and meta["pipeline_tag"] == "text-generation"
    assert {"speculative-decoding", "dflash", "ddtree"} <= set(meta["tags"].split())
    order = sections(card)
    assert order[0] == "Use" and order.index("Results") < order.index("Training"), order


def test_an_exported_card_has_the_same_shape(tmp_path):
    import json

    from ddtree.train.card import model_card

    hf = json.loads((ROOT / "ddtree" / "assets" / "smollm2-135m-dflash" / "config.json").read_text())
    cfg = dict(seqs_per_step=8, anchors=128, lr=1e-4, warmup=0.04, grad_clip=1.0, gamma=None, bf16=False,
               distill=0.5, distill_topk=32, eval_ddtree_budget=32)
    state = dict(drafter_config=hf, config=cfg, step=3, label_tokens=100, seq_tokens=500, train_seconds=6.0)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "log.jsonl").write_text(json.dumps(
        dict(kind="eval", step=3, label_tokens=100, train_seconds=6.0, val_loss=3.0, val_acc=0.2, tau_dflash=1.5,
             tau_prompts="heldout")) + "\n")
    card = model_card(state, tmp_path / "run", None, "bfloat16", "t")
    meta = front_matter(card)
    assert meta["license"] == "apache-2.0" and meta["library_name"] == "ddtree" and "dflash" in meta["tags"]
    assert "base_model" not in meta  # no data directory: the target is not known
    assert sections(card) == ["Use", "Held-out curve", "Training"]
    # with the default target's data, the base model is named
    data = ROOT / "data" / "smollm2-v6"
    card = model_card(state, None, data, "bfloat16", "t")
    assert front_matter(card)["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert sections(card)[:2] == ["Use", "Training"]
