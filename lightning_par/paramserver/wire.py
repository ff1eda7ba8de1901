"""Objects as bytes without pickle: a small JSON description plus raw tensor data.

The parameter servers receive two objects from worker 0: the
:class:`~lightning_par.paramserver.spec.ServerSpec` and an optimiser state; worker 0
receives each server's state slices. ``pickle.loads`` on such bytes would run whatever code
the sender chose (Python's documentation: "never unpickle data that could have come from an
untrusted or unauthenticated source"), so they travel as:

* a JSON document (UTF-8) whose values are ``None``, booleans, numbers, strings, lists and
  tagged forms for tuples, non-string dict keys, dtypes, tensors (an index into the data
  part), the optimiser class (a **name** from
  :data:`~lightning_par.paramserver.spec.ELEMENTWISE`) and the few dataclasses of the
  protocol (:data:`DATACLASSES`, rebuilt field by field);
* the tensors' bytes, concatenated.

:func:`decode` builds only those types: anything else (a pickled payload, an unknown tag,
class or dtype, sizes that do not add up) is a :class:`WireError`, raised before any of it
is used. Floats that JSON cannot hold exactly (``inf``, ``nan``) use Python's ``json``
extensions, read back bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch

from lightning_par.paramserver.clipping import GradClip
from lightning_par.paramserver.plan import Piece, ShardPlan
from lightning_par.paramserver.spec import ELEMENTWISE, ServerSpec

#: The dataclasses that may travel, by name.
DATACLASSES: dict[str, type] = {c.__name__: c for c in (ServerSpec, ShardPlan, Piece, GradClip)}
#: The optimiser classes that may travel, by name (element-wise: see the spec module).
OPTIMIZERS: dict[str, type] = {c.__name__: c for c in ELEMENTWISE}
#: The tensor dtypes that may travel.
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
              torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
}  # fmt: skip
MAGIC = b"LPW1"


class WireError(ValueError):
    """Bytes that are not an object :func:`encode` wrote (refused, not interpreted)."""


def encode(obj: Any) -> bytes:
    """``obj`` as bytes: magic, JSON length (8 bytes), JSON, tensor data."""
    tensors: list[torch.Tensor] = []
    doc = json.dumps(_to_json(obj, tensors)).encode()
    data = b"".join(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                    if t.numel() else b"" for t in tensors)  # fmt: skip
    return MAGIC + len(doc).to_bytes(8, "little") + doc + data


def decode(data: bytes) -> Any:
    """The object :func:`encode` wrote, or :class:`WireError`."""
    if data[:4] != MAGIC:
        raise WireError(
            "refused a message that is not lightning_par's wire format (a pickle or another "
            "program's bytes?): parameter servers accept no pickled objects"
        )
    size = int.from_bytes(data[4:12], "little")
    if 12 + size > len(data):
        raise WireError("a wire message shorter than its header says")
    try:
        doc = json.loads(data[12 : 12 + size].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WireError(f"a wire message with a broken description: {err}") from err
    reader = _Reader(memoryview(data)[12 + size :])
    out = _from_json(doc, reader)
    if reader.offset != len(reader.data):
        raise WireError("a wire message with bytes left over after its tensors")
    return out


def _to_json(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        dtype = str(obj.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise WireError(f"cannot send a tensor of dtype {obj.dtype}")
        return {"~t": [dtype, list(obj.shape)]}
    if isinstance(obj, torch.dtype):
        return {"~d": str(obj).removeprefix("torch.")}
    if isinstance(obj, type):
        if OPTIMIZERS.get(obj.__name__) is not obj:
            raise WireError(f"cannot send the class {obj.__name__}: only {sorted(OPTIMIZERS)}")
        return {"~o": obj.__name__}
    if dataclasses.is_dataclass(obj):
        name = type(obj).__name__
        if DATACLASSES.get(name) is not type(obj):
            raise WireError(f"cannot send a {name}")
        fields = {f.name: _to_json(getattr(obj, f.name), tensors) for f in dataclasses.fields(obj)}
        return {"~c": [name, fields]}
    if isinstance(obj, tuple):
        return {"~u": [_to_json(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [_to_json(v, tensors) for v in obj]
    if isinstance(obj, dict):
        return {"~m": [[_to_json(k, tensors), _to_json(v, tensors)] for k, v in obj.items()]}
    raise WireError(f"cannot send a {type(obj).__name__} ({obj!r:.60})")


class _Reader:
    def __init__(self, data: memoryview) -> None:
        self.data, self.offset = data, 0

    def tensor(self, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        numel = 1
        for n in shape:
            if not isinstance(n, int) or n < 0:
                raise WireError(f"a tensor of shape {shape}")
            numel *= n
        size = numel * torch.empty((), dtype=dtype).element_size()
        if self.offset + size > len(self.data):
            raise WireError("a wire message shorter than its tensors")
        raw = bytearray(self.data[self.offset : self.offset + size])
        self.offset += size
        if not size:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)


def _from_json(doc: Any, reader: _Reader) -> Any:
    if doc is None or isinstance(doc, (bool, int, float, str)):
        return doc
    if isinstance(doc, list):
        return [_from_json(v, reader) for v in doc]
    if not isinstance(doc, dict) or len(doc) != 1:
        raise WireError(f"an unknown form in a wire message: {str(doc):.60}")
    (tag, value), = doc.items()  # fmt: skip
    if tag == "~t":
        return reader.tensor(_dtype(value[0]), value[1])
    if tag == "~d":
        return _dtype(value)
    if tag == "~o":
        if value not in OPTIMIZERS:
            raise WireError(f"refused the optimiser {value!r}: only {sorted(OPTIMIZERS)}")
        return OPTIMIZERS[value]
    if tag == "~c":
        name, fields = value
        if name not in DATACLASSES:
            raise WireError(f"refused an object of type {name!r}")
        cls = DATACLASSES[name]
        names = {f.name for f in dataclasses.fields(cls)}
        if set(fields) - names:
            raise WireError(f"a {name} with unknown fields {sorted(set(fields) - names)}")
        return cls(**{k: _from_json(v, reader) for k, v in fields.items()})
    if tag == "~u":
        return tuple(_from_json(v, reader) for v in value)
    if tag == "~m":
        return {_from_json(k, reader): _from_json(v, reader) for k, v in value}
    raise WireError(f"an unknown tag {tag!r} in a wire message")


def _dtype(name: Any) -> torch.dtype:
    if name not in DTYPES:
        raise WireError(f"refused a tensor dtype {name!r}")
    return DTYPES[name]
