"""A request's tokens handed to its HTTP thread in batches, not one queue item each.

mlx_lm.server's generation side puts one `Response` per token on the request's queue,
and its handler writes one SSE chunk per token that has text: per token a queue
wake-up (a lock handoff between the generation thread and the HTTP thread, under the
GIL), a JSON encoding, a socket write and, at the client, one event to parse. A running
batch (mlx_lm_diffusion.serving.scheduler) makes tokens in bursts: every row's newly final
tokens after each step, and a block's worth at once when a bidirectional block fills
out of order. Here they travel in `Mailbox`es:

- `ResponseSender.send(responses)` appends to the request's mailbox while its HTTP
  thread has not taken it yet, and otherwise puts a new mailbox on the queue: a slow
  reader finds every token made since its last read in one item, a fast one gets each
  step's tokens as they come;
- the handler's side (`unpack`) takes a mailbox whole and yields its Responses, the
  text of each run moved onto the run's first Response (`merge_texts`), so mlx_lm's
  handler writes one SSE chunk for the run. Every Response still counts its token
  (usage, logprobs), and the text the client reads, concatenated, is the same: the
  handler's text state machine reads text character by character, however it is split.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Iterable, Iterator, List


class Mailbox:
    """Responses of one request waiting for its HTTP thread (one queue item)."""

    __slots__ = ("items", "taken", "lock")

    def __init__(self, items: List[Any], lock: threading.Lock):
        self.items, self.taken, self.lock = items, False, lock

    def take(self) -> List[Any]:
        """The Responses sent so far; the sender starts a new mailbox after this."""
        with self.lock:
            self.taken = True
            return self.items


class ResponseSender:
    """Puts one request's Responses on its queue in mailboxes (one producer thread)."""

    def __init__(self, rqueue: Any):
        self.rqueue = rqueue
        self.lock = threading.Lock()
        self.box: Mailbox | None = None

    def send(self, responses: List[Any]) -> None:
        if not responses:
            return
        with self.lock:
            box = self.box
            if box is not None and not box.taken:  # (its reader has not come for it yet)
                box.items.extend(responses)
                return
            self.box = box = Mailbox(list(responses), self.lock)
        self.rqueue.put(box)

    def put(self, item: Any) -> None:
        """Anything else for the queue (a draft, an error, the end): it comes after the
        Responses sent so far, and the Responses sent after it come after it."""
        with self.lock:
            self.box = None
        self.rqueue.put(item)


def merge_texts(responses: List[Any]) -> List[Any]:
    """The Responses with their texts joined on the first one (the others' texts empty),
    except a Response that finishes with "stop": mlx_lm's handler drops that one's text
    (the EOS or the stop word), so it keeps its own."""
    if len(responses) < 2:
        return responses
    keep = [r for r in responses if r.finish_reason != "stop"]
    text = "".join(r.text for r in keep)
    if not keep or text == keep[0].text:
        return responses
    out = []
    for r in responses:
        if r.finish_reason == "stop":
            out.append(r)
        elif r is keep[0]:
            out.append(dataclasses.replace(r, text=text))
        else:
            out.append(dataclasses.replace(r, text=""))
    return out


def runs(items: Iterable[Any]) -> Iterator[List[Any]]:
    """A response iterator's items as runs: each mailbox's Responses (one per token, texts
    as made), anything else alone."""
    for item in items:
        yield item.take() if isinstance(item, Mailbox) else [item]


def unpack(items: Iterable[Any]) -> Iterator[Any]:
    """A response iterator (mlx_lm.server's) with its mailboxes opened."""
    for item in items:
        if isinstance(item, Mailbox):
            yield from merge_texts(item.take())
        else:
            yield item
