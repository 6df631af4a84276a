"""What one engine step launches on an NVIDIA GPU, read without a GPU.

The step is compiled for a deviceless H200 target by XLA's GPU compiler (the jax CUDA plugin:
no CUDA device, driver or toolkit needed) and the thunk sequence XLA would run is counted:

    pip install "jax-cuda13-plugin==$(python -c 'import jax; print(jax.__version__)')"  # ~130 MB
    python scripts/gpu_step_anatomy.py [--model DIR] [--tokens 16,64] [--scan-layers on,off]

Per step it prints:
  launches     what the host issues: a kernel, a copy, or a command buffer (one CUDA graph,
               however many kernels it holds); loops counted times their trip count
  kernels      kernels the GPU runs, inside command buffers or not
  host syncs   conditionals and loops whose trip count lives on the device: XLA:GPU copies
               the predicate to the host and waits for the device there, so the host cannot
               queue the next step's work ahead (each one is paid at every step)
  slice copies per-layer weight slices a scanned step copies before its matmuls
For a decode step of a small model every launch costs a few microseconds of host and device
time whatever it computes, so launches, not FLOPs or bytes, set the step time.

The engine is built on the CPU with the backend reported as "gpu" while it traces (it picks
its kernels and layer layout by backend), so the step holds the Pallas GPU kernels it would
run on the device. Without --model: a random SmolLM2-135M-shaped checkpoint.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

# one H200 (SXM) as XLA's GpuTargetConfigProto: what the compiler needs to know of the device
H200_TARGET = """
gpu_device_info {
  cuda_compute_capability { major: 9 minor: 0 }
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150000000000
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 patch: 0 }
device_description_str: "sm_9.0 with 150000000000B RAM, 132 cores, 1980000KHz clock, 2619000KHz mem clock, 52428800B L2$"
"""


@dataclass
class Thunk:
    kind: str  # kCustomKernel, kCopy, kWhile, kConditional, kCommandBuffer, ...
    name: str  # the HLO instruction it runs (dots written as underscores), may be empty
    indent: int
    children: list["Thunk"] = field(default_factory=list)  # a command buffer's or a fusion's thunks
    sections: dict[str, list["Thunk"]] = field(default_factory=dict)  # condition / body / *_branch


def parse_thunk_sequence(text: str) -> list[Thunk]:
    """XLA's thunk_sequence dump (`--xla_dump_to`) -> the tree of thunks. Nesting follows the
    indentation, except that a loop's "condition:" header is printed at column 0."""
    root: list[Thunk] = []
    stack: list[tuple[int, list[Thunk], Thunk | None]] = [(-1, root, None)]  # (indent, where children go, owner)
    last = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        indent = len(raw) - len(raw.lstrip())
        header = re.fullmatch(r"(\w+):", line)
        if header:
            if header.group(1) == "condition" and last is not None:
                indent = last.indent + 2
            while stack[-1][0] >= indent:
                stack.pop()
            owner = next(o for _, _, o in reversed(stack) if o is not None)
            section = owner.sections.setdefault(header.group(1), [])
            stack.append((indent, section, None))
            continue
        m = re.match(r"\d+:\s+(k\w+)\s+\[[^\]]*\]\s*([\w.\-]*)", line)
        if not m:
            continue
        while stack[-1][0] >= indent:
            stack.pop()
        last = Thunk(m.group(1), m.group(2), indent)
        stack[-1][1].append(last)
        stack.append((indent, last.children, last))
    return root


def _norm(name: str) -> str:
    return re.sub(r"[^0-9A-Za-z]", "_", name)


def loop_trip_counts(hlo: str) -> dict[str, int | None]:
    """Optimized HLO text -> {instruction name (normalized): trip count of the loop whose
    body holds it}; None for a loop whose trip count XLA does not know."""
    bodies: dict[str, int | None] = {}
    for m in re.finditer(r" while\(.*?body=%([\w.\-]+).*", hlo):
        trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', m.group(0))
        bodies[m.group(1)] = int(trip.group(1)) if trip else None
    out, comp = {}, None
    for line in hlo.splitlines():
        head = re.match(r"(?:ENTRY )?%([\w.\-]+) .*\{$", line)
        if head:
            comp = head.group(1)
            continue
        inst = re.match(r"\s+(?:ROOT )?%([\w.\-]+) = ", line)
        if inst and comp in bodies:
            out[_norm(inst.group(1))] = bodies[comp]
    return out


@dataclass
class Counts:
    launches: int = 0
    kernels: int = 0
    syncs: int = 0
    slice_copies: int = 0

    def add(self, other: "Counts", times: int = 1) -> None:
        self.launches += times * other.launches
        self.kernels += times * other.kernels
        self.syncs += times * other.syncs
        self.slice_copies += times * other.slice_copies


def _names(thunks: list[Thunk]):
    for t in thunks:
        if t.name:
            yield t.name
        yield from _names(t.children)
        for section in t.sections.values():
            yield from _names(section)


def count(thunks: list[Thunk], trips: dict[str, int | None]) -> Counts:
    """Launches, kernels, host syncs and weight-slice copies of one run of `thunks`. A loop of
    unknown trip count is counted once, with one host sync per iteration."""
    c = Counts()
    for t in thunks:
        if t.kind == "kCommandBuffer":
            inner = count(t.children, trips)
            c.launches += 1
            c.kernels += inner.kernels
            c.syncs += inner.syncs
        elif t.kind == "kWhile":
            body = t.sections.get("body", [])
            trip = next((trips[n] for n in _names(body) if n in trips), None)
            c.add(count(body, trips), trip or 1)
            if trip is None:  # the predicate is computed on the device and read by the host
                c.add(count(t.sections.get("condition", []), trips))
                c.syncs += 1
        elif t.kind == "kConditional":
            branches = [count(b, trips) for b in t.sections.values()]
            c.syncs += 1
            if branches:
                c.add(max(branches, key=lambda b: b.launches))
        elif t.kind == "kDynamicSliceFusion":
            c.launches += 1
            c.slice_copies += 1
        elif t.kind == "kSequential":
            c.add(count(t.children, trips))
        else:
            c.launches += 1
            c.kernels += t.kind != "kCopy"
    return c


def build_runner(model: str, scan: bool, kv_cache: str = "paged"):
    """The engine's ModelRunner, built on the CPU as the GPU backend would build it."""
    import jax
    from pagedjax import LLM

    real = jax.default_backend
    jax.default_backend = lambda: "gpu"  # kernels and layer layout are chosen by backend when traced
    try:
        llm = LLM(model, dtype="bfloat16", max_num_seqs=16, max_model_len=1024, scan_layers=scan, warmup=False,
                  kv_cache=kv_cache)
    except Exception:
        jax.default_backend = real
        raise
    return llm.engine.runner, real


def compile_step(runner, device, t: int):
    """(forward pass, sampler) of the step of T = t tokens, lowered (backend still "gpu") and
    compiled for `device`."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    data = runner.mesh.axis_names[0]
    mesh = Mesh(np.array([device]).reshape(1, 1), runner.mesh.axis_names)
    runner.mesh, runner.cache.mesh = mesh, None
    runner._by_rank, runner._rows_by_rank = NamedSharding(mesh, P(data)), NamedSharding(mesh, P(data, None))
    on_device = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
        mesh, x.sharding.spec if isinstance(x.sharding, NamedSharding) else P()))
    (step_buf, step_layout), (sample_buf, sample_layout) = runner.idle_buffers(t)
    spec = lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=runner._by_rank)
    weights, kv, lora = jax.tree.map(on_device, runner._specs)
    forward = runner._step.lower(weights, kv, spec(step_buf), spec(runner._prev_tokens(None, True)), lora,
                                 step_layout).compile()
    s = runner.buckets.num_rows(t)
    logits = jax.ShapeDtypeStruct((s, runner.vocab_size), jnp.float32, sharding=runner._rows_by_rank)
    sampler = runner._sample.lower(logits, spec(sample_buf), spec(runner._bitmask_ones(s, host=True)),
                                   jax.tree.map(on_device, runner.penalties), sample_layout).compile()
    return forward, sampler


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: random SmolLM2-135M-shaped)")
    p.add_argument("--tokens", default="16,64", help="step sizes T to compile, comma separated (each a bucket)")
    p.add_argument("--scan-layers", default="on,off", help="layer layouts to compile: on (lax.scan), off (unrolled)")
    p.add_argument("--kv-cache", choices=["paged", "dense"], default="paged", help="the KV cache backend")
    args = p.parse_args(argv)

    dump = Path(tempfile.mkdtemp(prefix="gpu_step_anatomy_"))
    os.environ["JAX_PLATFORMS"] = "cpu"  # no CUDA client: compile only
    os.environ["PAGEDJAX_COMPILE_CACHE"] = "0"  # a deviceless executable cannot be cached or loaded
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump}".strip()
    import jax
    from jax.experimental import topologies

    try:
        device = topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=H200_TARGET).devices[0]
    except Exception as e:  # no plugin, or one whose proto or options differ
        print(f"cannot compile for a GPU here: {type(e).__name__}: {e}\n(install the jax CUDA plugin of jax "
              f"{jax.__version__}: pip install jax-cuda13-plugin=={jax.__version__})", file=sys.stderr)
        return 2
    model = args.model
    if model is None:
        from gpu_e2e_bf16 import write_random_checkpoint

        model = tempfile.mkdtemp(prefix="smollm2_random_")
        write_random_checkpoint(Path(model))
    print(f"step of the engine ({args.kv_cache} KV cache) compiled for {device.device_kind} (deviceless); "
          f"jax {jax.__version__}")
    print(f"{'layers':>9} {'T':>5} {'part':>8} {'launches':>9} {'kernels':>8} {'host syncs':>11} {'slice copies':>13}")
    for layout in args.scan_layers.split(","):
        runner, real_backend = build_runner(model, {"on": True, "off": False}[layout], args.kv_cache)
        try:
            for t in (int(x) for x in args.tokens.split(",")):
                before = set(dump.glob("*"))
                for name, exe in zip(("forward", "sampler"), compile_step(runner, device, t)):
                    module = "jit__forward" if name == "forward" else "jit__sample"
                    seq = [f for f in set(dump.glob(f"*{module}*thunk_sequence*.txt")) - before]
                    if not seq:  # the sampler of this S compiled for a smaller T already
                        continue
                    seq = min(seq, key=lambda f: ("after_thunk_passes" not in f.name, f.name))  # the final sequence
                    c = count(parse_thunk_sequence(seq.read_text()), loop_trip_counts(exe.as_text()))
                    print(f"{'scanned' if layout == 'on' else 'unrolled':>9} {t:>5} {name:>8} {c.launches:>9} "
                          f"{c.kernels:>8} {c.syncs:>11} {c.slice_copies:>13}", flush=True)
        finally:
            jax.default_backend = real_backend
    return 0


if __name__ == "__main__":
    sys.exit(main())
