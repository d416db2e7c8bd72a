"""Where a prefill persists KDA checkpoints, which of them it keeps, and as what class.

A checkpoint is the only way back into a prefix for a hybrid model, but it is expensive (one
kimi-k3 checkpoint weighs as much as ~8,000 tokens of MLA cache), so where they land decides the
hit ratio. Every checkpoint placement here follows the seed: after each forward pass the state at
the last hash-block boundary it processed is persisted to fresh pages, the previous one of the same
request is recycled (intermediate), and the ones at turn ends are kept. The switches add kept
checkpoints where the seed leaves a reusable prefix unrestorable, or keep fewer where bytes are
scarce:

- `branch_points`: a request whose MLA match reaches beyond its deepest checkpoint (a prompt that
  branches off a cached conversation after the last checkpoint) ends a forward pass exactly at the
  end of the match and keeps the checkpoint there, so the next request sharing that prefix hits at
  full depth instead of at the previous turn end;
- `page_ladder`: every forward pass also stops at physical page ends and keeps the checkpoint
  there, so a long prompt leaves a rung every page that later requests can resume from; with
  `spec_rungs` the rungs above the prompt's deepest one are classed `spec` (speculative: the pool's
  weights may value them less);
- `deepest_rung`: a pass stops at the prompt's deepest page end only (one rung per prompt);
- `short_turn_ends`: the turn-end checkpoint is kept only for prompts shorter than a page (a
  longer prompt's deepest rung serves its next turn nearly as well, for no partial page).

Every placement that keeps a turn end also serves an exact resend of the prompt (a retry, `n > 1`
sampling, a regenerate). A hit leaves at least one token to compute, so a resend can only hit at
`(P - 1) // B * B`: the turn end itself unless the prompt ends on a hash-block boundary, one block
before it when it does. A block-aligned prompt therefore ends a pass one block before its end too
(`StepRequest.stop_at_resend_point`) and keeps the checkpoint there in the turn end's class: the
resend hits at `P - B`, the next turn at `P`. It costs one checkpoint per aligned prompt, and one
more pass of one block. Gains stay what losing each checkpoint costs: the resend point's is
measured from the request's previous kept checkpoint, the turn end's is then the one block past
it. The pair is re-classed together: a next turn that resumes at the turn end and goes on
supersedes both, an exact resend (restoring the resend point) makes both turns again.

Each kept checkpoint is committed with its class (`CommitItem.kind`: branch, rung, spec, turn,
in that precedence when one boundary is several), which the pool's eviction weights value. The
engine (`cachetier.engine.scheduler`) and the replay runners (`cachetier.replay.replayer`) use the
same object, so the replay measures the placement the engine runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from index.records import CheckpointKind, CommitItem, RequestPlan, StepRequest


@dataclass(frozen=True)
class CheckpointPlacement:
    """The seed's rule plus the switches above. `name` is what `cachetier demo --policy` takes,
    and the name of the replay runner that runs this placement on the preset's pool."""

    name: str
    branch_points: bool = False
    page_ladder: bool = False
    spec_rungs: bool = False
    deepest_rung: bool = False
    short_turn_ends: bool = False

    def __post_init__(self) -> None:
        if self.page_ladder and self.deepest_rung:
            raise ValueError(f"{self.name}: page_ladder and deepest_rung exclude each other")
        if self.spec_rungs and not self.page_ladder:
            raise ValueError(f"{self.name}: spec_rungs needs page_ladder")

    def first_step(self, rid: str, compute_tokens: int, prompt_tokens: int, hashes: bytes,
                   block_tokens: int, page_tokens: int) -> StepRequest:
        """A new request: its hashes go to the index, which knows where it will start, with the
        class of its turn end (kept by the index when the hit lands exactly there: then no pass
        of this request writes it, the checkpoint it restores from is it)."""
        return StepRequest(rid, compute_tokens, prompt_tokens, hashes,
                           stop_at_match=self.branch_points, stop_at_page_end=self.page_ladder,
                           stop_at_last_page_end=self.deepest_rung,
                           stop_at_resend_point=self.keeps_turn_end(prompt_tokens, page_tokens),
                           turn_end_kind=self.turn_end_kind(prompt_tokens, block_tokens,
                                                            page_tokens))

    def next_step(self, rid: str, compute_tokens: int, prompt_tokens: int,
                  page_tokens: int) -> StepRequest:
        return StepRequest(rid, compute_tokens, stop_at_match=self.branch_points,
                           stop_at_page_end=self.page_ladder,
                           stop_at_last_page_end=self.deepest_rung,
                           stop_at_resend_point=self.keeps_turn_end(prompt_tokens, page_tokens))

    def keeps_turn_end(self, prompt_tokens: int, page_tokens: int) -> bool:
        """Whether the prompt's turn end is kept, and with it its resend point (the index cuts a
        pass there only for a block-aligned prompt, where the two differ)."""
        return not (self.short_turn_ends and prompt_tokens >= page_tokens)

    def commit_item(self, plan: RequestPlan, prompt_tokens: int, block_tokens: int,
                    page_tokens: int) -> CommitItem:
        """What the forward pass of `plan` persisted: the checkpoint the plan gave pages for (the
        last hash-block boundary of the pass), with its class; none when the placement does not
        keep a checkpoint there after all (a long prompt's turn end with `short_turn_ends`)."""
        kind = self.checkpoint_kind(plan, prompt_tokens, block_tokens, page_tokens)
        if kind is None:
            return CommitItem(plan.rid, plan.stop)
        return CommitItem(plan.rid, plan.stop, plan.checkpoint_tokens, kind=kind)

    def checkpoint_kind(self, plan: RequestPlan, prompt_tokens: int, block_tokens: int,
                        page_tokens: int) -> CheckpointKind | None:
        """The class of the checkpoint at `plan.checkpoint_tokens`. It is kept when it is a
        branch point, a rung, the turn's last boundary (the pass reaching the prompt's end may
        cross none, so the turn-end checkpoint can be the one of an earlier pass, or the one the
        hit restored: `turn_end_kind`) or its resend point; otherwise it is intermediate."""
        at = plan.checkpoint_tokens
        if at == 0:
            return None
        if self.branch_points and plan.hit_tokens < plan.match_tokens == at:
            return "branch"
        return self._kind_at(at, prompt_tokens, block_tokens, page_tokens)

    def turn_end_kind(self, prompt_tokens: int, block_tokens: int,
                      page_tokens: int) -> CheckpointKind | None:
        """The class of the checkpoint at the deepest boundary a hit can reach, `(P - 1) // B *
        B` (the turn end, or the resend point of a block-aligned prompt), for a request that
        resumes exactly there (a hit is no branch point); None where none is kept."""
        deepest_hit = (prompt_tokens - 1) // block_tokens * block_tokens
        if deepest_hit == 0:
            return None
        return self._kind_at(deepest_hit, prompt_tokens, block_tokens, page_tokens)

    def _kind_at(self, at: int, prompt_tokens: int, block_tokens: int,
                 page_tokens: int) -> CheckpointKind | None:
        turn_end = prompt_tokens // block_tokens * block_tokens
        resend = (prompt_tokens - 1) // block_tokens * block_tokens
        deepest = (prompt_tokens - 1) // page_tokens * page_tokens  # the deepest rung below the end
        ladder = self.page_ladder or (self.deepest_rung and at == deepest)
        if ladder and at % page_tokens == 0 and not (at == turn_end and turn_end > deepest):
            return "spec" if self.spec_rungs and at < deepest else "rung"
        if at in (turn_end, resend):
            return "turn" if self.keeps_turn_end(prompt_tokens, page_tokens) else None
        return "intermediate"


SEED = CheckpointPlacement("seed")
BRANCH = CheckpointPlacement("branch", branch_points=True)
LADDER = CheckpointPlacement("ladder", branch_points=True, page_ladder=True)
PLACEMENTS = {placement.name: placement for placement in (SEED, BRANCH, LADDER)}
