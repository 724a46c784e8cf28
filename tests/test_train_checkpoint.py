"""Distributed checkpoints on 4 real CPU processes over gloo: saved in one layout, reloaded in
another, damaged ones skipped for the previous one, old ones pruned."""

import warnings
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import spawn_ranks

WORLD_SIZE = 4


def _worker(rank: int, out: dict, bodies, folder: str) -> None:
    """Run each body in its own subfolder; rank 0 marks each one that passed on every rank."""
    for body in bodies:
        body(rank, Path(folder) / body.__name__)
        dist.barrier()
        if rank == 0:
            out[f"{body.__name__} passed"] = True


class Spawned:
    """One launch of 4 processes for the whole file (a launch costs seconds on 2 cores)."""

    def __init__(self, out: dict):
        self.out = out
        errors = [f"{k}: {v}" for k, v in out.items() if str(k).startswith("error")]
        self.failure = "\n".join(errors) or "not run"  # the body that failed, its traceback

    def check(self, body) -> None:
        assert self.out.get(f"{body.__name__} passed"), self.failure


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> Spawned:
    folder = tmp_path_factory.mktemp("checkpoints")
    bodies = (_dp2_tp2_saves_tp4_and_plain_load, _pp2_tp2_saves_dp4_loads,
              _damaged_checkpoints_fall_back, _saves_keep_the_newest)
    worker = partial(_worker, bodies=bodies, folder=str(folder))
    return Spawned(spawn_ranks(worker, WORLD_SIZE, check=False))


def _on_rank0(rank: int, action) -> None:
    """Damage files on rank 0 only, once every rank has looked, then let every rank look."""
    dist.barrier()
    if rank == 0:
        action()
    dist.barrier()


def _mesh(*shape, names):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _sharded(full: torch.Tensor, mesh, placements):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, mesh, placements)


# Whole-model values every layout cuts its own way.
WQ = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
EMB = torch.arange(5, dtype=torch.float32) - 2.5


def _dp2_tp2_saves_tp4_and_plain_load(rank: int, folder: Path) -> None:
    from torch.distributed.tensor import Replicate, Shard

    from orchestrator.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

    mesh = _mesh(2, 2, names=("dp", "tp"))
    tp_shard = [Replicate(), Shard(0)]
    state = {"model": {"blocks.0.attn.wq.weight": _sharded(WQ, mesh, tp_shard),
                       "tok_emb.weight": EMB.clone()},
             "optim": {"blocks.0.attn.wq.weight.exp_avg": _sharded(WQ * 2, mesh, tp_shard),
                       "tok_emb.weight.exp_avg": EMB * 2},
             "meta": {"tokens_seen": 1234}}
    save_checkpoint(folder, 7, state, {"data_position": 99, "layout": "dp2 tp2"})

    info = latest_checkpoint(folder)
    assert (info.step, info.path.name) == (7, "step_00000007")
    tp4 = _mesh(4, names=("tp",))
    target = {"model": {"blocks.0.attn.wq.weight": _sharded(torch.zeros(8, 3), tp4, [Shard(0)]),
                        "tok_emb.weight": torch.zeros(5)},
              "optim": {"blocks.0.attn.wq.weight.exp_avg":
                        _sharded(torch.zeros(8, 3), tp4, [Shard(0)]),
                        "tok_emb.weight.exp_avg": torch.zeros(5)},
              "meta": {"tokens_seen": 0}}
    assert load_checkpoint(info, target) == {"data_position": 99, "layout": "dp2 tp2"}
    rows = slice(2 * rank, 2 * rank + 2)  # tp 4 holds 2 of the 8 rows on each rank
    torch.testing.assert_close(target["model"]["blocks.0.attn.wq.weight"].to_local(), WQ[rows])
    torch.testing.assert_close(
        target["optim"]["blocks.0.attn.wq.weight.exp_avg"].to_local(), WQ[rows] * 2)
    torch.testing.assert_close(target["model"]["tok_emb.weight"], EMB)
    assert target["meta"] == {"tokens_seen": 1234}

    plain = {"model": {"blocks.0.attn.wq.weight": torch.zeros(8, 3)}}  # dp 4: whole tensors
    load_checkpoint(info, plain)
    torch.testing.assert_close(plain["model"]["blocks.0.attn.wq.weight"], WQ)


def test_dtensor_checkpoint_reloads_with_another_tp_degree_and_as_plain_tensors(spawned):
    spawned.check(_dp2_tp2_saves_tp4_and_plain_load)


def _stage_state(stage: int, mesh_tp) -> dict:
    """What pipeline stage `stage` of 2 holds: a TP-sharded weight and a replicated one."""
    from torch.distributed.tensor import Shard

    if stage == 0:
        model = {"tok_emb.weight": EMB.clone(),
                 "blocks.0.attn.wq.weight": _sharded(WQ, mesh_tp, [Shard(0)])}
    else:
        model = {"blocks.1.attn.wq.weight": _sharded(WQ + 100, mesh_tp, [Shard(0)]),
                 "norm.weight": EMB * 3}
    optim = {f"{fqn}.exp_avg_sq": torch.ones(()) * (stage + 1) for fqn in model}
    return {"model": model, "optim": optim}


def _pp2_tp2_saves_dp4_loads(rank: int, folder: Path) -> None:
    from orchestrator.train.checkpoint import load_latest, save_checkpoint

    mesh = _mesh(2, 2, names=("pp", "tp"))
    stage = mesh.get_local_rank("pp")
    save_checkpoint(folder, 3, _stage_state(stage, mesh["tp"]), {"layout": "pp2 tp2"})

    whole = {"model": {"tok_emb.weight": torch.zeros(5), "blocks.0.attn.wq.weight":
                       torch.zeros(8, 3), "blocks.1.attn.wq.weight": torch.zeros(8, 3),
                       "norm.weight": torch.zeros(5)},
             "optim": {"tok_emb.weight.exp_avg_sq": torch.zeros(()),
                       "norm.weight.exp_avg_sq": torch.zeros(())}}
    info, problems = load_latest(folder, whole)
    assert (info.step, info.extra, problems) == (3, {"layout": "pp2 tp2"}, [])
    torch.testing.assert_close(whole["model"]["tok_emb.weight"], EMB)
    torch.testing.assert_close(whole["model"]["blocks.0.attn.wq.weight"], WQ)
    torch.testing.assert_close(whole["model"]["blocks.1.attn.wq.weight"], WQ + 100)
    torch.testing.assert_close(whole["model"]["norm.weight"], EMB * 3)
    assert whole["optim"]["tok_emb.weight.exp_avg_sq"].item() == 1.0
    assert whole["optim"]["norm.weight.exp_avg_sq"].item() == 2.0


def test_pipeline_stages_save_their_own_keys_and_every_rank_reloads_all(spawned):
    spawned.check(_pp2_tp2_saves_dp4_loads)


def _step_state(step: float, mesh) -> dict:
    from torch.distributed.tensor import Shard

    return {"model": {"w": _sharded(torch.full((8, 2), step), mesh, [Shard(0)]),
                      "b": torch.full((3,), step)},
            "meta": {"step": int(step)}}


def _step_of(state: dict) -> float:
    return state["model"]["w"].full_tensor()[0, 0].item()


def _largest_data_file(path: Path) -> Path:
    return max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)


def _damaged_checkpoints_fall_back(rank: int, folder: Path) -> None:
    from orchestrator.train.checkpoint import (
        CheckpointError, CheckpointMismatchError, CheckpointWarning, find_checkpoints,
        latest_checkpoint, load_checkpoint, load_latest, save_checkpoint, step_folder)

    mesh = _mesh(4, names=("dp",))
    for step in (1, 2, 3):
        save_checkpoint(folder, step, _step_state(step, mesh), {"step": step}, keep=3)
    _on_rank0(rank, lambda: (folder / ".tmp_step_00000009").mkdir())  # a save killed midway
    assert latest_checkpoint(folder).step == 3

    # Same size, content gone: passes the file checks, fails inside DCP on one rank.
    def zero_data():
        data = _largest_data_file(step_folder(folder, 3))
        data.write_bytes(bytes(data.stat().st_size))
    _on_rank0(rank, zero_data)
    assert latest_checkpoint(folder).step == 3
    state = _step_state(0, mesh)
    info, problems = load_latest(folder, state)
    assert (info.step, _step_of(state), state["meta"]["step"]) == (2, 2.0, 2)
    assert len(problems) == 1
    assert "step_00000003" in problems[0] and "DCP load failed" in problems[0]

    _on_rank0(rank, lambda: (step_folder(folder, 3) / "complete.json").unlink())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert latest_checkpoint(folder).step == 2
    assert [w.category for w in caught] == [CheckpointWarning]
    assert "step_00000003" in str(caught[0].message) and "complete.json missing" in str(
        caught[0].message)

    _on_rank0(rank, lambda: _largest_data_file(step_folder(folder, 2)).unlink())
    good, problems = find_checkpoints(folder)
    assert [info.step for info in good] == [1]
    assert "step_00000002" in problems[1] and ".distcp missing" in problems[1]

    def truncate_data():
        data = _largest_data_file(step_folder(folder, 1))
        data.write_bytes(data.read_bytes()[:100])
    _on_rank0(rank, truncate_data)
    assert latest_checkpoint(folder) is None
    with pytest.raises(CheckpointError, match="no checkpoint in .* reads"):
        load_latest(folder, _step_state(0, mesh))

    # The next save clears the killed save's folder and the damaged ones past `keep`.
    save_checkpoint(folder, 4, _step_state(4, mesh), {"step": 4})
    assert not (folder / ".tmp_step_00000009").exists()
    info = latest_checkpoint(folder)
    other_model = {"model": {"w": torch.zeros(8, 2), "blocks.9.w": torch.zeros(1)}}
    with pytest.raises(CheckpointMismatchError, match=r"1 keys missing \(model.blocks.9.w\)"):
        load_checkpoint(info, other_model)
    with pytest.raises(CheckpointMismatchError, match=r"model.w \(8, 2\) saved, \(4, 2\) here"):
        load_latest(folder, {"model": {"w": torch.zeros(4, 2)}})


def test_damaged_checkpoint_is_skipped_for_the_previous_one_with_a_warning(spawned):
    spawned.check(_damaged_checkpoints_fall_back)


def _saves_keep_the_newest(rank: int, folder: Path) -> None:
    from orchestrator.train.checkpoint import latest_checkpoint, load_latest, save_checkpoint

    def folders():
        return sorted(p.name for p in folder.iterdir())

    mesh = _mesh(4, names=("dp",))
    for step in (10, 20, 30):
        save_checkpoint(folder, step, _step_state(step, mesh), {"step": step})
    assert folders() == ["step_00000020", "step_00000030"]
    save_checkpoint(folder, 30, _step_state(31, mesh), {"step": 30, "again": True})
    assert folders() == ["step_00000020", "step_00000030"]
    assert latest_checkpoint(folder).extra == {"step": 30, "again": True}

    # A run resumed from step 20 saves 25: the abandoned step 30 must not be resumed later.
    save_checkpoint(folder, 25, _step_state(25, mesh), {"step": 25})
    assert folders() == ["step_00000020", "step_00000025"]
    state = _step_state(0, mesh)
    info, _ = load_latest(folder, state)
    assert (info.step, _step_of(state)) == (25, 25.0)

    # A state dict is made only when there is a checkpoint to load into it (stage=train made
    # one before its first step and kept it: zeros beside AdamW's own moments all run long).
    made = []

    def make() -> dict:
        made.append(_step_state(0, mesh))
        return made[-1]
    assert load_latest(folder / "never_saved", make) == (None, [])
    assert made == []
    info, _ = load_latest(folder, make)
    assert (info.step, len(made), _step_of(made[0])) == (25, 1, 25.0)


def test_save_keeps_the_two_newest_checkpoints(spawned):
    spawned.check(_saves_keep_the_newest)


# ---------------------------------------------------------------- before launch, no ranks
def test_a_checkpoint_fits_any_layout_of_its_model_and_no_other():
    """The CLI's check of train.load: the engine's state keys and global shapes of a model,
    against what a checkpoint holds (the ranks' own rule), and the line that refuses it."""
    from orchestrator.models.config import ModelConfig
    from orchestrator.train.load_check import another_model_text
    from orchestrator.train.checkpoint import CheckpointInfo, shape_mismatch
    from orchestrator.train.load_check import state_shapes

    tiny = ModelConfig()
    saved = state_shapes(tiny)  # any layout saves these: DTensors by their global shape
    assert saved["model.blocks.3.mlp.w_up.weight"] == (384, 128)
    assert saved["optim.lm_head.weight.exp_avg_sq"] == (512, 128)
    assert shape_mismatch(saved, state_shapes(ModelConfig(heads=2, kv_heads=1))) is None
    shallower = shape_mismatch(saved, {k: v for k, v in saved.items() if ".3." not in k})
    assert shallower is None  # keys the checkpoint has beyond the model's are left out
    deeper = shape_mismatch(saved, state_shapes(ModelConfig(layers=5)))
    assert deeper.startswith("27 keys missing (model.blocks.4.attn_norm.weight, "), deeper
    wider = shape_mismatch(saved, state_shapes(ModelConfig(vocab=1024)))
    assert wider.startswith("other shapes: model.tok_emb.weight (512, 128) saved, (1024, 128) "
                            "here; "), wider
    info = CheckpointInfo(4, Path("/ck/step_00000004"),
                          {"model": {**vars(ModelConfig()), "dtype": "fp32"}})
    line = another_model_text("/ck", info, ModelConfig(layers=5), deeper)
    assert line.startswith("train.load=/ck: checkpoint /ck/step_00000004 is of another model "
                           "(model tiny, model.layers=4; here model tiny, layers=5): 27 keys "
                           "missing"), line
    assert line.endswith("Give train.load a checkpoint of tiny, or train the model it was "
                         "saved by (model.layers=4)"), line
