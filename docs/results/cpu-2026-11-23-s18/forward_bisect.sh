#!/bin/bash
for r in 1 2 3 4; do
  for t in old t-c02b934 t-eca9a6b t-508f002; do
    v=$(cd /tmp/s18/$t && PYTHONPATH=. /work/main/.venv/bin/python docs/probe_step_path.py forward 2>&1 | grep -o '[0-9.]* ms' | head -1)
    echo "$r $t $v"
  done
  v=$(cd /work/main && PYTHONPATH=. /work/main/.venv/bin/python docs/probe_step_path.py forward 2>&1 | grep -o '[0-9.]* ms' | head -1)
  echo "$r main $v"
done
