# ds_hecate: the two set-up commands of the README are `make demo` and `make test`.
PYTHON ?= python3
export OMP_NUM_THREADS ?= 1

.PHONY: install demo test lint gpu-site gpu-check gpu-fit gpu-install gpu-wheels
# A visible NVIDIA GPU: `make test` then installs the `gpu` extra (CuPy, NCCL) so tests/gpu run on the GPU itself
# (without one they run under the GPU stand-in, tests/fake_cupy.py).
HAS_GPU := $(shell nvidia-smi -L 2>/dev/null | grep -q GPU && echo 1)

# torch first and pinned: the CPU wheel of 2.13.0 (the library itself asks only torch>=2.4); an open range would
# pull a multi-GB CUDA build. deepspeed without build isolation, or pip builds it against a second
# (CUDA) torch. The suite also runs the benchmarks, so their baselines' pins (benchmarks/requirements.txt) are
# resolved together with the library's requirements.
install:
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q --no-build-isolation -r requirements.txt -r benchmarks/requirements.txt
	$(PYTHON) -m pip install -q --no-build-isolation --no-deps -e .

# The main job: a small GPT-style MoE (deepspeed.moe.layer.MoE) trained with Hecate on 2 CPU ranks. DeepSpeed's
# launcher through ds_hecate.tools.launch: a free master port, and the job's CPU all-reduce buffers removed from
# /dev/shm when it ends, however it ends (DeepSpeed leaves 66 MiB per rank there; docs/troubleshooting.md).
demo: install
	$(PYTHON) -m ds_hecate.tools.launch --num_gpus 2 \
		examples/train_gpt_moe.py --deepspeed_config ds_configs/ds_hecate.json

test: install $(if $(HAS_GPU),gpu-install)
	$(PYTHON) -m pytest tests -q -p no:cacheprovider

# The static type check: mypy, pinned (a new release brings new checks: they arrive as a change of this pin, not as a
# red CI run), with the settings of mypy.ini (check_untyped_defs: the bodies of unannotated tests are checked too),
# over TYPED. The types of torch, numpy and pydantic come from the installed packages, hence `install` first.
MYPY_VERSION = 2.4.1
TYPED ?= ds_hecate tests benchmarks

lint: install
	$(PYTHON) -m pip install -q mypy==$(MYPY_VERSION)
	$(PYTHON) -m mypy $(TYPED)

gpu-install: install
	$(PYTHON) -m pip install -q --no-build-isolation -e '.[gpu]'

# The one-command check of the GPU path, on a GPU machine as it is (docs/benchmarks.md, "GPU check"): no install of
# torch, CuPy or the requirements (whatever CUDA torch and CuPy are there stay). What is missing to import DeepSpeed
# (DeepSpeed itself, pydantic, ...) comes from the wheelhouse .whl/ that `make gpu-wheels` builds where pip has
# network, installed with --no-index into GPU_SITE only if deepspeed or transformers (AutoEP's) is not importable
# (gpu-site); ds_hecate runs from the checkout. Every stage in its own process with its own timeout (they sum to at
# most 480 s, a minute under this target's 540: benchmarks/gpu/runner.py); the JSON ($(GPU_OUT).json) is rewritten after each stage, the
# Markdown table ($(GPU_OUT).md) printed at the end. `make gpu-check ARGS=--dry-run` runs every stage's code on the
# CPU under the GPU stand-in (CI); ARGS=--quick shrinks sizes.
ARGS ?=
GPU_SITE ?= /tmp/ds_hecate_site
GPU_OUT ?= runs/gpu_check
GPU_PYTHONPATH = $(CURDIR):$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH}

gpu-site:
	@if PYTHONPATH="$(GPU_PYTHONPATH)" $(PYTHON) -c "import deepspeed, pydantic, transformers" >/dev/null 2>&1; \
	then :; \
	elif ls .whl/*.whl >/dev/null 2>&1; then \
		echo "gpu-site: deepspeed or transformers is not importable; installing the wheelhouse .whl/ into $(GPU_SITE)"; \
		$(PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
			--target $(GPU_SITE) .whl/*.whl || exit 1; \
	else \
		echo "gpu-site: deepspeed or transformers is not importable and there is no wheelhouse .whl/ (run make"; \
		echo "gpu-wheels where pip has network and bring .whl/ along)"; exit 1; \
	fi

gpu-check:
	@$(MAKE) --no-print-directory gpu-site
	@mkdir -p $(dir $(GPU_OUT))
	PYTHONPATH="$(GPU_PYTHONPATH)" timeout 540 $(PYTHON) benchmarks/gpu_check.py --out $(GPU_OUT).json \
		--markdown $(GPU_OUT).md $(ARGS)

# The GPU's call overhead fit, on a GPU machine as it is (docs/simulator.md, "Call overhead"): the layer benchmark's
# N-rank rows (ds_hecate's layer call, AutoEP, the plain layer and its all-to-alls) on the device in bf16, one
# process per shape, each under its own timeout (a shape that fails leaves only its own cells out), then the records
# cut into one fixture ($(FIT_OUT).json) with the device's memory bandwidth measured beside them. The fit itself
# and the simulator's tables are made from that fixture on any machine. Each shape at most FIT_SHAPE_TIMEOUT
# seconds (8 minutes for the four); `make gpu-fit FIT_DEVICE=cpu FIT_DTYPE=fp32 FIT_SHAPES=quick FIT_MIB=16` runs it
# on the CPU (tests/test_gpu_fit.py).
FIT_DEVICE ?= cuda
FIT_DTYPE ?= bf16
FIT_SHAPES ?= host-bound host-bound-8 qwen3-30b-a3b deepseek-v3
FIT_REPS ?= 20
FIT_MIB ?= 512
FIT_SHAPE_TIMEOUT ?= 120
FIT_OUT ?= runs/gpu_fit

gpu-fit:
	@$(MAKE) --no-print-directory gpu-site
	@rm -rf $(FIT_OUT).d && mkdir -p $(FIT_OUT).d
	@for shape in $(FIT_SHAPES); do \
		echo "gpu-fit: $$shape"; \
		PYTHONPATH="$(GPU_PYTHONPATH)" timeout $(FIT_SHAPE_TIMEOUT) $(PYTHON) -m benchmarks.layer \
			--device $(FIT_DEVICE) --dtype $(FIT_DTYPE) --shape $$shape --n-rank \
			--systems plain,ds_hecate-call,autoep --reps $(FIT_REPS) \
			--json $(FIT_OUT).d/$$shape.json --markdown $(FIT_OUT).d/$$shape.md \
			|| echo "gpu-fit: $$shape failed; its cells are left out"; \
	done
	PYTHONPATH="$(GPU_PYTHONPATH)" $(PYTHON) -m ds_hecate.sim.overhead_fit --trim $(FIT_OUT).d/*.json \
		--fixture $(FIT_OUT).json --memory-mib $(FIT_MIB)

# Where pip has network: the wheels a GPU machine without network lacks (Python 3.12, manylinux x86-64, --no-deps
# with every dependency named; deepspeed built from its sdist), into .whl/, listed with sizes.
gpu-wheels:
	$(PYTHON) tools/gpu_wheels.py --dest .whl
