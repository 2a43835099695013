""":class:`~framework.multimodal.inputs.MultimodalInputs` on the HTTP -> scheduler wire.

msgpack only, never pickle (a message must not be able to run code in the scheduler): a tensor
travels as its raw bytes with its dtype name and shape, and is rebuilt with ``torch.frombuffer``.
Text-only requests carry no multimodal field at all (``GenerateReq`` omits defaults). torch is
imported only when a multimodal request is encoded or decoded, so ``ipc`` stays light to import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    import torch

    from framework.multimodal.inputs import MultimodalInputs

DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
"""dtypes a processor may produce; a name outside this list is refused when decoding."""


class WireTensor(msgspec.Struct, array_like=True):
    """A tensor as raw bytes: ``dtype`` is torch's name without the prefix (``float32``)."""

    dtype: str
    shape: list[int]
    data: bytes


class WireImage(msgspec.Struct, array_like=True):
    pixel_values: WireTensor
    grid_thw: tuple[int, int, int]
    offset: int
    length: int
    hash: int


class WireMultimodal(msgspec.Struct, omit_defaults=True):
    """What a scheduler request needs beyond its ids (see ``MultimodalInputs``)."""

    items: list[WireImage] = msgspec.field(default_factory=list)
    mrope_positions: WireTensor | None = None
    mrope_position_delta: int = 0


def tensor_to_wire(t: torch.Tensor) -> WireTensor:
    import torch

    t = t.detach().to("cpu").contiguous()
    # Viewed as bytes, any dtype (bfloat16 too, which numpy lacks) is copied out the same way.
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return WireTensor(str(t.dtype).removeprefix("torch."), list(t.shape), data)


def tensor_from_wire(w: WireTensor) -> torch.Tensor:
    import torch

    if w.dtype not in DTYPES:
        raise ValueError(f"unsupported tensor dtype {w.dtype!r} in a multimodal request")
    dtype = getattr(torch, w.dtype)
    numel = 1
    for n in w.shape:
        numel *= n
    if numel == 0:
        return torch.empty(w.shape, dtype=dtype)
    item = torch.empty((), dtype=dtype).element_size()
    if len(w.data) != numel * item:
        raise ValueError(f"a multimodal tensor of shape {w.shape} ({w.dtype}) needs {numel * item} bytes, "
                         f"got {len(w.data)}")
    # bytearray: frombuffer wants a writable buffer, and the tensor must own its memory.
    return torch.frombuffer(bytearray(w.data), dtype=torch.uint8).view(dtype).reshape(w.shape)


def to_wire(mm: MultimodalInputs) -> WireMultimodal:
    items = [WireImage(tensor_to_wire(i.pixel_values), tuple(int(x) for x in i.grid_thw), i.offset, i.length, i.hash)
             for i in mm.items]
    positions = tensor_to_wire(mm.mrope_positions) if mm.mrope_positions is not None else None
    return WireMultimodal(items, positions, int(mm.mrope_position_delta))


def from_wire(w: WireMultimodal) -> MultimodalInputs:
    from framework.multimodal.inputs import ImageItem, MultimodalInputs

    items = [ImageItem(pixel_values=tensor_from_wire(i.pixel_values), grid_thw=tuple(i.grid_thw), offset=i.offset,
                       length=i.length, hash=i.hash) for i in w.items]
    positions = tensor_from_wire(w.mrope_positions) if w.mrope_positions is not None else None
    return MultimodalInputs(items=items, mrope_positions=positions, mrope_position_delta=w.mrope_position_delta)
