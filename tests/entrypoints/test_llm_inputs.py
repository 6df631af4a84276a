"""The offline API's inputs as vLLM's: prompt dicts, LLM.chat, a model given as a Hugging Face
id (a fake Hugging Face cache holding a tiny random Llama), the model's generation_config.json
sampling defaults, include_stop_str_in_output, truncate_prompt_tokens, and the progress bar's
token count. One engine for the module."""
from __future__ import annotations

import json
import shutil

import pytest

from pagedjax import SamplingParams

REPO = "tiny-org/tiny-llama"
REVISION = "0123456789abcdef0123456789abcdef01234567"
# ChatML with a variable chat_template_kwargs can set (as Qwen 3's enable_thinking)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
            "{% if not (continue_final_message and loop.last) %}<|im_end|>\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}")
GENERATION_DEFAULTS = {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1,
                       "max_new_tokens": 7}
GREEDY = dict(temperature=0.0, ignore_eos=True)


def make_hub_cache(root, checkpoint, generation: dict | None = None):
    """A Hugging Face cache at `root` holding REPO: the checkpoint, a tokenizer with TEMPLATE
    and a generation_config.json with `generation`; returns the snapshot dir."""
    from tiny_models import make_tokenizer

    repo = root / ("models--" + REPO.replace("/", "--"))
    snapshot = repo / "snapshots" / REVISION
    shutil.copytree(checkpoint, snapshot)
    tokenizer = make_tokenizer(384)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(str(snapshot))
    (snapshot / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1,
                                                                 **(generation or {})}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.fixture(scope="module")
def hub(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-hub")
    return root, make_hub_cache(root, tiny_checkpoints("llama")[0], GENERATION_DEFAULTS)


@pytest.fixture(scope="module")
def llm(hub):
    """LLM(REPO) with the fake cache as the Hugging Face cache, offline."""
    from pagedjax import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_CACHE", str(hub[0]))
        mp.setenv("HF_HUB_OFFLINE", "1")
        # small chunks and batches: few step shapes to compile
        return LLM(REPO, max_model_len=256, block_size=16, num_blocks=64, max_num_batched_tokens=32, max_num_seqs=4,
                   dtype="float32", warmup=False)


@pytest.fixture(scope="module")
def tokenizer(hub):
    """The snapshot's tokenizer, loaded apart from the engine's."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(hub[1]))


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_a_hugging_face_id_loads_from_the_cache(llm, hub):
    assert llm.engine.model_dir == hub[1] and llm.engine.model_name == REPO


def test_prompt_dicts_are_the_same_prompts(llm, tokenizer):
    text = '{"name": "Alice", "tags"'
    ids = tokenizer.encode(text)
    params = SamplingParams(max_tokens=4, **GREEDY)
    plain = llm.generate([text, ids], params, use_tqdm=False)
    dicts = llm.generate([{"prompt": text}, {"prompt_token_ids": ids, "cache_salt": "tenant-a"}], params,
                         use_tqdm=False)
    assert tokens(dicts) == tokens(plain) and plain[0].prompt_token_ids == ids
    assert [o.prompt for o in dicts] == [text, None]
    one = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)  # a single dict
    assert tokens(one) == tokens(plain)[1:]


@pytest.mark.parametrize("prompts, error, message", [
    ({"prompt": "hi", "multi_modal_data": {"image": None}}, ValueError,
     "prompt: multi_modal_data is not supported (pagedjax serves text-only models)"),
    ([{"prompt": "hi", "foo": 1}], ValueError, "prompts[0]: unknown key 'foo'"),
    ([{"prompt": "hi", "prompt_token_ids": [1]}], ValueError, "give either 'prompt' or 'prompt_token_ids', not both"),
    ([{"prompt_token_ids": "12"}], TypeError, "prompts[0]['prompt_token_ids'] must be a list of int token ids"),
    (["ok", 3.5], TypeError, "prompts[1] must be a str, a list of token ids, {'prompt': str} or"),
    ({}, ValueError, "a prompt dict needs 'prompt' (a str) or 'prompt_token_ids'"),
])
def test_bad_prompts_name_what_is_wrong(llm, prompts, error, message):
    with pytest.raises(error) as e:
        llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    assert message in str(e.value)
    assert not llm.engine.has_unfinished_requests()


def test_chat_is_the_template_rendered_then_generated(llm, tokenizer):
    params = SamplingParams(max_tokens=4, **GREEDY)
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"}]
    ids = tokenizer.apply_chat_template(convo, add_generation_prompt=True, tokenize=True, return_dict=False)
    out = llm.chat(convo, params, use_tqdm=False)
    ref = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    assert out[0].prompt_token_ids == ids and tokens(out) == tokens(ref)
    assert out[0].prompt == tokenizer.apply_chat_template(convo, add_generation_prompt=True, tokenize=False)
    # several conversations, content as text parts, kwargs reaching the template
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world!"}]}]
    outs = llm.chat([convo, parts], params, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})
    assert outs[0].prompt.endswith("<|im_start|>assistant\n<think></think>")
    assert outs[1].prompt.startswith("<|im_start|>user\nHello, world!<|im_end|>")


def test_chat_continues_a_final_assistant_message(llm, tokenizer):
    convo = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "The quick"}]
    out = llm.chat(convo, SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False, add_generation_prompt=False,
                   continue_final_message=True)
    assert out[0].prompt.endswith("<|im_start|>assistant\nThe quick")
    assert out[0].prompt_token_ids == tokenizer.apply_chat_template(
        convo, continue_final_message=True, tokenize=True, return_dict=False)
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt cannot both be true"):
        llm.chat(convo, continue_final_message=True)
    with pytest.raises(ValueError, match="continue_final_message needs the last message to be an assistant"):
        llm.chat(convo[:1], add_generation_prompt=False, continue_final_message=True)


def test_chat_with_a_template_of_its_own(llm, tmp_path):
    params = SamplingParams(max_tokens=1, **GREEDY)
    inline = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {{ mood }}{% endfor %}"
    out = llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False, chat_template=inline,
                   chat_template_kwargs={"mood": "calm"})
    assert out[0].prompt == "[user] hi calm"
    path = tmp_path / "template.jinja"
    path.write_text("{{ messages[0]['content'] | upper }}")
    assert llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False,
                    chat_template=str(path))[0].prompt == "HI"
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        llm.chat([{"role": "user", "content": "hi"}], chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="chat_template_kwargs may not set tokenize"):
        llm.chat([{"role": "user", "content": "hi"}], chat_template_kwargs={"tokenize": True})
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]: only text parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_generation_config_gives_the_default_sampling_params(llm, monkeypatch):
    expected = dict(temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, repetition_penalty=1.1, max_tokens=7)
    defaults = llm.get_default_sampling_params()
    assert {k: getattr(defaults, k) for k in expected} == expected
    seen = []
    add = llm.engine.add_request
    monkeypatch.setattr(llm.engine, "add_request", lambda rid, prompt, params, **kw: (seen.append(params),
                                                                                     add(rid, prompt, params, **kw)))
    llm.generate("Hello", use_tqdm=False)  # no sampling params: the model's defaults
    llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)  # given: its own (greedy)
    assert {k: getattr(seen[0], k) for k in expected} == expected
    assert (seen[1].temperature, seen[1].top_k, seen[1].max_tokens) == (0.0, 0, 2)


def test_include_stop_str_in_output(llm):
    base = llm.generate("Hello", SamplingParams(max_tokens=16, **GREEDY), use_tqdm=False)[0].outputs[0].text
    # a two-character stop string that first occurs in the second half
    i = next(i for i in range(len(base) // 2, len(base) - 1) if base.find(base[i:i + 2]) == i and base[i:i + 2].strip())
    stop = base[i:i + 2]
    cut = llm.generate("Hello", SamplingParams(max_tokens=16, stop=[stop], **GREEDY), use_tqdm=False)[0].outputs[0]
    kept = llm.generate("Hello", SamplingParams(max_tokens=16, stop=[stop], include_stop_str_in_output=True,
                                                **GREEDY), use_tqdm=False)[0].outputs[0]
    assert (cut.text, cut.finish_reason, cut.stop_reason) == (base[:i], "stop", stop)
    assert (kept.text, kept.finish_reason, kept.stop_reason) == (base[:i + 2], "stop", stop)
    assert kept.token_ids == cut.token_ids  # the same tokens; only the text differs
    # streamed: the deltas add up to the same text (nothing held back, nothing cut off)
    engine, out = llm.engine, llm.engine.output
    engine.output.stream_text = out.output_deltas = True
    try:
        engine.add_request("streamed", "Hello", SamplingParams(max_tokens=16, stop=[stop],
                                                               include_stop_str_in_output=True, **GREEDY))
        deltas = []
        while engine.has_unfinished_requests():
            deltas += [o.outputs[0].text for o in engine.step() if o.request_id == "streamed"]
    finally:
        out.stream_text = out.output_deltas = False
    assert "".join(deltas) == base[:i + 2] and len([d for d in deltas if d]) > 1


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm, tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    short = llm.generate({"prompt_token_ids": ids[-3:]}, SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
    cut = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=3, truncate_prompt_tokens=3, **GREEDY),
                       use_tqdm=False)
    whole = llm.generate(ids, SamplingParams(max_tokens=3, truncate_prompt_tokens=-1, **GREEDY), use_tqdm=False)
    assert cut[0].prompt_token_ids == ids[-3:] and tokens(cut) == tokens(short)
    assert whole[0].prompt_token_ids == ids  # -1: the last max_model_len (256) tokens, all of these
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be an integer >= 1"):
        SamplingParams(truncate_prompt_tokens=0)


def test_the_progress_bar_counts_this_calls_tokens(llm, capsys):
    params = SamplingParams(max_tokens=3, **GREEDY)
    for _ in range(2):
        llm.generate(["Hello", "world"], params)
        err = capsys.readouterr().err
        assert "tokens=6" in err and "tokens=12" not in err
