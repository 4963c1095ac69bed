"""Carry drafters off a lent GPU machine in few bytes, and rebuild them here.

A device call brings back at most 64 MiB. A drafter's LM head is the target's own rows (frozen in training: the fused
loss computes no gradient for it), so `pack` leaves it out and keeps its SHA-256; `unpack` rebuilds it from the
target's LM head and the drafter's d2t (or takes it from a reference drafter that has it), and refuses a rebuild
whose bytes differ from what was trained. With --reference, `pack` also leaves out every tensor bit-equal to the
reference's (a Markov head fitted on a frozen drafter packs as the head alone).

    python scripts/drafter_pack.py pack runs/ft-ce-q8 pack/ft-ce            # on the device machine
    python scripts/drafter_pack.py unpack pack/ft-ce runs/ft-ce-q8 \\
        --reference ddtree/assets/smollm2-135m-dflash                        # here (embedded target)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

HEAD = "lm_head.weight"


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def pack(src: Path, dst: Path, reference: Path | None = None) -> None:
    state = load_file(src / "model.safetensors")
    dst.mkdir(parents=True, exist_ok=True)
    head = state.pop(HEAD, None)
    manifest = {} if head is None else {"head_sha256": digest(head), "head_shape": list(head.shape),
                                        "head_dtype": str(head.dtype)}
    ref = {} if reference is None else load_file(reference / "model.safetensors")
    same = sorted(k for k, v in state.items() if k in ref and ref[k].dtype == v.dtype and torch.equal(ref[k], v))
    for k in same:
        del state[k]
    manifest["from_reference"] = same
    save_file(state, str(dst / "weights.safetensors"))
    shutil.copy(src / "config.json", dst / "config.json")
    (dst / "manifest.json").write_text(json.dumps(manifest) + "\n")


def _head_candidates(d2t: torch.Tensor | None, reference: Path | None, target_dir: str | None, dtype):
    """Heads the packed one may be: the reference drafter's (same d2t), and the target's rows as held where the
    drafter was trained (float32 or bfloat16), as they are and rounded to power-of-two 8-bit blocks (`train
    quantize`), in the packed head's `dtype`."""
    if reference is not None:
        ref = load_file(reference / "model.safetensors")
        if HEAD in ref and d2t is not None and "d2t" in ref and torch.equal(ref["d2t"], d2t):
            yield "the reference drafter's", ref[HEAD]
    from ddtree.runtime.cpu.qlinear import round_po2_q8
    from ddtree.models.loading import load_target, resolve_target_dir

    target = load_target(resolve_target_dir(target_dir), torch.float32, "cpu")
    rows = target.lm_head.weight.detach()
    if d2t is not None:
        rows = rows[torch.arange(d2t.numel()) + d2t]
    for source in (torch.float32, torch.bfloat16):  # the target's dtype where it was trained (bf16 on a GPU)
        held = rows.to(source).float()
        yield f"the target's rows in {source}", held.to(dtype)
        yield f"the target's rows in {source}, rounded", round_po2_q8(held).to(dtype)


def unpack(src: Path, dst: Path, reference: Path | None, target_dir: str | None) -> str:
    manifest = json.loads((src / "manifest.json").read_text())
    state = load_file(src / "weights.safetensors")
    if manifest.get("from_reference"):
        if reference is None:
            raise SystemExit(f"unpack {src}: {len(manifest['from_reference'])} tensors are the reference drafter's: "
                             "pass it as --reference")
        ref = load_file(reference / "model.safetensors")
        state.update({k: ref[k] for k in manifest["from_reference"]})
    if "head_sha256" in manifest:
        dtype = getattr(torch, manifest["head_dtype"].removeprefix("torch."))
        for name, head in _head_candidates(state.get("d2t"), reference, target_dir, dtype):
            if list(head.shape) == manifest["head_shape"] and digest(head) == manifest["head_sha256"]:
                state[HEAD] = head.contiguous()
                break
        else:
            raise SystemExit(f"unpack {src}: no rebuilt LM head matches the packed one's SHA-256: "
                             "pass the drafter it was trained from as --reference")
    else:
        name = "none (the target's)"
    dst.mkdir(parents=True, exist_ok=True)
    save_file(state, str(dst / "model.safetensors"))
    shutil.copy(src / "config.json", dst / "config.json")
    if reference is not None and (reference / "ngrams.npz").is_file():  # the target's n-gram table, not trained here
        shutil.copy(reference / "ngrams.npz", dst / "ngrams.npz")
    return name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="a drafter directory without its LM head (with the head's SHA-256)")
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--reference", type=Path, help="leave out the tensors bit-equal to this drafter's")
    u = sub.add_parser("unpack", help="a packed drafter with its LM head rebuilt and checked")
    u.add_argument("src", type=Path)
    u.add_argument("dst", type=Path)
    u.add_argument("--reference", type=Path, help="the drafter given to pack, and whose head the packed one may "
                   "share (same d2t)")
    u.add_argument("--target", help="the target (default: the embedded SmolLM2-135M-Instruct)")
    args = ap.parse_args(argv)
    if args.command == "pack":
        pack(args.src, args.dst, args.reference)
    else:
        name = unpack(args.src, args.dst, args.reference, args.target)
        print(f"unpack: {args.dst} (LM head: {name})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
