"""Hardware and model catalogs (data in gpus.yaml / models.yaml, sources in SOURCES.md)."""

from kernels.catalog.gpus import GpuSpec, get_gpu, list_gpus
from kernels.catalog.models import ModelSpec, get_model, list_models, model_from_hf_config

__all__ = ["GpuSpec", "ModelSpec", "get_gpu", "get_model", "list_gpus", "list_models", "model_from_hf_config"]
