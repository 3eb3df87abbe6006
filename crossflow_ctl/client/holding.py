"""The decision logic of late binding, with no I/O and no clock of its own.

:class:`HoldBook` keeps the prompts a router holds back from the prefill pool and answers, given
the time in milliseconds, every question :class:`~crossflow_ctl.client.queue.AdmissionQueue`
asks: hold this answer or dispatch it? which held prompts are past their deadline? in what order
to re-offer them on a room update, and what to do with the answer to a re-offer? It is
deterministic (same calls, same results), so tests drive it with plain integers for time.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import islice
from typing import Annotated, Generic, Literal, TypeVar

from pydantic import Field, field_validator

from crossflow_ctl.domain.admission import Admission, AdmissionRequest, Decision, Reason
from crossflow_ctl.domain.models import MAX_TOKENS, Credits, Frozen
from crossflow_ctl.domain.room import NodeRoom, RoomStatus, RoomView

K = TypeVar("K")


class Dispatch(StrEnum):
    """Why a prompt got its outcome."""

    BORROWED = "borrowed"
    """BORROW on the first offer."""
    BORROWED_LATE = "borrowed_late"
    """BORROW on a re-offer, after being held."""
    NOT_HELD = "not_held"
    """NORMAL on the first offer, for a reason that holding cannot fix (no demand, ...)."""
    PREFILL_ROOM = "prefill_room"
    """Held, then sent to prefill because the router said prefill has room."""
    DEADLINE = "deadline"
    """Held for ``max_hold_ms`` without a borrow."""
    NO_DEMAND = "no_demand"
    """Held, then Demand stopped holding (a room update or a re-offer said so)."""
    ROOM_UNKNOWN = "room_unknown"
    """Held, then the broker was in doubt or out of reach (room unknown, store or broker
    unavailable, timeout)."""
    OVERFLOW = "overflow"
    """Would have been held, but ``max_held`` prompts already were (or holding is off)."""
    WITHDRAWN = "withdrawn"
    """Held, then withdrawn by the router."""
    CLOSED = "closed"
    """Held when the queue closed (or its room watch ended)."""


class QueueConfig(Frozen):
    max_held: Annotated[int, Field(ge=0, le=1_000_000)] = 256
    """Prompts held at once; more are dispatched to prefill at once (OVERFLOW)."""
    max_hold_ms: Annotated[int, Field(ge=0, le=600_000)] = 500
    """Longest a prompt is held before it goes to prefill; keep it well inside the TTFT target.
    With a ``prefill_room`` predicate a held prompt goes to prefill as soon as prefill has room,
    so the deadline fires only under overload, where it moves the prompt to a prefill queue it
    waits in just as long and where no lease can reach it: make it long there."""
    order: Literal["fifo", "shortest"] = "fifo"
    """Queue order: arrival, or fewest uncached prompt tokens first (ties by arrival). Held
    prompts go to prefill in this order and are re-offered in it, unless the queue is behind
    (``fresh_first_ms``)."""
    fresh_first_ms: Annotated[int | None, Field(ge=1, le=600_000)] = 5_000
    """Adaptive LIFO for room, under overload. Once the oldest held prompt has been held this
    long (the queue is behind), a room update re-offers first the *fresh* prompts, held less
    than this, in ``fresh_order``, then the others in queue order, and a refusal skips a
    prompt instead of ending the pass. Prefill still takes the oldest. A FIFO queue that is
    behind makes every prompt wait the whole backlog; this way room serves fresh prompts at
    once while the rest drain through prefill in order, and once arrivals stop nothing is
    fresh, so room and prefill both take the oldest and the tail stays close to FIFO's.
    Never acts while ``max_hold_ms`` is shorter. None: room follows ``order`` always."""
    fresh_order: Literal["smallest", "newest"] = "smallest"
    """Order of fresh prompts when the queue is behind: fewest prompt (cached and uncached)
    plus expected output tokens first, the KV a borrowed prompt takes on its node, which is
    the credit overloaded nodes run short of, so the room serves the most prompts (ties
    newest first); or newest first."""
    max_reoffers_per_update: Annotated[int, Field(ge=1, le=10_000)] = 16
    """Admits one room update may cause at most."""
    hold_reasons: frozenset[Reason] = frozenset(
        {Reason.NO_ROOM, Reason.NO_BENEFIT, Reason.NO_LEASES}
    )
    """NORMAL reasons worth holding for: Demand holds but no node has room (or benefit) now.
    Never NO_DEMAND: the pool is not behind, so there is nothing to wait for, and the broker
    counts a prompt it answers NO_DEMAND as sent to the prefill pool (Demand's wait)."""
    recheck_ms: Annotated[int, Field(ge=1, le=60_000)] = 50
    """How often the live queue re-asks the router's prefill-room predicate while holding."""

    @field_validator("hold_reasons")
    @classmethod
    def _not_no_demand(cls, reasons: frozenset[Reason]) -> frozenset[Reason]:
        if Reason.NO_DEMAND in reasons:
            raise ValueError("no_demand is never held: the broker counts it as sent to prefill")
        return reasons


MAX_REQUEST_ID_LEN = 256
"""AdmissionRequest.request_id's limit."""
DOUBT = frozenset({Reason.STORE_UNAVAILABLE, Reason.TIMEOUT, Reason.BROKER_UNAVAILABLE})


class Step(StrEnum):
    """What a re-offer's answer means for the rest of the pass."""

    BORROWED = "borrowed"
    """Hand it out; go on with the next held prompt."""
    REFUSED = "refused"
    """No room for this one: keep it held and end the pass (when the queue is behind, skip it
    and go on: :meth:`HoldBook.behind`)."""
    DISPATCH_ALL = "dispatch_all"
    """Demand is gone or the broker is in doubt: every held prompt goes to prefill."""


@dataclass(slots=True)
class Held(Generic[K]):
    key: K
    request: AdmissionRequest
    seq: int
    since_ms: int
    deadline_ms: int
    last: Admission
    """The latest NORMAL answer: what the prompt is dispatched with when it leaves unborrowed."""
    offers: int = 1
    compute_need: int = field(init=False)
    """The compute a node needs spare to take it: its uncached tokens (:class:`_Room`)."""
    kv_need: int = field(init=False)
    """The least KV any node needs spare to take it: its uncached tokens, and a cached prefix
    that does not live on a decode node, which any node must pull in."""

    def __post_init__(self) -> None:
        request = self.request
        self.compute_need = request.uncached_prompt_tokens
        remote = request.cached_prefix_tokens if request.cached_prefix_node_id is None else 0
        self.kv_need = self.compute_need + remote


class _MinBag:
    """A multiset of ints with its least at hand, O(log n) to add or remove one: a min-heap
    whose removals wait as counts until their value comes to the top (lazy deletion, as
    :attr:`HoldBook._deadlines` drops ended holds), compacted once removals waiting outnumber
    the values held, so the heap stays within about twice the bag."""

    __slots__ = ("_gone", "_heap", "_stale")

    def __init__(self) -> None:
        self._heap: list[int] = []
        self._gone: dict[int, int] = {}
        """Value -> removals of it still in the heap."""
        self._stale = 0
        """Removals still in the heap (the sum of ``_gone``)."""

    def __len__(self) -> int:
        return len(self._heap) - self._stale

    def add(self, value: int) -> None:
        heapq.heappush(self._heap, value)

    def remove(self, value: int) -> None:
        """Remove one ``value`` (it is in the bag)."""
        gone = self._gone
        gone[value] = gone.get(value, 0) + 1
        self._stale += 1
        if self._stale > 32 and 2 * self._stale > len(self._heap):
            self._heap = self.values()
            heapq.heapify(self._heap)
            gone.clear()
            self._stale = 0

    def least(self) -> int | None:
        """The least value in the bag (None: it is empty)."""
        heap, gone = self._heap, self._gone
        while heap:
            top = heap[0]
            n = gone.get(top)
            if not n:
                return top
            heapq.heappop(heap)
            if n == 1:
                del gone[top]
            else:
                gone[top] = n - 1
            self._stale -= 1
        return None

    def values(self) -> list[int]:
        """Every value in the bag, once per add not removed since (in no set order)."""
        gone = dict(self._gone)
        out: list[int] = []
        for v in self._heap:
            n = gone.get(v)
            if n:
                gone[v] = n - 1
            else:
                out.append(v)
        return out

    def clear(self) -> None:
        self._heap.clear()
        self._gone.clear()
        self._stale = 0


def _arrival(held: Held[K]) -> int:
    return held.seq


@dataclass(frozen=True, slots=True)
class _Room:
    """The most spare compute and KV any node in a room view has."""

    compute_tokens: int
    kv_tokens: int = MAX_TOKENS
    """MAX_TOKENS: KV not looked at."""

    def fits(self, held: Held[K]) -> bool:
        """Whether some node might take ``held``: its compute and KV needs within the room."""
        return held.compute_need <= self.compute_tokens and held.kv_need <= self.kv_tokens


class PassRoom:
    """The room a room view showed, less what the grants of the pass re-offering on it took.

    A re-offer pass walks held prompts chosen on the view's room (:meth:`HoldBook.to_reoffer`).
    Each prompt it borrows takes its debit from its node, room that every later prompt of the
    pass was chosen on: offered anyway, a prompt that no node can take any more is only refused
    NO_ROOM (under overload most re-offers were such refusals, an Admit each). So a pass takes
    each grant's debit off its node (:meth:`took`), and a prompt that no node's room left can
    take (:meth:`fits`) counts as refused without its Admit: skipped when the queue is behind,
    the end of the pass in queue order, as its refusal would be.

    Only a sure refusal is skipped: a node takes the prompt unless it is out of slots, short of
    the prompt's compute priced as Admit prices it (the view says the node's lease pricing;
    where it does not, compute is not judged) or, when ``with_kv``, of the KV any node needs
    for it. Safety counts a timed debit's tokens on the node's open node time (``need_for``),
    which can come to one token less than the debit's own rounding: so a grant takes its
    tokens less one off, and a prompt needs its priced tokens less one, keeping the room left
    an upper bound and the need a lower bound. A grant whose answer does not say its debit (a
    broker before ``Admission.debit``, on AdmitStream, which sends no explanation) takes
    nothing off. The broker still decides every prompt offered."""

    def __init__(self, view: RoomView, with_kv: bool) -> None:
        self._with_kv = with_kv
        self._nodes = {n.node_id: _NodeLeft(n) for n in view.nodes}

    def fits(self, held: Held[K]) -> bool:
        """Whether some node's room left might take ``held``."""
        request = held.request
        for node in self._nodes.values():
            if node.slots <= 0 or (self._with_kv and held.kv_need > node.kv_tokens):
                continue
            need = node.room.compute_need(
                request.uncached_prompt_tokens, request.cached_prefix_tokens
            )
            if need is None or need - 1 <= node.compute_tokens:
                return True
        return False

    def took(self, admission: Admission) -> None:
        """A prompt of this pass borrowed (``admission``): its debit leaves its node."""
        debit = granted_debit(admission)
        node = self._nodes.get(admission.node_id)
        if debit is None or node is None:
            return
        node.compute_tokens -= max(0, debit.compute_tokens - 1)
        node.kv_tokens -= debit.kv_tokens
        node.slots -= debit.slots


@dataclass(slots=True)
class _NodeLeft:
    """One node of a :class:`PassRoom`: its room as the view showed it, and what is left."""

    room: NodeRoom
    compute_tokens: int = field(init=False)
    kv_tokens: int = field(init=False)
    slots: int = field(init=False)

    def __post_init__(self) -> None:
        room = self.room
        self.compute_tokens, self.kv_tokens, self.slots = (
            room.compute_tokens,
            room.kv_tokens,
            room.slots,
        )


def granted_debit(admission: Admission) -> Credits | None:
    """What a BORROW answer debited on its node: its ``debit``, else (a broker before that
    field) as its explanation tells; None for a NORMAL answer, or when neither says."""
    if admission.decision is not Decision.BORROW:
        return None
    if admission.debit is not None:
        return admission.debit
    plan = admission.plan
    if plan is None:
        return None
    for check in plan.ranked:
        if check.node_id == admission.node_id:
            return check.debit
    return None


def _kv_tokens(request: AdmissionRequest) -> int:
    """The KV a borrowed prompt takes on its node: whole prompt and expected output."""
    return (
        request.uncached_prompt_tokens
        + request.cached_prefix_tokens
        + request.expected_output_tokens
    )


def _shortest(held: Held[K]) -> tuple[int, int]:
    return (held.request.uncached_prompt_tokens, held.seq)


class HoldBook(Generic[K]):
    """Held prompts by key, in arrival order (see module docstring)."""

    def __init__(self, config: QueueConfig) -> None:
        self.config = config
        self._held: dict[K, Held[K]] = {}
        self._seq = 0
        self._tokens = 0
        """Uncached prompt tokens of everything held."""
        self._deadlines: list[tuple[int, int, K]] = []
        """Heap of (deadline, seq, key) per hold; an entry whose hold has ended (its key is
        gone or held again under a later seq) is dropped when it comes to the top."""
        self._compute_needs = _MinBag()
        self._kv_needs = _MinBag()
        """Every held prompt's compute and KV need, the least of each at hand: when the room
        is short of the least of either, no prompt fits and a room update scans nothing (a
        book that is behind is long, and most updates then find nothing fits). Min-heaps, not
        sorted lists: a hold or take costs O(log n), not a shift of up to ``max_held``."""

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[Held[K]]:
        return iter(self._held.values())

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def worth_holding(self, admission: Admission) -> bool:
        return admission.decision is Decision.NORMAL and admission.reason in (
            self.config.hold_reasons
        )

    def hold(
        self, key: K, request: AdmissionRequest, admission: Admission, now_ms: int
    ) -> Dispatch | None:
        """Hold ``request`` after its first answer: None when held, else why it was not."""
        if not self.worth_holding(admission):
            return Dispatch.NOT_HELD
        if self.config.max_hold_ms == 0 or len(self._held) >= self.config.max_held:
            return Dispatch.OVERFLOW
        if key in self._held:
            raise ValueError("key is already held")
        self._seq += 1
        deadline = now_ms + self.config.max_hold_ms
        self._held[key] = Held(
            key=key,
            request=request,
            seq=self._seq,
            since_ms=now_ms,
            deadline_ms=deadline,
            last=admission,
        )
        self._tokens += request.uncached_prompt_tokens
        heapq.heappush(self._deadlines, (deadline, self._seq, key))
        held = self._held[key]
        self._compute_needs.add(held.compute_need)
        self._kv_needs.add(held.kv_need)
        return None

    def take(self, key: K) -> Held[K] | None:
        held = self._held.pop(key, None)
        if held is not None:
            self._tokens -= held.request.uncached_prompt_tokens
            self._compute_needs.remove(held.compute_need)
            self._kv_needs.remove(held.kv_need)
        return held

    def ahead_of_new(self, request: AdmissionRequest) -> int:
        """Uncached tokens held ahead of ``request`` were it held now: they would reach
        prefill before it (everything held, or in "shortest" order those no longer than it).
        0 when the book is full: such a prompt goes to prefill at once (OVERFLOW)."""
        if len(self._held) >= self.config.max_held:
            return 0
        if self.config.order == "fifo":
            return self._tokens
        size = request.uncached_prompt_tokens
        return sum(
            t for h in self._held.values() if (t := h.request.uncached_prompt_tokens) <= size
        )

    def ordered(self) -> list[Held[K]]:
        """Held prompts in re-offer (and dispatch) order."""
        return list(self._in_order())

    def _in_order(self) -> Iterable[Held[K]]:
        """:meth:`ordered`, without copying a FIFO book (arrival order is the dict's): for a
        reader that does not change the book while it reads."""
        if self.config.order == "shortest":
            return sorted(self._held.values(), key=_shortest)
        return self._held.values()

    def heads(self) -> Iterator[Held[K]]:
        """:meth:`ordered` for a reader that takes each prompt it is given before it asks for
        the next (or stops): a FIFO book yields its head each time, with no copy of the book
        per call (the router asks on every room update and prefill completion, and usually
        stops at the first); it stops should the reader not have taken the last one."""
        if self.config.order == "shortest":
            yield from self.ordered()
            return
        last: Held[K] | None = None
        while (held := next(iter(self._held.values()), None)) is not None and held is not last:
            yield held
            last = held

    def drain(self) -> list[Held[K]]:
        """Remove and return everything held, in order."""
        out = self.ordered()
        self._held.clear()
        self._tokens = 0
        self._deadlines.clear()
        self._compute_needs.clear()
        self._kv_needs.clear()
        return out

    def due(self, now_ms: int) -> list[Held[K]]:
        """Remove and return the prompts whose hold deadline has passed, in order."""
        heap = self._deadlines
        if not heap or heap[0][0] > now_ms:
            return []  # the heap's top, even one whose hold ended, is no later than any hold's
        out: list[Held[K]] = []
        while (first := self._first_deadline()) is not None and first.deadline_ms <= now_ms:
            heapq.heappop(self._deadlines)
            self.take(first.key)
            out.append(first)
        out.sort(key=_shortest if self.config.order == "shortest" else _arrival)
        return out

    def next_deadline_ms(self) -> int | None:
        first = self._first_deadline()
        return first.deadline_ms if first is not None else None

    def _first_deadline(self) -> Held[K] | None:
        """The hold whose deadline falls first (a heap: O(log n), not a scan per call)."""
        heap = self._deadlines
        while heap:
            _, seq, key = heap[0]
            held = self._held.get(key)
            if held is not None and held.seq == seq:
                return held
            heapq.heappop(heap)
        return None

    def on_room(self, view: RoomView) -> Dispatch | None:
        """A room update: the reason to dispatch everything held, or None to re-offer."""
        if view.status is RoomStatus.UNKNOWN:
            return Dispatch.ROOM_UNKNOWN
        if not view.demand_holds:
            return Dispatch.NO_DEMAND
        return None

    def behind(self, now_ms: int) -> bool:
        """Whether the queue is behind (``fresh_first_ms``): its oldest prompt has been held
        at least that long. Then room goes to fresh prompts first and a refusal skips."""
        after = self.config.fresh_first_ms
        if after is None or not self._held:
            return False
        oldest = next(iter(self._held.values()))  # insertion is arrival order
        return now_ms - oldest.since_ms >= after

    def to_reoffer(self, view: RoomView, now_ms: int) -> list[tuple[Held[K], int]]:
        """The held prompts to re-offer on ``view``, in order, at most the configured number,
        each with the uncached tokens held ahead of it (:meth:`reoffer_request`): those that
        go to prefill before it, whatever the re-offer order.

        A prompt is skipped when it needs more compute than any node in the view has spare,
        or, when the queue is behind (refusals skip anyway), more KV (its tokens still count
        as ahead of the prompts after it). In queue order a prompt short of KV is offered and
        its refusal ends the pass, so later prompts do not overtake it for ever."""
        if not view.has_room:
            return []
        most = self.config.max_reoffers_per_update
        if not self.behind(now_ms):
            return list(islice(self._fits(_Room(view.max_compute_tokens)), most))
        room = _Room(view.max_compute_tokens, max(n.kv_tokens for n in view.nodes))
        return list(islice(self._fresh_first(room, now_ms), most))

    def _fits(
        self, room: _Room, skip: frozenset[int] | set[int] = frozenset()
    ) -> Iterator[tuple[Held[K], int]]:
        """Held prompts that fit ``room`` in queue order (but those whose seq is in ``skip``),
        each with the uncached tokens of every prompt before it. A room update scans the whole
        book when little fits, so the test is inlined (``_Room.fits``)."""
        compute, kv = room.compute_tokens, room.kv_tokens
        least, least_kv = self._compute_needs.least(), self._kv_needs.least()
        if least is None or least_kv is None or least > compute or least_kv > kv:
            return  # nothing held fits (or nothing is held)
        ahead = 0
        for held in self._in_order():
            need = held.compute_need
            if need <= compute and held.kv_need <= kv and held.seq not in skip:
                yield held, ahead
            ahead += need

    def _fresh_first(self, room: _Room, now_ms: int) -> Iterator[tuple[Held[K], int]]:
        assert self.config.fresh_first_ms is not None
        cutoff = now_ms - self.config.fresh_first_ms
        if self.config.order == "fifo":
            fresh = self._fresh_fifo(room, cutoff)
        else:
            fresh = [(h, a) for h, a in self._fits(room) if h.since_ms > cutoff]
        if self.config.fresh_order == "smallest":
            fresh.sort(key=lambda e: (_kv_tokens(e[0].request), -e[0].seq))
        else:
            fresh.sort(key=lambda e: -e[0].seq)
        yield from fresh
        # the rest: every prompt not offered as fresh (not "held before the cutoff": a prompt
        # held after a later-stamped one, its Admit having come back later, is in neither)
        yield from self._fits(room, {h.seq for h, _ in fresh})

    def _fresh_fifo(self, room: _Room, cutoff: int) -> list[tuple[Held[K], int]]:
        """The fresh prompts of a FIFO book with their tokens ahead, read from the newest end
        (fresh prompts are the last held), so a pass costs the fresh prompts, not the book."""
        out: list[tuple[Held[K], int]] = []
        ahead = self._tokens
        for held in reversed(self._held.values()):
            if held.since_ms <= cutoff:
                break
            ahead -= held.compute_need
            if room.fits(held):
                out.append((held, ahead))
        return out

    @staticmethod
    def reoffer_request(
        held: Held[K], ahead_tokens: int = 0, prefill_node_id: str | None = None
    ) -> AdmissionRequest:
        """The request a re-offer sends: the same prompt with the tokens now held ahead of
        it, under a request id of its own (``<id>#<offer>``), since a broker that keeps
        request records replays the first answer to a repeated id. Each offer is a new
        admission attempt; only one can borrow, as nothing is re-offered once borrowed. An
        empty id stays empty. ``prefill_node_id``: the prefill server a NORMAL answer would
        send it to now (None: none named, the broker reads the least-loaded server's wait);
        the first offer's may be seconds old, its server since jammed, drained or gone."""
        update: dict[str, object] = {
            "held_ahead_tokens": max(0, ahead_tokens),
            "prefill_node_id": prefill_node_id,
        }
        base = held.request.request_id
        if base:
            suffix = f"#{held.offers + 1}"
            update["request_id"] = base[: MAX_REQUEST_ID_LEN - len(suffix)] + suffix
        return held.request.model_copy(update=update)

    def answered(self, held: Held[K], admission: Admission) -> Step:
        """Record a re-offer's answer; a BORROWED prompt is removed from the book."""
        held.offers += 1
        if admission.decision is Decision.BORROW:
            self.take(held.key)
            return Step.BORROWED
        held.last = admission
        if self.worth_holding(admission):
            return Step.REFUSED
        return Step.DISPATCH_ALL

    @staticmethod
    def dispatch_for(admission: Admission) -> Dispatch:
        """Why a pass that ended on this NORMAL answer dispatches everything held."""
        return Dispatch.ROOM_UNKNOWN if admission.reason in DOUBT else Dispatch.NO_DEMAND
