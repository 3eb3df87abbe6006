"""Value models shared by the broker, the agent, the store and the simulator.

Units are in the field names: ``*_tokens``, ``*_bytes``, ``*_ms``, ``*_tps`` (tokens per second).
Every model is frozen; construction validates, and :func:`validated` turns pydantic's
ValidationError into :class:`InvalidArgument` naming the field at fault.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from enum import StrEnum
from keyword import iskeyword
from typing import Annotated, Any, NamedTuple, TypeVar, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from crossflow_ctl.domain.errors import InvalidArgument

# Upper bounds beyond which a value is absurd rather than large. A decode node with more than a
# billion KV token slots or a petabyte of transfer credit is a bug or an attack, not a lease.
MAX_TOKENS = 1_000_000_000
MAX_BYTES = 10**15
MAX_SLOTS = 100_000
MAX_TTL_MS = 3_600_000
MAX_RATE_TPS = 1e9
MAX_MS = 86_400_000.0
MAX_HORIZON_MS = 600_000
"""The borrow horizon's bound, on the broker's policy and the agent's lease settings alike."""
MAX_S_PER_TOKEN = 1.0
"""A borrowed prompt token costing a node more than a second is a bug, not a lease."""
MAX_S_PER_TOKEN_CONTEXT = 1e-3
MICROS_PER_S = 1_000_000
MAX_COMPUTE_US = 2**40
"""A compute debit's node time is capped here (about 12.7 days, far past any lease's horizon, so
a debit at the cap never fits), which keeps a node's open sum of it an exact integer in a double
(the Redis scripts' Lua numbers) for up to 8,192 open debits at the cap."""
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
MAX_ID_LEN = 128
MAX_POOL_LEN = 64
MAX_LABELS = 32
MAX_LABEL_KEY_LEN = 128
MAX_LABEL_VALUE_LEN = 256
LABEL_KEY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]*$"
MAX_EPOCH_LEAD_MS = 3_600_000
"""How far a lease's epoch may be ahead of the broker's clock (unix ms). Agents take their start
time in unix ms as their epoch (or any smaller counter), so an epoch later than an hour from now
is not a start time: refused, so that one bad lease cannot put a node's epoch out of reach of
every later agent start (an epoch of 2^63-1 would otherwise brick the node for good)."""

NodeId = Annotated[str, Field(min_length=1, max_length=MAX_ID_LEN, pattern=ID_PATTERN)]
_ID = re.compile(ID_PATTERN)


def is_node_id(node_id: str) -> bool:
    """Whether ``node_id`` is well formed, as ``NodeId`` validates it (the pattern over the WHOLE
    string: ``match`` would take 'd1\n', since ``$`` also matches before a final newline);
    says nothing of existence."""
    return len(node_id) <= MAX_ID_LEN and _ID.fullmatch(node_id) is not None


PoolName = Annotated[str, Field(min_length=1, max_length=MAX_POOL_LEN, pattern=ID_PATTERN)]
Tokens = Annotated[int, Field(ge=0, le=MAX_TOKENS)]
Ms = Annotated[float, Field(ge=0.0, le=MAX_MS, allow_inf_nan=False)]
Tps = Annotated[float, Field(ge=0.0, le=MAX_RATE_TPS, allow_inf_nan=False)]
SPerToken = Annotated[float, Field(ge=0.0, le=MAX_S_PER_TOKEN, allow_inf_nan=False)]
"""Node seconds per borrowed uncached token (a lease's ``a``)."""
SPerTokenContext = Annotated[float, Field(ge=0.0, le=MAX_S_PER_TOKEN_CONTEXT, allow_inf_nan=False)]
"""Extra node seconds per uncached token per token of attended context (a lease's ``b``)."""

M = TypeVar("M", bound=BaseModel)
F = TypeVar("F", bound="Frozen")
_LABEL_KEY = re.compile(LABEL_KEY_PATTERN)


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        inherited = getattr(cls.trusted, "__func__", None)  # None: not a classmethod
        if inherited is _GENERIC_TRUSTED or getattr(inherited, "_generated", False):
            _FIELDS[cls] = _field_order(cls)
            type.__setattr__(cls, "trusted", classmethod(_trusted_builder(cls)))
        else:  # a model (or one it extends) defines its own ``trusted``: that stands, and
            _FIELDS[cls] = _GENERIC  # ``replaced`` goes through it

    @classmethod
    def trusted(cls: type[F], **values: Any) -> F:
        """``model_construct(**values)`` (no validation: for values known valid), about twice
        as fast when ``values`` names every field: the same object without pydantic's scan of
        each field for aliases and defaults. For hot loops (simulated telemetry, lease credits,
        stored leases, admission's answers).

        Each model class gets its own ``trusted`` (:func:`_trusted_builder`), generated from
        its field list, with each field a keyword parameter: the call's keywords land in them
        with no dict built and compared per call. This is the fallback for classes that take
        pydantic's path always (a post-init hook, aliases)."""
        return cast(F, cls.model_construct(**values))

    def replaced(self: F, **update: Any) -> F:
        """A copy with ``update``'s fields, built by :meth:`trusted` (no validation: for
        values known valid, of the fields' types; hot paths copy stored values this way)."""
        cls = type(self)
        order, names = _FIELDS.get(cls, _GENERIC)
        values = self.__dict__.copy()  # in field order; the update's fields overwrite in place
        if order and values.keys() == names and update.keys() <= names:
            values.update(update)
            return _built(cls, values, names)
        return cls.trusted(**{**values, **update})


_GENERIC_TRUSTED = Frozen.__dict__["trusted"].__func__
_GENERIC: tuple[tuple[str, ...], frozenset[str]] = ((), frozenset())
"""A model's entry in ``_FIELDS`` when it takes pydantic's path always."""
_FIELDS: dict[type[Frozen], tuple[tuple[str, ...], frozenset[str]]] = {}
"""Each model's field names in order (empty: the model takes pydantic's path always, see
:func:`_field_order`), and as a set (copied, not rebuilt from the keys, for each model's
``model_fields_set``)."""
_set = object.__setattr__
_new = object.__new__
_set_fields_set = BaseModel.__dict__["__pydantic_fields_set__"].__set__
_set_extra = BaseModel.__dict__["__pydantic_extra__"].__set__
_set_private = BaseModel.__dict__["__pydantic_private__"].__set__
_set_dict = BaseModel.__dict__["__dict__"].__set__
"""Pydantic's slots, set through their descriptors (what ``object.__setattr__`` finds by name)."""
_UNSET: Any = object()
"""A generated ``trusted``'s default for each field: the call left the field out."""


def _field_order(cls: type[Frozen]) -> tuple[tuple[str, ...], frozenset[str]]:
    """``cls``'s fields in order and as a set; no order where ``model_construct`` does more
    than set the fields (a post-init hook, a field with an alias), so its path is taken."""
    fields = cls.__pydantic_fields__
    aliased = any(f.alias is not None or f.validation_alias is not None for f in fields.values())
    plain = all(name.isidentifier() and not iskeyword(name) for name in fields)
    if cls.__pydantic_post_init__ or aliased or cls.__pydantic_root_model__ or not plain:
        return _GENERIC  # (a field name that is no Python identifier cannot be a parameter)
    return tuple(fields), frozenset(fields)


def _built(cls: type[F], values: dict[str, Any], names: frozenset[str]) -> F:
    """A ``cls`` of ``values`` (every field, in order: the caller's own dict, kept as the
    model's ``__dict__``), as ``model_construct`` builds it, without validation."""
    model = _new(cls)
    _set(model, "__dict__", values)
    _set_fields_set(model, set(names))  # every field was set; each model owns its set
    _set_extra(model, None)
    _set_private(model, None)
    return model


def _trusted_builder(cls: type[Frozen]) -> Any:
    """``cls.trusted``: with every field given (any order), the model ``model_construct``
    builds, built directly (:func:`_built`); else (a field left out, or an unknown name)
    ``model_construct`` itself, which fills defaults and drops unknown names as before."""
    order, names = _FIELDS[cls]
    if not order:
        return _GENERIC_TRUSTED
    params = ", ".join(f"{name}=_UNSET" for name in order)
    given = " or ".join(f"{name} is _UNSET" for name in order)
    values = ", ".join(f"{name!r}: {name}" for name in order)
    source = (  # its own names begin with "_", which no field's does (pydantic's rule)
        # closure cells, not globals (cheaper to read per call); ``set`` too (a field may be
        # named so)
        "def _make(_UNSET, _partial, _new, _set_dict, _set_fields_set, _set_extra,"
        " _set_private, _names, _set_of):\n"
        f"  def trusted(_cls, *, {params}, **_others):\n"
        f"    _values = {{{values}}}\n"
        f"    if {given} or _others:\n"
        "      return _partial(_cls, _values, _others)\n"
        "    _model = _new(_cls)\n"
        "    _set_dict(_model, _values)\n"
        "    _set_fields_set(_model, _set_of(_names))\n"
        "    _set_extra(_model, None)\n"
        "    _set_private(_model, None)\n"
        "    return _model\n"
        "  return trusted\n"
    )
    scope: dict[str, Any] = {}
    exec(source, scope)  # every field name is an identifier, no keyword (_field_order)
    built = scope["_make"](
        _UNSET, _partial, _new, _set_dict, _set_fields_set, _set_extra, _set_private, names, set
    )
    built._generated = True
    built.__qualname__ = f"{cls.__qualname__}.trusted"
    built.__doc__ = Frozen.trusted.__doc__
    return built


def _partial(cls: type[F], values: dict[str, Any], others: dict[str, Any]) -> F:
    """``model_construct`` of the fields a generated ``trusted`` was given (and any other
    names), as the call gave them."""
    given = {name: value for name, value in values.items() if value is not _UNSET}
    return cast(F, cls.model_construct(**given, **others))


def validated(cls: type[M], /, **data: Any) -> M:
    """Build ``cls`` or raise InvalidArgument naming the first field at fault."""
    return validated_from(cls, data)


def validated_from(cls: type[M], data: dict[str, Any]) -> M:
    """:func:`validated` from a dict the caller built (no copy through keyword arguments)."""
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or cls.__name__
        raise InvalidArgument(err["msg"], field=field) from None


def known_fields(
    cls: type[BaseModel], data: Mapping[str, Any]
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``data`` keeping only the keys ``cls`` has a field for, and the others' names, sorted:
    how a record stored by a newer version (a rolling upgrade) is read from the fields this one
    knows, the rest set aside rather than refused."""
    known = cls.model_fields
    kept = {k: v for k, v in data.items() if k in known}
    return kept, tuple(sorted(str(k) for k in data if k not in known))


class NodeRole(StrEnum):
    DECODE = "decode"
    PREFILL = "prefill"


class ZeroReason(StrEnum):
    """Why a lease offers nothing."""

    STARTING = "starting"
    TELEMETRY_MISSING = "telemetry_missing"
    TELEMETRY_STALE = "telemetry_stale"
    TELEMETRY_IMPLAUSIBLE = "telemetry_implausible"
    ITL_OVER_SLO = "itl_over_slo"
    CORDONED = "cordoned"
    DRAINING = "draining"
    SHUTTING_DOWN = "shutting_down"
    NO_CAPACITY = "no_capacity"


CREDIT_NAMES = ("compute_tokens", "kv_tokens", "kv_transfer_bytes", "output_tokens", "slots")


class Shares(NamedTuple):
    """The borrow share of each credit (0..1, CREDIT_NAMES order): the part of a node's lease,
    credit by credit, that may be lent (``PolicySettings.shares``)."""

    compute: float
    kv: float
    kv_transfer: float
    output: float
    slots: float

    @classmethod
    def of(cls, share: Share) -> Shares:
        """``share`` per credit: a single float is the same share on every credit."""
        if isinstance(share, Shares):
            return share
        return cls(share, share, share, share, share)


Share = float | Shares
"""One borrow share for every credit, or one per credit."""


class Credits(Frozen):
    """The five credits of a lease, each in its own unit."""

    compute_tokens: Tokens = 0
    """Borrowed prefill the node can run within the borrow horizon, in uncached tokens at the
    lease's ``borrowed_prefill_rate_tps`` (seconds of borrowed prefill x that rate). A prompt
    debits its own cost in that unit (:func:`crossflow_ctl.domain.lending.compute_debit`) and
    keeps its node time, so open debits count at the latest lease's rate (:mod:`.safety`)."""
    kv_tokens: Tokens = 0
    """KV-cache token slots for borrowed requests (what each places on the node, see
    :func:`crossflow_ctl.domain.admission.debit_for`)."""
    kv_transfer_bytes: Annotated[int, Field(ge=0, le=MAX_BYTES)] = 0
    """Bytes of remote cached prefix the node can pull in."""
    output_tokens: Tokens = 0
    """Output tokens the node can still decode over the horizon."""
    slots: Annotated[int, Field(ge=0, le=MAX_SLOTS)] = 0
    """Borrowed prompts the node will run at once."""

    @classmethod
    def zero(cls) -> Credits:
        return cls()

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        return (
            self.compute_tokens,
            self.kv_tokens,
            self.kv_transfer_bytes,
            self.output_tokens,
            self.slots,
        )

    @classmethod
    def from_tuple(cls, values: tuple[int, ...] | list[int]) -> Credits:
        """Five amounts in CREDIT_NAMES order, each floored at zero (ValueError unless five)."""
        c1, c2, c3, c4, c5 = values
        compute, kv, transfer = max(0, int(c1)), max(0, int(c2)), max(0, int(c3))
        output, slots = max(0, int(c4)), max(0, int(c5))
        in_bounds = (
            compute <= MAX_TOKENS
            and kv <= MAX_TOKENS
            and transfer <= MAX_BYTES
            and output <= MAX_TOKENS
            and slots <= MAX_SLOTS
        )  # within every field's bounds: nothing left to validate (admission's hot path)
        build = cls.trusted if in_bounds else cls
        return build(
            compute_tokens=compute,
            kv_tokens=kv,
            kv_transfer_bytes=transfer,
            output_tokens=output,
            slots=slots,
        )

    def is_zero(self) -> bool:
        return not (
            self.compute_tokens
            or self.kv_tokens
            or self.kv_transfer_bytes
            or self.output_tokens
            or self.slots
        )

    @classmethod
    def saturated(cls, values: tuple[int, ...] | list[int]) -> Credits:
        """A total of many amounts (a node's open debits), each floored at zero and capped at
        its bound: the total can pass a bound (reading it raised a ValidationError), and capped
        it still leaves no room under any lease, whose credits keep within the same bounds."""
        bounds = (MAX_TOKENS, MAX_TOKENS, MAX_BYTES, MAX_TOKENS, MAX_SLOTS)
        return cls.from_tuple([min(int(v), top) for v, top in zip(values, bounds, strict=True)])

    def minus(self, other: Credits) -> Credits:
        """Credit by credit, floored at zero."""
        return Credits.from_tuple(
            [a - b for a, b in zip(self.as_tuple(), other.as_tuple(), strict=True)]
        )

    def plus(self, other: Credits) -> Credits:
        return Credits.from_tuple(
            [a + b for a, b in zip(self.as_tuple(), other.as_tuple(), strict=True)]
        )

    def scaled(self, share: Share) -> Credits:
        """Each credit times its ``share`` (0..1), rounded down."""
        return Credits.from_tuple(
            [int(v * s) for v, s in zip(self.as_tuple(), Shares.of(share), strict=True)]
        )


class Lease(Frozen):
    """A versioned, self-expiring offer from one decode node (DESIGN.md §2)."""

    node_id: NodeId
    epoch: Annotated[int, Field(ge=1, lt=2**63)]
    version: Annotated[int, Field(ge=1, lt=2**63)]
    ttl_ms: Annotated[int, Field(gt=0, le=MAX_TTL_MS)]
    credits: Credits = Credits()
    zero_reason: ZeroReason | None = None
    zero_detail: Annotated[str, Field(max_length=512)] = ""
    queue_wait_ms: Ms = 0.0
    """Wait of the queued borrowed work the broker's open debits do not cover; the broker adds
    its open debits' (``lending.queue_wait_ms``)."""
    borrowed_prefill_rate_tps: Tps = 0.0
    """Borrowed-prefill rate for a prompt over the agent's reference prefix (tokens/s)."""
    prefill_s_per_token: SPerToken = 0.0
    """``a``: node seconds per borrowed uncached token, at no attended context (0: unknown, every
    token costs ``1 / borrowed_prefill_rate_tps``)."""
    prefill_s_per_token_context: SPerTokenContext = 0.0
    """``b``: extra node seconds per borrowed uncached token per token of attended context. A
    prompt of U uncached tokens over a cached prefix X costs ``U * (a + b * (X + U/2))`` s."""
    itl_ms: Ms = 0.0
    itl_slo_ms: Ms = 0.0
    last_notice_seq: Annotated[int, Field(ge=0, lt=2**63)] = 0
    """Highest notice sequence the agent had seen when its telemetry snapshot was taken."""
    snapshot_unix_ms: Annotated[int, Field(ge=0)] = 0
    """Agent clock at snapshot time; informational, never used for expiry."""
    horizon_ms: Annotated[int, Field(ge=0, le=MAX_HORIZON_MS)] = 0
    """Borrow horizon the agent sized the credits over (0: not said, an agent older than the
    field); the broker caps the credits to its own horizon with it (``session.within_horizon``)."""

    @model_validator(mode="after")
    def _zero_lease_has_no_credit(self) -> Lease:
        if self.zero_reason is not None and not self.credits.is_zero():
            raise ValueError("a zero lease (zero_reason set) must carry zero credits")
        return self

    @property
    def is_zero(self) -> bool:
        return self.zero_reason is not None or self.credits.is_zero()

    def is_newer_than(self, epoch: int, version: int) -> bool:
        return (self.epoch, self.version) > (epoch, version)

    def prefill_service_s(self, uncached: int, cached: int) -> float:
        """Node seconds a borrowed prompt's prefill takes here (inf when the lease has no rate)."""
        if self.prefill_s_per_token > 0.0:
            a, b = self.prefill_s_per_token, self.prefill_s_per_token_context
            return prefill_seconds(uncached, cached, a, b)
        rate = self.borrowed_prefill_rate_tps
        return uncached / rate if rate > 0 else float("inf")


def prefill_seconds(uncached: int, cached: int, a_s: float, b_s: float) -> float:
    """Node seconds to prefill ``uncached`` tokens over a ``cached`` prefix at ``a_s`` seconds per
    token plus ``b_s`` per token of attended context: ``U * (a + b * (X + U/2))``. The one
    pricing of a prompt, shared by the debit (Safety) and the service time (Benefit)."""
    return uncached * (a_s + b_s * (cached + uncached / 2.0))


class StoredLease(Frozen):
    """A lease as the store holds it: with the broker-clock receipt time and expiry."""

    lease: Lease
    received_at_ms: int
    expires_at_ms: int
    """``received_at_ms + min(lease.ttl_ms, max_lease_ttl_ms)``, on the broker's clock."""

    def expired(self, now_ms: int) -> bool:
        return now_ms >= self.expires_at_ms

    def effective_credits(self, now_ms: int) -> Credits:
        """Zero once expired or for a zero lease (DESIGN.md §5.5)."""
        if self.expired(now_ms) or self.lease.zero_reason is not None:
            return Credits()
        return self.lease.credits


class PoolLoad(Frozen):
    """One prefill server's load, as its agent reports it."""

    pool: PoolName = "default"
    node_id: NodeId
    outstanding_uncached_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS * 100)]
    processing_rate_tps: Tps
    """Uncached prompt tokens processed per second, recently."""
    prefill_rate_tps: Tps = 0.0
    """Prefill rate one request sees on this server (0 when unknown)."""
    ttl_ms: Annotated[int, Field(gt=0, le=MAX_TTL_MS)]
    queued_requests: Annotated[int, Field(ge=0, le=10_000_000)] = 0
    queue_wait_ms: Ms | None = None
    """Time this server needs to clear the prompts it holds, running and queued, counting each
    one's cached-prefix (context) cost as well as its uncached tokens: how long a prompt sent to
    it now waits before its own prefill starts, as of the report. None: the agent cannot tell
    (the broker then reads the pool's wait from tokens and rates alone)."""


class StoredPoolLoad(Frozen):
    load: PoolLoad
    received_at_ms: int
    expires_at_ms: int
    seq: Annotated[int, Field(ge=0, lt=2**63)] = 0
    """The store's ingest sequence of the report: each report stored for a pool gets a higher
    one than every report stored for that pool before it, whichever replica stored it (0: a
    report stored before sequences existed, older than any that has one)."""


class PoolSnapshot(Frozen):
    """The live (unexpired) reports of one prefill pool, aggregated."""

    pool: str
    reports: tuple[PoolLoad, ...] = ()
    report_seqs: tuple[int, ...] = ()
    """The store's ingest sequence of each report (``StoredPoolLoad.seq``), in the order of
    ``reports``; () when unknown. Every replica reads the same sequences, unlike receipt times
    (each on the clock of the replica that took the report): a prompt sent after a replica saw a
    report's sequence is not in that report (:mod:`crossflow_ctl.domain.pending`)."""

    @classmethod
    def of_stored(cls, pool: str, live: Sequence[StoredPoolLoad]) -> PoolSnapshot:
        """The snapshot of ``live`` (stored, unexpired reports): each load with its sequence."""
        return cls.trusted(
            pool=pool,
            reports=tuple(s.load for s in live),
            report_seqs=tuple(s.seq for s in live),
        )

    @property
    def outstanding_uncached_tokens(self) -> int:
        return sum(r.outstanding_uncached_tokens for r in self.reports)

    @property
    def processing_rate_tps(self) -> float:
        return sum(r.processing_rate_tps for r in self.reports)

    @property
    def prefill_rate_tps(self) -> float:
        """Per-request prefill rate: the mean over servers that know it."""
        known = [r.prefill_rate_tps for r in self.reports if r.prefill_rate_tps > 0]
        return sum(known) / len(known) if known else 0.0

    @property
    def no_rate(self) -> bool:
        """Work is outstanding but no server reports a processing rate: the wait is unbounded
        (Demand holds); displays say "no rate" rather than a sentinel number of ms. Never when
        every server reports its wait in time: that wait needs no rate."""
        return (
            bool(self.reports)
            and self.server_waits_ms() is None
            and self.outstanding_uncached_tokens > 0
            and (self.processing_rate_tps <= 0)
        )

    def server_waits_ms(self, sent_to: Mapping[str, int] | None = None) -> dict[str, float] | None:
        """Each server's own wait in time (``PoolLoad.queue_wait_ms``) by node id, when every
        live report carries one; None otherwise (one figure in tokens and one in time cannot be
        compared, so a pool that is part way through an upgrade is read in tokens alone).
        ``sent_to``: uncached tokens sent to each server that its report does not show yet,
        added at its own rate (when it reports one)."""
        waits: dict[str, float] = {}
        for r in self.reports:
            if r.queue_wait_ms is None:
                return None
            wait = r.queue_wait_ms
            sent = sent_to.get(r.node_id, 0) if sent_to else 0
            if sent > 0 and r.processing_rate_tps > 0:
                wait += sent / r.processing_rate_tps * 1000.0
            waits[r.node_id] = wait
        return waits or None

    def estimated_wait_ms(
        self,
        pending_tokens: int = 0,
        prefill_node_id: str | None = None,
        sent_to: Mapping[str, int] | None = None,
    ) -> float | None:
        """The wait of a prompt sent to the pool now; None when nothing reports.

        When every server reports its wait in time (:meth:`server_waits_ms`), it is that of
        ``prefill_node_id`` (the server the router would send the prompt to), or, with none
        named, that of the least-loaded server (where a least-loaded router sends it); a named
        server without a live report gives None (its wait is unknown: Demand fails). Otherwise
        it is the pool's outstanding uncached tokens over its recent rate.

        ``pending_tokens``: uncached tokens sent to the pool since its reports were taken, which
        they do not show yet; they count only at a known rate, spread over the pool (at its
        total rate). Without one (a pool that has not processed anything lately reports none)
        they say nothing about time: an idle pool's first prompts must not read as an unbounded
        wait. ``sent_to``: with waits in time, tokens sent to each named server that its own
        report does not show yet, added to that server's wait at its own rate (a server's
        wait then never reads below what was sent to it since)."""
        if not self.reports:
            return None
        rate = self.processing_rate_tps
        waits = self.server_waits_ms(sent_to)
        if prefill_node_id is not None and not any(
            r.node_id == prefill_node_id for r in self.reports
        ):
            return None
        if waits is not None:
            wait = waits[prefill_node_id] if prefill_node_id is not None else min(waits.values())
            if rate > 0:
                wait += pending_tokens / rate * 1000.0
            return min(MAX_MS, wait)
        outstanding = self.outstanding_uncached_tokens
        if rate > 0:
            outstanding += pending_tokens
        if outstanding == 0:
            return 0.0
        if rate <= 0:
            return MAX_MS
        return min(MAX_MS, outstanding / rate * 1000.0)


class ReservationState(StrEnum):
    HELD = "held"
    COMMITTED = "committed"
    RELEASED = "released"
    """Released by the router; still counted until a causally later lease arrives (§5.4)."""


class Reservation(Frozen):
    reservation_id: str
    node_id: NodeId
    state: ReservationState
    debit: Credits
    compute_us: Annotated[int, Field(ge=0, le=MAX_COMPUTE_US)] = 0
    """Node time of borrowed prefill its compute debit stands for, in whole microseconds, priced
    at grant with the same lease coefficients as its tokens (0: untimed, granted against a lease
    without a rate, counted in its tokens). Safety counts open debits in the unit of the NEWEST
    lease from it (:mod:`crossflow_ctl.domain.safety`)."""
    lease_epoch: int
    lease_version: int
    created_at_ms: int
    expires_at_ms: int
    grant_seq: int
    release_seq: int = 0
    request_id: str = ""
    owner: str = ""
    """Identity of the router it was granted to (``router/<name>``); "" without authentication.
    Only that router (or an admin) may commit or release it."""

    @property
    def compute_time(self) -> ComputeTime:
        """The node time behind its compute debit (none when untimed)."""
        return ComputeTime.of_debit(self.debit.compute_tokens, self.compute_us)


class NoticeKind(StrEnum):
    GRANT = "grant"
    COMMIT = "commit"
    RELEASE = "release"
    EXPIRE = "expire"
    CORDON = "cordon"
    UNCORDON = "uncordon"


class Notice(Frozen):
    """A per-node event the broker relays to the node's agent, with a per-node sequence."""

    node_id: NodeId
    seq: int
    kind: NoticeKind
    reservation_id: str = ""
    debit: Credits = Credits()
    at_ms: int = 0
    pulled_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS)] | None = None
    """GRANT only: the prefix tokens the grant pulls in from elsewhere, the debit's
    ``kv_transfer_bytes`` in the unit it was priced in (None: not told, a broker before it)."""


class NoticeRow(NamedTuple):
    """One notice as an agent stream relays it: :class:`Notice`'s values without the model (the
    relay runs for every grant and expiry, so a store may read its entries straight into rows,
    checking what the model would: ``redis_codec.notice_rows``), encoded by the transport
    (``wire.convert.notice_rows_to_proto``)."""

    seq: int
    kind: NoticeKind
    reservation_id: str
    debit: tuple[int, int, int, int, int] | None
    """The debit's amounts (``Credits.as_tuple``: validated as a Notice's debit is); None: none
    stored (the message still carries an empty one, as a zero debit)."""
    at_ms: int
    pulled_tokens: int | None

    @classmethod
    def of(cls, notice: Notice) -> NoticeRow:
        return cls(
            notice.seq,
            notice.kind,
            notice.reservation_id,
            notice.debit.as_tuple(),
            notice.at_ms,
            notice.pulled_tokens,
        )


def check_epoch(epoch: int, now_ms: int, field: str = "lease.epoch") -> None:
    """InvalidArgument when ``epoch`` is more than MAX_EPOCH_LEAD_MS ahead of ``now_ms``."""
    if epoch > now_ms + MAX_EPOCH_LEAD_MS:
        raise InvalidArgument(
            f"epoch {epoch} is more than {MAX_EPOCH_LEAD_MS} ms ahead of the broker clock "
            f"({now_ms}); an epoch is the agent's start time in unix ms",
            field=field,
        )


class NodeInfo(Frozen):
    """What the store knows of a node besides its lease.

    Its identity (``role``, ``pool``) is fixed once registered: a Hello that names another role
    or pool is refused unless the node is cordoned (the operator's way to move a server between
    roles: cordon, drain, restart its agent with the new role, uncordon)."""

    node_id: NodeId
    role: NodeRole = NodeRole.DECODE
    pool: PoolName = "default"
    cordoned: bool = False
    cordon_reason: str = ""
    labels: dict[str, str] = Field(default_factory=dict)
    """At most MAX_LABELS; keys match LABEL_KEY_PATTERN (at most MAX_LABEL_KEY_LEN characters),
    values at most MAX_LABEL_VALUE_LEN characters."""
    notice_seq: int = 0
    registered_at_ms: Annotated[int, Field(ge=0)] = 0
    """When the store first registered the node (its first agent Hello, kept across the agent's
    reconnects and restarts, reset only by deleting the node), on the store's clock; 0: not
    known (registered by a broker older than the field)."""

    @field_validator("labels")
    @classmethod
    def _labels_bounded(cls, labels: dict[str, str]) -> dict[str, str]:
        if len(labels) > MAX_LABELS:
            raise ValueError(f"at most {MAX_LABELS} labels, got {len(labels)}")
        for key, value in labels.items():
            if not 0 < len(key) <= MAX_LABEL_KEY_LEN or not _LABEL_KEY.match(key):
                raise ValueError(
                    f"label key {key[:40]!r} must match {LABEL_KEY_PATTERN} "
                    f"(at most {MAX_LABEL_KEY_LEN} characters)"
                )
            if len(value) > MAX_LABEL_VALUE_LEN:
                raise ValueError(
                    f"label {key!r}: value longer than {MAX_LABEL_VALUE_LEN} characters"
                )
        return labels


class ComputeTime(NamedTuple):
    """The node time behind a node's open compute debits (or one debit's): ``us`` microseconds
    of borrowed prefill, and ``tokens``, the compute tokens of the debits that carry it (timed
    debits, ``Reservation.compute_us > 0``); the other compute tokens are untimed."""

    us: int = 0
    tokens: int = 0

    def plus(self, other: ComputeTime) -> ComputeTime:
        return ComputeTime(self.us + other.us, self.tokens + other.tokens)

    def minus(self, other: ComputeTime) -> ComputeTime:
        return ComputeTime(self.us - other.us, self.tokens - other.tokens)

    @classmethod
    def of_debit(cls, compute_tokens: int, compute_us: int) -> ComputeTime:
        """One debit's: timed when it has node time, else nothing."""
        return cls(compute_us, compute_tokens) if compute_us > 0 else cls()

    def behind(self, compute_tokens: int) -> ComputeTime:
        """This time as the node time behind ``compute_tokens`` open compute tokens: itself
        when it can be (``us > 0`` and ``0 <= tokens <= compute_tokens``), else none (all
        untimed, the rule from before debits had node time). Totals an older broker rewrote
        without the time can leave it inconsistent (docs/upgrading.md); the Redis
        scripts apply the same rule (``cf_compute_at``)."""
        if self.us > 0 and 0 <= self.tokens <= compute_tokens:
            return self
        return ComputeTime()

    def tokens_at(self, compute_tokens: int, rate_tps: float) -> int:
        """``compute_tokens`` (of which this time's are the timed ones) in the unit of a lease
        whose borrowed-prefill rate is ``rate_tps``: the untimed tokens as they are, the timed
        ones as their node time at that rate, ``ceil(us x rate / 1e6)``; all as they are under
        a lease without a rate, or when this time cannot be behind them (:meth:`behind`). The
        one conversion (the Redis scripts do the same arithmetic on doubles, in the same
        order), used by :mod:`crossflow_ctl.domain.safety`."""
        if rate_tps <= 0.0 or self.behind(compute_tokens).us <= 0:
            return compute_tokens
        return compute_tokens - self.tokens + math.ceil(self.us * rate_tps / MICROS_PER_S)


class NodeState(Frozen):
    """One node as admission and the admin API see it: lease, open debits, cordon."""

    info: NodeInfo
    lease: StoredLease | None = None
    open_debits: Credits = Credits()
    open_reservations: int = 0
    open_compute: ComputeTime = ComputeTime()
    """The node time behind ``open_debits.compute_tokens``: Safety counts them in the unit of
    the node's latest lease from it (:mod:`crossflow_ctl.domain.safety`)."""

    def available(self, now_ms: int, share: Share = 1.0) -> Credits:
        """Latest lease credit x its share, minus open debits in its unit (DESIGN.md §5.2)."""
        if self.lease is None or self.info.cordoned:
            return Credits()
        credits = self.lease.effective_credits(now_ms).scaled(share)
        if credits.is_zero():
            return credits
        rate = self.lease.lease.borrowed_prefill_rate_tps
        opened = self.open_debits
        compute = self.open_compute.tokens_at(opened.compute_tokens, rate)
        # ``credits.minus`` of the open debits with their compute in the lease's unit, on their
        # amounts (no model copied per node room).
        return Credits.from_tuple(
            (
                credits.compute_tokens - compute,
                credits.kv_tokens - opened.kv_tokens,
                credits.kv_transfer_bytes - opened.kv_transfer_bytes,
                credits.output_tokens - opened.output_tokens,
                credits.slots - opened.slots,
            )
        )
