"""Where a prefill persists KDA checkpoints, and which of them it keeps.

A checkpoint is the only way back into a prefix for a hybrid model, but it is expensive (one
kimi-k3 checkpoint weighs as much as ~8,000 tokens of MLA cache), so where they land decides the
hit ratio. Every policy here follows the seed: after each forward pass the state at the last
hash-block boundary it processed is persisted to fresh pages, the previous one of the same request
is recycled (intermediate), and the ones at turn ends are kept (durable). The switches add kept
checkpoints where the seed leaves a reusable prefix unrestorable:

- `branch_points`: a request whose MLA match reaches beyond its deepest checkpoint (a prompt that
  branches off a cached conversation after the last checkpoint) ends a forward pass exactly at the
  end of the match and keeps the checkpoint there, so the next request sharing that prefix hits at
  full depth instead of at the previous turn end;
- `page_ladder`: every forward pass also stops at physical page ends and keeps the checkpoint
  there, so a long prompt leaves a rung every page that later requests can resume from.

The engine (`cachetier.engine`) and the replay benchmark use the same object, so the benchmark
measures the policy the engine runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from index.records import CommitItem, RequestPlan, StepRequest


@dataclass(frozen=True)
class CheckpointPolicy:
    name: str
    branch_points: bool = False
    page_ladder: bool = False

    def first_step(self, rid: str, compute_tokens: int, prompt_tokens: int,
                   hashes: bytes) -> StepRequest:
        """A new request: its hashes go to the index, which knows where it will start."""
        return StepRequest(rid, compute_tokens, prompt_tokens, hashes,
                           stop_at_match=self.branch_points, stop_at_page_end=self.page_ladder)

    def next_step(self, rid: str, compute_tokens: int) -> StepRequest:
        return StepRequest(rid, compute_tokens, stop_at_match=self.branch_points,
                           stop_at_page_end=self.page_ladder)

    def commit_item(self, plan: RequestPlan, prompt_tokens: int, block_tokens: int,
                    page_tokens: int) -> CommitItem:
        """What the forward pass of `plan` persisted: the checkpoint the plan gave pages for (the
        last hash-block boundary of the pass). It is kept when it is the turn's last boundary (the
        pass reaching the prompt's end may cross none, so the turn-end checkpoint can be the one
        of an earlier pass), a branch point, or (ladder) a page end."""
        at = plan.checkpoint_tokens
        kept = at > 0 and (at == prompt_tokens // block_tokens * block_tokens
                           or (self.branch_points and plan.hit_tokens < plan.match_tokens == at)
                           or (self.page_ladder and at % page_tokens == 0))
        return CommitItem(plan.rid, plan.stop, at, kept)


SEED = CheckpointPolicy("seed")
BRANCH = CheckpointPolicy("branch", branch_points=True)
LADDER = CheckpointPolicy("ladder", branch_points=True, page_ladder=True)
POLICIES = {policy.name: policy for policy in (SEED, BRANCH, LADDER)}
