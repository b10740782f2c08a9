"""A memory cgroup of one's own for one run, made under this process's cgroup as
bench/memcap.sh makes it (v2: memory.max, memory.swap.max 0; v1: memory.limit_in_bytes and,
where swap is accounted, memory.memsw.limit_in_bytes):
its peak is the run's alone, and a limit caps what the kernel lets the run hold. Where none
can be made (no root, no delegation, v2's rule against processes in an inner group), `make`
says why and the caller goes on without one."""
import os


def _own():
    """(version, the directory of this process's memory cgroup) or (None, why)."""
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError as e:
        return None, f"/proc/self/cgroup: {e}"
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        own = next((ln.split(":", 2)[2] for ln in lines if ln.startswith("0::")), None)
        return (2, "/sys/fs/cgroup" + own.rstrip("/")) if own is not None else (None, "no v2 entry")
    for ln in lines:
        _, controllers, path = ln.split(":", 2)
        if "memory" in controllers.split(","):
            return 1, "/sys/fs/cgroup/memory" + path.rstrip("/")
    return None, "no memory controller in /proc/self/cgroup"


def peak_file(version, group):
    return os.path.join(group, "memory.peak" if version == 2 else "memory.max_usage_in_bytes")


def read_peak(version, group):
    try:
        with open(peak_file(version, group)) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def enclosing_peak():
    """(peak bytes, path) of the memory cgroup this process is in (shared with whatever
    else runs there), or (None, why)."""
    version, group = _own()
    if version is None:
        return None, group
    peak = read_peak(version, group)
    return (peak, group) if peak is not None else (None, f"no {peak_file(version, group)}")


def oom_kills(version, group):
    name = "memory.events" if version == 2 else "memory.oom_control"
    try:
        for line in open(os.path.join(group, name)):
            k, v = line.split()
            if k == "oom_kill":
                return int(v)
    except (OSError, ValueError):
        pass
    return None


class Group:
    """One run's cgroup: `join()` in the child (a preexec_fn), `peak()` after it, `remove()`."""

    def __init__(self, version, path, limit):
        self.version, self.path, self.limit = version, path, limit

    def join(self):
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    def peak(self):
        return read_peak(self.version, self.path)

    def oom_kills(self):
        return oom_kills(self.version, self.path)

    def remove(self):
        parent = os.path.dirname(self.path)
        try:
            for pid in open(os.path.join(self.path, "cgroup.procs")).read().split():
                with open(os.path.join(parent, "cgroup.procs"), "w") as f:
                    f.write(pid)
        except OSError:
            pass
        try:
            os.rmdir(self.path)
        except OSError:
            pass


def make(name, limit=None):
    """(Group, None), or (None, why none could be made). `limit` in bytes, None: uncapped."""
    version, parent = _own()
    if version is None:
        return None, parent
    path = os.path.join(parent, name)
    try:
        os.mkdir(path)
    except OSError as e:
        return None, f"cannot make {path}: {e.strerror} (root or a delegated cgroup is needed)"
    g = Group(version, path, limit)
    try:
        if limit is not None:
            if version == 2:
                open(os.path.join(path, "memory.max"), "w").write(str(limit))
                if os.path.exists(os.path.join(path, "memory.swap.max")):
                    open(os.path.join(path, "memory.swap.max"), "w").write("0")
            else:
                open(os.path.join(path, "memory.limit_in_bytes"), "w").write(str(limit))
                # memory and swap together, where swap is accounted: no run over the cap in swap
                if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):
                    open(os.path.join(path, "memory.memsw.limit_in_bytes"), "w").write(str(limit))
        if g.peak() is None:
            raise OSError(0, f"{peak_file(version, path)} cannot be read")
        # Whether a process may join: v2 refuses one in a group whose parent has
        # controllers enabled for its children while holding processes itself.
        pid = os.fork()
        if pid == 0:
            try:
                g.join()
                os._exit(0)
            except OSError:
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        if os.WEXITSTATUS(status) != 0:
            raise OSError(0, f"a process cannot join {path}")
    except OSError as e:
        g.remove()
        return None, f"cgroup v{version} at {path}: {e.strerror or e}"
    return g, None
