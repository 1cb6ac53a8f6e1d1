"""Time to resume a Megatron-LM run at a new topology (issue 41), against
Megatron's own load at the source topology (the floor) measured in the same
run. Prints measurements and ratios; asserts nothing.

The checkpoint: a legacy-format TP=2 PP=2 DP=2 run with the distributed
optimizer (bf16 weights, fp32 masters, Adam moments; >= 1 GiB), written once
by the real megatron-core on CPU (tests/fixtures/make_megatron.py, scaled)
under bench/out/.

  floor    Megatron's own load at the source topology, as Megatron-LM's
           load_checkpoint does for this format: 8 gloo ranks (TP=2 PP=2
           DP=2) torch.load their mp_rank_TT_PPP/model_optim_rng.pt, load the
           model and optimizer state dicts, and DistributedOptimizer
           .load_parameter_state(distrib_optim.pt) (DP rank 0 reads, scatters).
  ckptfs   ckptfs mount (no index yet), then megatron-core's
           dist_checkpointing.load of <mount>/torch_dist/iter_N at TP=1 PP=2
           DP=2 (4 gloo ranks; fully_reshardable: each rank reads the states of
           its stage), model and optimizer load_state_dict, as
           tests/integration/megatron_torch_dist_resume.py does.
  local    the same torch_dist/ files copied to local disk, loaded the same
           way: megatron-core's own cost of this layout, without ckptfs.

Each side: the load's own time (slowest rank, from a barrier after the model
and optimizer are built to the last state applied), the wall time including
the process start and the model build, and the peak RSS of the largest process
(GNU time); ckptfs adds the mount with its index build and the daemon's VmHWM.
Source page cache is dropped (fadvise) before each timed run. The floor runs
8 processes and ckptfs 4 on this machine's cores, each with one OpenMP thread
(torchrun's default); both build the same model.

    python bench/megatron_resume_bench.py [--layers 8] [--hidden 1024] [--bin build/ckptfs]
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "fixtures"))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
from dcp_bench import cold_mount, drop_cache, tagged, vm_hwm_kib  # noqa: E402
from ds_bench import files_under  # noqa: E402


def worker(rank, o, port, mode, path):
    import torch
    import torch.distributed as dist
    import make_megatron as mk
    import megatron_torch_dist_resume as resume
    mk.LAYERS, mk.HIDDEN, mk.FFN, mk.HEADS = o.layers, o.hidden, o.ffn, o.heads
    mk.cpu_only()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=o.tp * o.pp * o.dp)
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(o.tp, o.pp)
    chunks, ddp, opt = mk.build(o, step=False)
    resume.prepare_to_load(opt)
    dist.barrier()
    t0 = time.perf_counter()
    if mode == "floor":
        rank_dir = os.path.join(path, f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}_"
                                      f"{ps.get_pipeline_model_parallel_rank():03d}")
        sd = torch.load(os.path.join(rank_dir, "model_optim_rng.pt"), weights_only=False, map_location="cpu")
        chunks[0].load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])
        opt.load_parameter_state(os.path.join(rank_dir, "distrib_optim.pt"))
    else:
        resume.load_torch_dist(chunks, opt, path)
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"LOAD_SECONDS {t.item():.3f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def run_worker(mode, tp, pp, dp, path, a):
    """This script as a worker: wall time, the load's time, peak RSS (KiB)."""
    # One OpenMP thread per rank, as torchrun sets for several processes per
    # node: torch's default (a thread per core, spinning while idle) in 4-8
    # ranks on 2 cores starves whatever serves their reads.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    r = subprocess.run(["/usr/bin/time", "-f", "MAXRSS_KB %M", sys.executable, os.path.abspath(__file__), "--worker",
                        mode, str(tp), str(pp), str(dp), path, "--layers", str(a.layers), "--hidden", str(a.hidden)],
                       capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        print(r.stdout[-2000:], r.stderr[-4000:])
        raise SystemExit(f"{mode} load failed")
    load = float(tagged(r.stdout, "LOAD_SECONDS")[1])
    rss = int(tagged(r.stderr, "MAXRSS_KB")[1])
    return wall, load, rss


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "ckptfs"))
    ap.add_argument("--worker", nargs=5, metavar=("MODE", "TP", "PP", "DP", "PATH"))
    a = ap.parse_args()
    o = argparse.Namespace(mode="legacy", out=None, vp=None, dist_opt=True, bf16=True, arch="gpt", experts=None, ep=1,
                           bucket_size=None, layers=a.layers, hidden=a.hidden, ffn=4 * a.hidden, heads=16)
    if a.worker:
        import torch.multiprocessing as mp
        import make_megatron as mk
        from ports import free_port
        mode, tp, pp, dp, path = a.worker
        o.tp, o.pp, o.dp = int(tp), int(pp), int(dp)
        mk.preload_megatron()
        mp.start_processes(worker, args=(o, free_port(), mode, path), nprocs=o.tp * o.pp * o.dp,
                           start_method="fork")
        return

    ck = os.path.join(HERE, "out", f"megatron-legacy-distopt-tp2-pp2-dp2-L{a.layers}-H{a.hidden}")
    if not os.path.exists(os.path.join(ck, "latest_checkpointed_iteration.txt")):
        shutil.rmtree(ck, ignore_errors=True)
        print(f"writing {ck} with megatron-core ...", flush=True)
        subprocess.run([sys.executable, os.path.join(ROOT, "tests", "fixtures", "make_megatron.py"), "legacy", ck,
                        "--tp", "2", "--pp", "2", "--dp", "2", "--dist-opt", "--bf16", "--layers", str(a.layers),
                        "--hidden", str(a.hidden), "--ffn", str(4 * a.hidden), "--heads", "16"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.rmtree(os.path.join(ck, "reference"), ignore_errors=True)
    src = files_under(ck, skip=(".ckptfs", "reference"))
    size = sum(os.path.getsize(f) for f in src)
    it = int(open(os.path.join(ck, "latest_checkpointed_iteration.txt")).read())
    print(f"checkpoint: {ck}: {len(src)} files, {size / 2**30:.2f} GiB", flush=True)

    drop_cache(src)
    f_wall, f_load, f_rss = run_worker("floor", 2, 2, 2, os.path.join(ck, f"iter_{it:07d}"), a)
    print(f"floor: Megatron's legacy load at TP=2 PP=2 DP=2 (8 ranks): load {f_load:.2f} s, "
          f"wall {f_wall:.2f} s, peak RSS {f_rss / 1024:.0f} MiB", flush=True)

    work = tempfile.mkdtemp(prefix="mresume-bench-", dir=os.path.join(HERE, "out"))
    try:
        mnt = os.path.join(work, "mnt")
        t_mount, pid = cold_mount(a.bin, ck, mnt, src)
        local = os.path.join(work, "torch_dist")
        try:
            c_wall, c_load, c_rss = run_worker("torch_dist", 1, 2, 2, os.path.join(mnt, "torch_dist", f"iter_{it:07d}"), a)
            hwm = vm_hwm_kib(pid) if pid else -1
            shutil.copytree(os.path.join(mnt, "torch_dist"), local)
        finally:
            subprocess.run([a.bin, "umount", mnt], stdout=subprocess.DEVNULL)
        drop_cache(files_under(local))
        l_wall, l_load, l_rss = run_worker("torch_dist", 1, 2, 2, os.path.join(local, f"iter_{it:07d}"), a)
        total = t_mount + c_load
        print(f"ckptfs: mount (index built) {t_mount:.2f} s + megatron-core load of torch_dist/ at TP=1 PP=2 DP=2 "
              f"(4 ranks) {c_load:.2f} s = {total:.2f} s; wall with process start and model build "
              f"{t_mount + c_wall:.2f} s; peak RSS {c_rss / 1024:.0f} MiB, daemon {hwm / 1024:.0f} MiB", flush=True)
        print(f"the same torch_dist/ files copied to local disk, loaded the same way: load {l_load:.2f} s, "
              f"wall {l_wall:.2f} s, peak RSS {l_rss / 1024:.0f} MiB", flush=True)
        print(f"ratio ckptfs / floor: load (mount included) {total / f_load:.2f}x, "
              f"wall {(t_mount + c_wall) / f_wall:.2f}x, peak RSS {c_rss / f_rss:.2f}x")
        print(f"ratio ckptfs / local torch_dist copy: load (mount included) {total / l_load:.2f}x, "
              f"wall {(t_mount + c_wall) / l_wall:.2f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
