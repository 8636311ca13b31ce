#!/usr/bin/env bash
# One call on a lent GPU (the device tool), prepared and checked on a CPU first: the wheels the GPU machine lacks,
# the cuda-marked tests that issues wait on, the QLoRA benchmark against Hugging Face's recipe at 1B (every
# contender) and 8B (hf and auto), then the other cuda-marked tests. Every stage runs under the time left before
# a deadline (DEADLINE_S, 480 s), and writes under $OUT as it goes, so a call cut short still returns its figures.
#
# Here, once: echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps --only-binary=:all: \
#   --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
#   --platform manylinux_2_17_x86_64 -d .whl bitsandbytes==0.50.2 torchao==0.18.0 peft==0.21.2 \
#   transformers==5.23.0 jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0 liger-kernel==0.8.5
# Then: run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=540)
# A shorter call: FIRST_TESTS=tests/transforms/test_compiling.py CONTENDERS_FIRST=hf,saving,compile MODELS_SECOND=
# REST_TESTS=0 bash benchmarks/gpu_session.sh
# CPU check of the script: MODELS_FIRST=tiny MODELS_SECOND=tiny FIRST_TESTS=tests/test_readme.py bash benchmarks/gpu_session.sh
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
t0=$(date +%s)
deadline=$(( t0 + ${DEADLINE_S:-480} ))
left() { echo $(( deadline - $(date +%s) > 5 ? deadline - $(date +%s) : 5 )); }
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks:$PWD/tests
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null
FIRST_TESTS=${FIRST_TESTS:-tests/strategies/test_fsdp_one_gpu.py tests/data/test_packing_guard.py tests/transforms/test_compiling.py}
# shellcheck disable=SC2086
timeout $(( $(left) < 110 ? $(left) : 110 )) python3 -m pytest -q -p no:cacheprovider -m cuda $FIRST_TESTS \
  > "$OUT/cuda_tests_first.log" 2>&1
tail -3 "$OUT/cuda_tests_first.log"; echo "first cuda tests done at $(( $(date +%s) - t0 )) s"
peers() {  # models contenders per-contender-timeout stage-cap
  timeout $(( $(left) < $4 ? $(left) : $4 )) python3 benchmarks/gpu_peers.py --models "$1" --contenders "$2" \
    --timeout "$3" --out "$OUT" > "$OUT/gpu_peers-$1.log" 2>&1
  grep -E '^\||^##|^[a-z-]+: \{' "$OUT/gpu_peers-$1.log" | grep -v '^[a-z-]*: {' ; grep -F '"error"' "$OUT/gpu_peers-$1.log" | cut -c1-400 | tail -3
  echo "benchmark $1 done at $(( $(date +%s) - t0 )) s"
}
peers "${MODELS_FIRST:-1b}" "${CONTENDERS_FIRST:-hf,auto,auto-half,saving,compile}" 100 "${FIRST_CAP_S:-210}"
if [ -n "${MODELS_SECOND-8b}" ]; then peers "${MODELS_SECOND-8b}" "${CONTENDERS_SECOND:-hf,auto}" 170 300; fi
[ "${REST_TESTS:-1}" = 1 ] || exit 0
# shellcheck disable=SC2086
timeout "$(left)" python3 -m pytest -q -p no:cacheprovider -m cuda tests $(printf -- '--deselect %s ' $FIRST_TESTS) \
  > "$OUT/cuda_tests_rest.log" 2>&1
tail -3 "$OUT/cuda_tests_rest.log"; echo "all done at $(( $(date +%s) - t0 )) s"
