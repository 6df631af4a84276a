"""JSON schemas are compiled with closed objects (grammar.closed_objects): an object schema that
lists `properties` and says nothing of other keys takes no other key, so a model can neither
invent properties nor write a key twice; what a schema says itself is kept (issue 34)."""
import copy
import json

import pytest

from pagedjax.sampling_params import StructuredOutputsParams as SO
from pagedjax.structured_output.grammar import GrammarCompiler, closed_objects
from tiny_models import make_tokenizer

PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, len(tok), (tok.eos_token_id,))


def accepts(compiler, tok, schema, text):
    """Whether the grammar of `schema` takes all of text's tokens and may then end."""
    m = compiler.matcher(SO(json=schema))
    return all(m.accept(t) for t in tok.encode(text)) and m.accept(tok.eos_token_id)


def test_response_format_schema_refuses_invented_and_repeated_keys(compiler, tok):
    assert accepts(compiler, tok, PERSON, '{"name": "Mara"}')
    assert not accepts(compiler, tok, PERSON, '{"name": "Mara", "age": 20}')  # an invented property
    assert not accepts(compiler, tok, PERSON, '{"name": "Mara", "name": "Aurora"}')  # a key twice
    assert not accepts(compiler, tok, PERSON, '{"name": "Mara", "x": 1, "x": 2}')  # an invented key twice
    nested = {"type": "object", "properties": {"who": PERSON, "tags": {"type": "array", "items": PERSON}}}
    assert accepts(compiler, tok, nested, '{"who": {"name": "a"}, "tags": [{"name": "b"}]}')
    assert not accepts(compiler, tok, nested, '{"who": {"name": "a", "age": 1}}')
    assert not accepts(compiler, tok, nested, '{"tags": [{"name": "b", "skills": []}]}')
    assert not accepts(compiler, tok, nested, '{"who": {"name": "a"}, "extra": 1}')
    # the schema as JSON text too (response_format may give either)
    assert not accepts(compiler, tok, json.dumps(PERSON), '{"name": "Mara", "age": 20}')


def test_what_the_schema_says_is_kept(compiler, tok):
    # additionalProperties: false given by the user is enforced; true (or a schema) keeps the object open
    assert not accepts(compiler, tok, {**PERSON, "additionalProperties": False}, '{"name": "a", "b": 1}')
    assert accepts(compiler, tok, {**PERSON, "additionalProperties": True}, '{"name": "a", "b": 1}')
    typed = {**PERSON, "additionalProperties": {"type": "integer"}}
    assert accepts(compiler, tok, typed, '{"name": "a", "b": 1}')
    assert not accepts(compiler, tok, typed, '{"name": "a", "b": "c"}')
    assert accepts(compiler, tok, {**PERSON, "patternProperties": {"^x": {}}}, '{"name": "a", "x1": 1}')
    # an object without `properties` is free-form (json_object, a map)
    assert accepts(compiler, tok, {"type": "object"}, '{"a": 1, "b": {"c": 2}}')
    m = compiler.matcher(SO(json_object=True))
    assert all(m.accept(t) for t in tok.encode('{"any": "keys"}')) and m.accept(tok.eos_token_id)
    # required names outside `properties`: left open (closing would make it unsatisfiable)
    assert accepts(compiler, tok, {**PERSON, "required": ["name", "id"]}, '{"name": "a", "id": 1}')


def test_combined_parts_stay_open_and_compile(compiler, tok):
    """allOf members, anyOf beside properties, $ref with siblings: each part adds keys the
    others must let through."""
    all_of = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}
    assert accepts(compiler, tok, all_of, '{"a": 1, "b": 2}')
    beside = {"type": "object", "properties": {"kind": {"type": "string"}}, "required": ["kind"],
              "anyOf": [{"properties": {"x": {"type": "integer"}}, "required": ["x"]}]}
    assert accepts(compiler, tok, beside, '{"kind": "k", "x": 1}')
    ref = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P", "properties": {"extra": {}}}},
           "$defs": {"P": {"type": "object", "properties": {"q": {"type": "integer"}}}}}
    assert accepts(compiler, tok, ref, '{"p": {"q": 1, "extra": 2}}')
    # an anyOf of whole objects (a tagged union): each member is closed
    union = {"anyOf": [{"type": "object", "properties": {"cat": {"type": "string"}}, "required": ["cat"]},
                       {"type": "object", "properties": {"dog": {"type": "string"}}, "required": ["dog"]}]}
    assert accepts(compiler, tok, union, '{"dog": "rex"}')
    assert not accepts(compiler, tok, union, '{"dog": "rex", "cat": "tom"}')
    # a plain $ref to a definition: the definition is closed
    plain = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": ref["$defs"]}
    assert not accepts(compiler, tok, plain, '{"p": {"q": 1, "z": 2}}')


def test_closed_objects_rewrites_a_copy():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}},
                                               "b": {"allOf": [{"properties": {"c": {}}}]},
                                               "d": {"$ref": "#/$defs/D"}, "e": {"$ref": "#/$defs/E", "required": []}},
              "$defs": {"D": {"properties": {"x": {}}}, "E": {"properties": {"y": {}}}}}
    before = copy.deepcopy(schema)
    out = closed_objects(schema)
    assert schema == before  # the request's own schema is untouched
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False  # `properties: {}`: exactly {}
    assert "additionalProperties" not in out["properties"]["b"]["allOf"][0]
    assert out["$defs"]["D"]["additionalProperties"] is False
    assert "additionalProperties" not in out["$defs"]["E"]  # its $ref has sibling keywords
    assert "additionalProperties" not in out["properties"]["e"]

