"""What `pagedjax bench throughput` and `bench latency` share: the model and engine flags (as
`pagedjax generate` takes them), the LLM they build, and random token-id prompts."""
from __future__ import annotations

import argparse
import sys

from pagedjax.entrypoints.cli_args import (add_engine_arguments, check_engine_arguments, engine_flags, engine_kwargs,
                                          flag_names, init_processes, model_help)


def add_model_arguments(p: argparse.ArgumentParser, check) -> None:
    """--model and every engine flag; `check(args)` runs after the engine flags' own checks."""
    p.add_argument("--model", default=None, help=model_help())
    add_engine_arguments(p)

    def both(args: argparse.Namespace) -> None:
        check(args)
        check_engine_arguments(args)
        if args.max_model_len is not None and args.input_len + args.output_len > args.max_model_len:
            raise ValueError(f"--input-len {args.input_len} + --output-len {args.output_len} is more than "
                             f"--max-model-len {args.max_model_len}")

    p.set_defaults(_check=both)


def positive(args: argparse.Namespace, *names: str) -> None:
    """ValueError naming the flag of the first of `names` that is not a positive integer."""
    for name in names:
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")


def make_llm(args: argparse.Namespace, input_len: int, output_len: int):
    """The LLM of the engine flags, its background warm-up finished (every step shape
    compiled); None after printing the error when it cannot be built or the lengths do not fit
    its max_model_len."""
    from pagedjax.entrypoints.llm import LLM

    try:
        init_processes(args)
        llm = LLM(args.model, **engine_kwargs(args))
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"{args._parser.prog}: error: {flag_names(str(e), engine_flags())}", file=sys.stderr)
        return None
    limit = llm.engine.max_model_len
    if input_len + output_len > limit:
        print(f"{args._parser.prog}: error: --input-len {input_len} + --output-len {output_len} is more than the "
              f"engine's max_model_len {limit} (set --max-model-len, or shorter lengths)", file=sys.stderr)
        return None
    llm.wait_for_warmup()
    return llm


def random_prompts(llm, n: int, length: int, rng) -> list[list[int]]:
    """n prompts of `length` token ids drawn (numpy Generator `rng`) from the model's
    vocabulary, its tokenizer's special tokens left out."""
    import numpy as np

    vocab = llm.engine.model_config.vocab_size
    special = set(getattr(llm.tokenizer, "all_special_ids", None) or ()) if llm.tokenizer is not None else set()
    ids = np.setdiff1d(np.arange(vocab), np.fromiter(special, dtype=np.int64, count=len(special)))
    return rng.choice(ids, size=(n, length)).tolist()
