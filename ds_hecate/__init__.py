"""ds_hecate: Fully Sharded Sparse Data Parallelism (Hecate) for Mixture-of-Experts training in DeepSpeed.

``import ds_hecate`` makes ``deepspeed.initialize`` Hecate-aware: a config with
``"zero_optimization": {"stage": 2, "hecate": {"enabled": true}}`` then trains the model's MoE layers with
sharded experts, while everything else stays with DeepSpeed.
"""
from .config import HecateConfig, parse_hecate_section, split_hecate_section
from .errors import HecateConfigError, HecateError, HecateModelError, HecateUnsupportedError
from .experts import SwiGLUExpert
from .deepspeed_glue.initialize import initialize, patch_deepspeed
from .moe_layer import MoE, num_parameters

__version__ = "0.1.0"

patch_deepspeed()

__all__ = ["HecateConfig", "HecateConfigError", "HecateError", "HecateModelError", "HecateUnsupportedError", "MoE",
           "SwiGLUExpert", "initialize", "num_parameters", "parse_hecate_section", "patch_deepspeed",
           "split_hecate_section", "__version__"]
