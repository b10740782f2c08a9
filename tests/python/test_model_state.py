"""model.state_dict() and model.load_state_dict() under offload_parameters, against the
same model under torch.optim.AdamW: at any level of the model (a submodule's, a parent's),
through a module reached by two paths, and wrong entries refused with nothing written."""
import pytest
import torch

import memascend.torch as mt
from memascend import errors


class Net(torch.nn.Module):
    """Two paths to one module (`shared`), and a tied weight (`tied.weight` is
    `embed.weight`), as a transformers model with tied embeddings has."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        self.shared = torch.nn.Linear(8, 8)
        self.again = self.shared
        self.tied = torch.nn.Linear(8, 11, bias=False)
        self.tied.weight = self.embed.weight

    def forward(self, x):
        return self.tied(self.again(self.shared(self.body(self.embed(x)))))


def net(seed=0):
    torch.manual_seed(seed)
    return Net()


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 11, (4, 5), generator=g), torch.randint(0, 11, (4, 5), generator=g)


def train(m, opt, steps, first=0):
    losses = []
    for step in range(first, first + steps):
        x, y = batch(step)
        loss = torch.nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def pair(tmp_path, seed=0):
    """(the reference under torch's AdamW, its optimizer, the same under memascend, its
    optimizer): the same initial values."""
    ref, m = net(seed), net(seed)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    opt = mt.OffloadedAdamW(m.parameters(), lr=1e-2, weight_decay=0.01,
                            volume=str(tmp_path / "opt.vol"))
    mt.offload_parameters(m, opt)
    return ref, ref_opt, m, opt


def close(a, b, tol=1e-5):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape, k
        assert torch.allclose(a[k], b[k], rtol=tol, atol=tol), k


def test_state_dict_at_every_level_and_through_every_path(tmp_path):
    """A submodule's state_dict, and the second path to a shared module, held the empty
    tensors the parameters hold between uses (saved so, a checkpoint without weights)."""
    ref, ref_opt, m, opt = pair(tmp_path)
    assert train(m, opt, 2) == pytest.approx(train(ref, ref_opt, 2), rel=1e-5)
    close(m.state_dict(), ref.state_dict())
    close(m.body.state_dict(), ref.body.state_dict())
    close(m.again.state_dict(), ref.again.state_dict())
    close(m.tied.state_dict(), ref.tied.state_dict())
    wrapper, ref_wrapper = torch.nn.ModuleDict({"net": m}), torch.nn.ModuleDict({"net": ref})
    close(wrapper.state_dict(), ref_wrapper.state_dict())
    opt.close()


@pytest.mark.parametrize("where", ["model", "submodule", "parent", "non-strict"])
def test_load_state_dict_goes_on_as_under_adamw(tmp_path, where):
    """model.load_state_dict() under torch's AdamW replaces the values and keeps the
    moments; under offload_parameters it failed (every entry a size mismatch)."""
    ref, ref_opt, m, opt = pair(tmp_path)
    train(ref, ref_opt, 2)
    train(m, opt, 2)
    other = net(seed=7).state_dict()  # values of another run
    if where == "model":
        ref.load_state_dict(other)
        m.load_state_dict(other)
    elif where == "submodule":
        part = {k[len("body."):]: v for k, v in other.items() if k.startswith("body.")}
        ref.body.load_state_dict(part)
        m.body.load_state_dict(part)
    elif where == "parent":
        outer = {f"net.{k}": v for k, v in other.items()}
        torch.nn.ModuleDict({"net": ref}).load_state_dict(outer)
        torch.nn.ModuleDict({"net": m}).load_state_dict(outer)
    else:  # a partial checkpoint (transformers loads shard by shard so), in bf16
        part = {k: v.to(torch.bfloat16) for k, v in other.items() if k.startswith("shared.")}
        assert ref.load_state_dict(part, strict=False).missing_keys == \
            m.load_state_dict(part, strict=False).missing_keys
    close(m.state_dict(), ref.state_dict())
    assert train(m, opt, 3, first=2) == pytest.approx(train(ref, ref_opt, 3, first=2), rel=1e-4)
    close(m.state_dict(), ref.state_dict(), tol=1e-4)
    opt.close()
    close(m.state_dict(), ref.state_dict(), tol=1e-4)  # the model given back


def test_loaded_values_are_committed(tmp_path):
    """Loaded values are the state on the volume: a resume finds them."""
    m = net()
    opt = mt.OffloadedAdamW(m.parameters(), lr=1e-2, volume=str(tmp_path / "opt.vol"))
    mt.offload_parameters(m, opt)
    train(m, opt, 1)
    other = net(seed=7).state_dict()
    m.load_state_dict(other)
    opt.close()
    again = net(seed=3)
    opt = mt.OffloadedAdamW(again.parameters(), lr=1e-2, volume=str(tmp_path / "opt.vol"),
                            resume=True)
    close(again.state_dict(), other)
    opt.close()


@pytest.mark.parametrize("wrong", ["shape", "complex", "not a tensor"])
def test_a_wrong_entry_is_refused_and_nothing_is_written(tmp_path, wrong):
    ref, ref_opt, m, opt = pair(tmp_path)
    train(m, opt, 1)
    before = m.state_dict()
    other = net(seed=7).state_dict()
    other["shared.weight"] = {"shape": torch.zeros(8, 9),
                              "complex": torch.zeros(8, 8, dtype=torch.complex64),
                              "not a tensor": [[0.0] * 8] * 8}[wrong]
    with pytest.raises(RuntimeError, match="shared.weight"):
        m.load_state_dict(other)
    close(m.state_dict(), before)  # no offloaded entry written, the good ones neither
    assert opt.steps == 1
    train(m, opt, 1, first=1)
    opt.close()


def test_load_state_dict_inside_a_pass_is_refused(tmp_path):
    m = net()
    opt = mt.OffloadedAdamW(m.parameters(), lr=1e-2, volume=str(tmp_path / "opt.vol"))
    mt.offload_parameters(m, opt)
    other = net(seed=7).state_dict()
    calls = []

    def load_in_forward(module, inputs):
        calls.append(1)
        m.load_state_dict(other)
    handle = m.tied.register_forward_pre_hook(load_in_forward)
    x, _ = batch(0)
    with pytest.raises(errors.FailedPreconditionError, match="in use"):
        m(x)
    handle.remove()
    assert calls
    opt.close()


def test_a_load_between_forward_and_backward_fails_the_backward_as_in_torch(tmp_path):
    """The backward pass re-fetches a saved parameter: after a load it took its gradient at
    values the forward pass never used. torch refuses a parameter changed in place so."""
    ref, ref_opt, m, opt = pair(tmp_path)
    other = net(seed=7).state_dict()
    x, y = batch(0)
    for model in (ref, m):
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        model.load_state_dict(other)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
    close(m.state_dict(), ref.state_dict())
    assert train(m, opt, 2) == pytest.approx(train(ref, ref_opt, 2), rel=1e-4)  # goes on
    opt.close()


def test_a_scalar_parameter_loads_from_one_element_as_in_torch(tmp_path):
    """torch loads a 0-dim parameter from a checkpoint's 1-element tensor (old files)."""
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.scale = torch.nn.Parameter(torch.tensor(2.0))

        def forward(self, x):
            return self.lin(x) * self.scale
    m = Scaled()
    opt = mt.OffloadedAdamW(m.parameters(), lr=1e-2, volume=str(tmp_path / "opt.vol"))
    mt.offload_parameters(m, opt)
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    sd["scale"] = torch.tensor([5.0])
    m.load_state_dict(sd)
    assert m.state_dict()["scale"].item() == 5.0
    opt.close()
