"""Shortest prompt first: a corellm scheduling policy, packaged as an out-of-tree plugin.

The package's ``pyproject.toml`` lists this module in the ``corellm`` entry-point group, so once
the package is installed corellm registers the scheduler ``shortest_prompt_first``. Select it
with ``scheduler: {name: shortest_prompt_first}`` in the config.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from corellm import hookimpl
from corellm.components import SchedulerSpec
from corellm.interfaces import SchedulingPolicy
from corellm.request import Request
from corellm.scheduling import SchedulingContext, policy_scheduler

__version__ = "0.2.0"


class ShortestPromptFirstPolicy(SchedulingPolicy):
    """Admit the waiting request with the fewest prompt tokens first.

    This is shortest-job-first where the prompt stands in for the size of the job. The prompt is
    the only size known on arrival; the output length is not. When many requests are waiting,
    admitting short prompts first lowers the mean time to first token. The cost is that a long
    prompt can wait indefinitely while shorter ones keep arriving. Use ``fcfs`` where that
    matters.
    """

    def waiting_key(self, request: Request, ctx: SchedulingContext) -> int:
        # BatchScheduler breaks ties between equal keys by arrival order.
        return request.num_prompt_tokens

    def choose_victim(self, running: Sequence[Request], ctx: SchedulingContext) -> Request:
        """Preempt the running request this policy ranks last: the longest prompt, and of
        equally long prompts the one that arrived last.

        - The victim rejoins the waiting queue behind every request still running, so it is not
          re-admitted ahead of them. No request pushes out one with a shorter prompt to make
          room for itself; if the request that needs blocks is the longest, it is the victim.
        - Preemption is by recomputation, so the longest prompt costs the most to redo. That is
          the same cost SPF already puts on long prompts at admission.
        - Remaining output is not used: ``max_tokens`` is only an upper bound, and EOS usually
          arrives well before it, so "longest remaining" would be a guess.
        """
        return max(running, key=lambda r: (r.num_prompt_tokens, r.arrival_seq))


@hookimpl
def corellm_schedulers() -> Iterator[SchedulerSpec]:
    yield policy_scheduler("shortest_prompt_first", lambda options: ShortestPromptFirstPolicy(),
                           summary="Admit the shortest waiting prompt first; preempt the longest.")
