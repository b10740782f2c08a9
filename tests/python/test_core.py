"""memascend.Volume, memascend.TensorStore, system_info() and the exceptions."""
import pytest

import memascend
from memascend import errors


def test_system_info_describes_the_machine():
    info = memascend.system_info()
    assert info["cpu"]["online_cpus"] >= 1
    assert info["page_size"] >= 4096 and info["memory"]["total_bytes"] > 0
    assert isinstance(info["io_uring"], bool)
    assert info["io_backend"] in ("io_uring", "threads")
    # The backend comes with why: every operation the engine uses, tried (Note [io_uring probe]).
    assert info["io_backend_reason"]
    checks = info["io_uring_detail"]["checks"]
    assert checks and checks[0]["name"] == "setup"
    if info["io_backend"] == "io_uring":
        assert all(c["ok"] for c in checks if c["name"] != "opcode probe"), checks
        assert [c["name"] for c in checks][-2:] == ["write_fixed", "read_fixed"]
    else:
        assert not all(c["ok"] for c in checks) or checks == []


def test_system_info_says_why_io_uring_is_off():
    import json
    import os
    import subprocess
    import sys
    env = dict(os.environ, MEMASCEND_DISABLE_IO_URING="1")
    out = subprocess.run([sys.executable, "-c",
                          "import json, memascend; print(json.dumps(memascend.system_info()))"],
                         env=env, check=True, capture_output=True, text=True).stdout
    info = json.loads(out)
    assert info["io_backend"] == "threads"
    assert "MEMASCEND_DISABLE_IO_URING" in info["io_backend_reason"]


def test_a_tensor_written_to_a_store_comes_back_after_reopening(tmp_path):
    path = str(tmp_path / "v.vol")
    payload = bytes(range(256)) * 1024  # 256 KiB
    with memascend.Volume.open_or_create(path, size=64 << 20) as vol:
        with memascend.TensorStore(vol, host_budget=1 << 20) as store:
            t = store.register("w", len(payload), dtype="float32")
            store.write(t, payload)
            with store.acquire(t) as lease:
                assert bytes(memoryview(lease)[:4]) == payload[:4]
                assert lease.nbytes == len(payload)
        assert vol.stats()["durable_objects"] >= 1
    with memascend.Volume.open(path) as vol, memascend.TensorStore(vol, host_budget=1 << 20) as s:
        assert "w" in s.stored_tensors()
        assert s.read(s.register("w", len(payload))) == payload


def test_errors_carry_the_status_code_and_a_builtin_base(tmp_path):
    with pytest.raises(errors.NotFoundError) as e:
        memascend.Volume.open(str(tmp_path / "missing.vol"))
    assert e.value.code == errors.StatusCode.NOT_FOUND
    assert isinstance(e.value, LookupError)
    # a file that is not a volume is refused and left as it was
    foreign = tmp_path / "notes.txt"
    foreign.write_bytes(b"my thesis" * 1000)
    with pytest.raises(errors.FailedPreconditionError):
        memascend.Volume.open(str(foreign))
    with pytest.raises(errors.FailedPreconditionError):
        memascend.Volume.open_or_create(str(foreign), size=64 << 20)
    assert foreign.read_bytes() == b"my thesis" * 1000


def test_bad_input_to_the_store_is_refused(tmp_path):
    with memascend.Volume.open_or_create(str(tmp_path / "v.vol"), size=64 << 20) as vol:
        with pytest.raises(errors.InvalidArgumentError):
            memascend.TensorStore(vol, host_budget=0)
        with memascend.TensorStore(vol, host_budget=1 << 20) as store:
            t = store.register("w", 4096)
            with pytest.raises(errors.AlreadyExistsError):
                store.register("w", 4096)
            with pytest.raises(errors.InvalidArgumentError):
                store.write(t, b"short")
            with pytest.raises(errors.InvalidArgumentError):
                store.register("x", 16, dtype="int7")
            lease = store.acquire(t)
            with pytest.raises(errors.FailedPreconditionError):
                store.close()  # a lease is held
            with pytest.raises(errors.FailedPreconditionError):
                vol.close()  # a store is open on it
            lease.release()
            with pytest.raises(errors.FailedPreconditionError):
                lease.address


def test_each_module_of_memascend_torch_stays_readable():
    """memascend.torch is a package whose modules each do one job: none over 500 lines."""
    import os
    import memascend.torch as mt
    folder = os.path.dirname(mt.__file__)
    sizes = {f: sum(1 for _ in open(os.path.join(folder, f)))
             for f in os.listdir(folder) if f.endswith(".py")}
    assert len(sizes) >= 8 and max(sizes.values()) <= 500, sizes


def _stub_classes(path):
    """{class name: {member name: ast node}} of a stub file."""
    import ast
    with open(path) as f:
        tree = ast.parse(f.read())
    out = {}
    for c in tree.body:
        if isinstance(c, ast.ClassDef):
            out[c.name] = {n.target.id if isinstance(n, ast.AnnAssign) else n.name: n
                           for n in c.body if isinstance(n, (ast.FunctionDef, ast.AnnAssign))}
    return out


def test_the_stubs_name_what_the_runtime_has():
    """_core.pyi and torch/optimizer.pyi (the package's type hints) installed beside the
    modules, each public name in them and the runtime alike, OffloadedAdamW's signatures
    too: a signature changed in optimizer.py is changed in its stub."""
    import inspect
    import os
    from memascend import _core
    import memascend.torch.optimizer as optimizer
    here = os.path.dirname(memascend.__file__)
    assert os.path.exists(os.path.join(here, "py.typed"))
    stubs = _stub_classes(os.path.join(here, "_core.pyi"))
    for cls in (_core.Volume, _core.TensorStore, _core.Lease):
        public = {n for n in dir(cls) if not n.startswith("_")}
        assert public == {n for n in stubs[cls.__name__] if not n.startswith("_")}, cls

    stub = _stub_classes(os.path.join(os.path.dirname(optimizer.__file__), "optimizer.pyi"))
    stub = stub["OffloadedAdamW"]
    cls = optimizer.OffloadedAdamW
    own = {n for n in vars(cls) if not n.startswith("_") or n in ("__init__", "__exit__")}
    assert own <= set(stub), own - set(stub)
    for name in own:
        runtime = inspect.signature(getattr(cls, name)) if callable(getattr(cls, name)) else None
        node = stub[name]
        if runtime is None or not hasattr(node, "args"):
            continue
        a = node.args
        names = [x.arg for x in a.posonlyargs + a.args] + \
                ([a.vararg.arg] if a.vararg else []) + [x.arg for x in a.kwonlyargs] + \
                ([a.kwarg.arg] if a.kwarg else [])
        assert names == list(runtime.parameters), (name, names, list(runtime.parameters))
