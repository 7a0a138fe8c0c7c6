"""An exponential moving average (EMA) of a model's weights: a smoother model than the last step's, often a
better one, evaluated beside it.

    ema = EMA(model, decay=0.999)
    ema.update()                      # after every optimizer step
    evaluate(ema.module, ...)         # an nn.Module like the model, in eval mode
"""

import copy

import torch
from torch import nn

from common.runtime import unwrap


class EMA:
    """After update t, the average is ``d * average + (1 - d) * weights`` with d = min(decay, (1 + t) / (10 + t)):
    a warm-up, since a fixed 0.999 would keep 96% of the untrained weights after 40 steps (0.999^40) and a short
    run's average would evaluate like an untrained model. Batch norm's running statistics are averaged too (a
    copy of the model's integer buffers, such as its step counts), so the average evaluates like a trained
    model. It follows the plain module inside DDP's or torch.compile's wrapper."""

    def __init__(self, model: nn.Module, decay: float):
        self.module = copy.deepcopy(unwrap(model)).eval().requires_grad_(False)
        self.decay, self.updates = decay, 0
        # state_dict() values share storage with the live tensors, so these pairs follow every step; a tied
        # weight (two names, one tensor) is averaged once
        pairs = zip(self.module.state_dict().values(), unwrap(model).state_dict().values(), strict=True)
        self.pairs = list({averaged.data_ptr(): (averaged, current) for averaged, current in pairs}.values())

    @torch.no_grad()
    def update(self) -> None:
        self.updates += 1
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        for averaged, current in self.pairs:
            if averaged.is_floating_point():
                averaged.lerp_(current, 1 - decay)
            else:
                averaged.copy_(current)

    def state_dict(self) -> dict:
        return {"module": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])
        self.updates = state["updates"]
