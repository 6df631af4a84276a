"""The embedded default model: first tokens equal transformers' on the same GGUF."""
import pytest

from pagedjax import LLM, SamplingParams

NEW_TOKENS = 12


def test_default_model_matches_transformers_gguf(default_model_path, default_tokenizer):
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    from pagedjax.models.default_model import default_gguf_path

    gguf = default_gguf_path(progress=False)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    chat = default_tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                 add_generation_prompt=True, tokenize=False)
    prompts = [chat, "The three primary colors are", "def fibonacci(n):"]
    llm = LLM(None, max_model_len=256, max_num_seqs=4, warmup=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = default_tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == want, (prompt, out.outputs[0].text)
    assert "Paris" in outs[0].outputs[0].text
