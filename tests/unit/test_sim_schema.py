"""The sim's structured output: `sim_schema.fill` gives a value the schema's own
validator takes, for the pydantic models clients send and for schemas written by hand, and
stays bounded on hostile ones."""

from __future__ import annotations

import datetime
import enum
import json
import time
import uuid
from typing import Annotated, Any, Literal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field, HttpUrl

from corral.bundled.sim_schema import MAX_ITEMS, fill
from corral.gateway.doors.ollama_shapes import BadRequest, context_of, turns_of


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Node(BaseModel):
    name: str
    children: list[Node] = []
    parent: Node | None = None


class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    colour: Colour
    age: Annotated[int, Field(ge=3, le=20)]
    code: Annotated[str, Field(pattern=r"^[A-Z]{3}$")] = "ABC"
    tags: Annotated[list[str], Field(min_length=2, max_length=3)]
    born: datetime.date
    seen: datetime.datetime
    id: uuid.UUID
    home: HttpUrl | None = None
    scores: dict[str, float]
    pair: tuple[int, str]
    either: int | str
    ratio: Annotated[float, Field(gt=0, lt=0.1)]
    step: Annotated[int, Field(multiple_of=5, gt=7)]
    below: Annotated[float, Field(lt=-3)]


class Cat(BaseModel):
    pet_type: Literal["cat"]
    meows: int


class Dog(BaseModel):
    pet_type: Literal["dog"]
    barks: float


class Owner(BaseModel):
    pet: Cat | Dog = Field(discriminator="pet_type")
    pets: list[Pet]
    tree: Node


@pytest.mark.parametrize("model", [Node, Pet, Owner])
def test_pydantic_models_validate_what_fill_gives(model: type[BaseModel]) -> None:
    value = fill(model.model_json_schema(), ["some", "words"])
    model.model_validate(value)
    model.model_validate_json(json.dumps(value))


def test_hand_written_schemas_type_lists_and_definitions() -> None:
    schema = {
        "definitions": {"item": {"type": "object", "properties": {"n": {"type": "integer"}},
                                 "required": ["n"]}},
        "type": "object",
        "properties": {
            "maybe": {"type": ["string", "null"]},
            "items": {"type": "array", "items": {"$ref": "#/definitions/item"}, "minItems": 2},
            "fixed": {"const": 7},
            "both": {"allOf": [{"properties": {"a": {"type": "string"}}, "required": ["a"]},
                               {"properties": {"b": {"type": "boolean"}}, "required": ["b"]}]},
            "unique": {"type": "array", "items": {"type": "string"}, "minItems": 3,
                       "uniqueItems": True},
        },
        "required": ["maybe", "items", "fixed", "both", "unique"],
    }  # fmt: skip
    value = fill(schema, ["w"])
    assert isinstance(value["maybe"], str)
    assert len(value["items"]) == 2
    assert all(isinstance(i["n"], int) for i in value["items"])
    assert value["fixed"] == 7
    assert isinstance(value["both"]["a"], str)
    assert value["both"]["b"] is True
    assert len(set(value["unique"])) == 3


def test_hostile_schemas_stay_bounded() -> None:
    """Schemas come from clients: a reference to itself, an array asking for a billion items,
    a pattern that backtracks, a dangling reference, junk where a schema should be."""
    loop = {"$defs": {"a": {"type": "object", "properties": {"next": {"$ref": "#/$defs/a"}},
                            "required": ["next"]}}, "$ref": "#/$defs/a"}  # fmt: skip
    huge = {"type": "array", "items": {"type": "string", "minLength": 10**9}, "minItems": 10**9}
    slow = {"type": "string", "minLength": 4000, "pattern": "^(a+)+$"}
    wide = {"type": "object", "properties": {f"k{i}": {"type": "array", "items": {
        "type": "object", "properties": {f"j{j}": {"type": "string"} for j in range(50)}}}
        for i in range(200)}}  # fmt: skip
    started = time.monotonic()
    schemas: list[Any] = [loop, huge, slow, wide, {"$ref": "#/nowhere"}, [], "x", None, True, 3]
    for schema in schemas:
        json.dumps(fill(schema))
    assert len(fill(huge)) == MAX_ITEMS
    assert time.monotonic() - started < 30  # bounded work: seconds, not hours (a loose guard)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.recursive(
        st.just({"type": "string"}) | st.just({"type": "integer"}) | st.just({"type": "null"}),
        lambda inner: (
            st.builds(
                lambda props: {"type": "object", "properties": props, "required": list(props)},
                st.dictionaries(st.text("abc", min_size=1, max_size=3), inner, max_size=3),
            )
            | st.builds(lambda i: {"type": "array", "items": i, "minItems": 1}, inner)
            | st.builds(lambda a, b: {"anyOf": [a, b]}, inner, inner)
        ),
        max_leaves=12,
    )
)
def test_fill_fits_random_schemas(schema: dict[str, Any]) -> None:
    _fits(fill(schema), schema)


def _fits(value: Any, schema: dict[str, Any]) -> None:
    if "anyOf" in schema:
        errors = 0
        for branch in schema["anyOf"]:
            try:
                _fits(value, branch)
            except AssertionError:
                errors += 1
        assert errors < len(schema["anyOf"])
        return
    kind = schema["type"]
    if kind == "object":
        assert isinstance(value, dict)
        assert set(schema["required"]) <= set(value)
        for key, sub in schema["properties"].items():
            _fits(value[key], sub)
    elif kind == "array":
        assert isinstance(value, list)
        for item in value:
            _fits(item, schema["items"])
    elif kind == "string":
        assert isinstance(value, str)
    elif kind == "integer":
        assert isinstance(value, int)
    else:
        assert value is None


# --- Ollama's `context` ------------------------------------------------------------------------


@given(
    st.lists(
        st.tuples(st.sampled_from(["system", "user", "assistant"]), st.text(max_size=40)),
        max_size=6,
    )
)
def test_a_context_gives_back_the_turns_it_was_made_of(turns: list[tuple[str, str]]) -> None:
    packed = context_of(turns)
    assert all(isinstance(x, int) for x in packed)
    assert turns_of(packed) == turns


@pytest.mark.parametrize(
    "context",
    [
        [1, 2, 3],  # another server's token ids
        "abc",
        [2**24 + 1],  # the mark alone
        [2**24 + 1, 5, 2**30],  # a value past three bytes
        [2**24 + 1, 90, 1, 2],  # a length past the bytes
        [2**24 + 1, True, 1],
        [*context_of([("user", "hi")])[:-1], 0xFFFFFF],  # damaged
    ],
)
def test_a_context_corral_did_not_give_is_refused(context: Any) -> None:
    with pytest.raises(BadRequest, match="context"):
        turns_of(context)


def test_values_come_from_what_the_prompt_gives_in_turn() -> None:
    """A model asked for a tool's arguments takes them from the prompt: its numbers in turn
    (where they fit the schema), its quoted texts in turn, the keys it names for a JSON."""
    from corral.bundled.sim_schema import cues_of, keys_of

    cues = cues_of("add 2 and 3, name it '你好啊集团'; a JSON with 'setup' and 'punchline' keys")
    assert cues.numbers == (2.0, 3.0)
    args = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                                             "name": {"type": "string"}}}  # fmt: skip
    assert fill(args, cues=cues) == {"a": 2, "b": 3, "name": "你好啊集团"}
    small = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 2.5}}}
    assert fill(small, cues=cues_of("pick 7 or 2"))["n"] == 2  # 7 does not fit: the next
    assert keys_of(cues) == ["setup", "punchline"]  # names, not the quoted phrase
    assert fill(args)["a"] == 1  # no prompt: a value in range, as before


def test_a_tool_the_user_asks_for_is_called_with_the_values_named_for_it() -> None:
    """OpenCode's `@explore` mention: "call the task tool with subagent: explore". A model
    calls the tool asked for, with the value named for its field (`subagent_type`)."""
    from corral.bundled.sim_schema import cues_of
    from corral.bundled.sim_turns import Choice, pick

    said = "@explore list the files. Call the task tool with subagent: explore"
    tools = ["bash", "read", "list", "task"]
    assert pick(tools, Choice(), True, set(), said) == "task"  # not `list`, a word of the text
    assert pick(tools, Choice(), True, set(), "list the files") == "bash"  # none asked: first
    task = {"type": "object", "required": ["description", "subagent_type"],
            "properties": {"description": {"type": "string"},
                           "subagent_type": {"type": "string"}}}  # fmt: skip
    args = fill(task, ["words"], cues_of(said))
    assert args == {"description": "words", "subagent_type": "explore"}
