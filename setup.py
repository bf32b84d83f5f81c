"""ds_hecate: Fully Sharded Sparse Data Parallelism (Hecate) for MoE training, as a DeepSpeed extension."""
import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

AUTOLOAD_PTH = "ds_hecate_autoload.pth"
KERNEL_SOURCES = sorted(n for n in os.listdir("kernels") if n.endswith(".cu")) if os.path.isdir("kernels") else []


class BuildWithAutoload(build_py):
    """Also place ds_hecate_autoload.pth at the root of the build, so it lands in site-packages, where Python
    runs it at start-up (automatic activation; switch off with DS_HECATE_AUTOLOAD=0)."""

    def run(self):
        super().run()
        shutil.copy(AUTOLOAD_PTH, os.path.join(self.build_lib, AUTOLOAD_PTH))
        # The CUDA kernel sources (kernels/*.cu) ship inside the package: ds_hecate/kernels/, where
        # ds_hecate.comm.gpu.kernels compiles them at run time with CuPy.
        os.makedirs(os.path.join(self.build_lib, "ds_hecate", "kernels"), exist_ok=True)
        for name in KERNEL_SOURCES:
            shutil.copy(os.path.join("kernels", name), os.path.join(self.build_lib, "ds_hecate", "kernels", name))

    def get_outputs(self, include_bytecode=True):
        return (super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, AUTOLOAD_PTH)]
                + [os.path.join(self.build_lib, "ds_hecate", "kernels", name) for name in KERNEL_SOURCES])

setup(
    name="ds_hecate",
    version="0.1.0",
    description="Fully Sharded Sparse Data Parallelism (Hecate, arXiv 2502.02581) for Mixture-of-Experts in DeepSpeed",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["ds_hecate", "ds_hecate.*"]),
    # py.typed: the package's type hints are for its users' type checkers too (PEP 561; mypy.ini checks them). The
    # simulator's fitted per-call overhead coefficients (python -m ds_hecate.sim.overhead_fit), read by its presets.
    package_data={"ds_hecate": ["py.typed"], "ds_hecate.sim": ["call_overhead_fit.json"]},
    py_modules=["ds_hecate_autoload"],
    python_requires=">=3.9",
    entry_points={"console_scripts": ["ds-hecate=ds_hecate.tools.cli:main"]},
    cmdclass={"build_py": BuildWithAutoload},
    # Lower bounds only: the oldest releases we know work (docs/install.md lists what CI tests). No upper bound
    # unless a named release is known to break us; none is today. The comparison baselines' pins (AutoEP needs
    # transformers 5.10.x) live in benchmarks/requirements.txt, not here.
    install_requires=[
        "torch>=2.4",
        "deepspeed>=0.19.8",
        "pydantic>=2",
        "numpy",
    ],
    extras_require={
        "test": ["pytest>=8", "hypothesis>=6"],
        # CuPy and NCCL for the CuPy transport and the kernels: CUDA 12 (`gpu`) or CUDA 13 (`gpu13`), matching the
        # CUDA build of the torch already installed (neither extra installs torch).
        "gpu": ["cupy-cuda12x", "nvidia-nccl-cu12>=2.18.1"],
        "gpu13": ["cupy-cuda13x", "nvidia-nccl-cu13"],
        "mpi": ["mpi4py"],
        "hf": ["transformers>=5.10", "accelerate>=1.15", "safetensors>=0.8"],
    },
)
