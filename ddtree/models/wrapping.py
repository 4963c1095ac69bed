"""What a runtime (ddtree/runtime/cpu/runtime.py, ddtree/runtime/gpu/runtime.py) is to the reference model it runs: a wrapper whose
own attributes are its fast paths, and through which everything else is the model's."""
from __future__ import annotations


class RuntimeWrapper:
    """A runtime object around a reference model (`reference`): what it does not define is the model's, read and
    written (`pair.target.model.layers`, `pair.drafter.label = ...`), except its own state (_OWN) and a method of
    its own replaced on the instance (a test's oracle draft)."""

    _OWN: frozenset = frozenset()

    def __getattr__(self, name):
        return getattr(self.reference, name)

    def __setattr__(self, name, value):
        if name in self._OWN or callable(getattr(type(self), name, None)):  # its state, or one of its methods replaced
            object.__setattr__(self, name, value)
        else:
            setattr(self.reference, name, value)
