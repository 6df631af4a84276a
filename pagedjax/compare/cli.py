"""Command line of the dense-vs-paged comparison: `pagedjax bench compare` and
`scripts/compare_kv_cache.py` (same arguments)."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

TINY_CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=64,
                   intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                   bos_token_id=0, eos_token_id=1, torch_dtype="float32")


def make_tiny_model(path: Path, seed: int = 0) -> Path:
    """Writes a random tiny Llama checkpoint (config.json + safetensors, no tokenizer)."""
    from safetensors.numpy import save_file

    c, rng = TINY_CONFIG, np.random.default_rng(seed)
    e, i, d = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    h, hkv = c["num_attention_heads"], c["num_key_value_heads"]
    w = lambda *shape: (rng.standard_normal(shape) * 0.2).astype(np.float32)  # noqa: E731
    tensors = {"model.embed_tokens.weight": w(c["vocab_size"], e), "model.norm.weight": np.ones(e, np.float32)}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        tensors.update({p + "self_attn.q_proj.weight": w(h * d, e), p + "self_attn.k_proj.weight": w(hkv * d, e),
                        p + "self_attn.v_proj.weight": w(hkv * d, e), p + "self_attn.o_proj.weight": w(e, h * d),
                        p + "mlp.gate_proj.weight": w(i, e), p + "mlp.up_proj.weight": w(i, e),
                        p + "mlp.down_proj.weight": w(e, i), p + "input_layernorm.weight": np.ones(e, np.float32),
                        p + "post_attention_layernorm.weight": np.ones(e, np.float32)})
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(c))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_mutually_exclusive_group()
    m.add_argument("--model", default=None, help="local Hugging Face model dir (default: SmolLM2-135M-Instruct)")
    m.add_argument("--tiny", action="store_true", help="a random tiny Llama (2 layers, width 64): fast, same memory story")
    w = p.add_argument_group("workload (every request arrives at t=0; lengths uniform in [LO, HI])")
    w.add_argument("--num-requests", type=int, default=40, help="requests in the workload")
    w.add_argument("--prompt-len", type=int, nargs=2, default=[32, 320], metavar=("LO", "HI"),
                   help="prompt tokens per request")
    w.add_argument("--output-len", type=int, nargs=2, default=[100, 200], metavar=("LO", "HI"),
                   help="tokens generated per request (EOS ignored)")
    w.add_argument("--max-model-len", type=int, default=2048, help="prompt + output token limit (a dense slot's "
                   "length)")
    w.add_argument("--shared-prefix-len", type=int, default=0, help="tokens every prompt starts with")
    w.add_argument("--n", type=int, default=1, help="sequences per request (parallel sampling)")
    w.add_argument("--seed", type=int, default=0, help="seed of the workload's lengths and tokens")
    k = p.add_argument_group("KV memory (the same budget for both backends)")
    b = k.add_mutually_exclusive_group()
    b.add_argument("--kv-budget-tokens", type=int, default=None,
                   help="KV budget in tokens of KV (default: 9000, 4 dense slots of 2048 and a remainder)")
    b.add_argument("--kv-budget-mib", type=float, default=None, help="KV budget in MiB")
    k.add_argument("--block-size", type=int, default=16, help="paged block size")
    k.add_argument("--max-num-seqs", type=int, default=32,
                   help="most requests running at once, both backends (default: 32; on CPU a decode step is "
                        "compute-bound well before that)")
    k.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the model's matrices (auto: as `pagedjax generate --dtype auto`)")
    t = p.add_argument_group("KV tiers of the paged run (off by default; docs/design/kv_tiers.md)")
    t.add_argument("--kv-offload-gb", type=float, default=None, help="host-memory KV tier in GiB")
    t.add_argument("--kv-offload-dir", default=None, help="disk KV tier: a folder for full prefix blocks")
    t.add_argument("--kv-offload-disk-gb", type=float, default=None, help="size bound of --kv-offload-dir in GiB")
    p.add_argument("--out", default="results/compare_kv_cache", help="directory for JSON, markdown and PNGs")
    p.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--no-int8-kv", dest="int8_kv", action="store_false",
                   help="skip the third run (paged with an int8 KV cache in the same bytes)")


def run(args: argparse.Namespace) -> int:
    from pagedjax.compare.experiment import Workload, compare, kv_bytes_per_token, markdown_table, write_report

    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(Path(tmp) / "tiny-llama")) if args.tiny else args.model
        try:
            workload = Workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len),
                                args.max_model_len, args.shared_prefix_len, args.n, args.seed)
            budget = args.kv_budget_tokens
            if args.kv_budget_mib is not None:
                budget = int(args.kv_budget_mib * 2**20) // kv_bytes_per_token(model, args.dtype)
            budget = budget if budget is not None else 9000
            report = compare(model, workload, budget, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                             dtype=args.dtype, progress=not args.quiet, int8_kv=args.int8_kv,
                             kv_offload_gb=args.kv_offload_gb, kv_offload_dir=args.kv_offload_dir,
                             kv_offload_disk_gb=args.kv_offload_disk_gb)
        except (ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if args.tiny:
            report["model"] = "random tiny Llama (--tiny)"
    paths = write_report(report, args.out, plots=not args.no_plots)
    print(markdown_table(report))
    for name, path in paths.items():
        print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="compare_kv_cache", description="Dense vs paged KV cache: same model, workload "
                                "and KV memory budget; JSON, a markdown table and PNG plots.")
    add_arguments(p)
    return run(p.parse_args(argv))
