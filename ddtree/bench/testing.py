"""Seeded random models for tests, CI and GPU timing runs (real shapes, random weights)."""
from __future__ import annotations

import torch

from ..base.config import ModelConfig
from ..base.options import LoadOptions
from ..models.protocol import reference
from ..runtime.attach import attach
from ..models.drafter import untrained_drafter
from ..models.markov import MarkovHead
from ..models.target import TargetModel

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=6, num_heads=4, num_kv_heads=2,
            head_dim=16, max_position_embeddings=512)
QWEN3_8B = dict(arch="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1e6, max_position_embeddings=40960)


def random_target(arch: str = "llama", seed: int = 0, dtype=torch.float32, device="cpu", init_scale: float = 0.1,
                  fused: bool = True, runtime: bool = True, **overrides):
    """A seeded random target. init_scale is the weights' std; larger gives peakier next-token distributions.
    fused: the inference weight layout that loading gives (ddtree/models/fused.py); False, the separate projections.
    runtime: as load() gives it (on a float32 CPU, inside the CPU runtime: ddtree/runtime/cpu/runtime.py); False: the
    bare reference TargetModel."""
    fields = {**TINY, "arch": arch, "rope_theta": 10000.0, "tie_word_embeddings": arch == "llama", **overrides}
    cfg = ModelConfig(**fields)
    gen = torch.Generator().manual_seed(seed)
    model = TargetModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * init_scale)
    model = model.to(device=device, dtype=dtype).eval().fuse(fused)
    return attach(model, None, LoadOptions())[0] if runtime else model


def random_pair(arch: str = "llama", seed: int = 0, num_draft_layers: int = 1, block_size: int = 8, **kw):
    """A seeded random target and an untrained drafter bound to it (both in the runtime unless runtime=False)."""
    target = random_target(arch, seed, **kw)
    drafter = untrained_drafter(target, num_draft_layers, block_size, seed=seed + 1)
    drafter.label = "random"
    return attach(target, drafter, LoadOptions()) if kw.get("runtime", True) else (target, drafter)


def char_tokenizer():
    """A character-level tokenizer whose ids fit TINY's vocabulary (96): lets text prompts (the command line)
    run on seeded random targets. Ids: 0 <unk>, 1 </s> (eos), then one per printable ASCII character."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = string.ascii_letters + string.digits + " .,:;!?'\"()-+*/=<>\n"
    vocab = {"<unk>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    assert len(vocab) <= TINY["vocab_size"]
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


def save_target(target: TargetModel, directory, tokenizer=None):
    """Write a target as a Hugging Face directory (config.json, model.safetensors, the tokenizer if given)."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(target.cfg.to_hf()))
    state = {k: v.contiguous() for k, v in reference(target).state_dict().items()}
    if target.cfg.tie_word_embeddings:
        state.pop("lm_head.weight")  # shared with the embedding: safetensors stores a tensor once
    save_file(state, str(directory / "model.safetensors"))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    return directory


def add_markov_head(drafter, rank: int = 8, candidates: int = 32, seed: int = 0, strength: float = 1.0):
    """Give `drafter` a seeded random Markov head (ddtree/models/markov.py) whose bias is far from zero, so that its
    trees differ from the marginals' ones. Returns the drafter."""
    cfg, m = drafter.cfg, drafter.cfg.model
    head = MarkovHead(m.hidden_size, cfg.draft_vocab, cfg.block_size - 1, rank, candidates)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.proj.copy_(torch.randn(head.proj.shape, generator=gen) * m.hidden_size ** -0.5 * strength * 8)
        head.out.copy_(torch.randn(head.out.shape, generator=gen) * strength)
    model = reference(drafter)
    model.set_markov_head(head.to(model.fc.weight.device, model.fc.weight.dtype))
    return drafter
