"""The scheduler's view of the device's adapter slots: which adapter each holds, and which
running requests use it.

A request for an adapter is admitted only when the adapter has a slot: the one it holds, a free
one, or the least recently used one whose adapter no running request uses (evicted). Otherwise
it waits (the scheduler sets it aside for the round, and admits the others): it never fails for
want of a slot. An adapter with running requests is never evicted. ``acquire`` returns the slot
and whether the workers must load it (``take_loads`` collects those for the plan); ``release``
undoes one ``acquire`` (a request finished, aborted or preempted); ``admit`` and ``leave`` do
the same for a scheduler's ``Request``. ``check_invariants`` verifies the counts against the
running requests.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from corellm.lora.request import LoRARequest

if TYPE_CHECKING:
    from corellm.request import Request


class LoRASlots:
    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.max_loras = max_loras
        self.held: list[LoRARequest | None] = [None] * max_loras
        self.slot_of: dict[int, int] = {}              # adapter id -> its slot
        self.users: Counter[int] = Counter()           # adapter id -> running requests
        self._idle: OrderedDict[int, None] = OrderedDict()   # loaded, unused: LRU first
        self._loads: dict[int, LoRARequest] = {}       # slot -> adapter, since take_loads
        self._blocked = False        # a request waits for a slot in this round of admissions

    def _slot_for(self, lora: LoRARequest) -> int | None:
        """The slot ``lora`` would take now (None: none can be had)."""
        slot = self.slot_of.get(lora.lora_int_id)
        if slot is not None:
            return slot
        if None in self.held:
            return self.held.index(None)
        if self._idle:
            return self.slot_of[next(iter(self._idle))]
        return None

    def can_take(self, lora: LoRARequest) -> bool:
        return self._slot_for(lora) is not None

    def acquire(self, lora: LoRARequest) -> tuple[int, bool]:
        """A slot for one more running request of ``lora``, and whether it must be loaded."""
        slot = self._slot_for(lora)
        if slot is None:
            raise RuntimeError(f"no adapter slot for {lora.lora_name!r}: ask can_take first")
        key = lora.lora_int_id
        load = self.held[slot] is None or self.held[slot].lora_int_id != key
        if load:
            self._loads[slot] = lora
            old = self.held[slot]
            if old is not None:                        # evict an idle adapter
                del self.slot_of[old.lora_int_id]
                self._idle.pop(old.lora_int_id, None)
            self.held[slot] = lora
            self.slot_of[key] = slot
        self._idle.pop(key, None)
        self.users[key] += 1
        return slot, load

    def release(self, lora: LoRARequest) -> None:
        key = lora.lora_int_id
        self.users[key] -= 1
        if self.users[key] <= 0:
            del self.users[key]
            if key in self.slot_of:
                self._idle[key] = None                 # most recently used last

    def waits(self, request: Request) -> bool:
        """``request`` runs an adapter that can get no slot now, or a request before it in
        this round waits for one: then no later adapter request is admitted in the round, so
        the adapters holding the slots drain and the waiting request gets one (with steady
        traffic on them it would wait for ever). Base-model requests never wait here."""
        if request.lora_request is None:
            return False
        if self._blocked or not self.can_take(request.lora_request):
            self._blocked = True
        return self._blocked

    def admit(self, request: Request) -> None:
        """``request``, admitted, takes its adapter's slot (``request.lora_slot``; none for the
        base model)."""
        if request.lora_request is not None:
            request.lora_slot, _ = self.acquire(request.lora_request)

    def take_loads(self) -> dict[int, LoRARequest]:
        """The slots assigned a new adapter since the last call (slot -> adapter): what the
        workers load before the step this plan is for."""
        loads, self._loads = self._loads, {}
        self._blocked = False                          # (called once a round, at its end)
        return loads

    def leave(self, request: Request) -> None:
        """``request`` stops running (finished, aborted or preempted): its slot is released."""
        if request.lora_slot >= 0 and request.lora_request is not None:
            request.lora_slot = -1
            self.release(request.lora_request)

    @staticmethod
    def stats(running: Iterable[Request], waiting: Iterable[Request]) -> dict[str, Any]:
        """``SchedulerStats``' adapter fields: each adapter's running and waiting requests."""
        out: dict[str, Any] = {}
        for key, requests in (("running_lora_adapters", running),
                              ("waiting_lora_adapters", waiting)):
            out[key] = dict(Counter(r.lora_request.lora_name for r in requests
                                    if r.lora_request is not None))
        return out

    def check_invariants(self, running: Iterable[Request | LoRARequest | None],
                         waiting: Iterable[Request] = ()) -> None:
        """The counts agree with the running requests (or their adapters), each running request
        holds its adapter's slot, and no waiting request holds one."""
        loras = []
        for r in running:
            if r is not None and not isinstance(r, LoRARequest):
                if r.lora_request is not None:
                    assert self.held[r.lora_slot] == r.lora_request, (r, r.lora_slot)
                r = r.lora_request
            loras.append(r)
        assert all(r.lora_slot < 0 for r in waiting)
        counts = Counter(lora.lora_int_id for lora in loras if lora is not None)
        assert counts == +self.users, (counts, self.users)
        for key in counts:
            assert key in self.slot_of, f"adapter {key} runs without a slot"
        for key, slot in self.slot_of.items():
            held = self.held[slot]
            assert held is not None and held.lora_int_id == key, (key, slot, held)
        assert set(self._idle) == set(self.slot_of) - set(self.users), (self._idle, self.users)
        assert sum(h is not None for h in self.held) == len(self.slot_of)
