"""After warm-up, new batch sizes and lengths compile nothing; warm-up compiles few shapes."""
import jax
import numpy as np

from pagedjax import LLM, SamplingParams

_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileEvents:
    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event, duration, **kw):
        if event == _EVENT:
            self.count += 1


def test_no_compilation_after_first_generate(tiny_checkpoints):
    events = CompileEvents()
    path, _ = tiny_checkpoints("qwen2")
    llm = LLM(str(path), max_num_seqs=4, max_model_len=96, block_size=8, num_blocks=64,
              max_num_batched_tokens=64)
    rng = np.random.default_rng(0)
    llm.generate([[3, 4, 5]], SamplingParams(max_tokens=2), use_tqdm=False)  # while buckets compile
    llm.wait_for_warmup()
    after_first = events.count
    assert after_first > 0
    assert llm.engine.runner.compiled_shapes == [8, 16, 32, 48, 64]  # one packed step shape per rung
    for batch, (lo, hi), max_tokens in [(1, (1, 5), 3), (3, (10, 40), 17), (7, (30, 80), 9), (2, (60, 90), 6)]:
        prompts = [rng.integers(2, 300, size=int(rng.integers(lo, hi))).tolist() for _ in range(batch)]
        params = [SamplingParams(max_tokens=max_tokens, temperature=t, top_k=k, top_p=0.9, seed=i)
                  for i, (t, k) in enumerate([(0.0, 0), (0.8, 5)] * batch)][:batch]
        llm.generate(prompts, params, use_tqdm=False)
    assert events.count == after_first, "a workload inside the configured limits triggered an XLA compile"
    assert llm.stats()["kv_blocks_free"] == 64


def test_background_warmup_yields_to_steps_that_fit_and_resumes_when_idle_or_full(tiny_checkpoints):
    """The warm-up thread holds before its next bucket while requests run in compiled buckets
    (it would slow them), goes on when a step fills its budget (bigger buckets are wanted)
    or the engine is idle, and `wait_for_warmup` always finishes it."""
    path, _ = tiny_checkpoints("qwen2")
    llm = LLM(str(path), max_num_seqs=4, max_model_len=256, block_size=8, num_blocks=64, max_num_batched_tokens=64)
    engine, go = llm.engine, llm.engine.runner.background_warmup.go
    engine.add_request("small", [3, 4, 5], SamplingParams(max_tokens=3))
    engine.step()
    assert not go.is_set(), "a 3-token step fits every bucket: the warm-up should wait"
    while engine.has_unfinished_requests():
        engine.step()
    assert go.is_set(), "idle engine: the warm-up should go on"
    engine.add_request("long", list(range(2, 202)), SamplingParams(max_tokens=2))
    engine.step()
    assert go.is_set(), "a 200-token prompt fills the step budget: the warm-up should go on"
    engine.abort_request("long")
    engine.add_request("small2", [3, 4, 5], SamplingParams(max_tokens=3))
    engine.step()
    llm.wait_for_warmup()  # finishes even while a request holds it
    assert llm.engine.runner.compiled_shapes == [8, 16, 32, 48, 64] and go.is_set()
    assert llm.engine.runner._primed == {8, 16, 32, 48, 64}  # each ran once, off the request path
    engine.step()
    assert go.is_set(), "after wait_for_warmup nothing holds the warm-up again"
    while engine.has_unfinished_requests():
        engine.step()


def test_default_configuration_compiles_eleven_step_shapes():
    from pagedjax.core.buckets import Buckets

    assert Buckets(64, 2048).token_buckets() == [8, 16, 32, 48, 64, 96, 128, 256, 512, 1024, 2048]
    assert Buckets(64, 2048).all_shapes()[:3] == [(8, 8), (16, 16), (32, 32)]
    assert Buckets(64, 2048).all_shapes()[-1] == (2048, 64)
    assert Buckets(4, 100).token_buckets() == [8, 16, 32, 48, 64, 96, 100]


def test_no_compilation_after_warmup_across_every_sampling_feature(tiny_checkpoints, tmp_path):
    """Penalties, logit bias, token masks, grammars, logprobs, prompt logprobs, scoring and
    beam search are operands of the compiled steps, never new shapes."""
    import shutil

    from pagedjax import BeamSearchParams, StructuredOutputsParams
    from tiny_models import make_tokenizer

    src, _ = tiny_checkpoints("qwen2")
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    make_tokenizer(384).save_pretrained(str(tmp_path))
    llm = LLM(str(tmp_path), max_num_seqs=4, max_model_len=128, block_size=8, num_blocks=64,
              max_num_batched_tokens=64)
    llm.wait_for_warmup()
    llm.engine.grammar_compiler  # built at first use (host only)
    events = CompileEvents()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = [
        SamplingParams(max_tokens=12, presence_penalty=0.5, frequency_penalty=0.3, logprobs=3),
        SamplingParams(max_tokens=9, repetition_penalty=1.2, logit_bias={5: 2.0}, temperature=0.7, seed=1),
        SamplingParams(max_tokens=30, structured_outputs=StructuredOutputsParams(json=schema), n=2),
        SamplingParams(max_tokens=5, min_tokens=3, allowed_token_ids=[3, 4, 5, 1], bad_words=["ab"]),
        SamplingParams(max_tokens=4, prompt_logprobs=5),
        SamplingParams(max_tokens=0, prompt_logprobs=1),
        SamplingParams(max_tokens=6, structured_outputs=StructuredOutputsParams(choice=("x", "yz"))),
    ]
    prompts = ["hello there", [3, 4, 5, 6, 7] * 9, "json please", [9, 8, 7], "score this text", "and this", "pick"]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[5].outputs[0].token_ids == [] and outs[4].prompt_logprobs[1] is not None
    llm.beam_search([[3, 4, 5]], params=BeamSearchParams(beam_width=2, max_tokens=4))
    assert events.count == 0, "a sampling feature triggered an XLA compile after warm-up"
    assert llm.stats()["kv_blocks_free"] == 64


def test_persistent_cache_keeps_every_executable(tmp_path):
    """A warm start compiles nothing only if quick compiles are cached too: pagedjax sets
    JAX's threshold to 0 s, unless the user set one; it uses the user's cache dir if any."""
    import os
    import subprocess
    import sys

    code = ("import jax; from pagedjax.worker import compile_counter; compile_counter.enable_persistent_cache(); "
            "print(jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)")
    env = {k: v for k, v in os.environ.items() if k not in ("PAGEDJAX_COMPILE_CACHE", "JAX_COMPILATION_CACHE_DIR",
                                                            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")}

    def run(**extra):
        out = subprocess.run([sys.executable, "-c", code], env={**env, "PAGEDJAX_CACHE": str(tmp_path), **extra},
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        directory, seconds = out.stdout.split()
        return directory, float(seconds)

    assert run() == (str(tmp_path / "jax_compilation_cache"), 0.0)
    assert run(JAX_COMPILATION_CACHE_DIR=str(tmp_path / "mine")) == (str(tmp_path / "mine"), 0.0)
    assert run(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="2.5")[1] == 2.5
