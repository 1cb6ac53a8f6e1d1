"""ckptfs for torch: tensors as torch tensors, and a DCP StorageReader.

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    import ckptfs.torch

    sd = {"model": model.state_dict(), "optim": optim_state_dict}   # DTensors at any placement
    dcp.load(sd, storage_reader=ckptfs.torch.StorageReader("/ckpt/global_step1000"),
             planner=DefaultLoadPlanner(allow_partial_load=True))

Any checkpoint ckptfs reads (DeepSpeed, Megatron legacy / torch_dist / zarr,
DCP, ...) loads at the caller's world size and placements; each rank reads only
the boxes of its own shards.

Keys. The reader offers every tensor under the keys `key_map(info)` returns
(default_keys below): a parameter under its params/ name, bare and with
"model." in front; an optimizer state under "optim.state.<name>.<state>" and
"optimizer.state.<name>.<state>" (the flattened keys of
get_state_dict(model, optim) saved as {"model": ..., "optim": ...}), the
optimizer's step count included where the checkpoint keeps one per parameter
(params/<name>/step: DeepSpeed, Megatron, DCP); it is never guessed from the
training iteration, which can differ. Pass your own key_map for other names (a model whose module names
differ from the checkpoint's). Non-tensor entries (other/<name>: DCP's bytes
entries, param_groups values, train state) are offered under their own key as
bytes the planner unpickles. With the default keys, the param groups a family
reader made from groups saved with integer ids (DeepSpeed, verl, Megatron) are
offered as dcp/ offers them, "optim.param_groups.<i>.<name>" and
"optimizer.param_groups.<i>.<name>", `params` the members' names (so
set_state_dict restores the learning rate and the rest); a key_map may rename
the members, so with one they are not. Keys the checkpoint does not have
(another optimizer's param_groups layout) need allow_partial_load=True; they
keep the values the caller's optimizer was built with.

view="dcp": the keys and chunks of the mount's dcp/ (the same plan, made by the
same C++ code, and the same .metadata bytes): model.<fqn> from the fp32 master
where there is one, optim.state.<fqn>.<state> and optimizer.state.<fqn>.<state>;
each item reads its box straight into the destination instead of unpickling a
torch.save archive.

view="hf": the tensors of the checkpoint's hf/ export instead, under their
Hugging Face names (Megatron's fused QKV split, SwiGLU fc1 split, torchtitan's
RoPE permutation: whatever hf/ serves), for models named the Hugging Face way
(transformers; torchtitan through its state-dict adapter). Each item reads the
rows of its box from the hf/ safetensors file (a column box reads its rows whole).
"""
from __future__ import annotations

import io
import json
import math
import os
import pickle
import struct
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch.distributed.checkpoint import StorageReader as _DcpStorageReader
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

import ckptfs
from ckptfs import Checkpoint, TensorInfo
from ckptfs import _ckptfs as _core

__all__ = ["read", "StorageReader", "default_keys"]


def _torch_dtype(name: str) -> torch.dtype:
    d = getattr(torch, name, None)
    if not isinstance(d, torch.dtype):
        raise TypeError(f"torch has no dtype {name}")
    return d


def read(ck: Checkpoint, name: str, state: str = "param", box: Any = None, dtype: Any = None,
         out: Optional[torch.Tensor] = None, pin_memory: bool = False, device: Any = None) -> torch.Tensor:
    """Checkpoint.read as a torch tensor (bfloat16 and fp8 included).

    `device` ("cuda", "cuda:1", a torch.device): the tensor is made in that
    device's memory and filled there: the source spans go up once from pinned
    staging and the merge / padding strip / widening / mean run on the GPU into
    it, with no device-to-host copy and no full-size host buffer. `out` may be
    a contiguous CUDA tensor too (its device wins). Host tensors: `pin_memory`
    allocates the result pinned."""
    t = ck.tensor(name, state)
    dt = ckptfs._dtype_name(dtype) or t.dtype
    if out is None:
        offsets, lengths = ckptfs._box(box, t.shape)
        shape = lengths if lengths is not None else list(t.shape)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        if dev.type == "cuda":
            out = torch.empty(shape, dtype=_torch_dtype(dt), device=dev)
        else:
            out = torch.empty(shape, dtype=_torch_dtype(dt), pin_memory=pin_memory)
            if device is not None:
                out = out.to(dev)
    _read_into(ck, t, box, dt, out)
    return out


def _read_into(ck: Checkpoint, t: TensorInfo, box: Any, dtype: str, out: torch.Tensor) -> None:
    """ck.read into `out`, host or CUDA memory; a CUDA tensor is written after
    the work queued on its device's current stream."""
    if out.device.type == "cuda":
        if not out.is_contiguous():
            raise ValueError("out must be a contiguous tensor")
        stream = torch.cuda.current_stream(out.device).cuda_stream
        ck.read(t.name, t.state, box=box, dtype=dtype, out=out, stream=stream)
    elif out.device.type == "cpu":
        ck.read(t.name, t.state, box=box, dtype=dtype, out=out)
    else:
        raise ValueError(f"out must be host or CUDA memory, not {out.device}")


# The element conversions the read engine renders (the core's own rule): identity,
# bf16 / f16 / fp8 widened to float32, float32 rounded to bf16 / f16.
_renders = _core.renders


def default_keys(t: TensorInfo) -> list[str]:
    """The state-dict keys a tensor is offered under (see the module doc)."""
    if t.role == "param":
        return [t.name, "model." + t.name]
    if t.role == "optim_state":
        return [f"optim.state.{t.name}.{t.state}", f"optimizer.state.{t.name}.{t.state}"]
    return [t.name]


class StorageReader(_DcpStorageReader):
    """torch.distributed.checkpoint.StorageReader over any checkpoint ckptfs reads.

    `src`: the checkpoint directory (or pass checkpoint_id to dcp.load);
    `index`: where its index lives (ckptfs.open's default otherwise);
    `key_map`: TensorInfo -> key or keys (default_keys; view="params" only);
    `view`: "params" (every tensor and optimizer state), "dcp" (dcp/'s keys) or "hf" (the hf/ export)."""

    def __init__(self, src: Union[str, os.PathLike, None] = None, index: Optional[str] = None,
                 key_map: Optional[Callable[[TensorInfo], Union[str, Iterable[str]]]] = None, view: str = "params",
                 **open_kwargs: Any):
        super().__init__()
        if view not in ("params", "dcp", "hf"):
            raise ValueError(f"view must be 'params', 'dcp' or 'hf', not {view!r}")
        self.src = None if src is None else str(src)
        self.index = index
        self.view = view
        self.key_map = key_map or default_keys
        self.open_kwargs = open_kwargs
        self.ck: Optional[Checkpoint] = None
        self._by_key: dict[str, Any] = {}

    # -- StorageReader --------------------------------------------------------
    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        if checkpoint_id is not None and str(checkpoint_id) != self.src:
            self.src, self.ck = str(checkpoint_id), None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return os.path.isdir(checkpoint_id)

    def _open(self) -> Checkpoint:
        if self.ck is None:
            if self.src is None:
                raise ValueError("ckptfs.torch.StorageReader: no checkpoint directory (pass src or checkpoint_id)")
            self.ck = ckptfs.open(self.src, self.index, **self.open_kwargs)
        return self.ck

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Every tensor as one chunk of its global shape, under its keys."""
        ck = self._open()
        md: dict[str, TensorStorageMetadata] = {}
        self._by_key = {}
        if self.view == "dcp":
            # dcp/.metadata as the mount serves it; the keys' tensors from the same plan.
            with ck.open_file("dcp/.metadata") as f:
                md = pickle.loads(f.read())
            by_id = {t.id: t for t in ck.tensors()}
            rows, _left_out = ck._c.dcp_plan()
            for key, alias, tid, _chunks, literal in rows:
                for k in (key, alias):
                    if k:  # a literal entry (DeepSpeed, verl and FSDP rank files' param groups): its bytes
                        self._by_key[k] = by_id[tid] if tid >= 0 else bytes(literal)
            return md
        if self.view == "hf":
            for key, t in _hf_tensors(ck).items():
                self._by_key[key] = t
                md[key] = _chunk_md(t.dtype, t.shape)
            return Metadata(state_dict_metadata=md)
        for t in ck.tensors():
            keys = self.key_map(t)
            for key in [keys] if isinstance(keys, str) else keys:
                if key in self._by_key:
                    o = self._by_key[key]
                    raise ckptfs.Error(f"cannot map {self.src}: key {key!r} names params/{o.name}/{o.state} and "
                                       f"params/{t.name}/{t.state}; pass a key_map that tells them apart")
                self._by_key[key] = t
                md[key] = BytesStorageMetadata() if t.dtype == "object" else _chunk_md(t.dtype, t.shape)
        if self.key_map is default_keys:
            # The param groups the family reader made (DeepSpeed, verl, Megatron:
            # `.params` are the checkpoint's FQNs, which a key_map may rename),
            # as dcp/ offers them, where the checkpoint has no entry of the key.
            for key, data in ck._c.family_entries():
                for k in (key, "optimizer." + key[len("optim."):] if key.startswith("optim.") else None):
                    if k and k not in self._by_key:
                        self._by_key[k] = bytes(data)
                        md[k] = BytesStorageMetadata()
        return Metadata(state_dict_metadata=md)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not self._by_key:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """Each item reads its box of the global tensor straight into the
        destination when it is contiguous (host or CUDA memory) of a dtype the
        engine renders (the source's, or float32 widened from bf16 / f16 / fp8,
        or bf16 / f16 rounded from float32): a CUDA destination is filled on
        its GPU, merges and widening included, with no host round trip."""
        ck = self._open()
        hf_files: dict[str, io.BufferedReader] = {}  # view="hf": each file opened (and checked) once
        try:
            for req in plan.items:
                self._read_item(ck, req, planner, hf_files)
        finally:
            for f in hf_files.values():
                f.close()
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_item(self, ck: Checkpoint, req: Any, planner: LoadPlanner, hf_files: dict) -> None:
        t = self._by_key[req.storage_index.fqn]
        if isinstance(t, bytes):  # made by the family reader, as dcp/ serves it
            planner.load_bytes(req, io.BytesIO(t))
            return
        if req.type == LoadItemType.BYTE_IO:
            # A non-tensor entry: other/<name> holds the bytes the source
            # stored (DCP: what torch.save wrote; the planner unpickles them).
            with ck.open_file(f"other/{t.name}") as f:
                data = f.read()
            try:
                planner.load_bytes(req, io.BytesIO(data))
            except Exception as e:  # an unpicklable blob: say which entry and where
                raise ckptfs.Error(f"cannot load other/{t.name} of {self.src}: {e}") from e
            return
        dest = planner.resolve_tensor(req).detach()
        # The item's box of the global tensor: its chunk's offsets (dcp/ has
        # several chunks per tensor) plus the offsets inside the chunk.
        base = req.storage_index.offset or [0] * len(req.lengths)
        box = tuple(slice(b + o, b + o + n) for b, o, n in zip(base, req.storage_offsets, req.lengths))
        if isinstance(t, _HfTensor):
            if t.path not in hf_files:
                hf_files[t.path] = ck.open_file(t.path)
            dest.copy_(t.read_box(hf_files[t.path], box))
        else:
            want = str(dest.dtype).removeprefix("torch.")
            on_device = dest.device.type in ("cpu", "cuda")
            if on_device and dest.is_contiguous() and _renders(t.dtype, want):
                _read_into(ck, t, box, want, dest)
            else:  # a strided destination, another device or dtype: a contiguous read, then copy_
                dt = want if _renders(t.dtype, want) else t.dtype
                tmp = torch.empty(list(req.lengths), dtype=_torch_dtype(dt),
                                  device=dest.device if dest.device.type == "cuda" else "cpu")
                _read_into(ck, t, box, dt, tmp)
                dest.copy_(tmp)
        planner.commit_tensor(req, dest)


def _chunk_md(dtype: str, shape: tuple) -> TensorStorageMetadata:
    size = torch.Size(shape)
    return TensorStorageMetadata(properties=TensorProperties(dtype=_torch_dtype(dtype)), size=size,
                                 chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)])


# safetensors dtype names -> torch's (the ones hf/ writes).
_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


class _HfTensor:
    """A tensor of an hf/ safetensors file: where its bytes are in that file."""

    def __init__(self, path: str, dtype: str, shape: tuple, begin: int, end: int):
        self.path, self.dtype, self.shape, self.begin, self.end = path, dtype, shape, begin, end
        self.name, self.state = path, "hf"

    def read_box(self, f: io.BufferedReader, box: tuple) -> torch.Tensor:
        """The rows of the box's first dim (one contiguous range of the open
        hf/ file `f`), read into a tensor and sliced to the box."""
        dt = _torch_dtype(self.dtype)
        shape = list(self.shape)
        r0, r1 = (box[0].start, box[0].stop) if shape else (0, 1)
        rows = torch.empty([r1 - r0] + shape[1:], dtype=dt)
        row_bytes = dt.itemsize * math.prod(shape[1:])
        f.seek(self.begin + r0 * row_bytes)
        view = rows.reshape(-1).view(torch.uint8).numpy()
        n = f.readinto(view) if view.size else 0
        if n != view.size:
            raise ckptfs.Error(f"cannot read {self.path}: {n} of {view.size} bytes")
        return rows[(slice(None),) + tuple(box[1:])] if shape else rows.reshape([])


def _hf_tensors(ck: Checkpoint) -> dict[str, _HfTensor]:
    """Name -> _HfTensor for every tensor of hf/ (its index, else model.safetensors)."""
    if "hf" not in ck.listdir(""):
        raise ckptfs.Error(f"cannot read {ck.src}: no hf/ export")
    names = ck.listdir("hf")
    if "model.safetensors.index.json" in names:
        with ck.open_file("hf/model.safetensors.index.json") as f:
            files = sorted(set(json.loads(f.read())["weight_map"].values()))
    elif "model.safetensors" in names:
        files = ["model.safetensors"]
    else:
        with ck.open_file("hf/ERRORS") as f:
            why = f.read().decode(errors="replace").strip()
        raise ckptfs.Error(f"cannot read {ck.src}/hf: no model files ({why or 'hf/ERRORS is empty'})")
    out: dict[str, _HfTensor] = {}
    for name in files:
        path = f"hf/{name}"
        with ck.open_file(path) as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for key, v in header.items():
            if key == "__metadata__":
                continue
            b, e = v["data_offsets"]
            out[key] = _HfTensor(path, _ST_DTYPES[v["dtype"]], tuple(v["shape"]), 8 + n + b, 8 + n + e)
    return out
