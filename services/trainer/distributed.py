"""The processes of one training: where this one runs (rank, device) and the model wrapped for DDP across them."""

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn


@dataclass(slots=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    votes: dist.ProcessGroup | None = None
    """A gloo group of the processes, for decisions taken on the host (``everywhere``)."""

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed() -> Dist:
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK; a plain ``python -m`` run is one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    votes = dist.new_group(backend="gloo") if world > 1 else None
    return Dist(rank, world, local, device, votes)


def everywhere(flags: list[bool], env: Dist) -> list[bool]:
    """Each flag True in every process: one vote on the host (gloo) for all of them, so no process waits for its
    GPU."""
    if env.world == 1:
        return flags
    vote = torch.tensor([int(f) for f in flags])
    dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=env.votes)
    return [bool(v) for v in vote.tolist()]


def distribute(objective: nn.Module, env: Dist) -> nn.Module:
    if env.world == 1:
        return objective
    device_ids = [env.local_rank] if env.device.type == "cuda" else None
    # the buffers (the target's LM head and embedding, the vocabulary maps) are the same everywhere and never change:
    # re-sending them before every forward would move the whole LM head each step
    return nn.parallel.DistributedDataParallel(objective, device_ids=device_ids, broadcast_buffers=False)
