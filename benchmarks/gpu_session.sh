#!/usr/bin/env bash
# One call on a lent GPU (the device tool), prepared and checked on a CPU first: the wheels the GPU machine lacks,
# the QLoRA benchmark against Hugging Face's recipe (benchmarks/gpu_peers.py, about 8 minutes for both sizes), then
# the cuda-marked tests. Everything is written under $OUT as it goes, so a call cut short still returns it.
#
# Here, once: echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps --only-binary=:all: \
#   --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
#   --platform manylinux_2_17_x86_64 -d .whl bitsandbytes==0.50.2 torchao==0.18.0 peft==0.21.2 \
#   transformers==5.23.0 jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0 liger-kernel==0.8.5
# Then: run(command="bash benchmarks/gpu_session.sh", carry=[".whl"])   (MODELS=1b CONTENDERS=hf,auto to shorten)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks:$PWD/tests
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
(cd benchmarks && python3 gpu_peers.py --models "${MODELS:-1b,8b}" --contenders "${CONTENDERS:-hf,auto,saving,compile}" \
  --out "$OUT") 2>&1 | tee "$OUT/gpu_peers.log" | grep -v -i warn | tail -20
echo "benchmark done at $(( $(date +%s) - t0 )) s"
python3 -m pytest -q -p no:cacheprovider -m cuda tests 2>&1 | tee "$OUT/cuda_tests.log" | tail -15
echo "all done at $(( $(date +%s) - t0 )) s"
