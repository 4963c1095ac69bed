"""Batched decoding for training data: many sequences at once over the target's own layers.

A fixed set of `slots` rows shares one KV cache k, v [layers, slots, kv_heads, capacity, head_dim]; each row
has its own length (= the position of its next token). A step feeds one token per row (a [slots, H] pass,
per-row RoPE positions, each row attending to its own first length+1 keys); a row that finishes is refilled
at once with the next job, whose prompt is prefilled into that row alone by the target's ordinary
single-sequence forward. So the batch stays full and every matmul reads the weights once for all rows.

Attention reads every row's keys up to the longest row of its group, and it is most of a step's time (the
matmuls are shared by all rows; the KV reads are not). So every `resort_every` steps the rows are reordered
by length (their cache rows moved along) and attention runs per group of `group_size` consecutive rows, each
group up to its own longest row.

A job may carry a follow-up turn: when its answer ends with a stop token, the follow-up's tokens are fed to
the same row (its cache already holds prompt + answer) and the row goes on decoding the second answer.

Each row's tokens are what single-sequence `ar` decoding of the same model gives, up to floating-point
rounding of batched matmuls (near-ties may flip; `tests/test_batched.py` checks rows with the checker).
Sampled rows (temperature > 0) draw from their own per-job generator, so a job's answer does not depend on
which other jobs share the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F

from ..models.attention import Visibility
from ..base.config import SamplingParams
from ..models.kv_cache import KVCache
from ..models.protocol import reference
from ..engine.sampling import choose


@dataclass
class Job:
    key: str
    prompt_ids: list[int]
    temperature: float = 0.0  # 0 = greedy
    seed: int = 0
    follow_up: list[int] | None = None  # tokens fed after the first answer's stop token (a second user turn)
    tag: object = None  # caller's bookkeeping (e.g. which chunk the job belongs to)


def fits(job: Job, max_new_tokens: int, capacity: int) -> bool:
    """Can a row of `capacity` positions hold the job's prompt and answer (and its follow-up turn and answer)?"""
    extra = (len(job.follow_up) + 1 + max_new_tokens) if job.follow_up else 0
    return len(job.prompt_ids) + max_new_tokens + extra <= capacity


@dataclass
class Answer:
    job: Job
    turn: int  # 1 or 2
    prompt_ids: list[int]  # everything before the answer (for turn 2: prompt + answer 1 + follow-up)
    response_ids: list[int]  # ends with the stop token when the model produced one
    last_turn: bool = True  # False when a second turn of this job follows


@dataclass
class _Row:
    job: Job
    turn: int
    prompt_ids: list[int]
    response: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


class _SlotCache(KVCache):
    """One row of the batched cache seen as a single-sequence KVCache (views, no copies), so the target's
    own forward prefills it."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, length: int):
        self.k, self.v, self.capacity, self.length = k, v, k.shape[2], length


class BatchedDecoder:
    def __init__(self, target, slots: int, capacity: int, max_new_tokens: int, stop_ids: Iterable[int],
                 group_size: int = 8, resort_every: int = 32):
        c = target.cfg
        if slots < 1 or capacity < 2 or max_new_tokens < 1:
            raise ValueError(f"need slots >= 1, capacity >= 2, max_new_tokens >= 1; got {slots}, {capacity}, "
                             f"{max_new_tokens}")
        self.target, self.slots, self.capacity, self.max_new_tokens = target, slots, capacity, max_new_tokens
        self.group_size, self.resort_every = max(1, group_size), max(1, resort_every)
        self.stop_ids = set(int(t) for t in stop_ids)
        shape = (c.num_layers, slots, c.num_kv_heads, capacity, c.head_dim)
        self.k = torch.zeros(shape, dtype=target.kv_dtype, device=target.device)  # fp16 in the CPU integer mode
        self.v = torch.zeros(shape, dtype=target.kv_dtype, device=target.device)
        self.lengths = [0] * slots  # committed rows per slot = position of the slot's next token
        self.rows: list[_Row | None] = [None] * slots
        self.next_token = [0] * slots
        self.decode_steps = 0
        self.prefill_tokens = 0

    # --- one row -----------------------------------------------------------------------------------------
    def _prefill(self, slot: int, ids: list[int]) -> torch.Tensor:
        """Feed `ids` to one row after what it holds; return the logits [V] of the last one."""
        start = self.lengths[slot]
        cache = _SlotCache(self.k[:, slot], self.v[:, slot], start)
        dev = self.target.device
        out = self.target(torch.tensor(ids, device=dev), torch.arange(start, start + len(ids), device=dev), cache,
                          Visibility.causal(start, len(ids), dev), last_only=True)
        self.lengths[slot] = start + len(ids)
        self.prefill_tokens += len(ids)
        return out.logits[0]

    def _choose(self, logits: torch.Tensor, row: _Row) -> int:
        params = SamplingParams(row.job.temperature if row.generator is not None else 0.0)
        return int(choose(logits[None], params, row.generator)[0])  # the engine's own token choice

    def _start(self, slot: int, job: Job) -> None:
        gen = torch.Generator(self.target.device).manual_seed(job.seed) if job.temperature > 0 else None
        row = _Row(job, 1, list(job.prompt_ids), generator=gen)
        self.lengths[slot] = 0
        self.rows[slot] = row
        self.next_token[slot] = self._choose(self._prefill(slot, row.prompt_ids), row)

    # --- the batch -----------------------------------------------------------------------------------------
    def _resort(self) -> None:
        """Reorder the rows by length (cache rows, lengths, pending tokens and row states together), so each
        attention group holds rows of similar length."""
        order = sorted(range(self.slots), key=lambda s: self.lengths[s])
        if order == list(range(self.slots)):
            return
        used = max(self.lengths) + 1
        perm = torch.tensor(order, device=self.k.device)
        for cache in (self.k, self.v):  # only the used positions move
            cache[:, :, :, :used] = cache[:, perm, :, :used]
        self.lengths = [self.lengths[s] for s in order]
        self.rows = [self.rows[s] for s in order]
        self.next_token = [self.next_token[s] for s in order]

    @torch.inference_mode()
    def _step(self) -> None:
        """Every row takes its pending token and computes the next one: a [slots]-token pass."""
        if self.decode_steps % self.resort_every == 0:
            self._resort()
        t, dev = self.target, self.target.device
        cfg = t.cfg
        pos = torch.tensor(self.lengths, device=dev)  # [S]
        tokens = torch.tensor(self.next_token, device=dev)  # [S]
        slot_idx = torch.arange(self.slots, device=dev)[:, None]  # [S, 1]
        head_idx = torch.arange(cfg.num_kv_heads, device=dev)[None, :]  # [1, Hkv]
        group = cfg.num_heads // cfg.num_kv_heads
        # attention groups: consecutive rows [a, b), keys up to the group's longest row
        groups = []
        for a in range(0, self.slots, self.group_size):
            b = min(a + self.group_size, self.slots)
            span = max(self.lengths[a:b]) + 1
            visible = (torch.arange(span, device=dev)[None, :] <= pos[a:b, None])[:, None, None, :]  # [b-a,1,1,span]
            groups.append((a, b, span, visible))
        h = t.embed(tokens)  # [S, H]
        model = reference(t)  # its layers, one row per slot (the runtime's passes are one sequence's)
        cos, sin = model.rotary(pos, h.dtype)  # [S, D]: each row at its own position

        def attend(i, q, k, v):  # q [Hq, S, D], k, v [Hkv, S, D]: one new row per slot
            self.k[i, slot_idx, head_idx, pos[:, None]] = k.transpose(0, 1)  # row s writes at its own position
            self.v[i, slot_idx, head_idx, pos[:, None]] = v.transpose(0, 1)
            # GQA: the `group` query heads of a KV head attend as `group` queries of that head.
            qf = q.transpose(0, 1).reshape(self.slots, cfg.num_kv_heads, group, cfg.head_dim)
            o = torch.cat([F.scaled_dot_product_attention(qf[a:b], self.k[i, a:b, :, :span].to(qf.dtype),
                                                          self.v[i, a:b, :, :span].to(qf.dtype), attn_mask=visible)
                           for a, b, span, visible in groups])  # .to: an fp16 cache is read widened (a no-op else)
            return o.reshape(self.slots, cfg.num_heads, cfg.head_dim).transpose(0, 1)

        for i, layer in enumerate(model.model.layers):  # rows play the role of tokens: [S, H]
            h = layer(h, cos, sin, lambda q, k, v, i=i: attend(i, q, k, v))
        logits = t.logits(model.model.norm(h))  # [S, V]
        greedy = logits.argmax(-1).tolist()
        for s, row in enumerate(self.rows):
            if row is not None:  # an idle row (no jobs left) stays at length 0, rewriting position 0
                self.lengths[s] += 1
                row.response.append(self.next_token[s])
                self.next_token[s] = greedy[s] if row.generator is None else self._choose(logits[s], row)
        self.decode_steps += 1

    def _finished(self, slot: int) -> Answer | None:
        """The row's answer when its last committed token ended it, else None."""
        row = self.rows[slot]
        if row is None or not row.response:
            return None
        stopped = row.response[-1] in self.stop_ids
        if not stopped and len(row.response) < self.max_new_tokens and self.lengths[slot] < self.capacity:
            return None
        second = row.turn == 1 and stopped and row.job.follow_up is not None
        return Answer(row.job, row.turn, row.prompt_ids, row.response, last_turn=not second)

    @torch.inference_mode()
    def run(self, jobs: Iterable[Job]) -> Iterator[Answer]:
        """Decode every job; yields each answer (first turns, then second turns) as it completes. Jobs whose
        prompt cannot fit the cache with max_new_tokens (twice with a follow-up) are skipped (yielded as
        answers with an empty response and turn 0)."""
        pending = iter(jobs)

        def refill(slot: int) -> Answer | None:
            for job in pending:
                if fits(job, self.max_new_tokens, self.capacity):
                    self._start(slot, job)
                    return None
                return Answer(job, 0, list(job.prompt_ids), [])
            self.rows[slot] = None
            self.lengths[slot] = 0
            return None

        for s in range(self.slots):
            while (skipped := refill(s)) is not None:
                yield skipped
        while any(r is not None for r in self.rows):
            self._step()
            for s, row in enumerate(self.rows):
                ans = self._finished(s)
                if ans is None:
                    continue
                yield ans
                if not ans.last_turn:  # the row keeps its cache: prompt + answer, then the follow-up turn
                    # (a response token is appended when it is fed, so the stop token's K/V are there)
                    prompt2 = row.prompt_ids + row.response + list(row.job.follow_up)
                    self.rows[s] = _Row(row.job, 2, prompt2, generator=row.generator)
                    self.next_token[s] = self._choose(self._prefill(s, list(row.job.follow_up)), self.rows[s])
                    continue
                while (skipped := refill(s)) is not None:
                    yield skipped
