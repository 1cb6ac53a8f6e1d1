"""Writes a torch.distributed.checkpoint (DCP) checkpoint with the *metadata* of a
very large run and tiny tensors: many ranks x many tensors, one chunk per
(tensor, rank), for the scale benchmark (bench/scale_bench.py).

    python make_dcp_scale.py OUT --ranks 64 --tensors 16384 [--ref REF.npz]

Every byte is written by torch's own code, in one process: each "rank" gets a
`SavePlan` of `WriteItem`s (the shape `create_default_local_save_plan` makes for
a tensor sharded over dim 0), the coordinator's `create_default_global_save_plan`
and `dedup_save_plans` merge them into the global `Metadata`,
`FileSystemWriter.prepare_global_plan` / `write_data` write each rank's
`__<r>_0.distcp` (torch.save per item) and `FileSystemWriter.finish` pickles
`.metadata`. Only the collectives are skipped (there is no process group:
the plans are passed by hand), so the result is what `dcp.save` writes on
`--ranks` ranks. Keys are those of a nested state dict {"model": ..., "optim": {"state": ...}}
(`model.layers.<i>.<p>`, `optim.state.layers.<i>.<p>.exp_avg` / `.exp_avg_sq`).

Each chunk is `--rows` rows of `--cols` float32 values, equal to
f(tensor, row, col) below, so any element can be checked. With `--ref`, the
full values of a sample of tensors are saved as an npz keyed by the paths the
mount serves them at (`params/<fqn>/param.npy`, `params/<fqn>/exp_avg.npy`).
"""
import argparse
import dataclasses
import os
import sys
import time

import numpy as np
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_global_save_plan
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans

PARAMS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
          "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
          "mlp.down_proj.weight", "input_layernorm.weight")
STATES = (None, "exp_avg", "exp_avg_sq")


def names(n_tensors):
    """(fqn, state) pairs: params and their two Adam states, layer by layer."""
    out = []
    per_layer = len(PARAMS) * len(STATES)
    for i in range((n_tensors + per_layer - 1) // per_layer):
        for p in PARAMS:
            for s in STATES:
                if len(out) < n_tensors:
                    out.append((f"layers.{i}.{p}", s))
    return out


def key_of(fqn, state):
    return f"model.{fqn}" if state is None else f"optim.state.{fqn}.{state}"


def path_of(fqn, state):
    return ("model", fqn) if state is None else ("optim", "state", fqn, state)


def value(t, rows, cols, row0):
    """The chunk of tensor #t starting at global row row0: exact in float32."""
    r = np.arange(row0, row0 + rows, dtype=np.float64)[:, None]
    c = np.arange(cols, dtype=np.float64)[None, :]
    return ((t % 997) * 1000.0 + r * 7.0 + c * 0.5).astype(np.float32)


class ChunkPlanner(DefaultSavePlanner):
    """resolve_data computes the chunk instead of looking it up in a state dict."""

    def __init__(self, ids, rows, cols):
        super().__init__()
        self.ids, self.rows, self.cols = ids, rows, cols

    def resolve_data(self, item):
        t = self.ids[item.index.fqn]
        return torch.from_numpy(value(t, self.rows, self.cols, item.index.offset[0]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--tensors", type=int, default=16384)
    ap.add_argument("--rows", type=int, default=1, help="rows per chunk")
    ap.add_argument("--cols", type=int, default=4)
    ap.add_argument("--ref", help="write the full values of a sample of tensors here (npz)")
    ap.add_argument("--sample", type=int, default=24)
    a = ap.parse_args()
    if os.path.exists(os.path.join(a.out, ".metadata")):
        sys.exit(f"{a.out} already holds a checkpoint")
    t0 = time.time()
    pairs = names(a.tensors)
    keys = [key_of(f, s) for f, s in pairs]
    ids = {k: i for i, k in enumerate(keys)}
    gshape = torch.Size([a.ranks * a.rows, a.cols])
    props = TensorProperties(dtype=torch.float32)
    planner_data = {k: path_of(f, s) for k, (f, s) in zip(keys, pairs)}
    plans = []
    for r in range(a.ranks):
        off = torch.Size([r * a.rows, 0])
        items = [WriteItem(index=MetadataIndex(k, off), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=off, sizes=torch.Size([a.rows, a.cols])),
                                                       properties=props, size=gshape))
                 for k in keys]
        plans.append(SavePlan(items, planner_data=planner_data if r == 0 else {}))
    print(f"plans: {a.ranks} x {len(keys)} items in {time.time() - t0:.1f} s", flush=True)
    writer = FileSystemWriter(a.out, sync_files=False)
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    plans = [writer.prepare_local_plan(p) for p in plans]
    plans = dedup_save_plans(plans)
    global_plan, metadata = create_default_global_save_plan(plans)
    metadata = dataclasses.replace(metadata, planner_data=planner_data)
    global_plan = writer.prepare_global_plan(global_plan)
    planner = ChunkPlanner(ids, a.rows, a.cols)
    results = []
    for r, plan in enumerate(global_plan):
        results.append(writer.write_data(plan, planner).value())
        if r % 8 == 7:
            print(f"  wrote {r + 1}/{a.ranks} rank files ({time.time() - t0:.0f} s)", flush=True)
    writer.finish(metadata, results)
    md = os.path.getsize(os.path.join(a.out, ".metadata"))
    print(f"{a.ranks * len(keys)} chunks, .metadata {md / 2**20:.1f} MiB, {time.time() - t0:.0f} s")
    if a.ref:
        rng = np.random.default_rng(0)
        ref = {}
        for t in sorted(set(rng.integers(0, len(keys), a.sample).tolist()) | {0, len(keys) - 1}):
            fqn, state = pairs[t]
            full = value(t, a.ranks * a.rows, a.cols, 0)
            ref[f"params/{fqn}/{'param' if state is None else state}.npy"] = full
        np.savez(a.ref, **ref)


if __name__ == "__main__":
    main()
