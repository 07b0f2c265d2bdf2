"""The one table of the GPU check, from steps.tsv and each step's JSON and log.

    python benchmarks/gpu/summary.py LOGS_DIR CPU(0|1) SECONDS

Each step's figures are read from its JSON where it wrote one, else the last line of its log;
the tests step lists every failing test by name (pytest's ``-rf`` lines). Exits 1 when a step failed.
"""

from __future__ import annotations

import json
import os
import re
import sys


def load(out: str, name: str):
    try:
        return json.load(open(os.path.join(out, name)))
    except (OSError, ValueError):
        return None


def log_lines(out: str, name: str) -> list[str]:
    try:
        return [ln.rstrip() for ln in open(os.path.join(out, f"{name}.log"), errors="replace") if ln.strip()]
    except OSError:
        return []


def log_tail(out: str, name: str) -> str:
    lines = log_lines(out, name)
    return lines[-1][:140] if lines else "no log"


class Table:
    def __init__(self, steps: dict[str, tuple[str, str, str]]):
        self.steps = steps
        self.rows: list[tuple[str, str, str, str, str]] = []  # step, check, status, secs, result

    def add(self, step: str, check: str, result: str, status: str | None = None) -> None:
        """A row; the step's own status (and secs) unless ``status`` is given (one of several rows)."""
        if step not in self.steps:  # left out (STEPS)
            return
        st, secs, detail = self.steps[step]
        first = not any(r[0] == step for r in self.rows)
        self.rows.append(
            (step if first else "", check, st if status is None else status, secs if first else "", detail or result)
        )

    def render(self) -> str:
        head = ("step", "check", "status", "secs", "")
        widths = [max(len(str(r[i])) for r in [*self.rows, head]) for i in range(4)]
        lines = [
            f"{head[0]:<{widths[0]}}  {head[1]:<{widths[1]}}  {head[2]:<{widths[2]}}  {head[3]:>{widths[3]}}  result"
        ]
        for r in self.rows:
            lines.append(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]:>{widths[3]}}  {r[4]}")
        return "\n".join(lines)


def setup_rows(t: Table, out: str) -> str:
    env = load(out, "setup.json")
    if not env:
        t.add("setup", "environment", log_tail(out, "setup"))
        return "?"
    res = (
        f"python {env['python']}, torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}, "
        f"transformers {env['transformers']}; {env['gpus']} x {env['gpu']}; host {env['cpu']}; "
        f"engine imported {'with' if env['dask_loaded_by_engine'] else 'without'} dask"
    )
    if env["errors"]:
        res += "; " + "; ".join(env["errors"])
    t.add("setup", "environment", res)
    return env["gpu"]


def kernel_rows(t: Table, out: str) -> None:
    kern = load(out, "kernels.json")
    start = len(t.rows)
    for r in (kern or {}).get("rows", []):
        if "error" in r:
            t.add("kernels", f"{r['kernel']} {r['dtype']}", r["error"], "FAIL")
        else:
            t.add(
                "kernels",
                f"{r['kernel']} {r['dtype']}",
                f"max|err| {r['max_abs_err']:8.2e}  triton {r['triton_ms']:8.3f} ms  torch {r['torch_ms']:8.3f} ms"
                f"  {r['speedup']:7.3g}x",
                "ok" if r["ok"] else f"FAIL (rel {r['rel_err']:.1e} > {r['tol']:.0e})",
            )
    done = t.rows[start:]
    if not done or (t.steps.get("kernels", ("",))[0] != "ok" and not any(r[2].startswith("FAIL") for r in done)):
        t.add("kernels", "Triton vs torch", f"{len(done)} cases done; {log_tail(out, 'kernels')}")


def attention_rows(t: Table, out: str) -> None:
    a = load(out, "attention.json")
    if a:
        t.add(
            "attention",
            f"decode bandwidth ({a.get('dtype') or a['shape'].split()[-1]})",
            f"{a['attn_gb_s']:.4g} GB/s = {a['ratio']:.3g} x copy {a['copy_gb_s']:.4g} GB/s "
            f"({a['segments']} seg; no split {a['attn_nosplit_gb_s']:.4g} GB/s; rel err {a['rel_err']:.1e}; "
            f"{a['shape']})",
        )
    else:
        t.add("attention", "decode bandwidth", log_tail(out, "attention"))


def graph_rows(t: Table, out: str) -> None:
    g = load(out, "graphs.json")
    if g and "batch_graphs" in g:
        t.add(
            "graphs",
            f"CUDA graphs vs eager ({g['dtype']}, peaked weights)",
            f"batch of {g['num_prompts']}: {g['batch_graphs']:.4g} vs {g['batch_eager']:.4g} tok/s = "
            f"{g['batch_speedup']:.3g}x; one sequence: {g['single_graphs']:.4g} vs {g['single_eager']:.4g} tok/s "
            f"= {g['single_speedup']:.3g}x; identical {g['identical']}/{g['num_prompts']}; "
            f"{len(g['graph_sizes'])} graphs",
        )
    else:
        t.add("graphs", "CUDA graphs vs eager", log_tail(out, "graphs"))


def host_rows(t: Table, out: str, name: str = "host", what: str = "decode step") -> None:
    h = load(out, f"{name}.json")
    runs = (h or {}).get("batches") or {}
    if not runs:
        t.add(name, f"time per {what} by phase", log_tail(out, name))
        return
    for batch, r in runs.items():
        phases = r.get("phases_ms") or {}
        parts = ", ".join(f"{k} {v:.3g}" for k, v in phases.items())
        extra = ""
        if r.get("device_forward_ms") is not None:
            extra = f"; forward on the device {r['device_forward_ms']:.3g} ms"
        t.add(
            name,
            f"{what}, batch {batch}",
            f"{r.get('step_ms', float('nan')):.3g} ms/step, host (all but the forward) "
            f"{r.get('host_ms', float('nan')):.3g} ms; {r.get('tok_s', float('nan')):.5g} tok/s; "
            f"median ms: {parts}{extra}",
        )


def async_rows(t: Table, out: str) -> None:
    """Asynchronous scheduling against the synchronous loop: tok/s at each batch both ran."""
    sync = ((load(out, "host.json") or {}).get("batches")) or {}
    runs = ((load(out, "host_async.json") or {}).get("batches")) or {}
    for batch, r in runs.items():
        s = sync.get(batch)
        if s and s.get("tok_s") and r.get("tok_s"):
            t.add(
                "host_async",
                f"async vs sync scheduling, batch {batch}",
                f"{r['tok_s']:.5g} vs {s['tok_s']:.5g} tok/s = {r['tok_s'] / s['tok_s']:.3g}x; wall ms/step "
                f"{r.get('wall_ms_per_step', float('nan')):.3g} vs {s.get('wall_ms_per_step', float('nan')):.3g}",
            )


def generate_rows(t: Table, out: str, name: str, label: str) -> None:
    g = load(out, f"{name}.json")
    if not g:
        t.add(name, label, log_tail(out, name))
        return
    modes = g.get("modes") or {"": g}
    mode = "forced" if "forced" in modes else next(iter(modes))
    fig = modes[mode]
    res = {r["engine"]: r for r in fig.get("results", [])}
    d, h = res.get("dfllm"), res.get("transformers")
    args = g.get("args") or {}
    text = f"dfllm {d['tok_s']:.5g} tok/s" if d else "no dfllm figure"
    if d and h:
        text += f", transformers {h['tok_s']:.4g} tok/s = {d['tok_s'] / h['tok_s']:.3g}x"
    roof = fig.get("roofline") or g.get("roofline")
    if isinstance(roof, dict) and roof.get("ceiling_tok_s"):
        text += (
            f"; roofline {roof['ceiling_tok_s']:.5g} tok/s, dfllm {100 * d['tok_s'] / roof['ceiling_tok_s']:.3g}%"
            if d
            else ""
        )
    busy = fig.get("device_busy") or g.get("device_busy")
    if isinstance(busy, dict) and busy.get("idle_fraction") is not None:
        text += f"; device idle {100 * busy['idle_fraction']:.3g}% of the run"
    fid = (fig.get("fidelity") or {}).get("transformers") or fig.get("match")
    if isinstance(fid, dict) and fid.get("fraction") is not None:
        text += f"; greedy match {fid['fraction']:.2f}"
    if args.get("num_prompts"):
        text += f" ({args['num_prompts']} prompts)"
    t.add(name, f"{label} ({args.get('dtype') or 'float32'})", text)


def tp_rows(t: Table, out: str) -> None:
    tp = load(out, "tp.json")
    if tp:
        t.add(
            "tp",
            f"tensor parallel ({tp['backend']})",
            f"tp=2 == one rank on {tp['identical']}/{tp['prompts']} prompts; tp=2 {tp['tp2_tok_s']:.4g} tok/s, "
            f"tp=1 {tp['tp1_tok_s']:.4g} tok/s ({tp['model']})",
        )
    else:
        t.add("tp", "tensor parallel", log_tail(out, "tp"))


def test_rows(t: Table, out: str, cpu: bool) -> None:
    lines = log_lines(out, "tests")
    summary = next(
        (ln.strip("= ") for ln in reversed(lines) if re.search(r"\b(passed|failed|error|no tests ran)\b", ln)),
        "no summary line",
    )
    t.add("tests", "CUDA tests" if not cpu else "kernel tests (interpreter subset)", summary)
    for ln in lines:
        if ln.startswith(("FAILED ", "ERROR ")):
            t.add("tests", "failed" if ln.startswith("FAILED") else "error", ln.split(" ", 1)[1][:160], "FAIL")


def main() -> int:
    out, cpu, total = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
    steps = {}
    for line in open(os.path.join(out, "steps.tsv")):
        name, status, secs, detail = line.rstrip("\n").split("\t")
        steps[name] = (status, secs, detail)
    t = Table(steps)
    gpu = setup_rows(t, out)
    kernel_rows(t, out)
    attention_rows(t, out)
    graph_rows(t, out)
    host_rows(t, out)
    host_rows(t, out, "host_async", "decode step, asynchronous scheduling")
    async_rows(t, out)
    host_rows(t, out, "host_text", "detokenized decode step")
    generate_rows(t, out, "generate", "chat workload vs transformers")
    generate_rows(t, out, "nano", "nano-vllm workload")
    tp_rows(t, out)
    test_rows(t, out, cpu)
    failed = sorted(name for name, (st, _, _) in steps.items() if st.startswith("FAIL"))
    kind = "CPU dry run (--cpu)" if cpu else "GPU check"
    print(f"==== dfllm {kind} on {gpu}: {total} s, {'FAILED: ' + ', '.join(failed) if failed else 'all steps ok'}")
    print(t.render())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
