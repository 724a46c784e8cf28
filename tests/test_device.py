"""Device sheets and FLOP/s, defined once (orchestrator/device.py): analytic model profiles,
trace's compute prices and train's MFU read the same figures."""
import numpy as np
import pytest
from scipy.optimize import curve_fit

from orchestrator.device import (OpCost, attention_efficiency, ceiling_efficiency,
                                 dense_peak_flops, gemm_efficiency, load_device_sheet, model_flops,
                                 op_flops_per_us, op_us, peak_flops)
from orchestrator.errors import ConfigError
from orchestrator.trace.timing import ComputePricer


@pytest.fixture(scope="module")
def h100():
    return load_device_sheet("h100")


def test_sustained_is_the_dense_peak_times_the_sheets_largest_gemm_efficiency(h100):
    assert dense_peak_flops(h100, "bf16") == h100["peak_TFLOPs"]["bf16"] * 1e12
    assert peak_flops(h100, "bfloat16") == \
        dense_peak_flops(h100, "bf16") * h100["efficiency"]["gemm"]["max"]
    cpu = load_device_sheet("cpu")  # a sheet with one efficiency: that one
    assert peak_flops(cpu, "fp32") == dense_peak_flops(cpu, "fp32") * cpu["efficiency"]


def test_an_op_of_a_dtype_the_sheet_lacks_is_priced_at_its_fp32_rate(h100):
    assert op_flops_per_us(h100, "int64") == op_flops_per_us(h100, "fp32") == \
        peak_flops(h100, "fp32") / 1e6


def test_trace_and_analytic_profiles_price_an_op_alike(h100):
    """trace's roofline of a recorded op is device.op_us, the function analytic profiles price
    their ops with: a GEMM by its FLOPs, flash attention by its keys and head dim."""
    pricer = ComputePricer(h100)
    mm = {"op": "aten.mm", "flops": 4e12, "bytes": 3e8, "dtype": "bf16",
          "shapes": [[8192, 16384], [16384, 15000]]}
    assert pricer.roofline_us(mm) == op_us(h100, OpCost("gemm", 4e12, 3e8, "bf16"))
    flash = {"op": "aten._scaled_dot_product_flash_attention", "flops": 2e12, "bytes": 1e8,
             "dtype": "bf16", "shapes": [[1, 16, 4096, 128], [1, 2, 8192, 128]]}
    assert pricer.roofline_us(flash) == op_us(h100, OpCost("attention", 2e12, 1e8, "bf16",
                                                           8192, 128))
    backward = {**flash, "op": "aten._scaled_dot_product_flash_attention_backward",
                "shapes": [[1, 16, 4096, 128], *flash["shapes"]]}
    assert pricer.roofline_us(backward) == pricer.roofline_us(flash)


# ---------------------------------------------------------------- efficiency curves
def test_a_small_gemm_runs_below_a_large_ones_efficiency_on_the_h100_sheet(h100):
    """Issue 41: one constant priced every GEMM alike; the sheet's curve slows small ones."""
    pricer = ComputePricer(h100)

    def tflops(n):  # an n^3 bf16 GEMM as the trace records it
        flops = 2.0 * n ** 3
        us = pricer.roofline_us({"op": "aten.mm", "flops": flops, "bytes": 6.0 * n * n,
                                 "dtype": "bf16", "shapes": [[n, n], [n, n]]})
        return flops / us / 1e6

    small, large = tflops(2048), tflops(8192)
    assert small < 0.9 * large
    assert large < dense_peak_flops(h100, "bf16") / 1e12


@pytest.mark.parametrize("sheet", ["h100", "h200", "a100"])
def test_gemm_curve_rises_monotonically_from_zero_to_its_max(sheet):
    sheet = load_device_sheet(sheet)
    flops = np.logspace(6, 15, 50)
    eff = [gemm_efficiency(sheet, f) for f in flops]
    assert all(b > a for a, b in zip(eff, eff[1:]))
    assert eff[0] < 0.01 and gemm_efficiency(sheet, 0.0) == 0.0
    top = ceiling_efficiency(sheet)
    assert 0 < top <= 1 and eff[-1] == pytest.approx(top, rel=1e-5) and max(eff) < top


def test_attention_curve_rises_with_length_and_interpolates_between_head_dims(h100):
    seqs = [256, 1024, 4096, 16384, 131072]
    for head_dim in (64, 96, 128, 256, 512):
        eff = [attention_efficiency(h100, s, head_dim) for s in seqs]
        assert all(b > a for a, b in zip(eff, eff[1:])) and eff[-1] < 1
    at = {d: attention_efficiency(h100, 4096, d) for d in (32, 64, 96, 128, 512, 256)}
    assert at[96] == pytest.approx((at[64] + at[128]) / 2)
    assert at[32] == at[64] and at[512] == at[256]  # clamped outside the listed head dims
    assert attention_efficiency(load_device_sheet("a100"), 4096, 128) is None  # none listed


def _fit_saturating(x, eff):
    """(max, half) of eff = max x / (x + half), least squares on log efficiency."""
    x, eff = np.asarray(x, float), np.asarray(eff, float)

    def log_curve(x, top, half):
        return np.log(top) + np.log(x) - np.log(x + half)

    (top, half), _ = curve_fit(log_curve, x, np.log(eff), p0=(eff.max(), np.median(x)),
                               bounds=([1e-3, 0.0], [1.0, np.inf]))
    return top, half


def test_the_h100_curves_are_the_fits_of_the_points_the_sheet_lists(h100):
    """Each curve's two numbers are refitted from its public points (the sheet's sources)."""
    peak = h100["peak_TFLOPs"]["bf16"]
    gemm = h100["efficiency"]["gemm"]
    flops = [2.0 * m * n * k for m, n, k, _ in gemm["points"]]
    top, half = _fit_saturating(flops, [t / peak for *_, t in gemm["points"]])
    assert (top, half / 1e9) == pytest.approx((gemm["max"], gemm["half_GFLOP"]), rel=0.01)
    for head_dim, curve in h100["efficiency"]["attention"].items():
        seqs, tflops = zip(*curve["points"])
        top, half = _fit_saturating(seqs, [t / peak for t in tflops])
        assert (top, half) == pytest.approx((curve["max"], curve["half_seq"]), rel=0.01), \
            head_dim


def test_an_op_is_never_faster_than_its_bytes_and_other_ops_are_their_bytes(h100):
    hbm_bytes_per_us = h100["hbm_GBps"] * 1e3
    skinny = OpCost("gemm", 2.0 * 128 * 16384 * 16384, 2.0 * 16384 * 16384, "bf16")
    assert op_us(h100, skinny) == skinny.bytes / hbm_bytes_per_us  # weight-bound
    assert op_us(h100, OpCost("memory", 0.0, 3e9, "bf16")) == 3e9 / hbm_bytes_per_us


def test_a_sheet_with_bad_curves_is_refused(tmp_path, monkeypatch):
    import yaml

    from orchestrator.device import check_efficiency

    sheet = {"peak_TFLOPs": {"bf16": 1.0}, "type": "gpu", "hbm_GBps": 1000}
    for eff, why in (({"gemm": {"max": 1.2, "half_GFLOP": 1}}, r"max must be in \(0, 1\]"),
                     ({"attention": {}}, "need a gemm entry"), (0.0, r"not in \(0, 1\]")):
        with pytest.raises(ValueError, match=why):
            check_efficiency({**sheet, "efficiency": eff})
    with pytest.raises(ValueError, match="need hbm_GBps"):
        check_efficiency({"efficiency": {"gemm": {"max": 0.8, "half_GFLOP": 1}}})
    (tmp_path / "device").mkdir()
    (tmp_path / "device" / "bad.yaml").write_text(yaml.safe_dump(
        {**sheet, "efficiency": {"gemm": {"max": 0.8, "half_GFLOP": -1}}}))
    monkeypatch.setattr("orchestrator.device.config_dirs", lambda: [tmp_path])
    with pytest.raises(ConfigError, match="bad.yaml: efficiency: gemm"):
        load_device_sheet("bad")


def test_model_flops_are_six_per_parameter_and_token_plus_causal_attention():
    # 1e9 parameters, 2 layers of hidden 1024, 2 sequences of 512 tokens
    tokens = 1024
    attention = 12 * 2 * 1024 * 512 * tokens / 2
    assert model_flops(10**9, 2, 1024, 512, tokens) == 6 * 10**9 * tokens + attention


@pytest.mark.parametrize("line, old, says", [
    ("hbm_GBps: fast", "hbm_GBps: 3350", "hbm_GBps='fast' must be a number > 0"),
    ("  fp32: -1", "  fp32: 66.9", "peak_TFLOPs.fp32=-1 must be a number > 0"),
    ("mem_GiB: .nan", "mem_GiB: 80", "mem_GiB=nan must be a number > 0"),
])
def test_a_site_device_sheet_with_a_bad_number_is_refused_naming_it(tmp_path, monkeypatch, line,
                                                                   old, says):
    """Before: `hbm_GBps: fast` in a site's sheet was a ValueError traceback (exit 1); a peak of
    -1 priced tiny's block at 2 us and wrote the profile."""
    from orchestrator.conf_folders import CONF_DIR

    text = (CONF_DIR / "device" / "h100.yaml").read_text().replace("name: h100", "name: mine")
    lines = [line if (l.startswith(old) and (old.startswith(" ") or not l.startswith(" ")))
             else l for l in text.splitlines()]
    assert line in lines
    (tmp_path / "device").mkdir()
    (tmp_path / "device" / "mine.yaml").write_text("\n".join(lines) + "\n")
    monkeypatch.setenv("ORCHESTRATOR_CONF", str(tmp_path))
    with pytest.raises(ConfigError) as error:
        load_device_sheet("mine")
    assert str(error.value) == f"device sheet {tmp_path / 'device' / 'mine.yaml'}: {says}"
