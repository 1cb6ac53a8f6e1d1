"""ckptfs without a mount: any sharded training checkpoint, read at any topology.

The same core as the FUSE filesystem (index, views, read engine, transforms),
in-process: no /dev/fuse, no mount rights, and tensor bytes land in your
buffer without passing through the kernel twice.

    import ckptfs
    ck = ckptfs.open("/ckpt/global_step1000")       # builds or reuses the index
    ck.info()["family"]                             # "deepspeed", ... (ckptfs.families())
    for t in ck.tensors(): print(t.name, t.state, t.dtype, t.shape)
    w = ck.read("layers.0.mlp.fc1.weight")          # numpy array, the full tensor
    m = ck.read("layers.0.mlp.fc1.weight", state="exp_avg", box=(slice(0, 128), slice(None)))
    with ck.open_file("topo/tp2-pp1/tp1-pp0.safetensors") as f:   # any file of the tree
        blob = f.read()

Names are the ones the mount's params/ directory uses; `state` is "param",
"exp_avg", "exp_avg_sq", "fp32" ... as the tensor's files there are named.
Errors are ckptfs.Error (an OSError) with the core's "cannot <verb> <file>:
<reason>" text; a name that does not exist is a KeyError.
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from ckptfs._ckptfs import Error, _Checkpoint
from ckptfs._ckptfs import families as _families

__all__ = ["open", "families", "Checkpoint", "TensorInfo", "Error"]

# numpy's spelling of the dtypes ckptfs serves; bfloat16 and the fp8 formats
# have none (ml_dtypes provides them when installed).
_NUMPY = {
    "bool": np.bool_, "uint8": np.uint8, "int8": np.int8, "int16": np.int16, "int32": np.int32,
    "int64": np.int64, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64,
    "float16": np.float16, "float32": np.float32, "float64": np.float64,
    "complex64": np.complex64, "complex128": np.complex128,
}
try:  # optional: numpy dtypes for bfloat16 and fp8
    import ml_dtypes as _ml

    _NUMPY.update({"bfloat16": _ml.bfloat16, "float8_e4m3fn": _ml.float8_e4m3fn, "float8_e5m2": _ml.float8_e5m2,
                   "float8_e4m3fnuz": _ml.float8_e4m3fnuz, "float8_e5m2fnuz": _ml.float8_e5m2fnuz})
except ImportError:
    pass
# The dtypes numpy holds only through ml_dtypes (read passes their arrays as unsigned views).
_ML_DTYPES = {"bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the checkpoint, as params/ (or other/) shows it."""

    name: str              # params/<name>/ (other/<name> for role "other")
    state: str             # "param", "exp_avg", ...; "" for role "other"
    role: str              # "param", "optim_state" or "other"
    dtype: str             # torch spelling ("bfloat16"); "object" for a pickled non-tensor
    shape: tuple           # the global shape, whatever the sharding (a padded vocabulary: its true rows)
    key: str               # the checkpoint's own key
    error: str = ""        # non-empty: the tensor cannot be read, and why
    id: int = -1

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def _dtype_name(dtype: Any) -> Optional[str]:
    """"float32", np.float32, torch.float32 -> "float32"."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        return dtype.removeprefix("torch.")
    s = str(dtype)
    if s.startswith("torch."):
        return s[len("torch."):]
    return np.dtype(dtype).name


def _box(box: Any, shape: Sequence[int]):
    """A tuple of slices (step 1) over the leading dims -> (offsets, lengths)."""
    if box is None:
        return None, None
    if not isinstance(box, tuple):
        box = (box,)
    if len(box) > len(shape):
        raise IndexError(f"box of {len(box)} dims for a tensor of shape {list(shape)}")
    offsets, lengths = [], []
    for d, n in enumerate(shape):
        s = box[d] if d < len(box) else slice(None)
        if not isinstance(s, slice):
            raise TypeError(f"box dim {d}: a slice, not {type(s).__name__} (a box keeps every dim)")
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"box dim {d}: step {step}; boxes are contiguous ranges")
        offsets.append(start)
        lengths.append(max(0, stop - start))
    return offsets, lengths


class _ViewFile(io.RawIOBase):
    """A file of the virtual tree, read through the core (no FUSE)."""

    def __init__(self, c: _Checkpoint, path: str):
        super().__init__()
        ino, is_dir, size = c.stat(path)
        if is_dir:
            raise IsADirectoryError(path)
        c.open(ino)  # refuses files whose sources changed since indexing
        self._c, self._ino, self._size, self._pos, self.name = c, ino, size, 0, path

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b) -> int:
        view = np.frombuffer(b, dtype=np.uint8) if not isinstance(b, np.ndarray) else b.view(np.uint8)
        n = self._c.pread(self._ino, self._pos, view)
        self._pos += n
        return n

    @property
    def size(self) -> int:
        return self._size


class Checkpoint:
    """An opened checkpoint: its index, views and read engine (see ckptfs.open)."""

    def __init__(self, src: str, index: Optional[str] = None, *, engine: str = "auto", gpu: str = "auto",
                 rebuild: bool = False, family: Optional[str] = None):
        self.src = str(src)
        self._c = _Checkpoint(self.src, None if index is None else str(index), engine, gpu, rebuild, family)
        self._tensors = [TensorInfo(name=fqn, state=state, role=role, dtype=dtype, shape=tuple(shape), key=key,
                                    error=err, id=i)
                         for (i, key, role, fqn, state, dtype, shape, err, _alias) in self._c.tensors()]
        self._by_name = {(t.name, t.state): t for t in self._tensors}

    # -- what it holds -----------------------------------------------------
    def info(self) -> dict:
        """checkpoint.json of the tree (family, step, world size, topology, findings...)
        plus where the index lives and whether this open built it."""
        with self.open_file("checkpoint.json") as f:
            doc = json.loads(f.read())
        doc["index_dir"] = self._c.index_dir
        doc["index_built"] = self._c.built
        return doc

    def tensors(self) -> list[TensorInfo]:
        return list(self._tensors)

    def tensor(self, name: str, state: str = "param") -> TensorInfo:
        t = self._by_name.get((name, state))
        if t is None and state == "param":
            t = self._by_name.get((name, ""))  # other/<name>
        if t is None:
            states = sorted(s for (n, s) in self._by_name if n == name)
            hint = f" (states: {', '.join(states)})" if states else ""
            raise KeyError(f"no tensor {name!r} with state {state!r} in {self.src}{hint}")
        return t

    # -- reading -----------------------------------------------------------
    def read(self, name: str, state: str = "param", box: Any = None, dtype: Any = None, out: Any = None,
             stream: int = 0):
        """The tensor (or the sub-box `box`, a tuple of slices) as a numpy array,
        the bytes the mount's params/<name>/<state> file serves. `dtype`: None
        keeps the source's; "float32" widens bf16/fp16/fp8; "bfloat16" /
        "float16" round float32 to nearest even (as torch's .to()). `out`: a C-contiguous
        buffer to fill instead (anything speaking DLPack or the buffer protocol): host
        memory (numpy array, torch tensor, pinned or not), or CUDA device memory, which
        the GPU fills (merges, strips and widening run there, nothing comes back to the
        host; `stream`: the cudaStream_t whose queued work the writes follow, 0 the
        default stream). Its element count must be the box's. The GIL is released while
        reading."""
        t = self.tensor(name, state)
        if t.dtype == "object":
            raise TypeError(f"{name} is a pickled object, not a tensor: read other/{name} with open_file")
        dt = _dtype_name(dtype) or t.dtype
        offsets, lengths = _box(box, t.shape)
        if out is None:
            np_dtype = _NUMPY.get(dt)
            if np_dtype is None:
                raise TypeError(f"numpy has no {dt} (install ml_dtypes, pass dtype='float32', "
                                f"or use ckptfs.torch.read)")
            out = np.empty(tuple(lengths) if lengths is not None else t.shape, dtype=np_dtype)
        buf = out
        if isinstance(out, np.ndarray) and dt in _ML_DTYPES and out.dtype == _NUMPY.get(dt):
            buf = out.view(np.uint16 if out.dtype.itemsize == 2 else np.uint8)  # DLPack has no ml_dtypes
        self._c.read_into(t.id, dt, offsets, lengths, buf, stream)
        return out

    def open_file(self, path: str) -> io.BufferedReader:
        """Any file of the tree ("params/w/param.npy", "universal/...", "topo/tp2-pp1/tp0-pp0.safetensors",
        "hf/model.safetensors") as a read-only binary file object."""
        return io.BufferedReader(_ViewFile(self._c, path.strip("/")), buffer_size=1 << 20)

    def listdir(self, path: str = "") -> list[str]:
        return [name for name, _ in self._c.listdir(path.strip("/"))]

    def isdir(self, path: str) -> bool:
        return self._c.stat(path.strip("/"))[1]

    def getsize(self, path: str) -> int:
        return self._c.stat(path.strip("/"))[2]

    def verify(self, deep: bool = False, threads: int = 0) -> dict:
        """`ckptfs verify` (reads every tensor once): the report as a dict;
        findings under "findings", each naming the file and the problem."""
        return json.loads(self._c.verify(deep, threads))

    def device_info(self, ordinal: int = 0) -> dict:
        """The backend that fills CUDA buffers on device `ordinal` (made on first use):
        its name, whether its kernels matched the CPU's on the check plans (if not,
        reads into that device render on the host and only upload), and the device and
        pinned bytes it holds now (0 once idle for 2 s)."""
        name, trusted, why, held = self._c.device_info(ordinal)
        return {"name": name, "kernels_trusted": trusted, "why": why, "held_bytes": held}

    def stats(self) -> dict:
        """The counters .ckptfs/stats shows (reads, bytes, latency percentiles)."""
        return json.loads(self._c.stats())

    def __repr__(self) -> str:
        return f"ckptfs.Checkpoint({self.src!r}, {len(self._tensors)} tensors)"


def open(src: str, index: Optional[str] = None, **kwargs: Any) -> Checkpoint:  # noqa: A001 (like io.open)
    """Opens the checkpoint directory `src`, building its index when absent or
    stale (at `index`, else where the mount keeps it: <src>/.ckptfs/index, or
    ~/.cache/ckptfs/<hash> when <src> is read-only). Keywords: engine
    ("auto", "uring", "pread"), gpu ("auto", "on", "off"), rebuild (bool),
    family (one of families(): read `src` as that family where two could
    claim it; default: detect)."""
    return Checkpoint(src, index, **kwargs)


def families() -> dict[str, str]:
    """The checkpoint families ckptfs reads: {name: title}, the names
    info()["family"] and the `family` keyword use."""
    return dict(_families())

