"""What every runtime is: a plain object around the reference model it runs (`model`), implementing its protocol
(ddtree/models/protocol.py) itself. These bases give the parts a runtime reads from its reference as they are; each
runtime (cpu/runtime.py, gpu/runtime.py) defines its own passes. Nothing is forwarded: a name neither defines is an
AttributeError, and an attribute set on a runtime stays the runtime's."""
from __future__ import annotations

import torch


class Runtime:
    """A runtime of the reference model `model` (a TargetModel or a DFlashDrafter)."""

    def __init__(self, model):
        self.model = model

    @property
    def cfg(self):
        return self.model.cfg

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)

    def describe(self) -> dict:
        return self.model.describe()

    def refresh(self):
        self.model.refresh()
        return self

    def check_fresh(self) -> None:
        self.model.check_fresh()


class TargetRuntime(Runtime):
    """protocol.Target's shape and identity, read from the reference TargetModel."""

    step_ops = None  # the engine's own step operations unless the runtime supplies faster ones
    host_inputs = False  # its passes take device tensors

    @property
    def backend(self) -> str:
        return self.model.backend

    @property
    def attention_backend(self) -> str:
        return self.model.attention_backend

    @property
    def quant(self) -> str | None:
        return self.model.quant

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.model.kv_dtype

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.embed(tokens)

    def embed_table(self) -> torch.Tensor:
        return self.model.embed_table()

    def lazy_logits(self, rows: int) -> bool:
        return self.model.lazy_logits(rows)


class DrafterRuntime(Runtime):
    """protocol.Drafter's identity and vocabulary, read from the reference DFlashDrafter (bound to the target's
    runtime)."""

    @property
    def label(self) -> str:
        return self.model.label

    @property
    def block_size(self) -> int:
        return self.model.block_size

    @property
    def target(self):
        return self.model.target

    @property
    def markov(self):
        return self.model.markov

    @property
    def d2t(self) -> torch.Tensor:
        return self.model.d2t

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.to_target_ids(ids)
