"""Tiny random Tunix models (Qwen 3, Llama 3) on a one-device mesh, for the Tunix tests."""
import jax
import jax.numpy as jnp
from flax import nnx

VOCAB = 49152  # the default model's tokenizer (SmolLM2)


def make_mesh():
    # Auto axes: jax.make_mesh's default explicit axes break Tunix Qwen 3's embedding lookup (jax 0.10)
    return jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def tiny_actor(mesh, family: str = "qwen3", seed: int = 0, tied: bool = True):
    """2 layers, hidden 64, 4 query / 2 KV heads of 16; float32. Embeddings and norms drawn
    wide enough that greedy choices are clear (default init gives near-equal logits)."""
    dims = dict(num_layers=2, vocab_size=VOCAB, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16,
                num_kv_heads=2, rope_theta=1_000_000)
    if family == "qwen3":
        from tunix.models.qwen3 import model as lib

        cfg = lib.ModelConfig(**dims, norm_eps=1e-6, use_tied_embedding=tied, dtype=jnp.float32,
                              param_dtype=jnp.float32)
        cls = lib.Qwen3
    else:
        from tunix.models.llama3 import model as lib

        cfg = lib.ModelConfig(**dims, norm_eps=1e-5, weight_tying=tied)
        cls = lib.Llama3
    with jax.set_mesh(mesh):
        model = cls(cfg, rngs=nnx.Rngs(params=seed))
    perturb(model, seed, scale=1.0)
    return model


def perturb(model, seed: int, scale: float = 0.3):
    """Redraws every parameter around its value (scale 1: from scratch: embeddings ~ N(0, 0.5),
    matrices ~ N(0, 0.3), norms ~ 1 + N(0, 0.1), wide enough for varied greedy tokens; the
    default init repeats one token), a stand-in for a training step when scale < 1."""
    state = nnx.state(model, nnx.Param)
    key = jax.random.key(seed + 1000)
    flat = list(nnx.to_flat_state(state))
    for path, var in flat:
        old = var.get_value()
        key, sub = jax.random.split(key)
        noise = jax.random.normal(sub, old.shape, old.dtype)
        norm = path[-1] == "w" and old.ndim == 1
        std = 0.1 if norm else 0.5 if path[-1] == "input_embedding" else 0.3
        base = (1.0 if norm else 0.0) if scale == 1.0 else old
        var.set_value(jax.device_put(base + scale * std * noise, old.sharding))
    nnx.update(model, nnx.from_flat_state(flat))
