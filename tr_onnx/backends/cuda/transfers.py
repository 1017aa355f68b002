"""Host transfers of the cuda executor: batches up, results down, state in and out.

``write_input`` copies a compact (NCHW) host array through one of two pinned buffers (the host
fills one while the other's copy may be in flight) into the arena; a padded channels-last input
is uploaded compact into the WORKSPACE region (dead between steps) and padded on the device by
``tr_pad_nhwc``, and a float32 batch for a half input is rounded there (``tr_convert``);
``read_output`` the reverse with ``tr_unpad_nhwc``. Where WORKSPACE is too small the host lays
the data out instead. ``all_finite`` reduces a tensor on the device to a flag in the first 4
bytes of WORKSPACE and reads back only the flag. A third pinned buffer serves the synchronous
reads and writes between steps.

``staging_bytes(graph)`` is the WORKSPACE a cuda plan reserves for these transfers (the staged
batch, the flag): the compiler passes it to the MemoryPlan, so no transfer depends on how much
scratch the plan's kernels happened to ask for. The step report comes back from its own tensor
(``train_pass.StepGuard.report``) into the pinned buffer its batch went up through.
"""

from __future__ import annotations

import math

import numpy as np

from ... import ir
from ...errors import InputError
from ...layouts import GatherRowsLayout
from ...memory import Region
from .. import HostTransfers
from .bind import DT, geometry, i64
from .capture import DeviceBuffer
from .device import launch_dims

REPORT_BYTES = 32
"""The step report tensor's bytes (float32 x 8: ``ops.optimizers.REPORT_FIELDS``, padded)."""
HALF_INPUTS = ("float16", "bfloat16")  # inputs a float32 host batch is rounded to on the device


def staging_bytes(graph: ir.Graph) -> int:
    """WORKSPACE bytes the transfers want: every graph input staged compact as float32 (the
    widest a host batch comes up as), and ``all_finite``'s 4-byte flag."""
    return max([4] + [math.prod(v.shape) * max(4, v.dtype.itemsize) for v in graph.inputs])


class DeviceTransfers(HostTransfers):
    """``ExecutorAPI``'s transfers for an executor with ``plan``, ``memory``, ``device`` and
    ``bind_ctx`` (a ``bind.BindContext``); call ``_init_transfers`` once bound."""

    @property
    def _workspace(self) -> tuple[int, int]:
        """(device pointer, bytes) of the WORKSPACE region: the transfers' staging area."""
        start, size = self.memory.regions[Region.WORKSPACE]
        return self.bind_ctx.base + start, size

    def _init_transfers(self) -> None:
        start, size = self.memory.regions[Region.INPUT]
        self._input_start = start
        # a half-precision input comes from the host as float32 and is rounded on the device
        # (layout_convert.cu / elementwise.cu): its float32 staging area follows the INPUT mirror
        self._wide: dict[str, int] = {}
        end = size
        for t in self.memory.tensors.values():
            if t.region == Region.INPUT and t.dtype.name in HALF_INPUTS:
                self._wide[t.name] = end
                end += -(-math.prod(t.shape) * 4 // 256) * 256
        self._report = end  # the report of the step whose batch came up through the buffer
        end += REPORT_BYTES
        # and its model outputs (a training plan's, where a plain copy reads them: [N, C]
        # scores), so they can be read after the next step was launched over them
        self._outputs: dict[str, int] = {}
        for name in self.plan.info.outputs if self.plan.info is not None else ():
            t = self.memory.tensors.get(name)
            g = geometry(t) if t is not None else None
            if g is not None and g.kind == "flat" and not isinstance(t.layout, GatherRowsLayout):
                end = -(-end // 256) * 256
                self._outputs[name] = end
                end += t.nbytes
        largest = max([t.nbytes for t in self.memory.tensors.values()] + [end, 1])
        self._host = self.device.pinned_buffers(largest, 3)
        self._k, self._k_ready = 0, False

    def _flip_host_buffers(self) -> None:
        self.device.record_host_buffer(self._k)
        self._k, self._k_ready = 1 - self._k, False

    def _host_buffer(self) -> np.ndarray:
        if not self._k_ready:
            self.device.wait_host_buffer(self._k)
            self._k_ready = True
        return self._host[self._k]

    def write_input(self, name: str, array, host_layout: str = "nchw") -> None:
        """Upload a graph input (or a per-step scalar: ``__lr``, ``__step``...) from a compact
        host array (logical NCHW; ``host_layout='nhwc'`` for channels-last host data)."""
        t = self.memory.tensors.get(name)
        if t is None or t.region != Region.INPUT:
            inputs = sorted(n for n, x in self.memory.tensors.items() if x.region == Region.INPUT)
            raise InputError(f"{name!r} is not an input of this plan; inputs: {inputs}")
        src = np.asarray(array)
        if host_layout == "nhwc" and src.ndim >= 3:
            src = np.moveaxis(src, -1, 1)
        if src.shape != tuple(t.shape):
            raise InputError(f"{name!r}: expected shape {list(t.shape)}, got {list(src.shape)}")
        host = self._host_buffer()
        g = geometry(t)
        self.device.begin_node(f"<upload {name}>", "upload")
        slot = self.bind_ctx.tensor_buf(t, True)
        ws_ptr, ws_bytes = self._workspace
        # a float batch for a half input goes up as float32 and is rounded on the device: NumPy
        # takes ~30 ms to round a 64x3x224x224 batch to fp16 on one core, the kernel microseconds
        wide = name in self._wide and src.dtype.kind == "f" and g is not None and (
            g.kind == "flat" and not isinstance(t.layout, GatherRowsLayout)
            or g.kind == "channels_last" and t.layout.kind == "channels_last")
        stage_dtype = np.dtype(np.float32) if wide else t.dtype
        array = np.asarray(src, dtype=stage_dtype)
        compact = array.nbytes
        off = self._wide[name] if wide else t.offset - self._input_start
        if wide and compact > ws_bytes:
            wide, array = False, np.asarray(src, dtype=t.dtype)  # no room: the host rounds
            compact, off = array.nbytes, t.offset - self._input_start
        dt = DT.get(t.dtype.name)
        src_dt = "f32" if wide else dt
        if g is not None and g.kind == "channels_last" and t.layout.kind == "channels_last" \
                and compact <= ws_bytes:
            np.copyto(np.ndarray(t.shape, array.dtype, host, off), array)
            staging = DeviceBuffer(ws_ptr, compact, True)
            self.device.memcpy_async(staging, host[off:off + compact], compact, "h2d")
            grid, block = launch_dims(g.n)
            self.device.launch(self.bind_ctx.kernel(f"tr_pad_nhwc_{src_dt}_{dt}"), grid,
                               block, (DeviceBuffer(ws_ptr, compact, False), slot, i64(g.n),
                                       i64(g.c), i64(g.s), i64(g.cp)))
        elif wide:  # flat: up as float32 into WORKSPACE, rounded into the slot
            np.copyto(np.ndarray(t.shape, array.dtype, host, off), array)
            self.device.memcpy_async(DeviceBuffer(ws_ptr, compact, True),
                                     host[off:off + compact], compact, "h2d")
            grid, block = launch_dims(g.n)
            self.device.launch(self.bind_ctx.kernel(f"tr_convert_f32_{dt}"), grid, block,
                               (DeviceBuffer(ws_ptr, compact, False), slot, i64(g.n)))
        elif g is not None and g.kind == "flat" and not isinstance(t.layout, GatherRowsLayout):
            np.copyto(np.ndarray(t.shape, t.dtype, host, off), array)
            self.device.memcpy_async(slot, host[off:off + compact], compact, "h2d")
        else:  # the host lays the data out (GatherRows, or no room to stage in WORKSPACE)
            view = host[off:off + t.nbytes]
            view[...] = 0
            if isinstance(t.layout, GatherRowsLayout):
                t.layout.physical_view(view, 0, t.dtype)[...] = t.layout.to_physical(array)
            else:
                t.layout.kernel_view(view, 0, t.dtype)[...] = array
            self.device.memcpy_async(slot, view, t.nbytes, "h2d")

    def write_scalar(self, name: str, value) -> None:
        """A per-step scalar (lr, step count...) of INPUT goes up with the batch, through the
        pinned buffer and an async copy; any other through ``write_tensor`` (synchronous)."""
        t = self.memory.tensors.get(name)
        if t is not None and t.region == Region.INPUT:
            self.write_input(name, np.full(t.shape, value, t.dtype))
        else:
            super().write_scalar(name, value)

    def read_output(self, name: str, host_layout: str = "nchw") -> np.ndarray:
        """A compact host copy of any tensor of the plan (waits for the stream)."""
        t = self.memory.tensors.get(name)
        if t is None:
            raise InputError(f"{name!r} is not a tensor of this plan")
        host = self._host[2]
        g = geometry(t)
        compact = math.prod(t.shape) * t.dtype.itemsize
        src = self.bind_ctx.tensor_buf(t)
        self.device.begin_node(f"<download {name}>", "download")
        ws_ptr, ws_bytes = self._workspace
        if g is not None and g.kind == "channels_last" and t.layout.kind == "channels_last" \
                and compact <= ws_bytes:
            dt = DT[t.dtype.name]
            grid, block = launch_dims(g.m)
            self.device.launch(self.bind_ctx.kernel(f"tr_unpad_nhwc_{dt}_{dt}"), grid, block,
                               (src, DeviceBuffer(ws_ptr, compact, True), i64(g.m), i64(g.c),
                                i64(g.s), i64(g.cp)))
            self.device.memcpy_async(host[:compact], DeviceBuffer(ws_ptr, compact, False),
                                     compact, "d2h")
            self.device.synchronize()
            out = np.ndarray(t.shape, t.dtype, host).copy()
        elif g is not None and g.kind == "flat" and not isinstance(t.layout, GatherRowsLayout):
            self.device.memcpy_async(host[:compact], src, compact, "d2h")
            self.device.synchronize()
            out = np.ndarray(t.shape, t.dtype, host).copy()
        else:
            self.device.memcpy_async(host[:t.nbytes], src, t.nbytes, "d2h")
            self.device.synchronize()
            if isinstance(t.layout, GatherRowsLayout):
                out = t.layout.to_logical(t.layout.physical_view(host, 0, t.dtype))
            else:
                out = np.array(t.layout.kernel_view(host, 0, t.dtype), order="C")
        if host_layout == "nhwc" and out.ndim >= 3:
            out = np.ascontiguousarray(np.moveaxis(out, 1, -1))
        return out

    def all_finite(self, name: str) -> bool:
        """No NaN/Inf in tensor ``name``, decided on the device: ``tr_zero_lanes_b4`` clears a
        float32 flag in the first 4 bytes of WORKSPACE (per-node scratch, dead between phases,
        so free outside the captured step), ``tr_unscale_check_<dt>`` with a null inv_scale
        sets it to 1 on a non-finite element (the tensor is not written), and only those 4
        bytes come back to the host. A tensor the flat kernel cannot index (a non-plain
        layout, GatherRows, a dtype without kernels) or a plan with no WORKSPACE takes the
        host round trip of ``HostTransfers.all_finite``."""
        t = self.memory.tensors.get(name)
        if t is None:
            raise InputError(f"{name!r} is not a tensor of this plan")
        g = geometry(t)
        ws_ptr, ws_bytes = self._workspace
        if g is None or g.kind != "flat" or isinstance(t.layout, GatherRowsLayout) or \
                t.dtype.name not in DT or ws_bytes < 4:
            return super().all_finite(name)
        flag = DeviceBuffer(ws_ptr, 4, True)
        self.device.begin_node(f"<all_finite {name}>", "check")
        self.device.launch(self.bind_ctx.kernel("tr_zero_lanes_b4"), (1, 1, 1), (1, 1, 1),
                           (flag, i64(1), i64(0), i64(1)))
        grid, block = launch_dims(g.n)
        self.device.launch(self.bind_ctx.kernel(f"tr_unscale_check_{DT[t.dtype.name]}"), grid,
                           block, (self.bind_ctx.tensor_buf(t),
                                   i64(g.n), None, flag))
        host = self._host[2]
        self.device.memcpy_async(host[:4], DeviceBuffer(ws_ptr, 4, False), 4, "d2h")
        self.device.synchronize()
        return bool(host[:4].view(np.float32)[0] == 0.0)

    def load_constants(self) -> None:
        """Upload the plan's initial contents (parameters, constants, optimizer state) once,
        through the host buffer, before the first step (a synchronous setup)."""
        graph = self.plan.graph
        for v in graph.values.values():
            if v.data is None or v.span_of is not None or v.alias_of is not None:
                continue
            t = self.memory.tensors[v.name]
            host = np.zeros(t.nbytes, np.uint8)
            if isinstance(t.layout, GatherRowsLayout):
                t.layout.physical_view(host, 0, t.dtype)[...] = t.layout.to_physical(v.data)
            else:
                t.layout.kernel_view(host, 0, t.dtype)[...] = v.data
            self.device.memcpy(self.bind_ctx.tensor_buf(t, True),
                               host, t.nbytes, "h2d")

    def write_tensor(self, name: str, array) -> None:
        """Overwrite any tensor of the plan (parameters, optimizer state) from a compact host
        array, synchronously, between steps (``ExecutorAPI``; its other state helpers come
        from ``HostTransfers`` on top of this and ``read_output``)."""
        t = self.memory.tensors.get(name)
        if t is None:
            raise InputError(f"{name!r} is not a tensor of this plan")
        array = np.asarray(array, dtype=t.dtype)
        if array.shape != tuple(t.shape):
            raise InputError(f"{name!r}: expected shape {list(t.shape)}, got {list(array.shape)}")
        host = np.zeros(t.nbytes, np.uint8)
        if isinstance(t.layout, GatherRowsLayout):
            t.layout.physical_view(host, 0, t.dtype)[...] = t.layout.to_physical(array)
        else:
            t.layout.kernel_view(host, 0, t.dtype)[...] = array
        self.device.memcpy(self.bind_ctx.tensor_buf(t, True), host,
                           t.nbytes, "h2d")
