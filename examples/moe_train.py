"""Train a toy model with ep_comm's reference MoE layer on CPU ranks (gloo).

    python examples/moe_train.py --ranks 2 --steps 20

Each rank holds a shard of every batch and ``E / R`` of the experts; tokens travel to their
experts with ``ep_comm.dispatch`` and back with ``ep_comm.combine`` (both differentiable). The
replicated parameters (input/output layers, router) are kept in sync by all-reducing their
gradients, as data parallelism would; expert gradients stay on their rank.
"""
from __future__ import annotations

import argparse
import gc
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from ep_comm.moe import MoE


class ToyModel(nn.Module):
    """``x [N, d_in]`` float32 -> ``[N, 1]``: linear, tanh, residual MoE, linear head."""

    def __init__(self, d_in: int, hidden: int, num_experts: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, hidden)
        self.moe = MoE(hidden, 2 * hidden, num_experts, top_k=2, group=group, init_seed=0)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.head(h + self.moe(h))

    def replicated_parameters(self) -> list[nn.Parameter]:
        return [*self.inp.parameters(), *self.head.parameters(), *self.moe.replicated_parameters()]


def _run(rank: int, world_size: int, port: int, steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    torch.manual_seed(0)  # same replicated parameters on every rank
    model = ToyModel(d_in=8, hidden=32, num_experts=4 * world_size, group=dist.group.WORLD)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    target = torch.linspace(-1, 1, 8)
    data = torch.Generator().manual_seed(100 + rank)  # each rank reads its own shard
    for step in range(steps):
        x = torch.randn(64, 8, generator=data)
        y = torch.sin(x @ target).unsqueeze(-1)
        loss = nn.functional.mse_loss(model(x), y) / world_size
        opt.zero_grad()
        loss.backward()
        for p in model.replicated_parameters():
            dist.all_reduce(p.grad)
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0 and (step % 5 == 0 or step == steps - 1):
            print(f"step {step:3d}  loss {total.item():.4f}", flush=True)
        opt.step()
    # The layer's Buffer holds the process group: drop it first (a collection: the model sits in
    # reference cycles), so that destroy_process_group ends gloo's worker thread now. Left alive,
    # the thread outlives the call and may free its last all_reduce's tensors while the
    # interpreter shuts down, which aborts the process.
    del model, opt
    gc.collect()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_run, args=(args.ranks, port, args.steps), nprocs=args.ranks)


if __name__ == "__main__":
    main()
