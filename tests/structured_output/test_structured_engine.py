"""Structured outputs and bad_words through the engine, on a tiny random model with a real
(byte-level BPE) tokenizer: whatever the random weights prefer, every output obeys its
constraint, with sampling, n > 1, stop strings and prefix caching."""
import json
import re
import shutil

import jsonschema
import pytest

from pagedjax import LLM, SamplingParams, StructuredOutputsParams
from pagedjax.structured_output.grammar import StructuredOutputError
from tiny_models import make_tokenizer

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["color", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "integer"},
                                                                                  "y": {"type": "boolean"}},
                                                "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def llm(tiny_checkpoints, tmp_path_factory):
    src, _ = tiny_checkpoints("llama")
    path = tmp_path_factory.mktemp("tiny-llama-tok")
    shutil.copytree(src, path, dirs_exist_ok=True)
    make_tokenizer(384).save_pretrained(str(path))
    return LLM(str(path), max_num_seqs=4, max_model_len=256, block_size=8, num_blocks=128,
               max_num_batched_tokens=64, warmup=False)


def _json_params(schema, **kw):
    return SamplingParams(max_tokens=200, structured_outputs=StructuredOutputsParams(json=schema), **kw)


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_outputs_validate(llm, schema):
    prompts = ["Give me JSON:", "Answer in JSON please"]
    params = [_json_params(schema), _json_params(schema, temperature=1.0, seed=3, n=2)]
    for out in llm.generate(prompts, params, use_tqdm=False):
        for o in out.outputs:
            assert o.finish_reason == "stop", o.text
            jsonschema.validate(json.loads(o.text), schema)
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_json_object_regex_and_choice(llm):
    specs = [StructuredOutputsParams(json_object=True), StructuredOutputsParams(regex=r"[a-z]{2,6}-[0-9]{3}"),
             StructuredOutputsParams(choice=("yes", "no", "a.b (maybe)"))]
    # free-form JSON from random weights may never close: make closing characters likely
    # (the grammar still decides where they are allowed)
    closing = {t: 6.0 for t in llm.tokenizer.convert_tokens_to_ids(['"', "}"])}
    params = [SamplingParams(max_tokens=120, temperature=0.8, seed=s, structured_outputs=spec,
                             logit_bias=closing if spec.json_object else None)
              for spec in specs for s in range(3)]
    outs = llm.generate(["Reply:"] * len(params), params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(isinstance(json.loads(t), dict) for t in texts[:3]), texts[:3]
    assert all(re.fullmatch(r"[a-z]{2,6}-[0-9]{3}", t) for t in texts[3:6]), texts[3:6]
    assert all(t in ("yes", "no", "a.b (maybe)") for t in texts[6:]), texts[6:]


def test_stop_strings_and_prefix_cache_with_grammar(llm):
    spec = StructuredOutputsParams(regex=r"[a-z]{3,6}@[a-z]{2,4}\.com")
    prompt = "An email address for the sales team of the company, written plainly: "
    first = llm.generate([prompt], SamplingParams(max_tokens=40, structured_outputs=spec), use_tqdm=False)[0]
    assert re.fullmatch(r"[a-z]{3,6}@[a-z]{2,4}\.com", first.outputs[0].text)
    hits = llm.stats()["prefix_cache_hit_tokens"]
    again = llm.generate([prompt], SamplingParams(max_tokens=40, structured_outputs=spec), use_tqdm=False)[0]
    assert llm.stats()["prefix_cache_hit_tokens"] > hits
    assert again.outputs[0].text == first.outputs[0].text
    cut = llm.generate([prompt], SamplingParams(max_tokens=40, structured_outputs=spec, stop=["@"]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == first.outputs[0].text.split("@")[0]


def test_bad_words_are_never_generated(llm):
    tok = llm.tokenizer
    word = next(w for w in ("the", "and", "of", "to", "in") if len(tok.encode(w, add_special_tokens=False)) == 1)
    wid = tok.encode(word, add_special_tokens=False)[0]
    pushed = SamplingParams(max_tokens=8, ignore_eos=True, logit_bias={wid: 30.0})
    assert llm.generate(["x"], pushed, use_tqdm=False)[0].outputs[0].token_ids == [wid] * 8
    banned = SamplingParams(max_tokens=8, ignore_eos=True, logit_bias={wid: 30.0}, bad_words=[word])
    assert wid not in llm.generate(["x"], banned, use_tqdm=False)[0].outputs[0].token_ids


def test_invalid_schema_is_a_clear_error(llm):
    with pytest.raises(StructuredOutputError, match="schema"):
        llm.generate(["x"], _json_params({"type": "nonsense"}), use_tqdm=False)
    with pytest.raises(StructuredOutputError, match="regex"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")), use_tqdm=False)
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]
