"""Two processes on localhost (2 virtual CPU devices each, gloo collectives) run one tp = 4
engine: both return the same outputs, equal to transformers' and to one process's."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from tiny_models import hf_greedy

WORKER = Path(__file__).with_name("mp_worker.py")
PROMPTS = [[5, 6, 7, 8, 9] * 7, [11, 12, 13], list(range(20, 60))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_tp4_match_transformers_and_one_process(tiny_checkpoints):
    path, torch_model = tiny_checkpoints("llama")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PAGEDJAX_COMPILE_CACHE"] = "0"  # two processes compiling one program: no shared cache folder
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(path), str(port), str(i)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=600)
            line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
            assert p.returncode == 0 and line, f"worker failed:\n{out[-2000:]}\n{err[-4000:]}"
            results.append(json.loads(line[len("RESULT "):]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    a, b = results
    assert (a["process"], b["process"]) == (0, 1)
    assert a["devices"] == b["devices"] == 4 and a["local_devices"] == b["local_devices"] == 2
    assert a["greedy"] == b["greedy"] == [hf_greedy(torch_model, p, 10) for p in PROMPTS]
    assert a["sampled"] == b["sampled"] and a["sampled"][0] != a["sampled"][1]
    assert len(a["kv_pool_bytes_per_device"]) == 2  # each process holds its own devices' shards
    assert a["kv_blocks_free"] == a["kv_blocks_total"]
    from pagedjax import LLM, SamplingParams

    one = LLM(str(path), max_num_batched_tokens=32, max_num_seqs=8, num_blocks=64, max_model_len=256)
    sampled = one.generate(PROMPTS[:1], SamplingParams(n=2, max_tokens=6, temperature=0.9, seed=3, ignore_eos=True,
                                                       logprobs=1), use_tqdm=False)
    assert [list(c.token_ids) for c in sampled[0].outputs] == a["sampled"]


def test_serve_across_two_processes_listens_on_process_0_and_exits_with_it(tiny_checkpoints):
    import signal
    import time
    import urllib.request

    path, torch_model = tiny_checkpoints("llama")
    coord, port = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=2", PAGEDJAX_COMPILE_CACHE="0",
               PAGEDJAX_IDLE_TICK_S="0.2")  # idle ticks (followers' keep-alive broadcasts) before the requests
    cmd = [sys.executable, "-c", "import sys; from pagedjax.entrypoints.cli import main; sys.exit(main())", "serve", str(path),
           "--port", str(port), "-tp", "4", "--max-num-batched-tokens", "32", "--max-num-seqs", "8",
           "--num-blocks", "64", "--max-model-len", "256", "--num-processes", "2",
           "--coordinator-address", f"127.0.0.1:{coord}", "--served-model-name", "tiny"]
    procs = [subprocess.Popen(cmd + ["--process-id", str(i)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env) for i in range(2)]
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            assert all(p.poll() is None for p in procs), "a server process exited early"
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "the server never became healthy"
                time.sleep(0.5)
        time.sleep(1.5)
        for prompt in PROMPTS[:2]:  # two requests: the followers apply each add before its steps
            body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0,
                               "ignore_eos": True, "logprobs": 0}).encode()
            req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
            answer = json.loads(urllib.request.urlopen(req, timeout=120).read())
            tokens = answer["choices"][0]["logprobs"]["tokens"]  # "token_id:N": the model has no tokenizer
            assert [int(t.split(":")[1]) for t in tokens] == hf_greedy(torch_model, prompt, 10)
        procs[0].send_signal(signal.SIGINT)
        codes = [p.wait(timeout=60) for p in procs]
        assert codes == [0, 0], [p.stdout.read()[-3000:] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
