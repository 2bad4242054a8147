#!/bin/bash
# Alternating A/B of the main workload: the code before the platform change (/tmp/before, its own venv) and after (/work/main).
for i in 1 2 3; do
  for side in before after; do
    if [ $side = before ]; then cd /tmp/before; PY=/tmp/before-venv/bin/python; else cd /work/main; PY=python3; fi
    $PY benchmarks/throughput.py --make-model /tmp/bench-model --skip-hf --no-phases --no-compute-limit --no-tqdm --json /tmp/bench/ab-$side-$i.json > /tmp/bench/ab-$side-$i.txt 2>&1
    echo "$side $i $(grep -E '^corellm ' /tmp/bench/ab-$side-$i.txt | head -1)"
  done
done
