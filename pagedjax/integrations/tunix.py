"""pagedjax as a Tunix rollout engine: `RLCluster(..., ClusterConfig(rollout_engine=PagedJaxRollout))`.

Tunix (google-tunix, `pip install -e ".[tunix]"`) trains a Flax NNX actor and asks its
rollout engine for samples, their log-probabilities and, after each step, to take the new
weights. PagedJaxRollout serves Tunix's own Qwen 3 and Llama 3 models: at construction it
reads the actor's config into a Hugging Face config (a temporary directory holding only
config.json), starts an engine with `load_format="dummy"` and sends it the actor's weights
through `LLM.update_weights`, as it does again at every `update_params`. Prompts are
tokenized as Tunix's own sampler does (BOS, then the text), so greedy rollouts equal its
VanillaRollout token for token; identical prompts (Tunix repeats each one per generation)
run as one request with n samples that share the prompt's KV blocks.

A qwix LoRA actor runs as the base weights plus a pagedjax LoRA adapter: Tunix then syncs
only the LoRA matrices, and only they move (written as a PEFT adapter, loaded into the
engine's LoRA slot). Not supported yet: Tunix's offload_to_cpu (use `rollout.llm.sleep()` to
free the engine's memory instead), mixture-of-experts Qwen 3.
"""
from __future__ import annotations

import functools
import inspect
import json
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

try:
    from tunix.rl.rollout import base_rollout
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("pagedjax.integrations.tunix needs Tunix: pip install -e \".[tunix]\" (google-tunix)") from e

from pagedjax.entrypoints.llm import LLM
from pagedjax.sampling_params import SamplingParams


def _family(actor) -> str:
    from tunix.models.llama3 import model as llama3
    from tunix.models.qwen3 import model as qwen3

    if isinstance(actor, qwen3.Qwen3):
        if getattr(actor.config, "num_experts", None):
            raise NotImplementedError("PagedJaxRollout does not serve mixture-of-experts Qwen 3 actors yet")
        return "qwen3"
    if isinstance(actor, llama3.Llama3):
        return "llama3"
    raise NotImplementedError(f"PagedJaxRollout serves Tunix's Qwen 3 and Llama 3 models, got {type(actor).__name__}")


def _rope_theta(actor, family: str) -> float:
    """The RoPE base the actor's attention really uses: Tunix 0.1.7 calls apply_rope without
    the config's rope_theta (so its default, 1e6, applies), and the engine must compute what
    the trained model computes."""
    import importlib

    module = importlib.import_module(f"tunix.models.{family}.model")  # (a qwix LoRA actor's class is made anew)
    attention = module.Attention.__call__
    if "rope_theta" in inspect.getsource(attention):
        return float(actor.config.rope_theta)
    return float(inspect.signature(module.apply_rope).parameters["rope_theta"].default)


def hf_config(actor, max_position_embeddings: int, bos_id: int | None, eos_id: int) -> dict:
    """A Hugging Face config.json (as a dict) for a Tunix Qwen 3 / Llama 3 actor."""
    family, c = _family(actor), actor.config
    tied = c.use_tied_embedding if family == "qwen3" else c.weight_tying
    return {"architectures": ["Qwen3ForCausalLM" if family == "qwen3" else "LlamaForCausalLM"],
            "model_type": family if family == "qwen3" else "llama", "vocab_size": c.vocab_size,
            "hidden_size": c.embed_dim, "intermediate_size": c.hidden_dim, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "rms_norm_eps": c.norm_eps, "rope_theta": _rope_theta(actor, family), "hidden_act": "silu",
            "max_position_embeddings": max_position_embeddings, "tie_word_embeddings": bool(tied),
            "attention_bias": False, "bos_token_id": bos_id, "eos_token_id": eos_id, "torch_dtype": "float32"}


def flat_params(state: nnx.State) -> dict[str, jax.Array]:
    """A Tunix parameter state as {"layers.0.attn.q_proj.w": array, ...}."""
    return {".".join(map(str, path)): var.get_value() if hasattr(var, "get_value") else var
            for path, var in nnx.to_flat_state(state)}


def hf_transform(config: dict):
    """The jnp function: flat Tunix Qwen 3 / Llama 3 parameters -> Hugging Face-named arrays
    ([out, in]); LLM.update_weights compiles it into the engine's update (one pass)."""
    dims = (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"])
    return functools.partial(_to_hf, dims=dims)


def _to_hf(flat: dict, dims: tuple) -> dict:
    d, n, k, h = dims
    out = {}
    for key, x in flat.items():
        if key == "embedder.input_embedding":
            out["model.embed_tokens.weight"] = x
        elif key == "final_norm.w":
            out["model.norm.weight"] = x
        elif key == "lm_head.w":
            out["lm_head.weight"] = x.T
        elif key.startswith("layers."):
            _, i, *rest = key.split(".")
            p, rest = f"model.layers.{i}.", ".".join(rest)
            if rest in ("attn.q_proj.w", "attn.k_proj.w", "attn.v_proj.w"):
                heads = n if rest.startswith("attn.q") else k
                out[p + f"self_attn.{rest.split('.')[1]}.weight"] = x.reshape(d, heads * h).T
            elif rest == "attn.o_proj.w":
                out[p + "self_attn.o_proj.weight"] = x.reshape(n * h, d).T
            elif rest in ("attn.q_norm.w", "attn.k_norm.w"):
                out[p + f"self_attn.{rest.split('.')[1]}.weight"] = x
            elif rest in ("mlp.gate_proj.kernel", "mlp.up_proj.kernel", "mlp.down_proj.kernel"):
                out[p + f"mlp.{rest.split('.')[1]}.weight"] = x.T
            elif rest in ("input_layernorm.w", "post_attention_layernorm.w"):
                out[p + f"{rest.split('.')[0]}.weight"] = x
            else:
                raise ValueError(f"unexpected Tunix parameter {key!r}")
        else:
            raise ValueError(f"unexpected Tunix parameter {key!r}")
    return out


def _own_mesh(method):
    """Runs an engine call outside the mesh Tunix sets around rollouts (the engine places
    its arrays on a mesh of its own; an ambient one would conflict with it in tracing)."""
    @functools.wraps(method)
    def run(*args, **kwargs):
        with jax.set_mesh(None):
            return method(*args, **kwargs)

    return run


class PagedJaxRollout(base_rollout.BaseRollout):
    """A Tunix rollout engine on a pagedjax LLM (see the module doc). engine_kwargs: any
    LLM option (block_size, num_blocks, max_num_seqs, kv_cache_memory_gb, ...); a subclass
    or functools.partial may set them for RLCluster, which passes only Tunix's arguments.
    share_prompts=False runs every sample as its own request (for comparisons).
    A qwix LoRA actor (its LoRA matrices nnx.LoRAParam) runs as the base weights plus a pagedjax
    LoRA adapter: give lora_alpha, the qwix LoraProvider's alpha (its scale is alpha / rank;
    qwix does not store it on the model), e.g. functools.partial(PagedJaxRollout, lora_alpha=8.0)."""

    @_own_mesh
    def __init__(self, rollout_actor=None, tokenizer=None, mesh=None, rollout_config=None, share_prompts: bool = True,
                 lora_alpha: float | None = None, **engine_kwargs):
        if rollout_actor is None or tokenizer is None:
            raise ValueError("PagedJaxRollout needs rollout_actor (a Tunix Qwen 3 / Llama 3 model) and tokenizer")
        from tunix.generate.tokenizer_adapter import TokenizerAdapter

        self.tokenizer = tokenizer if isinstance(tokenizer, TokenizerAdapter) else TokenizerAdapter(tokenizer)
        self.mesh = mesh
        self.share_prompts = share_prompts
        config = rollout_config or base_rollout.RolloutConfig()
        state = nnx.state(rollout_actor, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
        lora = nnx.state(rollout_actor, nnx.LoRAParam)
        self._lora = None  # the adapter's LoRARequest, when the actor has LoRA matrices
        self._lora_alpha, self._lora_dirs = lora_alpha, []
        if jax.tree.leaves(lora):
            if lora_alpha is None:
                raise ValueError("the actor has qwix LoRA matrices: give PagedJaxRollout lora_alpha (the "
                                 "LoraProvider's alpha), e.g. functools.partial(PagedJaxRollout, lora_alpha=8.0)")
            targets = sorted({str(path[-2]) for path, _ in nnx.to_flat_state(lora)})
            engine_kwargs.update(enable_lora=True, max_loras=1, max_cpu_loras=2,
                                 max_lora_rank=max(_lora_rank(lora), engine_kwargs.get("max_lora_rank", 0)),
                                 lora_target_modules=targets)
        leaf_dtype = jax.tree.leaves(state)[0].dtype
        dtype = jnp.dtype(config.data_type or leaf_dtype).name
        max_len = max(config.kv_cache_size or 0, config.max_prompt_length + config.max_tokens_to_generate)
        self._config = hf_config(rollout_actor, max_len, self.tokenizer.bos_id(), self.tokenizer.eos_id())
        self._transform = hf_transform(self._config)  # one function object: its compiled update is reused
        self._dir = tempfile.TemporaryDirectory(prefix="pagedjax-tunix-")
        (Path(self._dir.name) / "config.json").write_text(json.dumps(self._config))
        engine_kwargs.setdefault("max_num_seqs", 64)
        self.llm = LLM(self._dir.name, load_format="dummy", dtype=dtype, max_model_len=max_len,
                       warmup=engine_kwargs.pop("warmup", False), **engine_kwargs)
        self.update_params(state)
        if jax.tree.leaves(lora):
            self.update_params(lora)

    # -- Tunix's interface ------------------------------------------------------------------
    def model(self):
        """None: the engine holds its own copy of the weights in its own layout, never the
        actor's arrays, so Tunix must send every update through update_params (it skips them
        when model() shares the actor's arrays; its sharing check also needs the same tree
        structure as the actor's, which the engine's model does not have)."""
        return None

    def pad_id(self) -> int:
        return self.tokenizer.pad_id()

    def eos_id(self) -> int:
        return self.tokenizer.eos_id()

    @_own_mesh
    def update_params(self, params, filter_types=None) -> None:
        """Takes the actor's new parameters (a Tunix Qwen 3 / Llama 3 nnx.State, or the subset
        it trains): converted to Hugging Face names on the device and written into the engine
        (LLM.update_weights: no compilation of a step, the prefix cache dropped)."""
        flat = list(nnx.to_flat_state(params))
        lora = [(path, v) for path, v in flat if isinstance(v, nnx.LoRAParam)]
        base = [(path, v) for path, v in flat if not isinstance(v, nnx.LoRAParam)]
        with jax.transfer_guard("allow"):  # Tunix syncs inside "disallow_explicit" on CPU
            if base:
                self.llm.update_weights(flat_params(nnx.from_flat_state(base)), transform=self._transform)
            if lora:
                self._load_adapter(lora)

    @_own_mesh
    def generate(self, prompts, rollout_config, **kwargs) -> base_rollout.RolloutOutput:
        """Samples for each prompt (Tunix repeats a prompt once per generation: runs of equal
        prompts become one request with n samples sharing its blocks)."""
        prompts = [str(p) for p in prompts]
        ids = [self._tokenize(p) for p in prompts]
        width = max(len(x) for x in ids)
        pad_to = rollout_config.max_prompt_length
        if pad_to is None or pad_to < width:  # as Tunix's sampler: the next power of two
            pad_to = 1 << (width - 1).bit_length()
        eos = tuple(rollout_config.eos_tokens or (self.eos_id(),))
        groups = _runs(prompts) if self.share_prompts else [(i, 1) for i in range(len(prompts))]  # (first, count)
        params = [self._sampling_params(rollout_config, count, eos, first) for first, count in groups]
        outs = self.llm.generate([ids[first] for first, _ in groups], params, use_tqdm=False, lora_request=self._lora)
        tokens, logprobs = [], []
        for out in outs:
            for seq in out.outputs:
                toks = list(seq.token_ids)
                if toks and toks[-1] in eos:
                    toks.pop()  # Tunix's completions end before EOS
                tokens.append(np.asarray(toks, np.int32))
                if rollout_config.return_logprobs:
                    logprobs.append(np.asarray([lp[t] for lp, t in zip(seq.logprobs, toks)], np.float32))
        padded = np.full((len(prompts), pad_to), self.pad_id(), np.int32)
        for row, x in zip(padded, ids):
            row[pad_to - len(x):] = x
        text = [self.tokenizer.decode(t.tolist()) for t in tokens]
        return base_rollout.RolloutOutput(text=text, logits=[], tokens=tokens, left_padded_prompt_tokens=padded,
                                          logprobs=logprobs if rollout_config.return_logprobs else None)

    @_own_mesh
    def get_per_token_logps(self, prompt_tokens, completion_tokens) -> jax.Array:
        """log p(completion token | the prompt and completion before it) [B, C] float32, 0
        on the completions' trailing padding; the prompts' left padding ignored."""
        pad = self.pad_id()
        prompts, completions = np.asarray(prompt_tokens), np.asarray(completion_tokens)
        starts = [int(np.argmax(row != pad)) if (row != pad).any() else len(row) for row in prompts]
        # the completion ends before its trailing padding (a pad token inside it, where pad is
        # not EOS, is a token like any other)
        ends = [len(row) - int(np.argmax(row[::-1] != pad)) if (row != pad).any() else 0 for row in completions]
        keep = [i for i, e in enumerate(ends) if e > 0]
        scores = self.llm.score([prompts[i, starts[i]:].tolist() for i in keep],
                                [completions[i, :ends[i]].tolist() for i in keep], lora_request=self._lora) if keep else []
        out = np.zeros(completions.shape, np.float32)
        for i, lp in zip(keep, scores):
            out[i, :len(lp)] = lp
        return jnp.asarray(out)

    # -- helpers -------------------------------------------------------------------------------
    def _load_adapter(self, lora: list) -> None:
        """The qwix LoRA matrices as a PEFT adapter (only the adapter's bytes move), served in
        place of the previous one: a new id each time (the engine's adapters are immutable)."""
        from pagedjax.lora.request import LoRARequest

        path = Path(self._dir.name) / f"adapter-{len(self._lora_dirs)}"
        path.mkdir()
        rank = write_peft_adapter(lora, self._config, self._lora_alpha, path)
        new = LoRARequest("tunix-actor", len(self._lora_dirs) + 1, str(path))
        self.llm.engine.add_lora(new)
        old, self._lora = self._lora, new
        self._lora_dirs.append(path)
        if old is not None:  # forgotten by the engine (its host copy was read): its files go too
            self.llm.engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        self.lora_rank = rank

    def _tokenize(self, text: str) -> list[int]:
        """As Tunix's sampler: BOS (when the tokenizer has one), then the text, one BOS kept."""
        ids = list(self.tokenizer.encode(text))
        bos = self.tokenizer.bos_id()
        return self.tokenizer.dedup_bos_ids(([bos] if bos else []) + ids)

    @staticmethod
    def _sampling_params(config, n: int, eos: tuple, index: int) -> SamplingParams:
        greedy = config.top_p is None or not config.temperature  # Tunix samples greedily without top_p
        seed = None if config.seed is None else int(np.asarray(config.seed).ravel()[0]) + index
        params = SamplingParams(max_tokens=config.max_tokens_to_generate, n=n, seed=seed,
                                temperature=0.0 if greedy else float(config.temperature),
                                top_p=1.0 if greedy else float(config.top_p),
                                top_k=0 if greedy or not config.top_k else int(config.top_k),
                                stop_token_ids=list(eos), logprobs=0 if config.return_logprobs else None)
        return params.held_to_room()  # as Tunix's sampler: a prompt past max_prompt_length is held to the cache


def _lora_rank(lora: nnx.State) -> int:
    return max(int(np.shape(v.get_value())[-1]) for path, v in nnx.to_flat_state(lora)
               if str(path[-1]).endswith("lora_a"))


def write_peft_adapter(lora: list, config: dict, alpha: float, path: Path) -> int:
    """qwix LoRA matrices ((path, LoRAParam) of a Tunix Qwen 3 / Llama 3) -> a PEFT adapter in
    `path` (lora_A [r, in], lora_B [out, r], lora_alpha = alpha: PEFT's scale alpha / r is
    qwix's). Returns the rank."""
    from safetensors.numpy import save_file

    n, h = config["num_attention_heads"], config["head_dim"]
    tensors, targets, rank = {}, set(), 0
    for key, var in lora:
        *_, layer, block, proj, kind = map(str, key)  # layers.{i}.attn.q_proj.w_lora_a
        x = np.asarray(var.get_value(), np.float32)
        module = ("self_attn." if block == "attn" else "mlp.") + proj
        if kind.endswith("lora_a"):
            mat = x.reshape(n * h, -1).T if proj == "o_proj" else x.T  # [r, in]
            rank = max(rank, mat.shape[0])
            tensors[f"base_model.model.model.layers.{layer}.{module}.lora_A.weight"] = np.ascontiguousarray(mat)
        else:
            mat = x.reshape(x.shape[0], -1).T  # [out, r]
            tensors[f"base_model.model.model.layers.{layer}.{module}.lora_B.weight"] = np.ascontiguousarray(mat)
        targets.add(proj)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": alpha,
                                                           "target_modules": sorted(targets)}))
    return rank


def _runs(prompts: list[str]) -> list[tuple[int, int]]:
    """(first index, count) of each run of equal consecutive prompts."""
    runs = []
    for i, p in enumerate(prompts):
        if runs and prompts[runs[-1][0]] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


__all__ = ["PagedJaxRollout", "flat_params", "hf_config", "hf_transform"]
