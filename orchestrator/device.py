"""What a device computes, defined once: its sheet (conf/device/<name>.yaml: peak TFLOP/s per
dtype, an efficiency, HBM bandwidth), the FLOP/s it promises, and the model FLOPs an iteration
counts for MFU. Analytic model profiles, trace's compute prices and train's MFU all read these.
"""
from __future__ import annotations

from typing import Optional

from orchestrator.choices import Dtype
from orchestrator.conf_folders import CONF_DIR, config_dirs, group_options
from orchestrator.errors import ConfigError

DEVICE_DIR = CONF_DIR / "device"  # the package's sheets; a site's device/ folder comes first


def device_sheets() -> list:
    """Names of the device sheets in conf/device/ (the site's and the package's)."""
    return group_options("device", config_dirs())


def load_device_sheet(name: str) -> dict:
    """conf/device/<name>.yaml as a dict (a site's sheet first, as Hydra's groups); ConfigError
    naming the sheets there if it is missing."""
    import yaml

    dirs = config_dirs()
    path = next((d / "device" / f"{name}.yaml" for d in dirs
                 if (d / "device" / f"{name}.yaml").is_file()), DEVICE_DIR / f"{name}.yaml")
    if not path.exists():
        raise ConfigError(f"profile_model.device={name!r}: no sheet {path}; "
                          f"available: {', '.join(device_sheets())}")
    with open(path) as f:
        sheet = yaml.safe_load(f) or {}
    for key in ("peak_TFLOPs", "efficiency", "type"):
        if key not in sheet:
            raise ConfigError(f"device sheet {path} lacks {key!r}")
    sheet.setdefault("name", name)
    try:  # one dtype vocabulary: "bfloat16" and "bf16" name the same peak
        sheet["peak_TFLOPs"] = {str(Dtype.parse(k)): v for k, v in sheet["peak_TFLOPs"].items()}
    except ValueError as e:
        raise ConfigError(f"device sheet {path}: peak_TFLOPs: {e}") from None
    return sheet


def dense_peak_flops(sheet: dict, dtype: str) -> float:
    """The sheet's peak FLOP/s for `dtype` (the datasheet's dense figure: what MFU divides by);
    ConfigError when the sheet has none for it."""
    peaks = sheet["peak_TFLOPs"]
    dtype = str(Dtype.parse(dtype))
    if dtype not in peaks:
        raise ConfigError(f"device sheet {sheet['name']!r} has no peak_TFLOPs for dtype {dtype}; "
                          f"it lists {sorted(peaks)}")
    return float(peaks[dtype]) * 1e12


def peak_flops(sheet: dict, dtype: str) -> float:
    """Sustained FLOP/s the sheet promises for `dtype`: peak x efficiency."""
    return dense_peak_flops(sheet, dtype) * float(sheet["efficiency"])


def op_flops_per_us(sheet: dict, dtype: str) -> Optional[float]:
    """Sustained FLOPs per microsecond for one op of `dtype`; a dtype the sheet does not list
    (integer ops, an unknown name) gets its fp32 figure; None when it has neither."""
    try:
        return peak_flops(sheet, dtype) / 1e6
    except (ConfigError, ValueError):
        return peak_flops(sheet, "fp32") / 1e6 if "fp32" in sheet["peak_TFLOPs"] else None


def flops_to_us(flops: float, sheet: dict, dtype: str) -> float:
    """Microseconds to execute `flops` on the sheet's device at its efficiency."""
    return flops / peak_flops(sheet, dtype) * 1e6


def model_flops(params: int, layers: int, hidden: int, seq_len: int, tokens: int) -> float:
    """The model FLOPs of a training iteration over `tokens` tokens of `seq_len`-token
    sequences, as MFU counts them: 6 per parameter per token (forward 2, backward 4), plus the
    attention scores and their weighting (12 x layers x hidden x seq per token), halved for
    causal attention. Recompute is not counted (MFU, not HFU)."""
    attention = 12 * layers * hidden * seq_len * tokens / 2
    return 6 * params * tokens + attention
