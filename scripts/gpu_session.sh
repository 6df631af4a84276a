#!/usr/bin/env bash
# Every GPU check of the project in one prepared run (a lent GPU's minutes are few):
#
#     PYTHONPATH=. bash scripts/gpu_session.sh [LOG_DIR]     # on the GPU machine, from the repo root
#     (through the device tool: LOG_DIR "$OUT", so that the logs come back)
#
# Stages, each under its own time limit so one hang cannot eat the others, each log in LOG_DIR
# (default results/gpu_session):
#   1. env         jax / torch versions and the device
#   2. kernels     the Pallas GPU kernels compiled, against the jnp reference (gpu_kernel_check.py)
#   3. parity      the engine (Pallas kernels, float32) against transformers, token for token, on
#                  tiny random checkpoints of every family (tests/engine/test_parity.py)
#   4. e2e_bf16    the engine end to end in bf16, speculation off and on, and transformers bf16 on
#                  the same GPU (gpu_e2e_bf16.py --hf)
#      e2e_unrolled the same with the layers unrolled instead of under scan: is XLA:GPU's while
#                  loop (a host round trip per layer) where the flat step time goes?
#   5. decode_steps decode step time, layers under scan and unrolled, speculation off and on
#                  (gpu_decode_steps.py: compiles only the shapes it uses, ~20-50 s each); to
#                  compare with an older tree, `git archive REV pagedjax models pallas_kernels`
#                  into an ignored folder, carry it, and run the script with PYTHONPATH=<folder>
#      step_times  a step's host work against its wait for the device, async scheduling off and on
#                  (step_times.py; float32, four engines warmed up: slow)
#      decode_floor decode step ms at batch 1, 16, 64, 256 against the HBM floor, the default
#                  model (or its random SmolLM2 shape) and a random 1B Llama (decode_floor.py)
#   6. default model, when its GGUF is cached (models/default_model.py; no network is needed):
#      spec_bf16        scripts/bench_speculative.py in bf16 on the real checkpoint
#      default_parity   greedy tokens against transformers on the real checkpoint (float32)
# STAGES="spec_bf16 default_parity" runs only the stages named. On the H200: env 9 s, kernels 72,
# parity 58, e2e_bf16 93 (--repeats 1, no --hf) to 200 (92 with --hf --repeats 2 once steps took
# ~2 ms), decode_steps ~110, spec_bf16 92, default_parity 61; all stages
# together may not fit one 10-minute call. Prints a summary line per stage;
# the exit code is the number of stages that failed.
set -u
LOG=${1:-results/gpu_session}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false  # several processes share the GPU
PY=${PYTHON:-python3}
failed=0
summary=()

stage() {  # stage NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    if [ -n "${STAGES:-}" ] && [[ " ${STAGES//,/ } " != *" $name "* ]]; then return; fi
    local start=$SECONDS
    echo "=== $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" >"$LOG/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$LOG/$name.log"
    summary+=("$name: rc=$rc in $((SECONDS - start))s")
    [ "$rc" -ne 0 ] && failed=$((failed + 1))
    echo "=== $name: rc=$rc in $((SECONDS - start))s"
}

stage env 60 bash -c "nvidia-smi -L; $PY -c 'import jax, flax, transformers, torch; print(\"jax\", jax.__version__, jax.devices(), \"flax\", flax.__version__, \"transformers\", transformers.__version__, \"torch\", torch.__version__)'"
stage kernels 150 "$PY" scripts/gpu_kernel_check.py --no-bench --workers 6
stage parity 100 "$PY" -m pytest tests/engine/test_parity.py -k test_greedy_matches_transformers -n 4 --dist load -p no:cacheprovider -q -rs
stage e2e_bf16 200 "$PY" scripts/gpu_e2e_bf16.py --hf
stage e2e_unrolled 200 "$PY" scripts/gpu_e2e_bf16.py --scan-layers off --repeats 2
stage decode_steps 200 bash -c "for a in '--scan-layers on' '--scan-layers off' '--scan-layers on --speculate 4'; do $PY scripts/gpu_decode_steps.py \$a || exit; done"
stage step_times 240 "$PY" scripts/step_times.py --repeats 2 --pool-sizes 256
# issue 49: decode steps at batch 1-256 against the HBM floor (a 1 GiB read on the device), the
# SmolLM2-shaped model and a random Llama-3.2-1B-shaped one (weights made on the device, no checkpoint)
stage decode_floor 300 bash -c "$PY scripts/decode_floor.py --batches 1,16,64,256 --repeats 2 && $PY scripts/decode_floor.py --model random-1b --batches 1,16,64,256 --repeats 2"
if "$PY" -c "import sys; from models.default_model import cache_root, GGUF_NAME; sys.exit(not (cache_root() / 'gguf' / GGUF_NAME).is_file())"; then
    stage spec_bf16 260 "$PY" scripts/bench_speculative.py --dtype bfloat16 --repeats 2 --batch-1-prompts 2 \
        --output "$LOG/bench_speculative.json"
    stage default_parity 120 "$PY" -m pytest tests/models/test_default_model.py -n 0 -p no:cacheprovider -q -rs
else
    summary+=("default model: skipped (no GGUF under the cache)")
fi
printf '%s\n' "--- summary" "${summary[@]}"
exit "$failed"
