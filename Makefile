# ds_hecate: the two set-up commands of the README are `make demo` and `make test`.
PYTHON ?= python3
FREE_PORT = $(shell $(PYTHON) -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
export OMP_NUM_THREADS ?= 1

.PHONY: install demo test

# torch first and pinned: the CPU wheel of 2.13.0; an open range would pull a multi-GB CUDA build.
# deepspeed without build isolation, or pip builds it against a second (CUDA) torch.
install:
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q --no-build-isolation -r requirements.txt
	$(PYTHON) -m pip install -q --no-build-isolation --no-deps -e .

# The main job: a small GPT-style MoE (deepspeed.moe.layer.MoE) trained with Hecate on 2 CPU ranks.
demo: install
	$(PYTHON) -m deepspeed.launcher.runner --num_gpus 2 --master_port $(FREE_PORT) \
		examples/train_gpt_moe.py --deepspeed_config ds_configs/ds_hecate.json

test: install
	$(PYTHON) -m pytest tests -q -p no:cacheprovider
