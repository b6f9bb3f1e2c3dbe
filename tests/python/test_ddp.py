"""DistributedDataParallel (gloo, 2 processes) and AMP training through an
opforge op: gradients are all-reduced and match single-process training."""

import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import opforge


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x):
        h = self.fc1(x).abs() + 0.1  # the op's domain is x >= 0
        return self.fc2(opforge.dispersion_correction(h, 0.8))


def _train(model, batches, amp):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in batches:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
    return model


def _data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(3)]


def _worker(rank, world, port, out_dir, amp):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(Net())
    shards = [(x[rank::world], y[rank::world]) for x, y in _data()]  # each rank: half of every batch
    _train(model, shards, amp)
    torch.save(model.module.state_dict(), os.path.join(out_dir, f"rank{rank}.pt"))
    # both ranks done before either tears gloo down: a rank that destroys the group (rank 0 also hosts the
    # store) while its peer is still talking to it has died with std::terminate on a loaded machine
    dist.barrier()
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(amp):
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(2, _free_port(), out, amp), nprocs=2, join=True)
        states = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(2)]
    torch.manual_seed(0)
    single = _train(Net(), _data(), amp).state_dict()  # the full batches in one process
    return states, single


def test_ddp_matches_single_process():
    (r0, r1), single = _run(amp=False)
    for k in single:
        torch.testing.assert_close(r0[k], r1[k], rtol=0, atol=0)  # replicas stay identical
        torch.testing.assert_close(r0[k], single[k], rtol=1e-5, atol=1e-6)


def test_ddp_with_bf16_autocast():
    (r0, r1), single = _run(amp=True)
    for k in single:
        torch.testing.assert_close(r0[k], r1[k], rtol=0, atol=0)
        torch.testing.assert_close(r0[k], single[k], rtol=2e-2, atol=2e-2)
