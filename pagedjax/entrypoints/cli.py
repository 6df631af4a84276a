"""Command line: `pagedjax generate ...`, `pagedjax serve ...` and `pagedjax bench compare ...`."""
from __future__ import annotations

import argparse
import os
import sys


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine knobs shared by every subcommand."""
    g = p.add_argument_group("engine")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (power of two)")
    g.add_argument("--num-blocks", type=int, default=None, help="KV blocks in the pool (default: from memory)")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="most requests running at once (default: 64; generate: the number of prompts)")
    g.add_argument("--max-model-len", type=int, default=None, help="prompt + output token limit")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step, decode and prompt chunks together (default 2048)")
    g.add_argument("--no-prefix-caching", action="store_true", help="do not share identical prompt prefixes")
    g.add_argument("--no-async-scheduling", action="store_true",
                   help="read each step's tokens before scheduling the next (default: the host prepares "
                        "step t + 1 while the device runs step t)")
    g.add_argument("--kv-cache", choices=["paged", "dense"], default="paged")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the model's matrices (activations stay float32); auto: bfloat16 where the hardware "
                        "has fast bf16 (TPU, GPU, CPU with AVX512-BF16/AMX), else float32")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="KV cache dtype (auto: the model dtype)")
    g.add_argument("--seed", type=int, default=0, help="engine seed (per-request seeds derive from it)")
    g.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4}\' (prompt lookup) or \'{"model": "DRAFT_DIR", '
                        '"num_speculative_tokens": 4}\' (a draft model with the same vocabulary; it drafts '
                        'fewer or none while they do not pay, "adaptive": false keeps k)')
    g.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="devices to split the weights and KV heads over (default 1)")
    g.add_argument("-dp", "--data-parallel-size", type=int, default=1, help="data-parallel ranks (default 1)")
    m = p.add_argument_group("several processes (every process runs the same command, its own --process-id)")
    m.add_argument("--coordinator-address", default=None, metavar="HOST:PORT", help="process 0's address")
    m.add_argument("--num-processes", type=int, default=1)
    m.add_argument("--process-id", type=int, default=0)


def _json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def init_processes(args: argparse.Namespace) -> None:
    """jax.distributed.initialize for a multi-process run (before anything touches JAX)."""
    if args.num_processes > 1:
        if not args.coordinator_address:
            raise ValueError("--num-processes > 1 needs --coordinator-address HOST:PORT (process 0's)")
        from pagedjax.parallel.distributed import initialize

        initialize(args.coordinator_address, args.num_processes, args.process_id)


def engine_kwargs(args: argparse.Namespace) -> dict:
    max_num_seqs = 64 if args.max_num_seqs is None else args.max_num_seqs  # 0 is refused, not taken as unset
    return dict(block_size=args.block_size, num_blocks=args.num_blocks, max_num_seqs=max_num_seqs,
                max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=not args.no_prefix_caching, kv_cache=args.kv_cache, dtype=args.dtype,
                kv_cache_dtype=args.kv_cache_dtype,
                seed=args.seed, speculative_config=args.speculative_config,
                async_scheduling=not args.no_async_scheduling,
                tensor_parallel_size=args.tensor_parallel_size,
                data_parallel_size=args.data_parallel_size)


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one or more prompts, streaming it",
                       description="Generate text with the embedded default model or a local HF model dir.")
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompts (default: read one from stdin)")
    p.add_argument("--model", default=None, help="local Hugging Face model dir (default: SmolLM2-135M-Instruct)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    add_engine_arguments(p)
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from pagedjax.engine.llm_engine import LLMEngine
    from pagedjax.sampling_params import SamplingParams

    prompts = args.prompts or ([sys.stdin.read().strip()] if not sys.stdin.isatty() else [])
    if not prompts or not all(prompts):
        print("error: give at least one non-empty PROMPT (or pipe one on stdin)", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, min_p=args.min_p, seed=args.sample_seed, stop=args.stop,
                                ignore_eos=args.ignore_eos)
        init_processes(args)
        kwargs = engine_kwargs(args)
        if args.max_num_seqs is None:  # no bigger batch than the prompts: fewer, smaller shapes to compile
            kwargs["max_num_seqs"] = min(len(prompts), 64)
        engine = LLMEngine(args.model, stream_text=True, **kwargs)
        for i, prompt in enumerate(prompts):
            if args.chat:
                prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                              add_generation_prompt=True, tokenize=False)
            engine.add_request(str(i), prompt, params)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _stream(engine, len(prompts))
    return 0


def _stream(engine, n: int) -> None:
    """Prints text as it is produced: live for one prompt, per prompt when it ends otherwise."""
    shown = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            if n == 1:
                sys.stdout.write(text[shown:])
                sys.stdout.flush()
                shown = len(text)
            elif out.finished:
                print(f"--- [{out.request_id}] ---\n{text}")
    if n == 1:
        print()


def main(argv: list[str] | None = None) -> int:
    # transformers without torch advises on import that its models are unavailable; pagedjax
    # uses only its tokenizers and configs, so the line would only alarm a command-line user
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    parser = argparse.ArgumentParser(prog="pagedjax", description="JAX/Pallas LLM inference with a paged KV cache")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    try:
        from pagedjax.entrypoints.openai.api_server import add_serve_arguments, run_serve
    except ImportError:
        pass
    else:
        serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
        add_serve_arguments(serve)
        serve.set_defaults(func=run_serve)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    from pagedjax.compare import cli as compare_cli

    compare = bench.add_parser("compare", help="dense vs paged KV cache on one workload and KV budget",
                               description="Dense vs paged KV cache: same model, workload and KV memory budget; "
                                           "writes JSON, a markdown table and PNG plots.")
    compare_cli.add_arguments(compare)
    compare.set_defaults(func=compare_cli.run)
    args = parser.parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
