"""The GPT model: shape config (torch-free), the model, and parallelism applied from outside.

Import the torch parts explicitly: `from orchestrator.models.gpt import GPT`,
`from orchestrator.models.parallelize import apply_tensor_parallel, split_pipeline`.
"""

from orchestrator.models.config import (ModelConfig, count_block_params, count_params, is_moe,
                                         validate_model)

__all__ = ["ModelConfig", "count_block_params", "count_params", "is_moe", "validate_model"]
