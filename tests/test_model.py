"""The GPT model on one process: shapes, refusals, counting on meta, pipeline split."""

import dataclasses
import re

import pytest
import torch
import yaml

from orchestrator.config import CONF_DIR
from orchestrator.models.config import ModelConfig, count_params, validate_model
from orchestrator.models.gpt import GPT, cross_entropy_loss, draw_device
from orchestrator.models.parallelize import split_pipeline, stage_layer_ranges

CONF_MODEL = CONF_DIR / "model"


def _batch(cfg: ModelConfig, batch: int = 2, seq: int = 32, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (batch, seq + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def test_tiny_forward_backward_gives_finite_loss_and_every_gradient():
    cfg = ModelConfig()
    model = GPT(cfg)
    tokens, targets = _batch(cfg)
    assert model(tokens).shape == (2, 32, cfg.vocab)
    loss = model(tokens, targets)
    # An untrained model predicts about uniformly: loss near ln(vocab).
    assert abs(loss.item() - torch.log(torch.tensor(cfg.vocab)).item()) < 0.5
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name


def test_same_seed_gives_same_weights_and_other_seed_does_not():
    cfg = ModelConfig(layers=1)
    a, b, c = GPT(cfg, seed=3), GPT(cfg, seed=3), GPT(cfg, seed=4)
    assert torch.equal(a.blocks[0].attn.wq.weight, b.blocks[0].attn.wq.weight)
    assert not torch.equal(a.blocks[0].attn.wq.weight, c.blocks[0].attn.wq.weight)


def test_attention_is_causal():
    cfg = ModelConfig(layers=2)
    model = GPT(cfg)
    tokens, _ = _batch(cfg, seq=16)
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % cfg.vocab
    torch.testing.assert_close(model(tokens)[:, :10], model(changed)[:, :10])


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_packed_samples_each_compute_what_they_compute_alone(recompute):
    """Samples packed back to back into a row (train.microbatching=dynamic | packed) attend only
    to themselves, their positions from 0 (Megatron's --reset-attention-mask
    --reset-position-ids): each sample's logits in the row, through the whole model and
    through pipeline stages on segments (any recompute), are those of the sample alone."""
    from orchestrator.train.data import packed_segments, packed_tensors

    cfg = ModelConfig(layers=2)
    model = GPT(cfg)
    rows, row_len = [[5, 9, 3], [12, 8]], 24  # sample lengths per row; padding after them
    generator = torch.Generator().manual_seed(1)
    lengths = [n for row in rows for n in row]
    windows = {i: torch.randint(0, cfg.vocab, (n + 1,), generator=generator)
               for i, n in enumerate(lengths)}
    index = iter(range(len(lengths)))
    sample_rows = [[next(index) for _ in row] for row in rows]
    tokens, targets = packed_tensors(windows, sample_rows, row_len)
    segments = packed_segments(rows, row_len)
    assert segments[0].tolist() == [0] * 5 + [1] * 9 + [2] * 3 + [3] * 7
    stages = split_pipeline(model, [1, 1])
    for stage in stages:
        stage.recompute_blocks = frozenset(stage.blocks) if recompute == "full" else frozenset()
        for block in stage.blocks.values():
            block.attn.recompute_core = recompute == "selective"
    whole = model(tokens, segments=segments)
    h = tokens.clone()
    for stage in stages:
        h = stage(h, segments=segments)
    torch.testing.assert_close(h, whole)
    h.sum().backward()  # the recompute's backward reruns the masked forward
    for r, row in enumerate(sample_rows):
        at = 0
        for sample in row:
            n = len(windows[sample]) - 1
            alone = model(windows[sample][None, :-1])[0]
            torch.testing.assert_close(whole[r, at:at + n], alone, rtol=1e-5, atol=1e-5)
            at += n
    # the token-mean loss over the packed rows is the one over the samples run alone
    alone_sum = sum(cross_entropy_loss(model(w[None, :-1]), w[None, 1:]) * (len(w) - 1)
                    for w in windows.values())
    torch.testing.assert_close(model(tokens, targets, segments=segments),
                               alone_sum / sum(lengths))
    # without the segments a later sample sees the ones before it in its row
    assert not torch.allclose(model(tokens)[0, 5:14], whole[0, 5:14], atol=1e-4)


@pytest.mark.parametrize(
    "overrides, tp, message",
    [
        ({"heads": 6, "hidden": 96}, 4, "model.heads(6) is not divisible by tp(4)"),
        ({"hidden": 102}, 1, "model.hidden(102) is not divisible by model.heads(4)"),
        ({"kv_heads": 3}, 1, "model.heads(4) is not divisible by model.kv_heads(3)"),
        ({}, 4, "model.kv_heads(2) is not divisible by tp(4)"),
        ({"kv_heads": 4, "ffn": 390}, 4, "model.ffn(390) is not divisible by tp(4)"),
        # a vocabulary tp does not divide is padded (models/config.vocab_rows), not refused
        ({"make_vocab_size_divisible_by": 0}, 1,
         "model.make_vocab_size_divisible_by(0) must be a positive integer"),
        ({"kv_heads": 4, "seq_len": 250}, 4, "model.seq_len(250) is not divisible by tp(4)"),
        ({"layers": 0}, 1, "model.layers(0) must be a positive integer"),
        ({"dtype": "fp8"}, 1, "model.dtype('fp8') must be one of"),
        ({"hidden": 12, "heads": 4, "kv_heads": 4}, 1, "must be even for rotary"),
    ],
)
def test_invalid_shapes_are_refused_with_the_numbers(overrides, tp, message):
    cfg = dataclasses.replace(ModelConfig(), **overrides)
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_model(cfg, tp=tp)
    if tp == 1:  # the model refuses to be built, too
        with pytest.raises(ValueError):
            GPT(cfg)


@pytest.mark.parametrize("path", sorted(CONF_MODEL.glob("*.yaml")), ids=lambda p: p.stem)
def test_model_yaml_has_every_field_and_meta_count_matches_analytic(path):
    fields = yaml.safe_load(path.read_text())
    every = {f.name for f in dataclasses.fields(ModelConfig)}
    # a dense model's file may leave out the mixture-of-experts fields; a MoE model's lists all
    moe_fields = every - {f.name for f in dataclasses.fields(ModelConfig)
                          if f.name not in MOE_FIELDS}
    assert set(fields) == (every if fields.get("experts") else every - moe_fields), path.name
    cfg = ModelConfig(**fields)
    validate_model(cfg)
    with torch.device("meta"):  # no memory, even for 100B parameters
        model = GPT(cfg)
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg)
    assert model.lm_head.weight.dtype == cfg.dtype.torch  # "bf16" in the yaml: torch.bfloat16


MOE_FIELDS = ("experts", "top_k", "expert_ffn", "shared_expert_ffn", "dense_layers",
              "capacity_factor", "aux_loss_coef")


def test_published_mixtral_8x7b_parameter_count():
    """46,702,792,704: the count of the published checkpoint (46.7B; 12.9B active)."""
    from orchestrator.models.config import count_active_params

    cfg = ModelConfig(**yaml.safe_load((CONF_MODEL / "mixtral_8x7b.yaml").read_text()))
    assert count_params(cfg) == 46_702_792_704
    assert round(count_active_params(cfg) / 1e9, 1) == 12.9


def test_published_llama2_7b_parameter_count():
    cfg = ModelConfig(**yaml.safe_load((CONF_MODEL / "llama2_7b.yaml").read_text()))
    assert count_params(cfg) == 6_738_415_616


@pytest.mark.parametrize("layers_per_stage", [[4], [1, 1, 1, 1], [3, 1], [0, 4], [2, 0, 2]])
def test_pipeline_split_covers_each_block_once_and_matches_whole_model(layers_per_stage):
    cfg = ModelConfig()
    model = GPT(cfg)
    tokens, targets = _batch(cfg)
    stages = split_pipeline(model, layers_per_stage)
    owned = [int(i) for stage in stages for i in stage.blocks]
    assert owned == list(range(cfg.layers))
    assert stages[0].tok_emb is model.tok_emb and stages[-1].lm_head is model.lm_head
    h = tokens
    for stage in stages:
        h = stage(h)
    torch.testing.assert_close(cross_entropy_loss(h, targets), model(tokens, targets))
    # Parameter names of the stages are the model's own, each exactly once.
    names = [n for stage in stages for n in stage.state_dict()]
    assert sorted(names) == sorted(model.state_dict())


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                          reason="needs a CUDA device"))])
def test_pipeline_stage_built_on_meta_initialises_to_whole_model_values(device):
    # On a GPU the values are drawn there (draw_device), the same for a stage as for the whole.
    cfg = ModelConfig()
    with torch.device(device):
        whole = GPT(cfg, seed=5)
    with torch.device("meta"):
        lazy = GPT(cfg, seed=5)
    stage = split_pipeline(lazy, [1, 3])[1]
    stage.to_empty(device=device)
    assert draw_device(next(stage.parameters())).type == device
    stage.init_weights(seed=5)
    whole_params = dict(whole.named_parameters())
    for name, param in stage.named_parameters():
        assert torch.equal(param, whole_params[name]), name
    tokens = _batch(cfg)[0].to(device)
    h = whole.blocks[0](whole.embed(tokens), *whole.rope())
    torch.testing.assert_close(stage(h), whole(tokens))


@pytest.mark.parametrize(
    "layers_per_stage, message",
    [
        ([2, 1], r"sum\(layers_per_stage \[2, 1\]\) = 3 != model.layers\(4\)"),
        ([5, -1], r"must be integers >= 0"),
        ([], r"layers_per_stage is empty"),
    ],
)
def test_bad_pipeline_split_is_refused(layers_per_stage, message):
    with pytest.raises(ValueError, match=message):
        stage_layer_ranges(layers_per_stage, layers=4)


def test_profiler_pieces_compose_to_the_whole_forward():
    cfg = ModelConfig()
    model = GPT(cfg)
    tokens, targets = _batch(cfg)
    h = model.embed(tokens)
    cos, sin = model.rope()
    for block in model.blocks:
        h = block(h, cos, sin)
    torch.testing.assert_close(model.head_loss(h, targets), model(tokens, targets))


@pytest.mark.parametrize("vocab", [4096, 4095])
def test_the_vocab_parallel_embedding_looks_up_and_differentiates_only_its_rows(vocab):
    """Each TP rank's gradient is its own rows' (1/tp of the table, not the whole [vocab, hidden]
    DTensor's RowwiseParallel makes), and the partial lookups add up to the whole one."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from orchestrator.models.parallelize import VocabParallelEmbedding
    from orchestrator.profiling.model.analytic import fake_world

    whole = torch.nn.Embedding(vocab, 8)
    ids = torch.tensor([[0, 1, vocab // 2 - 1, vocab // 2, vocab // 2 + 1, vocab - 1]])
    with fake_world(2) as mesh:  # rank 0 of 2; the fake group's reduction is the identity
        emb = torch.nn.Embedding(vocab, 8)
        emb.load_state_dict(whole.state_dict())
        # Each rank cuts its rows from its own copy (src_data_rank=None: no scatter, which the
        # fake group fills with garbage on older torch, the GPU image's 2.11).
        parallelize_module(emb, mesh, VocabParallelEmbedding(input_layouts=Replicate(),
                                                             output_layouts=Replicate()),
                           src_data_rank=None)
        # The lookup before RowwiseParallel's reduction (which the fake group cannot do): this
        # rank's rows, zeros elsewhere.
        partial = emb.forward(DTensor.from_local(ids, mesh, [Replicate()], run_check=False))
        assert tuple(partial.placements) == (Partial(),)
        emb(ids).sum().backward()
        grad = emb.weight.grad
        rows = -(-vocab // 2)  # rank 0 owns rows [0, ceil(vocab / 2))
        assert tuple(grad.placements) == (Shard(0),)
        assert tuple(grad.to_local().shape) == (rows, 8)
        assert grad.to_local().untyped_storage().nbytes() == rows * 8 * 4
    mine = ids < rows
    assert torch.equal(partial.to_local(), whole(ids) * mine.unsqueeze(-1))
    assert torch.equal(grad.to_local().sum(1), torch.bincount(ids[mine], minlength=rows) * 8.0)


def _loss_case(dtype=torch.bfloat16, tokens: int = 256, vocab: int = 512):
    """Logits in `dtype` with every eighth target padding, and F.cross_entropy's losses and
    logits gradient of them (fp32)."""
    import torch.nn.functional as F

    from orchestrator.models.loss import IGNORE_INDEX

    generator = torch.Generator().manual_seed(0)
    base = torch.randn(tokens, vocab, generator=generator).to(dtype)
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    targets[::8] = IGNORE_INDEX
    want_logits = base.float().clone().requires_grad_()  # base itself stays a plain leaf
    want = F.cross_entropy(want_logits, targets, reduction="none")
    want.sum().backward()
    return base, targets, want, want_logits.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_loss_is_cross_entropy_and_never_holds_the_fp32_logits(dtype):
    """models/loss.token_losses in chunks of 1/8 of the logits: every token's loss and the
    logits' gradient are F.cross_entropy's (padding targets count nothing), and forward plus
    backward together hold at most the logits, their gradient in the logits' dtype and a few
    fp32 chunks: never an fp32 copy of the whole logits (what F.cross_entropy and torch's
    loss_parallel hold under bf16, 2-3 of them)."""
    from orchestrator.models.loss import token_losses
    from orchestrator.train.live_memory import LiveTensorBytes

    base, targets, want, want_grad = _loss_case(dtype)
    tokens, vocab = base.shape
    logits = base.clone().requires_grad_()
    chunk = tokens * vocab // 8
    live = LiveTensorBytes("cpu", [logits, targets])
    with live:
        losses = token_losses(logits, targets, chunk_elements=chunk)
        losses.sum().backward()
    torch.testing.assert_close(losses, want)
    torch.testing.assert_close(logits.grad.float(), want_grad,
                               **({} if dtype == torch.float32 else dict(atol=4e-3, rtol=0)))
    whole = tokens * vocab * dtype.itemsize  # the logits, and their gradient
    assert live.peak_bytes - live.start_bytes <= whole + 2 * chunk * 4 + 64 * tokens, (
        live.peak_bytes - live.start_bytes, whole)


def test_the_fused_loss_chunk_kernels_are_cross_entropy_on_a_vocabulary_shard():
    """The two functions `fused` compiles (models/loss.chunk_forward, chunk_grad), run eager
    here (the compiled ones train as eager: test_compile): on a rank holding vocabulary
    columns [100, 300) of 512, the log-sum-exp and the target's logit where the target is in
    the shard (0 elsewhere), and the gradient softmax - one-hot of a target in the shard, times
    each row's output gradient, in the logits' dtype: the eager path's (a scatter) to rounding."""
    from orchestrator.models.loss import chunk_forward, chunk_grad

    rows, first, width = 64, 100, 200
    generator = torch.Generator().manual_seed(1)
    part = torch.randn(rows, width, generator=generator).to(torch.bfloat16)
    targets = torch.randint(0, 512, (rows,), generator=generator)
    local = targets - first
    mine = (local >= 0) & (local < width)
    local = torch.where(mine, local, 0)
    grad = torch.rand(rows, generator=generator)
    lse, picked = chunk_forward(part, local, mine)
    x = part.float()
    torch.testing.assert_close(lse, torch.logsumexp(x, -1))
    want_picked = torch.where(mine, x[torch.arange(rows), local], 0.0)
    assert mine.any() and (~mine).any() and torch.equal(picked, want_picked)
    got = chunk_grad(part, lse, local, mine, grad)
    want = torch.softmax(x, -1)
    want[torch.arange(rows)[mine], local[mine]] -= 1.0
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), (want * grad[:, None]).to(torch.bfloat16).float())


def _fused_loss(base, targets, chunk):
    """(losses, logits gradient) of token_losses(fused=True) over `base`."""
    from orchestrator.models.loss import token_losses

    logits = base.clone().requires_grad_()
    losses = token_losses(logits, targets, chunk_elements=chunk, fused=True)
    losses.sum().backward()
    return losses, logits.grad


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")  # inductor's
def test_the_fused_loss_is_one_compiled_call_each_way_and_keeps_no_fp32_copy(monkeypatch):
    """token_losses(fused=True) on logits of 8 chunks runs one compiled call forward and one
    backward (chunked, each chunk was a compiled call: host time on a GPU, ~0.26 ms each), with
    F.cross_entropy's losses and gradient, and inductor's code for them allocates no buffer of
    the logits' size but the gradient itself (bf16): the fp32 conversion is fused."""
    from torch._inductor.utils import run_and_get_code

    from orchestrator.models import loss

    base, targets, want, want_grad = _loss_case()
    tokens, vocab = base.shape
    calls = {}

    def counted(fn):
        compiled = torch.compile(fn, fullgraph=True)

        def call(*args):
            calls[fn.__name__] = calls.get(fn.__name__, 0) + 1
            return compiled(*args)
        return call

    torch._dynamo.reset()  # compile here, so that run_and_get_code sees the code
    monkeypatch.setattr(loss, "_FUSED", {fn.__name__: counted(fn)
                                         for fn in (loss.chunk_forward, loss.chunk_grad)})
    (losses, grad), codes = run_and_get_code(_fused_loss, base, targets, tokens * vocab // 8)
    assert calls == {"chunk_forward": 1, "chunk_grad": 1}
    torch.testing.assert_close(losses, want)
    torch.testing.assert_close(grad.float(), want_grad, atol=4e-3, rtol=0)
    assert len(codes) == 2
    whole = re.compile(rf"empty_strided\w*\(\({tokens}, {vocab}\), \(\d+, \d+\), (torch\.\w+)\)")
    found = [m.group(1) for code in codes for m in whole.finditer(code)]
    assert found == ["torch.bfloat16"], found  # the gradient, in the logits' dtype


@pytest.mark.parametrize("error", ["unsupported", "recompile limit"])
def test_a_loss_whose_compile_fails_warns_once_and_runs_the_eager_chunks(monkeypatch, error):
    """A compile failure of the fused loss's kernels (a dynamo error at their first call, or
    the recompile limit a full graph raises at) warns one line naming the loss and runs the
    eager chunks, with F.cross_entropy's figures; later calls go eager without a word."""
    from torch._dynamo.exc import FailOnRecompileLimitHit, Unsupported

    from orchestrator.models import loss

    def fails(*args):
        if error == "unsupported":
            raise Unsupported("no such op")
        raise FailOnRecompileLimitHit("Hard failure due to fullgraph=True") from Unsupported(
            "no such op")

    monkeypatch.setattr(loss, "_FUSED", {"chunk_forward": fails, "chunk_grad": fails})
    base, targets, want, want_grad = _loss_case()
    with pytest.warns(UserWarning) as caught:
        losses, grad = _fused_loss(base, targets, base.numel() // 8)
    assert [str(w.message) for w in caught] == [
        f"torch.compile failed for the loss ({name}), which runs eager: Unsupported: no such op"
        for name in ("chunk_forward", "chunk_grad")]
    torch.testing.assert_close(losses, want)
    torch.testing.assert_close(grad.float(), want_grad, atol=4e-3, rtol=0)
    assert loss._FUSED == {"chunk_forward": None, "chunk_grad": None}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again, _ = _fused_loss(base, targets, base.numel() // 8)
    torch.testing.assert_close(again, want)


def test_the_loss_of_logits_with_no_data_is_one_chunk_with_the_same_flops_bytes_and_saved():
    """Fake logits (the analytic profile's, FakeTensorMode) are one chunk: one logsumexp
    forward and one exp backward, not one per chunk (~1200 at 128K tokens and a 150K
    vocabulary, a minute of the profile's time), with the FLOPs, the bytes the profile's ops
    read and write (but 8 a chunk: a 4-byte scalar written and read) and the saved tensors of
    the real logits' chunks."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    from orchestrator.models.loss import token_losses
    from orchestrator.profiling.model.analytic import ops_mode
    from orchestrator.profiling.model.memory import SavedTensorCounter

    tokens, vocab, chunk = 64, 256, 64 * 256 // 8
    base = torch.randn(tokens, vocab)
    targets = torch.randint(0, vocab, (tokens,))

    class Names(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    def count(logits, targets):
        counter = SavedTensorCounter([])
        with FlopCounterMode(display=False) as flops, ops_mode() as ops, Names() as names:
            with counter.hooks():
                losses = token_losses(logits, targets, chunk_elements=chunk)
            losses.sum().backward()
        saved = counter.total_bytes
        counter.release()
        return names.names, ops.bytes, flops.get_total_flops(), saved

    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        fake_names, fake_bytes, *fake_counts = count(
            fake.from_tensor(base).requires_grad_(), fake.from_tensor(targets))
    names, real_bytes, *real_counts = count(base.requires_grad_(), targets)
    assert names.count("logsumexp") == names.count("exp_") == 8  # real logits: chunks of 1/8
    assert fake_names.count("logsumexp") == fake_names.count("exp_") == 1, fake_names
    assert fake_counts == real_counts
    assert fake_bytes == pytest.approx(real_bytes, abs=8 * 8)
