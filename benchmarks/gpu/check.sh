#!/usr/bin/env bash
# The GPU check of dfllm: runs ON the GPU machine, offline, in about 7 minutes, and ends in ONE table
# (table.txt) and one archive of every log and JSON (gpu-check.tar.gz), both in $OUT (else OUT_DIR).
# Prepare it here first: `bash benchmarks/gpu/pack.sh` fills .gpu/ (wheels the device lacks, the
# tokenizer); the device's run carries .gpu and calls `bash benchmarks/gpu/check.sh`.
#   setup      install .gpu/wheels offline into a private folder (never torch), point dfllm's cache at
#              the tokenizer (.gpu/tokenizer), build the CPU kernels in the background (the test
#              suite's conftest needs them) and the random-weight models (build_models.py);
#   kernels    every Triton kernel vs its PyTorch reference, fp16 and bf16 (bench_kernels.py);
#   attention  decode attention's bandwidth vs a device-to-device copy (bench_attention.py);
#   graphs     CUDA graphs vs enforce_eager on the SmolLM2 shape, peaked weights (bench_cuda_graphs.py);
#   host       the engine's time per decode step by phase, batch 1/64/256, a torch.profiler table
#              (bench_host.py);
#   host_async the host step again under asynchronous scheduling (async_scheduling=True), the same
#              model and batches: the figures that decide its default;
#   host_text  the same on the SmolLM2 shape with its tokenizer, every request detokenized, batch 1/256
#              (bench_host.py --detokenize: the text's share of the host's time);
#   generate   the 1B shape on the chat workload vs transformers, against the device's roofline
#              (bench_generate.py --device cuda);
#   nano       the 1B shape on nano-vllm's workload (256 sequences, 100-1024 in and out);
#   tp         tensor_parallel_size=2 vs one rank, when two GPUs are visible (tp_check.py);
#   tests      the CUDA tests, failures listed by name (-rf), each test time-limited.
# Every step has a time limit cut to what is left of BUDGET_S; the script exits 1 if a step failed.
#
#   bash benchmarks/gpu/check.sh          # on the GPU machine
#   bash benchmarks/gpu/check.sh --cpu    # dry run of every step on a CPU (Triton's interpreter, tiny
#                                         # shapes, a tiny model): what CI runs so that this cannot rot
# Env: OUT_DIR (default $OUT, else a new temp dir), BUDGET_S (default 420), STEPS (default all: a
# space-separated subset to run), PYTHON (default python3), TESTS (pytest arguments of the tests step).
set -uo pipefail  # no -e: a failed step is recorded and the next one still runs

CPU=0
for arg in "$@"; do
    case $arg in
        --cpu) CPU=1 ;;
        -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "unknown argument: $arg (try --help)" >&2; exit 2 ;;
    esac
done

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HERE="$REPO/benchmarks/gpu"
cd "$REPO" || exit 2
OUT_DIR="${OUT_DIR:-${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/dfllm-gpu-check.XXXXXX")}}"
mkdir -p "$OUT_DIR"
LOGS="$OUT_DIR/logs"  # everything but the table and the archive; archived at the end
mkdir -p "$LOGS"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/dfllm-gpu-work.XXXXXX")"  # models, the private site, the cache
BUDGET_S="${BUDGET_S:-420}"
STEPS="${STEPS:-setup kernels attention graphs host host_async host_text generate nano tp tests}"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"  # dfllm from this checkout
if ((CPU)); then
    export CUDA_VISIBLE_DEVICES=""  # everything on the CPU, even on a GPU machine
    export TRITON_INTERPRET=1       # Triton kernels through the interpreter
    DEVICE=cpu
else
    unset TRITON_INTERPRET
    DEVICE=cuda
fi
: > "$LOGS/steps.tsv"
T0=$SECONDS
FAILED=0

note() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${4:-}" >> "$LOGS/steps.tsv"; }
wanted() { [[ " $STEPS " == *" $1 "* ]]; }

step() {  # step NAME LIMIT CMD...: run with a time limit (cut to the budget left), log, record status
    local name=$1 limit=$2; shift 2
    wanted "$name" || return 0
    local left=$((BUDGET_S - (SECONDS - T0) - 10))  # 10 s kept for the summary and the archive
    ((limit > left)) && limit=$left
    if ((limit < 10)); then
        echo "=== $name: not run, ${left}s of the ${BUDGET_S}s budget left"
        note "$name" "FAIL (no time left)" 0 "not run: the ${BUDGET_S}s budget is spent"
        FAILED=1
        return
    fi
    echo "=== $name (limit ${limit}s): $*"
    local t0=$SECONDS rc
    timeout --kill-after=5 "$limit" "$@" > "$LOGS/$name.log" 2>&1
    rc=$?
    tail -n 25 "$LOGS/$name.log"
    local status=ok
    if ((rc == 124 || rc == 137)); then status="FAIL (timeout ${limit}s)"
    elif ((rc != 0)); then status="FAIL (rc $rc)"
    fi
    [[ $status == ok ]] || FAILED=1
    note "$name" "$status" $((SECONDS - t0))
}

# ---- setup ------------------------------------------------------------------------------------------
setup() {
    local site="$WORK/site"
    if ((!CPU)) && compgen -G "$REPO/.gpu/wheels/*.whl" >/dev/null; then  # pack.sh's (cp312), offline
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
            "$REPO"/.gpu/wheels/*.whl || return 1
    fi
    # the dfllm wheel gives the installed metadata; the checkout's code comes first on the path
    export PYTHONPATH="$REPO:$site${PYTHONPATH:+:$PYTHONPATH}"
    local tok="$REPO/.gpu/tokenizer"
    if ((CPU)) || [[ ! -f $tok/tokenizer.json ]]; then  # the bundled model, installed here
        tok=$("$PY" -c "from dfllm.models.bundled import resolve_model; print(resolve_model())") || return 1
    else
        # The tests resolve the bundled alias for its tokenizer only: on the device (no bundled
        # package), a cache entry holding the tokenizer files and the conversion marker stands in
        # for the converted model (no weights: a test loading them fails, and says so).
        export DFLLM_CACHE_DIR="$WORK/cache"
        local entry="$DFLLM_CACHE_DIR/models/smollm2-135m-instruct"
        mkdir -p "$entry" && cp "$tok"/* "$entry"/ && echo '{"tokenizer_only": true}' > "$entry/dfllm_bundled.json"
    fi
    # the CPU kernels, for the tests' conftest: built in the background while the benchmarks run
    ( "$PY" -c "from dfllm.kernels import _cpu; _cpu.load()" > "$LOGS/cpu-kernels.log" 2>&1 & )
    local models=(smollm2 llama-1b) dtype=bfloat16
    ((CPU)) && models=(tiny) && dtype=float32
    "$PY" "$HERE/build_models.py" "$WORK/models" --tokenizer "$tok" --models "${models[@]}" --dtype "$dtype" \
        || return 1
    "$PY" "$HERE/environment.py" "$LOGS/setup.json" "$DEVICE" || return 1
}
if wanted setup; then
    t0=$SECONDS
    echo "=== setup"
    if setup > "$LOGS/setup.log" 2>&1; then note setup ok $((SECONDS - t0)); else
        note setup "FAIL" $((SECONDS - t0)); FAILED=1; fi
    tail -n 15 "$LOGS/setup.log"
fi
GPUS=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['gpus'])" "$LOGS/setup.json" 2>/dev/null \
       || echo 0)
if ((!CPU && GPUS == 0)); then
    echo "no CUDA device (see $LOGS/setup.log): the GPU steps cannot run; use --cpu for the dry run" >&2
    STEPS="setup"
    FAILED=1
fi
if ((CPU)); then SMALL="$WORK/models/tiny"; BIG="$WORK/models/tiny"
else SMALL="$WORK/models/smollm2"; BIG="$WORK/models/llama-1b"; fi

# ---- the steps ----------------------------------------------------------------------------------
if ((CPU)); then
    step kernels 120 "$PY" benchmarks/bench_kernels.py --cpu --only rms_norm --json "$LOGS/kernels.json"
    step attention 60 "$PY" benchmarks/bench_attention.py --tiny --json "$LOGS/attention.json"
    note graphs skipped 0 "skipped: --cpu dry run (CUDA graphs need a GPU)"
    step host 90 "$PY" benchmarks/bench_host.py --device cpu --model "$SMALL" --batches 1 4 --max-tokens 6 \
        --repeats 1 --profile 2 --json "$LOGS/host.json"
    step host_async 60 "$PY" benchmarks/bench_host.py --device cpu --model "$SMALL" --batches 1 4 --max-tokens 6 \
        --repeats 1 --async-scheduling --json "$LOGS/host_async.json"
    step host_text 60 "$PY" benchmarks/bench_host.py --device cpu --model "$SMALL" --detokenize --batches 1 4 \
        --max-tokens 6 --repeats 1 --json "$LOGS/host_text.json"
    step generate 120 "$PY" benchmarks/bench_generate.py --device cpu --model "$SMALL" --num-prompts 2 \
        --mode forced --skip-llama-cpp --skip-breakdown --json "$LOGS/generate.json"
    step nano 90 "$PY" benchmarks/bench_generate.py --device cpu --model "$BIG" --workload nano-vllm \
        --num-prompts 2 --length-scale 0.02 --skip-hf --skip-llama-cpp --skip-breakdown --json "$LOGS/nano.json"
    note tp skipped 0 "skipped: --cpu dry run"
    TEST_ARGS=(tests/kernels/test_kernels.py -k "test_rms_norm and dtype0")
    [[ -n ${TESTS:-} ]] && read -ra TEST_ARGS <<< "$TESTS"
    step tests 120 "$PY" -m pytest -q -rf -p no:cacheprovider --timeout 120 "${TEST_ARGS[@]}"
else
    step kernels 60 "$PY" benchmarks/bench_kernels.py --json "$LOGS/kernels.json"
    step attention 30 "$PY" benchmarks/bench_attention.py --json "$LOGS/attention.json"
    step graphs 60 "$PY" benchmarks/bench_cuda_graphs.py --model "$SMALL" --json "$LOGS/graphs.json"
    # the issue's tiny model (2 layers, hidden 256, vocabulary 512): the host's share of a step
    step host 60 "$PY" benchmarks/bench_host.py --device cuda --batches 1 64 256 --max-tokens 128 --repeats 3 \
        --profile 20 --json "$LOGS/host.json"
    step host_async 45 "$PY" benchmarks/bench_host.py --device cuda --batches 1 64 256 --max-tokens 128 --repeats 3 \
        --async-scheduling --json "$LOGS/host_async.json"
    step host_text 45 "$PY" benchmarks/bench_host.py --device cuda --model "$SMALL" --detokenize --batches 1 256 \
        --max-tokens 64 --repeats 2 --json "$LOGS/host_text.json"
    step generate 120 "$PY" benchmarks/bench_generate.py --device cuda --model "$BIG" --dtype bfloat16 \
        --num-prompts 1024 --mode forced --skip-llama-cpp --skip-breakdown --json "$LOGS/generate.json"
    step nano 90 "$PY" benchmarks/bench_generate.py --device cuda --model "$BIG" --dtype bfloat16 \
        --workload nano-vllm --skip-hf --skip-llama-cpp --skip-breakdown --json "$LOGS/nano.json"
    if ((GPUS > 1)); then step tp 90 "$PY" "$HERE/tp_check.py" "$LOGS" cuda
    else wanted tp && note tp skipped 0 "skipped: $GPUS GPU"; fi
    TEST_ARGS=(tests/kernels/test_kernels.py tests/engine/test_triton_engine.py tests/engine/test_sampler_device.py
               tests/engine/test_cuda_graphs.py tests/engine/test_device_syncs.py tests/models/test_moe.py)
    [[ -n ${TESTS:-} ]] && read -ra TEST_ARGS <<< "$TESTS"
    step tests 240 "$PY" -m pytest -q -rf -p no:cacheprovider --timeout 90 "${TEST_ARGS[@]}"
fi

"$PY" "$HERE/summary.py" "$LOGS" "$CPU" "$((SECONDS - T0))" | tee "$OUT_DIR/table.txt"
[[ ${PIPESTATUS[0]} == 0 ]] || FAILED=1
tar czf "$OUT_DIR/gpu-check.tar.gz" -C "$OUT_DIR" logs && rm -rf "$LOGS"
rm -rf "$WORK"
exit "$FAILED"
