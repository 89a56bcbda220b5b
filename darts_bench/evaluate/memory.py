"""Returning the C heap's free memory to the OS after a model call.

Evaluation runs each row of a merge in its own thread (``darts_bench/stages/evaluate.py``), and on glibc
every thread that allocates gets a malloc arena of its own (up to 8 per core). A forward of a 135M
model over ~1,000-token judge prompts frees its activations (tensors below glibc's mmap threshold, up to
32 MiB, come from the arena) back to the calling thread's arena, which keeps them: free, but resident.
So each row thread that scored could hold up to its own peak working set. On the ``smollm2-135m`` run 13
(``results/smollm2-135m-2026-12-04/TIMINGS.md`` at ff6404f) the driver climbed by 0.75-1.1 GiB per row thread over
one merge's AlpacaEval pass, 6.8 -> 13.3 GiB, and fell back when the pass's threads ended.
``benchmarks/bench_row_thread_memory.py`` (6 row threads
judging 8 AlpacaEval instructions each with SmolLM2-135M, 2026-12-04): 393 MiB kept after the pass without
a trim, 14 MiB with it, verdicts bitwise equal.

:func:`trim_heap` (glibc ``malloc_trim(0)``: every arena, free pages inside a heap too, ``madvise``
``MADV_DONTNEED``) hands those pages back; :func:`heap_trimmed` does it after each call of a method.
Values are unaffected: only free memory is released.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_MALLOC_TRIM: Any = None  # the C function once looked up; False where the C library has none


def _malloc_trim():
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        _MALLOC_TRIM = False
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            fn = getattr(libc, "malloc_trim")
        except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim with
            return False
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
        _MALLOC_TRIM = fn
    return _MALLOC_TRIM


def trim_heap() -> bool:
    """Release the free memory of every malloc arena of this process to the OS (glibc
    ``malloc_trim(0)``, malloc_trim(3)). Takes milliseconds (a walk of the arenas' free chunks).

    Returns:
        True when glibc released memory, False when there was none to release or the C library has no
        ``malloc_trim`` (then nothing is done: other allocators return memory by their own rules).
    """
    fn = _malloc_trim()
    return bool(fn(0)) if fn else False


def heap_trimmed(method: F) -> F:
    """Decorator: :func:`trim_heap` after every call of ``method`` (also when it raises)."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        finally:
            trim_heap()

    return wrapper  # type: ignore[return-value]
