"""scripts/gpu_step_anatomy.py: counting what a GPU step launches from XLA's thunk dump."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from script_module import SCRIPTS, load_script

SCRIPT = SCRIPTS / "gpu_step_anatomy.py"

# shaped as XLA prints a thunk sequence: a loop's "condition:" header at column 0
THUNKS = """\
000: kCommandBuffer [source       | next=009 (1)] 
    001: kCustomKernel [source       | next=002 (1)] loop_gather_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
    002: kCustomKernel [prev=001 (1) | sink        ] wrapped_iota grid: [1, 1, 1] threads: [30, 1, 1]  shared_memory: 0 bytes
009: kWhile         [prev=000 (1) | next=020 (1)]   
condition:
    010: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    011: kDynamicSliceFusion [source        | next=013 (1)] params=1, results=1
        012: kCopy [source | sink] kCopy
    013: kCustomKernel       [prev=011 (1)  | next=014 (1)] gemm_fusion_dot_2 grid: [480, 1, 1] threads: [64, 1, 1]  shared_memory: 768 bytes
    014: kWhile              [prev=013 (1)  | next=000 (1)]       
condition:
        015: kCustomKernel [source | sink] loop_compare_fusion_1 grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
      body:
        016: kCustomKernel [source       | next=017 (1)] loop_select_fusion grid: [1, 1, 1] threads: [16, 1, 1]  shared_memory: 0 bytes
        017: kCopy         [prev=016 (1) | sink        ] kCopy
    000: kCommandBuffer      [prev=014 (1)  | sink        ] 
        018: kCustomKernel [source       | next=019 (1)] paged_decode_attention_gpu grid: [16, 3, 4] threads: [128, 1, 1]  shared_memory: 20480 bytes
        019: kCustomKernel [prev=018 (1) | sink        ] loop_add_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
020: kConditional  [prev=009 (1) | next=024 (1)]   
  false_branch:
    021: kCustomKernel [source | sink] input_reduce_fusion_4 grid: [1, 1, 1] threads: [16, 1, 1]  shared_memory: 0 bytes
  true_branch:
    022: kCustomKernel [source | sink] loop_broadcast_fusion grid: [3, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
    023: kCustomKernel [source | sink] loop_broadcast_fusion_2 grid: [3, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
024: kWhile        [prev=020 (1) | next=027 (1)]   
condition:
    025: kCustomKernel [source | sink] wrapped_compare grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    026: kCustomKernel [source | sink] input_scatter_fusion grid: [720, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
027: kCustomKernel [prev=024 (1) | sink        ] gemm_fusion_dot grid: [6144, 1, 1] threads: [64, 1, 1]  shared_memory: 768 bytes
"""

HLO = """\
%body_inner (p: (s32[])) -> (s32[]) {
  %loop_select_fusion = s32[16]{0} fusion(), kind=kLoop, calls=%fused_select
}

%body_outer (p: (s32[])) -> (s32[]) {
  %gemm_fusion_dot.2 = f32[4,16]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm
  %while.1 = (s32[]) while(%t), condition=%cond_inner, body=%body_inner, backend_config={"known_trip_count":{"n":"5"}}
}

%body_unknown (p: (s32[])) -> (s32[]) {
  ROOT %input_scatter_fusion = f32[8]{0} fusion(%x), kind=kInput, calls=%fused_scatter
}

ENTRY %main (a: f32[]) -> f32[] {
  %while.0 = (s32[]) while(%t0), condition=%c0, body=%body_outer, backend_config={"known_trip_count":{"n":"30"}}
  %while.2 = (s32[]) while(%t2), condition=%c2, body=%body_unknown
}
"""


def _load():
    return load_script("gpu_step_anatomy")


def test_counts_launches_kernels_syncs_and_slice_copies():
    """A command buffer is one launch; loops count times their trip count (found through the
    HLO of their body); a conditional and a loop of unknown trip count each make the host wait
    for the device once; the costlier branch of a conditional counts."""
    anatomy = _load()
    tree = anatomy.parse_thunk_sequence(THUNKS)
    assert [t.kind for t in tree] == ["kCommandBuffer", "kWhile", "kConditional", "kWhile", "kCustomKernel"]
    loop = tree[1]
    assert [t.kind for t in loop.sections["condition"]] == ["kCustomKernel"]
    assert [t.kind for t in loop.sections["body"]] == ["kDynamicSliceFusion", "kCustomKernel", "kWhile",
                                                       "kCommandBuffer"]
    inner = loop.sections["body"][2]
    assert [t.name for t in inner.sections["body"]] == ["loop_select_fusion", "kCopy"]
    assert sorted(tree[2].sections) == ["false_branch", "true_branch"]
    trips = anatomy.loop_trip_counts(HLO)
    assert trips == {"loop_select_fusion": 5, "gemm_fusion_dot_2": 30, "while_1": 30, "input_scatter_fusion": None}
    c = anatomy.count(tree, trips)
    # per outer iteration: slice copy 1 + gemm 1 + inner loop 5 x (kernel + copy) + command buffer 1 = 13 launches
    assert (c.launches, c.kernels, c.syncs, c.slice_copies) == (1 + 30 * 13 + 2 + 2 + 1, 2 + 30 * 8 + 2 + 2 + 1, 2, 30)


@pytest.mark.skipif(all(importlib.util.find_spec(m) is None for m in ("jax_cuda13_plugin", "jax_cuda12_plugin")),
                    reason="needs the jax CUDA plugin (the GPU compiler; no GPU needed)")
def test_unrolled_step_is_one_graph_without_host_syncs(tmp_path):
    """The engine's step compiled for a deviceless H200: with the layers unrolled the forward
    pass is one command buffer, and neither it nor the sampler makes the host wait."""
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])}
    run = subprocess.run([sys.executable, str(SCRIPT), "--tokens", "16", "--scan-layers", "off"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {line.split()[2]: [int(x) for x in line.split()[3:]] for line in run.stdout.splitlines()
            if line.split()[:1] == ["unrolled"]}
    assert rows["forward"][0] == 1 and rows["forward"][2] == 0, run.stdout
    assert rows["sampler"][2] == 0, run.stdout


@pytest.mark.parametrize("scan", [True, False])
def test_gpu_step_has_no_conditional_and_no_loop_but_the_layers(tiny_checkpoints, monkeypatch, scan):
    """The step and the sampler as a GPU would run them (traced with the backend reported as
    "gpu", exported for CUDA from this host): no conditional and no while loop but the layer
    scan, the two things XLA:GPU runs from the host (a conditional or a loop of unknown trip
    count makes the host wait for the device; a loop's iterations are launched one by one)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import export

    from pagedjax import LLMEngine

    path, _ = tiny_checkpoints("llama")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    eng = LLMEngine(str(path), stream_text=False, block_size=16, max_num_seqs=4, max_model_len=64,
                    num_blocks=16, max_num_batched_tokens=32, scan_layers=scan)
    runner = eng.runner
    _, _, (src, dst) = runner._idle_inputs(16)
    (step_buf, step_layout), (sample_buf, sample_layout) = runner.idle_buffers(16)
    spec = lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
    unsharded = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    weights, kv, lora = jax.tree.map(unsharded, runner._specs)
    forward = export.export(runner._step, platforms=["cuda"], disabled_checks=checks)(
        weights, kv, spec(step_buf), spec(runner._prev_tokens(None, True)), lora, step_layout)
    copy = export.export(runner._copy_blocks, platforms=["cuda"])(jax.tree.map(unsharded, runner._specs[1]),
                                                                    spec(src), spec(dst))
    s = runner.buckets.num_rows(16)
    sampler = export.export(runner._sample, platforms=["cuda"])(
        jax.ShapeDtypeStruct((s, runner.vocab_size), jnp.float32), spec(sample_buf),
        spec(runner._bitmask_ones(s, host=True)), jax.tree.map(unsharded, runner.penalties), sample_layout)
    text = forward.mlir_module()
    assert "xla.gpu.triton" in text  # the Pallas GPU kernels, as on the device
    assert text.count("stablehlo.while") == (1 if scan else 0)
    assert "stablehlo.while" not in copy.mlir_module()  # copy-on-write: all entries at once
    for name, mod in (("forward", text), ("sampler", sampler.mlir_module()), ("copy", copy.mlir_module())):
        assert "stablehlo.case" not in mod and "stablehlo.if" not in mod, name
