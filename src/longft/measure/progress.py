"""Per-layer progress inside a slow step (rank 0, interactive terminals only).

A long-context step can take minutes; a bar that moves once per step says nothing meanwhile. Once a
step has taken longer than `after_s`, each following step shows a bar over the decoder layers:
a forward pre-hook counts each layer's forward and puts a gradient hook on the layer's input,
which fires when backward has gone through that layer (last layer first). This does not depend on
how (or whether) the layers are recomputed, which changes between transformers releases. Hooks
only count; they change nothing.
"""

from __future__ import annotations

import torch

from longft.compat import torch as torch_compat


class LayerProgress:
    def __init__(self, layers, enabled: bool, after_s: float = 5.0, file=None):
        self.layers = list(layers)
        self.enabled = enabled and bool(self.layers)
        self.after_s = after_s
        self.file = file
        self.bar = None
        self.forward = self.backward = 0
        self._handles = [m.register_forward_pre_hook(self._hook) for m in self.layers] \
            if self.enabled else []

    def _hook(self, module, args) -> None:
        if self.bar is None or torch_compat.in_backward():
            return  # no bar, or a recompute inside backward
        self.forward += 1
        self.bar.set_description("forward")
        self.bar.update(1)
        if args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
            args[0].register_hook(self._backward_done)

    def _backward_done(self, grad):
        if self.bar is not None:
            self.backward += 1
            self.bar.set_description("backward")
            self.bar.update(1)

    def start_step(self, last_step_s: float | None) -> None:
        """Open a bar for this step if the previous one was slow."""
        self.forward = self.backward = 0
        if self.enabled and last_step_s is not None and last_step_s > self.after_s:
            from tqdm import tqdm
            self.bar = tqdm(total=2 * len(self.layers), unit="layer", leave=False,
                            file=self.file, disable=None if self.file is None else False)

    def end_step(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
