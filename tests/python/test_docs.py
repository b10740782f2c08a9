"""docs/python.md against the code: its API reference names every public name of
memascend, memascend.errors and memascend.torch with the signature the code has, and
nothing the code lacks; and what the prose promises (opt.state, repr, the refusal of
add_param_group, the volume sized by the state) holds.

The API reference is the fenced ```python blocks of docs/python.md that open with
``# API: <module>``; each is Python stub syntax, read here with ast. ctest passes the
source tree in MEMASCEND_SOURCE_DIR (else the tree this file is in).
"""
import ast
import enum
import inspect
import os
import re

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (Debian: python3-torch)")

import memascend  # noqa: E402
import memascend.errors  # noqa: E402
import memascend.torch as mt  # noqa: E402
from memascend import errors  # noqa: E402

SOURCE = os.environ.get("MEMASCEND_SOURCE_DIR",
                        os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
DOC = os.path.join(SOURCE, "docs", "python.md")
MODULES = {"memascend": memascend, "memascend.errors": errors, "memascend.torch": mt}


def api_blocks():
    with open(DOC) as f:
        text = f.read()
    blocks = re.findall(r"^```python\n(# API: (\S+)\n.*?)^```", text, re.S | re.M)
    return {module: ast.parse(src) for src, module in blocks}


def public_names(module):
    """What a user may import: __all__ (and __version__), else what the module defines."""
    if hasattr(module, "__all__"):
        return set(module.__all__) | ({"__version__"} if hasattr(module, "__version__") else set())
    return {n for n, o in vars(module).items()
            if not n.startswith("_") and getattr(o, "__module__", None) == module.__name__}


def documented(tree):
    """{name: node} of a block's top level; imported names map to the ImportFrom."""
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.AnnAssign):
            out[node.target.id] = node
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                out[alias.asname or alias.name] = node
    return out


def literal(node):
    return eval(compile(ast.Expression(node), DOC, "eval"), {"torch": torch})


def doc_parameters(fn):
    """[(name, kind, default node or None)] of a documented def, self dropped."""
    a = fn.args
    plain = a.posonlyargs + a.args
    defaults = [None] * (len(plain) - len(a.defaults)) + list(a.defaults)
    out = [(x.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD, d) for x, d in zip(plain, defaults)]
    if a.vararg:
        out.append((a.vararg.arg, inspect.Parameter.VAR_POSITIONAL, None))
    out += [(x.arg, inspect.Parameter.KEYWORD_ONLY, d) for x, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append((a.kwarg.arg, inspect.Parameter.VAR_KEYWORD, None))
    return [p for p in out if p[0] != "self"]


def pybind_parameters(obj):
    """[(name, default text or None)] from a pybind11 function's signature line."""
    line = (obj.__doc__ or "").strip().splitlines()[0]
    inner = re.match(r"\w+\((.*)\) ->", line).group(1)
    params, depth, cur = [], 0, ""
    for ch in inner:
        depth += ch in "([{" and 1 or ch in ")]}" and -1 or 0
        if ch == "," and depth == 0:
            params.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        params.append(cur.strip())
    out = []
    for p in params:
        name, _, rest = p.partition(":")
        out.append((name.strip(), rest.split("=", 1)[1].strip() if "=" in rest else None))
    return [p for p in out if p[0] != "self"]


def check_signature(where, obj, node, method=False):
    if not callable(obj):
        raise AssertionError(f"{where}: documented as a function, is {type(obj).__name__}")
    doc = doc_parameters(node)
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        sig = None
    if sig is None or "pybind11" in type(obj).__name__ or type(obj).__name__ == "builtin_function_or_method" \
            or type(obj).__name__ == "instancemethod":
        real = pybind_parameters(obj)
        assert len(real) == len(doc), (where, [d[0] for d in doc], real)
        for (name, _, default), (rname, rdefault) in zip(doc, real):
            assert re.fullmatch(r"arg\d+", rname) or rname == name, (where, name, rname)
            assert (default is None) == (rdefault is None), (where, name, "a default or not")
            if default is not None:
                assert ast.unparse(default) == rdefault, (where, name, ast.unparse(default), rdefault)
        return
    real = list(sig.parameters.values())[1 if method else 0:]  # a method's self, any name
    assert [d[0] for d in doc] == [p.name for p in real], (where, doc, str(sig))
    ours = (getattr(obj, "__module__", "") or "").startswith("memascend")
    for (name, kind, default), p in zip(doc, real):
        pkind = inspect.Parameter.POSITIONAL_OR_KEYWORD if p.kind in (
            inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) else p.kind
        assert kind == pkind, (where, name, "kind", kind, pkind)
        assert (default is None) == (p.default is inspect.Parameter.empty), (where, name, "default")
        if default is not None and ours:  # torch's own defaults differ between versions
            assert literal(default) == p.default, (where, name, literal(default), p.default)


@pytest.fixture(scope="module")
def instances(tmp_path_factory):
    """A live object of every documented class, for its instance attributes."""
    d = tmp_path_factory.mktemp("docs")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = mt.OffloadedAdamW(model.parameters(), volume=str(d / "run.vol"))
    offload = mt.offload_parameters(model, opt)
    vol = memascend.Volume.open_or_create(str(d / "act.vol"), 64 << 20)
    store = memascend.TensorStore(vol, host_budget=1 << 20)
    lease = store.acquire(store.register("t", 64))
    objs = {"OffloadedAdamW": opt, "ParameterOffload": offload,
            "ActivationOffload": mt.offload_activations(store), "StepTrace": mt.StepTrace(),
            "Volume": vol,
            "TensorStore": store, "Lease": lease, "Error": errors.NotFoundError("x")}
    yield objs
    lease.release()
    offload.remove()
    opt.close()
    store.close()
    vol.close()


def test_the_docs_have_an_api_block_per_module():
    assert set(api_blocks()) == set(MODULES)


@pytest.mark.parametrize("module_name", sorted(MODULES))
def test_every_public_name_is_documented_and_every_documented_name_exists(module_name):
    module, names = MODULES[module_name], documented(api_blocks()[module_name])
    missing = public_names(module) - set(names)
    assert not missing, f"{module_name}: public but not in docs/python.md: {sorted(missing)}"
    for name, node in names.items():
        assert hasattr(module, name), f"{module_name}.{name} is documented but does not exist"
        if isinstance(node, ast.ImportFrom):  # a re-export: the same object there
            assert getattr(module, name) is getattr(MODULES[node.module], name), name
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            assert getattr(module, name) == literal(node.value), name


def members(cls, obj):
    """A class's public members: what it (and its bases of memascend) define, and a live
    instance's attributes."""
    own = set()
    for c in cls.__mro__:
        if (c.__module__ or "").startswith("memascend"):
            own |= {n for n in vars(c) if not n.startswith("_")}
    if obj is not None:
        own |= {n for n in getattr(obj, "__dict__", {}) if not n.startswith("_")}
    return own


@pytest.mark.parametrize("module_name", sorted(MODULES))
def test_every_class_member_is_documented_with_its_signature(module_name, instances):
    module = MODULES[module_name]
    for name, node in documented(api_blocks()[module_name]).items():
        obj = getattr(module, name)
        if isinstance(node, ast.FunctionDef):
            check_signature(f"{module_name}.{name}", obj, node)
            continue
        if not isinstance(node, ast.ClassDef):
            continue
        assert inspect.isclass(obj), name
        if node.bases:
            assert [ast.unparse(b).split(".")[-1] for b in node.bases] == \
                [b.__name__ for b in obj.__bases__], (name, "bases")
        live = instances.get(name)
        body = {}
        for m in node.body:
            if isinstance(m, ast.FunctionDef):
                body[m.name] = m
            elif isinstance(m, ast.AnnAssign):
                body[m.target.id] = m
            elif isinstance(m, ast.Assign):  # an enum member and its value
                target = m.targets[0].id
                body[target] = m
                assert getattr(obj, target) == literal(m.value), (name, target)
        if issubclass(obj, errors.Error) and obj is not errors.Error or issubclass(obj, enum.Enum):
            continue  # documented by its bases (and values)
        undocumented = members(obj, live) - set(body)
        assert not undocumented, f"{module_name}.{name}: not in docs/python.md: {sorted(undocumented)}"
        for mname, m in body.items():
            where = f"{module_name}.{name}.{mname}"
            if isinstance(m, ast.AnnAssign):
                assert hasattr(live if live is not None else obj, mname), f"{where} does not exist"
                continue
            if not isinstance(m, ast.FunctionDef):
                continue
            static = inspect.getattr_static(obj, mname)
            decorators = {ast.unparse(d) for d in m.decorator_list}
            if "property" in decorators:
                assert isinstance(static, property), f"{where} is not a property"
                continue
            assert ("staticmethod" in decorators) == isinstance(static, staticmethod), \
                f"{where}: staticmethod or not"
            check_signature(where, getattr(obj, mname), m, method=not isinstance(
                static, (staticmethod, classmethod)))


def test_opt_state_reads_the_state_as_torch_adamw_keeps_it(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    ref = torch.nn.Linear(8, 4)
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with mt.OffloadedAdamW(model.parameters(), lr=1e-2, volume=str(tmp_path / "v.vol")) as opt:
        for _ in range(3):
            x = torch.randn(5, 8)
            for m, o in ((model, opt), (ref, ref_opt)):
                o.zero_grad()
                m(x).square().sum().backward()
                o.step()
        assert len(opt.state) == 2 and list(opt.state) == list(model.parameters())
        for p, q in zip(model.parameters(), ref.parameters()):
            assert p in opt.state
            s = opt.state[p]
            assert set(s) == {"step", "exp_avg", "exp_avg_sq"}
            assert float(s["step"]) == 3 and s["exp_avg"].shape == p.shape
            assert torch.allclose(s["exp_avg"], ref_opt.state[q]["exp_avg"], atol=1e-6)
            assert torch.allclose(s["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"], rtol=1e-4)
            s["exp_avg"].zero_()  # a copy: the optimizer's state stays
            assert opt.state[p]["exp_avg"].abs().sum() > 0
        sd = opt.state_dict()["state"]
        assert torch.equal(opt.state[model.weight]["exp_avg_sq"], sd[0]["exp_avg_sq"])
        with pytest.raises(KeyError):
            opt.state[torch.zeros(1)]
        assert torch.zeros(1) not in opt.state
        with pytest.raises(TypeError):
            opt.state[model.weight] = {}  # read-only: load_state_dict writes a state
    with pytest.raises(errors.FailedPreconditionError):
        opt.state[model.weight]


def test_opt_state_has_master_weights_for_16_bit_parameters(tmp_path):
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    with mt.OffloadedAdamW(model.parameters(), volume=str(tmp_path / "v.vol")) as opt:
        s = opt.state[model.weight]
        assert set(s) == {"step", "exp_avg", "exp_avg_sq", "master"}
        assert s["master"].dtype == torch.float32
        assert torch.equal(s["master"].to(torch.bfloat16), model.weight.detach())


def test_repr_shows_the_volume_and_the_budget(tmp_path):
    path = str(tmp_path / "v.vol")
    opt = mt.OffloadedAdamW(torch.nn.Linear(8, 4).parameters(), volume=path)
    text = repr(opt)
    assert text.startswith("OffloadedAdamW (") and repr(path) in text
    assert f"host_budget: {opt.host_budget} ({opt.host_budget_reason}" in text
    assert "Parameter Group 0" in text and "lr: 0.001" in text
    opt.close()
    assert "volume: closed" in repr(opt)


def test_add_param_group_says_it_is_refused(tmp_path):
    doc = mt.OffloadedAdamW.add_param_group.__doc__
    assert "Refused" in doc and "FailedPreconditionError" in doc
    model = torch.nn.Linear(4, 4)
    with mt.OffloadedAdamW([model.weight], volume=str(tmp_path / "v.vol")) as opt:
        with pytest.raises(errors.FailedPreconditionError):
            opt.add_param_group({"params": [model.bias]})


def test_the_volume_is_sized_by_the_state_not_a_guess(tmp_path):
    """docs/python.md, "Disk": a new volume file takes what volume_bytes says."""
    from memascend import _core
    model = torch.nn.Linear(1024, 1024)
    with mt.OffloadedAdamW(model.parameters(), volume=str(tmp_path / "v.vol")):
        pass
    layout = [("p0", 1024 * 1024), ("p1", 1024)]
    want = _core.OffloadedAdam.volume_bytes(layout, "float32", "float32", mt.DEFAULT_PART_ELEMENTS)
    assert os.path.getsize(tmp_path / "v.vol") == want
    assert want < 128 << 20


def test_the_docs_examples_take_no_needless_disk():
    with open(DOC) as f:
        text = f.read()
    assert not re.search(r"\b8 << 30", text), "an example volume of 8 GiB (fallocated: real disk)"
