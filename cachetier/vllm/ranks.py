"""An engine's tensor-parallel workers, as the connector's saves need them to act as one.

With TP > 1 each rank holds its share of every block's heads, and its own agent holds the same
share of every pool page (one page id, one share per rank). A step's saves are still one index
operation: one plan (the pages every rank writes its share into) and one commit, made once every
share is written, or a restore would read a prefix some rank never saved. So the leader (rank 0)
plans, the others receive its plan, and the leader commits only when every rank reports its
copies done. Both go through vLLM's TP group on its CPU process group (gloo on every platform):
loads need no agreement, each rank restores its share and reports its own failed receives, which
vLLM unites.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    rank: int
    size: int
    group: Any = None  # vLLM's `GroupCoordinator` for the TP group; None with one rank

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def from_leader(self, value: T | None) -> T | None:
        """The leader's `value`, on every rank (each must call it, in the same order)."""
        if self.size == 1:
            return value
        return self.group.broadcast_object(value, src=0)

    def all_succeeded(self, succeeded: bool) -> bool:
        """Whether every rank succeeded (each must call it, in the same order)."""
        if self.size == 1:
            return succeeded
        flag = torch.tensor([int(succeeded)], dtype=torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN,
                                     group=self.group.cpu_group)
        return bool(flag.item())


def engine_ranks(tp_degree: int) -> Ranks:
    """This worker's place in its engine's TP group (vLLM has set the group up by the time it
    builds a worker's connector)."""
    if tp_degree == 1:
        return Ranks(0, 1)
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    assert group.world_size == tp_degree, (group.world_size, tp_degree)
    return Ranks(group.rank_in_group, group.world_size, group)
