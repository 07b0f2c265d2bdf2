#!/usr/bin/env bash
# Packs, HERE, what the GPU machine lacks, into .gpu/ (git-ignored through .git/info/exclude), so
# that benchmarks/gpu/check.sh can run there with no network: the device's `run` takes .gpu/
# along (`carry: [".gpu"]`, 64 MiB with the working tree).
#   .gpu/wheels/     cp312 manylinux wheels of the packages the device's Python lacks and the
#                    engine's structured-output tests import (xgrammar and its dependencies), at
#                    the versions installed here, and a wheel of dfllm itself (its metadata:
#                    importlib.metadata.version("dfllm")); --with-dask adds the Dask stack
#   .gpu/tokenizer/  SmolLM2's tokenizer files and chat template (3.6 MB), from the bundled model
#
#   bash benchmarks/gpu/pack.sh [--with-dask]
# then, on the device: bash benchmarks/gpu/check.sh   (reads .gpu/, writes $OUT)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
PY=${PYTHON:-python}
DASK=0
[[ ${1:-} == --with-dask ]] && DASK=1
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu/wheels .gpu/tokenizer

# the device has Python 3.12, torch, triton, transformers, numpy, pandas, pyarrow (gpu-device.md)
WANT=(xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection)
((DASK)) && WANT+=(dask distributed partd locket zict tblib)
PINS=()
for name in "${WANT[@]}"; do
    v=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
    PINS+=("$name==$v")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .gpu/wheels "${PINS[@]}"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w .gpu/wheels . >/dev/null

"$PY" - <<'PY'
import shutil
from dfllm.models.bundled import resolve_model
src = resolve_model("smollm2-135m-instruct")
for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
             "generation_config.json"):
    if (src / name).exists():
        shutil.copy(src / name, f".gpu/tokenizer/{name}")
PY
du -sh .gpu
ls .gpu/wheels
