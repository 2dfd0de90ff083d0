#!/usr/bin/env bash
# The GPU checks of a session that has one: tests/test_cuda.py and bench/step.py on CUDA, logs in one folder;
# sized for about 9 minutes in all (under the device tool's 600 s a call) (each stage has its own limit: *_SECONDS).
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

# 1. the CUDA tests: parity with eager (fx, inductor, autocast), a steady step that never waits, and
#    compile(cuda_graph=True): bit for bit with and without graphs, a GradScaler's skip, dropout, a size change,
#    no host sync and O(1) launches in a replay
timeout "${TEST_SECONDS:-240}" "$py" -m pytest -v -p no:cacheprovider -rfEs tests/test_cuda.py > "$out/test_cuda.log" 2>&1
echo "tests/test_cuda.py: exit $?"; tail -n 25 "$out/test_cuda.log"

# 2. step time on the models where issuing ops takes the time: graphs against torch.compile's reduce-overhead
timeout "${BENCH_SECONDS:-160}" "$py" bench/step.py --device cuda --steps "${STEPS:-10}" \
  --models "${MODELS:-gpt-mini,mixtral-tiny}" \
  --backends "${BACKENDS:-fx,fx+graph,spmd-inductor+graph,inductor,reduce-overhead}" > "$out/bench.log" 2>&1
echo "bench/step.py --device cuda: exit $?"; grep -v "Warning\|warn" "$out/bench.log" | tail -n 30

# 3. GPT-2 small (124 M, batch 16 x 1024) in TF32, where arithmetic takes the time: step time and MFU
timeout "${GPT2_SECONDS:-150}" "$py" bench/step.py --device cuda --tf32 --steps "${GPT2_STEPS:-4}" --models gpt2-small \
  --backends "${GPT2_BACKENDS:-fx+graph,spmd-inductor+graph,reduce-overhead}" > "$out/gpt2.log" 2>&1
echo "bench/step.py gpt2-small: exit $?"; grep -v "Warning\|warn" "$out/gpt2.log" | tail -n 12
