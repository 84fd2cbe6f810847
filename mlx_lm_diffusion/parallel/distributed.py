"""Decoding across processes (`mlx.launch`): the group, sharded loading, what the ranks share.

Every rank loads its shard of the weights (model_adapters.runtime.sharding) and runs the same
decode. The host-side decisions are made on every rank from identical logits rather
than on rank 0 and broadcast: every forward ends in an all_sum or all_gather, whose
result is the same array on every rank, so commit counts, EOS, finality and greedy
choices agree without any extra message; random draws agree because the ranks share
one random state (`sync_random_state`, once at load, as mlx_lm.server does). Broadcasting
decisions would add a host round trip per step and stall the pipelined engine, for
nothing. What only rank 0 knows (a request, a cancellation) is shared explicitly
(`share_object`, `agree`). `check_agreement` verifies the outcome of a decode.

A rank that dies ends the others: the ring backend's next collective raises
("connection to a peer was lost"); `PeerWatchdog` bounds the waits where a peer hangs
without closing its connections.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from mlx_lm_diffusion.parallel import heartbeat

# Set by mlx.launch (ring: MLX_HOSTFILE; JACCL: MLX_JACCL_COORDINATOR / MLX_IBV_DEVICES;
# MPI: OMPI_*); without any of them there is no group to join.
_LAUNCH_ENV = ("MLX_HOSTFILE", "MLX_JACCL_COORDINATOR", "MLX_IBV_DEVICES", "OMPI_COMM_WORLD_SIZE")
PEER_TIMEOUT_ENV = "MLX_LM_DIFFUSION_PEER_TIMEOUT"
DEFAULT_PEER_TIMEOUT = 300.0  # seconds without progress before a rank gives up on its peers


def launched_group() -> Optional[mx.distributed.Group]:
    """The group this process was launched into by mlx.launch, or None (one process). A
    group that cannot form ends this rank with one line and exit 1 (`form_group`)."""
    if not any(os.environ.get(name) for name in _LAUNCH_ENV):
        return None
    group = form_group()
    if group.size() <= 1:
        return None
    # (a rank that dies ends the others at once, not after the watchdog's wait: heartbeat)
    try:
        heartbeat.start(group, lambda obj: share_object(group, obj), lambda reason: fail(group, reason))
    except OSError as e:
        fail(group, f"the ranks could not connect to each other beside the collectives: {e}")
    return group


def form_group() -> mx.distributed.Group:
    """mx.distributed.init(), whose failure ends this rank with one line naming it and exit 1:
    a peer that cannot be reached (or another process on its port) made the ring backend raise
    "[ring] Couldn't connect" after ~30 s, a traceback on every rank. (mlx.launch then warns
    "Node with rank R exited with code 1" and itself exits 0: its exit status is MLX's.) The
    wait itself cannot be bounded from here: MLX's init holds the interpreter until it returns."""
    rank = os.environ.get("MLX_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?"))
    try:
        return mx.distributed.init()
    except RuntimeError as e:
        fail(
            None,
            f"rank {rank}: the distributed group could not form: {e} (a peer that never started or "
            "could not be reached, or another process on its port)",
        )
        raise  # (fail ends the process)


def is_leader(group: Optional[mx.distributed.Group]) -> bool:
    return group is None or group.rank() == 0


def shard_loaded(model: nn.Module, group: mx.distributed.Group) -> nn.Module:
    """Shard a lazily loaded model over `group`, then load this rank's weights only.
    Parameters are evaluated one at a time, so a full tensor read from the checkpoint
    is released (only its slice kept) before the next is read."""
    if not hasattr(model, "shard"):
        raise ValueError(f"{type(model).__module__} has no tensor-parallel sharding (Model.shard)")
    model.shard(group)
    for _, value in tree_flatten(model.parameters()):
        mx.eval(value)
    sync_random_state(group)
    return model


def sync_random_state(group: mx.distributed.Group) -> None:
    """One random state on every rank (the sum of theirs), as mlx_lm.server does: draws
    made while decoding (sampling, Gumbel noise, uniform canvases) then agree."""
    seed = mx.distributed.all_sum(mx.random.state[0], group=group, stream=mx.cpu).view(mx.uint64).item()
    mx.random.seed(seed)


def parameter_bytes(model: nn.Module, vision: bool = True) -> int:
    """Bytes of the model's parameters (vision=False: without a vision tower and its
    projector, which stay whole on every rank)."""
    return sum(v.nbytes for k, v in tree_flatten(model.parameters()) if vision or "vision" not in k)


def share_object(group: Optional[mx.distributed.Group], obj: Any = None) -> Any:
    """Rank 0's `obj` on every rank (pickled; others pass anything). Two collectives."""
    if group is None:
        return obj
    if group.rank() == 0:
        data = mx.array(np.frombuffer(pickle.dumps(obj), dtype=np.uint8))
        mx.eval(mx.distributed.all_sum(mx.array(data.size), group=group, stream=mx.cpu))
        mx.eval(mx.distributed.all_sum(data, group=group, stream=mx.cpu))
        return obj
    size = mx.distributed.all_sum(mx.array(0), group=group, stream=mx.cpu).item()
    data = mx.distributed.all_sum(mx.zeros((size,), dtype=mx.uint8), group=group, stream=mx.cpu)
    return pickle.loads(np.array(data).tobytes())


def agree(group: Optional[mx.distributed.Group], flag: bool) -> bool:
    """Whether any rank's `flag` is set (every rank gets the same answer)."""
    if group is None:
        return flag
    return mx.distributed.all_sum(mx.array(int(flag)), group=group, stream=mx.cpu).item() > 0


def check_agreement(group: Optional[mx.distributed.Group], tokens: Sequence[int]) -> None:
    """RuntimeError unless every rank decoded the same tokens (one small all_gather)."""
    if group is None:
        return
    digest = hashlib.sha256(repr(list(map(int, tokens))).encode()).digest()[:8]
    mine = mx.array(list(digest), dtype=mx.uint8)[None]
    every = mx.distributed.all_gather(mine, group=group, stream=mx.cpu).tolist()
    if any(row != every[0] for row in every):
        raise RuntimeError(f"the ranks decoded different tokens (rank digests {every}); their logits differ")


def peer_timeout() -> float:
    value = os.environ.get(PEER_TIMEOUT_ENV)
    return DEFAULT_PEER_TIMEOUT if not value else float(value)


class PeerWatchdog:
    """Ends this process (exit 1, one line on stderr) if no progress is reported for
    `timeout` seconds while armed: a peer that hangs without closing its connections
    would otherwise keep this rank waiting in a collective forever."""

    def __init__(self, group: mx.distributed.Group, timeout: Optional[float] = None):
        self.group = group
        self.timeout = peer_timeout() if timeout is None else timeout
        self.last = time.monotonic()
        self.armed = False
        self._thread = threading.Thread(target=self._watch, name="peer-watchdog", daemon=True)
        self._thread.start()

    def pet(self) -> None:
        self.last = time.monotonic()

    def arm(self, armed: bool = True) -> None:
        self.last = time.monotonic()
        self.armed = armed

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            if self.armed and time.monotonic() - self.last > self.timeout:
                fail(
                    self.group,
                    f"no progress from the other ranks for {self.timeout:g} s "
                    f"(a peer hangs or died; {PEER_TIMEOUT_ENV} sets the limit)",
                )


_LAST_WORDS: list = []  # callbacks fail() runs before the process ends (the server's clients)


def on_failure(callback: Callable[[str], None]) -> None:
    """Run `callback(reason)` when this rank fails (distributed.fail), before it exits."""
    _LAST_WORDS.append(callback)


def fail(group: Optional[mx.distributed.Group], reason: str, code: int = 1) -> None:
    """One line on stderr naming this rank, then exit now: a collective of a broken
    group can block interpreter teardown. Its peers see it end (heartbeat)."""
    rank = "" if group is None else f"rank {group.rank()}/{group.size()}: "
    print(f"error: {rank}{' '.join(str(reason).split())}", file=sys.stderr, flush=True)
    for callback in _LAST_WORDS:
        try:
            callback(reason)
        except Exception:  # noqa: BLE001 (the process ends anyway)
            pass
    sys.stdout.flush()
    os._exit(code)


def is_group_failure(error: BaseException) -> bool:
    """A collective's error: the ring backend lost a peer (or another backend failed)."""
    text = str(error)
    return isinstance(error, RuntimeError) and any(s in text for s in ("[ring]", "[jaccl]", "[mpi]", "peer"))


@contextmanager
def group_failures_end_the_process(group: Optional[mx.distributed.Group]) -> Iterator[None]:
    """A collective that fails (a peer died) ends this rank with one line, exit 1."""
    try:
        yield
    except RuntimeError as e:
        if group is not None and is_group_failure(e):
            gone = heartbeat.peer_gone()  # (the heartbeat names the rank that died, when it sees one)
            if gone is not None:
                fail(group, f"{gone} is gone: its connection closed (the process died or was killed)")
            fail(group, f"the distributed group failed: {e} (a peer rank died or lost its connection)")
        raise


class DistributedRun:
    """A front door's part under mlx.launch: rank 0 prints, the others follow silently;
    every rank reports its decode's progress to a watchdog."""

    def __init__(self, group: Optional[mx.distributed.Group]):
        self.group = group
        self.watchdog = PeerWatchdog(group) if group is not None else None

    def progress(self, callback: Optional[Callable] = None) -> Optional[Callable]:
        """`callback` (a draft callback, or None) that also tells the watchdog each step."""
        if self.watchdog is None:
            return callback
        self.watchdog.arm()

        def on_step(step: Any) -> None:
            self.watchdog.pet()
            if callback is not None:
                callback(step)

        return on_step

    def finished(self, text: str) -> None:
        """The decode is over: every rank must have decoded `text` (RuntimeError if not)."""
        if self.watchdog is not None:
            self.watchdog.arm(False)
        check_agreement(self.group, text.encode())

    def silence(self) -> None:
        """Rank 0 prints; the others' stdout goes nowhere (errors still reach stderr)."""
        if not is_leader(self.group):
            sys.stdout = open(os.devnull, "w")


class StoppedByLeader(Exception):
    """Raised on the other ranks when rank 0 stops a decode (its client left, a cancel)."""


def agreed_check(group: Optional[mx.distributed.Group], check: Callable[[], None]) -> Callable[[], None]:
    """`check` (it raises to stop a decode) run on rank 0, its verdict shared: every rank
    stops at the same forward (one all_sum a call), rank 0 with its own error."""
    if group is None:
        return check

    def agreed() -> None:
        error = None
        if group.rank() == 0:
            try:
                check()
            except Exception as e:  # (re-raised below, once every rank knows)
                error = e
        if agree(group, error is not None):
            if error is not None:
                raise error
            logging.info(f"rank {group.rank()}/{group.size()}: rank 0 stopped this decode")
            raise StoppedByLeader("rank 0 stopped this decode")

    return agreed
