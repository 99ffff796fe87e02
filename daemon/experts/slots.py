"""The expert cache algorithm of one MoE layer, free of MLX: the slot table, admission with the
layer's eviction policy, and pass planning. `LayerPool` (cache.py) runs it next to the slot arrays;
`moed trace analyze` and `moed bench policy` replay traces through the very same code."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from moed.daemon.experts.policies import EvictionPolicy


def plan_passes(needed: np.ndarray, slot_of: np.ndarray, slots: int) -> list[np.ndarray]:
    """Split a call's distinct experts into passes of at most `slots`. Resident experts go first,
    so the first pass is all hits as far as it goes and evicts nothing the call still needs."""
    if needed.size <= slots:
        return [needed]
    resident = slot_of[needed] >= 0
    ordered = np.concatenate([needed[resident], needed[~resident]])
    return [ordered[i : i + slots] for i in range(0, ordered.size, slots)]


# All-hit calls told to the policy together (`touch_call`): at most this many wait.
TOUCH_BATCH = 64


class SlotTable:
    """expert <-> slot tables of one layer and the policy that picks victims."""

    def __init__(self, num_experts: int, slots: int, policy: EvictionPolicy):
        self.num_experts = num_experts
        self._policy = policy
        self._touched: list[Sequence[int]] = []  # all-hit calls the policy has not heard of
        # The slot of each expert given one, written where a device reads it (cache.py's slot
        # table for the decode graph): an entry is written when its expert gets a slot and never
        # cleared, so a graph still pending reads the slots it was built for.
        self.device_slots: np.ndarray | None = None
        self.slots_given = 0  # slots given by `admit` so far (a stale copy of the above can tell)
        self._reset(slots)

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy, told of every call so far (in call order)."""
        if self._touched:
            self._catch_up()
        return self._policy

    def _catch_up(self) -> None:
        touched, self._touched = self._touched, []
        policy = self._policy
        for needed in touched:
            policy.begin_call()
            policy.touch_many(needed)

    def _reset(self, slots: int) -> None:
        self.slots = slots
        self.slot_of = np.full(self.num_experts, -1, dtype=np.int64)
        # The same table as a list, kept in step with `slot_of` by every write below: a decode
        # call looks up its few ids in it (host_route.py) without a numpy call.
        self.slot_list = [-1] * self.num_experts
        self.expert_in = np.full(slots, -1, dtype=np.int64)
        self._free = list(range(slots - 1, -1, -1))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def resident(self) -> list[int]:
        return [int(e) for e in self.expert_in if e >= 0]

    def plan_passes(self, needed: np.ndarray) -> list[np.ndarray]:
        """Start a layer call that uses the distinct experts `needed` (ascending)."""
        self.policy.begin_call()
        return plan_passes(needed, self.slot_of, self.slots)

    def begin_call(self) -> None:
        """Start a layer call whose distinct experts fit one pass (what `plan_passes` does for
        it, without the plan)."""
        self.policy.begin_call()

    def touch_call(self, needed: Sequence[int]) -> None:
        """A layer call whose distinct experts `needed` (ascending) are all resident: what
        `plan_passes` and `admit` do for it, without their lookups (the common decode call). The
        policy hears of it with the next calls, before anything reads or changes it (`policy`):
        its state is the same whenever it is read, and the decode call, where each call costs
        most (host_route.py), makes none."""
        touched = self._touched
        touched.append(needed)
        if len(touched) >= TOUCH_BATCH:
            self._catch_up()

    def admit(
        self, experts: Iterable[int], keep: Sequence[int] = ()
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Make room for `experts` (at most `slots` of them): hits are touched first, then each
        miss takes a free slot or evicts the policy's victim outside `experts` and `keep`.
        Returns (hits, [(expert, slot) to read]). The caller guarantees no pending computation
        still reads an evicted slot."""
        # Lists: a call's few experts cost less in Python than in numpy calls. Hits keep the
        # call's order.
        ids: list[int] = (
            np.ravel(experts).tolist() if isinstance(experts, np.ndarray) else list(experts)
        )
        if len(ids) > self.slots:
            raise ValueError(f"{len(ids)} experts do not fit {self.slots} slots")
        slot_of, slot_list, policy = self.slot_of, self.slot_list, self.policy
        found = [slot_list[e] for e in ids]
        hits = [e for e, slot in zip(ids, found) if slot >= 0]
        if len(hits) == len(ids):  # every expert a hit
            policy.touch_many(ids)
            return hits, []
        policy.touch_many(hits)
        missing = list(dict.fromkeys(e for e, slot in zip(ids, found) if slot < 0))  # once each
        short = len(missing) - len(self._free)
        # The victims are ranked once for the whole call: evicting one never reorders the rest.
        victims = policy.victims(short, [*ids, *keep] if keep else ids) if short > 0 else []
        loads = []
        device = self.device_slots
        for e in missing:
            if not self._free:
                self._evict(victims.pop(0))  # frees exactly one slot
            slot = self._free.pop()
            slot_of[e] = slot_list[e] = slot
            if device is not None:
                device[e] = slot
            self.expert_in[slot] = e
            policy.insert(e)
            loads.append((e, slot))
        self.slots_given += len(loads)
        return hits, loads

    def _evict(self, expert: int) -> None:
        slot = self.slot_list[expert]
        self.slot_of[expert] = self.slot_list[expert] = -1
        self.expert_in[slot] = -1
        self.policy.remove(expert)
        self._free.append(slot)

    def forget(self, loads: list[tuple[int, int]]) -> None:
        """Undo `admit` for reads that failed, so no slot claims bytes it does not hold."""
        for e, _slot in loads:
            if self.slot_list[e] >= 0:
                self._evict(e)

    def resize_table(self, new_slots: int) -> list[tuple[int, int, int]]:
        """Re-plan the table for `new_slots` slots, keeping the most valuable residents (in the
        policy's order). Returns [(expert, old slot, new slot)] for the caller to move bytes."""
        keep = self.policy.order()[-new_slots:]  # most valuable last
        old_slot_of = self.slot_of
        for e in self.policy.order():
            self.policy.remove(e)
        self.policy.set_capacity(new_slots)
        self._reset(new_slots)
        moves = []
        for e in keep:
            slot = self._free.pop()
            self.slot_of[e] = self.slot_list[e] = slot
            self.expert_in[slot] = e
            self.policy.insert(e)
            moves.append((e, int(old_slot_of[e]), slot))
        return moves
