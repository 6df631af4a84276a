"""Async scheduling: step t + 1 is scheduled and dispatched before step t's tokens are read
back; outputs must be exactly those of one step at a time, whatever stops, preempts or aborts."""
import numpy as np

from pagedjax import LLM, SamplingParams
from pagedjax.engine.llm_engine import LLMEngine


def _count_overlapped(engine) -> list[int]:
    """Counts steps dispatched while the previous one was still unread (a step observer)."""
    counter = [0]

    def count(record):
        counter[0] += record.dispatched_ahead

    engine.step_observers.append(count)
    return counter


def _workload(stop_token: int):
    rng = np.random.default_rng(3)
    shared = rng.integers(2, 384, size=24).tolist()  # a common prefix: cached blocks are shared
    prompts = [shared + rng.integers(2, 384, size=int(k)).tolist() for k in (1, 5, 9, 17, 30, 3, 12, 40)]
    params = [
        SamplingParams(max_tokens=12, ignore_eos=True),
        SamplingParams(max_tokens=20, stop_token_ids=[stop_token]),  # ends early, mid-step
        SamplingParams(max_tokens=9, temperature=0.8, seed=7, logprobs=2),
        SamplingParams(max_tokens=15, n=2, temperature=1.0, seed=1),  # forks after the prompt
        SamplingParams(max_tokens=1),
        SamplingParams(max_tokens=25, ignore_eos=True, top_k=5, temperature=0.7, seed=3),
        SamplingParams(max_tokens=6, stop_token_ids=[stop_token], ignore_eos=True),
        SamplingParams(max_tokens=18),
    ]
    return prompts, params


def _run(path, async_scheduling: bool, prompts, params):
    # a pool too small for all of them at once: requests are preempted and recomputed
    llm = LLM(str(path), max_num_seqs=4, max_model_len=128, block_size=8, num_blocks=14, warmup=False,
              async_scheduling=async_scheduling)
    overlapped = _count_overlapped(llm.engine)
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], "blocks leaked"
    got = [[(c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs] for o in outs]
    return got, overlapped[0], stats["num_preemptions"]


def test_async_outputs_equal_one_step_at_a_time(tiny_checkpoints):
    path, _ = tiny_checkpoints("llama")
    prompts, _ = _workload(0)
    probe = LLM(str(path), max_num_seqs=4, max_model_len=128, block_size=8, warmup=False)
    first = probe.generate([prompts[1]], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    stop_token = first[0].outputs[0].token_ids[4]  # a token greedy decoding of prompt 1 produces
    prompts, params = _workload(stop_token)
    want, overlapped_sync, _ = _run(path, False, prompts, params)
    got, overlapped, preemptions = _run(path, True, prompts, params)
    assert overlapped_sync == 0
    assert overlapped > 10, "async scheduling never dispatched a step ahead"
    assert preemptions > 0, "the workload was meant to preempt"
    assert any(c[1] == "stop" for o in got for c in o), "the workload was meant to stop on a token"
    assert got == want


def test_abort_while_a_step_is_in_flight(tiny_checkpoints):
    path, _ = tiny_checkpoints("qwen2")
    prompts = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14]]
    p = SamplingParams(max_tokens=10, ignore_eos=True)

    def run(abort: bool, async_scheduling: bool):
        engine = LLMEngine(str(path), stream_text=False, max_num_seqs=4, max_model_len=64, block_size=8,
                           num_blocks=32, async_scheduling=async_scheduling)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, p)
        done, records = {}, []
        engine.step_observers.append(records.append)
        for k in range(100):
            if not engine.has_unfinished_requests():
                break
            if abort and k == 3:
                assert records[-1].dispatched_ahead or not async_scheduling  # a step is in flight
                engine.abort_request("r1")
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        assert engine.pool.num_free == engine.pool.num_blocks
        return done

    want = run(False, False)
    got = run(True, True)
    assert "r1" not in got and got == {k: v for k, v in want.items() if k != "r1"}


def test_host_bound_requests_run_one_step_at_a_time(tiny_checkpoints):
    """Token masks and penalties need each token on the host before the next step."""
    path, _ = tiny_checkpoints("qwen2")
    llm = LLM(str(path), max_num_seqs=4, max_model_len=64, block_size=8, warmup=False)
    overlapped = _count_overlapped(llm.engine)
    llm.generate([[3, 4, 5]], SamplingParams(max_tokens=6, presence_penalty=0.5), use_tqdm=False)
    llm.generate([[3, 4, 5]], SamplingParams(max_tokens=6, allowed_token_ids=[5, 6, 7]), use_tqdm=False)
    assert overlapped[0] == 0
    llm.generate([[3, 4, 5]], SamplingParams(max_tokens=6), use_tqdm=False)
    assert overlapped[0] > 0
