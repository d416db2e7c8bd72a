"""The checkpoint classes and the eviction weights' names have one source, eviction/policy.py: the
scripts get them from the preamble index.scripts generates, so a class added in Python changes
what every script accepts, counts and scores, and no .lua file (nor another .py) restates them."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from redis.asyncio import Redis

from eviction.policy import (CLASSES, COMMIT_KINDS, TIER, EvictionWeights, PerClass, lru,
                             pool_field, weight_names)
from index.errors import BadRequest
from index.meta import CORE_FIELDS, CORE_FORMAT, GEOMETRY_FIELDS, decode_core
from index.records import CommitItem
from index.scripts import SCRIPT_NAMES, ScriptConstants, Scripts, library
from index.snapshot import read_pool, sanity_check
from index.store import PrefixIndex, pool_fields
from tests.index_harness import new_request, only, small_config

REPO = Path(__file__).resolve().parents[1]
LUA = REPO / "index" / "lua"
CONFIG = small_config()  # 4-token hash blocks, 16-token pages, 3 KDA groups
TOKENS = list(range(20))  # 5 hash blocks: a checkpoint at 20, anchored on the second page

# Four or more class names in one literal, in the order of CLASSES, is a restated list (the
# classes are six, the commit kinds five). Rules about a few classes ("intermediate or
# superseded") stay where they apply, and data naming classes (the kinds of a run of commits)
# lists them in its own order.
LIST_AT = 4
CLASS_WORD = re.compile(r"\b(" + "|".join(CLASSES) + r")\b")
QUOTED_CLASS = re.compile(r"""["'](""" + "|".join(CLASSES) + r""")["']""")
LUA_TABLE = re.compile(r"\{[^{}]*\}")  # an innermost table constructor (or a braced comment)
PY_BRACKETS = re.compile(r"[\[({][^\[\](){}]*[\])}]")  # an innermost tuple, list, set, call...


def restates(names: list[str]) -> bool:
    distinct = list(dict.fromkeys(names))
    return len(distinct) >= LIST_AT and distinct == sorted(distinct, key=CLASSES.index)


def lua_lists(text: str) -> list[str]:
    """Tables, and lines (a comment listing them), that restate the classes."""
    parts = [*LUA_TABLE.findall(text), *text.splitlines()]
    return [t for t in parts if restates(CLASS_WORD.findall(t))]


def py_lists(text: str) -> list[str]:
    return [b for b in PY_BRACKETS.findall(text) if restates(QUOTED_CLASS.findall(b))]


def test_the_scans_see_the_lists_that_were_written_before() -> None:
    """What lib.lua, commit.lua, records.py and the policy model said before the preamble."""
    assert lua_lists('local CLASSES = {"intermediate", "turn", "branch", "rung", "spec", '
                     '"superseded"}')
    assert lua_lists("{intermediate = true, turn = true, branch = true, rung = true, spec = true}")
    assert lua_lists("-- {rid = str,\n--  kind = intermediate | turn | branch | rung | spec}")
    assert lua_lists("-- the classes: intermediate, turn, branch, rung, spec and superseded")
    assert py_lists('CheckpointKind = Literal["intermediate", "turn", "branch", "rung", "spec"]')
    assert py_lists('CLASSES = ("intermediate", "turn", "branch", "rung", "spec", "superseded")')
    assert not lua_lists('if rec.cls == "intermediate" or rec.cls == "superseded" then')
    assert not py_lists('if rec["cls"] in ("intermediate", "superseded"):')
    assert not py_lists('await prefill_more(index, "a", ["rung", "spec", "branch", "turn"])')


def test_no_lua_file_spells_the_class_list() -> None:
    found = {p.name: lua_lists(p.read_text()) for p in sorted(LUA.glob("*.lua"))}
    assert found and not {name: hits for name, hits in found.items() if hits}


def test_no_other_python_file_spells_the_class_list() -> None:
    policy, samples = REPO / "eviction" / "policy.py", Path(__file__).resolve()
    files = [p for top in ("cachetier", "index", "eviction", "gpu_pool", "kernels", "tinymodel",
                           "tests") for p in sorted((REPO / top).rglob("*.py"))]
    found = {str(p.relative_to(REPO)): py_lists(p.read_text())
             for p in files if p not in (policy, samples)}
    assert {name: hits for name, hits in found.items() if hits} == {}
    assert py_lists(policy.read_text())  # the one definition (the scan does see it there)


def test_lua_builds_no_weight_field_name_and_reads_only_weights_python_sends() -> None:
    """The per-class fields come as W_BONUS / W_VALUE; the scalar ones lib.lua's `score` reads
    by name must be those EvictionWeights has, and every one of those is read."""
    text = "\n".join(p.read_text() for p in sorted(LUA.glob("*.lua")))
    assert not re.search(r"""["']w_""", text)
    read = set(re.findall(r"\bm\.(w_\w+)", text))
    assert read == {pool_field(name) for name in weight_names()[0]}


def test_per_class_weights_have_one_field_per_class_in_order() -> None:
    """PerClass spells the classes as fields (keyword construction needs names): it must follow
    CLASSES, since the scripts' per-class arrays are in that order."""
    assert tuple(f.name for f in dataclasses.fields(PerClass)) == CLASSES
    assert set(COMMIT_KINDS) < set(CLASSES)
    w = PerClass(*range(1, len(CLASSES) + 1))
    assert [w[c] for c in CLASSES] == list(range(1, len(CLASSES) + 1))


async def test_the_scripts_see_the_python_definitions(redis: Redis) -> None:
    """The preamble, evaluated by Redis, holds CLASSES, COMMIT_KINDS and the meta fields
    `as_pool_fields` writes; the library of every script starts with it."""
    preamble = ScriptConstants().preamble()
    assert library().source.split("\n", 1)[1].startswith(preamble + "\n")
    seen = json.loads(await redis.eval(preamble + """
        local fields = {}
        for f in pairs(WEIGHT_FIELDS) do fields[#fields + 1] = f end
        assert(#WEIGHT_LIST == #fields)
        for _, f in ipairs(WEIGHT_LIST) do assert(WEIGHT_FIELDS[f]) end
        local kinds = {}
        for k in pairs(IS_COMMIT_KIND) do kinds[#kinds + 1] = k end
        return cjson.encode({classes = CLASSES, index = CLASS_INDEX, kinds = COMMIT_KINDS,
                             is_kind = kinds, fields = fields, bonus = W_BONUS, value = W_VALUE})
    """, 0))
    n = len(CLASSES)
    weights = EvictionWeights(bonus=PerClass(*range(1, n + 1)), value=PerClass(*range(11, n + 11)))
    pool = weights.as_pool_fields()
    assert seen["classes"] == list(CLASSES)
    assert seen["index"] == {c: i for i, c in enumerate(CLASSES, 1)}
    assert seen["kinds"] == list(COMMIT_KINDS) and set(seen["is_kind"]) == set(COMMIT_KINDS)
    assert set(seen["fields"]) == set(pool)
    assert [pool[f] for f in seen["bonus"]] == [weights.bonus[c] for c in CLASSES]
    assert [pool[f] for f in seen["value"]] == [weights.value[c] for c in CLASSES]


async def index_with(redis: Redis, constants: ScriptConstants,
                     extra: dict[str, float]) -> PrefixIndex:
    """A pool whose scripts were loaded with `constants`, created with `lru()` weights plus the
    fields of `extra` (the weights of a class Python does not have)."""
    index = PrefixIndex(redis, "p", CONFIG)
    index._scripts = Scripts(redis, constants)
    fields = {**pool_fields(CONFIG, lru()), **extra}
    args = [x for name, value in fields.items() for x in (name, repr(value))]
    index.epoch = int(await index._scripts.call("create_pool", index.keys, args))
    return index


async def plan(index: PrefixIndex) -> int:
    """Plan TOKENS in one step with a checkpoint at its end; returns the checkpoint's lead."""
    step = await index.plan_step([new_request("a", TOKENS, len(TOKENS), 4)])
    return only(step).checkpoint_pages[0]


async def commit(index: PrefixIndex, kind: str) -> None:
    """Commit the planned step's checkpoint as `kind`, confirm it and release the request."""
    result = await index.commit([CommitItem("a", 20, 20, kind=kind)])  # type: ignore[arg-type]
    assert result.requests[0].checkpoint == "registered"
    await index.confirm(result.ticket)
    await index.release(["a"])


async def test_a_class_added_in_python_reaches_every_script(redis: Redis) -> None:
    """Scripts loaded with one more class (and commit kind): create_pool wants its weights,
    commit takes it, the anchor counts it in a slot after the others, and its weights score both
    the checkpoint and its anchor."""
    more = ScriptConstants(classes=(*CLASSES, "archived"), commit_kinds=(*COMMIT_KINDS, "archived"))
    # another library, none of whose functions is named as this one's
    assert library(more).source != library().source
    assert library(more).functions.keys() == library().functions.keys() == set(SCRIPT_NAMES)
    assert not set(library(more).functions.values()) & set(library().functions.values())
    with pytest.raises(BadRequest, match="missing pool field w_(bonus|value)_archived"):
        await index_with(redis, more, {})
    index = await index_with(redis, more, {"w_bonus_archived": 3 * TIER, "w_value_archived": 0.5})
    lead = await plan(index)
    await commit(index, "archived")
    state = await read_pool(redis, index.keys, more.classes)
    sanity_check(state, CONFIG.cache.num_pages, CONFIG.cache.blocks_per_page)
    rec = state.pages[lead]
    anchor = state.pages[rec["anchor"]]
    zeros = [0] * len(CLASSES)
    assert rec["cls"] == "archived" and rec["gain"] == 20 and rec["dur"] == 1
    assert anchor["cn"] == [*zeros, 1] and anchor["cg"] == [*zeros, 20]
    # lru(): recency 1; the class's bonus (above w_mla) and value per page its eviction frees
    kda = CONFIG.model.kda_groups
    assert state.lru[lead] == pytest.approx(rec["lu"] + 3 * TIER + 0.5 * 20 / kda, rel=1e-15)
    assert state.lru[rec["anchor"]] == pytest.approx(anchor["lu"] + 3 * TIER + 0.5 * 20 / (1 + kda),
                                                     rel=1e-15)


async def test_the_shipped_scripts_refuse_a_class_python_does_not_define(redis: Redis) -> None:
    index = await index_with(redis, ScriptConstants(), {})
    lead = await plan(index)
    with pytest.raises(BadRequest, match="kind must be one of " + ", ".join(COMMIT_KINDS) + "$"):
        await commit(index, "archived")
    await commit(index, "turn")  # the refused commit changed nothing
    state = await read_pool(redis, index.keys)
    assert state.pages[state.pages[lead]["anchor"]]["cn"] == [int(c == "turn") for c in CLASSES]


def test_constants_refuse_what_cannot_be_a_lua_name_or_meta_field() -> None:
    with pytest.raises(ValueError, match="distinct"):
        ScriptConstants(classes=(*CLASSES, 'x"; redis.call("FLUSHALL") --'))
    with pytest.raises(ValueError, match="distinct"):
        ScriptConstants(classes=(*CLASSES, "turn"))
    with pytest.raises(ValueError, match="commit kind"):
        ScriptConstants(commit_kinds=(*COMMIT_KINDS, "archived"))


async def test_the_scripts_read_and_write_the_core_as_python_does(redis: Redis) -> None:
    """`core_table` and `core_blob` (the preamble's codec of meta's packed geometry and counters)
    agree with index.meta field by field, a fractional clock and a ticket near 2^53 included."""
    values = {field: float(i + 1) for i, field in enumerate(CORE_FIELDS)}
    values.update(clock=1234.5625, ticket=float(2**53 - 1))
    blob = CORE_FORMAT.pack(*values.values())
    seen = await redis.eval(ScriptConstants().preamble() + """
        local m = core_table(ARGV[1])
        local fields = {}
        for i, f in ipairs(CORE_FIELDS) do fields[i] = f end
        return {core_blob(m), cjson.encode(fields), cjson.encode(GEOMETRY_FIELDS),
                tostring(m.clock), tostring(m.ticket == 2^53 - 1)}
    """, 0, blob)
    assert seen[0] == blob and decode_core(seen[0]) == values
    assert json.loads(seen[1]) == list(CORE_FIELDS)
    assert json.loads(seen[2]) == list(GEOMETRY_FIELDS)
    assert seen[3:] == [b"1234.5625", b"true"]
