"""ds_hecate: Fully Sharded Sparse Data Parallelism (Hecate) for Mixture-of-Experts training in DeepSpeed.

``import ds_hecate`` makes ``deepspeed.initialize`` Hecate-aware: a config with
``"zero_optimization": {"stage": 2, "hecate": {"enabled": true}}`` then trains the model's MoE layers with
sharded experts, while everything else stays with DeepSpeed. The installed ``ds_hecate_autoload`` hook imports this
package right after DeepSpeed, so scripts that never name ds_hecate get the same (``DS_HECATE_AUTOLOAD=0``: off).

The public face is :data:`__all__`, listed here once: the MoE layer, ``initialize`` (the same call spelled
explicitly), the expert module with a fast path, the parameter count, the config schema and the errors. Everything
else is internal, reached by its module path (the layout: docs/design.md).
"""
from .config import HecateConfig
from .errors import HecateConfigError, HecateError, HecateModelError, HecateUnsupportedError
from .experts import SwiGLUExpert
from .deepspeed_glue import initialize as _glue
from .moe_layer import MoE, num_parameters

initialize = _glue.initialize
__version__ = "0.1.0"

_glue.patch_deepspeed()   # deepspeed.initialize and DeepSpeed's ZeRO config learn the hecate section

__all__ = ["HecateConfig", "HecateConfigError", "HecateError", "HecateModelError", "HecateUnsupportedError", "MoE",
           "SwiGLUExpert", "initialize", "num_parameters", "__version__"]
