"""Exact tensor memory of a training step on any device: every byte of every live tensor storage.

On CPUs the process RSS holds the interpreter, libraries and the allocator's free lists, so it
cannot check a memory model to a few percent; on GPUs `torch.cuda.max_memory_allocated` is the
figure, and this counts the same bytes (less the allocator's rounding) on any device.

`LiveTensorBytes` is a TorchDispatchMode: when it starts it finds the storages alive on the
device (the garbage collector's tensors and those handed to it: parameters, gradients, optimizer
states), then adds every storage an op creates and takes away each one freed (a weak reference
to the storage) or resized (FSDP frees its gathered parameters by resizing their storage to 0).
A storage counts once, however many views of it exist.
"""
from __future__ import annotations

import gc
import types
import weakref
from typing import Dict, Iterable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # a torch built without distributed
    _DTensor = None


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class LiveTensorBytes(TorchDispatchMode):
    """`with LiveTensorBytes(device, roots) as live:` counts the bytes of live tensor storages
    on `device` while the block runs, starting from the tensors reachable from `roots` (e.g. the
    Engine and its inputs). `live.start_bytes` (at entry), `live.bytes`
    (now), `live.peak_bytes` (the most at any moment), `live.peak_label` (the last `mark` before
    the peak) and `live.peak_by_label` (the peak within each marked span)."""

    def __init__(self, device, roots: Iterable[object] = (), detail: bool = False):
        super().__init__()
        self.detail = detail  # keep what was alive at the peak (slow: for finding terms)
        self._what: Dict[int, str] = {}
        self.peak_detail: list = []
        self.device = torch.device(device)
        self._extra = list(roots)
        self._sizes: Dict[int, int] = {}  # storage key -> bytes counted
        self._refs: Dict[int, weakref.ref] = {}
        self.bytes = 0
        self.start_bytes = 0
        self.peak_bytes = 0
        self.label: Optional[str] = None
        self.peak_label: Optional[str] = None
        self.peak_by_label: Dict[str, int] = {}
        self._resize = None

    # ------------------------------------------------------------------ counting
    def _on_device(self, t: torch.Tensor) -> bool:
        dev = t.device
        return dev.type == self.device.type and (self.device.index is None
                                                 or dev.index == self.device.index)

    def _add(self, t, what: str = "") -> None:
        if not isinstance(t, torch.Tensor):
            return
        t = _local(t)
        if t.is_meta or not self._on_device(t) or t.layout != torch.strided:
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # wrapper subclasses without storage
            return
        key = st._cdata
        if key in self._sizes:
            return
        size = st.nbytes()
        self._sizes[key] = size
        self._refs[key] = weakref.ref(st, lambda _, key=key: self._free(key))
        if self.detail:
            self._what[key] = f"{what} {tuple(t.shape)} {str(t.dtype)[6:]}"
        self._grow(size)

    def _free(self, key: int) -> None:
        size = self._sizes.pop(key, None)
        self._refs.pop(key, None)
        if size is not None:
            self.bytes -= size

    def _grow(self, size: int) -> None:
        self.bytes += size
        if self.bytes > self.peak_bytes:
            self.peak_bytes = self.bytes
            self.peak_label = self.label
            if self.detail:
                self.peak_detail = [(self._what.get(k, "?"), n) for k, n in self._sizes.items()]
        if self.label is not None and self.bytes > self.peak_by_label.get(self.label, 0):
            self.peak_by_label[self.label] = self.bytes

    def _resized(self, st: torch.UntypedStorage, size: int) -> None:
        key = st._cdata
        old = self._sizes.get(key)
        if old is None:
            return
        self._sizes[key] = size
        self.bytes -= old
        self._grow(size)

    def mark(self, label: str) -> None:
        """Name what runs from now on (the peak is attributed to the last label before it)."""
        self.label = label
        self.peak_by_label.setdefault(label, self.bytes)

    # ------------------------------------------------------------------ mode
    def __enter__(self):
        gc.collect()
        for t in reachable_tensors(self._extra):
            self._add(t, "held")
        self._extra = []
        self.start_bytes = self.peak_bytes = self.bytes
        original = torch.UntypedStorage.resize_
        mode = self

        def resize_(st, size):
            out = original(st, size)
            mode._resized(st, st.nbytes())
            return out

        self._resize = original
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _DTensor is not None and any(issubclass(t, _DTensor) for t in types):
            # Let DTensor run the op: the ops on local tensors it issues (some of them several
            # with temporaries, e.g. loss_parallel's log-softmax) come back here and count.
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._add(t, f"{self.label}:{func.__name__}" if self.detail else "")
        # In-place ops that allocate (resize of an output argument) change no key: the
        # storage was counted when it was created.
        return out


_OPAQUE = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.CodeType, type,
           types.FrameType, weakref.ReferenceType)


def reachable_tensors(roots: Iterable[object]) -> list:
    """Every tensor reachable from `roots` through Python references (attributes, containers,
    bound methods' objects), parameters' gradients too; functions, modules and classes are not
    followed (their globals reach the whole process)."""
    seen, out, stack = set(), [], list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            out.append(obj)
            if obj.is_leaf and obj.grad is not None:
                stack.append(obj.grad)
            stack.extend(vars(obj).values() if hasattr(obj, "__dict__") else ())
            continue
        stack.extend(gc.get_referents(obj))
    return out
