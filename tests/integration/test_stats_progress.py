"""`.ckptfs/stats` through a real mount, and progress lines of long CLI work
under a pseudo-terminal. The checkpoint is the bundled samples/dcp-tiny (no
torch needed), copied so that its index is private to the test."""
import json
import os
import re
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import ROOT, ckptfs_bin, fuse_usable, run

SAMPLE = ROOT / "samples" / "dcp-tiny"
TTY_TIMEOUT = 60


@pytest.fixture
def src(tmp_path):
    out = tmp_path / "ck"
    shutil.copytree(SAMPLE, out, ignore=shutil.ignore_patterns(".ckptfs"))
    return out


def read_stats(mnt):
    with open(Path(mnt) / ".ckptfs" / "stats") as f:
        return json.load(f)


def test_stats_after_du_find_ls_read_no_checkpoint_data(src, mounter):
    with mounter(src) as m:
        st = os.stat(m.path / ".ckptfs" / "stats")
        assert st.st_size == 0  # like /proc: read it to the end
        for cmd in (["du", "-sh", str(m.path)], ["find", str(m.path)], ["ls", "-laR", str(m.path)]):
            r = run(cmd, timeout=60)
            assert r.returncode == 0, (cmd, r.stderr)
        # Opened by name, never listed: diff -r of two mounts does not meet it.
        assert ".ckptfs/stats" not in run(["find", str(m.path)]).stdout
        assert "stats" not in os.listdir(m.path / ".ckptfs")
        s = read_stats(m.path)
        assert s["source_bytes_read"] == 0, s
        assert s["report_made"] is False, s
        assert s["lookups"] > 0 and s["getattrs"] + s["lookups"] > 0, s
        assert s["errors"] == 0, s
        # cat's bytes and python's json.load see the same document shape.
        cat = run(["cat", str(m.path / ".ckptfs" / "stats")], timeout=30)
        assert cat.returncode == 0
        assert set(json.loads(cat.stdout)) == set(s)

        params = sorted((m.path / "params").iterdir())
        assert params, "the sample has parameters"
        target = params[0] / "param.npy"
        size = target.stat().st_size
        r = subprocess.run(["cat", str(target)], capture_output=True, timeout=30)
        assert r.returncode == 0 and len(r.stdout) == size
        after = read_stats(m.path)
        assert after["reads"] > 0, after
        assert after["bytes"] >= size, after
        assert after["source_bytes_read"] > 0, after
        lat = after["read_latency_us"]
        assert lat["count"] == after["reads"], after
        for k in ("p50", "p90", "p99", "max"):
            assert isinstance(lat[k], (int, float)) and lat[k] >= 0, after
        assert 0 < lat["max"] and lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"], after
        assert after["uptime_s"] >= s["uptime_s"]
        assert isinstance(after["engine"], str) and isinstance(after["transforms"], str)
        # Reading the stats is not a read of the checkpoint.
        again = read_stats(m.path)
        assert again["source_bytes_read"] == after["source_bytes_read"]
        assert again["reads"] == after["reads"] and again["bytes"] == after["bytes"]
        assert again["report_made"] is False


def test_second_ls_lR_is_answered_by_the_kernel_and_topo_still_grows(src, mounter):
    """Directories are listed without OPENDIR, and the kernel caches their
    listings: a second `ls -lR` sends no listing request at all. topo/ gains
    entries while mounted; a cached listing of it must not hide a new one."""
    with mounter(src) as m:
        first = run(["ls", "-lR", str(m.path)], timeout=60)
        assert first.returncode == 0, first.stderr
        listed = read_stats(m.path)["listings"]
        assert listed > 0
        second = run(["ls", "-lR", str(m.path)], timeout=60)
        assert second.returncode == 0 and second.stdout == first.stdout
        assert read_stats(m.path)["listings"] == listed  # served from the kernel's cache
        topo = m.path / "topo"
        assert "tp1-pp1" not in os.listdir(topo)
        assert (topo / "tp1-pp1" / "layout.json").stat().st_size > 0  # planned on lookup
        assert "tp1-pp1" in os.listdir(topo)
        assert "tp1-pp1" in run(["ls", "-l", str(topo)], timeout=60).stdout
        assert os.listdir(m.path / "params") == [p.name for p in os.scandir(m.path / "params")]


def test_ls_lR_of_a_fresh_mount_needs_no_lookup_per_name(src, mounter):
    """Listings are READDIRPLUS answered from the tree: `ls -lR` gets every
    name with its attributes, so the kernel never looks a listed name up."""
    with mounter(src) as m:
        r = run(["ls", "-lR", str(m.path)], timeout=60)
        assert r.returncode == 0, r.stderr
        files = [ln for ln in r.stdout.splitlines() if ln.startswith("-")]
        assert len(files) >= 10, r.stdout
        s = read_stats(m.path)  # its own LOOKUP of "stats" (never listed)
        assert s["lookups"] <= 2, (s["lookups"], len(files))
        assert s["source_bytes_read"] == 0, s


def test_info_json_sizes_listed_before_any_read_are_their_bytes(src, mounter):
    """`ls -l` sizes info.json from the index records (its fragment lists are
    not read): what a later read returns has exactly that many bytes."""
    with mounter(src) as m:
        r = run(["ls", "-lR", "--time-style=+", str(m.path / "params")], timeout=60)
        assert r.returncode == 0, r.stderr
        listed, cur = {}, None
        for ln in r.stdout.splitlines():
            if ln.endswith(":") and not ln.startswith("-"):
                cur = ln[:-1]
            elif ln.startswith("-") and ln.endswith(" info.json"):
                listed[os.path.join(cur, "info.json")] = int(ln.split()[4])
        assert len(listed) >= 3, r.stdout
        for path, size in listed.items():
            data = open(path, "rb").read()
            assert len(data) == size, path
            info = json.loads(data)
            assert all(t.get("error") or t["fragments"] for t in info["tensors"].values()), path


def run_on_pty(args, env, timeout=TTY_TIMEOUT):
    """Runs `args` with stderr on a pseudo-terminal (stdout to a file);
    returns (exit code, what reached the terminal, stdout)."""
    master, slave = os.openpty()
    with tempfile.TemporaryFile() as out:
        p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=slave, env=env)
        os.close(slave)
        got = b""
        deadline = time.time() + timeout
        try:
            while True:
                left = deadline - time.time()
                if left <= 0:
                    p.kill()
                    raise AssertionError(f"{args} ran past {timeout}s; terminal so far: {got!r}")
                ready, _, _ = select.select([master], [], [], min(left, 1.0))
                if not ready:
                    if p.poll() is not None:
                        break
                    continue
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: every writer of the slave is gone
                    break
                if not chunk:
                    break
                got += chunk
        finally:
            os.close(master)
        rc = p.wait(timeout=timeout)
        out.seek(0)
        return rc, got.decode(errors="replace"), out.read().decode(errors="replace")


def tty_env(interval_ms="0"):
    env = dict(os.environ)
    env["CKPTFS_PROGRESS_INTERVAL_MS"] = interval_ms  # 0: redraw at every step, so the tiny sample draws
    env.pop("CKPTFS_FIXTURE_CACHE", None)
    return env


BYTES = r"\d+(?:\.\d)? (?:B|KiB|MiB|GiB)"


def check_progress(term, label):
    """A redrawn line with bytes and a rate, then a final line that ends the output."""
    lines = [l for l in re.split(r"\r\n|\r|\n", term.replace("\x1b[K", "")) if l]
    mine = [l for l in lines if l.startswith(label)]
    assert mine, term
    assert any(re.search(rf": {BYTES}.*, {BYTES}/s", l) and " in " not in l for l in mine), term
    final = mine[-1]
    assert re.search(rf": {BYTES} in \d+(?:\.\d)? s, {BYTES}/s$", final), term
    assert term.endswith("\r\n") or term.endswith("\n"), repr(term[-80:])
    return mine


def test_verify_deep_draws_progress_on_a_terminal(src, tmp_path):
    idx = tmp_path / "idx"
    rc, term, out = run_on_pty([ckptfs_bin(), "verify", "--deep", str(src), "--index", str(idx)], tty_env())
    assert rc == 0, (term, out)
    mine = check_progress(term, f"verifying {src} (deep): ")
    # With a known total: a percentage and, before the end, an ETA.
    assert any(re.search(r"\(\d+%\)", l) for l in mine), term
    assert any(re.search(r"\(\d+%\), .*, ETA ", l) for l in mine), term
    # The total is every byte the checks read: the count reaches it exactly.
    last = [l for l in mine if "%" in l][-1]
    m = re.search(rf": ({BYTES}) / ({BYTES}) \(100%\)", last)
    assert m and m.group(1) == m.group(2), term
    assert mine[-1] == [l for l in re.split(r"\r\n|\r|\n", term.replace("\x1b[K", "")) if l][-1], term


def test_index_force_draws_progress_on_a_terminal(src, tmp_path):
    idx = tmp_path / "idx"
    rc, term, out = run_on_pty([ckptfs_bin(), "index", "--force", str(src), "--index", str(idx)], tty_env())
    assert rc == 0, (term, out)
    check_progress(term, f"indexing {src}: ")


def test_cat_draws_progress_on_a_terminal_and_stdout_is_the_file(src, tmp_path):
    idx = tmp_path / "idx"
    key = "model.embed.weight"
    plain = subprocess.run([ckptfs_bin(), "cat", str(src), key, "--index", str(idx)], capture_output=True, timeout=60)
    assert plain.returncode == 0 and plain.stderr == b"", plain.stderr
    rc, term, out = run_on_pty([ckptfs_bin(), "cat", str(src), key, "--index", str(idx)], tty_env())
    assert rc == 0, term
    mine = check_progress(term, "cat params/")
    assert any(re.search(r"\(100%\)", l) for l in mine), term
    assert out == plain.stdout.decode(errors="replace")  # the bytes go to stdout; only stderr is the terminal


@pytest.mark.parametrize("quiet", ["-q", "--quiet"])
def test_quiet_draws_nothing(src, tmp_path, quiet):
    idx = tmp_path / "idx"
    for args in (["index", "--force", str(src)], ["verify", "--deep", str(src)]):
        rc, term, out = run_on_pty([ckptfs_bin(), *args, "--index", str(idx), quiet], tty_env())
        assert rc == 0, (args, term, out)
        assert term == "", (args, term)


def test_default_interval_draws_nothing_for_quick_work(src, tmp_path):
    """Work that ends before the first redraw draws nothing and finishes nothing."""
    idx = tmp_path / "idx"
    rc, term, out = run_on_pty([ckptfs_bin(), "verify", str(src), "--index", str(idx)], tty_env(interval_ms="600000"))
    assert rc == 0, (term, out)
    assert "verifying" not in term, term


def test_no_progress_when_stderr_is_a_pipe(src, tmp_path):
    idx = tmp_path / "idx"
    for args in (["index", "--force", str(src)], ["verify", "--deep", str(src)]):
        r = run([ckptfs_bin(), *args, "--index", str(idx)], env=tty_env(), timeout=60)
        assert r.returncode == 0, (args, r.stderr)
        assert r.stderr == "", (args, r.stderr)


def test_daemon_logs_progress_to_its_log_file(src, tmp_path):
    """The detached daemon (stderr not a terminal, a --log file) logs progress
    lines instead of drawing; the interval is shortened so the tiny sample logs."""
    if not fuse_usable():
        pytest.skip("no usable /dev/fuse or fusermount3")
    mnt, log = tmp_path / "mnt", tmp_path / "daemon.log"
    mnt.mkdir()
    env = tty_env()  # interval 0: a line per step instead of every 10 s
    r = run([ckptfs_bin(), "mount", str(src), str(mnt), "--index", str(tmp_path / "idx"), "--log", str(log)],
            env=env, timeout=60, stdin=subprocess.DEVNULL)
    try:
        assert r.returncode == 0, (r.stdout, r.stderr)
        assert os.path.ismount(mnt)
        assert "indexing" not in r.stderr and "verifying" not in r.stderr, r.stderr
        report = json.loads((mnt / ".ckptfs" / "report.json").read_text())
        assert report["source"] == str(src)
        assert read_stats(mnt)["report_made"] is True
        text = log.read_text()
        assert re.search(rf"ckptfs\[{re.escape(str(mnt))}\] info: indexing {re.escape(str(src))}: {BYTES} in ", text), text
        assert re.search(rf"ckptfs\[{re.escape(str(mnt))}\] info: verifying {re.escape(str(src))}: {BYTES} / {BYTES} \(\d+%\), {BYTES}/s", text), text
        assert re.search(rf"ckptfs\[{re.escape(str(mnt))}\] info: verifying {re.escape(str(src))}: {BYTES} in \d+(?:\.\d)? s, {BYTES}/s", text), text
        assert "\r" not in text and "\x1b" not in text
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True, timeout=60)
        deadline = time.time() + 30
        while os.path.ismount(mnt) and time.time() < deadline:
            time.sleep(0.05)
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True, timeout=60)


def walk_files(root):
    """Every file under root in name order, as ls -R and tar meet them."""
    out = []
    for d, dirs, files in os.walk(root):
        dirs.sort()
        out += [os.path.join(d, f) for f in sorted(files)]
    return out


def test_read_ahead_follows_cp_r_and_diff_r_and_nothing_else(src, mounter, tmp_path):
    """Cross-file read-ahead: GNU cp -r (inode order) and diff -r (name order)
    of params/ have the next files' sources asked ahead, every one of them then
    opened; the bytes equal those of a mount without it (the default). A reader
    of one file, or of the files backwards or interleaved, causes none."""
    with mounter(src, name="on", extra=["--read-ahead", "on"]) as on, mounter(src, name="off") as off:
        r = run(["cp", "-r", str(on.path / "params"), str(tmp_path / "copy")], timeout=120)
        assert r.returncode == 0, r.stderr
        s = read_stats(on.path)["read_ahead"]
        n = len(walk_files(on.path / "params"))
        assert s["on"] is True and s["files"] > 0 and s["bytes"] > 0, s
        # Unopened: at most two where the walk told name from inode order
        # (they agree over its first files) and two past params/'s end.
        assert s["hits"] >= n // 2 and s["files"] <= s["hits"] + 4, (s, n)
        assert run(["diff", "-r", str(on.path / "params"), str(off.path / "params")], timeout=120).returncode == 0
        assert run(["diff", "-r", str(tmp_path / "copy"), str(off.path / "params")], timeout=120).returncode == 0
        s_off = read_stats(off.path)["read_ahead"]
        assert s_off == {"on": False, "files": 0, "bytes": 0, "hits": 0}, s_off
        # diff -r walked the on-mount in name order: followed too.
        assert read_stats(on.path)["read_ahead"]["hits"] > s["hits"]
    files = None
    with mounter(src, name="one", extra=["-o", "read_ahead=on"]) as m:
        files = walk_files(m.path / "params")
        assert len(files) >= 12
        assert subprocess.run(["cat", files[0]], capture_output=True, timeout=30).returncode == 0
        for f in reversed(files):
            with open(f, "rb") as fh:
                fh.read()
        half = len(files) // 2
        for a, b in zip(files[:half], files[half:]):
            for f in (a, b):
                with open(f, "rb") as fh:
                    fh.read()
        s = read_stats(m.path)
        assert s["read_ahead"] == {"on": True, "files": 0, "bytes": 0, "hits": 0}, s
        assert s["bytes"] > 0
