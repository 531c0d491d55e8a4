"""The GPU backend of ``copy_engine``: peer-mapped regions, one stream per peer, device-side flags.

Mapping (once per group, in ``prepare``): where every peer is on this node and PyTorch's
``torch.distributed._symmetric_memory`` works (CUDA), the region is a symmetric-memory buffer
(``empty`` + ``rendezvous`` + ``get_buffer``: no hand-written IPC). Otherwise (ROCm builds
without it, or a group with peers on other nodes) each rank shares its buffer through
PyTorch's CUDA/HIP IPC handles, swapped over the process group, and maps its node's peers.
Multicast is never used (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NCCL_NVLS_ENABLE=0``).

Copies: a plain contiguous same-dtype device-to-device copy into peer memory is a memcpy that
the copy engines run (CUDA); anything strided or converting would silently become an SM kernel,
so ``dma_copy`` refuses it. On ROCm the copy is issued as ``hipMemcpyDeviceToDeviceNoCU`` (the
SDMA engines) where the runtime has it; set ``HSA_ENABLE_SDMA=1`` and ``ROC_P2P_SDMA_SIZE=0``,
without which small peer copies run as blit kernels on the compute units.

Host cost: the GPU runs an exchange in ~0.1 ms, so what the host spends issuing one is on the
critical path as soon as it exceeds the compute it overlaps. Copies are therefore issued as one
driver call each (``cuMemcpyDtoDAsync``; HIP: ``hipMemcpyAsync``) on views made once per shape
(``copy_engine.Route``), with no ``record_stream`` for the transport's own send slots and no
stream context switch; flags are addressed by pointer arithmetic, not by slicing a tensor.

Flags: ``cuStreamWriteValue32`` / ``cuStreamWaitValue32`` (HIP: ``hipStreamWriteValue32`` /
``hipStreamWaitValue32``) queue the epoch and credit writes and waits on the streams themselves,
so no exchange needs the host. A stream wait has no timeout of its own: a watchdog thread reads
this rank's flags a few times a second (``WaitLog``: a read per wake, not per wait, and a few
microseconds of the interpreter lock, so it does not slow the thread that issues the work), and
past the deadline records ``PeerLost`` naming the peer and writes the awaited value itself, so
the stream moves on and the next transport call raises. Where the stream operations are missing,
waits fall back to the host polling the flag (a round trip per wait: correct, slower).

None of this has run on AMD hardware yet; the CUDA path is exercised by ``benchmarks/``.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import os
import threading
import time
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from ditrun.transport.base import PeerLost
from ditrun.transport.lanes import raise_lane_error

HIP = torch.version.hip is not None
HIP_MEMCPY_DEVICE_TO_DEVICE_NO_CU = 1024
"""``hipMemcpyDeviceToDeviceNoCU`` (hip_runtime_api.h, ROCm 6.2+): a device copy on the SDMA engines."""
HIP_MEMCPY_DEVICE_TO_DEVICE = 3
WAIT_GEQ = 0
"""``CU_STREAM_WAIT_VALUE_GEQ`` / ``hipStreamWaitValueGte``: wait until ``*addr >= value``."""


class StreamOps:
    """Stream write-value / wait-value and raw async copies from the driver (CUDA) or runtime (HIP)."""

    def __init__(self):
        self.available = False
        self.memcpy = None
        """The raw async copy (dst, src, bytes, stream), or None: ``torch`` copies then."""
        self.memcpy_kind = HIP_MEMCPY_DEVICE_TO_DEVICE_NO_CU
        try:
            self._bind()
            self.available = True
        except (OSError, AttributeError) as err:
            warnings.warn(f"copy_engine: stream wait/write-value unavailable ({err}); flags are polled by the host.")

    def _bind(self) -> None:
        if HIP:
            lib = ctypes.CDLL("libamdhip64.so")
            self._wait, self._write = lib.hipStreamWaitValue32, lib.hipStreamWriteValue32
            self._wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint, ctypes.c_uint32]
            self._write.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint]
            self.memcpy = lib.hipMemcpyAsync
            self.memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            # A refused runtime call leaves a sticky last error that PyTorch's next launch check would raise.
            self._clear_error = lib.hipGetLastError
            return
        lib = ctypes.CDLL("libcuda.so.1")
        self._wait = getattr(lib, "cuStreamWaitValue32_v2", None) or lib.cuStreamWaitValue32
        self._write = getattr(lib, "cuStreamWriteValue32_v2", None) or lib.cuStreamWriteValue32
        for fn in (self._wait, self._write):
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self.memcpy = getattr(lib, "cuMemcpyDtoDAsync_v2", None)  # without it: torch copies, stream ops kept
        if self.memcpy is not None:
            self.memcpy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]

    def wait(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        args = (stream.cuda_stream, address, value, WAIT_GEQ) + ((0xFFFFFFFF,) if HIP else ())
        _check(self._wait(*args), "stream wait-value")

    def write(self, stream: torch.cuda.Stream, flags: torch.Tensor, index: int, value: int) -> None:
        """``flags[index] = value`` in stream order (a one-element fill kernel without stream operations)."""
        if not self.available:
            with torch.cuda.stream(stream):
                flags[index].fill_(value)
            return
        # Flags 0: the write is ordered after every memory operation before it on the stream.
        _check(self._write(stream.cuda_stream, flag_address(flags, index), value, 0), "stream write-value")

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> bool:
        """One raw async memcpy; False where the runtime has none (or refused it): copy with ``torch`` then."""
        if self.memcpy is None:
            return False
        nbytes = src.numel() * src.element_size()
        if HIP:
            code = self.memcpy(dst.data_ptr(), src.data_ptr(), nbytes, self.memcpy_kind, stream.cuda_stream)
            if code != 0:
                self._clear_error()
            if code != 0 and self.memcpy_kind == HIP_MEMCPY_DEVICE_TO_DEVICE_NO_CU:
                warnings.warn(
                    "copy_engine: hipMemcpyDeviceToDeviceNoCU unavailable; peer copies may use compute "
                    "units (set HSA_ENABLE_SDMA=1, ROC_P2P_SDMA_SIZE=0)."
                )
                self.memcpy_kind = HIP_MEMCPY_DEVICE_TO_DEVICE  # an older runtime: its plain device copy
                return self.copy(dst, src, stream)
        else:
            code = self.memcpy(dst.data_ptr(), src.data_ptr(), nbytes, stream.cuda_stream)
        if code != 0:
            warnings.warn(f"copy_engine: the raw async copy failed (error {code}); torch copies from now on.")
            self.memcpy = None
        return code == 0


def flag_address(flags: torch.Tensor, index: int) -> int:
    """The address of ``flags[index]`` (int32), without making a tensor view per exchange."""
    return flags.data_ptr() + 4 * index


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"copy_engine: {what} failed with driver error {code}.")


def dma_copy(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream, ops: StreamOps) -> None:
    """One memcpy from ``src`` into (peer-mapped) ``dst`` on ``stream``."""
    # A strided or converting copy_ would run as an SM kernel, which is what this transport avoids.
    if src.dtype != dst.dtype or not src.is_contiguous() or not dst.is_contiguous() or src.shape != dst.shape:
        raise RuntimeError(
            "copy_engine: a peer copy must be contiguous and of one dtype (one memcpy); got "
            f"{tuple(src.shape)} {src.dtype} -> {tuple(dst.shape)} {dst.dtype}."
        )
    if not ops.copy(dst, src, stream):
        with torch.cuda.stream(stream):
            dst.copy_(src)


class WaitLog:
    """The stream waits still pending on this rank's flags, oldest first, and which one ran past its deadline.

    ``watch`` is one append (the issuing thread pays nothing more); ``check`` is given the flags as
    read once and drops every satisfied wait from the front. Waits are queued in time order with
    one timeout, so deadlines only grow along the log: when the oldest pending wait is not late,
    none is, and a check costs the satisfied waits plus one.
    """

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.pending: collections.deque = collections.deque()

    def watch(self, index: int, value: int, describe, now: Optional[float] = None) -> None:
        self.pending.append((index, value, (time.monotonic() if now is None else now) + self.timeout_s, describe))

    def check(self, seen, now: float) -> Optional[tuple]:
        """Drop the satisfied waits; the oldest one past its deadline (it is dropped too), else None."""
        while self.pending:
            index, value, deadline, describe = self.pending[0]
            if seen[index] >= value:
                self.pending.popleft()
            elif now > deadline:
                return self.pending.popleft()
            else:
                return None
        return None


class Watchdog:
    """Bounds every stream wait on this rank's flags: a deadline, then ``PeerLost`` and an unblocked stream."""

    def __init__(self, device: torch.device, ops: StreamOps, flags: torch.Tensor, timeout_s: float):
        self.device, self.ops, self.flags, self.timeout_s = device, ops, flags, timeout_s
        self.error: Optional[BaseException] = None
        self.log = WaitLog(timeout_s)
        # A few reads per timeout, at most 4 a second: each wake takes the interpreter lock from the
        # thread issuing the GPU work, which a per-exchange host cost of ~0.1 ms cannot afford often.
        self.period_s = min(0.25, max(0.01, timeout_s / 20))
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="copy-engine-watchdog", daemon=True)
        self.thread.start()

    def watch(self, index: int, value: int, describe) -> None:
        self.log.watch(index, value, describe)  # a deque append: atomic, no lock

    def read(self, stream: torch.cuda.Stream, host: torch.Tensor) -> list:
        with torch.cuda.stream(stream):
            host.copy_(self.flags, non_blocking=True)
        stream.synchronize()
        return host.tolist()

    def _run(self) -> None:
        torch.cuda.set_device(self.device)
        stream = torch.cuda.Stream(self.device)
        host = torch.empty(self.flags.shape, dtype=torch.int32, pin_memory=True)
        while not self.closed:
            time.sleep(self.period_s)
            if self.log.pending:
                self._check(self.read(stream, host), stream)

    def _check(self, seen: list, stream: torch.cuda.Stream) -> None:
        while (late := self.log.check(seen, time.monotonic())) is not None:
            index, value, _, describe = late
            self.error = self.error or PeerLost(describe(self.timeout_s))
            self.ops.write(stream, self.flags, index, value)  # let the stream move on

    def close(self) -> None:
        self.closed = True
        self.thread.join(1.0 + self.period_s)  # not mid-CUDA-call while the interpreter shuts down


class StreamLane:
    """A peer's copy lane: its own stream (high priority, so copies start as soon as they may)."""

    def __init__(self, device: torch.device, ops: StreamOps, watchdog: Watchdog, stream=None):
        self.device, self.ops, self.watchdog = device, ops, watchdog
        self._stream = stream

    @property
    def stream(self) -> torch.cuda.Stream:
        return self._stream

    @property
    def error(self) -> Optional[BaseException]:
        return self.watchdog.error

    def follow(self, mark: Optional[torch.cuda.Event]) -> None:
        if mark is not None:
            self.stream.wait_event(mark)

    def hold(self, tensor: torch.Tensor) -> None:
        """A caller's own send tensor must outlive the copies this stream makes out of it."""
        tensor.record_stream(self.stream)

    def wait_value(self, flags: torch.Tensor, index: int, value: int, describe) -> None:
        # Waits are always on this rank's own flags, which the watchdog reads.
        self.watchdog.watch(index, value, describe)
        if self.ops.available:
            try:
                self.ops.wait(self.stream, flag_address(flags, index), value)
                return
            except RuntimeError as err:  # e.g. a driver with stream memory operations disabled
                self.ops.available = False
                warnings.warn(f"{err} Flags are polled by the host from now on.")
        while self.watchdog.flags[index].item() < value:  # the portable fallback: the host polls
            raise_lane_error([self])
            time.sleep(1e-5)

    def write_value(self, flags: torch.Tensor, index: int, value: int) -> None:
        self.ops.write(self.stream, flags, index, value)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dma_copy(dst, src, self.stream, self.ops)

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def close(self) -> None:
        self.stream.synchronize()


class ComputeLane(StreamLane):
    """The compute stream, whichever is current when the layout calls the transport."""

    def __init__(self, device, ops, watchdog, lanes):
        super().__init__(device, ops, watchdog)
        self.lanes = lanes

    @property
    def stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def wait_marks(self, marks: list, lanes: list) -> None:
        for event in marks:
            self.stream.wait_event(event)
        raise_lane_error(lanes)


class DeviceRegion:
    """Each mapped peer's region as a byte tensor (None for peers on other nodes), flags as int32."""

    def __init__(self, regions: list, keep):
        self._bytes, self._keep = regions, keep
        self._flags = [None if r is None else r.view(torch.int32) for r in regions]

    def bytes(self, rank: int) -> torch.Tensor:
        return self._bytes[rank]

    def flags(self, rank: int) -> torch.Tensor:
        return self._flags[rank]


class SymmetricMemoryFabric:
    def __init__(self, device: torch.device, timeout_s: float):
        # Multicast (NVLS) objects are neither needed nor safe on every machine; see docs/TRANSPORT.md#copy_engine.
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        if HIP and (os.environ.get("HSA_ENABLE_SDMA") == "0" or os.environ.get("ROC_P2P_SDMA_SIZE") != "0"):
            warnings.warn(
                "copy_engine on ROCm: set HSA_ENABLE_SDMA=1 and ROC_P2P_SDMA_SIZE=0, else small peer "
                "copies run as blit kernels on the compute units."
            )
        self.device, self.ops, self._timeout_s = device, StreamOps(), timeout_s
        self.watchdog: Optional[Watchdog] = None
        atexit.register(lambda: self.watchdog and self.watchdog.close())

    def map(self, nbytes: int, group, local: list[bool], flag_count: int) -> DeviceRegion:
        rank = dist.get_rank(group)
        devices: list = [None] * len(local)
        dist.all_gather_object(devices, self.device.index, group=group)
        # Symmetric memory wants one GPU per rank; two ranks sharing a GPU (a 1-GPU test of this
        # code path) go through IPC handles, as do ROCm builds and groups that span nodes.
        symmetric = all(local) and not HIP and len(set(devices)) == len(devices)
        regions, keep = self._symmetric(nbytes, group, local) if symmetric else self._ipc(nbytes, group, local)
        if self.watchdog is not None:
            self.watchdog.close()
        self.watchdog = Watchdog(
            self.device, self.ops, regions[rank][: 4 * flag_count].view(torch.int32), self._timeout_s
        )
        return DeviceRegion(regions, keep)

    def _symmetric(self, nbytes: int, group, local: list[bool]):
        import torch.distributed._symmetric_memory as symm_mem

        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older releases, a no-op when done
            with warnings.catch_warnings():  # newer releases deprecate it (nothing to enable any more)
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(group.group_name)
        buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
        buffer.zero_()  # every flag starts at epoch 0
        handle = symm_mem.rendezvous(buffer, group)
        handle.barrier()  # queued after zero_: no peer writes a flag before it is cleared
        torch.cuda.current_stream(self.device).synchronize()
        return [handle.get_buffer(j, (nbytes,), torch.uint8) for j in range(len(local))], (buffer, handle)

    def _ipc(self, nbytes: int, group, local: list[bool]):
        from torch.multiprocessing.reductions import reduce_tensor

        buffer = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        torch.cuda.current_stream(self.device).synchronize()
        shared: list = [None] * len(local)
        dist.all_gather_object(shared, reduce_tensor(buffer), group=group)
        rank = dist.get_rank(group)
        regions = [
            buffer if j == rank else (fn(*args) if here else None)
            for j, ((fn, args), here) in enumerate(zip(shared, local))
        ]
        dist.barrier(group=group)
        return regions, buffer

    def compute_lane(self, lanes: list) -> ComputeLane:
        return ComputeLane(self.device, self.ops, self.watchdog, lanes)

    def peer_lane(self, name: str, chaos_s: float, seed: int) -> StreamLane:
        return StreamLane(self.device, self.ops, self.watchdog, torch.cuda.Stream(self.device, priority=-1))

    def drain(self, lanes: list) -> None:
        for lane in lanes:
            if lane is not None:
                lane.close()
