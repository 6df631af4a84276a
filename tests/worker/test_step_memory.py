"""A step costs what its tokens cost, whatever the pool size: the compiled step updates the
donated KV cache in place and never copies it (checked on the compiled executable), and the
layers under scan give the same tokens as the unrolled model."""
import re

import numpy as np
import pytest

from pagedjax import SamplingParams
from pagedjax.engine.llm_engine import LLMEngine
from tiny_models import hf_greedy

NUM_BLOCKS = 4096


@pytest.fixture(scope="module", params=["paged", "dense", "paged-bf16"])
def engine(request, tiny_checkpoints):
    """paged-bf16: a bf16 model and KV cache (XLA:CPU would widen a bf16 scatter to an f32
    copy of the pool; the native write keeps it in place)."""
    path, _ = tiny_checkpoints("llama")
    kind, _, dtype = request.param.partition("-")
    kw = dict(num_blocks=NUM_BLOCKS) if kind == "paged" else dict(num_blocks=64)
    return LLMEngine(str(path), stream_text=False, kv_cache=kind, block_size=8, max_num_seqs=8,
                     max_model_len=96, max_num_batched_tokens=64, dtype={"bf16": "bfloat16"}.get(dtype, "float32"),
                     **kw)


def _pool_copies(hlo: str, pool_shape: tuple[int, ...]) -> list[str]:
    """HLO instructions that copy a whole pool-sized array (in any layout of its elements)."""
    size = int(np.prod(pool_shape))
    found = []
    for line in hlo.splitlines():
        m = re.search(r"= (?:f32|bf16)\[([\d,]+)\]\{[\d,]*\} copy\(", line)
        if m and int(np.prod([int(x) for x in m.group(1).split(",")])) == size:
            found.append(line.strip()[:160])
    return found


@pytest.mark.parametrize("t", [16, 64])
def test_compiled_step_updates_the_cache_in_place(engine, t):
    runner = engine.runner
    exe = runner.compile_bucket(t)
    pool_bytes = 2 * runner.kv[0].nbytes
    mem = exe.memory_analysis()
    assert mem.alias_size_in_bytes >= pool_bytes  # the donated cache is the output cache
    assert mem.temp_size_in_bytes < pool_bytes / 8  # scratch follows the tokens, not the pool
    assert _pool_copies(exe.as_text(), runner.kv[0].shape) == []


def test_copy_on_write_runs_apart_and_in_place(engine):
    """Copy-on-write is its own executable, run only before a step that has copies: the
    donated cache is its output, with no pool-sized copy (on CPU, and in the all-at-once form
    accelerators run)."""
    import jax

    from pagedjax.models.kv_cache import copy_blocks_at_once

    runner = engine.runner
    runner._compile_copy_blocks()
    pool_bytes = 2 * runner.kv[0].nbytes
    idx = jax.ShapeDtypeStruct((runner.dp * runner.buckets.max_num_seqs,), np.int32)
    at_once = jax.jit(lambda kv, s, d: copy_blocks_at_once(kv, runner.num_layers, s, d), donate_argnums=(0,))
    for exe in (runner._copy_executable, at_once.lower(runner._specs[1], idx, idx).compile()):
        assert exe.memory_analysis().alias_size_in_bytes >= pool_bytes
        assert _pool_copies(exe.as_text(), runner.kv[0].shape) == []


def _computations(hlo: str) -> dict[str, list[str]]:
    """HLO module text -> each computation's instruction lines, by name."""
    comps, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"(?:ENTRY )?%([\w.\-]+) .*\{$", line)
        if head:
            name = head.group(1)
            comps[name] = []
        elif name is not None and line.strip() != "}":
            comps[name].append(line)
    return comps


def _called(line: str) -> list[str]:
    """The computations an HLO instruction calls (fusions, conditionals' branches, loops...)."""
    names = re.findall(r"(?:calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)", line)
    for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
        names += re.findall(r"%([\w.\-]+)", group)
    return names


def test_rope_table_is_computed_once_per_step(engine):
    """cos and sin of the step's positions are computed once, not again inside each layer's
    (or head's) rope: on XLA:CPU they come out of a conditional, one table per branch, and
    no cosine lies anywhere else (fused into the layers, there would be one per layer)."""
    comps = _computations(engine.runner.compile_bucket(16).as_text())
    in_branches, todo = set(), [n for lines in comps.values() for line in lines
                                if " conditional(" in line for n in _called(line)]
    while todo:  # every computation a conditional's branch reaches
        name = todo.pop()
        if name not in in_branches:
            in_branches.add(name)
            todo += [n for line in comps.get(name, []) for n in _called(line)]
    cosines = [name for name, lines in comps.items() for line in lines if " cosine(" in line]
    assert engine.model.config.num_layers >= 2
    assert 1 <= len(cosines) <= 2 and set(cosines) <= in_branches, cosines


def test_scan_and_unrolled_layers_agree(tiny_checkpoints):
    path, hf_model = tiny_checkpoints("qwen2")
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42]]
    outs = {}
    for scan in (True, False):
        eng = LLMEngine(str(path), stream_text=False, block_size=8, max_num_seqs=4, max_model_len=64,
                        num_blocks=32, max_num_batched_tokens=32, scan_layers=scan)
        assert eng.model.scan_layers is scan
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, SamplingParams(max_tokens=6, ignore_eos=True))
        done = {}
        while eng.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
        outs[scan] = [done[str(i)] for i in range(len(prompts))]
    assert outs[True] == outs[False] == [hf_greedy(hf_model, p, 6) for p in prompts]


def test_sampler_updates_the_penalty_slots_in_place(tiny_checkpoints):
    """The penalty table ([max_num_seqs, V] counts, flags, bias) is donated to the sampler and
    aliased to its output: a step never copies it, whether or not a row uses penalties."""
    path, _ = tiny_checkpoints("llama")
    eng = LLMEngine(str(path), stream_text=False, block_size=8, max_num_seqs=32, max_model_len=96,
                    num_blocks=64, max_num_batched_tokens=64)
    runner = eng.runner
    runner.compile_bucket(16)  # S = 16 rows, the table has 32
    exe = runner._samplers[16]
    table_bytes = sum(x.nbytes for x in (runner.penalties.counts, runner.penalties.in_prompt, runner.penalties.bias))
    assert exe.memory_analysis().alias_size_in_bytes >= table_bytes
    rows, vocab = runner.penalties.counts.shape
    copies = [line for line in exe.as_text().splitlines() if f"[{rows},{vocab}]" in line and " copy(" in line]
    assert copies == []
