"""The requests `pagedjax bench serve` sends: random, shared-prefix, or read from a file of chats.

No tokenizer is needed. For /v1/completions the random and prefix prompts are token ids (their
lengths are exact); for chat they are text of common English words, one word per requested
token (about one token each for BPE tokenizers; the server's `usage` gives the exact count).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

# common English words; with a leading space most BPE vocabularies hold each as one token
WORDS = ("the of and to in is was for on that with as by at from his it an were are which this be has or had "
         "not but also first one their its new after who they have her she two been other when there all during "
         "into school time may years more most only over city some world would where later up such used many can "
         "state about national out known university united then made between part team game well year people "
         "year being film while south north under both high life group series three since against government "
         "began second several where house work before number best name through them long way each music war "
         "place area found last early did own back until those became family based around area water river "
         "small great public four history major although old day end played left large band").split()
WORDS = tuple(dict.fromkeys(WORDS))  # each once

ENDPOINT_TYPES = ("completions", "chat")
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
          "bard": "assistant", "model": "assistant", "system": "system", "tool": "tool"}


@dataclass(slots=True)
class BenchRequest:
    """One request of the load: `prompt` (token ids or text) for /v1/completions, `messages` for
    chat; `max_tokens` its output length; `prompt_len` the prompt's tokens where known
    without a tokenizer (token-id prompts), else None."""

    max_tokens: int
    prompt: list[int] | str | None = None
    messages: list[dict] | None = None
    prompt_len: int | None = None


def lengths(rng: random.Random, mean: int, spread: float, n: int) -> list[int]:
    """n lengths uniform in [mean * (1 - spread), mean * (1 + spread)], at least 1."""
    lo, hi = max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread)))
    return [rng.randint(lo, hi) for _ in range(n)]


def _ids(rng: random.Random, n: int, id_range: tuple[int, int]) -> list[int]:
    return [rng.randrange(*id_range) for _ in range(n)]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def random_requests(n: int, input_len: int, input_spread: float, output_len: int, output_spread: float,
                    endpoint_type: str, seed: int = 0, id_range: tuple[int, int] = (1000, 20000)) -> list[BenchRequest]:
    """`random`: each prompt drawn on its own (token ids for completions, words for chat)."""
    rng = random.Random(seed)
    ins, outs = lengths(rng, input_len, input_spread, n), lengths(rng, output_len, output_spread, n)
    if endpoint_type == "completions":
        return [BenchRequest(m, prompt=_ids(rng, k, id_range), prompt_len=k) for k, m in zip(ins, outs)]
    return [BenchRequest(m, messages=[{"role": "user", "content": _words(rng, k)}]) for k, m in zip(ins, outs)]


def prefix_requests(n: int, num_prefixes: int, prefix_len: int, input_len: int, input_spread: float, output_len: int,
                    output_spread: float, endpoint_type: str, seed: int = 0,
                    id_range: tuple[int, int] = (1000, 20000)) -> list[BenchRequest]:
    """`prefix`: `num_prefixes` shared prefixes of `prefix_len` tokens, each starting an equal
    share of the requests (in shuffled order), then a suffix of its own of `input_len` tokens.
    Chat: the prefix is the system message, the suffix the user message."""
    rng = random.Random(seed)
    ins, outs = lengths(rng, input_len, input_spread, n), lengths(rng, output_len, output_spread, n)
    which = [i % num_prefixes for i in range(n)]
    rng.shuffle(which)
    if endpoint_type == "completions":
        prefixes = [_ids(rng, prefix_len, id_range) for _ in range(num_prefixes)]
        return [BenchRequest(m, prompt=prefixes[p] + _ids(rng, k, id_range), prompt_len=prefix_len + k)
                for p, k, m in zip(which, ins, outs)]
    prefixes = [_words(rng, prefix_len) for _ in range(num_prefixes)]
    return [BenchRequest(m, messages=[{"role": "system", "content": prefixes[p]},
                                      {"role": "user", "content": _words(rng, k)}])
            for p, k, m in zip(which, ins, outs)]


def read_records(path: str | Path) -> list:
    """The records of a .json file (a list of them) or a .jsonl file (one per line)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--dataset-path: no such file: {path}")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".jsonl" or (not text.lstrip().startswith("[") and path.suffix != ".json"):
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        records = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--dataset-path: {path} is not valid JSON / JSON Lines ({e})") from None
    if not isinstance(records, list):
        raise ValueError(f"--dataset-path: {path} must hold a JSON list of records (or be JSON Lines)")
    return records


def _message(turn, where: str) -> dict:
    if not isinstance(turn, dict):
        raise ValueError(f"{where}: a turn must be an object, got {type(turn).__name__}")
    role = turn.get("role", turn.get("from"))
    content = turn.get("content", turn.get("value"))
    if role not in _ROLES:
        raise ValueError(f"{where}: unknown role {role!r} (known: {', '.join(_ROLES)})")
    if content is None:
        raise ValueError(f"{where}: a turn needs 'content' (or ShareGPT's 'value')")
    return {"role": _ROLES[role], "content": content}


def record_request(record, index: int, endpoint_type: str, output_len: int) -> BenchRequest | None:
    """One record as a request: the turns up to its last user turn (a reference reply after it
    is dropped), or its `prompt` text; `max_tokens` from the record, else `output_len`. None:
    a conversation with no user turn (skipped)."""
    where = f"--dataset-path record {index}"
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record must be an object, got {type(record).__name__}")
    max_tokens = record.get("max_tokens", output_len)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"{where}: max_tokens must be a positive integer, got {max_tokens!r}")
    if isinstance(record.get("prompt"), str):
        if endpoint_type == "completions":
            return BenchRequest(max_tokens, prompt=record["prompt"])
        return BenchRequest(max_tokens, messages=[{"role": "user", "content": record["prompt"]}])
    turns = record.get("messages", record.get("conversations"))
    if not isinstance(turns, list):
        raise ValueError(f"{where}: needs 'conversations' or 'messages' (a list of turns) or 'prompt' (a string)")
    messages = [_message(t, f"{where} turn {i}") for i, t in enumerate(turns)]
    if endpoint_type != "chat":
        raise ValueError(f"{where} is a conversation: send it with --endpoint-type chat")
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is None:
        return None
    return BenchRequest(max_tokens, messages=messages[:last_user + 1])


def file_requests(path: str | Path, n: int, endpoint_type: str, output_len: int, seed: int = 0) -> list[BenchRequest]:
    """`n` requests from a file of chats, shuffled with `seed`, reused in turn when the file
    has fewer usable records than `n`."""
    records = read_records(path)
    usable = [req for i, rec in enumerate(records)
              if (req := record_request(rec, i, endpoint_type, output_len)) is not None]
    if not usable:
        raise ValueError(f"--dataset-path: none of the {len(records)} records of {path} has a user turn or a prompt")
    random.Random(seed).shuffle(usable)
    return [usable[i % len(usable)] for i in range(n)]
