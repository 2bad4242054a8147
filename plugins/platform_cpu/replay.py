"""CPU graphs: a decode step's work recorded once, as the calls it made, and replayed.

On the CPU every kernel of a decode step is a C call and what runs around it is Python: the
model's modules, the platform's checks, the tensors allocated for each output. For a small
model that Python is as long as the kernels themselves. A CUDA graph removes the same cost on a
GPU by recording the kernels a step launched and launching them again; this is its CPU analogue.
A decode-only step of ``n`` rows runs eagerly once while a ``StepRecorder`` records, in order:

* every call into a library the platform built (``native.load_library``: corellm's GEMMs and
  quantized kernels, the element-wise kernels, an attention backend's kernels built through
  ``Platform.native_library``), with its arguments (the addresses of its tensors) and what it
  returned;
* every torch operation (a ``TorchDispatchMode``): its inputs and outputs are kept alive, so
  every address a recorded call read or wrote stays valid; views and allocations need nothing
  on replay, in-place operations run again as they were called, and functional ones run again
  into the tensor they first returned (their ``out=`` form where aten has one).

``StepProgram.replay`` then makes the same calls with the same arguments, none of the Python
around them: the step's inputs (token ids, positions, the attention metadata) are written to the
addresses the recording read, which is why only a metadata builder that declares
``replayable`` (fixed addresses for decode-only steps) gets programs. What cannot be replayed is
refused while recording (``NotReplayable``: an operation whose result Python read, such as
``.item()`` or a tensor's truth value), and what the recorder cannot see (a C call outside the
platform's libraries, a write through numpy) is caught before a program is trusted: its first
replay runs beside the eager step on the same inputs and must give the same logits, bit for bit.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from corellm.platforms import ModelStepper, StepInputs, steps_refused

logger = logging.getLogger(__name__)

# The recorder a step is being recorded into (None: calls just run).
_active: StepRecorder | None = None
_raw_call = ctypes._CFuncPtr.__call__

_NATIVE, _INPLACE, _OUT, _COPY = range(4)
_ALLOCATIONS = frozenset(f"aten::{n}" for n in (
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"))


class NotReplayable(RuntimeError):
    """A step that a program cannot reproduce (the message says which operation and why)."""


class RecordingFunction(ctypes._CFuncPtr):
    """A C function of a platform-built library: called as ctypes calls it, and recorded while
    a step is recorded (``RecordingLibrary``)."""

    _flags_ = ctypes._FUNCFLAG_CDECL
    _restype_ = ctypes.c_int

    def __call__(self, *args: Any) -> Any:
        result = _raw_call(self, *args)
        if _active is not None and _active.thread == threading.get_ident():
            _active.native(self, args, result)
        return result


class RecordingLibrary(ctypes.CDLL):
    """``ctypes.CDLL`` whose functions are ``RecordingFunction``s."""

    def __init__(self, name: str, mode: int = ctypes.DEFAULT_MODE) -> None:
        super().__init__(name, mode=mode)
        self._FuncPtr = RecordingFunction      # CDLL.__init__ sets its own class per instance


def _storage(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage; None for a tensor without one (an MKL-packed weight)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _is_view(out: torch.Tensor, tensors: list[torch.Tensor]) -> bool:
    """Whether ``out`` shares memory with one of ``tensors`` (a view, or an input returned
    as is): nothing to recompute on replay."""
    ptr = _storage(out)
    return ptr is not None and any(_storage(t) == ptr for t in tensors)


def _tensors(values: Any) -> list[torch.Tensor]:
    found = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found.extend(_tensors(v))
    return found


def _out_overload(func: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """aten's ``out=`` form of a functional overload (``add.Tensor`` -> ``add.out``), if any."""
    packet, name = func._overloadpacket, func._overloadname
    for candidate in ("out",) if name == "default" else (f"{name}_out", "out"):
        overload = getattr(packet, candidate, None) if candidate in packet.overloads() else None
        if overload is not None:
            args = [a.name for a in overload._schema.arguments if not a.is_out]
            if args == [a.name for a in func._schema.arguments]:
                return overload
    return None


class StepRecorder(TorchDispatchMode):
    """Records one eager step (``with StepRecorder() as rec: ...``) as a list of calls."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ to keep torch.compile out of it, importing
        # torch._dynamo on the first call (a second of the first decode step); nothing is
        # compiled under this mode.
        return False

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple] = []
        self.keep: list[Any] = []          # every tensor a recorded call may read or write
        self.thread = threading.get_ident()  # calls of other threads are not this step's

    def __enter__(self) -> StepRecorder:
        global _active
        if _active is not None:
            raise RuntimeError("a step is already being recorded")
        _active = self
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        global _active
        _active = None
        return super().__exit__(*exc)

    def native(self, fn: RecordingFunction, args: tuple, result: Any) -> None:
        self.steps.append((_NATIVE, fn, args, None, result))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = _tensors(args) + _tensors(kwargs.values())
        self.keep.append((args, kwargs, out))
        outs = out if isinstance(out, (list, tuple)) else (out,)
        if not all(isinstance(o, torch.Tensor) for o in outs):
            raise NotReplayable(f"{func}: its result was read back to Python ({out!r}), so the "
                                "step's path depends on its values")
        schema = func._schema
        if schema.name in _ALLOCATIONS:
            return out                                # the tensor stays where it is
        if any(r.alias_info is not None and r.alias_info.is_write for r in schema.returns):
            self.steps.append((_INPLACE, func, args, kwargs, None))   # x.add_(), out=...
            return out
        if all(_is_view(o, inputs) for o in outs):
            return out                                # a view of memory already recorded
        if len(outs) == 1 and not isinstance(out, (list, tuple)):
            overload = _out_overload(func)
            if overload is not None:
                try:
                    overload(*args, **kwargs, out=out)   # the same values, once, to check
                except (RuntimeError, TypeError):
                    overload = None
            if overload is not None:
                self.steps.append((_OUT, overload, args, dict(kwargs, out=out), None))
                return out
        self.steps.append((_COPY, func, args, kwargs, outs))
        return out


class StepProgram:
    """A recorded step: ``replay()`` makes its calls again and leaves the step's logits in
    ``output``."""

    def __init__(self, recorder: StepRecorder, output: torch.Tensor) -> None:
        self.steps = recorder.steps
        self.keep = recorder.keep
        self.output = output
        self.verified = False
        self.calls = sum(1 for s in self.steps if s[0] == _NATIVE)

    def replay(self) -> torch.Tensor:
        for kind, fn, args, kwargs, extra in self.steps:
            if kind == _NATIVE:
                result = _raw_call(fn, *args)
                if result != extra:
                    raise RuntimeError(f"replayed step: {fn.__name__} returned {result!r}, "
                                       f"{extra!r} when recorded")
            elif kind == _COPY:
                result = fn(*args, **kwargs)
                for o, r in zip(extra, result if isinstance(result, (list, tuple))
                                else (result,)):
                    o.copy_(r)
            else:
                fn(*args, **kwargs)
        return self.output


class CpuStepper(ModelStepper):
    """The step on the CPU: eager as the reference runs it, except decode-only steps of up to
    ``max_rows`` rows (``platform.cpu_graphs``), which replay a ``StepProgram`` recorded for
    their row count: recorded at its first step, trusted once its first replay matched the eager
    step bit for bit, replayed from then on. The token ids and positions go through persistent
    buffers (the addresses the programs read)."""

    def __init__(self, model: Any, device: torch.device, limits: Any, max_rows: int) -> None:
        super().__init__(model, device)
        self.limits = limits
        self.programs: dict[int, StepProgram] = {}
        self.refused: dict[int, str] = {}
        self.off: str | None = "the platform has not warmed the stepper up"
        self.replays = 0
        n = max(1, min(max_rows, limits.max_num_seqs))
        self._ids = torch.zeros(n, dtype=torch.int64)
        self._positions = torch.zeros(n, dtype=torch.int64)

    def _rows(self, inputs: StepInputs) -> int | None:
        """The row count whose program this step runs, or None (eager)."""
        if self.off is not None:
            return None
        lim = self.limits
        if inputs.num_tokens > lim.max_num_batched_tokens or inputs.num_reqs > lim.max_num_seqs:
            self._turn_off(f"a step of {inputs.num_reqs} requests and {inputs.num_tokens} "
                           "tokens exceeded the scheduler's limits, which moves the buffers "
                           "the programs read")
            return None
        n = inputs.num_tokens
        if not inputs.decode_only or n > self._ids.shape[0] or n in self.refused:
            return None
        rows = inputs.logits_indices          # a program computes the logits of every row
        if rows.shape[0] != n or (n > 1 and not (np.diff(rows) == 1).all()) or rows[0] != 0:
            return None
        return n

    def _turn_off(self, reason: str) -> None:
        self.off = reason
        self.programs.clear()
        logger.warning("CPU graphs: no longer replayed: %s", reason)

    def enable(self, refused: str | None) -> None:
        """Record decode steps from now on, or (``refused``: why not) never (logged)."""
        self.off = refused
        if refused:
            logger.info("CPU graphs: none recorded (%s)", refused)

    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        n = self._rows(inputs)
        if n is None:
            return super().forward(inputs)
        ids, positions = self._ids[:n], self._positions[:n]
        ids.numpy()[:] = inputs.input_ids
        positions.numpy()[:] = inputs.positions
        md = inputs.attn_metadata
        program = self.programs.get(n)
        if program is None:
            return self._record(n, ids, positions, md)
        if program.verified:
            self.replays += 1
            return program.replay()
        replayed = program.replay().clone()
        logits = self._eager(ids, positions, md)
        if torch.equal(replayed, logits):
            program.verified = True
            logger.info("CPU graphs: decode steps of %d row(s) replay %d native calls and %d "
                        "torch operations", n, program.calls, len(program.steps) - program.calls)
        else:
            del self.programs[n]
            self._refuse_rows(n, "its replay differed from the eager step (a kernel call the "
                                 "recorder did not see: a C library not built by the platform, "
                                 "or memory written outside torch)")
        return logits

    def _eager(self, ids: torch.Tensor, positions: torch.Tensor, md: Any) -> torch.Tensor:
        return self.model.compute_logits(self.model(ids, positions, md))

    def _record(self, n: int, ids: torch.Tensor, positions: torch.Tensor,
                md: Any) -> torch.Tensor:
        try:
            with StepRecorder() as recorder:
                logits = self._eager(ids, positions, md)
        except NotReplayable as exc:
            self._refuse_rows(n, str(exc))
            return self._eager(ids, positions, md)
        self.programs[n] = StepProgram(recorder, logits)
        return logits

    def _refuse_rows(self, n: int, reason: str) -> None:
        self.refused[n] = reason
        logger.warning("CPU graphs: decode steps of %d row(s) run eagerly: %s", n, reason)


def replay_refused(enabled: bool, builder: Any, tp_size: int) -> str | None:
    """Why no CPU graph is recorded (None: they are)."""
    return steps_refused("platform.cpu_graphs", enabled, builder, "replayable", tp_size)
