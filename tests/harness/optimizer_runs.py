"""A small model with every parameter kind the BERT optimizer sees, trained a few steps by each optimizer
implementation: the optimizer tests and the fused kernels' worker compare their parameters."""

from __future__ import annotations

import torch

from mlperf_bert.optim.optimizers import build_optimizer, parameter_groups

STEPS = 6
# Implementations round differently in the last bits, and Adam-type steps amplify that a
# little (early updates are ~sign(g)); after 6 steps they agree to a few fp32 ulps.
TIGHT = dict(rtol=1e-6, atol=1e-6)


class MixedModel(torch.nn.Module):
    """Every parameter kind the BERT optimizer sees, plus a zero-norm and an unused tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(11, 6)
        self.dense = torch.nn.Linear(6, 5)
        self.LayerNorm = torch.nn.LayerNorm(5)
        self.head = torch.nn.Linear(5, 3)
        self.zero_kernel = torch.nn.Parameter(torch.zeros(3, 3))  # ||p|| = 0: trust ratio 1
        self.scale = torch.nn.Parameter(torch.ones(3))  # 1-D without "bias" in its name
        self.unused = torch.nn.Parameter(torch.ones(2, 2))  # never gets a gradient

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.LayerNorm(self.dense(self.embedding(tokens))))
        return self.head(hidden) @ (self.zero_kernel + torch.eye(3)) * self.scale


def make_model(seed: int = 0) -> MixedModel:
    torch.manual_seed(seed)
    return MixedModel()


def batch(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 11, (8, 4), generator=generator)


def loss_fn(model: torch.nn.Module, step: int) -> torch.Tensor:
    # A large loss scale keeps the global gradient norm well above small clip bounds.
    return 30.0 * model(batch(step)).pow(2).mean()


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model, step).backward()
        optimizer.step()


def run(name: str, implementation: str, max_grad_norm: float | None, device: str = "cpu",
        lr: float | torch.Tensor = 2e-2, eps: float = 1e-6) -> MixedModel:
    model = make_model().to(device)
    optimizer = build_optimizer(parameter_groups(model, 0.01), name, lr, (0.9, 0.999), eps, 0.01,
                                max_grad_norm, implementation)
    train(model, optimizer, range(STEPS))
    return model.cpu()


def assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module, **tolerance: float) -> None:
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(x, y, msg=lambda m: f"{name}: {m}", **(tolerance or TIGHT))
