"""The drafter's optimizer: AdamW, or Muon for its matrices with AdamW for the rest.

Muon (momentum orthogonalized by Newton-Schulz iterations) is vLLM speculators' default for EAGLE-3 drafters. It is
defined for 2-D weights only: the drafter's ``fc`` and its layer's projections take Muon; the LM head (an output
layer, which Muon's authors leave to AdamW) and the norms take AdamW. The update is scaled to AdamW's RMS (Moonshot's
rule, torch's ``adjust_lr_fn="match_rms_adamw"``), so the same learning rate and schedule serve both.
"""

from typing import Literal

import torch
from torch import nn

Optimizer = Literal["adamw", "muon"]
BETAS = (0.9, 0.95)


class MuonAdamW(torch.optim.Optimizer):
    """Muon over ``matrices`` and AdamW over ``rest``, stepped together. Its param groups are the two optimizers'
    own, so a scheduler setting a group's ``lr`` sets it where each optimizer reads it."""

    def __init__(self, matrices: list[nn.Parameter], rest: list[nn.Parameter], lr: float, weight_decay: float):
        self.muon = torch.optim.Muon(matrices, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(rest, lr=lr, betas=BETAS, weight_decay=weight_decay)
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], {})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]  # no closure: two optimizers would run it twice
        if closure is not None:
            raise ValueError("MuonAdamW.step takes no closure")
        self.muon.step()
        self.adamw.step()

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if set(state_dict) != {"muon", "adamw"}:
            raise ValueError(f"not a Muon + AdamW optimizer state (keys {sorted(state_dict)[:4]})")
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])


def build_optimizer(kind: Optimizer, drafter: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer ``kind`` over the drafter's trainable parameters."""
    params = [(n, p) for n, p in drafter.named_parameters() if p.requires_grad]
    if kind == "adamw":
        return torch.optim.AdamW([p for _, p in params], lr=lr, betas=BETAS, weight_decay=weight_decay)
    if kind != "muon":
        raise ValueError(f"optimizer must be one of adamw, muon; got {kind!r}")
    matrices = [p for n, p in params if p.ndim == 2 and not n.startswith("lm_head")]
    rest = [p for n, p in params if not (p.ndim == 2 and not n.startswith("lm_head"))]
    return MuonAdamW(matrices, rest, lr, weight_decay)
