"""Training data: the TARGET's own answers to the training prompts, as resumable chunks of token ids.

Layout of a data directory:
    meta.json           what was generated (target, dtype, prompt set, decoding settings); checked on resume
    chunk_00000.npz     the answers to one chunk of prompts (the unit of resuming), compact:
                          tokens uint16 (or int32 for vocabularies over 65,536) [total]: every record's
                            prompt + response, concatenated
                          offsets int64 [R + 1], prompt_lens int32 [R], turns uint8 [R] (1, or 2 for an answer
                            to a follow-up), temperatures float32 [R] (0 = greedy)
                          records: JSON lines, one {"key", "source", "split"} per record, as uint8 bytes
    shard_00000.jsonl   (older layout, still read) one JSON record per prompt
A chunk is written to a temporary name and renamed when all its answers are in, so a restart skips finished
chunks and redoes only unfinished ones. A response ends with the stop token when the target produced one
(the drafter must learn to predict it too). Answers come from `BatchedDecoder` (the project's own target code,
many rows at once), greedy or sampled per prompt.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..base.config import ConfigError
from ..base.files import read_jsonl
from .batched import Answer, BatchedDecoder, Job
from .static_batched import StaticBatchedDecoder
from .prompts import Prompt

SHARD_GLOB = "shard_*.jsonl"
CHUNK_GLOB = "chunk_*.npz"


def encode_prompt(prompt: Prompt, tokenizer) -> list[int]:
    if prompt.ids is not None:
        return list(prompt.ids)
    if tokenizer is None:
        raise ValueError(f"prompt {prompt.key} is text but the target has no tokenizer")
    return _template(tokenizer, prompt.messages)


def _template(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return [int(t) for t in ids]


def follow_up_ids(prompt: Prompt, tokenizer, prompt_ids: list[int]) -> list[int] | None:
    """The tokens that follow the first answer's stop token for the follow-up turn: the chat template of
    [user, assistant, user] minus its [user, assistant] part, so the second turn's prompt is exactly the
    template's own tokens around the target's answer."""
    if prompt.follow_up_ids is not None:
        return list(prompt.follow_up_ids)
    if prompt.follow_up is None or tokenizer is None:
        return None
    marker = "\u2063ANSWER\u2063"  # any text: only the template around it matters
    both = prompt.messages + [{"role": "assistant", "content": marker}, {"role": "user", "content": prompt.follow_up}]
    text = tokenizer.apply_chat_template(both, add_generation_prompt=True, tokenize=False)
    eos = _template_end(tokenizer)
    after = text.split(marker, 1)[1]
    if not after.startswith(eos):
        return None  # a template that does not close the answer with the stop token: no second turn
    return [int(t) for t in tokenizer.encode(after[len(eos):], add_special_tokens=False)]


def _template_end(tokenizer) -> str:
    """The token that closes an assistant turn in the chat template (the model's stop token), as text. A
    lookup of one token, not of the whole vocabulary (this runs once per prompt)."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return "<|im_end|>" if im_end is not None and im_end != tokenizer.unk_token_id else tokenizer.eos_token


@dataclass
class GenerationSettings:
    max_new_tokens: int = 256  # per answer (a follow-up's answer gets as many again)
    slots: int = 64  # rows decoded together
    sampled_fraction: float = 0.25  # prompts answered at a temperature drawn from [t_min, t_max] (the rest greedy)
    t_min: float = 0.7
    t_max: float = 1.0
    follow_up_fraction: float = 0.35  # prompts that get a second user turn
    seed: int = 0
    chunk_size: int = 250  # prompts per chunk file
    max_prompt_tokens: int = 512
    answers_per_prompt: int = 1  # answers 2.. of a prompt are always sampled (key "<key>#<n>", the prompt's split)

    def __post_init__(self):
        for name in ("sampled_fraction", "follow_up_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {getattr(self, name)}")
        if not 0.0 < self.t_min <= self.t_max:
            raise ValueError(f"need 0 < t_min <= t_max, got {self.t_min}, {self.t_max}")
        if min(self.max_new_tokens, self.slots, self.chunk_size, self.max_prompt_tokens, self.answers_per_prompt) < 1:
            raise ValueError("max_new_tokens, slots, chunk_size, max_prompt_tokens and answers_per_prompt must be >= 1")


def _job_sampling(key: str, settings: GenerationSettings, sampled: bool = False) -> tuple[float, int]:
    """(temperature, seed) of a prompt, fixed by its key: the same prompt always gets the same draw. sampled: always
    at a temperature (a prompt's further answers: a greedy one would repeat the first)."""
    rng = random.Random(f"sample:{settings.seed}:{key}")
    draw = rng.random() < settings.sampled_fraction
    temperature = rng.uniform(settings.t_min, settings.t_max) if draw or sampled else 0.0
    return temperature, rng.getrandbits(62)


# The batched generators: "rows" (BatchedDecoder, shaped for a CPU), "static" (StaticBatchedDecoder: fixed buffers;
# on CUDA graphs and the Triton row attention), "static-eager" (the same in plain torch, without either) and "auto"
# (static on CUDA, else rows).
DECODERS = ("auto", "rows", "static", "static-eager")

# Recorded in meta.json but free to change on resume: how many rows run together is a matter of the machine
# (512 on a GPU, 64 on a CPU), not of what is generated.
EXECUTION_KEYS = {"slots"}


def _check_meta(out_dir: Path, meta: dict) -> None:
    path = out_dir / "meta.json"
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e}); restore it or use another --out directory") from None
        diff = sorted(k for k in set(old) | set(meta) if old.get(k) != meta.get(k) and k not in EXECUTION_KEYS)
        if diff:
            raise ValueError(f"{out_dir} already holds data generated with different settings ({', '.join(diff)}); "
                             "use another --out directory or the original settings")
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(meta, indent=2) + "\n")


def generate_data(target, tokenizer, prompts: list[Prompt], out_dir, settings: GenerationSettings, stop_ids=(),
                  heldout_fraction: float = 0.02, meta: dict | None = None, progress: bool = True,
                  max_minutes: float | None = None, group_size: int = 8, decoder: str = "auto") -> dict:
    """Write the target's answers to `prompts` as chunks in out_dir; skip chunks already there; stop taking
    new chunks after max_minutes (the chunks under way are finished; run again to continue). group_size: rows per
    attention group of the CPU generator. decoder: one of DECODERS, an execution detail like slots (greedy answers
    are the same, sampled ones the same distribution). Returns counts:
    {"chunks", "written", "skipped", "remaining", "tokens", "answers", "seconds", "decode_steps",
    "prefill_tokens"}."""
    from tqdm import tqdm

    if decoder not in DECODERS:
        raise ValueError(f"decoder must be one of {', '.join(DECODERS)}, got {decoder!r}")
    out_dir = Path(out_dir)
    keys = [p.key for p in prompts]
    recorded = asdict(settings)
    if settings.answers_per_prompt == 1:  # directories made before the setting existed resume as they are
        del recorded["answers_per_prompt"]
    _check_meta(out_dir, {**(meta or {}), **recorded, "num_prompts": len(prompts),
                          "heldout_fraction": heldout_fraction, "prompt_keys_sha1": _sha1("\n".join(keys)),
                          "dtype": str(target.dtype).removeprefix("torch.")})
    chunks = [prompts[i:i + settings.chunk_size] for i in range(0, len(prompts), settings.chunk_size)]
    todo = [i for i in range(len(chunks)) if not (out_dir / f"chunk_{i:05d}.npz").is_file()]
    stats = {"chunks": len(chunks), "written": 0, "skipped": len(chunks) - len(todo), "remaining": len(todo),
             "tokens": 0, "answers": 0, "seconds": 0.0, "decode_steps": 0, "prefill_tokens": 0}
    if not todo:
        return stats
    capacity = settings.max_prompt_tokens + 2 * settings.max_new_tokens + 128  # room for a follow-up turn
    if decoder == "auto":
        decoder = "static" if target.device.type == "cuda" else "rows"
    if decoder.startswith("static"):
        plain = False if decoder == "static-eager" else None  # None: graphs and the Triton attention on CUDA
        batched = StaticBatchedDecoder(target, settings.slots, capacity, settings.max_new_tokens, stop_ids,
                                       graphs=plain, row_kernel=plain)
    else:
        batched = BatchedDecoder(target, settings.slots, capacity, settings.max_new_tokens, stop_ids, group_size)
    open_jobs: dict[int, int] = {}  # chunk -> jobs not finished yet
    records: dict[int, list] = {i: [] for i in todo}
    t0 = time.perf_counter()
    bar = tqdm(total=sum(len(chunks[i]) for i in todo) * settings.answers_per_prompt, unit="job", desc="generate-data",
               disable=not progress)

    def jobs():
        for i in todo:
            if max_minutes is not None and time.perf_counter() - t0 >= 60 * max_minutes:
                return
            chunk_jobs = []
            for p in chunks[i]:
                ids = encode_prompt(p, tokenizer)
                if len(ids) > settings.max_prompt_tokens:
                    continue
                follow = follow_up_ids(p, tokenizer, ids)
                for n in range(1, settings.answers_per_prompt + 1):
                    key = p.key if n == 1 else f"{p.key}#{n}"
                    temperature, seed = _job_sampling(key, settings, sampled=n > 1)
                    chunk_jobs.append(Job(key, ids, temperature, seed, follow, (i, p)))
            bar.update(len(chunks[i]) * settings.answers_per_prompt - len(chunk_jobs))  # prompts too long
            open_jobs[i] = len(chunk_jobs)
            if not chunk_jobs:
                _finish(i)
            yield from chunk_jobs

    def _finish(i: int) -> None:
        write_chunk(out_dir / f"chunk_{i:05d}.npz", records.pop(i), target.cfg.vocab_size)
        del open_jobs[i]
        stats["written"] += 1
        stats["remaining"] -= 1

    for ans in batched.run(jobs()):
        i, p = ans.job.tag
        if ans.turn > 0:
            records[i].append((ans, p.source, p.split(heldout_fraction)))
            stats["tokens"] += len(ans.response_ids)
            stats["answers"] += 1
        if ans.last_turn:
            bar.update(1)
            open_jobs[i] -= 1
            if open_jobs[i] == 0:
                _finish(i)
        bar.set_postfix(tok_s=f"{stats['tokens'] / (time.perf_counter() - t0):.0f}")
    bar.close()
    stats.update(seconds=time.perf_counter() - t0, decode_steps=batched.decode_steps,
                 prefill_tokens=batched.prefill_tokens)
    return stats


def write_chunk(path: Path, records: list[tuple[Answer, str, str]], vocab_size: int) -> None:
    """Atomically write one chunk (see the module docstring for the arrays)."""
    records = sorted(records, key=lambda r: (r[0].job.key, r[0].turn))  # independent of completion order
    seqs = [a.prompt_ids + a.response_ids for a, _, _ in records]
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.int32
    meta = "".join(json.dumps({"key": a.job.key, "source": src, "split": split}) + "\n" for a, src, split in records)
    arrays = dict(
        tokens=np.array([t for s in seqs for t in s], dtype=dtype),
        offsets=np.cumsum([0] + [len(s) for s in seqs], dtype=np.int64),
        prompt_lens=np.array([len(a.prompt_ids) for a, _, _ in records], dtype=np.int32),
        turns=np.array([a.turn for a, _, _ in records], dtype=np.uint8),
        temperatures=np.array([a.job.temperature for a, _, _ in records], dtype=np.float32),
        records=np.frombuffer(meta.encode(), dtype=np.uint8))
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, path)


# What to do about a damaged chunk or shard: generate-data writes any missing one again.
REGENERATE = "delete it and rerun the same generate-data command: it writes it again"
RECORD_KEYS = {"key", "source", "split", "prompt_ids", "response_ids"}


def read_chunk(path: Path) -> list[dict]:
    """One chunk's records as dicts: key, source, split, turn, temperature, prompt_ids, response_ids."""
    try:
        with np.load(path) as z:
            tokens, offsets, plens = z["tokens"].astype(np.int64), z["offsets"], z["prompt_lens"]
            turns, temps = z["turns"], z["temperatures"]
            metas = [json.loads(line) for line in bytes(z["records"]).decode().splitlines()]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:  # truncated or not a chunk
        raise ConfigError(f"{path} is damaged ({type(e).__name__}: {e}); {REGENERATE}") from None
    out = []
    for r, m in enumerate(metas):
        seq = tokens[offsets[r]:offsets[r + 1]].tolist()
        out.append({**m, "turn": int(turns[r]), "temperature": float(temps[r]), "prompt_ids": seq[:plens[r]],
                    "response_ids": seq[plens[r]:]})
    return out


def _sha1(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


@dataclass
class Sequence:
    tokens: list[int]  # prompt + response
    prompt_len: int
    key: str
    source: str
    turn: int = 1
    temperature: float = 0.0


def read_records(data_dir) -> list[dict]:
    """Every record of a data directory (chunks, then older JSONL shards), in file order."""
    data_dir = Path(data_dir)
    chunks, shards = sorted(data_dir.glob(CHUNK_GLOB)), sorted(data_dir.glob(SHARD_GLOB))
    if not chunks and not shards:
        raise FileNotFoundError(f"{data_dir} holds no {CHUNK_GLOB} chunks or {SHARD_GLOB} shards: run "
                                "`python -m ddtree train generate-data`")
    out = [r for path in chunks for r in read_chunk(path)]
    for path in shards:
        for number, r in read_jsonl(path, REGENERATE):
            if not isinstance(r, dict) or not RECORD_KEYS <= set(r):
                needs = ", ".join(sorted(RECORD_KEYS))
                raise ConfigError(f"{path}:{number}: not a generate-data record (needs {needs}); {REGENERATE}")
            out.append(r)
    return out


def data_dir_list(data_dirs) -> list:
    """One data directory (str or path) or several (any iterable) as a list; None as an empty list."""
    if data_dirs is None:
        return []
    return [data_dirs] if isinstance(data_dirs, (str, os.PathLike)) else list(data_dirs)


def read_sequences(data_dirs, split: str | None = "train", min_response: int = 2) -> list[Sequence]:
    """The records of one data directory, or of several (a list, in order), as training sequences (one split,
    or all with split=None)."""
    dirs = data_dir_list(data_dirs)
    return [Sequence(r["prompt_ids"] + r["response_ids"], len(r["prompt_ids"]), r["key"], r["source"],
                     r.get("turn", 1), r.get("temperature", 0.0))
            for d in dirs for r in read_records(d)
            if (split is None or r["split"] == split) and len(r["response_ids"]) >= min_response]
