"""Training on variable-length micro-batches (train/executor.py) on 4 real CPU processes over
gloo, against today's train_step and a single-process reference on the whole batch, also under
context parallelism and for a mixture-of-experts model with expert parallelism; and the
variable-length data it eats, and samples packed into rows against the same samples alone. One
launch for every case (a launch costs seconds)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from conftest import spawn_ranks

from orchestrator.models.gpt import IGNORE_INDEX
from orchestrator.planner.dynamic import MicroBatch
from orchestrator.train.data import LengthDistribution, make_data, micro_batch_tensors

WORLD_SIZE = 4
SEQ_LEN = 32
LR = 1e-2
CLEAR_GRAD = 1e-6  # gradients below this are rounding-level for Adam's sign
LENGTHS = LengthDistribution(mean_len=12, max_len=SEQ_LEN, min_len=2)
# Per dp rank, its plan over its 4 samples (local indices): different counts, sizes, padded
# lengths (the longest sample, rounded up to even for sequence parallelism) and recompute modes.
UNEQUAL_1F1B = [[((0, 1), "none"), ((2, 3), "full")],
                [((0,), "selective"), ((1, 2), "none"), ((3,), "full")]]
# pp4 dp1: one pipeline over the 4 samples, for eager 1F1B (more warm-up forwards)
UNEQUAL_PP4 = [[((0,), "none"), ((1,), "full"), ((2,), "selective"), ((3,), "none")]]
UNEQUAL_INTERLEAVED = [[((0, 1), "selective"), ((2, 3), "none")],
                       [((0,), "none"), ((1,), "full"), ((2,), "none"), ((3,), "selective")]]
# cp2 pp2: one pipeline, each micro-batch's sequences split over the CP pair
UNEQUAL_CP = [[((0,), "none"), ((1, 2), "full"), ((3,), "selective")]]
# MoE dp4 ep2: the dp ranks of an EP group (0 and 1, 2 and 3) run as many micro-batches, full
# recompute (which reruns the dispatcher's all-to-alls) at the same places; the pairs differ
UNEQUAL_MOE = [[((0, 1), "none"), ((2, 3), "full")],
               [((0,), "selective"), ((1, 2, 3), "full")],
               [((0,), "none"), ((1,), "full"), ((2, 3), "selective")],
               [((0, 1), "selective"), ((2,), "full"), ((3,), "none")]]
MOE = dict(experts=4, top_k=2, expert_ffn=64, shared_expert_ffn=64, dense_layers=1,
           aux_loss_coef=0.01)


def _model(moe: bool = False):
    from orchestrator.models.config import ModelConfig

    return ModelConfig(hidden=64, ffn=128, layers=4, heads=4, kv_heads=2, vocab=128,
                       seq_len=SEQ_LEN, **(MOE if moe else {}))


def _layout(pp, tp, m, **extra):
    from orchestrator.layout import ParallelLayout

    return ParallelLayout.uniform(WORLD_SIZE, tp, pp, 4, micro_batch_size=1,
                                  num_micro_batches=m, sequence_parallel=tp > 1, **extra)


def _global_samples(data, num_samples, step=0):
    """The step's samples: their windows (length + 1 tokens each)."""
    lengths = data.sample_lengths(step, 0, num_samples, LENGTHS)
    return data.varlen_windows(step, range(num_samples), lengths)


def _micro_batches(windows, plan, pad_to_max=False, multiple=2):
    from orchestrator.train.executor import MicroBatchInput

    out = []
    for samples, recompute in plan:
        longest = max(len(windows[i]) - 1 for i in samples)
        padded = SEQ_LEN if pad_to_max else -(-longest // multiple) * multiple
        tokens, targets = micro_batch_tensors(windows, MicroBatch(samples, padded, recompute))
        out.append(MicroBatchInput(tokens, targets, recompute))
    return out


def _real_tokens(windows) -> int:
    return sum(len(w) - 1 for w in windows)


def _params(engine) -> dict:
    from orchestrator.train.grads import local_tensor

    return {name: local_tensor(p).detach().clone() for name, p in engine.named_parameters().items()}


def _max_diff(a: dict, b: dict, masks: dict | None = None) -> float:
    """The largest |a - b| over every parameter (where masks[name] is True, if given)."""
    assert a.keys() == b.keys()
    diffs = [(a[k] - b[k]).abs() for k in a]
    if masks is not None:
        diffs = [d[masks[k]] for d, k in zip(diffs, a)]
    return max(float(d.max()) if d.numel() else 0.0 for d in diffs)


def _reference(windows, plan_by_dp, moe=False, multiple=2):
    """One process, the whole model: (loss = the mean over real tokens, gradient norm, the
    parameters after one AdamW step) on every dp rank's micro-batches; for a MoE model the
    balance loss's mean over its layers' calls (the step log's) after the parameters, each
    micro-batch's balance loss counted by its share of the batch's rows."""
    from orchestrator.models.gpt import GPT, token_loss_sum
    from orchestrator.models.moe import MoE

    model = GPT(_model(moe), seed=1)
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    total = _real_tokens(windows)
    rows = sum(len(samples) for plan in plan_by_dp for samples, _ in plan)
    loss_sum = 0.0
    for dp_rank, plan in enumerate(plan_by_dp):
        for mb in _micro_batches(windows[4 * dp_rank:4 * dp_rank + 4], plan, multiple=multiple):
            for layer in layers:
                layer.aux_grad_scale = len(mb.tokens) / rows
            loss = token_loss_sum(model(mb.tokens), mb.targets) / total
            loss.backward()
            loss_sum += float(loss.detach())
    norm = float(torch.sqrt(sum(p.grad.double().square().sum() for p in model.parameters())))
    if moe:
        return loss_sum, norm, (sum(m.aux_loss_sum for m in layers)
                                / sum(m.aux_calls for m in layers))
    optim = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8,
                              weight_decay=0.1)
    # Adam's first step moves a weight by about lr * sign(grad): where the gradient is within
    # rounding of zero its sign (and so the update) is arbitrary, so only clear gradients count.
    clear = {n: p.grad.abs() > CLEAR_GRAD for n, p in model.named_parameters()}
    optim.step()
    return loss_sum, norm, {n: p.detach().clone() for n, p in model.named_parameters()}, clear


def _equal_shapes(rank, out, name, layout, moe=False):
    """Today's train_step and the executor on the same equal micro-batches (1 x seq_len)."""
    from orchestrator.train.engine import Engine
    from orchestrator.train.executor import MicroBatchInput

    data = make_data(None, 128, SEQ_LEN, seed=0)
    results = []
    for dynamic in (False, True):
        engine = Engine(layout, _model(moe), torch.device("cpu"), seed=1)
        tokens, targets = data.rank_batch(0, engine.dp_rank, layout.dp, 2)
        if dynamic:
            batches = [MicroBatchInput(tokens[i:i + 1], targets[i:i + 1]) for i in range(2)]
            stats = engine.train_step_micro_batches(batches, LR, 1.0,
                                                    total_tokens=layout.dp * 2 * SEQ_LEN,
                                                    total_rows=layout.dp * 2)
        else:
            stats = engine.train_step(tokens, targets, LR, 1.0)
        results.append((stats.loss, stats.grad_norm, _params(engine), stats.aux_loss))
    (loss0, norm0, p0, aux0), (loss1, norm1, p1, aux1) = results
    out[(name, rank)] = (loss0, loss1, norm0, norm1, _max_diff(p0, p1), aux0, aux1)


def _unequal(rank, out, name, layout, plan_by_dp, pad_to_max=False, extra_warmup=0,
             moe=False, multiple=2):
    """The executor on this dp rank's plan (eager 1F1B with extra_warmup; padded lengths a
    multiple of `multiple`) against the whole-batch reference."""
    from orchestrator.train.engine import Engine

    data = make_data(None, 128, SEQ_LEN, seed=0)
    windows = _global_samples(data, 4 * len(plan_by_dp))  # 4 per dp rank
    engine = Engine(layout, _model(moe), torch.device("cpu"), seed=1)
    mine = windows[4 * engine.dp_rank:4 * engine.dp_rank + 4]
    batches = _micro_batches(mine, plan_by_dp[engine.dp_rank], pad_to_max, multiple)
    rows = sum(len(samples) for plan in plan_by_dp for samples, _ in plan)
    stats = engine.train_step_micro_batches(batches, LR, 0.0, _real_tokens(windows),
                                            extra_warmup=extra_warmup, total_rows=rows)
    if moe:  # the experts are sharded over EP: compare the step's numbers
        loss, norm, aux = _reference(windows, plan_by_dp, moe, multiple)
        out[(name, rank)] = (stats.loss, loss, stats.grad_norm, norm, stats.aux_loss, aux)
        return
    loss, norm, params, clear = _reference(windows, plan_by_dp, multiple=multiple)
    mine_params = _params(engine)
    diff = _max_diff(mine_params, {k: params[k] for k in mine_params}, clear)
    out[(name, rank)] = (stats.loss, loss, stats.grad_norm, norm, diff)


def _packed(rank, out, name, layout, modes=("selective", "full")):
    """The executor on this dp rank's 4 samples packed back to back into rows of SEQ_LEN
    tokens (pack_rows; the first row one micro-batch, the rest another), against the
    whole-batch reference on the same samples each padded alone: packed samples attend only
    to themselves, their positions from 0, on every pipeline stage."""
    from orchestrator.planner.dynamic import pack_rows
    from orchestrator.train.data import packed_segments, packed_tensors
    from orchestrator.train.engine import Engine
    from orchestrator.train.executor import MicroBatchInput

    data = make_data(None, 128, SEQ_LEN, seed=0)
    windows = _global_samples(data, 4 * layout.dp)
    engine = Engine(layout, _model(), torch.device("cpu"), seed=1)
    mine = windows[4 * engine.dp_rank:4 * engine.dp_rank + 4]
    lengths = [len(w) - 1 for w in mine]
    rows = pack_rows(lengths, SEQ_LEN)
    batches = []
    for group, mode in zip((rows[:1], rows[1:]), modes):
        tokens, targets = packed_tensors(dict(enumerate(mine)), group, SEQ_LEN)
        segments = packed_segments([[lengths[i] for i in row] for row in group], SEQ_LEN)
        batches.append(MicroBatchInput(tokens, targets, mode, segments=segments))
    stats = engine.train_step_micro_batches(batches, LR, 0.0, _real_tokens(windows),
                                            total_rows=layout.dp * len(rows))
    loss, norm, params, clear = _reference(windows, [[((0, 1), "none"), ((2, 3), "none")]]
                                           * layout.dp)
    diff = 0.0
    if layout.tp == 1:  # TP shards the parameters: the loss and gradient norm tell there
        mine_params = _params(engine)
        diff = _max_diff(mine_params, {k: params[k] for k in mine_params}, clear)
    out[(name, rank)] = (stats.loss, loss, stats.grad_norm, norm, diff,
                         max(len(row) for row in rows), len(rows))


def _worker(rank: int, out: dict) -> None:
    _packed(rank, out, "packed pp2 tp2", _layout(2, 2, m=2))
    _packed(rank, out, "packed dp4", _layout(1, 1, m=1), modes=("none", "selective"))
    _equal_shapes(rank, out, "equal pp2 tp1", _layout(2, 1, m=2))
    _equal_shapes(rank, out, "equal pp2 tp2", _layout(2, 2, m=2))
    # context parallelism (the ring, with SP inside each CP rank) and MoE with EP over dp ranks
    _equal_shapes(rank, out, "equal cp2 tp2", _layout(1, 2, m=2, cp=2))
    _equal_shapes(rank, out, "equal moe pp2 ep2", _layout(2, 1, m=2, ep=2), moe=True)
    _unequal(rank, out, "cp2 pp2", _layout(2, 1, m=2, cp=2), UNEQUAL_CP, multiple=4)
    _unequal(rank, out, "moe dp4 ep2", _layout(1, 1, m=1, ep=2), UNEQUAL_MOE, moe=True)
    _unequal(rank, out, "1f1b", _layout(2, 1, m=2), UNEQUAL_1F1B)
    _unequal(rank, out, "1f1b padded", _layout(2, 1, m=2), UNEQUAL_1F1B, pad_to_max=True)
    _unequal(rank, out, "eager 1f1b pp2", _layout(2, 1, m=2), UNEQUAL_1F1B, extra_warmup=1)
    _unequal(rank, out, "eager 1f1b pp4", _layout(4, 1, m=4), UNEQUAL_PP4, extra_warmup=2)
    _unequal(rank, out, "interleaved",
             _layout(2, 1, m=2, schedule="interleaved", virtual_stages=2),
             UNEQUAL_INTERLEAVED)
    _unequal(rank, out, "dp4 zero2", _layout(1, 1, m=1, zero=2),
             [UNEQUAL_1F1B[0], UNEQUAL_1F1B[1]] * 2)


@pytest.fixture(scope="module")
def results():
    return spawn_ranks(_worker, WORLD_SIZE)


@pytest.mark.parametrize("case", ["equal pp2 tp1", "equal pp2 tp2", "equal cp2 tp2",
                                  "equal moe pp2 ep2"])
def test_executor_matches_train_step_on_equal_micro_batches(results, case):
    """Also with context parallelism (each micro-batch's sequences split over the CP ranks)
    and for a MoE model (experts over EP ranks of two dp ranks; the balance loss's gradient
    and value as train_step's)."""
    for rank in range(WORLD_SIZE):
        loss_today, loss_new, norm_today, norm_new, param_diff, aux_today, aux_new = \
            results[(case, rank)]
        assert loss_new == pytest.approx(loss_today, rel=1e-6), (case, rank)
        assert norm_new == pytest.approx(norm_today, rel=1e-5), (case, rank)
        assert param_diff < 1e-5, (case, rank, param_diff)
        assert (aux_new is aux_today is None) == ("moe" not in case), (case, rank)
        if aux_today is not None:
            assert aux_new == pytest.approx(aux_today, rel=1e-6), (case, rank)


def test_moe_unequal_micro_batches_give_the_whole_batch_losses(results):
    """MoE with EP over pairs of dp ranks, micro-batches of different sizes, lengths and
    recompute (as many, full recompute at the same places within a pair): the token-mean
    loss, gradient norm and balance loss of one process on the whole batch."""
    for rank in range(WORLD_SIZE):
        loss, want_loss, norm, want_norm, aux, want_aux = results[("moe dp4 ep2", rank)]
        assert loss == pytest.approx(want_loss, rel=1e-5), rank
        assert norm == pytest.approx(want_norm, rel=1e-4), rank
        assert aux == pytest.approx(want_aux, rel=1e-5), rank


@pytest.mark.parametrize("case", ["1f1b", "interleaved", "dp4 zero2", "eager 1f1b pp2",
                                  "eager 1f1b pp4", "cp2 pp2"])
def test_unequal_micro_batches_give_the_whole_batch_token_mean(results, case):
    """Different micro-batch counts per dp rank (2 vs 3, 2 vs 4): loss, gradient norm and the
    updated parameters are those of one process on the whole batch, padding ignored; also
    under eager 1F1B's op order (the planner's extra warm-up forwards)."""
    for rank in range(WORLD_SIZE):
        loss, want_loss, norm, want_norm, param_diff = results[(case, rank)]
        assert loss == pytest.approx(want_loss, rel=1e-5), (case, rank)
        assert norm == pytest.approx(want_norm, rel=1e-4), (case, rank)
        assert param_diff < 1e-5, (case, rank, param_diff)


@pytest.mark.parametrize("case", ["packed pp2 tp2", "packed dp4"])
def test_packed_rows_give_the_loss_of_the_samples_alone(results, case):
    """Samples packed into rows (train.microbatching=dynamic | packed), through the pipeline
    executor with sequence parallelism and the plain loop: loss, gradient norm and updated
    parameters are those of the samples each padded alone (no sample attends to another)."""
    for rank in range(WORLD_SIZE):
        loss, want_loss, norm, want_norm, param_diff, most, rows = results[(case, rank)]
        assert most >= 2 and rows >= 2, (case, rank, most, rows)  # some row does pack
        assert loss == pytest.approx(want_loss, rel=1e-5), (case, rank)
        assert norm == pytest.approx(want_norm, rel=1e-4), (case, rank)
        assert param_diff < 1e-5, (case, rank, param_diff)


def test_extra_padding_changes_nothing(results):
    for rank in range(WORLD_SIZE):
        padded, plain = results[("1f1b padded", rank)], results[("1f1b", rank)]
        assert padded[0] == pytest.approx(plain[0], rel=1e-6)
        assert padded[2] == pytest.approx(plain[2], rel=1e-5)
        assert padded[4] < 1e-5


def test_sample_lengths_depend_on_seed_step_and_index_only():
    data = make_data(None, vocab=128, seq_len=64, seed=3)
    lengths = data.sample_lengths(5, 0, 16, LENGTHS)
    assert np.array_equal(data.sample_lengths(5, 4, 3, LENGTHS), lengths[4:7])
    again = make_data(None, vocab=128, seq_len=64, seed=3)  # a resumed run
    assert np.array_equal(again.sample_lengths(5, 0, 16, LENGTHS), lengths)
    assert not np.array_equal(data.sample_lengths(6, 0, 16, LENGTHS), lengths)
    other = make_data(None, vocab=128, seq_len=64, seed=4)
    assert not np.array_equal(other.sample_lengths(5, 0, 16, LENGTHS), lengths)


def test_sample_lengths_are_long_tailed_and_capped():
    data = make_data(None, vocab=128, seq_len=512, seed=0)
    capped = LengthDistribution(mean_len=64, max_len=256, min_len=8, sigma=1.0)
    lengths = data.sample_lengths(0, 0, 20000, capped)
    assert lengths.min() >= 8 and lengths.max() == 256  # the tail reaches the cap
    # lognormal(mu = ln 64 - 1/2, sigma 1): median 64 e^-0.5 = 38.8;
    # P(> 256) = P(z > ln 4 + 1/2 = 1.886) = 2.96%; P(< 8) = P(z < -1.579) = 5.7%
    assert 36 <= np.median(lengths) <= 42
    assert 0.025 <= np.mean(lengths == 256) <= 0.035
    assert 0.05 <= np.mean(lengths == 8) <= 0.065
    with pytest.raises(ValueError, match=r"max_len\(1024\) > the data's seq_len\(512\)"):
        data.sample_lengths(0, 0, 4, LengthDistribution(mean_len=64, max_len=1024))


@pytest.mark.parametrize("source", [None, os.path.dirname(os.__file__)])
def test_varlen_windows_are_the_fixed_windows_cut(source):
    data = make_data(source, vocab=256, seq_len=32, seed=2, max_bytes=1 << 20)
    tokens, targets = data.batch(3, 0, 4)
    windows = data.varlen_windows(3, [0, 1, 2, 3], [5, 32, 1, 17])
    assert [len(w) for w in windows] == [6, 33, 2, 18]
    for w, t, y in zip(windows, tokens, targets):
        assert torch.equal(w[:-1], t[:len(w) - 1]) and torch.equal(w[1:], y[:len(w) - 1])


def test_micro_batch_tensors_pad_with_ignored_targets():
    windows = [torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6, 7, 8]), torch.tensor([9, 10])]
    tokens, targets = micro_batch_tensors(windows, MicroBatch((2, 0), padded_len=4))
    assert tokens.tolist() == [[9, 0, 0, 0], [1, 2, 0, 0]]
    assert targets.tolist() == [[10, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX],
                                [2, 3, IGNORE_INDEX, IGNORE_INDEX]]
    with pytest.raises(ValueError, match=r"sample 1 has 4 tokens, more than .*padded_len\(3\)"):
        micro_batch_tensors(windows, MicroBatch((1,), padded_len=3))
