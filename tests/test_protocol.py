"""The wire protocol without a service: frames, typed decoding, envelopes, endpoints."""

from __future__ import annotations

import asyncio
import random
import re
from typing import Any

import msgpack
import pytest

from cachetier.config import PRESETS
from cachetier.errors import (BadFrame, BadMessage, BrokenStream, ErrorCode, ErrorInfo, PeerClosed,
                              RemoteError, TooLarge, UnknownOp)
from cachetier.wire.chunked import ChunkedDecoder
from cachetier.wire.framing import (HEADER, INLINE_BYTES, Endpoint, FrameBound, FramedStream,
                                    encode_frame)
from cachetier.wire.protocol import (CLIENT_OPS, Commit, CopyBatch, Plan, PlanReply, Registered,
                                     Reply, error_frame, from_wire, ok_frame, parse_reply,
                                     parse_request, request_frame, request_id, result_of, to_wire)
from index.records import (CommitItem, PageCopy, Removal, RequestPlan, StepPlan, StepRefusal,
                           StepRequest)

PLAN = StepPlan(ticket=7, epoch=3, evicted=1, removed=[Removal("ck", b"\x01" * 16)], requests=[
    RequestPlan("a", 32, 32, 40, [[1, 2, 5]], [6, 7, 8], [], 0,
                [PageCopy(9, 6, 0, 4096), PageCopy(2, 5, 0, 2048)])])


def stream_of(data: bytes, max_frame: int = 1024) -> FramedStream:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return FramedStream(reader, writer=None, max_frame=max_frame)  # type: ignore[arg-type]


async def test_frames_round_trip_and_end_cleanly():
    data = encode_frame({"a": 1}) + encode_frame([b"\x00", "x"])
    stream = stream_of(data)
    assert await stream.read() == {"a": 1}
    assert await stream.read() == [b"\x00", "x"]
    with pytest.raises(PeerClosed):
        await stream.read()


async def test_a_nil_body_is_a_frame_not_the_end():
    stream = stream_of(encode_frame(None) + encode_frame(1))
    assert await stream.read() is None and await stream.read() == 1


@pytest.mark.parametrize("data", [
    HEADER.pack(0),                                       # an empty frame cannot be a message
    HEADER.pack(1025) + b"x" * 1025,                      # over max_frame: refused before reading
    HEADER.pack(10) + b"short",                           # the peer stopped inside the body
    b"\x00\x00",                                          # ... or inside the header
], ids=["empty", "oversized", "truncated body", "truncated header"])
async def test_a_bad_length_breaks_the_stream(data):
    with pytest.raises(BrokenStream):
        await stream_of(data).read()


async def test_a_body_that_is_not_msgpack_costs_only_that_frame():
    stream = stream_of(HEADER.pack(2) + b"\xc1\xc1" + encode_frame("next"))
    with pytest.raises(BadFrame):
        await stream.read()
    assert await stream.read() == "next"


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """Every msgpack type at sizes around its headers' widths (fix, 8, 16, 32 bits)."""
    sized = rng.choice([0, 1, 15, 16, 31, 32, 255, 256, 65535, 65536])
    makers = [lambda: None, lambda: rng.random() < 0.5, lambda: rng.randrange(-2**63, 2**64),
              lambda: rng.randrange(-40, 300), lambda: rng.random(), lambda: "s" * sized,
              lambda: b"b" * sized,
              lambda: msgpack.ExtType(5, b"x" * rng.choice([1, 2, 4, 8, 16, 3, sized])),
              lambda: [random_value(rng, depth + 1) for _ in range(rng.choice([0, 1, 15, 16, 17]))],
              lambda: {f"k{i}": random_value(rng, depth + 1)
                       for i in range(rng.choice([0, 1, 15, 16, 17]))}]
    return rng.choice(makers[:8] if depth > 2 else makers)()


def objects_in(value: Any) -> int:
    if isinstance(value, list):
        return 1 + sum(map(objects_in, value))
    if isinstance(value, dict):
        return 1 + sum(1 + objects_in(v) for v in value.values())
    return 1


def test_a_body_decoded_chunk_by_chunk_is_the_body_decoded_at_once():
    rng = random.Random(7)
    for case in range(300):
        value = random_value(rng)
        body = msgpack.packb(value, use_bin_type=True)
        decoder = ChunkedDecoder(len(body), objects_in(value))  # exactly as many objects
        start = 0
        while start < len(body):  # cut anywhere: inside headers, strings, numbers
            step = rng.choice([1, 2, 3, 7, 64, 1000, 65536])
            decoder.feed(body[start:start + step])
            start += step
        assert decoder.value() == msgpack.unpackb(body), case
        over = ChunkedDecoder(len(body), objects_in(value) - 1)
        over.feed(body)
        with pytest.raises(BadFrame, match="more than"):
            over.value()


@pytest.mark.parametrize("body", [
    msgpack.packb([None] * 20_000),                                   # more objects than bound
    msgpack.packb([b"x" * INLINE_BYTES]) + b"\xc0",                   # bytes after the message
    msgpack.packb([b"x" * INLINE_BYTES, 1])[:-1] + b"\xc1",           # a byte msgpack never uses
    b"\x92" + msgpack.packb(b"x" * INLINE_BYTES),                     # ends inside its message
    b"\x91\x81\x01" + msgpack.packb(b"x" * INLINE_BYTES),             # a key msgpack refuses
], ids=["objects", "trailing", "invalid byte", "truncated", "int key"])
async def test_a_large_body_that_is_no_message_costs_only_that_frame(body):
    data = HEADER.pack(len(body)) + body + encode_frame("next")
    stream = stream_of(data, max_frame=1 << 20)
    stream.bound = FrameBound(1 << 20, 100)
    with pytest.raises(BadFrame):
        await stream.read()
    assert await stream.read() == "next"


def test_encoding_refuses_a_frame_over_the_limit():
    with pytest.raises(TooLarge):
        encode_frame(b"x" * 100, max_frame=64)


def test_step_plan_survives_the_wire():
    wire = msgpack.unpackb(msgpack.packb(ok_frame(5, PlanReply(plan=PLAN)), use_bin_type=True))
    reply = parse_reply(wire)
    assert reply.id == 5 and result_of(Plan("p", []), reply).outcome == PLAN


def test_refusal_and_nested_records_decode_to_their_types():
    refusal = StepRefusal("full", 10, 3)
    assert from_wire(PlanReply, to_wire(PlanReply(refusal=refusal)), "r").outcome == refusal
    registered = Registered(4, PRESETS["tiny"].model, PRESETS["tiny"].cache)
    assert from_wire(Registered, to_wire(registered), "r") == registered


def test_a_request_decodes_into_its_message():
    req = StepRequest("a", 16, 32, b"\x02" * 32, checkpoint=False)
    frame = request_frame(9, Plan("pool-0", [req]))
    assert request_id(frame) == 9
    assert parse_request(frame, CLIENT_OPS) == Plan("pool-0", [req])


GOOD_PLAN = {"op": "plan", "id": 1, "pool": "p", "requests": [
    {"rid": "a", "compute_tokens": 4, "prompt_tokens": 4, "hashes": b"h" * 16}]}


def mutated(path: list, value=None, drop=False) -> dict:
    frame = msgpack.unpackb(msgpack.packb(GOOD_PLAN))
    target = frame
    for key in path[:-1]:
        target = target[key]
    if drop:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return frame


@pytest.mark.parametrize("frame, error, where", [
    (mutated(["requests", 0, "compute_tokens"], "4"), BadMessage, "requests[0].compute_tokens"),
    (mutated(["requests", 0, "compute_tokens"], True), BadMessage, "compute_tokens: expected int"),
    (mutated(["requests", 0, "hashes"], "text"), BadMessage, "plan.requests[0].hashes"),
    (mutated(["requests", 0, "checkpoint"], 1), BadMessage, "expected bool"),
    (mutated(["requests"], {"rid": "a"}), BadMessage, "plan.requests: expected list"),
    (mutated(["requests", 0, "typo"], 1), BadMessage, "unknown field 'typo'"),
    (mutated(["pool"], drop=True), BadMessage, "missing field 'pool'"),
    (mutated(["op"], "plan!"), UnknownOp, "unknown op 'plan!'"),
    (mutated(["op"], "register"), UnknownOp, "unknown op"),   # an agent's op from a client
    (mutated(["op"], 3), BadMessage, "'op' string"),
    (mutated(["id"], -1), BadMessage, "'id'"),
    (mutated(["id"], 2**64 - 1), BadMessage, "'id'"),
    ([1, 2], BadFrame, "msgpack map"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_requests_name_the_field(frame, error, where):
    with pytest.raises(error, match=re.escape(where)):
        parse_request(frame, CLIENT_OPS)


@pytest.mark.parametrize("tp, items, where", [
    (list[int], [1, 2, True], "ids[2]: expected int"),      # a bool is no page id
    (list[int], [1, 2.0], "ids[1]: expected int"),
    (list[str], ["a", b"b"], "ids[1]: expected str"),
    (list[bytes], [b"h", "h"], "ids[1]: expected bytes"),
])
def test_lists_of_scalars_are_checked_item_by_item(tp, items, where):
    """The one-loop path for lists of ints, strs and bytes refuses what the walk refuses, and
    hands the walk what it cannot take, so the error names the item."""
    with pytest.raises(BadMessage, match=re.escape(where)):
        from_wire(tp, items, "ids")
    good = items[:-1]
    decoded = from_wire(tp, good, "ids")
    assert decoded == good and decoded is not good


def test_copy_rows_must_have_four_integers():
    frame = request_frame(1, CopyBatch(2, [(1, 2, 0, 64)]))
    frame["copies"] = [[1, 2, 0]]
    with pytest.raises(BadMessage, match=r"copies\[0\]: expected a list of 4 items"):
        parse_request(frame, {"copy": CopyBatch})


def test_a_model_spec_that_fails_its_own_checks_is_bad_input():
    wire = to_wire(Registered(1, PRESETS["tiny"].model, PRESETS["tiny"].cache))
    wire["model"]["tp_degree"] = 3
    with pytest.raises(BadMessage, match="tp_degree"):
        from_wire(Registered, wire, "registered")


def test_error_replies_raise_the_peers_error():
    info = ErrorInfo(ErrorCode.AGENT_LOST, "rank 0 gone", True)
    reply = parse_reply(error_frame(3, info))
    with pytest.raises(RemoteError) as err:
        result_of(Commit("p", [CommitItem("a", 4)]), reply)
    assert (err.value.code, err.value.retryable) == ("agent_lost", True)
    assert str(err.value) == "rank 0 gone"


def test_reply_envelope_is_strict():
    with pytest.raises(BadMessage):
        parse_reply({"id": 1, "ok": "yes"})
    assert parse_reply({"id": None, "ok": False, "error": None}) == Reply(None, False)


@pytest.mark.parametrize("url, endpoint", [
    ("tcp://127.0.0.1:7400", Endpoint("tcp", host="127.0.0.1", port=7400)),
    ("unix:///tmp/ct.sock", Endpoint("unix", path="/tmp/ct.sock")),
])
def test_endpoints_parse_and_print_back(url, endpoint):
    assert Endpoint.parse(url) == endpoint and endpoint.url == url


@pytest.mark.parametrize("url", ["tcp://127.0.0.1", "unix://relative/path", "http://x:1", "x"])
def test_bad_endpoints_are_refused(url):
    with pytest.raises(ValueError, match="expected tcp"):
        Endpoint.parse(url)
