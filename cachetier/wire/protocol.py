"""The cachetier wire protocol: its messages and their typed decoding.

Every frame (`framing`) holds one msgpack map. A request is `{"op", "id", **fields}`; its reply is
`{"id", "ok": true, "result"}` or `{"id", "ok": false, "error": {"code", "message", "retryable"}}`,
with id None when the request was too broken to carry one. A connection opens with `hello`
(version, token, role: the token is a credential, `cachetier.credentials`, whose role decides
which ops the connection may send, `cachetier.service.access`). A scheduler then sends `plan`,
`commit`, `confirm`, `release`, `stats`, `health` (an admin also `invalidate`); an agent sends
`register` once and from then on *receives* `copy` requests on the same
connection and answers them.

Messages are dataclasses decoded by their type hints (`from_wire`), so a field of the wrong type is
named with its path and never reaches the index, and unknown fields are refused rather than
ignored. The index's own records (`StepRequest`, `StepPlan`, ...) travel as they are: a scheduler
holds exactly what a direct caller of `PrefixIndex` would.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Mapping

from cachetier.config import CacheSpec, ModelSpec
from cachetier.errors import BadFrame, BadMessage, ErrorInfo, RemoteError, UnknownOp
from index.prefix import PinnedPrefix, PrefixProbe
from index.records import (CommitItem, CommitResult, ReleaseResult, StepPlan, StepRefusal,
                           StepRequest)

PROTOCOL_VERSION = 1
MAX_ID = 2**63 - 1

Role = Literal["client", "agent"]


@dataclass(frozen=True)
class Welcome:
    version: int
    server_id: str


@dataclass(frozen=True)
class Hello:
    """`session`: a scheduler's own random id, the same on every connection it opens, so the
    requests it planned stay its own across reconnections (`cachetier.service.ownership`)."""

    op: ClassVar[str] = "hello"
    reply: ClassVar[Any] = Welcome
    version: int
    token: str
    role: Role = "client"
    session: str = field(default="", repr=False)


@dataclass(frozen=True)
class AgentIdentity:
    """Who holds one tensor-parallel rank's share of a pool; `agent_id` names one process life."""

    pool: str
    rank: int
    agent_id: str


@dataclass(frozen=True)
class Registered:
    """The pool's epoch now, and the geometry the agent must build its pool with."""

    epoch: int
    model: ModelSpec
    cache: CacheSpec
    writes: int = 0  # the pool's write count (`index.identity`), for the agent's view
    peer_token: str = ""  # what agents pull each other's pages with (`cachetier.credentials`)


@dataclass(frozen=True)
class Register:
    """`epoch` is None from an agent whose pool bytes are new: the pool's metadata then describes
    bytes that no longer exist, so the service starts a new epoch."""

    op: ClassVar[str] = "register"
    reply: ClassVar[Any] = Registered
    pool: str
    rank: int
    tp_degree: int
    agent_id: str
    epoch: int | None = None
    data_url: str = ""  # where the agent serves its pages to peers (`gpu_pool.transfer`)
    writes: int = 0  # the highest write count of the pool the agent was told (`index.identity`)

    @property
    def identity(self) -> AgentIdentity:
        return AgentIdentity(self.pool, self.rank, self.agent_id)


@dataclass(frozen=True)
class CopyBatch:
    """One step's copies for one rank: `(src_page, dst_page, byte_offset, byte_count)` rows,
    run by the agent as a single `page_copy` launch over every layer slot, after it handed the
    pages the step's requests write (`claims`) to the step (`stamp`: `gpu_pool.claims`)."""

    op: ClassVar[str] = "copy"
    reply: ClassVar[Any] = None
    epoch: int
    copies: list[tuple[int, int, int, int]]
    writes: int = 0  # the pool's write count when the step was planned (`index.identity`)
    claims: list[int] = field(default_factory=list)
    stamp: int = 0


@dataclass(frozen=True)
class Fence:
    """Refuse every copy and write of an epoch before `epoch` from now on, and acknowledge once
    those under way have finished (`gpu_pool.fence`); the reply is the agent's fence epoch."""

    op: ClassVar[str] = "fence"
    reply: ClassVar[Any] = int
    epoch: int


@dataclass(frozen=True)
class Fetch:
    """Pull pages of another pool into this rank's pages: `sources[r]` is the page server of the
    source pool's rank r, `src_model`/`src_cache` its geometry (the TP degree may differ), each
    move `(src_page, dst_page, kind, nbytes)` with kind "kda" or "mla" and nbytes a
    full-attention page's filled prefix in the source's token rows (0: whole page; a GQA rank's
    row depends on the TP degree). Acked with the bytes received once every byte is in place."""

    op: ClassVar[str] = "fetch"
    reply: ClassVar[Any] = int
    epoch: int
    sources: list[str]
    src_model: ModelSpec
    src_cache: CacheSpec
    moves: list[tuple[int, int, str, int]]


@dataclass(frozen=True)
class PlanReply:
    """Exactly one of the two is set."""

    plan: StepPlan | None = None
    refusal: StepRefusal | None = None

    @property
    def outcome(self) -> StepPlan | StepRefusal:
        outcome = self.plan or self.refusal
        if outcome is None:
            raise BadMessage("a plan reply carries neither a plan nor a refusal")
        return outcome


@dataclass(frozen=True)
class Plan:
    op: ClassVar[str] = "plan"
    reply: ClassVar[Any] = PlanReply
    pool: str
    requests: list[StepRequest]


@dataclass(frozen=True)
class Commit:
    op: ClassVar[str] = "commit"
    reply: ClassVar[Any] = CommitResult
    pool: str
    items: list[CommitItem]


@dataclass(frozen=True)
class Confirm:
    op: ClassVar[str] = "confirm"
    reply: ClassVar[Any] = int
    pool: str
    ticket: int


@dataclass(frozen=True)
class Release:
    op: ClassVar[str] = "release"
    reply: ClassVar[Any] = ReleaseResult
    pool: str
    rids: list[str]


@dataclass(frozen=True)
class RouteReply:
    """Each pool's probe, the longest usable prefix first."""

    probes: list[PrefixProbe]


@dataclass(frozen=True)
class Route:
    """Which of `pools` holds the longest usable prefix of a prompt (read-only, for routing)."""

    op: ClassVar[str] = "route"
    reply: ClassVar[Any] = RouteReply
    pools: list[str]
    prompt_tokens: int
    hashes: bytes


@dataclass(frozen=True)
class Pin:
    """Pin the longest usable prefix of a prompt in `pool` under `reader`, until
    `Release(pool, [reader])`: a reader outside the tier (an engine's KV connector) copies those
    pages itself, and nothing evicts or rewrites them meanwhile. A hit of 0 pins nothing."""

    op: ClassVar[str] = "pin"
    reply: ClassVar[Any] = PinnedPrefix
    pool: str
    reader: str
    prompt_tokens: int
    hashes: bytes


@dataclass(frozen=True)
class HandoffReply:
    hit_tokens: int
    moved_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Handoff:
    """Copy the longest usable prefix of a prompt cached in `src_pool` into `dst_pool`
    (`cachetier.service.handoff`); answered once the destination's index holds it."""

    op: ClassVar[str] = "handoff"
    reply: ClassVar[Any] = HandoffReply
    src_pool: str
    dst_pool: str
    prompt_tokens: int
    hashes: bytes


@dataclass(frozen=True)
class PoolStats:
    """Counters of one pool; `ranks` are the ranks registered on the answering replica."""

    pool: str
    epoch: int
    num_pages: int
    free_pages: int
    evictable_pages: int
    requests: int
    pending_tickets: int
    ranks: list[int]
    checkpoints: int = 0  # registered in every KDA group (one record each)
    durable_checkpoints: int = 0  # kept at turn ends, branch points, ladder rungs


@dataclass(frozen=True)
class Stats:
    op: ClassVar[str] = "stats"
    reply: ClassVar[Any] = PoolStats
    pool: str


@dataclass(frozen=True)
class Invalidate:
    """Start the pool over in a new epoch (an admin's op); the reply is the new epoch."""

    op: ClassVar[str] = "invalidate"
    reply: ClassVar[Any] = int
    pool: str


@dataclass(frozen=True)
class HealthReport:
    server_id: str
    version: int
    redis: bool
    pools: dict[str, list[int]] = field(default_factory=dict)
    recovering: list[str] = field(default_factory=list)  # pools being started over (storage)


@dataclass(frozen=True)
class Health:
    op: ClassVar[str] = "health"
    reply: ClassVar[Any] = HealthReport


def op_table(*messages: type) -> dict[str, type]:
    return {m.op: m for m in messages}


CLIENT_OPS = op_table(Plan, Commit, Confirm, Release, Stats, Health, Route, Pin, Handoff,
                      Invalidate)
AGENT_OPS = op_table(CopyBatch, Fence, Fetch)


@dataclass(frozen=True)
class Reply:
    id: int | None
    ok: bool
    result: Any = None
    error: ErrorInfo | None = None


def request_frame(request_id: int, message: Any) -> dict[str, Any]:
    return {"op": message.op, "id": request_id, **to_wire(message)}


def ok_frame(request_id: int | None, result: Any) -> dict[str, Any]:
    """`to_wire(Reply(request_id, True, result))`, without walking the converted result twice."""
    return {"id": request_id, "ok": True, "result": to_wire(result), "error": None}


def error_frame(request_id: int | None, info: ErrorInfo) -> dict[str, Any]:
    return to_wire(Reply(request_id, False, error=info))


def request_id(frame: Any) -> int | None:
    """The id to echo in a reply, or None when the frame has no usable one."""
    rid = frame.get("id") if isinstance(frame, dict) else None
    return rid if _is_int(rid) and 0 <= rid <= MAX_ID else None


def parse_request(frame: Any, ops: Mapping[str, type]) -> Any:
    """The typed message of a request frame; `BadFrame`, `BadMessage` or `UnknownOp` otherwise."""
    if not isinstance(frame, dict):
        raise BadFrame(f"a frame must be a msgpack map, got {type(frame).__name__}")
    if request_id(frame) is None:
        raise BadMessage(f"a request needs an integer 'id' in 0..{MAX_ID}")
    fields = {k: v for k, v in frame.items() if k not in ("op", "id")}
    op = frame.get("op")
    if not isinstance(op, str):
        raise BadMessage("a request needs an 'op' string")
    if op not in ops:
        raise UnknownOp(f"unknown op {op[:64]!r}; expected one of {sorted(ops)}")
    return from_wire(ops[op], fields, op)


def parse_reply(frame: Any) -> Reply:
    return from_wire(Reply, frame, "reply")


def result_of(message: Any, reply: Reply) -> Any:
    """The typed result of `message`'s reply, or the peer's error raised as `RemoteError`."""
    if not reply.ok:
        raise RemoteError(reply.error or ErrorInfo("internal", "error reply without a body", False))
    return from_wire(message.reply, reply.result, f"{message.op} reply")


_SCALARS = frozenset({int, float, str, bytes, bool, type(None)})


def to_wire(value: Any) -> Any:
    """Dataclasses as maps of their fields, recursively; everything else as msgpack takes it.
    A scalar inside a record or a list is taken as it is, without a call: a plan's page tables
    are lists of ints, and a call per id was most of the encoding."""
    kind = type(value)
    if kind in _SCALARS:
        return value
    names = _field_names(kind)
    if names is not None:
        out = {}
        for name in names:
            field = getattr(value, name)
            out[name] = field if type(field) in _SCALARS else to_wire(field)
        return out
    if isinstance(value, (list, tuple)):
        return [v if type(v) in _SCALARS else to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    return value


@functools.cache
def _field_names(kind: type) -> tuple[str, ...] | None:
    """The fields of a dataclass type (a class object's own type is never one), else None."""
    if not dataclasses.is_dataclass(kind):
        return None
    return tuple(f.name for f in dataclasses.fields(kind))


def from_wire(tp: Any, value: Any, path: str) -> Any:
    """`value` checked against the type hint `tp` and built into it; `BadMessage` names the path
    of the first field that does not fit.

    A compiled decoder (`_decoder`) handles values that fit without building any path; anything
    it does not accept is decoded again by the checking walk below, which raises the error with
    its path (or returns the same value, for the rare input the decoder leaves to it)."""
    try:
        decode = _decoder(tp)
    except TypeError:  # an unhashable hint: only the walk handles it
        return _checked(tp, value, path)
    try:
        return decode(value)
    except _Mismatch:
        return _checked(tp, value, path)


def _checked(tp: Any, value: Any, path: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return _dataclass(tp, value, path)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _union(typing.get_args(tp), value, path)
    if origin is not None:
        return _generic(origin, typing.get_args(tp), value, path)
    return _scalar(tp, value, path)


def _dataclass(cls: type, value: Any, path: str) -> Any:
    if not isinstance(value, dict):
        raise BadMessage(f"{path}: expected a map, got {type(value).__name__}")
    hints = _hints(cls)
    unknown = [k for k in value if k not in hints]
    if unknown:
        raise BadMessage(f"{path}: unknown field {str(unknown[0])[:64]!r}")
    missing = [name for name in _required(cls) if name not in value]
    if missing:
        raise BadMessage(f"{path}: missing field {missing[0]!r}")
    kwargs = {k: _checked(hints[k], v, f"{path}.{k}") for k, v in value.items()}
    try:
        return cls(**kwargs)
    except ValueError as exc:  # the record's own validation (e.g. ModelSpec)
        raise BadMessage(f"{path}: {exc}") from None


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in typing.get_type_hints(cls).items() if k in names}


@functools.cache
def _required(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls)
                 if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)


def _union(arms: tuple[Any, ...], value: Any, path: str) -> Any:
    if value is None and type(None) in arms:
        return None
    (arm,) = [a for a in arms if a is not type(None)]  # only `X | None` is used on the wire
    return _checked(arm, value, path)


def _generic(origin: Any, args: tuple[Any, ...], value: Any, path: str) -> Any:
    if origin is Literal:
        if value not in args or isinstance(value, bool):
            raise BadMessage(f"{path}: expected one of {list(args)}, got {_shown(value)}")
        return value
    if origin is list and isinstance(value, list):
        return [_checked(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is tuple and isinstance(value, list) and len(value) == len(args):
        pairs = enumerate(zip(args, value, strict=True))
        return tuple(_checked(a, v, f"{path}[{i}]") for i, (a, v) in pairs)
    if origin is dict and isinstance(value, dict):
        return {_checked(args[0], k, f"{path} key"): _checked(args[1], v, f"{path}[{k!r}]")
                for k, v in value.items()}
    raise BadMessage(f"{path}: expected {_type_name(origin, args)}, got {_shown(value)}")


def _scalar(tp: Any, value: Any, path: str) -> Any:
    if tp is Any:
        return value
    if tp is None or tp is type(None):
        ok = value is None
    elif tp is int:
        ok = _is_int(value)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, tp)
    if not ok:
        raise BadMessage(f"{path}: expected {getattr(tp, '__name__', tp)}, got {_shown(value)}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _type_name(origin: Any, args: tuple[Any, ...]) -> str:
    if origin is tuple:
        return f"a list of {len(args)} items"
    return getattr(origin, "__name__", str(origin))


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


# Compiled decoders: one closure per type hint, no paths; `_Mismatch` hands the value back to
# the checking walk. Each accepts exactly what `_checked` accepts, or less, never more.

class _Mismatch(Exception):
    pass


Decode = Callable[[Any], Any]


@functools.cache
def _decoder(tp: Any) -> Decode:
    if dataclasses.is_dataclass(tp):
        return _dataclass_decoder(tp)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _union_decoder(typing.get_args(tp))
    if origin is not None:
        return _generic_decoder(origin, typing.get_args(tp))
    return _scalar_decoder(tp)


# Scalars checked by their exact type, not by one decoder call each (a plan's page ids, a
# record's ints): msgpack makes exactly these types, and a subclass (which `_checked` takes) goes
# to the walk. In a record a bool field takes a bool only, as the walk's isinstance does.
_EXACT_ITEMS = frozenset({int, str, bytes})
_EXACT_FIELDS = _EXACT_ITEMS | {bool}


def _dataclass_decoder(cls: type) -> Decode:
    hints = _hints(cls)
    required = frozenset(_required(cls))
    fields: dict[str, Decode] = {}
    exact = {name: hint for name, hint in hints.items() if hint in _EXACT_FIELDS}

    def decode(value: Any) -> Any:
        if not isinstance(value, dict):
            raise _Mismatch
        if not fields:  # built on first use, so a type may refer to itself
            fields.update({name: _decoder(hint) for name, hint in hints.items()})
        kwargs = {}
        for key, item in value.items():
            exact_type = exact.get(key)
            if exact_type is not None:
                if type(item) is not exact_type:
                    raise _Mismatch
                kwargs[key] = item
                continue
            field_decode = fields.get(key) if isinstance(key, str) else None
            if field_decode is None:
                raise _Mismatch
            kwargs[key] = field_decode(item)
        if not required <= kwargs.keys():
            raise _Mismatch
        try:
            return cls(**kwargs)
        except ValueError:
            raise _Mismatch from None

    return decode


def _union_decoder(arms: tuple[Any, ...]) -> Decode:
    optional = type(None) in arms
    others = [a for a in arms if a is not type(None)]
    if len(others) != 1:
        def refuse(value: Any) -> Any:
            raise _Mismatch
        return refuse
    inner = _decoder(others[0])

    def decode(value: Any) -> Any:
        if value is None and optional:
            return None
        return inner(value)

    return decode


def _generic_decoder(origin: Any, args: tuple[Any, ...]) -> Decode:
    if origin is Literal:
        def literal(value: Any) -> Any:
            if isinstance(value, bool) or value not in args:
                raise _Mismatch
            return value
        return literal
    if origin is list and args[0] in _EXACT_ITEMS:
        exact = args[0]

        def decode_scalars(value: Any) -> Any:
            if not isinstance(value, list):
                raise _Mismatch
            for v in value:
                if type(v) is not exact:  # a bool is no int here, as `_is_int` says
                    raise _Mismatch
            return list(value)
        return decode_scalars
    if origin is list:
        item = _decoder(args[0])

        def decode_list(value: Any) -> Any:
            if not isinstance(value, list):
                raise _Mismatch
            return [item(v) for v in value]
        return decode_list
    if origin is tuple:
        items = tuple(_decoder(a) for a in args)
        width = len(args)

        def decode_tuple(value: Any) -> Any:
            if not isinstance(value, list) or len(value) != width:
                raise _Mismatch
            return tuple(d(v) for d, v in zip(items, value))
        return decode_tuple
    if origin is dict:
        key, val = _decoder(args[0]), _decoder(args[1])

        def decode_dict(value: Any) -> Any:
            if not isinstance(value, dict):
                raise _Mismatch
            return {key(k): val(v) for k, v in value.items()}
        return decode_dict

    def refuse(value: Any) -> Any:
        raise _Mismatch
    return refuse


def _scalar_decoder(tp: Any) -> Decode:
    if tp is Any:
        return lambda value: value
    if tp is None or tp is type(None):
        test: Callable[[Any], bool] = lambda value: value is None
    elif tp is int:
        test = _is_int
    elif tp is float:
        test = lambda value: isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        test = lambda value: isinstance(value, tp)

    def decode(value: Any) -> Any:
        if not test(value):
            raise _Mismatch
        return value

    return decode
