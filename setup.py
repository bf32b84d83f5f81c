"""ds_hecate: Fully Sharded Sparse Data Parallelism (Hecate) for MoE training, as a DeepSpeed extension."""
from setuptools import find_packages, setup

setup(
    name="ds_hecate",
    version="0.1.0",
    description="Fully Sharded Sparse Data Parallelism (Hecate, arXiv 2502.02581) for Mixture-of-Experts in DeepSpeed",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["ds_hecate", "ds_hecate.*"]),
    python_requires=">=3.9",
    entry_points={"console_scripts": ["ds-hecate=ds_hecate.cli:main"]},
    install_requires=[
        "torch>=2.4,<2.14",
        "deepspeed>=0.19.8,<0.20",
        "pydantic>=2",
        "numpy",
    ],
    extras_require={
        "test": ["pytest>=8", "hypothesis>=6"],
        "gpu": ["cupy-cuda12x"],
        "mpi": ["mpi4py"],
    },
)
