"""Grammar-constrained decoding (JSON schema, regex, choice, Lark/GBNF grammar) on llguidance.

A GrammarCompiler turns a StructuredOutputsParams into a compiled grammar once (LRU-cached by
its key, safe to call from any thread); each constrained sequence holds a GrammarMatcher that
writes the allowed-next-token bitmask before a step and advances by the sampled token after it.

JSON schemas are compiled with two defaults (a schema's own keywords win):
- whitespace: JSON_WHITESPACE, at most 32 blanks at each place JSON allows them (the schema's
  "x-guidance" whitespace options replace it);
- closed objects (closed_objects): an object schema that lists `properties` and says nothing
  of other keys gets `additionalProperties: false`, as OpenAI's strict mode requires and vLLM's
  default backend (xgrammar, strict mode) assumes (parts that an allOf or a $ref with other
  keywords combine are left as written). The model then writes only the listed keys,
  each at most once, in the schema's order. Duplicate keys remain possible only among keys a
  schema leaves free (`additionalProperties: true` or a schema, `patternProperties`, an object
  without `properties` such as json_object's): llguidance does not make free keys unique.
"""
from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from urllib.parse import unquote

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from pagedjax.sampling_params import StructuredOutputsParams

CACHE_SIZE = 256  # compiled grammars kept
# JSON whitespace allowed at each place JSON allows it: any style (compact, ", ", indented),
# but bounded, so a model cannot loop on spaces forever. A schema's own "x-guidance" options
# (whitespace_flexible, whitespace_pattern, separators, lenient: ignore unsupported keywords) win.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{1,32}"
MAX_ERROR_CHARS = 400
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)  # no parser-state dumps in messages


class StructuredOutputError(ValueError):
    """An invalid JSON schema, regex or grammar."""


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one token bitmask: cdiv(vocab_size, 32)."""
    return (vocab_size + 31) // 32


def _short(message: str) -> str:
    message = message.replace("<non-verbose/>", "").strip()
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + " ..."


# JSON-schema keywords whose values are subschemas (a dict, or a list / map of them)
_ONE_SUBSCHEMA = ("additionalProperties", "items", "additionalItems")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_PARTS = ("allOf", "anyOf", "oneOf")
_OBJECT_KEYWORDS = ("properties", "required", "additionalProperties", "patternProperties", "minProperties",
                    "maxProperties")
_OPEN_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_ANNOTATIONS = ("$ref", "$defs", "definitions", "$schema", "$id", "$comment", "title", "description", "default",
                "examples", "x-guidance")


def _subschemas(node: dict):
    for key in _ONE_SUBSCHEMA:
        if isinstance(node.get(key), dict):
            yield node[key]
    for key in _SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            yield from (s for s in node[key] if isinstance(s, dict))
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            yield from (s for s in node[key].values() if isinstance(s, dict))


def closed_objects(schema: dict) -> dict:
    """A copy of `schema` in which every object schema that lists `properties` (and requires
    none but them) without saying what other keys may be (no `additionalProperties`,
    `patternProperties`) gets `additionalProperties: false`.

    Parts of an object that others complete are left as written: the members of an `allOf`,
    the `anyOf` / `oneOf` members of a schema with object keywords or a `$ref` of its own, the
    target of a `$ref` that has sibling keywords, and (through local `$ref`s) what those
    point to. Closing one of them would refuse the keys the other parts add."""
    root = copy.deepcopy(schema)

    def target(ref: object) -> dict | None:  # a local "#/..." JSON pointer's schema
        if not isinstance(ref, str) or not ref.startswith("#") or (ref != "#" and not ref.startswith("#/")):
            return None
        node: object = root
        for token in ref[2:].split("/") if ref != "#" else ():
            token = unquote(token).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and token in node:
                node = node[token]
            elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
                node = node[int(token)]
            else:
                return None
        return node if isinstance(node, dict) else None

    nodes, stack, seen = [], [root], set()
    while stack:  # every subschema, once
        node = stack.pop()
        if id(node) not in seen:
            seen.add(id(node))
            nodes.append(node)
            stack.extend(_subschemas(node))
    combined: set[int] = set()  # ids of the schemas that other parts complete
    todo: list[dict] = []
    for node in nodes:
        if isinstance(node.get("allOf"), list):
            todo += node["allOf"]
        has_object_keys = any(k in node for k in _OBJECT_KEYWORDS) or "$ref" in node
        for key in ("anyOf", "oneOf"):
            if has_object_keys and isinstance(node.get(key), list):
                todo += node[key]
        if "$ref" in node and any(k not in _ANNOTATIONS for k in node):
            todo.append(target(node["$ref"]))
    while todo:  # what a combined part points to or is made of is combined too
        node = todo.pop()
        if not isinstance(node, dict) or id(node) in combined:
            continue
        combined.add(id(node))
        for key in _PARTS:
            if isinstance(node.get(key), list):
                todo += node[key]
        if "$ref" in node:
            todo.append(target(node["$ref"]))
    for node in nodes:
        props = node.get("properties")
        required = node.get("required", [])
        if (isinstance(props, dict) and id(node) not in combined
                and not any(k in node for k in _OPEN_KEYWORDS + _PARTS + ("$ref",))
                and isinstance(required, list) and all(r in props for r in required)):
            node["additionalProperties"] = False
    return root


def _grammar(spec: StructuredOutputsParams) -> tuple[str, str]:
    """(what the user gave, in words; llguidance grammar text). Checks nothing beyond JSON syntax."""
    if spec.json is not None or spec.json_object:
        schema = {"type": "object"} if spec.json_object else spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise StructuredOutputError(f"invalid JSON schema: not valid JSON ({e})") from None
        if not isinstance(schema, dict):
            raise StructuredOutputError("invalid JSON schema: it must be a JSON object")
        try:
            schema = closed_objects(schema)
        except RecursionError:
            raise StructuredOutputError("invalid JSON schema: nested too deeply") from None
        options = schema.get("x-guidance")
        own_whitespace = isinstance(options, dict) and {"whitespace_flexible", "whitespace_pattern"} & options.keys()
        defaults = None if own_whitespace else {"whitespace_pattern": JSON_WHITESPACE}
        try:
            return "JSON schema", llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
        except ValueError as e:  # e.g. a schema that is not serializable
            raise StructuredOutputError(f"invalid JSON schema: {_short(str(e))}") from None
    if spec.regex is not None:
        return "regex", llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:  # Lark string literals take JSON escapes
        lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
        return "choice", llguidance.LLMatcher.grammar_from_lark(lark)
    text = spec.grammar
    if "::=" in text:  # GBNF (llama.cpp): converted unless it is Lark already
        try:
            text = any_to_lark(text)
        except Exception as e:  # the converter raises its own error types
            raise StructuredOutputError(f"invalid grammar: {_short(str(e))}") from None
    return "grammar", llguidance.LLMatcher.grammar_from_lark(text)


class CompiledGrammar:
    """A validated grammar and a matcher in its start state, which matchers are copied from."""

    __slots__ = ("kind", "grammar", "_start")

    def __init__(self, kind: str, grammar: str, start: llguidance.LLMatcher):
        self.kind, self.grammar, self._start = kind, grammar, start


def _ll_tokenizer(tokenizer, vocab_size: int, eos_token) -> llguidance.LLTokenizer:
    """llguidance's view of a fast HF tokenizer (its Rust tokenizer's JSON). transformers 5.12
    (what installs beside google-tunix) wraps a byte-level BPE's decoder in a Sequence
    (ByteFallback, Fuse, Replace, ByteLevel) that llguidance does not recognise as byte-level,
    so it would read a token such as 'Ġ"' as those bytes; the plain ByteLevel decoder is
    restored in the copy handed to llguidance."""
    import json
    from copy import copy

    backend = copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    spec = json.loads(backend.to_str())
    decoder = spec.get("decoder") or {}
    if decoder.get("type") == "Sequence" and (spec.get("pre_tokenizer") or {}).get("type") == "ByteLevel":
        byte_level = [d for d in decoder.get("decoders", []) if d.get("type") == "ByteLevel"]
        if byte_level:
            spec["decoder"] = byte_level[0]
    return llguidance.LLTokenizer(json.dumps(spec), n_vocab=vocab_size,
                                  eos_token=eos_token if eos_token is not None else tokenizer.eos_token_id)


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], cache_size: int = CACHE_SIZE):
        # vocab_size: the logits' width; ids the tokenizer lacks (vocab_size > len(tokenizer)) never match
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self._tokenizer = _ll_tokenizer(tokenizer, vocab_size, list(self.eos_token_ids) or None)
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of `spec` (cached); raises StructuredOutputError when invalid."""
        key = spec.key()
        with self._lock:
            if (hit := self._cache.get(key)) is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compile(spec)  # outside the lock: llguidance drops the GIL to build
        with self._lock:
            compiled = self._cache.setdefault(key, compiled)  # a racing thread's copy wins
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher at the start of `spec`'s grammar."""
        return GrammarMatcher(self.compile(spec)._start.deep_copy())

    def _compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        kind, grammar = _grammar(spec)
        start = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=_LIMITS)
        if not start.is_error():  # some errors surface only at the first mask: compute it on a copy
            probe = start.deep_copy()
            probe.compute_bitmask()
            start = probe if probe.is_error() else start
        if start.is_error():
            raise StructuredOutputError(f"invalid {kind}: {_short(start.get_error())}")
        return CompiledGrammar(kind, grammar, start)


class GrammarMatcher:
    """One sequence's position in a grammar. Not thread-safe: one thread drives it at a time."""

    __slots__ = ("_m", "error")

    def __init__(self, matcher: llguidance.LLMatcher, error: str | None = None):
        self._m = matcher
        self.error = error

    def fill_bitmask(self, out: np.ndarray) -> None:
        """Writes the allowed next tokens into out: int32 [bitmask_words(vocab_size)], bit j of
        word i <=> token 32 * i + j. EOS is allowed once the grammar is complete; only EOS after
        an error. Releases the GIL while it computes."""
        if out.dtype != np.int32 or not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError("the bitmask must be a writeable, C-contiguous int32 array")
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)  # checks the size itself

    def accept(self, token: int) -> bool:
        """Advances by one sampled token; False (and self.error set) if it was not allowed."""
        try:
            if self._m.consume_token(int(token)):
                return True
            message = self._m.get_error()
        except (ValueError, OverflowError, RuntimeError) as e:  # e.g. an id outside the vocabulary
            message = str(e)
        self.error = _short(message) or f"token {token} is not allowed here"
        return False

    def is_terminated(self) -> bool:
        """Nothing but EOS can follow (the grammar is complete and closed, EOS was taken, or an error)."""
        return self._m.is_stopped()

    def fork(self) -> GrammarMatcher:
        """An independent copy in the same state (for n > 1 sequences of one request)."""
        return GrammarMatcher(self._m.deep_copy(), self.error)
