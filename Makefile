# ds_hecate: the two set-up commands of the README are `make demo` and `make test`.
PYTHON ?= python3
FREE_PORT = $(shell $(PYTHON) -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
export OMP_NUM_THREADS ?= 1

.PHONY: install demo test gpu-check gpu-install
# A visible NVIDIA GPU: `make test` then installs the `gpu` extra (CuPy, NCCL) so tests/gpu run instead of skipping.
HAS_GPU := $(shell nvidia-smi -L 2>/dev/null | grep -q GPU && echo 1)

# torch first and pinned: the CPU wheel of 2.13.0 (this machine's; the library itself asks only torch>=2.4); an
# open range would pull a multi-GB CUDA build. deepspeed without build isolation, or pip builds it against a second
# (CUDA) torch. The suite also runs the benchmarks, so their baselines' pins (benchmarks/requirements.txt) are
# resolved together with the library's requirements.
install:
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q --no-build-isolation -r requirements.txt -r benchmarks/requirements.txt
	$(PYTHON) -m pip install -q --no-build-isolation --no-deps -e .

# The main job: a small GPT-style MoE (deepspeed.moe.layer.MoE) trained with Hecate on 2 CPU ranks.
demo: install
	$(PYTHON) -m deepspeed.launcher.runner --num_gpus 2 --master_port $(FREE_PORT) \
		examples/train_gpt_moe.py --deepspeed_config ds_configs/ds_hecate.json

test: install $(if $(HAS_GPU),gpu-install)
	$(PYTHON) -m pytest tests -q -p no:cacheprovider

gpu-install: install
	$(PYTHON) -m pip install -q --no-build-isolation -e '.[gpu]'

# One GPU: tests/gpu, 20 training steps CUDA vs CPU, 1-rank NCCL round trips, stream ordering (and its ablation),
# compute-sanitizer memcheck where present; one JSON file (gpu_check.json). `--dry-run` checks the script on a CPU.
gpu-check: gpu-install
	timeout 480 $(PYTHON) benchmarks/gpu_check.py --out gpu_check.json
