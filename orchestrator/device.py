"""What a device computes, defined once: its sheet (conf/device/<name>.yaml: peak TFLOP/s per
dtype, an efficiency, HBM bandwidth), the FLOP/s it promises, the time of one op on it
(`OpTimer`), and the model FLOPs an iteration counts for MFU. Analytic model profiles, trace's
compute prices and train's MFU all read these.

A sheet's `efficiency` is one number (every FLOP at peak x efficiency, as before) or curves by
op (docs/workload.md, "Compute efficiency"):
- gemm: one matrix product of F FLOPs on one rank reaches e(F) = max x F / (F + half_GFLOP x 1e9)
  of peak (small GEMMs leave SMs idle and pay their fill; large ones approach the device's
  best), and no GEMM beats its bytes at hbm_GBps;
- attention: a flash-attention kernel over s keys with head dim d reaches
  e(s) = max_d x s / (s + half_seq_d), by head dim (linear between the listed ones, clamped);
  a sheet without it prices attention as a GEMM of its FLOPs;
- every other op (norms, rotary, SwiGLU, softmax, residual adds, casts): its bytes / hbm_GBps.
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Optional

from orchestrator.choices import Dtype
from orchestrator.conf_folders import CONF_DIR, config_dirs, group_options
from orchestrator.errors import ConfigError

DEVICE_DIR = CONF_DIR / "device"  # the package's sheets; a site's device/ folder comes first


def device_sheets() -> list:
    """Names of the device sheets in conf/device/ (the site's and the package's)."""
    return group_options("device", config_dirs())


def load_device_sheet(name: str, key: str = "profile_model.device") -> dict:
    """conf/device/<name>.yaml as a dict (a site's sheet first, as Hydra's groups); ConfigError
    naming `key` (the setting that named it) and the sheets there if it is missing."""
    import yaml

    dirs = config_dirs()
    path = next((d / "device" / f"{name}.yaml" for d in dirs
                 if (d / "device" / f"{name}.yaml").is_file()), DEVICE_DIR / f"{name}.yaml")
    if not path.exists():
        raise ConfigError(f"{key}={name!r}: no sheet {path}; "
                          f"available: {', '.join(device_sheets())}")
    with open(path) as f:
        sheet = yaml.safe_load(f) or {}
    for key in ("peak_TFLOPs", "efficiency", "type"):
        if key not in sheet:
            raise ConfigError(f"device sheet {path} lacks {key!r}")
    _check_numbers(sheet, path)
    try:
        check_efficiency(sheet)
    except ValueError as e:
        raise ConfigError(f"device sheet {path}: efficiency: {e}") from None
    sheet.setdefault("name", name)
    try:  # one dtype vocabulary: "bfloat16" and "bf16" name the same peak
        sheet["peak_TFLOPs"] = {str(Dtype.parse(k)): v for k, v in sheet["peak_TFLOPs"].items()}
    except ValueError as e:
        raise ConfigError(f"device sheet {path}: peak_TFLOPs: {e}") from None
    return sheet


def _check_numbers(sheet: dict, path) -> None:
    """ConfigError naming the sheet and the key when a memory, bandwidth or peak is not a finite
    number > 0 (a site's sheet: `hbm_GBps: fast` was a ValueError traceback, a peak of -1 priced
    every op at a few microseconds)."""
    import math

    peaks = sheet["peak_TFLOPs"]
    if not isinstance(peaks, dict):
        raise ConfigError(f"device sheet {path}: peak_TFLOPs must map dtypes to TFLOP/s "
                          f"(bf16: 989.4), not {peaks!r}")
    values = [(key, sheet[key]) for key in ("mem_GiB", "hbm_GBps") if sheet.get(key) is not None]
    values += [(f"peak_TFLOPs.{k}", v) for k, v in peaks.items()]
    for key, value in values:
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or value <= 0):
            raise ConfigError(f"device sheet {path}: {key}={value!r} must be a number > 0")


def dense_peak_flops(sheet: dict, dtype: str) -> float:
    """The sheet's peak FLOP/s for `dtype` (the datasheet's dense figure: what MFU divides by);
    ConfigError when the sheet has none for it."""
    peaks = sheet["peak_TFLOPs"]
    dtype = str(Dtype.parse(dtype))
    if dtype not in peaks:
        raise ConfigError(f"device sheet {sheet['name']!r} has no peak_TFLOPs for dtype {dtype}; "
                          f"it lists {sorted(peaks)}")
    return float(peaks[dtype]) * 1e12


def has_curves(sheet: dict) -> bool:
    """True when the sheet's efficiency is per op (curves), False for one number."""
    return isinstance(sheet["efficiency"], dict)


def check_efficiency(sheet: dict) -> None:
    """ValueError saying what is wrong with the sheet's `efficiency` (a number in (0, 1], or
    curves: gemm {max, half_GFLOP}, optional attention {head_dim: {max, half_seq}}), and that
    curves need hbm_GBps (the other ops are priced by their bytes)."""
    eff = sheet["efficiency"]
    if not isinstance(eff, dict):
        if not 0 < float(eff) <= 1:
            raise ValueError(f"{eff} is not in (0, 1]")
        return
    if "gemm" not in eff:
        raise ValueError("curves need a gemm entry {max, half_GFLOP}")
    curves = [("gemm", eff["gemm"], "half_GFLOP")]
    curves += [(f"attention.{d}", c, "half_seq") for d, c in (eff.get("attention") or {}).items()]
    for name, curve, half in curves:
        if not 0 < float(curve["max"]) <= 1 or float(curve[half]) < 0:
            raise ValueError(f"{name}: max must be in (0, 1] and {half} >= 0, got {curve}")
    if not sheet.get("hbm_GBps"):
        raise ValueError("curves need hbm_GBps (ops other than GEMMs and attention move bytes)")


def describe_efficiency(sheet: dict) -> str:
    """The sheet's efficiency in a few words: "efficiency 0.55", or its curves' limits."""
    if not has_curves(sheet):
        return f"efficiency {sheet['efficiency']}"
    eff = sheet["efficiency"]
    gemm = eff["gemm"]
    text = f"GEMMs at {gemm['max']} x F / (F + {gemm['half_GFLOP']} GFLOP) of peak"
    if eff.get("attention"):
        text += (", flash attention up to "
                 f"{max(float(c['max']) for c in eff['attention'].values())} by length and head "
                 "dim")
    return text + f", other ops at {sheet['hbm_GBps']} GB/s"


def ceiling_efficiency(sheet: dict) -> float:
    """The share of peak the sheet's largest GEMMs reach: its one efficiency, or the gemm
    curve's max."""
    eff = sheet["efficiency"]
    return float(eff["gemm"]["max"]) if isinstance(eff, dict) else float(eff)


def gemm_efficiency(sheet: dict, flops: float) -> float:
    """Share of peak one GEMM of `flops` FLOPs (on one rank) reaches: max x F / (F + half);
    the sheet's one efficiency when it has no curves."""
    if not has_curves(sheet):
        return float(sheet["efficiency"])
    curve = sheet["efficiency"]["gemm"]
    half = float(curve["half_GFLOP"]) * 1e9
    return float(curve["max"]) * flops / (flops + half) if flops > 0 else 0.0


def attention_efficiency(sheet: dict, seq_len: float, head_dim: float) -> Optional[float]:
    """Share of peak a flash-attention kernel over `seq_len` keys with `head_dim` reaches:
    max_d x s / (s + half_seq_d), interpolated linearly in the head dim between the sheet's
    (clamped at its smallest and largest); None when the sheet has no attention curves."""
    if not has_curves(sheet) or not sheet["efficiency"].get("attention"):
        return None
    table = sorted((int(d), c) for d, c in sheet["efficiency"]["attention"].items())

    def at(curve):
        return float(curve["max"]) * seq_len / (seq_len + float(curve["half_seq"]))

    if head_dim <= table[0][0]:
        return at(table[0][1])
    for (d0, c0), (d1, c1) in zip(table, table[1:]):
        if head_dim <= d1:
            w = (head_dim - d0) / (d1 - d0)
            return (1 - w) * at(c0) + w * at(c1)
    return at(table[-1][1])


# Ops that launch no kernel: views, metadata, allocation (the trace records none of them, and
# analytic profiles price none).
NO_KERNEL_OPS = {
    "aten.view", "aten._unsafe_view", "aten.t", "aten.transpose", "aten.permute", "aten.expand",
    "aten.slice", "aten.select", "aten.split", "aten.split_with_sizes", "aten.unsqueeze",
    "aten.squeeze", "aten.as_strided", "aten.alias", "aten.detach", "aten.unbind", "aten.chunk",
    "aten.reshape", "aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty",
    "aten.new_empty_strided", "aten.lift_fresh", "aten._reshape_alias", "aten.narrow",
    "aten.view_as", "aten.flatten", "aten.unflatten", "aten.movedim", "aten.diagonal",
    "aten.sym_size", "aten.sym_stride", "aten.sym_numel", "aten.is_same_size",
    "aten._to_copy_meta", "aten.set_", "aten.resize_", "aten.unsafe_split",
    "aten._local_scalar_dense",
}
# Matrix products (matmul and linear reach the dispatcher as these) and flash-attention kernels.
GEMM_OPS = ("mm", "addmm", "bmm", "baddbmm")
ATTENTION_KERNELS = ("flash_attention_for_cpu", "flash_attention", "efficient_attention",
                     "cudnn_attention")


def op_kind(name: str) -> str:
    """"gemm", "attention" or "memory" for an aten op's overload-packet name ("mm",
    "aten._scaled_dot_product_flash_attention_backward", "aten.add", ...)."""
    name = name.split(".")[-1]
    if name in GEMM_OPS:
        return "gemm"
    prefix = "_scaled_dot_product_"
    if name.startswith(prefix) and \
            name[len(prefix):].removesuffix("_backward") in ATTENTION_KERNELS:
        return "attention"
    return "memory"


class OpCost(NamedTuple):
    """What one op asks of the device: `kind` "gemm" (a matrix product), "attention" (a flash
    kernel over `seq_len` keys of `head_dim`) or "memory" (anything else), its FLOPs and the
    bytes it reads and writes."""

    kind: str
    flops: float
    bytes: float
    dtype: str = "bf16"
    seq_len: float = 0.0
    head_dim: float = 0.0


class OpTimer:
    """Times ops on one sheet's device (`us`), the sheet read once: what analytic profiles and
    trace price every op with."""

    def __init__(self, sheet: dict):
        self.sheet = sheet
        self.curves = has_curves(sheet)
        if self.curves:
            gemm = sheet["efficiency"]["gemm"]
            self.gemm_max, self.gemm_half = float(gemm["max"]), float(gemm["half_GFLOP"]) * 1e9
        self.scalar = None if self.curves else float(sheet["efficiency"])
        hbm = sheet.get("hbm_GBps")
        self.hbm_bytes_per_us = float(hbm) * 1e3 if hbm else None
        self._peaks: Dict[str, Optional[float]] = {}
        self._attention: Dict[tuple, Optional[float]] = {}

    def peak(self, dtype: str) -> Optional[float]:
        """Dense FLOP/s of an op of `dtype` (peak_or_fp32)."""
        if dtype not in self._peaks:
            self._peaks[dtype] = peak_or_fp32(self.sheet, dtype)
        return self._peaks[dtype]

    def us(self, op: OpCost) -> float:
        """Microseconds of one op: its FLOPs at its efficiency (the gemm or attention curve;
        the one efficiency on a sheet without curves), and never less than its bytes at
        hbm_GBps (where the sheet has it); an op with no FLOPs is its bytes alone."""
        t = 0.0
        if op.flops:
            peak = self.peak(op.dtype)
            if peak:
                if self.scalar is not None:
                    eff = self.scalar
                else:
                    eff = None
                    if op.kind == "attention":
                        key = (op.seq_len, op.head_dim)
                        if key not in self._attention:
                            self._attention[key] = attention_efficiency(self.sheet, *key)
                        eff = self._attention[key]
                    if eff is None:
                        eff = self.gemm_max * op.flops / (op.flops + self.gemm_half)
                t = op.flops / (peak * eff) * 1e6
        if self.hbm_bytes_per_us:
            t = max(t, op.bytes / self.hbm_bytes_per_us)
        return t


def op_us(sheet: dict, op: OpCost) -> float:
    """Microseconds of one op on the sheet's device (OpTimer.us)."""
    return OpTimer(sheet).us(op)


def peak_or_fp32(sheet: dict, dtype: str) -> Optional[float]:
    """Dense peak FLOP/s for `dtype`, else the sheet's fp32 one (integer ops, unknown names),
    else None."""
    for name in (dtype, "fp32"):
        try:
            return dense_peak_flops(sheet, name)
        except (ConfigError, ValueError):
            continue
    return None


def peak_flops(sheet: dict, dtype: str) -> float:
    """Sustained FLOP/s the sheet promises for `dtype` where an op's shape is not known:
    peak x its one efficiency, or x its gemm curve's max (the largest GEMMs' rate)."""
    return dense_peak_flops(sheet, dtype) * ceiling_efficiency(sheet)


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
