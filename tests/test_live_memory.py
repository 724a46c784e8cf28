"""LiveTensorBytes counts every live storage byte exactly: what was reachable when it started,
what ops make, views once, frees and resizes; its peak is the most alive at one moment."""
from __future__ import annotations

import torch

from orchestrator.train.live_memory import LiveTensorBytes, reachable_tensors


def test_counts_held_tensors_new_ones_views_and_frees():
    held = torch.zeros(1000)  # 4000 B
    holder = {"a": [held, held[10:20]], "grad_of": torch.nn.Parameter(torch.zeros(10))}
    holder["grad_of"].grad = torch.ones(10)
    live = LiveTensorBytes("cpu", [holder])
    with live:
        assert live.start_bytes == 4000 + 40 + 40
        live.mark("make")
        x = torch.ones(250)  # +1000
        view = x[:100]  # no new storage
        y = x * 2  # +1000
        assert live.bytes == 4080 + 2000
        del x, view, y
        assert live.bytes == 4080
        live.mark("after")
        z = torch.empty(10, dtype=torch.float64)  # +80
    assert (live.peak_bytes, live.peak_label) == (6080, "make")
    assert live.peak_by_label["after"] == 4160
    del z


def test_a_resized_storage_counts_its_new_size():
    t = torch.zeros(100)
    live = LiveTensorBytes("cpu", [t])
    with live:
        t.untyped_storage().resize_(0)  # FSDP frees gathered parameters this way
        assert live.bytes == 0
        t.untyped_storage().resize_(800)
        assert live.bytes == 800
    assert live.peak_bytes == 800


def test_reachable_tensors_follow_objects_not_modules_or_functions():
    class Holder:
        def __init__(self):
            self.weights = [torch.zeros(3)]
            self.fn = torch.zeros  # a function: not followed into torch's globals

    found = reachable_tensors([Holder()])
    assert len(found) == 1 and found[0].shape == (3,)


def test_counts_the_temporaries_inside_a_dtensor_op():
    """DTensor runs some ops as several local ones (loss_parallel's log-softmax: the logits less
    their max, its exponential, then the output): each temporary counts, as on a GPU."""
    import torch.nn.functional as F
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    from orchestrator.profiling.model.analytic import fake_world

    with fake_world(2) as mesh:
        logits = distribute_tensor(torch.randn(64, 256), mesh, [Shard(1)])
        targets = torch.randint(0, 256, (64,))
        local_bytes = 64 * 128 * 4
        live = LiveTensorBytes("cpu", [logits, targets])
        with live, loss_parallel():
            F.cross_entropy(logits, targets)
    # held logits + (shifted and its exponential) at once: the output alone would be one more
    assert live.peak_bytes - live.start_bytes >= 2 * local_bytes
