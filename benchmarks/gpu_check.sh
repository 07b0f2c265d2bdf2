#!/usr/bin/env bash
# GPU check of dfllm's Triton kernels, in under 5 minutes on one CUDA GPU:
#   1. the kernel tests and the engine parity test on CUDA (bfloat16 included);
#   2. decode attention bandwidth against a device-to-device copy (benchmarks/bench_attention.py);
#   3. the generation benchmark (benchmarks/bench_generate.py --device cuda), dfllm and transformers on the GPU;
# then one summary table. Run from anywhere: bash benchmarks/gpu_check.sh
# Env: NUM_PROMPTS (default 64) for step 3; OUT_DIR for the logs and JSON (default a temp dir).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
OUT_DIR="${OUT_DIR:-$(mktemp -d)}"
NUM_PROMPTS="${NUM_PROMPTS:-64}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET   # compiled kernels, not the interpreter
mkdir -p "$OUT_DIR"

# ---- environment: torch must be there (never reinstalled); install only what is missing ----
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible to torch')"
missing=$(python - <<'PY'
import importlib.util
mods = {"triton": "triton", "transformers": "transformers", "tokenizers": "tokenizers",
        "safetensors": "safetensors", "gguf": "gguf", "jinja2": "jinja2", "psutil": "psutil",
        "tqdm": "tqdm", "pytest": "pytest"}
print(" ".join(pkg for mod, pkg in mods.items() if importlib.util.find_spec(mod) is None))
PY
)
if [[ -n "$missing" ]]; then
    echo "installing missing packages: $missing"
    python -m pip install -q $missing
fi
python -c "import dfllm" || python -m pip install -q --no-deps --no-build-isolation -e .

declare -A STATUS
step() {  # step NAME SECONDS CMD...: run with a time limit, log to $OUT_DIR/NAME.log, record pass/FAIL
    local name=$1 limit=$2; shift 2
    echo "=== $name (limit ${limit}s)"
    local rc=0
    timeout "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log" || rc=$?
    if [[ $rc -eq 0 ]]; then STATUS[$name]=ok; else STATUS[$name]="FAIL (rc $rc)"; fi
}

T0=$SECONDS
step tests 150 python -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_triton_engine.py
step attention 45 python benchmarks/bench_attention.py --json "$OUT_DIR/attention.json"
step generate 120 python benchmarks/bench_generate.py --device cuda --num-prompts "$NUM_PROMPTS" \
    --json "$OUT_DIR/generate.json"

# ---- summary ------------------------------------------------------------------------------------
TESTS_LINE=$(grep -E "passed|failed|error" "$OUT_DIR/tests.log" | tail -1 || true)
python - "$OUT_DIR" "${STATUS[tests]}" "${STATUS[attention]}" "${STATUS[generate]}" "$TESTS_LINE" \
    "$((SECONDS - T0))" <<'PY'
import json, os, sys
out, st_tests, st_attn, st_gen, tests_line, secs = sys.argv[1:]

def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None

a, g = load("attention.json"), load("generate.json")
rows = [("kernel tests (CUDA, bf16 incl.)", st_tests, tests_line.strip("= ") or "-")]
if a:
    rows.append(("decode attention", st_attn,
                 f"{a['attn_gb_s']:.0f} GB/s vs copy {a['copy_gb_s']:.0f} GB/s = {a['ratio']:.2f} "
                 f"({a['segments']} seg; no split {a['attn_nosplit_gb_s']:.0f} GB/s; err {a['rel_err']:.1e})"))
else:
    rows.append(("decode attention", st_attn, "-"))
if g:
    res = {r["engine"]: r for r in g["results"]}
    d, h = res.get("dfllm"), res.get("transformers")
    text = f"dfllm {d['tok_s']:.0f} tok/s" if d else "-"
    if h:
        text += f", transformers {h['tok_s']:.0f} tok/s, ratio {g['ratio']:.2f}x"
    if g.get("match"):
        text += f", greedy match {g['match']['fraction']:.2f}"
    rows.append(("generation (fp32)", st_gen, text))
else:
    rows.append(("generation (fp32)", st_gen, "-"))
print(f"\n==== dfllm GPU check ({secs}s, logs in {out})")
w = max(len(r[0]) for r in rows)
for name, status, detail in rows:
    print(f"{name:<{w}}  {status:<12} {detail}")
PY
for s in "${STATUS[@]}"; do [[ $s == ok ]] || exit 1; done
