"""Fair share across tenants by tokens served: a corellm scheduling policy in the spirit of the
Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024),
packaged as an out-of-tree plugin.

Once the package is installed, corellm registers the scheduler ``fair_share`` (select it with
``scheduler: {name: fair_share}``). A tenant is ``request.user`` (``LLM.generate(..., user=)``,
OpenAI's ``user`` field); requests without one form a single anonymous tenant.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence

from pydantic import Field, model_validator

from corellm import hookimpl
from corellm.components import SchedulerOptions, SchedulerSpec
from corellm.interfaces import SchedulingPolicy
from corellm.request import Request
from corellm.scheduling import SchedulingContext, WaitingQueue, policy_scheduler

__version__ = "0.1.0"

SCHEDULER_NAME = "fair_share"

Tenant = str | None


class FairShareOptions(SchedulerOptions):
    """The knobs of ``fair_share``, next to the shared batching ones."""

    prefill_weight: float = Field(
        1.0, ge=0, le=1000,
        description="Cost of one prompt token computed for a tenant (prefix-cache hits are "
                    "free).")
    decode_weight: float = Field(
        2.0, ge=0, le=1000,
        description="Cost of one output token computed for a tenant (VTC's default prices "
                    "output twice input, as the APIs that bill by token do).")
    tenant_weights: dict[str, float] = Field(
        default_factory=dict,
        description="Share of each named tenant relative to default_weight: a tenant of weight "
                    "2 is served twice the tokens of a weight-1 tenant while both wait.")
    default_weight: float = Field(
        1.0, gt=0, le=1e6,
        description="Weight of the tenants not in tenant_weights, the anonymous one included.")

    @model_validator(mode="after")
    def _check(self) -> FairShareOptions:
        if self.prefill_weight == 0 and self.decode_weight == 0:
            raise ValueError("prefill_weight and decode_weight cannot both be 0: nothing would "
                             "ever be counted")
        for tenant, weight in self.tenant_weights.items():
            if not 0 < weight <= 1e6:
                raise ValueError(f"tenant_weights[{tenant!r}] must be in (0, 1e6], got {weight}")
        return self


class FairSharePolicy(SchedulingPolicy):
    """Admit from the tenant that has been served the fewest weighted tokens.

    **Counters.** Each tenant has a counter of the tokens computed for it, prompt tokens at
    ``prefill_weight`` and output tokens at ``decode_weight``, divided by the tenant's weight.
    ``on_scheduled`` adds each step's plan to it. What is counted is compute: a prefix-cache hit
    costs the tenant nothing, and the recomputation of a preempted request counts again.

    **Order.** ``queue_group`` puts each tenant in its own heap, first come first served within
    a tenant (``waiting_key`` is the arrival sequence). ``select`` looks only at the tenants'
    heads (``waiting.heads()``, O(tenants), whatever the queue length) and returns the head of
    the tenant with the smallest counter. Counters move once per step, but one step may admit
    many requests: ``select`` adds what this round's admissions so far will compute
    (``ctx.admitted``), so a step with a large token budget alternates between tenants instead
    of filling up from one.

    **No banked credit.** ``active`` counts each tenant's requests in the scheduler (from
    arrival in ``waiting_key`` to ``on_finished``). A tenant that had none and gets one is
    lifted to the smallest counter among the active tenants (VTC's lift): it keeps its deficit
    if it is behind, but an idle spell earns it nothing. Without the lift a tenant returning
    after an hour would own the engine until its counter caught up.
    """

    def __init__(self, prefill_weight: float = 1.0, decode_weight: float = 2.0,
                 tenant_weights: dict[str, float] | None = None,
                 default_weight: float = 1.0) -> None:
        self.prefill_weight = prefill_weight
        self.decode_weight = decode_weight
        self.tenant_weights = dict(tenant_weights or {})
        self.default_weight = default_weight
        self.counters: dict[Tenant, float] = {}        # weighted tokens served, per tenant
        self.active: dict[Tenant, int] = {}            # requests in the scheduler, per tenant
        self.floor = 0.0                               # lift level while no tenant is active

    # ------------------------------------------------------------------ accounting
    def weight(self, tenant: Tenant) -> float:
        return self.tenant_weights.get(tenant, self.default_weight)   # None is never a key

    def cost(self, request: Request, num_tokens: int) -> float:
        """Weighted cost of computing the next ``num_tokens`` tokens of ``request``: positions
        before the end of the prompt are prefill, the rest output."""
        start = request.num_computed_tokens
        prompt = max(0, min(start + num_tokens, request.num_prompt_tokens) - start)
        weighted = self.prefill_weight * prompt + self.decode_weight * (num_tokens - prompt)
        return weighted / self.weight(request.user)

    def on_scheduled(self, scheduled: Sequence[tuple[Request, int]],
                     ctx: SchedulingContext) -> None:
        # num_computed_tokens has not advanced yet: the plan's tokens start there.
        for request, n in scheduled:
            self.counters[request.user] += self.cost(request, n)

    # ------------------------------------------------------------------ activity and the lift
    def waiting_key(self, request: Request, ctx: SchedulingContext) -> int:
        if request.num_preemptions == 0:               # an arrival, not a preempted request
            tenant = request.user
            if tenant not in self.active:
                floor = min((self.counters[t] for t in self.active), default=self.floor)
                self.counters[tenant] = max(self.counters.get(tenant, floor), floor)
            self.active[tenant] = self.active.get(tenant, 0) + 1
        # First come, first served within a tenant; a preempted request keeps its place.
        return request.arrival_seq

    def on_finished(self, request: Request, ctx: SchedulingContext) -> None:
        tenant = request.user
        self.active[tenant] -= 1
        if not self.active[tenant]:
            del self.active[tenant]
            if not self.active:                        # the next arrival starts from here
                self.floor = self.counters[tenant]

    # ------------------------------------------------------------------ decisions
    def queue_group(self, request: Request) -> Hashable:
        return request.user

    def select(self, waiting: WaitingQueue, ctx: SchedulingContext) -> Request | None:
        pending: dict[Tenant, float] = {}              # this round's admissions, not yet counted
        for request, n in ctx.admitted:
            pending[request.user] = pending.get(request.user, 0.0) + self.cost(request, n)
        return min(waiting.heads().items(), key=lambda item: (
            self.counters[item[0]] + pending.get(item[0], 0.0), item[1].arrival_seq))[1]

    def choose_victim(self, running: Sequence[Request], ctx: SchedulingContext) -> Request:
        """Preempt the most recently admitted running request of the tenant with the largest
        counter.

        - The tenant that has been served the most gives up service, which is what the counters
          say is fair; the request rejoins the front of its tenant's queue, so it is the
          tenant's next admission, not its last.
        - Within that tenant the last admitted usually has computed the fewest tokens, so the
          least work is recomputed, and it is the most recent grant of service to the tenant.

        ``preempt_for`` keeps its default (never preempt for a waiting request): fairness is
        enforced at admission, and recompute preemption would waste the work it undoes.
        """
        tenants = dict.fromkeys(r.user for r in running)     # in admission order: ties go early
        worst = max(tenants, key=lambda t: self.counters[t])
        return [r for r in running if r.user == worst][-1]


def _build(options: SchedulerOptions) -> FairSharePolicy:
    assert isinstance(options, FairShareOptions)
    return FairSharePolicy(options.prefill_weight, options.decode_weight,
                           options.tenant_weights, options.default_weight)


@hookimpl
def corellm_schedulers() -> Iterator[SchedulerSpec]:
    yield policy_scheduler(
        SCHEDULER_NAME, _build, options=FairShareOptions,
        summary="Fair share of tokens served across tenants (request.user), VTC-style.")
