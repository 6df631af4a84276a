"""Grammar-constrained decoding: random walks over the allowed tokens always yield valid outputs."""
import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import numpy as np
import pytest

from pagedjax.sampling_params import StructuredOutputsParams as SO
from pagedjax.structured_output.grammar import GrammarCompiler, StructuredOutputError, bitmask_words
from tiny_models import make_tokenizer

CLOSERS = ('"', "]", "}", ",")  # tokens with these end strings, arrays and objects sooner


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def vocab(tok):
    return len(tok) + 29  # logits wider than the tokenizer, and not a multiple of 32


@pytest.fixture(scope="module")
def compiler(tok, vocab):
    return GrammarCompiler(tok, vocab, (tok.eos_token_id,))


def allowed(matcher, vocab):
    """Token ids the matcher allows next; no bit past the vocabulary is ever set."""
    mask = np.zeros(bitmask_words(vocab), np.int32)
    matcher.fill_bitmask(mask)
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")  # bit j of word i = token 32i+j
    assert not bits[vocab:].any()
    return np.flatnonzero(bits)


def walk(matcher, tok, vocab, seed, p_eos=0.2, max_steps=3000):
    """Samples uniformly among allowed tokens (hurrying towards closers) until EOS or the end;
    returns the decoded text."""
    rng = np.random.default_rng(seed)
    eos = tok.eos_token_id
    names = tok.convert_ids_to_tokens(list(range(len(tok))))
    out = []
    for _ in range(max_steps):
        ids = allowed(matcher, vocab)
        assert ids.size and ids.max() < len(tok), "only real tokens may be allowed"
        if eos in ids and (ids.size == 1 or rng.random() < p_eos):
            assert matcher.accept(eos) and matcher.is_terminated()
            break
        ids = ids[ids != eos]
        closers = [i for i in ids if any(c in names[i] for c in CLOSERS)]
        t = int(rng.choice(closers if closers and rng.random() < 0.3 else ids))
        assert matcher.accept(t), matcher.error
        out.append(t)
        if matcher.is_terminated():
            assert allowed(matcher, vocab).tolist() == [eos]
            break
    else:
        pytest.fail("the walk did not end")
    return tok.decode(out)


SCHEMAS = {
    "nested": {"type": "object", "additionalProperties": False, "required": ["name", "age", "address"],
               "properties": {"name": {"type": "string", "maxLength": 8},
                              "age": {"type": "integer", "minimum": 0, "maximum": 150},
                              "address": {"type": "object", "additionalProperties": False,
                                          "required": ["city", "zip"],
                                          "properties": {"city": {"type": "string"},
                                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
    "enums": {"type": "object", "additionalProperties": False, "required": ["color", "kind", "flag"],
              "properties": {"color": {"enum": ["red", "green", "a.b", "(x)"]}, "kind": {"const": "k"},
                             "flag": {"type": "boolean"}, "note": {"type": ["string", "null"]}}},
    "array": {"type": "array", "minItems": 1, "maxItems": 3,
              "items": {"type": "object", "additionalProperties": False, "required": ["id", "score"],
                        "properties": {"id": {"type": "integer"}, "score": {"type": "number"},
                                       "tags": {"type": "array", "items": {"type": "string"}}}}},
    "numbers": {"type": "object", "additionalProperties": False, "required": ["x", "n", "any"],
                "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1},
                               "n": {"type": "integer", "exclusiveMinimum": 0, "maximum": 9},
                               "any": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}},
}


@pytest.mark.parametrize("name", SCHEMAS)
def test_json_schema_walks_validate(compiler, tok, vocab, name):
    schema = SCHEMAS[name]
    for seed in range(6):
        text = walk(compiler.matcher(SO(json=schema)), tok, vocab, seed)
        jsonschema.validate(json.loads(text), schema)


def test_json_schema_as_text_and_json_object(compiler, tok, vocab):
    schema = SCHEMAS["enums"]
    text = walk(compiler.matcher(SO(json=json.dumps(schema))), tok, vocab, 0)
    jsonschema.validate(json.loads(text), schema)
    for seed in range(4):
        assert isinstance(json.loads(walk(compiler.matcher(SO(json_object=True)), tok, vocab, seed)), dict)


def accepts(matcher, tok, text):
    """Whether the matcher takes all of text's tokens and may then end."""
    return all(matcher.accept(t) for t in tok.encode(text)) and matcher.accept(tok.eos_token_id)


def test_json_whitespace_is_bounded_and_x_guidance_wins(compiler, tok):
    obj = SO(json={"type": "object"})
    assert accepts(compiler.matcher(obj), tok, '{"a":1}')
    assert accepts(compiler.matcher(obj), tok, '{\n  "a": [1, 2],\n  "b": {"c": null}\n}')
    assert accepts(compiler.matcher(obj), tok, '{"a":' + " " * 32 + "1}")
    assert not accepts(compiler.matcher(obj), tok, '{"a":' + " " * 33 + "1}")
    compact = SO(json={"type": "object", "x-guidance": {"whitespace_flexible": False}})
    assert accepts(compiler.matcher(compact), tok, '{"a":1}')
    assert not accepts(compiler.matcher(compact), tok, '{"a": 1}')
    lenient = SO(json={"type": "array", "uniqueItems": True, "x-guidance": {"lenient": True}})
    with pytest.raises(StructuredOutputError, match="uniqueItems"):
        compiler.compile(SO(json={"type": "array", "uniqueItems": True}))
    assert accepts(compiler.matcher(lenient), tok, "[1, 1]")
    assert not accepts(compiler.matcher(lenient), tok, "[" + " " * 33 + "1]")  # still bounded


@pytest.mark.parametrize("regex", [r"[a-z]{2,5}@(foo|bar)\.com", r"-?[0-9]+(\.[0-9]{1,3})?", r"(ab|c\.d)*x",
                                   r"\((é|\n)\)"])
def test_regex_walks_fullmatch(compiler, tok, vocab, regex):
    for seed in range(8):
        assert re.fullmatch(regex, walk(compiler.matcher(SO(regex=regex)), tok, vocab, seed))


def test_choice_outputs_exactly_one_choice(compiler, tok, vocab):
    choices = ("a.b", "(x)", "yes", "yes!", 'é\n"q\\', "[0-9]")
    seen = {walk(compiler.matcher(SO(choice=choices)), tok, vocab, seed) for seed in range(80)}
    assert seen == set(choices)
    for bad in ("axb", "x", "yes!!", "7"):
        assert not accepts(compiler.matcher(SO(choice=choices)), tok, bad)


def parse_expr(s: str, i: int = 0) -> int:
    """Recursive descent for the grammar below; returns the end index or raises."""
    if s[i] == "(":
        i = parse_expr(s, i + 1)
        assert s[i] == "+"
        i = parse_expr(s, i + 1)
        assert s[i] == ")"
        return i + 1
    m = re.match(r"[0-9]{1,3}", s[i:])
    return i + m.end()


def test_lark_and_gbnf_grammars(compiler, tok, vocab):
    lark = 'start: expr\nexpr: NUMBER | "(" expr "+" expr ")"\nNUMBER: /[0-9]{1,3}/\n'
    for seed in range(8):
        text = walk(compiler.matcher(SO(grammar=lark)), tok, vocab, seed)
        assert parse_expr(text) == len(text)
    gbnf = 'root ::= answer "!"\nanswer ::= "yes" | "no"\n'
    outs = {walk(compiler.matcher(SO(grammar=gbnf)), tok, vocab, seed) for seed in range(20)}
    assert outs == {"yes!", "no!"}


def test_disallowed_token_is_rejected(compiler, tok, vocab):
    m = compiler.matcher(SO(choice=("yes", "no")))
    assert m.error is None
    assert not m.accept(tok.encode("z")[0])
    assert m.error and "<state>" not in m.error
    assert m.is_terminated()
    for bad in (len(tok), vocab - 1, vocab, 10**9, -1):  # ids with no token: rejected, not raised
        m = compiler.matcher(SO(choice=("yes", "no")))
        assert not m.accept(bad) and m.error
    m = compiler.matcher(SO(choice=("yes", "no")))
    assert not m.accept(tok.eos_token_id)  # EOS only once the grammar is complete


def test_eos_allowed_when_complete(tok, vocab):
    compiler = GrammarCompiler(tok, vocab, (tok.eos_token_id, tok.bos_token_id))  # two EOS ids
    m = compiler.matcher(SO(regex="ab|abc"))
    for t in tok.encode("ab"):
        assert not m.is_terminated() and m.accept(t)
    ids = allowed(m, vocab).tolist()
    assert {tok.eos_token_id, tok.bos_token_id} <= set(ids) and len(ids) > 2 and not m.is_terminated()
    assert m.accept(tok.encode("c")[0]) and m.is_terminated()
    assert sorted(allowed(m, vocab).tolist()) == sorted([tok.eos_token_id, tok.bos_token_id])
    assert m.accept(tok.bos_token_id) and m.is_terminated()


def test_fork_is_independent(compiler, tok, vocab):
    m = compiler.matcher(SO(regex="a(b|c)d"))
    assert m.accept(tok.encode("a")[0])
    f = m.fork()
    b, c = tok.encode("b")[0], tok.encode("c")[0]
    assert m.accept(b) and f.accept(c)
    assert allowed(m, vocab).tolist() == allowed(f, vocab).tolist() == tok.encode("d")
    assert not m.accept(c) and m.error and f.error is None
    assert f.accept(tok.encode("d")[0]) and f.is_terminated()
    assert compiler.matcher(SO(regex="a(b|c)d")).accept(tok.encode("a")[0])  # the start state is untouched


def test_compile_is_cached_and_thread_safe(tok, vocab):
    compiler = GrammarCompiler(tok, vocab, (tok.eos_token_id,), cache_size=3)
    specs = [SO(json=SCHEMAS[n]) for n in SCHEMAS] + [SO(regex=f"x{i}+") for i in range(4)]
    barrier = threading.Barrier(8)

    def run(i):
        barrier.wait()
        return [compiler.compile(specs[(i + j) % len(specs)]) for j in range(len(specs))]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(8)))
    assert all(len(r) == len(specs) for r in results)
    same = SO(json=json.loads(json.dumps(SCHEMAS["array"])))  # an equal spec: the same key
    assert compiler.compile(same) is compiler.compile(SO(json=SCHEMAS["array"]))
    assert len(compiler._cache) == 3  # bounded
    m = compiler.matcher(same)
    assert m.accept(tok.encode("[")[0])


@pytest.mark.parametrize("spec, words", [
    (SO(json={"type": "nonsense"}), ["invalid JSON schema", "nonsense"]),
    (SO(json="{not json"), ["invalid JSON schema", "not valid JSON"]),
    (SO(json='"just a string"'), ["invalid JSON schema"]),
    (SO(json="true"), ["invalid JSON schema"]),
    (SO(json={"type": "string", "format": "no-such-format"}), ["invalid JSON schema", "no-such-format"]),
    (SO(regex="("), ["invalid regex"]),
    (SO(regex="a{3,1}"), ["invalid regex"]),
    (SO(grammar="start: foo"), ["invalid grammar", "foo"]),
    (SO(grammar="blah blah"), ["invalid grammar"]),
    (SO(grammar='root ::= ("a"'), ["invalid grammar"]),
])
def test_invalid_constraints_raise_at_compile(compiler, spec, words):
    with pytest.raises(StructuredOutputError) as e:
        compiler.compile(spec)
    message = str(e.value)
    assert all(w in message for w in words), message
    assert len(message) < 500 and "<state>" not in message and "panicked" not in message
    assert isinstance(e.value, ValueError)


def test_fill_bitmask_checks_its_buffer(compiler, vocab):
    m = compiler.matcher(SO(regex="a+"))
    for bad in (np.zeros(bitmask_words(vocab), np.int64), np.zeros(bitmask_words(vocab) - 1, np.int32),
                np.zeros(2 * bitmask_words(vocab), np.int32)[::2]):
        with pytest.raises(ValueError):
            m.fill_bitmask(bad)
    batch = np.zeros((3, bitmask_words(vocab)), np.int32)
    m.fill_bitmask(batch[1])  # a row of a batch mask
    assert batch[1].any() and not batch[0].any() and not batch[2].any()
    assert bitmask_words(32) == 1 and bitmask_words(33) == 2
