# Source me from the repository root on the device machine (see docs/device/README.md):
# the peers' wheels from .whl into /tmp/site, fairscale's package from .devsite.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD/.devsite:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), 'cpus', __import__('os').cpu_count())"
python3 -c "import torchrec, fbgemm_gpu; print('torchrec ok')" 2>&1 | tail -1
