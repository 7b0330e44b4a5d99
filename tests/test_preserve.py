"""``preserved`` puts back what measuring changes: in memory, or through a file under an
address-space limit (See Note [address space under RLIMIT_AS])."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from memfit.measuring import preserve
from memfit.measuring.preserve import create_optimizer_state, preserved


class Versioned(nn.Module):
    """Refuses a state dict without its version, as torchvision's MNASNet does."""

    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)  # type: ignore[no-any-return]

    def _load_from_state_dict(self, state_dict: Any, prefix: str, local_metadata: Any, *args: Any) -> None:
        if local_metadata.get("version") != 2:
            raise ValueError(f"version should be set to 2 instead of {local_metadata.get('version')}")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


def _changed(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.ones(2, 4)).sum().backward()
    opt.step()


@pytest.mark.parametrize("spill", [False, True], ids=["in-memory", "spilled"])
def test_preserved_puts_back_weights_grads_optimizer_and_versions(
    spill: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(preserve, "address_space_limited", lambda device: spill)
    model = Versioned()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    create_optimizer_state(model, opt)
    _changed(model, opt)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    state = {k: v.clone() for k, v in opt.state[model.lin.weight].items()}
    where = opt.state[model.lin.weight]["exp_avg"].data_ptr()
    with preserved(model, opt):
        for _ in range(2):
            _changed(model, opt)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert all(torch.equal(v, state[k]) for k, v in opt.state[model.lin.weight].items())
    # spilled, the state is read back into the tensors it came from: no new allocation
    assert (opt.state[model.lin.weight]["exp_avg"].data_ptr() == where) is spill


def test_a_spilled_snapshot_leaves_no_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setattr(preserve, "address_space_limited", lambda device: True)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    model = Versioned()
    with preserved(model):
        assert len(list(tmp_path.iterdir())) == 1
    assert not list(tmp_path.iterdir())
