"""DDP and FSDP2 (``fully_shard``) training of a model built on opforge's ops:
two processes over gloo on 127.0.0.1, each taking half of every batch,
compared with the same training in one process on the whole batch.

The model is opforge's GPT (rms_norm / add_rms_norm, rope, attention, swiglu,
linear_cross_entropy) with every projection an ``opforge.nn.Linear``, plus a
small MLP of ``opforge.nn.Linear`` with a bias and a fused activation around
an ``opforge.nn.LayerNorm`` (odd widths, so FSDP pads its shards). DDP runs
with default and with small buckets; FSDP with reshard_after_forward on and
off, with matrices sharded on dim 1, accumulating two micro-batches, and
under MixedPrecisionPolicy(bfloat16 parameters). A small net through ``dispersion_correction`` also trains under
DDP with and without bfloat16 autocast. One spawned run trains every
configuration (starting a rank and importing torch costs seconds), writing
each rank's final full parameters, its losses and opforge's log of one step;
the tests below compare them. Each rank runs one torch thread.

Tolerances (float32, AdamW at lr 1e-2, 3 steps): the ranks average two
half-batch gradients where one process takes the whole batch, so results
differ by float32 rounding, which Adam's normalisation amplifies for small
gradients: parameters within atol 5e-5, rtol 1e-4 of the single process
(measured max |diff| 1.0e-5), mean losses within rtol 1e-5. Under
MixedPrecisionPolicy(bfloat16 parameters, float32 reduction) the reference
is the same policy in one process (float32 master weights; a bfloat16 copy
for forward and backward on each rank's half batch; the two gradients
upcast and averaged in float32; the step on float32), within the same bounds
(measured: bitwise equal). Against plain float32 training, the bfloat16 run's
mean losses stay within 5e-2 (bfloat16's spacing at 6.5 is 0.03) and each
parameter's update (final - initial) points the same way as float32's
(cosine >= 0.98; measured >= 0.99); elementwise, Adam moves a parameter by
about lr whatever the size of its gradient, so a rounding-sized gradient
can move it by lr the other way.
"""

import copy
import multiprocessing
import os
import re
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

import opforge
import opforge.nn as onn
from dist_helpers import COLLECTIVE_TIMEOUT_S, free_port, spawn
from opforge.models import GPT, GPTConfig

pytestmark = pytest.mark.slow  # the full tier: process groups of spawned ranks

CONFIG = GPTConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
BATCH, SEQ, FEATURES, HIDDEN, OUT = 4, 32, 16, 45, 7
STEPS = 3
DDP_RUNS = {  # name: DistributedDataParallel options
    "ddp": {},
    # from step 2 (DDP rebuilds its buckets after step 1), 11 small buckets all-reduced while the backward is
    # still running opforge's kernels; .grad views of them
    "ddp_buckets": dict(bucket_cap_mb=0.02, gradient_as_bucket_view=True),
}
FSDP_RUNS = {  # name: fully_shard options
    "fsdp": dict(reshard_after_forward=True),
    "fsdp_keep": dict(reshard_after_forward=False),
    "fsdp_bf16": dict(reshard_after_forward=True, mp=(torch.bfloat16, torch.float32)),
    "fsdp_dim1": dict(reshard_after_forward=True, dim1=True),  # matrices sharded on dim 1 (where it divides)
    "fsdp_accum": dict(reshard_after_forward=True, accumulate=True),  # two micro-batches per step
}
RUNS = (*DDP_RUNS, *FSDP_RUNS)
LOGGED = {"fsdp": "float32", "fsdp_bf16": "bfloat16"}  # runs whose first step opforge logs, per rank: dtype


class Model(torch.nn.Module):
    """GPT's next-token loss plus an MLP's mean squared error."""

    def __init__(self):
        super().__init__()
        self.gpt = GPT(CONFIG, fused=True)
        for block in self.gpt.layers:
            for parent in (block.self_attn, block.mlp):
                for name, m in list(parent.named_children()):
                    if type(m) is torch.nn.Linear:  # the same parameters, through opforge's linear
                        new = onn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
                        new.weight, new.bias = m.weight, m.bias
                        setattr(parent, name, new)
        self.mlp = torch.nn.Sequential(onn.Linear(FEATURES, HIDDEN, activation="gelu"), onn.LayerNorm(HIDDEN),
                                       onn.Linear(HIDDEN, OUT, activation="silu"))

    def forward(self, idx, targets, x, y):
        _, lm_loss = self.gpt(idx, targets)
        return lm_loss + torch.nn.functional.mse_loss(self.mlp(x), y)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x):
        h = self.fc1(x).abs() + 0.1  # the op's domain is x >= 0
        return self.fc2(opforge.dispersion_correction(h, 0.8))


def _net_train(model, batches, amp):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in batches:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
    return model


def _net_data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(3)]


def _net_single(amp):
    torch.manual_seed(0)
    return _net_train(Net(), _net_data(), amp).state_dict()  # the full batches in one process


def _model():
    torch.manual_seed(0)
    return Model()


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1), generator=g), torch.randn(BATCH, FEATURES, generator=g),
             torch.randn(BATCH, OUT, generator=g)) for _ in range(STEPS)]


def _inputs(batch, rank=None, world=2):
    tokens, x, y = batch
    if rank is not None:  # this rank's half of the batch
        tokens, x, y = tokens[rank::world], x[rank::world], y[rank::world]
    return tokens[:, :-1], tokens[:, 1:], x, y


def _train(model, batches, rank=None, log=None, accumulate=False):
    """STEPS optimizer steps; the losses. log: opforge's log of the first step goes there. accumulate: each
    rank's half in two micro-batches of one sequence, gradients synchronised after the second only."""
    opt, losses = _optimizer(model.parameters()), []
    for step, batch in enumerate(batches):
        if log and step == 0:
            opforge.set_log_level("info")
            opforge.set_log_file(log)
        opt.zero_grad()
        if accumulate:
            inputs, loss = _inputs(batch, rank), 0.0
            for i in range(2):
                model.set_requires_gradient_sync(i == 1)
                micro = model(*(t[i : i + 1] for t in inputs)) / 2
                micro.backward()
                loss += micro.item()
        else:
            loss = model(*_inputs(batch, rank))
            loss.backward()
            loss = loss.item()
        opt.step()
        if log and step == 0:
            opforge.set_log_file(None)
            opforge.set_log_level("warning")
        losses.append(loss)
    return losses


# ---- the ranks -------------------------------------------------------------------------------------------------------


def _fsdp(name):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor, Shard

    opts = dict(FSDP_RUNS[name])
    opts.pop("accumulate", None)
    mp = opts.pop("mp", None)
    if mp:
        opts["mp_policy"] = MixedPrecisionPolicy(param_dtype=mp[0], reduce_dtype=mp[1])
    if opts.pop("dim1", False):  # FSDP refuses uneven shards on dim 1: those stay on dim 0
        opts["shard_placement_fn"] = lambda p: Shard(1) if p.ndim == 2 and p.shape[1] % 2 == 0 else None
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _model()
    for block in model.gpt.layers:
        fully_shard(block, mesh=mesh, **opts)
    fully_shard(model.mlp, mesh=mesh, **opts)
    fully_shard(model, mesh=mesh, **opts)  # the root: embedding (tied to the head) and the final norm
    for pname, p in model.named_parameters():  # really sharded: each rank holds half (rounded up)
        assert isinstance(p, DTensor), pname
        assert p.to_local().numel() <= (p.shape[0] + 1) // 2 * (p.numel() // p.shape[0]), (pname, p.to_local().shape, p.shape)
    return model


def _full_state(model):
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()}


def _worker(rank, world, out_dir):
    for amp in (False, True):
        torch.manual_seed(0)
        net = torch.nn.parallel.DistributedDataParallel(Net())
        _net_train(net, [(x[rank::world], y[rank::world]) for x, y in _net_data()], amp)
        torch.save(net.module.state_dict(), os.path.join(out_dir, f"net_amp{int(amp)}.rank{rank}.pt"))
    batches = _batches()
    for name in RUNS:
        ddp = name in DDP_RUNS
        model = torch.nn.parallel.DistributedDataParallel(_model(), **DDP_RUNS[name]) if ddp else _fsdp(name)
        log = os.path.join(out_dir, f"{name}.rank{rank}.log") if name in LOGGED else None
        losses = _train(model, batches, rank, log, FSDP_RUNS.get(name, {}).get("accumulate", False))
        state = _full_state(model.module if ddp else model)
        torch.save({"losses": losses, "state": state}, os.path.join(out_dir, f"{name}.rank{rank}.pt"))


@pytest.fixture(scope="module")
def ranks():
    """{run: [rank 0's result, rank 1's]}, each {"losses", "state", "log" (LOGGED runs only)}; and
    {("net", amp): [rank 0's state_dict, rank 1's]}."""
    with tempfile.TemporaryDirectory() as out:
        spawn(_worker, out, timeout=300)  # ~30 s here; a bound on a hang, not a speed test
        results = {}
        for name in RUNS:
            results[name] = []
            for r in range(2):
                res = torch.load(os.path.join(out, f"{name}.rank{r}.pt"))
                log = os.path.join(out, f"{name}.rank{r}.log")
                if os.path.exists(log):
                    with open(log) as f:
                        res["log"] = f.read()
                results[name].append(res)
        for amp in (False, True):
            results["net", amp] = [torch.load(os.path.join(out, f"net_amp{int(amp)}.rank{r}.pt")) for r in range(2)]
    return results


# ---- the single-process references -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def single():
    """Plain float32 training on the whole batch in one process."""
    model = _model()
    losses = _train(model, _batches())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@pytest.fixture(scope="module")
def single_bf16():
    """FSDP's mixed precision in one process: float32 master weights; per step, for each rank's half of the
    batch, forward and backward on a bfloat16 copy of the parameters (inputs cast as FSDP casts them,
    buffers left in float32); the two gradients upcast to float32 and averaged; the step on float32."""
    master = _model()
    opt, losses = _optimizer(master.parameters()), []
    for batch in _batches():
        grads, loss_sum = [torch.zeros_like(p) for p in master.parameters()], 0.0
        for rank in range(2):
            work = copy.deepcopy(master)
            for p in work.parameters():
                p.data = p.data.to(torch.bfloat16)
            idx, targets, x, y = _inputs(batch, rank)
            loss = work(idx, targets, x.bfloat16(), y.bfloat16())
            loss.backward()
            for g, p in zip(grads, work.parameters()):
                g += p.grad.float()
            loss_sum += loss.item()
        for g, p in zip(grads, master.parameters()):
            p.grad = g / 2
        opt.step()
        losses.append(loss_sum / 2)
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in master.state_dict().items()}}


def _close(got, want, rtol, atol, what):
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=atol, msg=lambda m: f"{what}, {k}: {m}")


# ---- the tests -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("amp", [False, True])
def test_ddp_custom_op_net(ranks, amp):
    (r0, r1), single = ranks["net", amp], _net_single(amp)
    _close(r0, r1, 0, 0, "rank 0 vs rank 1")  # replicas stay identical
    rtol, atol = (2e-2, 2e-2) if amp else (1e-5, 1e-6)
    _close(r0, single, rtol, atol, f"amp={amp}: DDP vs one process")


@pytest.mark.parametrize("name", RUNS)
def test_ranks_agree_exactly(ranks, name):
    r0, r1 = ranks[name]
    _close(r0["state"], r1["state"], 0, 0, f"{name}: rank 0 vs rank 1")


@pytest.mark.parametrize("name", [*DDP_RUNS, "fsdp", "fsdp_keep", "fsdp_dim1", "fsdp_accum"])
def test_matches_single_process(ranks, single, name):
    r0, r1 = ranks[name]
    assert r0["losses"][0] != r1["losses"][0]  # each rank trained on its own half
    _close(r0["state"], single["state"], 1e-4, 5e-5, f"{name} vs one process")
    mean = [(a + b) / 2 for a, b in zip(r0["losses"], r1["losses"])]  # each rank's loss is over its half
    torch.testing.assert_close(mean, single["losses"], rtol=1e-5, atol=1e-6)
    assert single["losses"][-1] < single["losses"][0]  # it trains


def test_fsdp_bf16_matches_the_same_policy_in_one_process(ranks, single_bf16):
    r0, r1 = ranks["fsdp_bf16"]
    _close(r0["state"], single_bf16["state"], 1e-4, 5e-5, "fsdp_bf16 vs one process")
    mean = [(a + b) / 2 for a, b in zip(r0["losses"], r1["losses"])]
    torch.testing.assert_close(mean, single_bf16["losses"], rtol=1e-5, atol=1e-5)


def test_fsdp_bf16_stays_close_to_float32(ranks, single):
    r0, r1 = ranks["fsdp_bf16"]
    init = _model().state_dict()
    for k, want in single["state"].items():
        got = r0["state"][k]
        assert got.dtype == torch.float32, k  # the master weights stay float32
        cos = torch.nn.functional.cosine_similarity((got - init[k]).flatten(), (want - init[k]).flatten(), dim=0)
        assert cos >= 0.98, f"{k}: the bfloat16 run's update and float32's have cosine {cos:.4f}"
    mean = [(a + b) / 2 for a, b in zip(r0["losses"], r1["losses"])]
    torch.testing.assert_close(mean, single["losses"], rtol=0, atol=5e-2)


_LOG_LINE = re.compile(r"\[opforge info\] (opforge::\w+) (.*?) isa=")
_TENSOR = re.compile(r"\w+\[[^\]]*\]")


@pytest.mark.parametrize("name", LOGGED)
def test_fsdp_sharded_weights_reach_opforge_ops(ranks, name):
    """Each rank's log of its first step under fully_shard: every fused op ran, forward and backward, in
    the compute dtype, on the all-gathered (full-size) weights, not on a rank's shard."""
    dt = LOGGED[name]
    linears = sorted(f"{dt}[{o}, {i}]" for o, i in (m.weight.shape for m in _model().modules()
                                                      if isinstance(m, onn.Linear)))
    for rank, res in enumerate(ranks[name]):
        calls = [(m.group(1), _TENSOR.findall(m.group(2))) for m in map(_LOG_LINE.match, res["log"].splitlines()) if m]
        ops = {op[:-1] if op.endswith("_backward_") else op for op, _ in calls}  # in-place backwards count alike
        want = {f"opforge::{op}{suffix}" for op in ("linear", "rms_norm", "add_rms_norm", "layer_norm", "rope",
                                                    "attention", "glu", "linear_cross_entropy")
                for suffix in ("", "_backward")}
        assert want <= ops, f"rank {rank}: missing {sorted(want - ops)}"
        for op, args in calls:  # in the compute dtype throughout (but int64 targets)
            if op == "opforge::linear_cross_entropy_backward":  # and the gradient of its float32 loss first
                assert args[0] == "float32[]", (rank, op, args)
                args = args[1:]
            assert all(a.startswith((f"{dt}[", "int64[")) for a in args), (rank, op, args)
        # every linear's weight, forward (x, weight, out) and backward (g, x, weight), as the model holds it
        assert sorted(args[1] for op, args in calls if op == "opforge::linear") == linears, rank
        assert sorted(args[2] for op, args in calls if op == "opforge::linear_backward") == linears, rank
        lce = [args for op, args in calls if op == "opforge::linear_cross_entropy"]
        # hidden (tokens of this rank's half batch, dim), the tied head (vocab, dim) in full
        assert lce == [[f"{dt}[{BATCH // 2 * SEQ}, {CONFIG.dim}]", f"{dt}[{CONFIG.vocab_size}, {CONFIG.dim}]",
                        f"int64[{BATCH // 2 * SEQ}]"]], lce


def test_dtensor_inputs_are_refused_clearly():
    """Tensor parallelism is not supported: the ops have no DTensor sharding rules (FSDP2 is unaffected: it
    hands each module all-gathered plain tensors). A DTensor reaching an op fails naming the op."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        x = distribute_tensor(torch.randn(4, 16), mesh, [Replicate()])
        w = distribute_tensor(torch.randn(8, 16), mesh, [Shard(0)])
        with pytest.raises(NotImplementedError, match="opforge.linear.default does not have a sharding strategy"):
            opforge.functional.linear(x, w)
    finally:
        dist.destroy_process_group()


# ---- compiled DDP (opt-in: ~100 s on a loaded 2-core machine, mostly inductor compiling on each rank) ------------


def _compiled_ddp_worker(rank, world, out_dir):
    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(torch.compile(model, fullgraph=True))
    losses = _train(ddp, _batches(), rank)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save({"losses": losses, "state": state}, os.path.join(out_dir, f"compiled.rank{rank}.pt"))


@pytest.mark.skipif(not os.environ.get("OPFORGE_SLOW_TESTS"), reason="slow (~100 s): set OPFORGE_SLOW_TESTS=1")
def test_ddp_of_the_compiled_model(single):
    """DDP around torch.compile(fullgraph=True) of the model: no graph break in the opforge ops, gradients
    all-reduced by DDP's hooks on the compiled backward. (Compiling the DDP wrapper itself with
    fullgraph=True breaks in DDP's own Python, not in opforge.)"""
    with tempfile.TemporaryDirectory() as out:
        spawn(_compiled_ddp_worker, out, timeout=400)
        r0, r1 = (torch.load(os.path.join(out, f"compiled.rank{r}.pt")) for r in range(2))
    _close(r0["state"], r1["state"], 0, 0, "compiled DDP: rank 0 vs rank 1")
    _close(r0["state"], single["state"], 1e-4, 5e-5, "compiled DDP vs one process")
    mean = [(a + b) / 2 for a, b in zip(r0["losses"], r1["losses"])]
    torch.testing.assert_close(mean, single["losses"], rtol=1e-5, atol=1e-6)


# ---- the harness: a failing or hanging rank fails the test in bounded time and leaves no process behind ----------


def _one_rank_fails(rank, world, out_dir):
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.barrier()  # rank 0 waits for a peer that never comes


def _one_rank_hangs(rank, world, out_dir):
    if rank == 0:
        time.sleep(600)


def test_spawn_reports_a_failing_rank_and_stops_its_peer():
    with tempfile.TemporaryDirectory() as out:
        with pytest.raises(Exception, match="rank 1 fails on purpose"):
            spawn(_one_rank_fails, out, timeout=300)
        stopped_after = time.time() - os.path.getmtime(os.path.join(out, "rank1.err"))  # rank 1 failed then
    assert stopped_after < COLLECTIVE_TIMEOUT_S / 2  # rank 0 stopped, not left to time out in the barrier
    assert multiprocessing.active_children() == []


def test_spawn_stops_hanging_ranks_at_the_timeout():
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as out, pytest.raises(TimeoutError, match="still running after 5s"):
        spawn(_one_rank_hangs, out, timeout=5)
    assert time.monotonic() - start < 30  # the timeout, then terminate (or kill after 5 s)
    assert multiprocessing.active_children() == []
