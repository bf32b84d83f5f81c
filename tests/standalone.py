"""Source code that loads ``ds_hecate/planning`` as a stand-alone package in a fresh interpreter, to prove the
planner needs neither torch nor the rest of ds_hecate (and to run it fast in subprocesses)."""
from __future__ import annotations

import textwrap
from pathlib import Path

PLANNING_DIR = Path(__file__).resolve().parents[1] / "ds_hecate" / "planning"


def planning_prelude(block_torch: bool = True) -> str:
    """Code binding ``planning`` to the stand-alone package; with ``block_torch`` any torch/deepspeed import fails."""
    block = ('sys.modules["torch"] = None  # any "import torch" (torch.distributed included) raises ImportError\n'
             'sys.modules["deepspeed"] = None\n') if block_torch else ""
    return textwrap.dedent("""
        import importlib, importlib.util, sys
        {block}spec = importlib.util.spec_from_file_location(
            "standalone_planning", {init!r}, submodule_search_locations=[{dir!r}])
        planning = importlib.util.module_from_spec(spec)
        sys.modules["standalone_planning"] = planning
        spec.loader.exec_module(planning)
        assert not any(m == "torch" or m.startswith("torch.") or m.startswith("ds_hecate")
                       for m, v in sys.modules.items() if v is not None)
    """).format(block=block, init=str(PLANNING_DIR / "__init__.py"), dir=str(PLANNING_DIR))
