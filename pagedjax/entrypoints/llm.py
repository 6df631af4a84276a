"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import inspect
import itertools
from collections.abc import Sequence
from dataclasses import fields

import numpy as np

from pagedjax.config import EngineConfig
from pagedjax.core.beam_search import BeamSearchOutput, BeamSearchParams
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.entrypoints.chat_template import load_chat_template, render_conversations
from pagedjax.entrypoints.prompts import PromptInput, parse_prompts
from pagedjax.lora.request import LoRARequest
from pagedjax.outputs import EmbeddingRequestOutput, RequestOutput
from pagedjax.pooling.params import PoolingParams
from pagedjax.sampling_params import SamplingParams


class LLM:
    """Batch generation on one engine. `warmup=True` compiles the smallest step bucket at
    once and the others on a background thread: generation starts right away (steps stay
    within the compiled buckets meanwhile) and, once `wait_for_warmup()` returns, batches of
    any size and length within the limits compile nothing."""

    def __init__(self, model: str | None = None, *, warmup: bool = True, weights=None, **engine_kwargs):
        """model: a local Hugging Face dir, a Hugging Face model id (from the local Hugging Face
        cache, downloaded into it where the network allows), None for the embedded default
        model; generation_config (an engine kwarg): where get_default_sampling_params() comes
        from ("auto": the model's generation_config.json, "vllm": none, or a folder); engine_kwargs:
        any EngineConfig field (block_size, num_blocks, max_num_seqs, max_model_len, kv_cache,
        dtype, load_format, ...: the signature lists them with their defaults). weights:
        Hugging Face-named arrays (a mapping or (name, array) pairs, numpy or jax.Array) to
        use instead of the directory's weight files (its config and tokenizer are read)."""
        self.engine = LLMEngine(model, stream_text=False, weights=weights, **engine_kwargs)
        if warmup:
            self.engine.warmup(background=True)
        self._ids = itertools.count()

    def wait_for_warmup(self) -> None:
        """Blocks until every step bucket is compiled (e.g. before timing a run)."""
        self.engine.wait_for_warmup()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams a call without any uses: the engine's defaults with the model's
        generation_config.json sampling fields over them (EngineConfig.generation_config)."""
        return SamplingParams(**self.engine.sampling_defaults).held_to_room()  # max_new_tokens too is a default

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generates for every prompt; returns RequestOutputs in prompt order. A prompt is a
        str, a list of token ids, {"prompt": str} or {"prompt_token_ids": [...]} (either with
        an optional "cache_salt"); give one or a list. sampling_params: one for every prompt,
        a list with one per prompt, or None: `get_default_sampling_params()`. lora_request
        (engine started with enable_lora=True): one LoRARequest for every prompt, or a list
        with one per prompt (None: the base model)."""
        prompts = parse_prompts(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _per_prompt(sampling_params, len(prompts), SamplingParams, "SamplingParams")
        loras = _per_prompt(lora_request, len(prompts), LoRARequest, "lora requests")
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        self._add_all(ids, lambda i: self.engine.add_request(ids[i], prompts[i].prompt, params[i],
                                                             cache_salt=prompts[i].cache_salt, lora_request=loras[i]))
        return self._run(ids, use_tqdm)

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generates a reply to each conversation: `messages` is one conversation (a list of
        {"role": ..., "content": ...} dicts; content a str or a list of text parts) or a list
        of them. Rendered with the tokenizer's chat template, or `chat_template` (a Jinja file
        path or the template text), with `tools` and `chat_template_kwargs` (e.g.
        {"enable_thinking": False}) passed to it; add_generation_prompt opens the assistant's
        turn; continue_final_message (add_generation_prompt=False) continues a final assistant
        message instead. Returns RequestOutputs as generate does (`.prompt`: the rendered text)."""
        rendered = render_conversations(self.tokenizer, messages, chat_template=load_chat_template(chat_template),
                                        tools=tools, add_generation_prompt=add_generation_prompt,
                                        continue_final_message=continue_final_message,
                                        chat_template_kwargs=chat_template_kwargs)
        outs = self.generate([{"prompt_token_ids": ids} for _, ids in rendered], sampling_params, use_tqdm,
                             lora_request)
        for out, (text, _) in zip(outs, rendered):
            out.prompt = text
        return outs

    def embed(self, prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, use_tqdm: bool = True, *,
              normalize: bool = True, dimensions: int | None = None) -> list[EmbeddingRequestOutput]:
        """Embeds every prompt (prefill only, through the same scheduler as generation);
        returns EmbeddingRequestOutputs in prompt order, each with `.outputs.embedding` (numpy
        float32 [D], also `.embedding`) and `.prompt_token_ids`. Pooling is the engine's
        `pooling_type` (last token or mean over the prompt). normalize: L2-normalize (default);
        dimensions: keep the first D values (then normalize). pooling_params: instead of
        normalize/dimensions, one PoolingParams for every prompt or one per prompt."""
        prompts = _plain_prompts(prompts, "embeddings")
        if pooling_params is None:
            params = [PoolingParams(normalize=normalize, dimensions=dimensions)] * len(prompts)
        elif not normalize or dimensions is not None:
            raise ValueError("give either pooling_params or normalize/dimensions, not both")
        else:
            params = _per_prompt(pooling_params, len(prompts), PoolingParams, "PoolingParams")
        ids = [f"embd-{next(self._ids)}" for _ in prompts]
        self._add_all(ids, lambda i: self.engine.add_embed_request(ids[i], prompts[i], params[i]))
        return self._run(ids, use_tqdm, "embedding", count_tokens=False)

    def _add_all(self, ids: list[str], add) -> None:
        """add(i) (adds request ids[i] to the engine) for every i, or for none: an error aborts
        those already added (nothing is left queued behind a failed call)."""
        added = []
        try:
            for i, rid in enumerate(ids):
                add(i)
                added.append(rid)
        except Exception:
            for rid in added:
                self.engine.abort_request(rid)
            raise

    def _run(self, ids: list[str], use_tqdm: bool, desc: str = "generating", count_tokens: bool = True) -> list:
        from tqdm import tqdm

        done: dict = {}
        bar = tqdm(total=len(ids), desc=desc, unit="req", disable=not use_tqdm)
        tokens_before = self.engine.num_generated_tokens  # the bar counts this call's tokens
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
                        if count_tokens:  # embeddings generate none
                            bar.set_postfix(tokens=self.engine.num_generated_tokens - tokens_before)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[rid] for rid in ids]

    def beam_search(self, prompts, beam_width: int | None = None, max_tokens: int | None = None, *,
                    params: BeamSearchParams | None = None, use_tqdm: bool = True) -> list[BeamSearchOutput]:
        """Beam search for every prompt (beams share KV blocks, copy-on-write); outputs in
        prompt order, each with up to beam_width finished sequences, best first."""
        from tqdm import tqdm

        prompts = _plain_prompts(prompts, "beam search")
        params = params or BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens)
        ids = [f"beam-{next(self._ids)}" for _ in prompts]
        try:
            for rid, prompt in zip(ids, prompts):
                self.engine.add_beam_search(rid, prompt, params)
            with tqdm(total=len(ids), desc="beam search", unit="req", disable=not use_tqdm) as bar:
                while any(rid not in self.engine.finished_beam_searches for rid in ids):
                    self.engine.step()
                    bar.n = sum(rid in self.engine.finished_beam_searches for rid in ids)
                    bar.refresh()
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return [self.engine.finished_beam_searches.pop(rid) for rid in ids]

    def stats(self) -> dict:
        return self.engine.stats()

    def close(self) -> None:
        """Waits for the disk KV tier's pending writes (kv_offload_dir; a no-op without it), so
        that a later engine on the same folder finds every block. Idempotent; also at the end
        of `with LLM(...) as llm:`."""
        self.engine.close_kv_tiers()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- inside a training loop (docs/design/integration.md) ---------------------------------
    def update_weights(self, weights, transform=None) -> int:
        """New weights from memory between generate calls: Hugging Face-named arrays (a
        mapping or (name, array) pairs; jax.Array on any device or numpy; any subset). The
        engine's layout (fused projections, stacked layers, 8-bit re-quantization, shards) is
        its own business. All or nothing; compiles no step; drops the prefix cache. Returns the
        number of engine parameters written. transform: a jnp function of `weights` returning
        the Hugging Face-named arrays (e.g. from a trainer's own layout), compiled into the
        same update so the weights are read once."""
        return self.engine.update_weights(weights, transform)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix (e.g. after changing the weights by other means)."""
        return self.engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Releases device memory while the process trains: level 1 the KV pool, level 2 the
        weights too (kept on the host). generate raises until wake_up()."""
        self.engine.sleep(level)

    def wake_up(self) -> None:
        """Restores what sleep released, compiling nothing."""
        self.engine.wake_up()

    def score(self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
              use_tqdm: bool = False, lora_request: LoRARequest | None = None) -> list[np.ndarray]:
        """The model's log-probability of each completion token after its prompt (token ids):
        one float32 array [len(completion)] per pair, raw log_softmax of the logits (no
        temperature). Batched through the scheduler like prompts (chunked prefill; a prompt's
        blocks may come from the prefix cache, e.g. n completions of one prompt). lora_request:
        score with that adapter (enable_lora)."""
        prompts, completions = [list(p) for p in prompts], [list(c) for c in completions]
        if len(prompts) != len(completions):
            raise ValueError(f"got {len(prompts)} prompts and {len(completions)} completions; give one of each per pair")
        ids = [f"score-{next(self._ids)}" for _ in prompts]
        self._add_all(ids, lambda i: self.engine.add_score_request(ids[i], prompts[i], completions[i], lora_request))
        outs = self._run(ids, use_tqdm, "scoring", count_tokens=False)
        return [np.array([entry[tok] for entry, tok in zip(out.prompt_logprobs[len(p):], c)], np.float32)
                for out, p, c in zip(outs, prompts, completions)]


def _per_prompt(value, n: int, one: type, what: str) -> list:
    """One value for each of n prompts: `value` itself n times (a `one` or None), or a
    sequence of exactly n."""
    if value is None or isinstance(value, one):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"got {len(values)} {what} for {n} prompts; pass one, or exactly one per prompt")
    return values


def _plain_prompts(prompts, what: str) -> list[str | list[int]]:
    """The prompts (as generate takes them) as strs and token-id lists; a cache_salt is
    refused (it is a generation option)."""
    parsed = parse_prompts(prompts)
    if any(p.cache_salt is not None for p in parsed):
        raise ValueError(f"'cache_salt' is not supported for {what}; leave it out of the prompt dicts")
    return [p.prompt for p in parsed]


def _signature() -> inspect.Signature:
    """LLM(model, *, <every EngineConfig field with its default>, warmup)."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
              inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)]
    params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default)
               for f in fields(EngineConfig) if f.name != "model"]
    params.append(inspect.Parameter("warmup", inspect.Parameter.KEYWORD_ONLY, default=True))
    params.append(inspect.Parameter("weights", inspect.Parameter.KEYWORD_ONLY, default=None))
    return inspect.Signature(params)


LLM.__init__.__signature__ = _signature()
