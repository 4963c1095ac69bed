"""Growing a trained drafter without changing what it computes (`fit --init-from DIR --layers N --taps ...`).

A drafter that has converged at its size can go on training with more capacity from exactly where it stands:
- more draft layers: the new layers go on top with their output projections (o_proj, down_proj) zero, so each
  new residual block adds 0 and the drafter's output is unchanged; training then moves those projections first
  and the rest of the new layer follows;
- more tap layers: fc [H, taps*H] gets zero columns for the new taps' features, so ctx = hidden_norm(fc(F)) is
  unchanged; the old taps keep their columns wherever they sit in the new order.
Both are exact (adding zeros), so a grown drafter drafts the same tokens as the one it came from
(tests/test_grow.py), and its held-out loss starts where that one's ended.

A new drafter may also start its layers from the target's (`fit --layers-from-target I,J,...`): draft layer k
becomes a copy of target layer I_k (norms and projections; q/k norms stay 1 where the target has none).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..base.config import ConfigError
from ..models.drafter import DFlashDrafter
from ..models.protocol import reference


def grow_drafter(drafter: DFlashDrafter, layers: int | None = None, taps: list[int] | None = None,
                 seed: int = 0) -> DFlashDrafter:
    """A new drafter with `layers` draft layers and tap layers `taps` (each default: the drafter's own) that
    computes what `drafter` computes. Its old taps must all be among the new ones; layers may only grow. The new
    layers' other weights are seeded N(0, 0.02) and their norms 1, as in `untrained_drafter`."""
    drafter = reference(drafter)
    cfg = drafter.cfg
    old_layers, old_taps = cfg.model.num_layers, list(cfg.target_layer_ids)
    layers = old_layers if layers is None else layers
    taps = old_taps if taps is None else list(taps)
    if layers < old_layers:
        raise ConfigError(f"a drafter can only grow: {old_layers} layers -> {layers} (drop --layers, or give "
                          f">= {old_layers})")
    if missing := [t for t in old_taps if t not in taps]:
        raise ConfigError(f"--taps {taps} drops the drafter's tap layers {missing}; keep all of {old_taps}")
    if len(set(taps)) != len(taps):
        raise ConfigError(f"--taps {taps} has duplicates")
    if cfg.layer_types and len(set(cfg.layer_types)) > 1 and layers != old_layers:
        raise ConfigError("growing a drafter with mixed layer types is not supported (which type would a new "
                          "layer get?)")
    if layers == old_layers and taps == old_taps:
        return drafter
    model = replace(cfg.model, num_layers=layers, raw={**cfg.model.raw, "num_hidden_layers": layers})
    types = tuple(cfg.layer_types[:1]) * layers if cfg.layer_types else ()
    new_cfg = replace(cfg, model=model, target_layer_ids=tuple(taps), layer_types=types)
    w = drafter.fc.weight
    grown = DFlashDrafter(new_cfg, drafter.attention_backend).to(w.device, w.dtype)

    old = drafter.state_dict()
    state = grown.state_dict()
    for key, value in old.items():
        if key != "fc.weight":
            state[key] = value.clone()  # every old layer, norm, head and d2t as they were
    hidden = cfg.model.hidden_size
    fc = torch.zeros_like(state["fc.weight"])  # [H, len(taps) * H]
    for i, tap in enumerate(old_taps):
        j = taps.index(tap)
        fc[:, j * hidden:(j + 1) * hidden] = old["fc.weight"][:, i * hidden:(i + 1) * hidden]
    state["fc.weight"] = fc
    gen = torch.Generator().manual_seed(seed)
    for i in range(old_layers, layers):
        for key in [k for k in state if k.startswith(f"layers.{i}.")]:
            if "norm" in key:
                state[key].fill_(1.0)
            elif key.endswith(("o_proj.weight", "down_proj.weight")):
                state[key].zero_()
            else:
                state[key].copy_(torch.randn(state[key].shape, generator=gen) * 0.02)
    grown.load_state_dict(state)
    if drafter._target:
        grown.bind(drafter.target)
    return grown


def layers_from_target(drafter: DFlashDrafter, target, layer_ids: list[int]) -> DFlashDrafter:
    """`drafter` (in place) with draft layer k's weights copied from target layer layer_ids[k]. The shapes agree:
    a drafter is shaped after its target (`untrained_drafter`). fc, the head and the q/k norms (which a Llama
    target lacks; they stay 1) keep their init."""
    drafter, target = reference(drafter), reference(target)
    layers = drafter.cfg.model.num_layers
    if len(layer_ids) != layers:
        raise ConfigError(f"--layers-from-target names {len(layer_ids)} target layers for {layers} draft layers: "
                          f"give one per draft layer (or --layers {len(layer_ids)})")
    if bad := [i for i in layer_ids if not 0 <= i < target.cfg.num_layers]:
        raise ConfigError(f"--layers-from-target {bad}: the target has layers 0..{target.cfg.num_layers - 1}")
    with torch.no_grad():
        for k, i in enumerate(layer_ids):
            source = target.model.layers[i].state_dict()
            mine = drafter.layers[k].state_dict()
            if missing := [n for n in source if n not in mine or mine[n].shape != source[n].shape]:
                raise ConfigError(f"target layer {i} does not fit a draft layer ({missing[:3]}): the drafter is "
                                  "not shaped after this target")
            for name, value in source.items():
                mine[name].copy_(value)
    return drafter
