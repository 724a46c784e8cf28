"""orchestrator/dist_names.py: torch's tensor collectives under the names this torch has.
torch 2.13 warns on every call of all_gather_into_tensor / reduce_scatter_tensor (a new user's
ZeRO-2 train printed the warning once per rank); 2.11, the GPU machines', has only those."""
from __future__ import annotations

import ast
import warnings

import torch
import torch.distributed as dist

from conftest import REPO

OLD_NAMES = {"all_gather_into_tensor", "reduce_scatter_tensor"}


def test_no_module_calls_torchs_old_collective_names_but_dist_names():
    calls = []
    for path in sorted((REPO / "orchestrator").rglob("*.py")):
        if path.name == "dist_names.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in OLD_NAMES):
                calls.append(f"{path.relative_to(REPO)}:{node.lineno} {node.func.attr}")
    assert not calls, calls


def test_the_names_gather_and_scatter_without_a_warning(tmp_path):
    from orchestrator.dist_names import all_gather_single, reduce_scatter_single

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch's FutureWarning fails the test
            x = torch.arange(4.0)
            gathered = torch.empty(4)
            all_gather_single(gathered, x)
            scattered = torch.empty(4)
            reduce_scatter_single(scattered, x)
        assert torch.equal(gathered, x) and torch.equal(scattered, x)
    finally:
        dist.destroy_process_group()
