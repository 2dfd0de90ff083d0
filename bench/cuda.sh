#!/usr/bin/env bash
# The GPU checks of a session that has one: tests/test_cuda.py and bench/step.py on CUDA, logs in one folder.
#
# Run:  bash bench/cuda.sh [OUTDIR]     (python3 with a CUDA build of torch; PYTHON=... to pick another)
#
# Uses the torch, onnxruntime and transformers already installed (a GPU image's own; nothing is installed):
# the package runs from a copy of this checkout with passes/ placed as spmd_ort/passes, as the installed
# package has it. Each stage has its own time limit, so one that hangs or runs long leaves the others' logs.
set -u
out=${1:-out/cuda}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
cp -r "$root/spmd_ort" "$root/tests" "$root/examples" "$root/bench" "$root/csrc" "$root/pyproject.toml" "$work/"
cp -r "$root/passes" "$work/spmd_ort/passes"
cd "$work" || exit 1

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$py" -c "import importlib, os, sys, torch
print('python', sys.version.split()[0], '| cuda', torch.version.cuda, '| cpus', os.cpu_count())
for name in ('torch', 'onnxruntime', 'onnxscript', 'transformers', 'triton'):
    try:
        m = importlib.import_module(name)
        print(name, m.__version__, *(m.get_available_providers() if name == 'onnxruntime' else ()))
    except Exception as exc:
        print(name, 'not importable:', exc)"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

timeout "${TEST_SECONDS:-210}" "$py" -m pytest -q -p no:cacheprovider -rfEs tests/test_cuda.py > "$out/test_cuda.log" 2>&1
echo "tests/test_cuda.py: exit $?"; tail -n 25 "$out/test_cuda.log"

timeout "${BENCH_SECONDS:-270}" "$py" bench/step.py --device cuda --steps "${STEPS:-10}" \
  --models "${MODELS:-gpt-mini,mlp,cnn,mixtral-tiny}" --backends fx,ort,spmd-inductor,inductor > "$out/bench.log" 2>&1
echo "bench/step.py --device cuda: exit $?"; grep -v "Warning\|warn" "$out/bench.log" | tail -n 30
