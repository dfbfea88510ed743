"""What a scheduler side reads of a step's ``SchedulerOutput``, for any role."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput


def scheduled_starts(out: SchedulerOutput) -> dict[str, int]:
    """Each request the step runs (new and cached ones alike) -> its tokens computed before the step."""
    starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
    cached = out.scheduled_cached_reqs
    starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    return starts
