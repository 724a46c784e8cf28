"""torch.distributed's tensor collectives under the names this torch has. torch 2.13 renamed
all_gather_into_tensor and reduce_scatter_tensor to all_gather_single and reduce_scatter_single
(same arguments) and warns on every call of the old names, once per rank; the lent GPU machines'
torch 2.11 has only the old ones."""
from __future__ import annotations

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                         or dist.reduce_scatter_tensor)
