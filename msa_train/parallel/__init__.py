"""Everything parallel: process groups, the DeepSpeed config and engine, model parallelisation."""
from msa_train.parallel.deepspeed_config import build_deepspeed_config
from msa_train.parallel.distributed import DistInfo, destroy_distributed, init_distributed, resolve_device
from msa_train.parallel.engine import build_engine, model_init_context, parallelize

__all__ = ["DistInfo", "build_deepspeed_config", "build_engine", "destroy_distributed", "init_distributed",
           "model_init_context", "parallelize", "resolve_device"]
