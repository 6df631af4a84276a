"""OpenAI/vLLM API parity on /v1/completions and /v1/chat/completions: sampling fields,
logprobs everywhere (echo, scoring with max_tokens 0, prompt_logprobs), structured outputs,
beam search, /tokenize, /detokenize, /version and the no-op fields.

Over real uvicorn and the FakeEngine (hand-computable outputs, see fake_engine.py), with the
official openai client where it has the field, raw httpx where it has not.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from pagedjax.sampling_params import StructuredOutputsParams

from .conftest import MODEL, metric, openai_client, running_server, wait_for
from .fake_engine import VOCAB_SIZE, W0, FakeEngine, FakeGrammarCompiler

C, CHAT = "/v1/completions", "/v1/chat/completions"
P = {"model": MODEL, "prompt": "w1", "max_tokens": 2}
M = {"model": MODEL, "messages": [{"role": "user", "content": "w1"}], "max_tokens": 2}
G = dict(model=MODEL, temperature=0.0)
USER_W5 = [{"role": "user", "content": "w5"}]


@pytest.fixture(scope="module")
def psrv():
    """A server whose engine has a (fake) grammar compiler."""
    with running_server(FakeEngine(step_delay=0.001, grammar_compiler=FakeGrammarCompiler())) as s:
        yield s


@pytest.fixture
def pclient(psrv) -> openai.OpenAI:
    return openai_client(psrv.url)


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=20)


def _last_params(s):
    return s.engine.params[s.engine.added[-1]]


def _sse(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json=body, timeout=20) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


# ---- 1. sampling fields reach SamplingParams ---------------------------------------------


def test_sampling_fields_reach_the_engine(psrv, pclient):
    extra = {"repetition_penalty": 1.3, "min_tokens": 1, "bad_words": ["w9", "w3 w4"],
             "allowed_token_ids": [W0 + 2, W0 + 3], "stop_token_ids": [W0 + 7]}
    pclient.completions.create(model=MODEL, prompt="w1", max_tokens=3, presence_penalty=0.5, frequency_penalty=-1,
                               logit_bias={str(W0 + 2): 5, str(W0 + 3): -100}, extra_body=extra)
    p = _last_params(psrv)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens) == (0.5, -1.0, 1.3, 1)
    assert p.logit_bias == {W0 + 2: 5.0, W0 + 3: -100.0}
    assert (p.bad_words, p.allowed_token_ids, p.stop_token_ids) == (["w9", "w3 w4"], [W0 + 2, W0 + 3], [W0 + 7])
    assert p.structured_outputs is None and p.prompt_logprobs is None
    pclient.chat.completions.create(messages=USER_W5, max_tokens=3, presence_penalty=-2, frequency_penalty=2,
                                    logit_bias={"7": 1.5}, extra_body=extra, **G)
    p = _last_params(psrv)
    assert (p.presence_penalty, p.frequency_penalty, p.logit_bias, p.min_tokens) == (-2.0, 2.0, {7: 1.5}, 1)
    assert (p.repetition_penalty, p.bad_words, p.allowed_token_ids) == (1.3, ["w9", "w3 w4"], [W0 + 2, W0 + 3])


def test_defaults_are_neutral(psrv, pclient):
    pclient.completions.create(model=MODEL, prompt="w1", max_tokens=1)
    p = _last_params(psrv)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.logit_bias, p.min_tokens,
            p.bad_words, p.allowed_token_ids) == (0.0, 0.0, 1.0, None, 0, None, None)
    assert not p.uses_penalties and not p.uses_token_mask


BAD_RANGES = [
    ("presence_penalty", 2.01), ("presence_penalty", -2.5), ("frequency_penalty", 3),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", 101),
    ("logit_bias", {"5": 100.5}), ("logit_bias", {"5": -101}), ("logit_bias", {"x": 1}),
    ("logit_bias", {"-3": 1}), ("logit_bias", {str(VOCAB_SIZE): 1}), ("logit_bias", {"5": "1"}),
    ("logit_bias", {str(i): 1 for i in range(1025)}), ("logit_bias", [1, 2]),
    ("min_tokens", -1), ("min_tokens", 5),  # more than max_tokens (2)
    ("bad_words", [""]), ("bad_words", "w1"), ("bad_words", ["x" * 300]),
    ("allowed_token_ids", []), ("allowed_token_ids", [VOCAB_SIZE]), ("allowed_token_ids", [-1]),
    ("stop_token_ids", [2**31]),
    ("length_penalty", 11), ("early_stopping", "sometimes"), ("use_beam_search", "yes"),
]


@pytest.mark.parametrize("path", [C, CHAT])
@pytest.mark.parametrize("field,value", BAD_RANGES, ids=[f"{f}={str(v)[:20]}" for f, v in BAD_RANGES])
def test_out_of_range_is_400_naming_the_field(server, path, field, value):
    r = _post(server.url, path, {**(P if path == C else M), field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(field), r.json()


def test_huge_malformed_logit_bias_is_one_short_error(server):
    r = _post(server.url, C, {**P, "logit_bias": {str(i): "x" for i in range(1000)}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias" and len(r.text) < 1000


def test_completions_only_fields(server):
    for field, value in [("prompt_logprobs", 21), ("prompt_logprobs", -1), ("logprobs", 21), ("echo", 1)]:
        r = _post(server.url, C, {**P, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    for field, value in [("prompt_logprobs", 1), ("echo", True)]:  # chat has no such field
        r = _post(server.url, CHAT, {**M, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


# ---- 2. logprobs, echo, scoring ----------------------------------------------------------

# prompt "w1 w2 w5": position 1 predicts w2 (the prompt's own token, -0.5), position 2
# predicts w3 (-0.5; then w4 -1.0) while the prompt has w5 (-2.0, the third most likely)
ECHO = dict(model=MODEL, prompt="w1 w2 w5", temperature=0.0, echo=True)


def test_echo_with_logprobs(pclient, psrv):
    r = pclient.completions.create(**ECHO, max_tokens=2, logprobs=1)
    c = r.choices[0]
    assert c.text == "w1 w2 w5" + "w6 w7" and c.finish_reason == "length"
    lp = c.logprobs
    assert lp.tokens == ["w1", "w2", "w5", "w6", "w7"]
    assert lp.token_logprobs == [None, -0.5, -2.0, -0.5, -0.5]
    assert lp.top_logprobs == [None, {"w2": -0.5}, {"w3": -0.5}, {"w6": -0.5}, {"w7": -0.5}]
    assert lp.text_offset == [0, 2, 4, 6, 8]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (3, 2)
    p = _last_params(psrv)
    assert (p.logprobs, p.prompt_logprobs, p.max_tokens) == (1, 1, 2)  # the engine was asked for prompt logprobs
    r = pclient.completions.create(**ECHO, max_tokens=1, logprobs=2)
    assert r.choices[0].logprobs.token_logprobs[:3] == [None, -0.5, -2.0]
    assert r.choices[0].logprobs.top_logprobs[2] == {"w3": -0.5, "w4": -1.0}


def test_echo_without_logprobs_and_token_prompts(pclient, psrv):
    r = pclient.completions.create(**ECHO, max_tokens=2)
    assert r.choices[0].text == "w1 w2 w5w6 w7" and r.choices[0].logprobs is None
    assert _last_params(psrv).prompt_logprobs is None  # nothing to score: no prompt logprobs asked for
    r = pclient.completions.create(model=MODEL, prompt=[[W0 + 1, W0 + 2], [W0 + 8]], max_tokens=1, echo=True,
                                   n=2, temperature=0)
    assert [c.text for c in r.choices] == ["w1 w2w3", "w1 w2w4", "w8w9", "w8w10"]


def test_echo_stream_matches_non_stream(pclient):
    whole = pclient.completions.create(**ECHO, max_tokens=3, logprobs=1, n=2)
    chunks = list(pclient.completions.create(**ECHO, max_tokens=3, logprobs=1, n=2, stream=True))
    for i, choice in enumerate(whole.choices):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].text.startswith("w1 w2 w5") and mine[0].logprobs.token_logprobs[0] is None
        assert "".join(c.text for c in mine) == choice.text
        for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert sum((getattr(c.logprobs, field) for c in mine), []) == getattr(choice.logprobs, field)
        assert mine[-1].finish_reason == "length"


def test_scoring_with_max_tokens_0(pclient, psrv):
    r = pclient.completions.create(**ECHO, max_tokens=0, logprobs=0)
    c = r.choices[0]
    assert (c.text, c.finish_reason) == ("w1 w2 w5", "length")
    assert c.logprobs.tokens == ["w1", "w2", "w5"] and c.logprobs.token_logprobs == [None, -0.5, -2.0]
    assert c.logprobs.top_logprobs == [None, {}, {}]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 0, 3)
    p = _last_params(psrv)
    assert (p.max_tokens, p.prompt_logprobs, p.logprobs) == (0, 0, 0)
    # echo alone: the prompt back; streamed: one chunk with the prompt, then usage
    assert pclient.completions.create(**ECHO, max_tokens=0).choices[0].text == "w1 w2 w5"
    chunks = list(pclient.completions.create(**ECHO, max_tokens=0, logprobs=1, stream=True,
                                             stream_options={"include_usage": True}))
    assert [(c.choices[0].text, c.choices[0].finish_reason) for c in chunks if c.choices] == [("w1 w2 w5", "length")]
    assert chunks[0].choices[0].logprobs.token_logprobs == [None, -0.5, -2.0]
    assert chunks[-1].usage.completion_tokens == 0
    # prompts as token ids, several of them
    r = pclient.completions.create(model=MODEL, prompt=[[W0 + 1, W0 + 2], [W0 + 4, W0 + 5]], max_tokens=0,
                                   echo=True, logprobs=1)
    assert [c.logprobs.token_logprobs for c in r.choices] == [[None, -0.5], [None, -0.5]]


def test_max_tokens_0_needs_echo_or_prompt_logprobs(server):
    r = _post(server.url, C, {**P, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = _post(server.url, CHAT, {**M, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_prompt_logprobs_vllm_shape(psrv):
    r = _post(psrv.url, C, {**P, "prompt": "w1 w2 w5", "prompt_logprobs": 1, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == "w6"
    w2, w3, w5 = (str(W0 + i) for i in (2, 3, 5))
    assert choice["prompt_logprobs"] == [
        None,
        {w2: {"logprob": -0.5, "rank": 1, "decoded_token": "w2"}},
        {w3: {"logprob": -0.5, "rank": 1, "decoded_token": "w3"},
         w5: {"logprob": -2.0, "rank": None, "decoded_token": "w5"}},  # outside the top 1: rank unknown
    ]
    assert _last_params(psrv).prompt_logprobs == 1
    # within the top k the prompt token has its rank; scoring alone with max_tokens 0
    r = _post(psrv.url, C, {**P, "prompt": "w1 w2 w5", "prompt_logprobs": 3, "max_tokens": 0})
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], r.json()["usage"]["completion_tokens"]) == ("", "length", 0)
    assert choice["prompt_logprobs"][2][w5] == {"logprob": -2.0, "rank": 3, "decoded_token": "w5"}
    assert len(choice["prompt_logprobs"][2]) == 3
    # echo logprobs and prompt_logprobs together: each its own k
    r = _post(psrv.url, C, {**P, "prompt": "w1 w2 w5", "prompt_logprobs": 0, "echo": True, "logprobs": 2})
    choice = r.json()["choices"][0]
    assert choice["prompt_logprobs"][2] == {w5: {"logprob": -2.0, "rank": None, "decoded_token": "w5"}}
    assert choice["logprobs"]["top_logprobs"][2] == {"w3": -0.5, "w4": -1.0}
    assert _last_params(psrv).prompt_logprobs == 2
    r = _post(psrv.url, C, {**P, "prompt": "w1 w2 w5", "prompt_logprobs": 1, "echo": True, "logprobs": 3})
    assert r.json()["choices"][0]["prompt_logprobs"][2] == {  # the engine's top 3 tells w5's rank
        w3: {"logprob": -0.5, "rank": 1, "decoded_token": "w3"},
        w5: {"logprob": -2.0, "rank": 3, "decoded_token": "w5"}}
    # not asked for: no field at all
    assert "prompt_logprobs" not in _post(psrv.url, C, P).json()["choices"][0]


def test_prompt_logprobs_not_streamed(server):
    r = _post(server.url, C, {**P, "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_completion_logprobs_sdk_stream(pclient):
    chunks = list(pclient.completions.create(**G, prompt="w1", max_tokens=3, logprobs=2, stream=True))
    lps = [c.choices[0].logprobs for c in chunks if c.choices]
    assert sum((lp.tokens for lp in lps), []) == ["w2", "w3", "w4"]
    assert sum((lp.text_offset for lp in lps), []) == [0, 2, 4]
    assert lps[0].top_logprobs[0] == {"w2": -0.5, "w3": -1.0}


def test_chat_logprobs_sdk_stream(pclient):
    chunks = list(pclient.chat.completions.create(messages=USER_W5, max_tokens=2, logprobs=True, top_logprobs=3,
                                                  stream=True, **G))
    content = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in content] == [("w6", -0.5), ("w7", -0.5)]
    assert [(t.token, t.logprob) for t in content[1].top_logprobs] == [("w7", -0.5), ("w8", -1.0), ("w9", -2.0)]
    r = pclient.chat.completions.create(messages=USER_W5, max_tokens=2, logprobs=True, top_logprobs=3, **G)
    assert [t.model_dump() for t in r.choices[0].logprobs.content] == [t.model_dump() for t in content]


# ---- 3. structured outputs ---------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("path,fields,expected", [
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                                       "strict": True}}},
     StructuredOutputsParams(json=SCHEMA)),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     StructuredOutputsParams(json_object=True)),
    (CHAT, {"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    (CHAT, {"response_format": {"type": "text"}}, None),
    (C, {"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    (C, {"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=SCHEMA)),
    (C, {"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredOutputsParams(json=json.dumps(SCHEMA))),
    (CHAT, {"structured_outputs": {"regex": "w[0-9]+"}}, StructuredOutputsParams(regex="w[0-9]+")),
    (C, {"structured_outputs": {"choice": ["w1", "w2"]}}, StructuredOutputsParams(choice=("w1", "w2"))),
    (CHAT, {"structured_outputs": {"grammar": "start: \"w1\""}}, StructuredOutputsParams(grammar="start: \"w1\"")),
    (CHAT, {"structured_outputs": {"json_object": True}}, StructuredOutputsParams(json_object=True)),
    (C, {"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
    (CHAT, {"guided_regex": "w1"}, StructuredOutputsParams(regex="w1")),
    (C, {"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=("a", "b"))),
    (CHAT, {"guided_grammar": "start: \"w1\""}, StructuredOutputsParams(grammar="start: \"w1\"")),
])
def test_structured_outputs_mapping(psrv, path, fields, expected):
    compiler = psrv.engine.grammar_compiler
    before = len(compiler.compiled)
    r = _post(psrv.url, path, {**(P if path == C else M), **fields})
    assert r.status_code == 200, r.text
    assert _last_params(psrv).structured_outputs == expected
    if expected is not None:  # compiled once, on the worker thread, before the engine got it
        assert compiler.compiled[before:] == [expected]
        assert all(t.startswith("pagedjax-cpu") for t in compiler.threads)


def test_structured_outputs_sdk(pclient, psrv):
    pclient.chat.completions.create(messages=USER_W5, max_tokens=2, **G, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}})
    assert _last_params(psrv).structured_outputs == StructuredOutputsParams(json=SCHEMA)


@pytest.mark.parametrize("path,fields,param,words", [
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format", "fake compiler"),
    (C, {"structured_outputs": {"regex": "("}}, "structured_outputs", "fake compiler"),
    (C, {"guided_regex": "("}, "guided_regex", "fake compiler"),
    (C, {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    (C, {"structured_outputs": {}}, "structured_outputs", "exactly one"),
    (C, {"structured_outputs": {"choice": []}}, "structured_outputs.choice", None),
    (C, {"structured_outputs": {"whitespace": "x"}}, "structured_outputs.whitespace", None),
    (CHAT, {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "at most one"),
    (CHAT, {"response_format": {"type": "xml"}}, "response_format", None),
    (CHAT, {"response_format": {"type": "json_schema"}}, "response_format.json_schema.json_schema", None),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.json_schema.name", None),
])
def test_structured_outputs_errors(psrv, path, fields, param, words):
    r = _post(psrv.url, path, {**(P if path == C else M), **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    if words:
        assert words in err["message"], err


def test_structured_outputs_without_a_compiler(server):
    r = _post(server.url, CHAT, {**M, "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "tokenizer" in r.json()["error"]["message"]
    r = _post(server.url, C, {**P, "guided_choice": ["a"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_choice"


# ---- 4. beam search ----------------------------------------------------------------------


def test_beam_search_completions(pclient, psrv):
    r = pclient.completions.create(model=MODEL, prompt="w1", max_tokens=3, n=3, temperature=0.7,  # ignored
                                   extra_body={"use_beam_search": True, "length_penalty": 0.5,
                                               "early_stopping": True})
    assert [(c.index, c.text, c.finish_reason) for c in r.choices] == [
        (0, "w2 w3 w4", "length"), (1, "w3 w4 w5", "length"), (2, "w4 w5 w6", "length")]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (1, 9)
    bp = psrv.engine.beam_params[psrv.engine.added[-1]]
    assert (bp.beam_width, bp.max_tokens, bp.length_penalty, bp.early_stopping) == (3, 3, 0.5, True)
    # several prompts, echo, EOS
    r = pclient.completions.create(model=MODEL, prompt=["w1", "w98"], max_tokens=4, n=2, echo=True,
                                   extra_body={"use_beam_search": True})
    assert [(c.text, c.finish_reason) for c in r.choices] == [
        ("w1w2 w3 w4 w5", "length"), ("w1w3 w4 w5 w6", "length"), ("w98w99", "stop"), ("w98", "stop")]
    assert wait_for(lambda: psrv.engine.free_blocks == psrv.engine.num_blocks)


def test_beam_search_chat(pclient, psrv):
    r = pclient.chat.completions.create(messages=USER_W5, max_tokens=2, n=2, extra_body={"use_beam_search": True},
                                        model=MODEL)
    assert [(c.index, c.message.content, c.finish_reason) for c in r.choices] == [
        (0, "w6 w7", "length"), (1, "w7 w8", "length")]
    bp = psrv.engine.beam_params[psrv.engine.added[-1]]
    assert (bp.beam_width, bp.max_tokens, bp.length_penalty, bp.early_stopping) == (2, 2, 1.0, False)


@pytest.mark.parametrize("path,fields,param", [
    (C, {"stream": True}, "stream"), (CHAT, {"stream": True}, "stream"),
    (C, {"logprobs": 1}, "logprobs"), (CHAT, {"logprobs": True}, "logprobs"),
    (C, {"prompt_logprobs": 1}, "prompt_logprobs"), (C, {"stop": ["w3"]}, "stop"),
    (C, {"stop_token_ids": [5]}, "stop_token_ids"), (C, {"presence_penalty": 1}, "presence_penalty"),
    (C, {"logit_bias": {"5": 1}}, "logit_bias"), (C, {"min_tokens": 1}, "min_tokens"),
    (C, {"n": 11}, "n"), (C, {"max_tokens": 0, "echo": True}, "max_tokens"),
    (C, {"guided_regex": "a"}, "guided_regex"), (CHAT, {"response_format": {"type": "json_object"}}, "response_format"),
    (C, {"cache_salt": "t"}, "cache_salt"), (C, {"bad_words": ["w3"]}, "bad_words"),
])
def test_beam_search_conflicts(psrv, path, fields, param):
    r = _post(psrv.url, path, {**(P if path == C else M), "use_beam_search": True, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and "beam" in r.json()["error"]["message"]


def test_beam_search_aborted_on_disconnect():
    engine = FakeEngine(step_delay=0.01)
    with running_server(engine) as s:
        body = {**P, "max_tokens": 200, "n": 4, "use_beam_search": True, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.url + C, json=body, timeout=0.3)
        assert wait_for(lambda: len(engine.aborted) == 1, timeout=10)
        assert wait_for(lambda: metric(s.url, "pagedjax:kv_blocks_free") == engine.num_blocks)
        assert s.async_engine.num_in_flight() == 0 and not s.async_engine._beam_searches
        r = _post(s.url, C, {**P, "n": 2, "use_beam_search": True})  # the server goes on
        assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_beam_search_counts_as_pending_sequences():
    with running_server(FakeEngine(max_num_seqs=0, step_delay=0.01), max_pending_requests=4) as s:
        r = _post(s.url, C, {**P, "n": 5, "use_beam_search": True})
        assert r.status_code == 400 and "5 sequences" in r.json()["error"]["message"]


# ---- 5. tokenize, detokenize, version, models --------------------------------------------


def test_tokenize_prompt(server):
    r = _post(server.url, "/tokenize", {"prompt": "w1 w2", "model": MODEL})
    assert r.status_code == 200
    assert r.json() == {"count": 2, "max_model_len": 256, "tokens": [W0 + 1, W0 + 2], "token_strs": None}
    r = _post(server.url, "/tokenize", {"prompt": "w1 w2", "add_special_tokens": False, "return_token_strs": True})
    assert r.json()["token_strs"] == ["w1", "w2"]


def test_tokenize_messages_as_the_chat_endpoint_renders_them(server, client):
    msgs = [{"role": "system", "content": "w3"}, {"role": "user", "content": "w1"}]
    r = _post(server.url, "/tokenize", {"messages": msgs})
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1)
    assert r.json()["count"] == chat.usage.prompt_tokens == len(r.json()["tokens"])
    tail = server.engine.tokenizer.convert_tokens_to_ids(["<|im_start|>", "assistant"])
    assert r.json()["tokens"][-2:] == tail
    r2 = _post(server.url, "/tokenize", {"messages": msgs, "add_generation_prompt": False})
    assert r2.json()["tokens"] == r.json()["tokens"][:-2]


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "w1", "messages": [{"role": "user", "content": "w1"}]},
                                  "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {"prompt": "w1", "model": "other"}, "model"),
    ("/tokenize", {"messages": []}, "messages"), ("/tokenize", {"prompt": "w1", "bogus": 1}, "bogus"),
    ("/detokenize", {"tokens": [VOCAB_SIZE]}, "tokens"), ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {}, "tokens"), ("/detokenize", {"tokens": "w1"}, "tokens"),
])
def test_tokenize_errors(server, path, body, param):
    r = _post(server.url, path, body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"].startswith(param)


def test_detokenize(server):
    r = _post(server.url, "/detokenize", {"tokens": [W0 + 1, W0 + 2], "model": MODEL})
    assert r.status_code == 200 and r.json() == {"prompt": "w1 w2"}
    assert _post(server.url, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


def test_version_and_models(server, client):
    from importlib.metadata import version

    r = httpx.get(server.url + "/version")
    assert r.status_code == 200 and r.json() == {"version": version("pagedjax")}
    assert client.models.list().data[0].max_model_len == 256
    assert client.models.retrieve(MODEL).max_model_len == 256


def test_tokenize_needs_the_api_key():
    with running_server(api_key="sekret") as s:
        assert httpx.post(s.url + "/tokenize", json={"prompt": "w1"}).status_code == 401
        assert httpx.post(s.url + "/detokenize", json={"tokens": [5]}).status_code == 401
        auth = {"Authorization": "Bearer sekret"}
        assert httpx.post(s.url + "/tokenize", json={"prompt": "w1"}, headers=auth).status_code == 200
        assert httpx.get(s.url + "/version").status_code == 200


# ---- 6. no-op fields accepted, result-changing ones rejected ------------------------------


def test_no_op_fields_are_accepted(client):
    r = client.chat.completions.create(
        model=MODEL, messages=USER_W5, max_tokens=2, temperature=0, user="u", store=True,
        metadata={"k": "v"}, service_tier="auto", safety_identifier="s", prompt_cache_key="c",
        prompt_cache_retention="24h", prediction={"type": "content", "content": "w6 w7"}, modalities=["text"],
        audio=None, extra_body={"prompt_cache_options": {"mode": "implicit", "ttl": "30m"}})
    assert r.choices[0].message.content == "w6 w7"


@pytest.mark.parametrize("field,value", [
    ("reasoning_effort", "low"), ("verbosity", "low"), ("web_search_options", {}), ("modalities", ["text", "audio"]),
    ("audio", {"voice": "alloy", "format": "wav"}), ("moderation", {"model": "m"}), ("service_tier", "cheap"),
    ("metadata", {"k": "v" * 600}), ("metadata", {str(i): "v" for i in range(17)}), ("repetition_penalties", 1),
])
def test_result_changing_or_unknown_fields_are_rejected(server, field, value):
    r = _post(server.url, CHAT, {**M, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(field), r.text


def test_no_op_fields_are_chat_only(server):
    r = _post(server.url, C, {**P, "store": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "store"


def test_prompt_logprobs_of_a_huge_request_are_refused():
    """A 4 MiB body could otherwise make the engine hold GBs of prompt log-probabilities."""
    import httpx

    from .conftest import running_server

    with running_server() as s:
        body = {"model": "fake-model", "prompt": [[5] * 200] * 1000, "max_tokens": 0, "echo": True, "logprobs": 20}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 400 and "prompt log-probabilities" in r.json()["error"]["message"]
