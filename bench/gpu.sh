#!/usr/bin/env bash
# The GPU measurements of docs/BENCHMARKS.md in one run, the most important first:
#
#   bench/gpu.sh OUT_DIR [SECONDS [STEPS]]
#
# versions, the CUDA tests, the LM head at B=1 T=8192 H=4096 V=151936 bf16 (then V=248320), the KL of two heads,
# logitless's tokens-per-chunk curve on each schedule (the CUDA defaults come from it), GRPO and GRADE end to
# end, JAX. Each step has a time limit, and one that would not fit in what is left of SECONDS (default 540) is
# skipped; STEPS, a regular expression, picks the steps by name (default: all), as a second run does for the
# steps the first had no time for. OUT_DIR gets two files, rewritten after every step so that a run stopped early
# still leaves the steps before it: gpu.log (everything printed) and gpu.tar (each step's log, JSON and PNG).
#
# Packages the machine lacks travel as wheels in .whl/ (`make gpu-wheels`); they are installed with --no-deps
# into a scratch directory ahead of the machine's own. logitless runs from this tree's src/.
set -u
OUT=${1:?usage: bench/gpu.sh OUT_DIR [SECONDS [STEPS]]}
BUDGET=${2:-540}
ONLY=${3:-.}
PYTHON=${PYTHON:-python3}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu.log") 2>&1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

if compgen -G ".whl/*.whl" > /dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
        .whl/*.whl || exit 1
    export PYTHONPATH="$WORK/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}"

# step NAME SECONDS COMMAND...: COMMAND with at most SECONDS (less if less is left), its output in NAME.log
step() {
    local name=$1 limit=$2
    shift 2
    [[ $name =~ $ONLY ]] || return
    local left=$((BUDGET - SECONDS))
    if ((left < 30)); then
        echo "== $name: skipped, ${left}s left of ${BUDGET}s"
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name (at ${SECONDS}s, limit ${limit}s): $*"
    timeout --kill-after=15 "$limit" "$@" > "$WORK/$name.log" 2>&1  # the step's whole process group
    echo "== $name: exit $? at ${SECONDS}s"
    tail -n 40 "$WORK/$name.log"
    tar -cf "$OUT/gpu.tar.part" -C "$WORK" --exclude=./site . && mv "$OUT/gpu.tar.part" "$OUT/gpu.tar"
}

cat > "$WORK/versions.py" <<'PY'
import importlib

for name in ("torch", "triton", "jax", "transformers", "trl", "liger_kernel", "peft", "accelerate", "logitless"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), module.__file__)
    except Exception as err:
        print(name, "missing:", err)
import torch

print("cuda", torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_properties(0))
PY

SHAPE="-B 1 -T 8192 -H 4096 --dtype bfloat16 --device cuda --repeats 10"  # -V is given per step

step nvidia_smi 30 nvidia-smi
step versions 60 "$PYTHON" "$WORK/versions.py"
step cuda_tests 150 "$PYTHON" -m pytest -q -p no:cacheprovider tests/ops/test_triton.py tests/ops/test_devices.py \
    tests/ops/test_implementations.py tests/ops/test_engine.py
step lmhead_cuda 240 "$PYTHON" -m logitless bench lmhead $SHAPE -V 151936 --profile \
    --json "$WORK/lmhead_cuda.json" --plot "$WORK/lmhead_cuda.png"
step lmhead_cuda_v248320 120 "$PYTHON" -m logitless bench lmhead $SHAPE -V 248320 \
    --json "$WORK/lmhead_cuda_v248320.json" --plot "$WORK/lmhead_cuda_v248320.png"
step lmhead_kl_cuda 120 "$PYTHON" -m logitless bench lmhead $SHAPE -V 151936 --loss kl \
    --json "$WORK/lmhead_kl_cuda.json" --plot "$WORK/lmhead_kl_cuda.png"
step lmhead_curve_cuda 90 "$PYTHON" -m logitless bench lmhead $SHAPE -V 151936 --impl gemm logitless \
    --block-tokens 1024 2048 4096 8192 --json "$WORK/lmhead_curve_cuda.json" --plot "$WORK/lmhead_curve_cuda.png"
step lmhead_one_pass_cuda 90 env LOGITLESS_ONE_PASS=1 "$PYTHON" -m logitless bench lmhead $SHAPE -V 151936 \
    --impl gemm logitless --block-tokens 512 1024 2048 4096 --json "$WORK/lmhead_one_pass_cuda.json" \
    --plot "$WORK/lmhead_one_pass_cuda.png"
step grpo_cuda 150 "$PYTHON" -m logitless bench grpo --model random-qwen2.5-0.5b --device cuda --dtype bfloat16 \
    --setups default --json "$WORK/grpo_cuda.json"
step grade_cuda 120 "$PYTHON" -m logitless bench grade --model random-qwen2.5-0.5b --device cuda \
    --json "$WORK/grade_cuda.json"
step jax_cuda 120 "$PYTHON" -m logitless bench jax -B 1 -T 8192 -H 4096 --dtype bfloat16 --compile-shape none \
    --json "$WORK/jax_cuda.json" --plot "$WORK/jax_cuda.png"
echo "== done at ${SECONDS}s"
