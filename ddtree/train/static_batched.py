"""Batched data generation shaped for a GPU: fixed buffers, one replayed decode graph per step, one copy back.

`BatchedDecoder` (batched.py) is shaped for a CPU: per-step Python over the rows, attention per group of rows, a
prefill per refilled row. On a GPU each of those is a launch or a synchronization, and a step of a 135M target is a
few milliseconds of kernels. Here:

- `slots` rows share k, v [layers, slots, kv_heads, capacity, head_dim]. Every per-row input of a step lives in one
  device tensor `state` [6, slots] (the token fed, its position, whether the row advances, the job's seed halves,
  its token counter) and `temperature` [slots]; the host keeps a numpy mirror and uploads it (one copy) only when a
  row changed.
- A decode step is one pass over every row (idle rows too: they rewrite one cache row of their own that their next
  prefill overwrites). Its attention reads each row's own keys through a Triton kernel (kernels/row_attention.py,
  on CUDA), else SDPA over keys [0, span) with a mask, span the longest row rounded up to `span_step` (under
  continuous refill the longest row holds ~4x the mean's keys). The next token is chosen on the device and the
  inputs advance there, so a quiet step uploads nothing and downloads [slots] token ids (the step's one
  synchronization). On CUDA the pass is a captured graph (one per span).
- Rows whose job ended wait until `refill_at` rows wait (or nothing else runs); then all of them are prefilled
  together in padded passes of at most `prefill_tokens` tokens (a follow-up turn the same way, after its row's past).
- Sampling: inverse CDF of softmax(logits / T) at one uniform per row, hashed from (job seed, token counter): a job's
  answer does not depend on its batch, and there is no generator state to capture.

Greedy rows are what single-sequence `ar` decoding of the same model gives, up to the rounding of batched matmuls
(tests/test_static_batched.py checks them with the checker). The jobs and answers are batched.py's.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from ..base.kernel_files import kernel_module
from ..models.protocol import reference
from .batched import Answer, Job, fits

TOKEN, POSITION, ADVANCE, SEED_LO, SEED_HI, COUNTER = range(6)
_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """An integer hash of values in [0, 2^32) (int64 tensors; every product stays below 2^63)."""
    for _ in range(2):
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def counter_uniform(seed_lo: torch.Tensor, seed_hi: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """One uniform in (0, 1) per row [R] (float32) from the row's seed halves and token counter (int64 [R])."""
    h = _mix32((seed_lo + _mix32((seed_hi ^ counter) & _MASK32)) & _MASK32)
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def choose_rows(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """logits [R, V], temperature [R] (0 = greedy), uniform [R] -> tokens [R] (int64): the argmax, or the token whose
    slice of softmax(logits / T)'s CDF holds the uniform."""
    greedy = logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature.clamp_min(1e-6)[:, None], dim=-1)
    cdf = probs.cumsum(-1)  # [R, V]; its last entry is 1 up to rounding
    drawn = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None]).squeeze(1).clamp_max(logits.shape[-1] - 1)
    return torch.where(temperature > 0, drawn, greedy)


class StaticBatchedDecoder:
    """`run(jobs)` yields Answers like BatchedDecoder.run. graphs: capture each span's decode pass (CUDA only)."""

    def __init__(self, target, slots: int, capacity: int, max_new_tokens: int, stop_ids: Iterable[int],
                 span_step: int = 128, refill_at: int | None = None, prefill_tokens: int = 16384,
                 graphs: bool | None = None, row_kernel: bool | None = None):
        if slots < 1 or capacity < 2 or max_new_tokens < 1 or span_step < 1 or prefill_tokens < 1:
            raise ValueError(f"need slots, max_new_tokens, span_step, prefill_tokens >= 1 and capacity >= 2; got "
                             f"{slots}, {max_new_tokens}, {span_step}, {prefill_tokens}, {capacity}")
        self.target, self.model = target, reference(target)
        c, dev = self.model.cfg, target.device
        self.slots, self.capacity, self.max_new_tokens = slots, capacity, max_new_tokens
        self.prefill_limit = prefill_tokens
        self.refill_at = max(1, slots // 32) if refill_at is None else max(1, refill_at)
        self.graphs = dev.type == "cuda" if graphs is None else graphs
        if self.graphs and dev.type != "cuda":
            raise ValueError("graphs=True needs a CUDA target")
        # the decode step's attention: the Triton kernel reading each row's own keys (kernels/row_attention.py; on
        # CUDA where triton imports, by default), else SDPA over [0, span) with a mask
        self._row_attention = None
        if dev.type == "cuda" if row_kernel is None else row_kernel:
            try:
                self._row_attention = kernel_module("row_attention").row_attention
            except ImportError as e:
                if row_kernel:
                    raise ValueError(f"row_kernel=True needs triton ({e}); pip install triton") from None
        if self._row_attention is not None:
            span_step = capacity  # the kernel reads each row's length on the device: one span, one graph
        self.span_step = span_step
        self.stops = np.array(sorted(int(t) for t in stop_ids), dtype=np.int64)
        shape = (c.num_layers, slots, c.num_kv_heads, capacity, c.head_dim)
        self.k = torch.zeros(shape, dtype=target.dtype, device=dev)
        self.v = torch.zeros(shape, dtype=target.dtype, device=dev)
        self.state = torch.zeros(6, slots, dtype=torch.int64, device=dev)  # rows TOKEN ... COUNTER
        self.temperature = torch.zeros(slots, dtype=torch.float32, device=dev)
        self.chosen = torch.zeros(slots, dtype=torch.int64, device=dev)  # the decode pass's output
        pin = dev.type == "cuda"
        self.host = torch.zeros(6, slots, dtype=torch.int64, pin_memory=pin)  # the mirror of `state`
        self.host_temperature = torch.zeros(slots, dtype=torch.float32, pin_memory=pin)
        self.h = self.host.numpy()
        self.response = np.zeros((slots, max_new_tokens), dtype=np.int64)  # the row's answer so far
        self.length = np.zeros(slots, dtype=np.int64)  # tokens of this turn's answer
        self.jobs: list[Job | None] = [None] * slots
        self.turn = np.zeros(slots, dtype=np.int64)
        self.prompts: list[list[int]] = [[] for _ in range(slots)]
        self.dirty = True  # the mirror differs from the device state
        self.decode_steps = 0
        self.prefill_tokens = 0  # tokens prefilled so far (BatchedDecoder's count)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._rows = torch.arange(slots, device=dev)[:, None]  # [R, 1] index of the cache write
        self._heads = torch.arange(c.num_kv_heads, device=dev)[None, :]  # [1, Hkv]

    # --- the decode pass ----------------------------------------------------------------------------------------
    def _decode(self, span: int) -> None:
        """Every row feeds state[TOKEN] at state[POSITION]; `chosen` gets its next token; rows with ADVANCE set
        move on (token, position, counter). Fixed shapes: capturable."""
        c, m, s = self.model.cfg, self.model, self.state
        pos = s[POSITION]
        group = c.num_heads // c.num_kv_heads
        if self._row_attention is None:
            visible = (torch.arange(span, device=pos.device)[None, :] <= pos[:, None])[:, None, None, :]  # [R,1,1,span]
        else:
            lengths = pos + 1  # [R] keys per row, this step's included

        def attend(i, q, k, v):  # q [Hq, R, D], k, v [Hkv, R, D]: one new row per slot, at the row's position
            self.k[i, self._rows, self._heads, pos[:, None]] = k.transpose(0, 1)
            self.v[i, self._rows, self._heads, pos[:, None]] = v.transpose(0, 1)
            if self._row_attention is not None:
                return self._row_attention(q.transpose(0, 1), self.k[i], self.v[i], lengths).transpose(0, 1)
            qf = q.transpose(0, 1).reshape(self.slots, c.num_kv_heads, group, c.head_dim)  # GQA as `group` queries
            o = F.scaled_dot_product_attention(qf, self.k[i, :, :, :span], self.v[i, :, :, :span], attn_mask=visible)
            return o.reshape(self.slots, c.num_heads, c.head_dim).transpose(0, 1)

        h = m.embed(s[TOKEN])  # [R, H]: rows play the role of tokens
        cos, sin = m.rotary(pos, h.dtype)
        for i, layer in enumerate(m.model.layers):
            h = layer(h, cos, sin, lambda q, k, v, i=i: attend(i, q, k, v))
        logits = m.logits(m.model.norm(h))  # [R, V]
        self.chosen.copy_(choose_rows(logits, self.temperature, counter_uniform(s[SEED_LO], s[SEED_HI], s[COUNTER])))
        adv = s[ADVANCE]
        s[TOKEN].copy_(torch.where(adv > 0, self.chosen, s[TOKEN]))
        s[POSITION].add_(adv)
        s[COUNTER].add_(adv)

    def _replay(self, span: int) -> None:
        if not self.graphs:
            return self._decode(span)
        graph = self._graphs.get(span)
        if graph is None:
            # the warm-up runs a real step, so this step is it; the capture records the pass without running it,
            # so state and chosen keep the warm-up's results
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._decode(span)
            torch.cuda.current_stream().wait_stream(side)
            self._pool = self._pool or torch.cuda.graph_pool_handle()
            graph = self._graphs[span] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._decode(span)
            return
        graph.replay()

    # --- prefill --------------------------------------------------------------------------------------------
    def _prefill(self, slots: list[int], starts: list[int], seqs: list[list[int]]) -> torch.Tensor:
        """Feed seqs[j] to row slots[j] after its first starts[j] cached positions, all rows in one padded pass;
        returns the hidden state [n, H] (final-normed) at each row's last token."""
        c, m, dev = self.model.cfg, self.model, self.k.device
        n, width = len(slots), max(len(q) for q in seqs)
        group = c.num_heads // c.num_kv_heads
        ids = torch.zeros(n, width, dtype=torch.int64)
        for j, q in enumerate(seqs):
            ids[j, :len(q)] = torch.tensor(q)
        lens = torch.tensor([len(q) for q in seqs])
        start = torch.tensor(starts)
        positions = start[:, None] + torch.arange(width)[None, :]  # [n, W]; a pad's position is past its row
        valid = torch.arange(width)[None, :] < lens[:, None]  # [n, W]
        span = int((start + lens).max())
        rows = torch.tensor(slots, device=dev)
        write_rows = rows[:, None].expand(n, width)[valid.to(dev)][:, None]  # [N, 1]: the valid tokens' cache rows
        write_pos = positions.to(dev)[valid.to(dev)][:, None]
        flat_valid = valid.flatten().to(dev)
        positions, ids = positions.to(dev), ids.to(dev)
        visible = (torch.arange(span, device=dev)[None, None, :] <= positions[:, :, None])  # [n, W, span]
        visible = visible[:, None, None].expand(n, 1, group, width, span).reshape(n, 1, group * width, span)

        def attend(i, q, k, v):  # q [Hq, n*W, D], k, v [Hkv, n*W, D]
            self.k[i, write_rows, self._heads, write_pos] = k.transpose(0, 1)[flat_valid]
            self.v[i, write_rows, self._heads, write_pos] = v.transpose(0, 1)[flat_valid]
            qf = (q.reshape(c.num_kv_heads, group, n, width, c.head_dim).permute(2, 0, 1, 3, 4)
                  .reshape(n, c.num_kv_heads, group * width, c.head_dim))
            o = F.scaled_dot_product_attention(qf, self.k[i, rows, :, :span], self.v[i, rows, :, :span],
                                               attn_mask=visible)  # [n, Hkv, group*W, D]
            return (o.reshape(n, c.num_kv_heads, group, width, c.head_dim).permute(1, 2, 0, 3, 4)
                    .reshape(c.num_heads, n * width, c.head_dim))

        h = m.embed(ids.flatten())  # [n*W, H]
        cos, sin = m.rotary(positions.flatten(), h.dtype)
        for i, layer in enumerate(m.model.layers):
            h = layer(h, cos, sin, lambda q, k, v, i=i: attend(i, q, k, v))
        last = h.reshape(n, width, -1)[torch.arange(n, device=dev), (lens - 1).to(dev)]  # [n, H]
        self.prefill_tokens += int(lens.sum())
        return m.model.norm(last)

    def _start_rows(self, entries: list[tuple[int, int, list[int]]]) -> None:
        """entries (slot, start, tokens): prefill each and set the row to decode its first token."""
        entries = sorted(entries, key=lambda e: len(e[2]))
        a = 0
        while a < len(entries):  # padded groups of similar length, at most prefill_tokens padded tokens each
            b = a + 1
            while b < len(entries) and (b + 1 - a) * len(entries[b][2]) <= self.prefill_limit:
                b += 1
            part = entries[a:b]
            slots = [e[0] for e in part]
            hidden = self._prefill(slots, [e[1] for e in part], [e[2] for e in part])
            self._upload()  # the rows' seeds and counters for the choice
            idx = torch.tensor(slots, device=hidden.device)
            s = self.state[:, idx]
            first = choose_rows(self.model.logits(hidden), self.temperature[idx],
                                counter_uniform(s[SEED_LO], s[SEED_HI], s[COUNTER])).tolist()
            for (slot, start, seq), tok in zip(part, first):
                self.h[TOKEN, slot], self.h[POSITION, slot] = tok, start + len(seq)
                self.h[COUNTER, slot] += 1
                self.h[ADVANCE, slot] = 1
            self.dirty = True
            a = b

    def _upload(self) -> None:
        if self.dirty:
            self.state.copy_(self.host, non_blocking=True)
            self.temperature.copy_(self.host_temperature, non_blocking=True)
            self.dirty = False

    # --- jobs --------------------------------------------------------------------------------------------------
    def _assign(self, slot: int, job: Job | None) -> None:
        self.jobs[slot], self.turn[slot], self.length[slot] = job, 1, 0
        h = self.h
        h[ADVANCE, slot], h[POSITION, slot], h[TOKEN, slot] = 0, 0, 0
        if job is not None:
            self.prompts[slot] = list(job.prompt_ids)
            h[SEED_LO, slot], h[SEED_HI, slot] = job.seed & _MASK32, (job.seed >> 32) & _MASK32
            h[COUNTER, slot] = 0
            self.host_temperature[slot] = job.temperature
        self.dirty = True

    @torch.inference_mode()
    def run(self, jobs: Iterable[Job]) -> Iterator[Answer]:
        """Decode every job; yields each answer (first turns, then second turns) as it completes. Jobs that cannot
        fit the cache with max_new_tokens (twice with a follow-up) are yielded at once with turn 0 and no answer."""
        pending = iter(jobs)
        waiting: list[tuple[int, int, list[int]]] = []  # (slot, start, tokens) to prefill
        idle = list(range(self.slots))  # rows without a job
        exhausted = False
        h = self.h
        while True:
            while idle and not exhausted:  # give idle rows new jobs
                job = next(pending, None)
                if job is None:
                    exhausted = True
                elif not fits(job, self.max_new_tokens, self.capacity):
                    yield Answer(job, 0, list(job.prompt_ids), [])
                else:
                    slot = idle.pop()
                    self._assign(slot, job)
                    waiting.append((slot, 0, list(job.prompt_ids)))
            running = int(h[ADVANCE].sum())
            if waiting and (len(waiting) >= self.refill_at or running == 0 or exhausted):
                self._start_rows(waiting)
                waiting = []
                running = int(h[ADVANCE].sum())
            if running == 0:
                return
            self._upload()
            span = min(self.capacity, -(-(int(h[POSITION].max()) + 1) // self.span_step) * self.span_step)
            self._replay(span)
            fed = h[TOKEN].copy()
            chosen = self.chosen.cpu().numpy()  # the step's one synchronization
            self.decode_steps += 1
            adv = h[ADVANCE] > 0
            rows = np.flatnonzero(adv)
            self.response[rows, self.length[rows]] = fed[rows]
            self.length[rows] += 1
            h[TOKEN, rows] = chosen[rows]
            h[POSITION, rows] += 1
            h[COUNTER, rows] += 1
            stopped = np.isin(fed, self.stops) & adv
            done = stopped | (adv & ((self.length >= self.max_new_tokens) | (h[POSITION] >= self.capacity)))
            for slot in np.flatnonzero(done).tolist():
                job, turn = self.jobs[slot], int(self.turn[slot])
                answer = self.response[slot, :self.length[slot]].tolist()
                second = turn == 1 and bool(stopped[slot]) and job.follow_up is not None
                yield Answer(job, turn, self.prompts[slot], answer, last_turn=not second)
                h[ADVANCE, slot] = 0
                self.dirty = True
                if second:  # the row keeps its cache (prompt + answer, the stop token's K/V included)
                    self.prompts[slot] = self.prompts[slot] + answer + list(job.follow_up)
                    self.turn[slot], self.length[slot] = 2, 0
                    waiting.append((slot, int(h[POSITION, slot]), list(job.follow_up)))
                else:
                    self._assign(slot, None)
                    idle.append(slot)
