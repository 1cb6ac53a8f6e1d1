"""The Debian package, built by cpack from the build directory of $CKPTFS_BIN,
installs like the FUSE filesystems already on a node: ckptfs in /usr/bin, the
mount(8) helpers mount.fuse.ckptfs / mount.ckptfs in /usr/sbin (/sbin with
merged /usr), the man page, bash completion and the deployment examples, and
nothing else. Its Depends names the package of every shared library the binary
needs. Installing needs root and dpkg and is skipped otherwise; the package is
removed again whatever happens, and a ckptfs already installed on the machine
is never touched."""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import ckptfs_bin, run


def cache_value(cache, key):
    m = re.search(rf"^{re.escape(key)}:[A-Z]+=(.*)$", cache, re.M)
    return m.group(1) if m else None


@pytest.fixture(scope="module")
def build():
    """The CMake build directory holding $CKPTFS_BIN, and its cache."""
    d = Path(os.path.dirname(os.path.abspath(ckptfs_bin())))
    if not (d / "CMakeCache.txt").exists():
        pytest.skip(f"{d} is not a CMake build directory (no CMakeCache.txt)")
    for tool in ("cmake", "cpack", "dpkg-deb", "dpkg"):
        if shutil.which(tool) is None:
            pytest.skip(f"no {tool}")
    if not (d / "CPackConfig.cmake").exists():
        # Configured before the packaging rules existed: configure again, as the
        # next build there would.
        r = run(["cmake", str(d)], timeout=120)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return d, (d / "CMakeCache.txt").read_text()


@pytest.fixture(scope="module")
def deb(build, tmp_path_factory):
    """ckptfs_<version>_<arch>.deb, made by `cpack -G DEB` (which first builds
    `all` in the build directory: nothing to do after a full build)."""
    d, cache = build
    out = tmp_path_factory.mktemp("deb")
    r = run(["cpack", "-G", "DEB", "-B", str(out), "--config", str(d / "CPackConfig.cmake")], cwd=d, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    version = cache_value(cache, "CMAKE_PROJECT_VERSION")
    arch = run(["dpkg", "--print-architecture"]).stdout.strip()
    path = out / f"ckptfs_{version}_{arch}.deb"
    assert path.exists(), f"no {path.name} in {sorted(p.name for p in out.iterdir())}"
    return path, version


def has_man_page(build_dir):
    """CMake made the man page's install rule (it does when it finds help2man)."""
    return "ckptfs.1.gz" in (build_dir / "cmake_install.cmake").read_text()


def expected_files(build_dir):
    files = {
        "usr/bin/ckptfs",
        "usr/sbin/mount.fuse.ckptfs",
        "usr/sbin/mount.ckptfs",
        "usr/share/bash-completion/completions/ckptfs",
        "usr/share/doc/ckptfs/examples/ckptfs@.service",
        "usr/share/doc/ckptfs/examples/mnt-ck.mount",
        "usr/share/doc/ckptfs/examples/slurm-prolog.sh",
        "usr/share/doc/ckptfs/examples/slurm-epilog.sh",
    }
    if has_man_page(build_dir):
        files.add("usr/share/man/man1/ckptfs.1.gz")
    return files


def depends_names(depends):
    """Package names of a Depends field (alternatives and versions dropped)."""
    return {alt.split("(")[0].strip() for item in depends.split(",") for alt in item.split("|")}


def test_control_fields(deb):
    path, version = deb
    fields = {}
    for key in ("Package", "Version", "Section", "Maintainer", "Depends", "Description"):
        fields[key] = run(["dpkg-deb", "-f", str(path), key]).stdout.strip()
    assert fields["Package"] == "ckptfs"
    assert fields["Version"] == version
    assert fields["Section"] == "utils"
    assert "<" in fields["Maintainer"] and fields["Description"]
    assert "fuse3" in depends_names(fields["Depends"])  # fusermount3


def test_depends_covers_needed_libraries(deb, bin_path):
    """Every NEEDED library of the binary resolves (ldd) to a file whose
    package (dpkg -S) is in Depends: a library linked without updating the
    list in CMakeLists.txt fails here."""
    path, _ = deb
    if shutil.which("objdump") is None:
        pytest.skip("no objdump")
    needed = re.findall(r"NEEDED\s+(\S+)", run(["objdump", "-p", bin_path]).stdout)
    assert needed
    resolved = {}
    for line in run(["ldd", bin_path]).stdout.splitlines():
        m = re.match(r"\s*(\S+) => (/\S+)", line)
        if m:
            resolved[m.group(1)] = m.group(2)
        m = re.match(r"\s*(/\S+) \(0x", line)  # the dynamic loader
        if m:
            resolved[os.path.basename(m.group(1))] = m.group(1)
    depends = depends_names(run(["dpkg-deb", "-f", str(path), "Depends"]).stdout)
    missing = []
    for lib in needed:
        assert lib in resolved, f"ldd does not resolve {lib}"
        owner = None
        # dpkg records the path the package shipped (/lib or /usr/lib on merged /usr).
        for candidate in {resolved[lib], os.path.realpath(resolved[lib])}:
            for p in (candidate, candidate.replace("/usr/lib/", "/lib/", 1), candidate.replace("/lib/", "/usr/lib/", 1)):
                r = run(["dpkg", "-S", p])
                if r.returncode == 0:
                    owner = r.stdout.split(":")[0].strip()
                    break
            if owner:
                break
        if owner is None:
            pytest.skip(f"{lib} ({resolved[lib]}) belongs to no Debian package here")
        if owner not in depends:
            missing.append(f"{lib} ({owner})")
    assert not missing, f"Depends lacks the packages of {missing}"


def test_contents_are_only_the_install_rules(deb, build):
    """Binary, helper links, man page, completion, examples: no test or bench
    binaries, whatever else the build directory holds."""
    path, _ = deb
    build_dir, _ = build
    listing = run(["dpkg-deb", "-c", str(path)]).stdout.splitlines()
    files, links = set(), {}
    for line in listing:
        perms, name = line.split()[0], line.split(None, 5)[5]
        if perms.startswith("d"):
            continue
        if " -> " in name:
            name, target = name.split(" -> ")
            links[name.removeprefix("./")] = target
        files.add(name.removeprefix("./"))
    assert files == expected_files(build_dir)
    assert links == {"usr/sbin/mount.fuse.ckptfs": "../bin/ckptfs", "usr/sbin/mount.ckptfs": "../bin/ckptfs"}


@pytest.fixture
def installed(deb):
    """The package installed with dpkg -i, removed with dpkg -r afterwards."""
    path, version = deb
    if os.geteuid() != 0:
        pytest.skip("installing a package needs root")
    state = run(["dpkg-query", "-W", "-f=${Status}", "ckptfs"]).stdout
    if "installed" in state.split() or os.path.lexists("/usr/bin/ckptfs"):
        pytest.skip("ckptfs is already installed on this machine; not replacing it")
    try:
        r = run(["dpkg", "-i", str(path)], timeout=120)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        yield version
    finally:
        r = run(["dpkg", "-r", "ckptfs"], timeout=120)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        assert not os.path.lexists("/usr/bin/ckptfs")


def test_installed_package(installed, build):
    version = installed
    build_dir, _ = build
    r = run(["/usr/bin/ckptfs", "--version"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"ckptfs {version}"), r.stdout

    # mount -t fuse.ckptfs (fstab, .mount units) runs /sbin/mount.fuse.ckptfs.
    for helper in ("mount.fuse.ckptfs", "mount.ckptfs"):
        p = Path("/usr/sbin") / helper
        assert p.is_symlink() and os.readlink(p) == "../bin/ckptfs"
        assert p.resolve() == Path("/usr/bin/ckptfs").resolve()
        if Path("/sbin").resolve() == Path("/usr/sbin").resolve():  # merged /usr
            assert (Path("/sbin") / helper).resolve() == Path("/usr/bin/ckptfs").resolve()

    if has_man_page(build_dir):
        page = "/usr/share/man/man1/ckptfs.1.gz"
        text = run(["zcat", page]).stdout
        assert ".TH CKPTFS" in text and "mount" in text
        if shutil.which("man"):
            r = run(["man", "-l", page], env={**os.environ, "MANPAGER": "cat", "MAN_KEEP_FORMATTING": ""})
            assert r.returncode == 0 and "mount" in r.stdout, r.stderr

    completion = Path("/usr/share/bash-completion/completions/ckptfs")
    assert completion.is_file()
    r = run(["bash", "-c", f'source {completion}; COMP_WORDS=(ckptfs mo); COMP_CWORD=1; _ckptfs; '
             'echo "${COMPREPLY[@]}"; complete -p ckptfs'])
    assert r.returncode == 0 and r.stdout.splitlines() == ["mount", "complete -F _ckptfs ckptfs"], r.stdout + r.stderr
