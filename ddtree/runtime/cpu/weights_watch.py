"""Has any weight of a module changed since its fast copies were made? The CPU runtime's guard: the C++ stacks,
packed / bf16 / 8-bit copies and transposes are copies of the weights, and a method's tokens equal plain
decoding's only while every pass reads the same values. Training updates a drafter in place between decodes, and
tests edit weights, so the runtime asks on every pass and re-makes its copies when they changed."""
from __future__ import annotations

import operator

import torch

from . import qlinear

_version = operator.attrgetter("_version")
_registrations = [0, False]  # parameters and submodules registered (or replaced) since the hooks; hooks installed


def _count_registration(*_):
    _registrations[0] += 1


def registrations() -> int:
    """Changes whenever any module gains or replaces a parameter or submodule (attribute assignment included): a
    parameter list cached under this number is still the module's while the number is the same. The global
    registration hooks that count them are installed on the first call (when the first WeightsWatch is made,
    at load), not on import: importing ddtree changes nothing in torch."""
    if not _registrations[1]:
        torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)
        torch.nn.modules.module.register_module_module_registration_hook(_count_registration)
        _registrations[1] = True
    return _registrations[0]


class WeightsWatch:
    """Has any weight of a module changed since mark()? Written in place (an optimizer step, load_state_dict, a test's
    surgery: version counters), re-pointed (`p.data = x`: data pointers) or replaced (attribute assignment, a new
    submodule: the registration hooks above, then the parameters' identities). Whoever holds copies of the weights
    (the stacks, bf16 and packed copies, transposes) asks on every pass and re-makes them when it is true.
    `params_of()` lists the current weights. The check runs in C++ where the kernel is built (one loop, every
    pass), else in Python (weights_key)."""

    def __init__(self, params_of):
        self.params_of = params_of
        self.mark()

    def mark(self) -> None:
        """The current weights are the reference from now on."""
        self.registrations = registrations()
        self.params = list(self.params_of())
        self.sample = values_sample(self.params)
        native = all(p.device.type == "cpu" and not p.is_inference() for p in self.params) and qlinear.cpu_kernel_available()
        self.snapshot = qlinear.kernel().WeightsSnapshot(self.params) if native else None
        self.key = None if native else weights_key(self.params)

    def changed(self) -> bool:
        if self.registrations != registrations():  # something was registered somewhere: is it one of ours?
            if list(map(id, self.params_of())) != list(map(id, self.params)):
                return True
            self.registrations = registrations()
        return self.snapshot.changed() if self.snapshot is not None else weights_key(self.params) != self.key

    def stale(self) -> bool:
        """Were values written where torch does not count writes (`p.data[...] = x`, `p.data.mul_()`, a numpy
        view's elements) since mark()? Seen where they reach SAMPLE_POINTS evenly spaced elements of a weight
        (any write to a whole weight or to a block of rows); a single element elsewhere is not. One gather per
        weight: asked once per generation, not per pass."""
        return not torch.equal(values_sample(self.params), self.sample)


SAMPLE_POINTS = 64  # per weight: WeightsWatch.stale()
STALE = ("the model's weights were written where torch does not count writes (through .data or a numpy view) "
         "after its fast copies of them were made, so decoding would mix the old and the new weights: call "
         "pair.refresh() (or model.refresh()) after such edits. In-place torch ops (with torch.no_grad(): "
         "w.mul_(2)), load_state_dict and assigning parameters are followed without it")


def values_sample(params) -> torch.Tensor:
    """About SAMPLE_POINTS evenly spaced elements of every weight, concatenated [sum of the samples] as float64
    bit patterns (int64: a NaN then equals itself)."""
    parts = [p.detach().reshape(-1)[::max(1, p.numel() // SAMPLE_POINTS)] for p in params if p.numel()]
    return torch.cat(parts).double().view(torch.int64) if parts else torch.zeros(0, dtype=torch.int64)


def weights_key(params) -> tuple:
    """What changes when a parameter is written in place or re-pointed (an optimizer step, load_state_dict, a
    test's surgery): identity, storage and version counter. WeightsWatch's check where the C++ snapshot is not
    available; built by map() (C loops), not a generator: it runs every pass."""
    params = list(params)
    return tuple(map(id, params)), tuple(map(torch.Tensor.data_ptr, params)), tuple(map(_version, params))
