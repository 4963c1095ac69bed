"""Training loop: AdamW + warmup/cosine, grad clipping, resumable checkpoints, wall-time limit, tau evaluation
with the real decoding engine, and multi-process data parallelism (torchrun; gloo on CPU, nccl on CUDA).

Everything that decides the data order is a function of (seed, epoch, step), so a resumed run replays exactly
the sequences and anchors an uninterrupted one would have seen:
    epoch order   = randperm(n_train, seed + epoch)
    step s        = order[s*S*W : (s+1)*S*W], rank r takes its S sequences (S = seqs_per_step, W = world size)
    anchors       = sample_anchors(..., generator seeded by (seed, epoch, sequence index))
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import random
import re
import sys
import time
import warnings
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..api import Pair
from ..base.config import ConfigError
from ..models.drafter import DFlashDrafter, DrafterConfig
from .data import Sequence
from .model import DraftLoss, sample_anchors, target_features_packed

CHECKPOINT = "checkpoint.pt"
STAT_KEYS = ("ce_sum", "w_sum", "correct", "labels", "markov_sum", "markov_w")  # DraftLoss's stats, summed per step
RUNTIME_FIELDS = ("pack_tokens", "checkpoint_every", "max_minutes", "max_steps", "eval_every", "eval_prompts",
                  "eval_max_new_tokens", "eval_ddtree_budget", "val_sequences", "feature_cache", "progress")


@dataclass
class TrainConfig:
    lr: float = 6e-4
    weight_decay: float = 0.01
    warmup: float = 0.04  # fraction of all steps
    min_lr_ratio: float = 0.0  # cosine decays to lr * min_lr_ratio
    grad_clip: float = 1.0
    epochs: int = 6
    total_steps: int | None = None  # the schedule's length in steps, in place of epochs x steps per epoch
    seqs_per_step: int = 4  # per process (gradient accumulation)
    anchors: int = 64  # per sequence, re-drawn every epoch
    include_prompt_anchors: bool = False
    max_seq_len: int = 1024
    gamma: float | None = None  # loss decay; None = 7 for B=16, 5 for B=10, 4 for B=8
    distill: float = 0.0  # weight of the target's own distribution in the loss (0 = hard labels only)
    distill_topk: int = 32  # the teacher distribution is the target's top-k, renormalized
    objective: str = "ce"  # "ce", "tv" (total variation: speculative sampling's rejection) or "ce+tv" (model.DraftLoss)
    markov_weight: float = 0.0  # > 0: train the drafter's Markov head with it, this weight on its NLL (model.DraftLoss)
    markov_lr: float | None = None  # the head's peak learning rate (None: lr), on the same schedule
    seed: int = 0
    bf16: bool = False  # autocast; only worth it on GPUs and CPUs with bf16 units
    # runtime (may change on --resume)
    pack_tokens: int = 0  # > 0: a step's sequences share passes of up to this many tokens (GPUs); 0: one each
    checkpoint_every: int = 100
    max_minutes: float = 110.0
    max_steps: int | None = None  # stop (with a checkpoint) after this global step
    eval_every: int = 0  # steps; 0 = only at the end
    eval_prompts: int = 4
    eval_max_new_tokens: int = 96
    eval_ddtree_budget: int = 0  # 0 = dflash only
    val_sequences: int = 16
    feature_cache: str | None = None
    progress: bool = True


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)


def init_distributed(device: torch.device) -> None:
    """Join the torchrun process group when WORLD_SIZE > 1 (gloo on CPU, nccl on CUDA)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


class FeatureSource:
    """Target tap features of a sequence (and, with topk > 0, the target's top-k next-token log-probs and ids
    for distillation): computed by the frozen target, optionally cached on disk (features in fp16, or fp32 if
    a value would overflow fp16) so later epochs skip the target pass."""

    def __init__(self, target, tap_layers, cache_dir: str | None, topk: int = 0):
        self.target, self.taps, self.topk = target, tuple(tap_layers), topk
        name = "taps_" + "_".join(map(str, self.taps)) + (f"_top{topk}" if topk else "")
        self.dir = Path(cache_dir) / name if cache_dir else None
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)

    def __call__(self, seq: Sequence, tokens: torch.Tensor):
        """Returns (features [T, taps*H], teacher (logprobs, ids) [T, K] or None)."""
        return self.many([(seq, tokens)])[0]

    def many(self, items: list, pack_tokens: int = 0) -> list:
        """__call__ for [(seq, tokens), ...]: the sequences not in the cache go through the target together, in
        passes of up to pack_tokens tokens (0: a pass each, the CPU default)."""
        results = [self._load(seq, tokens) for seq, tokens in items]
        todo = [i for i, r in enumerate(results) if r is None]
        passes, size = [], 0
        for i in todo:
            n = items[i][1].numel()
            if passes and size + n <= pack_tokens:
                passes[-1].append(i)
                size += n
            else:
                passes.append([i])
                size = n
        for group in passes:
            outs = target_features_packed(self.target, [items[i][1] for i in group], self.taps, self.topk)
            for i, out in zip(group, outs):
                results[i] = self._store(*items[i], out)
        return results

    def _path(self, seq: Sequence, tokens: torch.Tensor):
        return self.dir / (hashlib.sha1(f"{seq.key}:{tokens.tolist()}".encode()).hexdigest()[:20] + ".pt")

    def _load(self, seq: Sequence, tokens: torch.Tensor):
        if self.dir is None or not (path := self._path(seq, tokens)).is_file():
            return None
        try:
            saved = torch.load(path, weights_only=True)  # tensors only: never unpickle objects from a file
        except Exception:  # noqa: BLE001 - a damaged or foreign cache file: computed (and written) again
            return None
        feats, teacher = (saved, None) if torch.is_tensor(saved) else (saved["taps"], saved["teacher"])
        dev = self.target.device
        teacher = None if teacher is None else (teacher[0].to(dev).float(), teacher[1].to(dev).long())
        return feats.to(dev, self.target.dtype), teacher

    def _store(self, seq: Sequence, tokens: torch.Tensor, out):
        feats, teacher = (out, None) if self.topk == 0 else out
        if self.dir is not None:
            path = self._path(seq, tokens)
            small = feats.half() if feats.abs().max() < 6e4 else feats.float()
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            if teacher is None:
                torch.save(small.cpu(), tmp)
            else:
                teacher = (teacher[0].half().float(), teacher[1])  # train on exactly what later epochs read
                torch.save({"taps": small.cpu(), "teacher": (teacher[0].half().cpu(), teacher[1].int().cpu())}, tmp)
            os.replace(tmp, path)
            feats = small.to(feats.dtype)  # train on exactly what later epochs will read
        return feats, teacher


class Trainer:
    def __init__(self, cfg: TrainConfig, target, drafter: DFlashDrafter, train: list[Sequence], out_dir,
                 heldout: list[Sequence] = (), tokenizer=None, stop_ids=(), log=None):
        self.cfg, self.target, self.drafter = cfg, target, drafter
        fits = lambda s: s.prompt_len <= cfg.max_seq_len - 2  # noqa: E731 - room for at least one anchor
        self.train_seqs, self.heldout = [s for s in train if fits(s)], [s for s in heldout if fits(s)]
        self.tokenizer, self.stop_ids = tokenizer, tuple(stop_ids)
        self.log_fn = log or (lambda text: print(text, file=sys.stderr, flush=True))  # progress: stderr
        self.out_dir = Path(out_dir)
        self.device = target.device
        self.rank, self.world = _rank_world()
        if not self.train_seqs:
            raise ValueError("no training sequences")
        if drafter.markov is not None:  # a head is trained only with its own loss term; else it stays as it is
            drafter.markov.requires_grad_(cfg.markov_weight > 0)
        self.loss_model = DraftLoss(drafter, target, cfg.gamma, cfg.distill, cfg.objective,
                                    cfg.markov_weight).to(self.device)
        self.model = self.loss_model
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.model = DistributedDataParallel(self.loss_model, device_ids=ids)
        params = [(n, p) for n, p in drafter.named_parameters() if p.requires_grad]
        head = [p for n, p in params if n.startswith("markov.")]  # no decay, as markov-fit
        decay = [p for n, p in params if p.ndim >= 2 and not n.startswith("markov.")]
        no_decay = [p for n, p in params if p.ndim < 2 and not n.startswith("markov.")]  # norms
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if head:
            groups.append({"params": head, "weight_decay": 0.0, "lr": cfg.markov_lr or cfg.lr})
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))
        self.steps_per_epoch = len(self.train_seqs) // (cfg.seqs_per_step * self.world)
        if self.steps_per_epoch < 1:
            raise ValueError(f"{len(self.train_seqs)} training sequences are fewer than one step needs "
                             f"({cfg.seqs_per_step} per process x {self.world} processes)")
        # a run sized by compute (total_steps) reads a random subset of its last epoch; the order stays a function
        # of (seed, epoch, step), so a resume replays it
        self.total_steps = cfg.total_steps or self.steps_per_epoch * cfg.epochs
        warm = max(1, round(cfg.warmup * self.total_steps))

        def schedule(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            t = (step - warm) / max(1, self.total_steps - warm)
            return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
        self.features = FeatureSource(target, drafter.cfg.target_layer_ids, cfg.feature_cache,
                                      cfg.distill_topk if cfg.distill > 0 else 0)
        self.step, self.label_tokens, self.seq_tokens, self.train_seconds = 0, 0, 0, 0.0

    # --- data position ------------------------------------------------------------------------------------
    def _step_sequences(self, step: int) -> tuple[int, list[int]]:
        epoch, s = divmod(step, self.steps_per_epoch)
        order = torch.randperm(len(self.train_seqs), generator=torch.Generator().manual_seed(self.cfg.seed + epoch))
        per = self.cfg.seqs_per_step
        start = (s * self.world + self.rank) * per
        return epoch, order[start:start + per].tolist()

    def _examples(self, seqs: list[Sequence], anchor_seeds: list[int]) -> list:
        """[(tokens [T], features [T, taps*H], anchors [A], teacher or None)] for these sequences; with
        pack_tokens the target's passes are packed like the drafter's."""
        tokens = [torch.tensor(s.tokens[: self.cfg.max_seq_len], device=self.device) for s in seqs]
        anchors = [sample_anchors(s.prompt_len, t.numel(), self.cfg.anchors, torch.Generator().manual_seed(a),
                                  self.cfg.include_prompt_anchors).to(self.device)
                   for s, t, a in zip(seqs, tokens, anchor_seeds)]
        feats = self.features.many(list(zip(seqs, tokens)), self.cfg.pack_tokens)
        return [(t, f, a, teacher) for t, a, (f, teacher) in zip(tokens, anchors, feats)]

    # --- packing a step's sequences into passes -------------------------------------------------------------
    def _packs(self, examples: list) -> list[list]:
        """The step's examples in passes of at most pack_tokens tokens (a longer sequence alone), in order."""
        if self.cfg.pack_tokens <= 0:
            return [[e] for e in examples]
        packs, size = [], 0
        for e in examples:
            if packs and size + e[0].numel() <= self.cfg.pack_tokens:
                packs[-1].append(e)
                size += e[0].numel()
            else:
                packs.append([e])
                size = e[0].numel()
        return packs

    @staticmethod
    def _packed(pack: list):
        """Concatenates examples (tokens, feats, anchors, teacher) into one pass; returns them plus bounds [S+1]
        (None for a single sequence, which keeps the unpacked arithmetic)."""
        if len(pack) == 1:
            return (*pack[0], None)
        lengths = torch.tensor([e[0].numel() for e in pack])
        bounds = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(pack[0][0].device)
        tokens = torch.cat([e[0] for e in pack])
        feats = torch.cat([e[1] for e in pack])
        anchors = torch.cat([e[2] + bounds[i] for i, e in enumerate(pack)])
        teacher = None if pack[0][3] is None else tuple(torch.cat([e[3][k] for e in pack]) for k in range(2))
        return tokens, feats, anchors, teacher, bounds

    # --- one optimizer step ---------------------------------------------------------------------------------
    def train_step(self) -> dict:
        t0 = time.perf_counter()
        self.drafter.train()
        epoch, indices = self._step_sequences(self.step)
        totals = torch.zeros(len(STAT_KEYS), dtype=torch.float64, device=self.device)
        examples = self._examples([self.train_seqs[idx] for idx in indices],
                                  [((self.cfg.seed * 1_000_003 + epoch) * 1_000_003 + idx) % 2**62 for idx in indices])
        seq_tokens = sum(e[0].numel() for e in examples)
        packs = self._packs(examples)
        for i, pack in enumerate(packs):
            tokens, feats, anchors, teacher, bounds = self._packed(pack)
            last = i == len(packs) - 1
            ctx = self.model.no_sync() if self.world > 1 and not last else _null()
            with ctx:
                with torch.autocast(self.device.type, torch.bfloat16, enabled=self.cfg.bf16):
                    loss, st = self.model(tokens, feats, anchors, teacher=teacher, bounds=bounds)
                (loss / len(indices)).backward()  # loss sums the pack's per-sequence means
            totals += torch.stack([st[k].double() for k in STAT_KEYS])
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        counts = torch.cat([totals, torch.tensor([seq_tokens], dtype=torch.float64, device=self.device)])
        if self.world > 1:
            dist.all_reduce(counts)
        self.step += 1
        self.label_tokens += int(counts[3])
        self.seq_tokens += int(counts[-1])
        self.train_seconds += time.perf_counter() - t0
        return {"kind": "train", "step": self.step, "epoch": epoch, "lr": lr, "loss": float(counts[0] / counts[1]),
                "acc": float(counts[2] / counts[3]), **self._markov_record(counts), "grad_norm": float(grad_norm),
                "label_tokens": self.label_tokens, "seq_tokens": self.seq_tokens,
                "train_seconds": round(self.train_seconds, 2)}

    def _markov_record(self, totals, prefix: str = "") -> dict:
        """{"markov_nll": the head's weighted mean NLL} from totals in STAT_KEYS order, when the head is trained."""
        if self.cfg.markov_weight <= 0:
            return {}
        return {prefix + "markov_nll": float(totals[4] / max(float(totals[5]), 1e-12))}

    # --- evaluation ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out weighted CE / top-1 accuracy (fixed anchors) and tau of real dflash (and ddtree) decoding."""
        self.drafter.eval()
        out = {"kind": "eval", "step": self.step, "label_tokens": self.label_tokens, "seq_tokens": self.seq_tokens,
               "train_seconds": round(self.train_seconds, 2)}
        val = self.heldout[: self.cfg.val_sequences]
        if val:
            totals = torch.zeros(len(STAT_KEYS), dtype=torch.float64)
            for i, seq in enumerate(val):
                (tokens, feats, anchors, teacher), = self._examples([seq], [1_000_003 + i])
                _, st = self.loss_model(tokens, feats, anchors, teacher=teacher)
                totals += torch.tensor([float(st[k]) for k in STAT_KEYS], dtype=torch.float64)
            out.update(val_loss=float(totals[0] / totals[1]), val_acc=float(totals[2] / totals[3]),
                       **self._markov_record(totals, "val_"))
        prompts = [s.tokens[: s.prompt_len] for s in (self.heldout or self.train_seqs)[: self.cfg.eval_prompts]]
        if prompts:
            out["tau_prompts"] = "heldout" if self.heldout else "train"  # no held-out data: say so in the record
            drafter = self.drafter
            if drafter.fc.weight.dtype != self.target.dtype:  # decode with a copy in the target's dtype
                drafter = DFlashDrafter(drafter.cfg, drafter.attention_backend)
                drafter.load_state_dict(self.drafter.state_dict())
                drafter = drafter.to(self.target.device, self.target.dtype)
            pair = Pair(self.target, drafter.bind(self.target), self.tokenizer, self.stop_ids)
            methods = [("dflash", 0)]
            if self.cfg.eval_ddtree_budget:
                methods.append(("ddtree", self.cfg.eval_ddtree_budget))
            for method, budget in methods:
                steps = accepted = 0
                for p in prompts:
                    stats = pair.generate(p, method=method, budget=budget or 64,
                                          max_new_tokens=self.cfg.eval_max_new_tokens).stats
                    steps += stats.steps
                    accepted += sum(stats.acceptance_lengths)
                out[f"tau_{method}"] = accepted / max(1, steps)
        self.drafter.train()
        return out

    # --- checkpoints --------------------------------------------------------------------------------------
    def state(self) -> dict:
        return {"drafter": self.drafter.state_dict(), "drafter_config": self.drafter.cfg.to_hf(),
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "step": self.step, "label_tokens": self.label_tokens, "seq_tokens": self.seq_tokens,
                "train_seconds": self.train_seconds, "config": asdict(self.cfg), "num_train": len(self.train_seqs),
                "world": self.world, "format": CHECKPOINT_FORMAT, "rng": rng_state()}

    def save_checkpoint(self) -> Path:
        path = self.out_dir / CHECKPOINT
        if self.rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            torch.save(self.state(), tmp)
            os.replace(tmp, path)
        return path

    def load_state(self, state: dict) -> None:
        if state["num_train"] != len(self.train_seqs):
            raise ValueError(f"the checkpoint was trained on {state['num_train']} sequences, this data has "
                             f"{len(self.train_seqs)}: resume with the same data directory")
        if state["world"] != self.world:
            raise ValueError(f"the checkpoint was written by {state['world']} processes, this run has {self.world}; "
                             "resume with the same number of processes (the data order depends on it)")
        self.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.label_tokens, self.seq_tokens = state["step"], state["label_tokens"], state["seq_tokens"]
        self.train_seconds = state.get("train_seconds", 0.0)
        set_rng_state(state["rng"])
        self._trim_log()

    def _logged(self) -> list[dict | None]:
        """log.jsonl's records; None for a line cut short by a crash."""
        path = self.out_dir / "log.jsonl"
        lines = path.read_text().splitlines() if path.is_file() else []
        return [_json_or_none(line) for line in lines if line.strip()]

    def _trim_log(self) -> None:
        """Keep log records up to the checkpoint's step only: a run stopped between checkpoints logged steps that
        the resumed run trains (identically) again, and each step must appear once."""
        if self.rank != 0:
            return
        records = self._logged()
        kept = [r for r in records if r is not None and r.get("step", 0) <= self.step]
        if len(kept) < len(records):
            tmp = self.out_dir / "log.jsonl.tmp"
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, self.out_dir / "log.jsonl")


    # --- the loop -----------------------------------------------------------------------------------------
    def log(self, record: dict) -> None:
        if self.rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with open(self.out_dir / "log.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            if record["kind"] == "eval":
                self.log_fn("eval " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                               for k, v in record.items() if k != "kind"))

    def run(self) -> str:
        """Train until all epochs are done ("done"), or max_steps / the wall-time limit ("paused", with a
        checkpoint to --resume from). Either way exports the drafter to out_dir/drafter."""
        from tqdm import tqdm

        cfg, t0 = self.cfg, time.monotonic()
        bar = tqdm(total=self.total_steps, initial=self.step, unit="step", desc="fit",
                   disable=not cfg.progress or self.rank != 0)
        status = "done"
        while self.step < self.total_steps:
            stop = (cfg.max_steps is not None and self.step >= cfg.max_steps) or \
                (time.monotonic() - t0) / 60 >= cfg.max_minutes
            if self.world > 1:  # every process must stop at the same step, or the others hang in all_reduce
                flag = torch.tensor([float(stop)], device=self.device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                stop = bool(flag.item())
            if stop:
                status = "paused"
                break
            rec = self.train_step()
            self.log(rec)
            bar.update(1)
            bar.set_postfix(loss=f"{rec['loss']:.3f}", acc=f"{rec['acc']:.3f}", lr=f"{rec['lr']:.2e}")
            if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < self.total_steps:
                self._eval_and_log()
            if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                self.save_checkpoint()
        bar.close()
        if status == "done":
            self._eval_and_log()
        if self.rank == 0:  # the drafter as of now, in the published format (final when status == "done")
            self.drafter.save(self.out_dir / "drafter")
        self.save_checkpoint()
        if self.world > 1:
            dist.barrier()
        return status

    def _eval_and_log(self) -> None:
        # Once per step: resuming a finished run reaches the end again without training a step.
        evaluated = self.rank != 0 or any(r is not None and r.get("kind") == "eval" and r.get("step") == self.step
                                          for r in self._logged())
        if not evaluated and (self.cfg.eval_prompts or self.cfg.val_sequences):
            self.log(self.evaluate())
        if self.world > 1:
            dist.barrier()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _json_or_none(line: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


# 2: read with torch.load(weights_only=True): tensors and plain Python values only (the RNG states as tensors and
# lists, see rng_state). Format 1 pickled numpy's RNG state, which only a full unpickler reads: such a file is
# refused, never unpickled, since unpickling a file runs whatever code it names.
CHECKPOINT_FORMAT = 2


def rng_state() -> dict:
    """The torch, Python and numpy RNG states as tensors and plain values (what weights_only=True reads back)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss],
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}


def set_rng_state(state: dict) -> None:
    """rng_state's inverse: every generator continues exactly where it was saved."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))


def read_checkpoint(path) -> dict:
    """A training checkpoint's state, read with weights_only=True: a file that holds anything but tensors and plain
    values (an older ddtree's checkpoint, or a crafted one) is refused with a ConfigError; none of its code runs."""
    not_one = f"is not a training checkpoint: pass a `train fit` run directory or its {CHECKPOINT}"
    try:
        with warnings.catch_warnings():  # torch's note on a plain pickle's protocol: the error below says it all
            warnings.simplefilter("ignore", UserWarning)
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # weights_only refused what it read: nothing of the file has run
        named = re.findall(r"GLOBAL (\S+)", str(e))
        if named and named[0].startswith("numpy"):
            raise ConfigError(f"{path} is a checkpoint of an older ddtree (it pickles numpy's RNG state), which is "
                              "not read: unpickling a file can run code. Export its drafter with the ddtree version "
                              "that wrote it (`train export --run`) and go on with `train fit --init-from` that "
                              "drafter, or start the run again") from None
        why = f"it names Python code ({named[0]}) that a checkpoint never holds" if named else "not a checkpoint's data"
        raise ConfigError(f"{path} {not_one} ({why}; refused without running anything)") from None
    except Exception as e:  # noqa: BLE001 - a file that is no checkpoint fails in many ways
        raise ConfigError(f"{path} {not_one} ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(state, dict) or not {"drafter", "drafter_config", "step", "config"} <= set(state):
        raise ConfigError(f"{path} {not_one} (it holds no drafter state)")
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ConfigError(f"{path} is a checkpoint of format {state.get('format', 1)}, this ddtree reads format "
                          f"{CHECKPOINT_FORMAT}: export its drafter with the ddtree version that wrote it and go on "
                          "with `train fit --init-from` that drafter, or start the run again")
    return state


def drafter_from_checkpoint(path, target=None) -> tuple[DFlashDrafter, dict]:
    state = read_checkpoint(path)
    try:
        cfg = DrafterConfig.from_hf(state["drafter_config"])
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    drafter = DFlashDrafter.on_meta(cfg).fill(state["drafter"], path)  # allocates nothing a bad config asks for
    if target is not None:
        drafter = drafter.to(target.device, target.dtype).bind(target)
    return drafter, state


# Limits of this invocation: a resumed run takes them from its own command line, never from the saved run.
SESSION_FIELDS = ("max_minutes", "max_steps", "progress")


def resume_config(saved: dict, overrides: TrainConfig, given=None) -> TrainConfig:
    """The saved training settings, with only runtime fields taken from this run's settings: all of them, or
    (given: the names set on this command line) the session limits plus the runtime fields named in `given`,
    so a resumed run keeps e.g. its evaluation settings unless they are given again."""
    names = {f.name for f in fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in saved.items() if k in names})
    take = RUNTIME_FIELDS if given is None else [k for k in RUNTIME_FIELDS if k in SESSION_FIELDS or k in given]
    return replace(cfg, **{k: getattr(overrides, k) for k in take})
