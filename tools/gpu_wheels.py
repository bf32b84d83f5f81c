"""``make gpu-wheels`` (``python tools/gpu_wheels.py --dest .whl``): the wheels a GPU machine without network lacks
to import ds_hecate and DeepSpeed, fetched here into ``.whl/`` (git-ignored) for ``make gpu-check`` to install there
with ``--no-index``.

The target: Python 3.12 on manylinux x86-64 with torch and CuPy already there (never replaced) and no DeepSpeed or
pydantic. The wheelhouse holds exactly what is missing, every dependency named (``--no-deps``: pip resolves nothing
there): ``deepspeed`` (an sdist, built here into a pure-Python wheel, ``DS_BUILD_OPS=0``: ds_hecate uses none of its
ops), pydantic and its dependencies (pydantic-core as a cp312 manylinux binary), hjson and typing-extensions, and
what DeepSpeed's AutoEP needs to run beside ds_hecate in the layer benchmark (transformers 5.10 and kernels 0.12,
with their dependencies).
Versions are the ones installed here, else the pins below; every wheel's requirements are checked against the
wheelhouse and :data:`THERE`, and the listing is printed with sizes.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Dict, List

PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
#: built here from its sdist
BUILT = {"deepspeed": "0.19.8"}
#: fetched as wheels for the target; the version installed here wins over the pin
FETCHED = {"pydantic": "2.13.4", "pydantic-core": "2.46.4", "annotated-types": "0.7.0",
           "typing-inspection": "0.4.2", "typing-extensions": "4.16.0", "hjson": "3.1.0",
           # AutoEP, the baseline the layer benchmark and ``make gpu-fit`` time beside ds_hecate: DeepSpeed's AutoEP
           # runs with transformers 5.10.x and kernels 0.12.x (benchmarks/requirements.txt)
           "transformers": "5.10.4", "kernels": "0.12.3", "tokenizers": "0.23.3", "huggingface-hub": "2.4.0",
           "safetensors": "0.8.0", "regex": "2026.12.2", "hf-xet": "1.8.0", "filelock": "4.3.2",
           "fsspec": "2026.9.0", "httpx": "0.29.0", "httpcore": "1.0.9", "h11": "0.16.0", "anyio": "4.16.0",
           "idna": "3.13", "certifi": "2026.5.20", "click": "8.5.1", "typer": "0.29.2", "shellingham": "1.5.4",
           "rich": "15.0.0", "markdown-it-py": "4.3.0", "mdurl": "0.1.2", "pygments": "2.20.0",
           "annotated-doc": "0.0.7"}
#: what the target machine already has of what the wheels above require
THERE = ("einops", "msgpack", "ninja", "numpy", "packaging", "psutil", "py-cpuinfo", "torch", "tqdm",
         "typing-extensions", "nvidia-ml-py", "pyyaml", "pytest", "hypothesis", "cupy-cuda13x", "setuptools")
#: what may travel with a checkout
LIMIT_MIB = 48


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def versions() -> Dict[str, str]:
    out = {}
    for name, pin in FETCHED.items():
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = pin
    return out


#: the target's environment markers, as a requirement's marker is evaluated there (no extra asked for)
TARGET_MARKERS = {"python_version": PYTHON_VERSION, "python_full_version": PYTHON_VERSION + ".0",
                  "platform_system": "Linux", "sys_platform": "linux", "os_name": "posix",
                  "platform_machine": "x86_64", "implementation_name": "cpython",
                  "platform_python_implementation": "CPython", "extra": ""}


def requirements(wheel: Path) -> List[str]:
    """The wheel's requirements on the target (names), from its METADATA: those whose marker holds there (a
    ``python_version < "3.11"`` backport, an extra's, a Windows-only one does not)."""
    from packaging.requirements import Requirement
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode("utf-8", "replace")
    names = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(TARGET_MARKERS):
                names.append(_norm(req.name))
    return names


def _run(cmd: List[str], env=None) -> None:
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)


def build(dest: Path) -> List[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()   # one version of each: two stop the whole install there
    env = {**os.environ, "DS_BUILD_OPS": "0"}
    for name, version in BUILT.items():
        _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dest),
              f"{name}=={version}"], env=env)
    platform_args = [arg for p in PLATFORMS for arg in ("--platform", p)]
    _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
          PYTHON_VERSION, "--implementation", "cp", *platform_args, "-d", str(dest)]
         + [f"{name}=={version}" for name, version in versions().items()])
    return sorted(dest.glob("*.whl"))


def check(wheels: List[Path]) -> List[str]:
    """Requirements that neither the wheelhouse nor the target machine provides."""
    have = {_norm(w.name.split("-")[0]) for w in wheels} | {_norm(n) for n in THERE}
    return sorted({f"{w.name} needs {r}" for w in wheels for r in requirements(w) if r not in have})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", default=".whl")
    dest = Path(parser.parse_args(argv).dest)
    wheels = build(dest)
    total = sum(w.stat().st_size for w in wheels)
    print(f"\nwheelhouse {dest}: {len(wheels)} wheels for Python {PYTHON_VERSION}, manylinux x86-64")
    for w in wheels:
        print(f"  {w.stat().st_size / 2 ** 20:7.2f} MiB  {w.name}")
    print(f"  {total / 2 ** 20:7.2f} MiB  total")
    missing = check(wheels)
    for line in missing:
        print(f"  MISSING: {line}")
    if total > LIMIT_MIB * 2 ** 20:
        print(f"the wheelhouse is over {LIMIT_MIB} MiB")
        return 1
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
