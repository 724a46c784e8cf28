"""A process's start without garbage collections (a rank's, the CLI's)."""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def collector_paused():
    """The block (a process's imports) without garbage collections, then everything made so
    far kept out of later ones. Importing torch makes ~300k objects that live as long as the
    process and almost no garbage, yet the collections it triggers cost a fifth of the import
    (0.4-0.5 CPU-s of the ~2.3 that torch, DTensor and dynamo take); frozen, they are never
    scanned again, at exit neither (~0.9 s). Only for a process of its own (a rank, the CLI):
    a caller's objects, frozen, would never be collected."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()
