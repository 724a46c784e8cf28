"""Device sheets and FLOP/s, defined once (orchestrator/device.py): analytic model profiles,
trace's compute prices and train's MFU read the same figures."""
import pytest

from orchestrator.device import (dense_peak_flops, flops_to_us, load_device_sheet, model_flops,
                                 op_flops_per_us, peak_flops)
from orchestrator.trace.timing import ComputePricer


@pytest.fixture(scope="module")
def h100():
    return load_device_sheet("h100")


def test_sustained_is_the_dense_peak_times_the_sheets_efficiency(h100):
    assert dense_peak_flops(h100, "bf16") == h100["peak_TFLOPs"]["bf16"] * 1e12
    assert peak_flops(h100, "bfloat16") == dense_peak_flops(h100, "bf16") * h100["efficiency"]


def test_an_op_of_a_dtype_the_sheet_lacks_is_priced_at_its_fp32_rate(h100):
    assert op_flops_per_us(h100, "int64") == op_flops_per_us(h100, "fp32") == \
        peak_flops(h100, "fp32") / 1e6


def test_trace_and_analytic_profiles_time_the_same_flops_alike(h100):
    record = {"flops": 4e12, "bytes": 0, "dtype": "bf16"}
    assert ComputePricer(h100).roofline_us(record) == pytest.approx(
        flops_to_us(4e12, h100, "bf16"), rel=1e-12)


def test_model_flops_are_six_per_parameter_and_token_plus_causal_attention():
    # 1e9 parameters, 2 layers of hidden 1024, 2 sequences of 512 tokens
    tokens = 1024
    attention = 12 * 2 * 1024 * 512 * tokens / 2
    assert model_flops(10**9, 2, 1024, 512, tokens) == 6 * 10**9 * tokens + attention
