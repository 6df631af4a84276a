"""PagedJaxRollout against Tunix's own VanillaRollout on the same actor: greedy rollouts token
for token (before and after new weights), per-token log-probs within 1e-4, and a GRPO run
whose rollouts come from pagedjax."""
import jax
import numpy as np
import optax
import pytest
from flax import nnx
from tunix.generate.tokenizer_adapter import TokenizerAdapter
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout, vanilla_rollout

from pagedjax.integrations.tunix import PagedJaxRollout
from tunix_models import make_mesh, perturb, tiny_actor

PROMPTS = ["The quick brown fox", "The quick brown fox", "Hello, my name is", "1 + 1 =", "Once upon a time there"]
GREEDY = base_rollout.RolloutConfig(max_tokens_to_generate=12, max_prompt_length=16, kv_cache_size=64, top_p=None,
                                    temperature=1.0)
ENGINE = dict(block_size=8, num_blocks=64, max_num_seqs=8)


@pytest.fixture(scope="module")
def tokenizer(default_tokenizer):
    return TokenizerAdapter(default_tokenizer)


def _vanilla(actor, tokenizer):
    c = actor.config
    return vanilla_rollout.VanillaRollout(actor, tokenizer, base_rollout.CacheConfig(
        cache_size=64, num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim))


def _assert_same_rollouts(a, b):
    assert len(a.tokens) == len(b.tokens)
    for x, y in zip(a.tokens, b.tokens):
        assert np.asarray(x).tolist() == np.asarray(y).tolist()
    np.testing.assert_array_equal(np.asarray(a.left_padded_prompt_tokens), b.left_padded_prompt_tokens)
    assert a.text == b.text


@pytest.mark.parametrize("family,tied", [("qwen3", True), ("qwen3", False), ("llama3", True)])
def test_greedy_rollouts_equal_vanilla(tokenizer, family, tied):
    mesh = make_mesh()
    actor = tiny_actor(mesh, family, tied=tied)
    with jax.set_mesh(mesh):
        vanilla = _vanilla(actor, tokenizer)
        ours = PagedJaxRollout(rollout_actor=actor, tokenizer=tokenizer, mesh=mesh, rollout_config=GREEDY, **ENGINE)
        before = ours.generate(PROMPTS, GREEDY)
        _assert_same_rollouts(vanilla.generate(PROMPTS, GREEDY), before)
        assert ours.model() is None and ours.pad_id() == vanilla.pad_id() and ours.eos_id() == vanilla.eos_id()
        perturb(actor, seed=1)  # a "training step"
        new_state = nnx.state(actor, nnx.Param)
        vanilla.update_params(new_state, (nnx.Param,))
        want = vanilla.generate(PROMPTS, GREEDY)
        compiles = ours.llm.stats()["num_compilations"]  # (counted process-wide: vanilla's are done)
        ours.update_params(new_state, (nnx.Param,))
        after = ours.generate(PROMPTS, GREEDY)
        assert ours.llm.stats()["num_compilations"] == compiles  # the second sync and rollout compile nothing
        _assert_same_rollouts(want, after)
    assert [t.tolist() for t in after.tokens] != [t.tolist() for t in before.tokens]
    stats = ours.llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_per_token_logps_equal_vanilla(tokenizer):
    mesh = make_mesh()
    actor = tiny_actor(mesh, "qwen3", seed=3)
    sampled = base_rollout.RolloutConfig(max_tokens_to_generate=12, max_prompt_length=16, kv_cache_size=64,
                                         temperature=1.0, top_p=1.0, seed=7)
    with jax.set_mesh(mesh):
        vanilla = _vanilla(actor, tokenizer)
        ours = PagedJaxRollout(rollout_actor=actor, tokenizer=tokenizer, mesh=mesh, rollout_config=sampled, **ENGINE)
        out = ours.generate(PROMPTS, sampled)
        pad = ours.pad_id()
        completions = np.full((len(PROMPTS), 12), pad, np.int32)
        for row, toks in zip(completions, out.tokens):
            row[:len(toks)] = toks
        prompts = jax.numpy.asarray(out.left_padded_prompt_tokens)
        want = np.asarray(vanilla.get_per_token_logps(prompts, jax.numpy.asarray(completions)))
        got = np.asarray(ours.get_per_token_logps(prompts, jax.numpy.asarray(completions)))
    assert got.shape == want.shape == completions.shape and got.dtype == np.float32
    mask = completions != pad
    assert mask.sum() > 20
    np.testing.assert_allclose(got[mask], want[mask], atol=1e-4)


def _length_reward(prompts, completions, **kwargs):
    return [len(c) / 10.0 for c in completions]


def test_grpo_trains_with_pagedjax_rollouts(tokenizer, default_tokenizer):
    """Tunix's GRPOLearner, 3 steps, rollouts from PagedJaxRollout; afterwards the engine's
    greedy rollouts equal a vanilla rollout of the trained actor (the weights were synced)."""
    mesh = make_mesh()
    actor, reference = tiny_actor(mesh, "qwen3", seed=0), tiny_actor(mesh, "qwen3", seed=0)
    sampled = base_rollout.RolloutConfig(max_tokens_to_generate=8, max_prompt_length=16, kv_cache_size=64,
                                         temperature=0.9, top_p=1.0, top_k=50)
    config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                      rl_cluster_lib.Role.ROLLOUT: mesh},
        rollout_engine=PagedJaxRollout, offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(actor_optimizer=optax.adamw(1e-2), eval_every_n_steps=100,
                                                        max_steps=3),
        rollout_config=sampled)
    cluster = rl_cluster_lib.RLCluster(actor=actor, reference=reference, tokenizer=default_tokenizer,
                                       cluster_config=config)
    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, reward_fns=_length_reward,
                                       algo_config=grpo_learner.GRPOConfig(num_generations=2, num_iterations=1,
                                                                           beta=0.04, epsilon=0.2))
    assert learner.should_sync_weights  # the engine holds its own copy: Tunix must send updates
    data = [{"prompts": np.array(PROMPTS[i:i + 2])} for i in range(3)]
    before = [np.asarray(x).copy() for x in jax.tree.leaves(nnx.state(actor, nnx.Param))]
    learner.train(data)
    trained = cluster.actor_trainer.model
    after = jax.tree.leaves(nnx.state(trained, nnx.Param))
    assert any(not np.array_equal(a, np.asarray(b)) for a, b in zip(before, after))  # it trained
    rollout = cluster.rollout
    assert isinstance(rollout, PagedJaxRollout)
    assert rollout.llm.engine.num_weight_updates >= 3  # construction + each step's sync
    with jax.set_mesh(mesh):
        _assert_same_rollouts(_vanilla(trained, tokenizer).generate(PROMPTS, GREEDY), rollout.generate(PROMPTS, GREEDY))


def test_lora_actor_moves_only_adapter_bytes(tokenizer):
    """A qwix LoRA actor: its rollouts equal the vanilla rollout of the same LoRA actor, and a
    LoRA-only update_params (what Tunix sends when only the adapter trains) writes no base
    weight, only the adapter."""
    import functools

    import qwix

    mesh = make_mesh()
    base = tiny_actor(mesh, "qwen3", seed=4)
    provider = qwix.LoraProvider(module_path=".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*up_proj|.*down_proj",
                                 rank=4, alpha=8.0)
    with jax.set_mesh(mesh):
        actor = qwix.apply_lora_to_model(base, provider, **base.get_model_input())
    _perturb_lora(actor, seed=0)
    with jax.set_mesh(mesh):
        vanilla = _vanilla(actor, tokenizer)
        with pytest.raises(ValueError, match="lora_alpha"):
            PagedJaxRollout(rollout_actor=actor, tokenizer=tokenizer, mesh=mesh, rollout_config=GREEDY, **ENGINE)
        engine = functools.partial(PagedJaxRollout, lora_alpha=8.0)
        ours = engine(rollout_actor=actor, tokenizer=tokenizer, mesh=mesh, rollout_config=GREEDY, **ENGINE)
        before = ours.generate(PROMPTS, GREEDY)
        _assert_same_rollouts(vanilla.generate(PROMPTS, GREEDY), before)
        weights = list(ours.llm.engine.runner._weights)
        updates = ours.llm.engine.num_weight_updates
        _perturb_lora(actor, seed=1)
        lora_state = nnx.state(actor, nnx.LoRAParam)
        vanilla.update_params(lora_state, (nnx.LoRAParam,))
        ours.update_params(lora_state, (nnx.LoRAParam,))
        after = ours.generate(PROMPTS, GREEDY)
        _assert_same_rollouts(vanilla.generate(PROMPTS, GREEDY), after)
    assert [t.tolist() for t in after.tokens] != [t.tolist() for t in before.tokens]
    assert ours.llm.engine.num_weight_updates == updates  # no base weight written
    assert all(a is b for a, b in zip(weights, ours.llm.engine.runner._weights))
    assert [l.lora_int_id for l in ours.llm.engine.list_loras()] == [2]  # the old adapter is gone


def _perturb_lora(model, seed):
    flat = list(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)))
    key = jax.random.key(seed)
    for _, var in flat:
        key, sub = jax.random.split(key)
        old = var.get_value()
        var.set_value(jax.device_put(0.3 * jax.random.normal(sub, old.shape, old.dtype), old.sharding))
    nnx.update(model, nnx.from_flat_state(flat))
