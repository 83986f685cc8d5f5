"""Fused multi-tensor kernels in Triton: the ``"triton"`` backend of
:func:`lightning_mpx.scaling.unscale.unscale_grads_`.

This module imports triton; :mod:`lightning_mpx.scaling.unscale` imports it only when the backend is used, so that
``import lightning_mpx`` needs torch alone.

Design. Every tensor of a call is cut into chunks of ``workspace.chunk_size`` elements, and a table with one row per
chunk, ``(tensor index, first element, length)`` as int64, is built on the host, copied to the device once and kept
in the caller's :class:`~lightning_mpx.scaling.unscale.UnscaleWorkspace` for the next steps: it depends only on the
tensors' sizes, dtypes and layouts. The tensors' base addresses live in two small int64 arrays beside it (one entry per
tensor), uploaded again only when an address changes: ``zero_grad(set_to_none=True)``, torch's default, gives the
gradients new buffers whenever the caching allocator hands out other blocks, and rebuilding the table for that cost
tens of milliseconds of host time per step on an H100 run (``benchmarks/gpu_host_profile.py``). One program
handles one chunk: it loads its row and its tensor's two base addresses, casts them to typed pointers
(``int64 -> tl.pointer_type``), offsets them to the chunk and walks it ``block_size`` elements at a time. Tensors of one
(source dtype, destination dtype) pair share a launch, so the number of launches depends on the number of dtype pairs
(one or two in practice), never on the number of tensors. Folding each chunk's start into its addresses keeps every
in-kernel offset below ``chunk_size``: no 32-bit overflow, whatever the tensor size.

The scale is a device tensor read by the kernel (a new scale never recompiles anything and never needs the host).
The non-finite flag is set by a masked store of 1.0 (every writer writes the same value, so the result does not
depend on their order). The norm is deterministic: each program writes the sum of squares of its chunk to its own
slot of a partials buffer, and a one-program kernel adds the slots in a fixed order and takes the square root; there
are no float atomics.

Statistics (``STATS``, a compile-time flag: launches without it compile to the kernels they were before). On a
logging step each program also measures its chunk's *scaled* values, before the multiply: how many are below the
half dtype's smallest normal number (``tiny``, zero included), how many are exactly zero, and the largest magnitude
(inf for inf and NaN). They go to per-chunk slots of three buffers made on the first such call, and
:func:`tensor_stats` adds them up per tensor with three torch ops (two ``index_add_`` and a ``scatter_reduce_``); the
caller reduces those per module.

Byte counts per element (``s``/``d``: source/destination element sizes):

* unscale in place (+ flag, + norm): read ``s``, write ``s`` - the floor (8 bytes for FP32);
* unscale into FP32 masters (O2): read ``s``, write ``d`` (2 + 4 for half gradients);
* unscale + clip by norm: one read-only pass for the flag and the norm (``s``), then one pass that multiplies by
  ``clip coefficient / scale`` (``s + d``): 12 bytes for FP32 in place, 8 for half gradients into FP32 masters;
* FP32 masters to half model parameters: read 4, write 2.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Sequence

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

if TYPE_CHECKING:
    from lightning_mpx.scaling.workspace import UnscaleWorkspace

Tensors = Sequence[torch.Tensor]

#: Largest finite FP32 value: |x| <= it is false exactly for inf, -inf and NaN.
_FP32_MAX = tl.constexpr(3.4028234663852886e38)

_TL_DTYPES = MappingProxyType({torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16})
SUPPORTED_DTYPES = tuple(_TL_DTYPES)


@triton.jit
def _chunk_kernel(
    table_ptr,
    src_base_ptr,
    dst_base_ptr,
    scale_ptr,
    found_ptr,
    partials_ptr,
    under_ptr,
    zero_ptr,
    peak_ptr,
    tiny,
    SRC: tl.constexpr,
    DST: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    STORE: tl.constexpr,
    CHECK: tl.constexpr,
    NORM: tl.constexpr,
    STATS: tl.constexpr,
    ALIGNED: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One chunk: ``dst = round_DST(float(src) * scale)``, with the flag and the sum of squares of the result."""
    pid = tl.program_id(0)
    row = table_ptr + pid.to(tl.int64) * 3
    owner = tl.load(row)
    first = tl.load(row + 1)
    src = tl.load(src_base_ptr + owner).to(tl.pointer_type(SRC)) + first
    dst = tl.load(dst_base_ptr + owner).to(tl.pointer_type(DST)) + first
    if ALIGNED:
        # Every base address of this launch is a multiple of 16 bytes (checked when the addresses were uploaded) and
        # every chunk starts a multiple of 16 bytes into its tensor: without the hint, pointers loaded from memory
        # get one-element loads.
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
    n = tl.load(row + 2).to(tl.int32)
    scale = tl.load(scale_ptr) if HAS_SCALE else 1.0
    squares = tl.zeros([BLOCK], dtype=tl.float32)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    under = tl.zeros([BLOCK], dtype=tl.int32)  # unused (and removed by the compiler) without STATS
    zero = tl.zeros([BLOCK], dtype=tl.int32)
    peak = tl.zeros([BLOCK], dtype=tl.float32)
    # A constant trip count; only the last block of a tensor is masked, and the steps past the end of a short
    # chunk are fully masked and move no data. A block's code is written out twice, for a full block (unmasked: the
    # compiler uses vector loads and stores) and for a tensor's last (masked); the two differ only in the mask.
    # Calls of a jit helper compiled to the same PTX (triton inlines them), but triton's interpreter (the tests on
    # CPU) paid for every call: a third of its time.
    # - STATS measure the scaled value, before the multiply; NaN counts as infinitely large (not as underflow). A
    #   zero (either sign) is read on the bits: triton's interpreter turns bfloat16 subnormals into zeros when it
    #   converts them to FP32, the GPU does not.
    # - The result is rounded to nearest-even in DST, the same on the GPU and in the interpreter. For BF16 on the
    #   bits: the interpreter's own FP32 -> BF16 cast truncates, and the GPU's cvt.rn rounds to nearest-even, which
    #   is what this computes (NaN becomes the canonical BF16 NaN: the carry of the rounding could reach the sign).
    # - The flag and the norm are taken on the value as stored (rounded to DST), as the reference does: an unscaled
    #   value that overflows the destination dtype is an overflow. tl.abs(v) <= _FP32_MAX is false for inf, -inf
    #   and NaN.
    for start in range(0, CHUNK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        if start + BLOCK <= n:
            loaded = tl.load(src + offs)
            x = loaded.to(tl.float32)
            if STATS:
                a = tl.abs(x)
                a = tl.where(a == a, a, float("inf"))
                small = a < tiny
                if SRC == tl.float32:
                    nil = (loaded.to(tl.uint32, bitcast=True) & 0x7FFFFFFF) == 0
                else:
                    nil = (loaded.to(tl.uint16, bitcast=True) & 0x7FFF) == 0
                under += small.to(tl.int32)
                zero += nil.to(tl.int32)
                peak = tl.maximum(peak, a)
            if HAS_SCALE:
                x = x * scale  # one FP32 multiply, then one rounding to DST: what torch's unscale does
            if DST == tl.bfloat16:
                bits = x.to(tl.uint32, bitcast=True)
                upper = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
                y = tl.where(x != x, 0x7FC0, upper).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            else:
                y = x.to(DST)
            if STORE:
                tl.store(dst + offs, y)
            v = y.to(tl.float32)
            if CHECK:
                bad = tl.maximum(bad, tl.where(tl.abs(v) <= _FP32_MAX, 0, 1))
            if NORM:
                squares += v * v
        else:  # the same, masked
            mask = offs < n
            loaded = tl.load(src + offs, mask=mask, other=0.0)
            x = loaded.to(tl.float32)
            if STATS:
                a = tl.abs(x)
                a = tl.where(a == a, a, float("inf"))
                small = a < tiny
                if SRC == tl.float32:
                    nil = (loaded.to(tl.uint32, bitcast=True) & 0x7FFFFFFF) == 0
                else:
                    nil = (loaded.to(tl.uint16, bitcast=True) & 0x7FFF) == 0
                small = small & mask  # masked lanes hold 0: not elements
                nil = nil & mask
                under += small.to(tl.int32)
                zero += nil.to(tl.int32)
                peak = tl.maximum(peak, a)
            if HAS_SCALE:
                x = x * scale
            if DST == tl.bfloat16:
                bits = x.to(tl.uint32, bitcast=True)
                upper = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
                y = tl.where(x != x, 0x7FC0, upper).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            else:
                y = x.to(DST)
            if STORE:
                tl.store(dst + offs, y, mask=mask)
            v = y.to(tl.float32)
            if CHECK:
                bad = tl.maximum(bad, tl.where(tl.abs(v) <= _FP32_MAX, 0, 1))
            if NORM:
                squares += v * v  # masked lanes hold 0
    if CHECK:
        tl.store(found_ptr, 1.0, mask=tl.max(bad, axis=0) > 0)
    if NORM:
        tl.store(partials_ptr + pid, tl.sum(squares, axis=0))
    if STATS:
        tl.store(under_ptr + pid, tl.sum(under, axis=0))
        tl.store(zero_ptr + pid, tl.sum(zero, axis=0))
        tl.store(peak_ptr + pid, tl.max(peak, axis=0))


@triton.jit
def _finalize_kernel(
    partials_ptr,
    n,
    norm_ptr,
    coef_ptr,
    scale_ptr,
    found_ptr,
    max_norm,
    CLIP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Norm from the partial sums in a fixed order; with ``CLIP``, ``coef_ptr`` gets ``clip coefficient * scale``."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    # A while loop: triton 3.6's interpreter cannot take a runtime bound in range() with numpy 2.
    start = 0
    while start < n:
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(partials_ptr + offs, mask=offs < n, other=0.0)
        start += BLOCK
    norm = tl.sqrt_rn(tl.sum(acc, axis=0))
    tl.store(norm_ptr, norm)
    if CLIP:
        # As torch.nn.utils.clip_grad_norm_: max_norm / (norm + 1e-6) is evaluated by torch as
        # reciprocal(norm + 1e-6) * max_norm, each step rounded.
        coef = tl.div_rn(1.0, norm + 1e-6) * max_norm
        coef = tl.minimum(coef, 1.0, propagate_nan=tl.PropagateNan.ALL)
        # An overflow step (skipped) leaves the gradients unclipped, as unscale.clip_coefficient; an infinite norm
        # of finite gradients (their squares overflow FP32) gets torch's coefficient, 0.
        coef = tl.where(tl.load(found_ptr) == 0, coef, 1.0)
        tl.store(coef_ptr, coef * tl.load(scale_ptr))


# -- tables ------------------------------------------------------------------------------------------------------
@dataclass
class _Group:
    src_dtype: torch.dtype
    dst_dtype: torch.dtype
    members: tuple[int, ...]  # indices, in the call's lists, of this group's tensors (the table's tensor index)
    table: torch.Tensor  # this group's rows of the plan's table (a view)
    partials: torch.Tensor  # this group's slots of the plan's partials buffer (a view)
    rows: slice = field(default_factory=lambda: slice(0, 0))  # this group's rows in the plan's table
    src_base: torch.Tensor | None = None  # int64 [len(members)] on the device, set by bind()
    dst_base: torch.Tensor | None = None
    aligned: bool = False  # every source and destination base address is a multiple of 16 bytes


@dataclass
class _Plan:
    """Chunk table of one list of (source, destination) tensors on one device, kept across steps.

    ``supported`` is false when the kernels cannot take the tensors (several devices, layouts that differ between a
    source and its destination, other dtypes); the verdict is cached like a table, and the caller uses the foreach
    twin.
    """

    supported: bool
    device: torch.device | None = None
    table: torch.Tensor | None = None  # int64 [chunks, 3] on the device: tensor index in its group, start, length
    groups: tuple[_Group, ...] = ()
    partials: torch.Tensor | None = None  # FP32 [max(chunks, 1)]: per-chunk sums of squares
    coef: torch.Tensor | None = None  # FP32 [1]: clip coefficient * inv_scale, written and read within one call
    addresses: tuple[object, ...] = ()  # the source and destination addresses the groups' bases hold
    uploads: int = 0  # how many times base addresses were uploaded
    # Statistics (made on the first call that asks for them): per row, the index of its tensor in the call's list,
    # and the per-chunk underflow counts (int32), zero counts (int32) and peaks (FP32).
    owners: torch.Tensor | None = None
    under: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    peak: torch.Tensor | None = None


_DTYPE = operator.attrgetter("dtype")
_NOT = operator.not_


def _fingerprint(tensors: Tensors) -> tuple[object, ...]:
    # Built from C-level accessors mapped over the list, because it runs on every step (about 0.05 us per tensor
    # and accessor): Python-level loops over thousands of tensors would dominate a step's host time.
    contiguous = tuple(map(torch.Tensor.is_contiguous, tensors))
    return (
        tuple(map(torch.Tensor.numel, tensors)),
        tuple(map(_DTYPE, tensors)),
        tuple(map(torch.Tensor.get_device, tensors)),
        contiguous,
        # Only tensors that are not contiguous have a layout beyond their size that matters to ``supports``.
        tuple((t.shape, t.stride()) for t in itertools.compress(tensors, map(_NOT, contiguous))),
    )


def key(src: Tensors, dst: Tensors) -> tuple[object, ...]:
    """Everything a plan's table depends on: each tensor's element count, dtype, device and layout.

    A resized or re-cast tensor or a different list needs a new table; the device and layout parts make the cached
    ``supported`` verdict (and the device checks done before a plan is built) hold for every call that finds the
    plan. Addresses are not part of it: :func:`bind` refreshes them. ``dst is src`` is the in-place case.
    """
    if dst is src:
        return (_fingerprint(src),)
    return (_fingerprint(src), _fingerprint(dst))


def cached(workspace: UnscaleWorkspace, plan_key: tuple[object, ...]) -> _Plan | None:
    """The workspace's plan for this key, if it has one (marked as the most recently used)."""
    plans = workspace._plans
    plan = plans.get(plan_key)
    if plan is not None:
        plans.move_to_end(plan_key)
    return plan  # type: ignore[no-any-return]


def bind(found: _Plan, src: Tensors, dst: Tensors) -> None:
    """Point a supported plan at these tensors: upload their base addresses if they differ from the last call's.

    The check is two C-level maps over the lists (about 0.05 us per tensor); the upload, when an address changed, is
    one small pinned host-to-device copy queued on the stream (the host does not wait for the device).
    """
    if not found.groups:
        return
    addresses = (tuple(map(torch.Tensor.data_ptr, src)), None if dst is src else tuple(map(torch.Tensor.data_ptr, dst)))
    if addresses == found.addresses:
        return
    src_ptrs = addresses[0]
    dst_ptrs = src_ptrs if addresses[1] is None else addresses[1]
    flat: list[int] = []
    spans = []
    for group in found.groups:
        s = [src_ptrs[i] for i in group.members]
        d = [dst_ptrs[i] for i in group.members]
        spans.append((len(flat), len(s), all(a % 16 == 0 for a in s) and all(a % 16 == 0 for a in d)))
        flat += s + d
    host = torch.tensor(flat, dtype=torch.int64)
    assert found.device is not None
    if found.device.type == "cuda":
        # Pinned (from torch's caching host allocator, which keeps the block until the copy is done) + non_blocking.
        bases = host.pin_memory().to(found.device, non_blocking=True)
    else:
        bases = host.to(found.device)
    for group, (offset, count, aligned) in zip(found.groups, spans):
        group.src_base = bases[offset : offset + count]
        group.dst_base = bases[offset + count : offset + 2 * count]
        group.aligned = aligned
    found.addresses = addresses
    found.uploads += 1


def plan(workspace: UnscaleWorkspace, plan_key: tuple[object, ...], src: Tensors, dst: Tensors) -> _Plan:
    """Build the plan for ``src``/``dst`` (a table, or an unsupported verdict) and keep it in the workspace."""
    pairs = [(s, d) for s, d in zip(src, dst) if s.numel()]  # empty tensors need no rows and no checks
    if pairs and not supports([s for s, _ in pairs], [d for _, d in pairs]):
        new = _Plan(supported=False)
    else:
        device = (pairs[0][0] if pairs else src[0]).device if src else None
        new = _build(src, dst, workspace.chunk_size, device) if device is not None else _Plan(supported=True)
        workspace.builds += 1
    plans = workspace._plans
    plans[plan_key] = new
    while len(plans) > workspace.max_plans:
        plans.popitem(last=False)
    return new


def _build(src: Tensors, dst: Tensors, chunk: int, device: torch.device) -> _Plan:
    by_pair: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}
    for index, (s, d) in enumerate(zip(src, dst)):
        if s.numel():
            by_pair.setdefault((s.dtype, d.dtype), []).append(index)
    tables: list[torch.Tensor] = []
    spans: list[tuple[torch.dtype, torch.dtype, tuple[int, ...], slice]] = []
    row = 0
    for (src_dtype, dst_dtype), members in by_pair.items():
        numels = torch.tensor([src[i].numel() for i in members], dtype=torch.int64)
        counts = (numels + chunk - 1) // chunk
        total = int(counts.sum())
        owner = torch.repeat_interleave(torch.arange(len(members)), counts)
        first = torch.cumsum(counts, 0) - counts
        start = (torch.arange(total) - first[owner]) * chunk
        length = torch.minimum(numels[owner] - start, torch.full_like(start, chunk))
        tables.append(torch.stack([owner, start, length], dim=1))
        spans.append((src_dtype, dst_dtype, tuple(members), slice(row, row + total)))
        row += total
    host = torch.cat(tables) if tables else torch.zeros((0, 3), dtype=torch.int64)
    if device.type == "cuda":
        # Pinned + non_blocking: the copy is queued on the stream; the host does not wait for the device.
        table = host.pin_memory().to(device, non_blocking=True)
    else:
        table = host.to(device)
    partials = torch.zeros(max(row, 1), dtype=torch.float32, device=device)
    coef = torch.zeros(1, dtype=torch.float32, device=device)
    table = table.contiguous()
    groups = tuple(_Group(sd, dd, members, table[rows], partials[rows], rows) for sd, dd, members, rows in spans)
    return _Plan(True, device, table, groups, partials, coef)


# -- checks ------------------------------------------------------------------------------------------------------
def interpreting() -> bool:
    """Whether these kernels run in triton's interpreter, which takes CPU tensors.

    Triton decides when a kernel is decorated, from ``TRITON_INTERPRET=1`` in the environment at that moment (when
    this module is first imported); setting the variable later changes nothing, so the kernel itself is asked.
    """
    return not isinstance(_chunk_kernel, triton.runtime.JITFunction)


def supports(src: Tensors, dst: Tensors) -> bool:
    """Whether the kernels can take these tensors: one device, supported dtypes, dense storage, matching layouts.

    The kernels walk storage element by element, so a source and its destination must lay their elements out alike
    and without gaps (contiguous, or the same strides on dense storage such as channels-last).
    """
    device = src[0].device
    for s, d in zip(src, dst):
        if s.device != device or d.device != device:
            return False
        if s.dtype not in _TL_DTYPES or d.dtype not in _TL_DTYPES:
            return False
        if s is not d and s.shape != d.shape:
            return False
        if not s.is_contiguous():
            if s.stride() != d.stride() or not _dense(s):
                return False
        elif s is not d and not d.is_contiguous():
            return False
    return True


def _dense(t: torch.Tensor) -> bool:
    return t.is_contiguous(memory_format=torch.channels_last) if t.dim() == 4 else (
        t.is_contiguous(memory_format=torch.channels_last_3d) if t.dim() == 5 else False
    )


# -- launches ----------------------------------------------------------------------------------------------------
def _launch_chunks(
    plan: _Plan,
    workspace: UnscaleWorkspace,
    scale: torch.Tensor | None,
    found: torch.Tensor | None,
    *,
    store: bool,
    norm: bool,
    stats_tiny: float | None = None,
) -> None:
    coef = plan.coef
    assert coef is not None
    stats = stats_tiny is not None
    for group in plan.groups:
        _chunk_kernel[(group.table.shape[0],)](
            group.table,
            group.src_base,
            group.dst_base,
            scale if scale is not None else coef,
            found if found is not None else coef,
            group.partials,
            plan.under[group.rows] if stats else coef,  # type: ignore[index]
            plan.zeros[group.rows] if stats else coef,  # type: ignore[index]
            plan.peak[group.rows] if stats else coef,  # type: ignore[index]
            stats_tiny if stats else 0.0,
            SRC=_TL_DTYPES[group.src_dtype],
            DST=_TL_DTYPES[group.dst_dtype],
            HAS_SCALE=scale is not None,
            STORE=store,
            CHECK=found is not None,
            NORM=norm,
            STATS=stats,
            ALIGNED=group.aligned,
            CHUNK=workspace.chunk_size,
            BLOCK=workspace.block_size,
            num_warps=workspace.num_warps,
        )


def _finalize(
    plan: _Plan, workspace: UnscaleWorkspace, scale: torch.Tensor, max_norm: float | None, flag: torch.Tensor
) -> torch.Tensor:
    partials, coef = plan.partials, plan.coef
    assert partials is not None and coef is not None
    total = sum(group.partials.numel() for group in plan.groups)
    norm = torch.empty((), dtype=torch.float32, device=partials.device)  # fresh: callers may keep old norms
    _finalize_kernel[(1,)](
        partials,
        total,
        norm,
        coef,
        scale,
        flag,
        float(max_norm) if max_norm is not None else 0.0,
        CLIP=max_norm is not None,
        BLOCK=workspace.block_size,
        num_warps=workspace.num_warps,
    )
    return norm


def unscale(
    plan: _Plan,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    want_norm: bool,
    max_norm: float | None,
    workspace: UnscaleWorkspace,
    *,
    stats_tiny: float | None = None,
) -> torch.Tensor | None:
    """The fused unscale (see the module docstring) over a supported plan from :func:`plan`; with ``stats_tiny``,
    the per-chunk statistics of the scaled values too (read them with :func:`tensor_stats`)."""
    if stats_tiny is not None:
        _stats_buffers(plan)
    if not plan.groups:  # nothing but empty tensors: nothing to unscale, a norm of zero
        return torch.zeros((), dtype=torch.float32, device=found_inf.device) if want_norm else None
    device = plan.device
    assert device is not None
    with _on(device):
        scale = inv_scale.to(device=device, dtype=torch.float32).reshape(1)
        flag = found_inf if found_inf.device == device else torch.zeros(1, dtype=torch.float32, device=device)
        if max_norm is None:
            _launch_chunks(plan, workspace, scale, flag, store=True, norm=want_norm, stats_tiny=stats_tiny)
            norm = _finalize(plan, workspace, scale, None, flag) if want_norm else None
        else:
            # 12-byte path: read-only pass for flag and norm, then one multiply by clip_coef * inv_scale.
            _launch_chunks(plan, workspace, scale, flag, store=False, norm=True, stats_tiny=stats_tiny)
            norm = _finalize(plan, workspace, scale, max_norm, flag)
            _launch_chunks(plan, workspace, plan.coef, None, store=True, norm=False)
    if flag is not found_inf:
        found_inf.copy_(torch.maximum(found_inf, flag.to(found_inf.device).reshape(found_inf.shape)))
    if norm is not None and norm.device != found_inf.device:
        norm = norm.to(found_inf.device)
    return norm


def _stats_buffers(plan: _Plan) -> None:
    """Make the plan's statistics buffers and its row-to-tensor index, once (the first logging step), on the device
    without reading it back."""
    if plan.owners is not None or plan.table is None:
        return
    device = plan.table.device
    rows = plan.table.shape[0]
    owners = torch.zeros(rows, dtype=torch.int64, device=device)
    for group in plan.groups:
        members = torch.tensor(group.members, dtype=torch.int64).to(device)
        owners[group.rows] = members[group.table[:, 0]]
    plan.owners = owners
    plan.under = torch.zeros(max(rows, 1), dtype=torch.int32, device=device)
    plan.zeros = torch.zeros(max(rows, 1), dtype=torch.int32, device=device)
    plan.peak = torch.zeros(max(rows, 1), dtype=torch.float32, device=device)


def tensor_stats(plan: _Plan, count: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per tensor of the call (``count`` of them, empty ones included): the underflow counts (int64), the zero counts
    (int64) and the peaks (FP32) that the last ``unscale(..., stats_tiny=...)`` over ``plan`` wrote per chunk, on
    ``device``."""
    under = torch.zeros(count, dtype=torch.int64, device=device)
    zeros = torch.zeros(count, dtype=torch.int64, device=device)
    peak = torch.zeros(count, dtype=torch.float32, device=device)
    if plan.owners is None or not plan.owners.numel():
        return under, zeros, peak
    assert plan.under is not None and plan.zeros is not None and plan.peak is not None
    rows = plan.owners.numel()
    owners = plan.owners.to(device)
    under.index_add_(0, owners, plan.under[:rows].to(device, torch.int64))
    zeros.index_add_(0, owners, plan.zeros[:rows].to(device, torch.int64))
    peak.scatter_reduce_(0, owners, plan.peak[:rows].to(device), "amax")
    return under, zeros, peak


def copy(plan: _Plan, workspace: UnscaleWorkspace) -> None:
    """``dst[i].copy_(src[i])`` for every pair of a supported plan, one launch per dtype pair."""
    if plan.groups:
        assert plan.device is not None
        with _on(plan.device):
            _launch_chunks(plan, workspace, None, None, store=True, norm=False)


class _on:
    """Make ``device`` current for the launches (triton launches on the current CUDA device)."""

    def __init__(self, device: torch.device) -> None:
        self._context = torch.cuda.device(device) if device.type == "cuda" else None

    def __enter__(self) -> None:
        if self._context is not None:
            self._context.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._context is not None:
            self._context.__exit__(*exc)
