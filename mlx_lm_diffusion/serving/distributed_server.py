"""The server under mlx.launch: rank 0 serves HTTP, the other ranks follow its requests.

mlx_lm.server's generation loop already shares every request from rank 0 (pickled,
`ResponseGenerator._share_request`), loads each rank's shard (`sharded_load`, which
calls our `Model.shard`) and seeds one random state; every rank then runs the same
decode. What this adds:

- cancellation (a client gone, a cancel, a stop) decided on rank 0 and agreed by every
  rank at the same forward (`distributed.agreed_check`); mlx_lm.server's own
  `ctx.stop()` would stop rank 0 alone (it raises NotImplementedError when
  distributed), so it sets the request's cancel event instead;
- a stop that reaches every rank (rank 0's shutdown is agreed before the next request);
- the ranks other than 0 serve nothing: they run the generation loop until it ends;
- a rank that dies ends the others: the next collective fails (the loop runs one every
  0.1 s while idle), the generation thread ends, and the process exits with one line.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import mlx.core as mx

from mlx_lm_diffusion.parallel import distributed


class DistributedGeneration:
    """Mixin for the server's ResponseGenerator (before mlx_lm.server's in the bases)."""

    def __init__(self, *args, **kwargs):
        self.group: Optional[mx.distributed.Group] = distributed.launched_group()
        self._stopping = False  # rank 0's stop, agreed by every rank before it takes effect
        self._watchdog = distributed.PeerWatchdog(self.group) if self.group is not None else None
        super().__init__(*args, **kwargs)

    def agreed(self, check: Callable[[], None]) -> Callable[[], None]:
        """`check` decided on rank 0 for every rank; it also tells the watchdog each step."""
        agreed = distributed.agreed_check(self.group, check)
        if self._watchdog is None:
            return agreed

        def checked() -> None:
            self._watchdog.pet()
            agreed()

        return checked

    def _next_request(self, timeout=None):
        if self.group is not None:
            if self._watchdog is not None:
                self._watchdog.arm()  # an idle loop still meets its peers every 0.1 s
            if distributed.agree(self.group, self._stopping):
                self._stop = True
                return None
        return super()._next_request(timeout)

    def stop_and_join(self):
        if self.group is None:
            return super().stop_and_join()
        self._stopping = True  # every rank's loop stops at its next request
        self._generation_thread.join()

    def generate(self, request, generation_args, progress_callback=None):
        ctx, responses = super().generate(request, generation_args, progress_callback)
        if self.group is not None and hasattr(request, "cancel"):
            # Stopping rank 0 alone would leave the others in a collective: the cancel
            # event is agreed at the next forward instead.
            ctx.stop = request.cancel.set
        return ctx, responses


def request_state(request: Any) -> dict:
    """A request as the other ranks receive it: without this process's channels (the
    client's socket, the draft sink, the cancel event)."""
    state = dict(request.__dict__)
    state.update(draft_sink=None, connection=None, ctx=None, cancel=None, cancel_error=None, peer_probe=None)
    return state


def restore_request(request: Any, state: dict) -> None:
    request.__dict__.update(state)
    request.cancel = threading.Event()


def follow(generator: Any) -> int:
    """A rank other than 0: no HTTP, the generation loop until rank 0 stops it (0) or the
    group fails (1, one line on stderr)."""
    generator.join()
    if generator.load_error is not None:
        distributed.fail(generator.group, f"cannot load the model: {generator.load_error}", code=2)
    if generator._generation_failed:
        distributed.fail(
            generator.group,
            "the generation loop ended: the distributed group failed (a peer rank died or lost its connection)",
        )
    return 0
