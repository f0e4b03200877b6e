"""The pipeline's local transport (core/parallel/pipeline/local_transport.py): shared rings
with sends larger than a ring or the socket takes at once, sockets alone where a process
cannot share rings, gloo kept where a process is elsewhere, and the errors for messages
that do not line up."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from slipstream.parallel.pipeline import local_transport, shared_ring
from slipstream.parallel.pipeline.runtime import PipelineRuntime, resolve_plan
from tests.distributed import run_distributed

# 2 MiB per micro-batch activation: more than a quarter of a shared ring (so it goes over
# the socket) and far more than a Unix socket's buffer, so every send is partly written by
# the channel's writer thread.
WIDTH, MICROBATCHES = 1 << 19, 4


class Scale(nn.Module):
    """An elementwise layer: large activations without large weights."""

    def __init__(self, width: int, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(width, generator=generator))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.weight)


def _train(name: str, early: bool) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage

    plan = resolve_plan(2, name, MICROBATCHES, None)
    stages, parameters = [], []
    for index in plan.stages_of(dist.get_rank()):
        module = Scale(WIDTH, seed=index)
        parameters += list(module.parameters())
        stages.append(PipelineStage(module, index, plan.num_stages, torch.device("cpu")))
    runtime = PipelineRuntime(stages, None, plan, early_receives=early)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(MICROBATCHES, WIDTH, generator=generator)
    y = torch.randn(MICROBATCHES, WIDTH, generator=generator)
    if early:  # a forward-only step first: its gradient sends send nothing, learn nothing
        runtime.evaluate((x,))
    runner = runtime.schedule._step_microbatches
    losses = [runtime.train((x,), y, F.mse_loss, lambda loss: loss)]
    learned = dict(getattr(runner, "receive_routes", {}))
    # A second step (gradients accumulate) posts the receives it learned; its target, not a
    # plain tensor, is split by torch's own splitting.
    target = nn.Parameter(2 * y, requires_grad=False)
    losses.append(runtime.train((x,), target, F.mse_loss, lambda loss: loss))
    no_grad = ""
    with torch.no_grad():
        try:
            runtime.train((x,), y, F.mse_loss, lambda loss: loss)
        except RuntimeError as error:
            no_grad = str(error)
    return {
        "local": runtime.channels is not None,
        # Whether the messages go through shared-memory rings (shared_ring.py).
        "rings": runtime.channels is not None
        and all(
            channel.inbox is not None and channel.outbox is not None
            for channel in runtime.channels.channels.values()
        ),
        # Which value each stage's sends carry, and to whom: learned from torch's first ops.
        "routes": dict(getattr(runner, "routes", {})),
        # The peer of each receive buffer of each (forward?, stage, micro-batch), and
        # whether the second step still found the same buffers.
        "receive_routes": {
            key: (
                [channel.peer for channel, _, _ in route.posts],
                route is runner.receive_routes[key],
            )
            for key, route in learned.items()
        },
        "loss": torch.stack(losses),
        "gradients": [p.grad.clone() for p in parameters],
        "no_grad": no_grad,
    }


def _large_sends_and_fallback() -> dict[str, Any]:
    dist.init_process_group("gloo")
    results: dict[str, Any] = {}
    for name in ("1f1b", "interleaved_1f1b"):
        reference, local = _train(name, early=False), _train(name, early=True)
        results[name] = {
            "local": local["local"],
            "rings": local["rings"],
            "routes": local["routes"],
            "receive_routes": local["receive_routes"],
            "no_grad": "needs gradients" in local["no_grad"] and reference["no_grad"] != "",
            "same": torch.equal(reference["loss"], local["loss"])
            and all(
                torch.equal(a, b)
                for a, b in zip(reference["gradients"], local["gradients"], strict=True)
            ),
        }
    reference = _train("1f1b", early=False)
    # One process that cannot share rings (not x86-64), or cannot make its rings (e.g. at
    # its limit of open files): the pair connects anew and every message goes over the
    # sockets, with the same bits.
    for case, name, instead in (
        ("sockets only", "rings_possible", lambda: False),
        ("no rings made", "make_inboxes", lambda peers: None),
    ):
        local_transport._CONNECTED.clear()
        kept = getattr(shared_ring, name)
        if dist.get_rank() == 1:
            setattr(shared_ring, name, instead)
        sockets = _train("1f1b", early=True)
        setattr(shared_ring, name, kept)
        results[case] = {
            "local": sockets["local"],
            "rings": sockets["rings"],
            "same": torch.equal(reference["loss"], sockets["loss"])
            and all(
                torch.equal(a, b)
                for a, b in zip(reference["gradients"], sockets["gradients"], strict=True)
            ),
        }
    # One process that says it runs elsewhere: every process keeps gloo, and trains the same.
    if dist.get_rank() == 1:
        local_transport.socket.gethostname = lambda: "another-machine"  # type: ignore[assignment]
    reference, elsewhere = _train("1f1b", early=False), _train("1f1b", early=True)
    results["elsewhere"] = {
        "local": elsewhere["local"],
        "same": all(
            torch.equal(a, b)
            for a, b in zip(reference["gradients"], elsewhere["gradients"], strict=True)
        ),
    }
    dist.destroy_process_group()
    return results


# (forward?, stage) -> (outputs or input gradients, [(which one, peer)]), per rank: every
# send after a stage's first is written straight from its outputs or gradients.
ROUTES = {
    "1f1b": [{(True, 0): (1, [(0, 1)])}, {(False, 1): (1, [(0, 0)])}],
    "interleaved_1f1b": [
        {(True, 0): (1, [(0, 1)]), (True, 2): (1, [(0, 1)]), (False, 2): (1, [(0, 1)])},
        {(True, 1): (1, [(0, 0)]), (False, 1): (1, [(0, 0)]), (False, 3): (1, [(0, 0)])},
    ],
}


def _receive_routes(name: str, rank: int) -> dict[tuple[bool, int, int], tuple[list[int], bool]]:
    """Every receive of a micro-batch from the other process: (forward?, stage, micro-batch)
    -> ([its peer], kept by the second step), from where each process's stages sit."""
    plan = resolve_plan(2, name, MICROBATCHES, None)
    routes = {}
    for stage in plan.stages_of(rank):
        for forward, neighbour in ((True, stage - 1), (False, stage + 1)):
            if 0 <= neighbour < plan.num_stages and plan.rank_of(neighbour) != rank:
                for chunk in range(MICROBATCHES):
                    routes[forward, stage, chunk] = ([1 - rank], True)
    return routes


def test_sends_larger_than_the_socket_and_a_process_elsewhere():
    for rank, results in enumerate(run_distributed(_large_sends_and_fallback, timeout=240)):
        for name in ("1f1b", "interleaved_1f1b"):
            expected = {
                "local": True,
                "rings": shared_ring.rings_possible(),
                "routes": ROUTES[name][rank],
                "receive_routes": _receive_routes(name, rank),
                "no_grad": True,
                "same": True,
            }
            assert results[name] == expected, (rank, name)
        assert results["sockets only"] == {"local": True, "rings": False, "same": True}, rank
        assert results["no rings made"] == {"local": True, "rings": False, "same": True}, rank
        assert results["elsewhere"] == {"local": False, "same": True}, rank


def _misaligned() -> dict[str, str]:
    dist.init_process_group("gloo")
    group = dist.new_group([0, 1])
    channels = local_transport.local_channels(group, True)
    assert channels is not None
    peer = 1 - dist.get_rank()
    errors: dict[str, str] = {}
    if dist.get_rank() == 1:
        buffer = torch.empty(4)
        works = channels.post([dist.P2POp(dist.irecv, buffer, peer, group)])
        with pytest.raises(RuntimeError) as unread:
            channels.check_drained()
        errors["unread"] = str(unread.value)
        dist.barrier()
        for work in works:
            work.wait()
        errors["received"] = str(buffer.tolist())
        too_large = torch.empty(8)
        works = channels.post([dist.P2POp(dist.irecv, too_large, peer, group)])
        with pytest.raises(RuntimeError) as mismatch:
            works[0].wait()
        errors["mismatch"] = str(mismatch.value)
        with pytest.raises(ValueError) as strided:
            channels.post([dist.P2POp(dist.isend, torch.zeros(4, 2).t(), peer, group)])
        errors["strided"] = str(strided.value)
    else:
        dist.barrier()
        for tensor in (torch.arange(4.0), torch.zeros(4)):
            for work in channels.post([dist.P2POp(dist.isend, tensor, peer, group)]):
                work.wait()
    dist.barrier()
    dist.destroy_process_group()
    return errors


def test_messages_that_do_not_line_up_fail_loudly():
    errors = run_distributed(_misaligned, timeout=120)[1]
    assert "left receives unread" in errors["unread"]
    assert errors["received"] == "[0.0, 1.0, 2.0, 3.0]"
    assert "16 bytes arrived for a 32-byte receive" in errors["mismatch"]
    assert "contiguous CPU tensors" in errors["strided"]


def test_a_send_route_is_kept_only_where_each_op_carries_a_whole_value():
    from types import SimpleNamespace

    from slipstream.parallel.pipeline.runner import _route

    a, b = torch.zeros(2, 3), torch.ones(4)

    def op(tensor: torch.Tensor, peer: int) -> Any:
        return SimpleNamespace(tensor=tensor, peer=peer)

    # A value sent to two processes, one not sent, a None gradient: kept, in torch's order.
    assert _route((a, None, b), [op(b.detach(), 3), op(a, 1), op(a.detach(), 2)]) == [
        (2, 3),
        (0, 1),
        (0, 2),
    ]
    # A zero gradient torch made for a missing one, part of a value, values sharing memory.
    assert _route((None, b), [op(torch.zeros(4), 1)]) == []
    assert _route((a,), [op(a[0], 1)]) == []
    assert _route((a, a.view(6)), [op(a, 1)]) == []


def test_a_receive_route_is_kept_only_while_the_stage_holds_its_buffers():
    from types import SimpleNamespace

    from slipstream.parallel.pipeline.runner import _ReceiveRoute

    a, b = torch.zeros(3), torch.zeros(2)
    infos = (SimpleNamespace(buffer=None), SimpleNamespace(buffer=a), SimpleNamespace(buffer=b))

    def posted(tensor: torch.Tensor, peer: int) -> Any:  # a receive as the channels post it
        return SimpleNamespace(
            tensor=tensor, channel=SimpleNamespace(peer=peer), address=0, nbytes=tensor.nbytes
        )

    route = _ReceiveRoute.of(infos, True, [posted(b, 1), posted(a, 2)])
    assert route is not None
    assert [(buffer, channel.peer) for channel, buffer, _ in route.posts] == [(b, 1), (a, 2)]
    assert route.matches(infos, True)
    assert not route.matches(infos, False)  # torch posts no gradient receives then
    assert not route.matches(tuple(list(infos)), True)  # set up anew: other infos
    infos[0].buffer = torch.zeros(1)  # one that held nothing now holds a buffer
    assert not route.matches(infos, True)
    infos[0].buffer = None
    assert route.matches(infos, True)
    infos[1].buffer = torch.zeros(3)  # a buffer replaced
    assert not route.matches(infos, True)
    # A stage with no receive infos for the micro-batch (forward only: no gradients come).
    nothing = _ReceiveRoute.of(None, False, [])
    assert nothing is not None and nothing.posts == [] and nothing.matches(None, False)
    assert not nothing.matches(None, True)
    # A receive into a tensor no info holds: torch's ops are used every time.
    assert _ReceiveRoute.of(infos, True, [posted(torch.zeros(1), 1)]) is None


def test_the_runner_splits_only_plain_tensor_targets_itself():
    from types import SimpleNamespace

    from slipstream.parallel.pipeline.runner import ActionRunner

    runner = ActionRunner(SimpleNamespace(_n_microbatches=4))
    y = torch.zeros(8, 2)
    assert runner.splits(None) and runner.splits(y)
    # torch's own step splits the rest (how differs between torch versions).
    assert not runner.splits(nn.Parameter(y, requires_grad=False))
    assert not runner.splits(y.requires_grad_())
    assert not runner.splits(torch.zeros(3, 2)) and not runner.splits(torch.zeros(()))


def test_tensors_of_every_size_arrive_whole_and_in_order():
    import socket

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sender = local_transport.LocalChannels({1: local_transport._Channel(ours, 1)})
    receiver = local_transport.LocalChannels({0: local_transport._Channel(theirs, 0)})
    tensors = [torch.empty(0), torch.arange(5.0), torch.empty(0, 3), torch.randn(3, 1 << 12)]
    buffers = [torch.full_like(tensor, -1) for tensor in tensors]
    works = [receiver.receive(0, buffer) for buffer in buffers]
    backlogs = [sender.send(1, tensor) for tensor in tensors]
    works[-1].wait()  # reads the earlier messages first
    for backlog in backlogs:
        if backlog is not None:
            backlog.wait()
    assert all(torch.equal(a, b) for a, b in zip(tensors, buffers, strict=True))
    ours.close()
    theirs.close()


def test_actions_become_calls_once_with_torchs_labels():
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import _Action
    from torch.distributed.pipelining.schedules import _ComputationType as Kind

    from slipstream.parallel.pipeline import runner

    stages = [SimpleNamespace(stage_index=0), SimpleNamespace(stage_index=3)]
    forward, backward = _Action(0, Kind.FORWARD, 1), _Action(3, Kind.FULL_BACKWARD, 0)
    pair = _Action(0, Kind.OVERLAP_F_B, None, (forward, backward))
    actions = [_Action(0, Kind.RECV_F, 1), _Action(0, Kind.UNSHARD, None), pair]
    calls = runner._compile(actions, stages)
    # One call per action a profiler labels (the overlapped pair as one, as torch labels
    # it), nothing for UNSHARD without FSDP; the pair's call runs its two actions in order.
    assert calls[0] == (actions[0], runner._Step.receive_forward, stages[0], 1)
    assert [action for action, *_ in calls] == [actions[0], pair]
    inner = calls[1][2]
    assert [(a, call, stage, chunk) for a, call, stage, chunk in inner] == [
        (forward, runner._Step.forward, stages[0], 1),
        (backward, runner._Step.full_backward, stages[1], 0),
    ]
    with pytest.raises(ValueError, match="cannot run action"):
        runner._compile([SimpleNamespace(computation_type="?", stage_index=0)], stages)
