#!/usr/bin/env bash
# One call on a lent GPU (the device tool), prepared and checked on a CPU first: issue 28's peer benchmark
# (benchmarks/gpu_peers.py: Hugging Face's recipe, the automatic choice, the memory-saving path, compile and Unsloth
# at Llama-3.2-1B shapes; Hugging Face's recipe and compile at Llama-3.1-8B), then every cuda-marked test in the
# time left. By run 5's wall times (H200; docs/benchmarks.md) the benchmark takes about 440 s (1B: 15 s to write
# the model, then 30-66 s a contender; 8B: 38 s, then 34 and 86 s) and the cuda tests 80 s; by run 6's, every
# cuda test in one process 114 s (FIRST_TESTS=tests FIRST_TESTS_CAP_S=200), Unsloth at 1B 92 s. Left for a next
# call (run 6): the NCCL twin of the frozen-rows check (tests/transforms/test_frozen_dtype.py, not yet run on a
# GPU), and why the compiled 1B step doubled with the host (CONTENDERS_FIRST=hf,compile PROFILE=1). Every stage
# runs under the time left before a deadline (DEADLINE_S, 560 s) and its cap; gpu_peers.py ends its contenders
# inside the cap (--budget) and writes under $OUT as it goes, so a call cut short still returns its figures and
# its table.
#
# Here, once (wheels for the machine's Python 3.12; .whl and .whl_unsloth are ignored folders):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#     bitsandbytes==0.50.2 torchao==0.18.0 peft==0.21.2 transformers==5.23.0 jsonargparse==4.53.0 \
#     docstring-parser==0.18.0 typeshed-client==2.15.0 liger-kernel==0.8.5
#   python benchmarks/slim_wheel.py .whl/bitsandbytes-0.50.2-*.whl --cuda 130   (43 MB to 4 MB)
#   the same download into .whl_unsloth of unsloth==2026.10.9 unsloth_zoo==2026.10.9 trl==1.15.0 datasets==4.8.5
#     "dill<0.4.2" "multiprocess<0.70.20" tyro typeguard shtab msgspec structlog json5 nest_asyncio cut_cross_entropy
#     (Unsloth's needs that the machine lacks), then
#   python benchmarks/slim_wheel.py .whl_unsloth/unsloth-2026.10.9-*.whl --drop '^studio/'   (28.6 MB to 2.2 MB)
# Then: run(command="bash benchmarks/gpu_session.sh", carry=[".whl", ".whl_unsloth"], timeout_s=590): 32 MB.
# The wheels install into .gpu_site, transformers into .gpu_tf and Unsloth's into .gpu_unsloth: ignored folders
# that a later call on the same warm machine finds there. The unsloth contender reads .gpu_unsloth and .gpu_site
# with the machine's own transformers (Unsloth 2026.10.9 pins transformers <= 5.17), the others .gpu_tf too.
#
# Settings: MODELS_FIRST (1b) with CONTENDERS_FIRST and FIRST_CAP_S (300), MODELS_SECOND (8b; empty: none) with
# CONTENDERS_SECOND (hf,compile) and SECOND_CAP_S (190), MORE_STAGES="8b:hf,auto,unsloth:170:230
# qwen-0.5b:saving,compile:100:90" (model:contenders:per-contender-timeout:cap; a later call),
# FIRST_TESTS (cuda-marked tests to run before the benchmark; none by default) with FIRST_TESTS_CAP_S (110),
# REST_TESTS=0 (no tests after), PROFILE=1 (each contender profiles one more step: gpu_peers.py --profile-step),
# KEEP_MODELS=.gpu_models (the checkpoints stay on the machine for a later call), INSTALL=0 (install nothing).
# CPU check of the script: INSTALL=0 MODELS_FIRST=tiny MODELS_SECOND= CONTENDERS_FIRST=hf,saving REST_TESTS=0 \
#   bash benchmarks/gpu_session.sh
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
t0=$(date +%s)
deadline=$(( t0 + ${DEADLINE_S:-560} ))
left() { echo $(( deadline - $(date +%s) > 5 ? deadline - $(date +%s) : 5 )); }
if [ -d .whl ] && [ "${INSTALL:-1}" = 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .gpu_tf \
    .whl/transformers-*.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .gpu_site \
    $(ls .whl/*.whl | grep -v /transformers-)
fi
if [ -d .whl_unsloth ] && [ "${INSTALL:-1}" = 1 ]; then  # the unsloth contender's own path: not .gpu_tf
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .gpu_unsloth \
    .whl_unsloth/*.whl
fi
export UNSLOTH_PYTHONPATH=$PWD/.gpu_unsloth:$PWD/.gpu_site:$PWD:$PWD/benchmarks
export PYTHONPATH=$PWD/.gpu_tf:$PWD/.gpu_site:$PWD:$PWD/benchmarks:$PWD/tests
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null
FIRST_TESTS=${FIRST_TESTS:-none}
if [ "$FIRST_TESTS" != none ]; then
  # shellcheck disable=SC2086
  first_cap=${FIRST_TESTS_CAP_S:-110}
  timeout $(( $(left) < first_cap ? $(left) : first_cap )) python3 -m pytest -q -p no:cacheprovider -m cuda $FIRST_TESTS \
    > "$OUT/cuda_tests_first.log" 2>&1
  tail -3 "$OUT/cuda_tests_first.log"; echo "first cuda tests done at $(( $(date +%s) - t0 )) s"
fi
extra=()
[ "${PROFILE:-0}" = 1 ] && extra+=(--profile-step)
[ -n "${KEEP_MODELS:-}" ] && extra+=(--keep-models "$KEEP_MODELS")
peers() {  # models contenders per-contender-timeout stage-cap
  local cap=$(( $(left) < $4 ? $(left) : $4 ))  # gpu_peers.py ends its contenders inside it and prints its table
  timeout $(( cap + 20 )) python3 benchmarks/gpu_peers.py --models "$1" --contenders "$2" \
    --timeout "$3" --budget "$cap" --out "$OUT" "${extra[@]}" > "$OUT/gpu_peers-$1.log" 2>&1
  grep -E '^\||^##|^[a-z-]+: \{' "$OUT/gpu_peers-$1.log" | grep -v '^[a-z-]*: {' ; grep -F '"error"' "$OUT/gpu_peers-$1.log" | cut -c1-400 | tail -3
  echo "benchmark $1 done at $(( $(date +%s) - t0 )) s"
}
peers "${MODELS_FIRST:-1b}" "${CONTENDERS_FIRST:-hf,auto,saving,compile,unsloth}" 100 "${FIRST_CAP_S:-300}"
if [ -n "${MODELS_SECOND-8b}" ]; then peers "${MODELS_SECOND-8b}" "${CONTENDERS_SECOND:-hf,compile}" 170 "${SECOND_CAP_S:-190}"; fi
for stage in ${MORE_STAGES:-}; do
  IFS=: read -r model contenders each cap <<< "$stage"
  peers "$model" "$contenders" "$each" "$cap"
done
[ "${REST_TESTS:-1}" = 1 ] || exit 0
# shellcheck disable=SC2086
timeout "$(left)" python3 -m pytest -q -p no:cacheprovider -m cuda tests $(printf -- '--deselect %s ' $FIRST_TESTS) \
  > "$OUT/cuda_tests_rest.log" 2>&1
tail -3 "$OUT/cuda_tests_rest.log"; echo "all done at $(( $(date +%s) - t0 )) s"
